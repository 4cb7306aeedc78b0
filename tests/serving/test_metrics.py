"""The bounded step log keeps absolute step numbers and says when a step has left its
window; running totals add calls and subtract snapshots into rates."""

from __future__ import annotations

import pytest

from attn_jax.serving.metrics import EngineTotals, StepStats, StepStatsLog


def _stats(prefill: int = 0, decode: int = 1, seconds: float = 0.5, compiled: bool = False) -> StepStats:
    return StepStats(
        num_requests=1, num_prefill_tokens=prefill, num_decode_tokens=decode, num_sampled=1, num_steps=1,
        token_bucket=16, host_seconds=0.1, dispatch_seconds=0.01, seconds=seconds, compiled=compiled,
    )  # fmt: skip


def test_log_keeps_the_last_steps_under_their_numbers():
    log = StepStatsLog(3)
    for i in range(5):
        assert log.append(_stats(decode=i)) == i
    assert len(log) == 5 and log.first_index == 2
    assert [s.num_decode_tokens for s in log] == [2, 3, 4]
    assert [s.num_decode_tokens for s in log[3:]] == [3, 4] and log[-1].num_decode_tokens == 4
    log.replace(4, _stats(decode=40))
    log.replace(0, _stats(decode=99))  # left the window: nothing to replace
    assert log[4].num_decode_tokens == 40 and [s.num_decode_tokens for s in log] == [2, 3, 40]
    with pytest.raises(IndexError, match=r"step 1 has left the window of steps \[2, 5\) \(the log keeps the last 3\)"):
        log[1]
    with pytest.raises(IndexError, match=r"step 0 has left the window"):
        log[:]
    with pytest.raises(IndexError, match=r"step 5 is outside the window"):
        log[5]


def test_totals_give_rates_over_a_span():
    totals = EngineTotals().add(_stats(prefill=8, decode=0, compiled=True))  # compiled: not in the rates
    before = totals
    for s in (_stats(prefill=30, decode=2, seconds=0.25), _stats(decode=4, seconds=0.5), _stats(decode=4)):
        totals = totals.add(s)
    span = totals - before
    assert span.steps == 3 and span.compiled_steps == 0 and span.prefill_tokens == 30 and span.decode_tokens == 10
    assert span.prefill_tokens_per_s == 30 / 0.25 and span.decode_tokens_per_s == 8 / 1.0
    assert span.seconds == pytest.approx(1.25) and span.mean_host_ms_per_step == pytest.approx(100.0)
    assert EngineTotals().prefill_tokens_per_s is None and EngineTotals().mean_host_ms_per_step is None
