"""Absorbed MLA decode as a Mosaic GPU kernel (``plgpu.kernel``, Hopper).

MQA of H query heads over the shared latent key ``[c_kv | k_pe]`` (576 wide for DeepSeek)
with value ``c_kv`` (512), as ``pallas_triton.mla_decode`` computes it, with FlashMLA's split
of the work between two warpgroups:

- A CTA is 64 query heads (``BLOCK_H``, wgmma's M; fewer heads are zero-padded) of one
  request, over one share of its context (``grid = (head blocks, splits, requests)``; head
  blocks vary fastest, so the CTAs reading one request's pages run side by side).
- A memory warpgroup streams the request's keys in blocks of 64 (``BLOCK_KV``), one TMA per
  page, into a two-slot shared-memory ring; q ``[64, 576]`` stays in shared memory.
- Warpgroup 0 computes the scores ``q . [c_kv | k_pe]^T`` on wgmma, the online softmax
  (exp2, the scale folded into one multiply), hands ``p`` (bf16) and the rescale factor to
  warpgroup 1 through shared memory, then accumulates ``p @ c_kv[:, :256]``; warpgroup 1
  accumulates ``p @ c_kv[:, 256:]`` meanwhile, under warpgroup 0's next scores. A
  ``[64, 512]`` float32 accumulator would not fit one warpgroup's registers; each holds half.
- V is the key block itself (its first 512 columns): no second copy of the cache is read.
- Keys past ``seq_len`` in a request's last block (the rest of its last page) are masked
  out of the scores and their ``c_kv`` rows zeroed in shared memory first, so NaN or garbage
  there cannot reach an output (0 * NaN would).
- With splits (few requests: ``default_num_splits``), each CTA writes its share's normalised
  output in q's dtype and its log-sum-exp; ``merge.merge_many_attn_states`` combines them in
  float32.

Shared memory is q (72 KiB), the ring (2 x 72 KiB) and ``p`` (8 KiB): 225 KiB of Hopper's
227, which is why the ring has two slots and the key block is 64. Supported: bfloat16 /
float16 q and cache (fp8 caches stay on the Triton kernel), ``kv_lora_rank`` 512 with rope
64 (any layout whose halves and smem fit: ``unsupported_reason``), pages of 8-multiples that
tile 64-key blocks or are tiled by them. Compiled on Hopper only (no interpreter runs
Mosaic GPU kernels in jax 0.11.2); CPU tests lower it for CUDA.
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

from attn_jax.ops.mla.pallas_triton import NUM_SMS_DEFAULT
from attn_jax.ops.mla.validate import dynamic_validate, is_concrete, static_validate_decode
from attn_jax.ops.ragged_paged_attention.config import MOSAIC_GPU_SMEM_BYTES
from attn_jax.ops.ragged_paged_attention.merge import merge_many_attn_states
from attn_jax.ops.ragged_paged_attention.pallas_mosaic_gpu import SUPPORTED_DTYPES, smem_transforms

BLOCK_H = 64
"""Query heads per CTA: wgmma's M for one warpgroup."""
BLOCK_KV = 64
"""Keys per block of the ring (and wgmma's N for the scores)."""
NUM_SLOTS = 2
"""Ring depth: what Hopper's shared memory holds beside q at 576-wide rows."""

__all__ = ["BLOCK_H", "BLOCK_KV", "default_num_splits", "mla_decode", "smem_bytes", "unsupported_reason"]


def smem_bytes(width: int, itemsize: int = 2) -> int:
    """Shared memory the kernel allocates at latent rows of ``width`` (q, ring, p, 2 row vectors)."""
    return (BLOCK_H + NUM_SLOTS * BLOCK_KV) * width * itemsize + BLOCK_H * BLOCK_KV * itemsize + 2 * BLOCK_H * 4


def unsupported_reason(*, kv_lora_rank: int, width: int, page_size: int, dtype, cache_dtype) -> str | None:
    """Why this kernel cannot serve the decode, or None when it can. ``width``: the cache's
    row (``kv_lora_rank + qk_rope_head_dim``)."""
    if np.dtype(dtype) not in SUPPORTED_DTYPES:
        return f"the Mosaic GPU MLA decode kernel takes bfloat16/float16 q, not {np.dtype(dtype)}"
    if np.dtype(cache_dtype) != np.dtype(dtype):
        return (
            f"the Mosaic GPU MLA decode kernel needs the cache in q's dtype {np.dtype(dtype)}, "
            f"not {np.dtype(cache_dtype)}"
        )
    half = kv_lora_rank // 2
    if kv_lora_rank % 128 or half > 256:
        return f"kv_lora_rank={kv_lora_rank} must be a multiple of 128 of at most 512 (two wgmma halves of <= 256)"
    if width % 64:
        return f"the latent row of {width} values must be whole 128-byte swizzle tiles (a multiple of 64)"
    if smem_bytes(width) > MOSAIC_GPU_SMEM_BYTES:
        return f"rows of {width} need {smem_bytes(width)} bytes of shared memory; Hopper has {MOSAIC_GPU_SMEM_BYTES}"
    if page_size % 8 or (BLOCK_KV % page_size and page_size % BLOCK_KV):
        return f"page_size={page_size} must be a multiple of 8 that divides or is divided by {BLOCK_KV}"
    return None


def default_num_splits(*, num_reqs: int, num_heads: int, pages_per_req: int, page_size: int,
                       num_sms: int = NUM_SMS_DEFAULT) -> int:  # fmt: skip
    """Context splits so the CTAs about fill the SMs once (one CTA per SM: its shared memory),
    each split keeping at least 4 key blocks."""
    ctas = num_reqs * -(-num_heads // BLOCK_H)
    blocks = max(1, pages_per_req * page_size // BLOCK_KV)
    return int(max(1, min(round(num_sms / max(ctas, 1)), blocks // 4, 16)))


def _kernel(lens_ref, bt_ref, q_ref, kv_ref, out_ref, lse_ref, scoped, *, page_size, sm_scale, kv_lora_rank,
            num_splits):  # fmt: skip
    (q_smem, k_smem, p_smem, alpha_smem, lse_smem), (k_bars, q_bar), (k_consumed,), sync = scoped
    p_ready, p_consumed, stats_ready = sync
    half = kv_lora_rank // 2
    pages_per_req = bt_ref.shape[1]
    dtype = q_ref.dtype
    hb, split, req = lax.axis_index("heads"), lax.axis_index("split"), lax.axis_index("req")
    wg = lax.axis_index("wg")
    h0 = hb * BLOCK_H
    kv_len = lens_ref[req]
    num_blocks = lax.div(kv_len + BLOCK_KV - 1, jnp.int32(BLOCK_KV))
    per_split = lax.div(num_blocks + num_splits - 1, jnp.int32(num_splits))
    lo = jnp.minimum(split * per_split, num_blocks)
    n = jnp.minimum(lo + per_split, num_blocks) - lo  # this CTA's key blocks: lo .. lo + n
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def write_out(acc, l_i, col0):
        """This warpgroup's normalised half of the output, stored from registers (a TMA needs
        a contiguous shared-memory tile, and a column half of q's is not)."""
        empty = l_i == 0.0
        inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l_i))
        o = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
        out_ref.at[split, req, pl.ds(h0, BLOCK_H), pl.ds(col0, half)][...] = o

    @pl.when(wg == 0)
    def _scores_and_low_half():
        plgpu.set_max_registers(232, action="increase")
        plgpu.copy_gmem_to_smem(q_ref.at[req, pl.ds(h0, BLOCK_H)], q_smem, q_bar.at[0])
        plgpu.barrier_wait(q_bar.at[0])
        scale = sm_scale * math.log2(math.e)  # exp(x * s) = exp2(x * s * log2 e)
        m_i = plgpu.layout_cast(jnp.full((BLOCK_H,), -jnp.inf, jnp.float32), row_layout)
        l_i = plgpu.layout_cast(jnp.full((BLOCK_H,), 0, jnp.float32), row_layout)
        acc = plgpu.layout_cast(jnp.full((BLOCK_H, half), 0, jnp.float32), plgpu.Layout.WGMMA)

        def step(j, carry):
            acc, m_i, l_i = carry
            slot = lax.rem(j, jnp.int32(NUM_SLOTS))
            key0 = (lo + j) * BLOCK_KV
            plgpu.barrier_wait(k_bars.at[slot])

            @pl.when(key0 + BLOCK_KV > kv_len)
            def _zero_tail():  # keys from kv_len on may hold NaN: zero their c_kv rows (p is 0 there)
                for c in range(0, kv_lora_rank, 128):
                    v_tile = k_smem.at[slot, :, pl.ds(c, 128)]
                    vv = plgpu.load(v_tile, layout=plgpu.Layout.WGMMA)
                    rows = plgpu.broadcasted_iota(jnp.int32, (BLOCK_KV, 128), 0, layout=plgpu.Layout.WGMMA)
                    v_tile[...] = jnp.where(rows + key0 < kv_len, vv, jnp.zeros_like(vv))
                plgpu.commit_smem()

            def qk_scope(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk_scope, plgpu.ACC((BLOCK_H, BLOCK_KV), jnp.float32))
            kv_ids = plgpu.broadcasted_iota(jnp.int32, (BLOCK_H, BLOCK_KV), 1, layout=plgpu.Layout.WGMMA)
            s = jnp.where(kv_ids + key0 < kv_len, s, -jnp.inf)
            m_new = jnp.maximum(m_i, s.max(axis=1) * scale)
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)
            p16 = p.astype(dtype)
            pl.when(j > 0)(lambda: plgpu.barrier_wait(p_consumed.at[0]))  # warpgroup 1 is done with p
            p_smem[...] = p16
            alpha_smem[...] = alpha
            plgpu.commit_smem()
            plgpu.barrier_arrive(p_ready.at[0])
            acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p16, k_smem.at[slot, :, pl.ds(0, half)])

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(k_consumed.at[slot])
            return acc, m_new, l_i

        acc, m_i, l_i = lax.fori_loop(0, n, step, (acc, m_i, l_i))
        pl.when(n > 0)(lambda: plgpu.barrier_wait(p_consumed.at[0]))  # then alpha_smem carries l
        alpha_smem[...] = l_i
        empty = l_i == 0.0
        lse_smem[...] = jnp.where(empty, -jnp.inf, m_i * math.log(2.0) + jnp.log(jnp.where(empty, 1.0, l_i)))
        plgpu.commit_smem()
        plgpu.barrier_arrive(stats_ready.at[0])
        write_out(acc, l_i, 0)
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, req, pl.ds(h0, BLOCK_H)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _high_half():
        plgpu.set_max_registers(232, action="increase")
        acc = plgpu.layout_cast(jnp.full((BLOCK_H, half), 0, jnp.float32), plgpu.Layout.WGMMA)

        def step(j, acc):
            slot = lax.rem(j, jnp.int32(NUM_SLOTS))
            plgpu.barrier_wait(k_bars.at[slot])
            plgpu.barrier_wait(p_ready.at[0])
            alpha = plgpu.load(alpha_smem, layout=row_layout)
            acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, k_smem.at[slot, :, pl.ds(half, half)])

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(p_consumed.at[0])
            plgpu.barrier_arrive(k_consumed.at[slot])
            return acc

        acc = lax.fori_loop(0, n, step, acc)
        plgpu.barrier_wait(stats_ready.at[0])  # alpha_smem holds l now
        write_out(acc, plgpu.load(alpha_smem, layout=row_layout), half)

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        chunk = min(page_size, BLOCK_KV)

        def cache_rows(j):
            """First cache row of each page-sized chunk of key block ``lo + j``."""
            rows = []
            for c in range(BLOCK_KV // chunk):
                key0 = (lo + j) * BLOCK_KV + c * chunk
                page = bt_ref[req, jnp.minimum(lax.div(key0, jnp.int32(page_size)), pages_per_req - 1)]
                rows.append(page * page_size + lax.rem(key0, jnp.int32(page_size)))
            return rows

        def fetch(rows, slot):
            for c, row in enumerate(rows):
                plgpu.copy_gmem_to_smem(
                    kv_ref.at[pl.ds(row, chunk)], k_smem.at[slot, pl.ds(c * chunk, chunk)], k_bars.at[slot]
                )

        for i in range(NUM_SLOTS):
            pl.when(i < n)(lambda i=i: fetch(cache_rows(i), i))

        @pl.loop(0, jnp.maximum(n - NUM_SLOTS, 0))
        def _(s):
            slot = lax.rem(s, jnp.int32(NUM_SLOTS))
            rows = cache_rows(s + NUM_SLOTS)  # the block table read under the wait (5 % on MLA-D1)
            plgpu.barrier_wait(k_consumed.at[slot])
            fetch(rows, slot)


def mla_decode(
    q,  # f[R, H, C + Rope]
    kv_cache,  # [P, S, C + Rope], q's dtype
    seq_lens,  # i32[R]
    block_tables,  # i32[R, pages_per_req]
    *,
    sm_scale: float,
    kv_lora_rank: int,
    return_lse: bool = False,
    num_splits: int | None = None,
):
    """``reference.mla_decode``'s contract (out f[R, H, C], with ``return_lse`` also lse
    f32[R, H]), compiled on Hopper; ``unsupported_reason`` must be None for the shapes.
    ``num_splits`` None: ``default_num_splits``.

    Example::

        out = mla_decode(q, kv_cache, seq_lens, block_tables, sm_scale=192**-0.5, kv_lora_rank=512)
    """
    static_validate_decode(q, kv_cache, seq_lens, block_tables, sm_scale=sm_scale, kv_lora_rank=kv_lora_rank)
    num_blocks, page_size, width = kv_cache.shape
    num_reqs, pages_per_req = block_tables.shape
    reason = unsupported_reason(
        kv_lora_rank=kv_lora_rank, width=width, page_size=page_size, dtype=q.dtype, cache_dtype=kv_cache.dtype
    )
    if reason:
        raise ValueError(reason)
    if is_concrete(seq_lens, block_tables):
        dynamic_validate(seq_lens, block_tables, num_blocks=num_blocks, block_size=page_size)
    if num_splits is None:
        num_splits = default_num_splits(
            num_reqs=num_reqs, num_heads=q.shape[1], pages_per_req=pages_per_req, page_size=page_size
        )
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    out, lse = _decode(q, kv_cache, jnp.asarray(seq_lens), jnp.asarray(block_tables), sm_scale=float(sm_scale),
                       kv_lora_rank=int(kv_lora_rank), num_splits=int(num_splits))  # fmt: skip
    return (out, lse) if return_lse else out


@functools.partial(jax.jit, static_argnames=("sm_scale", "kv_lora_rank", "num_splits"))
def _decode(q, kv_cache, seq_lens, block_tables, *, sm_scale, kv_lora_rank, num_splits):
    num_reqs, num_heads, width = q.shape
    if num_reqs == 0:
        return jnp.zeros((0, num_heads, kv_lora_rank), q.dtype), jnp.zeros((0, num_heads), jnp.float32)
    num_pages, page_size, _ = kv_cache.shape
    head_blocks = -(-num_heads // BLOCK_H)
    padded = head_blocks * BLOCK_H
    if padded != num_heads:  # a TMA box of q rows is BLOCK_H heads
        q = jnp.pad(q, ((0, 0), (0, padded - num_heads), (0, 0)))
    kv = kv_cache.reshape(num_pages * page_size, width)  # a bitcast: one latent row per slot
    chunks = BLOCK_KV // min(page_size, BLOCK_KV)

    def entry(lens_ref, bt_ref, q_ref, kv_ref, out_ref, lse_ref):
        body = functools.partial(
            _kernel, lens_ref, bt_ref, q_ref, kv_ref, out_ref, lse_ref, page_size=page_size, sm_scale=sm_scale,
            kv_lora_rank=kv_lora_rank, num_splits=num_splits,
        )  # fmt: skip
        pl.run_scoped(
            lambda *args: body(args),
            (
                plgpu.SMEM((BLOCK_H, width), q.dtype, transforms=smem_transforms(width, q.dtype)),
                plgpu.SMEM((NUM_SLOTS, BLOCK_KV, width), kv.dtype, transforms=smem_transforms(width, kv.dtype)),
                plgpu.SMEM((BLOCK_H, BLOCK_KV), q.dtype, transforms=smem_transforms(BLOCK_KV, q.dtype)),
                plgpu.SMEM((BLOCK_H,), jnp.float32),
                plgpu.SMEM((BLOCK_H,), jnp.float32),
            ),
            (plgpu.Barrier(num_arrivals=chunks, num_barriers=NUM_SLOTS), plgpu.Barrier(num_barriers=1)),
            (plgpu.Barrier(num_arrivals=2, num_barriers=NUM_SLOTS),),
            (plgpu.Barrier(num_barriers=1),) * 3,
            collective_axes="wg",
        )

    out, lse = plgpu.kernel(
        entry,
        out_type=(
            jax.ShapeDtypeStruct((num_splits, num_reqs, padded, kv_lora_rank), q.dtype),
            jax.ShapeDtypeStruct((num_splits, num_reqs, padded), jnp.float32),
        ),
        grid=(head_blocks, num_splits, num_reqs),
        grid_names=("heads", "split", "req"),
        num_threads=3,
        thread_name="wg",
        # Row statistics reduce within a warp (WGMMA rows): no cross-warp scratch, whose
        # default 2 KiB would not fit beside the ring.
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane, reduction_scratch_bytes=0
        ),
        kernel_name="mla_decode_mgpu",
    )(seq_lens, block_tables, q, kv)
    if num_splits == 1:
        out, lse = out[0], lse[0]
    else:
        out, lse = merge_many_attn_states(list(out), list(lse))
    return out[:, :num_heads], lse[:, :num_heads]
