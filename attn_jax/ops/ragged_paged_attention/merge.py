"""Merging two partial attentions of the same query rows by their log-sum-exp (vLLM's
``merge_attn_states``): cascade attention's shared prefix and per-request suffix, or any
split of a row's keys into two disjoint sets."""

from __future__ import annotations

import functools
import operator

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
    return merge_many_attn_states((out_a, out_b), (lse_a, lse_b))


def merge_many_attn_states(outs, lses):
    """``merge_attn_states`` over any number of disjoint key sets: ``outs`` K x f[..., D] (each
    normalised over its set), ``lses`` K x f32[...] (an infinite LSE marks an empty set) ->
    (out f[..., D] in ``outs[0]``'s dtype, lse f32[...]); split-KV partials merge this way."""
    lses = [jnp.asarray(lse, jnp.float32) for lse in lses]
    lses = [jnp.where(jnp.isinf(lse), -jnp.inf, lse) for lse in lses]
    m = functools.reduce(jnp.maximum, lses)
    empty = jnp.isneginf(m)
    m_safe = jnp.where(empty, 0.0, m)
    weights = [jnp.exp(lse - m_safe) for lse in lses]  # 0 for an empty part
    total = functools.reduce(operator.add, weights)
    scale = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, total))
    parts = [  # an empty part's rows are not read
        jnp.where((w > 0)[..., None], out.astype(jnp.float32), 0.0) * (w * scale)[..., None]
        for out, w in zip(outs, weights, strict=True)
    ]
    out = functools.reduce(operator.add, parts).astype(outs[0].dtype)
    lse = jnp.where(empty, -jnp.inf, m_safe + jnp.log(jnp.where(empty, 1.0, total)))
    return out, lse
