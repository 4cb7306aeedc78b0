"""Tests for the shared ragged paged attention workloads (batch construction, specs)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.testing.workloads import WORKLOADS, make_ragged_batch


@pytest.mark.parametrize("shuffle_blocks", [True, False])
@pytest.mark.parametrize("cache_dtype_str", ["auto", "fp8_e5m2"])
def test_batch_layout(shuffle_blocks, cache_dtype_str):
    query_lens, context_lens, block_size = [2, 0, 1, 0], [3, 5, 0, 0], 2
    batch = make_ragged_batch(
        0, query_lens, context_lens, num_q_heads=4, num_kv_heads=2, head_size=8,
        block_size=block_size, cache_dtype_str=cache_dtype_str, num_tokens=6, extra_blocks=2,
        num_padding_requests=1, shuffle_blocks=shuffle_blocks,
    )  # fmt: skip
    np.testing.assert_array_equal(batch.query_lens, [2, 0, 1, 0, 0])
    np.testing.assert_array_equal(batch.seq_lens, [5, 5, 1, 0, 0])
    np.testing.assert_array_equal(batch.query_start_loc, [0, 2, 2, 3, 3, 3])
    assert batch.num_actual_tokens == 3
    assert batch.q.shape == (6, 4, 8) and batch.k.shape == batch.v.shape == (6, 2, 8)
    # ceil(seq_len / 2) pages each: 3 + 3 + 1 = 7 used, plus 2 extra.
    assert batch.kv_cache.shape == (2, 9, 2, 2, 8) and batch.block_tables.shape == (5, 3)
    tables = np.asarray(batch.block_tables)
    used = np.concatenate([tables[0, :3], tables[1, :3], tables[2, :1]])
    assert len(set(used.tolist())) == 7 and ((tables >= 0) & (tables < 9)).all()
    if not shuffle_blocks:
        np.testing.assert_array_equal(used, np.arange(7))
    # New tokens sit at positions context .. seq_len - 1; padding rows are finite, slot -1.
    expected_slots = [tables[0, 1] * 2 + 1, tables[0, 2] * 2, tables[2, 0] * 2, -1, -1, -1]
    np.testing.assert_array_equal(batch.slot_mapping, expected_slots)
    np.testing.assert_array_equal(np.asarray(batch.k)[:2], batch.k_seqs[0][3:])
    np.testing.assert_array_equal(np.asarray(batch.v)[2], batch.v_seqs[2][0])
    for x in (batch.q, batch.k, batch.v):
        assert np.isfinite(np.asarray(x, np.float32)).all()
    assert [len(s) for s in batch.k_seqs] == [5, 5, 1, 0, 0]
    # The cache holds exactly the 8 context tokens; everything else is NaN.
    filled = ~np.isnan(np.asarray(batch.kv_cache, np.float32)).reshape(2, 18, -1).any(-1)
    assert filled.sum() == 2 * 8
    if cache_dtype_str == "auto":
        assert batch.k_scale is None and batch.op_kwargs == {}
        assert batch.kv_cache.dtype == jnp.float32
    else:
        assert batch.k_scale > 0 and set(batch.op_kwargs) == {"k_scale", "v_scale"}
        assert batch.kv_cache.dtype == jnp.float8_e5m2


def test_default_fp8_scales_follow_vllm_rule():
    batch = make_ragged_batch(1, [3], [4], num_q_heads=2, num_kv_heads=1, head_size=8, block_size=4,
                              cache_dtype_str="fp8")  # fmt: skip
    assert batch.k_scale == pytest.approx(np.abs(batch.k_seqs[0]).max() / 200.0)
    assert batch.v_scale == pytest.approx(np.abs(batch.v_seqs[0]).max() / 100.0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_activation_dtype(dtype):
    batch = make_ragged_batch(2, [1], [2], num_q_heads=2, num_kv_heads=2, head_size=8, block_size=2, dtype=dtype)
    assert batch.q.dtype == batch.k.dtype == batch.kv_cache.dtype == jnp.dtype(dtype)
    assert batch.k_seqs[0].dtype == jnp.dtype(dtype)


_SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_size=8, block_size=4)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (([1, 2], [3]), _SHAPE, "query_lens and context_lens must have the same length, got 2 and 1"),
        (([1, -1], [0, 0]), _SHAPE, "query_lens[1] must be an int >= 0, got -1"),
        (([1], [1.5]), _SHAPE, "context_lens[0] must be an int >= 0, got 1.5"),
        (([], []), _SHAPE, "a batch needs at least one request"),
        (([1], [0]), dict(_SHAPE, num_kv_heads=3), "num_q_heads=4 must be divisible by num_kv_heads=3"),
        (([1], [0]), dict(_SHAPE, block_size=0), "block_size must be an int >= 1, got 0"),
        (([2], [0]), dict(_SHAPE, num_tokens=1), "num_tokens must be an int >= 2, got 1"),
        (([1], [0]), dict(_SHAPE, extra_blocks=-1), "extra_blocks must be an int >= 0, got -1"),
        (([1], [0]), dict(_SHAPE, k_scale=0.5), "k_scale/v_scale apply to fp8 caches only"),
    ],
)
def test_make_ragged_batch_rejects_bad_arguments(args, kwargs, message):
    with pytest.raises(ValueError) as info:
        make_ragged_batch(0, *args, **kwargs)
    assert message in str(info.value)


def test_benchmark_workloads_match_design():
    design = {"D1", "D2", "M1", "P1", "M2"}  # M2: a serving step, not DESIGN.md's
    assert set(WORKLOADS) == design | {"E1", "E64", "E256", "EM64", "EM256", "EA256", "EA256R"}
    for spec in (WORKLOADS[name] for name in design):
        assert (spec.num_q_heads, spec.num_kv_heads, spec.head_size, spec.block_size) == (32, 8, 128, 16)
        assert spec.dtype == "bfloat16" and spec.causal
        assert len(spec.query_lens) == len(spec.context_lens)
    assert WORKLOADS["D1"].query_lens == (1,) * 64 and set(WORKLOADS["D1"].context_lens) == {4096}
    assert WORKLOADS["D2"].query_lens == (1,) * 8 and set(WORKLOADS["D2"].context_lens) == {32768}
    m1 = WORKLOADS["M1"]
    assert sorted(zip(m1.query_lens, m1.context_lens, strict=True)) == [(1, 2048)] * 60 + [(512, 1024)] * 4
    assert WORKLOADS["P1"].query_lens == (4096,) * 4 and WORKLOADS["P1"].context_lens == (0,) * 4
    m2 = WORKLOADS["M2"]
    assert sorted(zip(m2.query_lens, m2.context_lens, strict=True)) == [(1, 2048)] * 63 + [(512, 1024)]
    for n in (1, 64, 256):  # the engine's decode steps on SmolLM2-135M's heads (generate_gpu.py)
        e = WORKLOADS[f"E{n}"]
        assert (e.num_q_heads, e.num_kv_heads, e.head_size, e.block_size) == (9, 3, 64, 16)
        assert e.query_lens == (1,) * n and e.context_lens == (256,) * n
    ea, reordered = WORKLOADS["EA256"], WORKLOADS["EA256R"]  # the server's admission step, and prompts first
    assert ea.query_lens == (1,) * 151 + (128,) * 14 and ea.context_lens == (256,) * 151 + (0,) * 14
    pairs = [sorted(zip(w.query_lens, w.context_lens, strict=True)) for w in (ea, reordered)]
    assert pairs[0] == pairs[1]
    assert reordered.query_lens[:14] == (128,) * 14 and (ea.num_q_heads, ea.head_size) == (9, 64)


def test_workload_make_batch_with_overrides():
    batch = WORKLOADS["M1"].make_batch(0, num_q_heads=2, num_kv_heads=1, head_size=8, dtype=jnp.float32)
    assert batch.q.shape == (4 * 512 + 60, 2, 8)
    np.testing.assert_array_equal(batch.seq_lens, [1536] * 4 + [2049] * 60)
