"""Workloads for ragged paged attention, shared by tests and benchmarks.

``make_ragged_batch`` builds everything one op call needs (a packed query batch, a paged
cache already holding each request's context, block tables, slot mapping) plus the
dense per-request keys and values an oracle needs. ``WORKLOADS`` holds the benchmark
workloads D1, D2, M1 and P1 of DESIGN.md as specs.

Example::

    batch = make_ragged_batch(0, query_lens=[1, 5], context_lens=[7, 0], num_q_heads=4,
                              num_kv_heads=2, head_size=16, block_size=4)
    out, kv_cache = ragged_paged_attention(*batch.op_args, sm_scale=16**-0.5,
                                           **batch.op_kwargs)
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from attn_jax.backends.xla import XLAAttentionBackend
from attn_jax.kv_cache import DEFAULT_K_RANGE, DEFAULT_V_RANGE, MIN_SCALE, is_fp8_dtype
from attn_jax.metadata import CommonAttentionMetadata
from attn_jax.types import is_quantized_kv_cache, validate_activation_dtype

__all__ = ["WORKLOADS", "RaggedBatch", "WorkloadSpec", "make_ragged_batch"]

PADDING_SCALE = 100.0
"""Standard deviation of the random values in padding rows of q, k and v (finite garbage)."""


@dataclasses.dataclass(frozen=True, eq=False)
class RaggedBatch:
    """One call of the op (device arrays) and the dense per-request data of an oracle.

    Real token rows are ``0 : num_actual_tokens``; rows after that are padding (finite
    random values, slot -1). The cache holds every request's context keys and values
    (at distinct physical pages); all its other slots hold NaN.
    """

    q: jax.Array  # f[T, Hq, D], activation dtype
    k: jax.Array  # f[T, Hkv, D]: the new tokens' keys
    v: jax.Array  # f[T, Hkv, D]
    kv_cache: jax.Array  # [2, P, S, Hkv, D], cache dtype
    query_start_loc: jax.Array  # i32[R + 1]
    seq_lens: jax.Array  # i32[R]: context + query tokens
    block_tables: jax.Array  # i32[R, pages_per_req]; unused entries are random valid ids
    slot_mapping: jax.Array  # i32[T]; -1 for padding rows
    k_scale: float | None  # fp8 caches only: the cache stores k / k_scale
    v_scale: float | None
    cache_dtype_str: str
    query_lens: np.ndarray  # i32[R]
    context_lens: np.ndarray  # i32[R]
    k_seqs: tuple[np.ndarray, ...]  # R x f[seq_len_r, Hkv, D], activation dtype: context then new
    v_seqs: tuple[np.ndarray, ...]  # R x f[seq_len_r, Hkv, D]

    @property
    def num_actual_tokens(self) -> int:
        return int(self.query_lens.sum())

    @property
    def op_args(self) -> tuple[jax.Array, ...]:
        """The op's positional arguments: (q, k, v, kv_cache, query_start_loc, seq_lens,
        block_tables, slot_mapping)."""
        return (
            self.q,
            self.k,
            self.v,
            self.kv_cache,
            self.query_start_loc,
            self.seq_lens,
            self.block_tables,
            self.slot_mapping,
        )

    @property
    def op_kwargs(self) -> dict[str, jax.Array]:
        """``k_scale`` / ``v_scale`` as f32[] for fp8 caches; empty otherwise."""
        if self.k_scale is None:
            return {}
        return {"k_scale": jnp.float32(self.k_scale), "v_scale": jnp.float32(self.v_scale)}

    def with_shared_prefix(self, prefix_len: int) -> RaggedBatch:
        """This batch with request 0's first ``prefix_len`` cached tokens (whole pages) shared by
        every request: their block tables start with request 0's pages and their dense keys
        and values (the oracle's) with request 0's; the pages they held before go unused."""
        page = self.kv_cache.shape[2]
        if prefix_len % page or (self.context_lens < prefix_len).any():
            raise ValueError(f"prefix_len={prefix_len} must be whole pages of {page} within every context")
        tables = np.asarray(self.block_tables).copy()
        tables[:, : prefix_len // page] = tables[0, : prefix_len // page]
        k_seqs = tuple(np.concatenate([self.k_seqs[0][:prefix_len], k[prefix_len:]]) for k in self.k_seqs)
        v_seqs = tuple(np.concatenate([self.v_seqs[0][:prefix_len], v[prefix_len:]]) for v in self.v_seqs)
        return dataclasses.replace(self, block_tables=jnp.asarray(tables), k_seqs=k_seqs, v_seqs=v_seqs)

    def common_metadata(self) -> CommonAttentionMetadata:
        """This batch as ``CommonAttentionMetadata`` (host copies included), for the layers."""
        qsl, seq_lens = np.asarray(self.query_start_loc), np.asarray(self.seq_lens)
        return CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens, seq_lens_cpu=seq_lens,
            num_computed_tokens_cpu=seq_lens - self.query_lens, num_reqs=len(seq_lens),
            num_actual_tokens=self.num_actual_tokens, max_query_len=int(self.query_lens.max(initial=0)),
            block_table_tensor=np.asarray(self.block_tables), slot_mapping=np.asarray(self.slot_mapping),
        )  # fmt: skip


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _check_lengths(name: str, values: Sequence[int]) -> np.ndarray:
    lengths = [_check_int(f"{name}[{i}]", x, 0) for i, x in enumerate(values)]
    return np.asarray(lengths, dtype=np.int32).reshape(len(lengths))


def _default_scale(seqs: Sequence[np.ndarray], x_range: float) -> float:
    """``calc_kv_scales``'s rule in NumPy: max |x| / x_range, at least MIN_SCALE."""
    amax = max(float(np.abs(x.astype(np.float32)).max(initial=0.0)) for x in seqs)
    return max(amax / x_range, MIN_SCALE)


def _to_cache(x: np.ndarray, cache_dtype: np.dtype, scale: float | None) -> np.ndarray:
    """``quantize_to_cache`` in NumPy: x / scale clipped and cast for fp8, else a cast."""
    if not is_fp8_dtype(cache_dtype):
        return x.astype(cache_dtype)
    limit = float(ml_dtypes.finfo(cache_dtype).max)
    return np.clip(x.astype(np.float32) / np.float32(scale), -limit, limit).astype(cache_dtype)


def make_ragged_batch(
    seed_or_rng: int | np.random.Generator,
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype=np.float32,
    cache_dtype_str: str = "auto",
    num_tokens: int | None = None,
    extra_blocks: int = 0,
    num_padding_requests: int = 0,
    shuffle_blocks: bool = True,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> RaggedBatch:
    """A random ragged batch: request r has ``context_lens[r]`` cached tokens and
    ``query_lens[r]`` new ones (``seq_len = context + query``).

    q, k and v are standard normal in ``dtype`` (float32, bfloat16 or float16). The
    context keys and values are written (with NumPy, not the op's write path) into a
    fresh NaN-filled cache (``cache_dtype_str``, vLLM's names) at pages chosen at random
    (``shuffle_blocks``) or in order; the new tokens' keys and values are the op's k/v
    inputs, with their slots in ``slot_mapping``. Every request gets
    ``ceil(seq_len / block_size)`` distinct pages, unused block-table entries hold
    random valid page ids, and ``extra_blocks`` more pages stay unused (NaN).
    ``num_tokens`` (default: the real tokens) pads the token axis with rows of large
    finite random values (standard deviation ``PADDING_SCALE``) and slot -1.
    ``num_padding_requests`` empty requests (query 0, seq_len 0) go at the end.
    fp8 caches use ``k_scale`` / ``v_scale``, by default vLLM's ``calc_kv_scales`` rule
    (max |x| / 200 for keys, / 100 for values) on all of the batch's keys and values;
    other caches take no scales.
    """
    rng = np.random.default_rng(seed_or_rng)
    dtype = validate_activation_dtype(dtype)
    query_lens = _check_lengths("query_lens", query_lens)
    context_lens = _check_lengths("context_lens", context_lens)
    if query_lens.shape != context_lens.shape:
        raise ValueError(
            f"query_lens and context_lens must have the same length, got {query_lens.size} and {context_lens.size}"
        )
    num_padding_requests = _check_int("num_padding_requests", num_padding_requests, 0)
    if query_lens.size + num_padding_requests == 0:
        raise ValueError("a batch needs at least one request: query_lens is empty and num_padding_requests=0")
    num_q_heads = _check_int("num_q_heads", num_q_heads, 1)
    num_kv_heads = _check_int("num_kv_heads", num_kv_heads, 1)
    head_size = _check_int("head_size", head_size, 1)
    block_size = _check_int("block_size", block_size, 1)
    extra_blocks = _check_int("extra_blocks", extra_blocks, 0)
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"{num_q_heads=} must be divisible by {num_kv_heads=}")
    quantized = is_quantized_kv_cache(cache_dtype_str)
    if not quantized and (k_scale is not None or v_scale is not None):
        raise ValueError(
            f"k_scale/v_scale apply to fp8 caches only, got {k_scale=}, {v_scale=} for "
            f"cache_dtype_str={cache_dtype_str!r}"
        )
    num_actual = int(query_lens.sum())
    num_tokens = num_actual if num_tokens is None else _check_int("num_tokens", num_tokens, num_actual)

    pad = num_padding_requests
    query_lens = np.concatenate([query_lens, np.zeros(pad, np.int32)])
    context_lens = np.concatenate([context_lens, np.zeros(pad, np.int32)])
    seq_lens = context_lens + query_lens  # i32[R]
    num_reqs = seq_lens.size
    pages = -(-seq_lens // block_size)  # i32[R]
    pages_per_req = max(int(pages.max(initial=0)), 1)
    num_blocks = max(int(pages.sum()) + extra_blocks, 1)

    # Physical pages: request r's pages are ids[offsets[r] : offsets[r] + pages[r]].
    ids = rng.permutation(num_blocks) if shuffle_blocks else np.arange(num_blocks)
    offsets = np.concatenate([[0], np.cumsum(pages)])
    block_tables = rng.integers(0, num_blocks, size=(num_reqs, pages_per_req), dtype=np.int32)
    for r in range(num_reqs):
        block_tables[r, : pages[r]] = ids[offsets[r] : offsets[r + 1]]

    def slot(r: int, positions: np.ndarray) -> np.ndarray:
        return block_tables[r, positions // block_size] * block_size + positions % block_size

    def normal(*shape: int, scale: float = 1.0) -> np.ndarray:
        return (scale * rng.standard_normal(shape, dtype=np.float32)).astype(dtype)

    k_seqs = tuple(normal(int(n), num_kv_heads, head_size) for n in seq_lens)
    v_seqs = tuple(normal(int(n), num_kv_heads, head_size) for n in seq_lens)
    num_pad_rows = num_tokens - num_actual

    def padded(real_rows: list[np.ndarray], num_heads: int) -> np.ndarray:  # f[T, H, D]
        garbage = normal(num_pad_rows, num_heads, head_size, scale=PADDING_SCALE)
        return np.concatenate([*real_rows, garbage])

    q = padded([normal(num_actual, num_q_heads, head_size)], num_q_heads)
    k = padded([ks[c:] for ks, c in zip(k_seqs, context_lens, strict=True)], num_kv_heads)
    v = padded([vs[c:] for vs, c in zip(v_seqs, context_lens, strict=True)], num_kv_heads)
    slot_mapping = np.concatenate(
        [*(slot(r, np.arange(context_lens[r], seq_lens[r])) for r in range(num_reqs)),
         np.full(num_pad_rows, -1)]
    ).astype(np.int32)  # fmt: skip
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)

    if quantized:
        k_scale = _default_scale(k_seqs, DEFAULT_K_RANGE) if k_scale is None else float(k_scale)
        v_scale = _default_scale(v_seqs, DEFAULT_V_RANGE) if v_scale is None else float(v_scale)

    # The cache is built in NumPy, independently of the op's own write path.
    shape = XLAAttentionBackend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str)
    cache_dtype = XLAAttentionBackend.kv_cache_dtype_for(cache_dtype_str, dtype)
    kv_cache = np.full(shape, np.nan, dtype=cache_dtype)  # [2, P, S, Hkv, D]
    flat = kv_cache.reshape(2, num_blocks * block_size, num_kv_heads, head_size)  # a view
    for r in range(num_reqs):
        ctx = slot(r, np.arange(context_lens[r]))
        flat[0, ctx] = _to_cache(k_seqs[r][: context_lens[r]], cache_dtype, k_scale)
        flat[1, ctx] = _to_cache(v_seqs[r][: context_lens[r]], cache_dtype, v_scale)

    return RaggedBatch(
        q=jnp.asarray(q),
        k=jnp.asarray(k),
        v=jnp.asarray(v),
        kv_cache=jnp.asarray(kv_cache),
        query_start_loc=jnp.asarray(query_start_loc),
        seq_lens=jnp.asarray(seq_lens),
        block_tables=jnp.asarray(block_tables),
        slot_mapping=jnp.asarray(slot_mapping),
        k_scale=k_scale if quantized else None,
        v_scale=v_scale if quantized else None,
        cache_dtype_str=cache_dtype_str,
        query_lens=query_lens,
        context_lens=context_lens,
        k_seqs=k_seqs,
        v_seqs=v_seqs,
    )


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """A benchmark workload: request lengths and model shape (all lengths in tokens)."""

    name: str
    description: str
    query_lens: tuple[int, ...]  # new tokens per request
    context_lens: tuple[int, ...]  # cached tokens per request, before the new ones
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"
    causal: bool = True

    def make_batch(self, seed_or_rng: int | np.random.Generator = 0, **overrides) -> RaggedBatch:
        """``make_ragged_batch`` for this workload; ``overrides`` go to it as keywords."""
        kwargs = dict(
            num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            block_size=self.block_size,
            dtype=jnp.dtype(self.dtype),
        )
        return make_ragged_batch(seed_or_rng, self.query_lens, self.context_lens, **{**kwargs, **overrides})


WORKLOADS: dict[str, WorkloadSpec] = {
    spec.name: spec
    for spec in (
        WorkloadSpec("D1", "decode: 64 requests, 1 new token on 4096 cached", (1,) * 64, (4096,) * 64),
        WorkloadSpec("D2", "decode: 8 requests, 1 new token on 32768 cached", (1,) * 8, (32768,) * 8),
        WorkloadSpec(
            "M1",
            "mixed: 4 prefill chunks of 512 new tokens on 1024 cached, then 60 decodes on 2048 cached",
            (512,) * 4 + (1,) * 60,
            (1024,) * 4 + (2048,) * 60,
        ),
        WorkloadSpec("P1", "prefill: 4 requests of 4096 new tokens, no cache, causal", (4096,) * 4, (0,) * 4),
        WorkloadSpec(
            "M2",
            "mixed, a serving step: 1 prefill chunk of 512 new tokens on 1024 cached, then 63 decodes on 2048 cached",
            (512,) + (1,) * 63,
            (1024,) + (2048,) * 63,
        ),
        *(
            WorkloadSpec(
                f"E{n}",
                f"the engine's decode step at batch {n} on SmolLM2-135M's heads: 1 new token on 256 cached each",
                (1,) * n,
                (256,) * n,
                num_q_heads=9,
                num_kv_heads=3,
                head_size=64,
            )
            for n in (1, 64, 256)
        ),
        *(
            WorkloadSpec(
                f"EM{n}",
                f"the engine's admission step at batch {n} on SmolLM2-135M's heads: {n - p} decodes on 256 "
                f"cached, then {p} new prompt(s) of 128 tokens (rows after the decodes: no 8-aligned Mosaic tile)",
                (1,) * (n - p) + (128,) * p,
                (256,) * (n - p) + (0,) * p,
                num_q_heads=9,
                num_kv_heads=3,
                head_size=64,
            )
            for n, p in ((64, 1), (256, 2))
        ),
        *(
            WorkloadSpec(name, description, query_lens, context_lens, num_q_heads=9, num_kv_heads=3, head_size=64)
            for name, description, query_lens, context_lens in (
                (
                    "EA256",
                    "an upper bound on the server's admission step at 256 clients on SmolLM2-135M's heads "
                    "(serve_load's mean mixed call: 151 requests, about 137 decodes on 128-255 cached and 14 "
                    "prompts): 151 decodes on 256 cached, then 14 new prompts of 128 tokens",
                    (1,) * 151 + (128,) * 14,
                    (256,) * 151 + (0,) * 14,
                ),
                (
                    "EA256R",
                    "EA256 with the prompts first: 14 new prompts of 128 tokens, then 151 decodes on 256 cached",
                    (128,) * 14 + (1,) * 151,
                    (0,) * 14 + (256,) * 151,
                ),
            )
        ),
    )
}
"""DESIGN.md's benchmark workloads (bf16, 32 q heads, 8 kv heads, head_dim 128, block 16),
M2, a continuous-batching step as a serving engine's chunked prefill makes it (one chunk
beside the running decodes; not in DESIGN.md), and E1 / E64 / E256, the decode step that
``benchmarks/generate_gpu.py`` times (SmolLM2-135M: 9 q heads, 3 kv heads, head_dim 64), whose
kernels the tuned tables must also cover, and EM64 / EM256, a serving step that admits prompts
beside the decodes, on the same heads, with EA256 (EA256R: its prompts first) an upper bound on the
admission step of ``benchmarks/serve_load.py`` at 256 clients (not in DESIGN.md).

"Context" in DESIGN.md's wording is read as cached tokens: a D1 request has seq_len 4097.
"""
