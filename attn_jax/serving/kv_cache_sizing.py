"""How big an engine's KV cache and limits are on the device it runs on (vLLM's
``gpu_memory_utilization`` / ``kv_cache_memory`` and its start-up line).

On an accelerator the KV cache takes what is left of ``gpu_memory_utilization`` of the
device's allocator limit (``memory_stats()["bytes_limit"]``: JAX's preallocated pool, 75 %
of the device unless ``XLA_PYTHON_CLIENT_MEM_FRACTION`` says otherwise) once the weights
(already on the device, or about to be) and the largest step's activations are counted;
``kv_cache_bytes`` replaces that with an explicit size (a shared device). The activations
are estimated from the model's shape, not profiled (``activation_bytes``). On a CPU (no
memory statistics) the cache is ``CPU_KV_CACHE_BYTES`` and the limits stay small.

Example::

    plan = kv_cache_plan(config, params_bytes=weights, max_num_batched_tokens=2048, max_rows=256)
    print(plan.summary(num_blocks=plan.kv_cache_bytes // page_bytes, block_size=16, max_model_len=2048))
"""

from __future__ import annotations

import dataclasses

import jax

__all__ = [
    "ACCELERATOR_LIMITS", "CPU_KV_CACHE_BYTES", "CPU_LIMITS", "WORKSPACE_BYTES", "KVCachePlan", "activation_bytes",
    "default_limits", "kv_cache_plan",
]  # fmt: skip

CPU_KV_CACHE_BYTES = 256 << 20
"""The KV cache of an engine on a CPU (or any device without memory statistics)."""

CPU_LIMITS = (8, 256)
"""(max_num_seqs, max_num_batched_tokens) on a CPU: small, so a laptop compiles few shapes."""

ACCELERATOR_LIMITS = (256, 2048)
"""(max_num_seqs, max_num_batched_tokens) on a GPU or TPU: vLLM's defaults."""


def _memory_stats(device) -> dict | None:
    try:
        stats = device.memory_stats()
    except Exception:  # a platform without them (CPU) raises or returns None
        return None
    return stats if stats and stats.get("bytes_limit") else None


def default_limits(device=None) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) for ``device`` (default: the first local one):
    ``ACCELERATOR_LIMITS`` where it reports memory statistics, else ``CPU_LIMITS``."""
    device = jax.local_devices()[0] if device is None else device
    return ACCELERATOR_LIMITS if _memory_stats(device) is not None else CPU_LIMITS


@dataclasses.dataclass(frozen=True)
class KVCachePlan:
    """The KV cache's bytes per device and how they were found."""

    kv_cache_bytes: int
    source: str  # "explicit", "cpu default" or "gpu_memory_utilization=<u>"
    bytes_limit: int | None = None  # the device's allocator limit (None: unknown)
    weights_bytes: int = 0
    activation_bytes: int = 0

    def summary(self, *, num_blocks: int, block_size: int, max_model_len: int, capped: bool = False) -> str:
        """vLLM's start-up line: the cache's size in tokens and the concurrency it allows
        (``capped``: the engine took only every slot at ``max_model_len``, less than the budget)."""
        tokens = num_blocks * block_size
        how = self.source + (", capped at every slot at max_model_len" if capped else "")
        if self.bytes_limit is not None:
            how += (
                f" of {self.bytes_limit / 2**30:.1f} GiB; weights {self.weights_bytes / 2**30:.2f} GiB, "
                f"activations (estimated) {self.activation_bytes / 2**30:.2f} GiB"
            )
        return (
            f"KV cache: {tokens:,} tokens ({num_blocks:,} pages of {block_size}; {how}); maximum concurrency "
            f"at max_model_len {max_model_len}: {tokens / max_model_len:.2f}x"
        )


WORKSPACE_BYTES = 1 << 30
"""Kept beside the estimated activations for XLA's and the kernels' workspaces and the
warm-up's saved pages."""


def activation_bytes(config, *, max_num_batched_tokens: int, max_rows: int) -> int:
    """An upper estimate of one step's activations (bytes, float32): ``max_num_batched_tokens``
    tokens through the widest layer and ``max_rows`` rows of logits with as many vocabulary-wide
    rows again (the sampler's tempered logits and Gumbel noise, the candidate search's blocks,
    the log-softmax of the log-probabilities), twice over for XLA's temporaries, plus
    the penalties' token counts (``ModelRunner``: i32[max_rows, vocab], kept between steps) and
    ``WORKSPACE_BYTES``."""
    hidden, vocab = config.hidden_size, config.vocab_size
    inter = getattr(config, "intermediate_size", 4 * hidden)
    num_heads = getattr(config, "num_heads", 1)
    heads = num_heads + 2 * getattr(config, "num_kv_heads", num_heads)
    per_token = 4 * hidden + 3 * inter + heads * getattr(config, "head_dim", hidden // max(num_heads, 1))
    counts = 4 * max_rows * vocab
    return 2 * 4 * (max_num_batched_tokens * per_token + 8 * max_rows * vocab) + counts + WORKSPACE_BYTES


def kv_cache_plan(
    config, *, params_bytes: int, max_num_batched_tokens: int, max_rows: int, gpu_memory_utilization: float = 0.9,
    kv_cache_bytes: int | None = None, device=None, params_on_device: bool = False, copied_bytes: int = 0,
) -> KVCachePlan:  # fmt: skip
    """The KV cache's bytes per device. ``kv_cache_bytes`` given: that. Else on a device with
    memory statistics: ``gpu_memory_utilization`` of its allocator limit, less what is in use,
    the weights (``params_bytes`` per device; already counted in use when
    ``params_on_device``, then plus ``copied_bytes``, the runner's copy of some of them: its
    per-layer buffers) and ``activation_bytes``; ValueError when nothing is left, naming
    each part. Else (CPU) ``CPU_KV_CACHE_BYTES``."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization!r} must be in (0, 1]")
    if kv_cache_bytes is not None:
        if kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes={kv_cache_bytes!r} must be a positive number of bytes")
        return KVCachePlan(int(kv_cache_bytes), "explicit")
    device = jax.local_devices()[0] if device is None else device
    stats = _memory_stats(device)
    if stats is None:
        return KVCachePlan(CPU_KV_CACHE_BYTES, "cpu default")
    limit, in_use = int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
    weights = int(copied_bytes) if params_on_device else int(params_bytes)
    act = activation_bytes(config, max_num_batched_tokens=max_num_batched_tokens, max_rows=max_rows)
    free = int(gpu_memory_utilization * limit) - in_use - weights - act
    if free <= 0:
        raise ValueError(
            f"no device memory is left for the KV cache: gpu_memory_utilization={gpu_memory_utilization} of "
            f"{limit / 2**30:.2f} GiB, {in_use / 2**30:.2f} GiB in use, weights {weights / 2**30:.2f} GiB, "
            f"activations {act / 2**30:.2f} GiB; raise gpu_memory_utilization, lower max_num_batched_tokens or "
            "give kv_cache_bytes"
        )
    held = int(params_bytes) + int(copied_bytes)
    return KVCachePlan(free, f"gpu_memory_utilization={gpu_memory_utilization}", limit, held, act)
