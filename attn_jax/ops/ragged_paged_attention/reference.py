"""Ragged paged attention in pure jnp: the specification every kernel is tested against.

Written for clarity, not speed: every query token gathers its request's pages and
attends over them with explicit masks. Tokens are processed in chunks with
``jax.lax.map`` so memory stays bounded; there is no Python loop over requests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax.kv_cache import dequantize_from_cache, write_to_kv_cache
from attn_jax.ops.ragged_paged_attention.common import FP8_P_SCALE, normalize, quantize_fp8
from attn_jax.ops.ragged_paged_attention.validate import validate_inputs

# Elements of gathered k/v (per token chunk) the reference materialises at once.
_GATHER_BUDGET = 1 << 24


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
    q_scale=None,  # f32[] | None: FP8 attention (an e4m3 cache): q enters the dots as e4m3 q / q_scale
):
    """Writes new k/v into the paged cache, then attends. Returns (out, kv_cache), or
    (out, kv_cache, lse) with ``return_lse``: lse f32[T, Hq] is the natural log of each
    row's softmax denominator (its sink included), -inf for a row that sees nothing, the
    statistic ``merge_attn_states`` combines partial attentions by.

    Request r owns q rows ``query_start_loc[r]:query_start_loc[r+1]``; its context is
    ``seq_lens[r]`` tokens, of which the last ``query_len[r]`` are the new ones, so the
    i-th new token sits at position ``p = seq_lens[r] - query_len[r] + i``. It attends
    to cached positions ``j < seq_lens[r]`` with ``j <= p`` when ``causal`` and
    ``j > p - sliding_window`` when a window is set. Scores are
    ``sm_scale * q.k``, then ``c * tanh(s / c)`` (soft cap ``c``), plus
    ``alibi_slopes[h] * (j - p)``. A sink is a raw logit per query head that joins the
    softmax denominator only. Query head h reads kv head ``h // (Hq // Hkv)``.

    Rows past ``query_start_loc[-1]`` and rows that see no key are padding: their
    output is finite (zero). Unused cache slots (NaN included) never reach an output;
    NaN or inf in a request's own q, k or v reaches exactly the rows that see it.
    Softmax and accumulation run in float32; ``out`` has q's dtype and shape.

    FP8 attention (``q_scale`` given; the cache must be float8_e4m3fn): q is quantised per
    tensor to e4m3 (``q / q_scale``, saturating), ``q.k`` is an e4m3 x e4m3 dot accumulated in
    float32 and scaled by ``q_scale * k_scale``, and the softmax weights are quantised to
    e4m3 as ``p * FP8_P_SCALE`` for the ``p @ v`` dot (float32 accumulation, the denominator
    from the float32 weights), as FlashAttention-3's FP8 path does; ``out`` keeps q's dtype.

    Example::

        out, kv_cache = ragged_paged_attention(
            q, k, v, kv_cache, query_start_loc, seq_lens, block_tables, slot_mapping,
            sm_scale=head_size**-0.5)
    """
    validate_inputs(
        q, k, v, kv_cache, query_start_loc, seq_lens, block_tables, slot_mapping, sm_scale=sm_scale, causal=causal,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, sinks=sinks,
        q_scale=q_scale,
    )  # fmt: skip
    if k is not None:
        kv_cache = write_to_kv_cache(kv_cache, k, v, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    out, lse = _attend(
        q, kv_cache, jnp.asarray(query_start_loc), jnp.asarray(seq_lens), jnp.asarray(block_tables),
        sm_scale=sm_scale, causal=causal, sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, sinks=sinks,
        k_scale=k_scale, v_scale=v_scale, q_scale=q_scale,
    )  # fmt: skip
    return (out, kv_cache, lse) if return_lse else (out, kv_cache)


def _attend(
    q, kv_cache, query_start_loc, seq_lens, block_tables, *,
    sm_scale, causal, sliding_window, logits_soft_cap, alibi_slopes, sinks, k_scale, v_scale, q_scale=None,
):  # fmt: skip
    num_tokens, num_q_heads, head_size = q.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    num_reqs, pages_per_req = block_tables.shape
    group = num_q_heads // num_kv_heads
    max_kv_len = pages_per_req * block_size

    # Which request each q row belongs to, and its absolute position in that request.
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    req = jnp.searchsorted(query_start_loc[1:], rows, side="right").astype(jnp.int32)  # i32[T]
    is_real_row = req < num_reqs
    req = jnp.minimum(req, num_reqs - 1)
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    pos = seq_lens[req] - query_lens[req] + (rows - query_start_loc[req])  # i32[T]

    pages = jnp.clip(block_tables, 0, num_blocks - 1)  # unused entries may hold anything
    slopes = None if alibi_slopes is None else jnp.asarray(alibi_slopes, jnp.float32)
    sink_logits = None if sinks is None else jnp.asarray(sinks, jnp.float32)
    fp8 = q_scale is not None
    if fp8:  # the dots see the e4m3 entries; the scales multiply their f32 results
        s_scale = sm_scale * _scale(q_scale) * _scale(k_scale)
        o_scale = _scale(v_scale) / FP8_P_SCALE
    out_dtype = q.dtype
    if fp8:
        q = quantize_fp8(q, 1.0 / _scale(q_scale))  # e4m3[T, Hq, D]

    def one_row(args):
        q_row, r, p, real = args  # f[Hq, D], i32[], i32[], bool[]
        keys = dequantize_from_cache(kv_cache[0, pages[r]], None if fp8 else k_scale, jnp.float32)
        values = dequantize_from_cache(kv_cache[1, pages[r]], None if fp8 else v_scale, jnp.float32)
        keys = keys.reshape(max_kv_len, num_kv_heads, head_size)  # f32[L, Hkv, D]
        values = values.reshape(max_kv_len, num_kv_heads, head_size)

        j = jnp.arange(max_kv_len, dtype=jnp.int32)
        visible = real & (j < seq_lens[r])  # bool[L]
        if causal:
            visible &= j <= p
        if sliding_window is not None:
            visible &= j > p - sliding_window

        qg = q_row.astype(jnp.float32).reshape(num_kv_heads, group, head_size)
        s = jnp.einsum("kgd,lkd->kgl", qg, keys, precision=jax.lax.Precision.HIGHEST)
        s = s.reshape(num_q_heads, max_kv_len) * (s_scale if fp8 else sm_scale)  # f32[Hq, L]
        if logits_soft_cap is not None:
            s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
        if slopes is not None:
            s = s + slopes[:, None] * (j - p).astype(jnp.float32)[None, :]
        s = jnp.where(visible[None, :], s, -jnp.inf)

        m = jnp.max(s, axis=-1)  # f32[Hq]
        if sink_logits is not None:
            m = jnp.maximum(m, sink_logits)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        weights = jnp.exp(s - m[:, None])  # exactly 0 where masked
        denom = jnp.sum(weights, axis=-1)
        if sink_logits is not None:
            denom = denom + jnp.exp(sink_logits - m)
        values = jnp.where(visible[:, None, None], values, 0.0)  # masked NaNs must not leak
        wg = weights.reshape(num_kv_heads, group, max_kv_len)
        if fp8:  # e4m3 weights, scaled into e4m3's normal range (exact: 0 stays 0)
            wg = quantize_fp8(wg, FP8_P_SCALE).astype(jnp.float32)
        o = jnp.einsum("kgl,lkd->kgd", wg, values, precision=jax.lax.Precision.HIGHEST)
        o = o.reshape(num_q_heads, head_size)
        if fp8:
            o = o * o_scale
        o = normalize(o, denom[:, None])  # NaN from a visible q, k or v stays NaN
        lse = jnp.where(denom > 0, m + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
        return o.astype(out_dtype), lse

    per_row = 2 * max_kv_len * num_kv_heads * head_size
    batch = int(np.clip(_GATHER_BUDGET // max(per_row, 1), 1, max(num_tokens, 1)))
    return jax.lax.map(one_row, (q, req, pos, is_real_row), batch_size=batch)


def _scale(scale):
    """A per-tensor scale (None = 1.0) as f32[]."""
    return jnp.float32(1.0) if scale is None else jnp.asarray(scale, jnp.float32).reshape(())
