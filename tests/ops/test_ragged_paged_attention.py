"""The jnp reference of ragged paged attention against the float64 NumPy oracle.

Every batch comes from ``workloads.make_ragged_batch``: unused cache slots hold NaN and
padding rows hold large finite garbage, so a read out of bounds or a padding write
shows up. Each call also checks the returned cache: the new keys and values at their
slots, every other entry (NaN included) unchanged. Named cases and bad inputs here;
random batches in test_ragged_paged_attention_random.py; the checks in ragged_checks.py.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.kv_cache import write_to_kv_cache
from attn_jax.ops.ragged_paged_attention import chunked, pallas_mosaic_tpu, pallas_triton, reference
from attn_jax.ops.ragged_paged_attention.reference import ragged_paged_attention
from attn_jax.testing.workloads import make_ragged_batch
from tests.ops.ragged_checks import (
    NONFINITE_BATCH,
    check,
    check_nonfinite_output,
    check_output,
    make_options,
    run_op,
    with_nonfinite_entries,
)

JIT = pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])

_SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_size=16, block_size=4)
_MIXED = dict(query_lens=[1, 6, 1, 3], context_lens=[9, 0, 4, 5], **_SHAPE)

CASES: dict[str, tuple[dict, dict]] = {
    # name: (make_ragged_batch kwargs, op options)
    "decode_only": (dict(query_lens=[1, 1, 1], context_lens=[5, 12, 0], **_SHAPE), {}),
    "prefill_only_q_len_eq_kv_len": (dict(query_lens=[7, 3, 9], context_lens=[0, 0, 0], **_SHAPE), {}),
    "chunked_prefill": (dict(query_lens=[4, 5], context_lens=[8, 3], **_SHAPE), {}),
    "mixed": (_MIXED, {}),
    "empty_requests": (dict(query_lens=[0, 3, 0, 1], context_lens=[6, 2, 0, 4], **_SHAPE), {}),
    "padding_rows_and_requests": (
        dict(**_MIXED, num_tokens=16, num_padding_requests=2, extra_blocks=3),
        {},
    ),
    "block_size_2": (
        dict(query_lens=[3, 1], context_lens=[4, 6], num_q_heads=4, num_kv_heads=2, head_size=8, block_size=2),
        {},
    ),
    "block_size_8_head_32": (
        dict(query_lens=[5, 1], context_lens=[11, 20], num_q_heads=2, num_kv_heads=2, head_size=32, block_size=8),
        {},
    ),
    "gqa_group_3": (dict(_MIXED, num_q_heads=6, num_kv_heads=2), {}),  # _SHAPE itself is GQA, group 2
    "mha": (dict(_MIXED, num_kv_heads=4), {}),
    "mqa": (dict(_MIXED, num_kv_heads=1), {}),
    "non_causal": (_MIXED, dict(causal=False)),
    "sliding_window": (_MIXED, dict(sliding_window=3)),
    "sliding_window_1": (_MIXED, dict(sliding_window=1)),
    "non_causal_sliding_window": (_MIXED, dict(causal=False, sliding_window=4)),
    "soft_cap": (_MIXED, dict(logits_soft_cap=1.5, sm_scale=1.0)),
    "alibi": (_MIXED, dict(alibi=True)),
    "sinks": (_MIXED, dict(sinks=True)),
    "all_features": (
        dict(**_MIXED, num_tokens=15, num_padding_requests=1, extra_blocks=2),
        dict(sliding_window=5, logits_soft_cap=2.0, alibi=True, sinks=True, sm_scale=0.5),
    ),
    "bfloat16": (dict(_MIXED, dtype=jnp.bfloat16, num_tokens=14), dict(sinks=True)),
    "float16": (dict(_MIXED, dtype=jnp.float16, num_tokens=14), dict(alibi=True)),
    "bfloat16_cache_float32_activations": (dict(_MIXED, cache_dtype_str="bfloat16"), {}),
    "fp8_e4m3": (dict(_MIXED, cache_dtype_str="fp8_e4m3", num_tokens=14, extra_blocks=2), {}),
    "fp8_alias_unit_scales": (
        dict(_MIXED, cache_dtype_str="fp8", k_scale=1.0, v_scale=1.0, shuffle_blocks=False),
        dict(sliding_window=4),
    ),
    "fp8_e5m2": (dict(_MIXED, cache_dtype_str="fp8_e5m2", num_tokens=14, extra_blocks=2), {}),
    "fp8_e4m3_bfloat16_all_features": (
        dict(_MIXED, cache_dtype_str="fp8_e4m3", dtype=jnp.bfloat16, num_padding_requests=1),
        dict(sliding_window=6, logits_soft_cap=3.0, alibi=True, sinks=True),
    ),
    "fp8_e5m2_float16_mqa": (
        dict(_MIXED, cache_dtype_str="fp8_e5m2", dtype=jnp.float16, num_kv_heads=1),
        dict(causal=False),
    ),
}


EAGER_CASES = (
    "decode_only", "prefill_only_q_len_eq_kv_len", "mixed", "empty_requests",
    "padding_rows_and_requests", "all_features", "fp8_e4m3_bfloat16_all_features", "fp8_e5m2_float16_mqa",
)  # fmt: skip
"""Also run without jit (slower: every jnp op compiles on its own); every case runs jitted."""


@pytest.mark.parametrize(
    ("case", "use_jit"),
    [(case, True) for case in CASES] + [(case, False) for case in EAGER_CASES],
    ids=[f"{case}-jit" for case in CASES] + [f"{case}-eager" for case in EAGER_CASES],
)
def test_named_case_matches_oracle(case, use_jit):
    batch_kwargs, option_kwargs = CASES[case]
    batch = make_ragged_batch(0, **batch_kwargs)
    check(batch, make_options(batch, **option_kwargs), use_jit)


def test_unused_slots_really_hold_nan():
    """Guards the NaN-based tests: the batch's cache has NaN wherever no token lives."""
    batch = make_ragged_batch(0, **CASES["padding_rows_and_requests"][0])
    cache = np.asarray(batch.kv_cache, np.float32)
    num_slots = cache.shape[1] * cache.shape[2]
    assert np.isnan(cache).any()
    # Exactly the context slots are filled.
    assert (~np.isnan(cache)).reshape(2, num_slots, -1).all(-1).sum(-1).tolist() == [int(batch.context_lens.sum())] * 2


@JIT
def test_no_write_when_k_is_none(use_jit):
    """A KV-sharing layer passes k=v=None: nothing is written, the cache is read as is."""
    batch = make_ragged_batch(1, **CASES["padding_rows_and_requests"][0])
    filled = write_to_kv_cache(batch.kv_cache, batch.k, batch.v, batch.slot_mapping)
    batch = dataclasses.replace(batch, kv_cache=filled)
    options = make_options(batch, sinks=True)
    out, new_cache = run_op(batch, options, use_jit, write=False)
    np.testing.assert_array_equal(np.asarray(new_cache), np.asarray(filled))
    check_output(batch, options, out, new_cache)


@JIT
def test_only_empty_requests_and_padding_rows(use_jit):
    batch = make_ragged_batch(2, [0, 0], [5, 0], **_SHAPE, num_tokens=4, num_padding_requests=1)
    out, new_cache = run_op(batch, make_options(batch), use_jit)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(new_cache), np.asarray(batch.kv_cache))


def test_padding_rows_never_written_even_to_last_slot():
    """Slot -1 must not wrap around: the cache's last slot is unused and stays NaN."""
    batch = make_ragged_batch(3, [2, 1], [3, 2], **_SHAPE, num_tokens=6, extra_blocks=1, shuffle_blocks=False)
    _, new_cache = run_op(batch, make_options(batch), use_jit=False)
    assert np.isnan(np.asarray(new_cache, np.float32)[:, -1, -1]).all()


@pytest.mark.parametrize("window", [None, 4])
@JIT
def test_nonfinite_inputs_reach_exactly_the_rows_that_see_them(window, use_jit):
    """NaN / inf in a request's own q, k, v (new or cached) make exactly the output rows that
    see them non-finite, as torch SDPA does (before: 0.0); padding rows' NaN reaches nothing."""
    batch = with_nonfinite_entries(make_ragged_batch(0, **NONFINITE_BATCH))
    options = make_options(batch, sliding_window=window)
    out, _ = run_op(batch, options, use_jit)
    check_nonfinite_output(batch, options, out)


# --- bad inputs: one case per error message of validate.py --------------------------------


def _set(name, fn):
    return lambda args: args.update({name: fn(args[name])})


def _table_entry(args):
    args["block_tables"] = np.asarray(args["block_tables"]).copy()
    args["block_tables"][0, 0] = 99


BAD_INPUTS = {
    # name: (mutation of the op's arguments, exception, start of the message)
    "q_rank": (_set("q", lambda q: q[0]), ValueError, "q.shape=(4, 8) must be [num_tokens, num_q_heads, head_size]"),
    "q_dtype": (_set("q", lambda q: q.astype(jnp.int32)), TypeError, "q.dtype=int32 is not supported"),
    "cache_rank": (_set("kv_cache", lambda c: c[0]), ValueError, "kv_cache.shape=(3, 4, 2, 8) must be [2, num_blocks"),
    "cache_dtype": (_set("kv_cache", lambda c: c.astype(jnp.int8)), TypeError, "kv_cache.dtype=int8 is not supported"),
    "head_size": (_set("q", lambda q: q[..., :4]), ValueError, "kv_cache head_size=8 must equal q head_size=4"),
    "heads_divisible": (_set("q", lambda q: q[:, :3]), ValueError, "num_q_heads=3 must be divisible by num_kv_heads=2"),
    "k_without_v": (_set("v", lambda v: None), ValueError, "k and v must both be arrays or both be None"),
    "k_shape": (_set("k", lambda k: k[:, :1]), ValueError, "k.shape=(5, 1, 8) must be (5, 2, 8)"),
    "v_dtype": (_set("v", lambda v: v.astype(jnp.float16)), TypeError, "v.dtype=float16 must equal q.dtype=float32"),
    "query_start_loc_shape": (_set("query_start_loc", lambda x: x[:1]), ValueError,
                              "query_start_loc.shape=(1,) must be [num_reqs + 1] with num_reqs >= 1"),
    "seq_lens_shape": (_set("seq_lens", lambda x: x[:1]), ValueError, "seq_lens.shape=(1,) must be (2,)"),
    "block_tables_shape": (_set("block_tables", lambda x: x[:1]), ValueError,
                           "block_tables.shape=(1, 2) must be [num_reqs=2, pages_per_req]"),
    "slot_mapping_shape": (_set("slot_mapping", lambda x: x[:4]), ValueError, "slot_mapping.shape=(4,) must be (5,)"),
    "index_dtype": (_set("seq_lens", lambda x: np.asarray(x, np.int64)), TypeError, "seq_lens.dtype=int64 is not supported"),
    "sm_scale": (_set("sm_scale", lambda s: 0.0), ValueError, "sm_scale=0.0 must be a finite number > 0"),
    "sm_scale_inf": (_set("sm_scale", lambda s: float("inf")), ValueError, "sm_scale=inf must be a finite number > 0"),
    "sm_scale_nan": (_set("sm_scale", lambda s: float("nan")), ValueError, "sm_scale=nan must be a finite number > 0"),
    "sm_scale_none": (_set("sm_scale", lambda s: None), ValueError, "sm_scale=None must be a finite number > 0"),
    "sliding_window": (_set("sliding_window", lambda w: 0), ValueError,
                       "sliding_window=0 must be None (no window) or a positive int"),
    "sliding_window_float": (_set("sliding_window", lambda w: 2.0), ValueError,
                             "sliding_window=2.0 must be None (no window) or a positive int"),
    "soft_cap": (_set("logits_soft_cap", lambda c: -1.0), ValueError,
                 "logits_soft_cap=-1.0 must be None (no cap) or a finite number > 0"),
    "soft_cap_nan": (_set("logits_soft_cap", lambda c: float("nan")), ValueError,
                     "logits_soft_cap=nan must be None (no cap) or a finite number > 0"),
    "metadata_as_list": (_set("seq_lens", lambda x: [5, 3]), TypeError,
                         "seq_lens is a list; it must be an array (NumPy or jax) of dtype int32"),
    "alibi_shape": (_set("alibi_slopes", lambda a: np.ones(3, np.float32)), ValueError,
                    "alibi_slopes.shape=(3,) must be (4,)"),
    "sinks_shape": (_set("sinks", lambda a: np.ones((4, 1), np.float32)), ValueError, "sinks.shape=(4, 1) must be (4,)"),
    "query_start_loc_first": (_set("query_start_loc", lambda x: np.array([1, 2, 4], np.int32)), ValueError,
                              "query_start_loc[0]=1 must be 0"),
    "query_start_loc_decreasing": (_set("query_start_loc", lambda x: np.array([0, 3, 1], np.int32)), ValueError,
                                   "query_start_loc must be non-decreasing: query_start_loc[2]=1 < query_start_loc[1]=3"),
    "query_start_loc_past_tokens": (_set("query_start_loc", lambda x: np.array([0, 1, 6], np.int32)), ValueError,
                                    "query_start_loc[-1]=6 exceeds num_tokens=5"),
    "seq_len_negative": (_set("seq_lens", lambda x: np.array([-1, 3], np.int32)), ValueError,
                         "seq_lens[0]=-1 must be >= 0"),
    "seq_len_below_query_len": (_set("seq_lens", lambda x: np.array([5, 2], np.int32)), ValueError,
                                "seq_lens[1]=2 is less than request 1's query length 3"),
    "too_few_pages": (_set("seq_lens", lambda x: np.array([9, 3], np.int32)), ValueError,
                      "block_tables has 2 pages per request; request 0 needs 3 (seq_len 9, block_size=4)"),
    "block_id_out_of_range": (_table_entry, ValueError, "block_tables[0, 0]=99 is outside [0, num_blocks=3)"),
    "slot_out_of_range": (_set("slot_mapping", lambda x: np.array([12, 0, 1, 2, -1], np.int32)), ValueError,
                          "slot_mapping[0]=12 is outside [-1, num_blocks * block_size=12)"),
    "slot_below_minus_one": (_set("slot_mapping", lambda x: np.array([-2, 0, 1, 2, -1], np.int32)), ValueError,
                             "slot_mapping[0]=-2 is outside [-1, num_blocks * block_size=12)"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_raise(case):
    # T=5 rows (1 padding), R=2 requests with seq_lens [5, 3], 3 pages of 4 slots, 2 per request.
    batch = make_ragged_batch(0, [1, 3], [4, 0], num_q_heads=4, num_kv_heads=2, head_size=8, block_size=4,
                              num_tokens=5)  # fmt: skip
    names = ("q", "k", "v", "kv_cache", "query_start_loc", "seq_lens", "block_tables", "slot_mapping")
    args = dict(zip(names, batch.op_args, strict=True))
    args.update(make_options(batch, sliding_window=2, logits_soft_cap=5.0, alibi=True, sinks=True))
    mutate, error, message = BAD_INPUTS[case]
    mutate(args)
    with pytest.raises(error, match=re.escape(message)):
        ragged_paged_attention(*(args[n] for n in names), **{k: a for k, a in args.items() if k not in names})


def test_traced_sm_scale_is_named():
    batch = make_ragged_batch(0, [1, 3], [4, 0], num_q_heads=4, num_kv_heads=2, head_size=8, block_size=4)
    with pytest.raises(TypeError, match=r"sm_scale is a traced value .* a static hyperparameter"):
        jax.jit(lambda scale: ragged_paged_attention(*batch.op_args, sm_scale=scale))(0.5)


def test_numpy_scalars_are_accepted_as_options():
    batch = make_ragged_batch(0, **_MIXED)
    options = make_options(batch, sm_scale=np.float32(0.25), sliding_window=np.int64(3), logits_soft_cap=np.float64(2))
    check(batch, options, use_jit=False)


@pytest.mark.parametrize("module", ["reference", "chunked", "pallas_triton", "pallas_mosaic_tpu"])
@pytest.mark.parametrize(
    ("option", "message"),
    [
        (dict(sm_scale=float("inf")), "sm_scale=inf must be a finite number > 0"),
        (dict(sm_scale=None), "sm_scale=None must be a finite number > 0"),
        (dict(logits_soft_cap=0.0), "logits_soft_cap=0.0 must be None (no cap) or a finite number > 0"),
        (dict(sliding_window=np.float32(3)), "sliding_window=np.float32(3.0) must be None (no window)"),
    ],
    ids=["scale_inf", "scale_none", "soft_cap_0", "window_float"],
)
def test_every_implementation_refuses_bad_options_before_computing(module, option, message):
    """One shared static check (validate.py): the same error from each op, raised before any work."""
    batch = make_ragged_batch(0, [1, 3], [4, 0], num_q_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    q, k, v, cache, *rest = batch.op_args
    if module == "pallas_mosaic_tpu":
        cache = pallas_mosaic_tpu.from_reference_layout(cache)
    op = {
        "reference": reference,
        "chunked": chunked,
        "pallas_triton": pallas_triton,
        "pallas_mosaic_tpu": pallas_mosaic_tpu,
    }[module]
    with pytest.raises(ValueError, match=re.escape(message)):
        op.ragged_paged_attention(q, k, v, cache, *rest, **{"sm_scale": 0.125, **option})
