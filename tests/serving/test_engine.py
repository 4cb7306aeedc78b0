"""The engine on the embedded SmolLM2 matches stock transformers token for token (greedy):
all requests at once, requests arriving and finishing at different steps with chunked
prefill, and under preemption; seeded sampling is reproducible; no compilation after
warm-up; bad requests get clear errors.

One engine serves the whole module (its step compiles once per bucket): 4 requests per
step, a 32-token step budget, 128 tokens per request, a 10-page cache of 16-token pages.
"""

from __future__ import annotations

import dataclasses

import pytest

from attn_jax.metadata import MetadataBuckets
from attn_jax.serving import CascadeConfig, Engine, SamplingParams
from tests.serving.hf_reference import LONG_PROMPTS, PROMPTS, hf_greedy, hf_greedy_batch

NEW_TOKENS = 16  # per short prompt; EOS ignored on both sides so every prompt gets them all
LONG_NEW_TOKENS = 16
FORCED_CASCADE = CascadeConfig(min_prefix_len=16, min_requests=2)  # cascade for a few short prompts


@pytest.fixture(scope="module")
def engine(smollm2_gguf):
    # notebooks/serving.md runs these limits under the suite (ATTN_STACK_NOTEBOOK_FAST): keep them equal, and the
    # session's compilation cache holds their step programs once for both
    return Engine.from_gguf(
        smollm2_gguf, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, num_blocks=10,
        buckets=MetadataBuckets((32,), (4,), (8,)),
    )  # fmt: skip


@pytest.fixture(scope="module")
def expected(hf_smollm2):
    """transformers' greedy tokens, EOS ignored, for every test prompt."""
    model, tokenizer = hf_smollm2
    assert NEW_TOKENS == LONG_NEW_TOKENS  # one batched generate call
    prompts = PROMPTS + LONG_PROMPTS
    return dict(zip(prompts, hf_greedy_batch(model, tokenizer, prompts, NEW_TOKENS), strict=True))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def _finished(engine):
    while engine.has_unfinished():
        engine.step()


def test_logprobs_equal_transformers_log_softmax(engine, hf_smollm2):
    """Each token's log-probability and its 5 likeliest alternatives, greedy and sampled (raw:
    before temperature), equal transformers' float32 log-softmax over the same tokens to 2e-3;
    asking for them changes no token."""
    import torch

    model, _ = hf_smollm2
    params = [
        SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=5),
        SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=0, temperature=0.8, seed=7),
    ]
    results = engine.generate(PROMPTS[:2], params)
    assert [c.output_ids for c in engine.generate(PROMPTS[:1], greedy(6))] == [results[0].output_ids]
    for result, sp in zip(results, params, strict=True):
        ids = torch.tensor([result.prompt_ids + result.output_ids])
        with torch.no_grad():
            want = torch.log_softmax(model(ids).logits[0].float(), dim=-1).numpy()
        rows = want[len(result.prompt_ids) - 1 : -1]  # the distribution each output token was drawn from
        assert len(result.logprobs) == len(result.output_ids)
        for row, token, (logprob, top) in zip(rows, result.output_ids, result.logprobs, strict=True):
            assert abs(logprob - row[token]) < 2e-3
            assert len(top) == sp.logprobs
            for alt, alt_logprob in top:
                assert abs(alt_logprob - row[alt]) < 2e-3
            if top:
                assert sorted(row, reverse=True)[0] == pytest.approx(top[0][1], abs=2e-3)
    with pytest.raises(ValueError, match=r"logprobs=21 must be an int in \[0, 20\]"):
        SamplingParams(logprobs=21)


def test_greedy_batch_matches_transformers(engine, expected):
    results = engine.generate(PROMPTS, greedy(NEW_TOKENS))
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.output_ids == expected[prompt], prompt
        assert len(result.output_ids) == NEW_TOKENS
    assert any(len(r.prompt_ids) > engine.max_num_batched_tokens for r in results)  # one was chunked


def test_mixed_arrivals_and_finishes_match_transformers(engine, expected):
    """Requests join a running batch and leave it at different steps; a long prompt is
    prefilled in chunks beside decodes: no request's tokens change."""
    lengths = {PROMPTS[0]: 12, PROMPTS[1]: 16, PROMPTS[2]: 14, PROMPTS[3]: 15}
    ids = {engine.add_request(PROMPTS[0], greedy(12)): PROMPTS[0]}
    for _ in range(3):
        engine.step()
    ids[engine.add_request(PROMPTS[3], greedy(15))] = PROMPTS[3]  # chunked prefill
    ids[engine.add_request(PROMPTS[1], greedy(16))] = PROMPTS[1]
    first = len(engine.stats)
    for _ in range(4):
        engine.step()
    mixed = any(s.num_prefill_tokens > 0 and s.num_decode_tokens > 0 for s in engine.stats[first:])
    ids[engine.add_request(PROMPTS[2], greedy(14))] = PROMPTS[2]
    _finished(engine)
    assert mixed, "no step mixed a prefill chunk with decodes"
    for request_id, prompt in ids.items():
        out = engine.completion(request_id).output_ids
        assert out == expected[prompt][: lengths[prompt]], prompt


def test_preemption_when_the_cache_runs_out_keeps_every_requests_tokens(engine, expected):
    results = engine.generate(LONG_PROMPTS, greedy(LONG_NEW_TOKENS))
    pages = sum(-(-(len(r.prompt_ids) + LONG_NEW_TOKENS) // engine.block_size) for r in results)
    assert pages > engine.num_blocks  # they cannot all fit at once
    assert any(engine.get_request(r.request_id).num_preemptions for r in results)
    for prompt, result in zip(LONG_PROMPTS, results, strict=True):
        assert result.output_ids == expected[prompt], prompt
    assert engine.schedulers[0].allocator.num_free == engine.num_blocks  # every page returned


def test_no_compilation_after_warm_up(engine, expected):
    engine.generate(PROMPTS, greedy(NEW_TOKENS))  # the workload of the first test
    before = engine.num_compilations
    results = engine.generate(PROMPTS, greedy(NEW_TOKENS))
    assert engine.num_compilations == before
    assert results[0].output_ids == expected[PROMPTS[0]]
    # The programs compiled in traffic said which they were (a server logs them).
    assert engine.recent_compilations and all(" tokens, " in s and "step(s)" in s for s in engine.recent_compilations)


def test_stops_at_eos_where_transformers_stops(engine, hf_smollm2):
    want = hf_greedy(*hf_smollm2, PROMPTS[3], 8)  # " Earth." then EOS
    result = engine.generate([PROMPTS[3]], SamplingParams(max_new_tokens=8))[0]
    assert result.output_ids == want and want[-1] in engine.eos_token_ids and len(want) < 8
    assert result.finish_reason == "stop"


def test_shared_prefix_tokens_identical_with_caching_off_on_and_cascade(engine):
    """Three prompts sharing a 32-token (2-page) prefix: the same greedy tokens with prefix
    caching off, on, and on with cascade attention (its thresholds lowered to this batch);
    caching computes the prefix once and cascade runs in the decode steps."""
    shared = engine.tokenizer(LONG_PROMPTS[0])["input_ids"][:32]
    prompts = [shared + engine.tokenizer(p)["input_ids"][:n] for p, n in zip(PROMPTS[:3], (5, 3, 7), strict=True)]
    params = greedy(6)
    runs, computed = {}, {}
    for mode, caching, cascade in (("off", False, False), ("on", True, False), ("cascade", True, FORCED_CASCADE)):
        engine.enable_prefix_caching, engine.cascade_attention = caching, cascade
        first = len(engine.stats)
        runs[mode] = [c.output_ids for c in engine.generate(prompts, params)]
        computed[mode] = sum(s.num_prefill_tokens for s in engine.stats[first:])
        if mode == "cascade":
            assert any(s.cascade_prefix_len == 32 for s in engine.stats[first:])
        engine.reset_prefix_cache()
    engine.enable_prefix_caching, engine.cascade_attention = True, True
    assert runs["on"] == runs["off"] and runs["cascade"] == runs["off"]
    assert computed["off"] - computed["on"] == 2 * 32  # the prefix computed once, not three times


def test_seeded_sampling_is_reproducible_in_any_batch(engine):
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, top_k=40, seed=1234)
    alone = engine.generate([PROMPTS[2]], params)[0].output_ids
    crowd = engine.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1]], [SamplingParams(max_new_tokens=5), params, params])
    assert crowd[1].output_ids == alone
    # Only the seed differs (the same compiled sampling variant: top-k 40's candidates).
    other = engine.generate([PROMPTS[2]], dataclasses.replace(params, seed=99))[0]
    assert other.output_ids != alone


def test_streamed_text_adds_up_to_the_completion(engine):
    request_id = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=8))
    events = list(engine.stream())
    assert [e.request_id for e in events] == [request_id] * len(events)
    assert events[-1].finished and not any(e.finished for e in events[:-1])
    assert "".join(e.text for e in events) == engine.completion(request_id).text


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ("", SamplingParams(), "prompt is empty: give at least one character of text"),
        ([], SamplingParams(), "prompt is empty: it encodes to no tokens"),
        ([1, 99999], SamplingParams(), r"prompt token id 99999 is outside the vocabulary \[0, 49152\)"),
        (
            "Hello",
            SamplingParams(max_new_tokens=200),
            r"prompt of 1 tokens \+ max_new_tokens=200 = 201 exceeds max_model_len=128 "
            r"\(the model's context length is 8192\)",
        ),
    ],
)
def test_bad_requests(engine, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished()


def test_engine_limits_are_checked(smollm2_gguf, engine):
    with pytest.raises(ValueError, match="max_model_len=9000 exceeds the model's context length 8192"):
        Engine(engine.model, engine.params, max_model_len=9000)
    with pytest.raises(ValueError, match=r"buckets.token_buckets ends at 32, below the engine's limit 64"):
        Engine(engine.model, engine.params, max_num_batched_tokens=64, buckets=engine.buckets, max_model_len=128)
    with pytest.raises(ValueError, match="request_id='dup' is already in use"):
        engine.add_request("Hi", request_id="dup")
        engine.add_request("Hi", request_id="dup")
    _finished(engine)
