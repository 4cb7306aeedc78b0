"""The HTTP process's own CPU per request and per streamed token, with an engine that answers at once.

``attn-stack serve``'s HTTP process parses and validates each request, submits it, and streams
each token's server-sent event; under a closed loop of equal requests a wave of arrivals meets
that per-request work in series (BENCHMARKS.md, stop 57). This serves the real app
(``build_app``, uvicorn, the heap frozen as ``serve`` freezes it) in a process of its own over a
stand-in engine core (``EngineLoop``'s ``CoreHandle``): it admits each submission in its next
round and hands every live request ``--tokens-per-round`` tokens a round, one round every
``--round-ms``, with each round's message pickled and unpickled as the engine process's pipe
does. No engine, no device: the figures are the HTTP process's alone.

Two closed loops of ``--concurrency`` aiohttp clients (in this process): one token per request
(what a request costs), then ``--max-tokens`` (what a token adds). The server process's CPU
seconds (``/proc``) over each, per request and per token.

    python benchmarks/http_process_cpu.py --concurrency 64 --requests 1024 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import os
import pickle
import platform
import time
import urllib.request

from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder
from serve_load import free_port, thread_cpu_seconds


class StandInCore:
    """An engine core that answers at once: a submission is admitted in the next round, and
    every live request gets ``tokens_per_round`` tokens (" x" each) a round until its
    ``max_tokens``; a round every ``round_ms`` on the event loop, its message pickled."""

    max_model_len = 4096

    def __init__(self, round_ms: float, tokens_per_round: int) -> None:
        self.round_s, self.tokens_per_round = round_ms / 1e3, tokens_per_round
        self.live: dict[str, int] = {}  # request id -> tokens left
        self.arrived: list[tuple[str, int, int]] = []  # (request id, prompt tokens, max tokens)
        self._alive = True

    def start(self, aloop, on_message) -> None:
        self.aloop, self.on_message = aloop, on_message
        aloop.call_later(self.round_s, self._round)

    def send(self, command: tuple) -> None:
        if command[0] == "submit":
            request_id, spec, _ = command[1:]
            self.arrived.append((request_id, len(spec.prompt), spec.max_tokens or 1))
        elif command[0] == "abort":
            self.live.pop(command[1], None)
        elif command[0] == "stop":
            self._alive = False
            self.aloop.call_soon_threadsafe(self.on_message, ("closed", [], [], None, None))

    def alive(self) -> bool:
        return self._alive

    def join(self, timeout: float) -> None:
        pass

    def _round(self) -> None:
        from attn_jax.server.engine_core import RoundReport

        if not self._alive:
            return
        outputs = []
        for request_id, left in list(self.live.items()):
            n = min(self.tokens_per_round, left)
            reason = "length" if n == left else None
            outputs.append((request_id, [(" x", 1, None)] * n, reason, None))
            if reason:
                del self.live[request_id]
            else:
                self.live[request_id] = left - n
        admitted = [(request_id, prompt, None) for request_id, prompt, _ in self.arrived]
        self.live.update((request_id, wanted) for request_id, _, wanted in self.arrived)
        self.arrived = []
        message = ("round", admitted, outputs, RoundReport(emitted_at=time.perf_counter()))
        self.on_message(pickle.loads(pickle.dumps(message)))  # as the engine process's pipe
        self.aloop.call_later(self.round_s, self._round)


def serve(port: int, round_ms: float, tokens_per_round: int) -> None:
    """The server process: the app over a stand-in core, under uvicorn, as ``serve`` runs it."""
    import uvicorn

    from attn_jax.server.app import build_app
    from attn_jax.server.gc_heap import freeze_startup_heap

    app = build_app(StandInCore(round_ms, tokens_per_round), "stand-in")
    freeze_startup_heap()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds so far of process ``pid``'s live threads (Linux ``/proc``)."""
    return sum(thread_cpu_seconds(int(task), pid) or 0.0 for task in os.listdir(f"/proc/{pid}/task"))


async def closed_loop(base_url: str, concurrency: int, requests: int, max_tokens: int) -> int:
    """``requests`` streamed completions from ``concurrency`` clients; the events read."""
    import aiohttp

    body = {"model": "stand-in", "prompt": list(range(128)), "max_tokens": max_tokens, "stream": True}
    events = 0

    async def client(count: int) -> None:
        nonlocal events
        for _ in range(count):
            async with session.post(f"{base_url}/v1/completions", json=body) as response:
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
                async for data in response.content.iter_any():
                    events += data.count(b"data: ")

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        share = [requests // concurrency + (i < requests % concurrency) for i in range(concurrency)]
        await asyncio.gather(*(client(n) for n in share))
    return events


def measure(pid: int, base_url: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    """The server's CPU over one closed loop (after an unmeasured one of a tenth its size)."""
    asyncio.run(closed_loop(base_url, concurrency, max(concurrency, requests // 10), max_tokens))
    cpu, wall = process_cpu_seconds(pid), time.perf_counter()
    events = asyncio.run(closed_loop(base_url, concurrency, requests, max_tokens))
    cpu, wall = process_cpu_seconds(pid) - cpu, time.perf_counter() - wall
    return {"requests": requests, "max_tokens": max_tokens, "events": events, "seconds": wall, "server_cpu_s": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=1024, help="requests of each measured loop")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request of the second loop")
    parser.add_argument("--round-ms", type=float, default=10.0, help="the stand-in core's round period")
    parser.add_argument("--tokens-per-round", type=int, default=8, help="tokens a request gets a round")
    add_output_args(parser, "http_process_cpu.json")
    args = parser.parse_args()
    if min(args.concurrency, args.requests, args.tokens_per_round) < 1 or args.max_tokens < 2:
        parser.error("--concurrency, --requests and --tokens-per-round must be >= 1, --max-tokens >= 2")
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(
        target=serve, args=(port, args.round_ms, args.tokens_per_round), daemon=True
    )
    server.start()
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{base_url}/health", timeout=5).close()
            break
        except OSError:
            if time.monotonic() > deadline or not server.is_alive():
                raise RuntimeError("the stand-in server did not start") from None
            time.sleep(0.2)
    try:
        one = measure(server.pid, base_url, args.concurrency, args.requests, 1)
        many = measure(server.pid, base_url, args.concurrency, args.requests, args.max_tokens)
    finally:
        server.terminate()
        server.join(10)
    per_request = one["server_cpu_s"] / one["requests"]
    per_token = (many["server_cpu_s"] / many["requests"] - per_request) / (args.max_tokens - 1)
    result = {
        "benchmark": "http_process_cpu",
        "concurrency": args.concurrency,
        "round_ms": args.round_ms,
        "tokens_per_round": args.tokens_per_round,
        "one_token": one,
        "many_tokens": many,
        "server_cpu_ms_per_request": 1e3 * per_request,
        "server_cpu_us_per_token": 1e6 * per_token,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "date": datetime.date.today().isoformat(),
    }
    print(
        f"HTTP process CPU: {result['server_cpu_ms_per_request']:.3f} ms a request (one token), "
        f"{result['server_cpu_us_per_token']:.1f} us a further token ({args.concurrency} clients, "
        f"{args.tokens_per_round} tokens a round every {args.round_ms:g} ms); "
        + json.dumps({k: round(v, 2) for k, v in many.items() if isinstance(v, float)})
    )
    write_json(output_path(args), result)


if __name__ == "__main__":
    main()
