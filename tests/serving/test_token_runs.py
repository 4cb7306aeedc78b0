"""``Engine.step_runs``: a request's tokens of a K-step call come as one ``TokenRun`` (what
the server's engine core takes), holding exactly what ``step``'s per-token events hold:
the same ids and texts in order, a request's end on its last token (a run cut at its
``max_new_tokens`` or at a stop string inside the call), log-probabilities per token, and a
run of no tokens for an abort."""

from __future__ import annotations

from attn_jax.serving import SamplingParams, TokenRun
from attn_jax.serving.engine import TokenEvent, token_events
from attn_jax.testing.models import tiny_random_engine

K = 4


def _engine():
    return tiny_random_engine(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, num_scheduler_steps=K)


def _drain(engine) -> list[TokenRun]:
    runs = []
    while engine.has_unfinished():
        runs += engine.step_runs()
    return runs


def test_runs_group_a_calls_tokens_and_say_what_the_events_say():
    params = [
        SamplingParams(max_new_tokens=10, ignore_eos=True),  # 10 = 1 (the prompt's call) + 4 + 4 + 1: cut inside a call
        SamplingParams(max_new_tokens=9, ignore_eos=True, logprobs=2),
        SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.8, seed=3),
    ]
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    engine = _engine()
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    runs = _drain(engine)
    assert max(len(r.token_ids) for r in runs) == K  # the decode calls' runs hold K tokens
    events = token_events(runs)
    # The same requests through step(): one event per token, equal field for field.
    engine = _engine()
    assert [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)] == ids
    stepped: list[TokenEvent] = []
    while engine.has_unfinished():
        stepped += engine.step()
    assert events == stepped
    for request_id, sp in zip(ids, params, strict=True):
        mine = [r for r in runs if r.request_id == request_id]
        assert sum(len(r.token_ids) for r in mine) == sp.max_new_tokens
        assert [r.finished for r in mine] == [False] * (len(mine) - 1) + [True] and mine[-1].finish_reason == "length"
        assert all(len(r.texts) == len(r.token_ids) for r in mine)
        completion = engine.completion(request_id)
        assert [t for r in mine for t in r.token_ids] == completion.output_ids
        assert "".join(t for r in mine for t in r.texts) == completion.text
        if sp.logprobs is not None:
            scores = [s for r in mine for s in r.logprobs]
            assert len(scores) == sp.max_new_tokens and all(len(top) == 2 for _, top in scores)
            assert tuple(scores) == completion.logprobs
        else:
            assert all(r.logprobs is None for r in mine)


def test_an_abort_is_a_run_of_no_tokens():
    engine = _engine()
    request_id = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=100, ignore_eos=True))
    first = engine.step_runs() + engine.step_runs()
    assert first and all(not r.finished for r in first)
    engine.abort_request(request_id)
    runs = _drain(engine)
    assert runs[-1] == TokenRun(request_id, [], [], True, "abort")
    assert token_events([runs[-1]]) == [TokenEvent(request_id, -1, "", True, "abort")]


def test_one_step_calls_of_untokenized_requests_end_as_tokenized_ones_do():
    """A one-step call appends a plain token inline (``Engine._resolve``: no text, grammar or
    log-probabilities, and nothing ends); every other token goes through ``_append_run``. With
    no tokenizer the inline path runs; with one every token takes ``_append_run``: the same
    tokens, ends at EOS and at ``max_new_tokens``, and the same runs."""
    from attn_jax.models.llama import init_params
    from attn_jax.serving import Engine
    from attn_jax.testing.models import tiny_random_config

    limits = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32)
    tokenized = tiny_random_engine(**limits)
    config = tiny_random_config(tokenized.model.config.vocab_size)
    plain = Engine.from_llama(config, init_params(config, seed=0), None, **limits)
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16]]
    free = SamplingParams(max_new_tokens=12, ignore_eos=True)
    found = [c.output_ids for c in plain.generate(prompts, free)]
    assert found == [c.output_ids for c in tokenized.generate(prompts, free)]
    eos = found[1][5]  # the second request's sixth token ends it (and any other that samples it)
    params = [free, SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=7), free]
    results = []
    for engine in (plain, tokenized):
        engine.eos_token_ids = {eos}
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        runs = _drain(engine)
        ends = [(c.output_ids, c.finish_reason) for c in map(engine.completion, ids)]
        results.append(([(r.token_ids, r.finished, r.finish_reason) for r in runs], ends))
    assert results[0] == results[1]
    ends = results[0][1]
    assert ends[1] == (found[1][: found[1].index(eos) + 1], "stop") and ends[2][1] in ("stop", "length")
    assert ends[0] == (found[0], "length")
