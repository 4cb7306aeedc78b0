"""MLA workloads shared by tests and benchmarks: a paged latent cache with random context.

``make_mla_batch`` fills a ``[P, S, C + R]`` latent cache with each request's latents at
shuffled distinct pages (every other slot NaN, so an out-of-range read shows) and returns
the dense per-request latents an oracle needs. ``MLA_WORKLOADS`` holds DESIGN.md's MLA-D1
and MLA-P1 as specs.

Example::

    batch = make_mla_batch(0, seq_lens=[7, 1], num_heads=4, kv_lora_rank=32, rope_dim=16, block_size=4)
    out = mla_decode(batch.q_decode, batch.kv_cache, batch.seq_lens, batch.block_tables,
                     sm_scale=0.1, kv_lora_rank=32)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from attn_jax.kv_cache import dequantize_from_cache, quantize_to_cache


@dataclasses.dataclass(frozen=True, eq=False)
class MLABatch:
    """A latent cache holding each request's context, its block tables and dense latents."""

    kv_cache: jnp.ndarray  # [P, S, C + R], cache dtype; unused slots NaN
    seq_lens: np.ndarray  # i32[N]
    block_tables: np.ndarray  # i32[N, pages_per_req]; unused entries random valid ids
    latents: tuple[np.ndarray, ...]  # N x f32[seq_len_r, C + R]: what the cache holds (cast back)
    q_decode: jnp.ndarray  # f[N, H, C + R]: one absorbed decode query per request
    kv_lora_rank: int


@dataclasses.dataclass(frozen=True)
class MLAWorkloadSpec:
    """A benchmark workload: requests x context, heads, latent widths, page size."""

    name: str
    num_reqs: int
    context_len: int
    num_heads: int
    kv_lora_rank: int = 512
    rope_dim: int = 64
    block_size: int = 64
    query_len: int = 1  # 1: decode; else causal prefill of query_len tokens over no context


MLA_WORKLOADS = {
    "MLA-D1": MLAWorkloadSpec("MLA-D1", num_reqs=64, context_len=4096, num_heads=128),
    "MLA-D1-16": MLAWorkloadSpec("MLA-D1-16", num_reqs=64, context_len=4096, num_heads=16),
    "MLA-P1": MLAWorkloadSpec("MLA-P1", num_reqs=4, context_len=4096, num_heads=16, query_len=4096),
}


def make_mla_batch(
    seed: int,
    *,
    seq_lens: Sequence[int],
    num_heads: int,
    kv_lora_rank: int,
    rope_dim: int,
    block_size: int,
    dtype=jnp.float32,
    spare_pages: int = 2,
    extra_table_pages: int = 1,
    cache_dtype=None,
    k_scale: float = 1.0,
) -> MLABatch:
    """Random latents for requests of ``seq_lens`` tokens in a shuffled paged cache.

    ``dtype``: q's and the cache's dtype, unless ``cache_dtype`` (e.g. fp8, storing latent /
    ``k_scale``) is given; ``latents`` hold what the cache represents (dequantised)."""
    rng = np.random.default_rng(seed)
    lens = np.asarray(seq_lens, np.int32)
    width = kv_lora_rank + rope_dim
    pages_needed = -(-lens // block_size)
    pages_per_req = max(int(pages_needed.max(initial=0)), 1) + extra_table_pages
    num_blocks = int(pages_needed.sum()) + spare_pages
    order = rng.permutation(num_blocks)
    cache = np.full((num_blocks, block_size, width), np.nan, np.float32)
    table = rng.integers(0, num_blocks, size=(len(lens), pages_per_req)).astype(np.int32)
    latents, used = [], 0
    for r, n in enumerate(lens):
        lat = rng.standard_normal((int(n), width)).astype(np.float32)
        stored = quantize_to_cache(jnp.asarray(lat, dtype), cache_dtype or dtype, k_scale)
        lat = np.asarray(dequantize_from_cache(stored, k_scale))  # what the cache represents
        latents.append(lat)
        for p in range(pages_needed[r]):
            page = int(order[used])
            used += 1
            table[r, p] = page
            chunk = lat[p * block_size : (p + 1) * block_size]
            cache[page, : len(chunk)] = chunk
    q = rng.standard_normal((len(lens), num_heads, width)).astype(np.float32)
    stored = quantize_to_cache(jnp.asarray(cache, jnp.float32), cache_dtype or dtype, k_scale)
    return MLABatch(
        kv_cache=stored,
        seq_lens=lens,
        block_tables=table,
        latents=tuple(latents),
        q_decode=jnp.asarray(q, dtype),
        kv_lora_rank=kv_lora_rank,
    )
