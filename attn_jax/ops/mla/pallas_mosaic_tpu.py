"""Absorbed MLA decode as a Pallas kernel on Mosaic TPU.

MQA of H query heads over the shared latent key ``[c_kv | k_pe]`` (``C + R`` wide) with
value ``c_kv``. The grid is ``(num_reqs, num_kv_splits, pages_per_split)``: a program takes
every query head of one request (``[H, C + R]``, the rows of its matmuls) against one cache
page ``[S, C + R]``, so each page is read once for all heads; the innermost axis walks the
split's pages with the softmax state in VMEM scratch. seq_lens and the block table are
scalar-prefetched into SMEM, and the cache's BlockSpec index map reads the page id from the
table: Pallas pipelines the page copies HBM -> VMEM. Steps past a request's last page map
to that last page again (no new copy) and skip their compute.

Each split writes its partial state (accumulator, max, denominator); ``combine_splits``
(shared with the Triton kernel) merges them and yields the log-sum-exp. Refs are only
indexed, never reshaped or bitcast (both fail in jax 0.11.2's TPU interpreter).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attn_jax.ops.mla.pallas_triton import MASK_VALUE, combine_splits
from attn_jax.ops.mla.reference import fold_fp8_scale
from attn_jax.ops.mla.validate import dynamic_validate, is_concrete, static_validate_decode


def _kernel(lens_ref, table_ref, q_ref, kv_ref, acc_ref, m_ref, l_ref, m_sc, d_sc, acc_sc, *,
            sm_scale, kv_lora_rank, pages_per_split, pages_per_req):  # fmt: skip
    r, split, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    page_size = kv_ref.shape[1]
    kv_len = lens_ref[r]
    start = (split * pages_per_split + p) * page_size

    @pl.when(p == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
        d_sc[...] = jnp.zeros(d_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(start < kv_len)
    def _step():
        q = q_ref[0]  # [H, C + R]
        kv = kv_ref[0].astype(q.dtype)  # [S, C + R]
        precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
        s = jax.lax.dot_general(
            q, kv, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )  # f32[H, S]
        col = start + jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
        s = jnp.where(col < kv_len, s * sm_scale, MASK_VALUE)
        m_old = m_sc[...]  # f32[H, 1]
        m_new = jnp.maximum(m_old, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_old - m_new)
        prob = jnp.where(col < kv_len, jnp.exp(s - m_new), 0.0)
        row = start + jax.lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)
        v = jnp.where(row < kv_len, kv[:, :kv_lora_rank], jnp.zeros((), kv.dtype))  # unused slots may be NaN
        pv = jax.lax.dot(prob.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
        m_sc[...] = m_new
        d_sc[...] = alpha * d_sc[...] + jnp.sum(prob, axis=1, keepdims=True)
        acc_sc[...] = alpha * acc_sc[...] + pv

    @pl.when(p == pages_per_split - 1)
    def _finish():
        acc_ref[0, 0] = acc_sc[...]
        m_ref[0, 0] = m_sc[...]
        l_ref[0, 0] = d_sc[...]


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
    num_kv_splits: int = 1,
    k_scale=None,  # f32[] | None: required for fp8 caches (folded into q and the output)
):
    """``reference.mla_decode``'s contract as a Pallas TPU kernel. ``interpret=None`` compiles
    for a TPU when the default backend is one and runs the TPU interpreter
    (``pltpu.InterpretParams()``) elsewhere. ``num_kv_splits`` splits each request's pages
    over that many programs (flash-decoding), merged by log-sum-exp.

    Example::

        out = mla_decode(q, kv_cache, seq_lens, block_tables, sm_scale=192**-0.5, kv_lora_rank=512)
    """
    static_validate_decode(q, kv_cache, seq_lens, block_tables, sm_scale=sm_scale, kv_lora_rank=kv_lora_rank)
    num_blocks, page_size, _ = kv_cache.shape
    if is_concrete(seq_lens, block_tables):
        dynamic_validate(seq_lens, block_tables, num_blocks=num_blocks, block_size=page_size)
    if not isinstance(num_kv_splits, int) or num_kv_splits < 1:
        raise ValueError(f"num_kv_splits={num_kv_splits!r} must be an int >= 1")
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    q, out_scale = fold_fp8_scale(q, kv_cache, k_scale)
    out, lse = _decode(
        q, kv_cache, jnp.asarray(seq_lens), jnp.asarray(block_tables), sm_scale=float(sm_scale),
        kv_lora_rank=int(kv_lora_rank), num_kv_splits=num_kv_splits, interpret=bool(interpret),
    )  # fmt: skip
    if out_scale is not None:
        out = (out.astype(jnp.float32) * out_scale).astype(out.dtype)
    return (out, lse) if return_lse else out


@functools.partial(jax.jit, static_argnames=("sm_scale", "kv_lora_rank", "num_kv_splits", "interpret"))
def _decode(q, kv_cache, seq_lens, block_tables, *, sm_scale, kv_lora_rank, num_kv_splits, interpret):
    num_reqs, num_heads, width = q.shape
    num_blocks, page_size, _ = kv_cache.shape
    pages_per_req = block_tables.shape[1]
    if num_reqs == 0:
        return jnp.zeros((0, num_heads, kv_lora_rank), q.dtype), jnp.zeros((0, num_heads), jnp.float32)
    splits = min(num_kv_splits, pages_per_req)
    pps = -(-pages_per_req // splits)
    table = block_tables.reshape(-1)  # 1-D in SMEM

    def kv_index(r, split, p, lens, tab):
        last = jnp.maximum(jax.lax.div(lens[r] + page_size - 1, page_size) - 1, 0)  # lax.div: no sign op on TPU
        j = jnp.minimum(split * pps + p, last)  # past the context: the last page again, no new copy
        return jnp.clip(tab[r * pages_per_req + j], 0, num_blocks - 1), 0, 0

    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, kv_lora_rank=kv_lora_rank, pages_per_split=pps, pages_per_req=pages_per_req
    )
    acc, m, denom = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(num_reqs, splits, pps),
            in_specs=[
                pl.BlockSpec((1, num_heads, width), lambda r, s, p, *_: (r, 0, 0)),
                pl.BlockSpec((1, page_size, width), kv_index),
            ],
            out_specs=[
                pl.BlockSpec((1, 1, num_heads, kv_lora_rank), lambda r, s, p, *_: (s, r, 0, 0)),
                pl.BlockSpec((1, 1, num_heads, 1), lambda r, s, p, *_: (s, r, 0, 0)),
                pl.BlockSpec((1, 1, num_heads, 1), lambda r, s, p, *_: (s, r, 0, 0)),
            ],
            scratch_shapes=[
                pltpu.VMEM((num_heads, 1), jnp.float32),
                pltpu.VMEM((num_heads, 1), jnp.float32),
                pltpu.VMEM((num_heads, kv_lora_rank), jnp.float32),
            ],
        ),
        out_shape=(
            jax.ShapeDtypeStruct((splits, num_reqs, num_heads, kv_lora_rank), jnp.float32),
            jax.ShapeDtypeStruct((splits, num_reqs, num_heads, 1), jnp.float32),
            jax.ShapeDtypeStruct((splits, num_reqs, num_heads, 1), jnp.float32),
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="mla_decode_tpu",
    )(seq_lens, table, q, kv_cache)
    out, lse = combine_splits(acc, m[..., 0], denom[..., 0], num_heads)
    return out.astype(q.dtype), lse
