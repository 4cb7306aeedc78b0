"""Input checks for ragged paged attention, shared by the reference and the kernels.

``static_validate_inputs`` looks only at shapes, dtypes and static options, so it runs
at trace time. ``dynamic_validate_inputs`` looks at concrete index values (lengths,
block ids, slot ids); callers run it only when the arrays are concrete (not inside
``jit``), see ``is_concrete``; ``validate_inputs`` runs both, the prologue of every op.
``checkify_validate_inputs`` states the same dynamic
checks as ``jax.experimental.checkify`` checks on traced arrays: the layers' opt-in
checked mode (``attn_jax.set_debug_checks``), never the default path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from attn_jax.kv_cache import CACHE_STORAGE_DTYPES
from attn_jax.metadata import (
    check_block_ids,
    check_pages_fit,
    check_query_start_loc,
    check_seq_lens_cover_queries,
    check_slot_ids,
)
from attn_jax.types import (
    ACTIVATION_DTYPES,
    validate_positive_finite,
    validate_sliding_window,
    validate_soft_cap,
)

_INDEX_DTYPES = (np.dtype(np.int32),)


def is_concrete(*arrays) -> bool:
    """True when no argument is a tracer, i.e. its values can be inspected on the host."""
    return not any(isinstance(a, jax.core.Tracer) for a in arrays)


def _check_dtype(name: str, x, allowed: tuple[np.dtype, ...]) -> None:
    if not hasattr(x, "dtype"):
        raise TypeError(
            f"{name} is a {type(x).__name__}; it must be an array (NumPy or jax) of dtype {allowed[0]}, "
            f"e.g. np.asarray({name}, np.{allowed[0]})"
        )
    if np.dtype(x.dtype) not in allowed:
        valid = ", ".join(str(d) for d in allowed)
        raise TypeError(f"{name}.dtype={np.dtype(x.dtype)} is not supported. Valid dtypes are: {valid}")


def _check_shape(name: str, x, expected: tuple[int, ...], meaning: str) -> None:
    if tuple(x.shape) != expected:
        raise ValueError(f"{name}.shape={tuple(x.shape)} must be {expected} ({meaning})")


def check_query(q) -> None:
    """q must be an f[num_tokens, num_q_heads, head_size] array of an activation dtype."""
    _check_dtype("q", q, ACTIVATION_DTYPES)
    if q.ndim != 3:
        raise ValueError(f"q.shape={tuple(q.shape)} must be [num_tokens, num_q_heads, head_size]")


FP8_QUERY_CACHE_DTYPE = np.dtype(jnp.float8_e4m3fn)
"""The one cache dtype FP8 attention (``q_scale`` given) runs against: its dots take e4m3 on both sides."""


def check_fp8_query(q_scale, kv_cache) -> None:
    """FP8 attention (``q_scale`` not None) needs an e4m3 cache and a scalar scale; ValueError otherwise."""
    if q_scale is None:
        return
    if np.dtype(kv_cache.dtype) != FP8_QUERY_CACHE_DTYPE:
        raise ValueError(
            f"q_scale is given (FP8 attention: the query quantised to e4m3 for fp8 x fp8 dots) but "
            f"kv_cache.dtype={np.dtype(kv_cache.dtype)}; FP8 attention needs kv_cache.dtype={FP8_QUERY_CACHE_DTYPE} "
            "(kv_cache_dtype 'fp8' or 'fp8_e4m3'), or q_scale=None to attend in the query's dtype"
        )
    size = int(np.prod(np.shape(q_scale)))
    if size != 1:
        raise ValueError(f"q_scale has shape {tuple(np.shape(q_scale))}; it must be a scalar (one per-tensor scale)")


def static_validate_inputs(
    q,
    k,
    v,
    kv_cache,
    query_start_loc,
    seq_lens,
    block_tables,
    slot_mapping,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes=None,
    sinks=None,
    q_scale=None,
) -> None:
    """Checks shapes, dtypes and options; raises ValueError / TypeError naming the bad value."""
    check_query(q)
    for name, x in (
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
        ("block_tables", block_tables),
        ("slot_mapping", slot_mapping),
    ):
        _check_dtype(name, x, _INDEX_DTYPES)
    num_tokens, num_q_heads, head_size = q.shape
    if kv_cache.ndim != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache.shape={tuple(kv_cache.shape)} must be "
            "[2, num_blocks, block_size, num_kv_heads, head_size] (k at [0], v at [1])"
        )
    _check_dtype("kv_cache", kv_cache, CACHE_STORAGE_DTYPES)
    check_fp8_query(q_scale, kv_cache)
    _, _, _, num_kv_heads, cache_head_size = kv_cache.shape
    if cache_head_size != head_size:
        raise ValueError(f"kv_cache head_size={cache_head_size} must equal q head_size={head_size}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"{num_q_heads=} must be divisible by {num_kv_heads=}")
    if (k is None) != (v is None):
        raise ValueError("k and v must both be arrays or both be None (None: write nothing)")
    if k is not None:
        for name, x in (("k", k), ("v", v)):
            _check_shape(name, x, (num_tokens, num_kv_heads, head_size), "[num_tokens, num_kv_heads, head_size]")
            if x.dtype != q.dtype:
                raise TypeError(f"{name}.dtype={np.dtype(x.dtype)} must equal q.dtype={np.dtype(q.dtype)}")
    if query_start_loc.ndim != 1 or query_start_loc.shape[0] < 2:
        raise ValueError(
            f"query_start_loc.shape={tuple(query_start_loc.shape)} must be [num_reqs + 1] with num_reqs >= 1"
        )
    num_reqs = query_start_loc.shape[0] - 1
    _check_shape("seq_lens", seq_lens, (num_reqs,), f"[num_reqs] with num_reqs={num_reqs} from query_start_loc")
    if block_tables.ndim != 2 or block_tables.shape[0] != num_reqs:
        raise ValueError(f"block_tables.shape={tuple(block_tables.shape)} must be [num_reqs={num_reqs}, pages_per_req]")
    _check_shape("slot_mapping", slot_mapping, (num_tokens,), f"[num_tokens] with num_tokens={num_tokens} from q")
    validate_positive_finite("sm_scale", sm_scale, "the softmax scale, usually head_size**-0.5")
    validate_sliding_window(sliding_window)
    validate_soft_cap(logits_soft_cap)
    for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if x is not None:
            _check_shape(name, x, (num_q_heads,), f"one value per query head, num_q_heads={num_q_heads}")


def dynamic_validate_inputs(
    query_start_loc,
    seq_lens,
    block_tables,
    slot_mapping,
    *,
    num_blocks: int,
    block_size: int,
    causal: bool = True,
) -> None:
    """Checks concrete index values; raises ValueError naming the first bad entry.

    The checks are the metadata's own (``attn_jax.metadata.check_*``). Only the
    block-table entries a request uses (ceil(seq_len / block_size)) are checked.
    """
    qsl = np.asarray(query_start_loc)
    lens = np.asarray(seq_lens)
    table = np.asarray(block_tables)
    slots = np.asarray(slot_mapping)
    check_query_start_loc(qsl, "query_start_loc")
    if qsl[-1] > slots.shape[0]:
        raise ValueError(f"query_start_loc[-1]={qsl[-1]} exceeds num_tokens={slots.shape[0]}")
    if (bad := np.flatnonzero(lens < 0)).size:
        raise ValueError(f"seq_lens[{bad[0]}]={lens[bad[0]]} must be >= 0")
    if causal:
        check_seq_lens_cover_queries(lens, np.diff(qsl), "seq_lens")
    check_pages_fit(lens, block_size, table.shape[1], "block_tables")
    check_block_ids(table, lens, block_size, num_blocks, "block_tables")
    check_slot_ids(slots, num_blocks * block_size)


def validate_inputs(
    q, k, v, kv_cache, query_start_loc, seq_lens, block_tables, slot_mapping, *, sm_scale: float,
    causal: bool = True, sliding_window: int | None = None, logits_soft_cap: float | None = None,
    alibi_slopes=None, sinks=None, q_scale=None,
) -> None:  # fmt: skip
    """The ops' input checks: ``static_validate_inputs``, then ``dynamic_validate_inputs`` when
    the metadata is concrete; raises ValueError / TypeError naming the bad value.

    q f[T, Hq, D]; k, v f[T, Hkv, D] in q's dtype, or both None; kv_cache [2, P, S, Hkv, D] in
    a cache dtype (only its shape and dtype are read); query_start_loc i32[R + 1], seq_lens
    i32[R], block_tables i32[R, pages_per_req], slot_mapping i32[T].
    """
    static_validate_inputs(
        q, k, v, kv_cache, query_start_loc, seq_lens, block_tables, slot_mapping,
        sm_scale=sm_scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
        alibi_slopes=alibi_slopes, sinks=sinks, q_scale=q_scale,
    )  # fmt: skip
    if is_concrete(query_start_loc, seq_lens, block_tables, slot_mapping):
        _, num_blocks, block_size, _, _ = kv_cache.shape
        dynamic_validate_inputs(
            query_start_loc, seq_lens, block_tables, slot_mapping,
            num_blocks=num_blocks, block_size=block_size, causal=causal,
        )  # fmt: skip


def _first(bad):
    """Index tuple (i32 scalars) of the first True entry of ``bad`` (row-major)."""
    return jnp.unravel_index(jnp.argmax(bad.reshape(-1)), bad.shape)


def checkify_validate_inputs(
    query_start_loc,
    seq_lens,
    block_tables,
    slot_mapping,
    *,
    num_blocks: int,
    block_size: int,
    causal: bool = True,
) -> None:
    """``dynamic_validate_inputs``'s checks, with the same messages, as ``checkify.check``s.

    For traced metadata (inside ``jit``); the caller functionalizes them with
    ``checkify.checkify`` (a check that is not raises ValueError at trace time, so the
    checked mode can never be skipped silently). Only the block-table entries a request
    uses are checked, as on the host.
    """
    qsl, lens = jnp.asarray(query_start_loc), jnp.asarray(seq_lens)
    table, slots = jnp.asarray(block_tables), jnp.asarray(slot_mapping)
    num_tokens, width = slots.shape[0], table.shape[1]
    checkify.check(qsl[0] == 0, "query_start_loc[0]={v} must be 0", v=qsl[0])
    drops = qsl[1:] < qsl[:-1]
    (i,) = _first(drops)
    checkify.check(
        ~jnp.any(drops), "query_start_loc must be non-decreasing: query_start_loc[{i}]={a} < query_start_loc[{j}]={b}",
        i=i + 1, a=qsl[i + 1], j=i, b=qsl[i],
    )  # fmt: skip
    checkify.check(qsl[-1] <= num_tokens, f"query_start_loc[-1]={{v}} exceeds {num_tokens=}", v=qsl[-1])
    (r,) = _first(lens < 0)
    checkify.check(jnp.all(lens >= 0), "seq_lens[{r}]={v} must be >= 0", r=r, v=lens[r])
    if causal:
        query_lens = qsl[1:] - qsl[:-1]
        (r,) = _first(lens < query_lens)
        checkify.check(
            jnp.all(lens >= query_lens),
            "seq_lens[{r}]={s} is less than request {r}'s query length {q}; seq_len counts computed + new tokens",
            r=r, s=lens[r], q=query_lens[r],
        )  # fmt: skip
    pages = (lens + block_size - 1) // block_size  # i32[R]
    (r,) = _first(pages > width)
    checkify.check(
        jnp.all(pages <= width),
        f"block_tables has {width} pages per request; request {{r}} needs {{n}} (seq_len {{s}}, {block_size=})",
        r=r, n=pages[r], s=lens[r],
    )  # fmt: skip
    bad = (jnp.arange(width)[None, :] < pages[:, None]) & ((table < 0) | (table >= num_blocks))
    r, j = _first(bad)
    checkify.check(
        ~jnp.any(bad), f"block_tables[{{r}}, {{j}}]={{v}} is outside [0, {num_blocks=})", r=r, j=j, v=table[r, j]
    )
    bad = (slots < -1) | (slots >= num_blocks * block_size)
    (i,) = _first(bad)
    checkify.check(
        ~jnp.any(bad), f"slot_mapping[{{i}}]={{v}} is outside [-1, num_blocks * block_size={num_blocks * block_size})",
        i=i, v=slots[i],
    )  # fmt: skip
