"""An engine step that fails as a whole (not one request's failure, which the engine
contains): the request in flight gets a 500 naming the failure, ``/health`` turns 503,
and later requests get 503 instead of hanging. In-process (FastAPI's TestClient runs
the app's lifespan, so the engine thread starts and stops with it); the failure is
injected before anything compiles."""

from __future__ import annotations

from fastapi.testclient import TestClient

from attn_jax.server.app import build_app
from attn_jax.testing.models import TINY_RANDOM, tiny_random_engine


def test_a_failed_engine_step_fails_its_requests_and_the_health_check():
    engine = tiny_random_engine(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16)

    def broken_step():
        raise RuntimeError("device lost")

    engine.step_runs = broken_step
    with TestClient(build_app(engine, TINY_RANDOM)) as http:
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
        assert r.status_code == 500
        assert (
            r.json()["error"]["type"] == "server_error" and "RuntimeError: device lost" in r.json()["error"]["message"]
        )
        health = http.get("/health")
        assert health.status_code == 503 and "device lost" in health.json()["error"]["message"]
        later = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert later.status_code == 503 and "device lost" in later.json()["error"]["message"]
        metrics = http.get("/metrics").text
        assert 'attn_stack_request_success_total{finished_reason="error",model_name="tiny-random"} 1.0' in metrics
