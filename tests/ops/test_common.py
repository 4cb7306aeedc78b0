"""Unit tests of the per-tile math both kernels share (common.py) against NumPy."""

from __future__ import annotations

import numpy as np
import pytest

from attn_jax.ops.ragged_paged_attention import common


def _softmax_with_sink(s: np.ndarray, visible: np.ndarray, sinks: np.ndarray | None) -> np.ndarray:
    """f64[rows, cols] weights exp(s) / (sum visible exp(s) + exp(sink)); 0 where not visible."""
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=1, initial=-np.inf)
    if sinks is not None:
        m = np.maximum(m, sinks)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(visible, np.exp(s - m[:, None]), 0.0)
    denom = e.sum(axis=1) + (np.exp(sinks - m) if sinks is not None else 0.0)
    return np.divide(e, denom[:, None], out=np.zeros_like(e), where=denom[:, None] > 0)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 3])
def test_visible_mask_matches_definition(causal, window):
    q_pos = np.array([[0], [4], [7], [9], [-2], [3]], np.int32)  # -2: more queries than keys
    row_valid = np.array([[True]] * 5 + [[False]])  # the last row is padding
    kv_pos = np.arange(12, dtype=np.int32)[None, :]
    got = np.asarray(common.visible_mask(q_pos, kv_pos, 8, causal=causal, sliding_window=window, row_valid=row_valid))
    for r, p in enumerate(q_pos[:, 0]):
        for j in range(12):
            want = row_valid[r, 0] and j < 8 and (not causal or j <= p) and (window is None or j > p - window)
            assert got[r, j] == want, (p, j)


def test_transform_scores_soft_cap_and_alibi():
    s = np.array([[1.0, -30.0, 60.0]], np.float32)
    q_pos, kv_pos = np.array([[5]]), np.array([[3, 4, 5]])
    slopes = np.array([[0.5]], np.float32)
    got = np.asarray(common.transform_scores(s, q_pos, kv_pos, sm_scale=0.5, soft_cap=10.0, alibi_slopes=slopes))
    want = 10.0 * np.tanh(s * 0.5 / 10.0) + 0.5 * (kv_pos - q_pos)
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_online_softmax_over_tiles_equals_one_softmax(with_sinks):
    """Folding tiles one at a time (NaN in masked slots) gives the full softmax; rows with
    no visible key give 0 (or 0 with a sink: the sink has no value)."""
    rng = np.random.default_rng(0)
    rows, cols, d, tile = 6, 24, 8, 8
    s = rng.normal(scale=4.0, size=(rows, cols)).astype(np.float32)
    v = rng.normal(size=(cols, d)).astype(np.float32)
    visible = rng.random((rows, cols)) < 0.6
    visible[2] = False  # a row that sees nothing
    visible[3, :tile] = False  # a row whose first tile is empty
    s_nan = np.where(visible, s, np.nan)
    v_nan = v.copy()
    sinks = rng.normal(size=rows).astype(np.float32) if with_sinks else None

    state = common.init_softmax_state(rows, d, sinks=sinks)
    for t in range(0, cols, tile):
        state = common.online_softmax_update(
            state, s_nan[:, t : t + tile], visible[:, t : t + tile], v_nan[t : t + tile]
        )
    got = np.asarray(common.finalize_softmax_state(state))
    want = _softmax_with_sink(s.astype(np.float64), visible, sinks) @ v.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_merge_softmax_states_equals_unsplit():
    rng = np.random.default_rng(1)
    rows, cols, d = 4, 32, 8
    s = rng.normal(scale=3.0, size=(rows, cols)).astype(np.float32)
    v = rng.normal(size=(cols, d)).astype(np.float32)
    visible = rng.random((rows, cols)) < 0.5
    visible[:, 16:] &= np.arange(rows)[:, None] != 1  # row 1 sees nothing in the second split
    parts = []
    for lo in (0, 16):
        st = common.init_softmax_state(rows, d)
        parts.append(common.online_softmax_update(st, s[:, lo : lo + 16], visible[:, lo : lo + 16], v[lo : lo + 16]))
    m, denom, acc = (np.stack([np.asarray(p[i]) for p in parts]) for i in range(3))
    merged = common.finalize_softmax_state(common.merge_softmax_states(m, denom, acc))
    want = _softmax_with_sink(s.astype(np.float64), visible, None) @ v
    np.testing.assert_allclose(np.asarray(merged), want, rtol=1e-5, atol=1e-6)


def test_dequantize_scales_fp8():
    import ml_dtypes

    x = np.array([1.0, -2.0, 0.5], ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(common.dequantize(x, 3.0)), [3.0, -6.0, 1.5])
    np.testing.assert_array_equal(np.asarray(common.dequantize(x, None)), [1.0, -2.0, 0.5])
