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
- for sampled rows, the top-k and top-p thresholds of the tempered logits without a sort
  (a sort of the vocabulary was most of a decode step's device time: BENCHMARKS.md): each an exact bisection over the values' ordered 32-bit keys (32 masked
  reductions), the kept set every token at or above them, and a categorical (Gumbel-max)
  draw over it. Ties at the k-th value all stay (a sort would keep some of them).

The same program gives every row's log-probabilities (OpenAI's ``logprobs``; vLLM's
default "raw" mode): the chosen token's and the ``MAX_LOGPROBS`` most likely tokens', from
the model's logits before temperature and filters (``top_logprobs``: block maxima, then two
small top-k's).

Each row draws with its own key, ``fold_in(PRNGKey(seed), index)`` where ``index`` is the
number of tokens the request has generated so far, so a seeded request gives the same
tokens whatever else shares its batches.

Penalties (``apply_penalties``; vLLM's and OpenAI's semantics) change a row's logits before
all of the above, so a greedy row's argmax is the penalized logits' and its log-probabilities
are the penalized logits' (before temperature and filters); a row without penalties gets its
logits back bit for bit. They read each row's token counts, which the model runner keeps on
the device (``ModelRunner``: one i32[V] row per request slot, updated inside the step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MAX_LOGPROBS = 20
"""The most alternatives a request may ask log-probabilities of (OpenAI's ``top_logprobs``)."""


PROMPT_SEEN = 1 << 30
"""``apply_penalties``' counts: a token's count is its generated occurrences, plus this flag
when the request's prompt holds it (generated counts stay far below it)."""


def apply_penalties(logits, counts, presence, frequency, repetition):
    """The logits after vLLM's penalties (traceable; the values are data: one program).

    For a token seen in the prompt or the output (repetition, Keskar et al.'s CTRL rule): its
    logit divided by ``repetition`` when positive, multiplied by it otherwise. Then for the
    tokens generated so far: ``logit -= frequency * count + presence * (count > 0)``
    (OpenAI's presence and frequency penalties, over the output only).

    Args:
      logits: f32[N, V], the model's.
      counts: i32[N, V]: each row's generated count of each token, plus ``PROMPT_SEEN`` where
        its prompt holds the token.
      presence, frequency: f32[N], 0 = off (the API allows [-2, 2]).
      repetition: f32[N] > 0, 1 = off.

    Returns f32[N, V]; a row whose penalties are off is its logits unchanged (exactly).
    """
    generated = (counts & (PROMPT_SEEN - 1)).astype(logits.dtype)
    factor = jnp.where(counts != 0, repetition[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / factor, logits * factor)
    logits = logits - frequency[:, None] * generated
    return logits - presence[:, None] * (generated > 0).astype(logits.dtype)


def _ordered(x):
    """u32 keys in the order of the f32 values ``x`` (IEEE bits, the negatives' flipped)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _largest_key(holds, lo, hi):
    """Per row, the largest u32 key ``t`` in [lo, hi] for which ``holds(t)`` (bool[N]) is
    true, where ``holds`` is true at ``lo`` and monotone (true, then false, as ``t``
    grows): an exact bisection of 32 halvings (a loop of known trip count: on a GPU it
    reads no predicate back to the host)."""

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2 + ((hi - lo) & 1)  # ceil of the midpoint, without overflow
        ok = holds(mid) & (mid > lo)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, jnp.where(mid > lo, mid - 1, lo))

    return jax.lax.fori_loop(0, 32, halve, (lo, hi))[0]


def top_logprobs(logits, log_z, block: int = 128):
    """The L = min(``MAX_LOGPROBS``, V) most likely tokens of each row, most likely first,
    and their log-probabilities (f32[N, V] logits, f32[N, 1] their log-sum-exp), without a
    sort of the vocabulary: the top L tokens lie in the L blocks of ``block`` tokens with
    the largest maxima, so two small top-k's (over the block maxima, then over those L
    blocks' tokens) find them exactly. Returns (i32[N, L], f32[N, L])."""
    n, v = logits.shape
    count = min(MAX_LOGPROBS, v)
    blocks = -(-v // block)
    padded = jnp.pad(logits, [(0, 0), (0, blocks * block - v)], constant_values=-jnp.inf)
    tiles = padded.reshape(n, blocks, block)
    _, best = jax.lax.top_k(tiles.max(axis=-1), min(count, blocks))  # i32[N, L]
    candidates = jnp.take_along_axis(tiles, best[:, :, None], axis=1).reshape(n, -1)
    values, at = jax.lax.top_k(candidates, count)
    ids = best[jnp.arange(n)[:, None], at // block] * block + at % block
    return ids.astype(jnp.int32), values - log_z


def sample_tokens(logits, temperature, top_p, top_k, seeds, counters):
    """Next token per row and its log-probabilities (traceable; one program whatever the
    values).

    Args:
      logits: f32[N, V] (after ``apply_penalties`` for rows with penalties: the
        log-probabilities are then the penalized logits').
      temperature: f32[N]; 0 = greedy (argmax) for that row.
      top_p: f32[N] in (0, 1]; keeps the smallest set of most likely tokens whose
        probability reaches top_p (Hugging Face's rule: the most likely token always stays).
      top_k: i32[N]; 0 = off, else keeps the k most likely tokens (every token tied with
        the k-th stays).
      seeds: u32[N]; counters: i32[N] (tokens generated so far).

    Returns (i32[N] tokens, f32[N] each token's log-probability, i32[N, L] the L =
    min(``MAX_LOGPROBS``, V) most likely tokens, f32[N, L] their log-probabilities).
    """
    n, v = logits.shape
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = temperature > 0
    scaled = logits / jnp.where(sampled, temperature, 1.0)[:, None]
    keys = _ordered(scaled)
    lowest, highest = keys.min(axis=-1), keys.max(axis=-1)
    k = jnp.where((top_k > 0) & (top_k < v), top_k, v)
    kth = _largest_key(lambda t: (keys >= t[:, None]).sum(axis=-1) >= k, lowest, highest)
    probs = jax.nn.softmax(jnp.where(keys >= kth[:, None], scaled, -jnp.inf), axis=-1)

    def mass_above(t):  # bool[N]: the kept probability strictly above key t reaches top_p
        return jnp.where(keys > t[:, None], probs, 0.0).sum(axis=-1) >= top_p

    # The nucleus: keys above the largest t whose mass above reaches top_p (from kth - 1:
    # everything kept above it, whose mass reaches top_p <= 1 unless rounding says not).
    below = _largest_key(mass_above, kth - 1, highest)
    keep = keys > jnp.where(mass_above(kth - 1), below, kth - 1)[:, None]
    rng = jax.vmap(lambda seed, counter: jax.random.fold_in(jax.random.PRNGKey(seed), counter))(seeds, counters)
    drawn = jax.vmap(jax.random.categorical)(rng, jnp.where(keep, scaled, -jnp.inf)).astype(jnp.int32)
    tokens = jnp.where(sampled, drawn, greedy)
    log_z = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    top_ids, top_values = top_logprobs(logits, log_z)
    logprobs = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - log_z[:, 0]
    return tokens, logprobs, top_ids, top_values


def prompt_logprobs(logits, targets):
    """Each row's log-probability of ``targets`` and of its ``MAX_LOGPROBS`` most likely
    tokens, from the float32 log-softmax of ``logits`` (no penalties, no temperature: vLLM's
    prompt logprobs). Traceable.

    Args:
      logits: f[T, V], the model's at every token row of a prefill.
      targets: i32[T], each row's next prompt token (the one whose log-probability is wanted).

    Returns (f32[T] the targets' log-probabilities, i32[T, L] the L = min(``MAX_LOGPROBS``, V)
    most likely tokens, most likely first, f32[T, L] their log-probabilities).
    """
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top, ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, logits.shape[-1]))
    chosen = jnp.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
    return chosen, ids.astype(jnp.int32), top


def apply_guides(logits, masks, rows):
    """The logits with the tokens a row's output grammar forbids at -inf (structured
    outputs, ``structured_output.py``); traceable, the masks data.

    Args:
      logits: f32[N, V].
      masks: i32[S, W], W = ceil(V / 32): the device's mask table, a row per guided request
        (bit ``t % 32`` of word ``t // 32`` set: token t allowed).
      rows: i32[N], each row's mask row; -1: not guided.

    Returns f32[N, V]; a row that is not guided is its logits unchanged (exactly).
    """
    words = masks[jnp.maximum(rows, 0)]  # i32[N, W]
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(words.shape[0], -1)[:, : logits.shape[-1]] == 1
    return jnp.where(allowed | (rows < 0)[:, None], logits, -jnp.inf)
