"""The engine core in a process of its own (``EngineProcess``, what ``attn-stack serve``
runs; the subprocess server tests cover its normal traffic): a factory that fails is the
start error, word for word, and an engine process that dies ends the request in flight
with an error naming its exit code, turns ``/health`` 503 and refuses later requests."""

from __future__ import annotations

import functools

import pytest
from fastapi.testclient import TestClient

from attn_jax.server.app import build_app
from attn_jax.server.engine_process import EngineProcess, EngineStartError
from attn_jax.testing.models import TINY_RANDOM, tiny_random_engine


def test_a_factory_that_fails_is_the_start_error():
    with pytest.raises(EngineStartError, match="invalid literal for int"):
        EngineProcess(functools.partial(int, "not a number"))


def test_an_engine_process_that_dies_fails_its_request_and_the_health_check():
    engine = EngineProcess(
        functools.partial(tiny_random_engine, max_model_len=1024, max_num_seqs=2, max_num_batched_tokens=32)
    )
    assert engine.max_model_len == 1024
    with TestClient(build_app(engine, TINY_RANDOM)) as http:
        assert http.get("/health").status_code == 200
        body = {"prompt": "hello", "max_tokens": 1000, "stream": True, "ignore_eos": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            events = (line for line in response.iter_lines() if line.startswith("data:"))
            assert '"text"' in next(events)
            engine.process.kill()
            rest = list(events)
        assert "the engine process exited with code -9" in rest[-2] and rest[-1] == "data: [DONE]", rest[-2:]
        health = http.get("/health")
        assert health.status_code == 503 and "exited with code -9" in health.json()["error"]["message"]
        later = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert later.status_code == 503
        metrics = http.get("/metrics").text
        assert 'attn_stack_request_success_total{finished_reason="error",model_name="tiny-random"} 1.0' in metrics
