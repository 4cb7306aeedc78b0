"""Ragged paged attention as one Pallas kernel on GPU (Triton lowering).

One launch serves a mixed prefill + decode batch. The query tokens of each request are
cut into q-blocks of ``block_q`` tokens; a program handles one q-block for one KV head
(``grid = (Hkv, num_q_blocks, num_kv_splits)``: the KV heads vary fastest, so the blocks
start in the schedule's order, and the empty blocks a static schedule ends in start last,
where the tail of the real ones hides them), with the ``block_q`` tokens times the
``G = Hq // Hkv`` query heads of that KV head packed as the rows of the matmul
(``rows = block_q * next_pow2(G)``). So a K/V page is read once per q-block, not once
per query token, and once for the whole head group. Which request a q-block belongs to
is a host-computed schedule (``gpu_schedule``): the kernel never searches.

K/V tiles are ``pages_per_tile`` pages (or ``keys_per_tile`` keys of one page) gathered
through the block table. The cache keeps
the XLA backend's NHD layout ``[2, P, S, Hkv, D]``: one token's head row is D contiguous
elements, so a tile load reads whole rows and every byte it fetches is used.

With ``num_kv_splits > 1`` (flash-decoding, for few long sequences) each program covers
a slice of the KV tiles and writes its partial softmax state; ``merge_softmax_states``
(common.py) combines them. The per-tile math is common.py's, shared with the TPU kernel.

New keys and values are written before the kernel by ``kv_write.write_kv`` (a Pallas
kernel storing whole token rows, in place when the cache is donated: on an H100 it writes
P1's 16384 tokens in 59 us where XLA's two scatters took 436 us; BENCHMARKS.md); the
interpreter keeps ``write_to_kv_cache``'s scatter.

Head sizes are any multiple of 8 up to 256: Triton's tiles are powers of two, so a head
of D elements is loaded into a ``next_pow2(D)``-wide tile (at least 16, a dot's minimum)
with the columns past D masked off: no padded copy of q or the cache is made, and the
masked columns cost no memory traffic.

When the PALLAS_GPU backend runs a prefill batch's long requests in the Mosaic GPU kernel
(``pallas_mosaic_gpu``; the dispatch is ``attn_jax.backends.pallas_gpu``), this kernel
serves the other rows, writing into that kernel's output (``out_init``,
``input_output_aliases``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from attn_jax.kv_cache import write_to_kv_cache
from attn_jax.metadata import searchsorted
from attn_jax.ops.ragged_paged_attention import common, kv_write, validate
from attn_jax.ops.ragged_paged_attention.config import (
    GpuBlockSizes,
    check_block_sizes,
    gpu_block_sizes,
    head_tile,
    next_pow2,
)

SUPPORTED_HEAD_SIZES = tuple(range(8, 257, 8))
"""Multiples of 8 up to 256 (vLLM's FlashAttention range): loaded into a power-of-two tile of
``head_tile(D)`` columns with the rest masked off."""


SUPPORTED_PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Powers of two: a K/V tile is a power-of-two number of pages of at least 16 keys."""

_SCHEDULE_FIELDS = ("req", "tok_start", "tok_end", "pos_start", "kv_len")


def max_num_q_blocks(num_tokens: int, num_reqs: int, block_q: int) -> int:
    """Static bound on q-blocks: every request and the padding rows may start a partial block."""
    return -(-num_tokens // block_q) + num_reqs + 1


def gpu_schedule(query_start_loc, seq_lens, *, num_tokens: int, block_q: int, xp=jnp, segments=None):
    """i32[5, NB]: per q-block (request, first token, end token, first position, kv length).

    Runs on the host with ``xp=numpy`` (the metadata builder) or traced with ``xp=jax.numpy``
    (when the caller passes no schedule). Padding token rows (from ``query_start_loc[-1]``
    to ``num_tokens``) get blocks of a pseudo-request with no keys, so the kernel writes
    zeros there; blocks past the last one are empty (no rows, no keys). Blocks are ordered
    by decreasing KV extent (the grid runs roughly in order: the longest go first).

    ``segments`` (i32[N] request (R = padding), i32[N] first token, i32[N] end token) or
    None (each request's tokens, then the padding rows): the token ranges to cut into
    q-blocks. ``split_schedules`` passes the ranges the Mosaic GPU prefill leaves over.
    NB is ``cdiv(num_tokens, block_q) + N``.
    """
    num_reqs = seq_lens.shape[0]
    qsl = xp.concatenate([query_start_loc.astype(np.int32), xp.full((1,), num_tokens, np.int32)])
    qlens = qsl[1:] - qsl[:-1]  # i32[R + 1]: the last entry is the padding rows
    if segments is None:
        segments = (xp.arange(num_reqs + 1, dtype=np.int32), qsl[:-1], qsl[1:])
    seg_req, seg_lo, seg_hi = segments
    num_segments = seg_req.shape[0]
    nb = -(-num_tokens // block_q) + num_segments
    nblk = (seg_hi - seg_lo + block_q - 1) // block_q
    cum = xp.cumsum(nblk)
    b = xp.arange(nb, dtype=np.int32)
    seg = searchsorted(xp, cum, b, side="right").astype(np.int32)  # == N: unused block
    used = seg < num_segments
    seg = xp.minimum(seg, num_segments - 1)
    req = seg_req[seg]
    first = (cum[seg] - nblk[seg]).astype(np.int32)
    tok_start = seg_lo[seg] + (b - first) * block_q
    tok_end = xp.minimum(tok_start + block_q, seg_hi[seg])
    is_real = req < num_reqs
    kv_len = xp.where(is_real, seq_lens[xp.minimum(req, num_reqs - 1)], 0)
    pos_start = kv_len - qlens[req] + (tok_start - qsl[req])
    zero = xp.zeros_like(b)
    rows = (
        xp.where(used, xp.minimum(req, num_reqs - 1), zero),
        xp.where(used, tok_start, zero),
        xp.where(used, tok_end, zero),
        xp.where(used & is_real, pos_start, zero),
        xp.where(used, kv_len, zero),
    )
    # Heaviest q-blocks (longest KV extent) first, so the long causal tails do not run last.
    work = rows[3] + (rows[2] - rows[1])
    order = xp.argsort(-work, stable=True)
    return xp.stack(rows)[:, order].astype(np.int32)


def mixed_schedule(query_start_loc, seq_lens, *, num_tokens: int, block_q: int, xp=jnp):
    """i32[5, R + NB]: a mixed batch's q-blocks for one launch in two parts, one block per request
    for the decodes (``decode_part``), then ``gpu_schedule``'s blocks of every row but the
    decodes' (``block_q`` tokens; NB as there). The kernel runs the first part on decode blocks
    (``_attend``'s ``decode_block_sizes``): the decodes stream their KV as a decode batch's
    programs do while the other rows' programs compute beside them. The decodes first: the
    other part ends in the empty blocks of a static bound, which then start last."""
    num_reqs = seq_lens.shape[0]
    qsl = query_start_loc.astype(np.int32)
    decodes, split = decode_part(query_start_loc, seq_lens, xp=xp)
    segments = (
        xp.arange(num_reqs + 1, dtype=np.int32),
        xp.concatenate([split, qsl[-1:]]),
        xp.concatenate([qsl[1:], xp.full((1,), num_tokens, np.int32)]),
    )
    rest = gpu_schedule(query_start_loc, seq_lens, num_tokens=num_tokens, block_q=block_q, xp=xp, segments=segments)
    return xp.concatenate([decodes, rest], axis=1).astype(np.int32)


def decode_part(query_start_loc, seq_lens, *, xp=jnp):
    """(i32[5, R] decode blocks, i32[R] first row left to the other part): a mixed launch's
    first part, one block per request (requests of one new token; a request of more gets an
    empty block), longest KV first. A decode's row ends its request, so its other rows start
    at its end (none); any other request keeps all of its rows."""
    num_reqs = seq_lens.shape[0]
    qsl = query_start_loc.astype(np.int32)
    is_decode = (qsl[1:] - qsl[:-1]) == 1
    split = xp.where(is_decode, qsl[1:], qsl[:-1])
    kv_len = xp.where(is_decode, seq_lens.astype(np.int32), 0)
    decodes = xp.stack([xp.arange(num_reqs, dtype=np.int32), qsl[:-1], split, xp.maximum(kv_len - 1, 0), kv_len])
    return decodes[:, xp.argsort(-kv_len, stable=True)].astype(np.int32), split


def _kernel(sched_ref, block_tables_ref, q_ref, kv_ref, *refs, has_scales, parts, **params):
    """One (q-block, kv head, kv split): ``_attend_block``, for a q-block with rows. A q-block
    with none (the schedule's unused tail, sized for the worst case; in traced metadata every
    block of the Mosaic GPU split's rest when that kernel serves all rows) returns at once:
    on an H100 P1's traced rest schedule, 1,033 empty q-blocks x 8 heads, took 81 us when they
    ran the whole body (BENCHMARKS.md). Without ``has_scales`` there is no scales operand.

    ``parts``: ((first q-block, end q-block, KV-head programs, the part's static block
    parameters), ...) in grid order. One part, or two: a mixed batch's decodes on decode blocks,
    then its other rows on their blocks (``mixed_schedule``), one launch. The grid is (KV-head
    programs, q-blocks, splits), so ``ids`` reorders it."""
    ids = pl.program_id(1), pl.program_id(0), pl.program_id(2)  # read outside the branch (the interpreter's rule)
    refs = refs if has_scales else (None, *refs)
    has_rows = sched_ref[2, ids[0]] > sched_ref[1, ids[0]]
    for lo, hi, kv_programs, part in parts:
        body = functools.partial(_attend_block, ids, sched_ref, block_tables_ref, q_ref, kv_ref, *refs, **params,
                                 **dict(part))  # fmt: skip
        run = has_rows
        if len(parts) > 1:
            run = run & (ids[0] >= lo) & (ids[0] < hi) & (ids[1] < kv_programs)
        pl.when(run)(body)


def _attend_block(
    ids, sched_ref, block_tables_ref, q_ref, kv_ref, scales_ref, *rest,
    sm_scale, causal, sliding_window, soft_cap, has_alibi, has_sinks,
    group, block_q, group_pad, tile, num_kv_splits, spare_row, has_out_init=False, has_lse=False, fp8=False,
    num_init_splits=0, store_states=False, head_size, kv_heads_per_program=1,
):  # fmt: skip
    """One (q-block, kv head, kv split) of ``ids``. ``fp8``: FP8 attention (the query quantised to e4m3 here,
    e4m3 x e4m3 dots with f32 accumulation, the weights quantised for ``p @ v``).
    ``num_init_splits`` > 0: each row's softmax state starts from another part's split states
    over other keys (``init_m_ref``, ``init_denom_ref``, ``init_acc_ref``), folded in as
    ``merge_attn_states`` would merge them. ``store_states``: store the raw split states
    (acc, m, denom) even with one split.
    rest: [alibi_ref], [sinks_ref], [init_m_ref, init_denom_ref, init_acc_ref], [out_init_ref
    and, with ``has_lse``, lse_init_ref], out refs
    (out and, with ``has_lse``, lse; or the split's acc, m and denom)."""
    rest = list(rest)
    alibi_ref = rest.pop(0) if has_alibi else None
    sinks_ref = rest.pop(0) if has_sinks else None
    init_refs = [rest.pop(0) for _ in range(3)] if num_init_splits else None
    if has_out_init:
        del rest[: 2 if has_lse else 1]  # aliased to the output refs
    b, kv_block, split = ids
    num_tokens, num_q_heads, _ = q_ref.shape
    _, _, page_size, kv_width = kv_ref.shape  # the cache's heads flattened: [2, P, S, Hkv * D]
    num_kv_heads = kv_width // head_size
    pages_per_req = block_tables_ref.shape[1]
    pack, pack_pad = kv_heads_per_program, next_pow2(kv_heads_per_program)
    rows = block_q * pack_pad * group_pad

    req, tok_start, tok_end = sched_ref[0, b], sched_ref[1, b], sched_ref[2, b]
    pos_start, kv_len = sched_ref[3, b], sched_ref[4, b]

    # Rows are (token, packed kv head, head of its group). A program attends ``pack`` adjacent
    # KV heads at once: their columns are adjacent in every cached row, so one K/V tile of
    # ``width`` columns holds them all (head 80, 3 heads: 240 of 256 columns read, against 80
    # of 128 for one), and each row's q sits in its own head's columns with zeros elsewhere,
    # so q @ k.T scores each row against its own head only. p @ v fills every column; a row
    # keeps its own head's. ``pack`` = 1: a head narrower than its power-of-two tile loads its
    # D columns and masks the rest to 0.
    r = jnp.arange(rows, dtype=jnp.int32)
    tok = tok_start + r // (pack_pad * group_pad)  # i32[rows]
    slot = (r // group_pad) % pack_pad
    g = r % group_pad
    kv_head0 = kv_block * pack
    kv_head = kv_head0 + slot
    row_valid = (tok < tok_end) & (g < group) & (slot < pack) & (kv_head < num_kv_heads)
    tok_c = jnp.minimum(tok, num_tokens - 1)
    head = jnp.minimum(kv_head * group + g, num_q_heads - 1)
    # Every index is an array (no ':'), which both the Triton lowering and the interpreter take.
    # The cache's column index stays a plain arange plus a scalar (no clamp): Triton then sees
    # contiguous columns and issues 16-byte loads; masked-off columns are never read.
    width = head_tile(head_size * pack)
    c = jnp.arange(width, dtype=jnp.int32)[None, :]  # i32[1, W]
    kv_col = kv_head0 * head_size + c
    if pack == 1:  # the cache's real columns and the row's own: the same static mask
        kv_cols = own = c < head_size if width != head_size else True
        d = out_col = c
    else:  # a row's own columns; its q / out column d; a bijection onto [0, W) for the interpreter's stores
        kv_cols = c < jnp.minimum(pack, num_kv_heads - kv_head0) * head_size
        first = (slot * head_size)[:, None]
        own = (c >= first) & (c < first + head_size)
        d = jnp.clip(c - first, 0, head_size - 1)
        out_col = jax.lax.rem(c + width - first, width)

    def cols(mask):  # a row mask, narrowed to the row's own columns
        return mask & own

    q = plgpu.load(q_ref.at[tok_c[:, None], head[:, None], d], mask=cols(row_valid[:, None]), other=0.0)  # [rows, W]
    q_pos = (pos_start + (tok - tok_start))[:, None]  # i32[rows, 1]

    # KV range of this q-block: [lo, hi) positions, then this split's share of its tiles.
    last_pos = pos_start + (tok_end - tok_start) - 1
    hi = jnp.minimum(kv_len, last_pos + 1) if causal else kv_len
    lo = jnp.maximum(pos_start - sliding_window + 1, 0) if sliding_window is not None else 0
    hi = jnp.where(tok_end > tok_start, hi, 0)
    t_lo, t_hi = lo // tile, (hi + tile - 1) // tile
    per_split = (jnp.maximum(t_hi - t_lo, 0) + num_kv_splits - 1) // num_kv_splits
    s_lo = t_lo + split * per_split
    s_hi = jnp.minimum(s_lo + per_split, t_hi)

    k_scale, v_scale = (scales_ref[0], scales_ref[1]) if scales_ref is not None else (1.0, 1.0)
    p_scale = None
    if fp8:  # q / q_scale in e4m3; the scales multiply the dots' f32 results
        q_scale = scales_ref[2]
        q = common.quantize_fp8(q, 1.0 / q_scale)
        k_scale = k_scale * q_scale
        v_scale = v_scale * (1.0 / common.FP8_P_SCALE)
        p_scale = common.FP8_P_SCALE
    slopes = None
    if has_alibi:
        slopes = plgpu.load(alibi_ref.at[head], mask=row_valid, other=0.0)[:, None]
    sinks = None
    if has_sinks:
        sinks = plgpu.load(sinks_ref.at[head], mask=row_valid, other=common.MASK_VALUE)
        sinks = jnp.where(split == 0, sinks, common.MASK_VALUE)  # the sink joins one split only
    state = common.init_softmax_state(rows, width, sinks=sinks)
    if has_sinks:  # splits other than 0 start empty: denom = 0
        state = (state[0], jnp.where(split == 0, state[1], 0.0), state[2])
    if num_init_splits:  # the other part's splits join split 0 (acc in this call's v units)
        init_m, init_denom, init_acc = init_refs
        mine = row_valid & (split == 0)
    for i in range(num_init_splits):
        part = (
            plgpu.load(init_m.at[i, tok_c, head], mask=mine, other=common.MASK_VALUE),
            plgpu.load(init_denom.at[i, tok_c, head], mask=mine, other=0.0),
            plgpu.load(init_acc.at[i, tok_c[:, None], head[:, None], d], mask=cols(mine[:, None]), other=0.0) / v_scale,
        )
        state = common.fold_softmax_state(state, part)

    # f32 dots must not drop to TF32 (Triton's DEFAULT); 16-bit ones take the native MMA.
    # fp8 dots take no precision (tl.dot on e4m3 operands: FP8 wgmma on Hopper).
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def fp8_scores(page, offset, in_range, v, masked):
        """FP8 attention's q.k: the key tile is loaded transposed, e4m3[W, tile] (W runs down the
        rows, still contiguous in memory), so the dot takes it as is, with no transpose of an fp8
        tile. A masked tile routes non-finite values (common.route_nonfinite_values) in f32."""
        key_cols = in_range[None, :] & (kv_cols.T if width != head_size else True)
        k_t = plgpu.load(kv_ref.at[0, page[None, :], offset[None, :], kv_col.T], mask=key_cols, other=0.0)
        if masked:  # the routing's arithmetic in f32 (exact for e4m3 entries), then e4m3 again
            v32 = v.astype(jnp.float32)
            poison = v32 - v32  # f32[tile, W]: 0, or NaN where a value is not finite
            k_t = (k_t.astype(jnp.float32) + poison.T).astype(common.FP8_DTYPE)
            v = jnp.where(poison == 0, v32, 0.0).astype(common.FP8_DTYPE)
        dims = (((1,), (0,)), ((), ()))
        return jax.lax.dot_general(q, k_t, dims, preferred_element_type=jnp.float32), v

    def tile_step(t, state, masked: bool):
        j = t * tile + jnp.arange(tile, dtype=jnp.int32)  # i32[tile] cached positions
        in_range = j < hi
        page = plgpu.load(block_tables_ref.at[req, jnp.minimum(j // page_size, pages_per_req - 1)])
        offset = j % page_size
        if fp8:
            v = plgpu.load(kv_ref.at[1, page[:, None], offset[:, None], kv_col], mask=in_range[:, None] & kv_cols,
                           other=0.0)  # fmt: skip
            s, v = fp8_scores(page, offset, in_range, v, masked)
        else:
            page, offset, key_cols = page[:, None], offset[:, None], in_range[:, None] & kv_cols
            k = plgpu.load(kv_ref.at[0, page, offset, kv_col], mask=key_cols, other=0.0)
            v = plgpu.load(kv_ref.at[1, page, offset, kv_col], mask=key_cols, other=0.0)
            k = common.dequantize(k, None, q.dtype)  # fp8 scales fold into sm_scale and the output
            v = common.dequantize(v, None, q.dtype)
            if masked:  # rows of a masked tile share p @ v: keep a value's NaN from rows that do not see it
                k, v = common.route_nonfinite_values(k, v)
            dims = (((1,), (1,)), ((), ()))
            s = jax.lax.dot_general(q, k, dims, precision=precision, preferred_element_type=jnp.float32)
        # s f32[rows, tile]
        s = common.transform_scores(
            s, q_pos, j[None, :], sm_scale=sm_scale * k_scale, soft_cap=soft_cap, alibi_slopes=slopes
        )
        visible = None
        if masked:
            visible = common.visible_mask(
                q_pos, j[None, :], hi, causal=causal, sliding_window=sliding_window, row_valid=row_valid[:, None]
            )
        return common.online_softmax_update(state, s, visible, v, precision=precision, p_scale=p_scale)

    # Tiles every row sees whole (inside the window, before the diagonal, below kv_len) skip
    # the mask; the tiles at the window's edge, the diagonal and kv_len apply it. Rows that
    # are padding see those whole tiles too, harmlessly: their output is never stored.
    full_hi = jnp.minimum(pos_start + 1, hi) // tile if causal else hi // tile
    full_lo = t_lo
    if sliding_window is not None:
        full_lo = jnp.maximum(t_lo, (last_pos - sliding_window + 1 + tile - 1) // tile)
    full_lo = jnp.clip(full_lo, s_lo, s_hi)
    full_hi = jnp.clip(full_hi, full_lo, s_hi)
    masked_step = functools.partial(tile_step, masked=True)
    state = jax.lax.fori_loop(s_lo, full_lo, masked_step, state)
    state = jax.lax.fori_loop(full_lo, full_hi, functools.partial(tile_step, masked=False), state)
    state = jax.lax.fori_loop(full_hi, s_hi, masked_step, state)
    # The interpreter turns a masked store into a scatter of (kept or old) values, so
    # masked-off rows must not alias real ones: there they go to a spare token row.
    tok_s = jnp.where(row_valid, tok_c, num_tokens) if spare_row else tok_c
    head_s = jnp.where(row_valid, head, 0) if spare_row else head
    # The interpreter's outputs are W wide (sliced by the caller) and its masked stores
    # write every index they name: there every column is stored, a row's own at [0, D).
    store_mask = row_valid[:, None] if spare_row else cols(row_valid[:, None])
    m, denom, acc = state
    if not store_states:
        out_ref = rest[0]
        out = common.finalize_softmax_state(state) * v_scale
        plgpu.store(out_ref.at[tok_s[:, None], head_s[:, None], out_col], out.astype(out_ref.dtype), mask=store_mask)
        if has_lse:
            plgpu.store(rest[1].at[tok_s, head_s], common.log_sum_exp(m, denom), mask=row_valid)
    else:
        acc_ref, m_ref, denom_ref = rest
        plgpu.store(acc_ref.at[split, tok_s[:, None], head_s[:, None], out_col], acc * v_scale, mask=store_mask)
        plgpu.store(m_ref.at[split, tok_s, head_s], m, mask=row_valid)
        plgpu.store(denom_ref.at[split, tok_s, head_s], denom, mask=row_valid)


def ragged_paged_attention(
    q,  # f[T, Hq, D]
    k,  # f[T, Hkv, D] | None: new keys, written at slot_mapping; None = no write
    v,  # f[T, Hkv, D] | None
    kv_cache,  # [2, P, S, Hkv, D]: k at [0], v at [1] (NHD pages, the XLA backend's layout)
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
    block_sizes: GpuBlockSizes | None = None,
    schedule=None,  # i32[5, NB] from gpu_schedule (the builder's); derived here when None
    out_init=None,  # f[T, Hq, D] | None: rows another kernel wrote; this launch writes only its schedule's rows
    return_lse: bool = False,
    lse_init=None,  # f32[T, Hq] | None: with out_init and return_lse, the other kernel's rows' LSE
    q_scale=None,  # f32[] | None: FP8 attention (an e4m3 cache), as the reference's
    state_init=None,  # (m, denom, acc) | None: another call's return_states, over other keys, to fold in
    return_states: bool = False,
    decode_block_sizes: GpuBlockSizes | None = None,
):
    """The reference op's contract (``reference.ragged_paged_attention``) as a Pallas GPU kernel.

    Returns (out f[T, Hq, D] in q's dtype, kv_cache), and lse f32[T, Hq] third with
    ``return_lse`` (as the reference's). ``interpret=None`` runs compiled on a
    GPU and in the Pallas interpreter elsewhere. ``block_sizes`` defaults to
    ``config.gpu_block_sizes`` for the shapes; ``schedule`` must have been built with
    the same ``block_q``.

    With ``out_init`` (the PALLAS_GPU backend passes the Mosaic GPU prefill's output, and a
    ``schedule`` of the rows it left over) the kernel writes its rows into that buffer in
    place (and with ``return_lse`` its LSE into ``lse_init``). Compiled, new keys and values
    are written by ``write_new_kv``.

    With ``return_states`` it returns (states, kv_cache): the raw split-KV softmax states
    (m f32[S, T, Hq], denom f32[S, T, Hq], acc f32[S, T, Hq, D], S the splits; ``common``'s
    state, acc unnormalised), merged by no one. With ``state_init`` (such states, over keys
    this call does not see, as cascade attention's prefix part) each row's softmax starts
    from them: the result is ``merge_attn_states`` of the two parts, in this one launch.

    With ``decode_block_sizes`` (a mixed batch: ``schedule`` from ``mixed_schedule``, or the
    Mosaic GPU split's rest with its decode part) the batch's decodes run on those blocks and its
    other rows on ``block_sizes``, in one launch; both take one KV split and the same warps and
    stages (the launch's).

    With ``q_scale`` (FP8 attention, the reference's semantics) each program quantises its
    q-block to e4m3 as it loads it, so both dots are e4m3 x e4m3 with float32 accumulation
    (``tl.dot`` on fp8 operands: FP8 wgmma on Hopper, sm_89+ elsewhere).

    Example::

        out, kv_cache = ragged_paged_attention(
            q, k, v, kv_cache, query_start_loc, seq_lens, block_tables, slot_mapping,
            sm_scale=head_size**-0.5)
    """
    num_tokens, num_q_heads, _ = q.shape
    num_reqs = block_tables.shape[0]
    block_sizes = validate_inputs(
        q, k, v, kv_cache, query_start_loc, seq_lens, block_tables, slot_mapping, sm_scale=sm_scale, causal=causal,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, sinks=sinks,
        block_sizes=block_sizes, q_scale=q_scale,
    )  # fmt: skip
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    kv_cache = write_new_kv(kv_cache, k, v, slot_mapping, k_scale, v_scale, interpret=interpret)
    if return_states and (return_lse or out_init is not None):
        raise ValueError("return_states=True returns the raw states only: no return_lse, no out_init")
    if num_tokens == 0:  # nothing to attend; a zero-sized grid would not lower
        if return_states:  # one split that saw nothing
            rows = (1, *q.shape[:2])
            states = jnp.full(rows, common.MASK_VALUE), jnp.zeros(rows), jnp.zeros((*rows, q.shape[2]))
            return states, kv_cache
        empty = jnp.zeros_like(q), kv_cache
        return (*empty, jnp.zeros(q.shape[:2], jnp.float32)) if return_lse else empty
    if (return_lse and out_init is not None) != (lse_init is not None):
        raise ValueError("lse_init goes with out_init and return_lse=True (the other kernel's rows' LSE), not alone")
    if decode_block_sizes is not None:
        check_decode_part(block_sizes, decode_block_sizes, group=q.shape[1] // kv_cache.shape[3],
                          page_size=kv_cache.shape[2], return_states=return_states)  # fmt: skip
    if out_init is not None and schedule is None:
        raise ValueError("out_init needs the schedule of the rows the other kernel left over (schedule=None given)")
    make_schedule = gpu_schedule if decode_block_sizes is None else mixed_schedule
    if schedule is None:
        schedule = make_schedule(
            jnp.asarray(query_start_loc), jnp.asarray(seq_lens), num_tokens=num_tokens, block_q=block_sizes.block_q
        )
    # gpu_schedule cuts R + 1 segments (each request, the padding), the Mosaic GPU split's rest 2R + 1;
    # a decode part (mixed_schedule's, or the split's rest's) adds a block per request.
    full = max_num_q_blocks(num_tokens, num_reqs, block_sizes.block_q)
    widths = (full, full + num_reqs)
    if decode_block_sizes is not None:
        widths = (full + num_reqs, full + 2 * num_reqs)
    expected = [(len(_SCHEDULE_FIELDS), nb) for nb in widths]
    if tuple(schedule.shape) not in expected:
        raise ValueError(
            f"schedule.shape={tuple(schedule.shape)} must be one of {expected} ({make_schedule.__name__} with "
            f"block_q={block_sizes.block_q}, num_tokens={num_tokens}, num_reqs={num_reqs})"
        )
    out, lse = _attend(
        q, kv_cache, jnp.asarray(schedule, jnp.int32), jnp.asarray(block_tables),
        alibi_slopes, sinks, k_scale, v_scale, out_init, q_scale, lse_init, state_init,
        sm_scale=float(sm_scale), causal=causal, sliding_window=sliding_window,
        soft_cap=logits_soft_cap, block_sizes=block_sizes, interpret=interpret, return_lse=return_lse,
        return_states=return_states, decode_block_sizes=decode_block_sizes,
    )  # fmt: skip
    if return_states:
        return out, kv_cache
    return (out, kv_cache, lse) if return_lse else (out, kv_cache)


def validate_inputs(
    q, k, v, kv_cache, query_start_loc, seq_lens, block_tables, slot_mapping, *, sm_scale, causal,
    sliding_window, logits_soft_cap, alibi_slopes, sinks, block_sizes: GpuBlockSizes | None, q_scale=None,
) -> GpuBlockSizes:  # fmt: skip
    """The op's checks (``validate.validate_inputs``) and the GPU kernel's shape limits;
    returns ``block_sizes`` (or the defaults for these shapes) checked."""
    validate.validate_inputs(
        q, k, v, kv_cache, query_start_loc, seq_lens, block_tables, slot_mapping, sm_scale=sm_scale, causal=causal,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, sinks=sinks,
        q_scale=q_scale,
    )  # fmt: skip
    num_tokens, num_q_heads, head_size = q.shape
    _, _, page_size, num_kv_heads, _ = kv_cache.shape
    num_reqs, pages_per_req = block_tables.shape
    check_gpu_shapes(head_size=head_size, page_size=page_size)
    group = num_q_heads // num_kv_heads
    if block_sizes is None:
        block_sizes = gpu_block_sizes(
            num_reqs=num_reqs, pages_per_req=pages_per_req, page_size=page_size, head_size=head_size,
            num_kv_heads=num_kv_heads, group=group, mode="decode" if num_tokens <= num_reqs else "mixed",
            q_dtype=q.dtype, kv_dtype=kv_cache.dtype,
        )  # fmt: skip
    check_block_sizes(block_sizes, group=group, page_size=page_size)
    return block_sizes


def check_decode_part(
    block_sizes: GpuBlockSizes, decode_block_sizes: GpuBlockSizes, *, group: int, page_size: int,
    return_states: bool = False,
) -> None:  # fmt: skip
    """Raises ValueError unless ``decode_block_sizes`` can run beside ``block_sizes`` in one launch."""
    check_block_sizes(decode_block_sizes, group=group, page_size=page_size)
    launch = ("num_kv_splits", "num_warps", "num_stages")
    theirs = {f: getattr(block_sizes, f) for f in launch}
    mine = {f: getattr(decode_block_sizes, f) for f in launch}
    if mine != theirs or theirs["num_kv_splits"] != 1:
        raise ValueError(
            f"decode_block_sizes share the launch: their {mine} must equal block_sizes' {theirs}, with one KV split"
        )
    if return_states:
        raise ValueError("decode_block_sizes (a mixed batch's decode part) takes no return_states")


def write_new_kv(kv_cache, k, v, slot_mapping, k_scale, v_scale, *, interpret: bool):
    """The new k/v at slot_mapping (None: no write): compiled, ``kv_write.write_kv`` (a Pallas
    kernel, in place under donation); in the interpreter ``write_to_kv_cache``'s scatter."""
    if k is None:
        return kv_cache
    if interpret:
        return write_to_kv_cache(kv_cache, k, v, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return kv_write.write_kv(kv_cache, k, v, slot_mapping, k_scale, v_scale, interpret=False)


def check_gpu_shapes(*, head_size: int, page_size: int) -> None:
    """Raises ValueError when the GPU kernel cannot tile these shapes."""
    if head_size not in SUPPORTED_HEAD_SIZES:
        raise ValueError(f"{head_size=} is not supported by the Pallas GPU kernel; supported: multiples of 8 up to 256")
    if page_size not in SUPPORTED_PAGE_SIZES:
        raise ValueError(
            f"{page_size=} is not supported by the Pallas GPU kernel; supported: {list(SUPPORTED_PAGE_SIZES)}"
        )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "causal",
        "sliding_window",
        "soft_cap",
        "block_sizes",
        "interpret",
        "return_lse",
        "return_states",
        "decode_block_sizes",
    ),
)
def _attend(q, kv_cache, schedule, block_tables, alibi_slopes, sinks, k_scale, v_scale, out_init, q_scale=None,
            lse_init=None, state_init=None, *, sm_scale, causal, sliding_window, soft_cap, block_sizes, interpret,
            return_lse=False, return_states=False, decode_block_sizes=None):  # fmt: skip
    """(out f[T, Hq, D], lse f32[T, Hq] or None); with ``return_states``, ((m, denom, acc), None).
    With ``decode_block_sizes`` the schedule's first R q-blocks are the decode part's."""
    num_tokens, num_q_heads, head_size = q.shape
    num_reqs = block_tables.shape[0]
    num_kv_heads = kv_cache.shape[3]
    page_size = kv_cache.shape[2]
    group = num_q_heads // num_kv_heads
    splits = block_sizes.num_kv_splits
    nb = schedule.shape[1]
    part_blocks = [(block_sizes, 0, nb)]
    if decode_block_sizes is not None:
        part_blocks = [(decode_block_sizes, 0, num_reqs), (block_sizes, num_reqs, nb)]
    parts = tuple(
        (first, end, pl.cdiv(num_kv_heads, bs.kv_heads_per_program),
         (("block_q", bs.block_q), ("tile", bs.tile(page_size)), ("kv_heads_per_program", bs.kv_heads_per_program)))
        for bs, first, end in part_blocks
    )  # fmt: skip
    kv_programs = max(part[2] for part in parts)  # the grid's KV-head axis: the part with the most programs
    widest = max(head_tile(head_size * bs.kv_heads_per_program) for bs, _, _ in part_blocks)
    flat_cache = kv_cache.reshape(*kv_cache.shape[:3], num_kv_heads * head_size)  # a bitcast: no copy
    inputs = [schedule, block_tables, q, flat_cache]
    has_scales = not (k_scale is None and v_scale is None and q_scale is None)
    if has_scales:  # else none: XLA would build an array of ones in a kernel of its own, a launch before ours
        inputs.append(jnp.stack([
            jnp.float32(1.0) if x is None else jnp.asarray(x, jnp.float32).reshape(())
            for x in (k_scale, v_scale, q_scale)
        ]))  # fmt: skip
    if alibi_slopes is not None:
        inputs.append(jnp.asarray(alibi_slopes, jnp.float32))
    if sinks is not None:
        inputs.append(jnp.asarray(sinks, jnp.float32))
    if state_init is not None:
        inputs += list(state_init)
    out_tokens = num_tokens + 1 if interpret else num_tokens  # the interpreter's spare row
    out_cols = widest if interpret else head_size  # and its full-width tiles
    aliases = {}
    if out_init is not None:  # rows another kernel wrote: this launch writes only its own rows
        if interpret:  # the interpreter's output has a spare row and full-width tiles
            out_init = jnp.pad(out_init, ((0, 1), (0, 0), (0, out_cols - head_size)))
            lse_init = None if lse_init is None else jnp.pad(lse_init, ((0, 1), (0, 0)))
        aliases = {len(inputs): 0}
        inputs.append(out_init)
        if return_lse:
            aliases[len(inputs)] = 1
            inputs.append(lse_init)
    raw = splits > 1 or return_states
    if not raw:
        out_shape = jax.ShapeDtypeStruct((out_tokens, num_q_heads, out_cols), q.dtype)
        if return_lse:
            out_shape = (out_shape, jax.ShapeDtypeStruct((out_tokens, num_q_heads), jnp.float32))
    else:
        out_shape = (
            jax.ShapeDtypeStruct((splits, out_tokens, num_q_heads, out_cols), jnp.float32),
            jax.ShapeDtypeStruct((splits, out_tokens, num_q_heads), jnp.float32),
            jax.ShapeDtypeStruct((splits, out_tokens, num_q_heads), jnp.float32),
        )
    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, causal=causal, sliding_window=sliding_window, soft_cap=soft_cap,
        has_alibi=alibi_slopes is not None, has_sinks=sinks is not None, group=group,
        group_pad=next_pow2(group), num_kv_splits=splits, spare_row=interpret,
        has_out_init=out_init is not None, has_lse=return_lse, fp8=q_scale is not None,
        num_init_splits=0 if state_init is None else state_init[0].shape[0], store_states=raw,
        head_size=head_size, has_scales=has_scales, parts=parts,
    )  # fmt: skip
    result = pl.pallas_call(
        kernel,
        grid=(kv_programs, nb, splits),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages),
        interpret=interpret,
        input_output_aliases=aliases,
        name="ragged_paged_attention_gpu",
    )(*inputs)
    if not raw and return_lse:
        return result[0][:num_tokens, :, :head_size], result[1][:num_tokens]
    if not raw:
        return result[:num_tokens, :, :head_size], None
    acc, m, denom = result[0][:, :num_tokens, :, :head_size], result[1][:, :num_tokens], result[2][:, :num_tokens]
    if return_states:
        return (m, denom, acc), None
    m, denom, acc = common.merge_softmax_states(m, denom, acc)
    out = common.finalize_softmax_state((m.reshape(-1), denom.reshape(-1), acc.reshape(-1, head_size)))
    return out.reshape(q.shape).astype(q.dtype), common.log_sum_exp(m, denom) if return_lse else None
