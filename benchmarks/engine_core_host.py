"""The server's engine core on the host alone: microseconds per round and per token.

``attn-stack serve`` runs ``EngineCore`` (``attn_jax/server/engine_core.py``) on the engine
process's main thread, between the engine's steps: each round turns the step's
``TokenRun``s into the pieces each request streams, with its latencies and the round's
message. Here the core drives a stand-in engine whose ``step_runs`` returns a run of
``--steps`` tokens for each of ``--requests`` running requests at once, and no device, so the
figures are the core's own host time (the engine's is ``engine_host_cpu.py``'s). Requests
have no stop strings, echo or log-probabilities unless ``--stop`` gives every request one stop
string (the matcher's path).
``--gc-freeze`` freezes the heap first, as the server's engine process does
(``attn_jax/server/gc_heap.py``); each row counts the garbage collections of its timings.
``--requests 256 --steps 8`` is a round of serve's defaults under 256 clients.

    python benchmarks/engine_core_host.py --requests 64 256
    python benchmarks/engine_core_host.py --requests 256 --steps 8 --gc-freeze
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

from gc_pauses import GcPauses  # benchmarks/, the script's folder
from results_io import add_output_args, output_path, write_json

from attn_jax.server.engine_core import EngineCore, _Live
from attn_jax.server.stop_strings import StopMatcher
from attn_jax.serving.engine import TokenRun


class StandInEngine:
    """What ``EngineCore`` reads of an engine: a call of ``steps`` tokens per request, always busy."""

    tokenizer = None
    num_compilations = 0
    recent_compilations = ()

    def __init__(self, num_requests: int, steps: int) -> None:
        self.runs = [TokenRun(f"r{i}", [42] * steps, ["ab"] * steps, False, None) for i in range(num_requests)]

    def has_unfinished(self) -> bool:
        return True

    def step_runs(self) -> list[TokenRun]:
        return self.runs

    def dispatch_delay(self) -> float:
        return 0.0


def time_rounds(num_requests: int, rounds: int, stop: str | None, steps: int = 1) -> dict:
    """Median microseconds per round over 5 timings of ``rounds`` rounds each."""
    sent = [None]
    core = EngineCore(
        StandInEngine(num_requests, steps), lambda timeout: [], lambda message: sent.__setitem__(0, message)
    )
    for i in range(num_requests):  # admitted, as ``_admit`` records them
        core._live[f"r{i}"] = _Live(f"r{i}", StopMatcher(() if stop is None else (stop,)), 0.0)
    for _ in range(rounds // 10):
        core._round()
    per_round = []
    with GcPauses() as pauses:
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(rounds):
                core._round()
            per_round.append((time.perf_counter() - start) / rounds * 1e6)
    us = statistics.median(per_round)
    return {
        "requests": num_requests, "steps": steps, "stop": stop, "us_per_round": us,
        "us_per_token": us / (num_requests * steps),
        "gc_pauses": pauses.summary(),  # over the 5 timings
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 256], help="running requests (tokens a round)")
    parser.add_argument("--steps", type=int, default=1, help="tokens per request a round (serve's calls: 8)")
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--stop", default=None, help="a stop string every request has (default: none)")
    parser.add_argument(
        "--gc-freeze", action="store_true", help="freeze the heap first, as the server's engine process does"
    )
    add_output_args(parser, "engine_core_host_cpu.json")
    args = parser.parse_args()
    if args.gc_freeze:
        from attn_jax.server.gc_heap import freeze_startup_heap

        freeze_startup_heap()
    rows = []
    for n in args.requests:
        row = time_rounds(n, args.rounds, args.stop, args.steps)
        rows.append(row)
        collections = ", ".join(f"{g} {p['collections']} ({p['ms']:.1f} ms)" for g, p in row["gc_pauses"].items())
        print(
            f"{n:4d} requests x {args.steps} steps: {row['us_per_round']:8.1f} us a round, "
            f"{row['us_per_token']:.2f} us a token; collections {collections}",
            flush=True,
        )
    write_json(
        output_path(args),
        {
            "benchmark": "engine_core_host",
            "python": platform.python_version(),
            "machine": platform.machine(),
            "date": datetime.date.today().isoformat(),
            "gc_freeze": args.gc_freeze,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
