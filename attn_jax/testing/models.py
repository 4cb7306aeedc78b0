"""Model shapes for serving benchmarks and tests, with random weights made on the device.

Throughput does not depend on the weights' values (every request generates a fixed
number of tokens, EOS ignored), so benchmarks run real architectures on random weights:

- ``smollm2-135m``: the embedded model's shapes (30 layers, 9 q / 3 KV heads, head 64).
- ``llama3-8b-8l``: Llama-3-8B's shapes (32 q / 8 KV heads, head 128, hidden 4096,
  MLP 14336, vocab 128256, untied head) cut to 8 layers.

Example::

    config = MODEL_SHAPES["llama3-8b-8l"]()
    params = random_params(config, jnp.bfloat16)       # jax arrays, made on the default device
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from attn_jax.models.llama import LlamaConfig, fuse_params
from attn_jax.models.smollm2 import smollm2_135m_config


def llama3_8b_layers(num_layers: int = 8) -> LlamaConfig:
    """Llama-3-8B's shapes with ``num_layers`` layers (the full model has 32)."""
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=num_layers,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_ids=(128001, 128009),
        name=f"llama3-8b-{num_layers}l",
    )


def llama3_70b_layers(num_layers: int = 8) -> LlamaConfig:
    """Llama-3-70B's shapes (hidden 8192, 64 query / 8 KV heads, MLP 28672) with ``num_layers``
    layers (the full model has 80)."""
    return dataclasses.replace(
        llama3_8b_layers(num_layers), hidden_size=8192, intermediate_size=28672, num_heads=64,
        name=f"llama3-70b-{num_layers}l",
    )  # fmt: skip


MODEL_SHAPES = {
    "smollm2-135m": smollm2_135m_config,
    "llama3-8b-8l": llama3_8b_layers,
    "llama3-70b-8l": llama3_70b_layers,
}


def random_params(config: LlamaConfig, dtype=jnp.bfloat16, seed: int = 0) -> dict:
    """Random weights in ``load_gguf``'s layout (``fuse_params``'), drawn on the default device (a 2 GB model
    takes a moment there, minutes in NumPy): normal / sqrt(fan-in), norms near 1."""
    c = config
    h, i = c.hidden_size, c.intermediate_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"wq": (h, q), "wk": (h, kv), "wv": (h, kv), "wo": (q, h), "w_gate": (h, i), "w_up": (h, i)}
    shapes["w_down"] = (i, h)

    @functools.partial(jax.jit, static_argnums=1)
    def weight(key, shape):
        return (jax.random.normal(key, shape, jnp.float32) * shape[-2] ** -0.5).astype(dtype)

    def norm(key):
        return (1 + 0.1 * jax.random.normal(key, (h,), jnp.float32)).astype(dtype)

    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 4 + c.num_layers * (len(shapes) + 2)))
    layers = []
    for _ in range(c.num_layers):
        layer = {name: weight(next(keys), shape) for name, shape in shapes.items()}
        layer["attn_norm"], layer["ffn_norm"] = norm(next(keys)), norm(next(keys))
        layers.append(layer)
    params = {"embed": weight(next(keys), (c.vocab_size, h)), "final_norm": norm(next(keys)), "layers": layers}
    if not c.tie_word_embeddings:
        params["lm_head"] = weight(next(keys), (h, c.vocab_size))
    return fuse_params(config, params)


def unfused_layer(config: LlamaConfig, layer: dict) -> dict:
    """One layer of ``fuse_params``' layout back under its checkpoint names, every matrix
    [in, out] (``wq`` [H, Hq*D], ``wk``/``wv`` [H, Hkv*D], ``wo`` [Hq*D, H], ``w_gate``/``w_up``
    [H, I], ``w_down`` [I, H]), with ``bq``/``bk``/``bv`` and an unchanged ``bo``: tests compare
    them with other libraries' weights."""
    group = config.num_heads // config.num_kv_heads
    out = {k: v.T for k, v in layer.items() if k in ("wo", "w_down")}
    if "bo" in layer:
        out["bo"] = layer["bo"]
    for fused, names in (("wqkv", ("wq", "wk", "wv")), ("bqkv", ("bq", "bk", "bv"))):
        if fused in layer:  # [Hkv, G + 2, D, *rows]: each part's [out, *rows], a matrix's then as [in, out]
            x = layer[fused]
            rows = x.shape[3:]
            parts = (x[:, :group], x[:, group], x[:, group + 1])
            out.update({n: part.reshape(-1, *rows).T for n, part in zip(names, parts, strict=True)})
    out["w_gate"], out["w_up"] = layer["w_gate_up"][0].T, layer["w_gate_up"][1].T
    return out


def weight_bytes(params) -> int:
    """Bytes a decode step reads from the weights: every matrix once, minus the embedding
    table (a step gathers only its tokens' rows) unless the head is tied to it."""
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    if "lm_head" in params:
        total -= params["embed"].size * params["embed"].dtype.itemsize
    return int(total)


TINY_RANDOM = "tiny-random"
"""The test model's name (``attn-stack serve --model tiny-random``): ``tiny_random_engine``."""


def tiny_random_config(vocab_size: int = 49152) -> LlamaConfig:
    """A 2-layer decoder of random weights (hidden 64, 4 q / 2 KV heads of 16) over the
    embedded SmolLM2's vocabulary: real text in and out, compiled in a second on a CPU."""
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, max_position_embeddings=2048, bos_token_id=1, eos_token_ids=(2,), name=TINY_RANDOM,
    )  # fmt: skip


def tiny_random_engine(
    seed: int = 0, *, attn_backend=None, block_size: int = 16, devices: int | None = None, dtype="float32",
    **engine_kwargs,
):  # fmt: skip
    """An ``Engine`` on ``tiny_random_config`` with ``dtype`` weights from ``init_params(seed)``
    and the embedded SmolLM2's tokenizer and chat template: the same tokens in every
    process for the same ``seed`` and engine arguments (tests compare a server's output
    with an engine of their own). ``devices`` > 1: sharded as ``Engine.from_llama`` shards
    (its 2 KV heads over a model axis as far as they divide, requests over the rest)."""
    from attn_jax.models.gguf_loader import load_tokenizer
    from attn_jax.models.llama import init_params
    from attn_jax.models.smollm2 import gguf_path
    from attn_jax.serving import Engine

    tokenizer = load_tokenizer(gguf_path())
    config = tiny_random_config(tokenizer.vocab_size)
    return Engine.from_llama(
        config, init_params(config, seed=seed), tokenizer, attn_backend=attn_backend, block_size=block_size,
        devices=devices, dtype=dtype, **engine_kwargs,
    )  # fmt: skip
