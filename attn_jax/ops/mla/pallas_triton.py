"""Absorbed MLA decode as a Pallas kernel on GPU (Triton lowering).

MQA of H query heads over the shared latent key ``[c_kv | k_pe]`` (``C + R`` wide, e.g.
512 + 64) with value ``c_kv``. The grid is ``(num_reqs, cdiv(H, block_h), num_kv_splits)``:
a program holds ``block_h`` query heads of one request as the rows of its matmuls (all
heads when ``block_h >= H``), so each cache page is read once per head block, not once per
head. The 576-wide rows are not a power of two, which Triton tiles must be: the kernel
loads a tile's ``c_kv`` ``[tile, C]`` and ``k_pe`` ``[tile, R]`` separately and forms the
scores as ``q_nope . c_kv + q_pe . k_pe``; ``p @ c_kv`` reuses the loaded ``c_kv``.

With ``num_kv_splits > 1`` (flash-decoding, for few long requests) each program covers a
share of the request's tiles and writes its partial softmax state (accumulator, max,
denominator); ``combine_splits`` merges them in jnp and yields the log-sum-exp too.

Outputs are sized ``cdiv(H, block_h) * block_h`` heads and sliced afterwards, so no store
is masked (the interpreter turns masked stores into scatters).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from attn_jax.ops.mla.reference import fold_fp8_scale
from attn_jax.ops.mla.validate import dynamic_validate, is_concrete, static_validate_decode
from attn_jax.ops.ragged_paged_attention.config import gpu_smem_limit

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
"""Finite stand-in for -inf: the running max starts here, so exp(m_old - m_new) never sees inf - inf."""

NUM_SMS_DEFAULT = 132
"""Streaming multiprocessors assumed when choosing ``num_kv_splits`` (an H100 SXM)."""


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class MLADecodeBlockSizes:
    """Static tiling of the GPU MLA decode kernel.

    block_h: query heads per program (a power of two >= 16; Triton dots need 16 rows).
    pages_per_tile: cache pages per KV tile (``pages_per_tile * page_size`` keys, >= 16).
    num_kv_splits: programs per (request, head block) along the context.
    """

    block_h: int = 64
    pages_per_tile: int = 1
    num_kv_splits: int = 1
    num_warps: int = 8
    num_stages: int = 2


def default_block_sizes(
    *, num_reqs: int, num_heads: int, pages_per_req: int, page_size: int, num_sms: int = NUM_SMS_DEFAULT,
    device_kind: str | None = None, kv_width: int = 576, kv_itemsize: int = 2,
) -> MLADecodeBlockSizes:  # fmt: skip
    """A shape heuristic: every head of a request in one program up to 64 heads, 8
    warps (128 heads: two 64-head programs, as a 128 x 512 float32 accumulator does not fit
    a program's registers), tiles of >= 64 keys, and enough KV splits to give the SMs ~2
    programs each. When 32-head programs alone fill every SM (many requests of many
    heads), 32-head programs of 4 warps and no split instead: on the H100 they beat the
    64-head ones by 19 % at MLA-D1's 64 requests and lose by 3-10 % at 1-16 requests.
    16-head programs over a 2-byte cache take 4 warps and 3 stages where three KV tiles
    (``kv_width`` values of ``kv_itemsize`` bytes a key) fit ``device_kind``'s shared memory
    (``gpu_smem_limit``; Hopper's at DeepSeek's 576): MLA-D1-16's device time 119 -> 116 us
    on the H100 (BENCHMARKS.md)."""
    block_h = min(max(_next_pow2(num_heads), 16), 64)
    num_warps, num_stages = 8, 2
    if num_heads > block_h and num_reqs * -(-num_heads // 32) >= num_sms:
        block_h, num_warps = 32, 4
    pages_per_tile = max(1, 64 // page_size)
    tile_bytes = pages_per_tile * page_size * kv_width * kv_itemsize
    if block_h == 16 and kv_itemsize == 2 and 3 * tile_bytes <= gpu_smem_limit(device_kind):
        num_warps, num_stages = 4, 3
    head_blocks = -(-num_heads // block_h)
    tiles = max(1, -(-pages_per_req // pages_per_tile))
    splits = max(1, min(tiles, (2 * num_sms) // max(num_reqs * head_blocks, 1), 16))
    return MLADecodeBlockSizes(
        block_h=block_h,
        pages_per_tile=pages_per_tile,
        num_kv_splits=splits,
        num_warps=num_warps,
        num_stages=num_stages,
    )


def check_block_sizes(bs: MLADecodeBlockSizes, *, kv_lora_rank: int, rope_dim: int, page_size: int) -> None:
    """ValueError naming a shape or block size the Triton kernel cannot tile."""
    for name, value in (("kv_lora_rank", kv_lora_rank), ("qk_rope_head_dim", rope_dim), ("page_size", page_size)):
        if not is_pow2(value):
            raise ValueError(f"{name}={value} must be a power of two for the Triton MLA kernel (e.g. 512, 64, 64)")
    if not is_pow2(bs.block_h) or bs.block_h < 16:
        raise ValueError(f"block_h={bs.block_h} must be a power of two >= 16 (valid: 16, 32, 64, 128)")
    if not is_pow2(bs.pages_per_tile) or bs.pages_per_tile * page_size < 16:
        raise ValueError(
            f"pages_per_tile={bs.pages_per_tile} must be a power of two with pages_per_tile * {page_size=} >= 16"
        )
    if bs.num_kv_splits < 1:
        raise ValueError(f"num_kv_splits={bs.num_kv_splits} must be >= 1")


def _kernel(lens_ref, table_ref, q_ref, kv_ref, acc_ref, m_ref, l_ref, *, sm_scale, kv_lora_rank, block_h,
            pages_per_tile, num_kv_splits):  # fmt: skip
    r, hb, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_heads = q_ref.shape[1]
    _, page_size, width = kv_ref.shape
    pages_per_req = table_ref.shape[1]
    tile = pages_per_tile * page_size
    rope = width - kv_lora_rank

    head = hb * block_h + jnp.arange(block_h, dtype=jnp.int32)
    head_ok = head < num_heads
    head_c = jnp.minimum(head, num_heads - 1)
    dc = jnp.arange(kv_lora_rank, dtype=jnp.int32)[None, :]
    dr = kv_lora_rank + jnp.arange(rope, dtype=jnp.int32)[None, :]
    q_nope = plgpu.load(q_ref.at[r, head_c[:, None], dc], mask=head_ok[:, None], other=0.0)  # [BH, C]
    q_pe = plgpu.load(q_ref.at[r, head_c[:, None], dr], mask=head_ok[:, None], other=0.0)  # [BH, R]
    precision = jax.lax.Precision.HIGHEST if q_nope.dtype == jnp.float32 else None
    dims = (((1,), (1,)), ((), ()))

    kv_len = lens_ref[r]
    num_tiles = (kv_len + tile - 1) // tile
    per_split = (num_tiles + num_kv_splits - 1) // num_kv_splits
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, num_tiles)

    def body(t, state):
        m, denom, acc = state
        j = t * tile + jnp.arange(tile, dtype=jnp.int32)
        ok = j < kv_len
        page = plgpu.load(table_ref.at[r, jnp.minimum(j // page_size, pages_per_req - 1)])[:, None]
        off = (j % page_size)[:, None]
        c_kv = plgpu.load(kv_ref.at[page, off, dc], mask=ok[:, None], other=0.0)  # [tile, C]
        k_pe = plgpu.load(kv_ref.at[page, off, dr], mask=ok[:, None], other=0.0)  # [tile, R]
        c_kv, k_pe = c_kv.astype(q_nope.dtype), k_pe.astype(q_nope.dtype)
        s = jax.lax.dot_general(q_nope, c_kv, dims, precision=precision, preferred_element_type=jnp.float32)
        s += jax.lax.dot_general(q_pe, k_pe, dims, precision=precision, preferred_element_type=jnp.float32)
        s = jnp.where(ok[None, :], s * sm_scale, MASK_VALUE)  # f32[BH, tile]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(ok[None, :], jnp.exp(s - m_new[:, None]), 0.0)
        pv = jax.lax.dot(p.astype(c_kv.dtype), c_kv, precision=precision, preferred_element_type=jnp.float32)
        return m_new, alpha * denom + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    state = (
        jnp.full((block_h,), MASK_VALUE, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
        jnp.zeros((block_h, kv_lora_rank), jnp.float32),
    )
    m, denom, acc = jax.lax.fori_loop(lo, hi, body, state)
    rows = hb * block_h + jnp.arange(block_h, dtype=jnp.int32)  # the padded head axis: never masked
    plgpu.store(acc_ref.at[split, r, rows[:, None], dc], acc)
    plgpu.store(m_ref.at[split, r, rows], m)
    plgpu.store(l_ref.at[split, r, rows], denom)


def combine_splits(acc, m, denom, num_heads: int):
    """Merges split-KV partial states (acc f32[K, R, Hp, C], m/denom f32[K, R, Hp]) into
    (out f32[R, H, C], lse f32[R, H]); a request that saw no key gives 0 and lse -inf."""
    m_all = jnp.max(m, axis=0)
    w = jnp.exp(m - m_all[None])
    denom = jnp.sum(w * denom, axis=0)
    acc = jnp.sum(w[..., None] * acc, axis=0)
    empty = denom == 0
    out = jnp.where(empty[..., None], 0.0, acc / jnp.where(empty, 1.0, denom)[..., None])
    lse = jnp.where(empty, -jnp.inf, m_all + jnp.log(jnp.where(empty, 1.0, denom)))
    return out[:, :num_heads], lse[:, :num_heads]


def mla_decode(
    q,  # f[R, H, C + Rope]
    kv_cache,  # [P, S, C + Rope]
    seq_lens,  # i32[R]
    block_tables,  # i32[R, pages_per_req]
    *,
    sm_scale: float,
    kv_lora_rank: int,
    return_lse: bool = False,
    interpret: bool | None = None,
    block_sizes: MLADecodeBlockSizes | None = None,
    k_scale=None,  # f32[] | None: required for fp8 caches (folded into q and the output)
    device_kind: str | None = None,
):
    """``reference.mla_decode``'s contract as a Pallas GPU kernel. ``interpret=None`` runs
    compiled on a GPU and in the Pallas interpreter elsewhere; ``block_sizes`` default to
    ``default_block_sizes`` for the shapes and ``device_kind`` (``jax.Device.device_kind``
    of the GPU, read by the caller; None: no device's shared memory is assumed).

    Example::

        out = mla_decode(q, kv_cache, seq_lens, block_tables, sm_scale=192**-0.5, kv_lora_rank=512)
    """
    static_validate_decode(q, kv_cache, seq_lens, block_tables, sm_scale=sm_scale, kv_lora_rank=kv_lora_rank)
    num_blocks, page_size, width = kv_cache.shape
    num_reqs, pages_per_req = block_tables.shape
    if is_concrete(seq_lens, block_tables):
        dynamic_validate(seq_lens, block_tables, num_blocks=num_blocks, block_size=page_size)
    bs = block_sizes or default_block_sizes(
        num_reqs=num_reqs, num_heads=q.shape[1], pages_per_req=pages_per_req, page_size=page_size,
        device_kind=device_kind, kv_width=width, kv_itemsize=kv_cache.dtype.itemsize,
    )  # fmt: skip
    check_block_sizes(bs, kv_lora_rank=kv_lora_rank, rope_dim=width - kv_lora_rank, page_size=page_size)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    q, out_scale = fold_fp8_scale(q, kv_cache, k_scale)
    out, lse = _decode(
        q, kv_cache, jnp.asarray(seq_lens), jnp.asarray(block_tables),
        sm_scale=float(sm_scale), kv_lora_rank=int(kv_lora_rank), bs=bs, interpret=bool(interpret),
    )  # fmt: skip
    if out_scale is not None:
        out = (out.astype(jnp.float32) * out_scale).astype(out.dtype)
    return (out, lse) if return_lse else out


@functools.partial(jax.jit, static_argnames=("sm_scale", "kv_lora_rank", "bs", "interpret"))
def _decode(q, kv_cache, seq_lens, block_tables, *, sm_scale, kv_lora_rank, bs, interpret):
    num_reqs, num_heads, _ = q.shape
    if num_reqs == 0:
        return jnp.zeros((0, num_heads, kv_lora_rank), q.dtype), jnp.zeros((0, num_heads), jnp.float32)
    head_blocks = -(-num_heads // bs.block_h)
    padded = head_blocks * bs.block_h
    splits = bs.num_kv_splits
    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, kv_lora_rank=kv_lora_rank, block_h=bs.block_h,
        pages_per_tile=bs.pages_per_tile, num_kv_splits=splits,
    )  # fmt: skip
    acc, m, denom = pl.pallas_call(
        kernel,
        grid=(num_reqs, head_blocks, splits),
        out_shape=(
            jax.ShapeDtypeStruct((splits, num_reqs, padded, kv_lora_rank), jnp.float32),
            jax.ShapeDtypeStruct((splits, num_reqs, padded), jnp.float32),
            jax.ShapeDtypeStruct((splits, num_reqs, padded), jnp.float32),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="mla_decode_triton",
    )(seq_lens, block_tables, q, kv_cache)
    out, lse = combine_splits(acc, m, denom, num_heads)
    return out.astype(q.dtype), lse
