"""Paged KV cache block pool: page ids shared by every layer, with reference counts and
the prefix cache's hash -> page map.

A request holds the pages listed in its block table; a page may be held by several
requests at once (a shared prefix), so each used page has a reference count. A page
whose count drops to 0 goes back to one of two pools:

- the free pool (a stack: last freed, first reused) when it holds no cached content;
- the evictable pool (least recently freed first) when it is registered in the prefix
  cache under a block hash (``cache_block``): it keeps its content and hash, can be
  taken back by a request that needs that content (``touch``), and is evicted, its hash
  dropped, only when ``allocate`` finds the free pool empty.

A referenced page is never evicted. This is vLLM V1's ``BlockPool`` with one difference:
vLLM keeps never-cached and cached free pages in one LRU queue, so it may evict a cached
page while a page with nothing worth keeping is free; here empty pages go first.

Running out is an ``OutOfBlocksError`` that says how many pages were asked for and how
many are free; the scheduler turns it into waiting or preemption, never into a write
to another request's pages.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable

from attn_jax.types import validate_positive_int

logger = logging.getLogger(__name__)


class OutOfBlocksError(RuntimeError):
    """Not enough free KV cache pages for an allocation."""


class BlockAllocator:
    """Hands out page ids in [0, num_blocks), counts their references, and keeps the
    prefix cache's pages (hash -> page) until they are evicted.

    >>> a = BlockAllocator(4)
    >>> a.allocate(3)
    [0, 1, 2]
    >>> a.free([1]); a.allocate(1)
    [1]
    >>> a.cache_block(0, b"h0")
    True
    >>> a.free([0]); a.num_evictable, a.lookup(b"h0")
    (1, 0)
    >>> a.touch([0]); a.ref_count(0), a.num_evictable
    (1, 0)
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = validate_positive_int("num_blocks", num_blocks)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: pop() takes the top
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._refs: dict[int, int] = {}  # page -> reference count (> 0) of every page in use
        self._hash_of: dict[int, bytes] = {}  # cached page -> its block hash
        self._page_of: dict[bytes, int] = {}  # block hash -> cached page
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Pages an allocation can take now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Pages referenced by at least one request."""
        return len(self._refs)

    @property
    def num_evictable(self) -> int:
        """Cached pages that no request references (kept until evicted)."""
        return len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Pages registered in the prefix cache (referenced or evictable)."""
        return len(self._page_of)

    def ref_count(self, block: int) -> int:
        """How many requests hold ``block`` (0 for a free or evictable page)."""
        return self._refs.get(block, 0)

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def evictable_order(self) -> list[int]:
        """The evictable pages, the next to be evicted first."""
        return list(self._evictable)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """``n`` pages (n >= 0), each with one reference: free pages first, then evicted
        cached ones (least recently freed first, their hashes dropped). OutOfBlocksError
        if fewer are available (nothing taken)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n={n!r} must be a non-negative int")
        if n > self.num_free:
            raise OutOfBlocksError(
                f"cannot allocate {n} KV cache pages: {self.num_free} of {self.num_blocks} are free"
                + (f" ({len(self._evictable)} of them cached, evictable)" if self._evictable else "")
            )
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._page_of[self._hash_of.pop(block)]
                self.num_evictions += 1
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[int]) -> None:
        """One more reference to each of ``blocks``, cached pages found by ``lookup``
        (an evictable one leaves the evictable pool). ValueError (nothing changed) for a
        page that is not cached."""
        blocks = list(blocks)
        for b in blocks:
            if b not in self._hash_of:
                raise ValueError(f"cannot touch page {b}: it is not in the prefix cache")
        for b in blocks:
            self._evictable.pop(b, None)
            self._refs[b] = self._refs.get(b, 0) + 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drops one reference to each of ``blocks``, last first; a page left with none
        goes to the evictable pool if cached (so a request's tail pages are evicted before
        its head), else to the free pool. ValueError (nothing freed) for a page not in use."""
        blocks = list(blocks)
        for b in blocks:
            if b not in self._refs:
                if b in self._evictable:
                    state = "cached but unreferenced"
                else:
                    state = "free already" if 0 <= b < self.num_blocks else f"outside [0, {self.num_blocks})"
                raise ValueError(f"cannot free page {b}: it is {state}")
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"cannot free the same page twice in one call: {blocks}")
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                del self._refs[b]
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def lookup(self, block_hash: bytes) -> int | None:
        """The cached page holding the block with this hash, or None."""
        return self._page_of.get(block_hash)

    def cache_block(self, block: int, block_hash: bytes) -> bool:
        """Registers the used, full page ``block`` under ``block_hash``; False (nothing
        changed) when another page holds that hash already or ``block`` has a hash."""
        if block not in self._refs:
            raise ValueError(f"cannot cache page {block}: no request holds it")
        if block_hash in self._page_of or block in self._hash_of:
            return False
        self._page_of[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block (their pages become free), as vLLM's does: only when
        no page is in use; otherwise a logged warning and False, nothing changed."""
        if self._refs:
            logger.warning(
                "prefix cache not reset: %d of %d KV cache pages are still held by requests "
                "(reset it when no request is running)",
                len(self._refs),
                self.num_blocks,
            )
            return False
        self._free.extend(reversed(self._evictable))
        self._evictable.clear()
        self._hash_of.clear()
        self._page_of.clear()
        return True
