"""The prefix cache without a model: the block hash chain, the page pool's reference
counts and LRU eviction, the KV cache manager's lookups, and a randomized run of the
scheduler against a simulated cache that records what every page slot holds."""

from __future__ import annotations

import collections
import hashlib
import logging
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_jax.serving import BlockAllocator, OutOfBlocksError, Request, SamplingParams, Scheduler
from attn_jax.serving.kv_cache_manager import ROOT_HASH, KVCacheManager, block_hashes, hash_block

tokens = st.lists(st.integers(0, 2**40), min_size=0, max_size=40)


@given(tokens, st.integers(1, 8))
def test_hashes_chain_over_full_blocks(ids, bs):
    hashes = block_hashes(ids, bs)
    assert len(hashes) == len(ids) // bs  # a partial last block has no hash
    parent = ROOT_HASH
    for i, h in enumerate(hashes):
        manual = hashlib.sha256(parent + struct.pack(f"<I{bs}q", bs, *ids[i * bs : (i + 1) * bs])).digest()
        assert h == manual == hash_block(parent, ids[i * bs : (i + 1) * bs])
        parent = h
    for k in range(len(hashes) + 1):  # a prefix's hashes are the first ones of the whole
        assert block_hashes(ids[: k * bs], bs) == hashes[:k]


@given(tokens.filter(bool), st.integers(1, 8), st.data())
def test_a_changed_token_changes_its_block_and_every_later_one(ids, bs, data):
    p = data.draw(st.integers(0, len(ids) - 1))
    changed = [*ids[:p], ids[p] + 1, *ids[p + 1 :]]
    before, after = block_hashes(ids, bs), block_hashes(changed, bs)
    k = p // bs
    assert before[:k] == after[:k]
    assert all(a != b for a, b in zip(before[k:], after[k:], strict=True))


def test_extra_keys_and_their_errors():
    ids = list(range(8))
    plain, salted, other = block_hashes(ids, 4), block_hashes(ids, 4, ("a",)), block_hashes(ids, 4, ("b",))
    assert len({plain[0], salted[0], other[0]}) == 3 and len({plain[1], salted[1]}) == 2  # the chain carries it
    assert salted == [hash_block(ROOT_HASH, ids[:4], ("a",)), hash_block(salted[0], ids[4:])]  # one chain, two ways
    assert hash_block(ROOT_HASH, ids[:4], (7,)) != hash_block(ROOT_HASH, ids[:4], ("7",))
    with pytest.raises(TypeError, match=r"extra key 1.5 \(float\) must be a str or an int"):
        hash_block(ROOT_HASH, ids, (1.5,))


def test_evictable_pages_leave_least_recently_freed_first_tail_first():
    a = BlockAllocator(6)
    first, second = a.allocate(3), a.allocate(3)
    for block, name in zip(first + second, "abcdef", strict=True):
        assert a.cache_block(block, name.encode())
    a.free(first)  # a request's pages: its tail is evicted before its head
    a.free(second)
    assert a.evictable_order() == first[::-1] + second[::-1] and a.num_free == 6 and a.num_used == 0
    a.touch([first[0]])  # a cache hit takes it out of the evictable pool
    assert a.ref_count(first[0]) == 1 and first[0] not in a.evictable_order()
    assert a.allocate(2) == [first[2], first[1]]  # evicted: their hashes are gone
    assert a.lookup(b"c") is None and a.lookup(b"b") is None and a.lookup(b"a") == first[0]
    assert a.num_evictions == 2 and a.num_cached == 4


def test_free_pages_go_before_cached_ones_and_references_count():
    a = BlockAllocator(3)
    x, y, z = a.allocate(3)
    a.cache_block(x, b"x")
    a.touch([x])  # a second request shares it
    assert a.ref_count(x) == 2
    a.free([x, y])
    assert a.ref_count(x) == 1 and not a.is_evictable(x)  # still held: never evicted
    assert a.allocate(1) == [y]  # the free page, not a cached one
    a.free([x])
    assert a.is_evictable(x) and a.allocate(1) == [x] and a.lookup(b"x") is None
    with pytest.raises(ValueError, match="cannot touch page 2: it is not in the prefix cache"):
        a.touch([z])


def test_pool_errors():
    a = BlockAllocator(2)
    (x,) = a.allocate(1)
    a.cache_block(x, b"x")
    assert not a.cache_block(x, b"other")  # one hash per page
    y = a.allocate(1)[0]
    assert not a.cache_block(y, b"x")  # one page per hash: y stays uncached
    a.free([x, y])
    with pytest.raises(ValueError, match=f"cannot free page {x}: it is cached but unreferenced"):
        a.free([x])
    with pytest.raises(ValueError, match=f"cannot cache page {y}: no request holds it"):
        a.cache_block(y, b"y")
    with pytest.raises(OutOfBlocksError, match=r"cannot allocate 3 KV cache pages: 2 of 2 are free \(1 of them cached"):
        a.allocate(3)


def test_reset_prefix_cache_only_when_no_page_is_held(caplog):
    a = BlockAllocator(4)
    blocks = a.allocate(2)
    a.cache_block(blocks[0], b"h")
    with caplog.at_level(logging.WARNING):
        assert a.reset_prefix_cache() is False
    assert "2 of 4 KV cache pages are still held" in caplog.text and a.lookup(b"h") == blocks[0]
    a.free(blocks)
    assert a.reset_prefix_cache() is True
    assert a.lookup(b"h") is None and a.num_evictable == 0 and a.num_free == 4
    assert sorted(a.allocate(4)) == [0, 1, 2, 3]


def _request(ids, rid="r", new=4, salt=None) -> Request:
    return Request(rid, list(ids), SamplingParams(max_new_tokens=new), seed=0, cache_salt=salt)


def _computed(manager: KVCacheManager, request: Request, num_tokens: int) -> None:
    """Admits ``request`` with its hits, computes its first ``num_tokens`` and caches them."""
    hits, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, num_tokens - num_hit, hits)
    request.num_computed = num_tokens
    manager.cache_blocks(request)


def test_lookup_leaves_the_last_token_to_compute():
    manager = KVCacheManager(BlockAllocator(16), block_size=4)
    _computed(manager, _request(range(12), "a"), 12)
    for n, hit in ((12, 8), (9, 8), (8, 4), (5, 4), (4, 0), (13, 12)):
        blocks, num_hit = manager.get_computed_blocks(_request(range(n)))
        assert num_hit == hit and len(blocks) == hit // 4, n
    assert manager.get_computed_blocks(_request(range(12), salt="x"))[1] == 0  # another salt shares nothing
    assert manager.get_computed_blocks(_request([0, 1, 2, 9, 4, 5, 6, 7, 8]))[1] == 0  # differs in block 0
    off = KVCacheManager(BlockAllocator(16), block_size=4, enable_caching=False)
    _computed(off, _request(range(12), "a"), 12)
    assert off.get_computed_blocks(_request(range(12))) == ([], 0) and off.allocator.num_cached == 0


def test_allocation_counts_evictable_hits_as_taken():
    """Hits that sit in the evictable pool leave it: an admission needs them plus its new
    pages from the pool, or it takes nothing."""
    manager = KVCacheManager(BlockAllocator(4), block_size=4)
    a = _request(range(12), "a")
    _computed(manager, a, 12)
    manager.free(a)
    assert manager.allocator.num_evictable == 3
    b = _request(range(16), "b")  # hits: 3 evictable pages; new: 1 page for tokens 12..15 (+1 for a 17th)
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 12 and manager.num_pages_needed(b, 5, hits) == 5
    assert not manager.allocate_slots(b, 5, hits) and b.blocks == [] and manager.allocator.num_evictable == 3
    assert manager.allocate_slots(b, 4, hits) and b.blocks[:3] == hits and manager.allocator.num_free == 0


def test_admission_schedules_only_the_uncached_rest():
    s = Scheduler(BlockAllocator(32), block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                  enable_prefix_caching=True)  # fmt: skip
    s.add(_request(range(10), "a"))
    batch = s.schedule()
    batch.requests[0].num_computed += batch.num_new[0]
    batch.requests[0].output_ids.append(7)  # it decodes next
    s.add(_request([*range(9), 50, 51], "b"))
    batch = s.schedule()
    b = batch.requests[-1]
    assert b.request_id == "b" and batch.num_new[-1] == 3 and b.num_computed == 8 == b.num_cached_tokens
    assert (batch.num_queried_tokens, batch.num_cached_tokens) == (11, 8)
    a_blocks = batch.requests[0].blocks
    assert b.blocks[:2] == a_blocks[:2] and b.blocks[2] != a_blocks[2]


@pytest.mark.parametrize("caching", [False, True])
def test_requests_arriving_together_compute_a_shared_prefix_once(caching):
    """A block is shared from the step after the one that computes it; a request whose
    next block another request computes in this step waits one step for it, without
    holding back the requests behind it."""
    s = Scheduler(BlockAllocator(32), block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                  enable_prefix_caching=caching)  # fmt: skip
    a, b, c = _request(range(10), "a"), _request([*range(8), 40, 41], "b"), _request([50] * 6, "c")
    for r in (a, b, c):
        s.add(r)
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == (["a", "c"] if caching else ["a", "b", "c"])
    for r, n in zip(batch.requests, batch.num_new, strict=True):
        r.num_computed += n
        r.output_ids.append(7)
    batch = s.schedule()
    if caching:
        assert batch.requests[-1] is b and batch.num_new[-1] == 2 and b.num_cached_tokens == 8
        assert b.blocks[:2] == a.blocks[:2]


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_traffic_keeps_every_page_consistent(data):
    """Requests drawn from a few shared prefixes arrive, are scheduled, computed, aborted
    and preempted at random, through a small pool. A simulated cache records, for every
    page slot written, the token prefix its k/v depend on; after every step each running
    request's computed positions must hold its own prefix (so a cache hit never gives a
    request another prefix's k/v and a shared page is never overwritten), reference
    counts must equal the holders, and no held page may be evictable."""
    bs = data.draw(st.sampled_from([2, 4]), "block_size")
    num_blocks = data.draw(st.integers(6, 16), "num_blocks")
    seqs, budget = data.draw(st.integers(1, 4), "max_num_seqs"), data.draw(st.integers(1, 12), "budget")
    s = Scheduler(BlockAllocator(num_blocks), bs, seqs, budget, enable_prefix_caching=True)
    stems = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9], [8]]
    slots: dict[tuple[int, int], tuple[int, ...]] = {}  # (page, offset) -> the prefix whose k/v it holds
    live: list[Request] = []
    for step in range(data.draw(st.integers(5, 30), "steps")):
        for _ in range(data.draw(st.integers(0, 2), f"arrivals {step}")):
            stem = data.draw(st.sampled_from(stems))
            tail = data.draw(st.lists(st.integers(1, 3), max_size=5))
            new = data.draw(st.integers(1, 8))
            r = _request(stem + tail, f"r{step}-{len(live)}", new)
            if -(-r.max_tokens // bs) <= num_blocks:
                s.add(r)
                live.append(r)
        if live and data.draw(st.booleans(), f"abort {step}"):
            victim = data.draw(st.sampled_from(live))
            if victim.finish_reason is None:
                s.finish(victim, "abort")
        batch = s.schedule()
        for r, n in zip(batch.requests, batch.num_new, strict=True):
            assert 1 <= n and r.num_computed + n <= r.num_tokens  # the last token is always computed
            ids = r.prompt_ids + r.output_ids
            for p in range(r.num_computed, r.num_computed + n):
                slots[r.blocks[p // bs], p % bs] = tuple(ids[: p + 1])
            r.num_computed += n
            if r.num_computed == r.num_tokens:
                r.output_ids.append(sum(ids) % 3 + 1)  # a token that depends on the prefix
                if len(r.output_ids) == r.params.max_new_tokens:
                    s.finish(r, "length")
        holders = collections.Counter(b for r in s.running for b in r.blocks)
        a = s.allocator
        assert {b: a.ref_count(b) for b in holders} == dict(holders) and a.num_used == len(holders)
        assert a.num_used + a.num_free == num_blocks and not any(a.is_evictable(b) for b in holders)
        for r in s.running:
            ids = r.prompt_ids + r.output_ids
            for p in range(r.num_computed):
                assert slots[r.blocks[p // bs], p % bs] == tuple(ids[: p + 1])
    for r in live:
        if r.finish_reason is None:
            s.finish(r, "abort")
    assert s.allocator.num_used == 0 and s.allocator.num_free == num_blocks
