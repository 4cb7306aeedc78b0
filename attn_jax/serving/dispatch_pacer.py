"""When a server should dispatch its next call: just before the call in flight ends.

Under asynchronous scheduling the engine dispatches call N+1 before it reads call N's
tokens back, so the device never waits for the host. A server that dispatches N+1 as
soon as it has read N-1 back, though, fixes N+1's batch about a whole call before the
device starts it: a request that arrives meanwhile waits for N+1 *and* N+2 (two 8-step
calls at K = 8). ``DispatchPacer`` predicts when the call in flight will end on the
device and says how long the host may still wait, collecting arrivals, before it must
schedule and dispatch the next call to keep the device busy:

    delay = start + min(recent device seconds of calls like it) - max(recent host seconds) - margin - now

``start`` is when the call in flight could start on the device (its dispatch's end or the
previous call's end, whichever is later). A call's device seconds are learnt only where
its end is known exactly (the host was waiting when its tokens came back), and the
minimum and maximum make the guess err towards dispatching early: a late guess leaves
the device idle, an early one only admits an arrival one call later.
"""

from __future__ import annotations

import collections

PACER_WINDOW = 16
"""Calls each estimate looks back over."""

DISPATCH_MARGIN_S = 1e-3
"""Seconds of slack kept between the predicted dispatch and the device running dry."""


class DispatchPacer:
    """Learns calls' device and host seconds; ``delay`` says how long the next dispatch may wait."""

    def __init__(self, window: int = PACER_WINDOW, margin_s: float = DISPATCH_MARGIN_S) -> None:
        self.window, self.margin_s = window, margin_s
        self._device: dict[tuple, collections.deque[float]] = {}
        self._host: collections.deque[float] = collections.deque(maxlen=window)

    def observe_host(self, seconds: float) -> None:
        """A step's host seconds, from its start to its call's dispatch returning."""
        self._host.append(seconds)

    def observe_device(self, key: tuple, seconds: float) -> None:
        """The device seconds of a call of kind ``key`` whose end was seen exactly."""
        durations = self._device.get(key)
        if durations is None:
            durations = self._device[key] = collections.deque(maxlen=self.window)
        durations.append(seconds)

    def delay(self, key: tuple, start: float, now: float) -> float:
        """Seconds the next dispatch may still wait after ``now`` (``time.perf_counter()``)
        with a call of kind ``key`` in flight that could start on the device at ``start``;
        0 while its kind or the host's cost has not been timed."""
        durations = self._device.get(key)
        if not durations or not self._host:
            return 0.0
        return max(0.0, start + min(durations) - max(self._host) - self.margin_s - now)
