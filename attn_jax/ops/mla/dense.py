"""Up-projected MLA prefill in jnp, per request: each request's latents gathered and
up-projected once (not once per query row, as the reference does), its query rows attended
as one ``[q_block, H]`` block. The XLA_MLA and Pallas MLA backends' prefill path.

``q_block`` (static) must cover the longest prefill of the batch (the metadata builder
passes the next power of two); requests run one after another (``lax.map``). With
``context_chunk`` a request's context is read, up-projected and attended a chunk at a time,
the chunks merged by their log-sum-exp (vLLM's chunked-context prefill): memory is one
chunk's scores ``[H, q_block, context_chunk]`` and up-projected keys and values, however
long the context; without it, one chunk of the whole block table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax.kv_cache import dequantize_from_cache
from attn_jax.ops.mla.reference import softmax_rows
from attn_jax.ops.mla.validate import check_scale, dynamic_validate, is_concrete, static_validate_prefill
from attn_jax.ops.ragged_paged_attention.merge import merge_attn_states


def mla_prefill_dense(
    q,  # f[T, H, nope + Rope]
    kv_cache,  # [P, S, C + Rope]
    w_uk,  # f[C, H, nope]
    w_uv,  # f[C, H, Dv]
    query_start_loc,  # i32[R + 1]
    seq_lens,  # i32[R]
    block_tables,  # i32[R, pages_per_req]
    *,
    sm_scale: float,
    kv_lora_rank: int,
    q_block: int,
    causal: bool = True,
    k_scale=None,  # f32[] | None: required for fp8 caches
    context_chunk: int | None = None,  # static: context tokens per chunk, a multiple of the page size
):
    """``reference.mla_prefill``'s contract (without the LSE); every request's query length
    must be at most ``q_block`` (checked when the metadata is concrete). Returns f[T, H, Dv]."""
    static_validate_prefill(
        q, kv_cache, w_uk, w_uv, query_start_loc, seq_lens, block_tables, sm_scale=sm_scale, kv_lora_rank=kv_lora_rank
    )
    check_scale(kv_cache, k_scale)
    num_blocks, block_size, width = kv_cache.shape
    if context_chunk is not None and (context_chunk < 1 or context_chunk % block_size):
        raise ValueError(f"context_chunk={context_chunk} must be a positive multiple of the page size {block_size}")
    if is_concrete(query_start_loc, seq_lens, block_tables):
        dynamic_validate(seq_lens, block_tables, num_blocks=num_blocks, block_size=block_size,
                         query_start_loc=query_start_loc if causal else None)  # fmt: skip
        longest = int(np.diff(np.asarray(query_start_loc)).max(initial=0))
        if longest > q_block:
            raise ValueError(f"q_block={q_block} must cover the longest query, {longest} tokens")
    num_tokens, num_heads, _ = q.shape
    num_reqs, pages_per_req = block_tables.shape
    chunk = pages_per_req * block_size if context_chunk is None else context_chunk
    pages_per_chunk = chunk // block_size
    num_chunks = -(-pages_per_req // pages_per_chunk)
    nope, dv = w_uk.shape[2], w_uv.shape[2]
    qsl, lens = jnp.asarray(query_start_loc), jnp.asarray(seq_lens)
    pages = jnp.clip(jnp.asarray(block_tables), 0, num_blocks - 1)
    pages = jnp.pad(pages, ((0, 0), (0, num_chunks * pages_per_chunk - pages_per_req)))  # read, then masked
    dtype = q.dtype
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    w_uk, w_uv = w_uk.astype(dtype), w_uv.astype(dtype)
    q_pad = jnp.concatenate([q, jnp.zeros((q_block, num_heads, q.shape[2]), dtype)])
    i = jnp.arange(q_block)

    def one_request(r):
        start, qlen, kv_len = qsl[r], qsl[r + 1] - qsl[r], lens[r]
        qr = jax.lax.dynamic_slice_in_dim(q_pad, start, q_block).astype(jnp.float32)  # f32[Qb, H, D]
        q_pos = kv_len - qlen + i

        def attend_chunk(c, state):  # state: (out f32[H, Qb, Dv], lse f32[H, Qb]) over the chunks so far
            page_ids = jax.lax.dynamic_slice_in_dim(pages[r], c * pages_per_chunk, pages_per_chunk)
            latent = dequantize_from_cache(jnp.asarray(kv_cache)[page_ids], k_scale, dtype).reshape(chunk, width)
            j = c * chunk + jnp.arange(chunk)
            in_ctx = j < kv_len
            latent = jnp.where(in_ctx[:, None], latent, jnp.zeros((), dtype))  # unused slots may be NaN
            c_kv, k_pe = latent[:, :kv_lora_rank], latent[:, kv_lora_rank:]
            k_nope = jnp.einsum("lc,chd->hld", c_kv, w_uk, precision=precision, preferred_element_type=jnp.float32)
            values = jnp.einsum("lc,chd->hld", c_kv, w_uv, precision=precision, preferred_element_type=jnp.float32)
            s = jnp.einsum("qhd,hld->hql", qr[..., :nope], k_nope, precision=precision)
            s += jnp.einsum("qhd,ld->hql", qr[..., nope:], k_pe.astype(jnp.float32), precision=precision)
            visible = (i < qlen)[:, None] & in_ctx[None, :]
            if causal:
                visible &= j[None, :] <= q_pos[:, None]
            return merge_attn_states(*state, *softmax_rows(s * sm_scale, visible[None], values))

        empty = (jnp.zeros((num_heads, q_block, dv), jnp.float32), jnp.full((num_heads, q_block), -jnp.inf))
        out, _ = jax.lax.fori_loop(0, jnp.minimum(-(-kv_len // chunk), num_chunks), attend_chunk, empty)
        return jnp.swapaxes(out, 0, 1).astype(dtype)  # [Qb, H, Dv]

    blocks = jax.lax.map(one_request, jnp.arange(num_reqs))  # [R, Qb, H, Dv]
    rows = jnp.where(i[None, :] < (qsl[1:] - qsl[:-1])[:, None], qsl[:-1, None] + i[None, :], num_tokens)
    out = jnp.zeros((num_tokens, num_heads, dv), dtype)
    return out.at[rows.reshape(-1)].set(blocks.reshape(-1, num_heads, dv), mode="drop")
