"""Several HTTP processes over one engine process (``EngineProcess(num_clients=N)``,
``attn-stack serve --api-server-count N``): each client gets its own requests' tokens and
the engine's whole report; a duplicate request id is refused; a client that stops ends its
own requests alone; a real server of 2 HTTP processes answers on both, agrees on the
metrics, and goes down when one of them dies."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import re
import signal
import time

import httpx
import psutil
import pytest

from attn_jax.server.api_servers import default_count
from attn_jax.server.engine_loop import EngineLoop, EngineUnavailableError, GenerationSpec, RequestError
from attn_jax.server.engine_process import EngineProcess
from attn_jax.server.metrics import ServerMetrics
from attn_jax.testing.models import TINY_RANDOM, tiny_random_engine
from tests.server.conftest import Server


def _spec(prompt: list[int], max_tokens: int) -> GenerationSpec:
    return GenerationSpec(prompt=prompt, max_tokens=max_tokens, ignore_eos=True)


def test_two_clients_of_one_engine_process_get_their_own_tokens_and_the_whole_report():
    engine = EngineProcess(
        functools.partial(tiny_random_engine, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64),
        num_clients=2,
    )
    client = engine.client(1)
    with pytest.raises(ValueError, match="client 2: this engine process has clients 1 to 1"):
        engine.client(2)
    first, second = EngineLoop(engine, ServerMetrics("m")), EngineLoop(client, ServerMetrics("m"))
    prompts = [[5, 6, 7, i] for i in range(6)]
    aborted_tokens, counted = [], []

    async def run() -> None:
        aloop = asyncio.get_running_loop()
        first.start(aloop)
        second.start(aloop)
        # A request whose client went away is aborted through its own client's pipe.
        doomed = await second.submit(_spec(prompts[5], 200), "doomed")
        doomed.close()
        for _ in range(500):
            if _aborts(first.metrics):
                break
            await asyncio.sleep(0.01)
        assert _aborts(first.metrics) == 1
        counted.append(first.metrics.generation_tokens._value.get())  # the doomed request's tokens
        # The same prompts through both clients at once: each gets its own, equal, tokens.
        handles = [
            await loop.submit(_spec(p, 12), f"r{i}-{j}")
            for i, p in enumerate(prompts)
            for j, loop in enumerate((first, second))
        ]
        results = await asyncio.gather(*(h.collect() for h in handles))
        assert all(r[1] == 12 and r[2] == "length" for r in results), results
        assert [r[0] for r in results[0::2]] == [r[0] for r in results[1::2]]
        # A request id live on one client is refused to the other.
        live = await first.submit(_spec(prompts[0], 200), "same")
        with pytest.raises(RequestError, match="request id 'same' is in use by another request"):
            await second.submit(_spec(prompts[1], 4), "same")
        # The second client stops: its request ends "abort", the first's runs on to its end.
        other = await second.submit(_spec(prompts[2], 200), "other")
        await asyncio.to_thread(second.stop, 30.0)
        _, tokens, reason, _, _ = await other.collect()
        assert reason == "abort"
        aborted_tokens.append(tokens)
        with pytest.raises(EngineUnavailableError):
            await second.submit(_spec(prompts[3], 4))
        text, tokens, reason, _, _ = await live.collect()
        assert (tokens, reason) == (200, "length")
        assert (await (await first.submit(_spec(prompts[4], 3))).collect())[1] == 3
        await asyncio.to_thread(first.stop, 30.0)

    try:
        asyncio.run(run())
    finally:
        engine.join(5.0)
    # Every round's report went to every client: the first saw each token of both clients; the
    # second, each one until it stopped.
    generated = [m.generation_tokens._value.get() for m in (first.metrics, second.metrics)]
    assert generated[0] == counted[0] + 12 * 12 + aborted_tokens[0] + 200 + 3
    assert counted[0] + 12 * 12 + aborted_tokens[0] <= generated[1] < generated[0]


def _aborts(metrics: ServerMetrics) -> float:
    return metrics._finished.labels("m", "abort")._value.get()


def _sample(text: str, name: str) -> float:
    return float(re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M).group(1))


def test_serve_with_two_http_processes_answers_on_both_and_stops_when_one_dies():
    server = Server("--model", TINY_RANDOM, "--no-warmup", "--max-model-len", "512", "--api-server-count", "2")
    try:
        server.wait_ready()
        assert "2 HTTP processes share port" in server.log()

        def complete(i: int) -> tuple[int, str]:
            with httpx.Client(base_url=server.base_url, timeout=120) as http:  # a connection of its own
                body = {
                    "model": TINY_RANDOM,
                    "prompt": [3, 4, i % 3],
                    "max_tokens": 8,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                choice = http.post("/v1/completions", json=body).json()
                return choice["usage"]["completion_tokens"], choice["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(complete, range(24)))
        assert all(n == 8 for n, _ in results)
        assert len({text for _, text in results}) == 3  # one text per prompt, whichever process served it
        # Each process's /metrics holds the whole engine's tokens; the round delays are each its own.
        seen = set()
        for _ in range(24):
            with httpx.Client(base_url=server.base_url) as http:
                text = http.get("/metrics").text
            seen.add(
                (
                    _sample(text, "attn_stack_generation_tokens_total"),
                    _sample(text, "attn_stack_engine_round_delay_seconds_sum"),
                )
            )
        assert {tokens for tokens, _ in seen} == {24 * 8.0} and len(seen) == 2, seen
        # One HTTP process dies: the server stops rather than leave its share unanswered.
        workers = [p for p in psutil.Process(server.process.pid).children() if p.name() == "attn-stack-http"]
        assert len(workers) == 1, [p.name() for p in psutil.Process(server.process.pid).children()]
        workers[0].send_signal(signal.SIGKILL)
        assert server.process.wait(timeout=60) == 0
        assert re.search(r"HTTP process attn-stack-http-1 exited with code -9 while serving", server.log())
        time.sleep(0.5)
        assert not psutil.pid_exists(workers[0].pid) or workers[0].status() == psutil.STATUS_ZOMBIE
    finally:
        server.close()


def test_the_default_count_is_one_on_the_cpu_and_a_process_per_4_cores_elsewhere():
    assert [default_count("cpu", 64), default_count("gpu", 6), default_count("gpu", 8)] == [1, 1, 2]
    assert [default_count("gpu", 16), default_count("tpu", 224)] == [4, 4]


def test_sigterm_as_soon_as_health_answers_exits_0():
    """The other HTTP process may answer ``/health`` before the parent's uvicorn has its
    signal handlers: a SIGTERM then still shuts down cleanly (it used to kill the parent)."""
    server = Server("--model", TINY_RANDOM, "--no-warmup", "--max-model-len", "512", "--api-server-count", "2")
    try:
        server.wait_ready()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0, server.log()[-3000:]
    finally:
        server.close()
