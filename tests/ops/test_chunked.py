"""The chunked op (the XLA backend's serving path: fixed shapes, an online softmax over KV
chunks) against the float64 oracle and the reference."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.ops.ragged_paged_attention import chunked, reference
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

# Small tiles and chunks, so a request spans several of each (prefill tiles of 4 rows, KV chunks of 2 pages).
SMALL = functools.partial(chunked.ragged_paged_attention, q_tile=4, kv_chunk_pages=2)


@pytest.mark.parametrize(("case", "feature", "use_jit"), COMBOS, ids=lambda x: str(x))
def test_chunked_matches_oracle(case, feature, use_jit):
    query_lens, context_lens = CASES[case]
    features = dict(causal=False) if feature == "bidirectional" else FEATURES.get(feature, {})
    batch = make_ragged_batch(
        0, query_lens, context_lens, num_q_heads=6, num_kv_heads=2, head_size=16, block_size=4,
        num_tokens=sum(query_lens) + 5, extra_blocks=3, num_padding_requests=1,
    )  # fmt: skip
    check(batch, make_options(batch, **features), use_jit, op=SMALL)


def test_default_tiles_match_the_oracle():
    """The defaults: one prefill tile and one KV chunk cover these requests."""
    batch = make_ragged_batch(
        1, [1, 7, 1, 0, 4], [9, 3, 0, 0, 17], num_q_heads=6, num_kv_heads=2, head_size=16, block_size=4,
        num_tokens=24, num_padding_requests=1,
    )  # fmt: skip
    check(batch, make_options(batch, sinks=True), True, op=chunked.ragged_paged_attention)


@pytest.mark.parametrize("window", [None, 4])
def test_chunked_nonfinite_inputs_reach_exactly_the_rows_that_see_them(window):
    """A tile's rows share one dot: a value's NaN must not reach the rows that do not see it (0 * NaN)."""
    batch = with_nonfinite_entries(make_ragged_batch(0, **NONFINITE_BATCH))
    options = make_options(batch, sliding_window=window)
    out, _ = run_op(batch, options, use_jit=True, op=SMALL)
    check_nonfinite_output(batch, options, out)


@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_chunked_matches_reference_on_other_caches(cache_dtype):
    batch = make_ragged_batch(
        1, [1, 6, 1], [20, 5, 3], num_q_heads=4, num_kv_heads=4, head_size=32, block_size=8,
        cache_dtype_str=cache_dtype, num_tokens=16,
    )  # fmt: skip
    options = make_options(batch)
    want, want_cache = reference.ragged_paged_attention(*batch.op_args, **options, **batch.op_kwargs)
    got, got_cache = SMALL(*batch.op_args, **options, **batch.op_kwargs)
    n = batch.num_actual_tokens
    np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(want)[:n], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got_cache, np.float32), np.asarray(want_cache, np.float32))


@pytest.mark.parametrize("sinks", [False, True])
def test_log_sum_exp_matches_the_reference(sinks):
    """``return_lse`` (cascade attention's merge statistic); padding rows get -inf."""
    batch = make_ragged_batch(
        2, [1, 5, 0, 3], [7, 0, 4, 9], num_q_heads=4, num_kv_heads=2, head_size=16, block_size=4,
        num_tokens=12, num_padding_requests=1,
    )  # fmt: skip
    options = make_options(batch, sinks=sinks, logits_soft_cap=3.0)
    want = reference.ragged_paged_attention(*batch.op_args, **options, **batch.op_kwargs, return_lse=True)
    static = {name: options.pop(name) for name in ("sm_scale", "causal", "sliding_window", "logits_soft_cap")}
    got = jax.jit(functools.partial(SMALL, return_lse=True, **static))(*batch.op_args, **options, **batch.op_kwargs)
    n = batch.num_actual_tokens
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[2])[:n], np.asarray(want[2])[:n], rtol=1e-5, atol=1e-5)
    assert np.isneginf(np.asarray(got[2])[n:]).all()  # padding rows (the reference gives them the sink)


def test_zero_tokens_give_an_empty_result_as_the_reference_does():
    batch = make_ragged_batch(0, [0, 0], [3, 0], num_q_heads=4, num_kv_heads=2, head_size=16, block_size=4)
    want, want_cache = reference.ragged_paged_attention(*batch.op_args, sm_scale=0.25)
    got, got_cache = chunked.ragged_paged_attention(*batch.op_args, sm_scale=0.25)
    assert got.shape == want.shape == batch.q.shape == (0, 4, 16)
    np.testing.assert_array_equal(np.asarray(got_cache), np.asarray(want_cache))


@pytest.mark.parametrize("name", ["q_tile", "kv_chunk_pages"])
def test_bad_tile_sizes_are_refused(name):
    batch = make_ragged_batch(0, [1, 3], [4, 0], num_q_heads=2, num_kv_heads=1, head_size=8, block_size=4)
    with pytest.raises(ValueError, match=f"{name}=0 must be an int >= 1"):
        chunked.ragged_paged_attention(*batch.op_args, sm_scale=0.3, **{name: 0})


def test_one_compiled_shape_serves_every_batch_of_a_bucket():
    """Shapes depend on (T, R, table width) only: one trace serves decodes, prefills and a
    mix alike (the dense path it replaced compiled per prefill count and longest prefill)."""
    traces = []

    def op(*args, **kwargs):
        traces.append(1)
        return SMALL(*args, **kwargs)

    step = jax.jit(functools.partial(op, sm_scale=0.25))
    for seed, (query_lens, context_lens) in enumerate((([1, 1, 1], [5, 30, 2]), ([9, 1, 6], [0, 11, 0]), ([16], [7]))):
        pages = sum(-(-(q + c) // 4) for q, c in zip(query_lens, context_lens, strict=True))
        batch = make_ragged_batch(
            seed, query_lens, context_lens, num_q_heads=8, num_kv_heads=2, head_size=16, block_size=4,
            num_tokens=16, extra_blocks=16 - pages, num_padding_requests=3 - len(query_lens),
        )  # fmt: skip
        tables = np.zeros((3, 12), np.int32)  # one width for all: a table padded to the longest context
        tables[:, : batch.block_tables.shape[1]] = batch.block_tables
        batch = dataclasses.replace(batch, block_tables=jnp.asarray(tables))
        want, _ = reference.ragged_paged_attention(*batch.op_args, sm_scale=0.25)
        got, _ = step(*batch.op_args)
        n = batch.num_actual_tokens
        np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(want)[:n], rtol=1e-5, atol=1e-6)
    assert len(traces) == 1
