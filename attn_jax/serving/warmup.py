"""Compiling every step shape an engine can meet before it serves (``Engine.warmup``).

A jitted step compiles once per key: the packed inputs' layout (token, request and page
buckets, and the metadata's structure, which a backend may key on the step's prefill
count and longest prefill, or on cascade attention), the steps per call, and whether the
call samples (``PreparedCall.sampled``: decode batches of greedy rows skip the sampler unless
a request asks for log-probabilities, calls
in which a request computes more than one token always run it; a call with prompt
log-probabilities takes the largest token bucket). Sampling values are per-row data
(``sampling.py``): they never add a program. A compilation inside traffic stalls every
stream for as long as it takes, so a server compiles them all first.

The warm-up does not model each backend's rules. It enumerates batches that cover every
bucket combination the engine's limits allow (each request bucket's fewest and most
requests, and the most beside which a prefill still fits each token bucket: a mixed batch of
a small bucket), crossed with the query-length patterns a
backend could tell apart (decode-only; 1, 2, 4, ... and all requests prefilling; the
longest prefill at 2, 3 and every power of two and one past it, and at the budget;
contexts that fill the page bucket, with and without a prefix every request shares for
cascade attention), each multi-step decode count the engine can choose, greedy and sampled.
``ModelRunner.prepare`` computes each batch's compile key on the host (the same code
traffic runs); each distinct key is compiled (by ``workers`` threads at once: XLA compiles
outside the GIL, so a many-core host compiles that many programs in parallel; when warming
all, from the moment the enumeration first meets it) and then dispatched once with dummy
inputs.
Every dummy request's block table points at one scratch page, which
``ModelRunner.preserving_page`` saves and restores, so no page a request can see (live,
or cached for prefix reuse) is changed.

Example::

    report = engine.warmup()        # before taking requests
    print(report.summary())         # "warmed up 24 step shapes (24 compiled) in 12.3 s ..."
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed

import jax

from attn_jax.metadata import MetadataBuckets
from attn_jax.ops.ragged_paged_attention.config import next_pow2
from attn_jax.platforms import host_cpus
from attn_jax.serving.executable_cache import ExecutableCache
from attn_jax.serving.model_runner import ModelRunner, PreparedCall
from attn_jax.serving.scheduler import MIN_STEPS_CAP, Request, SamplingParams, ScheduledBatch

__all__ = [
    "MAX_WORKERS", "WarmupReport", "candidate_calls", "decode_step_counts", "default_workers", "query_len_patterns",
    "warm_up",
]  # fmt: skip

SCRATCH_PAGE = 0
"""The KV page every dummy request writes (saved and restored around the warm-up)."""


@dataclasses.dataclass(frozen=True)
class WarmupReport:
    """What a warm-up ran: the distinct step shapes (compile keys) it dispatched, the batches
    it enumerated to find them, the compilations that took (0 for shapes already compiled)
    and its wall time; and where the compilations' time went, summed over the programs (the
    threads run at once): tracing and lowering (Python, under the GIL) and XLA's compile."""

    num_shapes: int
    num_probes: int
    num_compilations: int
    seconds: float
    num_skipped: int = 0  # shapes past ``max_shapes``, left to compile when traffic meets them
    workers: int = 1  # threads that compiled at once
    num_loaded: int = 0  # programs loaded from the executable cache (neither traced nor compiled)
    listed: bool = False  # the calls came from the executable cache's list, not an enumeration
    lower_seconds: float = 0.0  # tracing and lowering, summed over the programs compiled
    compile_seconds: float = 0.0  # XLA's compile, summed over the programs compiled

    def summary(self) -> str:
        skipped = f"; {self.num_skipped} rarer shapes skipped (max_shapes)" if self.num_skipped else ""
        loaded = f", {self.num_loaded} loaded from the executable cache" if self.num_loaded else ""
        found = "the executable cache's call list" if self.listed else f"{self.num_probes} candidate batches"
        phases = (
            f" (summed over the programs: tracing and lowering {self.lower_seconds:.1f} s, XLA's compile "
            f"{self.compile_seconds:.1f} s)"
            if self.lower_seconds or self.compile_seconds
            else ""
        )
        return (
            f"warmed up {self.num_shapes} step shapes ({self.num_compilations} compiled by {self.workers} "
            f"thread(s){loaded}, from {found}) in {self.seconds:.1f} s{phases}{skipped}"
        )


MAX_WORKERS = 16
"""The most compile threads ``default_workers`` gives (each holds a program's compiler state):
16 on a 16-core H200 host started ``serve`` in 110 s against 8's 131 (BENCHMARKS.md, stop 67)."""


def default_workers() -> int:
    """Compile threads: one per core this process may use (``platforms.host_cpus``), at most
    ``MAX_WORKERS``."""
    return max(1, min(MAX_WORKERS, host_cpus()))


def _lengths_up_to(limit: int) -> list[int]:
    """2, 3 and each power of two and one past it, up to ``limit``, and ``limit``."""
    out = {2, 3, limit}
    out.update(x for k in range(1, limit.bit_length() + 1) for x in (1 << k, (1 << k) + 1))
    return sorted(x for x in out if 2 <= x <= limit)


def _counts_up_to(n: int) -> list[int]:
    """1, 2, 4, ... up to ``n``, and ``n``."""
    return sorted({1 << k for k in range(n.bit_length()) if 1 << k <= n} | {n})


def query_len_patterns(buckets: MetadataBuckets, max_num_seqs: int, max_num_batched_tokens: int) -> Iterator[tuple]:
    """Query-length tuples (one entry per request) that reach every (token bucket, request
    bucket) pair the limits allow, decode-only or with 1, 2, 4, ... or all requests
    prefilling, the longest prefill at each of ``_lengths_up_to`` the room left."""
    token_buckets = [t for t in buckets.token_buckets]
    request_buckets = [r for r in buckets.request_buckets]
    fit = MetadataBuckets.fit
    seen = set()
    for i, r in enumerate(request_buckets):
        low_r = request_buckets[i - 1] if i else 0
        if low_r >= max_num_seqs:
            break
        # The bucket's fewest and most requests, and for each token bucket the most that leave
        # room for a 2-token prefill beside decodes: a mixed batch (40 decodes and a 10-token
        # chunk in a 64-token bucket) whose bucket's ends hold no mixed batch (1 request, or
        # 64 that fill it with decodes) is still a key of its own.
        counts = {low_r + 1, min(r, max_num_seqs)}
        counts.update(min(r, max_num_seqs, min(t, max_num_batched_tokens) - 1) for t in token_buckets)
        for n in sorted(c for c in counts if c > low_r):
            if n > max_num_batched_tokens:
                continue
            decode = (1,) * n
            if decode not in seen:
                seen.add(decode)
                yield decode
            for j, t in enumerate(token_buckets):
                low_t = token_buckets[j - 1] if j else 0
                high = min(t, max_num_batched_tokens)
                if high <= low_t:
                    break
                for num_prefill in _counts_up_to(n):
                    decodes = n - num_prefill
                    for longest in _lengths_up_to(high - decodes - 2 * (num_prefill - 1)):
                        smallest = decodes + longest + 2 * (num_prefill - 1)  # the others at 2 tokens
                        largest = decodes + longest * num_prefill  # the others at ``longest``
                        total = min(high, largest)
                        if total < smallest or total <= low_t:
                            continue
                        extra, others = total - smallest, []
                        for _ in range(num_prefill - 1):
                            take = min(extra, longest - 2)
                            others.append(2 + take)
                            extra -= take
                        lens = (longest, *others, *(1,) * decodes)
                        if fit(token_buckets, sum(lens), "num_tokens") == t and lens not in seen:
                            seen.add(lens)
                            yield lens


def decode_step_counts(num_scheduler_steps: int, max_model_len: int, min_steps_cap: int) -> list[int]:
    """The steps per call an engine's multi-step decodes can take: its ``num_scheduler_steps``
    capped at the power of two >= the tokens a request has left (never below
    ``min_steps_cap``), over every count of tokens left."""
    counts = {min(num_scheduler_steps, max(next_pow2(left), min_steps_cap)) for left in range(1, max_model_len + 1)}
    return sorted(k for k in counts if k > 1)


def _dummy_batch(query_lens: Sequence[int], capacity: int, block_size: int, params: SamplingParams) -> ScheduledBatch:
    """Requests with these query lengths whose contexts fill ``capacity`` tokens, every page
    of every block table the scratch page (the requests share one prompt list and one block
    list: they are only read)."""
    prompt, blocks = [0] * capacity, [SCRATCH_PAGE] * -(-capacity // block_size)
    requests = []
    for i, q in enumerate(query_lens):
        request = Request(f"warmup-{i}", prompt, params, seed=0)
        request.num_computed = capacity - q
        request.blocks = blocks
        requests.append(request)
    return ScheduledBatch(requests, list(query_lens), [])


def _rows(batch: ScheduledBatch) -> dict[Request, tuple]:
    """Each dummy request's ``request_row``, by request."""
    return {r: ModelRunner.request_row(r, q, {}) for r, q in zip(batch.requests, batch.num_new, strict=True)}


def _call(runner: ModelRunner, batch: ScheduledBatch, rows: dict, num_steps: int, common_pages: int | None):
    """``runner.prepare`` of ``batch`` on every data shard, ``num_steps`` steps, with each
    shard's ``common_pages`` shared pages for cascade attention (None: none)."""
    common = None if common_pages is None else [common_pages] * runner.num_shards
    steps = [[num_steps] * len(batch.requests)] * runner.num_shards
    return runner.prepare([batch] * runner.num_shards, rows, steps, num_steps, common)


def _recipe_call(engine, recipe: list, sampled: bool) -> PreparedCall:
    """The call a ``_probes`` recipe (query lengths, capacity, steps, common pages, prompt
    log-probabilities) makes: ``prepare``'s, or its sampled twin (a greedy decode batch's)."""
    lens, capacity, num_steps, common_pages, prompt_logprobs = recipe
    params = SamplingParams(temperature=0.0, prompt_logprobs=0 if prompt_logprobs else None)
    batch = _dummy_batch(lens, capacity, engine.block_size, params)
    prepared = _call(engine.runner, batch, _rows(batch), num_steps, common_pages)
    return dataclasses.replace(prepared, sampled=True) if sampled else prepared


def _priority(recipe: list, sampled: bool) -> tuple:
    """A call's place in the warm-up's order (lower first): greedy decode batches, then
    prefills (always sampled), then sampled decode batches; without cascade before with,
    prompt log-probabilities last."""
    lens, _, _, common_pages, prompt_logprobs = recipe
    prefill = max(lens) > 1
    return (prompt_logprobs, sampled and not prefill, prefill, common_pages is not None)


def _probes(engine) -> Iterator[tuple[tuple, list, PreparedCall, bool]]:
    """Each candidate batch's calls as ``(priority, recipe, PreparedCall, twin)`` (``_recipe_call``
    makes the same call from the recipe; ``twin``: a greedy decode batch's sampled twin, not a
    batch of its own), keys repeated as the batches meet them (``_keep`` keeps the best placed
    of each)."""
    runner: ModelRunner = engine.runner
    block_size, max_model_len = engine.block_size, engine.max_model_len
    page_buckets = [p for p in engine.buckets.blocks_per_request_buckets]
    max_pages = -(-max_model_len // block_size)
    step_counts = [1]
    if runner.supports_decode_advance:
        step_counts += decode_step_counts(engine.num_scheduler_steps, max_model_len, MIN_STEPS_CAP)
    for lens in query_len_patterns(engine.buckets, engine.max_num_seqs, engine.max_num_batched_tokens):
        decode_only = max(lens) == 1
        for p in page_buckets:
            capacity = min(p * block_size, max_model_len)
            if max(lens) > capacity:
                continue
            batch = _dummy_batch(lens, capacity, block_size, SamplingParams(temperature=0.0))
            rows = _rows(batch)
            for k in step_counts if decode_only else [1]:
                for common in (None, min(p, max_pages)):
                    call = _call(runner, batch, rows, k, common)  # greedy rows; sampled if it holds a prompt chunk
                    recipe = [list(lens), capacity, k, common, False]
                    yield _priority(recipe, call.sampled), recipe, call, False
                    if not call.sampled:  # the same inputs run the sampled program too (greedy rows are exact there)
                        yield _priority(recipe, True), recipe, dataclasses.replace(call, sampled=True), True
            # With prompt log-probabilities: every token row's logits (one step, sampled, the widest table).
            if not decode_only:
                recipe = [list(lens), capacity, 1, None, True]
                prepared = _recipe_call(engine, recipe, False)
                yield _priority(recipe, prepared.sampled), recipe, prepared, False
            if capacity >= max_model_len:
                break


def _enumerate(engine, on_new: Callable[[PreparedCall], None] | None = None) -> tuple[dict, int]:
    """``{key: (priority, recipe, PreparedCall)}`` of every candidate call, and the number of
    candidate batches (a greedy call and its sampled twin are one); ``on_new`` as in
    ``candidate_calls``."""
    calls, num_probes = {}, 0
    for priority, recipe, prepared, twin in _probes(engine):
        num_probes += not twin
        _keep(calls, priority, recipe, prepared, on_new)
    return calls, num_probes


def _keep(calls: dict, priority: tuple, recipe: list, prepared: PreparedCall, on_new=None) -> None:
    """Adds a candidate to ``calls`` (``on_new`` on a key's first candidate), each key kept with
    its best-placed candidate (``_priority``; its recipe is the one the executable cache lists):
    a backend whose decode and prefill batches share a layout (the XLA backend's) gives a greedy
    prefill the sampled decode program, which then warms with the prefills."""
    kept = calls.get(prepared.key)
    if kept is None and on_new is not None:
        on_new(prepared)
    if kept is None or priority < kept[0]:
        calls[prepared.key] = (priority, recipe, prepared)


def candidate_calls(engine, on_new: Callable[[PreparedCall], None] | None = None) -> tuple[dict, int]:
    """The calls ``warm_up`` would compile for ``engine``, by ``PreparedCall.key``:
    ``{key: (priority, PreparedCall)}`` (lower priority first), and the number of candidate
    batches enumerated to find them (a greedy call and its sampled twin are one batch).
    Host work only (tests check that a call's key is among them). ``on_new(prepared)`` is
    called for each key as it is first met (``warm_up`` starts compiling it then)."""
    calls, num_probes = _enumerate(engine, on_new)
    return {key: (priority, prepared) for key, (priority, _, prepared) in calls.items()}, num_probes


def _list_name(engine) -> str:
    """The name the executable cache keeps this engine's call list under: its limits, buckets,
    mesh shape and cascade settings, and the ``ATTN_STACK_*`` settings a builder may read (the
    cache's fingerprint covers the model, devices and sources)."""
    runner = engine.runner
    settings = sorted((k, v) for k, v in os.environ.items() if k.startswith("ATTN_STACK_"))
    parts = (
        engine.max_num_seqs, engine.max_num_batched_tokens, engine.max_model_len, engine.block_size,
        engine.num_scheduler_steps, engine.buckets, runner.num_shards, runner.supports_decode_advance,
        runner.cascade, settings,
    )  # fmt: skip
    return "warmup-calls-" + hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def warm_up(
    engine,
    *,
    max_shapes: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    workers: int | None = None,
    executable_cache: str | os.PathLike | None = None,
) -> WarmupReport:
    """Dispatches (and so compiles) every distinct step shape ``engine`` can meet; see the
    module docstring. ``max_shapes``: warm at most this many, in order of likelihood
    (greedy decode batches, then prefills, then sampled decode batches, without cascade before
    with, and the prefills with prompt log-probabilities last: a program each, which computes
    every token row's logits),
    the rest counted in
    ``WarmupReport.num_skipped``; ``progress(done, total)`` after each shape compiles;
    ``workers``: compile threads (default ``default_workers()``); ``executable_cache``: a
    folder of compiled programs (``ExecutableCache``; one process only) from which programs
    are loaded without tracing, and to which compiled ones are written. The engine must hold
    no request (ValueError)."""
    if engine.has_unfinished() or engine.num_live_requests:
        raise ValueError(
            f"warmup needs an idle engine: {engine.num_live_requests} request(s) are live; warm up before adding any"
        )
    if max_shapes is not None and (isinstance(max_shapes, bool) or not isinstance(max_shapes, int) or max_shapes < 0):
        raise ValueError(f"max_shapes={max_shapes!r} must be an int >= 0 or None (all)")
    workers = default_workers() if workers is None else workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r} must be an int >= 1")
    start = time.perf_counter()
    runner: ModelRunner = engine.runner
    compilations = runner.num_compilations
    runner.compile_guide_writes()  # structured outputs' mask writes: one program, not a step shape
    cache = None
    if executable_cache is not None and jax.process_count() == 1:
        cache = ExecutableCache(executable_cache, runner)
    with ThreadPoolExecutor(workers) as pool:
        futures = []

        def submit(prepared: PreparedCall) -> None:
            if prepared.key not in runner.dispatched_keys:
                futures.append(pool.submit(runner.compile, prepared, cache))

        listed = None if cache is None else cache.load_list(_list_name(engine))
        if listed is not None:  # the call list a full enumeration stored: one call per program
            calls = {}
            for recipe, sampled in listed:
                prepared = _recipe_call(engine, recipe, sampled)
                _keep(calls, _priority(recipe, prepared.sampled), recipe, prepared)
            num_probes = len(listed)
            if max_shapes is None:
                for _, _, prepared in calls.values():
                    submit(prepared)
        else:
            # Warming all: each program compiles (or loads) as soon as the enumeration meets it,
            # beside the rest of the enumeration (host work under the GIL, about 10 s at serve's
            # GPU defaults).
            calls, num_probes = _enumerate(engine, on_new=submit if max_shapes is None else None)
            if cache is not None:
                listing = [[recipe, prepared.sampled] for _, recipe, prepared in calls.values()]
                cache.store_list(_list_name(engine), listing)
        ordered = [prepared for _, _, prepared in sorted(calls.values(), key=lambda x: x[0])]
        chosen = ordered if max_shapes is None else ordered[:max_shapes]
        if max_shapes is not None:
            for prepared in chosen:
                submit(prepared)
        lower_seconds = compile_seconds = 0.0
        for i, future in enumerate(as_completed(futures)):
            lowering, compiling = future.result()
            lower_seconds, compile_seconds = lower_seconds + lowering, compile_seconds + compiling
            if progress is not None:
                progress(i + 1, len(futures))
    with runner.preserving_page(SCRATCH_PAGE):  # each program run once (dispatch-side caches filled)
        for prepared in chosen:
            if prepared.key not in runner.dispatched_keys:
                jax.block_until_ready(runner.dispatch(prepared).tokens)
    seconds = time.perf_counter() - start
    return WarmupReport(
        len(chosen), num_probes, runner.num_compilations - compilations, seconds, len(ordered) - len(chosen), workers,
        0 if cache is None else cache.num_loaded, listed is not None, lower_seconds, compile_seconds,
    )  # fmt: skip
