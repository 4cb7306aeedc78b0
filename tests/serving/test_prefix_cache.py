"""Automatic prefix caching in the engine, on a tiny random model: the same greedy tokens
with caching off and on (shared system prompt, chunked prefill, preemption, multi-step
decoding), exactly the expected prompt tokens computed, and the page pool's accounting
checked after every step (references = holders, no held page evictable, every page back
in the pool at the end)."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from attn_jax.metadata import MetadataBuckets
from attn_jax.models.llama import LlamaConfig, LlamaModel, init_params
from attn_jax.serving import Engine, SamplingParams

CONFIG = LlamaConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
    eos_token_ids=(1,),
)  # fmt: skip
PARAMS = init_params(CONFIG, seed=7)
BS = 4  # tokens per page
SYSTEM = np.random.default_rng(100).integers(2, 128, 13).tolist()  # 3 full blocks + 1 token
PROMPTS = [SYSTEM + np.random.default_rng(i).integers(2, 128, n).tolist() for i, n in enumerate((1, 6, 3, 11, 4, 8))]
GREEDY = SamplingParams(max_new_tokens=5, ignore_eos=True)


def _engine(caching: bool = True, max_num_seqs: int = 8, max_num_batched_tokens: int = 64, **kwargs) -> Engine:
    """One bucket per shape, so each engine compiles its step once per sampling mode."""
    buckets = MetadataBuckets((max_num_batched_tokens,), (max_num_seqs,), (10,))
    return Engine(
        LlamaModel(CONFIG, block_size=BS), PARAMS, enable_prefix_caching=caching, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=40, buckets=buckets, **kwargs,
    )  # fmt: skip


def _check_pool(engine: Engine) -> None:
    """Each used page's reference count is the number of running requests holding it; no
    held page is evictable; every cached page is the one its hash maps to."""
    for s in engine.schedulers:
        a = s.allocator
        holders = collections.Counter(b for r in s.running for b in r.blocks)
        assert {b: a.ref_count(b) for b in holders} == dict(holders)
        assert a.num_used == len(holders) and a.num_used + a.num_free == a.num_blocks
        assert not any(a.is_evictable(b) for b in holders)
        for r in s.running:
            assert len(r.blocks) == len(set(r.blocks))


def _run(engine: Engine, prompts, params=GREEDY) -> list[list[int]]:
    """Runs ``prompts`` to completion, checking the pool after every step; then every page
    is back (free or evictable). Their ids are left in ``engine.test_ids``."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while engine.has_unfinished():
        engine.step()
        _check_pool(engine)
    assert all(s.allocator.num_used == 0 and s.allocator.num_free == engine.num_blocks for s in engine.schedulers)
    engine.test_ids = ids
    return [engine.completion(i).output_ids for i in ids]


def _cached_tokens(engine: Engine, ids) -> list[int]:
    return [engine.get_request(i).num_cached_tokens for i in ids]


_MARKS: dict[int, int] = {}


def _mark(engine: Engine) -> None:
    """Counts ``_steps`` from here: the engine's bounded stats log keeps absolute step numbers."""
    _MARKS[id(engine)] = len(engine.stats)


def _steps(engine: Engine):
    """The engine's ``StepStats`` since its last ``_mark``."""
    return engine.stats[_MARKS.get(id(engine), 0) :]


def _computed(engine: Engine) -> int:
    return sum(s.num_prefill_tokens + s.num_decode_tokens for s in _steps(engine))


@pytest.fixture(scope="module")
def uncached_engine() -> Engine:
    """Caching off, roomy limits, one step at a time, shared (compiled once)."""
    return _engine(False, async_scheduling=False)


@pytest.fixture(scope="module")
def uncached(uncached_engine):
    """The tokens without caching: ``uncached(prompts, params)``."""
    return lambda prompts, params=GREEDY: _run(uncached_engine, prompts, params)


@pytest.fixture(scope="module")
def reference(uncached) -> list[list[int]]:
    return uncached(PROMPTS)


@pytest.fixture(scope="module")
def cached_engine() -> Engine:
    """One engine with caching on and roomy limits, shared (compiled once)."""
    return _engine()


@pytest.fixture
def fresh(cached_engine) -> Engine:
    """``cached_engine`` with its prefix cache emptied and its step stats cleared."""
    assert cached_engine.reset_prefix_cache()
    _mark(cached_engine)
    return cached_engine


@pytest.mark.parametrize(
    "limits",
    [
        dict(max_num_seqs=2, max_num_batched_tokens=64),  # later requests admitted after the first ones' prefill
        dict(max_num_seqs=3, max_num_batched_tokens=7),  # chunked prefill: hits on a prefix still being filled
        dict(max_num_seqs=3, max_num_batched_tokens=24, num_blocks=12),  # preempts; evicts
        dict(max_num_seqs=2, max_num_batched_tokens=9, num_scheduler_steps=4),
    ],
    ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()),
)
def test_greedy_tokens_identical_with_caching_off_and_on(reference, limits):
    engine = _engine(**limits)
    assert _run(engine, PROMPTS) == reference
    again = _run(engine, PROMPTS)  # now every prompt's system prompt (and more) is cached
    assert again == reference
    stats = engine.prefix_cache_stats
    assert stats.hits > 0 and stats.hits == sum(s.num_cached_tokens for s in _steps(engine))
    assert stats.queries == sum(s.num_queried_tokens for s in _steps(engine)) >= 2 * sum(map(len, PROMPTS))


@pytest.mark.parametrize("caching", [False, True])
def test_prompt_tokens_computed_drop_by_the_cached_blocks(reference, fresh, uncached_engine, caching):
    """The first request caches the system prompt's 3 full blocks; the others, admitted
    together later, each take them (12 tokens) and compute only the rest."""
    engine = fresh if caching else uncached_engine
    _mark(engine)
    queried, hit = engine.prefix_cache_stats.queries, engine.prefix_cache_stats.hits
    first = _run(engine, PROMPTS[:1])
    rest = _run(engine, PROMPTS[1:])
    assert [*first, *rest] == reference
    hits = 12 * (len(PROMPTS) - 1) if caching else 0
    new = GREEDY.max_new_tokens - 1  # the last sampled token is never fed back
    assert _computed(engine) == sum(map(len, PROMPTS)) - hits + len(PROMPTS) * new
    assert engine.prefix_cache_stats.hits - hit == hits == sum(s.num_cached_tokens for s in _steps(engine))
    assert engine.prefix_cache_stats.queries - queried == (sum(map(len, PROMPTS)) if caching else 0)
    assert (engine.schedulers[0].allocator.num_cached > 0) == caching  # off: nothing is hashed
    assert _cached_tokens(engine, engine.test_ids) == [hits // 5] * 5


@pytest.mark.parametrize("steps", [1, 4])
def test_block_boundaries_and_fully_cached_prompts(uncached, fresh, steps):
    """Prompts ending exactly on a block boundary, and prompts whose every full block is
    cached: the last token is always computed again (for its logits), so a cached prompt
    of 8 tokens computes its second block again, one of 9 tokens its last token only."""
    eight, nine, twelve = SYSTEM[:8], SYSTEM[:9], SYSTEM[:12]
    prompts = [eight, nine, twelve, eight, nine, twelve, SYSTEM[:8] + [5, 6, 7, 8]]
    want = uncached(prompts)
    engine = fresh if steps == 1 else _engine(num_scheduler_steps=steps)
    got, cached = [], []
    for p in prompts:  # one at a time: each sees the blocks of those before
        got += _run(engine, [p])
        cached += _cached_tokens(engine, engine.test_ids)
    assert got == want
    assert cached == [0, 8, 8, 4, 8, 8, 8]
    computed = [len(p) - c for p, c in zip(prompts, cached, strict=True)]
    assert _computed(engine) == sum(computed) + len(prompts) * (GREEDY.max_new_tokens - 1)


def test_same_prefix_with_different_sampling_params(uncached, fresh):
    """Cached k/v do not depend on how tokens are sampled: seeded sampling from a cached
    prefix draws the tokens it draws without the cache."""
    params = [
        SamplingParams(max_new_tokens=6, temperature=1.0, top_k=7, seed=3),
        SamplingParams(max_new_tokens=4, temperature=0.7, top_k=5, top_p=0.9, seed=11),
        SamplingParams(max_new_tokens=3, temperature=1.5, top_k=8, top_p=0.5, seed=2**32 - 1),
    ]
    prompts = [PROMPTS[3]] * 3
    want = uncached(prompts, params)
    got, cached = [], []
    for p, sp in zip(prompts, params, strict=True):
        got += _run(fresh, [p], [sp])
        cached += _cached_tokens(fresh, fresh.test_ids)
    assert got == want
    assert cached == [0, 20, 20]


def test_abort_mid_prefill_keeps_what_was_computed(reference):
    """A request aborted while its prompt is prefilled in chunks leaves its computed full
    blocks in the cache (their k/v were dispatched) and every page back in the pool. The
    second step dispatches two chunks (the second behind the first, still running: the next
    is dispatched right behind it), so the abort comes with a call in flight that the step
    dispatched after another."""
    prompt = PROMPTS[3]  # 24 tokens, 6 blocks
    engine = _engine(max_num_seqs=4, max_num_batched_tokens=4)  # asynchronous: aborted with a step in flight
    rid = engine.add_request(prompt, GREEDY)
    engine.step()
    engine.step()
    assert engine.get_request(rid).num_computed == 12 and len(engine.stats) == 3
    engine.abort_request(rid)
    _check_pool(engine)
    assert engine.schedulers[0].allocator.num_used == 0 and engine.schedulers[0].allocator.num_cached == 3
    assert _run(engine, [prompt]) == [reference[3]]
    assert _cached_tokens(engine, engine.test_ids) == [12]


def test_preemption_with_shared_blocks(reference):
    """A cache too small for every request: requests holding shared pages are preempted
    (a shared page stays with its other holders), re-admitted from what is still cached,
    and the tokens do not change."""
    engine = _engine(max_num_seqs=6, max_num_batched_tokens=16, num_blocks=11, num_scheduler_steps=2)
    first = _run(engine, PROMPTS[:1])
    rest = _run(engine, PROMPTS[1:])
    assert [*first, *rest] == reference
    assert sum(engine.get_request(f"req-{i}").num_preemptions for i in range(len(PROMPTS))) > 0
    assert engine.prefix_cache_stats.requests > len(PROMPTS)  # re-admissions look the cache up again


def test_eviction_while_other_requests_hold_pages(uncached):
    """A long request holds most of a small cache while distinct short prompts come and go
    through the rest: their cached pages are evicted to make room (least recently freed
    first), the long request's never; the tokens are those without caching."""
    rng = np.random.default_rng(5)
    prompts = [PROMPTS[3]] + [rng.integers(2, 128, 9).tolist() for _ in range(6)]
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True)] + [SamplingParams(max_new_tokens=3)] * 6
    want = uncached(prompts, params)
    engine = _engine(max_num_seqs=2, num_blocks=12)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    allocator = engine.schedulers[0].allocator
    evictions_while_held = 0
    while engine.has_unfinished():
        engine.step()
        _check_pool(engine)  # the long request's pages among them: referenced, so never evictable
        if engine.get_request(ids[0]).blocks:
            evictions_while_held = allocator.num_evictions
    assert evictions_while_held > 0
    assert [engine.completion(i).output_ids for i in ids] == want


def test_reset_prefix_cache(fresh):
    engine = fresh
    _run(engine, PROMPTS[:1])
    assert engine.schedulers[0].allocator.num_cached > 0
    engine.add_request(PROMPTS[1], GREEDY)
    engine.step()
    assert engine.reset_prefix_cache() is False  # a request holds pages: nothing changes
    assert engine.schedulers[0].allocator.num_cached > 0
    list(engine.stream())
    assert engine.reset_prefix_cache() is True
    assert engine.schedulers[0].allocator.num_cached == 0
    assert engine.schedulers[0].allocator.num_free == engine.num_blocks
    _run(engine, PROMPTS[:1])
    assert _cached_tokens(engine, engine.test_ids) == [0]


@pytest.mark.parametrize(("flag", "enabled"), [([], True), (["--no-prefix-caching"], False)])
def test_generate_cli_passes_the_prefix_caching_flag(monkeypatch, capsys, flag, enabled):
    """``attn-stack generate`` turns prefix caching on unless told otherwise (the engine is
    stopped at construction: nothing loads)."""
    from attn_jax.cli import main

    seen = {}

    def from_gguf(*args, **kwargs):
        seen.update(kwargs)
        raise ValueError("stopped before loading")

    monkeypatch.setattr(Engine, "from_gguf", from_gguf)
    assert main(["generate", "--prompt", "hi", *flag]) == 2
    assert seen["enable_prefix_caching"] is enabled
    assert "stopped before loading" in capsys.readouterr().err
