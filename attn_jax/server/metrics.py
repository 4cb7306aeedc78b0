"""Prometheus metrics of one server (``GET /metrics``), in a registry of its own.

Names follow vLLM's (``vllm:`` becomes ``attn_stack_``): every engine round's report
(``record``) sets the request gauges and KV cache pages; TTFT and inter-token latency
are measured when a token reaches the engine core (read back from the device), a
step's values observed at once (``StepHistogram``: one NumPy call per step, not a
locked Python call per token); tokens/s is ``rate(attn_stack_generation_tokens_total[1m])``.

Example::

    metrics = ServerMetrics("SmolLM2-135M-Instruct")
    metrics.generation_tokens.inc(3)
    body = metrics.render()   # the text exposition format
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from attn_jax.server.engine_probe import EngineCounts

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
"""Seconds from a request's arrival to its first token (vLLM's buckets)."""

INTER_TOKEN_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
"""Seconds between a request's consecutive tokens (sub-millisecond for decode on an H100)."""

ROUND_DELAY_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)
"""Seconds from the engine core's sending a round to the HTTP side's taking it."""

E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class StepHistogram(Collector):
    """A Prometheus histogram of one label set that takes many observations in one call
    (``observe_many``): the server observes every token of a step at once. Exposed as
    ``prometheus_client.Histogram`` exposes one (``_bucket`` with ``le``, ``_count``,
    ``_sum``); thread-safe."""

    def __init__(
        self, name: str, documentation: str, buckets: Sequence[float], labels: dict[str, str],
        registry: CollectorRegistry,
    ) -> None:  # fmt: skip
        bounds = [float(b) for b in buckets]
        if bounds != sorted(set(bounds)) or not bounds:
            raise ValueError(f"buckets={list(buckets)} must be distinct and increasing")
        self._name, self._documentation, self._labels = name, documentation, labels
        self._bounds = np.asarray([*bounds, float("inf")])
        self._le = [floatToGoString(b) for b in self._bounds]
        self._counts = np.zeros(len(self._bounds), np.int64)  # per bucket, not cumulative
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float) -> None:
        self.observe_many((value,))

    def observe_many(self, values: Sequence[float]) -> None:
        """Observes each of ``values`` (a value lands in the first bucket whose bound it does
        not exceed, as Prometheus' ``le``)."""
        if not len(values):
            return
        v = np.asarray(values, np.float64)
        counts = np.bincount(np.searchsorted(self._bounds, v, side="left"), minlength=len(self._bounds))
        total = float(v.sum())
        with self._lock:
            self._counts += counts
            self._sum += total

    def collect(self):
        with self._lock:
            cumulative, total = np.cumsum(self._counts), self._sum
        family = HistogramMetricFamily(self._name, self._documentation, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), list(zip(self._le, cumulative.tolist(), strict=True)), total)
        yield family


class ServerMetrics:
    """The server's metrics, each labelled with the served model's name."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"attn_stack_{name}", doc, m, registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the engine's running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting for their first step.")
        self.kv_cache_blocks_used = gauge("kv_cache_blocks_used", "KV cache pages held by requests.")
        self.kv_cache_blocks_total = gauge("kv_cache_blocks_total", "KV cache pages in the engine.")

        def histogram(name: str, doc: str, buckets) -> StepHistogram:
            return StepHistogram(f"attn_stack_{name}", doc, buckets, {"model_name": model_name}, r)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Seconds from a request's arrival to its first token.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Seconds between a request's consecutive tokens.", INTER_TOKEN_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Seconds from a request's arrival to its end.", E2E_BUCKETS
        )
        self.round_delay = histogram(
            "engine_round_delay_seconds",
            "Seconds from the engine core's sending a round (its tokens, admissions) to this server's taking it: "
            "how far the HTTP side runs behind the engine.",
            ROUND_DELAY_BUCKETS,
        )
        self.generation_tokens = Counter(
            "attn_stack_generation_tokens", "Tokens generated (rate() of it is tokens/s).", m, registry=r
        ).labels(model_name)
        self.prompt_tokens = Counter("attn_stack_prompt_tokens", "Prompt tokens admitted.", m, registry=r).labels(
            model_name
        )
        self.step_compilations = Counter(
            "attn_stack_step_compilations", "Step shapes compiled while serving (0 after a complete warm-up).",
            m, registry=r,
        ).labels(model_name)  # fmt: skip
        self._finished = Counter(
            "attn_stack_request_success", "Requests ended, by finish reason.", [*m, "finished_reason"], registry=r
        )
        self._model_name = model_name

    def request_finished(self, reason: str) -> None:
        """Counts one ended request ("stop", "length", "abort" or "error")."""
        self._finished.labels(self._model_name, reason).inc()

    def set_counts(self, counts: EngineCounts, fallback_running: int, fallback_waiting: int) -> None:
        """Sets the gauges from the engine's counts (the server's own where the engine's are unknown)."""
        running = counts.num_running if counts.num_running is not None else fallback_running
        waiting = counts.num_waiting if counts.num_waiting is not None else fallback_waiting
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting)
        if counts.kv_blocks_used is not None:
            self.kv_cache_blocks_used.set(counts.kv_blocks_used)
        if counts.kv_blocks_total is not None:
            self.kv_cache_blocks_total.set(counts.kv_blocks_total)

    def record(self, report, received_at: float | None = None) -> None:
        """Applies one engine round's updates (an ``engine_core.RoundReport``; ``received_at``:
        ``time.perf_counter()`` when its message was taken, for the round's delay)."""
        if report.emitted_at is not None and received_at is not None:
            self.round_delay.observe(received_at - report.emitted_at)
        if report.prompt_tokens:
            self.prompt_tokens.inc(report.prompt_tokens)
        if report.time_to_first_token or report.inter_token_latency:
            self.generation_tokens.inc(len(report.time_to_first_token) + len(report.inter_token_latency))
            self.time_to_first_token.observe_many(report.time_to_first_token)
            self.inter_token_latency.observe_many(report.inter_token_latency)
        for reason, seconds in report.finished:
            self.request_finished(reason)
            self.e2e_request_latency.observe(seconds)
        if report.compilations:
            self.step_compilations.inc(report.compilations)
        if report.counts is not None:
            self.set_counts(report.counts, report.num_started, report.num_waiting)

    def render(self) -> bytes:
        """Every metric in Prometheus' text format (``CONTENT_TYPE``)."""
        return generate_latest(self.registry)
