"""Token selection inside the jitted step: greedy, or seeded temperature / top-k / top-p.

Each row draws with its own key, ``fold_in(PRNGKey(seed), index)`` where ``index`` is the
number of tokens the request has generated so far, so a seeded request gives the same
tokens whatever else shares its batches.

The work is sized on the host, per step, by ``num_candidates`` (static: part of the jit
key): 0 when every row is greedy (an argmax, nothing else), else the number of most
likely tokens ``lax.top_k`` keeps for the filtered rows. Nothing sorts the vocabulary
unless a row asks for top-p without top-k (then ``num_candidates`` is the vocabulary).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def num_candidates_for(temperature: np.ndarray, top_p: np.ndarray, top_k: np.ndarray, vocab_size: int) -> int:
    """The static candidate count of a step from its rows' f32[N] temperature, f32[N] top_p
    and i32[N] top_k: 0 if all are greedy; the vocabulary if a sampled row filters by
    top-p alone; else the power of two >= the largest top-k (1 when none filters)."""
    sampled = temperature > 0
    if not sampled.any():
        return 0
    if (sampled & (top_k == 0) & (top_p < 1)).any():
        return vocab_size
    largest = int(top_k[sampled].max(initial=1))
    return min(1 << max(largest - 1, 0).bit_length(), vocab_size)


def sample_tokens(logits, temperature, top_p, top_k, seeds, counters, *, num_candidates: int):
    """Next token per row.

    Args:
      logits: f32[N, V].
      temperature: f32[N]; 0 = greedy (argmax) for that row.
      top_p: f32[N] in (0, 1]; keeps the smallest set of most likely tokens whose
        probability reaches top_p (Hugging Face's rule: the most likely token always stays).
      top_k: i32[N]; 0 = off, else keeps the k most likely tokens.
      seeds: u32[N]; counters: i32[N] (tokens generated so far).
      num_candidates: static; ``num_candidates_for`` of these rows.

    Returns i32[N].
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if num_candidates == 0:
        return greedy
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    keys = jax.vmap(lambda seed, counter: jax.random.fold_in(jax.random.PRNGKey(seed), counter))(seeds, counters)
    unfiltered = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)

    values, order = jax.lax.top_k(scaled, num_candidates)  # f32[N, K], i32[N, K]: most likely first
    rank = jnp.arange(num_candidates, dtype=jnp.int32)[None, :]
    keep = jnp.where(top_k[:, None] > 0, rank < top_k[:, None], True)
    probs = jax.nn.softmax(jnp.where(keep, values, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the more likely tokens
    keep &= (before < top_p[:, None]) | (rank == 0)
    choice = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, values, -jnp.inf))
    filtered = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)

    sampled = jnp.where((top_k == 0) & (top_p >= 1), unfiltered, filtered)
    return jnp.where(temperature > 0, sampled, greedy)
