"""The engine core's round with a call in flight: it waits until ``Engine.dispatch_delay``
has passed, taking the commands that arrive meanwhile, so an arrival joins the next call
(not the one after it); idle, it waits for a command without a limit. A prompt being encoded
holds no running request's steps."""

from __future__ import annotations

import dataclasses
import threading
import time

from attn_jax.models.llama import LlamaConfig, LlamaModel, init_params
from attn_jax.server.engine_core import EngineCore, GenerationSpec
from attn_jax.serving import Engine

CONFIG = LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
    eos_token_ids=(1,),
)  # fmt: skip
SPEC = GenerationSpec(prompt=[3, 4, 5], max_tokens=4, ignore_eos=True)
DELAY = 0.05  # seconds the engine says the next dispatch may wait


def _tokens(messages: list[tuple]) -> dict[str, int]:
    """Each request's tokens over the core's round messages, none of which may carry an error
    or end a request other than by its length."""
    tokens = {}
    for message in messages:
        for request_id, pieces, reason, error in message[2]:
            assert error is None and reason in (None, "length")
            tokens[request_id] = tokens.get(request_id, 0) + sum(n for _, n, _ in pieces)
    return tokens


def test_a_round_waits_for_the_dispatch_time_and_admits_what_arrived_meanwhile():
    engine = Engine(LlamaModel(CONFIG, block_size=4), init_params(CONFIG, seed=0), max_num_seqs=4,
                    max_num_batched_tokens=32, max_model_len=32)  # fmt: skip
    engine.dispatch_delay = lambda: DELAY if engine.has_unfinished() else 0.0
    live_at_step, step = [], engine.step_runs

    def counting_step():
        live_at_step.append(engine.num_live_requests)
        return step()

    engine.step_runs = counting_step
    timeouts, messages, b_before_step = [], [], []

    def receive(timeout):
        timeouts.append(timeout)
        if timeout is None:  # idle: the first request, later the end
            return [("stop",)] if b_before_step else [("submit", "a", SPEC, time.perf_counter())]
        if timeout == 0.0:
            return []
        if not b_before_step:  # "b" arrives halfway through the first wait
            time.sleep(timeout / 2)
            b_before_step.append(len(live_at_step))
            return [("submit", "b", SPEC, time.perf_counter())]
        time.sleep(timeout)
        return []

    EngineCore(engine, receive, messages.append).run()
    assert timeouts[:2] == [None, 0.0] and DELAY - 0.01 < timeouts[2] <= DELAY and 0 < timeouts[3] <= DELAY / 2
    assert live_at_step[b_before_step[0]] == 2  # the step right after "b" arrived had it queued
    assert _tokens(messages) == {"a": 4, "b": 4} and messages[-1][0] == "closed"


def test_a_prompt_being_encoded_does_not_hold_the_running_requests():
    """A submission's prompt is encoded on the core's encoder thread: while "b"'s encoding
    waits (a tokenizer on a long prompt), "a" keeps stepping; "b" is admitted once encoded."""
    engine = Engine(LlamaModel(CONFIG, block_size=4), init_params(CONFIG, seed=0), max_num_seqs=4,
                    max_num_batched_tokens=32, max_model_len=32)  # fmt: skip
    gate = threading.Event()
    engine.encode = lambda prompt, chat=False: (gate.wait(10), [3, 4, 5])[1]
    steps_while_encoding, step = [], engine.step_runs

    def counting_step():
        if not gate.is_set():
            steps_while_encoding.append(engine.num_live_requests)
        return step()

    engine.step_runs = counting_step
    messages, sent = [], []

    def receive(timeout):
        now = time.perf_counter()
        if not sent:
            sent.append("a")
            return [("submit", "a", dataclasses.replace(SPEC, max_tokens=8), now)]
        if len(sent) == 1:
            sent.append("b")
            return [("submit", "b", GenerationSpec(prompt="a long prompt", max_tokens=2, ignore_eos=True), now)]
        if len(steps_while_encoding) >= 3:
            gate.set()
        finished = {o[0] for m in messages for o in m[2] if o[2] is not None}
        return [("stop",)] if finished == {"a", "b"} else []

    EngineCore(engine, receive, messages.append).run()
    assert len(steps_while_encoding) >= 3 and set(steps_while_encoding) == {1}  # "a" alone, stepping
    assert _tokens(messages) == {"a": 8, "b": 2}
