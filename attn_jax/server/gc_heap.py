"""The server processes' garbage collector: the startup heap frozen, young collections rarer.

CPython's oldest-generation collection walks every container object the process holds:
after a model load and a warm-up that is hundreds of thousands (the weights' and programs'
Python objects), and requests that live for a second or two keep promoting objects into
that generation, so full collections recur while serving, each a stop of the engine's loop
of about 0.1 s. And a round's per-token objects live until the round's message is sent, so
they survive the young collections their own allocations trigger (one per 700) and are
promoted, so the older generations' collections come often too: at 256 requests and 8 steps
per call a round of the core took 13.7 ms on the CPU, 2.85 ms frozen (BENCHMARKS.md, stop 57).

``freeze_startup_heap`` (vLLM's ``freeze_gc_heap``, which its API server and its engine
core call after start-up) collects once, moves every surviving object to the permanent
generation (``gc.freeze``: never walked again; a frozen object that later becomes cyclic
garbage is not reclaimed, which for a server's startup objects, held for its lifetime,
costs nothing), and raises the youngest generation's threshold to ``GEN0_THRESHOLD``
allocations. Called once each process has built what it keeps: the engine process before
it says it is ready, ``attn-stack serve``'s HTTP process before it listens. Never on import,
and never in a process the library does not own (``build_app`` and ``Engine`` leave a
user's process alone).
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 20_000
"""Net container allocations between young collections once frozen (CPython's default: 700)."""


def freeze_startup_heap(gen0_threshold: int = GEN0_THRESHOLD) -> None:
    """Collects, freezes every surviving object out of later collections, and sets the
    youngest generation's threshold to ``gen0_threshold`` (the older ones' stay)."""
    if gen0_threshold < 1:
        raise ValueError(f"gen0_threshold={gen0_threshold} must be >= 1")
    gc.collect()
    gc.freeze()
    gc.set_threshold(gen0_threshold, *gc.get_threshold()[1:])
