"""Python's garbage collections in a process, timed (``gc.callbacks``).

    with GcPauses() as pauses:
        run()
    pauses.summary()   # {"gen0": {"collections": n, "ms": t}, "gen1": ..., "gen2": ...}

``clock`` stamps each collection (an engine's call count, say), so that ``summary(since)``
keeps the collections of one phase of a longer recording (``serve_load.py``'s engine process).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable


class GcPauses:
    """Each garbage collection between ``start`` and ``stop`` (or inside the context): its
    ``clock()`` stamp, generation and wall seconds."""

    def __init__(self, clock: Callable[[], int] = lambda: 0) -> None:
        self.clock = clock
        self.events: list[tuple[int, int, float]] = []  # (stamp, generation, seconds)
        self._start: float | None = None

    def start(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def stop(self) -> None:
        gc.callbacks.remove(self._callback)

    def __enter__(self) -> GcPauses:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.events.append((self.clock(), info["generation"], time.perf_counter() - self._start))

    def summary(self, since: int = 0) -> dict:
        """Per generation, the collections stamped ``since`` or later: how many, their ms."""
        out = {f"gen{g}": {"collections": 0, "ms": 0.0} for g in range(3)}
        for stamp, generation, seconds in list(self.events):
            if stamp >= since:
                entry = out[f"gen{generation}"]
                entry["collections"] += 1
                entry["ms"] += 1e3 * seconds
        return out
