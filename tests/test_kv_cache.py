"""Tests for attn_jax.kv_cache: allocation, slot-mapped writes, fp8 quantisation, scales."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_jax.backends.xla import XLAAttentionBackend
from attn_jax.kv_cache import (
    MIN_SCALE,
    allocate_kv_cache,
    calc_kv_scales,
    dequantize_from_cache,
    quantize_to_cache,
    write_to_kv_cache,
)
from tests.oracle import assert_cache_entries_equal, cache_contents


def _cache(num_blocks=4, block_size=2, num_kv_heads=2, head_size=8, cache_dtype_str="auto", dtype=jnp.float32):
    return allocate_kv_cache(
        XLAAttentionBackend, num_blocks, block_size, num_kv_heads, head_size,
        cache_dtype_str, model_dtype=dtype, fill=jnp.nan,
    )  # fmt: skip


def _kv(rng, num_tokens, num_kv_heads=2, head_size=8, dtype=np.float32):
    shape = (num_tokens, num_kv_heads, head_size)
    return rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype)


# --- allocate_kv_cache -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cache_dtype_str", "model_dtype", "expected"),
    [
        ("auto", jnp.bfloat16, jnp.bfloat16),
        ("auto", jnp.float32, jnp.float32),
        ("auto", jnp.float16, jnp.float16),
        ("bfloat16", jnp.float32, jnp.bfloat16),
        ("float32", jnp.bfloat16, jnp.float32),
        ("fp8", jnp.bfloat16, jnp.float8_e4m3fn),
        ("fp8_e4m3", jnp.float32, jnp.float8_e4m3fn),
        ("fp8_e5m2", jnp.float16, jnp.float8_e5m2),
    ],
)
def test_allocate_shape_dtype_and_fill(cache_dtype_str, model_dtype, expected):
    cache = allocate_kv_cache(XLAAttentionBackend, 3, 4, 2, 8, cache_dtype_str, model_dtype, fill=jnp.nan)
    assert cache.shape == XLAAttentionBackend.get_kv_cache_shape(3, 4, 2, 8, cache_dtype_str)
    assert cache.shape == (2, 3, 4, 2, 8)
    assert cache.dtype == jnp.dtype(expected)
    assert np.isnan(np.asarray(cache, np.float32)).all()


def test_allocate_default_fill_is_zero_in_model_dtype():
    cache = allocate_kv_cache(XLAAttentionBackend, 1, 2, 1, 8)
    assert cache.dtype == jnp.bfloat16
    assert not np.asarray(cache, np.float32).any()


@pytest.mark.parametrize("arg", ["num_blocks", "block_size", "num_kv_heads", "head_size"])
@pytest.mark.parametrize("bad", [0, -1, 2.0, True, None])
def test_allocate_rejects_non_positive_int(arg, bad):
    kwargs = dict(num_blocks=2, block_size=2, num_kv_heads=1, head_size=8)
    kwargs[arg] = bad
    with pytest.raises(ValueError, match=re.escape(f"{arg}={bad!r} must be a positive integer")):
        allocate_kv_cache(XLAAttentionBackend, **kwargs)


def test_allocate_rejects_unknown_cache_dtype():
    with pytest.raises(ValueError, match="Invalid kv_cache_dtype: 'int8'.*fp8_e5m2"):
        allocate_kv_cache(XLAAttentionBackend, 2, 2, 1, 8, "int8")


# --- quantize_to_cache / dequantize_from_cache --------------------------------------------


@pytest.mark.parametrize("fp8", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_quantize_saturates_instead_of_overflowing(fp8):
    limit = float(jnp.finfo(fp8).max)
    x = jnp.array([1e30, -1e30, 3 * limit, -3 * limit, 0.0], jnp.float32)
    q = np.asarray(quantize_to_cache(x, fp8, 2.0), np.float32)
    np.testing.assert_array_equal(q, [limit, -limit, limit, -limit, 0.0])


@pytest.mark.parametrize("cache_dtype_str", ["fp8_e4m3", "fp8_e5m2"])
def test_quantize_divides_by_scale_and_matches_ml_dtypes(cache_dtype_str):
    x = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    scale = 0.02
    fp8 = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}[cache_dtype_str]
    q = quantize_to_cache(jnp.asarray(x), fp8, jnp.float32(scale))
    assert q.dtype == jnp.dtype(fp8)
    expected = cache_contents(x, cache_dtype_str, scale)
    assert_cache_entries_equal(np.asarray(q, np.float64), expected, cache_dtype_str)


def test_quantize_default_scale_is_one_and_nan_stays_nan():
    q = quantize_to_cache(jnp.array([1.5, jnp.nan]), jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(q, np.float32), [1.5, np.nan])


@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_quantize_non_fp8_is_plain_cast_ignoring_scale(cache_dtype):
    x = jnp.array([1.0, -2.5, 1e3], jnp.float32)
    q = quantize_to_cache(x, cache_dtype, 7.0)
    assert q.dtype == jnp.dtype(cache_dtype)
    np.testing.assert_array_equal(np.asarray(q, np.float32), [1.0, -2.5, 1e3])
    np.testing.assert_array_equal(np.asarray(dequantize_from_cache(q, 7.0), np.float32), [1.0, -2.5, 1e3])


@pytest.mark.parametrize("fp8", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_dequantize_multiplies_by_scale(fp8, out_dtype):
    x = jnp.array([1.0, -2.0, 0.5], fp8)
    d = dequantize_from_cache(x, jnp.float32(0.25), out_dtype)
    assert d.dtype == jnp.dtype(out_dtype)
    np.testing.assert_array_equal(np.asarray(d, np.float32), [0.25, -0.5, 0.125])


@pytest.mark.parametrize(("fp8", "rel"), [(jnp.float8_e4m3fn, 2**-4), (jnp.float8_e5m2, 2**-3)])
def test_quantize_round_trip_error_is_half_an_fp8_ulp(fp8, rel):
    x = jnp.asarray(np.random.default_rng(1).uniform(0.5, 4.0, 256), jnp.float32)
    scale = jnp.max(jnp.abs(x)) / 100.0
    back = dequantize_from_cache(quantize_to_cache(x, fp8, scale), scale)
    np.testing.assert_array_less(np.abs(np.asarray(back - x)), rel * np.abs(np.asarray(x)) + 1e-7)


def test_scale_must_have_one_element():
    with pytest.raises(ValueError, match=r"^scale must be a scalar or have one element, got shape \(2,\)"):
        quantize_to_cache(jnp.ones(3), jnp.float8_e4m3fn, jnp.ones(2))
    cache, key = _cache(cache_dtype_str="fp8"), np.ones((1, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"^v_scale must be a scalar or have one element, got shape \(1, 2\)"):
        write_to_kv_cache(cache, key, key, np.array([0], np.int32), 1.0, np.ones((1, 2)))


# --- write_to_kv_cache ---------------------------------------------------------------------


def test_write_places_tokens_at_slots_and_skips_minus_one():
    rng = np.random.default_rng(0)
    cache = _cache()  # 4 pages x 2 slots = 8 slots
    key, value = _kv(rng, 4)
    slots = np.array([5, -1, 0, 7], np.int32)
    new = np.asarray(write_to_kv_cache(cache, key, value, slots))
    flat = new.reshape(2, 8, 2, 8)
    for t, s in enumerate(slots):
        if s >= 0:
            np.testing.assert_array_equal(flat[0, s], key[t])
            np.testing.assert_array_equal(flat[1, s], value[t])
    untouched = np.setdiff1d(np.arange(8), slots)
    assert np.isnan(flat[:, untouched]).all()


def test_minus_one_does_not_wrap_to_last_slot():
    rng = np.random.default_rng(1)
    cache = _cache()
    key, value = _kv(rng, 3)
    new = np.asarray(write_to_kv_cache(cache, key, value, np.array([-1, -1, 2], np.int32)))
    assert np.isnan(new[:, -1, -1]).all(), "slot -1 wrote to the cache's last slot"
    assert np.isnan(new.reshape(2, 8, 2, 8)[:, [0, 1, 3, 4, 5, 6, 7]]).all()


def test_write_jit_with_donated_cache():
    rng = np.random.default_rng(2)
    key, value = _kv(rng, 3)
    slots = jnp.array([1, 6, -1], jnp.int32)
    expected = np.asarray(write_to_kv_cache(_cache(), key, value, slots))
    write = jax.jit(write_to_kv_cache, donate_argnums=0)
    new = write(_cache(), key, value, slots)
    np.testing.assert_array_equal(np.asarray(new), expected)


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("cache_dtype_str", ["fp8", "fp8_e5m2"])
def test_write_quantizes_for_fp8_caches(cache_dtype_str, use_jit):
    rng = np.random.default_rng(3)
    cache = _cache(cache_dtype_str=cache_dtype_str)
    key, value = _kv(rng, 2)
    k_scale, v_scale = 0.01, 0.02
    write = jax.jit(write_to_kv_cache) if use_jit else write_to_kv_cache
    new = write(cache, key, value, jnp.array([3, 4], jnp.int32), jnp.float32(k_scale), jnp.float32(v_scale))
    flat = np.asarray(new, np.float64).reshape(2, 8, 2, 8)
    assert_cache_entries_equal(flat[0, 3:5], cache_contents(key, cache_dtype_str, k_scale), cache_dtype_str)
    assert_cache_entries_equal(flat[1, 3:5], cache_contents(value, cache_dtype_str, v_scale), cache_dtype_str)
    assert np.isnan(flat[:, [0, 1, 2, 5, 6, 7]]).all()


def test_write_fp8_default_scales_are_one():
    cache = _cache(cache_dtype_str="fp8")
    key = np.full((1, 2, 8), 1.75, np.float32)
    new = np.asarray(write_to_kv_cache(cache, key, -key, np.array([0], np.int32)), np.float32)
    np.testing.assert_array_equal(new[0, 0, 0], key[0])
    np.testing.assert_array_equal(new[1, 0, 0], -key[0])


@pytest.mark.parametrize(("key_dtype", "cache_dtype_str"), [(np.float32, "bfloat16"), (ml_dtypes.bfloat16, "float32")])
def test_write_casts_to_cache_dtype(key_dtype, cache_dtype_str):
    rng = np.random.default_rng(4)
    cache = _cache(cache_dtype_str=cache_dtype_str)
    key, value = _kv(rng, 1, dtype=key_dtype)
    new = write_to_kv_cache(cache, key, value, np.array([2], np.int32))
    assert new.dtype == cache.dtype
    np.testing.assert_array_equal(np.asarray(new[0, 1, 0], np.float64), key[0].astype(cache.dtype).astype(np.float64))


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    num_blocks=st.integers(1, 5),
    block_size=st.integers(1, 4),
    num_tokens=st.integers(0, 8),
)
def test_write_matches_numpy_scatter(data, num_blocks, block_size, num_tokens):
    num_slots = num_blocks * block_size
    real = data.draw(st.lists(st.integers(0, num_slots - 1), unique=True, max_size=min(num_tokens, num_slots)))
    slots = np.array(real + [-1] * (num_tokens - len(real)), np.int32)
    slots = data.draw(st.permutations(slots)) if num_tokens else slots
    slots = np.asarray(slots, np.int32)
    rng = np.random.default_rng(len(real))
    key, value = _kv(rng, num_tokens, num_kv_heads=1)
    cache = _cache(num_blocks, block_size, num_kv_heads=1)
    expected = np.full((2, num_slots, 1, 8), np.nan, np.float32)
    for t, s in enumerate(slots):
        if s >= 0:
            expected[:, s] = key[t], value[t]
    new = np.asarray(write_to_kv_cache(cache, key, value, slots))
    np.testing.assert_array_equal(new, expected.reshape(cache.shape))


_BAD_WRITES = {
    "cache_rank": (
        dict(kv_cache=np.zeros((4, 2, 2, 8), np.float32)),
        r"kv_cache must have shape \[2, num_blocks, block_size, num_kv_heads, head_size\], got \(4, 2, 2, 8\)",
    ),
    "cache_leading_dim": (
        dict(kv_cache=np.zeros((3, 4, 2, 2, 8), np.float32)),
        r"kv_cache must have shape .*got \(3, 4, 2, 2, 8\)",
    ),
    "cache_dtype": (
        dict(kv_cache=np.zeros((2, 4, 2, 2, 8), np.int8)),
        r"kv_cache dtype int8 is not a cache dtype; valid: float32, bfloat16, float16, float8_e4m3fn, float8_e5m2",
    ),
    "key_rank": (
        dict(key=np.zeros((3, 16), np.float32), value=np.zeros((3, 16), np.float32)),
        r"key must have shape \[num_tokens, num_kv_heads, head_size\], got \(3, 16\)",
    ),
    "value_shape": (
        dict(value=np.zeros((3, 2, 4), np.float32)),
        r"value shape \(3, 2, 4\) must equal key shape \(3, 2, 8\)",
    ),
    "heads": (
        dict(key=np.zeros((3, 1, 8), np.float32), value=np.zeros((3, 1, 8), np.float32)),
        r"key/value \[num_kv_heads, head_size\] = \[1, 8\] must match the cache's \[2, 8\]",
    ),
    "head_size": (
        dict(key=np.zeros((3, 2, 4), np.float32), value=np.zeros((3, 2, 4), np.float32)),
        r"must match the cache's \[2, 8\] \(kv_cache shape \(2, 4, 2, 2, 8\)\)",
    ),
    "slot_len": (
        dict(slot_mapping=np.zeros(2, np.int32)),
        r"slot_mapping must have shape \[num_tokens\] = \(3,\) like key \(3, 2, 8\), got \(2,\)",
    ),
    "slot_rank": (
        dict(slot_mapping=np.zeros((3, 1), np.int32)),
        r"slot_mapping must have shape \[num_tokens\] = \(3,\) .* got \(3, 1\)",
    ),
    "key_int": (
        dict(key=np.zeros((3, 2, 8), np.int32), value=np.zeros((3, 2, 8), np.int32)),
        r"key must have a floating dtype, got int32",
    ),
    "kv_dtype_mismatch": (
        dict(value=np.zeros((3, 2, 8), np.float16)),
        r"key dtype float32 and value dtype float16 must be equal",
    ),
    "slot_float": (
        dict(slot_mapping=np.zeros(3, np.float32)),
        r"slot_mapping must have an integer dtype, got float32",
    ),
}


@pytest.mark.parametrize("case", list(_BAD_WRITES))
def test_write_rejects_bad_inputs(case):
    args = dict(
        kv_cache=np.zeros((2, 4, 2, 2, 8), np.float32),
        key=np.zeros((3, 2, 8), np.float32),
        value=np.zeros((3, 2, 8), np.float32),
        slot_mapping=np.zeros(3, np.int32),
    )
    overrides, message = _BAD_WRITES[case]
    args.update(overrides)
    with pytest.raises(ValueError, match=message):
        write_to_kv_cache(**args)


# --- calc_kv_scales ------------------------------------------------------------------------


def test_calc_kv_scales_uses_vllm_default_ranges():
    q = jnp.array([[1.0, -400.0]])
    k = jnp.array([100.0, 2.0], jnp.bfloat16)
    v = jnp.array([-50.0, 3.0], jnp.float16)
    scales = calc_kv_scales(q, k, v)
    for s in scales:
        assert s.shape == () and s.dtype == jnp.float32
    np.testing.assert_allclose([float(s) for s in scales], [400 / 200, 100 / 200, 50 / 100])


def test_calc_kv_scales_custom_ranges_and_jit():
    q, k, v = jnp.full(3, 2.0), jnp.full(3, -4.0), jnp.full(3, 8.0)
    scales = jax.jit(functools.partial(calc_kv_scales, q_range=1.0, k_range=2.0, v_range=4.0))(q, k, v)
    np.testing.assert_allclose([float(s) for s in scales], [2.0, 2.0, 2.0])


def test_calc_kv_scales_all_zero_or_empty_input_gives_floor():
    scales = calc_kv_scales(jnp.zeros(4), jnp.zeros((2, 2)), jnp.zeros(0))
    assert [float(s) for s in scales] == [MIN_SCALE] * 3
    q = quantize_to_cache(jnp.zeros(3), jnp.float8_e4m3fn, scales[1])
    assert not np.isnan(np.asarray(q, np.float32)).any()


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "200", True])
def test_calc_kv_scales_rejects_bad_range(bad):
    with pytest.raises(ValueError, match=f"k_range must be a positive number, got {bad!r}"):
        calc_kv_scales(jnp.ones(1), jnp.ones(1), jnp.ones(1), k_range=bad)
