"""What the metrics read from the engine beyond its public API, read defensively.

``Engine``'s public API (requests in, ``TokenEvent`` out) has no counts of running and
waiting requests or of KV cache pages in use. They live in the engine's schedulers
(``engine.schedulers[i].running / .waiting / .allocator``) today; this adapter reads
them where it finds them and returns None where it does not (an engine whose internals
moved), so the server keeps serving and only those gauges go quiet. Called only from
the engine's own thread.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class EngineCounts:
    num_running: int | None  # requests scheduled (prefilling or decoding), all data shards
    num_waiting: int | None  # requests queued for a first step or preempted
    kv_blocks_used: int | None  # KV cache pages held by requests, all data shards
    kv_blocks_total: int | None


def _schedulers(engine) -> list | None:
    for owner in (engine, getattr(engine, "core", None), getattr(engine, "engine_core", None)):
        found = getattr(owner, "schedulers", None) if owner is not None else None
        if found is None and owner is not None and getattr(owner, "scheduler", None) is not None:
            found = [owner.scheduler]
        if found is not None:
            return list(found)
    return None


def _count(schedulers: list, name: str) -> int | None:
    try:
        return sum(len(getattr(s, name)) for s in schedulers)
    except (AttributeError, TypeError):
        return None


def _blocks(schedulers: list) -> tuple[int | None, int | None]:
    try:
        allocators = [s.allocator for s in schedulers]
        total = sum(int(a.num_blocks) for a in allocators)
        return total - sum(int(a.num_free) for a in allocators), total
    except (AttributeError, TypeError):
        return None, None


def read_counts(engine) -> EngineCounts:
    """The engine's running / waiting requests and KV pages, each None where not found."""
    schedulers = _schedulers(engine)
    if schedulers is None:
        return EngineCounts(None, None, None, None)
    used, total = _blocks(schedulers)
    return EngineCounts(_count(schedulers, "running"), _count(schedulers, "waiting"), used, total)
