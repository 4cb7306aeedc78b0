"""Token selection inside the jitted step: greedy, or seeded temperature / top-k / top-p.

Each row draws with its own key, ``fold_in(PRNGKey(seed), index)`` where ``index`` is the
number of tokens the request has generated so far, so a seeded request gives the same
tokens whatever else shares its batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample_tokens(logits, temperature, top_p, top_k, seeds, counters):
    """Next token per row.

    Args:
      logits: f32[N, V].
      temperature: f32[N]; 0 = greedy (argmax) for that row.
      top_p: f32[N] in (0, 1]; keeps the smallest set of most likely tokens whose
        probability reaches top_p (Hugging Face's rule: the most likely token always stays).
      top_k: i32[N]; 0 = off, else keeps the k most likely tokens.
      seeds: u32[N]; counters: i32[N] (tokens generated so far).

    Returns i32[N].
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    vocab = logits.shape[-1]
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    order = jnp.argsort(-scaled, axis=-1)  # i32[N, V], most likely first
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab, dtype=jnp.int32)[None, :]
    keep = jnp.where(top_k[:, None] > 0, rank < top_k[:, None], True)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the more likely tokens
    keep &= (before < top_p[:, None]) | (rank == 0)
    filtered = jnp.where(keep, sorted_logits, -jnp.inf)

    def draw(seed, counter, row):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), counter)
        return jax.random.categorical(key, row)

    choice = jax.vmap(draw)(seeds, counters, filtered)  # index into the sorted order
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)
