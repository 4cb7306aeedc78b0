"""Ragged paged attention as one Pallas kernel on Mosaic TPU.

One launch serves a mixed prefill + decode batch. The grid is
``(Hkv // kv_heads_per_block, num_q_blocks)``: a program takes ``q_tokens_per_block``
query tokens of the packed batch (they may belong to several requests) for
``kv_heads_per_block`` KV heads; q and out are read and written in place as
``[q_tokens_per_block, kv_heads_per_block * G, D]`` blocks of ``[T, Hq, D]``. The
``G = Hq // Hkv`` query heads of a KV head are packed as the rows of the matmul
(``rows = q_tokens_per_block * G``, token-major), so one KV fetch serves the whole head
group. A decode (a request with one new token) runs on its own ``G`` rows with its own
softmax state, so decodes that share a q-block with a prefill chunk do not pay for the
block's other rows; the results are merged into the output block at the end.

Batch metadata (query_start_loc, seq_lens, the block table, slot_mapping and the
schedule: which requests each q-block overlaps) is scalar-prefetched into SMEM
(``PrefetchScalarGridSpec``): the grid needs no host loop and one compile serves a
bucket. KV pages stay in HBM; each program walks the (request, KV block) pairs it needs
in one flat loop and copies ``kv_pages_per_block`` pages per block HBM -> VMEM with async
DMAs into two buffers: the next pair's copy (within a request or at the next request's
first block) starts before the current block is computed.

KV cache layout (``kv_cache_shape``): ``[P, Hkv, S, 2 * D]``, one page holding every KV
head, each head an ``[S, 2 * D]`` tile whose lanes are the key (``[:D]``) then the value
(``[D:]``). A page of one head is one contiguous DMA for K and V together (half the
copies of separate K and V caches), the last two dims are ``(S, 2 * D)`` with ``2 * D``
a multiple of 128 for every supported head size, and for ``D = 64`` the key and value
share one 128-lane row, so no lane is padding: the kernel contracts the whole row with
a query zero-padded to 128 lanes (``q . [k, v] = q . k``) and keeps the value half of
``p @ [k, v]``. The reference layout ``[2, P, S, Hkv, D]`` is this one transposed
(``to_reference_layout`` / ``from_reference_layout``).

New keys and values (quantised for fp8 caches, interleaved into the layout's rows: an
elementwise op on the new tokens only) are DMA'd into their slots by the kernel itself,
HBM -> HBM, at the first q-block of each head block, before any KV is read: one DMA per
page that new tokens fill whole (``write_plan``), one per token elsewhere. The cache is
an aliased output (``input_output_aliases``), updated in place when donated.

The per-tile math (masks, score transforms, online softmax with sinks, fp8 dequant) is
``common.py``'s, shared with the GPU kernel; the row statistics are f32[rows, 1] columns.
With ``return_lse`` the kernel also writes each row's log-sum-exp ``m + log(denom)`` (-inf for a
row that saw no key) as a third output, lane-broadcast ``f32[T, Hq, LSE_LANES]`` in q/out's
blocks (as JAX's TPU flash attention writes its ``l`` and ``m``); the wrapper keeps lane 0.
Refs are only indexed and sliced, never reshaped or bitcast (``ref.reshape`` and
``ref.bitcast`` fail in jax 0.11.2's TPU interpreter): tiles are reshaped as values.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attn_jax.kv_cache import CACHE_STORAGE_DTYPES, quantize_to_cache
from attn_jax.metadata import searchsorted
from attn_jax.ops.ragged_paged_attention import common
from attn_jax.ops.ragged_paged_attention.config import (
    TpuBlockSizes,
    check_tpu_block_sizes,
    min_kv_heads_per_block,
    tpu_block_sizes,
)
from attn_jax.ops.ragged_paged_attention.validate import check_query, validate_inputs

SUPPORTED_HEAD_SIZES = (64, 80, 96, 128, 192, 256)
"""64 shares a 128-lane row between K and V; 128 and 256 fill whole lane tiles; 80 and 96
take the packed path 64 takes (a K|V row of 160 or 192 lanes, the whole array's width) and
192 a 384-lane K|V row. The interpreter and TPU lowering (``jax.export``) pass for all six;
none has run on a TPU."""

SUPPORTED_PAGE_SIZES = (16, 32, 64, 128, 256)
"""Multiples of the packed sublane tile (16 rows for bf16) up to 256 slots per page."""

FP8_MIN_PAGE_SIZE = 32
"""fp8 pages: a (32, 128) sublane tile of 8-bit values per page and head."""

FP8_QUERY_TPU_KINDS = ("TPU7x",)
"""TPUs (``jax.Device.device_kind``) with an fp8 MXU, the only ones for which Mosaic lowers the
e4m3 x e4m3 matmuls of FP8 attention (its matmul canonicalisation handles fp8 operands for TPU
generation 7 alone)."""

LSE_LANES = 128
"""Lanes of the kernel's LSE output: each row's value broadcast over one lane tile, so its blocks
are laid out as the output's (``(bq, hb * G, 128)`` f32); the wrapper returns lane 0."""

SMEM_CAPACITY_BYTES = 1024 * 1024
"""SMEM per TensorCore on v5e, v6e and v7x (jax._src.tpu_info)."""

SMEM_SCALAR_PREFETCH_LIMIT_BYTES = SMEM_CAPACITY_BYTES // 2
"""What the scalar-prefetched metadata may take; the rest stays for Mosaic's own use."""

_SMEM_WORD_ALIGN = 128
"""Each SMEM array is padded to a multiple of 128 words (a conservative estimate)."""


# --------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    """``(P, Hkv, S, 2 * D)``: the TPU layout of one layer's cache (see the module docstring)."""
    return (num_blocks, num_kv_heads, block_size, 2 * head_size)


def to_reference_layout(kv_cache):
    """``[P, Hkv, S, 2D]`` (TPU) -> ``[2, P, S, Hkv, D]`` (reference / XLA): a transpose copy."""
    num_blocks, num_kv_heads, block_size, width = kv_cache.shape
    x = kv_cache.reshape(num_blocks, num_kv_heads, block_size, 2, width // 2)
    return jnp.transpose(x, (3, 0, 2, 1, 4))


def from_reference_layout(kv_cache):
    """``[2, P, S, Hkv, D]`` (reference / XLA) -> ``[P, Hkv, S, 2D]`` (TPU): a transpose copy."""
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    x = jnp.transpose(kv_cache, (1, 3, 2, 0, 4))  # [P, Hkv, S, 2, D]
    return x.reshape(num_blocks, num_kv_heads, block_size, 2 * head_size)


def new_kv_rows(k, v, cache_dtype, k_scale=None, v_scale=None):
    """``[T, Hkv, 2D]`` rows as the TPU layout stores them: ``[k, v]`` quantised for fp8 caches."""
    k_new = quantize_to_cache(k, cache_dtype, k_scale)
    v_new = quantize_to_cache(v, cache_dtype, v_scale)
    return jnp.concatenate([k_new, v_new], axis=-1)


def write_to_tpu_kv_cache(kv_cache, k, v, slot_mapping, k_scale=None, v_scale=None):
    """The layout's write path outside the kernel (encoder K/V, tests): a slot scatter.

    kv_cache ``[P, Hkv, S, 2D]``; k, v ``f[T, Hkv, D]``; slot_mapping ``i32[T]`` (-1 and
    slots past ``P * S`` write nothing). Same semantics as ``kv_cache.write_to_kv_cache``.
    """
    check_tpu_cache_layout(kv_cache, num_kv_heads=k.shape[1], head_size=k.shape[2])
    num_blocks, _, block_size, _ = kv_cache.shape
    rows = new_kv_rows(k, v, kv_cache.dtype, k_scale, v_scale)  # [T, Hkv, 2D]
    slots = jnp.asarray(slot_mapping)
    slots = jnp.where((slots < 0) | (slots >= num_blocks * block_size), num_blocks * block_size, slots)
    return kv_cache.at[slots // block_size, :, slots % block_size].set(rows, mode="drop")


def check_tpu_cache_layout(kv_cache, *, num_kv_heads: int | None, head_size: int) -> None:
    """ValueError unless ``kv_cache`` is ``[P, Hkv, S, 2D]`` for these heads (the TPU layout);
    ``num_kv_heads=None`` accepts any head count."""
    shape = tuple(kv_cache.shape)
    heads_ok = len(shape) == 4 and (num_kv_heads is None or shape[1] == num_kv_heads)
    if not heads_ok or shape[3] != 2 * head_size:
        hint = ""
        if len(shape) == 5 and shape[0] == 2:
            hint = " It looks like the reference/XLA layout [2, P, S, Hkv, D]: convert it with from_reference_layout."
        raise ValueError(
            f"kv_cache.shape={shape} is not the PALLAS_TPU layout [num_blocks, num_kv_heads"
            f"{'' if num_kv_heads is None else f'={num_kv_heads}'}, "
            f"block_size, 2 * head_size={2 * head_size}] (K and V interleaved on the last axis).{hint}"
        )
    if np.dtype(kv_cache.dtype) not in CACHE_STORAGE_DTYPES:
        valid = ", ".join(str(d) for d in CACHE_STORAGE_DTYPES)
        raise TypeError(f"kv_cache.dtype={np.dtype(kv_cache.dtype)} is not a cache dtype. Valid dtypes are: {valid}")


def check_tpu_shapes(*, head_size: int | None = None, page_size: int | None = None, kv_dtype=None) -> None:
    """ValueError naming the value when the kernel cannot tile this head size, page size
    or (cache dtype, page size) combination; None skips a check."""
    if head_size is not None and head_size not in SUPPORTED_HEAD_SIZES:
        raise ValueError(
            f"head_size={head_size} is not supported by the TPU kernel; supported: {list(SUPPORTED_HEAD_SIZES)}"
        )
    if page_size is not None and page_size not in SUPPORTED_PAGE_SIZES:
        raise ValueError(
            f"page_size={page_size} is not supported by the TPU kernel; supported: {list(SUPPORTED_PAGE_SIZES)}"
        )
    fp8 = kv_dtype is not None and np.dtype(kv_dtype).itemsize == 1
    if fp8 and page_size is not None and page_size < FP8_MIN_PAGE_SIZE:
        raise ValueError(
            f"page_size={page_size} with an fp8 cache ({np.dtype(kv_dtype)}) is not supported by the TPU kernel: "
            f"fp8 packs {FP8_MIN_PAGE_SIZE} rows per sublane tile, so pages need >= {FP8_MIN_PAGE_SIZE} slots"
        )


# --------------------------------------------------------------------------------------
# Schedule and SMEM budget
# --------------------------------------------------------------------------------------


def tpu_schedule(query_start_loc, num_tokens: int, q_tokens_per_block: int, xp=jnp):
    """i32[2 * NB]: for each of the ``NB = ceil(num_tokens / bq)`` q-blocks, its first
    request then (at ``NB + b``) one past its last request with tokens in the block.

    Requests with no tokens at the batch's tail (bucket padding) fall outside every
    block. Runs on the host (``xp=numpy``, the metadata builder) or traced (``xp=jnp``).
    """
    qsl = query_start_loc.astype(np.int32)
    num_blocks = -(-num_tokens // q_tokens_per_block)
    start = xp.arange(num_blocks, dtype=np.int32) * q_tokens_per_block
    end = xp.minimum(start + q_tokens_per_block, qsl[-1])
    first = searchsorted(xp, qsl[1:], start, side="right").astype(np.int32)
    last = searchsorted(xp, qsl[:-1], end, side="left").astype(np.int32)
    last = xp.where(end > start, xp.maximum(last, first), first)  # a block of padding rows only: none
    return xp.concatenate([first, last]).astype(np.int32)


VMEM_DEFAULT_SCOPED_BYTES = 16 * 1024 * 1024
"""Mosaic's default scoped VMEM limit on v5e (the smallest of v5e, v6e and v7x)."""

VMEM_MAX_BYTES = 64 * 1024 * 1024
"""VMEM per TensorCore on v7x, the smallest of v5e (128 MiB), v6e (128 MiB) and v7x."""


def vmem_bytes_estimate(bs: TpuBlockSizes, *, group: int, head_size: int, page_size: int, q_itemsize: int,
                        kv_itemsize: int, per_row_inputs: int = 0, lse: bool = False) -> int:  # fmt: skip
    """Approximate VMEM of one program: double-buffered q and out blocks, the KV buffers, the
    decode buffer, per-row inputs (ALiBi, sinks: a lane tile each), with ``lse`` the LSE
    output blocks and their decode buffer (a lane tile per row), and per KV head the f32
    accumulator, the two row statistics (a lane tile per row) and the score tiles."""
    hb, bq, ppb = bs.kv_heads_per_block or 1, bs.q_tokens_per_block, bs.kv_pages_per_block
    rows, width, bkv = bq * group, 2 * head_size, ppb * page_size
    dq = width if head_size % 128 else head_size
    blocks = 2 * 2 * bq * hb * group * dq * q_itemsize  # q and out, double-buffered
    kv = 2 * hb * bkv * width * kv_itemsize
    decode = bq * hb * group * dq * 4
    per_row = (per_row_inputs * 2 + 3 * lse) * hb * rows * LSE_LANES * 4
    live = hb * (rows * dq * 4 + 2 * rows * 128 * 4) + 2 * rows * bkv * 4 + 2 * bkv * width * 4
    return int(blocks + kv + decode + per_row + live)


def vmem_limit_for(bs: TpuBlockSizes, **kwargs) -> int | None:
    """None (Mosaic's default) when ``vmem_bytes_estimate`` fits the default scoped limit,
    else 1.5x the estimate; ValueError naming ``VMEM_MAX_BYTES`` when even that cannot fit."""
    need = vmem_bytes_estimate(bs, **kwargs)
    if need <= VMEM_DEFAULT_SCOPED_BYTES * 3 // 4:
        return None
    if need > VMEM_MAX_BYTES * 3 // 4:
        raise ValueError(
            f"TPU block sizes {bs} need about {need} bytes of VMEM per program, more than 3/4 of "
            f"VMEM_MAX_BYTES={VMEM_MAX_BYTES} (v7x): use fewer q_tokens_per_block or kv_pages_per_block"
        )
    return min(need * 3 // 2, VMEM_MAX_BYTES)


def write_plan(slot_mapping, page_size: int, num_pages: int, xp=jnp):
    """i32[T]: how the kernel writes each new token, from ``slot_mapping`` (i32[T]).

    ``>= 0``: a single-token copy to that slot; ``-1``: no write (padding, a slot outside
    the cache, or a token written by a page copy); ``-(page + 2)``: token t starts a run of
    ``page_size`` tokens with consecutive slots that fill ``page`` exactly, copied as one
    DMA (prefill chunks write whole pages this way, not token by token).
    """
    slots = slot_mapping.astype(np.int32)
    num_tokens = slots.shape[0]
    valid = (slots >= 0) & (slots < num_pages * page_size)
    t = xp.arange(num_tokens, dtype=np.int32)
    follows = xp.concatenate([xp.zeros((1,), bool), valid[1:] & valid[:-1] & (slots[1:] == slots[:-1] + 1)])
    breaks = xp.cumsum(~follows).astype(np.int32)  # breaks[t]: runs started up to t
    end = xp.minimum(t + page_size - 1, num_tokens - 1)
    full = valid & (slots % page_size == 0) & (t + page_size <= num_tokens) & (breaks[end] == breaks)
    marks = xp.zeros((num_tokens + page_size,), np.int32)
    if xp is np:
        np.add.at(marks, t, full.astype(np.int32))
        np.add.at(marks, t + page_size, -full.astype(np.int32))
    else:
        marks = marks.at[t].add(full.astype(np.int32)).at[t + page_size].add(-full.astype(np.int32))
    covered = xp.cumsum(marks)[:num_tokens] > 0
    return xp.where(full, -(slots // page_size) - 2, xp.where(valid & ~covered, slots, -1)).astype(np.int32)


def smem_bytes(*arrays_or_sizes) -> int:
    """Estimated SMEM bytes of int32 scalar-prefetch arrays (given as arrays or element counts)."""
    total = 0
    for x in arrays_or_sizes:
        n = int(x) if isinstance(x, (int, np.integer)) else int(np.prod(x.shape))
        total += 4 * (-(-n // _SMEM_WORD_ALIGN) * _SMEM_WORD_ALIGN)
    return total


def check_smem_capacity(*, num_reqs: int, pages_per_req: int, num_tokens: int, q_tokens_per_block: int) -> int:
    """Bytes the metadata takes in SMEM; ValueError naming the limit when it does not fit."""
    num_q_blocks = -(-num_tokens // q_tokens_per_block)
    parts = {
        "query_start_loc": num_reqs + 1,
        "seq_lens": num_reqs,
        "block_tables": num_reqs * pages_per_req,
        "slot_mapping": num_tokens,
        "schedule": 2 * num_q_blocks,
    }
    total = smem_bytes(*parts.values())
    if total > SMEM_SCALAR_PREFETCH_LIMIT_BYTES:
        detail = ", ".join(f"{k}={4 * v} B" for k, v in parts.items())
        raise ValueError(
            f"the metadata bucket (num_reqs={num_reqs}, pages_per_req={pages_per_req}, num_tokens={num_tokens}) "
            f"needs {total} bytes of SMEM for scalar prefetch ({detail}), more than the TPU kernel's limit "
            f"SMEM_SCALAR_PREFETCH_LIMIT_BYTES={SMEM_SCALAR_PREFETCH_LIMIT_BYTES} (half of the "
            f"{SMEM_CAPACITY_BYTES} bytes of SMEM per core): use smaller request or blocks-per-request buckets"
        )
    return total


# --------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static the kernel body needs (hashable: part of the jit key)."""

    sm_scale: float
    causal: bool
    sliding_window: int | None
    soft_cap: float | None
    has_alibi: bool
    has_sinks: bool
    has_write: bool
    fp8: bool
    has_lse: bool  # a third output: each row's log-sum-exp (LSE_LANES lanes)
    fp8_query: bool  # FP8 attention: e4m3 q (quantised here), e4m3 x e4m3 dots, e4m3 weights for p @ v
    group: int
    head_size: int
    packed: bool  # D = 64: q and out span the whole [k, v] row
    num_tokens: int  # padded to a multiple of q_tokens_per_block
    num_reqs: int
    pages_per_req: int
    bs: TpuBlockSizes


def _kernel(qsl_ref, seq_lens_ref, tables_ref, slots_ref, sched_ref, *refs, st: _Static):
    """One (head block, q-block). refs: q, [alibi], [sinks], [scales], [kv_new], kv_in, out, kv_out,
    [lse], scratch ([lse decode buffer] last).

    Integer division is ``lax.div`` / ``lax.rem`` on non-negative values (``//`` lowers
    through ``sign``, which Mosaic lowers per TPU generation).
    """
    refs = list(refs)
    q_ref = refs.pop(0)
    alibi_ref = refs.pop(0) if st.has_alibi else None
    sinks_ref = refs.pop(0) if st.has_sinks else None
    scales_ref = refs.pop(0) if st.fp8 else None
    kv_new_ref = refs.pop(0) if st.has_write else None
    lse_ref = dec_lse = None
    if st.has_lse:
        *refs, dec_lse = refs
        lse_ref = refs.pop(3)
    _kv_in_ref, o_ref, kv_ref, kv_buf, sems, write_sem, dec_buf, dec_flags = refs  # kv_ref aliases _kv_in_ref

    hb, bq, ppb = st.bs.kv_heads_per_block, st.bs.q_tokens_per_block, st.bs.kv_pages_per_block
    h_blk, qb = pl.program_id(0), pl.program_id(1)
    num_q_blocks = pl.num_programs(1)
    h0 = h_blk * hb
    num_pages, _, page_size, width = kv_ref.shape
    bkv = ppb * page_size
    rows = bq * st.group
    d = st.head_size

    # 1. New keys and values into their slots (all tokens, this head block), before any read.
    if st.has_write:

        def row_copy(t, plan):  # one token's row: [hb, 2D]
            page, offset = jax.lax.div(plan, page_size), jax.lax.rem(plan, page_size)
            return pltpu.make_async_copy(
                kv_new_ref.at[pl.ds(h0, hb), t], kv_ref.at[page, pl.ds(h0, hb), offset], write_sem.at[0]
            )

        def page_copy(t, plan):  # a whole page from tokens t .. t + S - 1: [hb, S, 2D]
            return pltpu.make_async_copy(
                kv_new_ref.at[pl.ds(h0, hb), pl.ds(t, page_size)],
                kv_ref.at[-plan - 2, pl.ds(h0, hb)],
                write_sem.at[0],
            )

        @pl.when(qb == 0)
        def _write():
            def start(t, c):
                plan = slots_ref[t]
                pl.when(plan >= 0)(lambda: row_copy(t, plan).start())
                pl.when(plan <= -2)(lambda: page_copy(t, plan).start())
                return c

            def wait(t, c):
                plan = slots_ref[t]
                pl.when(plan >= 0)(lambda: row_copy(t, plan).wait())
                pl.when(plan <= -2)(lambda: page_copy(t, plan).wait())
                return c

            jax.lax.fori_loop(0, st.num_tokens, start, 0)
            jax.lax.fori_loop(0, st.num_tokens, wait, 0)

    # 2. The (request, KV block) pairs of this q-block, double-buffered.
    tok_lo = qb * bq
    r_first, r_end = sched_ref[qb], sched_ref[num_q_blocks + qb]
    row = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    tok = tok_lo + jax.lax.div(row, st.group)  # i32[rows, 1]

    def request(r):
        """(q_start, q_end, kv_len, first KV block, end KV block) of request r (clamped to a real one)."""
        r = jnp.minimum(r, st.num_reqs - 1)
        q_start, q_end, kv_len = qsl_ref[r], qsl_ref[r + 1], seq_lens_ref[r]
        q_len = q_end - q_start
        lo_tok, hi_tok = jnp.maximum(q_start, tok_lo), jnp.minimum(q_end, tok_lo + bq)
        first_pos = kv_len - q_len + (lo_tok - q_start)
        kv_hi = jnp.minimum(kv_len, kv_len - q_len + (hi_tok - q_start)) if st.causal else kv_len
        kv_lo = jnp.maximum(first_pos - st.sliding_window + 1, 0) if st.sliding_window is not None else 0
        blk_lo = jax.lax.div(kv_lo, bkv)
        blk_hi = jnp.maximum(jax.lax.div(kv_hi + bkv - 1, bkv), blk_lo + 1)  # at least one block: a uniform loop
        return q_start, q_end, kv_len, blk_lo, blk_hi

    def page_copies(r, blk, slot):
        """The DMAs of KV block ``blk`` of request r into buffer ``slot``, with their predicates."""
        r = jnp.minimum(r, st.num_reqs - 1)
        num_used = jax.lax.div(seq_lens_ref[r] + page_size - 1, page_size)
        copies = []
        for j in range(ppb):
            idx = blk * ppb + j
            live = idx < num_used
            idx = jnp.minimum(idx, st.pages_per_req - 1)
            page = jnp.clip(tables_ref[r * st.pages_per_req + idx], 0, num_pages - 1)
            copy = pltpu.make_async_copy(kv_ref.at[page, pl.ds(h0, hb)], kv_buf.at[slot, :, j], sems.at[slot])
            copies.append((live, copy))
        return copies

    def start_fetch(r, blk, slot):
        for live, copy in page_copies(r, blk, slot):
            pl.when(live)(copy.start)

    def wait_fetch(r, blk, slot):
        for live, copy in page_copies(r, blk, slot):
            pl.when(live)(copy.wait)

    k_scale = scales_ref[0] if st.fp8 and not st.fp8_query else None
    v_scale = scales_ref[1] if st.fp8 and not st.fp8_query else None
    precision = jax.lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 and not st.fp8_query else None
    # FP8 attention: tiles route non-finite values in f32 (exact for e4m3 entries), then enter the dots
    # as e4m3; q_scale * k_scale multiplies the scores, v_scale / FP8_P_SCALE the output.
    mm_dtype = common.FP8_DTYPE if st.fp8_query else q_ref.dtype
    tile_dtype = jnp.float32 if st.fp8_query else mm_dtype
    p_scale, qk_scale, inv_q_scale, out_scale = None, None, None, None
    if st.fp8_query:
        p_scale = common.FP8_P_SCALE
        qk_scale = scales_ref[2] * scales_ref[0]
        inv_q_scale = 1.0 / scales_ref[2]
        out_scale = scales_ref[1] * (1.0 / common.FP8_P_SCALE)

    def load_q(block):
        """A q block [.., G, Dq] folded to [rows, Dq] in the matmul dtype (e4m3 for FP8 attention)."""
        q = _fold_rows(block)
        return common.quantize_fp8(q, inv_q_scale) if st.fp8_query else q

    def finish(state):
        """f32[rows, W] output of a finished state (FP8 attention: v_scale / FP8_P_SCALE applied)."""
        out = common.finalize_softmax_state(state)
        return out * out_scale if st.fp8_query else out

    def finish_lse(state, n):
        """f32[n, LSE_LANES]: the state's log-sum-exp per row, over a lane tile; -inf where nothing was seen."""
        m, denom, _ = state
        return jnp.broadcast_to(common.log_sum_exp(m, denom), (n, LSE_LANES))

    def kv_tile(slot, i, blk, kv_len):
        """(k, v) of KV head i of the block in buffer ``slot``: [bkv, Dq], [bkv, W] in the matmul
        dtype, rows past kv_len zeroed (unused slots may hold NaN)."""
        kv_valid = (blk * bkv + jax.lax.broadcasted_iota(jnp.int32, (bkv, 1), 0)) < kv_len  # bool[bkv, 1]
        tile = kv_buf[slot, i].reshape(bkv, width)  # [bkv, 2D], cache dtype (a value reshape)
        if st.packed:  # D = 64: one 128-lane row holds [k, v]
            k = v = jnp.where(kv_valid, common.dequantize(tile, k_scale), 0.0)
            if st.fp8:
                v = jnp.where(kv_valid, common.dequantize(tile, v_scale), 0.0)
        else:
            k = jnp.where(kv_valid, common.dequantize(tile[:, :d], k_scale), 0.0)
            v = jnp.where(kv_valid, common.dequantize(tile[:, d:], v_scale), 0.0)
        return k.astype(tile_dtype), v.astype(tile_dtype)

    def update(state, q, k, v, q_pos, kv_pos, visible, slopes):
        k, v = common.route_nonfinite_values(k, v)  # rows not seeing a non-finite value stay clean
        k, v = k.astype(mm_dtype), v.astype(mm_dtype)
        s = jax.lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )  # f32[rows, bkv]
        if st.fp8_query:
            s = s * qk_scale
        s = common.transform_scores(s, q_pos, kv_pos, sm_scale=st.sm_scale, soft_cap=st.soft_cap, alibi_slopes=slopes)
        return common.online_softmax_update(state, s, visible, v, precision=precision, p_scale=p_scale)

    def heads(i):
        return slice(i * st.group, (i + 1) * st.group)

    def full_compute(r, blk, slot, states):
        """Every row of the q-block against KV block ``blk`` of request r (rows of other requests see nothing)."""
        q_start, q_end, kv_len, _, _ = request(r)
        q_len = q_end - q_start
        in_req = (tok >= q_start) & (tok < q_end)
        q_pos = jnp.where(in_req, kv_len - q_len + (tok - q_start), -1)  # i32[rows, 1]
        kv_pos = blk * bkv + jax.lax.broadcasted_iota(jnp.int32, (1, bkv), 1)  # i32[1, bkv]
        visible = common.visible_mask(
            q_pos, kv_pos, kv_len, causal=st.causal, sliding_window=st.sliding_window, row_valid=in_req
        )
        new_states = []
        for i in range(hb):
            k, v = kv_tile(slot, i, blk, kv_len)
            q = load_q(q_ref[:, heads(i), :])  # [rows, Dq]
            slopes = alibi_ref[i] if st.has_alibi else None  # f32[rows, 1]
            new_states.append(update(states[i], q, k, v, q_pos, kv_pos, visible, slopes))
        return tuple(new_states)

    def decode_compute(r, blk, slot, states):
        """A decode (one new token, local index j): only its G rows, with their own state,
        reset at the request's first block and stored to ``dec_buf[j]`` at its last."""
        q_start, _, kv_len, blk_lo, blk_hi = request(r)
        j = q_start - tok_lo
        q_pos = jnp.full((st.group, 1), kv_len - 1, jnp.int32)
        kv_pos = blk * bkv + jax.lax.broadcasted_iota(jnp.int32, (1, bkv), 1)
        visible = common.visible_mask(q_pos, kv_pos, kv_len, causal=st.causal, sliding_window=st.sliding_window)
        new_states = []
        for i in range(hb):
            fresh = common.init_softmax_state(
                st.group, acc_width, sinks=sinks_ref[i][: st.group] if st.has_sinks else None, column=True
            )
            state = jax.tree.map(lambda a, b: jnp.where(blk == blk_lo, a, b), fresh, states[i])
            k, v = kv_tile(slot, i, blk, kv_len)
            q = load_q(q_ref[pl.ds(j, 1), heads(i), :])  # [G, Dq]
            slopes = alibi_ref[i][: st.group] if st.has_alibi else None
            new_states.append(update(state, q, k, v, q_pos, kv_pos, visible, slopes))

        @pl.when(blk == blk_hi - 1)
        def _store():
            for i in range(hb):
                out = finish(new_states[i])  # f32[G, W]
                dec_buf[pl.ds(j, 1), heads(i), :] = out.reshape(1, st.group, acc_width)
                if st.has_lse:
                    dec_lse[pl.ds(j, 1), heads(i), :] = finish_lse(new_states[i], st.group).reshape(
                        1, st.group, LSE_LANES
                    )
            dec_flags[j] = 1

        return tuple(new_states)

    acc_width = width if st.packed else d
    states = tuple(
        common.init_softmax_state(rows, acc_width, sinks=sinks_ref[i] if st.has_sinks else None, column=True)
        for i in range(hb)
    )
    dec_states = tuple(common.init_softmax_state(st.group, acc_width, column=True) for _ in range(hb))

    def clear_flag(j, c):
        dec_flags[j] = 0
        return c

    jax.lax.fori_loop(0, bq, clear_flag, 0)

    @pl.when(r_first < r_end)
    def _prefetch_first():
        start_fetch(r_first, request(r_first)[3], 0)

    def body(carry):
        r, blk, slot, states, dec_states = carry
        q_start, q_end, _, _, blk_hi = request(r)
        last_of_req = blk + 1 >= blk_hi
        next_r = jnp.where(last_of_req, r + 1, r)
        next_blk = jnp.where(last_of_req, request(r + 1)[3], blk + 1)

        @pl.when(next_r < r_end)
        def _prefetch_next():
            start_fetch(next_r, next_blk, 1 - slot)

        wait_fetch(r, blk, slot)
        states, dec_states = jax.lax.cond(
            q_end - q_start == 1,
            lambda: (states, decode_compute(r, blk, slot, dec_states)),
            lambda: (full_compute(r, blk, slot, states), dec_states),
        )
        return next_r, next_blk, 1 - slot, states, dec_states

    init = (r_first, request(r_first)[3], jnp.int32(0), states, dec_states)
    _, _, _, states, _ = jax.lax.while_loop(lambda c: c[0] < r_end, body, init)

    for i in range(hb):
        out = finish(states[i])  # f32[rows, W]
        o_ref[:, heads(i), :] = out.reshape(bq, st.group, -1).astype(o_ref.dtype)
        if st.has_lse:
            lse_ref[:, heads(i), :] = finish_lse(states[i], rows).reshape(bq, st.group, LSE_LANES)

    def decode_rows(j, c):  # decodes replace their (empty) rows of the full state
        @pl.when(dec_flags[j] == 1)
        def _copy():
            o_ref[pl.ds(j, 1)] = dec_buf[pl.ds(j, 1)].astype(o_ref.dtype)
            if st.has_lse:
                lse_ref[pl.ds(j, 1)] = dec_lse[pl.ds(j, 1)]

        return c

    jax.lax.fori_loop(0, bq, decode_rows, 0)


def _fold_rows(q):
    """[bq, G, Dq] -> [bq * G, Dq] (row t * G + g). A packed dtype folds through float32
    when G is not a whole number of packed rows (as JAX's TPU ragged attention does)."""
    bq, group, dq = q.shape
    packing = 4 // q.dtype.itemsize
    if group % packing:
        return q.astype(jnp.float32).reshape(bq * group, dq).astype(q.dtype)
    return q.reshape(bq * group, dq)


# --------------------------------------------------------------------------------------
# The op
# --------------------------------------------------------------------------------------


def ragged_paged_attention(
    q,  # f[T, Hq, D]
    k,  # f[T, Hkv, D] | None: new keys, written at slot_mapping; None = no write
    v,  # f[T, Hkv, D] | None
    kv_cache,  # [P, Hkv, S, 2D]: the TPU layout (kv_cache_shape)
    query_start_loc,  # i32[R + 1]
    seq_lens,  # i32[R]
    block_tables,  # i32[R, pages_per_req]
    slot_mapping,  # i32[T]; -1 = padding, skipped
    *,
    sm_scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes=None,  # f32[Hq] | None
    sinks=None,  # f32[Hq] | None
    k_scale=None,  # f32[] | None: fp8 caches store k / k_scale
    v_scale=None,  # f32[] | None
    interpret: bool | None = None,
    block_sizes: TpuBlockSizes | None = None,
    schedule=None,  # i32[2 * NB] from tpu_schedule (the builder's); derived here when None
    device_kind: str | None = None,
    vmem_limit_bytes: int | None = None,
    q_scale=None,  # f32[] | None: FP8 attention (an e4m3 cache), as the reference's
    return_lse: bool = False,
):
    """The reference op (same arguments, same result) as one Mosaic TPU kernel.

    Returns ``(out f[T, Hq, D] in q's dtype, kv_cache [P, Hkv, S, 2D])``, and with
    ``return_lse`` a third value ``lse f32[T, Hq]`` as the reference's (each row's log
    softmax denominator, its sink included; -inf for a row that sees no key). kv_cache is in
    the TPU layout (``kv_cache_shape``; ``from_reference_layout`` converts the reference
    one); new k/v are written into it inside the kernel, in place when it is donated.

    ``interpret=None`` compiles for a TPU when the default backend is one and runs the
    TPU interpreter (``pltpu.InterpretParams()``) elsewhere. ``block_sizes`` default to
    the tuned table for ``device_kind`` (or the heuristic, ``config.tpu_block_sizes``);
    ``schedule`` is ``tpu_schedule(query_start_loc, T_padded, q_tokens_per_block)``.

    With ``q_scale`` (FP8 attention, the reference's semantics) the kernel quantises each q
    block to e4m3 and runs both dots e4m3 x e4m3 with float32 accumulation. Mosaic lowers fp8 x
    fp8 matmuls for TPU generation 7 (v7x, fp8 MXU); the PALLAS_TPU backend refuses FP8
    attention on older TPUs (``FP8_QUERY_TPU_KINDS``).

    Example::

        out, kv_cache = ragged_paged_attention(
            q, k, v, kv_cache, query_start_loc, seq_lens, block_tables, slot_mapping,
            sm_scale=head_size**-0.5)
    """
    check_query(q)
    num_tokens, num_q_heads, head_size = q.shape
    check_tpu_cache_layout(kv_cache, num_kv_heads=None, head_size=head_size)
    num_blocks, num_kv_heads, page_size, _ = kv_cache.shape
    ref_cache = jax.ShapeDtypeStruct((2, num_blocks, page_size, num_kv_heads, head_size), kv_cache.dtype)
    validate_inputs(  # on the cache seen in the reference's terms (shape only)
        q, k, v, ref_cache, query_start_loc, seq_lens, block_tables, slot_mapping, sm_scale=sm_scale, causal=causal,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, sinks=sinks,
        q_scale=q_scale,
    )  # fmt: skip
    check_tpu_shapes(head_size=head_size, page_size=page_size, kv_dtype=kv_cache.dtype)
    num_reqs, pages_per_req = block_tables.shape
    if num_tokens == 0:  # nothing to write or attend; a zero-sized grid would not lower
        empty = (jnp.zeros_like(q), kv_cache)
        return (*empty, jnp.zeros((0, num_q_heads), jnp.float32)) if return_lse else empty
    group = num_q_heads // num_kv_heads
    if block_sizes is None:
        block_sizes = tpu_block_sizes(
            q_dtype=q.dtype, kv_dtype=kv_cache.dtype, group=group, head_size=head_size, page_size=page_size,
            num_kv_heads=num_kv_heads, num_tokens=num_tokens, pages_per_req=pages_per_req, device_kind=device_kind,
        )  # fmt: skip
    if block_sizes.kv_heads_per_block is None:
        block_sizes = dataclasses.replace(block_sizes, kv_heads_per_block=min_kv_heads_per_block(group, num_kv_heads))
    check_tpu_block_sizes(
        block_sizes, group=group, num_kv_heads=num_kv_heads, pages_per_req=pages_per_req, q_dtype=q.dtype
    )
    bq = block_sizes.q_tokens_per_block
    padded_tokens = -(-num_tokens // bq) * bq
    check_smem_capacity(num_reqs=num_reqs, pages_per_req=pages_per_req, num_tokens=padded_tokens,
                        q_tokens_per_block=bq)  # fmt: skip
    fp8 = bool(np.dtype(kv_cache.dtype) in (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)))
    if vmem_limit_bytes is None:
        vmem_limit_bytes = vmem_limit_for(
            block_sizes, group=group, head_size=head_size, page_size=page_size, q_itemsize=q.dtype.itemsize,
            kv_itemsize=kv_cache.dtype.itemsize, per_row_inputs=(alibi_slopes is not None) + (sinks is not None),
            lse=return_lse,
        )  # fmt: skip
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    qsl = jnp.asarray(query_start_loc, jnp.int32)
    if schedule is None:
        schedule = tpu_schedule(qsl, padded_tokens, bq)
    kv_new = None
    if k is not None:
        kv_new = new_kv_rows(k, v, kv_cache.dtype, k_scale, v_scale)  # [T, Hkv, 2D]
        kv_new = jnp.pad(kv_new, ((0, padded_tokens - num_tokens), (0, 0), (0, 0))).transpose(1, 0, 2)
    slots = jnp.pad(jnp.asarray(slot_mapping, jnp.int32), (0, padded_tokens - num_tokens), constant_values=-1)
    slots = write_plan(slots, page_size, num_blocks) if k is not None else slots
    scales = None
    if fp8:
        one = jnp.float32(1.0)
        scales = jnp.stack([
            one if x is None else jnp.asarray(x, jnp.float32).reshape(()) for x in (k_scale, v_scale, q_scale)
        ])  # fmt: skip
    st = _Static(
        sm_scale=float(sm_scale), causal=bool(causal), sliding_window=sliding_window,
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        has_alibi=alibi_slopes is not None, has_sinks=sinks is not None, has_write=k is not None, fp8=fp8,
        fp8_query=q_scale is not None, has_lse=bool(return_lse),
        group=group, head_size=head_size, packed=head_size % 128 != 0, num_tokens=padded_tokens,
        num_reqs=num_reqs, pages_per_req=pages_per_req, bs=block_sizes,
    )  # fmt: skip
    out, kv_cache, lse = _call(
        st, q, kv_cache, qsl, jnp.asarray(seq_lens, jnp.int32), jnp.asarray(block_tables, jnp.int32), slots,
        jnp.asarray(schedule, jnp.int32), alibi_slopes, sinks, scales, kv_new, interpret, vmem_limit_bytes,
    )  # fmt: skip
    return (out, kv_cache, lse) if return_lse else (out, kv_cache)


@functools.partial(jax.jit, static_argnums=(0, 12, 13))
def _call(st: _Static, q, kv_cache, qsl, seq_lens, tables, slots, schedule, alibi, sinks, scales, kv_new,
          interpret, vmem_limit_bytes):  # fmt: skip
    num_tokens, num_q_heads, head_size = q.shape
    num_blocks, num_kv_heads, page_size, width = kv_cache.shape
    bs, group = st.bs, st.group
    hb, bq, ppb = bs.kv_heads_per_block, bs.q_tokens_per_block, bs.kv_pages_per_block
    padded = st.num_tokens
    rows = bq * group
    # q [T, Hq, D] is read in place: a block is bq tokens x the hb * G query heads of hb KV heads.
    qp = q if padded == num_tokens else jnp.pad(q, ((0, padded - num_tokens), (0, 0), (0, 0)))
    if st.packed:  # zeros against the value half of each [k, v] row
        qp = jnp.pad(qp, ((0, 0), (0, 0), (0, width - head_size)))
    dq = qp.shape[-1]
    out_width = width if st.packed else head_size

    grid = (num_kv_heads // hb, padded // bq)
    blk = lambda h, b, *_: (b, h, 0)  # noqa: E731
    in_specs = [pl.BlockSpec((bq, hb * group, dq), blk)]
    args = [qp]
    if st.has_alibi:  # per row: the slope of its query head, [Hkv, rows, 1]
        per_row = jnp.tile(jnp.asarray(alibi, jnp.float32).reshape(num_kv_heads, 1, group), (1, bq, 1))
        args.append(per_row.reshape(num_kv_heads, rows, 1))
        in_specs.append(pl.BlockSpec((hb, rows, 1), lambda h, b, *_: (h, 0, 0)))
    if st.has_sinks:  # per row: the sink of its query head, [Hkv, rows, 1]
        per_row = jnp.tile(jnp.asarray(sinks, jnp.float32).reshape(num_kv_heads, 1, group), (1, bq, 1))
        args.append(per_row.reshape(num_kv_heads, rows, 1))
        in_specs.append(pl.BlockSpec((hb, rows, 1), lambda h, b, *_: (h, 0, 0)))
    if st.fp8:
        args.append(scales)
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
    if st.has_write:
        args.append(kv_new)
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    args.append(kv_cache)
    in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    prefetch = (qsl, seq_lens, tables.reshape(-1), slots, schedule)
    cache_index = len(prefetch) + len(args) - 1

    out_shape = [
        jax.ShapeDtypeStruct((padded, num_q_heads, out_width), q.dtype),
        jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
    ]
    out_specs = [pl.BlockSpec((bq, hb * group, out_width), blk), pl.BlockSpec(memory_space=pl.ANY)]
    if st.has_lse:  # each row's LSE over a lane tile, in the output's blocks
        out_shape.append(jax.ShapeDtypeStruct((padded, num_q_heads, LSE_LANES), jnp.float32))
        out_specs.append(pl.BlockSpec((bq, hb * group, LSE_LANES), blk))
    scratch = [
        pltpu.VMEM((2, hb, ppb, page_size, width), kv_cache.dtype),
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.SemaphoreType.DMA((1,)),
        pltpu.VMEM((bq, hb * group, out_width), jnp.float32),  # decode results
        pltpu.SMEM((bq,), jnp.int32),  # which tokens of the q-block are decodes
    ]
    if st.has_lse:
        scratch.append(pltpu.VMEM((bq, hb * group, LSE_LANES), jnp.float32))  # decode LSEs
    cost = cost_estimate(
        num_tokens=padded, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        num_reqs=tables.shape[0], pages_per_req=tables.shape[1], page_size=page_size, num_blocks=num_blocks,
        q_itemsize=q.dtype.itemsize, kv_itemsize=kv_cache.dtype.itemsize, causal=st.causal,
    )  # fmt: skip
    kernel = pl.pallas_call(
        functools.partial(_kernel, st=st),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=grid,
            in_specs=in_specs,
            out_specs=tuple(out_specs),
            scratch_shapes=scratch,
        ),  # fmt: skip
        out_shape=tuple(out_shape),
        input_output_aliases={cache_index: 1},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=vmem_limit_bytes
        ),
        cost_estimate=cost,
        interpret=pltpu.InterpretParams() if interpret else False,
        name="ragged_paged_attention_tpu",
    )
    out, kv_cache, *lse = kernel(*prefetch, *args)
    if padded != num_tokens or st.packed:
        out = out[:num_tokens, :, out_width - head_size :]  # the value half when packed
    return out, kv_cache, (lse[0][:num_tokens, :, 0] if st.has_lse else None)


def cost_estimate(*, num_tokens, num_q_heads, num_kv_heads, head_size, num_reqs, pages_per_req, page_size,
                  num_blocks, q_itemsize, kv_itemsize, causal) -> pl.CostEstimate:  # fmt: skip
    """A shape-only estimate for XLA's scheduler: every query token against its bucket's
    longest possible context (halved when causal), the KV pages read once."""
    max_ctx = pages_per_req * page_size
    pairs = num_tokens * max_ctx // (2 if causal else 1)
    kv_bytes = min(num_blocks, num_reqs * pages_per_req) * page_size * num_kv_heads * 2 * head_size * kv_itemsize
    qo_bytes = 2 * num_tokens * num_q_heads * head_size * q_itemsize
    new_kv = 2 * num_tokens * num_kv_heads * 2 * head_size * kv_itemsize
    return pl.CostEstimate(
        flops=int(4 * head_size * num_q_heads * pairs),
        transcendentals=int(num_q_heads * pairs),
        bytes_accessed=int(kv_bytes + qo_bytes + new_kv),
    )


def workload_cost(query_lens, context_lens, *, num_q_heads, num_kv_heads, head_size, page_size,
                  q_itemsize, kv_itemsize, block_sizes: TpuBlockSizes, causal=True) -> dict[str, int]:  # fmt: skip
    """Host model of what the kernel moves and computes for one batch (NumPy, exact lengths).

    Returns ``kv_bytes`` (pages DMA'd: per q-block, each request's KV range up to its
    last visible position, whole pages), ``qo_bytes`` (q read, out written by the
    kernel), ``layout_bytes`` (head size 64 only: the wrapper pads q to 128 lanes and
    slices the value half of out, a read and a write each), ``write_bytes`` (new k/v
    rows: read and written), ``useful_flops`` (4 * D per visible (q, k) pair per query
    head, DESIGN.md's floor) and ``mxu_flops``
    (what the kernel's matmuls execute: every row of a q-block, or a decode's G rows,
    against every key of each KV block it walks).
    """
    query_lens, context_lens = np.asarray(query_lens, np.int64), np.asarray(context_lens, np.int64)
    group = num_q_heads // num_kv_heads
    bq, ppb = block_sizes.q_tokens_per_block, block_sizes.kv_pages_per_block
    bkv = ppb * page_size
    qsl = np.concatenate([[0], np.cumsum(query_lens)])
    total = int(qsl[-1])
    kv_pages = mxu_rows_cols = 0
    for b in range(-(-total // bq)):
        lo, hi = b * bq, min((b + 1) * bq, total)
        for r in np.flatnonzero((qsl[1:] > lo) & (qsl[:-1] < hi)):
            kv_len = context_lens[r] + query_lens[r]
            last_tok = min(qsl[r + 1], hi) - qsl[r]  # tokens of r in blocks <= b
            end = min(kv_len, context_lens[r] + last_tok) if causal else kv_len
            blocks = -(-end // bkv)
            kv_pages += min(blocks * ppb, -(-kv_len // page_size))
            # A decode runs on its own G rows (padded to 8 sublanes), others on the whole q-block.
            mxu_rows_cols += (max(group, 8) if query_lens[r] == 1 else bq * group) * blocks * bkv
    pairs = int(sum(q * c + q * (q + 1) // 2 for q, c in zip(query_lens, context_lens, strict=True)))
    width = 2 * head_size
    dq = width if head_size % 128 else head_size
    return {
        "kv_bytes": int(kv_pages * page_size * num_kv_heads * width * kv_itemsize),
        "qo_bytes": int(2 * total * num_q_heads * head_size * q_itemsize),
        "layout_bytes": int(6 * total * num_q_heads * head_size * q_itemsize) if head_size % 128 else 0,
        "write_bytes": int(2 * total * num_kv_heads * width * kv_itemsize),
        "useful_flops": int(4 * head_size * num_q_heads * pairs),
        "mxu_flops": int(2 * (dq + dq) * mxu_rows_cols * num_kv_heads),
    }


def estimated_smem_for(num_reqs: int, pages_per_req: int, num_tokens: int, q_tokens_per_block: int) -> int:
    """SMEM bytes of one bucket's metadata (``check_smem_capacity`` without the check)."""
    nqb = math.ceil(num_tokens / q_tokens_per_block)
    return smem_bytes(num_reqs + 1, num_reqs, num_reqs * pages_per_req, num_tokens, 2 * nqb)
