"""Sparse absorbed MLA as a Pallas kernel on GPU (Triton lowering): ``sparse_reference.sparse_mla``'s
contract. The grid is ``(num_tokens, cdiv(H, block_h))``: a program takes ``block_h`` query
heads of one token and walks its top-k list in tiles of ``block_k`` positions, gathering
each tile's latent rows through the request's block table (``c_kv`` and ``k_pe`` loaded
apart: Triton tiles are powers of two), with the online softmax of the decode kernel; -1
entries are masked. Outputs are padded to whole head blocks (no masked stores) and sliced.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from attn_jax.ops.mla.pallas_triton import MASK_VALUE, is_pow2
from attn_jax.ops.mla.reference import fold_fp8_scale
from attn_jax.ops.mla.sparse_reference import token_positions, validate_topk_positions
from attn_jax.ops.mla.validate import check_index, check_latent_cache, dynamic_validate, is_concrete


def _kernel(req_ref, topk_ref, table_ref, q_ref, kv_ref, out_ref, lse_ref, *, sm_scale, kv_lora_rank, block_h,
            block_k, num_reqs):  # fmt: skip
    t, hb = pl.program_id(0), pl.program_id(1)
    num_heads = q_ref.shape[1]
    _, page_size, width = kv_ref.shape
    pages_per_req = table_ref.shape[1]
    topk = topk_ref.shape[1]
    rope = width - kv_lora_rank

    head = hb * block_h + jnp.arange(block_h, dtype=jnp.int32)
    head_ok = head < num_heads
    head_c = jnp.minimum(head, num_heads - 1)
    dc = jnp.arange(kv_lora_rank, dtype=jnp.int32)[None, :]
    dr = kv_lora_rank + jnp.arange(rope, dtype=jnp.int32)[None, :]
    q_nope = plgpu.load(q_ref.at[t, head_c[:, None], dc], mask=head_ok[:, None], other=0.0)
    q_pe = plgpu.load(q_ref.at[t, head_c[:, None], dr], mask=head_ok[:, None], other=0.0)
    precision = jax.lax.Precision.HIGHEST if q_nope.dtype == jnp.float32 else None
    dims = (((1,), (1,)), ((), ()))
    req = req_ref[t]
    real = req < num_reqs
    req_c = jnp.minimum(req, num_reqs - 1)

    def body(i, state):
        m, denom, acc = state
        kk = i * block_k + jnp.arange(block_k, dtype=jnp.int32)
        idx = plgpu.load(topk_ref.at[t, jnp.minimum(kk, topk - 1)], mask=kk < topk, other=-1)
        ok = (idx >= 0) & real
        pos = jnp.maximum(idx, 0)
        page = plgpu.load(table_ref.at[req_c, jnp.minimum(pos // page_size, pages_per_req - 1)])[:, None]
        off = (pos % page_size)[:, None]
        c_kv = plgpu.load(kv_ref.at[page, off, dc], mask=ok[:, None], other=0.0).astype(q_nope.dtype)
        k_pe = plgpu.load(kv_ref.at[page, off, dr], mask=ok[:, None], other=0.0).astype(q_nope.dtype)
        s = jax.lax.dot_general(q_nope, c_kv, dims, precision=precision, preferred_element_type=jnp.float32)
        s += jax.lax.dot_general(q_pe, k_pe, dims, precision=precision, preferred_element_type=jnp.float32)
        s = jnp.where(ok[None, :], s * sm_scale, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(ok[None, :], jnp.exp(s - m_new[:, None]), 0.0)
        pv = jax.lax.dot(p.astype(c_kv.dtype), c_kv, precision=precision, preferred_element_type=jnp.float32)
        return m_new, alpha * denom + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    state = (
        jnp.full((block_h,), MASK_VALUE, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
        jnp.zeros((block_h, kv_lora_rank), jnp.float32),
    )
    m, denom, acc = jax.lax.fori_loop(0, pl.cdiv(topk, block_k), body, state)
    empty = denom == 0
    out = jnp.where(empty[:, None], 0.0, acc / jnp.where(empty, 1.0, denom)[:, None])
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, denom)))
    rows = hb * block_h + jnp.arange(block_h, dtype=jnp.int32)
    plgpu.store(out_ref.at[t, rows[:, None], dc], out.astype(out_ref.dtype))
    plgpu.store(lse_ref.at[t, rows], lse)


def sparse_mla(
    q,  # f[T, H, C + Rope]
    kv_cache,  # [P, S, C + Rope]
    topk_positions,  # i32[T, topk]; -1 = padding
    query_start_loc,  # i32[R + 1]
    seq_lens,  # i32[R]
    block_tables,  # i32[R, pages_per_req]
    *,
    sm_scale: float,
    kv_lora_rank: int,
    return_lse: bool = False,
    interpret: bool | None = None,
    block_h: int = 64,
    block_k: int = 64,
    num_warps: int = 8,
    k_scale=None,  # f32[] | None: required for fp8 caches (folded into q and the output)
):
    """``sparse_reference.sparse_mla`` as a Pallas GPU kernel; ``interpret=None`` compiles on a
    GPU and interprets elsewhere. ``block_h`` (heads per program) and ``block_k`` (positions
    per tile) are powers of two >= 16."""
    width = kv_cache.shape[2]
    rope = check_latent_cache(kv_cache, kv_lora_rank)
    if q.ndim != 3 or q.shape[2] != width:
        raise ValueError(f"q.shape={tuple(q.shape)} must be [num_tokens, num_heads, {width}] (the absorbed query)")
    check_index("topk_positions", topk_positions, 2)
    for name, value in (("kv_lora_rank", kv_lora_rank), ("qk_rope_head_dim", rope), ("block_h", block_h),
                        ("block_k", block_k)):  # fmt: skip
        if not is_pow2(value) or value < (16 if name.startswith("block") else 1):
            raise ValueError(f"{name}={value} must be a power of two (block sizes >= 16) for the Triton kernel")
    num_blocks, page_size, _ = kv_cache.shape
    if is_concrete(topk_positions, query_start_loc, seq_lens, block_tables):
        dynamic_validate(seq_lens, block_tables, num_blocks=num_blocks, block_size=page_size,
                         query_start_loc=query_start_loc)  # fmt: skip
        validate_topk_positions(topk_positions, query_start_loc, seq_lens)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    num_tokens, num_heads, _ = q.shape
    req, _, real = token_positions(query_start_loc, seq_lens, num_tokens)
    num_reqs = seq_lens.shape[0]
    req = jnp.where(real, req, num_reqs).astype(jnp.int32)
    q, out_scale = fold_fp8_scale(q, kv_cache, k_scale)
    out, lse = _sparse(
        req, jnp.asarray(topk_positions), jnp.asarray(block_tables), q, kv_cache, sm_scale=float(sm_scale),
        kv_lora_rank=int(kv_lora_rank), block_h=block_h, block_k=block_k, num_warps=num_warps,
        interpret=bool(interpret),
    )  # fmt: skip
    if out_scale is not None:
        out = (out.astype(jnp.float32) * out_scale).astype(out.dtype)
    return (out, lse) if return_lse else out


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "kv_lora_rank", "block_h", "block_k", "num_warps", "interpret")
)
def _sparse(req, topk, tables, q, kv_cache, *, sm_scale, kv_lora_rank, block_h, block_k, num_warps, interpret):
    num_tokens, num_heads, _ = q.shape
    if num_tokens == 0:
        return jnp.zeros((0, num_heads, kv_lora_rank), q.dtype), jnp.zeros((0, num_heads), jnp.float32)
    head_blocks = -(-num_heads // block_h)
    padded = head_blocks * block_h
    kernel = functools.partial(_kernel, sm_scale=sm_scale, kv_lora_rank=kv_lora_rank, block_h=block_h,
                               block_k=block_k, num_reqs=tables.shape[0])  # fmt: skip
    out, lse = pl.pallas_call(
        kernel,
        grid=(num_tokens, head_blocks),
        out_shape=(
            jax.ShapeDtypeStruct((num_tokens, padded, kv_lora_rank), q.dtype),
            jax.ShapeDtypeStruct((num_tokens, padded), jnp.float32),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="sparse_mla_triton",
    )(req, topk, tables, q, kv_cache)
    return out[:, :num_heads], lse[:, :num_heads]
