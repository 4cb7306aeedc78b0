"""``attn-stack serve --shutdown-timeout``: on SIGTERM a stream in flight runs on for the
timeout, then ends with finish reason "abort" and ``[DONE]``, and the process exits 0 well
before the stream would have ended by itself."""

from __future__ import annotations

import json
import signal
import time

import httpx

from attn_jax.testing.models import TINY_RANDOM
from tests.server.conftest import Server, sse_data

ARGS = ["--model", TINY_RANDOM, "--no-warmup", "--max-model-len", "2048", "--num-scheduler-steps", "1"]
TIMEOUT_S = 2.0


def test_sigterm_ends_a_long_stream_after_the_timeout_and_exits_0():
    server = Server(*ARGS, "--shutdown-timeout", str(TIMEOUT_S)).wait_ready()
    body = dict(model=TINY_RANDOM, prompt="hi", max_tokens=2000, temperature=0, stream=True, ignore_eos=True)
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as response:
                data = sse_data(response.iter_lines())
                chunks = [json.loads(next(data))]
                sent = time.monotonic()
                server.process.send_signal(signal.SIGTERM)
                rest = list(data)
                ended = time.monotonic() - sent
        assert rest[-1] == "[DONE]"
        chunks += [json.loads(d) for d in rest[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
        assert len(chunks) < 2000 and TIMEOUT_S - 0.5 < ended < TIMEOUT_S + 10, (len(chunks), ended)
        assert server.process.wait(timeout=30) == 0, server.log()[-3000:]
    finally:
        server.close()
