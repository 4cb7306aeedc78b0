"""A long run leaves nothing behind: thousands of requests (greedy and sampled, ending by
length, EOS, stop string, abort and error, some preempted) through one engine on a tiny
random model; afterwards every internal container is back to its starting size (the
bounded completion record and stats window at most their bounds) and every KV page is
back in the allocator.

The default suite runs 300 requests; the issue's 5,000 (several minutes on 2 cores) run
when ``ATTN_STACK_SOAK_REQUESTS`` asks for them (slow tests are part of the default suite,
so this one is opt-in)::

    ATTN_STACK_SOAK_REQUESTS=5000 pytest -n 0 tests/serving/test_engine_soak.py -k many
"""

from __future__ import annotations

import gc
import logging
import os

import numpy as np
import pytest

from attn_jax.metadata import MetadataBuckets
from attn_jax.models.llama import LlamaConfig, LlamaModel, init_params
from attn_jax.serving import Engine, SamplingParams
from attn_jax.serving.metrics import StepStatsLog

CONFIG = LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
    eos_token_ids=(1,),
)  # fmt: skip
PARAMS = init_params(CONFIG, seed=7)
MAX_FINISHED = 50
STATS_WINDOW = 64
_CONTAINERS = (list, dict, set, StepStatsLog)
SOAK_REQUESTS = int(os.environ.get("ATTN_STACK_SOAK_REQUESTS", "0"))


class LetterTokenizer:
    """Token i is one letter (a tokenizer without a ``tokenizers`` backend: the
    detokenizer's window path); token 0 is special (skipped)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i % 26) for i in ids if not (skip_special_tokens and i == 0))


def _sizes(engine: Engine) -> dict[str, int]:
    """len() of every container the engine, its runner, schedulers and allocators hold."""
    owners = {"engine": engine, "runner": engine.runner}
    for i, s in enumerate(engine.schedulers):
        owners[f"scheduler{i}"], owners[f"allocator{i}"] = s, s.allocator
        owners[f"kv_cache_manager{i}"] = s.kv_cache_manager
    sizes = {}
    for name, owner in owners.items():
        for attr, value in vars(owner).items():
            if isinstance(value, StepStatsLog):
                sizes[f"{name}.{attr}"] = sum(1 for _ in value)  # the steps kept (len counts all)
            elif isinstance(value, _CONTAINERS) or hasattr(value, "maxlen"):
                sizes[f"{name}.{attr}"] = len(value)
    return sizes


def _rss_bytes() -> int:
    """This process's resident memory now (Linux), after a garbage collection."""
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _params(rng, i: int) -> SamplingParams:
    kind = i % 5
    if kind == 0:  # ends by EOS (token 1) or length
        return SamplingParams(max_new_tokens=int(rng.integers(1, 6)))
    if kind == 1:  # seeded sampling
        return SamplingParams(max_new_tokens=int(rng.integers(1, 6)), temperature=1.0, top_k=8, seed=i, ignore_eos=True)
    if kind == 2:  # a stop string of one or two letters
        return SamplingParams(max_new_tokens=6, ignore_eos=True, stop=("ab", "c"))
    return SamplingParams(max_new_tokens=int(rng.integers(1, 8)), ignore_eos=True)


@pytest.fixture(autouse=True)
def _quiet():
    """No log records (a preemption logs one; pytest keeps every record it captures, which
    would grow the process, not the engine)."""
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


def _soak(num_requests: int) -> tuple[Engine, dict[str, int], list[tuple[int, int]]]:
    engine = Engine(
        LlamaModel(CONFIG, block_size=4), PARAMS, LetterTokenizer(), max_num_seqs=8, max_num_batched_tokens=32,
        max_model_len=24, num_blocks=12, buckets=MetadataBuckets((32,), (8,), (8,)), num_scheduler_steps=2,
        max_finished_requests=MAX_FINISHED, stats_window=STATS_WINDOW,
    )  # fmt: skip
    start = _sizes(engine)
    rng = np.random.default_rng(0)
    submitted, finished, rss = 0, {}, []
    live: list[str] = []
    while len(finished) < num_requests:
        while submitted < num_requests and len(live) < 12:
            prompt = rng.integers(0, CONFIG.vocab_size, int(rng.integers(1, 12))).tolist()
            request_id = engine.add_request(prompt, _params(rng, submitted))
            if submitted % 23 == 5:
                engine.get_request(request_id).seed = 2**32  # fails alone when scheduled
            live.append(request_id)
            submitted += 1
        events = engine.step()
        if submitted % 17 == 3 and live:
            engine.abort_request(live[0])  # waiting, running, or in a dispatched call
        for e in events:
            if e.finished:
                assert e.request_id not in finished, "a second final event"
                finished[e.request_id] = e.finish_reason
                live.remove(e.request_id)
        if len(finished) // 100 > len(rss):
            rss.append((engine.num_compilations, _rss_bytes()))
    while engine.has_unfinished():
        assert not engine.step()
    reasons = set(finished.values())
    assert reasons == {"stop", "length", "abort", "error"}, reasons
    gc.collect()
    return engine, start, rss


def _check_nothing_left(engine: Engine, start: dict[str, int]) -> None:
    end = _sizes(engine)
    b = engine.runner.buckets  # one exact-bucket record per combination of the engine's buckets, at most
    combinations = len(b.token_buckets) * len(b.request_buckets) * len(b.blocks_per_request_buckets)
    bounded = {"engine._finished": MAX_FINISHED, "engine.stats": STATS_WINDOW, "runner._exact_buckets": combinations}
    bounded["runner.dispatched_keys"] = engine.num_compilations  # one key per compiled step shape
    bounded["runner._table_slots"] = engine.num_compilations  # one per packed layout, at most one per program
    bounded["engine.recent_compilations"] = engine.recent_compilations.maxlen  # the last few, for a server's log
    for i in range(len(engine.schedulers)):  # the prefix cache keeps freed pages, at most every page
        free, evictable = end.pop(f"allocator{i}._free"), end.pop(f"allocator{i}._evictable", 0)
        assert free + evictable == engine.num_blocks, f"allocator{i}: {free} free + {evictable} evictable"
        bounded |= {f"allocator{i}._hash_of": engine.num_blocks, f"allocator{i}._page_of": engine.num_blocks}
    for name, size in end.items():
        if name in bounded:
            assert size <= bounded[name], name
        else:
            assert size == start[name], f"{name}: {start[name]} at the start, {size} after the run"
    assert engine.num_live_requests == 0 and engine._in_flight is None
    for s in engine.schedulers:
        assert s.allocator.num_free == engine.num_blocks and s.allocator.num_used == 0
    assert engine.totals.steps == len(engine.stats) > STATS_WINDOW  # every call counted, the window wrapped
    assert all(s.seconds is not None and s.seconds >= 0 for s in engine.stats)


def test_soak_300_requests_leave_nothing_behind():
    engine, start, _ = _soak(300)
    _check_nothing_left(engine, start)


@pytest.mark.slow
@pytest.mark.skipif(SOAK_REQUESTS < 1000, reason="opt-in: ATTN_STACK_SOAK_REQUESTS=5000 (minutes on 2 cores)")
def test_soak_many_requests_leave_nothing_behind():
    engine, start, rss = _soak(SOAK_REQUESTS)
    _check_nothing_left(engine, start)
    # Resident memory, sampled every 100 requests, grows by at most 5 % between samples with
    # no compilation in between (a compilation keeps its executable: tens of MB); most of
    # the run has none.
    spans: dict[int, list[int]] = {}
    for compilations, size in rss:
        spans.setdefault(compilations, []).append(size)
    assert max(map(len, spans.values())) >= len(rss) // 2, spans
    for sizes in spans.values():
        assert sizes[-1] <= 1.05 * sizes[0], {k: [v >> 20 for v in vs] for k, vs in spans.items()}
