"""Checks of a ragged paged attention op against the float64 oracle, shared by op tests.

``check(batch, options, use_jit, op=...)`` runs an op (the jnp reference by default; a
kernel later) on a ``RaggedBatch`` and checks both results: the returned cache holds the
new keys and values at their slots and nothing else changed (NaN included); the output
matches the oracle on the keys and values that cache holds, within ``TOLERANCES``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from attn_jax.ops.ragged_paged_attention.reference import ragged_paged_attention
from attn_jax.testing.workloads import RaggedBatch
from tests.oracle import assert_cache_entries_equal, attention_oracle, cache_contents


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


def make_options(batch: RaggedBatch, *, sm_scale=None, causal=True, sliding_window=None,
                 logits_soft_cap=None, alibi=False, sinks=False, seed=0) -> dict:  # fmt: skip
    """The op's keyword options (sm_scale None = head_size**-0.5); ``alibi`` / ``sinks``
    draw random slopes in [0, 1) / sink logits ~ N(0, 2^2) per query head."""
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


def run_op(batch: RaggedBatch, options: dict, use_jit: bool, write: bool = True, op=ragged_paged_attention):
    """``op`` on ``batch``, eagerly or under jit; ``write=False`` passes k = v = None."""
    static = {n: options[n] for n in ("sm_scale", "causal", "sliding_window", "logits_soft_cap")}
    fn = functools.partial(op, **static)
    if use_jit:
        fn = jax.jit(fn)
    q, k, v, *rest = batch.op_args
    if not write:
        k = v = None
    return fn(q, k, v, *rest, alibi_slopes=options["alibi_slopes"], sinks=options["sinks"], **batch.op_kwargs)


def rel_l2(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def read_back(batch: RaggedBatch, kv_cache) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each request's keys and values (f64, dequantised) read from ``kv_cache`` through
    its block table, after checking them against an independent quantisation."""
    cache = np.asarray(kv_cache, np.float64)
    block_size = cache.shape[2]
    tables = np.asarray(batch.block_tables)
    fp8 = batch.cache_dtype_str in _FP8_KEY
    seqs: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
    for r, seq_len in enumerate(np.asarray(batch.seq_lens)):
        j = np.arange(seq_len)
        pages, offsets = tables[r, j // block_size], j % block_size
        for i, (raw, scale) in enumerate(((batch.k_seqs[r], batch.k_scale), (batch.v_seqs[r], batch.v_scale))):
            stored = cache[i, pages, offsets]  # f64[seq_len, Hkv, D]
            expected = cache_contents(raw, batch.cache_dtype_str, scale)
            assert_cache_entries_equal(stored, expected, batch.cache_dtype_str)
            seqs[i].append(stored * scale if fp8 else stored)
    return seqs


def check_output(batch: RaggedBatch, options: dict, out, kv_cache) -> None:
    """``out`` against the oracle on the keys and values ``kv_cache`` (the op's) holds."""
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype, (out.shape, out.dtype)
    out = np.asarray(out, np.float64)
    n = batch.num_actual_tokens
    assert np.isfinite(out[n:]).all(), "padding rows must be finite"
    assert np.isfinite(out[:n]).all(), "NaN or inf in a real row: an unused cache slot leaked"
    q = np.asarray(batch.q, np.float64)
    expected = attention_oracle(q, *read_back(batch, kv_cache), batch.query_lens, **options)
    if batch.cache_dtype_str not in _FP8_KEY:
        tol = TOLERANCES[batch.q.dtype.name]
        np.testing.assert_allclose(out[:n], expected, rtol=tol.rtol, atol=tol.atol)
    elif n:
        tol = TOLERANCES[_FP8_KEY[batch.cache_dtype_str]]
        unquantized = attention_oracle(q, batch.k_seqs, batch.v_seqs, batch.query_lens, **options)
        err, err_unquantized = rel_l2(out[:n], expected), rel_l2(out[:n], unquantized)
        assert err < tol.rel_l2, f"relative L2 error {err:.3g} vs the dequantised oracle"
        assert err_unquantized < tol.rel_l2_unquantized, (
            f"relative L2 error {err_unquantized:.3g} vs the unquantised oracle"
        )


def check_cache(batch: RaggedBatch, new_cache) -> None:
    """The op's cache: the new tokens' entries at their slots, everything else as before."""
    assert new_cache.shape == batch.kv_cache.shape and new_cache.dtype == batch.kv_cache.dtype
    expected = np.asarray(batch.kv_cache, np.float64).copy()
    flat = expected.reshape(2, -1, *expected.shape[3:])  # a view: [2, P * S, Hkv, D]
    slots = np.asarray(batch.slot_mapping)
    real = slots >= 0
    flat[0, slots[real]] = cache_contents(np.asarray(batch.k)[real], batch.cache_dtype_str, batch.k_scale)
    flat[1, slots[real]] = cache_contents(np.asarray(batch.v)[real], batch.cache_dtype_str, batch.v_scale)
    assert_cache_entries_equal(np.asarray(new_cache, np.float64), expected, batch.cache_dtype_str)


def check(batch: RaggedBatch, options: dict, use_jit: bool, op=ragged_paged_attention) -> None:
    """Runs ``op`` on ``batch`` and checks its cache and output."""
    out, new_cache = run_op(batch, options, use_jit, op=op)
    check_cache(batch, new_cache)
    check_output(batch, options, out, new_cache)


# --- non-finite inputs ---------------------------------------------------------------------

NONFINITE_BATCH = dict(query_lens=[1, 8, 3], context_lens=[20, 0, 4], num_q_heads=4, num_kv_heads=2, head_size=64,
                       block_size=16, num_tokens=14)  # fmt: skip
"""A decode (row 0), an 8-token prefill (rows 1-8), a 3-token chunk on 4 cached (rows 9-11), 2 padding
rows: shapes every implementation takes (the TPU kernel's head sizes and pages included)."""

NONFINITE_ENTRIES = (
    # (what, token row or (request, cached position), head, value)
    ("q", 0, 0, np.nan),  # the decode's own query, head 0: only that output row
    ("k", 3, 0, np.nan),  # a prefill key (position 2): the rows at positions 2.. see it (window: 2..5)
    ("v", 10, 1, np.inf),  # the chunk's second token: rows 10 and 11, heads of kv head 1
    ("v_cached", (0, 2), 1, np.nan),  # the decode's context: hidden by a window of 4 (it sees 17..20)
    ("v_cached", (2, 1), 0, np.inf),  # the chunk's context: every row of the chunk sees it
    ("q", 13, 1, np.nan),  # a padding row's query: never reaches any output
    ("k", 12, 0, np.nan),  # a padding row's key (slot -1: never written)
)


def with_nonfinite_entries(batch: RaggedBatch, entries=NONFINITE_ENTRIES) -> RaggedBatch:
    """``batch`` with whole head vectors of q, the new k/v or the cached k/v set to NaN or inf
    (in the op's inputs and in the oracle's per-request keys and values alike)."""
    q, k, v = (np.array(x) for x in (batch.q, batch.k, batch.v))
    k_seqs, v_seqs = [s.copy() for s in batch.k_seqs], [s.copy() for s in batch.v_seqs]
    cache = np.array(batch.kv_cache)
    qsl, tables = np.asarray(batch.query_start_loc), np.asarray(batch.block_tables)
    block_size = cache.shape[2]
    for what, where, head, value in entries:
        if what == "q":
            q[where, head] = value
        elif what in ("k", "v"):
            (k if what == "k" else v)[where, head] = value
            r = int(np.searchsorted(qsl[1:], where, side="right"))
            if where < batch.num_actual_tokens:
                seqs = k_seqs if what == "k" else v_seqs
                seqs[r][batch.context_lens[r] + where - qsl[r], head] = value
        else:
            r, pos = where
            cache[int(what == "v_cached"), tables[r, pos // block_size], pos % block_size, head] = value
            (v_seqs if what == "v_cached" else k_seqs)[r][pos, head] = value
    return dataclasses.replace(
        batch, q=jax.numpy.asarray(q), k=jax.numpy.asarray(k), v=jax.numpy.asarray(v),
        kv_cache=jax.numpy.asarray(cache), k_seqs=tuple(k_seqs), v_seqs=tuple(v_seqs),
    )  # fmt: skip


def check_nonfinite_output(batch: RaggedBatch, options: dict, out, *, upper: RaggedBatch | None = None) -> None:
    """Exactly the output rows (token, head) whose oracle output is non-finite are non-finite
    in ``out``; the others match the oracle; padding rows are finite. With ``upper`` (``batch``
    with its non-finite entries spread further), at least ``batch``'s rows and at most
    ``upper``'s are non-finite."""
    out = np.asarray(out, np.float64)
    n = batch.num_actual_tokens

    def bad_rows(b):
        with np.errstate(invalid="ignore", over="ignore"):
            expected = attention_oracle(np.asarray(b.q, np.float64), b.k_seqs, b.v_seqs, b.query_lens, **options)
        return expected, ~np.isfinite(expected).all(-1)  # bool[n, Hq]

    expected, bad_expected = bad_rows(batch)
    assert bad_expected.any() and not bad_expected.all(), "the test batch must have clean and poisoned rows"
    bad = ~np.isfinite(out[:n]).all(-1)
    if upper is None:
        np.testing.assert_array_equal(bad, bad_expected, err_msg="non-finite output rows (token, head) differ")
    else:
        bad_upper = bad_rows(upper)[1]
        missed = np.argwhere(bad_expected & ~bad)
        assert not len(missed), f"rows that see a non-finite entry stayed finite: {missed}"
        assert (bad <= bad_upper).all(), f"non-finite rows past the bound: {np.argwhere(bad & ~bad_upper)}"
    assert np.isfinite(out[n:]).all(), "padding rows must be finite"
    tol = TOLERANCES[batch.q.dtype.name]
    np.testing.assert_allclose(out[:n][~bad], expected[~bad], rtol=tol.rtol, atol=tol.atol)
