"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``, vLLM's) on the tiny engine
against a float64 NumPy forward of the same weights: every prompt position, across chunked
prefill, beside requests that do not ask; no prefix-cache hit skips a position; no program
compiled after the warm-up; batches without such requests keep their programs."""

from __future__ import annotations

import numpy as np
import pytest

from attn_jax.metadata import MetadataBuckets
from attn_jax.models.llama import rope_frequencies
from attn_jax.serving import SamplingParams
from attn_jax.serving.warmup import candidate_calls
from attn_jax.testing.models import tiny_random_engine

PROMPTS = [
    "The capital of France is Paris, and the capital of Italy is Rome. " * 3,  # > the 32-token step budget
    "One two three four",
    "A",
]


@pytest.fixture(scope="module")
def engine():
    engine = tiny_random_engine(
        max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, num_blocks=32, num_scheduler_steps=1,
        buckets=MetadataBuckets((16, 32), (4,), (8,)),
    )  # fmt: skip
    engine.warmup_keys = set(candidate_calls(engine)[0])  # what Engine.warmup would compile (compiling is slow)
    return engine


def _log_softmax_f64(engine, ids: list[int]) -> np.ndarray:
    """f64[T, V]: the next-token log-softmax at every position of ``ids``, a float64 NumPy
    forward of the tiny LLaMA's weights (``fuse_params``' layout)."""
    c, p = engine.model.config, {k: v for k, v in engine.runner.params.items()}
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731

    def norm(x, w):
        return f64(w) * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.rms_norm_eps)

    inv_freq, _ = rope_frequencies(c)
    angles = np.arange(len(ids))[:, None] * f64(inv_freq)[None]
    cos, sin = np.cos(np.concatenate([angles] * 2, -1)), np.sin(np.concatenate([angles] * 2, -1))

    def rope(x):  # [T, H, D]
        half = x.shape[-1] // 2
        return x * cos[:, None] + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin[:, None]

    t, group = len(ids), c.num_heads // c.num_kv_heads
    h = f64(p["embed"])[ids]
    norms = f64(p["layer_norms"])
    causal = np.tril(np.ones((t, t), bool))
    for i, w in enumerate(p["layers"]):
        qkv = np.einsum("th,kgdh->tkgd", norm(h, norms[i][0]), f64(w["wqkv"]))
        q = rope(qkv[:, :, :group].reshape(t, c.num_heads, c.head_dim))
        k, v = rope(qkv[:, :, group]), qkv[:, :, group + 1]
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(c.head_dim)
        s = np.where(causal, s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        h = h + np.einsum("hqk,khd->qhd", a, v).reshape(t, -1) @ f64(w["wo"]).T
        gate_up = np.einsum("th,gih->tgi", norm(h, norms[i][1]), f64(w["w_gate_up"]))
        silu = gate_up[:, 0] / (1 + np.exp(-gate_up[:, 0]))
        h = h + (silu * gate_up[:, 1]) @ f64(w["w_down"]).T
    head = f64(p["lm_head"]) if "lm_head" in p else f64(p["embed"]).T
    logits = norm(h, p["final_norm"]) @ head
    z = logits.max(-1, keepdims=True)
    return logits - z - np.log(np.exp(logits - z).sum(-1, keepdims=True))


def test_prompt_logprobs_match_float64_oracle(engine):
    """Each prompt token's log-probability and its top 5 equal the float64 oracle's to 1e-4 (a
    prompt chunked over 3 calls, one of a single token, and one beside a request that asks for
    none); the first token's entry is None; tokens are unchanged; every program the calls ran
    is one the warm-up compiles."""
    params = [
        SamplingParams(max_new_tokens=2, ignore_eos=True, prompt_logprobs=5, logprobs=1),
        SamplingParams(max_new_tokens=3, ignore_eos=True),
        SamplingParams(max_new_tokens=1, ignore_eos=True, prompt_logprobs=0),
    ]
    results = engine.generate(PROMPTS, params)
    plain = engine.generate(PROMPTS, SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert results[0].output_ids == plain[0].output_ids
    assert results[1].prompt_logprobs is None
    assert len(results[0].prompt_ids) > engine.max_num_batched_tokens  # chunked prefill
    for result, sp in zip(results, params, strict=True):
        if sp.prompt_logprobs is None:
            continue
        ids = result.prompt_ids
        want = _log_softmax_f64(engine, ids)
        assert len(result.prompt_logprobs) == len(ids) and result.prompt_logprobs[0] is None
        for p, entry in enumerate(result.prompt_logprobs[1:]):
            logprob, top = entry
            assert abs(logprob - want[p, ids[p + 1]]) < 1e-4, p
            assert [t for t, _ in top] == np.argsort(-want[p])[: sp.prompt_logprobs].tolist()
            np.testing.assert_allclose([v for _, v in top], np.sort(want[p])[::-1][: sp.prompt_logprobs], atol=1e-4)
    assert engine.runner.dispatched_keys <= engine.warmup_keys


def test_prompt_logprobs_take_no_prefix_cache_hits(engine):
    """A prompt whose blocks are cached is still computed whole when its log-probabilities are
    asked for (every position's logits), and gives the same values."""
    prompt = PROMPTS[0]
    first = engine.generate([prompt], SamplingParams(max_new_tokens=1, prompt_logprobs=1))[0]
    before = engine.prefix_cache_stats
    again = engine.generate([prompt], SamplingParams(max_new_tokens=1, prompt_logprobs=1))[0]
    assert engine.prefix_cache_stats.hits == before.hits
    np.testing.assert_allclose(
        [e[0] for e in again.prompt_logprobs[1:]], [e[0] for e in first.prompt_logprobs[1:]], atol=1e-6
    )


def test_prompt_logprobs_programs_are_warmed_and_counted(engine):
    """The warm-up holds one program with prompt log-probabilities per token bucket and batch
    kind of a prefill or mixed call (the widest block table; no decode-only layout, no
    multi-step call), and the calls with them ran only those; the values are checked."""
    keys = engine.warmup_keys
    with_prompt = [k for k in keys if "prompt_targets" in str(k[0])]
    assert with_prompt and all(k[1] == 1 and k[2] for k in with_prompt)
    assert len(with_prompt) <= 2 * len(engine.buckets.token_buckets)
    assert any("prompt_targets" in str(k[0]) for k in engine.runner.dispatched_keys)
    assert engine.runner.dispatched_keys <= keys
    with pytest.raises(ValueError, match=r"prompt_logprobs=21 must be an int in \[0, 20\]"):
        SamplingParams(prompt_logprobs=21)
