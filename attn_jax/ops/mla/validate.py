"""Input checks for multi-head latent attention, shared by the reference and the kernels.

``static_*`` checks look at shapes, dtypes and options only (trace time); ``dynamic_validate``
looks at concrete index values (lengths, block ids, slots) and runs only outside ``jit``.
The latent cache is ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``: one row per
token holding the compressed ``c_kv`` then the shared rotary key ``k_pe``, no heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax.metadata import (
    check_block_ids,
    check_pages_fit,
    check_query_start_loc,
    check_seq_lens_cover_queries,
    check_slot_ids,
)
from attn_jax.types import ACTIVATION_DTYPES, validate_positive_finite

CACHE_DTYPES: tuple[np.dtype, ...] = (*ACTIVATION_DTYPES, np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))
"""Latent cache dtypes: the activation dtypes, and fp8 (the cache stores latent / k_scale)."""

_INDEX = np.dtype(np.int32)


def is_concrete(*arrays) -> bool:
    """True when no argument is a tracer (its values can be read on the host)."""
    return not any(isinstance(a, jax.core.Tracer) for a in arrays)


def check_index(name: str, x, ndim: int) -> None:
    if not hasattr(x, "dtype") or np.dtype(x.dtype) != _INDEX:
        got = np.dtype(x.dtype) if hasattr(x, "dtype") else type(x).__name__
        raise TypeError(f"{name} has dtype {got}; it must be an int32 array (valid dtypes: int32)")
    if x.ndim != ndim:
        raise ValueError(f"{name}.shape={tuple(x.shape)} must have {ndim} dimension(s)")


def check_latent_cache(kv_cache, kv_lora_rank: int) -> int:
    """Checks the cache and ``kv_lora_rank``; returns the rope width (cache width - rank)."""
    if kv_cache.ndim != 3:
        raise ValueError(
            f"kv_cache.shape={tuple(kv_cache.shape)} must be [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]"
        )
    if np.dtype(kv_cache.dtype) not in CACHE_DTYPES:
        valid = ", ".join(str(d) for d in CACHE_DTYPES)
        raise TypeError(f"kv_cache.dtype={np.dtype(kv_cache.dtype)} is not supported. Valid dtypes are: {valid}")
    width = kv_cache.shape[2]
    if not isinstance(kv_lora_rank, (int, np.integer)) or not 0 < kv_lora_rank < width:
        raise ValueError(
            f"kv_lora_rank={kv_lora_rank!r} must be an int in [1, {width - 1}]: the cache row is "
            f"{width} wide = kv_lora_rank + qk_rope_head_dim, with qk_rope_head_dim >= 1"
        )
    return width - int(kv_lora_rank)


def check_scale(kv_cache, k_scale) -> None:
    """An fp8 latent cache needs its scale: ValueError naming the dtype when ``k_scale`` is None
    (other caches ignore it, as vLLM ignores k_scale for unquantised caches)."""
    if np.dtype(kv_cache.dtype).itemsize == 1 and k_scale is None:
        raise ValueError(
            f"kv_cache.dtype={np.dtype(kv_cache.dtype)} is fp8: pass k_scale (an f32 scalar; the cache "
            "stores latent / k_scale, e.g. 1.0)"
        )


def _check_query(q, last: int, meaning: str) -> None:
    if not hasattr(q, "dtype") or np.dtype(q.dtype) not in ACTIVATION_DTYPES:
        valid = ", ".join(str(d) for d in ACTIVATION_DTYPES)
        got = np.dtype(q.dtype) if hasattr(q, "dtype") else type(q).__name__
        raise TypeError(f"q.dtype={got} is not supported. Valid dtypes are: {valid}")
    if q.ndim != 3:
        raise ValueError(f"q.shape={tuple(q.shape)} must be [num_tokens, num_heads, head_size]")
    if q.shape[2] != last:
        raise ValueError(f"q head_size={q.shape[2]} must be {last} ({meaning})")


def static_validate_decode(q, kv_cache, seq_lens, block_tables, *, sm_scale, kv_lora_rank) -> None:
    """Absorbed decode: q f[R, H, kv_lora_rank + rope], seq_lens i32[R], block_tables i32[R, pages]."""
    rope = check_latent_cache(kv_cache, kv_lora_rank)
    width = kv_cache.shape[2]
    _check_query(q, width, f"the absorbed query: kv_lora_rank={kv_lora_rank} + qk_rope_head_dim={rope}")
    check_index("seq_lens", seq_lens, 1)
    check_index("block_tables", block_tables, 2)
    num_reqs = q.shape[0]
    if seq_lens.shape[0] != num_reqs or block_tables.shape[0] != num_reqs:
        raise ValueError(
            f"seq_lens.shape={tuple(seq_lens.shape)} and block_tables.shape={tuple(block_tables.shape)} "
            f"must have num_reqs={num_reqs} rows (one decode token per request: q.shape={tuple(q.shape)})"
        )
    validate_positive_finite("sm_scale", sm_scale, "the softmax scale, usually qk_head_dim**-0.5")


def static_validate_prefill(
    q, kv_cache, w_uk, w_uv, query_start_loc, seq_lens, block_tables, *, sm_scale, kv_lora_rank
) -> None:
    """Up-projected prefill: q f[T, H, nope + rope], w_uk f[C, H, nope], w_uv f[C, H, v]."""
    rope = check_latent_cache(kv_cache, kv_lora_rank)
    for name, w in (("w_uk", w_uk), ("w_uv", w_uv)):
        if w.ndim != 3 or w.shape[0] != kv_lora_rank:
            raise ValueError(
                f"{name}.shape={tuple(w.shape)} must be [kv_lora_rank={kv_lora_rank}, num_heads, head_dim]"
            )
    num_heads, nope = w_uk.shape[1], w_uk.shape[2]
    if w_uv.shape[1] != num_heads:
        raise ValueError(f"w_uv.shape={tuple(w_uv.shape)} must have num_heads={num_heads} (from w_uk) in axis 1")
    _check_query(q, nope + rope, f"qk_nope_head_dim={nope} (from w_uk) + qk_rope_head_dim={rope} (from the cache)")
    if q.shape[1] != num_heads:
        raise ValueError(f"q.shape={tuple(q.shape)} must have num_heads={num_heads} (from w_uk) in axis 1")
    check_index("query_start_loc", query_start_loc, 1)
    check_index("seq_lens", seq_lens, 1)
    check_index("block_tables", block_tables, 2)
    num_reqs = query_start_loc.shape[0] - 1
    if num_reqs < 1 or seq_lens.shape[0] != num_reqs or block_tables.shape[0] != num_reqs:
        raise ValueError(
            f"query_start_loc.shape={tuple(query_start_loc.shape)}, seq_lens.shape={tuple(seq_lens.shape)} and "
            f"block_tables.shape={tuple(block_tables.shape)} must describe num_reqs >= 1 requests alike"
        )
    validate_positive_finite("sm_scale", sm_scale, "the softmax scale, usually qk_head_dim**-0.5")


def static_validate_write(kv_cache, kv_c, k_pe, slot_mapping, *, kv_lora_rank) -> None:
    """New latents: kv_c f[T, kv_lora_rank], k_pe f[T, rope], slot_mapping i32[T]."""
    rope = check_latent_cache(kv_cache, kv_lora_rank)
    for name, x, width in (("kv_c", kv_c, kv_lora_rank), ("k_pe", k_pe, rope)):
        if x.ndim != 2 or x.shape[1] != width:
            raise ValueError(f"{name}.shape={tuple(x.shape)} must be [num_tokens, {width}]")
    check_index("slot_mapping", slot_mapping, 1)
    if not kv_c.shape[0] == k_pe.shape[0] == slot_mapping.shape[0]:
        raise ValueError(
            f"kv_c.shape={tuple(kv_c.shape)}, k_pe.shape={tuple(k_pe.shape)} and "
            f"slot_mapping.shape={tuple(slot_mapping.shape)} must have the same num_tokens"
        )


def dynamic_validate(seq_lens, block_tables, *, num_blocks: int, block_size: int, query_start_loc=None) -> None:
    """Concrete values: lengths >= 0 (covering the queries), pages that fit, block ids in range."""
    lens, table = np.asarray(seq_lens), np.asarray(block_tables)
    if (bad := np.flatnonzero(lens < 0)).size:
        raise ValueError(f"seq_lens[{bad[0]}]={lens[bad[0]]} must be >= 0")
    if query_start_loc is not None:
        qsl = np.asarray(query_start_loc)
        check_query_start_loc(qsl)
        check_seq_lens_cover_queries(lens, np.diff(qsl), "seq_lens")
    check_pages_fit(lens, block_size, table.shape[1], "block_tables")
    check_block_ids(table, lens, block_size, num_blocks, "block_tables")


def dynamic_validate_slots(slot_mapping, *, num_slots: int) -> None:
    """Every slot in [-1, num_slots) (-1 = padding, not written)."""
    check_slot_ids(np.asarray(slot_mapping), num_slots)


def validate_write(kv_cache, kv_c, k_pe, slot_mapping, *, kv_lora_rank, k_scale) -> None:
    """A latent write's checks: shapes and dtypes, the scale, and the slots when concrete."""
    static_validate_write(kv_cache, kv_c, k_pe, slot_mapping, kv_lora_rank=kv_lora_rank)
    check_scale(kv_cache, k_scale)
    if is_concrete(slot_mapping):
        dynamic_validate_slots(slot_mapping, num_slots=kv_cache.shape[0] * kv_cache.shape[1])
