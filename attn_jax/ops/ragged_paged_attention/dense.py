"""Ragged paged attention in pure jnp, fast: each request's pages are gathered once.

The reference gathers a request's whole context for every query token, which is right
for a specification and slow for serving. This path splits the batch in two groups,
each dense per request:

* decode group: every request with exactly one new token. Its pages are gathered once
  (``[R, L, Hkv, D]``) and its single query row attends to them.
* prefill group: the requests listed in ``prefill_reqs`` (every request with more than
  one new token), each padded to ``q_block`` query rows (``[Rp, q_block, Hq, D]``)
  against its pages gathered once (``[Rp, L, Hkv, D]``).

``q_block`` and the length of ``prefill_reqs`` are static, so a jitted step compiles once
per (token bucket, request bucket, pages bucket, Rp, q_block). The XLA backend's
``build_for_jit`` computes them on the host (``dense_schedule``), bucketed to powers of
two. Same parameters, semantics and return value as the reference, which it is tested
against; softmax and accumulation in float32 at ``Precision.HIGHEST``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax.kv_cache import dequantize_from_cache, write_to_kv_cache
from attn_jax.ops.ragged_paged_attention.common import normalize, route_nonfinite_values
from attn_jax.ops.ragged_paged_attention.config import next_pow2
from attn_jax.ops.ragged_paged_attention.validate import (
    dynamic_validate_inputs,
    is_concrete,
    static_validate_inputs,
)

_HIGHEST = jax.lax.Precision.HIGHEST


def dense_schedule(
    query_start_loc, num_reqs: int | None = None, q_block: int | None = None, num_slots: int | None = None
) -> tuple[np.ndarray, int]:
    """Host-side schedule of the prefill group: ``(prefill_reqs, q_block)``.

    Args:
      query_start_loc: i32[R + 1] (NumPy or a concrete array).
      num_reqs: R (default: ``len(query_start_loc) - 1``).
      q_block: the prefill group's rows per request; default the power of two >= the
        longest prefill. A fixed value (e.g. the token bucket) means fewer compilations.
      num_slots: the group's length; default the power of two >= the prefill count. A
        fixed value gives batches with other prefill counts (e.g. a step's data shards)
        one shape.

    Returns ``prefill_reqs`` i32[num_slots], the requests with more than one new token
    padded with R (= none) (num_slots = 0 by default when there are none), and ``q_block``
    (the given one, else 0 when there are no prefills). ValueError if a given q_block or
    num_slots is too small.

    >>> dense_schedule(np.array([0, 1, 6, 7, 10], np.int32))
    (array([1, 3], dtype=int32), 8)
    """
    qsl = np.asarray(query_start_loc)
    num_reqs = qsl.shape[0] - 1 if num_reqs is None else num_reqs
    query_lens = np.diff(qsl)[:num_reqs]
    prefills = np.flatnonzero(query_lens > 1).astype(np.int32)
    if num_slots is None:
        num_slots = next_pow2(prefills.size) if prefills.size else 0
    if num_slots < prefills.size:
        raise ValueError(f"{num_slots=} is less than the {prefills.size} requests with more than one new token")
    padded = np.full(num_slots, num_reqs, np.int32)
    padded[: prefills.size] = prefills
    longest = int(query_lens[prefills].max(initial=0))
    if q_block is None:
        return padded, next_pow2(longest) if prefills.size else 0
    if q_block < longest:
        raise ValueError(f"{q_block=} is less than the longest prefill's query length {longest}")
    return padded, int(q_block)


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
    interpret: bool | None = None,  # accepted for parity with the kernels; pure jnp either way
    prefill_reqs=None,  # i32[Rp] | None: requests with > 1 new token, padded with R
    q_block: int | None = None,  # static: query rows per prefill request, >= its query length
):
    """The reference's op (same arguments, same result) with pages gathered per request.

    ``prefill_reqs`` / ``q_block`` come from ``dense_schedule``; when absent they are
    derived from concrete metadata, or (inside ``jit``) every request is put in the
    prefill group with ``q_block = T``: correct, and as slow as that sounds. A request
    with more than one new token missing from ``prefill_reqs``, or longer than
    ``q_block``, is an error when the metadata is concrete (ValueError naming it).

    Returns (out f[T, Hq, D] in q's dtype, kv_cache); rows past the real tokens are 0.
    """
    del interpret
    static_validate_inputs(
        q, k, v, kv_cache, query_start_loc, seq_lens, block_tables, slot_mapping,
        sm_scale=sm_scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
        alibi_slopes=alibi_slopes, sinks=sinks,
    )  # fmt: skip
    _, num_blocks, block_size, _, _ = kv_cache.shape
    num_reqs = block_tables.shape[0]
    concrete = is_concrete(query_start_loc, seq_lens, block_tables, slot_mapping)
    if concrete:
        dynamic_validate_inputs(
            query_start_loc, seq_lens, block_tables, slot_mapping,
            num_blocks=num_blocks, block_size=block_size, causal=causal,
        )  # fmt: skip
    if prefill_reqs is None:
        if concrete:
            prefill_reqs, q_block = dense_schedule(query_start_loc, num_reqs)
        else:
            prefill_reqs, q_block = jnp.arange(num_reqs, dtype=jnp.int32), q.shape[0]
    elif q_block is None:
        raise ValueError("prefill_reqs was given without q_block: pass both (see dense_schedule)")
    elif concrete and is_concrete(prefill_reqs):
        _check_schedule(np.asarray(query_start_loc), np.asarray(prefill_reqs), q_block, num_reqs)
    if k is not None:
        kv_cache = write_to_kv_cache(kv_cache, k, v, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    if q.shape[0] == 0:  # no rows: an empty result, as the reference gives
        return jnp.zeros_like(q), kv_cache

    qsl = jnp.asarray(query_start_loc, jnp.int32)
    seq_lens = jnp.asarray(seq_lens, jnp.int32)
    pages = jnp.clip(jnp.asarray(block_tables, jnp.int32), 0, num_blocks - 1)
    opts = dict(
        sm_scale=sm_scale, causal=causal, sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        slopes=None if alibi_slopes is None else jnp.asarray(alibi_slopes, jnp.float32),
        sinks=None if sinks is None else jnp.asarray(sinks, jnp.float32),
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    num_tokens = q.shape[0]
    query_lens = qsl[1:] - qsl[:-1]  # i32[R]
    out = jnp.zeros((num_tokens + 1, *q.shape[1:]), q.dtype)  # row T collects dropped rows

    # Decode group: one row per request (row qsl[r]), pages gathered once per request.
    reqs = jnp.arange(num_reqs, dtype=jnp.int32)
    is_decode = query_lens == 1
    rows = jnp.where(is_decode, qsl[:-1], num_tokens)[:, None]  # i32[R, 1]
    o = _attend_requests(q, kv_cache, reqs, rows, is_decode[:, None], seq_lens, pages, **opts)
    out = out.at[rows[:, 0]].set(o[:, 0], mode="drop")

    # Prefill group: q_block rows per listed request.
    prefill_reqs = jnp.asarray(prefill_reqs, jnp.int32)
    if prefill_reqs.shape[0] and q_block:
        listed = prefill_reqs < num_reqs
        reqs = jnp.minimum(prefill_reqs, num_reqs - 1)  # i32[Rp]
        i = jnp.arange(q_block, dtype=jnp.int32)
        valid = listed[:, None] & (query_lens[reqs] > 1)[:, None] & (i[None, :] < query_lens[reqs][:, None])
        rows = jnp.where(valid, qsl[reqs][:, None] + i[None, :], num_tokens)  # i32[Rp, q_block]
        o = _attend_requests(q, kv_cache, reqs, rows, valid, seq_lens, pages, **opts)
        out = out.at[rows.reshape(-1)].set(o.reshape(-1, *q.shape[1:]), mode="drop")
    return out[:num_tokens], kv_cache


def _check_schedule(qsl: np.ndarray, prefill_reqs: np.ndarray, q_block: int, num_reqs: int) -> None:
    query_lens = np.diff(qsl)[:num_reqs]
    listed = set(prefill_reqs[prefill_reqs < num_reqs].tolist())
    for r in np.flatnonzero(query_lens > 1).tolist():
        if r not in listed:
            raise ValueError(
                f"request {r} has query_len={int(query_lens[r])} > 1 but is not in prefill_reqs="
                f"{prefill_reqs.tolist()}; build them with dense_schedule"
            )
        if query_lens[r] > q_block:
            raise ValueError(f"request {r} has query_len={int(query_lens[r])} > {q_block=}")


def _attend_requests(
    q, kv_cache, reqs, rows, valid, seq_lens, pages, *,
    sm_scale, causal, sliding_window, logits_soft_cap, slopes, sinks, k_scale, v_scale,
):  # fmt: skip
    """Attention of ``rows`` (i32[G, Qb]; row T = none) of requests ``reqs`` (i32[G]).

    Returns f[G, Qb, Hq, D] in q's dtype; invalid rows are 0.
    """
    num_tokens, num_q_heads, head_size = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_q_heads // num_kv_heads
    num_groups, q_block = rows.shape
    max_kv_len = pages.shape[1] * block_size

    req_pages = pages[reqs]  # i32[G, pages_per_req]
    keys = dequantize_from_cache(kv_cache[0, req_pages], k_scale, jnp.float32)
    values = dequantize_from_cache(kv_cache[1, req_pages], v_scale, jnp.float32)
    keys = keys.reshape(num_groups, max_kv_len, num_kv_heads, head_size)  # f32[G, L, Hkv, D]
    values = values.reshape(num_groups, max_kv_len, num_kv_heads, head_size)
    # A request's rows share one einsum: a non-finite value moves to its key, where the mask keeps
    # it in exactly the rows that see it (unused slots' NaN included: they are never visible).
    keys, values = route_nonfinite_values(keys, values)

    seq = seq_lens[reqs]  # i32[G]
    # Position of each row: the request's query rows are its last query_len positions.
    first_row = rows[:, :1]
    qlen = jnp.sum(valid, axis=1, keepdims=True).astype(jnp.int32)
    pos = seq[:, None] - qlen + (rows - first_row)  # i32[G, Qb]
    j = jnp.arange(max_kv_len, dtype=jnp.int32)
    visible = valid[:, :, None] & (j[None, None, :] < seq[:, None, None])  # bool[G, Qb, L]
    if causal:
        visible &= j[None, None, :] <= pos[:, :, None]
    if sliding_window is not None:
        visible &= j[None, None, :] > pos[:, :, None] - sliding_window

    qg = q[jnp.minimum(rows, num_tokens - 1)].astype(jnp.float32)  # f32[G, Qb, Hq, D]
    qg = qg.reshape(num_groups, q_block, num_kv_heads, group, head_size)
    s = jnp.einsum("bqkgd,blkd->bkgql", qg, keys, precision=_HIGHEST) * sm_scale  # f32[G, Hkv, g, Qb, L]
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    if slopes is not None:
        rel = (j[None, None, :] - pos[:, :, None]).astype(jnp.float32)  # f32[G, Qb, L]
        s = s + slopes.reshape(num_kv_heads, group)[None, :, :, None, None] * rel[:, None, None]
    mask = visible[:, None, None]  # bool[G, 1, 1, Qb, L]
    s = jnp.where(mask, s, -jnp.inf)

    m = jnp.max(s, axis=-1)  # f32[G, Hkv, g, Qb]
    if sinks is not None:
        sink = sinks.reshape(num_kv_heads, group)[None, :, :, None]
        m = jnp.maximum(m, sink)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    weights = jnp.exp(s - m[..., None])  # exactly 0 where masked
    denom = jnp.sum(weights, axis=-1)
    if sinks is not None:
        denom = denom + jnp.exp(sink - m)
    o = jnp.einsum("bkgql,blkd->bqkgd", weights, values, precision=_HIGHEST)  # f32[G, Qb, Hkv, g, D]
    denom = jnp.moveaxis(denom, -1, 1)[..., None]  # f32[G, Qb, Hkv, g, 1]
    o = normalize(o, denom)
    return o.reshape(num_groups, q_block, num_q_heads, head_size).astype(q.dtype)
