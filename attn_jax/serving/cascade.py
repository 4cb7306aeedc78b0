"""Cascade attention in the engine: the prefix every running request shares, each step.

vLLM V1's scheme, in two parts:

- the scheduler's side (``num_common_prefix_blocks``, vLLM's ``get_num_common_prefix_blocks``):
  the leading pages of a running request whose reference count equals the number of running
  requests. Only running requests hold pages, so such a page is in every running request's
  block table, and at the same index (a cached page is named by a chained hash of the whole
  prefix up to it);
- the runner's side (``common_prefix_len``, the first half of vLLM's
  ``_compute_cascade_attn_prefix_len``): those pages' tokens, capped at the smallest
  ``num_computed`` of the step's requests (the prefix must lie wholly before every query
  token: its k/v are read, never written, by the step) and aligned down to the page size.

The attention group's builder then decides (``use_cascade_attention``, thresholds in
``CascadeConfig``; PALLAS_GPU weighs float32 layers' dot work too) and the metadata carries
the length as data (an i32[] leaf): a new length never recompiles the step, while cascade
on / off is part of the metadata's structure, so a bucket compiles at most twice.

Example::

    blocks = num_common_prefix_blocks(allocator, scheduler.running)
    prefix = common_prefix_len(blocks, block_size, [r.num_computed for r in batch.requests])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from attn_jax.serving.block_allocator import BlockAllocator
from attn_jax.types import validate_positive_int


@dataclasses.dataclass(frozen=True)
class CascadeConfig:
    """The engine's cascade attention setting.

    Attributes:
      enabled: let the builder choose cascade attention (False: never).
      min_prefix_len: fewest shared tokens for it; None: the builder's own threshold
        (``XLAMetadataBuilder.CASCADE_MIN_PREFIX``, 256).
      min_requests: fewest requests in the step; None: the builder's own
        (``CASCADE_MIN_REQUESTS``, 8).
      performance_model: let a builder with a model of both paths' work decline cascade
        where the model says it does not pay (PALLAS_GPU's for float32 layers, whose dots run
        on FMA units: ``PallasGPUMetadataBuilder.use_cascade_attention``); False: the
        thresholds alone decide (benchmarks measuring cascade where the model declines it).
    """

    enabled: bool = True
    min_prefix_len: int | None = None
    min_requests: int | None = None
    performance_model: bool = True

    def __post_init__(self) -> None:
        for name in ("min_prefix_len", "min_requests"):
            value = getattr(self, name)
            if value is not None:
                validate_positive_int(name, value)

    @classmethod
    def of(cls, setting: CascadeConfig | bool) -> CascadeConfig:
        """``setting`` as a config: True is the default, False turns cascade attention off."""
        if isinstance(setting, CascadeConfig):
            return setting
        if isinstance(setting, bool):
            return cls(enabled=setting)
        raise TypeError(f"cascade_attention={setting!r} must be a bool or a CascadeConfig")


def num_common_prefix_blocks(allocator: BlockAllocator, running: Sequence) -> int:
    """Leading pages of ``running[0]`` (a request with ``blocks``) held by every request in
    ``running``: those whose reference count equals ``len(running)``; 0 with none running."""
    if not running:
        return 0
    count = 0
    for block in running[0].blocks:
        if allocator.ref_count(block) != len(running):
            break
        count += 1
    return count


def common_prefix_len(num_common_blocks: int, block_size: int, num_computed: Sequence[int]) -> int:
    """Tokens of the shared prefix a step may read once: ``num_common_blocks`` pages, capped at
    the smallest of the step's requests' ``num_computed`` tokens (k/v already in the cache),
    aligned down to ``block_size``; 0 for a step with no request."""
    if num_common_blocks <= 0 or not len(num_computed):
        return 0
    tokens = min(num_common_blocks * block_size, min(int(n) for n in num_computed))
    return tokens // block_size * block_size
