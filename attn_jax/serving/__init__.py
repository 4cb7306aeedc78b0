"""Serving: paged block allocator, KV cache manager (prefix caching), continuous-batching scheduler, engine."""

from attn_jax.serving.block_allocator import BlockAllocator, OutOfBlocksError
from attn_jax.serving.cascade import CascadeConfig
from attn_jax.serving.engine import Completion, Engine, StepStats, TokenEvent, TokenRun
from attn_jax.serving.kv_cache_manager import KVCacheManager, PrefixCacheStats
from attn_jax.serving.scheduler import Request, SamplingParams, Scheduler

__all__ = [
    "BlockAllocator",
    "CascadeConfig",
    "Completion",
    "Engine",
    "KVCacheManager",
    "OutOfBlocksError",
    "PrefixCacheStats",
    "Request",
    "SamplingParams",
    "Scheduler",
    "StepStats",
    "TokenEvent",
    "TokenRun",
]
