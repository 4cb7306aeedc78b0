"""Up-projected MLA prefill with a Pallas GPU attention kernel (Triton lowering).

Each prefill request's latents are gathered from the paged cache and up-projected in XLA
(``k_nope = c_kv @ W_UK`` [R, L, H, nope], ``v = c_kv @ W_UV`` [R, L, H, Dv], ``k_pe`` [R, L,
R_dim] shared by the heads); the kernel then runs causal attention with q/k head size
``nope + rope`` (192) and v head size ``Dv`` (128), which differ. Grid ``(R, cdiv(q_block,
block_q), H)``: a program takes ``block_q`` query rows of one request and one head, and walks
the request's keys in tiles of ``block_k`` up to its causal limit with the online softmax:
first the tiles every row of the block sees (no mask), then the diagonal ones (masked). The
last q-blocks, which see the most keys, are launched first (a shorter tail of light blocks).
The 192-wide q/k are handled as their 128 + 64 parts (Triton tiles are powers of two).
Rows of a block past the request's tokens write to a spare output row (no masked store).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from attn_jax.kv_cache import dequantize_from_cache
from attn_jax.ops.mla.pallas_triton import MASK_VALUE, is_pow2
from attn_jax.ops.mla.validate import check_scale, dynamic_validate, is_concrete, static_validate_prefill


def _kernel(qsl_ref, lens_ref, q_ref, knope_ref, kpe_ref, v_ref, *refs, sm_scale, nope, block_q, block_k,
            rest: bool = False):  # fmt: skip
    """One (request, q-block, head). ``rest``: refs are (span_lo, span_hi, out_init, out): the
    rows of each request's ``[span_lo, span_hi)`` are another kernel's (the Mosaic GPU prefill's,
    already in ``out_init``, aliased to ``out``): a block inside its span returns at once, the
    others store only their own rows, and the programs of one more "request" (index R) store
    zeros in the rows no request owns (masked stores: compiled only). Else refs are (out, lse)."""
    ids = pl.program_id(0), pl.num_programs(1) - 1 - pl.program_id(1), pl.program_id(2)  # the heaviest q-blocks first
    if not rest:
        return _block(ids, qsl_ref, lens_ref, q_ref, knope_ref, kpe_ref, v_ref, *refs, sm_scale=sm_scale, nope=nope,
                      block_q=block_q, block_k=block_k)  # fmt: skip
    lo_ref, hi_ref, _, out_ref = refs
    r, qb, h = ids
    num_reqs = lens_ref.shape[0]

    @pl.when(r < num_reqs)
    def _request():
        start, qlen = qsl_ref[r], qsl_ref[r + 1] - qsl_ref[r]
        lo, hi = lo_ref[r], hi_ref[r]
        first, last = start + qb * block_q, start + jnp.minimum((qb + 1) * block_q, qlen)
        block = functools.partial(_block, ids, qsl_ref, lens_ref, q_ref, knope_ref, kpe_ref, v_ref, out_ref, None,
                                  sm_scale=sm_scale, nope=nope, block_q=block_q, block_k=block_k,
                                  span=(lo, hi))  # fmt: skip
        pl.when((qb * block_q < qlen) & ((first < lo) | (last > hi)))(block)

    @pl.when(r == num_reqs)
    def _padding():  # rows [qsl[R], T), block_q at a time, this program every num_programs(1)-th block
        num_tokens, dv = out_ref.shape[0], out_ref.shape[2]
        first = qsl_ref[num_reqs] + qb * block_q
        stride = pl.num_programs(1) * block_q
        zeros = jnp.zeros((block_q, dv), out_ref.dtype)
        dvv = jnp.arange(dv, dtype=jnp.int32)[None, :]

        def store(k, _):
            rows = first + k * stride + jnp.arange(block_q, dtype=jnp.int32)
            rows_c = jnp.minimum(rows, num_tokens - 1)[:, None]
            plgpu.store(out_ref.at[rows_c, h, dvv], zeros, mask=(rows < num_tokens)[:, None])

        jax.lax.fori_loop(0, jnp.maximum(num_tokens - first + stride - 1, 0) // stride, store, None)


def _block(ids, qsl_ref, lens_ref, q_ref, knope_ref, kpe_ref, v_ref, out_ref, lse_ref, *, sm_scale, nope, block_q,
           block_k, span=None):  # fmt: skip
    """The q-block ``ids`` = (request, q-block, head); ``span`` (lo, hi): store only rows outside it."""
    r, qb, h = ids
    num_tokens = q_ref.shape[0]
    rope, dv = kpe_ref.shape[2], v_ref.shape[3]
    start, qlen, kv_len = qsl_ref[r], qsl_ref[r + 1] - qsl_ref[r], lens_ref[r]
    i = qb * block_q + jnp.arange(block_q, dtype=jnp.int32)
    row_ok = i < qlen
    tok = jnp.where(row_ok, start + i, num_tokens)  # the spare row for rows past the request
    tok_c = jnp.minimum(tok, num_tokens - 1)
    dn = jnp.arange(nope, dtype=jnp.int32)[None, :]
    dr = jnp.arange(rope, dtype=jnp.int32)[None, :]
    dvv = jnp.arange(dv, dtype=jnp.int32)[None, :]
    q_nope = plgpu.load(q_ref.at[tok_c[:, None], h, dn], mask=row_ok[:, None], other=0.0)
    q_pe = plgpu.load(q_ref.at[tok_c[:, None], h, nope + dr], mask=row_ok[:, None], other=0.0)
    precision = jax.lax.Precision.HIGHEST if q_nope.dtype == jnp.float32 else None
    dims = (((1,), (1,)), ((), ()))
    pos = kv_len - qlen + i  # i32[block_q]
    hi = jnp.minimum(kv_len, kv_len - qlen + jnp.minimum((qb + 1) * block_q, qlen))  # causal limit of the block
    hi = jnp.where(qb * block_q < qlen, hi, 0)

    def body(t, state, masked: bool):
        m, denom, acc = state
        j = t * block_k + jnp.arange(block_k, dtype=jnp.int32)
        jc = jnp.minimum(j, knope_ref.shape[1] - 1)[:, None]
        ok = j < hi
        load = functools.partial(plgpu.load, mask=ok[:, None], other=0.0) if masked else plgpu.load
        k_nope = load(knope_ref.at[r, jc, h, dn])
        k_pe = load(kpe_ref.at[r, jc, dr])
        v = load(v_ref.at[r, jc, h, dvv])
        s = jax.lax.dot_general(q_nope, k_nope, dims, precision=precision, preferred_element_type=jnp.float32)
        s += jax.lax.dot_general(q_pe, k_pe, dims, precision=precision, preferred_element_type=jnp.float32)
        s = s * sm_scale
        if masked:
            visible = ok[None, :] & (j[None, :] <= pos[:, None]) & row_ok[:, None]
            s = jnp.where(visible, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        if masked:
            p = jnp.where(visible, p, 0.0)
        pv = jax.lax.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
        return m_new, alpha * denom + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    state = (
        jnp.full((block_q,), MASK_VALUE, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
        jnp.zeros((block_q, dv), jnp.float32),
    )
    # Tiles [0, full) lie at or before the block's first row's position: every row sees every
    # key (rows past the request are never stored). A block of only such rows has hi = 0.
    num_tiles = (hi + block_k - 1) // block_k
    full = jnp.clip((kv_len - qlen + qb * block_q + 1) // block_k, 0, num_tiles)
    state = jax.lax.fori_loop(0, full, functools.partial(body, masked=False), state)
    m, denom, acc = jax.lax.fori_loop(full, num_tiles, functools.partial(body, masked=True), state)
    empty = denom == 0
    out = jnp.where(empty[:, None], 0.0, acc / jnp.where(empty, 1.0, denom)[:, None])
    if span is not None:
        mine = row_ok & ((start + i < span[0]) | (start + i >= span[1]))
        plgpu.store(out_ref.at[tok_c[:, None], h, dvv], out.astype(out_ref.dtype), mask=mine[:, None])
        return
    plgpu.store(out_ref.at[tok[:, None], h, dvv], out.astype(out_ref.dtype))
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, denom)))
    plgpu.store(lse_ref.at[tok, h], lse)


def mla_prefill(
    q,  # f[T, H, nope + Rope]
    kv_cache,  # [P, S, C + Rope]
    w_uk,  # f[C, H, nope]
    w_uv,  # f[C, H, Dv]
    query_start_loc,  # i32[R + 1]
    seq_lens,  # i32[R]
    block_tables,  # i32[R, pages_per_req]
    *,
    sm_scale: float,
    kv_lora_rank: int,
    q_block: int,
    k_scale=None,
    return_lse: bool = False,
    interpret: bool | None = None,
    block_q: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
):
    """``dense.mla_prefill_dense``'s contract (causal) with the attention in a Pallas GPU kernel;
    ``q_block`` (static) covers the longest query. ``interpret=None``: compiled on a GPU.
    Returns out f[T, H, Dv] (and with ``return_lse`` lse f32[T, H], -inf for rows that see nothing)."""
    validate_prefill(q, kv_cache, w_uk, w_uv, query_start_loc, seq_lens, block_tables, sm_scale=sm_scale,
                     kv_lora_rank=kv_lora_rank, k_scale=k_scale, block_q=block_q, block_k=block_k)  # fmt: skip
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    out, lse = _prefill(
        q, kv_cache, w_uk, w_uv, jnp.asarray(query_start_loc), jnp.asarray(seq_lens), jnp.asarray(block_tables),
        None if k_scale is None else jnp.asarray(k_scale, jnp.float32), sm_scale=float(sm_scale),
        kv_lora_rank=int(kv_lora_rank), q_block=int(q_block), block_q=block_q, block_k=block_k,
        num_warps=num_warps, num_stages=num_stages, interpret=bool(interpret),
    )  # fmt: skip
    return (out, lse) if return_lse else out


def validate_prefill(q, kv_cache, w_uk, w_uv, query_start_loc, seq_lens, block_tables, *, sm_scale, kv_lora_rank,
                     k_scale, block_q, block_k) -> None:  # fmt: skip
    """The op's checks (and the dynamic ones when the metadata is concrete), and this kernel's:
    power-of-two head parts and blocks of at least 16."""
    static_validate_prefill(
        q, kv_cache, w_uk, w_uv, query_start_loc, seq_lens, block_tables, sm_scale=sm_scale, kv_lora_rank=kv_lora_rank
    )
    check_scale(kv_cache, k_scale)
    nope, dv = w_uk.shape[2], w_uv.shape[2]
    rope = kv_cache.shape[2] - kv_lora_rank
    for name, value in (("qk_nope_head_dim", nope), ("qk_rope_head_dim", rope), ("v_head_dim", dv),
                        ("block_q", block_q), ("block_k", block_k)):  # fmt: skip
        if not is_pow2(value) or value < 16:
            raise ValueError(f"{name}={value} must be a power of two >= 16 for the Triton MLA prefill kernel")
    num_blocks, block_size, _ = kv_cache.shape
    if is_concrete(query_start_loc, seq_lens, block_tables):
        dynamic_validate(seq_lens, block_tables, num_blocks=num_blocks, block_size=block_size,
                         query_start_loc=query_start_loc)  # fmt: skip


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "kv_lora_rank", "q_block", "block_q", "block_k", "num_warps", "num_stages",
                     "interpret"),
)  # fmt: skip
def _prefill(q, kv_cache, w_uk, w_uv, qsl, lens, tables, k_scale, *, sm_scale, kv_lora_rank, q_block, block_q,
             block_k, num_warps, num_stages, interpret):  # fmt: skip
    k_nope, k_pe, v = up_project(kv_cache, w_uk, w_uv, lens, tables, k_scale, kv_lora_rank=kv_lora_rank, dtype=q.dtype)
    out, lse = attend(q, k_nope, k_pe, v, qsl, lens, sm_scale=sm_scale, q_block=q_block, block_q=block_q,
                      block_k=block_k, num_warps=num_warps, num_stages=num_stages, interpret=interpret)  # fmt: skip
    owned = jnp.arange(q.shape[0]) < qsl[-1]
    return zero_unowned_rows(out, qsl, q.shape[0]), jnp.where(owned[:, None], lse[: q.shape[0]], -jnp.inf)


def up_project(kv_cache, w_uk, w_uv, lens, tables, k_scale, *, kv_lora_rank: int, dtype):
    """Each request's latents gathered from the cache (slots past its length zeroed: they may
    hold NaN) and up-projected: (k_nope f[R, L, H, nope], k_pe f[R, L, rope], v f[R, L, H, Dv]),
    ``L = pages_per_req * block_size``, in ``dtype``."""
    num_blocks, block_size, width = kv_cache.shape
    num_reqs, pages_per_req = tables.shape
    max_len = pages_per_req * block_size
    pages = jnp.clip(tables, 0, num_blocks - 1)
    latent = dequantize_from_cache(kv_cache[pages], k_scale, dtype).reshape(num_reqs, max_len, width)
    in_ctx = jnp.arange(max_len)[None, :, None] < lens[:, None, None]
    latent = jnp.where(in_ctx, latent, jnp.zeros((), dtype))  # unused slots may be NaN
    c_kv, k_pe = latent[..., :kv_lora_rank], latent[..., kv_lora_rank:]
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    k_nope = jnp.einsum("rlc,chd->rlhd", c_kv, w_uk.astype(dtype), precision=precision).astype(dtype)
    v = jnp.einsum("rlc,chd->rlhd", c_kv, w_uv.astype(dtype), precision=precision).astype(dtype)
    return k_nope, k_pe, v


def attend(q, k_nope, k_pe, v, qsl, lens, *, sm_scale, q_block, block_q, block_k, num_warps, num_stages, interpret,
           spans=None, out_init=None):  # fmt: skip
    """The kernel over up-projected keys and values: (out f[T + 1, H, Dv], lse f32[T + 1, H]),
    row T a spare; with ``spans`` (i32[R] lo, i32[R] hi) and ``out_init`` f[T, H, Dv] (another
    kernel's rows), only the rows outside the spans, and zeros in the rows no request owns, are
    written into ``out_init``, which is returned."""
    num_tokens, num_heads, _ = q.shape
    num_reqs, dv = k_nope.shape[0], v.shape[3]
    rest = spans is not None
    kernel = functools.partial(_kernel, sm_scale=sm_scale, nope=k_nope.shape[3], block_q=block_q, block_k=block_k,
                               rest=rest)  # fmt: skip
    out_shape = (
        jax.ShapeDtypeStruct((num_tokens + 1, num_heads, dv), q.dtype),  # + the spare row
        jax.ShapeDtypeStruct((num_tokens + 1, num_heads), jnp.float32),
    )
    inputs = (qsl, lens, q, k_nope, k_pe, v)
    if rest:
        out_shape, inputs = jax.ShapeDtypeStruct(out_init.shape, out_init.dtype), (*inputs, *spans, out_init)
    return pl.pallas_call(
        kernel,
        grid=(num_reqs + rest, pl.cdiv(q_block, block_q), num_heads),  # rest: + the padding rows' programs
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        input_output_aliases={8: 0} if rest else {},
        name="mla_prefill_pallas_triton",
    )(*inputs)


def zero_unowned_rows(out, qsl, num_tokens: int):
    """``out[:num_tokens]`` with the rows no request owns (padding: never written) zeroed."""
    owned = jnp.arange(num_tokens) < qsl[-1]
    return jnp.where(owned[:, None, None], out[:num_tokens], jnp.zeros((), out.dtype))
