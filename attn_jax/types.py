"""Vocabulary shared by every module: attention types, KV-cache dtypes and layouts."""

from __future__ import annotations

import enum
import math
import numbers
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np


class AttentionType(enum.StrEnum):
    """Which tokens attend to which; values are vLLM's strings.

    Members compare equal to their strings, so ``attn_type="decoder"`` works wherever
    an ``AttentionType`` is expected.
    """

    DECODER = "decoder"
    """Causal self-attention over the request's cached and new tokens."""
    ENCODER = "encoder"
    """Bidirectional self-attention in the encoder of an encoder-decoder model."""
    ENCODER_ONLY = "encoder_only"
    """Bidirectional self-attention in an encoder-only model."""
    ENCODER_DECODER = "encoder_decoder"
    """Cross-attention: decoder queries over the encoder's cached keys and values."""

    @classmethod
    def parse(cls, value: str | AttentionType) -> AttentionType:
        """``AttentionType(value)`` with an error that lists the valid values."""
        try:
            return cls(value)
        except ValueError:
            valid = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"Unknown attn_type: {value!r}. Valid options are: {valid}") from None

    @property
    def is_causal(self) -> bool:
        return self is AttentionType.DECODER


CacheDType = Literal["auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"]
"""vLLM's KV-cache dtype names. "auto" means the model's activation dtype; "fp8" = "fp8_e4m3"."""

CACHE_DTYPES: tuple[str, ...] = get_args(CacheDType)

KVCacheLayout = Literal["NHD", "HND"]
"""Order of a cache page's axes: NHD = [block_size, Hkv, D], HND = [Hkv, block_size, D]."""

KV_CACHE_LAYOUTS: tuple[str, ...] = get_args(KVCacheLayout)

_STORAGE_DTYPES = {
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "float32": jnp.float32,
    "fp8": jnp.float8_e4m3fn,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "fp8_e5m2": jnp.float8_e5m2,
}

ACTIVATION_DTYPES: tuple[np.dtype, ...] = tuple(np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))


SEED_LIMIT = 2**32
"""Sampling seeds are in [0, SEED_LIMIT): the engine's step packs them as uint32."""


def validate_positive_int(name: str, value) -> int:
    """Returns ``int(value)`` if it is a positive integer (any ``numbers.Integral``: Python or
    NumPy; bool excluded), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return int(value)


def _static_real(name: str, value, what: str) -> float | None:
    """``float(value)`` for a real number (Python, NumPy or a concrete 0-d array; bool excluded),
    None if ``value`` is not one; TypeError naming ``name`` for a traced value."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} is a traced value ({value.aval}); it is a static hyperparameter ({what}): pass a Python or "
            "NumPy number, not an array computed under jax.jit"
        )
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if getattr(value, "shape", None) == () and np.dtype(getattr(value, "dtype", object)).kind in "fiu":
        return float(value)
    return None


def validate_positive_finite(name: str, value, what: str) -> float:
    """``float(value)`` if it is a finite real number > 0 (Python or NumPy scalar, or a
    concrete 0-d array), else ValueError naming it; TypeError for a traced value.
    ``what`` says what the value is, for the message."""
    x = _static_real(name, value, what)
    if x is None or not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name}={value!r} must be a finite number > 0 ({what})")
    return x


def validate_sliding_window(value, name: str = "sliding_window") -> int | None:
    """None, or ``int(value)`` for a positive integer (Python or NumPy); else ValueError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(
            f"{name}={value!r} must be None (no window) or a positive int: a window of 0 or less would hide every key"
        )
    return int(value)


def validate_soft_cap(value, name: str = "logits_soft_cap") -> float | None:
    """None, or ``float(value)`` for a finite number > 0 (the cap c of ``c * tanh(s / c)``)."""
    if value is None:
        return None
    x = _static_real(name, value, "the cap c of c * tanh(s / c)")
    if x is None or not (math.isfinite(x) and x > 0):
        raise ValueError(
            f"{name}={value!r} must be None (no cap) or a finite number > 0 (the cap c of c * tanh(s / c))"
        )
    return x


def validate_cache_dtype(kv_cache_dtype: str) -> str:
    """Returns ``kv_cache_dtype`` if it is one of CACHE_DTYPES, else raises ValueError."""
    if kv_cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"Invalid kv_cache_dtype: {kv_cache_dtype!r}. Valid values are: {', '.join(CACHE_DTYPES)}")
    return kv_cache_dtype


def is_quantized_kv_cache(kv_cache_dtype: str) -> bool:
    """True for the fp8 cache dtypes, whose entries are stored divided by k/v scales."""
    return validate_cache_dtype(kv_cache_dtype).startswith("fp8")


def cache_storage_dtype(kv_cache_dtype: str, model_dtype) -> np.dtype:
    """The dtype the cache array holds: ``model_dtype`` for "auto", else the named dtype."""
    validate_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        return validate_activation_dtype(model_dtype)
    return np.dtype(_STORAGE_DTYPES[kv_cache_dtype])


def validate_activation_dtype(dtype) -> np.dtype:
    """Returns ``np.dtype(dtype)`` if attention supports it as an activation dtype."""
    try:
        d = np.dtype(dtype)
    except TypeError:
        d = None
    if d not in ACTIVATION_DTYPES:
        valid = ", ".join(str(x) for x in ACTIVATION_DTYPES)
        raise TypeError(f"Unsupported activation dtype: {dtype!r}. Valid dtypes are: {valid}")
    return d


def validate_kv_cache_layout(layout: str) -> str:
    """Returns ``layout`` if it is "NHD" or "HND", else raises ValueError."""
    if layout not in KV_CACHE_LAYOUTS:
        raise ValueError(f"Invalid KV cache layout: {layout!r}. Valid options are: {', '.join(KV_CACHE_LAYOUTS)}")
    return layout
