"""Device time per call from one CUPTI trace: medians over calls, per kernel class.

``trace_calls`` runs each function ``n`` times under ``jax.profiler.trace`` (CUPTI on a
GPU), waiting for each call and sleeping ``gap_s`` after it so the device idles between
calls; ``group_calls`` splits the GPU streams' events into calls at those idle gaps (the
k-th group is the k-th call) and ``summarize`` gives each call's device span and kernel sum
(every event on the streams: kernels and the memsets a call issues). ``back_to_back_us`` is
the steady state instead: calls issued without waiting, the span of all of them over their
count. No host clock enters the numbers.

    groups = trace_calls({"fa3": lambda: fn(*args)}, n=50)["fa3"]
    summarize(groups)["median_us"]
"""

from __future__ import annotations

import collections
import glob
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax


class DeviceEvent(NamedTuple):
    name: str
    start_ns: float
    duration_ns: float


def gpu_stream_events(profile) -> list[DeviceEvent]:
    """Every event on a GPU plane's ``Stream`` lines of a ``jax.profiler.ProfileData``, by start."""
    out = []
    for plane in profile.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if line.name.startswith("Stream"):
                out.extend(DeviceEvent(ev.name, ev.start_ns, ev.duration_ns) for ev in line.events)
    return sorted(out, key=lambda e: e.start_ns)


def device_timeline(events: Sequence[DeviceEvent], min_gap_us: float = 20.0) -> dict:
    """How busy the device was over ``events`` (sorted by start; every stream, overlaps
    counted once): the window from the first event's start to the last one's end, the time
    some event ran, the idle share, and the idle gaps of at least ``min_gap_us`` (the device
    waiting for the host between calls, where a CUDA graph's launch gaps inside a call are a
    few microseconds) apart from the shorter ones."""
    if not events:
        raise ValueError("device_timeline needs at least one event; got none")
    busy_ns, long_gaps, short_ns = 0.0, [], 0.0
    begin, end = events[0].start_ns, events[0].start_ns + events[0].duration_ns
    first = begin
    for ev in events[1:]:
        if ev.start_ns > end:  # the device idled from ``end`` to this event's start
            busy_ns += end - begin
            gap = ev.start_ns - end
            if gap >= min_gap_us * 1e3:
                long_gaps.append(gap / 1e3)
            else:
                short_ns += gap
            begin = ev.start_ns
        end = max(end, ev.start_ns + ev.duration_ns)
    busy_ns += end - begin
    window = end - first
    return {
        "events": len(events),
        "window_ms": window / 1e6,
        "busy_ms": busy_ns / 1e6,
        "idle_share": 1.0 - busy_ns / window if window > 0 else 0.0,
        "min_gap_us": min_gap_us,
        "long_gaps": len(long_gaps),
        "long_gaps_ms": sum(long_gaps) / 1e3,
        "long_gap_us_p50": statistics.median(long_gaps) if long_gaps else None,
        "long_gap_us_max": max(long_gaps) if long_gaps else None,
        "short_gaps_ms": short_ns / 1e6,
    }


def group_calls(events: Sequence[DeviceEvent], expected: int, min_gap_ns: float) -> list[list[DeviceEvent]]:
    """``events`` (sorted by start) split where the device idled at least ``min_gap_ns``;
    raises RuntimeError unless that makes exactly ``expected`` groups."""
    groups: list[list[DeviceEvent]] = []
    end = None
    for ev in events:
        if end is None or ev.start_ns - end >= min_gap_ns:
            groups.append([])
            end = ev.start_ns
        groups[-1].append(ev)
        end = max(end, ev.start_ns + ev.duration_ns)
    if len(groups) != expected:
        raise RuntimeError(
            f"the trace's GPU events split into {len(groups)} calls at idle gaps of {min_gap_ns / 1e3:.0f} us, "
            f"expected {expected} ({len(events)} events)"
        )
    return groups


def _traced_events(run: Callable[[], None]) -> list[DeviceEvent]:
    """The GPU stream events of ``run()`` under ``jax.profiler.trace``, by start."""
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir):
            run()
        files = glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True)
        if not files:
            raise RuntimeError(f"jax.profiler.trace wrote no .xplane.pb under {log_dir}")
        events = gpu_stream_events(ProfileData.from_file(files[0]))
    if not events:
        raise RuntimeError(f"the trace has no GPU stream events (device: {jax.devices()[0].device_kind})")
    return events


def trace_calls(
    calls: dict[str, Callable[[], object]], n: int = 50, gap_s: float = 1e-3
) -> dict[str, list[list[DeviceEvent]]]:
    """Each of ``calls`` (name -> a thunk returning what to wait on) run once to warm up, then
    ``n`` times each inside one trace; the device events of every call, by name."""
    for call in calls.values():
        jax.block_until_ready(call())

    def run():
        for call in calls.values():
            for _ in range(n):
                jax.block_until_ready(call())
                time.sleep(gap_s)

    events = _traced_events(run)
    groups = group_calls(events, n * len(calls), min_gap_ns=gap_s * 1e9 / 3)
    return {name: groups[i * n : (i + 1) * n] for i, name in enumerate(calls)}


def back_to_back_us(call: Callable[[], object], n: int = 50) -> float:
    """Device microseconds per call when ``n`` calls of ``call`` are issued without waiting,
    the host running ahead as it does through a model's layers: the span of all their GPU
    events over ``n``. Unlike ``trace_calls``' spans, a launch gap between a call's kernels
    that the host hides behind the device's earlier work does not count; but it cannot go
    below the host's dispatch rate, so for a call whose dispatch takes longer than its
    kernels it times the host. Only the last call's result is waited on (a thunk may donate
    the previous one's buffers)."""
    jax.block_until_ready(call())

    def run():
        last = None
        for _ in range(n):
            last = call()
        jax.block_until_ready(last)

    events = _traced_events(run)
    return (max(e.start_ns + e.duration_ns for e in events) - events[0].start_ns) / 1e3 / n


def with_back_to_back(summary: dict, call: Callable[[], object], n: int = 50) -> dict:
    """``summary`` (of isolated calls) with ``back_to_back_us`` of ``n`` calls of ``call``, or
    ``back_to_back_error`` when that trace fails: the isolated spans stand without it."""
    try:
        summary["back_to_back_us"] = back_to_back_us(call, n=n)
    except Exception as e:  # noqa: BLE001 - a trace that cannot run must not lose the other timings
        summary["back_to_back_error"] = f"{type(e).__name__}: {e}"[:300]
    return summary


def summarize(groups: list[list[DeviceEvent]], classes: Sequence[tuple[str, str]] = ()) -> dict:
    """Per-call device microseconds over calls: ``median_us`` (and mean, min, max) of each call's
    span, from its first event's start to its last event's end, which counts launch gaps
    between its kernels once and overlapping kernels (programmatic dependent launch) once;
    ``median_kernel_sum_us``: of the sum of its events' durations. With ``classes`` ((class,
    substring of the lowercased event name), first match wins, else "other"), each class's
    median and mean sum too."""
    spans = [(max(e.start_ns + e.duration_ns for e in g) - min(e.start_ns for e in g)) / 1e3 for g in groups]
    sums = [sum(e.duration_ns for e in g) / 1e3 for g in groups]
    out = {"calls": len(groups), "median_us": statistics.median(spans), "mean_us": statistics.fmean(spans),
           "min_us": min(spans), "max_us": max(spans), "median_kernel_sum_us": statistics.median(sums),
           "events_per_call": len(groups[0])}  # fmt: skip
    if classes:
        per = collections.defaultdict(lambda: [0.0] * len(groups))
        for i, g in enumerate(groups):
            for e in g:
                cls = next((c for c, sub in classes if sub in e.name.lower()), "other")
                per[cls][i] += e.duration_ns / 1e3
        out["median_us_by_class"] = {c: statistics.median(v) for c, v in sorted(per.items())}
        out["mean_us_by_class"] = {c: statistics.fmean(v) for c, v in sorted(per.items())}
    return out
