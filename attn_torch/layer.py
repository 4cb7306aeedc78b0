"""``attn_torch.Attention``: vLLM's Attention layer as a torch.nn.Module over attn-stack's backends.

The layer is a thin torch shell around ``attn_jax.Attention``: the same constructor
arguments, the same selector (``get_attn_backend``) and the same backend classes. A
step reads its batch metadata from ``set_forward_context`` and its KV cache from
``layer.kv_cache[virtual_engine]``, bound with ``bind_kv_cache``, as in vLLM::

    layer = Attention(num_heads=8, head_size=64, scale=64**-0.5, num_kv_heads=2, prefix="l0.attn")
    bind_kv_cache({"l0.attn": layer.init_kv_cache(num_blocks=64)})
    with set_forward_context(common_attn_metadata):
        out = layer(q, k, v)          # q [T, 512], k/v [T, 128] -> out [T, 512]

What happens per call (``attend``: called directly in eager mode, through
``torch.ops.attn_stack.unified_attention`` under ``torch.compile``):
the new k/v are written into the torch cache in place (``attn_torch.kv_cache``), then
the query crosses to JAX zero-copy (``bridge.dlpack.to_jax``; the cache's zero-copy view
is made once per bound tensor), the backend's jitted impl computes the output, and the
output crosses back zero-copy (``to_torch``). Bytes moved besides attention's own reads:
the new k/v and the output.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch import nn

from attn_jax.kv_cache import DEFAULT_K_RANGE, DEFAULT_V_RANGE, MIN_SCALE
from attn_jax.layer import Attention as JaxAttention
from attn_jax.layer import CacheConfig
from attn_jax.types import AttentionType, is_quantized_kv_cache, validate_positive_finite
from attn_torch import ops
from attn_torch.forward_context import get_forward_context
from attn_torch.kv_cache import NHD_LAYOUT, write_to_kv_cache
from bridge.dlpack import SUPPORTED_DTYPES, BridgeError, to_jax, to_torch

__all__ = ["ACTIVATION_DTYPES", "Attention", "bind_kv_cache"]

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DIRECT_CALL_DEVICES = ("cpu", "cuda")
_TORCH_OF_NP = {v: k for k, v in SUPPORTED_DTYPES.items()}
_unnamed = itertools.count()


def _torch_dtype(np_dtype) -> torch.dtype:
    return _TORCH_OF_NP[np.dtype(np_dtype)]


def _numpy_dtype(x: torch.Tensor):
    """A tensor's NumPy dtype for the JAX layer's checks (its torch dtype if the bridge has none)."""
    return SUPPORTED_DTYPES.get(x.dtype, x.dtype)


class Attention(nn.Module):
    """Attention layer: writes new k/v to the bound paged cache and attends (MHA/GQA/MQA).

    Arguments are vLLM's (``quant_config`` must be None: no quantised checkpoints yet;
    ``sinks`` goes in ``extra_impl_args`` as in vLLM), plus keywords ``block_size``,
    ``kv_cache_dtype`` (used when ``cache_config`` is None), ``dtype`` (the activation
    dtype for backend selection; default ``torch.get_default_dtype()``, as vLLM) and
    ``attention_chunk_size``. ``prefix`` names the layer for ``bind_kv_cache`` and
    per-layer metadata; an empty prefix gets a unique generated name. The eager (DLPack)
    path needs a backend with the NHD cache layout ``[2, P, S, Hkv, D]`` (XLA, PALLAS_GPU);
    others (PALLAS_TPU) raise NotImplementedError there and run through ``attn_torch.torchax``.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes=None,
        cache_config: CacheConfig | None = None,
        quant_config=None,
        logits_soft_cap: float | None = None,
        per_layer_sliding_window: int | None = None,
        use_mla: bool = False,
        use_sparse: bool = False,
        prefix: str = "",
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        attn_backend=None,
        *,
        block_size: int = 16,
        kv_cache_dtype: str = "auto",
        dtype: torch.dtype | None = None,
        attention_chunk_size: int | None = None,
        **extra_impl_args,
    ) -> None:
        super().__init__()
        if quant_config is not None:
            raise NotImplementedError("quant_config: attn_torch has no quantised-checkpoint support; pass None")
        sinks = extra_impl_args.pop("sinks", None)
        if extra_impl_args:
            raise TypeError(f"Unknown extra_impl_args {sorted(extra_impl_args)}; supported: ['sinks']")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if dtype not in ACTIVATION_DTYPES:
            valid = ", ".join(str(d) for d in ACTIVATION_DTYPES)
            raise TypeError(f"Unsupported activation dtype={dtype}. Valid dtypes are: {valid}")
        if isinstance(sinks, torch.Tensor):
            sinks = sinks.detach().to("cpu", torch.float32).numpy()
        name = prefix or f"attn_torch.Attention.{next(_unnamed)}"
        self._jax = JaxAttention(
            num_heads, head_size, scale, num_kv_heads, alibi_slopes, cache_config, logits_soft_cap,
            per_layer_sliding_window, use_mla, use_sparse, name, attn_type, kv_sharing_target_layer_name,
            attn_backend, block_size=block_size, kv_cache_dtype=kv_cache_dtype, sinks=sinks,
            dtype=SUPPORTED_DTYPES[dtype], attention_chunk_size=attention_chunk_size,
        )  # fmt: skip
        j = self._jax
        self.num_heads, self.head_size, self.num_kv_heads = j.num_heads, j.head_size, j.num_kv_heads
        self.scale, self.block_size, self.kv_cache_dtype = j.scale, j.block_size, j.kv_cache_dtype
        self.attn_type, self.sliding_window = j.attn_type, j.sliding_window
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_backend, self.impl = j.attn_backend, j.impl
        self.dtype = dtype
        self.calculate_kv_scales = j.calculate_kv_scales
        self._k_scale_float = self._v_scale_float = 1.0
        self._nhd = self.kv_cache_shape(1) == (2, 1, self.block_size, self.num_kv_heads, self.head_size)
        self.layer_name = name
        ops.register_layer(name, self)
        # Replaced by bind_kv_cache; one entry per virtual engine, as in vLLM.
        self.kv_cache: list[torch.Tensor] = [torch.tensor([])]
        # "NHD": [2, P, S, Hkv, D], written by the layer. "paired": [P, 2, S, Hkv, D] (each page's K then V,
        # transformers' paged cache), written by its owner; the step reads it through the same zero-copy view.
        self.kv_cache_layout = "NHD"
        # (tensor, data_ptr, JAX view) of the cache last used: one crossing per bound tensor, not per call.
        self._cache_view: tuple[torch.Tensor, int, jax.Array] | None = None
        self._step = _shared_step(self.attn_backend, self.impl)

    # ------------------------------------------------------------------ cache

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The dtype of this layer's cache tensor (the model dtype for "auto")."""
        return _torch_dtype(self.attn_backend.kv_cache_dtype_for(self.kv_cache_dtype, SUPPORTED_DTYPES[self.dtype]))

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """[2, num_blocks, block_size, Hkv, D]."""
        shape = self.attn_backend.get_kv_cache_shape(
            num_blocks, self.block_size, self.num_kv_heads, self.head_size, self.kv_cache_dtype
        )
        return tuple(shape)

    def init_kv_cache(self, num_blocks: int, device: torch.device | str | None = None) -> torch.Tensor:
        """A zero cache tensor of the backend's shape and dtype for ``num_blocks`` pages."""
        return torch.zeros(self.kv_cache_shape(num_blocks), dtype=self.kv_cache_torch_dtype, device=device)

    def check_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """ValueError unless ``kv_cache`` has this layer's cache shape (any page count) and dtype."""
        if not isinstance(kv_cache, torch.Tensor):
            raise TypeError(
                f"kv_cache for layer {self.layer_name!r} must be a torch.Tensor, got {type(kv_cache).__name__}"
            )
        if self.kv_cache_layout == "paired":
            shape, axis = (1, 2, self.block_size, self.num_kv_heads, self.head_size), 0
        else:
            shape = self.kv_cache_shape(1)
            axis = next(i for i, (a, b) in enumerate(zip(shape, self.kv_cache_shape(2), strict=True)) if a != b)
        if kv_cache.dim() != len(shape) or any(kv_cache.shape[i] != n for i, n in enumerate(shape) if i != axis):
            expected = ", ".join("num_blocks" if i == axis else str(n) for i, n in enumerate(shape))
            raise ValueError(
                f"kv_cache.shape={tuple(kv_cache.shape)} for layer {self.layer_name!r} must be [{expected}] "
                f"(backend {self.attn_backend.get_name()}, kv_cache_layout={self.kv_cache_layout!r})"
            )
        if kv_cache.dtype != self.kv_cache_torch_dtype:
            raise ValueError(
                f"kv_cache.dtype={kv_cache.dtype} for layer {self.layer_name!r} does not match its "
                f"kv_cache_dtype={self.kv_cache_dtype!r} with activation dtype {self.dtype}: expected "
                f"{self.kv_cache_torch_dtype}"
            )
        if not kv_cache.is_contiguous():
            raise BridgeError(
                f"kv_cache with shape={tuple(kv_cache.shape)} and strides={kv_cache.stride()} for layer "
                f"{self.layer_name!r} is not contiguous: the layer writes it in place and JAX reads it zero-copy, "
                "so it must be one compact row-major buffer (allocate it with layer.init_kv_cache)"
            )

    # ---------------------------------------------------------------- forward

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        output_shape: torch.Size | tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """query [T, Hq*D] or [T, Hq, D]; key, value [T, Hkv*D] or [T, Hkv, D] (None for
        cross-attention and KV-sharing layers). Returns [T, Hq*D] (or ``output_shape``) in
        query's dtype. Metadata comes from ``set_forward_context``; the cache is
        ``self.kv_cache[virtual_engine]``, updated in place.
        """
        for name, x in (("key", key), ("value", value)):
            if x is not None and x.device != query.device:  # before dispatch: a meta input would pick the fake
                raise BridgeError(
                    f"{name} is on {x.device} but query is on {query.device}; q, k, v must share a device"
                )
        num_tokens = query.shape[0]
        q = self._heads("query", query, self.num_heads)
        k = None if key is None else self._heads("key", key, self.num_kv_heads)
        v = None if value is None else self._heads("value", value, self.num_kv_heads)
        if query.device.type in _DIRECT_CALL_DEVICES and not torch.compiler.is_compiling():
            out = self.attend(q, k, v)  # eager: the op's implementation minus the dispatcher (vLLM's direct call)
        else:  # one opaque node under torch.compile; torchax (attn_torch.torchax) and meta tensors dispatch the op too
            out = torch.ops.attn_stack.unified_attention(q, k, v, self.layer_name)
        if output_shape is None:
            output_shape = (num_tokens, self.num_heads * self.head_size)
        return out.view(output_shape)

    def _heads(self, name: str, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        if x.dim() == 3 and tuple(x.shape[1:]) == (num_heads, self.head_size):
            return x
        if x.dim() == 2 and x.shape[1] == num_heads * self.head_size:
            return x.unflatten(1, (num_heads, self.head_size))
        raise ValueError(
            f"{name}.shape={tuple(x.shape)} must be [T, {num_heads * self.head_size}] or "
            f"[T, {num_heads}, {self.head_size}] (num_heads={num_heads}, head_size={self.head_size})"
        )

    def attend(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None) -> torch.Tensor:
        """The op's real implementation: query f[T, Hq, D], key/value f[T, Hkv, D] | None -> f[T, Hq, D]."""
        ctx = get_forward_context()
        engine = ctx.virtual_engine
        if not 0 <= engine < len(self.kv_cache):
            raise ValueError(f"virtual_engine={engine} but layer {self.layer_name!r} has {len(self.kv_cache)} caches")
        kv_cache = self.kv_cache[engine]
        if kv_cache.numel() == 0:
            raise RuntimeError(
                f"Layer {self.layer_name!r} has no bound KV cache: call attn_torch.bind_kv_cache("
                f"{{{self.layer_name!r}: layer.init_kv_cache(num_blocks)}}) before the forward pass"
            )
        paired = self.kv_cache_layout == "paired"
        if not (self._nhd or paired):
            raise NotImplementedError(
                f"attn_torch writes new k/v with torch into the NHD layout {NHD_LAYOUT}, but backend "
                f"{self.attn_backend.get_name()} keeps its cache as {self.kv_cache_shape(1)} (for 1 block); run a "
                "PyTorch model on that backend through attn_torch.torchax instead"
            )
        self._check_inputs(query, key, value, kv_cache)
        jax_cache = self._jax_cache(kv_cache)
        prepared = ctx.prepare(
            self.layer_name, self._jax.metadata_builder, kv_cache.device,
            num_blocks=kv_cache.shape[0 if paired else 1], causal=self.attn_type.is_causal,
        )  # fmt: skip
        if query.shape[0] != prepared.num_tokens:
            raise ValueError(
                f"query has {query.shape[0]} token rows but the forward context's slot_mapping has "
                f"{prepared.num_tokens}: pad the activations to the metadata's num_tokens"
            )
        num_slots = kv_cache.shape[0 if paired else 1] * kv_cache.shape[2]
        if prepared.max_slot >= num_slots:
            raise ValueError(
                f"slot_mapping holds slot {prepared.max_slot}, outside layer {self.layer_name!r}'s cache of "
                f"num_blocks * block_size = {num_slots} slots"
            )
        if key is not None and paired:
            raise ValueError(
                f"layer {self.layer_name!r} reads a 'paired' cache that its owner writes: call it with key=value=None"
            )
        if key is not None and self.kv_sharing_target_layer_name is None:
            if self.calculate_kv_scales and is_quantized_kv_cache(self.kv_cache_dtype):
                self._calc_kv_scales(key, value)
            write_to_kv_cache(
                kv_cache, key, value, prepared.write_slots, prepared.write_rows,
                k_scale=self._k_scale_float, v_scale=self._v_scale_float,
            )  # fmt: skip
        # query crosses after the cache write is queued: on CUDA its crossing makes JAX wait for torch's
        # stream, which orders the step after the write too, so the cache's view is made only once.
        out = self._step(
            to_jax(query, name="query"), jax_cache, prepared.backend_metadata,
            self._jax.k_scale, self._jax.v_scale, paired=paired,
        )  # fmt: skip
        return to_torch(out, name="attention output")

    def _check_inputs(self, query, key, value, kv_cache) -> None:
        device = kv_cache.device
        for name, x in (("query", query), ("key", key), ("value", value)):
            if x is not None and x.device != device:
                raise BridgeError(
                    f"{name} is on {x.device} but layer {self.layer_name!r}'s KV cache is on {device}; "
                    "q, k, v and the cache must share one device"
                )
        self._jax.check_inputs(query, key, value, dtype_of=_numpy_dtype)  # the JAX layer's rules

    def unbind_kv_cache(self) -> None:
        """Drops the bound caches (and their JAX view): ``kv_cache`` is empty again."""
        self.kv_cache = [torch.tensor([])]
        self._cache_view = None

    def _jax_cache(self, kv_cache: torch.Tensor) -> jax.Array:
        """The cache's zero-copy JAX view, checked and made once per bound tensor (and again if
        the tensor is reassigned or its storage moves). Torch writes the cache in place; JAX only
        reads it through this view, so the view always sees the current contents.
        """
        view = self._cache_view
        if view is None or view[0] is not kv_cache or view[1] != kv_cache.data_ptr():
            self.check_kv_cache(kv_cache)
            view = self._cache_view = (kv_cache, kv_cache.data_ptr(), to_jax(kv_cache, name="kv_cache"))
        return view[2]

    def _calc_kv_scales(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """vLLM's once-only scales: max|k| / 200, max|v| / 100 (at least MIN_SCALE)."""
        k_scale = max(float(key.abs().max()) / DEFAULT_K_RANGE, MIN_SCALE)
        v_scale = max(float(value.abs().max()) / DEFAULT_V_RANGE, MIN_SCALE)
        self._k_scale_float, self._v_scale_float = k_scale, v_scale
        self._jax.k_scale, self._jax.v_scale = jnp.float32(k_scale), jnp.float32(v_scale)
        self.calculate_kv_scales = self._jax.calculate_kv_scales = False

    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        """Sets the fp8 cache scales (a checkpoint's, say): the cache stores k / k_scale.
        Each must be a finite number > 0 (ValueError otherwise: 0 or NaN would zero the cache)."""
        k_scale = validate_positive_finite("k_scale", k_scale, "the fp8 cache stores k / k_scale")
        v_scale = validate_positive_finite("v_scale", v_scale, "the fp8 cache stores v / v_scale")
        self._k_scale_float, self._v_scale_float = k_scale, v_scale
        self._jax.k_scale, self._jax.v_scale = jnp.float32(k_scale), jnp.float32(v_scale)
        self.calculate_kv_scales = self._jax.calculate_kv_scales = False

    def extra_repr(self) -> str:
        return (
            f"prefix={self.layer_name!r}, head_size={self.head_size}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, scale={self.scale:.6g}, backend={self.attn_backend.get_name()}, "
            f"kv_cache_dtype={self.kv_cache_dtype!r}, block_size={self.block_size}"
        )


_STEPS: dict[tuple, object] = {}
_IMPL_FIELDS = (
    "num_heads", "head_size", "num_kv_heads", "scale", "sliding_window", "logits_soft_cap", "attn_type",
    "kv_cache_dtype", "kv_sharing_target_layer_name",
)  # fmt: skip


def _shared_step(backend, impl):
    """The jitted read-only step ``(q, kv_cache, metadata, k_scale, v_scale, paired) -> out``.

    Layers whose impls have equal hyperparameters (and no per-head alibi slopes or sinks)
    share one jitted function, so a 30-layer model compiles each batch shape once, not 30
    times. ``paired=True`` takes a [P, 2, S, Hkv, D] cache and moves the K/V axis inside
    the jitted function, where XLA fuses it into the backend's page reads (no cache copy).
    """
    per_head = any(getattr(impl, name, None) is not None for name in ("alibi_slopes", "sinks"))
    key = (backend, type(impl), *(getattr(impl, name, None) for name in _IMPL_FIELDS))
    if not per_head and key in _STEPS:
        return _STEPS[key]

    def step(q, kv_cache, backend_metadata, k_scale, v_scale, paired=False):
        if paired:
            kv_cache = jnp.moveaxis(kv_cache, 1, 0)
        out, _ = impl.forward(q, None, None, kv_cache, backend_metadata, k_scale=k_scale, v_scale=v_scale)
        return out

    jitted = jax.jit(step, static_argnames="paired")
    if not per_head:
        _STEPS[key] = jitted
    return jitted


def bind_kv_cache(
    kv_caches: Mapping[str, torch.Tensor],
    forward_context: Mapping[str, Attention] | None = None,
    runner_kv_caches: list[torch.Tensor] | None = None,
) -> None:
    """Binds each layer's cache tensor: ``forward_context[name].kv_cache = [kv_caches[name]]``.

    ``forward_context`` maps layer names to layers (default: every live
    ``attn_torch.Attention``, vLLM's static forward context). Each tensor is checked
    against its layer's shape and dtype. A layer that shares another layer's KV
    (``kv_sharing_target_layer_name``) and has no entry of its own gets its target's
    tensor. ``runner_kv_caches``, if given, receives the tensors in name order.
    """
    layers = dict(ops.static_forward_context() if forward_context is None else forward_context)
    for name, cache in kv_caches.items():
        if name not in layers:
            raise KeyError(f"bind_kv_cache: no attention layer named {name!r}; layers: {sorted(layers)}")
        layers[name].check_kv_cache(cache)
        layers[name].kv_cache = [cache]
        layers[name]._cache_view = None  # releases the old cache's view (and its storage)
    for name, layer in layers.items():
        target = getattr(layer, "kv_sharing_target_layer_name", None)
        if name not in kv_caches and target is not None and target in kv_caches:
            layer.check_kv_cache(kv_caches[target])
            layer.kv_cache = [kv_caches[target]]
            layer._cache_view = None
    if runner_kv_caches is not None:
        runner_kv_caches.extend(kv_caches[name] for name in sorted(kv_caches))
