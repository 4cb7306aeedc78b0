"""Causal prefill over the paged cache as a Mosaic GPU kernel (``plgpu.kernel``, Hopper).

The long requests of a prefill batch (each request's 8-aligned span of new tokens, when
it holds at least ``2 * block_q`` of them) run here; short requests, the unaligned rows
at a span's ends and padding rows stay with the Triton kernel (``pallas_triton.py``), which
writes its rows into the same output buffer afterwards. The metadata builder schedules it
on Hopper unless ``ATTN_STACK_MGPU_PREFILL=0`` (``backends/pallas_gpu.py`` says what was
measured).

Structure (JAX's ``attention_mgpu.py``, FlashAttention-3 style, adapted to pages):

- A work item is one q-tile of ``2 * block_q`` query tokens of one request, for one query
  head; heads vary fastest, so the ``G`` heads of a KV head run side by side and share
  K/V pages through L2. A CTA serves one item (``grid = (Hq, num_tiles)``), or, on a
  persistent grid (``MgpuBlockSizes.num_ctas``, launches of few waves: ``persistent_ctas``),
  one item of each wave of ``num_ctas`` items in turn (dealt in reverse in every other
  wave, so that no CTA takes the heaviest item of each), its K/V ring and barriers running
  on from one item into the next and empty tiles skipped without a launch. Which request,
  which tokens and which positions is the host schedule ``mgpu_schedule``. A request is served on
  its 8-aligned token span (TMA boxes of q and out rows start on 8-row tiles); the
  last tile of the span is shifted back to end at the span's end (it overlaps the tile
  before it, and both write identical rows), so every row of every tile is a real row
  and the output stores are whole TMA tiles. The few rows outside the span, and the
  requests too short to fill a tile, are the Triton kernel's. A TMA into the tiled
  buffers views the whole array in 8-row tiles, so for a token count that is not a
  multiple of 8 each warpgroup takes its q rows through an untiled buffer (copied into
  the tiled one in registers) and stores its output rows from it, with no pad of q
  and no slice of out (q is padded where that buffer does not fit beside the ring).
- Three warpgroups: two compute warpgroups (``block_q`` rows each; QK^T and PV on
  ``wgmma``, online softmax in registers with exp2, ping-ponged by a schedule barrier so
  one warpgroup's softmax overlaps the other's matmuls) and one memory warpgroup that
  streams K/V blocks of ``block_kv`` keys into a ``steps_in_flight``-deep shared-memory
  ring, released by consumed barriers.
- Paging: a K (or V) block is ``block_kv // page_size`` TMA copies, one per page, each
  ``[page_size, D]`` rows of the cache at the page's id read from the block table by the
  memory warpgroup; all copies of a block complete on one barrier. One copy per page and
  not per run of consecutive pages: a TMA box has a static shape, and a run's length is
  only known at run time. Keys and values may also come held apart and of different
  widths (``prefill_attention_kv``: MLA's up-projected q/k 192 and v 128, one page per
  request); the paged cache passes its one array as both, V rows from ``v_row0``. A key
  may come in two parts, the second shared by every head (MLA's ``k_pe``): each part has
  its own ring and q.k is two wgmmas over q's matching columns, so no per-head copy of
  the shared part is ever written.
- Causal: KV blocks above the diagonal are never fetched (the loop ends at the tile's
  last position); blocks wholly below it skip the mask.
- FP8 attention (``q_scale``, an e4m3 cache): each compute warpgroup quantises its q rows
  to e4m3 once, and q.k runs on FP8 wgmma; FP8 wgmma takes both operands K-major and V's
  rows are N-major for p @ v, so the two warpgroups convert each V block to float16 in a
  shared-memory ring (exact, half a block each) and p @ v runs in float16.
- Keys past ``seq_len`` in the last block (the rest of the last page, or pages the block
  table does not name) are masked out of the scores, and the compute warpgroup zeroes
  those V rows in shared memory before the PV matmul, so NaN or garbage there cannot
  reach an output (0 * NaN would).

What it lacks, each named by ``unsupported_reason`` so the caller keeps those batches on
the Triton kernel: non-causal attention, sliding window, soft cap, ALiBi, sinks, fp8
caches (except FP8 attention, ``q_scale``, at head sizes that are multiples of 32),
float32 activations, head sizes other than 64, 80, 96, 112, 128, 192 and 256, pages that
do not tile a KV block (``block_kv % page_size`` or ``page_size % 8``). ``common.py``'s per-tile
functions are not used here: the kernel keeps ``attention_mgpu``'s softmax, written
against ``plgpu.Layout.WGMMA`` register layouts (row statistics in ``WGMMA.reduce(1)``,
base-2 exponentials with the scale folded into one multiply, the PV ``wgmma`` fed from
registers between schedule barriers), an ordering that ``common.online_softmax_update``
(one function from scores to the new state, with ``jnp.dot`` for PV) cannot express;
whether common's masks and transforms would lower here was not tried.

Lowering semantics: ``Lane`` (the ``attention_mgpu`` style). Under the default
``Warpgroup`` semantics, Mosaic GPU's layout inference rejects a TMA copy whose GMEM
row index it cannot prove a multiple of the shared-memory tile (8 rows), and the row of
a page or of a ragged request start is a run-time value.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from attn_jax.metadata import searchsorted
from attn_jax.ops.ragged_paged_attention.common import FP8_DTYPE
from attn_jax.ops.ragged_paged_attention.config import MOSAIC_GPU_SMEM_BYTES, MgpuBlockSizes, mgpu_block_sizes

SUPPORTED_HEAD_SIZES = (64, 80, 96, 112, 128, 192, 256)
"""Rows of 16-bit data that whole swizzle tiles cover (``swizzle_bytes``): 128-byte tiles at
64, 128, 192 and 256, 64-byte at 96, 32-byte at 80 and 112 (wgmma's K and N in steps of the
tile). Past 128 the default K/V blocks are 64 keys (``config.mgpu_block_sizes``), so the ring
fits Hopper's shared memory."""
SUPPORTED_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))

__all__ = [
    "MgpuBlockSizes",
    "max_num_tiles",
    "dealt_item",
    "mgpu_schedule",
    "persistent_ctas",
    "prefill_attention",
    "prefill_attention_kv",
    "smem_transforms",
    "unsupported_reason",
]


def unsupported_reason(
    *, head_size: int, page_size: int, dtype, cache_dtype, causal: bool, sliding_window=None,
    logits_soft_cap=None, alibi_slopes=None, sinks=None, block_sizes: MgpuBlockSizes | None = None,
    query_quant: bool = False,
) -> str | None:  # fmt: skip
    """Why this kernel cannot serve the configuration, or None when it can (``block_sizes``
    None: ``config.mgpu_block_sizes``' default for the head size). ``query_quant``: FP8
    attention (``prefill_attention``'s ``q_scale``) over an e4m3 cache."""
    block_sizes = block_sizes or mgpu_block_sizes(head_size=head_size)
    if not causal:
        return "the Mosaic GPU prefill kernel is causal only"
    for name, value in (("sliding_window", sliding_window), ("logits_soft_cap", logits_soft_cap),
                        ("alibi_slopes", alibi_slopes), ("sinks", sinks)):  # fmt: skip
        if value is not None:
            return f"the Mosaic GPU prefill kernel has no {name}"
    if np.dtype(dtype) not in SUPPORTED_DTYPES:
        return f"the Mosaic GPU prefill kernel takes bfloat16/float16 activations, not {np.dtype(dtype)}"
    if query_quant and np.dtype(cache_dtype) != np.dtype(FP8_DTYPE):
        return (
            f"FP8 attention on the Mosaic GPU prefill kernel needs a float8_e4m3fn cache, not {np.dtype(cache_dtype)}"
        )
    if not query_quant and np.dtype(cache_dtype) != np.dtype(dtype):
        return f"the Mosaic GPU prefill kernel needs the cache in the activation dtype, not {np.dtype(cache_dtype)}"
    if head_size not in SUPPORTED_HEAD_SIZES:
        return f"the Mosaic GPU prefill kernel takes head sizes {list(SUPPORTED_HEAD_SIZES)}, not {head_size}"
    if query_quant and head_size % 32:
        return f"FP8 attention on the Mosaic GPU prefill kernel needs e4m3 rows of whole 32-byte tiles, not {head_size}"
    smem = block_sizes.smem_bytes(head_size, dtype, cache_dtype)
    if smem > MOSAIC_GPU_SMEM_BYTES:
        return (
            f"the Mosaic GPU prefill kernel with {block_sizes} needs {smem} bytes of shared memory at "
            f"head_size={head_size}; Hopper has {MOSAIC_GPU_SMEM_BYTES}"
        )
    chunk = min(page_size, block_sizes.block_kv)
    if page_size % 8 or block_sizes.block_kv % chunk or (page_size > block_sizes.block_kv and page_size % chunk):
        return f"page_size={page_size} does not tile block_kv={block_sizes.block_kv} in rows of 8"
    return None


PERSISTENT_MAX_WAVES = 8
"""A launch of at most this many waves of items runs on a persistent grid (``persistent_ctas``)."""


def persistent_ctas(num_items: int, bs: MgpuBlockSizes) -> int | None:
    """CTAs of a persistent launch over ``num_items`` (tile, head) items, or None for one CTA
    per item: persistent when ``bs.num_ctas`` is set and the items fill at most
    ``PERSISTENT_MAX_WAVES`` waves of it. Measured on the H200 at head 128 (BENCHMARKS.md,
    stops 79-80): M1's chunks (1,024 items, half of them empty tiles) took 93.5 us on 132
    looping CTAs against 103.2 us with one CTA each; P1 (4,224 items, 32 waves) gained no
    more than the runs' spread looping, so it keeps one CTA per item."""
    if bs.num_ctas is None or num_items > PERSISTENT_MAX_WAVES * bs.num_ctas:
        return None
    return min(bs.num_ctas, num_items)


def dealt_item(i, cta, *, num_ctas: int, total: int):
    """(item, valid): the schedule item (``tile * Hq + head``) that CTA ``cta`` of a persistent
    launch serves in its ``i``-th turn, clamped into range, and whether it exists. Turn ``i``
    deals the ``i``-th wave of ``num_ctas`` items, in reverse in odd turns: the schedule is
    longest-first, so dealt in order CTA 0 would take the heaviest item of every wave (on P1's
    schedule its share is 1.031x the mean, dealt 1.000x; BENCHMARKS.md, stop 80)."""
    c = jnp.where(lax.rem(i, 2) == 0, cta, num_ctas - 1 - cta)
    w = i * num_ctas + c
    return jnp.minimum(w, total - 1), w < total


def swizzle_bytes(row_bytes: int) -> int:
    """The widest shared-memory swizzle (128, 64 or 32 bytes) that tiles a row of ``row_bytes``."""
    return next(s for s in (128, 64, 32) if row_bytes % s == 0)


def max_num_tiles(num_tokens: int, num_reqs: int, tile: int) -> int:
    """Static bound on q-tiles: each request served here has >= ``tile`` tokens and at most one partial tile."""
    full = num_tokens // tile
    return max(full + min(num_reqs, full), 1)


def mgpu_schedule(query_start_loc, seq_lens, *, num_tokens: int, tile: int, xp=jnp):
    """(i32[4, NT] tiles, (i32[R] lo, i32[R] hi)): per tile (request, first token, first
    position, kv length), and the token span ``[lo, hi)`` of each request served here.

    A TMA box of q or out rows must start at a multiple of 8 tokens (the 8-row tiles of
    the swizzled shared-memory layout), so a request is served on its 8-aligned span
    ``[ceil8(start), floor8(end))`` when that span holds at least ``tile`` tokens; the
    rows outside it (at most 7 at either end) and every other request are the Triton
    kernel's (``lo == hi`` for a request not served). Tiles start every ``tile`` tokens,
    the last shifted back to end at the span's end. Unused tiles have kv length 0 (the
    kernel skips them). Tiles are ordered by decreasing last position (longest KV extent
    first). Host (``xp=numpy``) or traced (``xp=jnp``).
    """
    num_reqs = seq_lens.shape[0]
    nt = max_num_tiles(num_tokens, num_reqs, tile)
    qsl = query_start_loc.astype(np.int32)
    start, end = qsl[:-1], qsl[1:]
    lo, hi = (start + 7) // 8 * 8, end // 8 * 8
    served = hi - lo >= tile
    lo, hi = xp.where(served, lo, end), xp.where(served, hi, end)
    span = hi - lo
    ntiles = (span + tile - 1) // tile
    cum = xp.cumsum(ntiles)
    b = xp.arange(nt, dtype=np.int32)
    req = searchsorted(xp, cum, b, side="right").astype(np.int32)
    used = req < num_reqs
    req = xp.minimum(req, num_reqs - 1)
    first = (cum[req] - ntiles[req]).astype(np.int32)
    tok = lo[req] + xp.minimum((b - first) * tile, span[req] - tile)
    kv_len = seq_lens[req]
    pos = kv_len - (end[req] - start[req]) + (tok - start[req])
    zero = xp.zeros_like(b)
    rows = (
        xp.where(used, req, zero),
        xp.where(used, tok, zero),
        xp.where(used, pos, zero),
        xp.where(used, kv_len, zero),
    )
    order = xp.argsort(-(rows[2] + tile * used), stable=True)
    return xp.stack(rows)[:, order].astype(np.int32), (lo.astype(np.int32), hi.astype(np.int32))


def _kernel(sched_ref, bt_ref, q_ref, k_ref, krope_ref, v_ref, scales_ref, out_ref, lse_ref, scoped, *,
            bs: MgpuBlockSizes, page_size: int, group: int, sm_scale: float, v_row0: int,
            num_ctas: int | None, zero_tail: bool = True):  # fmt: skip
    """One CTA: its work items, each one q-tile of the schedule for one query head (one item
    per CTA, or with ``num_ctas`` CTAs one item of each wave of the head-fastest order, odd
    waves dealt in reverse, the K/V ring running on across them). ``krope_ref`` [N, Dr] or
    None: the keys' second part, shared by the heads (keys ``[k | krope]``, q as wide as
    both). ``scales_ref`` f32[3] (k_scale, v_scale, q_scale) or None: FP8 attention, the
    cache e4m3, q quantised to e4m3 in the kernel (q8_smem), q.k on FP8 wgmma; each V block
    converted to float16 in a shared-memory ring (vb_smem, exact; Hopper converts e4m3 to
    f16 only) for p @ v in float16, since FP8 wgmma takes no N-major B operand. The two
    compute warpgroups convert half a 128-key block each, while their q.k wgmma runs, and
    meet on ``vb_ready`` before p @ v (a 64-key block: each converts it whole)."""
    block_q, block_kv, steps = bs.block_q, bs.block_kv, bs.steps_in_flight
    dv = v_ref.shape[-1]  # v/out width (q/k may be wider: MLA)
    dtype = q_ref.dtype
    fp8 = scales_ref is not None
    pv_dtype = jnp.float16 if fp8 else dtype
    pages_per_req = bt_ref.shape[1]
    num_q_heads = q_ref.shape[1]
    (
        (q_smem2, o_smem2, k_smem, v_smem, lse_smem2, q8_smem2, vb_smem, krope_smem, stage_smem2),
        (k_bars, v_bars, q_bars),
        consumed,
        sched_bar,
    ) = scoped
    dk = k_smem.shape[-1]  # the per-head part of a key
    k_consumed, v_consumed, vb_ready = (*consumed, None)[:3]
    wg = lax.axis_index("wg")
    if num_ctas is None:
        num_items = 1

        def item(_):
            return lax.axis_index("tile"), lax.axis_index("heads"), True
    else:
        cta = lax.axis_index("cta")
        total = num_q_heads * sched_ref.shape[1]
        num_items = -(-total // num_ctas)  # waves

        def item(i):
            w, valid = dealt_item(i, cta, num_ctas=num_ctas, total=total)
            return lax.div(w, jnp.int32(num_q_heads)), lax.rem(w, jnp.int32(num_q_heads)), valid

    def for_each_item(body):
        """``body(tile, q_head, g, max_steps)`` for this CTA's items in order, valid ones only;
        ``g`` counts the K/V blocks streamed before the item (its first block's ring slot),
        ``max_steps`` the item's own."""

        def one(i, g):
            tile, q_head, valid = item(i)
            kv_len = sched_ref[3, tile]
            pos0 = sched_ref[2, tile]
            live = (kv_len > 0) & valid
            # The memory warpgroup streams every block any row of the tile sees.
            max_steps = jnp.where(live, lax.div(pos0 + 2 * block_q + block_kv - 1, jnp.int32(block_kv)), 0)
            pl.when(live)(lambda: body(tile, q_head, g, max_steps))
            return g + max_steps

        lax.fori_loop(0, num_items, one, jnp.int32(0))

    def schedule_sync():
        plgpu.barrier_arrive(sched_bar)
        plgpu.barrier_wait(sched_bar)

    def ring_slot(g):
        return lax.rem(g, jnp.int32(steps))

    def convert_v(step, slot, kv_len, masked: bool):
        """FP8: this warpgroup's share of V block ``step``, e4m3 -> f16 into ``vb_smem``; with
        ``masked``, keys from kv_len on (the last page's tail, unnamed pages: NaN maybe) -> 0."""
        plgpu.barrier_wait(v_bars.at[slot])

        def rows(r0, n):
            vv = plgpu.load(v_smem.at[slot, pl.ds(r0, n)], layout=plgpu.Layout.WGMMA).astype(jnp.float16)
            if masked:
                key = plgpu.broadcasted_iota(jnp.int32, (n, dv), 0, layout=plgpu.Layout.WGMMA)
                vv = jnp.where(key + (step * block_kv + r0) < kv_len, vv, jnp.zeros_like(vv))
            vb_smem.at[slot, pl.ds(r0, n)][...] = vv

        if block_kv >= 128:
            half = block_kv // 2
            pl.when(wg == 0)(lambda: rows(0, half))
            pl.when(wg == 1)(lambda: rows(half, half))
        else:
            rows(0, block_kv)
        plgpu.commit_smem()
        plgpu.barrier_arrive(vb_ready.at[slot])

    def _compute_item(tile, q_head, g, max_steps, *, qo_smem, row0):
        tok0 = sched_ref[1, tile]
        pos0 = sched_ref[2, tile]
        kv_len = sched_ref[3, tile]
        q_pos0 = pos0 + row0  # position of this warpgroup's first row
        kv_steps = lax.div(q_pos0 + block_q + block_kv - 1, jnp.int32(block_kv))
        full_steps = lax.div(q_pos0, jnp.int32(block_kv))
        q_rows = q_ref.at[pl.ds(tok0 + row0, block_q), q_head]
        # The last item's output store reads the buffer q is about to be written into.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        if stage_smem2 is None:
            plgpu.copy_gmem_to_smem(q_rows, qo_smem, q_bars.at[wg])
            plgpu.barrier_wait(q_bars.at[wg])
        else:  # q's token count is not a multiple of 8: through the untiled buffer into the tiled one
            plgpu.copy_gmem_to_smem(q_rows, stage_smem2.at[wg], q_bars.at[wg])
            plgpu.barrier_wait(q_bars.at[wg])
            qo_smem[...] = plgpu.load(stage_smem2.at[wg], layout=plgpu.Layout.WGMMA, optimized=False)
            plgpu.commit_smem()
        scale = sm_scale * math.log2(math.e)  # exp(x * s) = exp2(x * s * log2 e)
        q_operand, out_scale = qo_smem, None
        if fp8:  # q / q_scale, saturated to e4m3's finite range (cvt.satfinite), as quantize_fp8
            k_scale, out_scale, q_scale = scales_ref[0], scales_ref[1], scales_ref[2]
            q16 = plgpu.load(qo_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
            q_operand = q8_smem2.at[wg]
            q_operand[...] = (q16 * (1.0 / q_scale)).astype(k_smem.dtype)
            plgpu.commit_smem()
            scale = scale * (q_scale * k_scale)
        m_i = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l_i = plgpu.layout_cast(jnp.full((block_q,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.full((block_q, dv), 0, jnp.float32), plgpu.Layout.WGMMA)
        plgpu.barrier_wait(k_bars.at[ring_slot(g)])
        pl.when(wg == 1)(schedule_sync)

        def kv_step(step, carry, masked: bool):
            acc, m_i, l_i = carry
            slot = ring_slot(g + step)

            def qk_scope(acc_ref):
                if krope_ref is None:
                    plgpu.wgmma(acc_ref, q_operand, k_smem.at[slot].transpose((1, 0)))
                else:  # q . [k | krope] = q[:, :dk] . k + q[:, dk:] . krope
                    plgpu.wgmma(acc_ref, q_operand.at[:, pl.ds(0, dk)], k_smem.at[slot].transpose((1, 0)))
                    dr = krope_smem.shape[-1]
                    plgpu.wgmma(acc_ref, q_operand.at[:, pl.ds(dk, dr)], krope_smem.at[slot].transpose((1, 0)))
                if fp8:  # under the q.k wgmma, before the sync the other warpgroup's p @ v waits behind
                    convert_v(step, slot, kv_len, masked)
                schedule_sync()
                return acc_ref[...]

            qk = pl.run_scoped(qk_scope, plgpu.ACC((block_q, block_kv), jnp.float32))
            plgpu.barrier_arrive(k_consumed.at[slot])
            if masked:
                q_ids = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 0, layout=plgpu.Layout.WGMMA)
                kv_ids = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 1, layout=plgpu.Layout.WGMMA)
                qk = jnp.where(q_ids + q_pos0 >= kv_ids + step * block_kv, qk, -jnp.inf)
            m_ij = jnp.maximum(m_i, qk.max(axis=1) * scale)
            alpha = jnp.exp2(m_i - m_ij)
            m_i = m_ij
            p = jnp.exp2(qk * scale - lax.broadcast_in_dim(m_ij, qk.shape, [0]))
            acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
            l_i *= alpha
            p16 = p.astype(pv_dtype)
            if dv <= 128:
                l_i += p.sum(axis=1)
                acc, l_i, m_i, p16 = lax.optimization_barrier((acc, l_i, m_i, p16))
            plgpu.barrier_arrive(sched_bar)
            if fp8:
                v_operand = vb_smem.at[slot]
                plgpu.barrier_wait(vb_ready.at[slot])
            else:
                v_operand = v_smem.at[slot]
                plgpu.barrier_wait(v_bars.at[slot])
            plgpu.barrier_wait(sched_bar)
            if dv > 128:
                l_i += p.sum(axis=1)
            if masked and zero_tail and not fp8:
                # Keys from kv_len on (the last page's tail, unnamed pages) may hold NaN: zero their V rows.
                @pl.when((step + 1) * block_kv > kv_len)
                def _zero_tail():
                    v_tile = v_smem.at[slot]
                    vv = plgpu.load(v_tile, layout=plgpu.Layout.WGMMA)
                    rows = plgpu.broadcasted_iota(jnp.int32, (block_kv, dv), 0, layout=plgpu.Layout.WGMMA)
                    v_tile[...] = jnp.where(rows + step * block_kv < kv_len, vv, jnp.zeros_like(vv))
                    plgpu.commit_smem()

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_operand)
                nxt = step + 1

                @pl.when(nxt < kv_steps)
                def _():
                    plgpu.barrier_wait(k_bars.at[ring_slot(g + nxt)])

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_consumed.at[slot])
            return acc, m_i, l_i

        def drain(step, _):  # blocks the other warpgroup needs: release them here too
            slot = ring_slot(g + step)
            if num_ctas is not None:
                # Waited though unused: each wait flips this thread's phase bit of the barrier,
                # which the next item's waits on the same slot rely on.
                plgpu.barrier_wait(k_bars.at[slot])
                if not fp8:
                    plgpu.barrier_wait(v_bars.at[slot])
            if fp8:  # the other warpgroup's p @ v needs this one's share of the block
                convert_v(step, slot, kv_len, masked=True)
            plgpu.barrier_arrive(k_consumed.at[slot])
            plgpu.barrier_arrive(v_consumed.at[slot])
            schedule_sync()
            schedule_sync()

        carry = (acc, m_i, l_i)
        carry = lax.fori_loop(0, full_steps, functools.partial(kv_step, masked=False), carry)
        acc, m_i, l_i = lax.fori_loop(full_steps, kv_steps, functools.partial(kv_step, masked=True), carry)
        lax.fori_loop(kv_steps, max_steps, drain, None)
        pl.when(wg == 0)(schedule_sync)
        acc /= lax.broadcast_in_dim(l_i, (block_q, dv), [0])
        if fp8:
            acc *= out_scale
        o_smem = qo_smem if o_smem2 is None else o_smem2.at[wg]
        if stage_smem2 is not None:
            o_smem = stage_smem2.at[wg]
        o_smem[...] = acc.astype(dtype)
        if lse_ref is not None:  # natural log: m_i is log2-scaled, exp2(m_i) = exp(m_i * ln 2)
            lse_smem2.at[wg][...] = m_i * math.log(2.0) + jnp.log(l_i)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_ref.at[pl.ds(tok0 + row0, block_q), q_head])
        if lse_ref is not None:
            plgpu.copy_smem_to_gmem(lse_smem2.at[wg], lse_ref.at[q_head, pl.ds(tok0 + row0, block_q)])

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        qo_smem = q_smem2.at[wg]  # q, then the output when it is as wide
        row0 = wg * block_q
        for_each_item(functools.partial(_compute_item, qo_smem=qo_smem, row0=row0))
        # The CTA may exit once its last output store has read shared memory (the grid's end
        # makes the writes visible), as JAX's Hopper matmul does.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        chunk = min(page_size, block_kv)

        def fetch(req, kv_head, step, slot, plane, smem, bars):
            for c in range(block_kv // chunk):
                key0 = step * block_kv + c * chunk
                page = bt_ref[req, jnp.minimum(lax.div(key0, jnp.int32(page_size)), pages_per_req - 1)]
                row = plane * v_row0 + page * page_size + lax.rem(key0, jnp.int32(page_size))
                plgpu.copy_gmem_to_smem(
                    (k_ref, v_ref)[plane].at[pl.ds(row, chunk), kv_head],
                    smem.at[slot, pl.ds(c * chunk, chunk)],
                    bars.at[slot],
                )
                if plane == 0 and krope_ref is not None:
                    plgpu.copy_gmem_to_smem(
                        krope_ref.at[pl.ds(row, chunk)], krope_smem.at[slot, pl.ds(c * chunk, chunk)], bars.at[slot]
                    )

        def stream(tile, q_head, g, max_steps):
            req = sched_ref[0, tile]
            kv_head = lax.div(q_head, jnp.int32(group))

            @pl.loop(0, max_steps)
            def _(step):
                slot = ring_slot(g + step)
                refill = g + step >= steps  # the slot held an earlier block: wait until both warpgroups are done

                pl.when(refill)(lambda: plgpu.barrier_wait(k_consumed.at[slot]))
                fetch(req, kv_head, step, slot, 0, k_smem, k_bars)
                pl.when(refill)(lambda: plgpu.barrier_wait(v_consumed.at[slot]))
                fetch(req, kv_head, step, slot, 1, v_smem, v_bars)

        for_each_item(stream)


def prefill_attention(
    q,  # f[T, Hq, D]
    kv_cache,  # [2, P, S, Hkv, D]
    schedule,  # i32[4, NT] from mgpu_schedule
    block_tables,  # i32[R, pages_per_req]
    *,
    sm_scale: float,
    block_sizes: MgpuBlockSizes | None = None,
    interpret=False,
    zero_tail: bool = True,
    return_lse: bool = False,
    k_scale=None,  # f32[] | None: with q_scale, an e4m3 cache's scales (None: 1)
    v_scale=None,
    q_scale=None,  # f32[] | None: FP8 attention (``reference.ragged_paged_attention``'s q_scale)
):
    """f[T, Hq, D]: causal attention for the rows of the schedule's tiles; other rows are undefined.
    With ``return_lse``, (out, lse f32[T, Hq]): each row's log-sum-exp of its scaled scores
    (natural log, as ``reference.ragged_paged_attention``'s), undefined where out is.

    The caller fills the rest (``pallas_triton.ragged_paged_attention`` passes this output to
    the Triton kernel, which writes the other rows in place). Compiled on Hopper only (no
    interpreter runs it in jax 0.11.2). ``zero_tail=False`` skips zeroing the V rows past
    a request's ``seq_len`` in its last K/V block: a diagnosis knob
    (``benchmarks/prefill_mgpu_check.py --only diag``), right only when those cache slots
    hold finite values.

    With ``q_scale`` (FP8 attention; the cache float8_e4m3fn): q is quantised to e4m3 in the
    kernel and q.k runs on FP8 wgmma scaled by ``q_scale * k_scale``; the softmax weights stay
    in q's dtype and meet V converted exactly to it (FP8 wgmma takes no N-major B operand, which
    V's rows are), so p is not quantised as the reference's p is (``common.FP8_P_SCALE``).
    """
    bs = block_sizes or mgpu_block_sizes(head_size=q.shape[-1])
    scales = None
    if q_scale is not None:
        one = jnp.float32(1.0)
        scales = jnp.stack(
            [jnp.asarray(one if x is None else x, jnp.float32).reshape(()) for x in (k_scale, v_scale, q_scale)]
        )
    return _prefill(
        q, kv_cache, schedule, block_tables, scales, sm_scale=float(sm_scale), bs=bs, interpret=interpret,
        zero_tail=zero_tail, return_lse=return_lse,
    )  # fmt: skip


def smem_transforms(row_elems: int, dtype):
    """Tiling and swizzle of a shared-memory tile whose rows are ``row_elems`` of ``dtype``."""
    itemsize = np.dtype(dtype).itemsize
    swizzle = swizzle_bytes(row_elems * itemsize)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


@functools.partial(jax.jit, static_argnames=("sm_scale", "bs", "interpret", "zero_tail", "return_lse"))
def _prefill(q, kv_cache, schedule, block_tables, scales, *, sm_scale, bs, interpret, zero_tail, return_lse):
    _, num_blocks, page_size, num_kv_heads, head_dim = kv_cache.shape
    num_slots = num_blocks * page_size
    kv = kv_cache.reshape(2 * num_slots, num_kv_heads, head_dim)  # a bitcast: K rows, then V rows
    return _launch(q, kv, None, kv, schedule, block_tables, scales, page_size=page_size, v_row0=num_slots,
                   sm_scale=sm_scale, bs=bs, interpret=interpret, zero_tail=zero_tail,
                   return_lse=return_lse)  # fmt: skip


def prefill_attention_kv(
    q,  # f[T, Hq, Dk + Dr]
    k,  # f[N, Hkv, Dk]: key rows, ``page_size`` to a page
    v,  # f[N, Hkv, Dv]: value rows, the same pages
    schedule,  # i32[4, NT] from mgpu_schedule
    block_tables,  # i32[R, pages_per_req]: page ids into k and v
    *,
    page_size: int,
    sm_scale: float,
    k_rope=None,  # f[N, Dr] | None: the keys' second part, one row per slot shared by every head
    block_sizes: MgpuBlockSizes | None = None,
):
    """f[T, Hq, Dv]: ``prefill_attention`` over keys and values held apart, whose widths may
    differ (MLA's up-projected prefill: q/k 192, v 128), 16-bit; rows the schedule's tiles do
    not cover are undefined. With ``k_rope`` a key is ``[k | k_rope]`` (MLA: ``k_nope`` 128
    per head, ``k_pe`` 64 shared), never concatenated in memory. ``Dk`` and ``Dv`` must be
    ``SUPPORTED_HEAD_SIZES``, ``Dr`` a multiple of 64, and q as wide as the whole key."""
    for name, width in (("k", k.shape[-1]), ("v", v.shape[-1])):
        if width not in SUPPORTED_HEAD_SIZES:
            raise ValueError(f"{name} head size {width} is not one of {list(SUPPORTED_HEAD_SIZES)}")
    dr = 0 if k_rope is None else k_rope.shape[-1]
    if k_rope is not None and (k_rope.ndim != 2 or k_rope.shape[0] != k.shape[0] or dr % 64):
        raise ValueError(
            f"k_rope must be [N={k.shape[0]}, Dr] with Dr a multiple of 64 (whole 128-byte tiles), got {k_rope.shape}"
        )
    if k_rope is not None and k_rope.dtype != k.dtype:
        raise ValueError(f"k_rope's dtype {k_rope.dtype} must be k's, {k.dtype}")
    if q.shape[-1] != k.shape[-1] + dr:
        raise ValueError(f"q's width {q.shape[-1]} must be the key's, {k.shape[-1]} + {dr}")
    bs = block_sizes or mgpu_block_sizes(head_size=max(q.shape[-1], v.shape[-1]))
    return _prefill_kv(q, k, k_rope, v, schedule, block_tables, page_size=page_size, sm_scale=float(sm_scale), bs=bs)


@functools.partial(jax.jit, static_argnames=("page_size", "sm_scale", "bs"))
def _prefill_kv(q, k, k_rope, v, schedule, block_tables, *, page_size, sm_scale, bs):
    return _launch(q, k, k_rope, v, schedule, block_tables, None, page_size=page_size, v_row0=0, sm_scale=sm_scale,
                   bs=bs, interpret=False, zero_tail=True, return_lse=False)  # fmt: skip


def _launch(q, k, k_rope, v, schedule, block_tables, scales, *, page_size, v_row0, sm_scale, bs, interpret, zero_tail,
            return_lse):  # fmt: skip
    """The kernel over key rows ``k`` [N, Hkv, Dk] (with ``k_rope`` [N, Dr] or None, their shared
    second part) and value rows ``v`` (from row ``v_row0``; the paged cache passes its one array
    as both) for the schedule's tiles of ``q``."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, dv = k.shape[1], v.shape[-1]
    chunks = bs.block_kv // min(page_size, bs.block_kv)
    num_tiles = schedule.shape[1]
    rope = k_rope is not None
    # A TMA between GMEM and a tiled shared-memory buffer views the whole array in 8-row tiles:
    # Mosaic GPU refuses a token count that is not a multiple of 8 ("dimension 1 must have size
    # smaller or a multiple of its tiling 8"). Such a q and out go through an untiled buffer
    # instead (``stage``: one shared-memory round trip per tile, no copy of q or out in HBM);
    # q is padded (a copy) only where that buffer does not fit, q and out differ in width, or
    # the LSE is returned. The engine's token buckets need neither.
    pad = -num_tokens % 8
    stage = (
        bool(pad) and dv == head_dim and not return_lse
        and bs.smem_bytes(head_dim, q.dtype, k.dtype, staged=True) <= MOSAIC_GPU_SMEM_BYTES
    )  # fmt: skip
    if pad and not stage:
        q = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
    fp8 = scales is not None
    transforms = smem_transforms(head_dim, q.dtype)
    ring = (bs.steps_in_flight, bs.block_kv)
    # FP8 attention and the LSE keep one CTA per item: their persistent launches were not run on a GPU.
    num_ctas = None if fp8 or return_lse else persistent_ctas(num_q_heads * num_tiles, bs)
    if num_ctas is None:  # one CTA per q-tile and query head
        grid, grid_names = (num_q_heads, num_tiles), ("heads", "tile")
    else:  # persistent: each CTA loops over one (tile, head) of each wave (dealt_item)
        grid, grid_names = (num_ctas,), ("cta",)

    def entry(sched_ref, bt_ref, q_ref, k_ref, *refs):
        krope_ref, refs = (refs[0], refs[1:]) if rope else (None, refs)
        v_ref, refs = refs[0], refs[1:]
        scales_ref = refs[0] if fp8 else None
        out_ref, lse_ref = (*refs[1 if fp8 else 0 :], None)[:2]
        dk = k.shape[-1]
        scratch = (
            plgpu.SMEM((2, bs.block_q, head_dim), q.dtype, transforms=transforms),
            plgpu.SMEM((2, bs.block_q, dv), q.dtype, transforms=smem_transforms(dv, q.dtype))
            if dv != head_dim
            else None,
            plgpu.SMEM((*ring, dk), k.dtype, transforms=smem_transforms(dk, k.dtype)),
            plgpu.SMEM((*ring, dv), v.dtype, transforms=smem_transforms(dv, v.dtype)),
            plgpu.SMEM((2, bs.block_q), jnp.float32) if return_lse else None,
            plgpu.SMEM((2, bs.block_q, head_dim), k.dtype, transforms=smem_transforms(head_dim, k.dtype))
            if fp8
            else None,
            plgpu.SMEM((*ring, dv), jnp.float16, transforms=smem_transforms(dv, jnp.float16)) if fp8 else None,
            plgpu.SMEM((*ring, k_rope.shape[-1]), k_rope.dtype, transforms=smem_transforms(k_rope.shape[-1], k.dtype))
            if rope
            else None,
            plgpu.SMEM((2, bs.block_q, head_dim), q.dtype) if stage else None,
        )
        body = functools.partial(
            _kernel, sched_ref, bt_ref, q_ref, k_ref, krope_ref, v_ref, scales_ref, out_ref, lse_ref, bs=bs,
            page_size=page_size,
            group=num_q_heads // num_kv_heads, sm_scale=sm_scale, v_row0=v_row0, num_ctas=num_ctas,
            zero_tail=zero_tail,
        )  # fmt: skip
        pl.run_scoped(
            lambda *args: body(args),
            scratch,
            (
                plgpu.Barrier(num_arrivals=chunks * (2 if rope else 1), num_barriers=bs.steps_in_flight),
                plgpu.Barrier(num_arrivals=chunks, num_barriers=bs.steps_in_flight),
                plgpu.Barrier(num_barriers=2),
            ),
            (plgpu.Barrier(num_arrivals=2, num_barriers=bs.steps_in_flight),) * (3 if fp8 else 2),
            plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )

    out_type = jax.ShapeDtypeStruct((*q.shape[:2], dv), q.dtype)
    if return_lse:  # tokens minor: a warpgroup's block_q rows of one head are one 1-D TMA box
        out_type = (out_type, jax.ShapeDtypeStruct((num_q_heads, q.shape[0]), jnp.float32))
    out = plgpu.kernel(
        entry,
        out_type=out_type,
        grid=grid,
        grid_names=grid_names,
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
        kernel_name="ragged_paged_prefill_mgpu",
    )(schedule, block_tables, q, k, *([k_rope] if rope else []), v, *([scales] if fp8 else []))
    if not return_lse:
        return out[:num_tokens]
    out, lse = out
    return out[:num_tokens], lse[:, :num_tokens].T
