"""The jnp reference of ragged paged attention against the float64 NumPy oracle.

Every batch comes from ``workloads.make_ragged_batch``: unused cache slots hold NaN and
padding rows hold large finite garbage, so a read out of bounds or a padding write
shows up. Each call also checks the returned cache: the new keys and values at their
slots, every other entry (NaN included) unchanged.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_jax.kv_cache import write_to_kv_cache
from attn_jax.ops.ragged_paged_attention.reference import ragged_paged_attention
from attn_jax.ops.ragged_paged_attention.workloads import RaggedBatch, make_ragged_batch
from tests.oracle import as_cached, attention_oracle, cache_contents


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Elementwise (rtol, atol) for unquantised caches; relative L2 error for fp8 ones."""

    rtol: float | None = None
    atol: float | None = None
    rel_l2: float | None = None  # vs the oracle on the dequantised cache entries
    rel_l2_unquantized: float | None = None  # vs the oracle on the unquantised k/v


TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(rtol=1e-5, atol=1e-5),
    "bfloat16": Tolerance(rtol=2e-2, atol=2e-2),
    "float16": Tolerance(rtol=1e-2, atol=1e-2),
    "fp8_e4m3": Tolerance(rel_l2=1e-2, rel_l2_unquantized=0.1),
    "fp8_e5m2": Tolerance(rel_l2=1e-2, rel_l2_unquantized=0.2),
}
"""Keyed by activation dtype, or by the fp8 cache dtype ("fp8" is "fp8_e4m3")."""

_FP8_KEY = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}



def _options(batch: RaggedBatch, *, sm_scale=None, causal=True, sliding_window=None,
             logits_soft_cap=None, alibi=False, sinks=False, seed=0) -> dict:  # fmt: skip
    """The op's keyword options; alibi slopes and sink logits are drawn at random."""
    rng = np.random.default_rng(seed)
    num_q_heads, head_size = batch.q.shape[1:]
    return dict(
        sm_scale=head_size**-0.5 if sm_scale is None else sm_scale,
        causal=causal,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        alibi_slopes=rng.uniform(0.0, 1.0, num_q_heads).astype(np.float32) if alibi else None,
        sinks=(2.0 * rng.standard_normal(num_q_heads)).astype(np.float32) if sinks else None,
    )


def _run(batch: RaggedBatch, options: dict, use_jit: bool, k=None, v=None, write=True):
    """Calls the op on ``batch`` (eagerly or under jit); ``write=False`` passes k=v=None."""
    static = {n: options[n] for n in ("sm_scale", "causal", "sliding_window", "logits_soft_cap")}
    op = functools.partial(ragged_paged_attention, **static)
    if use_jit:
        op = jax.jit(op)
    q, k, v, *rest = batch.op_args
    if not write:
        k = v = None
    return op(
        q, k, v, *rest,
        alibi_slopes=options["alibi_slopes"], sinks=options["sinks"], **batch.op_kwargs,
    )  # fmt: skip


def _rel_l2(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def _oracle(batch: RaggedBatch, options: dict, quantized: bool = True) -> np.ndarray:
    """The oracle on the cache's view of k/v (``quantized``) or on the raw k/v."""
    cache_dtype = batch.cache_dtype_str if quantized else "auto"
    k_seqs = [as_cached(x, cache_dtype, batch.k_scale) for x in batch.k_seqs]
    v_seqs = [as_cached(x, cache_dtype, batch.v_scale) for x in batch.v_seqs]
    return attention_oracle(np.asarray(batch.q, np.float64), k_seqs, v_seqs, batch.query_lens, **options)


def _check_output(batch: RaggedBatch, options: dict, out) -> None:
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    out = np.asarray(out, np.float64)
    n = batch.num_actual_tokens
    assert np.isfinite(out[n:]).all(), "padding rows must be finite"
    expected = _oracle(batch, options)
    assert np.isfinite(out[:n]).all(), "NaN or inf in a real row: an unused cache slot leaked"
    if batch.cache_dtype_str in _FP8_KEY:
        tol = TOLERANCES[_FP8_KEY[batch.cache_dtype_str]]
        if n:
            assert _rel_l2(out[:n], expected) < tol.rel_l2
            assert _rel_l2(out[:n], _oracle(batch, options, quantized=False)) < tol.rel_l2_unquantized
    else:
        tol = TOLERANCES[batch.q.dtype.name]
        np.testing.assert_allclose(out[:n], expected, rtol=tol.rtol, atol=tol.atol)


def _expected_cache(batch: RaggedBatch) -> np.ndarray:
    """f64 of the cache after the op: the new tokens' entries at their slots."""
    expected = np.asarray(batch.kv_cache, np.float64).copy()
    flat = expected.reshape(2, -1, *expected.shape[3:])  # a view: [2, P * S, Hkv, D]
    slots = np.asarray(batch.slot_mapping)
    real = slots >= 0
    flat[0, slots[real]] = cache_contents(np.asarray(batch.k)[real], batch.cache_dtype_str, batch.k_scale)
    flat[1, slots[real]] = cache_contents(np.asarray(batch.v)[real], batch.cache_dtype_str, batch.v_scale)
    return expected


def _check_cache(batch: RaggedBatch, new_cache) -> None:
    assert new_cache.shape == batch.kv_cache.shape and new_cache.dtype == batch.kv_cache.dtype
    # assert_array_equal treats NaN == NaN: untouched NaN slots must stay NaN.
    np.testing.assert_array_equal(np.asarray(new_cache, np.float64), _expected_cache(batch))


def _check(batch: RaggedBatch, options: dict, use_jit: bool) -> None:
    out, new_cache = _run(batch, options, use_jit)
    _check_output(batch, options, out)
    _check_cache(batch, new_cache)


JIT = pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])

# --- named cases ---------------------------------------------------------------------------

_SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_size=16, block_size=4)
_MIXED = dict(query_lens=[1, 6, 1, 3], context_lens=[9, 0, 4, 5], **_SHAPE)

CASES: dict[str, tuple[dict, dict]] = {
    # name: (make_ragged_batch kwargs, op options)
    "decode_only": (dict(query_lens=[1, 1, 1], context_lens=[5, 12, 0], **_SHAPE), {}),
    "prefill_only_q_len_eq_kv_len": (dict(query_lens=[7, 3, 9], context_lens=[0, 0, 0], **_SHAPE), {}),
    "chunked_prefill": (dict(query_lens=[4, 5], context_lens=[8, 3], **_SHAPE), {}),
    "mixed": (_MIXED, {}),
    "single_token": (dict(query_lens=[1], context_lens=[0], **_SHAPE), {}),
    "empty_requests": (dict(query_lens=[0, 3, 0, 1], context_lens=[6, 2, 0, 4], **_SHAPE), {}),
    "padding_rows_and_requests": (
        dict(**_MIXED, num_tokens=16, num_padding_requests=2, extra_blocks=3), {},
    ),
    "unshuffled_blocks": (dict(**_MIXED, shuffle_blocks=False, extra_blocks=1), {}),
    "block_size_2": (dict(query_lens=[3, 1], context_lens=[4, 6], num_q_heads=4, num_kv_heads=2,
                          head_size=8, block_size=2), {}),  # fmt: skip
    "block_size_8_head_32": (dict(query_lens=[5, 1], context_lens=[11, 20], num_q_heads=2,
                                  num_kv_heads=2, head_size=32, block_size=8), {}),  # fmt: skip
    "mha": (dict(_MIXED, num_kv_heads=4), {}),
    "gqa": (dict(_MIXED, num_q_heads=6, num_kv_heads=2), {}),
    "mqa": (dict(_MIXED, num_kv_heads=1), {}),
    "non_causal": (_MIXED, dict(causal=False)),
    "sliding_window": (_MIXED, dict(sliding_window=3)),
    "sliding_window_1": (_MIXED, dict(sliding_window=1)),
    "non_causal_sliding_window": (_MIXED, dict(causal=False, sliding_window=4)),
    "soft_cap": (_MIXED, dict(logits_soft_cap=1.5, sm_scale=1.0)),
    "alibi": (_MIXED, dict(alibi=True)),
    "sinks": (_MIXED, dict(sinks=True)),
    "sm_scale": (_MIXED, dict(sm_scale=0.7)),
    "all_features": (
        dict(**_MIXED, num_tokens=15, num_padding_requests=1, extra_blocks=2),
        dict(sliding_window=5, logits_soft_cap=2.0, alibi=True, sinks=True, sm_scale=0.5),
    ),
    "bfloat16": (dict(_MIXED, dtype=jnp.bfloat16, num_tokens=14), dict(sinks=True)),
    "float16": (dict(_MIXED, dtype=jnp.float16, num_tokens=14), dict(alibi=True)),
    "bfloat16_cache_float32_activations": (dict(_MIXED, cache_dtype_str="bfloat16"), {}),
    "fp8_e4m3": (dict(_MIXED, cache_dtype_str="fp8_e4m3", num_tokens=14, extra_blocks=2), {}),
    "fp8_alias": (dict(_MIXED, cache_dtype_str="fp8"), dict(sliding_window=4)),
    "fp8_e5m2": (dict(_MIXED, cache_dtype_str="fp8_e5m2", num_tokens=14, extra_blocks=2), {}),
    "fp8_e4m3_bfloat16_all_features": (
        dict(_MIXED, cache_dtype_str="fp8_e4m3", dtype=jnp.bfloat16, num_padding_requests=1),
        dict(sliding_window=6, logits_soft_cap=3.0, alibi=True, sinks=True),
    ),
    "fp8_e5m2_float16_mqa": (dict(_MIXED, cache_dtype_str="fp8_e5m2", dtype=jnp.float16, num_kv_heads=1),
                             dict(causal=False)),  # fmt: skip
    "fp8_unit_scales": (dict(_MIXED, cache_dtype_str="fp8", k_scale=1.0, v_scale=1.0), {}),
}


@JIT
@pytest.mark.parametrize("case", list(CASES))
def test_named_case_matches_oracle(case, use_jit):
    batch_kwargs, option_kwargs = CASES[case]
    batch = make_ragged_batch(0, **batch_kwargs)
    _check(batch, _options(batch, **option_kwargs), use_jit)


def test_unused_slots_really_hold_nan():
    """Guards the NaN-based tests: the batch's cache has NaN wherever no token lives."""
    batch = make_ragged_batch(0, **CASES["padding_rows_and_requests"][0])
    cache = np.asarray(batch.kv_cache, np.float32)
    num_slots = cache.shape[1] * cache.shape[2]
    assert np.isnan(cache).any()
    # Exactly the context slots are filled.
    assert (~np.isnan(cache)).reshape(2, num_slots, -1).all(-1).sum(-1).tolist() == [
        int(batch.context_lens.sum())
    ] * 2


@JIT
def test_no_write_when_k_is_none(use_jit):
    """A KV-sharing layer passes k=v=None: nothing is written, the cache is read as is."""
    batch = make_ragged_batch(1, **CASES["padding_rows_and_requests"][0])
    filled = write_to_kv_cache(batch.kv_cache, batch.k, batch.v, batch.slot_mapping)
    batch = dataclasses.replace(batch, kv_cache=filled)
    options = _options(batch, sinks=True)
    out, new_cache = _run(batch, options, use_jit, write=False)
    _check_output(batch, options, out)
    np.testing.assert_array_equal(np.asarray(new_cache), np.asarray(filled))


@JIT
def test_only_empty_requests_and_padding_rows(use_jit):
    batch = make_ragged_batch(2, [0, 0], [5, 0], **_SHAPE, num_tokens=4, num_padding_requests=1)
    out, new_cache = _run(batch, _options(batch), use_jit)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(new_cache), np.asarray(batch.kv_cache))


def test_padding_rows_never_written_even_to_last_slot():
    """Slot -1 must not wrap around: the cache's last slot is unused and stays NaN."""
    batch = make_ragged_batch(3, [2, 1], [3, 2], **_SHAPE, num_tokens=6, extra_blocks=1, shuffle_blocks=False)
    _, new_cache = _run(batch, _options(batch), use_jit=False)
    assert np.isnan(np.asarray(new_cache, np.float32)[:, -1, -1]).all()


# --- random batches ------------------------------------------------------------------------


@st.composite
def batch_specs(draw, dtypes=("float32",), cache_dtypes=("auto",)):
    """(make_ragged_batch kwargs, option kwargs) for a small random ragged batch."""
    num_reqs = draw(st.integers(1, 4))
    lens = st.lists(st.integers(0, 6), min_size=num_reqs, max_size=num_reqs)
    query_lens = draw(lens)
    context_lens = draw(st.lists(st.integers(0, 12), min_size=num_reqs, max_size=num_reqs))
    num_q_heads, num_kv_heads = draw(st.sampled_from([(2, 2), (4, 2), (4, 1), (6, 3), (3, 1)]))
    batch_kwargs = dict(
        query_lens=query_lens,
        context_lens=context_lens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_size=draw(st.sampled_from([8, 16])),
        block_size=draw(st.sampled_from([2, 3, 4, 8])),
        dtype=jnp.dtype(draw(st.sampled_from(dtypes))),
        cache_dtype_str=draw(st.sampled_from(cache_dtypes)),
        num_tokens=sum(query_lens) + draw(st.integers(0, 3)),
        extra_blocks=draw(st.integers(0, 2)),
        num_padding_requests=draw(st.integers(0, 1)),
        shuffle_blocks=draw(st.booleans()),
    )
    option_kwargs = dict(
        sm_scale=draw(st.sampled_from([None, 0.3, 1.0])),
        causal=draw(st.booleans()),
        sliding_window=draw(st.none() | st.integers(1, 8)),
        logits_soft_cap=draw(st.sampled_from([None, 1.0, 5.0])),
        alibi=draw(st.booleans()),
        sinks=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )
    return batch_kwargs, option_kwargs


@settings(max_examples=30, deadline=None)
@given(spec=batch_specs(), seed=st.integers(0, 2**16))
def test_random_batches_match_oracle_eager(spec, seed):
    batch_kwargs, option_kwargs = spec
    batch = make_ragged_batch(seed, **batch_kwargs)
    _check(batch, _options(batch, **option_kwargs), use_jit=False)


@settings(max_examples=12, deadline=None)
@given(spec=batch_specs(), seed=st.integers(0, 2**16))
def test_random_batches_match_oracle_jit(spec, seed):
    batch_kwargs, option_kwargs = spec
    batch = make_ragged_batch(seed, **batch_kwargs)
    _check(batch, _options(batch, **option_kwargs), use_jit=True)


@settings(max_examples=25, deadline=None)
@given(
    spec=batch_specs(
        dtypes=("float32", "bfloat16", "float16"),
        cache_dtypes=("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"),
    ),
    seed=st.integers(0, 2**16),
)
def test_random_low_precision_and_fp8_match_oracle(spec, seed):
    batch_kwargs, option_kwargs = spec
    batch = make_ragged_batch(seed, **batch_kwargs)
    _check(batch, _options(batch, **option_kwargs), use_jit=False)
