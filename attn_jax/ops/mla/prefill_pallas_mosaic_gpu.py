"""Up-projected MLA prefill with its attention in the Mosaic GPU prefill kernel (Hopper).

The latents are up-projected as for the Triton kernel (``prefill_pallas_triton.up_project``);
the keys' two parts (``k_nope`` per head, ``k_pe`` shared by the heads, never repeated or
concatenated) and the values are laid out request by request, each request's ``L =
pages_per_req * block_size`` rows one "page", for ``pallas_mosaic_gpu.prefill_attention_kv``
(q/k and v head sizes differ: 192 and 128 for DeepSeek). The rows its 128-token tiles leave
over (at most 7 at either end of a request's 8-aligned span, and requests shorter than a
tile) are the Triton MLA prefill kernel's, which writes them, and zeros in the padding rows
no request owns, into the same output (``prefill_pallas_triton.attend`` with ``spans``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax.ops.mla.prefill_pallas_triton import attend, up_project, validate_prefill
from attn_jax.ops.mla.validate import is_concrete
from attn_jax.ops.ragged_paged_attention import pallas_mosaic_gpu
from attn_jax.ops.ragged_paged_attention.config import MOSAIC_GPU_SMEM_BYTES, MgpuBlockSizes, mgpu_block_sizes


def unsupported_reason(*, qk_head_dim: int, v_head_dim: int, dtype, max_len: int, rope_dim: int = 64) -> str | None:
    """Why the Mosaic GPU kernel cannot serve this MLA prefill, or None. ``max_len``: the
    rows per request (``pages_per_req * block_size``), which must tile its K/V blocks;
    ``rope_dim``: the part of ``qk_head_dim`` that is ``k_pe`` (the rest is ``k_nope``)."""
    if np.dtype(dtype) not in pallas_mosaic_gpu.SUPPORTED_DTYPES:
        return f"the Mosaic GPU prefill kernel takes bfloat16/float16 activations, not {np.dtype(dtype)}"
    for name, width in (("k_nope", qk_head_dim - rope_dim), ("v", v_head_dim)):
        if width not in pallas_mosaic_gpu.SUPPORTED_HEAD_SIZES:
            return f"{name} head size {width} is not one of {list(pallas_mosaic_gpu.SUPPORTED_HEAD_SIZES)}"
    if rope_dim % 64:
        return f"rope_dim={rope_dim} must be whole 128-byte tiles of 16-bit values (a multiple of 64)"
    bs = mgpu_block_sizes(head_size=max(qk_head_dim, v_head_dim))
    smem = bs.smem_bytes(qk_head_dim, dtype, v_head_size=v_head_dim)
    if smem > MOSAIC_GPU_SMEM_BYTES:
        return f"{bs} needs {smem} bytes of shared memory at q/k {qk_head_dim}, v {v_head_dim}"
    if max_len % bs.block_kv:
        return f"{max_len} rows per request do not tile {bs.block_kv}-key blocks"
    return None


def mla_prefill(
    q,  # f[T, H, nope + rope]
    kv_cache,  # [P, S, C + rope]
    w_uk,  # f[C, H, nope]
    w_uv,  # f[C, H, Dv]
    query_start_loc,  # i32[R + 1]
    seq_lens,  # i32[R]
    block_tables,  # i32[R, pages_per_req]
    *,
    sm_scale: float,
    kv_lora_rank: int,
    q_block: int,
    k_scale=None,
    block_q: int = 64,
    block_k: int = 64,
):
    """``prefill_pallas_triton.mla_prefill``'s contract (causal, out f[T, H, Dv]; no LSE),
    compiled on Hopper; ``unsupported_reason`` must be None for the shapes. ``block_q`` /
    ``block_k`` are the Triton kernel's, for the rows left over."""
    validate_prefill(q, kv_cache, w_uk, w_uv, query_start_loc, seq_lens, block_tables, sm_scale=sm_scale,
                     kv_lora_rank=kv_lora_rank, k_scale=k_scale, block_q=block_q, block_k=block_k)  # fmt: skip
    max_len = block_tables.shape[1] * kv_cache.shape[1]
    dims = dict(qk_head_dim=q.shape[2], v_head_dim=w_uv.shape[2], dtype=q.dtype, max_len=max_len,
                rope_dim=kv_cache.shape[2] - kv_lora_rank)  # fmt: skip
    if (reason := unsupported_reason(**dims)) is not None:
        raise ValueError(f"the Mosaic GPU MLA prefill cannot serve these shapes: {reason}")
    xp = np if is_concrete(query_start_loc, seq_lens) else jnp
    tiles, spans = pallas_mosaic_gpu.mgpu_schedule(
        xp.asarray(query_start_loc), xp.asarray(seq_lens), num_tokens=q.shape[0], tile=MgpuBlockSizes().tile, xp=xp
    )
    return _prefill(
        q, kv_cache, w_uk, w_uv, jnp.asarray(query_start_loc), jnp.asarray(seq_lens), jnp.asarray(block_tables),
        None if k_scale is None else jnp.asarray(k_scale, jnp.float32), jnp.asarray(tiles),
        tuple(jnp.asarray(s) for s in spans), sm_scale=float(sm_scale), kv_lora_rank=int(kv_lora_rank),
        q_block=int(q_block), block_q=block_q, block_k=block_k,
    )  # fmt: skip


@functools.partial(jax.jit, static_argnames=("sm_scale", "kv_lora_rank", "q_block", "block_q", "block_k"))
def _prefill(q, kv_cache, w_uk, w_uv, qsl, lens, tables, k_scale, tiles, spans, *, sm_scale, kv_lora_rank, q_block,
             block_q, block_k):  # fmt: skip
    k_nope, k_pe, v = up_project(kv_cache, w_uk, w_uv, lens, tables, k_scale, kv_lora_rank=kv_lora_rank, dtype=q.dtype)
    num_reqs, max_len, num_heads, nope = k_nope.shape
    rope, dv = k_pe.shape[2], v.shape[3]
    rows = num_reqs * max_len
    out = pallas_mosaic_gpu.prefill_attention_kv(
        q, k_nope.reshape(rows, num_heads, nope), v.reshape(rows, num_heads, dv), tiles,
        jnp.arange(num_reqs, dtype=jnp.int32)[:, None], page_size=max_len, sm_scale=sm_scale,
        k_rope=k_pe.reshape(rows, rope),
    )  # fmt: skip
    # The rows left over, and zeros in the padding rows, written in place.
    return attend(q, k_nope, k_pe, v, qsl, lens, sm_scale=sm_scale, q_block=q_block, block_q=block_q,
                  block_k=block_k, num_warps=4, num_stages=2, interpret=False, spans=spans, out_init=out)  # fmt: skip
