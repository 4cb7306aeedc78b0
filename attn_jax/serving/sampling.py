"""Token selection inside the jitted step: greedy, or seeded temperature / top-k / top-p,
one program for every mix of values.

Sampling parameters are per-row data (vLLM's and tpu-inference's sampling tensors), never
program structure: no value a client may send compiles anything, and nothing branches on
the device (an XLA conditional on a GPU reads its predicate back to the host every step: one
around this sampler made greedy decode steps 15 % slower on an H200, BENCHMARKS.md, stop
73). The one static choice is tpu-inference's "any row samples", for decode steps: a decode
step whose rows are all greedy, without penalties or log-probabilities, runs an argmax alone
(the model runner's program without this function; a step in which a request computes more
than one token always samples, ``PreparedCall.sampled``); one that samples computes, for every row,
without sorting the vocabulary:

- the argmax (greedy rows, temperature 0);
- one Gumbel noise per token (the row's key), so a draw is the argmax of tempered logits +
  noise over the tokens it may draw (the Gumbel-max form of a categorical draw);
- a row with no filter (top-k off, top-p 1) draws over the whole vocabulary: exact;
- a row with top-k or top-p draws over its ``CANDIDATES`` most likely tokens (found by block
  maxima, as ``top_logprobs`` finds its 20), its top-k / top-p set masked in sorted order
  over them: tpu-inference's fixed candidate count (its ``max_k``). The set is exactly Hugging
  Face's (and vLLM's GPU sampler's) for a top-k of 1 to ``CANDIDATES`` (with or without
  top-p), and for a top-p alone whose nucleus ends within the candidates (its probabilities
  over the whole vocabulary). Past that the set is cut to the candidates: a nucleus wider
  than ``CANDIDATES`` tokens keeps them all, and so does a top-k between ``CANDIDATES`` and
  the vocabulary (with a top-p, its nucleus measured over the whole vocabulary's
  probabilities).

The program that samples also gives each row's log-probabilities (OpenAI's ``logprobs``;
``token_logprobs``): the chosen token's and the ``MAX_LOGPROBS`` most likely tokens', from the
float32 log-softmax of the logits after the row's output grammar (``apply_guides``) and before
its penalties, temperature and filters: vLLM v1's default "raw" mode (its model runner applies
the grammar bitmask before the sampler). The top ``MAX_LOGPROBS`` come from block maxima
(``top_logprobs``), not from a sort. A decode batch of greedy rows in which a request asks for
them runs the sampling program (its greedy rows are exact there); the argmax alone computes
none: on an H200 they cost 36-88 us a step over it at 1-256 rows (BENCHMARKS.md, stop 74).

Each row draws with its own key, ``fold_in(PRNGKey(seed), index)`` where ``index`` is the
number of tokens the request has generated so far, so a seeded request gives the same
tokens whatever else shares its batches.

Penalties (``apply_penalties``; vLLM's and OpenAI's semantics) change a row's logits before
the draw (a greedy row's argmax is the penalized logits'; its log-probabilities stay the
raw ones); a row without penalties gets its logits back bit for bit. They read each row's
token counts, which the model runner keeps on the device (``ModelRunner``: one i32[V] row
per request slot, updated inside the step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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


CANDIDATES = 128
"""The tokens a top-k / top-p row draws among: its most likely ones (``sample_tokens``)."""

CANDIDATE_BLOCK = 32
"""``top_logprobs``' block for the candidates: the two top-k's it runs cost about
V / block + CANDIDATES * block values a row, least near sqrt(V / CANDIDATES) (H200 figures in
BENCHMARKS.md)."""


def candidate_sets(scaled, top_p, top_k, candidates: int = CANDIDATES):
    """Each row's ``candidates`` most likely tokens and the ones its top-k / top-p keeps
    (traceable; see the module docstring for where the set is exact).

    Args:
      scaled: f32[N, V], the tempered logits.
      top_p: f32[N] in (0, 1]; top_k: i32[N], 0 = off.

    Returns (i32[N, C] ids, most likely first; f32[N, C] their tempered logits; bool[N, C]
    kept), C = min(``candidates``, V).
    """
    ids, values = top_logprobs(scaled, block=CANDIDATE_BLOCK, count=candidates)
    c = values.shape[-1]
    rank = jax.lax.broadcasted_iota(jnp.int32, values.shape, 1)
    in_top_k = (top_k > 0) & (top_k <= c)
    keep = jnp.where(in_top_k[:, None], rank < top_k[:, None], True)
    whole = jax.nn.logsumexp(scaled, axis=-1)  # the vocabulary's normaliser
    kept = jax.nn.logsumexp(jnp.where(keep, values, -jnp.inf), axis=-1)  # top-k's renormaliser
    probs = jnp.exp(values - jnp.where(in_top_k, kept, whole)[:, None])
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the more likely tokens
    keep &= (before < top_p[:, None]) | (rank == 0)
    return ids, values, keep


def sample_tokens(logits, temperature, top_p, top_k, seeds, counters):
    """Next token per row (traceable; one program whatever the values; see the module
    docstring for what is drawn).

    Args:
      logits: f32[N, V] (after ``apply_penalties`` and ``apply_guides``).
      temperature: f32[N]; 0 = greedy (argmax) for that row.
      top_p: f32[N] in (0, 1]; keeps the smallest set of most likely tokens whose
        probability reaches top_p (Hugging Face's rule: the most likely token always stays).
      top_k: i32[N]; 0 = off, else keeps the k most likely tokens.
      seeds: u32[N]; counters: i32[N] (tokens generated so far).

    Returns i32[N] tokens.
    """
    v = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = temperature > 0
    scaled = logits / jnp.where(sampled, temperature, 1.0)[:, None]
    keys = jax.vmap(lambda seed, counter: jax.random.fold_in(jax.random.PRNGKey(seed), counter))(seeds, counters)
    noise = jax.vmap(lambda key: jax.random.gumbel(key, (v,), scaled.dtype))(keys)  # f32[N, V]
    unfiltered = jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32)
    ids, values, keep = candidate_sets(scaled, top_p, top_k)
    perturbed = jnp.where(keep, values + jnp.take_along_axis(noise, ids, axis=-1), -jnp.inf)
    filtered = jnp.take_along_axis(ids, jnp.argmax(perturbed, axis=-1)[:, None], axis=-1)[:, 0]
    no_filter = ((top_k <= 0) | (top_k >= v)) & (top_p >= 1.0)
    return jnp.where(sampled, jnp.where(no_filter, unfiltered, filtered), greedy)


def top_logprobs(logprobs, block: int = 128, count: int = MAX_LOGPROBS):
    """The L = min(``count``, V) largest of each row of ``logprobs`` f32[T, V], most likely
    first, without a top-k over the vocabulary: the top L lie in the L blocks of ``block``
    tokens with the largest maxima, so two small top-k's (over the block maxima, then over
    those blocks' tokens) find them exactly (H200, 256 rows of 49,152, L = 20, each with an
    argmax: 0.25 ms against 1.28 with ``lax.top_k``, BENCHMARKS.md). Returns (i32[T, L] ids,
    f32[T, L]). The last block's padding (V not a multiple of ``block``) is -inf: a row with
    fewer than L finite values may list it among its -inf entries, as token V - 1 (an id in the
    vocabulary, never past it)."""
    n, v = logprobs.shape
    count = min(count, v)
    blocks = -(-v // block)
    padded = jnp.pad(logprobs, [(0, 0), (0, blocks * block - v)], constant_values=-jnp.inf)
    tiles = padded.reshape(n, blocks, block)
    _, best = jax.lax.top_k(tiles.max(axis=-1), min(count, blocks))  # i32[T, L] block indices
    candidates = jnp.take_along_axis(tiles, best[:, :, None], axis=1).reshape(n, -1)
    values, at = jax.lax.top_k(candidates, count)
    ids = jnp.take_along_axis(best, at // block, axis=1) * block + at % block
    return jnp.minimum(ids, v - 1).astype(jnp.int32), values


def token_logprobs(logits, tokens):
    """Each row's log-probability of ``tokens`` and of its ``MAX_LOGPROBS`` most likely
    tokens, from the float32 log-softmax of ``logits`` (traceable). A step's sampled tokens
    (the raw logits: see the module docstring) and a prefill's prompt tokens (vLLM's prompt
    logprobs: each token row's next prompt token) both go through it.

    Args:
      logits: f[T, V].
      tokens: i32[T], the token whose log-probability each row wants.

    Returns (f32[T] the tokens' log-probabilities, i32[T, L] the L = min(``MAX_LOGPROBS``, V)
    most likely tokens, most likely first, f32[T, L] their log-probabilities).
    """
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    ids, top = top_logprobs(logprobs)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return chosen, ids, top


def pack_scores(tokens, chosen, ids, top):
    """``tokens`` i32[...] and ``token_logprobs``' three (f32[...], i32[..., L], f32[..., L])
    as one i32[..., 2 + 2L] array (token, chosen's bits, ids, top's bits; traceable), so the
    host reads a call's tokens and log-probabilities in one device-to-host copy and a mesh
    gathers them in one collective. ``unpack_scores`` reads it back."""
    bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.int32)  # noqa: E731
    return jnp.concatenate([tokens[..., None], bits(chosen)[..., None], ids, bits(top)], axis=-1)


def unpack_scores(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``pack_scores``' i32[..., 2 + 2L] on the host as its four arrays (views, no copy):
    (i32[...] tokens, f32[...] their log-probabilities, i32[..., L] ids, f32[..., L] theirs)."""
    count = (scores.shape[-1] - 2) // 2
    ids = scores[..., 2 : 2 + count]
    return scores[..., 0], scores[..., 1].view(np.float32), ids, scores[..., 2 + count :].view(np.float32)


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
