"""A float64 NumPy oracle for multi-head latent attention, independent of the jnp reference.

Dense per-request latents (no pages), explicit loops over requests and query rows, and the
up-projection written out per head, so it shares no code or indexing with the op.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _attend(scores: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, float]:
    """scores f64[L] (already scaled, only visible keys), values f64[L, Dv] -> (out, lse)."""
    if scores.size == 0:
        return np.zeros(values.shape[1]), -np.inf
    m = scores.max()
    p = np.exp(scores - m)
    return p @ values / p.sum(), m + np.log(p.sum())


def mla_decode_oracle(q, latents: Sequence[np.ndarray], *, kv_lora_rank: int, sm_scale: float):
    """q f[R, H, C + Rope]; latents R x f[L_r, C + Rope] -> (out f64[R, H, C], lse f64[R, H])."""
    q = np.asarray(q, np.float64)
    num_reqs, num_heads, _ = q.shape
    out = np.zeros((num_reqs, num_heads, kv_lora_rank))
    lse = np.full((num_reqs, num_heads), -np.inf)
    for r, lat in enumerate(latents):
        lat = np.asarray(lat, np.float64)
        for h in range(num_heads):
            scores = np.array([sm_scale * float(q[r, h] @ lat[j]) for j in range(len(lat))])
            out[r, h], lse[r, h] = _attend(scores, lat[:, :kv_lora_rank])
    return out, lse


def mla_prefill_oracle(
    q, latents: Sequence[np.ndarray], w_uk, w_uv, query_lens: Sequence[int], *, sm_scale: float, causal: bool = True
):
    """q f[>= sum(query_lens), H, nope + Rope]; latents R x f[L_r, C + Rope] (context then new);
    w_uk f[C, H, nope]; w_uv f[C, H, Dv] -> (out f64[T, H, Dv], lse f64[T, H]); rows past the
    real tokens are 0 / -inf."""
    q, w_uk, w_uv = (np.asarray(x, np.float64) for x in (q, w_uk, w_uv))
    kv_lora_rank, num_heads, nope = w_uk.shape
    out = np.zeros((q.shape[0], num_heads, w_uv.shape[2]))
    lse = np.full((q.shape[0], num_heads), -np.inf)
    row = 0
    for lat, qlen in zip(latents, query_lens, strict=True):
        lat = np.asarray(lat, np.float64)
        seq_len = len(lat)
        c_kv, k_pe = lat[:, :kv_lora_rank], lat[:, kv_lora_rank:]
        for i in range(qlen):
            pos = seq_len - qlen + i
            n = pos + 1 if causal else seq_len
            for h in range(num_heads):
                k = np.concatenate([c_kv[:n] @ w_uk[:, h, :], k_pe[:n]], axis=1)  # [n, nope + Rope]
                v = c_kv[:n] @ w_uv[:, h, :]
                out[row, h], lse[row, h] = _attend(sm_scale * (k @ q[row, h]), v)
            row += 1
    return out, lse


def sparse_mla_oracle(q, latents: Sequence[np.ndarray], topk, query_lens: Sequence[int], *, kv_lora_rank: int,
                      sm_scale: float):  # fmt: skip
    """q f[T, H, C + Rope]; topk i[T, K] positions (-1 skipped) -> (out f64[T, H, C], lse f64[T, H])."""
    q = np.asarray(q, np.float64)
    out = np.zeros((q.shape[0], q.shape[1], kv_lora_rank))
    lse = np.full(q.shape[:2], -np.inf)
    row = 0
    for lat, qlen in zip(latents, query_lens, strict=True):
        lat = np.asarray(lat, np.float64)
        for _ in range(qlen):
            chosen = lat[[int(s) for s in topk[row] if s >= 0]]
            for h in range(q.shape[1]):
                out[row, h], lse[row, h] = _attend(sm_scale * (chosen @ q[row, h]), chosen[:, :kv_lora_rank])
            row += 1
    return out, lse


def indexer_oracle(q_idx, weights, keys: Sequence[np.ndarray], query_lens: Sequence[int], *, topk: int):
    """Per real token, the set of its top-k visible positions by sum_j w_j relu(q_j . k_s)."""
    q_idx, weights = np.asarray(q_idx, np.float64), np.asarray(weights, np.float64)
    result, row = [], 0
    for k, qlen in zip(keys, query_lens, strict=True):
        k = np.asarray(k, np.float64)
        for i in range(qlen):
            p = len(k) - qlen + i
            scores = np.array([sum(weights[row, j] * max(q_idx[row, j] @ k[s], 0.0) for j in range(len(weights[row])))
                               for s in range(p + 1)])  # fmt: skip
            result.append(set(np.argsort(-scores, kind="stable")[:topk].tolist()))
            row += 1
    return result


def check_deepseek_decode(decode, *, num_heads: int, block_size: int) -> None:
    """Calls ``decode(q, kv_cache, seq_lens, block_tables, sm_scale=..., kv_lora_rank=512,
    return_lse=True)`` (a compiled GPU kernel) on a bf16 batch of DeepSeek's latent (512 + 64)
    whose requests hold one key, 700, none, 2049 and 64 (the pages past each length NaN), and
    checks its output and LSE against the oracle."""
    import jax.numpy as jnp

    from attn_jax.testing.mla import make_mla_batch

    b = make_mla_batch(6, seq_lens=[1, 700, 0, 2049, 64], num_heads=num_heads, kv_lora_rank=512, rope_dim=64,
                       block_size=block_size, dtype=jnp.bfloat16)  # fmt: skip
    scale = 192**-0.5
    out, lse = decode(b.q_decode, b.kv_cache, b.seq_lens, b.block_tables, sm_scale=scale, kv_lora_rank=512,
                      return_lse=True)  # fmt: skip
    want, want_lse = mla_decode_oracle(np.asarray(b.q_decode.astype(jnp.float32)), b.latents, kv_lora_rank=512,
                                       sm_scale=scale)  # fmt: skip
    assert out.shape == want.shape and out.dtype == jnp.bfloat16
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=5e-2, rtol=1e-3)
