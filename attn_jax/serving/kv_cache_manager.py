"""KV cache manager: each request's pages, and automatic prefix caching (vLLM V1's).

A full block of ``block_size`` tokens is identified by a chained hash: SHA-256 (hashlib)
of the parent block's hash, the block's token ids and its extra keys (a request's
``cache_salt`` on its first block), so a hash names the whole prefix up to the block's
end. A block gets its hash when it is full and its tokens' k/v have been dispatched
(prompt and generated tokens alike); the pool then maps hash -> page. On admission
(``get_computed_blocks``) a request takes the longest run of cached full blocks from its
first token on, at most ``num_tokens - 1`` tokens: its last token is always computed
again, for its logits. So a request of n tokens takes at most (n - 1) // block_size
blocks: one ending on a block boundary computes its whole last block again, any other
its partial last block (a single token when that block holds only the last token).

Example::

    manager = KVCacheManager(BlockAllocator(64), block_size=16, enable_caching=True)
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    if manager.allocate_slots(request, num_new_tokens, hits):
        request.num_computed = num_hit_tokens            # then schedule num_new_tokens from there
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from attn_jax.serving.block_allocator import BlockAllocator
from attn_jax.types import validate_positive_int

if TYPE_CHECKING:
    from attn_jax.serving.scheduler import Request

ROOT_HASH = hashlib.sha256(b"attn-stack prefix cache").digest()  # the parent of every request's first block


def _digest(parent: bytes, block: bytes, extra_keys: Sequence[str | int]) -> bytes:
    """SHA-256 over ``parent``, a block's packed count and ids, and each extra key tagged with
    its type and length: the one place a block's hash is made."""
    h = hashlib.sha256(parent)
    h.update(block)
    for key in extra_keys:
        if isinstance(key, str):
            data = key.encode()
            h.update(b"s" + struct.pack("<I", len(data)) + data)
        elif isinstance(key, int) and not isinstance(key, bool):
            h.update(b"i" + struct.pack("<q", key))
        else:
            raise TypeError(f"extra key {key!r} ({type(key).__name__}) must be a str or an int")
    return h.digest()


def hash_block(parent: bytes, token_ids: Sequence[int], extra_keys: Sequence[str | int] = ()) -> bytes:
    """The block's chained hash: SHA-256 over ``parent`` (32 bytes), the token count as a
    little-endian uint32 and the token ids as little-endian int64, and each extra key
    tagged with its type and length (32 bytes)."""
    return _digest(parent, struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids), extra_keys)


def chain_hashes(
    parent: bytes, token_ids: Sequence[int], block_size: int, first_extra_keys: Sequence[str | int] = ()
) -> list[bytes]:
    """``hash_block``'s chain over the full blocks of ``token_ids`` from ``parent`` (the
    extra keys on the first block), the ids packed once for all blocks (2-3x faster than
    a ``hash_block`` per block: the prefix cache hashes every prompt's blocks on admission)."""
    data = np.asarray(token_ids, dtype="<i8").tobytes()
    count, width = struct.pack("<I", block_size), 8 * block_size
    out: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        parent = _digest(parent, count + data[i * width : (i + 1) * width], first_extra_keys if i == 0 else ())
        out.append(parent)
    return out


def block_hashes(token_ids: Sequence[int], block_size: int, extra_keys: Sequence[str | int] = ()) -> list[bytes]:
    """The chained hashes of the full blocks of ``token_ids`` (``extra_keys`` on the first)."""
    return chain_hashes(ROOT_HASH, token_ids, block_size, extra_keys)


@dataclasses.dataclass
class PrefixCacheStats:
    """Prefix cache lookups: ``queries`` tokens looked up (each admitted request's known
    tokens, re-admissions after preemption included), ``hits`` of them found cached."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / queries (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0

    def __add__(self, other: PrefixCacheStats) -> PrefixCacheStats:
        return PrefixCacheStats(self.requests + other.requests, self.queries + other.queries, self.hits + other.hits)


class KVCacheManager:
    """Allocates and frees a request's pages (``request.blocks``, its block table) and,
    with ``enable_caching``, shares cached full blocks between requests.

    Args:
      allocator: the page pool (reference counts, hash -> page map, evictable pages).
      block_size: tokens per page.
      enable_caching: automatic prefix caching; off: no hashing, no lookups.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int, enable_caching: bool = True) -> None:
        self.allocator = allocator
        self.block_size = validate_positive_int("block_size", block_size)
        self.enable_caching = bool(enable_caching)
        self.stats = PrefixCacheStats()
        self._num_cached: dict[Request, int] = {}  # its leading blocks with a hash in the pool

    def _update_hashes(self, request: Request, num_tokens: int) -> None:
        """Extends ``request.block_hashes`` over the full blocks of its first ``num_tokens``
        tokens (known to the host)."""
        bs, hashes = self.block_size, request.block_hashes
        start, stop = len(hashes), num_tokens // bs
        if stop > start:
            parent = hashes[-1] if hashes else ROOT_HASH
            extra = (request.cache_salt,) if start == 0 and request.cache_salt is not None else ()
            hashes.extend(chain_hashes(parent, request.known_ids(start * bs, stop * bs), bs, extra))

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The cached pages of the longest prefix of ``request``'s known tokens held in full
        blocks, at most ``num_tokens - 1`` tokens long, and that prefix's length; ([], 0)
        with caching off. Nothing is taken: ``allocate_slots`` takes them."""
        if not self.enable_caching:
            return [], 0
        num_known = len(request.prompt_ids) + len(request.output_ids)
        self._update_hashes(request, num_known)
        blocks = []
        for block_hash in request.block_hashes[: (num_known - 1) // self.block_size]:
            block = self.allocator.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def _new_pages(self, request: Request, num_new_tokens: int, num_hits: int) -> int:
        """Free pages ``num_new_tokens`` more tokens take beyond the request's own pages and its
        ``num_hits`` cached ones."""
        num_tokens = request.num_computed + num_hits * self.block_size + num_new_tokens
        return max(-(-num_tokens // self.block_size) - len(request.blocks) - num_hits, 0)

    def num_pages_needed(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> int:
        """Pages an ``allocate_slots`` call takes from the pool: new pages, plus evictable
        cached ones among ``computed_blocks`` (they leave the evictable pool)."""
        new = self._new_pages(request, num_new_tokens, len(computed_blocks))
        return new + sum(self.allocator.is_evictable(b) for b in computed_blocks)

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Pages for ``num_new_tokens`` more tokens of ``request`` after its computed ones
        and ``computed_blocks`` (cache hits from ``get_computed_blocks``, for a request
        with no pages yet): the hits referenced and appended, then new pages. False, with
        nothing taken, when the pool cannot supply them. (A running request's next tokens
        usually need no new page: one division, nothing else.)"""
        if computed_blocks and request.blocks:
            raise ValueError(
                f"request {request.request_id!r} holds {len(request.blocks)} pages already: "
                "cache hits are taken only on admission"
            )
        new = self._new_pages(request, num_new_tokens, len(computed_blocks))
        if computed_blocks:
            if not self.allocator.can_allocate(self.num_pages_needed(request, num_new_tokens, computed_blocks)):
                return False
            self.allocator.touch(computed_blocks)
            request.blocks += computed_blocks
            self._num_cached[request] = max(self._num_cached.get(request, 0), len(computed_blocks))
        elif not new:  # the tokens fit in the request's pages
            return True
        elif not self.allocator.can_allocate(new):
            return False
        if new:
            request.blocks += self.allocator.allocate(new)
        return True

    def blocks_completed(self, request: Request, num_new_tokens: int) -> list[bytes]:
        """The hashes of the full blocks that computing ``num_new_tokens`` more tokens of
        ``request`` completes (tokens the host knows only); [] with caching off."""
        start = request.num_computed // self.block_size
        if not self.enable_caching or (request.num_computed + num_new_tokens) // self.block_size == start:
            return []  # (or it opens no block: most decodes, asked every step while requests wait)
        num_known = len(request.prompt_ids) + len(request.output_ids)
        end = min(request.num_computed + num_new_tokens, num_known) // self.block_size
        self._update_hashes(request, end * self.block_size)
        return request.block_hashes[start:end]

    def next_block_pending(self, request: Request, num_hit_blocks: int, pending: set[bytes]) -> bool:
        """Whether the block after ``request``'s ``num_hit_blocks`` cached ones is in
        ``pending`` (being computed in this step) and could be a hit once cached."""
        num_known = len(request.prompt_ids) + len(request.output_ids)
        i = num_hit_blocks
        return bool(pending) and i < (num_known - 1) // self.block_size and request.block_hashes[i] in pending

    def record_admission(self, request: Request, num_hit_tokens: int) -> None:
        """Counts one admission's lookup in ``stats`` (its known tokens and hits)."""
        if self.enable_caching:
            self.stats.requests += 1
            self.stats.queries += len(request.prompt_ids) + len(request.output_ids)
            self.stats.hits += num_hit_tokens

    def cache_blocks(self, request: Request) -> None:
        """Registers the request's full blocks whose k/v are computed (dispatched) and
        whose tokens the host knows, and that have no hash in the pool yet."""
        if not self.enable_caching:
            return
        num_tokens = min(request.num_computed, len(request.prompt_ids) + len(request.output_ids))
        num_full = min(num_tokens // self.block_size, len(request.blocks))
        start = self._num_cached.get(request, 0)
        if num_full <= start:
            return
        self._update_hashes(request, num_full * self.block_size)
        for i in range(start, num_full):
            self.allocator.cache_block(request.blocks[i], request.block_hashes[i])
        self._num_cached[request] = num_full

    def cache_full_blocks(self, requests: Sequence[Request]) -> None:
        """``cache_blocks`` of each of ``requests`` whose computed tokens fill a block past
        its cached ones (the scheduler's pass over its running requests every step: most
        decodes complete no block, and skipping them before the call is what keeps it cheap)."""
        if not self.enable_caching:
            return
        size, cached = self.block_size, self._num_cached
        for request in requests:
            if request.num_computed >= (cached.get(request, 0) + 1) * size:
                self.cache_blocks(request)

    def free(self, request: Request) -> None:
        """Caches the request's full computed blocks, then drops its references to its
        pages (tail first, so its tail is evicted before its head) and empties its table."""
        self.cache_blocks(request)
        self.allocator.free(request.blocks)
        request.blocks = []
        self._num_cached.pop(request, None)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block when no page is in use (``BlockAllocator``'s)."""
        return self.allocator.reset_prefix_cache()
