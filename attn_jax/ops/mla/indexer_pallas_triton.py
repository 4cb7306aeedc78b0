"""The lightning indexer (DeepSeek-V3.2's DSA) with its scores in a Pallas kernel on GPU
(Triton lowering) and the top-k in XLA: ``sparse_reference.lightning_indexer``'s contract.

The reference forms every per-head logit ``[T, HI, L]`` at once (4 GiB in float32 for a
4096-token prefill over 4096 positions with 64 index heads). Here a program takes one token
and ``block_l`` positions of its request, gathers their index keys through the block table
(masked loads: positions past the token's are never read), and reduces
``sum_j weights[t, j] * relu(q_idx[t, j] . k_idx[s])`` over the heads in registers, so only
the scores f32[T, L] reach memory; position blocks wholly past the token's position skip the
dot and write -inf. ``sparse_reference.topk_of_scores`` then picks the positions.

Index heads, index head size and ``block_l`` must be powers of two >= 16 (Triton's dot tiles).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from attn_jax.ops.mla.pallas_triton import is_pow2
from attn_jax.ops.mla.sparse_reference import check_indexer_inputs, token_positions, topk_of_scores
from attn_jax.ops.mla.validate import check_index


def _kernel(req_ref, pos_ref, table_ref, q_ref, w_ref, k_ref, out_ref, *, block_l, num_reqs):
    t, lb = pl.program_id(0), pl.program_id(1)
    _, page_size, dim = k_ref.shape
    pages_per_req = table_ref.shape[1]
    req, pos = req_ref[t], pos_ref[t]
    start = lb * block_l
    cols = pl.ds(start, block_l)

    @pl.when((req < num_reqs) & (start <= pos))
    def _scores():
        s = start + jnp.arange(block_l, dtype=jnp.int32)
        visible = s <= pos
        s = jnp.minimum(s, pos)
        page = plgpu.load(table_ref.at[req, jnp.minimum(s // page_size, pages_per_req - 1)])[:, None]
        k = plgpu.load(k_ref.at[page, (s % page_size)[:, None], jnp.arange(dim)[None, :]], mask=visible[:, None],
                       other=0.0)  # fmt: skip
        q = plgpu.load(q_ref.at[t])  # [HI, DI]
        compute = jnp.float32 if jnp.float32 in (q.dtype, k.dtype) else jnp.bfloat16
        precision = jax.lax.Precision.HIGHEST if compute == jnp.float32 else None
        logits = jax.lax.dot_general(q.astype(compute), k.astype(compute), (((1,), (1,)), ((), ())),
                                     precision=precision, preferred_element_type=jnp.float32)  # fmt: skip
        w = plgpu.load(w_ref.at[t]).astype(jnp.float32)
        scores = jnp.sum(w[:, None] * jnp.maximum(logits, 0.0), axis=0)
        plgpu.store(out_ref.at[t, cols], jnp.where(visible, scores, -jnp.inf))

    @pl.when((req >= num_reqs) | (start > pos))
    def _unseen():
        plgpu.store(out_ref.at[t, cols], jnp.full((block_l,), -jnp.inf, jnp.float32))


def index_scores(
    q_idx,  # f[T, HI, DI]
    weights,  # f[T, HI]
    k_idx_cache,  # [P, S, DI]
    query_start_loc,  # i32[R + 1]
    seq_lens,  # i32[R]
    block_tables,  # i32[R, pages_per_req]
    *,
    interpret: bool | None = None,
    block_l: int = 128,
):
    """f32[T, pages_per_req * S]: each token's index score at every position of its request,
    -inf at positions it may not see (past its own, padding rows). ``interpret=None``:
    compiled on a GPU, the Pallas interpreter elsewhere."""
    num_tokens, heads, dim = q_idx.shape
    for name, value in (("index heads", heads), ("index head size", dim), ("block_l", block_l)):
        if not is_pow2(value) or value < 16:
            raise ValueError(f"{name}={value} must be a power of two >= 16 for the Triton indexer kernel")
    for name, x, ndim in (("query_start_loc", query_start_loc, 1), ("seq_lens", seq_lens, 1),
                          ("block_tables", block_tables, 2)):  # fmt: skip
        check_index(name, jnp.asarray(x), ndim)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return _scores(q_idx, weights, k_idx_cache, jnp.asarray(query_start_loc), jnp.asarray(seq_lens),
                   jnp.asarray(block_tables), interpret=bool(interpret), block_l=int(block_l))  # fmt: skip


@functools.partial(jax.jit, static_argnames=("interpret", "block_l"))
def _scores(q_idx, weights, k_idx_cache, query_start_loc, seq_lens, block_tables, *, interpret, block_l):
    num_tokens = q_idx.shape[0]
    max_len = block_tables.shape[1] * k_idx_cache.shape[1]
    num_reqs = seq_lens.shape[0]
    req, pos, real = token_positions(query_start_loc, seq_lens, num_tokens)
    req = jnp.where(real, req, num_reqs).astype(jnp.int32)
    blocks = -(-max_len // block_l)
    scores = pl.pallas_call(
        functools.partial(_kernel, block_l=block_l, num_reqs=num_reqs),
        grid=(num_tokens, blocks),
        out_shape=jax.ShapeDtypeStruct((num_tokens, blocks * block_l), jnp.float32),
        interpret=interpret,
        name="lightning_indexer_triton",
    )(req, pos.astype(jnp.int32), block_tables, q_idx, weights, k_idx_cache)
    return scores[:, :max_len]


def lightning_indexer(
    q_idx,  # f[T, HI, DI]: the indexer's queries
    weights,  # f[T, HI]: per-token head weights (scales folded in)
    k_idx_cache,  # [P, S, DI]: the indexer's keys, paged like the latent cache
    query_start_loc,  # i32[R + 1]
    seq_lens,  # i32[R]
    block_tables,  # i32[R, pages_per_req]
    *,
    topk: int,
    interpret: bool | None = None,
    block_l: int = 128,
):
    """i32[T, topk], as ``sparse_reference.lightning_indexer``: per token the positions of its
    ``topk`` highest index scores among those it may see, best first; -1 where fewer are
    visible and for padding rows.

    Example::

        topk_positions = lightning_indexer(q_idx, w, k_idx_cache, qsl, seq_lens, tables, topk=2048)
    """
    check_indexer_inputs(q_idx, weights, k_idx_cache, topk)
    scores = index_scores(q_idx, weights, k_idx_cache, query_start_loc, seq_lens, block_tables,
                          interpret=interpret, block_l=block_l)  # fmt: skip
    return topk_of_scores(scores, topk)
