"""The Pallas TPU kernel against the float64 oracle in the TPU interpreter.

No TPU here: the kernel runs in the TPU interpreter (``pltpu.InterpretParams()``) on tiny
ragged batches (lowering for TPU, bad inputs, layout and tables: test_pallas_mosaic_tpu_lowering.py).
Batches come from
``make_ragged_batch`` (unused cache slots hold NaN, padding rows large finite garbage);
``tpu_op`` converts their reference-layout cache to the TPU layout and back, so the shared
checks (``ragged_checks.check``: output vs oracle, cache writes) apply unchanged.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_jax.ops.ragged_paged_attention import pallas_mosaic_tpu
from attn_jax.ops.ragged_paged_attention.config import TpuBlockSizes
from attn_jax.testing.workloads import make_ragged_batch
from tests.ops.ragged_checks import (
    NONFINITE_BATCH,
    TOLERANCES,
    check,
    check_nonfinite_output,
    check_output,
    make_options,
    read_back,
    run_op,
    with_nonfinite_entries,
)
from tests.oracle import attention_oracle


def tpu_op(block_sizes: TpuBlockSizes | None = None):
    """The kernel with the reference's calling convention: the cache in and out in the
    reference layout, converted to and from the TPU layout around the call."""

    def op(q, k, v, kv_cache, *rest, **kwargs):
        out, cache = pallas_mosaic_tpu.ragged_paged_attention(
            q, k, v, pallas_mosaic_tpu.from_reference_layout(kv_cache), *rest, block_sizes=block_sizes, **kwargs
        )
        return out, pallas_mosaic_tpu.to_reference_layout(cache)

    return op


_G4 = dict(num_q_heads=8, num_kv_heads=2)  # GQA ratio 4
_MIXED = dict(query_lens=[1, 9, 1, 4], context_lens=[21, 0, 5, 12])
SMALL = TpuBlockSizes(q_tokens_per_block=4, kv_pages_per_block=1)  # several q-blocks and KV blocks

CASES: dict[str, tuple[dict, dict, TpuBlockSizes | None]] = {
    # name: (make_ragged_batch kwargs, op options, block sizes (None: the heuristic))
    "decode_only_window_g4_h128_p16": (dict(query_lens=[1, 1, 1], context_lens=[37, 9, 0], **_G4, head_size=128,
                                            block_size=16), dict(sliding_window=5), TpuBlockSizes(2, 2)),
    "prefill_only_q_len_eq_kv_len_g1_h64_p16": (dict(query_lens=[19, 6], context_lens=[0, 0], num_q_heads=2,
                                                     num_kv_heads=2, head_size=64, block_size=16), {},
                                                TpuBlockSizes(8, 1)),
    "mixed_padding_g8_h128_p32": (dict(_MIXED, num_q_heads=8, num_kv_heads=1, head_size=128, block_size=32,
                                       num_tokens=19, num_padding_requests=2, extra_blocks=2), {}, None),
    "empty_requests_h64_p32": (dict(query_lens=[0, 3, 0, 1], context_lens=[6, 2, 0, 4], **_G4, head_size=64,
                                    block_size=32), {}, SMALL),
    "sliding_window_two_of_four_kv_heads_per_block": (dict(_MIXED, num_q_heads=16, num_kv_heads=4, head_size=128,
                                                           block_size=16), dict(sliding_window=6),
                                                      TpuBlockSizes(8, 1, kv_heads_per_block=2)),
    "non_causal": (dict(_MIXED, **_G4, head_size=64, block_size=16), dict(causal=False), SMALL),
    "soft_cap_alibi": (dict(_MIXED, **_G4, head_size=64, block_size=16),
                       dict(logits_soft_cap=1.5, sm_scale=1.0, alibi=True), SMALL),
    "bfloat16_all_features": (dict(_MIXED, **_G4, head_size=128, block_size=16, dtype=jnp.bfloat16),
                              dict(sliding_window=9, logits_soft_cap=3.0, alibi=True, sinks=True), None),
    "fp8_e4m3_h64_bf16": (dict(_MIXED, **_G4, head_size=64, block_size=32, dtype=jnp.bfloat16,
                               cache_dtype_str="fp8_e4m3", extra_blocks=1), dict(sinks=True), None),
    "fp8_e5m2_h128": (dict(_MIXED, **_G4, head_size=128, block_size=32, cache_dtype_str="fp8_e5m2"),
                      dict(sliding_window=7), SMALL),
    # Head sizes past the lane tiles: 80 and 96 in the packed layout as 64 is, 192 = 128 + 64.
    "h80_mixed_sinks": (dict(_MIXED, **_G4, head_size=80, block_size=16), dict(sinks=True), SMALL),
    "h96_bf16_window": (dict(_MIXED, **_G4, head_size=96, block_size=16, dtype=jnp.bfloat16),
                        dict(sliding_window=7), None),
    "h192_decode": (dict(query_lens=[1, 1, 1], context_lens=[37, 9, 0], **_G4, head_size=192, block_size=16),
                    {}, TpuBlockSizes(2, 2)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_oracle_in_tpu_interpreter(name):
    batch_kwargs, options, block_sizes = CASES[name]
    batch = make_ragged_batch(0, **batch_kwargs)
    check(batch, make_options(batch, **options), use_jit=True, op=tpu_op(block_sizes))


@pytest.mark.parametrize(("head_size", "window"), [(64, 4), (128, None)], ids=["packed_h64_window", "h128"])
def test_nonfinite_inputs_reach_exactly_the_rows_that_see_them_in_tpu_interpreter(head_size, window):
    batch = with_nonfinite_entries(make_ragged_batch(0, **dict(NONFINITE_BATCH, head_size=head_size)))
    options = make_options(batch, sliding_window=window)
    out, _ = run_op(batch, options, use_jit=True, op=tpu_op(SMALL))
    check_nonfinite_output(batch, options, out)


@st.composite
def tpu_batches(draw):
    """(make_ragged_batch kwargs, make_options kwargs, block sizes) for a tiny random TPU batch."""
    num_reqs = draw(st.integers(1, 4))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    num_kv_heads = draw(st.sampled_from([1, 2]))
    page = draw(st.sampled_from([16, 32]))
    cache = draw(st.sampled_from(["auto", "bfloat16", "fp8_e4m3", "fp8_e5m2"])) if page == 32 else "auto"
    query_lens = draw(st.lists(st.integers(0, 12), min_size=num_reqs, max_size=num_reqs))
    batch = dict(
        query_lens=query_lens, context_lens=draw(st.lists(st.integers(0, 40), min_size=num_reqs, max_size=num_reqs)),
        num_q_heads=group * num_kv_heads, num_kv_heads=num_kv_heads, head_size=draw(st.sampled_from([64, 128])),
        block_size=page, cache_dtype_str=cache, num_tokens=max(sum(query_lens) + draw(st.integers(0, 4)), 1),
        extra_blocks=draw(st.integers(0, 2)), num_padding_requests=draw(st.integers(0, 1)),
    )  # fmt: skip
    options = dict(
        causal=draw(st.booleans()), sliding_window=draw(st.none() | st.integers(1, 30)),
        logits_soft_cap=draw(st.sampled_from([None, 2.0])), alibi=draw(st.booleans()), sinks=draw(st.booleans()),
    )  # fmt: skip
    tokens = 8 // math.gcd(8, group)  # float32 queries: 8-row tiles
    block_sizes = TpuBlockSizes(tokens * draw(st.integers(1, 3)), 1)
    return batch, options, block_sizes


@settings(max_examples=2, deadline=None)
@given(spec=tpu_batches(), seed=st.integers(0, 2**16))
def test_random_batches_match_oracle_in_tpu_interpreter(spec, seed):
    batch_kwargs, options, block_sizes = spec
    batch = make_ragged_batch(seed, **batch_kwargs)
    check(batch, make_options(batch, **options, seed=seed), use_jit=True, op=tpu_op(block_sizes))


def test_jit_with_donated_cache_updates_in_place():
    batch = make_ragged_batch(2, **_MIXED, **_G4, head_size=128, block_size=16, num_tokens=18)
    options = make_options(batch, alibi=True)
    static = {n: options.pop(n) for n in ("sm_scale", "causal", "sliding_window", "logits_soft_cap")}
    step = jax.jit(
        lambda *args, **kw: pallas_mosaic_tpu.ragged_paged_attention(*args, **static, block_sizes=SMALL, **kw),
        donate_argnums=3,
    )
    q, k, v, cache, *rest = batch.op_args
    cache = pallas_mosaic_tpu.from_reference_layout(cache)
    out, new_cache = step(q, k, v, cache, *rest, **options)
    assert cache.is_deleted()  # donated: the kernel's aliased output reused the buffer
    check_output(batch, {**static, **options}, out, pallas_mosaic_tpu.to_reference_layout(new_cache))


def test_kv_sharing_writes_nothing_eager_with_sinks():
    """k = v = None (a layer reading another layer's cache): the cache comes back unchanged.
    Called eagerly (concrete metadata: the host-side checks and schedule run)."""
    batch = make_ragged_batch(3, **_MIXED, **_G4, head_size=128, block_size=16, num_tokens=17)
    filled = pallas_mosaic_tpu.to_reference_layout(
        pallas_mosaic_tpu.write_to_tpu_kv_cache(
            pallas_mosaic_tpu.from_reference_layout(batch.kv_cache), batch.k, batch.v, batch.slot_mapping
        )
    )  # fmt: skip
    batch = dataclasses.replace(batch, kv_cache=filled)
    options = make_options(batch, sinks=True)
    out, new_cache = run_op(batch, options, use_jit=False, write=False, op=tpu_op(SMALL))
    np.testing.assert_array_equal(np.asarray(new_cache), np.asarray(filled))
    check_output(batch, options, out, new_cache)


LSE_CASES = {
    # name: (make_ragged_batch kwargs, op options, block sizes): decodes, prefills and padding rows
    "f32_h64_sinks_soft_cap": (dict(_MIXED, **_G4, head_size=64, block_size=16, num_tokens=17),
                               dict(sinks=True, logits_soft_cap=5.0), SMALL),
    "bf16_h128_window_two_kv_heads_per_block": (dict(_MIXED, num_q_heads=16, num_kv_heads=4, head_size=128,
                                                     block_size=16, num_tokens=18, dtype=jnp.bfloat16),
                                                dict(sliding_window=6), TpuBlockSizes(8, 1, kv_heads_per_block=2)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(LSE_CASES))
def test_lse_matches_the_oracle_in_tpu_interpreter(name):
    """``return_lse``: each row's log-sum-exp against the float64 oracle's; padding rows (no key)
    give the sink, or -inf without sinks."""
    batch_kwargs, option_kwargs, block_sizes = LSE_CASES[name]
    batch = make_ragged_batch(1, **batch_kwargs)
    options = make_options(batch, **option_kwargs)
    static = {n: options.pop(n) for n in ("sm_scale", "causal", "sliding_window", "logits_soft_cap")}
    step = jax.jit(
        lambda *args, **kw: pallas_mosaic_tpu.ragged_paged_attention(
            *args, **static, block_sizes=block_sizes, return_lse=True, **kw
        )
    )  # fmt: skip
    q, k, v, cache, *rest = batch.op_args
    out, new_cache, lse = step(q, k, v, pallas_mosaic_tpu.from_reference_layout(cache), *rest, **options)
    new_cache = pallas_mosaic_tpu.to_reference_layout(new_cache)
    check_output(batch, {**static, **options}, out, new_cache)
    k_seqs, v_seqs = read_back(batch, new_cache)
    _, expected = attention_oracle(
        np.asarray(batch.q, np.float64), k_seqs, v_seqs, batch.query_lens, **static, **options, return_lse=True
    )
    n, num_q_heads = batch.num_actual_tokens, batch.q.shape[1]
    assert lse.shape == (batch.q.shape[0], num_q_heads) and lse.dtype == jnp.float32
    tol = TOLERANCES[np.dtype(batch.q.dtype).name]
    np.testing.assert_allclose(np.asarray(lse[:n]), expected, rtol=tol.rtol, atol=tol.atol)
    padding = np.asarray(lse[n:])
    assert padding.shape[0] > 0
    if options["sinks"] is None:
        assert np.isneginf(padding).all(), "padding rows see no key: LSE -inf"
    else:
        np.testing.assert_allclose(padding, np.broadcast_to(options["sinks"], padding.shape), rtol=1e-6)


def test_lse_of_zero_tokens_is_empty():
    batch = make_ragged_batch(0, [0], [5], **_G4, head_size=64, block_size=16, num_tokens=0)
    q, k, v, cache, *rest = batch.op_args
    out, _, lse = pallas_mosaic_tpu.ragged_paged_attention(
        q, k, v, pallas_mosaic_tpu.from_reference_layout(cache), *rest, sm_scale=0.1, return_lse=True
    )
    assert out.shape == (0, 8, 64) and lse.shape == (0, 8) and lse.dtype == jnp.float32
