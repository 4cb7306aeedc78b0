"""Paged KV cache block allocator: a free list of page ids shared by every layer.

A request owns the pages listed in its block table; the allocator hands out free page
ids, takes them back when the request finishes or is preempted, and reuses them
(last freed, first reused). Running out is an ``OutOfBlocksError`` that says how many
pages were asked for and how many are free; the scheduler turns it into waiting or
preemption, never into a write to another request's pages.
"""

from __future__ import annotations

from collections.abc import Iterable

from attn_jax.types import validate_positive_int


class OutOfBlocksError(RuntimeError):
    """Not enough free KV cache pages for an allocation."""


class BlockAllocator:
    """Hands out page ids in [0, num_blocks).

    >>> a = BlockAllocator(4)
    >>> a.allocate(3)
    [0, 1, 2]
    >>> a.free([1]); a.allocate(1)
    [1]
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = validate_positive_int("num_blocks", num_blocks)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: pop() takes the top
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        """Pages free now."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` free page ids (n >= 0); OutOfBlocksError if fewer are free (nothing taken)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n={n!r} must be a non-negative int")
        if n > len(self._free):
            raise OutOfBlocksError(
                f"cannot allocate {n} KV cache pages: {len(self._free)} of {self.num_blocks} are free"
            )
        blocks = [self._free.pop() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Returns pages to the pool; ValueError (nothing freed) for an id not in use."""
        blocks = list(blocks)
        for b in blocks:
            if b not in self._used:
                state = "free already" if 0 <= b < self.num_blocks else f"outside [0, {self.num_blocks})"
                raise ValueError(f"cannot free page {b}: it is {state}")
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"cannot free the same page twice in one call: {blocks}")
        for b in reversed(blocks):
            self._used.discard(b)
            self._free.append(b)
