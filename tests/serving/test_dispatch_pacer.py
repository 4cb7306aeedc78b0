"""``DispatchPacer``: the next dispatch may wait until the call in flight is predicted to
end on the device, less the host's cost to dispatch one and a margin, and errs early."""

from __future__ import annotations

import pytest

from attn_jax.serving.dispatch_pacer import DispatchPacer

DECODE, PREFILL = (8, 64), (1, 256)  # (num_steps, token_bucket)


def test_no_delay_until_both_the_call_kind_and_the_host_are_timed():
    pacer = DispatchPacer(margin_s=0.001)
    assert pacer.delay(DECODE, start=10.0, now=10.0) == 0.0
    pacer.observe_device(DECODE, 0.008)
    assert pacer.delay(DECODE, start=10.0, now=10.0) == 0.0  # the host's cost is unknown
    pacer.observe_host(0.002)
    assert pacer.delay(PREFILL, start=10.0, now=10.0) == 0.0  # a kind never timed
    assert pacer.delay(DECODE, start=10.0, now=10.0) == pytest.approx(0.008 - 0.002 - 0.001)


def test_the_guess_errs_early_the_shortest_call_and_the_dearest_host():
    pacer = DispatchPacer(window=3, margin_s=0.0)
    for seconds in (0.009, 0.008, 0.010):
        pacer.observe_device(DECODE, seconds)
    for seconds in (0.001, 0.003, 0.002):
        pacer.observe_host(seconds)
    assert pacer.delay(DECODE, start=5.0, now=5.001) == pytest.approx(0.008 - 0.003 - 0.001)
    assert pacer.delay(DECODE, start=5.0, now=5.006) == 0.0  # late already: dispatch now
    pacer.observe_device(DECODE, 0.012)  # the window keeps the last 3: 0.008 and 0.009 leave
    pacer.observe_device(DECODE, 0.012)
    assert pacer.delay(DECODE, start=5.0, now=5.0) == pytest.approx(0.010 - 0.003)
