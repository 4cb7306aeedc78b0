"""The dense per-request op (the XLA backend's serving path) against the float64 oracle
and the reference, and the XLA backend's ``build_for_jit`` that selects it."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from attn_jax import Attention, build_common_attn_metadata
from attn_jax.backends import xla
from attn_jax.ops.ragged_paged_attention import dense, reference
from attn_jax.testing.workloads import make_ragged_batch
from tests.ops.ragged_checks import (
    NONFINITE_BATCH,
    check,
    check_nonfinite_output,
    make_options,
    run_op,
    with_nonfinite_entries,
)

CASES = {
    "decode": ([1, 1, 1], [9, 30, 2]),
    "prefill": ([5, 12, 3], [0, 0, 0]),
    "mixed": ([1, 7, 1, 0, 4], [9, 3, 0, 0, 17]),
    "q_len_eq_kv_len": ([6, 9], [0, 0]),
}


FEATURES = {
    "window": dict(sliding_window=5),
    "softcap": dict(logits_soft_cap=4.0),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
}
COMBOS = [(case, "plain", True) for case in CASES]
COMBOS += [("mixed", feature, True) for feature in FEATURES]
COMBOS += [("prefill", "bidirectional", True), ("mixed", "plain", False)]


@pytest.mark.parametrize(("case", "feature", "use_jit"), COMBOS, ids=lambda x: str(x))
def test_dense_matches_oracle(case, feature, use_jit):
    query_lens, context_lens = CASES[case]
    features = dict(causal=False) if feature == "bidirectional" else FEATURES.get(feature, {})
    batch = make_ragged_batch(
        0, query_lens, context_lens, num_q_heads=6, num_kv_heads=2, head_size=16, block_size=4,
        num_tokens=sum(query_lens) + 5, extra_blocks=3, num_padding_requests=1,
    )  # fmt: skip
    check(batch, make_options(batch, **features), use_jit, op=dense.ragged_paged_attention)


@pytest.mark.parametrize("window", [None, 4])
def test_dense_nonfinite_inputs_reach_exactly_the_rows_that_see_them(window):
    """A request's rows share one einsum: a value's NaN must not reach its earlier rows (0 * NaN)."""
    batch = with_nonfinite_entries(make_ragged_batch(0, **NONFINITE_BATCH))
    options = make_options(batch, sliding_window=window)
    out, _ = run_op(batch, options, use_jit=True, op=dense.ragged_paged_attention)
    check_nonfinite_output(batch, options, out)


@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_dense_matches_reference_on_other_caches(cache_dtype):
    batch = make_ragged_batch(
        1, [1, 6, 1], [20, 5, 3], num_q_heads=4, num_kv_heads=4, head_size=32, block_size=8,
        cache_dtype_str=cache_dtype, num_tokens=16,
    )  # fmt: skip
    options = make_options(batch)
    want, want_cache = reference.ragged_paged_attention(*batch.op_args, **options, **batch.op_kwargs)
    got, got_cache = dense.ragged_paged_attention(*batch.op_args, **options, **batch.op_kwargs)
    n = batch.num_actual_tokens
    np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(want)[:n], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got_cache, np.float32), np.asarray(want_cache, np.float32))


def test_zero_tokens_give_an_empty_result_as_the_reference_does():
    batch = make_ragged_batch(0, [0, 0], [3, 0], num_q_heads=4, num_kv_heads=2, head_size=16, block_size=4)
    want, want_cache = reference.ragged_paged_attention(*batch.op_args, sm_scale=0.25)
    got, got_cache = dense.ragged_paged_attention(*batch.op_args, sm_scale=0.25)
    assert got.shape == want.shape == batch.q.shape == (0, 4, 16)
    np.testing.assert_array_equal(np.asarray(got_cache), np.asarray(want_cache))


def test_schedule_buckets_and_errors():
    qsl = np.array([0, 1, 6, 7, 10], np.int32)
    reqs, q_block = dense.dense_schedule(qsl)
    assert reqs.tolist() == [1, 3] and q_block == 8
    assert dense.dense_schedule(qsl, q_block=16)[1] == 16
    assert dense.dense_schedule(np.array([0, 1, 2], np.int32)) == (pytest.approx(np.zeros(0)), 0)
    with pytest.raises(ValueError, match="q_block=4 is less than the longest prefill's query length 5"):
        dense.dense_schedule(qsl, q_block=4)
    reqs, q_block = dense.dense_schedule(qsl, q_block=16, num_slots=4)  # a step's fixed width
    assert reqs.tolist() == [1, 3, 4, 4] and q_block == 16
    reqs, q_block = dense.dense_schedule(np.array([0, 1, 2], np.int32), q_block=16, num_slots=2)  # an idle shard
    assert reqs.tolist() == [2, 2] and q_block == 16
    with pytest.raises(ValueError, match="num_slots=1 is less than the 2 requests with more than one new token"):
        dense.dense_schedule(qsl, num_slots=1)
    batch = make_ragged_batch(0, [1, 5], [3, 0], num_q_heads=2, num_kv_heads=1, head_size=8, block_size=4)
    kwargs = dict(sm_scale=0.3)
    with pytest.raises(ValueError, match=r"request 1 has query_len=5 > 1 but is not in prefill_reqs=\[2\]"):
        dense.ragged_paged_attention(*batch.op_args, **kwargs, prefill_reqs=np.array([2], np.int32), q_block=8)
    with pytest.raises(ValueError, match="request 1 has query_len=5 > q_block=4"):
        dense.ragged_paged_attention(*batch.op_args, **kwargs, prefill_reqs=np.array([1], np.int32), q_block=4)
    with pytest.raises(ValueError, match="prefill_reqs was given without q_block"):
        dense.ragged_paged_attention(*batch.op_args, **kwargs, prefill_reqs=np.array([1], np.int32))


def test_xla_build_for_jit_takes_the_dense_path_with_the_same_result(monkeypatch):
    layer = Attention(num_heads=8, head_size=16, scale=0.25, num_kv_heads=2, block_size=4)
    md = build_common_attn_metadata([1, 5, 0], [11, 5, 0], [[3, 7, 9], [4, 1, 0], [0, 0, 0]], block_size=4)
    small = layer.metadata_builder.build_for_jit(md)  # a small group: the whole bucket, one shape per bucket
    assert small.q_block == md.num_tokens and small.prefill_reqs.tolist() == [1] + [md.num_reqs] * (md.num_reqs - 1)
    monkeypatch.setattr(xla, "FIXED_PREFILL_SCORES", 0)
    fast = layer.metadata_builder.build_for_jit(md)  # powers of two >= the prefill count and longest prefill
    assert fast.q_block == 8 and fast.prefill_reqs.tolist() == [1]
    step_wide = layer.metadata_builder.build_for_jit(md, step_query_lens=np.array([1, 5, 3, 9, 2]))
    assert step_wide.q_block == 16 and step_wide.prefill_reqs.tolist() == [1] + [md.num_reqs] * 3
    assert layer.metadata_builder.build(0, md).q_block is None  # build keeps the reference path
    rng = np.random.default_rng(0)
    q = rng.standard_normal((md.num_tokens, 8 * 16), dtype=np.float32)
    k = rng.standard_normal((md.num_tokens, 2 * 16), dtype=np.float32)
    cache = layer.init_kv_cache(12)
    step = jax.jit(layer.__call__)
    want, want_cache = step(q, k, k, cache, md)
    got, got_cache = step(q, k, k, cache, fast)
    n = md.num_actual_tokens
    np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(want)[:n], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got_cache), np.asarray(want_cache))
    with pytest.raises(ValueError, match="build_for_jit computes the dense path's schedule on the host"):
        jax.jit(layer.metadata_builder.build_for_jit)(md)
