"""The k/v write as a Pallas GPU kernel (Triton lowering): new rows stored in place.

In the NHD cache ``[2, P, S, Hkv, D]`` one token's keys for all KV heads are one
contiguous row of ``Hkv * D`` elements at flat slot ``slot_mapping[t]`` (page ``s // S``,
offset ``s % S``). The kernel views the cache as ``[2, P * S, Hkv * D]`` (a bitcast) and
each program copies ``block_tokens`` whole rows of new keys and values into their slots:
coalesced row loads and stores, no index arithmetic beyond one slot per row. Both planes'
rows come as one operand ``[2, T, Hkv * D]``, so that XLA computes them in one fusion (the
rotated keys and the values sliced out of the q/k/v product). The cache is both an input
and the output (``input_output_aliases``), so under ``jax.jit`` with the cache donated
nothing else is copied: the kernel moves the new tokens' bytes once (read k and v, write
them), which is what a copy at device bandwidth moves.

It replaces ``attn_jax.kv_cache.write_to_kv_cache`` (two XLA scatters) with the same
contract: negative slots (padding) and slots from ``P * S`` on write nothing, fp8 caches
store ``x / scale`` quantised by ``quantize_to_cache``; two tokens with the same slot
leave either one's values. ``benchmarks/attention.py`` times both (BENCHMARKS.md).
``write_latents`` runs the same kernel over one plane: MLA's latent cache ``[P, S, C + R]``
(PALLAS_MLA_GPU's write, in place of ``mla.reference.write_latent_cache``'s scatter).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from attn_jax.kv_cache import _check_write_inputs, _scalar_scale, quantize_to_cache

BLOCK_TOKENS = 16
"""Rows per program: 16 rows of ``Hkv * D`` bf16 elements are 32 KiB of loads in flight at Hkv * D = 1024."""


def _column_block(width: int) -> int:
    """The largest power of two dividing ``width``, at most 2048 (Triton blocks are powers of two)."""
    return min(width & -width, 2048)


def _write_kernel(slots_ref, rows_ref, _, cache_ref, *, num_slots, block_tokens, cols, spare):
    """``rows_ref`` [planes, T, width]: the new rows of each cache plane (k and v; MLA's one
    latent); then the cache in (aliased to the output, unused) and out [planes, slots, width]."""
    t0 = pl.program_id(0) * block_tokens
    c0 = pl.program_id(1) * cols
    planes, num_tokens, _ = rows_ref.shape
    tok = t0 + jnp.arange(block_tokens, dtype=jnp.int32)
    tok_ok = tok < num_tokens
    tok_c = jnp.minimum(tok, num_tokens - 1)
    slot = plgpu.load(slots_ref.at[tok_c], mask=tok_ok, other=-1)
    ok = tok_ok & (slot >= 0) & (slot < num_slots)
    # The interpreter turns a masked store into a scatter of kept-or-old values, so rows
    # that write nothing go to a spare row no real slot uses.
    slot = jnp.where(ok, slot, num_slots if spare else 0)[:, None]
    c = c0 + jnp.arange(cols, dtype=jnp.int32)[None, :]
    row = tok_c[:, None]
    for plane in range(planes):
        plgpu.store(cache_ref.at[plane, slot, c], plgpu.load(rows_ref.at[plane, row, c]), mask=ok[:, None])


def write_kv(
    kv_cache,  # [2, P, S, Hkv, D]
    key,  # f[T, Hkv, D]
    value,  # f[T, Hkv, D]
    slot_mapping,  # i32[T]; -1 = padding, not written
    k_scale=None,  # f32[] | None
    v_scale=None,  # f32[] | None
    *,
    interpret: bool | None = None,
    block_tokens: int = BLOCK_TOKENS,
):
    """``write_to_kv_cache``'s contract as one Pallas kernel; returns the updated cache.

    ``interpret=None`` runs compiled on a GPU and in the Pallas interpreter elsewhere.
    In place when the caller donates ``kv_cache`` to its ``jax.jit``.

    Example::

        step = jax.jit(write_kv, donate_argnums=0)
        kv_cache = step(kv_cache, k, v, slot_mapping)
    """
    kv_cache, key, value = jnp.asarray(kv_cache), jnp.asarray(key), jnp.asarray(value)
    slot_mapping = jnp.asarray(slot_mapping)
    _check_write_inputs(kv_cache, key, value, slot_mapping)
    if block_tokens < 1 or block_tokens & (block_tokens - 1):
        raise ValueError(f"{block_tokens=} must be a power of two")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    k_scale, v_scale = _scalar_scale("k_scale", k_scale), _scalar_scale("v_scale", v_scale)
    k_new = quantize_to_cache(key, kv_cache.dtype, k_scale)
    v_new = quantize_to_cache(value, kv_cache.dtype, v_scale)
    if key.shape[0] == 0:
        return kv_cache
    num_tokens = key.shape[0]
    rows = jnp.stack([k_new.reshape(num_tokens, -1), v_new.reshape(num_tokens, -1)])  # [2, T, Hkv * D]
    return _write(
        kv_cache, rows, slot_mapping.astype(jnp.int32), interpret=interpret, block_tokens=block_tokens
    ).reshape(kv_cache.shape)


def write_latents(
    kv_cache,  # [P, S, C + R]: MLA's latent cache, one row per token
    latents,  # f[T, C + R]: each new token's [kv_c | k_pe]
    slot_mapping,  # i32[T]; -1 = padding, not written
    k_scale=None,  # f32[] | None: an fp8 cache stores latent / k_scale
    *,
    interpret: bool | None = None,
    block_tokens: int = BLOCK_TOKENS,
):
    """``mla.reference.write_latent_cache``'s contract for rows already joined, as the same
    kernel with one plane: the latent cache viewed ``[1, P * S, C + R]``, each row stored at
    its slot, in place under donation."""
    kv_cache, latents, slot_mapping = jnp.asarray(kv_cache), jnp.asarray(latents), jnp.asarray(slot_mapping)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if latents.shape[0] == 0:
        return kv_cache
    rows = quantize_to_cache(latents, kv_cache.dtype, _scalar_scale("k_scale", k_scale))[None]  # [1, T, C + R]
    return _write(
        kv_cache[None], rows, slot_mapping.astype(jnp.int32), interpret=interpret, block_tokens=block_tokens
    ).reshape(kv_cache.shape)


@functools.partial(jax.jit, static_argnames=("interpret", "block_tokens"))
def _write(kv_cache, rows, slots, *, interpret, block_tokens):
    """[planes, num_slots, width]: ``rows[p]`` (``rows`` f[planes, T, width]) stored into plane p at ``slots``."""
    planes, num_tokens, width = rows.shape
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    flat = kv_cache.reshape(planes, num_slots, width)
    if interpret:  # a spare row per plane for the interpreter's masked stores
        flat = jnp.concatenate([flat, jnp.zeros((planes, 1, width), flat.dtype)], axis=1)
    cols = _column_block(width)
    kernel = functools.partial(
        _write_kernel, num_slots=num_slots, block_tokens=block_tokens, cols=cols, spare=interpret
    )
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_tokens, block_tokens), width // cols),
        out_shape=jax.ShapeDtypeStruct(flat.shape, flat.dtype),
        input_output_aliases={2: 0},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="kv_write_gpu",
    )(slots, rows, flat)
    if interpret:
        out = out[:, :num_slots]
    return out
