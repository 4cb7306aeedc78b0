"""Structured outputs through the engine (``SamplingParams.json_schema``,
``serving/structured_output.py``): even a model of random weights writes JSON its schema
accepts, greedy or seeded (a seeded guided request gives the same tokens alone or in a
batch), an unguided request beside guided ones keeps its tokens bit for bit and its
multi-step calls (a guided request takes one step of every other one: no call waits for
its token), a guided
request short of tokens ends with "length", a grammar failure ends its request alone, and
guided calls run only programs the warm-up compiles (no new step shape)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from attn_jax.metadata import MetadataBuckets
from attn_jax.serving import SamplingParams
from attn_jax.serving.sampling import apply_guides
from attn_jax.serving.structured_output import compile_json_schema
from attn_jax.serving.warmup import candidate_calls
from attn_jax.testing.models import tiny_random_engine

# One bucket per axis: a few programs; multi-step decodes (4) for the unguided calls.
LIMITS = dict(
    max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96, num_scheduler_steps=4,
    buckets=MetadataBuckets((32,), (4,), (6,)),
)  # fmt: skip
OK = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
COLOR = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}
PROMPT = "Answer in JSON:"


@pytest.fixture(scope="module")
def engine():
    return tiny_random_engine(**LIMITS)


def _guided(schema: dict, n: int = 24, **kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, json_schema=json.dumps(schema), **kwargs)


def test_guided_output_matches_the_schema_and_unguided_rows_keep_their_tokens(engine):
    (alone,) = engine.generate([PROMPT], SamplingParams(max_new_tokens=20))
    (seeded_alone,) = engine.generate(["Hello"], _guided(COLOR, temperature=1.0, seed=3))
    params = [_guided(OK), SamplingParams(max_new_tokens=20), _guided(COLOR, temperature=1.0, seed=3)]
    first = len(engine.stats)
    got = engine.generate([PROMPT, PROMPT, "Hello"], params)
    # Beside guided requests (one step of each call), the unguided one kept its multi-step calls:
    # a 4-step call sampled 4 + 1 + 1 tokens.
    calls = engine.stats[first:]
    assert any(s.num_steps == 4 and s.num_sampled == 6 for s in calls)
    # ... and no call waited for a guided token's read-back: a guided request sits out the call
    # dispatched while its token is pending, so no two 4-step calls in a row hold both.
    assert not any(a.num_sampled == b.num_sampled == 6 for a, b in itertools.pairwise(calls) if a.num_steps == 4)
    assert got[1].output_ids == alone.output_ids  # unguided beside guided rows: bit for bit
    assert got[2].output_ids == seeded_alone.output_ids  # seeded and guided: the same in any batch
    ok, color = json.loads(got[0].text), json.loads(got[2].text)
    assert set(ok) == {"ok"} and isinstance(ok["ok"], bool) and got[0].finish_reason == "stop"
    assert set(color) == {"color", "ok"} and color["color"] in COLOR["properties"]["color"]["enum"]
    assert engine.eos_token_ids.isdisjoint(got[0].output_ids)  # ended by the grammar, not by EOS
    # Every guided call ran a program the warm-up compiles: structured outputs add no step shape.
    assert engine.runner.dispatched_keys <= set(candidate_calls(engine)[0])


def test_json_object_and_a_short_guided_request(engine):
    short, whole = engine.generate(
        [PROMPT, PROMPT], [_guided(OK, n=3), SamplingParams(max_new_tokens=40, json_schema='{"type": "object"}')]
    )
    assert short.finish_reason == "length" and len(short.output_ids) == 3 and short.text.startswith("{")
    assert whole.finish_reason == "stop" and isinstance(json.loads(whole.text), dict)


def test_a_grammar_failure_ends_its_request_alone(engine):
    (want,) = engine.generate([PROMPT], SamplingParams(max_new_tokens=6))
    bad = engine.add_request(PROMPT, _guided(OK))
    good = engine.add_request(PROMPT, SamplingParams(max_new_tokens=6))

    def refuse(token: int) -> bool:
        raise ValueError(f"token {token} was refused by the output grammar")

    engine._requests[bad].guide.advance = refuse
    list(engine.stream())
    failed = engine.completion(bad)
    assert failed.finish_reason == "error" and "refused by the output grammar" in failed.error
    assert engine.completion(good).output_ids == want.output_ids


def test_bad_schemas_are_refused_naming_json_schema(engine):
    for schema, words in (
        ('{"type": "foo"}', "Invalid type"),
        ("[1, 2]", "must be a JSON object"),
        ("{not json", "is not JSON text"),
    ):
        with pytest.raises(ValueError, match="json_schema") as e:
            engine.add_request(PROMPT, SamplingParams(json_schema=schema))
        assert words in str(e.value), schema
    with pytest.raises(ValueError, match="json_schema=.* must be a JSON Schema as JSON text"):
        SamplingParams(json_schema=OK)
    assert compile_json_schema(json.dumps(OK))


def test_apply_guides_masks_guided_rows_only():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 40)).astype(np.float32)
    masks = np.zeros((2, 2), np.int32)
    masks[1, 0], masks[1, 1] = 1 << 3, 1 << (33 - 32)  # tokens 3 and 33
    out = np.asarray(apply_guides(logits, masks, np.asarray([-1, 1, 0], np.int32)))
    assert (out[0] == logits[0]).all()
    assert np.flatnonzero(np.isfinite(out[1])).tolist() == [3, 33] and (out[1, [3, 33]] == logits[1, [3, 33]]).all()
    assert not np.isfinite(out[2]).any()


def test_a_decode_an_admission_call_left_out_holds_back_the_next_call():
    """A budget smaller than the slots: an admission call can leave out a decode whose token is
    pending from the call before (older requests used the budget), and the next call reads its
    inputs from the admission call's output only, so the engine must not dispatch it right
    behind (``Engine.step_runs``): every request finishes as with synchronous scheduling. The
    guided request sits out the next call, which frees the budget the left-out decode takes."""
    limits = dict(max_num_seqs=4, max_num_batched_tokens=3, max_model_len=64)
    plain = SamplingParams(max_new_tokens=8, ignore_eos=True)
    asks = SamplingParams(max_new_tokens=8, ignore_eos=True, prompt_logprobs=1)
    arrivals = [[([5], plain), ([7], _guided(COLOR, n=8))], [([11, 12, 13, 14, 15, 16], asks)], [([9], plain)]]

    def run(**kwargs):
        engine = tiny_random_engine(**limits, **kwargs)
        ids = []
        for step in itertools.count():
            for prompt, params in arrivals[step] if step < len(arrivals) else []:
                ids.append(engine.add_request(prompt, params))
            if step >= len(arrivals) and not engine.has_unfinished():
                break
            engine.step()
        return [engine.completion(i) for i in ids]

    done, expected = run(), run(async_scheduling=False)
    assert [c.finish_reason for c in done] == ["length"] * 4
    assert [c.output_ids for c in done] == [c.output_ids for c in expected]
