"""Paged KV cache: allocation, slot-mapped writes, fp8 quantisation and scale estimation.

One layer's cache is ``[2, P, S, Hkv, D]`` (NHD pages): keys at index 0, values at index
1, P pages of S slots each. A token's slot is ``block_id * S + offset``; slot -1 marks a
padding token whose key and value are not written. fp8 caches ("fp8", "fp8_e4m3",
"fp8_e5m2") store ``k / k_scale`` and ``v / v_scale``, clipped to the fp8 dtype's finite
range; the other cache dtypes store the values as they are, cast to the cache dtype.

Example::

    cache = allocate_kv_cache(XLAAttentionBackend, num_blocks=4, block_size=2,
                              num_kv_heads=1, head_size=8, model_dtype=jnp.float32)
    key = value = jnp.ones((3, 1, 8))
    cache = write_to_kv_cache(cache, key, value, jnp.array([5, -1, 0]))  # row 1 skipped
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax.types import validate_positive_int

__all__ = [
    "CACHE_STORAGE_DTYPES",
    "DEFAULT_K_RANGE",
    "DEFAULT_Q_RANGE",
    "DEFAULT_V_RANGE",
    "FP8_DTYPES",
    "MIN_SCALE",
    "allocate_kv_cache",
    "calc_kv_scales",
    "dequantize_from_cache",
    "is_fp8_dtype",
    "quantize_to_cache",
    "write_to_kv_cache",
]

FP8_DTYPES: tuple[np.dtype, ...] = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))
"""Storage dtypes of the fp8 caches: "fp8" / "fp8_e4m3" and "fp8_e5m2"."""

CACHE_STORAGE_DTYPES: tuple[np.dtype, ...] = (
    np.dtype(jnp.float32),
    np.dtype(jnp.bfloat16),
    np.dtype(jnp.float16),
    *FP8_DTYPES,
)
"""Every dtype a KV cache array may hold."""

DEFAULT_Q_RANGE = 200.0
"""vLLM's Q_SCALE_CONSTANT: ``q_scale = max|q| / DEFAULT_Q_RANGE``."""
DEFAULT_K_RANGE = 200.0
"""vLLM's K_SCALE_CONSTANT: ``k_scale = max|k| / DEFAULT_K_RANGE``."""
DEFAULT_V_RANGE = 100.0
"""vLLM's V_SCALE_CONSTANT: ``v_scale = max|v| / DEFAULT_V_RANGE``."""

MIN_SCALE = float(np.finfo(np.float32).tiny)
"""Floor of every scale from ``calc_kv_scales``: the smallest normal float32 (~1.2e-38).

An all-zero (or empty) input would otherwise give a scale of 0 and ``0 / 0 = NaN`` on quantising;
the floor's reciprocal (~8.5e37) is still a finite float32.
"""


def is_fp8_dtype(dtype) -> bool:
    """True if ``dtype`` is one of the fp8 cache storage dtypes (e4m3fn, e5m2)."""
    return np.dtype(dtype) in FP8_DTYPES


def allocate_kv_cache(
    backend_cls,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    cache_dtype_str: str = "auto",
    model_dtype=jnp.bfloat16,
    fill: float = 0.0,
) -> jax.Array:
    """One layer's KV cache for ``backend_cls``, every entry set to ``fill``.

    The shape is ``backend_cls.get_kv_cache_shape(...)`` ([2, P, S, Hkv, D] for the XLA
    backend) and the dtype ``backend_cls.kv_cache_dtype_for(cache_dtype_str, model_dtype)``:
    ``model_dtype`` for "auto", else the named dtype (float8_e4m3fn for "fp8" and
    "fp8_e4m3", float8_e5m2 for "fp8_e5m2"). Tests pass ``fill=jnp.nan`` so that a read of
    an unused slot shows in the output.
    """
    num_blocks = validate_positive_int("num_blocks", num_blocks)
    block_size = validate_positive_int("block_size", block_size)
    num_kv_heads = validate_positive_int("num_kv_heads", num_kv_heads)
    head_size = validate_positive_int("head_size", head_size)
    shape = backend_cls.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str)
    dtype = backend_cls.kv_cache_dtype_for(cache_dtype_str, model_dtype)
    return jnp.full(shape, fill, dtype=dtype)


def _scalar_scale(name: str, scale) -> jax.Array:
    """``scale`` (None = 1.0; a Python number or an array of one element) as f32[]."""
    if scale is None:
        return jnp.float32(1.0)
    scale = jnp.asarray(scale, dtype=jnp.float32)
    if scale.size != 1:
        raise ValueError(f"{name} must be a scalar or have one element, got shape {scale.shape}")
    return scale.reshape(())


def quantize_to_cache(x: jax.Array, cache_dtype, scale=None) -> jax.Array:
    """``x`` as the cache stores it, in ``cache_dtype``.

    fp8 cache dtypes: ``x / scale`` computed in float32, clipped to the dtype's finite
    range (an overflow saturates, never becomes NaN or inf; a NaN input stays NaN), then
    cast; ``scale`` is a scalar (None = 1.0). XLA divides by a scalar as a multiply by
    its reciprocal, so a quotient on an exact fp8 rounding tie may round either way (one
    fp8 ulp). Other cache dtypes: a plain cast, and ``scale`` is ignored, as vLLM
    ignores k_scale/v_scale for unquantised caches.
    """
    cache_dtype = np.dtype(cache_dtype)
    if not is_fp8_dtype(cache_dtype):
        return jnp.asarray(x).astype(cache_dtype)
    limit = float(jnp.finfo(cache_dtype).max)
    scaled = jnp.asarray(x, dtype=jnp.float32) / _scalar_scale("scale", scale)
    return jnp.clip(scaled, -limit, limit).astype(cache_dtype)


def dequantize_from_cache(x: jax.Array, scale=None, dtype=jnp.float32) -> jax.Array:
    """Cache entries ``x`` back as values in ``dtype``: ``x * scale`` for fp8 caches.

    For fp8 ``x`` the product is taken in float32 (``scale`` None = 1.0); for other cache
    dtypes it is a plain cast and ``scale`` is ignored (see ``quantize_to_cache``).
    """
    x = jnp.asarray(x)
    if not is_fp8_dtype(x.dtype):
        return x.astype(dtype)
    return (x.astype(jnp.float32) * _scalar_scale("scale", scale)).astype(dtype)


def _check_write_inputs(kv_cache, key, value, slot_mapping) -> None:
    if kv_cache.ndim != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must have shape [2, num_blocks, block_size, num_kv_heads, head_size], got {kv_cache.shape}"
        )
    if np.dtype(kv_cache.dtype) not in CACHE_STORAGE_DTYPES:
        valid = ", ".join(str(d) for d in CACHE_STORAGE_DTYPES)
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} is not a cache dtype; valid: {valid}")
    if key.ndim != 3:
        raise ValueError(f"key must have shape [num_tokens, num_kv_heads, head_size], got {key.shape}")
    if value.shape != key.shape:
        raise ValueError(f"value shape {value.shape} must equal key shape {key.shape}")
    if key.shape[1:] != kv_cache.shape[3:]:
        raise ValueError(
            f"key/value [num_kv_heads, head_size] = {list(key.shape[1:])} must match the "
            f"cache's {list(kv_cache.shape[3:])} (kv_cache shape {kv_cache.shape})"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(
            f"slot_mapping must have shape [num_tokens] = ({key.shape[0]},) like key "
            f"{key.shape}, got {slot_mapping.shape}"
        )
    for name, arr in (("key", key), ("value", value)):
        if not jnp.issubdtype(arr.dtype, jnp.floating):
            raise ValueError(f"{name} must have a floating dtype, got {arr.dtype}")
    if key.dtype != value.dtype:
        raise ValueError(f"key dtype {key.dtype} and value dtype {value.dtype} must be equal")
    if not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise ValueError(f"slot_mapping must have an integer dtype, got {slot_mapping.dtype}")


def write_to_kv_cache(
    kv_cache: jax.Array,  # [2, P, S, Hkv, D]
    key: jax.Array,  # f[T, Hkv, D]
    value: jax.Array,  # f[T, Hkv, D]
    slot_mapping: jax.Array,  # int[T]; -1 = padding, not written
    k_scale=None,  # f32[] | None (1.0): fp8 caches store key / k_scale
    v_scale=None,  # f32[] | None (1.0)
) -> jax.Array:
    """Returns ``kv_cache`` with token t's key and value at flat slot ``slot_mapping[t]``.

    Slot ``s`` is page ``s // S``, offset ``s % S``. A negative slot (-1 marks padding)
    writes nothing: it does not wrap around to the cache's last slot. Slots from
    ``P * S`` on are out of bounds and are dropped as well. Keys and
    values are quantised for fp8 caches (``quantize_to_cache``) and cast to the cache
    dtype otherwise. Jittable; the update is a scatter (``.at[].set``), in place when the
    cache is donated. Two tokens with the same slot leave either one's values.
    """
    kv_cache, key, value = jnp.asarray(kv_cache), jnp.asarray(key), jnp.asarray(value)
    slot_mapping = jnp.asarray(slot_mapping)
    _check_write_inputs(kv_cache, key, value, slot_mapping)
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    num_slots = num_blocks * block_size
    k_scale, v_scale = _scalar_scale("k_scale", k_scale), _scalar_scale("v_scale", v_scale)
    k_new = quantize_to_cache(key, kv_cache.dtype, k_scale)  # [T, Hkv, D], cache dtype
    v_new = quantize_to_cache(value, kv_cache.dtype, v_scale)
    # Negative slots become num_slots, out of range, and mode="drop" skips them.
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)  # int[T]
    flat = kv_cache.reshape(2, num_slots, num_kv_heads, head_size)
    flat = flat.at[0, slots].set(k_new, mode="drop")
    flat = flat.at[1, slots].set(v_new, mode="drop")
    return flat.reshape(kv_cache.shape)


def calc_kv_scales(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    q_range: float = DEFAULT_Q_RANGE,
    k_range: float = DEFAULT_K_RANGE,
    v_range: float = DEFAULT_V_RANGE,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(q_scale, k_scale, v_scale), each f32[] = ``max|x| / x_range``, like vLLM's
    ``Attention.calc_kv_scales``.

    The default ranges are vLLM's Q/K/V_SCALE_CONSTANT: 200, 200 and 100, so the largest
    key lands at 200 in the cache and the largest value at 100 (float8_e4m3fn's largest
    finite value is 448). A pure function: the caller keeps the scales (vLLM computes
    them once, on the first batch). Each scale is at least ``MIN_SCALE``, so an all-zero
    or empty input gives a tiny positive scale, not 0.
    """
    ranges = {"q_range": q_range, "k_range": k_range, "v_range": v_range}
    for name, r in ranges.items():
        if isinstance(r, bool) or not isinstance(r, numbers.Real) or not r > 0:
            raise ValueError(f"{name} must be a positive number, got {r!r}")

    def scale(x, x_range):
        amax = jnp.max(jnp.abs(jnp.asarray(x, dtype=jnp.float32)), initial=0.0)
        return jnp.maximum(amax / jnp.float32(x_range), jnp.float32(MIN_SCALE))

    return scale(query, q_range), scale(key, k_range), scale(value, v_range)
