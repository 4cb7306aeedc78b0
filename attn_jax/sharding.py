"""Tensor- and data-parallel serving with ``jax.sharding.Mesh`` and ``shard_map``.

The mesh has two axes: "data" splits requests (each data shard has its own requests,
its own KV cache pages and block tables) and "model" splits heads: query and KV heads,
the KV cache's head axis, the attention output projection's input columns, and the MLP's
intermediate dimension (Megatron-style, one ``psum`` after the attention output and
one after the MLP), and an untied LM head's vocabulary columns (one all-gather of the
logits per step, in the activation dtype). A model axis larger than the KV heads that
they divide (TP=4 over 2 KV heads) splits the query heads and gives each model shard a
copy of the KV head its queries read (vLLM's rule, ``replicate_kv_heads``). A model whose KV
heads do not divide over the model axis otherwise (SmolLM2 has 3 KV heads) keeps attention
and its cache replicated over that axis, with a logged warning, and still splits the MLP.
Several hosts: call ``jax.distributed.initialize()`` first; the mesh then spans every
process's devices, with no other distribution layer.

Test on a CPU with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (set before
jax initialises).

Example::

    mesh = make_mesh(4, num_kv_heads=config.num_kv_heads)       # data=4, model=1 for SmolLM2
    engine = Engine.from_gguf(mesh=mesh)
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

logger = logging.getLogger(__name__)

DATA = "data"
MODEL = "model"


def check_num_devices(num_devices, devices=None) -> int:
    """``num_devices`` if it is a positive int no larger than the devices available, else
    ValueError naming both (with the XLA flag that makes CPU devices)."""
    devices = list(jax.devices() if devices is None else devices)
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"devices={num_devices!r} must be a positive integer (this host has {len(devices)})")
    if num_devices > len(devices):
        platform = devices[0].platform if devices else "none"
        hint = (
            "; on a CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before jax starts"
            if platform == "cpu"
            else ""
        )
        raise ValueError(f"devices={num_devices} but only {len(devices)} {platform} device(s) are available{hint}")
    return num_devices


def make_mesh(
    num_devices: int | None = None,
    *,
    model_parallel: int | None = None,
    num_kv_heads: int | None = None,
    devices=None,
) -> Mesh:
    """A ("data", "model") mesh over the first ``num_devices`` devices.

    Args:
      num_devices: devices to use (default: all of ``devices``).
      model_parallel: size of the "model" axis; default ``gcd(num_devices, num_kv_heads)``
        (KV heads split as far as they divide; the rest of the devices split requests),
        or 1 without ``num_kv_heads``.
      num_kv_heads: the model's KV heads, for the default and the warning.
      devices: default ``jax.devices()``.

    A "model" axis that does not divide ``num_kv_heads`` (or more devices than KV heads)
    means replicated KV heads: a logged warning. ValueError names a bad count and the
    number of devices available.
    """
    devices = list(jax.devices() if devices is None else devices)
    num_devices = check_num_devices(len(devices) if num_devices is None else num_devices, devices)
    if model_parallel is None:
        model_parallel = math.gcd(num_devices, num_kv_heads) if num_kv_heads else 1
    if isinstance(model_parallel, bool) or not isinstance(model_parallel, int) or model_parallel < 1:
        raise ValueError(f"model_parallel={model_parallel!r} must be a positive integer")
    if num_devices % model_parallel:
        raise ValueError(f"model_parallel={model_parallel} must divide devices={num_devices}")
    if num_kv_heads is not None and num_kv_heads % num_devices:
        data = num_devices // model_parallel
        if model_parallel > num_kv_heads and model_parallel % num_kv_heads == 0:
            how = f"each copied {model_parallel // num_kv_heads} times over the 'model' axis of {model_parallel}"
        elif num_kv_heads % model_parallel:
            how = f"replicated over the 'model' axis of {model_parallel}"
        elif model_parallel == 1:
            how = "replicated on every device (model axis 1)"
        else:
            how = f"split over a 'model' axis of {model_parallel} only"
        logger.warning(
            "num_kv_heads=%d cannot be split over %d devices: KV heads are %s; requests are split over a "
            "'data' axis of %d",
            num_kv_heads, num_devices, how, data,
        )  # fmt: skip
    grid = np.asarray(devices[:num_devices], dtype=object).reshape(num_devices // model_parallel, model_parallel)
    return Mesh(grid, (DATA, MODEL))


def kv_replication(config, model_parallel: int) -> int:
    """How many copies of each KV head a model axis of ``model_parallel`` needs (vLLM's
    rule): ``model_parallel / num_kv_heads`` when the axis is larger than the KV heads,
    divisible by them and the query heads divide over it; else 1."""
    kv, q = config.num_kv_heads, config.num_heads
    if model_parallel > kv and model_parallel % kv == 0 and q % model_parallel == 0:
        return model_parallel // kv
    return 1


def replicate_kv_heads(config, params, copies: int):
    """``(config, params)`` of the same model with each KV head repeated ``copies`` times:
    KV head j becomes heads ``j * copies ... (j + 1) * copies - 1``, each serving the next
    ``G / copies`` of its query heads (``fuse_params``' ``wqkv`` [Hkv, G + 2, D, H] and
    ``bqkv`` [Hkv, G + 2, D] regrouped; NumPy or jax arrays). The outputs are the same;
    over a model axis of ``num_kv_heads * copies`` every shard then holds one KV head."""
    import dataclasses

    if copies == 1:
        return config, params
    g = config.num_heads // config.num_kv_heads
    if g % copies:
        raise ValueError(f"copies={copies} must divide the {g} query heads of each KV head")

    def regroup(w):  # [Hkv, G + 2, *rest] -> [Hkv * copies, G / copies + 2, *rest]
        xp = jax.numpy if isinstance(w, jax.Array) else np
        hkv, _, *rest = w.shape
        q = w[:, :g].reshape(hkv, copies, g // copies, *rest)
        kv = xp.broadcast_to(w[:, g:][:, None], (hkv, copies, 2, *rest))
        return xp.concatenate([q, kv], axis=2).reshape(hkv * copies, g // copies + 2, *rest)

    layers = [{k: regroup(v) if k in ("wqkv", "bqkv") else v for k, v in layer.items()} for layer in params["layers"]]
    config = dataclasses.replace(
        config, num_kv_heads=config.num_kv_heads * copies, kv_head_copies=config.kv_head_copies * copies
    )
    return config, {**params, "layers": layers}


def shard_model(config, params, mesh: Mesh):
    """``(config, params, LlamaModel keywords)`` for one shard of ``mesh``: KV heads copied
    first where the model axis needs it (``kv_replication``), then ``local_model_kwargs``."""
    copies = kv_replication(config, mesh.shape[MODEL])
    if copies > 1:
        logger.info(
            "num_kv_heads=%d over a 'model' axis of %d: each KV head copied %d times (vLLM's rule)",
            config.num_kv_heads, mesh.shape[MODEL], copies,
        )  # fmt: skip
    config, params = replicate_kv_heads(config, params, copies)
    return config, params, local_model_kwargs(config, mesh)


def describe_mesh(mesh: Mesh, config) -> str:
    """One line: the mesh's split and what each axis holds, for the CLI's start-up message."""
    data, m = mesh.shape[DATA], mesh.shape[MODEL]
    copies = getattr(config, "kv_head_copies", 1)
    kv = config.num_kv_heads // copies  # the checkpoint's
    if m == 1:
        heads = "weights replicated"
    elif copies > 1:
        heads = f"{kv} KV heads each copied {copies} times, query heads split {m} ways"
    elif kv % m == 0:
        heads = f"{kv} KV heads split {m} ways"
    else:
        heads = f"attention replicated ({kv} KV heads do not divide by {m}), the MLP split {m} ways"
    return f"mesh data={data} x model={m}: requests over data, {heads} over model"


def local_model_kwargs(config, mesh: Mesh, warn: bool = True) -> dict:
    """``LlamaModel`` keywords for one shard of ``mesh``: local head counts and what is
    split over the "model" axis (attention when the KV heads divide, the MLP when its
    intermediate size does, an untied LM head when the vocabulary does); logs a warning for
    what is replicated unless ``warn`` is False."""
    m = mesh.shape[MODEL]
    attn = config.num_kv_heads % m == 0
    if warn and m > 1 and not attn:
        logger.warning(
            "num_kv_heads=%d does not divide over the 'model' axis of %d: attention and its KV cache "
            "are replicated on every model shard",
            config.num_kv_heads,
            m,
        )
    mlp = config.intermediate_size % m == 0
    if warn and m > 1 and not mlp:
        logger.warning("intermediate_size=%d does not divide by %d: the MLP is replicated", config.intermediate_size, m)
    head = not config.tie_word_embeddings and config.vocab_size % m == 0  # tied: the embedding's lookup reads it
    return dict(
        num_heads=config.num_heads // m if attn else config.num_heads,
        num_kv_heads=config.num_kv_heads // m if attn else config.num_kv_heads,
        model_axis=MODEL,
        attn_sharded=attn and m > 1,
        mlp_sharded=mlp and m > 1,
        head_sharded=head and m > 1,
    )


class ShardedStep:
    """Runs an engine's device step under ``shard_map`` on ``mesh``.

    Batch inputs get a leading "data" axis (one slice per data shard, each with its own
    requests and block ids into its own slice of the cache's page axis); weights are
    split over "model" as ``local_model_kwargs`` says.
    """

    def __init__(self, model, mesh: Mesh) -> None:
        if tuple(mesh.axis_names) != (DATA, MODEL):
            raise ValueError(f"mesh axes {mesh.axis_names} must be ({DATA!r}, {MODEL!r}): use make_mesh")
        self.model = model
        self.mesh = mesh
        self.data_size = mesh.shape[DATA]
        m = mesh.shape[MODEL]
        expected = local_model_kwargs(model.config, mesh, warn=False)
        got = dict(
            num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads,
            model_axis=model.model_axis,
            attn_sharded=model.attn_sharded,
            mlp_sharded=model.mlp_sharded,
            head_sharded=getattr(model, "head_sharded", False),
        )
        if m > 1 and got != expected:
            raise ValueError(
                f"the model was built for another mesh: {got}; for this mesh build it with "
                f"LlamaModel(config, **local_model_kwargs(config, mesh)) = {expected}"
            )
        by_in = P(None, MODEL)  # [out, in] matrices summed over the shards' parts of in
        attn, mlp = model.attn_sharded, model.mlp_sharded
        self.layer_specs = {  # llama.fuse_params' layout
            "wqkv": P(MODEL, None, None, None) if attn else P(),  # [Hkv, G + 2, D, H]: by KV head
            "bqkv": P(MODEL, None, None) if attn else P(),  # optional q/k/v biases (Qwen2, Llama's attention_bias)
            "wo": by_in if attn else P(),  # [H, Hq*D]: by query head
            "bo": P(),  # added after the psum over heads
            "w_gate_up": P(None, MODEL, None) if mlp else P(),  # [2, I, H]: by I
            "w_down": by_in if mlp else P(),  # [H, I]: by I
        }
        # Each layer's cache in its backend's layout ([2, P, S, Hkv, D] for XLA and PALLAS_GPU,
        # [P, Hkv, S, 2D] for PALLAS_TPU): pages over data, KV heads over model when attention is split.
        self.page_axis, self.head_axis = _cache_axes(model)
        spec = [None] * len(model.kv_cache_shape(1))
        spec[self.page_axis] = DATA
        spec[self.head_axis] = MODEL if attn else None
        self.cache_spec = P(*spec)
        self._rows = NamedSharding(mesh, P(DATA))  # per-shard arrays: a leading "data" axis

    def param_specs(self, params) -> dict:
        specs = {k: P() for k in params if k != "layers"}
        if "lm_head" in specs and getattr(self.model, "head_sharded", False):
            specs["lm_head"] = P(None, MODEL)  # [H, V]: by vocabulary column
        from attn_jax.serving.layer_buffers import ROWS as LAYER_ROWS  # here: serving imports this module

        # A packed layer's buffer of matrices (``serving/layer_buffers.py``: only when no model axis
        # splits them) is replicated.
        specs["layers"] = [
            {k: P() if k == LAYER_ROWS else self.layer_specs[k] for k in layer} for layer in params["layers"]
        ]
        return specs

    def put_params(self, params):
        specs = self.param_specs(params)
        return jax.tree.map(lambda x, s: put_global(x, NamedSharding(self.mesh, s)), params, specs)

    def init_kv_caches(self, num_blocks_per_shard: int) -> list:
        """Zero caches, one per layer, ``data * num_blocks_per_shard`` pages, sharded."""
        shape = list(self.model.kv_cache_shape(num_blocks_per_shard))
        shape[self.page_axis] *= self.data_size
        if self.model.attn_sharded:
            shape[self.head_axis] *= self.mesh.shape[MODEL]
        dtype = self.model.attn.attn_backend.kv_cache_dtype_for(self.model.attn.kv_cache_dtype, self.model.dtype)
        sharding = NamedSharding(self.mesh, self.cache_spec)
        zeros = jax.jit(lambda: jax.numpy.zeros(shape, dtype), out_shardings=sharding)
        return [zeros() for _ in range(self.model.config.num_layers)]

    def zeros_per_shard(self, *shape: int) -> jax.Array:
        """i32[data, *shape] zeros, a slice per data shard (the engine's last sampled tokens and
        token counts: each data shard holds and reads its own)."""
        return jax.jit(lambda: jnp.zeros((self.data_size, *shape), jnp.int32), out_shardings=self._rows)()

    def global_step(self, device_step):
        """``device_step(params, caches, rows, packed, layout, num_steps, sampled, page_delta)``
        (one shard's arrays; ``rows`` a pytree of per-row state, each leaf with a leading data
        axis here, as ``packed`` and ``page_delta`` have; layout, num_steps and sampled
        static; it returns sampled tokens, the rows' state, caches, the next call's inputs
        and the tokens' scores, ``sampling.pack_scores``) as one function of the global arrays
        over the mesh, which ``ModelRunner`` jits as it jits one device's step (its static and
        donated arguments). The next call's inputs stay on their shards (i32[data, n]): a
        decode call continued from them uploads only its page delta, as on one device.

        The only collective beside the model's own (one ``psum`` per split attention and
        MLP, one all-gather of a split LM head's logits) gathers the data shards' scores (the
        sampled tokens with their log-probabilities; a greedy call's tokens alone), once per
        call (a prefill's prompt scores, when a request asks for them, a second):
        the result is replicated, so every process of a multi-process run reads all of them.
        The rows' state stays on its shard (split over "data")."""
        mesh, cache_spec = self.mesh, self.cache_spec

        def step(params, caches, rows, packed, layout, num_steps, sampled, page_delta):
            def body(params, caches, rows, packed, page_delta):
                tokens, rows, caches, next_packed, scores = device_step(
                    params, caches, jax.tree.map(lambda a: a[0], rows), packed[0], layout, num_steps, sampled,
                    page_delta[0],
                )  # fmt: skip
                rows = jax.tree.map(lambda a: a[None], rows)
                if scores[0] is None:  # a greedy call's program computes its tokens alone
                    return jax.lax.all_gather(tokens, DATA), rows, caches, next_packed[None], scores
                # The tokens travel in their scores (``pack_scores``' column 0): one all-gather; a
                # prefill's prompt scores, when asked, a second.
                scores = tuple(jax.lax.all_gather(a, DATA) for a in scores)
                return scores[0][..., 0], rows, caches, next_packed[None], scores

            fn = jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(self.param_specs(params), [cache_spec] * len(caches), P(DATA), P(DATA), P(DATA)),
                out_specs=(
                    P(), P(DATA), [cache_spec] * len(caches), P(DATA), P(),
                ),
                check_vma=False,
            )  # fmt: skip
            return fn(params, caches, rows, packed, page_delta)

        return step

    def put_per_shard(self, x) -> jax.Array:
        """``x`` (the same in every process) split over "data": an array with a leading "data"
        axis, or a sequence of each data shard's array (one shape), placed as their stack
        without stacking them on the host. Each device's row goes straight from the host in
        one batched transfer (``make_array_from_callback``), and each process uploads only the
        rows of its own devices. (``jax.device_put`` of the stacked array cost 0.2-0.4 ms more
        a call on a 2 x H200 host, and more with every data shard: issue 48.)"""
        if isinstance(x, np.ndarray):
            shape, row = x.shape, lambda i: x[i : i + 1]
        else:
            first = np.asarray(x[0])
            shape, row = (len(x), *first.shape), lambda i: x[i][None]
        if shape[0] != self.data_size:
            raise ValueError(f"{shape[0]} rows for a 'data' axis of {self.data_size}")
        return jax.make_array_from_callback(shape, self._rows, lambda index: row(index[0].start or 0))

    def stack_inputs(self, packed) -> tuple[jax.Array, object]:
        """Each data shard's packed inputs (``step_inputs.pack`` results, which must share one
        layout) as one i32[data, n] array over the mesh (``put_per_shard``: each shard's buffer
        to its own devices), and that layout."""
        layout = packed[0][1]
        for _, other in packed:
            if other is not layout and other != layout:
                raise ValueError(f"data shards built inputs of different structures: {layout} and {other}")
        return self.put_per_shard([buffer for buffer, _ in packed]), layout


def put_global(x, sharding: NamedSharding) -> jax.Array:
    """``x`` (the same value in every process) placed with ``sharding``: ``device_put`` where
    this process holds every device, else each process uploads the shards of its own."""
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _cache_axes(model) -> tuple[int, int]:
    """The page and KV-head axes of ``model``'s cache layout, read off its backend's shapes."""
    attn = model.attn
    backend, spec = attn.attn_backend, (model.block_size, model.num_kv_heads, model.config.head_dim)

    def shape(pages: int, heads: int) -> tuple[int, ...]:
        return backend.get_kv_cache_shape(pages, spec[0], heads, spec[2], attn.kv_cache_dtype)

    base = shape(1, spec[1])

    def changed(other: tuple[int, ...]) -> int:
        return next(i for i, (a, b) in enumerate(zip(base, other, strict=True)) if a != b)

    return changed(shape(2, spec[1])), changed(shape(1, 2 * spec[1]))
