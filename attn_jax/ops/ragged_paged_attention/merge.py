"""Merging two partial attentions of the same query rows by their log-sum-exp (vLLM's
``merge_attn_states``): cascade attention's shared prefix and per-request suffix, or any
split of a row's keys into two disjoint sets."""

from __future__ import annotations

import jax.numpy as jnp


def merge_attn_states(
    out_a,  # f[T, Hq, D]: attention over key set A, normalised over A
    lse_a,  # f32[T, Hq]: log of A's softmax denominator; -inf (or +inf, vLLM's marker) = A is empty
    out_b,  # f[T, Hq, D]: the same rows over key set B, disjoint from A
    lse_b,  # f32[T, Hq]
):
    """(out f[T, Hq, D] in out_a's dtype, lse f32[T, Hq]): the attention over A and B together.

    ``out = (out_a * exp(lse_a - m) + out_b * exp(lse_b - m)) / (exp(lse_a - m) + exp(lse_b - m))``
    with ``m = max(lse_a, lse_b)``, and ``lse = m + log(...)``: exactly what one softmax over
    both key sets gives. As in vLLM an infinite LSE marks an empty part (its output is not
    read); a row empty in both parts gets zeros and LSE -inf.

    Example::

        out, lse = merge_attn_states(prefix_out, prefix_lse, suffix_out, suffix_lse)
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or lse_a.shape != out_a.shape[:2]:
        raise ValueError(
            f"merge_attn_states needs out_a.shape == out_b.shape = [T, Hq, D] and lse shapes [T, Hq]: "
            f"got out_a {out_a.shape}, lse_a {lse_a.shape}, out_b {out_b.shape}, lse_b {lse_b.shape}"
        )
    lse_a = jnp.asarray(lse_a, jnp.float32)
    lse_b = jnp.asarray(lse_b, jnp.float32)
    lse_a = jnp.where(jnp.isinf(lse_a), -jnp.inf, lse_a)
    lse_b = jnp.where(jnp.isinf(lse_b), -jnp.inf, lse_b)
    m = jnp.maximum(lse_a, lse_b)
    empty = jnp.isneginf(m)
    m_safe = jnp.where(empty, 0.0, m)
    w_a = jnp.exp(lse_a - m_safe)  # 0 for an empty part
    w_b = jnp.exp(lse_b - m_safe)
    total = w_a + w_b
    scale = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, total))
    a = jnp.where((w_a > 0)[..., None], out_a.astype(jnp.float32), 0.0)  # an empty part's rows are not read
    b = jnp.where((w_b > 0)[..., None], out_b.astype(jnp.float32), 0.0)
    out = (a * (w_a * scale)[..., None] + b * (w_b * scale)[..., None]).astype(out_a.dtype)
    lse = jnp.where(empty, -jnp.inf, m_safe + jnp.log(jnp.where(empty, 1.0, total)))
    return out, lse
