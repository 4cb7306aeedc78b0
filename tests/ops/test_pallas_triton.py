"""The Pallas GPU kernel against the float64 oracle and the jnp reference.

On the CPU the kernel runs in the Pallas interpreter (``interpret=True``) on small
ragged batches; the same bodies run compiled on a GPU (marker ``gpu``) at realistic
sizes. Batches come from ``make_ragged_batch``: unused cache slots hold NaN and padding
rows large finite garbage, so a stray read or write shows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_jax.ops.ragged_paged_attention import pallas_triton
from attn_jax.ops.ragged_paged_attention.config import GpuBlockSizes, gpu_block_sizes
from attn_jax.testing.workloads import make_ragged_batch
from tests.ops.ragged_checks import (
    NONFINITE_BATCH,
    NONFINITE_ENTRIES,
    check,
    check_nonfinite_output,
    make_options,
    rel_l2,
    run_op,
    with_nonfinite_entries,
)

ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (jax sees no 'gpu' backend)")

_SHAPE = dict(num_q_heads=8, num_kv_heads=2, head_size=32, block_size=16)
_MIXED = dict(query_lens=[1, 19, 1, 6], context_lens=[37, 0, 5, 20], **_SHAPE)
ONE_PASS = GpuBlockSizes(block_q=4, pages_per_tile=1)
SPLIT = GpuBlockSizes(block_q=4, pages_per_tile=1, num_kv_splits=3)

CASES: dict[str, tuple[dict, dict, GpuBlockSizes]] = {
    # name: (make_ragged_batch kwargs, op options, block sizes)
    "decode_only": (dict(query_lens=[1, 1, 1], context_lens=[40, 12, 0], **_SHAPE), {}, ONE_PASS),
    "decode_split_kv": (dict(query_lens=[1, 1], context_lens=[70, 3], **_SHAPE), dict(sinks=True), SPLIT),
    "prefill_only_q_len_eq_kv_len": (dict(query_lens=[17, 3], context_lens=[0, 0], **_SHAPE), {}, ONE_PASS),
    "mixed_with_padding": (dict(_MIXED, num_tokens=33, num_padding_requests=1, extra_blocks=2), {}, ONE_PASS),
    "mixed_split_kv": (_MIXED, {}, SPLIT),
    "empty_requests": (dict(query_lens=[0, 3, 0, 1], context_lens=[6, 2, 0, 4], **_SHAPE), {}, ONE_PASS),
    "mha_head_64_page_32": (
        dict(_MIXED, num_q_heads=2, num_kv_heads=2, head_size=64, block_size=32),
        {},
        GpuBlockSizes(block_q=16, pages_per_tile=1),
    ),
    "gqa_8_head_128": (
        dict(_MIXED, num_q_heads=8, num_kv_heads=1, head_size=128),
        {},
        GpuBlockSizes(block_q=2, pages_per_tile=2),
    ),
    "gqa_3_padded_group": (dict(_MIXED, num_q_heads=6, num_kv_heads=2), {}, ONE_PASS),
    "non_causal_window": (_MIXED, dict(causal=False, sliding_window=4), ONE_PASS),
    "sliding_window": (_MIXED, dict(sliding_window=7), SPLIT),
    "soft_cap_alibi_sinks": (dict(_MIXED, num_tokens=30), dict(logits_soft_cap=2.0, alibi=True, sinks=True), ONE_PASS),
    "bfloat16": (dict(_MIXED, dtype=jnp.bfloat16), dict(sinks=True), ONE_PASS),
    "float16": (dict(_MIXED, dtype=jnp.float16), dict(alibi=True), ONE_PASS),
    "fp8_e4m3": (dict(_MIXED, cache_dtype_str="fp8_e4m3", extra_blocks=2), {}, ONE_PASS),
    "fp8_e5m2_bf16": (dict(_MIXED, dtype=jnp.bfloat16, cache_dtype_str="fp8_e5m2"), dict(sliding_window=9), SPLIT),
    # Head sizes that are not powers of two: loaded into a power-of-two tile, the rest masked.
    "head_80_mixed": (dict(_MIXED, head_size=80, extra_blocks=1), dict(sinks=True), ONE_PASS),
    "head_96_decode_split_kv": (dict(query_lens=[1, 1], context_lens=[70, 3], **dict(_SHAPE, head_size=96)), {}, SPLIT),
    "sub_page_tiles_split_kv": (
        dict(_MIXED, block_size=64, extra_blocks=1),
        dict(sliding_window=30),
        GpuBlockSizes(block_q=4, pages_per_tile=1, num_kv_splits=2, keys_per_tile=16),
    ),
    "head_112_fp8_cache_split_kv": (
        dict(_MIXED, head_size=112, cache_dtype_str="fp8_e4m3", extra_blocks=2),
        dict(alibi=True),
        SPLIT,
    ),
    "head_24_bf16_window": (dict(_MIXED, head_size=24, dtype=jnp.bfloat16), dict(sliding_window=5), ONE_PASS),
    # Adjacent KV heads packed into one tile (kv_heads_per_program): 4 KV heads in programs of
    # 3 + 1, a head group of 3 padded to 4; all heads of a request in one program; fp8.
    "head_80_pack_3_decode_split_kv": (
        dict(
            query_lens=[1, 1, 1],
            context_lens=[70, 3, 33],
            num_q_heads=12,
            num_kv_heads=4,
            head_size=80,
            block_size=16,
            extra_blocks=1,
        ),
        dict(sinks=True, logits_soft_cap=3.0),
        GpuBlockSizes(block_q=1, pages_per_tile=2, num_kv_splits=2, kv_heads_per_program=3),
    ),  # fmt: skip
    "head_96_pack_2_mixed": (
        dict(_MIXED, head_size=96, num_tokens=33, dtype=jnp.bfloat16),
        dict(alibi=True, sliding_window=9),
        GpuBlockSizes(block_q=4, pages_per_tile=1, kv_heads_per_program=2),
    ),
    "head_40_pack_3_fp8": (
        dict(_MIXED, num_q_heads=6, num_kv_heads=3, head_size=40, cache_dtype_str="fp8_e4m3", extra_blocks=2),
        {},
        GpuBlockSizes(block_q=4, pages_per_tile=1, num_kv_splits=3, kv_heads_per_program=3),
    ),
}


# A mixed batch's decodes on decode blocks beside the other rows' q-blocks, one launch: (batch,
# options, the other rows' blocks, the decodes' blocks).
DECODE_PART_CASES: dict[str, tuple[dict, dict, GpuBlockSizes, GpuBlockSizes]] = {
    "padding_wider_decode_tiles": (
        dict(_MIXED, num_tokens=33, num_padding_requests=1, extra_blocks=2),
        {},
        ONE_PASS,
        GpuBlockSizes(4, 2),
    ),
    "head_80_decodes_pack_3_sinks_soft_cap": (
        dict(_MIXED, num_q_heads=12, num_kv_heads=4, head_size=80, extra_blocks=1),
        dict(sinks=True, logits_soft_cap=3.0),
        ONE_PASS,
        GpuBlockSizes(block_q=1, pages_per_tile=2, kv_heads_per_program=3),
    ),
    "fp8_window_alibi": (
        dict(_MIXED, dtype=jnp.bfloat16, cache_dtype_str="fp8_e4m3", extra_blocks=2),
        dict(sliding_window=9, alibi=True),
        ONE_PASS,
        GpuBlockSizes(4, 2),
    ),
}


def _op(block_sizes, interpret, decode_block_sizes=None):
    return functools.partial(pallas_triton.ragged_paged_attention, block_sizes=block_sizes, interpret=interpret,
                             decode_block_sizes=decode_block_sizes)  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_oracle_interpret(name):
    batch_kwargs, options, bs = CASES[name]
    batch = make_ragged_batch(0, **batch_kwargs)
    check(batch, make_options(batch, **options), use_jit=True, op=_op(bs, True))


@pytest.mark.parametrize("name", list(DECODE_PART_CASES))
def test_decode_part_matches_oracle_interpret(name):
    batch_kwargs, options, bs, decode_bs = DECODE_PART_CASES[name]
    batch = make_ragged_batch(0, **batch_kwargs)
    check(batch, make_options(batch, **options), use_jit=True, op=_op(bs, True, decode_bs))


@pytest.mark.parametrize(
    ("decode_bs", "match"),
    [
        (GpuBlockSizes(4, 2, num_warps=8), r"their \{.*'num_warps': 8.*\} must equal block_sizes'"),
        (GpuBlockSizes(4, 2, num_kv_splits=2), r"with one KV split"),
        (GpuBlockSizes(1, 2), r"gives 4 rows .* at least 16"),
    ],
)
def test_decode_part_that_cannot_share_the_launch_is_named(decode_bs, match):
    batch = make_ragged_batch(0, **_MIXED)
    with pytest.raises(ValueError, match=match):
        run_op(batch, make_options(batch), use_jit=False, op=_op(ONE_PASS, True, decode_bs))


@pytest.mark.parametrize(
    ("bs", "window"),
    [(GpuBlockSizes(8, 1), 4), (GpuBlockSizes(8, 1, num_kv_splits=2), None)],
    ids=["one_pass_window", "split_kv"],
)
def test_nonfinite_inputs_reach_exactly_the_rows_that_see_them_interpret(bs, window):
    batch = with_nonfinite_entries(make_ragged_batch(0, **NONFINITE_BATCH))
    options = make_options(batch, sliding_window=window)
    out, _ = run_op(batch, options, use_jit=True, op=_op(bs, interpret=True))
    check_nonfinite_output(batch, options, out)


def test_nonfinite_inputs_with_packed_kv_heads_stay_in_their_request_interpret():
    """Packed KV heads share a tile, so a non-finite cached or new key / value may reach the
    rows of the heads packed with it in its request (``0 * NaN`` in ``q @ k.T``); never other
    requests' rows, nor rows that do not see its position."""
    entries = [e for e in NONFINITE_ENTRIES if e[0] == "q"] + [  # each kv entry on one head of 2, spread to both
        (what, where, 0, value) for what, where, _, value in NONFINITE_ENTRIES if what != "q"
    ]
    spread = entries + [(what, where, 1, value) for what, where, _, value in entries if what != "q"]
    batch = make_ragged_batch(0, **NONFINITE_BATCH)
    bs = GpuBlockSizes(4, 1, kv_heads_per_program=2)
    for window in (4, None):
        options = make_options(batch, sliding_window=window)
        out, _ = run_op(with_nonfinite_entries(batch, entries), options, use_jit=True, op=_op(bs, interpret=True))
        check_nonfinite_output(with_nonfinite_entries(batch, entries), options, out,
                               upper=with_nonfinite_entries(batch, spread))  # fmt: skip


def test_kv_sharing_writes_nothing_and_matches_reference():
    batch = make_ragged_batch(1, **_MIXED)
    options = make_options(batch)
    out, cache = run_op(batch, options, use_jit=False, write=False, op=_op(ONE_PASS, True))
    np.testing.assert_array_equal(np.isnan(np.asarray(cache)), np.isnan(np.asarray(batch.kv_cache)))
    ref, _ = run_op(batch, options, use_jit=False, write=False)
    n = batch.num_actual_tokens
    np.testing.assert_allclose(np.asarray(out)[:n], np.asarray(ref)[:n], rtol=1e-5, atol=1e-5)


def test_jit_with_cache_donated_updates_in_place():
    batch = make_ragged_batch(2, **_MIXED)
    step = jax.jit(
        functools.partial(pallas_triton.ragged_paged_attention, sm_scale=0.2, block_sizes=ONE_PASS, interpret=True),
        donate_argnums=3,
    )
    q, k, v, cache, *rest = batch.op_args
    cache = jnp.array(cache)  # a buffer this test owns
    lowered = step.lower(q, k, v, cache, *rest).as_text()
    assert "tf.aliasing_output" in lowered or "jax.buffer_donor" in lowered
    out, new_cache = step(q, k, v, cache, *rest)
    assert cache.is_deleted(), "the donated cache buffer should have been reused"
    assert np.isfinite(np.asarray(out)).all()


@st.composite
def _specs(draw):
    num_reqs = draw(st.integers(1, 4))
    query_lens = draw(st.lists(st.integers(0, 9), min_size=num_reqs, max_size=num_reqs))
    heads = draw(st.sampled_from([(2, 2), (8, 2), (4, 1), (6, 3), (8, 1)]))
    batch_kwargs = dict(
        query_lens=query_lens,
        context_lens=draw(st.lists(st.integers(0, 40), min_size=num_reqs, max_size=num_reqs)),
        num_q_heads=heads[0], num_kv_heads=heads[1], head_size=32,
        block_size=draw(st.sampled_from([16, 32])),
        dtype=jnp.dtype(draw(st.sampled_from(["float32", "bfloat16"]))),
        num_tokens=sum(query_lens) + draw(st.integers(0, 3)),
        extra_blocks=draw(st.integers(0, 2)),
    )  # fmt: skip
    options = dict(
        causal=draw(st.booleans()),
        sliding_window=draw(st.none() | st.integers(1, 20)),
        logits_soft_cap=draw(st.sampled_from([None, 3.0])),
        alibi=draw(st.booleans()),
        sinks=draw(st.booleans()),
    )
    bs = GpuBlockSizes(
        block_q=draw(st.sampled_from([2, 4, 8])),
        pages_per_tile=draw(st.sampled_from([1, 2])),
        num_kv_splits=draw(st.sampled_from([1, 2])),
    )
    return draw(st.integers(0, 2**16)), batch_kwargs, options, bs


@settings(max_examples=5, deadline=None)
@given(spec=_specs())
def test_random_batches_match_oracle_interpret(spec):
    seed, batch_kwargs, options, bs = spec
    group = batch_kwargs["num_q_heads"] // batch_kwargs["num_kv_heads"]
    bs = GpuBlockSizes(max(bs.block_q, 16 // pallas_triton.next_pow2(group)), bs.pages_per_tile, bs.num_kv_splits)
    batch = make_ragged_batch(seed, **batch_kwargs)
    check(batch, make_options(batch, **options), use_jit=True, op=_op(bs, True))


def test_default_block_sizes_run_and_split_long_decodes():
    bs = gpu_block_sizes(num_reqs=2, pages_per_req=256, page_size=16, head_size=128, num_kv_heads=8,
                         group=4, mode="decode")  # fmt: skip
    assert bs.num_kv_splits > 1 and bs.block_q * 4 >= 16
    mixed = gpu_block_sizes(num_reqs=2, pages_per_req=256, page_size=16, head_size=128, num_kv_heads=8,
                            group=4, mode="mixed")  # fmt: skip
    assert mixed.num_kv_splits == 1
    batch = make_ragged_batch(3, query_lens=[1, 1], context_lens=[30, 2], **_SHAPE)
    check(
        batch,
        make_options(batch),
        use_jit=False,
        op=functools.partial(pallas_triton.ragged_paged_attention, interpret=True),
    )


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("bs", "match"),
    [
        (GpuBlockSizes(block_q=3, pages_per_tile=1), "block_q=3 must be a power of two"),
        (GpuBlockSizes(block_q=1, pages_per_tile=1), "gives 4 rows .* needs at least 16"),
        (GpuBlockSizes(block_q=4, pages_per_tile=0), "pages_per_tile=0 must be a positive int"),
    ],
)
def test_bad_block_sizes_are_named(bs, match):
    batch = make_ragged_batch(0, **_MIXED)
    with pytest.raises(ValueError, match=match):
        run_op(batch, make_options(batch), use_jit=False, op=_op(bs, True))


@pytest.mark.parametrize(("head_size", "block_size", "match"), [
    (100, 16, r"head_size=100 is not supported by the Pallas GPU kernel; supported: multiples of 8 up to 256"),
    (264, 16, r"head_size=264 is not supported by the Pallas GPU kernel; supported: multiples of 8 up to 256"),
    (32, 12, r"page_size=12 is not supported by the Pallas GPU kernel; supported: \[1, 2, 4"),
])  # fmt: skip
def test_unsupported_shapes_are_named(head_size, block_size, match):
    batch = make_ragged_batch(0, query_lens=[2], context_lens=[3], num_q_heads=4, num_kv_heads=2,
                              head_size=head_size, block_size=block_size)  # fmt: skip
    with pytest.raises(ValueError, match=match):
        run_op(batch, make_options(batch), use_jit=False, op=_op(None, True))


def test_schedule_of_wrong_block_q_is_rejected():
    batch = make_ragged_batch(0, **_MIXED)
    sched = pallas_triton.gpu_schedule(np.asarray(batch.query_start_loc), np.asarray(batch.seq_lens),
                                    num_tokens=batch.q.shape[0], block_q=8, xp=np)  # fmt: skip
    with pytest.raises(ValueError, match=r"schedule.shape=.* must be .* block_q=4"):
        run_op(batch, make_options(batch), use_jit=False,
               op=functools.partial(_op(ONE_PASS, True), schedule=sched))  # fmt: skip


def test_host_and_traced_schedules_agree():
    batch = make_ragged_batch(0, **dict(_MIXED, num_tokens=40, num_padding_requests=2))
    args = (np.asarray(batch.query_start_loc), np.asarray(batch.seq_lens))
    host = pallas_triton.gpu_schedule(*args, num_tokens=40, block_q=4, xp=np)
    step = jax.jit(lambda a, b: pallas_triton.gpu_schedule(a, b, num_tokens=40, block_q=4))
    np.testing.assert_array_equal(host, np.asarray(step(*args)))
    assert "while" not in step.lower(*args).as_text()  # no device loop: a GPU reads a loop's predicate back
    req, start, end = host[0], host[1], host[2]
    covered = np.zeros(40, int)
    for s, e in zip(start, end, strict=True):
        covered[s:e] += 1
    assert (covered == 1).all(), "every token row (padding included) belongs to exactly one q-block"
    assert (req < len(batch.seq_lens)).all()


def test_mixed_schedule_gives_each_decode_one_block_of_its_own():
    batch = make_ragged_batch(0, **dict(_MIXED, num_tokens=40, num_padding_requests=2))
    args = (np.asarray(batch.query_start_loc), np.asarray(batch.seq_lens))
    num_reqs = len(batch.seq_lens)
    host = pallas_triton.mixed_schedule(*args, num_tokens=40, block_q=4, xp=np)
    step = jax.jit(lambda a, b: pallas_triton.mixed_schedule(a, b, num_tokens=40, block_q=4))
    np.testing.assert_array_equal(host, np.asarray(step(*args)))
    decodes, rest = host[:, :num_reqs], host[:, num_reqs:]
    covered = np.zeros(40, int)
    for s, e in zip(host[1], host[2], strict=True):
        covered[s:e] += 1
    assert (covered == 1).all(), "every token row (padding included) belongs to exactly one q-block"
    is_decode = np.diff(args[0]) == 1
    real = decodes[:, decodes[2] > decodes[1]]
    assert sorted(real[0]) == list(np.flatnonzero(is_decode)), "a block per decode, in the decode part only"
    np.testing.assert_array_equal(real[4], args[1][real[0]])  # the KV length: the whole sequence
    np.testing.assert_array_equal(real[3], real[4] - 1)  # the token's position: the last
    assert not np.isin(rest[0, rest[2] > rest[1]], np.flatnonzero(is_decode)).any()


# ------------------------------------------------------------------ on a GPU
@gpu
@needs_gpu
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_oracle_compiled(name):
    batch_kwargs, options, bs = CASES[name]
    batch = make_ragged_batch(0, **batch_kwargs)
    check(batch, make_options(batch, **options), use_jit=True, op=_op(bs, False))


@gpu
@needs_gpu
@pytest.mark.parametrize("name", list(DECODE_PART_CASES))
def test_decode_part_matches_oracle_compiled(name):
    batch_kwargs, options, bs, decode_bs = DECODE_PART_CASES[name]
    batch = make_ragged_batch(0, **batch_kwargs)
    check(batch, make_options(batch, **options), use_jit=True, op=_op(bs, False, decode_bs))


@gpu
@needs_gpu
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize(
    "lens", [([1] * 16, [700] * 16), ([300, 1, 1, 64], [200, 1000, 3000, 0])], ids=["decode", "mixed"]
)
def test_realistic_sizes_match_reference_compiled(lens, cache_dtype):
    batch = make_ragged_batch(4, *lens, num_q_heads=32, num_kv_heads=8, head_size=128, block_size=16,
                              dtype=jnp.bfloat16, cache_dtype_str=cache_dtype, extra_blocks=4)  # fmt: skip
    options = make_options(batch, sinks=True, sliding_window=1024)
    out, _ = run_op(batch, options, use_jit=True, op=functools.partial(pallas_triton.ragged_paged_attention))
    f32 = dataclasses_replace_f32(batch)
    ref, _ = run_op(f32, options, use_jit=True)
    n = batch.num_actual_tokens
    assert rel_l2(np.asarray(out, np.float32)[:n], np.asarray(ref)[:n]) < 1e-2


def dataclasses_replace_f32(batch):
    import dataclasses

    cache = batch.kv_cache if batch.k_scale is not None else batch.kv_cache.astype(jnp.float32)
    return dataclasses.replace(batch, q=batch.q.astype(jnp.float32), k=batch.k.astype(jnp.float32),
                               v=batch.v.astype(jnp.float32), kv_cache=cache)  # fmt: skip


@gpu
@needs_gpu
def test_no_recompile_within_a_bucket():
    from attn_jax.ops.ragged_paged_attention.config import GpuBlockSizes as BS

    bs = BS(block_q=4, pages_per_tile=4)
    step = jax.jit(functools.partial(pallas_triton.ragged_paged_attention, sm_scale=0.1, block_sizes=bs))
    for seed, lens in enumerate(([1, 7, 1], [3, 1, 5], [1, 1, 1])):
        batch = make_ragged_batch(seed, lens, [50, 9, 120], num_q_heads=8, num_kv_heads=2, head_size=64,
                                  block_size=16, num_tokens=16, extra_blocks=20 - 0)  # fmt: skip
        cache = jnp.zeros((2, 40, 16, 2, 64), jnp.float32).at[:, : batch.kv_cache.shape[1]].set(batch.kv_cache)
        tables = jnp.zeros((3, 8), jnp.int32).at[:, : batch.block_tables.shape[1]].set(batch.block_tables)
        step(batch.q, batch.k, batch.v, cache, batch.query_start_loc, batch.seq_lens, tables, batch.slot_mapping)
    assert step._cache_size() == 1
