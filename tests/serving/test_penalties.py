"""Presence, frequency and repetition penalties through the engine (``SamplingParams``; the
formula against a float64 oracle is in ``test_scheduler.py``): greedy with penalties stops
repeating, the repetition penalty counts the prompt and the others do not, and the tokens
are the same whether a call runs one step or four (``num_scheduler_steps``), continues the
last call on the device (the persistent batch) or is built on the host each step, and
whether the request was preempted and recomputed on the way; a row without penalties keeps
its tokens beside rows with them; a request with a repetition penalty takes no prefix-cache
hits."""

from __future__ import annotations

import dataclasses

import pytest

from attn_jax.metadata import MetadataBuckets
from attn_jax.models.llama import LlamaConfig, LlamaModel, init_params
from attn_jax.serving import Engine, SamplingParams
from attn_jax.serving.model_runner import ModelRunner

CONFIG = LlamaConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32,
    eos_token_ids=(1,),
)  # fmt: skip
PARAMS = init_params(CONFIG, seed=6)
# One bucket per axis: two step shapes a program kind, so each engine compiles a few programs.
LIMITS = dict(max_num_seqs=3, max_num_batched_tokens=24, max_model_len=48, buckets=MetadataBuckets((24,), (3,), (12,)))
REPEATS = list(range(10, 29))  # greedy continues it with one token over and over
PROMPTS = [REPEATS, [5, 6, 7, 8, 9], [40, 41, 42]]
PENALIZED = [
    SamplingParams(
        max_new_tokens=12, ignore_eos=True, frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.3
    ),
    SamplingParams(max_new_tokens=12, ignore_eos=True),
    SamplingParams(
        max_new_tokens=10, ignore_eos=True, temperature=0.9, seed=3, repetition_penalty=0.8, presence_penalty=-0.5
    ),
]


def _engine(**kwargs) -> Engine:
    return Engine(LlamaModel(CONFIG, block_size=4), PARAMS, **LIMITS, **kwargs)


@pytest.fixture(scope="module")
def reference() -> Engine:
    """Every call one step, built on the host (no asynchronous scheduling: no decode chain)."""
    return _engine(async_scheduling=False)


def _greedy(engine: Engine, prompt, **penalties) -> list[int]:
    (c,) = engine.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True, **penalties))
    return c.output_ids


def test_greedy_with_penalties_stops_repeating(reference):
    plain = _greedy(reference, REPEATS)
    assert len(set(plain)) <= len(plain) // 2  # the model repeats itself
    for penalties in (dict(frequency_penalty=2.0, presence_penalty=2.0), dict(presence_penalty=2.0)):
        out = _greedy(reference, REPEATS, **penalties)
        assert len(set(out)) == len(out) and out[:2] == plain[:2], penalties  # the same until it would repeat


def test_the_repetition_penalty_counts_the_prompt_and_presence_does_not(reference):
    presence = _greedy(reference, REPEATS, presence_penalty=2.0)
    assert set(presence) & set(REPEATS)  # prompt tokens come back: presence counts the output only
    repetition = _greedy(reference, REPEATS, repetition_penalty=3.0)
    assert not set(repetition) & set(REPEATS) and len(set(repetition)) == len(repetition)


def test_multi_step_chained_and_preempted_calls_give_one_step_calls_tokens(reference, monkeypatch):
    """A mixed batch (penalties greedy, none, penalties sampled): the same tokens from calls of
    four steps under a cache small enough to preempt, and from chained one-step calls; the
    row without penalties has its tokens of a batch without them."""
    want = [c.output_ids for c in reference.generate(PROMPTS, PENALIZED)]
    (alone,) = reference.generate(PROMPTS[1:2], PENALIZED[1:2])
    assert want[1] == alone.output_ids

    multi = _engine(num_scheduler_steps=4, num_blocks=9)
    got = multi.generate(PROMPTS, PENALIZED)
    assert [c.output_ids for c in got] == want
    assert any(s.num_steps == 4 for s in multi.stats)
    assert any(multi.get_request(c.request_id).num_preemptions for c in got)

    continued = []
    original = ModelRunner.continue_decode

    def spy(self, *args, **kwargs):
        call = original(self, *args, **kwargs)
        continued.append(call is not None)
        return call

    monkeypatch.setattr(ModelRunner, "continue_decode", spy)
    chained = _engine()
    assert [c.output_ids for c in chained.generate(PROMPTS, PENALIZED)] == want and sum(continued) > 5


def test_a_repetition_penalty_takes_no_prefix_cache_hits(reference):
    prompt = list(range(50, 71))  # 21 tokens: 5 full pages
    want = _greedy(reference, prompt, repetition_penalty=2.0)
    hits = reference.prefix_cache_stats.hits
    assert _greedy(reference, prompt, repetition_penalty=2.0) == want
    assert reference.prefix_cache_stats.hits == hits  # the prompt recomputed, so its tokens are counted
    _greedy(reference, prompt, presence_penalty=1.0)
    assert reference.prefix_cache_stats.hits > hits  # presence counts the output only: the prompt may come cached


def test_logprobs_are_the_raw_distribution_and_move_greedy_calls_to_the_sampler():
    """Log-probabilities are vLLM's raw ones, before penalties: a penalized request's first
    token's top alternatives equal a plain request's (the same context) though its token
    differs. A greedy request that asks for them decodes on the sampled program (the argmax
    alone computes none), one that does not on the greedy program (its prompt's call samples,
    as every call with a prompt chunk does); their tokens are the same."""
    engine = _engine()
    asked, prompt = dict(max_new_tokens=4, ignore_eos=True, logprobs=5), list(range(60, 90))
    plain, penalized = (
        engine.generate([prompt], SamplingParams(**asked, **penalties))[0]
        for penalties in ({}, dict(repetition_penalty=3.0))
    )
    assert plain.output_ids[0] in prompt and penalized.output_ids[0] not in prompt
    (plain_lp, plain_top), (penalized_lp, penalized_top) = plain.logprobs[0], penalized.logprobs[0]
    assert [i for i, _ in plain_top] == [i for i, _ in penalized_top]
    assert [v for _, v in plain_top] == pytest.approx([v for _, v in penalized_top], abs=1e-6)
    assert plain_lp == pytest.approx(plain_top[0][1], abs=1e-6) and penalized_lp < plain_lp
    outputs = {}
    for logprobs in (5, None):
        greedy_only = _engine()
        calls, prepare = [], greedy_only.runner.prepare

        def recording(batches, *args, prepare=prepare, calls=calls, **kwargs):  # (a prompt chunk in it, sampled)
            prepared = prepare(batches, *args, **kwargs)
            calls.append((any(n > 1 for b in batches for n in b.num_new), prepared.sampled))
            return prepared

        greedy_only.runner.prepare = recording
        params = SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=logprobs)
        outputs[logprobs] = greedy_only.generate([REPEATS, PROMPTS[1]], params)
        assert (True, True) in calls and (True, False) not in calls
        assert ((False, False) in calls) == (logprobs is None) and ((False, True) in calls) == (logprobs is not None)
        sampled_keys = {sampled for *_, sampled in greedy_only.runner.dispatched_keys}  # continued calls too
        assert sampled_keys == ({False, True} if logprobs is None else {True})
        if logprobs is not None:
            assert all(len(o.logprobs) == 4 for o in outputs[logprobs])
    assert [o.output_ids for o in outputs[5]] == [o.output_ids for o in outputs[None]]


def test_greedy_tokens_are_the_same_when_every_call_runs_the_sampler():
    # The sampled program's greedy rows are exact: running every call on it (as a greedy decode
    # call does when a request asks for log-probabilities) changes no token.
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompts = [REPEATS, PROMPTS[1], list(range(50, 80)), [7]]
    argmax_decodes = _engine().generate(prompts, params)
    forced, calls = _engine(), []
    prepare = forced.runner.prepare

    def sampled_always(*args, **kwargs):
        prepared = prepare(*args, **kwargs)
        calls.append(prepared.sampled)
        return dataclasses.replace(prepared, sampled=True)

    forced.runner.prepare = sampled_always
    sampled_decodes = forced.generate(prompts, params)
    assert False in calls  # a decode call would have run the argmax alone
    assert [o.output_ids for o in argmax_decodes] == [o.output_ids for o in sampled_decodes]
