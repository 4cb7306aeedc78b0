"""Block allocator, scheduler (continuous batching, chunked prefill, preemption) and sampling,
without a model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.serving import BlockAllocator, OutOfBlocksError, Request, SamplingParams, Scheduler
from attn_jax.serving.sampling import PROMPT_SEEN, apply_penalties, sample_tokens


def test_allocator_allocates_frees_and_reuses():
    a = BlockAllocator(4)
    first = a.allocate(3)
    assert sorted(first) == [0, 1, 2] and a.num_free == 1
    a.free([first[1]])
    assert a.allocate(1) == [first[1]]  # the page freed last is reused first
    assert a.num_used == 3


def test_allocator_out_of_blocks_takes_nothing():
    a = BlockAllocator(2)
    a.allocate(1)
    with pytest.raises(OutOfBlocksError, match="cannot allocate 2 KV cache pages: 1 of 2 are free"):
        a.allocate(2)
    assert a.num_free == 1


@pytest.mark.parametrize(
    ("blocks", "match"),
    [([0], "cannot free page 0: it is free already"), ([7], r"outside \[0, 2\)"), ([1, 1], "same page twice")],
)
def test_allocator_bad_free(blocks, match):
    a = BlockAllocator(2)
    a.allocate(2 if blocks == [1, 1] else 0)
    with pytest.raises(ValueError, match=match):
        a.free(blocks)


def test_allocator_bad_counts():
    with pytest.raises(ValueError, match="num_blocks=0 must be a positive integer"):
        BlockAllocator(0)
    with pytest.raises(ValueError, match="n=-1 must be a non-negative int"):
        BlockAllocator(1).allocate(-1)


def _request(rid: str, prompt_len: int, new: int = 4) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=new), seed=0)


def _run_step(scheduler: Scheduler, batch) -> None:
    """What the engine does after a step: count the tokens, append one sampled token."""
    for r, n in zip(batch.requests, batch.num_new, strict=True):
        r.num_computed += n
        if r.num_computed == r.num_tokens:
            r.output_ids.append(7)
            if len(r.output_ids) == r.params.max_new_tokens:
                scheduler.finish(r, "length")


def test_chunked_prefill_under_token_budget_and_continuous_batching():
    s = Scheduler(BlockAllocator(32), block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    a, b = _request("a", 10), _request("b", 3)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == ["a"] and batch.num_new == [8]  # a's first chunk
    _run_step(s, batch)
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == ["a", "b"] and batch.num_new == [2, 3]
    _run_step(s, batch)
    c = _request("c", 2)
    s.add(c)  # arrives while a and b decode
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == ["a", "b", "c"] and batch.num_new == [1, 1, 2]
    assert len(a.blocks) == 3 and len(b.blocks) == 1  # ceil(11 / 4), ceil(4 / 4)
    assert len({*a.blocks, *b.blocks, *c.blocks}) == len(a.blocks) + len(b.blocks) + len(c.blocks)


def test_max_num_seqs_limits_admission():
    s = Scheduler(BlockAllocator(32), block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        s.add(_request(f"r{i}", 3))
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == ["r0", "r1"] and len(s.waiting) == 1


def test_requests_with_penalties_own_a_count_slot_while_running():
    """A slot of the device's token counts per running request with penalties: distinct,
    taken at admission (with the tokens known then), given back on finish and preemption."""
    s = Scheduler(BlockAllocator(4), block_size=4, max_num_seqs=3, max_num_batched_tokens=64)
    pen = SamplingParams(max_new_tokens=8, presence_penalty=0.5)
    a, b = (Request(rid, list(range(1, 9)), pen, seed=0) for rid in "ab")
    plain = _request("plain", 3)
    for r in (a, b, plain):
        s.add(r)
    _run_step(s, s.schedule())  # a and b prefilled (2 pages each; plain waits for pages)
    assert {a.penalty_slot, b.penalty_slot} == {0, 1} and plain.penalty_slot == -1
    assert a.num_counted_inputs == b.num_counted_inputs == 8
    batch = s.schedule()  # a needs a third page: b is preempted and its slot comes back
    assert batch.preempted == [b] and b.penalty_slot == -1
    s.finish(a, "stop")
    assert a.penalty_slot == -1
    s.schedule()
    assert b.penalty_slot in (0, 1, 2) and plain.penalty_slot == -1
    assert b.num_counted_inputs == 9  # its prompt and the token it generated before the preemption


def test_preemption_frees_the_newest_and_recomputes_it():
    s = Scheduler(BlockAllocator(4), block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = _request("a", 8, new=8), _request("b", 8, new=8)
    s.add(a)
    s.add(b)
    _run_step(s, s.schedule())  # both prefilled: 2 pages each, the cache is full
    assert s.allocator.num_free == 0
    batch = s.schedule()  # a's next token needs a third page: b (newest) is preempted
    assert [r.request_id for r in batch.requests] == ["a"] and batch.preempted == [b]
    assert b.num_computed == 0 and b.blocks == [] and b.num_preemptions == 1 and s.waiting[0] is b
    assert len(a.blocks) == 3


def test_waiting_when_the_cache_is_full_and_refusal_when_a_request_can_never_fit():
    s = Scheduler(BlockAllocator(3), block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match=r"needs up to 4 KV cache pages .* but the cache holds 3"):
        s.add(_request("big", 12, new=4))
    s.add(_request("a", 8, new=4))
    s.add(_request("b", 8, new=4))
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == ["a"] and [r.request_id for r in s.waiting] == ["b"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(max_new_tokens=0), "max_new_tokens=0 must be a positive integer"),
        (dict(temperature=-1.0), "temperature=-1.0 must be a finite number >= 0"),
        (dict(temperature=float("inf")), r"temperature=inf must be a finite number >= 0 \(0 = greedy\)"),
        (dict(temperature=float("nan")), "temperature=nan must be a finite number >= 0"),
        (dict(temperature="0.5"), "temperature='0.5' must be a finite number >= 0"),
        (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
        (dict(top_k=-2), "top_k=-2 must be an int >= 0"),
        (dict(seed="x"), r"seed='x' must be an int in \[0, 2\*\*32\) or None"),
        (dict(seed=-1), r"seed=-1 is outside \[0, 2\*\*32\)"),
        (dict(seed=2**32), r"seed=4294967296 is outside \[0, 2\*\*32\)"),
        (dict(seed=np.int64(-5)), r"seed=np.int64\(-5\) is outside \[0, 2\*\*32\)"),
        (dict(top_k=2.0), "top_k=2.0 must be an int >= 0"),
        (dict(presence_penalty=2.5), r"presence_penalty=2.5 must be a number in \[-2, 2\] \(0 = off\)"),
        (dict(frequency_penalty=float("nan")), r"frequency_penalty=nan must be a number in \[-2, 2\]"),
        (dict(frequency_penalty="1"), r"frequency_penalty='1' must be a number in \[-2, 2\]"),
        (dict(repetition_penalty=0), r"repetition_penalty=0 must be a finite number > 0 \(1 = off\)"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty=inf must be a finite number > 0"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_accept_numpy_scalars():
    params = SamplingParams(max_new_tokens=np.int64(4), temperature=np.float32(0.5), top_p=np.float64(0.9),
                            top_k=np.int64(5), seed=np.uint32(2**32 - 1))  # fmt: skip
    assert params == SamplingParams(max_new_tokens=4, temperature=0.5, top_p=float(np.float64(0.9)), top_k=5,
                                    seed=2**32 - 1)  # fmt: skip
    assert [type(x) for x in (params.max_new_tokens, params.temperature, params.top_k, params.seed)] == [
        int,
        float,
        int,
        int,
    ]


def _sample(logits, temperature, top_p=1.0, top_k=0, seed=0, counter=0):
    n, _ = logits.shape
    t, p, k = np.full(n, temperature, np.float32), np.full(n, top_p, np.float32), np.full(n, top_k, np.int32)
    return np.asarray(
        jax.jit(sample_tokens)(
            jnp.asarray(logits, jnp.float32), t, p, k, jnp.full(n, seed, jnp.uint32), jnp.full(n, counter, jnp.int32)
        )
    )


def test_one_sampling_program_serves_every_mix_of_values():
    """Sampling values are data: greedy, unfiltered, top-k and top-p rows (alone or mixed in
    one batch) run through one compiled program, and each row gets what it asked for."""
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((6, 30)).astype(np.float32) * 4
    step = jax.jit(sample_tokens)
    order = np.argsort(-logits, axis=-1)
    mixes = (
        ([0.0] * 6, [1.0] * 6, [0] * 6),  # all greedy
        ([1.0] * 6, [1.0] * 6, [0] * 6),  # sampled, no filter
        ([0.0, 1.0, 0.7, 2.0, 1.0, 0.0], [1.0, 1.0, 0.5, 1.0, 1e-6, 0.3], [0, 2, 0, 1, 0, 5]),  # mixed
    )
    for temps, top_p, top_k in mixes:
        picked = np.asarray(
            step(logits, np.float32(temps), np.float32(top_p), np.int32(top_k), np.arange(6, dtype=np.uint32),
                 np.zeros(6, np.int32))
        )  # fmt: skip
        for row, (t, p, k) in enumerate(zip(temps, top_p, top_k, strict=True)):
            rank = int(np.flatnonzero(order[row] == picked[row])[0])
            if t == 0 or p == 1e-6 or k == 1:
                assert rank == 0, (row, t, p, k)
            elif k:
                assert rank < k
    assert step._cache_size() == 1


def test_top_p_keeps_the_nucleus_within_top_k():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((256, 40)).astype(np.float32) * 3
    order = np.argsort(-logits, axis=-1)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    sorted_probs = np.take_along_axis(probs, order, -1)
    for top_k, top_p in ((0, 0.6), (4, 0.6), (4, 1.0)):
        picked = _sample(logits, 1.0, top_p=top_p, top_k=top_k, seed=3)
        kept = (np.cumsum(sorted_probs, -1) - sorted_probs < top_p) if top_k == 0 else None
        for row, token in enumerate(picked):
            rank = int(np.flatnonzero(order[row] == token)[0])
            if top_k:
                assert rank < top_k
            if kept is not None:
                assert kept[row, rank]


def test_sampling_greedy_top_k_top_p_and_seeds():
    logits = np.random.default_rng(0).standard_normal((64, 50)).astype(np.float32)
    greedy = logits.argmax(-1)
    assert (_sample(logits, 0.0) == greedy).all()
    assert (_sample(logits, 1.0, top_k=1) == greedy).all()
    assert (_sample(logits, 1.0, top_p=1e-6) == greedy).all()
    top3 = np.argsort(-logits, axis=-1)[:, :3]
    picked = _sample(logits, 5.0, top_k=3, seed=1)
    assert all(p in row for p, row in zip(picked, top3, strict=True))
    again = _sample(logits, 5.0, top_k=3, seed=1)
    assert (picked == again).all()  # seeded: reproducible
    assert (_sample(logits, 5.0, seed=1) != _sample(logits, 5.0, seed=2)).any()
    assert (_sample(logits, 5.0, seed=1, counter=0) != _sample(logits, 5.0, seed=1, counter=1)).any()


def _penalized_oracle(logits, generated, in_prompt, presence, frequency, repetition):
    """vLLM's penalties in float64 NumPy (``apply_penalties``' specification)."""
    logits = logits.astype(np.float64)
    seen = (generated > 0) | in_prompt
    factor = np.where(seen, repetition[:, None], 1.0)
    logits = np.where(logits > 0, logits / factor, logits * factor)
    return logits - frequency[:, None] * generated - presence[:, None] * (generated > 0)


def test_penalties_match_a_float64_oracle_and_leave_rows_without_them_exact():
    rng = np.random.default_rng(0)
    n, v = 6, 97
    logits = rng.normal(0, 3, (n, v)).astype(np.float32)
    generated = rng.integers(0, 4, (n, v)) * (rng.random((n, v)) < 0.3)
    in_prompt = rng.random((n, v)) < 0.2
    presence = np.array([0.0, 1.5, -2.0, 0.0, 0.7, 2.0], np.float32)
    frequency = np.array([0.0, 0.0, 0.5, -1.0, 2.0, -2.0], np.float32)
    repetition = np.array([1.0, 1.0, 1.0, 1.3, 0.6, 2.0], np.float32)
    counts = (generated + PROMPT_SEEN * in_prompt).astype(np.int32)
    got = np.asarray(jax.jit(apply_penalties)(logits, counts, presence, frequency, repetition))
    want = _penalized_oracle(logits, generated, in_prompt, presence, frequency, repetition)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(got[0], logits[0])  # penalties off: the logits bit for bit


def test_a_request_waits_a_step_for_the_blocks_a_running_request_completes():
    """A new request whose next block a running request's chunk completes in this step sits
    the step out (the requests behind it are admitted) and takes the block from the cache in
    the next; the running decodes beside it take no pages while their tokens fit."""
    s = Scheduler(BlockAllocator(32), 4, max_num_seqs=4, max_num_batched_tokens=8, enable_prefix_caching=True)
    first = _request("a", 12)  # three blocks, computed in two chunks of 8 and 4
    s.add(first)
    _run_step(s, s.schedule())  # tokens 0-7: blocks 0 and 1
    twin = Request("b", [*first.prompt_ids, 50, 51, 52, 53], SamplingParams(max_new_tokens=4), seed=0)
    other = _request("c", 2)
    s.add(twin)
    s.add(other)
    batch = s.schedule()  # a's last 4 tokens complete block 2, which b's prompt needs after its hits 0 and 1
    assert [r.request_id for r in batch.requests] == ["a", "c"] and batch.num_new == [4, 2]
    _run_step(s, batch)
    pages = list(other.blocks)
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == ["a", "c", "b"]
    assert batch.num_cached_tokens == 12 == twin.num_cached_tokens  # blocks 0, 1 and 2
    assert other.blocks == pages  # c's next token fits in its page
