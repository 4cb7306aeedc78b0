"""Serving: paged block allocator, continuous-batching scheduler, engine."""

from attn_jax.serving.block_allocator import BlockAllocator, OutOfBlocksError
from attn_jax.serving.engine import Completion, Engine, StepStats, TokenEvent
from attn_jax.serving.scheduler import Request, SamplingParams, Scheduler

__all__ = [
    "BlockAllocator",
    "Completion",
    "Engine",
    "OutOfBlocksError",
    "Request",
    "SamplingParams",
    "Scheduler",
    "StepStats",
    "TokenEvent",
]
