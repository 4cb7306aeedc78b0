"""``StepHistogram`` exposes what ``prometheus_client.Histogram`` exposes for the same values."""

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from attn_jax.server.metrics import INTER_TOKEN_BUCKETS, StepHistogram


def _samples(registry: CollectorRegistry) -> tuple[list[str], float]:
    """The exposition's sample lines but ``_created`` (a timestamp) and ``_sum``, and the sum."""
    lines = [line for line in generate_latest(registry).decode().splitlines() if not line.startswith("#")]
    (total,) = [float(line.split()[-1]) for line in lines if "_sum" in line]
    return [line for line in lines if "_created" not in line and "_sum" not in line], total


def test_matches_prometheus_histogram_on_bounds_and_between():
    rng = np.random.default_rng(0)
    values = [*INTER_TOKEN_BUCKETS, 0.0, 1e-9, 3.0, 1e9, *rng.exponential(0.01, 500).tolist()]
    ours, stock = CollectorRegistry(), CollectorRegistry()
    histogram = StepHistogram("x_seconds", "doc", INTER_TOKEN_BUCKETS, {"model_name": "m"}, ours)
    reference = Histogram("x_seconds", "doc", ["model_name"], buckets=INTER_TOKEN_BUCKETS, registry=stock).labels("m")
    histogram.observe_many(values[:7])
    histogram.observe_many([])
    for v in values[7:12]:
        histogram.observe(v)
    histogram.observe_many(np.asarray(values[12:]))
    for v in values:
        reference.observe(v)
    (lines, total), (lines_ref, total_ref) = _samples(ours), _samples(stock)
    assert lines == lines_ref
    assert total == pytest.approx(total_ref, rel=1e-12)


@pytest.mark.parametrize("buckets", [(), (0.2, 0.1), (0.1, 0.1)])
def test_refuses_buckets_that_are_not_increasing(buckets):
    with pytest.raises(ValueError, match="distinct and increasing"):
        StepHistogram("y", "doc", buckets, {}, CollectorRegistry())
