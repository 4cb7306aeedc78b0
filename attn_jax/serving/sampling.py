"""Token selection inside the jitted step: greedy, or seeded temperature / top-k / top-p,
one program for every mix of values.

Sampling parameters are per-row data (vLLM's and tpu-inference's sampling tensors), never
program structure: no value a client may send compiles anything, and nothing branches on
the device (an XLA conditional on a GPU reads its predicate back to the host: a sync per
step, which stalls the asynchronous pipeline). The one static choice is tpu-inference's
"any row samples": a step whose rows are all greedy runs an argmax alone (the model
runner's program without this function); one where any row samples computes, exactly,
for every row:

- the argmax (greedy rows, temperature 0);
- the tempered logits sorted once (most likely first; as vLLM's GPU sampler sorts them),
  the row's top-k / top-p set masked in sorted order (no filter: every token), and a
  categorical draw over it.

Each row draws with its own key, ``fold_in(PRNGKey(seed), index)`` where ``index`` is the
number of tokens the request has generated so far, so a seeded request gives the same
tokens whatever else shares its batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample_tokens(logits, temperature, top_p, top_k, seeds, counters):
    """Next token per row (traceable; one program whatever the values).

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
    sampled = temperature > 0
    scaled = logits / jnp.where(sampled, temperature, 1.0)[:, None]
    vocab = jax.lax.broadcasted_iota(jnp.int32, scaled.shape, 1)
    negated, order = jax.lax.sort((-scaled, vocab), dimension=1, num_keys=1)  # most likely first
    values = -negated  # f32[N, V]
    rank = vocab  # position in the sorted order
    keep = jnp.where(top_k[:, None] > 0, rank < top_k[:, None], True)
    probs = jax.nn.softmax(jnp.where(keep, values, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the more likely tokens
    keep &= (before < top_p[:, None]) | (rank == 0)
    keys = jax.vmap(lambda seed, counter: jax.random.fold_in(jax.random.PRNGKey(seed), counter))(seeds, counters)
    choice = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, values, -jnp.inf))
    drawn = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
    return jnp.where(sampled, drawn, greedy)
