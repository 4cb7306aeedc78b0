"""A request's life in the engine's core on a tiny random model: it leaves every live
structure once its final event is returned (its completion kept in a bounded record),
an abort ends it with one final event, stop strings end it, TTFT and each call's time
are measured when tokens are read back (a model that sleeps in its step shows it), and
a model that is not a ``LlamaModel`` runs through the ``ServingModel`` Protocol."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.metadata import MetadataBuckets
from attn_jax.models.base import ServingModel
from attn_jax.models.llama import LlamaConfig, LlamaModel, init_params
from attn_jax.serving import Engine, SamplingParams
from attn_jax.serving.engine import UnknownRequestError

CONFIG = LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
    eos_token_ids=(1,),
)  # fmt: skip
PARAMS = init_params(CONFIG, seed=3)
PROMPTS = [np.random.default_rng(i).integers(2, 64, n).tolist() for i, n in enumerate((3, 9, 5, 12, 4))]
GREEDY = SamplingParams(max_new_tokens=5, ignore_eos=True)
SLEEP = 0.05  # seconds the slow model's step sleeps


class LetterTokenizer:
    """Token i is one letter; no ``tokenizers`` backend."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i % 26) for i in ids)


class SlowModel:
    """A ``ServingModel`` that is not a ``LlamaModel``: a Llama whose step also sleeps
    ``SLEEP`` seconds on the host (a callback the logits depend on), once per step."""

    def __init__(self, inner: LlamaModel) -> None:
        self.inner = inner
        self.config, self.block_size, self.dtype = inner.config, inner.block_size, inner.dtype

    @property
    def attention_group(self):
        return self.inner.attention_group

    def init_kv_caches(self, num_blocks):
        return self.inner.init_kv_caches(num_blocks)

    def step(self, params, kv_caches, token_ids, positions, attn_metadata, logits_rows):
        logits, kv_caches = self.inner.step(params, kv_caches, token_ids, positions, attn_metadata, logits_rows)

        def sleep(x):
            time.sleep(SLEEP)
            return np.zeros((), np.float32)

        zero = jax.pure_callback(sleep, jax.ShapeDtypeStruct((), jnp.float32), logits[0, 0])
        return logits + zero, kv_caches


class BusyModel(SlowModel):
    """A Llama whose step also runs matmuls on the device (about ``SLEEP`` seconds of CPU
    work, dispatched asynchronously as a GPU step is; a host callback is run inside the call)."""

    def step(self, params, kv_caches, token_ids, positions, attn_metadata, logits_rows):
        logits, kv_caches = self.inner.step(params, kv_caches, token_ids, positions, attn_metadata, logits_rows)
        x = jnp.full((512, 512), 0.01, jnp.float32) + logits[0, 0] * 0
        busy = jax.lax.fori_loop(0, 40, lambda i, y: jnp.tanh(y @ y), x)
        return logits + busy[0, 0] * 0, kv_caches


def _engine(model=None, **kwargs) -> Engine:
    kwargs = dict(dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32), **kwargs)
    return Engine(model or LlamaModel(CONFIG, block_size=4), PARAMS, LetterTokenizer(), **kwargs)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return [c.output_ids for c in _engine(async_scheduling=False).generate(PROMPTS, GREEDY)]


def test_finished_requests_leave_and_the_record_is_bounded(reference):
    engine = _engine(max_finished_requests=2)
    results = engine.generate(PROMPTS, GREEDY)  # generate keeps every completion it returns
    assert [c.output_ids for c in results] == reference
    assert engine.num_live_requests == 0 and not engine._aborted and engine._in_flight is None
    assert list(engine._finished) == [r.request_id for r in results][-2:]  # the latest two finished last here
    kept = results[-1].request_id
    assert engine.completion(kept) == results[-1] and engine.get_request(kept).output_ids == reference[-1]
    with pytest.raises(UnknownRequestError, match="it keeps the last 2 finished ones"):
        engine.completion(results[0].request_id)
    again = engine.add_request(PROMPTS[0], GREEDY, request_id=kept)  # a finished request's id is free again
    assert [e.token_id for e in engine.stream()] == reference[0] and engine.completion(again).output_ids == reference[0]


@pytest.mark.parametrize("steps", [1, 3])
def test_abort_ends_with_one_final_event_then_the_request_leaves(reference, steps):
    engine = _engine(num_scheduler_steps=steps)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS[:3]]
    events = engine.step() + engine.step()
    engine.abort_request(ids[1])
    assert engine.completion(ids[1]).finish_reason == "abort"  # known at once
    events += list(engine.stream())
    ends = [e for e in events if e.request_id == ids[1] and e.finished]
    assert len(ends) == 1 and ends[0].token_id == -1 and ends[0].finish_reason == "abort"
    assert all(not e.finished for e in events if e.request_id == ids[1] and e is not ends[0])
    assert engine.num_live_requests == 0
    assert [engine.completion(i).output_ids for i in (ids[0], ids[2])] == [reference[0], reference[2]]
    assert engine.schedulers[0].allocator.num_free == engine.num_blocks


def test_stop_strings_end_requests(reference):
    text = LetterTokenizer().decode(reference[1])
    stop = text[2:4]  # completed by the request's fourth token
    engine = _engine()
    request_id = engine.add_request(PROMPTS[1], SamplingParams(max_new_tokens=5, ignore_eos=True, stop=stop))
    events = list(engine.stream())
    done = engine.completion(request_id)
    assert done.finish_reason == "stop" and done.text == text[: text.index(stop)]
    assert done.output_ids == reference[1][: len(done.output_ids)] and len(done.output_ids) <= 4
    assert "".join(e.text for e in events) == done.text
    with pytest.raises(ValueError, match="needs text: this engine has no tokenizer"):
        Engine(LlamaModel(CONFIG, block_size=4), PARAMS, max_model_len=32).add_request([3], SamplingParams(stop="x"))
    with pytest.raises(ValueError, match="stop=.* must be a non-empty string"):
        SamplingParams(stop=["ok", ""])


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_calls_are_timed_to_read_back_and_ttft_is_measured(reference, async_scheduling):
    """Each call's time covers its device work (the model sleeps in every step), also the
    prefill call's under asynchronous scheduling; the calls' times add up to no more than
    the wall time."""
    model = SlowModel(LlamaModel(CONFIG, block_size=4))
    assert isinstance(model, ServingModel)
    engine = _engine(model, async_scheduling=async_scheduling, buckets=MetadataBuckets((32,), (4,), (8,)))
    engine.generate(PROMPTS[:2], GREEDY)  # compiles
    before = engine.totals
    start = time.perf_counter()
    results = engine.generate(PROMPTS[:2], GREEDY)
    wall = time.perf_counter() - start
    assert [c.output_ids for c in results] == reference[:2]
    span = engine.totals - before
    calls = engine.stats[len(engine.stats) - span.steps :]
    assert span.compiled_steps == 0 and calls[0].num_prefill_tokens > 0
    for s in calls:  # (a call's share may start a moment after its dispatch: at the previous call's end)
        assert s.seconds >= 0.8 * SLEEP * s.num_steps and s.latency_seconds >= 0.8 * SLEEP * s.num_steps
    assert span.seconds <= wall
    assert 0 < span.prefill_tokens_per_s <= calls[0].num_prefill_tokens / (0.8 * SLEEP)
    for c in results:
        assert SLEEP <= c.ttft_seconds <= c.latency_seconds <= wall


def test_dispatch_delay_lets_the_next_step_wait_while_the_call_in_flight_runs(reference):
    """Every call keeps the device busy for a while: once calls are timed, right after a
    ``step`` the next may wait for part of the call in flight, never longer than calls take,
    and a loop that waits that long gets the same tokens; with nothing in flight it is 0."""
    model = BusyModel(LlamaModel(CONFIG, block_size=4))
    engine = _engine(model, buckets=MetadataBuckets((32,), (4,), (8,)))
    assert engine.dispatch_delay() == 0.0
    engine.generate(PROMPTS[:2], GREEDY)  # compiles, then times the calls
    for prompt in PROMPTS[:2]:
        engine.add_request(prompt, GREEDY)
    delays, outputs = [], {}
    while engine.has_unfinished():
        for event in engine.step():
            outputs.setdefault(event.request_id, []).append(event.token_id)
        delays.append(engine.dispatch_delay())
        time.sleep(delays[-1])
    assert list(outputs.values()) == reference[:2]
    assert delays[-1] == 0.0  # the last step read the last call back: nothing in flight
    longest = max(s.latency_seconds for s in engine.stats)
    assert all(0.0 < d < longest for d in delays[:-1]), (delays, longest)


def test_an_admission_call_behind_a_running_call_has_the_next_one_dispatched_with_it():
    """A request arriving while a multi-step decode runs: the ``step`` that dispatches its
    one-step admission call also dispatches the decode call after it, then reads back the
    two older calls (the decode, then the admission call, so the tokens come in order); every
    request's tokens are a synchronous engine's. A step whose call has nothing in flight
    before it, or is not an admission call, dispatches one call."""
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    expected = [c.output_ids for c in _engine(async_scheduling=False).generate(PROMPTS[:3], params)]
    engine = _engine(num_scheduler_steps=4)
    ids = [engine.add_request(p, params) for p in PROMPTS[:2]]
    early = engine.step_runs() + engine.step_runs()  # the prompts (nothing in flight: one call), their decodes
    assert len(engine.stats) == 2 and engine.stats[-1].num_steps == 4
    ids.append(engine.add_request(PROMPTS[2], params))
    runs = engine.step_runs()
    admission, follow = engine.stats[2:]
    assert admission.num_steps == 1 and admission.num_prefill_tokens == len(PROMPTS[2])
    assert admission.num_decode_tokens == 2 and follow.num_steps == 4 and follow.num_requests == 3
    # Read back in this step: the decode call's 4 tokens a request, then the admission call's.
    assert [(r.request_id, len(r.token_ids)) for r in runs] == [(ids[0], 4), (ids[1], 4)] + [(i, 1) for i in ids]
    outputs = {i: [] for i in ids}
    for r in early + runs + engine.step_runs():  # a step whose call is not an admission call: one call
        outputs[r.request_id] += r.token_ids
    assert len(engine.stats) == 5 and engine.stats[-1].num_prefill_tokens == 0
    while engine.has_unfinished():
        for r in engine.step_runs():
            outputs[r.request_id] += r.token_ids
    assert [outputs[i] for i in ids] == expected


def test_a_failed_follow_up_reads_the_older_call_back(monkeypatch):
    """The call after an admission call fails to dispatch (a device error, say): the step
    raises, the older call's tokens are read back into its requests all the same (none stays
    pending for good), the admission call stays in flight, and later steps finish every
    request with the tokens of an engine that never failed."""
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    expected = [c.output_ids for c in _engine(async_scheduling=False).generate(PROMPTS[:3], params)]
    engine = _engine(num_scheduler_steps=4)
    ids = [engine.add_request(p, params) for p in PROMPTS[:2]]
    engine.step_runs()
    engine.step_runs()
    ids.append(engine.add_request(PROMPTS[2], params))
    dispatch, dispatched = engine.runner.dispatch, []

    def fails_second(prepared):
        dispatched.append(prepared)
        if len(dispatched) == 2:
            raise RuntimeError("device lost")
        return dispatch(prepared)

    monkeypatch.setattr(engine.runner, "dispatch", fails_second)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step_runs()
    monkeypatch.undo()
    first_two = [engine.get_request(i) for i in ids[:2]]
    assert all(len(r.output_ids) == 5 and r.num_pending == 1 for r in first_two)  # 1 + 4 read back; 1 in flight
    while engine.has_unfinished():
        engine.step_runs()
    assert [engine.completion(i).output_ids for i in ids] == expected
