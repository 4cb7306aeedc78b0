"""Sparse MLA (DeepSeek-V3.2's DeepSeek Sparse Attention) and its lightning indexer, in pure jnp.

Each query token attends only to a per-token list of ``topk`` positions of its request's
context (i32[T, topk], -1 = padding), in the absorbed MLA form: H query heads of size
``C + R`` over the latent rows ``[c_kv | k_pe]`` at those positions, values ``c_kv``. The
positions come from the lightning indexer: index scores ``I[t, s] = sum_j w[t, j] *
relu(q_idx[t, j] . k_idx[s])`` over its heads j, against a paged index-key cache that shares
the latent cache's block table; the top ``topk`` visible positions (``s <= p``) per token.
The specification for the sparse kernels; clear, not fast (one gather per token).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax.kv_cache import dequantize_from_cache
from attn_jax.ops.mla.reference import softmax_rows
from attn_jax.ops.mla.validate import check_index, check_latent_cache, check_scale, dynamic_validate, is_concrete

_HIGHEST = jax.lax.Precision.HIGHEST


def token_positions(query_start_loc, seq_lens, num_tokens: int):
    """(req i32[T], pos i32[T], real bool[T]): each token row's request (clamped), absolute
    position in it, and whether it is a real token (rows past query_start_loc[-1]: padding)."""
    qsl, lens = jnp.asarray(query_start_loc), jnp.asarray(seq_lens)
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    req = jnp.searchsorted(qsl[1:], rows, side="right").astype(jnp.int32)
    real = req < lens.shape[0]
    req = jnp.minimum(req, lens.shape[0] - 1)
    pos = lens[req] - (qsl[req + 1] - qsl[req]) + rows - qsl[req]
    return req, pos, real


def validate_topk_positions(topk_positions, query_start_loc, seq_lens) -> None:
    """ValueError naming the first entry that is neither -1 (padding) nor a position its token
    may see (0 <= s <= p, p the token's position); rows past the real tokens are not checked."""
    topk = np.asarray(topk_positions)
    qsl, lens = np.asarray(query_start_loc), np.asarray(seq_lens)
    for r in range(len(lens)):
        qlen = int(qsl[r + 1] - qsl[r])
        for i in range(qlen):
            t, p = int(qsl[r]) + i, int(lens[r]) - qlen + i
            bad = np.flatnonzero((topk[t] < -1) | (topk[t] > p))
            if bad.size:
                k = int(bad[0])
                raise ValueError(
                    f"topk_positions[{t}, {k}]={int(topk[t, k])} is beyond token {t}'s sequence "
                    f"(request {r}, position {p}): valid entries are -1 (padding) or 0..{p}"
                )


def sparse_mla(
    q,  # f[T, H, C + Rope]: absorbed queries
    kv_cache,  # [P, S, C + Rope]
    topk_positions,  # i32[T, topk]: positions in the token's request; -1 = padding
    query_start_loc,  # i32[R + 1]
    seq_lens,  # i32[R]
    block_tables,  # i32[R, pages_per_req]
    *,
    sm_scale: float,
    kv_lora_rank: int,
    return_lse: bool = False,
    k_scale=None,  # f32[] | None: required for fp8 caches
):
    """Sparse absorbed MLA: token t attends to the latent rows at ``topk_positions[t]`` of its
    request (-1 entries skipped; a row with none gives 0, lse -inf). Returns out f[T, H, C] in
    q's dtype (and lse f32[T, H] with ``return_lse``). A position listed twice counts twice.
    """
    width = kv_cache.shape[2]
    check_latent_cache(kv_cache, kv_lora_rank)
    check_scale(kv_cache, k_scale)
    if q.ndim != 3 or q.shape[2] != width:
        raise ValueError(f"q.shape={tuple(q.shape)} must be [num_tokens, num_heads, {width}] (the absorbed query)")
    check_index("topk_positions", topk_positions, 2)
    check_index("query_start_loc", query_start_loc, 1)
    if topk_positions.shape[0] != q.shape[0]:
        raise ValueError(f"topk_positions.shape={tuple(topk_positions.shape)} must have num_tokens={q.shape[0]} rows")
    num_blocks, block_size, _ = kv_cache.shape
    if is_concrete(topk_positions, query_start_loc, seq_lens, block_tables):
        dynamic_validate(seq_lens, block_tables, num_blocks=num_blocks, block_size=block_size,
                         query_start_loc=query_start_loc)  # fmt: skip
        validate_topk_positions(topk_positions, query_start_loc, seq_lens)
    req, _, real = token_positions(query_start_loc, seq_lens, q.shape[0])
    idx = jnp.asarray(topk_positions)
    valid = real[:, None] & (idx >= 0)  # bool[T, K]
    tables = jnp.asarray(block_tables)
    safe = jnp.maximum(idx, 0)
    page = jnp.clip(jnp.take_along_axis(tables[req], safe // block_size, axis=1), 0, num_blocks - 1)
    latent = dequantize_from_cache(jnp.asarray(kv_cache)[page, safe % block_size], k_scale)  # f32[T, K, C + R]
    s = jnp.einsum("thw,tkw->thk", q.astype(jnp.float32), latent, precision=_HIGHEST) * sm_scale
    values = jnp.where(valid[..., None], latent[..., :kv_lora_rank], 0.0)
    out, lse = softmax_rows(s, valid[:, None, :], values)
    out = out.astype(q.dtype)
    return (out, lse) if return_lse else out


def lightning_indexer(
    q_idx,  # f[T, HI, DI]: the indexer's queries
    weights,  # f[T, HI]: per-token head weights (scales folded in)
    k_idx_cache,  # [P, S, DI]: the indexer's keys, paged like the latent cache
    query_start_loc,  # i32[R + 1]
    seq_lens,  # i32[R]
    block_tables,  # i32[R, pages_per_req]
    *,
    topk: int,
):
    """i32[T, topk]: per token the positions of its ``topk`` highest index scores among the
    positions it may see (``s <= p``), best first; -1 where fewer are visible, and for
    padding rows. ``I[t, s] = sum_j weights[t, j] * relu(q_idx[t, j] . k_idx[s])``."""
    check_indexer_inputs(q_idx, weights, k_idx_cache, topk)
    num_tokens = q_idx.shape[0]
    num_blocks, block_size, dim = k_idx_cache.shape
    req, pos, real = token_positions(query_start_loc, seq_lens, num_tokens)
    pages_per_req = block_tables.shape[1]
    max_len = pages_per_req * block_size
    pages = jnp.clip(jnp.asarray(block_tables), 0, num_blocks - 1)
    keys = jnp.asarray(k_idx_cache)[pages[req]].reshape(num_tokens, max_len, dim).astype(jnp.float32)
    logits = jnp.einsum("thd,tld->thl", q_idx.astype(jnp.float32), keys, precision=_HIGHEST)
    scores = jnp.einsum("th,thl->tl", weights.astype(jnp.float32), jax.nn.relu(logits), precision=_HIGHEST)
    j = jnp.arange(max_len)[None, :]
    visible = real[:, None] & (j <= pos[:, None])
    return topk_of_scores(jnp.where(visible, scores, -jnp.inf), topk)


def check_indexer_inputs(q_idx, weights, k_idx_cache, topk) -> None:
    """ValueError naming a lightning-indexer input whose shape or ``topk`` is off."""
    if not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk={topk!r} must be an int >= 1")
    dim = k_idx_cache.shape[-1]
    if k_idx_cache.ndim != 3:
        raise ValueError(f"k_idx_cache.shape={tuple(k_idx_cache.shape)} must be [num_blocks, block_size, DI]")
    if q_idx.ndim != 3 or q_idx.shape[2] != dim or weights.shape != q_idx.shape[:2]:
        raise ValueError(
            f"q_idx.shape={tuple(q_idx.shape)} must be [T, HI, {dim}] (DI from k_idx_cache) and "
            f"weights.shape={tuple(weights.shape)} must be [T, HI]"
        )


def topk_of_scores(scores, topk: int):
    """i32[T, topk]: the positions of each row's ``topk`` highest scores f32[T, L], best first;
    -1 where a row has fewer finite scores (-inf marks a position the token may not see)."""
    length = scores.shape[1]
    if topk > length:
        scores = jnp.pad(scores, ((0, 0), (0, topk - length)), constant_values=-jnp.inf)
    values, idx = jax.lax.top_k(scores, topk)
    return jnp.where(jnp.isneginf(values), -1, idx).astype(jnp.int32)
