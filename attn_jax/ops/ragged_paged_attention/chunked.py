"""Ragged paged attention in pure jnp with fixed shapes: an online softmax over KV chunks.

The XLA backend's serving path (the CPU's, and any platform without a kernel). Its shapes
depend only on the token count T, the request slots R and the block table's width, never
on the batch's lengths, so a jitted step compiles once per (T, R, width); its work follows
the batch's longest context, not the table's width, so a table padded to the engine's
longest context costs nothing (``AttentionMetadataBuilder.reads_live_pages_only``).

The query rows form tiles, each of one request:

* decode tiles: one per request slot, its single new token (requests with exactly one);
* prefill tiles: ``q_tile`` consecutive rows of one request with more than one new token,
  ``ceil(T / q_tile) + min(R, T // 2)`` of them (enough for any batch of T tokens), laid out
  on the device from ``query_start_loc``.

Each kind walks its tiles' pages in chunks of ``kv_chunk_pages`` with a ``fori_loop`` whose
trip count is data (the chunks up to the kind's furthest visible key; from its nearest one
under a sliding window): a chunk's pages are gathered for every tile at once and folded into
each tile's running softmax state with the kernels' tile math (``common.py``: masks, score
transforms, sinks, online softmax, non-finite routing), vmapped over tiles and KV heads. A
KV head's query heads are the tile's rows (token-major), as in the kernels. Softmax and
accumulation run in float32 at ``Precision.HIGHEST``. Same parameters, semantics and return
values as the reference (``reference.py``), which it is tested against, except FP8
attention (``q_scale``), which only the reference computes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from attn_jax.kv_cache import dequantize_from_cache, write_to_kv_cache
from attn_jax.ops.ragged_paged_attention import common
from attn_jax.ops.ragged_paged_attention.validate import validate_inputs

_HIGHEST = jax.lax.Precision.HIGHEST

Q_TILE = 32
"""Query rows of a prefill tile (the token bucket's size when it is smaller)."""
KV_CHUNK_TOKENS = 64
"""Keys a loop step gathers per tile (whole pages; the block table's width when it is smaller)."""


def ragged_paged_attention(
    q,  # f[T, Hq, D]
    k,  # f[T, Hkv, D] | None: new keys, written at slot_mapping; None = no write
    v,  # f[T, Hkv, D] | None
    kv_cache,  # [2, P, S, Hkv, D]: k at [0], v at [1] (NHD pages)
    query_start_loc,  # i32[R + 1]
    seq_lens,  # i32[R]
    block_tables,  # i32[R, pages_per_req]
    slot_mapping,  # i32[T]; -1 = padding, skipped
    *,
    sm_scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes=None,  # f32[Hq] | None
    sinks=None,  # f32[Hq] | None
    k_scale=None,  # f32[] | None: fp8 caches store k / k_scale
    v_scale=None,  # f32[] | None
    return_lse: bool = False,
    interpret: bool | None = None,  # accepted for parity with the kernels; pure jnp either way
    q_tile: int = Q_TILE,
    kv_chunk_pages: int | None = None,  # default: KV_CHUNK_TOKENS' pages
):
    """The reference's op (same arguments, same results), in fixed shapes with work bounded
    by the longest context (module docstring). Returns (out f[T, Hq, D] in q's dtype,
    kv_cache), or (out, kv_cache, lse f32[T, Hq]) with ``return_lse``; rows past the real
    tokens are 0 (lse -inf). ValueError for a ``q_tile`` or ``kv_chunk_pages`` below 1."""
    del interpret
    validate_inputs(
        q, k, v, kv_cache, query_start_loc, seq_lens, block_tables, slot_mapping, sm_scale=sm_scale, causal=causal,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, sinks=sinks,
    )  # fmt: skip
    for name, value in (("q_tile", q_tile), ("kv_chunk_pages", 1 if kv_chunk_pages is None else kv_chunk_pages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    _, num_blocks, block_size, _, _ = kv_cache.shape
    if k is not None:
        kv_cache = write_to_kv_cache(kv_cache, k, v, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    num_tokens, num_q_heads, _ = q.shape
    num_reqs, width = block_tables.shape
    if num_tokens == 0 or num_reqs == 0:  # no rows (or no request owns them): zeros, as the reference gives
        out = jnp.zeros_like(q)
        lse = jnp.full((num_tokens, num_q_heads), -jnp.inf, jnp.float32)
        return (out, kv_cache, lse) if return_lse else (out, kv_cache)
    if kv_chunk_pages is None:
        kv_chunk_pages = max(1, KV_CHUNK_TOKENS // block_size)
    chunk = min(kv_chunk_pages, width)

    qsl = jnp.asarray(query_start_loc, jnp.int32)
    lens = jnp.asarray(seq_lens, jnp.int32)
    tables = jnp.clip(jnp.asarray(block_tables, jnp.int32), 0, num_blocks - 1)  # unused entries may hold anything
    tables = jnp.pad(tables, ((0, 0), (0, -width % chunk)))  # whole chunks; the padding is never visible
    query_lens = qsl[1:] - qsl[:-1]  # i32[R]
    tiles = functools.partial(
        _attend_tiles, q, kv_cache, lens, tables, qsl, query_lens, chunk=chunk, sm_scale=sm_scale, causal=causal,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
        slopes=None if alibi_slopes is None else jnp.asarray(alibi_slopes, jnp.float32),
        sinks=None if sinks is None else jnp.asarray(sinks, jnp.float32), k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip

    def attend(reqs, rows, valid):  # a kind without rows (a decode-only batch's prefill tiles) costs nothing
        shape = rows.shape
        none = (jnp.full(shape, num_tokens), jnp.zeros((*shape, *q.shape[1:]), q.dtype),
                jnp.full((*shape, num_q_heads), -jnp.inf, jnp.float32))  # fmt: skip
        return jax.lax.cond(valid.any(), lambda: tiles(reqs, rows, valid), lambda: none)

    # Decode tiles: one row per request slot.
    reqs = jnp.arange(num_reqs, dtype=jnp.int32)
    is_decode = (query_lens == 1)[:, None]
    decode = attend(reqs, jnp.where(is_decode, qsl[:-1, None], num_tokens), is_decode)

    # Prefill tiles: q_tile rows of one request each, numbered request by request.
    rows_per_tile = min(q_tile, num_tokens)
    num_tiles = -(-num_tokens // rows_per_tile) + min(num_reqs, num_tokens // 2)
    tiles_of = jnp.where(query_lens > 1, -(-query_lens // rows_per_tile), 0)  # i32[R]
    ends = jnp.cumsum(tiles_of)
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    owner = jnp.minimum(jnp.searchsorted(ends, tile, side="right"), num_reqs - 1).astype(jnp.int32)  # i32[N]
    first = (tile - (ends[owner] - tiles_of[owner])) * rows_per_tile  # the tile's first row within its request
    offset = first[:, None] + jnp.arange(rows_per_tile, dtype=jnp.int32)[None, :]  # i32[N, q_tile]
    valid = (tile < ends[-1])[:, None] & (offset < query_lens[owner][:, None])
    prefill = attend(owner, jnp.where(valid, qsl[owner][:, None] + offset, num_tokens), valid)

    out = jnp.zeros((num_tokens + 1, *q.shape[1:]), q.dtype)  # row T collects the tiles' padding rows
    lse = jnp.full((num_tokens + 1, num_q_heads), -jnp.inf, jnp.float32)
    for rows, tile_out, tile_lse in (decode, prefill):
        out = out.at[rows.reshape(-1)].set(tile_out.reshape(-1, *q.shape[1:]), mode="drop")
        lse = lse.at[rows.reshape(-1)].set(tile_lse.reshape(-1, num_q_heads), mode="drop")
    out = out[:num_tokens]
    return (out, kv_cache, lse[:num_tokens]) if return_lse else (out, kv_cache)


def _attend_tiles(
    q, kv_cache, lens, tables, qsl, query_lens, reqs, rows, valid, *,
    chunk, sm_scale, causal, sliding_window, logits_soft_cap, slopes, sinks, k_scale, v_scale,
):  # fmt: skip
    """Attention of tiles: ``rows`` i32[G, Qt] (row T where not ``valid``) of requests
    ``reqs`` i32[G], ``valid`` bool[G, Qt] the real rows; ``qsl`` i32[R + 1] and
    ``query_lens`` i32[R] the batch's. Returns (rows, out f[G, Qt, Hq, D] in q's dtype,
    lse f32[G, Qt, Hq]); rows that see nothing give 0 and -inf."""
    num_tokens, num_q_heads, head_size = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_q_heads // num_kv_heads
    num_tiles, tile_rows = rows.shape
    chunk_len = chunk * block_size

    seq = lens[reqs]  # i32[G]
    # A row's position: a request's new tokens are its last query_len positions.
    pos = jnp.where(valid, seq[:, None] - query_lens[reqs][:, None] + rows - qsl[reqs][:, None], 0)  # i32[G, Qt]
    # The rows of a tile's kv head: its tokens' query heads of that head, token-major (the kernels' packing).
    qt = q[jnp.minimum(rows, num_tokens - 1)].astype(jnp.float32)  # f32[G, Qt, Hq, D]
    qt = qt.reshape(num_tiles, tile_rows, num_kv_heads, group, head_size).transpose(0, 2, 1, 3, 4)
    qt = qt.reshape(num_tiles, num_kv_heads, tile_rows * group, head_size)
    row_pos = jnp.repeat(pos, group, axis=1)[..., None]  # i32[G, rows, 1]
    row_valid = jnp.repeat(valid, group, axis=1)[..., None]  # bool[G, rows, 1]
    row_slopes = None if slopes is None else jnp.tile(slopes.reshape(num_kv_heads, 1, group), (1, tile_rows, 1))
    row_sinks = None if sinks is None else jnp.tile(sinks.reshape(num_kv_heads, 1, group), (1, tile_rows, 1))

    def update(state, q_rows, keys, values, q_pos, ok, kv_pos, kv_len, alibi):
        # One tile and KV head: q_rows f32[rows, D] against a chunk's keys / values f32[cols, D].
        keys, values = common.route_nonfinite_values(keys, values)
        s = jax.lax.dot_general(q_rows, keys, (((1,), (1,)), ((), ())), precision=_HIGHEST)
        s = common.transform_scores(
            s, q_pos, kv_pos, sm_scale=sm_scale, soft_cap=logits_soft_cap,
            alibi_slopes=None if alibi is None else alibi.reshape(-1, 1),
        )  # fmt: skip
        visible = common.visible_mask(q_pos, kv_pos, kv_len, causal=causal, sliding_window=sliding_window, row_valid=ok)
        return common.online_softmax_update(state, s, visible, values, precision=_HIGHEST)

    per_head = jax.vmap(update, in_axes=(0, 0, 0, 0, None, None, None, None, None if slopes is None else 0))
    per_tile = jax.vmap(per_head, in_axes=(0, 0, 0, 0, 0, 0, None, 0, None))

    # The chunks a kind needs: up to its furthest visible key, from its nearest one under a window.
    live = valid.any(axis=1)
    last = jnp.where(valid, pos, -1).max(axis=1)  # i32[G]
    end = jnp.where(live, jnp.minimum(seq, last + 1) if causal else seq, 0)
    stop = -(-end.max() // chunk_len)
    start = 0
    if sliding_window is not None:
        nearest = jnp.where(valid, pos, jnp.iinfo(jnp.int32).max).min(axis=1) - sliding_window + 1
        start = jnp.minimum(jnp.where(live, jnp.maximum(nearest, 0), jnp.iinfo(jnp.int32).max).min() // chunk_len, stop)

    tile_tables = tables[reqs]  # i32[G, width]

    def step(j, state):
        pages = jax.lax.dynamic_slice_in_dim(tile_tables, j * chunk, chunk, axis=1)  # i32[G, chunk]
        keys = dequantize_from_cache(kv_cache[0, pages], k_scale, jnp.float32)  # f32[G, chunk, S, Hkv, D]
        values = dequantize_from_cache(kv_cache[1, pages], v_scale, jnp.float32)
        keys = keys.reshape(num_tiles, chunk_len, num_kv_heads, head_size).transpose(0, 2, 1, 3)
        values = values.reshape(num_tiles, chunk_len, num_kv_heads, head_size).transpose(0, 2, 1, 3)
        kv_pos = (j * chunk_len + jnp.arange(chunk_len, dtype=jnp.int32))[None, :]  # i32[1, cols]
        return per_tile(state, qt, keys, values, row_pos, row_valid, kv_pos, seq, row_slopes)

    rows_per_head = tile_rows * group
    if row_sinks is None:
        m = jnp.full((num_tiles, num_kv_heads, rows_per_head), common.MASK_VALUE, jnp.float32)
        denom = jnp.zeros((num_tiles, num_kv_heads, rows_per_head), jnp.float32)
    else:  # a sink enters as the initial state: m = sink, denom = 1
        m = jnp.broadcast_to(
            row_sinks.reshape(1, num_kv_heads, rows_per_head), (num_tiles, num_kv_heads, rows_per_head)
        )
        denom = jnp.ones((num_tiles, num_kv_heads, rows_per_head), jnp.float32)
    acc = jnp.zeros((num_tiles, num_kv_heads, rows_per_head, head_size), jnp.float32)
    m, denom, acc = jax.lax.fori_loop(start, stop, step, (m, denom, acc))

    o = common.normalize(acc, denom[..., None])  # f32[G, Hkv, rows, D]
    o = o.reshape(num_tiles, num_kv_heads, tile_rows, group, head_size).transpose(0, 2, 1, 3, 4)
    lse = common.log_sum_exp(m, denom).reshape(num_tiles, num_kv_heads, tile_rows, group).transpose(0, 2, 1, 3)
    return (
        rows,
        o.reshape(num_tiles, tile_rows, num_q_heads, head_size).astype(q.dtype),
        lse.reshape(num_tiles, tile_rows, num_q_heads),
    )
