"""Per-tile math shared by the Pallas kernels: masks, score transforms, online softmax.

Every function here is a pure function of jnp values (no refs, no Pallas primitives), so
the same code lowers through Triton (``pallas_triton.py``), Mosaic TPU (``pallas_mosaic_tpu.py``)
and runs eagerly in unit tests. A kernel tile is ``rows`` query rows (query tokens times
the query heads of one KV head, packed) against ``cols`` cached key positions.

The online softmax keeps, per row, the running maximum ``m``, the running denominator
``denom`` and the unnormalised accumulator ``acc``::

    state = init_softmax_state(rows, head_size, sinks=sinks_per_row)
    for each KV tile:
        s = transform_scores(dot(q, k.T), q_pos, kv_pos, sm_scale=..., soft_cap=..., alibi=...)
        state = online_softmax_update(state, s, visible_mask(...), v)
    out = finalize_softmax_state(state)

A sink (one raw logit per query head) enters as the initial state ``m = sink, denom = 1``:
it joins the denominator and contributes nothing to the numerator, exactly as
``p_j = exp(s_j) / (sum_i exp(s_i) + exp(sink))``.

Non-finite values: NaN or inf in a request's own q, k or v reach exactly the output rows
that can see them (DESIGN.md), as non-finite values (NaN where torch SDPA may give inf);
whatever a row cannot see never reaches it. Masks are applied with ``where`` (never by
multiplying), and ``route_nonfinite_values`` keeps ``p @ v`` from carrying ``0 * NaN``
from a value no row of the tile sees to the rows that do not see it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
"""Finite stand-in for -inf: the running max starts here, so exp(m_old - m_new) never sees inf - inf."""


def dequantize(x, scale, dtype=jnp.float32):
    """Cache tile to compute dtype: ``x * scale`` for fp8 caches (scale a scalar), a cast otherwise."""
    x = x.astype(dtype)
    if scale is None:
        return x
    return x * jnp.asarray(scale, jnp.float32).astype(dtype)


FP8_P_SCALE = 256.0
"""FP8 attention's probability scale: the softmax weights ``p`` in [0, 1] are quantised as
``p * FP8_P_SCALE`` to e4m3 for the ``p @ v`` dot and the product divided by it again.

FlashAttention-3's FP8 choice (its softmax ``Max_offset = 8``: ``exp2(s - max + 8)`` in [0, 256]): a
power of two (exact in every format), below e4m3's largest finite value 448, so no weight
saturates, that moves the small weights off e4m3's subnormals (below 2**-6), where a bare cast
would round them to a few levels or to 0. The denominator is summed from the float32 weights."""

FP8_DTYPE = jnp.float8_e4m3fn
"""The operand dtype of FP8 attention's dots: the query, the cache and the softmax weights."""


def quantize_fp8(x, inv_scale):
    """``x * inv_scale`` (``inv_scale`` = 1 / the per-tensor scale) rounded to e4m3, clipped to
    its finite range (+-448: an overflow saturates; NaN stays NaN). ``x`` of any float dtype."""
    limit = float(jnp.finfo(FP8_DTYPE).max)
    scaled = x.astype(jnp.float32) * inv_scale
    # Two wheres, not jnp.clip: Triton lowers min/max to minnum/maxnum, which drop a NaN.
    scaled = jnp.where(scaled > limit, limit, jnp.where(scaled < -limit, -limit, scaled))
    return scaled.astype(FP8_DTYPE)


def visible_mask(q_pos, kv_pos, kv_len, *, causal: bool, sliding_window: int | None, row_valid=None):
    """bool[rows, cols]: which cached positions each query row may attend to.

    q_pos i32[rows, 1]: absolute position of each query row in its request (negative is
    legal for cross-attention with more queries than keys); kv_pos i32[1, cols]: cached
    positions; kv_len: the request's context length (scalar or i32[rows, 1]); row_valid
    bool[rows, 1] or None: False marks padding rows, which see nothing. Positions
    ``j >= kv_len`` are never visible, so whatever unused slots hold cannot reach an output.
    """
    visible = kv_pos < kv_len
    if row_valid is not None:
        visible = visible & row_valid
    if causal:
        visible = visible & (kv_pos <= q_pos)
    if sliding_window is not None:
        visible = visible & (kv_pos > q_pos - sliding_window)
    return visible


def transform_scores(s, q_pos, kv_pos, *, sm_scale: float, soft_cap: float | None, alibi_slopes=None):
    """f32[rows, cols] raw ``q.k`` to logits: scale, soft cap ``c*tanh(s/c)``, ALiBi ``slope*(j-p)``.

    alibi_slopes: f32[rows, 1] (the slope of each row's query head) or None.
    """
    s = s * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    if alibi_slopes is not None:
        s = s + alibi_slopes * (kv_pos - q_pos).astype(jnp.float32)
    return s


def init_softmax_state(rows: int, head_size: int, sinks=None, *, column: bool = False):
    """(m f32[rows], denom f32[rows], acc f32[rows, head_size]) before any key; sinks f32[rows] or None.

    ``column=True`` keeps m and denom as f32[rows, 1] column vectors (sinks f32[rows, 1]):
    the TPU kernel's choice, since Mosaic lays out 2-D row statistics natively. Every
    function below accepts either shape and keeps it.
    """
    shape = (rows, 1) if column else (rows,)
    acc = jnp.zeros((rows, head_size), jnp.float32)
    if sinks is None:
        return jnp.full(shape, MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32), acc
    return sinks.astype(jnp.float32).reshape(shape), jnp.ones(shape, jnp.float32), acc


def _col(x):
    """A per-row statistic as a column f32[rows, 1], whether it is f32[rows] or already one."""
    return x if x.ndim == 2 else x[:, None]


def softmax_tile_update(m, denom, s, visible):
    """One tile's softmax bookkeeping: returns (m_new f32[rows], denom_new, alpha f32[rows], p f32[rows, cols]).

    ``alpha`` rescales the old accumulator and ``p`` are the tile's unnormalised weights
    (exactly 0 where not visible, whatever ``s`` holds there, NaN included). ``visible=None``
    means every entry is visible (a tile inside every row's range: no mask to apply).
    """
    if visible is not None:
        s = jnp.where(visible, s, MASK_VALUE)
    keepdims = m.ndim == 2  # column statistics stay columns
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=keepdims))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - _col(m_new))
    if visible is not None:
        p = jnp.where(visible, p, 0.0)
    denom_new = alpha * denom + jnp.sum(p, axis=1, keepdims=keepdims)
    return m_new, denom_new, alpha, p


def route_nonfinite_values(k, v):
    """(k, v) of one tile with every non-finite value entry moved to its key: ``k`` becomes
    NaN in that entry's place, ``v`` 0.

    ``p @ v`` gives ``0 * NaN = NaN`` in rows whose weight for that key is 0 (rows that do
    not see it), so a masked tile must not hold non-finite values. A NaN key instead makes
    that key's score NaN in every row, and the visibility mask (a ``where``) keeps it in
    exactly the rows that see the key, whose output becomes NaN. Elementwise (``v - v`` is
    0 or NaN), so it lowers on Triton and Mosaic alike; k and v may be the same array.
    """
    poison = v - v  # 0 where v is finite, NaN where it is NaN or +-inf
    return k + poison.astype(k.dtype), jnp.where(poison == 0, v, jnp.zeros_like(v))


def online_softmax_update(state, s, visible, v, *, precision=None, p_scale=None):
    """Folds one KV tile into the running state.

    state: (m, denom, acc) as from ``init_softmax_state``; s f32[rows, cols] logits;
    visible bool[rows, cols] or None (all visible); v [cols, head_size] in the matmul dtype (rows of v that are
    not visible to any row must be finite: mask or zero them when loading; with ``visible``
    given, non-finite entries must have gone through ``route_nonfinite_values``).
    ``p_scale`` (FP8 attention, ``FP8_P_SCALE``): the weights enter the dot as ``p * p_scale``
    in v's dtype, so ``acc`` holds ``p_scale`` times the sum; the caller divides it out.
    """
    m, denom, acc = state
    m_new, denom_new, alpha, p = softmax_tile_update(m, denom, s, visible)
    if p_scale is not None:
        p = p * p_scale
    pv = jax.lax.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
    return m_new, denom_new, acc * _col(alpha) + pv


def normalize(acc, denom):
    """``acc / denom`` with ``denom`` broadcast against ``acc``: rows that saw no key
    (denom == 0) give 0; a NaN denominator (a row that saw a non-finite value) gives NaN."""
    empty = denom == 0
    return jnp.where(empty, 0.0, acc / jnp.where(empty, 1.0, denom))


def finalize_softmax_state(state):
    """f32[rows, head_size] ``acc / denom``; rows that saw no key (denom == 0) give 0,
    rows that saw a non-finite score or value give NaN."""
    _, denom, acc = state
    return normalize(acc, _col(denom))


def log_sum_exp(m, denom):
    """f32 like ``m``: the log of a softmax denominator from its running state (max ``m``,
    ``denom`` scaled by ``exp(-m)``), ``m + log(denom)``; -inf where nothing was seen (denom 0)."""
    seen = denom > 0
    return jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), -jnp.inf)


def fold_softmax_state(state, other):
    """Two states over disjoint keys as one: ``merge_softmax_states`` of two, without stacking
    (which the Triton lowering has not). state, other: (m f32[rows], denom f32[rows], acc
    f32[rows, head_size])."""
    (m, denom, acc), (m_o, denom_o, acc_o) = state, other
    m_new = jnp.maximum(m, m_o)
    w, w_o = jnp.exp(m - m_new), jnp.exp(m_o - m_new)
    return m_new, denom * w + denom_o * w_o, acc * _col(w) + acc_o * _col(w_o)


def merge_softmax_states(m, denom, acc):
    """Combines split-KV partial states along axis 0 (flash-decoding's reduce).

    m, denom f32[splits, ...]; acc f32[splits, ..., head_size]. Returns the merged
    (m, denom, acc) with the split axis removed; splits that saw nothing carry
    ``m = MASK_VALUE, denom = 0`` and drop out. A sink must be folded into exactly one split.
    """
    m_all = jnp.max(m, axis=0)
    weight = jnp.exp(m - m_all[None])
    return m_all, jnp.sum(weight * denom, axis=0), jnp.sum(weight[..., None] * acc, axis=0)
