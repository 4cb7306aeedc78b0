"""A float64 NumPy oracle for ragged paged attention, independent of the jnp reference.

It works on dense per-request keys and values (no pages, no slot mapping) with explicit
loops over requests and query tokens, so it shares no code or indexing with the op.
"""

from __future__ import annotations

from collections.abc import Sequence

import ml_dtypes
import numpy as np

_FP8 = {
    "fp8": ml_dtypes.float8_e4m3fn,
    "fp8_e4m3": ml_dtypes.float8_e4m3fn,
    "fp8_e5m2": ml_dtypes.float8_e5m2,
}
_PLAIN = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def cache_contents(x: np.ndarray, cache_dtype_str: str, scale: float | None = None) -> np.ndarray:
    """f64 of the entries a ``cache_dtype_str`` cache stores for ``x``.

    fp8: ``x / scale`` in float32, clipped to the fp8 dtype's finite range, rounded to
    fp8. "auto": ``x`` unchanged. Other dtypes: ``x`` rounded to that dtype.
    """
    x = np.asarray(x)
    if cache_dtype_str in _FP8:
        fp8 = _FP8[cache_dtype_str]
        limit = float(ml_dtypes.finfo(fp8).max)
        scaled = np.clip(x.astype(np.float32) / np.float32(scale), -limit, limit)
        return scaled.astype(fp8).astype(np.float64)
    if cache_dtype_str == "auto":
        return x.astype(np.float64)
    return x.astype(_PLAIN[cache_dtype_str]).astype(np.float64)


def fp8_ulp(x: np.ndarray, cache_dtype_str: str) -> np.ndarray:
    """f64: the spacing of the fp8 grid at ``|x|`` (subnormal spacing below the normals)."""
    info = ml_dtypes.finfo(_FP8[cache_dtype_str])
    exponent = np.floor(np.log2(np.maximum(np.abs(x), float(info.smallest_normal))))
    return 2.0 ** (exponent - info.nmant)


def assert_cache_entries_equal(actual: np.ndarray, expected: np.ndarray, cache_dtype_str: str) -> None:
    """Cache entries (f64) equal, NaN matching NaN; fp8 entries may differ by one fp8 ulp.

    fp8 rounding of ``x / scale`` is ambiguous at ties: XLA divides by a scalar as a
    multiply by its reciprocal, one float32 ulp off the true quotient, and vLLM's
    default scales put the largest key and value exactly on a tie (200 and 100 are
    midpoints of the e4m3 grid).
    """
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected), err_msg="NaN entries differ")
    if cache_dtype_str not in _FP8:
        np.testing.assert_array_equal(actual, expected)
        return
    a, e = np.nan_to_num(actual), np.nan_to_num(expected)
    ulp = np.maximum(fp8_ulp(a, cache_dtype_str), fp8_ulp(e, cache_dtype_str))
    bad = np.abs(a - e) > ulp
    assert not bad.any(), (
        f"{bad.sum()} fp8 cache entries differ by more than one ulp, first at "
        f"{np.argwhere(bad)[0].tolist()}: {a[bad][0]} vs expected {e[bad][0]}"
    )


def attention_oracle(
    q: np.ndarray,  # f[>= sum(query_lens), Hq, D]; rows past the real tokens are ignored
    k_seqs: Sequence[np.ndarray],  # R x f[seq_len_r, Hkv, D]: context then new tokens
    v_seqs: Sequence[np.ndarray],  # R x f[seq_len_r, Hkv, D]
    query_lens: Sequence[int],  # R
    *,
    sm_scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: np.ndarray | None = None,  # f[Hq]
    sinks: np.ndarray | None = None,  # f[Hq]
    attention_chunk_size: int | None = None,
    return_lse: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """f64[sum(query_lens), Hq, D]: attention of every real query row, in float64; with
    ``return_lse`` also f64[sum(query_lens), Hq], the log of each softmax denominator
    (sink included; -inf where a row sees nothing).

    With ``attention_chunk_size`` c (chunked local attention), the token at position p
    sees only positions of its own chunk, j >= (p // c) * c.
    """
    q = np.asarray(q, dtype=np.float64)
    num_q_heads, head_size = q.shape[1:]
    slopes = None if alibi_slopes is None else np.asarray(alibi_slopes, np.float64)
    sink = None if sinks is None else np.asarray(sinks, np.float64)
    out = np.zeros((int(sum(query_lens)), num_q_heads, head_size))
    lse = np.full(out.shape[:2], -np.inf)
    row = 0
    for r, query_len in enumerate(query_lens):
        keys = np.asarray(k_seqs[r], dtype=np.float64)  # [L, Hkv, D]
        values = np.asarray(v_seqs[r], dtype=np.float64)
        seq_len, num_kv_heads, _ = keys.shape
        group = num_q_heads // num_kv_heads
        for i in range(query_len):
            p = seq_len - query_len + i  # absolute position of this query token
            for h in range(num_q_heads):
                kv_h = h // group
                scores, kept = [], []
                for j in range(seq_len):
                    if causal and j > p:
                        continue
                    if sliding_window is not None and j <= p - sliding_window:
                        continue
                    if attention_chunk_size is not None and j < p // attention_chunk_size * attention_chunk_size:
                        continue
                    s = sm_scale * float(q[row, h] @ keys[j, kv_h])
                    if logits_soft_cap is not None:
                        s = logits_soft_cap * np.tanh(s / logits_soft_cap)
                    if slopes is not None:
                        s += slopes[h] * (j - p)
                    scores.append(s)
                    kept.append(j)
                logits = np.array(scores + ([] if sink is None else [sink[h]]))
                if not len(logits):
                    continue  # sees nothing: zeros, lse -inf
                weights = np.exp(logits - logits.max())
                probs = weights[: len(kept)] / weights.sum()
                out[row, h] = probs @ values[kept, kv_h]
                lse[row, h] = logits.max() + np.log(weights.sum())
            row += 1
    return (out, lse) if return_lse else out
