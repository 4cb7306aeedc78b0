"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache, in pure jnp.

The specification the MLA kernels are tested against; clear, not fast. The cache
``kv_cache`` is ``[P, S, C + R]``: per token one row, ``c_kv`` (``C = kv_lora_rank``, e.g.
512) then the rotary key ``k_pe`` (``R = qk_rope_head_dim``, e.g. 64), shared by all heads.

- ``mla_decode``: the weight-absorbed form. Each request's one query row per head is
  ``[q_nope @ W_UK | q_pe]`` (C + R wide); it attends to the request's whole context (MQA
  over the shared key ``[c_kv | k_pe]``) and the value is ``c_kv``: out f[R, H, C], which the
  caller multiplies by ``W_UV``.
- ``mla_prefill``: the up-projected form. Keys ``[c_kv @ W_UK | k_pe]`` (nope + R) and values
  ``c_kv @ W_UV`` per head, ordinary causal attention over ragged requests whose context
  (earlier tokens and the new ones) is in the cache: out f[T, H, v_head_dim].

Both optionally return the log-sum-exp f32 per (row, head) (natural log of the softmax
denominator of the scaled scores; -inf for a row that sees nothing), so partial results
merge as ``merge_attn_states`` does. Softmax and accumulation in float32; rows that see
no key give 0; unused cache slots (NaN included) never reach an output. An fp8 cache
(e4m3, e5m2) stores ``latent / k_scale``; every op on it takes ``k_scale`` (ValueError without).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn_jax.kv_cache import dequantize_from_cache, quantize_to_cache
from attn_jax.ops.mla.validate import (
    check_scale,
    dynamic_validate,
    is_concrete,
    static_validate_decode,
    static_validate_prefill,
    validate_write,
)

_HIGHEST = jax.lax.Precision.HIGHEST


def write_latent_cache(kv_cache, kv_c, k_pe, slot_mapping, *, kv_lora_rank: int, k_scale=None):
    """Returns ``kv_cache`` [P, S, C + R] with token t's ``[kv_c[t] | k_pe[t]]`` at flat slot
    ``slot_mapping[t]`` (page ``slot // S``, offset ``slot % S``); slot -1 writes nothing.

    kv_c f[T, C] (already normalised: ``kv_a_layernorm``), k_pe f[T, R] (already rotated).
    Cast to the cache dtype (fp8: ``latent / k_scale``, clipped); a scatter, in place under
    ``jit`` with the cache donated.
    """
    validate_write(kv_cache, kv_c, k_pe, slot_mapping, kv_lora_rank=kv_lora_rank, k_scale=k_scale)
    num_blocks, block_size, width = kv_cache.shape
    num_slots = num_blocks * block_size
    rows = quantize_to_cache(jnp.concatenate([kv_c, k_pe], axis=-1), kv_cache.dtype, k_scale)  # [T, C + R]
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)  # out of range: dropped
    flat = jnp.asarray(kv_cache).reshape(num_slots, width).at[slots].set(rows, mode="drop")
    return flat.reshape(kv_cache.shape)


def softmax_rows(s, visible, values):
    """s f32[..., H, L] scores, visible bool broadcastable to s, values f32[..., L, Dv] (masked
    rows already zero). Returns (out f32[..., H, Dv], lse f32[..., H])."""
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m[..., None])  # exactly 0 where masked
    denom = jnp.sum(p, axis=-1)
    out = jnp.einsum("...hl,...ld->...hd", p, values, precision=_HIGHEST)
    empty = denom == 0
    out = jnp.where(empty[..., None], 0.0, out / jnp.where(empty, 1.0, denom)[..., None])
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, denom)))
    return out, lse


def fold_fp8_scale(q, kv_cache, k_scale):
    """(q, out_scale) for a kernel that reads raw cache entries: with an fp8 cache,
    ``q . (c * k_scale) = (q * k_scale) . c`` and ``sum p (c * k_scale) = k_scale * sum p c``,
    so the kernel takes ``q * k_scale`` and its output is multiplied by ``out_scale``."""
    check_scale(kv_cache, k_scale)
    if jnp.dtype(kv_cache.dtype).itemsize != 1:
        return q, None
    scale = jnp.asarray(k_scale, jnp.float32).reshape(())
    return (q.astype(jnp.float32) * scale).astype(q.dtype), scale


def mla_decode(
    q,  # f[R, H, C + Rope]: [q_nope @ W_UK | q_pe] of each request's one decode token
    kv_cache,  # [P, S, C + Rope]
    seq_lens,  # i32[R]: context length including the new token (0 = padding request)
    block_tables,  # i32[R, pages_per_req]
    *,
    sm_scale: float,
    kv_lora_rank: int,
    return_lse: bool = False,
    k_scale=None,  # f32[] | None: required for fp8 caches (they store latent / k_scale)
):
    """Absorbed MLA decode (MQA over the latent). Returns out f[R, H, C] in q's dtype, and
    with ``return_lse`` also lse f32[R, H].

    Request r's query attends to cached positions ``j < seq_lens[r]`` with scores
    ``sm_scale * q . [c_kv | k_pe]`` and values ``c_kv``.

    Example::

        out = mla_decode(q, kv_cache, seq_lens, block_tables, sm_scale=192**-0.5, kv_lora_rank=512)
    """
    static_validate_decode(q, kv_cache, seq_lens, block_tables, sm_scale=sm_scale, kv_lora_rank=kv_lora_rank)
    check_scale(kv_cache, k_scale)
    num_blocks, block_size, width = kv_cache.shape
    if is_concrete(seq_lens, block_tables):
        dynamic_validate(seq_lens, block_tables, num_blocks=num_blocks, block_size=block_size)
    num_reqs, pages_per_req = block_tables.shape
    max_len = pages_per_req * block_size
    pages = jnp.clip(jnp.asarray(block_tables), 0, num_blocks - 1)  # unused entries may hold anything
    latent = dequantize_from_cache(jnp.asarray(kv_cache)[pages], k_scale).reshape(num_reqs, max_len, width)
    visible = jnp.arange(max_len)[None, :] < jnp.asarray(seq_lens)[:, None]  # bool[R, L]
    s = jnp.einsum("rhw,rlw->rhl", q.astype(jnp.float32), latent, precision=_HIGHEST) * sm_scale
    values = jnp.where(visible[..., None], latent[..., :kv_lora_rank], 0.0)
    out, lse = softmax_rows(s, visible[:, None, :], values)
    out = out.astype(q.dtype)
    return (out, lse) if return_lse else out


def mla_prefill(
    q,  # f[T, H, nope + Rope]: [q_nope | q_pe]
    kv_cache,  # [P, S, C + Rope]
    w_uk,  # f[C, H, nope]: k_nope = c_kv @ w_uk
    w_uv,  # f[C, H, Dv]: v = c_kv @ w_uv
    query_start_loc,  # i32[R + 1]
    seq_lens,  # i32[R]
    block_tables,  # i32[R, pages_per_req]
    *,
    sm_scale: float,
    kv_lora_rank: int,
    causal: bool = True,
    return_lse: bool = False,
    k_scale=None,  # f32[] | None: required for fp8 caches
):
    """Up-projected MLA over ragged requests with cached context. Returns out f[T, H, Dv] in
    q's dtype, and with ``return_lse`` also lse f32[T, H].

    Request r owns rows ``query_start_loc[r]:query_start_loc[r+1]``, the last tokens of its
    ``seq_lens[r]``-token context (whose latents are in the cache already); the i-th sits at
    position ``p = seq_lens[r] - query_len[r] + i`` and sees ``j <= p`` (``causal``) or every
    ``j < seq_lens[r]``. Keys ``[c_kv @ w_uk | k_pe]``, values ``c_kv @ w_uv``. Rows past
    ``query_start_loc[-1]`` are padding: 0, lse -inf.

    Example::

        out = mla_prefill(q, kv_cache, w_uk, w_uv, qsl, seq_lens, block_tables,
                          sm_scale=192**-0.5, kv_lora_rank=512)
    """
    static_validate_prefill(
        q, kv_cache, w_uk, w_uv, query_start_loc, seq_lens, block_tables, sm_scale=sm_scale, kv_lora_rank=kv_lora_rank
    )
    check_scale(kv_cache, k_scale)
    num_blocks, block_size, width = kv_cache.shape
    if is_concrete(query_start_loc, seq_lens, block_tables):
        dynamic_validate(
            seq_lens, block_tables, num_blocks=num_blocks, block_size=block_size,
            query_start_loc=query_start_loc if causal else None,
        )  # fmt: skip
    num_tokens = q.shape[0]
    num_reqs, pages_per_req = block_tables.shape
    max_len = pages_per_req * block_size
    qsl, lens = jnp.asarray(query_start_loc), jnp.asarray(seq_lens)
    pages = jnp.clip(jnp.asarray(block_tables), 0, num_blocks - 1)
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    req = jnp.searchsorted(qsl[1:], rows, side="right").astype(jnp.int32)
    real = req < num_reqs
    req = jnp.minimum(req, num_reqs - 1)
    pos = lens[req] - (qsl[req + 1] - qsl[req]) + rows - qsl[req]  # i32[T]
    w_uk32, w_uv32 = w_uk.astype(jnp.float32), w_uv.astype(jnp.float32)
    nope = w_uk.shape[2]

    def one_row(args):
        q_row, r, p, is_real = args
        latent = dequantize_from_cache(jnp.asarray(kv_cache)[pages[r]], k_scale).reshape(max_len, width)
        j = jnp.arange(max_len)
        visible = is_real & (j < lens[r])
        if causal:
            visible &= j <= p
        c_kv = jnp.where(visible[:, None], latent[:, :kv_lora_rank], 0.0)
        k_nope = jnp.einsum("lc,chd->hld", c_kv, w_uk32, precision=_HIGHEST)  # f32[H, L, nope]
        values = jnp.einsum("lc,chd->hld", c_kv, w_uv32, precision=_HIGHEST)  # f32[H, L, Dv]
        q32 = q_row.astype(jnp.float32)
        s = jnp.einsum("hd,hld->hl", q32[:, :nope], k_nope, precision=_HIGHEST)
        s = s + jnp.einsum("hd,ld->hl", q32[:, nope:], latent[:, kv_lora_rank:], precision=_HIGHEST)
        out, lse = softmax_rows(s[:, None, :] * sm_scale, visible[None, None, :], values)
        return out[:, 0], lse[:, 0]

    out, lse = jax.lax.map(one_row, (q, req, pos, real))
    out = out.astype(q.dtype)
    return (out, lse) if return_lse else out
