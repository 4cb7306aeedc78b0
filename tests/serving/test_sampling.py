"""The sampler against a float64 NumPy oracle: the kept set of top-k / top-p (every drawn
token in it, the draws following its renormalized probabilities; where the fixed candidate
count cuts it, the candidates); the top log-probabilities of a prompt's rows, exactly; the
scores the host reads them in, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.serving.sampling import (
    CANDIDATES,
    MAX_LOGPROBS,
    candidate_sets,
    pack_scores,
    sample_tokens,
    token_logprobs,
    top_logprobs,
    unpack_scores,
)


def _kept(logits, temperature, top_p, top_k):
    """The oracle: (bool[V] the tokens a row may draw, by Hugging Face's rules in sorted order,
    f64[V] their renormalized probabilities)."""
    scaled = logits.astype(np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    keep = np.ones(len(scaled), bool) if not top_k else np.arange(len(scaled)) < top_k
    probs = np.where(keep, np.exp(scaled[order] - scaled.max()), 0.0)
    probs /= probs.sum()
    keep &= (np.cumsum(probs) - probs < top_p) | (np.arange(len(scaled)) == 0)
    out = np.zeros(len(scaled), bool)
    out[order[keep]] = True
    weights = np.where(out, np.exp(scaled - scaled.max()), 0.0)
    return out, weights / weights.sum()


@pytest.mark.parametrize("vocab", [7, 300])
def test_draws_stay_in_the_oracles_kept_set_with_its_probabilities(vocab):
    rng = np.random.default_rng(vocab)
    rows = [(0.7, 1.0, 0), (1.0, 0.5, 0), (1.3, 0.9, 5), (1.0, 1.0, 3), (2.0, 0.2, 0), (0.5, 1e-6, 0)]
    n, draws = len(rows), 2000
    logits = rng.normal(0, 2, (n, vocab)).astype(np.float32)
    t, p, k = (np.array([r[i] for r in rows], dt) for i, dt in enumerate((np.float32, np.float32, np.int32)))
    step = jax.jit(jax.vmap(sample_tokens, in_axes=(None, None, None, None, None, 0)))
    counters = jnp.arange(draws, dtype=jnp.int32)[:, None].repeat(n, 1)
    tokens = np.asarray(step(logits, t, p, k, np.arange(n, dtype=np.uint32), counters))  # i32[draws, n]
    for row, (temperature, top_p, top_k) in enumerate(rows):
        kept, probs = _kept(logits[row], temperature, top_p, top_k)
        assert kept[tokens[:, row]].all(), row
        freq = np.bincount(tokens[:, row], minlength=vocab) / draws
        np.testing.assert_allclose(freq, probs, atol=0.05)


@pytest.mark.parametrize("vocab", [5, 129, 1000])
def test_top_logprobs_equal_the_sorted_log_softmax(vocab):
    logits = np.random.default_rng(vocab).normal(0, 3, (4, vocab)).astype(np.float32)
    logits[1, -1] = 50.0  # the best token in the last, padded block
    ids, values = jax.jit(top_logprobs)(logits)
    want = np.argsort(-logits.astype(np.float64), axis=-1)[:, : min(MAX_LOGPROBS, vocab)]
    np.testing.assert_array_equal(np.asarray(ids), want)
    np.testing.assert_array_equal(np.asarray(values), np.take_along_axis(logits, want, -1))


def test_scores_unpack_to_the_tokens_and_log_probabilities_bit_for_bit():
    logits = np.random.default_rng(0).normal(0, 3, (2, 3, 50)).astype(np.float32)
    tokens = np.array([[0, 7, 49], [3, 3, 1]], np.int32)
    rows = [token_logprobs(a, t) for a, t in zip(logits, tokens, strict=True)]
    want = [np.stack(parts) for parts in zip(*rows, strict=True)]  # (f32[2, 3], i32[2, 3, L], f32[2, 3, L])
    got = unpack_scores(np.asarray(jax.jit(pack_scores)(tokens, *want)))
    np.testing.assert_array_equal(got[0], tokens)
    for g, w in zip(got[1:], want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)


def test_candidate_sets_are_the_oracles_where_exact_and_cut_to_the_candidates_past_them():
    """Over 1,000 tokens: the oracle's kept set and its probabilities for a top-k of 1..128
    (with and without top-p), a nucleus within the 128 candidates with top-k off, and no filter
    (the whole vocabulary, by its own Gumbel-max); with a top-k past 128 the whole vocabulary's
    nucleus (here within 128); a nucleus wider than 128 keeps the 128 most likely; greedy rows
    their argmax. Every draw is in its row's set."""
    vocab, draws = 1000, 2000
    logits = np.random.default_rng(1).normal(0, 4, (7, vocab)).astype(np.float32)
    logits[3] /= 8  # flat: 73 % of the unfiltered row's probability lies past its 128 most likely tokens
    rows = [(1.0, 0.5, 0), (1.3, 0.9, 5), (0.7, 1.0, 128), (1.0, 1.0, 0), (1.0, 0.2, 200), (8.0, 0.99, 0),
            (0.0, 1.0, 0)]  # fmt: skip
    t, p, k = (np.array([r[i] for r in rows], dt) for i, dt in enumerate((np.float32, np.float32, np.int32)))
    scaled = logits / np.where(t > 0, t, 1.0)[:, None]
    ids, _, keep = (np.asarray(a) for a in jax.jit(candidate_sets)(scaled, p, k))
    counters = jnp.arange(draws, dtype=jnp.int32)[:, None].repeat(len(rows), 1)
    step = jax.jit(jax.vmap(sample_tokens, in_axes=(None, None, None, None, None, 0)))
    tokens = np.asarray(step(logits, t, p, k, np.arange(len(rows), dtype=np.uint32), counters))
    for row in range(4):  # exact: the oracle's set and probabilities
        want, probs = _kept(logits[row], *rows[row])
        if row < 3:
            assert want.sum() <= CANDIDATES and set(ids[row][keep[row]]) == set(np.flatnonzero(want)), row
        assert set(tokens[:, row]) <= set(np.flatnonzero(want)), row
        np.testing.assert_allclose(np.bincount(tokens[:, row], minlength=vocab) / draws, probs, atol=0.05)
    assert not set(tokens[:, 3]) <= set(ids[3])  # the unfiltered row draws past its candidates
    whole, _ = _kept(logits[4], 1.0, 0.2, 0)  # top-k 200: the nucleus over the whole vocabulary
    assert whole.sum() <= CANDIDATES and set(ids[4][keep[4]]) == set(np.flatnonzero(whole))
    wide, _ = _kept(logits[5], 8.0, 0.99, 0)
    most_likely = np.argsort(-logits[5].astype(np.float64), kind="stable")[:CANDIDATES]
    assert wide.sum() > CANDIDATES and keep[5].all() and set(ids[5]) == set(most_likely)  # cut to the 128
    for row in (4, 5):
        assert set(tokens[:, row]) <= set(ids[row][keep[row]]), row
    assert (tokens[:, 6] == logits[6].argmax()).all()


@pytest.mark.parametrize(("top_p", "top_k"), [(1.0, 50), (0.9, 0), (1.0, 0), (0.5, 3)])
def test_a_row_with_few_allowed_tokens_draws_only_them(top_p, top_k):
    """A guided row (every token but a few at -inf) in a vocabulary that is not a multiple of
    the candidate search's blocks: its draws stay among its finite tokens (the last block's
    padding is never drawn, nor any id past the vocabulary), and its top log-probabilities
    list only ids in the vocabulary."""
    vocab, draws = 1000, 500
    logits = np.full((1, vocab), -np.inf, np.float32)
    logits[0, 992:] = np.random.default_rng(2).normal(0, 1, 8)
    step = jax.jit(jax.vmap(sample_tokens, in_axes=(None, None, None, None, None, 0)))
    args = (np.float32([1.0]), np.float32([top_p]), np.int32([top_k]), np.zeros(1, np.uint32))
    tokens = np.asarray(step(logits, *args, jnp.arange(draws, dtype=jnp.int32)[:, None]))
    assert set(tokens[:, 0]) <= set(range(992, vocab))
    ids, values = jax.jit(top_logprobs)(logits)
    assert np.asarray(ids).max() < vocab and set(np.asarray(ids)[0, :8]) == set(range(992, vocab))
    assert np.isneginf(np.asarray(values)[0, 8:]).all()
