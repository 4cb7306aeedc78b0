"""Per-batch attention metadata shared by every layer and backend, and batch utilities.

``CommonAttentionMetadata`` follows vLLM's fields and names. It is a registered pytree
whose leaves are all of its fields: a jitted step that receives it is retraced only when
an array's shape changes (the padded bucket), never for new values. Inside ``jit`` every
field, the ``_cpu`` copies and the counts included, is a tracer; host-side logic
(``split_decodes_and_prefills``, virtual batches) runs before ``jit``, on the NumPy
copies.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from attn_jax.types import KVCacheLayout, validate_kv_cache_layout, validate_positive_int

Array = Any  # jax.Array or np.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class CommonAttentionMetadata:
    """Per-batch attention metadata (vLLM's ``CommonAttentionMetadata``).

    Requests with no new tokens (even no context) are legal padding and produce no
    rows; token rows past ``num_actual_tokens`` are padding, with slot -1.
    """

    query_start_loc: Array  # i32[num_reqs + 1], device
    query_start_loc_cpu: np.ndarray  # i32[num_reqs + 1], host
    seq_lens: Array  # i32[num_reqs], device: computed + new tokens
    seq_lens_cpu: np.ndarray  # i32[num_reqs], host
    num_computed_tokens_cpu: np.ndarray  # i32[num_reqs], host
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    block_table_tensor: Array  # i32[num_reqs, max_blocks_per_req], device
    slot_mapping: Array  # i32[num_tokens], device; -1 past num_actual_tokens

    def __post_init__(self) -> None:
        # Python lists (or tuples) become int32 NumPy arrays (range-checked); arrays and tracers stay.
        for field in _METADATA_ARRAY_FIELDS:
            value = getattr(self, field)
            if isinstance(value, (list, tuple)):
                object.__setattr__(self, field, _int_array(value, field))

    @property
    def query_lens_cpu(self) -> np.ndarray:
        """i32[num_reqs]: new tokens per request (host)."""
        return np.diff(self.query_start_loc_cpu)

    @property
    def num_tokens(self) -> int:
        """Rows of the (padded) token axis."""
        return self.slot_mapping.shape[0]


_METADATA_ARRAY_FIELDS = (
    "query_start_loc", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu", "num_computed_tokens_cpu",
    "block_table_tensor", "slot_mapping",
)  # fmt: skip


# --------------------------------------------------------------------------------------
# Decode / prefill split
# --------------------------------------------------------------------------------------


def split_decodes_and_prefills(md: CommonAttentionMetadata, decode_threshold: int = 1) -> tuple[int, int, int, int]:
    """Finds the decode / prefill boundary of a reordered batch (host-side, before jit).

    A request is a decode when its query length is <= ``decode_threshold``, else a
    prefill; a reordered batch has every decode before every prefill. Zero-length
    requests at the tail of the batch (the padding of a bucketed batch) are neither:
    they are not counted and may follow prefills. A zero-length request before the
    tail is a decode like any other, so it must come before the prefills.

    Returns ``(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)``.
    Raises ValueError naming the first decode that follows a prefill.

    >>> md = build_common_attn_metadata([1, 1, 5], [9, 4, 5], np.zeros((3, 1), np.int32), 16)
    >>> split_decodes_and_prefills(md)
    (2, 1, 2, 5)
    """
    if decode_threshold < 1:
        raise ValueError(f"{decode_threshold=} must be >= 1")
    qsl = np.asarray(md.query_start_loc_cpu)[: md.num_reqs + 1]  # i32[num_reqs + 1]
    query_lens = np.diff(qsl)  # i32[num_reqs]
    live = np.flatnonzero(query_lens)
    num_live = int(live[-1]) + 1 if live.size else 0  # requests before the padded tail
    is_prefill = query_lens[:num_live] > decode_threshold
    num_decodes = int(np.argmax(is_prefill)) if is_prefill.any() else num_live
    late = np.flatnonzero(~is_prefill[num_decodes:])
    if late.size:
        bad = num_decodes + int(late[0])
        raise ValueError(
            f"The batch is not reordered: request {bad} (query_len={int(query_lens[bad])} <= "
            f"{decode_threshold=}) is a decode after prefill request {num_decodes} "
            f"(query_len={int(query_lens[num_decodes])}); decodes must come first "
            "(see reorder_batch_to_split_decodes_and_prefills)."
        )
    num_decode_tokens = int(qsl[num_decodes] - qsl[0])
    num_prefill_tokens = int(qsl[num_live] - qsl[num_decodes])
    return num_decodes, num_live - num_decodes, num_decode_tokens, num_prefill_tokens


class InputBatchLike(Protocol):
    """What ``reorder_batch_to_split_decodes_and_prefills`` needs of a persistent batch."""

    req_ids: list[str]

    def swap_states(self, i: int, j: int) -> None:
        """Swaps every per-request state of rows i and j (req_ids included)."""


class SchedulerOutputLike(Protocol):
    """What ``reorder_batch_to_split_decodes_and_prefills`` needs of a scheduler step."""

    num_scheduled_tokens: Mapping[str, int]


def reorder_batch_to_split_decodes_and_prefills(
    input_batch: InputBatchLike,
    scheduler_output: SchedulerOutputLike,
    decode_threshold: int = 1,
) -> bool:
    """Moves requests with <= ``decode_threshold`` scheduled tokens to the front.

    Uses vLLM's minimal-swap scheme: the decodes furthest back are swapped, in
    descending order, with the prefills nearest the front, until every decode lies
    before every prefill. Decodes and prefills keep no particular relative order.
    Returns True if any swap was made.
    """
    decodes: list[int] = []
    prefills: list[int] = []
    for i, req_id in enumerate(input_batch.req_ids):
        try:
            num_tokens = scheduler_output.num_scheduled_tokens[req_id]
        except KeyError:
            raise ValueError(
                f"Request {req_id!r} (batch row {i}) has no entry in scheduler_output.num_scheduled_tokens"
            ) from None
        (decodes if num_tokens <= decode_threshold else prefills).append(i)

    num_decodes = len(decodes)
    modified = False
    for i in range(1, min(num_decodes, len(prefills)) + 1):
        decode_idx = decodes[num_decodes - i]
        if decode_idx < num_decodes:
            break
        input_batch.swap_states(prefills[i - 1], decode_idx)
        modified = True
    return modified


# --------------------------------------------------------------------------------------
# Local (chunked) attention: virtual batches
# --------------------------------------------------------------------------------------


def searchsorted(xp, a, v, side: str = "left"):
    """``xp.searchsorted(a, v, side=side)`` for schedules built on the host (``xp=numpy``) or
    traced (``xp=jax.numpy``). Traced, it compares every pair (``method="compare_all"``: one
    fused kernel over the few hundred entries a schedule searches) instead of jnp's default
    binary search, which XLA runs as a while loop (on a GPU the loop's predicate goes back
    to the host every iteration)."""
    if xp is np:
        return np.searchsorted(a, v, side=side)
    return xp.searchsorted(a, v, side=side, method="compare_all")


def check_query_start_loc(qsl: np.ndarray, name: str = "query_start_loc") -> None:
    """Raises ValueError unless ``qsl`` is 1-D, starts at 0 and is non-decreasing."""
    if qsl.ndim != 1 or qsl.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D with num_reqs + 1 >= 1 entries, got shape {qsl.shape}")
    if qsl[0] != 0:
        raise ValueError(f"{name}[0]={int(qsl[0])} must be 0")
    drops = np.flatnonzero(np.diff(qsl) < 0)
    if drops.size:
        i = int(drops[0]) + 1
        raise ValueError(
            f"{name} must be non-decreasing: {name}[{i}]={int(qsl[i])} < {name}[{i - 1}]={int(qsl[i - 1])}"
        )


def _first_bad(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def check_seq_lens_cover_queries(seq_lens: np.ndarray, query_lens: np.ndarray, name: str) -> None:
    """Raises ValueError naming the first request whose seq_len < query_len."""
    short = seq_lens < query_lens
    if short.any():
        r = _first_bad(short)
        raise ValueError(
            f"{name}[{r}]={int(seq_lens[r])} is less than request {r}'s query length "
            f"{int(query_lens[r])}; seq_len counts computed + new tokens"
        )


def check_pages_fit(seq_lens: np.ndarray, block_size: int, width: int, name: str) -> int:
    """Returns the most pages any request uses; ValueError if that exceeds ``width``."""
    max_pages = -(-int(seq_lens.max()) // block_size) if seq_lens.size else 0
    if max_pages > width:
        r = _first_bad(-(-seq_lens // block_size) > width)
        raise ValueError(
            f"{name} has {width} pages per request; request {r} needs "
            f"{-(-int(seq_lens[r]) // block_size)} (seq_len {int(seq_lens[r])}, {block_size=})"
        )
    return max_pages


def check_block_ids(block_table: np.ndarray, seq_lens: np.ndarray, block_size: int, num_blocks: int, name: str) -> None:
    """Raises ValueError naming the first block id a request uses that is outside
    [0, num_blocks); entries past a request's ceil(seq_len / block_size) may hold anything."""
    used = np.arange(block_table.shape[1]) < -(-seq_lens // block_size)[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_blocks))
    if np.any(bad):
        r, j = (int(x[0]) for x in np.nonzero(bad))
        raise ValueError(f"{name}[{r}, {j}]={int(block_table[r, j])} is outside [0, {num_blocks=})")


def check_slot_ids(slot_mapping: np.ndarray, num_slots: int, name: str = "slot_mapping") -> None:
    """Raises ValueError naming the first slot outside [-1, num_slots) (-1 = padding)."""
    bad = (slot_mapping < -1) | (slot_mapping >= num_slots)
    if np.any(bad):
        i = _first_bad(bad)
        raise ValueError(f"{name}[{i}]={int(slot_mapping[i])} is outside [-1, num_blocks * block_size={num_slots})")


def make_local_attention_virtual_batches(
    attn_chunk_size: int,
    query_start_loc_np: np.ndarray,
    seq_lens_np: np.ndarray,
    block_table: Array,
    block_size: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, Array]:
    """Splits each request into "virtual" requests, one per attention chunk it queries.

    With chunked local attention (Llama 4) a token at position p sees only the keys of
    its own chunk, positions [p // attn_chunk_size * attn_chunk_size, p]. Each request
    becomes one virtual request per chunk that holds any of its new tokens; the virtual
    request's keys start at the chunk start, so ordinary causal attention over the
    virtual batch is chunked attention over the real one.

    Args:
      attn_chunk_size: chunk length in tokens, a positive multiple of ``block_size``.
      query_start_loc_np: i32[R + 1], host.
      seq_lens_np: i32[R], host; computed + new tokens, >= the query length.
      block_table: i32[R, P], np.ndarray or jax.Array; P >= ceil(seq_len / block_size).
      block_size: tokens per cache page.

    Returns (V virtual requests, in request order, a request's in chunk order):
      seqlens_q_local i32[V], cu_seqlens_q_local i32[V + 1], seqlens_k_local i32[V],
      block_table_local i32[V, attn_chunk_size // block_size], the same kind of array
      as ``block_table``; pages past a request's table are clamped to its last column
      (never read: they lie past seqlens_k_local).

    A request with no new tokens (padding) yields one virtual request with
    seqlens_q_local = seqlens_k_local = 0 whose block row is the request's first
    pages; nothing reads it.

    Example (the seed's): chunk 4, block 2, query lens [4, 10, 5], seq lens [6, 17, 9]
    give seqlens_q_local [2, 2, 1, 4, 4, 1, 4, 1], seqlens_k_local
    [4, 2, 4, 4, 4, 1, 4, 1], and virtual keys starting at [0, 4, 4, 8, 12, 16, 4, 8].
    """
    validate_positive_int("attn_chunk_size", attn_chunk_size)
    validate_positive_int("block_size", block_size)
    if attn_chunk_size % block_size:
        raise ValueError(f"{attn_chunk_size=} must be a multiple of {block_size=}")
    qsl = np.asarray(query_start_loc_np)
    check_query_start_loc(qsl, "query_start_loc_np")
    seq_lens = np.asarray(seq_lens_np, dtype=np.int32)  # i32[R]
    q_lens = np.diff(qsl).astype(np.int32)  # i32[R]
    num_reqs = q_lens.shape[0]
    if seq_lens.shape != (num_reqs,):
        raise ValueError(f"seq_lens_np has shape {seq_lens.shape}; query_start_loc_np implies ({num_reqs},)")
    if block_table.ndim != 2 or block_table.shape[0] != num_reqs:
        raise ValueError(f"block_table has shape {tuple(block_table.shape)}; expected ({num_reqs}, pages)")
    check_seq_lens_cover_queries(seq_lens, q_lens, "seq_lens_np")
    width = block_table.shape[1]
    if width == 0 and num_reqs:
        raise ValueError(f"block_table has shape {tuple(block_table.shape)}; it needs >= 1 page column")
    check_pages_fit(seq_lens, block_size, width, "block_table")

    context = seq_lens - q_lens  # i32[R]: position of each request's first new token
    has_q = q_lens > 0
    first_chunk = np.where(has_q, context // attn_chunk_size, 0)  # i32[R]
    last_chunk = np.where(has_q, (seq_lens - 1) // attn_chunk_size, 0)  # i32[R]
    num_local = (last_chunk - first_chunk + 1).astype(np.int32)  # i32[R], >= 1
    cu_local = np.cumsum(num_local)
    num_virtual = int(cu_local[-1]) if num_reqs else 0

    req = np.repeat(np.arange(num_reqs, dtype=np.int32), num_local)  # i32[V]
    chunk = first_chunk[req] + np.arange(num_virtual, dtype=np.int32) - (cu_local - num_local)[req]
    k_start = chunk * attn_chunk_size  # i32[V]: first key position of the virtual request
    k_end = np.minimum(seq_lens[req], k_start + attn_chunk_size)  # i32[V]
    has_q_v = has_q[req]
    seqlens_q_local = np.where(has_q_v, k_end - np.maximum(context[req], k_start), 0).astype(np.int32)
    seqlens_k_local = np.where(has_q_v, k_end - k_start, 0).astype(np.int32)
    cu_seqlens_q_local = np.zeros(num_virtual + 1, np.int32)
    np.cumsum(seqlens_q_local, out=cu_seqlens_q_local[1:])

    pages_per_chunk = attn_chunk_size // block_size
    pages = np.minimum(
        (k_start // block_size)[:, None] + np.arange(pages_per_chunk, dtype=np.int32),
        width - 1,
    )  # i32[V, pages_per_chunk]
    block_table_local = block_table[req[:, None], pages]
    return seqlens_q_local, cu_seqlens_q_local, seqlens_k_local, block_table_local


# --------------------------------------------------------------------------------------
# KV cache layout
# --------------------------------------------------------------------------------------

KV_CACHE_LAYOUT_ENV = "ATTN_STACK_KV_CACHE_LAYOUT"
_kv_cache_layout_override: str | None = None


def get_kv_cache_layout() -> KVCacheLayout:
    """The KV cache page layout: "NHD" ([block_size, Hkv, D]) or "HND" ([Hkv, block_size, D]).

    Precedence: ``set_kv_cache_layout`` > env ``ATTN_STACK_KV_CACHE_LAYOUT`` (read on
    every call, never cached; empty counts as unset) > "NHD".
    """
    if _kv_cache_layout_override is not None:
        return _kv_cache_layout_override
    env = os.environ.get(KV_CACHE_LAYOUT_ENV)
    if not env:
        return "NHD"
    try:
        return validate_kv_cache_layout(env)
    except ValueError as e:
        raise ValueError(f"{KV_CACHE_LAYOUT_ENV}: {e}") from None


def set_kv_cache_layout(layout: KVCacheLayout | None) -> None:
    """Overrides the layout for every later ``get_kv_cache_layout``; None clears it."""
    global _kv_cache_layout_override
    _kv_cache_layout_override = None if layout is None else validate_kv_cache_layout(layout)


# --------------------------------------------------------------------------------------
# Per-layer hyperparameters
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PerLayerParameters:
    """Hyperparameters a whole-model backend (FlashInfer-style plan) needs to share.

    window_left is FlashInfer's: the number of keys left of the query that it sees,
    i.e. ``sliding_window - 1`` (the query itself is the window's last key), or -1 for
    no window.
    """

    window_left: int
    logits_soft_cap: float | None
    sm_scale: float


def get_per_layer_parameters(layers: Mapping[str, Any], impl_cls: type | None = None) -> dict[str, PerLayerParameters]:
    """Reads each layer's ``impl`` (sliding_window, logits_soft_cap, scale).

    ``layers`` maps layer names to objects with an ``.impl``; with ``impl_cls`` given,
    every impl must be an instance of it (TypeError naming the layer otherwise).
    """
    params: dict[str, PerLayerParameters] = {}
    for name, layer in layers.items():
        impl = getattr(layer, "impl", None)
        if impl is None:
            raise TypeError(f"Layer {name!r} ({type(layer).__name__}) has no .impl")
        if impl_cls is not None and not isinstance(impl, impl_cls):
            raise TypeError(
                f"Layer {name!r} has impl of type {type(impl).__name__}; expected an instance of {impl_cls.__name__}"
            )
        sliding_window = getattr(impl, "sliding_window", None)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"Layer {name!r}: {sliding_window=} must be >= 1 or None")
        params[name] = PerLayerParameters(
            window_left=-1 if sliding_window is None else sliding_window - 1,
            logits_soft_cap=getattr(impl, "logits_soft_cap", None),
            sm_scale=impl.scale,
        )
    return params


def infer_global_hyperparameters(
    per_layer_params: Mapping[str, PerLayerParameters],
) -> PerLayerParameters:
    """The parameters every layer shares; ValueError if there are none or they differ."""
    if not per_layer_params:
        raise ValueError("No attention layers: per_layer_params is empty")
    items = iter(per_layer_params.items())
    first_name, global_params = next(items)
    for name, params in items:
        if params != global_params:
            raise ValueError(
                "Every layer must share window_left, logits_soft_cap and sm_scale: layer "
                f"{name!r} has {params}, but layer {first_name!r} has {global_params}"
            )
    return global_params


# --------------------------------------------------------------------------------------
# Host validation
# --------------------------------------------------------------------------------------


def _check_shape(name: str, shape: tuple[int, ...], expected: tuple[int, ...], why: str) -> None:
    if tuple(shape) != expected:
        raise ValueError(f"{name} has shape {tuple(shape)}; expected {expected} ({why})")


def validate_common_metadata(
    md: CommonAttentionMetadata,
    num_blocks: int | None = None,
    *,
    block_size: int | None = None,
    causal: bool = True,
) -> None:
    """Dynamic checks of a concrete (not traced) ``CommonAttentionMetadata``; host only.

    Checks shapes against ``num_reqs``; that query_start_loc starts at 0, never
    decreases and ends at ``num_actual_tokens``; that the device copies equal the host
    ones; ``max_query_len`` >= every query length; slot_mapping is -1 past
    ``num_actual_tokens``. With ``causal``: seq_len >= query_len and
    num_computed_tokens = seq_len - query_len. With ``block_size``: every request's
    pages fit in the block table. With ``num_blocks`` too (it needs ``block_size``):
    the block ids a request uses (its first ceil(seq_len / block_size)) lie in
    [0, num_blocks) and slots in [-1, num_blocks * block_size); unused entries may
    hold anything. Raises ValueError naming the first bad value.
    """
    num_reqs = md.num_reqs
    qsl = np.asarray(md.query_start_loc_cpu)
    seq_lens = np.asarray(md.seq_lens_cpu)
    computed = np.asarray(md.num_computed_tokens_cpu)
    block_table = np.asarray(md.block_table_tensor)
    slot_mapping = np.asarray(md.slot_mapping)
    why = f"num_reqs={num_reqs}"
    _check_shape("query_start_loc_cpu", qsl.shape, (num_reqs + 1,), why)
    _check_shape("query_start_loc", md.query_start_loc.shape, (num_reqs + 1,), why)
    _check_shape("seq_lens_cpu", seq_lens.shape, (num_reqs,), why)
    _check_shape("seq_lens", md.seq_lens.shape, (num_reqs,), why)
    _check_shape("num_computed_tokens_cpu", computed.shape, (num_reqs,), why)
    if block_table.ndim != 2 or block_table.shape[0] != num_reqs:
        raise ValueError(f"block_table_tensor has shape {block_table.shape}; expected ({num_reqs}, pages) ({why})")
    if slot_mapping.ndim != 1:
        raise ValueError(f"slot_mapping has shape {slot_mapping.shape}; expected (num_tokens,)")
    check_query_start_loc(qsl, "query_start_loc_cpu")
    for name, dev, host in (
        ("query_start_loc", md.query_start_loc, qsl),
        ("seq_lens", md.seq_lens, seq_lens),
    ):
        diff = np.flatnonzero(np.asarray(dev) != host)
        if diff.size:
            i = int(diff[0])
            raise ValueError(f"{name}[{i}]={int(np.asarray(dev)[i])} differs from {name}_cpu[{i}]={int(host[i])}")

    query_lens = np.diff(qsl)
    num_tokens = slot_mapping.shape[0]
    if md.num_actual_tokens != qsl[-1]:
        raise ValueError(f"num_actual_tokens={md.num_actual_tokens} must equal query_start_loc_cpu[-1]={int(qsl[-1])}")
    if md.num_actual_tokens > num_tokens:
        raise ValueError(f"num_actual_tokens={md.num_actual_tokens} exceeds the {num_tokens} rows of slot_mapping")
    if num_reqs and md.max_query_len < query_lens.max():
        r = int(np.argmax(query_lens))
        raise ValueError(
            f"max_query_len={md.max_query_len} is less than request {r}'s query length {int(query_lens[r])}"
        )
    if np.any(seq_lens < 0):
        r = _first_bad(seq_lens < 0)
        raise ValueError(f"seq_lens_cpu[{r}]={int(seq_lens[r])} must be >= 0")
    if causal:
        check_seq_lens_cover_queries(seq_lens, query_lens, "seq_lens_cpu")
        expected = seq_lens - query_lens
        if np.any(computed != expected):
            r = _first_bad(computed != expected)
            raise ValueError(
                f"num_computed_tokens_cpu[{r}]={int(computed[r])} must be seq_len - query_len = {int(expected[r])}"
            )
    tail = slot_mapping[md.num_actual_tokens :]
    if np.any(tail != -1):
        i = md.num_actual_tokens + _first_bad(tail != -1)
        raise ValueError(
            f"slot_mapping[{i}]={int(slot_mapping[i])} must be -1: rows past "
            f"num_actual_tokens={md.num_actual_tokens} are padding"
        )

    if num_blocks is not None and block_size is None:
        raise ValueError(f"{num_blocks=} needs block_size to check block and slot ids")
    if block_size is None:
        return
    validate_positive_int("block_size", block_size)
    width = block_table.shape[1]
    check_pages_fit(seq_lens, block_size, width, "block_table_tensor")
    if num_blocks is None:
        return
    check_block_ids(block_table, seq_lens, block_size, num_blocks, "block_table_tensor")
    check_slot_ids(slot_mapping[: md.num_actual_tokens], num_blocks * block_size)


# --------------------------------------------------------------------------------------
# Bucketed builder
# --------------------------------------------------------------------------------------


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    return tuple(1 << k for k in range(lo.bit_length() - 1, hi.bit_length()))


@dataclasses.dataclass(frozen=True)
class MetadataBuckets:
    """Padded sizes for the metadata's shapes: each count is padded to the smallest
    bucket that holds it, so a jitted step compiles once per bucket combination.

    Every field is a non-empty, strictly increasing tuple of positive ints (any
    sequence is accepted and stored as a tuple).
    """

    token_buckets: tuple[int, ...] = _powers_of_two(16, 8192)
    request_buckets: tuple[int, ...] = _powers_of_two(1, 1024)
    blocks_per_request_buckets: tuple[int, ...] = _powers_of_two(1, 2048)

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, Sequence) or not value:
                raise ValueError(f"{field.name}={value!r} must be a non-empty sequence of ints")
            if not all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) for b in value):
                raise ValueError(f"{field.name}={value!r} must hold only ints")
            if value[0] <= 0:
                raise ValueError(f"{field.name}={value!r} must be positive")
            if any(a >= b for a, b in zip(value, value[1:], strict=False)):
                raise ValueError(f"{field.name}={value!r} must be strictly increasing")
            object.__setattr__(self, field.name, tuple(int(b) for b in value))

    @staticmethod
    def fit(buckets: tuple[int, ...], n: int, what: str) -> int:
        """The smallest bucket >= n; ValueError naming ``what`` when none is."""
        i = bisect.bisect_left(buckets, n)
        if i == len(buckets):
            raise ValueError(f"{what}={n} exceeds the largest bucket {buckets[-1]}")
        return buckets[i]


def _int_array(x, name: str, ndim: int | None = None) -> np.ndarray:
    """``x`` (a sequence or an integer array) as int32 NumPy; ValueError naming the first entry
    outside int32's range (never a silent wrap-around) or a non-integer dtype."""
    a = np.asarray(x)
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
    if a.dtype.kind not in "iu":
        if a.size:
            raise ValueError(f"{name} must hold integers, got dtype {a.dtype}")
        return a.astype(np.int32)  # an empty list comes in as float64
    if a.dtype.itemsize > 4 or a.dtype == np.uint32:
        info = np.iinfo(np.int32)
        bad = (a < info.min) | (a > info.max)
        if bad.any():
            index = ", ".join(str(int(i)) for i in np.argwhere(bad)[0])
            value = int(a[tuple(np.argwhere(bad)[0])])
            raise ValueError(
                f"{name}[{index}]={value} is outside int32's range [{info.min}, {info.max}]: "
                "metadata is int32 and is never narrowed silently"
            )
    return a.astype(np.int32, copy=False)


def build_common_attn_metadata(
    query_lens,
    seq_lens,
    block_table,
    block_size: int,
    buckets: MetadataBuckets = MetadataBuckets(),
) -> CommonAttentionMetadata:
    """Builds bucket-padded ``CommonAttentionMetadata`` from per-request lengths (host, NumPy).

    Args:
      query_lens: i[R], new tokens per request, >= 0.
      seq_lens: i[R], computed + new tokens per request, >= query_lens.
      block_table: i[R, P], page ids; P >= ceil(seq_len / block_size) for every request.
      block_size: tokens per cache page.
      buckets: the padded sizes.

    Returns metadata whose token, request and pages-per-request axes are padded to the
    smallest bucket that fits (ValueError naming the count when none does):
    ``num_reqs`` is the padded request count (the arrays' length), ``num_actual_tokens``
    and ``max_query_len`` describe the real tokens. Padding requests have query_len 0,
    seq_len 0 and an all-zero block row (never read); padding tokens have slot -1.
    Token i of request r, at position p = seq_len - query_len + i, has slot
    ``block_table[r, p // block_size] * block_size + p % block_size``. Every field,
    the device ones included, is a NumPy int32 array (a device field and its ``_cpu``
    twin are one array): a ``jax.device_put`` per build costs several times the build
    itself, while ``jit`` transfers NumPy arguments with its call for less
    (benchmarks/metadata_build.py measures both).

    >>> md = build_common_attn_metadata([3, 1], [3, 6], [[4, 0], [7, 2]], block_size=4)
    >>> md.slot_mapping[:5].tolist(), md.num_reqs, md.num_tokens
    ([16, 17, 18, 9, -1], 2, 16)
    """
    q = _int_array(query_lens, "query_lens", 1)
    s = _int_array(seq_lens, "seq_lens", 1)
    bt = _int_array(block_table, "block_table", 2)
    num_reqs = q.shape[0]
    if s.shape != (num_reqs,) or bt.shape[0] != num_reqs:
        raise ValueError(
            f"query_lens {q.shape}, seq_lens {s.shape} and block_table {bt.shape} must agree on the number of requests"
        )
    block_size = validate_positive_int("block_size", block_size)
    if num_reqs and q.min() < 0:
        r = _first_bad(q < 0)
        raise ValueError(f"query_lens[{r}]={int(q[r])} must be >= 0")
    check_seq_lens_cover_queries(s, q, "seq_lens")
    max_pages = check_pages_fit(s, block_size, bt.shape[1], "block_table")
    r_pad = MetadataBuckets.fit(buckets.request_buckets, num_reqs, "num_reqs")
    p_pad = MetadataBuckets.fit(buckets.blocks_per_request_buckets, max_pages, "blocks per request")

    qsl = np.empty(r_pad + 1, np.int32)  # i32[r_pad + 1]
    qsl[0] = 0
    np.cumsum(q, out=qsl[1 : num_reqs + 1])
    num_actual_tokens = int(qsl[num_reqs])
    qsl[num_reqs + 1 :] = num_actual_tokens
    t_pad = MetadataBuckets.fit(buckets.token_buckets, num_actual_tokens, "num_tokens")
    seq_lens_p = np.zeros(r_pad, np.int32)  # i32[r_pad]
    seq_lens_p[:num_reqs] = s
    computed = seq_lens_p.copy()  # i32[r_pad]
    computed[:num_reqs] -= q
    width = min(bt.shape[1], p_pad)
    block_table_p = np.empty((r_pad, p_pad), np.int32)  # i32[r_pad, p_pad]
    block_table_p[:num_reqs, :width] = bt[:, :width]
    block_table_p[:num_reqs, width:] = 0
    block_table_p[num_reqs:] = 0

    # Token t of request r sits at position p = t - qsl[r] + computed[r]. With
    # x = r * p_pad * block_size + p, one repeat gives both the flat block-table index
    # x // block_size = r * p_pad + p // block_size and the in-page offset x % block_size.
    key = np.arange(0, num_reqs * p_pad * block_size, p_pad * block_size, dtype=np.intp)
    key += computed[:num_reqs]
    key -= qsl[:num_reqs]
    x = key.repeat(q)  # intp[T]
    x += np.arange(num_actual_tokens, dtype=np.intp)
    if block_size & (block_size - 1):
        page, offset = np.divmod(x, block_size)
    else:  # a power of two: shift and mask are about twice as fast as divmod
        page, offset = x >> (block_size.bit_length() - 1), x & (block_size - 1)
    slot_mapping = np.empty(t_pad, np.int32)  # i32[t_pad]
    real_slots = slot_mapping[:num_actual_tokens]
    np.multiply(block_table_p.ravel()[page], block_size, out=real_slots)
    np.add(real_slots, offset, out=real_slots, casting="unsafe")
    slot_mapping[num_actual_tokens:] = -1
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens_p,
        seq_lens_cpu=seq_lens_p,
        num_computed_tokens_cpu=computed,
        num_reqs=r_pad,
        num_actual_tokens=num_actual_tokens,
        max_query_len=int(q.max()) if num_reqs else 0,
        block_table_tensor=block_table_p,
        slot_mapping=slot_mapping,
    )
