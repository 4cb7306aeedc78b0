"""Ragged paged attention on a GPU: DESIGN.md's workloads D1, D2, M1, P1 against the floors.

For each workload: the bytes floor (KV read once + q read + out written, over the measured
device-to-device copy bandwidth) and the FLOPs floor (4 * D per visible (q, k) pair per
query head, over the measured bf16 matmul rate); then, for each implementation, the
median time, achieved GB/s and TFLOP/s, the percentage of the binding floor and the
relative L2 error against a float32 reference on the same inputs.

Implementations: PALLAS_GPU (this project's kernels, default or tuned block sizes; on
Hopper, prefill batches with the Mosaic GPU split as the opt-in builder makes it, beside
``pallas_gpu_triton_only``, or mixed batches forced through the split as
``pallas_gpu_mgpu_split``, and each launch of a split alone as ``part_*`` rows;
``pallas_gpu_with_write``: write + attend in one donated jit, with the device time of each
kernel class from a CUPTI trace and the write alone by the Pallas kernel and by XLA's
scatter), XLA (the jnp reference), and peers: jax's Pallas ``paged_attention`` (decode), cuDNN through
``jax.nn.dot_product_attention`` on the dense equivalent, torch SDPA on the dense
equivalent (when torch with CUDA is there), and FlashAttention-3 (``fa3``: the
``flash-attn3-jax`` wheel, Hopper only, installed on the GPU machine; never a dependency):
its paged ``flash_mha_with_kvcache`` at each of ``--fa3-pages`` with ``num_splits`` swept
(one call per query length, so M1 is two calls), ``flash_mha_varlen`` on dense packed k/v
for mixed batches and ``flash_mha`` for uniform prefills; inputs converted outside the timed
region (``fa3_peer.py``), every output checked against the float32 reference and PALLAS_GPU's.

Besides the host-timed ``ms`` (median of back-to-back calls), rows of pallas_gpu, the write
step and fa3 carry ``device_ms``: the median over ``--cupti-calls`` calls of each call's
GPU time from a CUPTI trace (``cupti_timing.py``), each call waited for and the device idle
between calls, with the same floors; their ``back_to_back_us`` is the steady state, the same
calls issued without waiting (a launch gap between a call's kernels that the host hides behind
the device's earlier work, as in a model's step, then does not count).

    python benchmarks/attention.py                       # all workloads, all implementations
    python benchmarks/attention.py --tune D1,M1          # + block-size sweeps, merged into tuned/gpu_*.json
    python benchmarks/attention.py --workloads D1 --impls pallas_gpu
    python benchmarks/attention.py --workloads D1,D2,M1,P1,P1_p128 --impls pallas_gpu,fa3 --out r.json

A workload name may carry a page size and a head size: ``P1_p128``, ``D1_h80``.

Writes benchmarks/results/attention_<device>.json (or --out).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import functools
import itertools
import json
import os
import pathlib
import platform
import re
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax import Attention, CommonAttentionMetadata
from attn_jax.backends import pallas_gpu as pallas_gpu_backend
from attn_jax.backends.pallas_gpu import launch_mode, mgpu_split
from attn_jax.kv_cache import write_to_kv_cache
from attn_jax.ops.ragged_paged_attention import kv_write, pallas_mosaic_gpu, pallas_triton, reference
from attn_jax.ops.ragged_paged_attention.config import (
    GPU_MATCH_KEYS,
    H100_NUM_SMS,
    MAX_PACKED_WIDTH,
    TUNED_DIR,
    GpuBlockSizes,
    check_block_sizes,
    decode_part_block_sizes,
    gpu_batch_mode,
    gpu_block_sizes,
    gpu_entry_key,
    kv_heads_to_pack,
    mgpu_block_sizes,
    mgpu_prefill_available,
    next_pow2,
)
from attn_jax.registry import AttentionBackendEnum
from attn_jax.testing.workloads import WORKLOADS, WorkloadSpec

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks.fa3_peer and benchmarks.cupti_timing when run as a script
    sys.path.insert(0, str(ROOT))

from benchmarks import cupti_timing, fa3_peer  # noqa: E402 - after the path above
from benchmarks.gpu_check import gpu_device  # noqa: E402


# --------------------------------------------------------------------------- inputs
@dataclasses.dataclass
class DeviceBatch:
    """One workload's op inputs on the device (random bf16 values, no NaN: timing only)."""

    spec: WorkloadSpec
    q: jax.Array  # bf16[T, Hq, D]
    kv_cache: jax.Array  # bf16[2, P, S, Hkv, D]
    query_start_loc: jax.Array
    seq_lens: jax.Array
    block_tables: jax.Array
    slot_mapping: jax.Array
    query_lens: np.ndarray
    context_lens: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.q.shape[0])


def make_device_batch(spec: WorkloadSpec, seed: int = 0) -> DeviceBatch:
    """Pages shuffled over the cache; values drawn on the device (fast for GB-sized caches)."""
    rng = np.random.default_rng(seed)
    qlens, clens = np.asarray(spec.query_lens, np.int32), np.asarray(spec.context_lens, np.int32)
    seq_lens = qlens + clens
    S = spec.block_size
    pages = -(-seq_lens // S)
    num_blocks = int(pages.sum())
    width = int(pages.max())
    ids = rng.permutation(num_blocks).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(pages)])
    tables = np.zeros((len(seq_lens), width), np.int32)
    slots = []
    for r in range(len(seq_lens)):
        tables[r, : pages[r]] = ids[offsets[r] : offsets[r + 1]]
        pos = np.arange(clens[r], seq_lens[r])
        slots.append(tables[r, pos // S] * S + pos % S)
    T = int(qlens.sum())
    key_q, key_kv = jax.random.split(jax.random.key(seed))
    dtype = jnp.dtype(spec.dtype)
    q = jax.random.normal(key_q, (T, spec.num_q_heads, spec.head_size), dtype)
    kv = jax.random.normal(key_kv, (2, num_blocks, S, spec.num_kv_heads, spec.head_size), dtype)
    return DeviceBatch(
        spec, q, kv, jnp.asarray(np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)), jnp.asarray(seq_lens),
        jnp.asarray(tables), jnp.asarray(np.concatenate(slots).astype(np.int32)), qlens, clens,
    )  # fmt: skip


def count_floors(spec: WorkloadSpec, query_lens, context_lens) -> tuple[float, float]:
    """(bytes, flops) of attention over these requests at ``spec``'s shape: KV read once + q read
    + out written; 4 * D per visible (causal) pair per q head."""
    item = jnp.dtype(spec.dtype).itemsize
    query_lens, context_lens = np.asarray(query_lens), np.asarray(context_lens)
    seq = query_lens + context_lens
    kv_bytes = 2 * int(seq.sum()) * spec.num_kv_heads * spec.head_size * item
    qo_bytes = 2 * int(query_lens.sum()) * spec.num_q_heads * spec.head_size * item
    # Query token i of request r (position c + i) sees c + i + 1 keys (causal).
    pairs = sum(int(q) * int(c) + int(q) * (int(q) + 1) // 2 for q, c in zip(query_lens, context_lens, strict=True))
    return kv_bytes + qo_bytes, 4.0 * spec.head_size * spec.num_q_heads * pairs


def floors(b: DeviceBatch) -> tuple[float, float]:
    """(bytes, flops) of the whole batch (``count_floors``)."""
    return count_floors(b.spec, b.query_lens, b.context_lens)


# --------------------------------------------------------------------------- timing
def time_jax(fn, *args, reps: int = 30, inner: int = 5) -> float:
    """Median seconds per call: ``inner`` calls back to back, synchronised, ``reps`` times."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def measure_ceilings() -> dict[str, float]:
    """Device-to-device copy bandwidth (bytes read + written) and bf16 8192^3 matmul rate."""
    x = jax.random.normal(jax.random.key(1), (1 << 30,), jnp.bfloat16)  # 2 GiB
    copy = jax.jit(lambda x: x * jnp.bfloat16(1.0001))
    t_copy = time_jax(copy, x, reps=10, inner=3)
    del x
    a = jax.random.normal(jax.random.key(2), (8192, 8192), jnp.bfloat16)
    bm = jax.random.normal(jax.random.key(3), (8192, 8192), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    t_mm = time_jax(mm, a, bm, reps=10, inner=3)
    return {"copy_bytes_per_s": 2 * 2 * (1 << 30) / t_copy, "matmul_flops_per_s": 2 * 8192**3 / t_mm}


# --------------------------------------------------------------------------- implementations
def schedules(b: DeviceBatch, block_sizes: GpuBlockSizes, mgpu: bool) -> dict:
    """The kernel's schedule arguments, as the metadata builder makes them on this device
    (the Mosaic GPU split for prefill and mixed batches on Hopper, a mixed batch's decodes on
    decode blocks in the Triton launch); ``mgpu=False`` leaves the split out (the Triton kernel
    serves all), ``mgpu="force"`` makes it for any batch."""
    qsl, seq = np.asarray(b.query_start_loc), np.asarray(b.seq_lens)
    kind = jax.devices()[0].device_kind
    s = b.spec
    mode = launch_mode(b.query_lens)
    decode_bs = None
    if mode == "mixed":
        decode_bs = decode_part_block_sizes(
            block_sizes, default_block_sizes(b, mode="decode"), group=s.num_q_heads // s.num_kv_heads,
            page_size=s.block_size, device_kind=kind, head_size=s.head_size, q_dtype=s.dtype,
            kv_dtype=s.dtype,
        )  # fmt: skip
    make = pallas_triton.gpu_schedule if decode_bs is None else pallas_triton.mixed_schedule
    schedule = make(qsl, seq, num_tokens=b.num_tokens, block_q=block_sizes.block_q, xp=np)
    out = {"schedule": jnp.asarray(schedule), "decode_block_sizes": decode_bs}
    takes_split = pallas_gpu_backend.PallasGPUMetadataBuilder.takes_mgpu_split(mode, b.num_tokens)
    if mgpu_prefill_available(kind) and (mgpu == "force" or (mgpu and takes_split)):
        mbs = mgpu_block_sizes(head_size=b.spec.head_size, device_kind=kind)
        out.update(mgpu_split(qsl, seq, num_tokens=b.num_tokens, block_q=block_sizes.block_q, mgpu_bs=mbs,
                              decode_part=decode_bs is not None))  # fmt: skip
    return out


def pallas_gpu_fn(b: DeviceBatch, block_sizes: GpuBlockSizes | None, mgpu: bool = True):
    s = b.spec
    if block_sizes is None:
        block_sizes = default_block_sizes(b)
    sched = schedules(b, block_sizes, mgpu)

    @jax.jit
    def run(q, kv_cache, qsl, seq_lens, tables, slots):
        out, _ = pallas_gpu_backend.ragged_paged_attention(
            q, None, None, kv_cache, qsl, seq_lens, tables, slots, sm_scale=s.head_size**-0.5,
            interpret=False, block_sizes=block_sizes, **sched,
        )  # fmt: skip
        return out

    return run


def split_part_times(b: DeviceBatch, bs: GpuBlockSizes, sched: dict) -> dict[str, float]:
    """Seconds of the Mosaic GPU prefill launch alone and of the Triton launch on the rest alone."""
    s = b.spec
    mgpu = jax.jit(functools.partial(pallas_mosaic_gpu.prefill_attention, sm_scale=s.head_size**-0.5,
                                     block_sizes=sched["mgpu_block_sizes"]))  # fmt: skip

    rest = functools.partial(
        pallas_triton._attend, sm_scale=s.head_size**-0.5, causal=True, sliding_window=None, soft_cap=None,
        block_sizes=bs, interpret=False, decode_block_sizes=sched["decode_block_sizes"],
    )  # fmt: skip

    times = {"part_mgpu_prefill": time_jax(mgpu, b.q, b.kv_cache, sched["mgpu_schedule"], b.block_tables)}
    if sched["rest_schedule"] is not None:
        times["part_triton_rest"] = time_jax(
            lambda q, c, sc, bt: rest(q, c, sc, bt, None, None, None, None, None),
            b.q, b.kv_cache, sched["rest_schedule"], b.block_tables,
        )  # fmt: skip
    return times


def with_write_ms(b: DeviceBatch, reps: int = 30, inner: int = 5, cupti_calls: int = 50) -> dict[str, float]:
    """Median ms per step of write + attend (the op as a layer calls it, cache donated, one jit),
    and of the k/v write alone by the Pallas kernel and by XLA's scatter, each in place; the
    step's device time per kernel class from a CUPTI trace of ``cupti_calls`` steps
    (``device_us_per_step``: means; ``device_step``: the median step and class medians)."""
    s = b.spec
    bs = default_block_sizes(b)
    sched = schedules(b, bs, True)
    k = jax.random.normal(jax.random.key(7), (b.num_tokens, s.num_kv_heads, s.head_size), b.q.dtype)
    rest = (b.query_start_loc, b.seq_lens, b.block_tables, b.slot_mapping)

    def step(q, k, v, kv_cache, *rest):
        return pallas_gpu_backend.ragged_paged_attention(
            q, k, v, kv_cache, *rest, sm_scale=s.head_size**-0.5, interpret=False, block_sizes=bs, **sched
        )

    def chain(fn, args_of):
        cache = jnp.array(b.kv_cache)
        cache = fn(*args_of(cache))
        times = []
        for _ in range(reps):
            jax.block_until_ready(cache)
            t0 = time.perf_counter()
            for _ in range(inner):
                cache = fn(*args_of(cache))
            jax.block_until_ready(cache)
            times.append((time.perf_counter() - t0) / inner)
        del cache
        return statistics.median(times) * 1e3

    full = jax.jit(step, donate_argnums=3)
    out_ms = {}
    cache = jnp.array(b.kv_cache)
    out, cache = full(b.q, k, k, cache, *rest)
    times = []
    for _ in range(reps):
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        for _ in range(inner):
            out, cache = full(b.q, k, k, cache, *rest)
        jax.block_until_ready((out, cache))
        times.append((time.perf_counter() - t0) / inner)
    out_ms["write_and_attend_ms"] = statistics.median(times) * 1e3
    state = {"cache": cache}
    del cache

    def one_step():
        out, new_cache = full(b.q, k, k, state["cache"], *rest)
        state["cache"] = new_cache
        return out, new_cache

    try:  # per-kernel device times of the same step (CUPTI through jax.profiler), medians over steps
        summary = cupti_timing.summarize(cupti_timing.trace_calls({"step": one_step}, n=cupti_calls)["step"],
                                         KERNEL_CLASSES)  # fmt: skip
        out_ms["device_us_per_step"] = summary.pop("mean_us_by_class")
        out_ms["device_step"] = cupti_timing.with_back_to_back(summary, one_step, cupti_calls)
    except Exception as e:  # noqa: BLE001 - a profiler that cannot run here must not lose the timings
        out_ms["device_us_per_step"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    state.clear()
    del out
    for name, f in (("pallas_write_ms", kv_write.write_kv), ("xla_scatter_write_ms", write_to_kv_cache)):
        fn = jax.jit(lambda c, f=f: f(c, k, k, b.slot_mapping), donate_argnums=0)
        out_ms[name] = chain(fn, lambda c: (c,))
    return out_ms


KERNEL_CLASSES = (
    ("attention_mosaic_gpu", "ragged_paged_prefill_mgpu"),
    ("attention_triton", "ragged_paged_attention_gpu"),
    ("kv_write_pallas", "kv_write_gpu"),
    ("kv_write_xla_scatter", "scatter"),
)
"""(class, substring of the kernel name) for ``cupti_timing.summarize``; first match wins, the rest is "other"."""


def default_block_sizes(b: DeviceBatch, mode: str | None = None) -> GpuBlockSizes:
    """The builder's Triton blocks for the batch (``mode``: its launch's, ``launch_mode``, unless given)."""
    s = b.spec
    mode = mode or launch_mode(b.query_lens)
    return gpu_block_sizes(
        num_reqs=len(b.query_lens), pages_per_req=int(b.block_tables.shape[1]), page_size=s.block_size,
        head_size=s.head_size, num_kv_heads=s.num_kv_heads, group=s.num_q_heads // s.num_kv_heads,
        mode=mode, q_dtype=s.dtype, kv_dtype=s.dtype,
        device_kind=jax.devices()[0].device_kind,
    )  # fmt: skip


LAYER_METADATA_PATHS = ("host", "host_per_step", "traced")


def layer_step_ms(b: DeviceBatch, metadata: str, reps: int = 30, inner: int = 5) -> float:
    """Median ms per step of write + attend through the public ``Attention`` layer (PALLAS_GPU,
    cache donated), ``metadata`` one of ``LAYER_METADATA_PATHS``: "traced" passes the host's
    ``CommonAttentionMetadata`` into ``jax.jit(layer.__call__)`` every step (its arrays go to
    the device with the call); "host" builds the backend's metadata with ``layer.prepare(md)``
    once and reuses it on the device every step; "host_per_step" calls ``layer.prepare(md)``
    every step, as the engine does for each new batch (the host's schedule, then its copy)."""
    if metadata not in LAYER_METADATA_PATHS:
        raise ValueError(f"metadata={metadata!r}; valid: {LAYER_METADATA_PATHS}")
    s = b.spec
    layer = Attention(s.num_q_heads, s.head_size, s.head_size**-0.5, s.num_kv_heads, block_size=s.block_size,
                      dtype=s.dtype, attn_backend=AttentionBackendEnum.PALLAS_GPU)  # fmt: skip
    qsl, seq = np.asarray(b.query_start_loc), np.asarray(b.seq_lens)
    md = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, seq_lens_cpu=seq,
        num_computed_tokens_cpu=b.context_lens, num_reqs=len(seq), num_actual_tokens=b.num_tokens,
        max_query_len=int(b.query_lens.max()), block_table_tensor=np.asarray(b.block_tables),
        slot_mapping=np.asarray(b.slot_mapping),
    )  # fmt: skip
    T = b.num_tokens
    q = b.q.reshape(T, -1)
    k = jax.random.normal(jax.random.key(7), (T, s.num_kv_heads * s.head_size), b.q.dtype)
    reused = md if metadata == "traced" else layer.prepare(md)
    step = jax.jit(layer.__call__, donate_argnums=3)
    state = {"cache": jnp.array(b.kv_cache)}
    times = []
    for i in range(reps + 1):
        jax.block_until_ready(state["cache"])
        t0 = time.perf_counter()
        for _ in range(inner):
            attn_md = layer.prepare(md) if metadata == "host_per_step" else reused
            out, state["cache"] = step(q, k, k, state["cache"], attn_md)
        jax.block_until_ready((out, state["cache"]))
        if i:  # the first round compiles
            times.append((time.perf_counter() - t0) / inner)
    state.clear()
    return statistics.median(times) * 1e3


def xla_fn(b: DeviceBatch, dtype=None):
    s = b.spec

    @jax.jit
    def run(q, kv_cache, qsl, seq_lens, tables, slots):
        if dtype is not None:
            q, kv_cache = q.astype(dtype), kv_cache.astype(dtype)
        out, _ = reference.ragged_paged_attention(
            q, None, None, kv_cache, qsl, seq_lens, tables, slots, sm_scale=s.head_size**-0.5
        )
        return out

    return run


def dense_kv(b: DeviceBatch):
    """Per-request dense k/v [B, L, Hkv, D] (all requests have one length in these workloads)."""
    seq = b.query_lens + b.context_lens
    groups = {}
    for r, n in enumerate(seq):
        groups.setdefault(int(n), []).append(r)
    out = []
    for n, reqs in groups.items():
        pages = b.block_tables[np.asarray(reqs)][:, : -(-n // b.spec.block_size)]
        kv = b.kv_cache[:, pages].reshape(2, len(reqs), -1, b.spec.num_kv_heads, b.spec.head_size)[:, :, :n]
        out.append((reqs, n, kv))
    return out


def cudnn_fn(b: DeviceBatch):
    """jax.nn.dot_product_attention(implementation="cudnn") per group of equal-length requests."""
    s = b.spec
    parts = dense_kv(b)
    qlens = b.query_lens
    qsl = np.concatenate([[0], np.cumsum(qlens)])

    def run(q):
        outs = []
        for reqs, n, kv in parts:
            ql = int(qlens[reqs[0]])
            rows = np.concatenate([np.arange(qsl[r], qsl[r + 1]) for r in reqs])
            qq = q[rows].reshape(len(reqs), ql, s.num_q_heads, s.head_size)
            # Causal with the cached prefix: query i sees keys <= (n - ql) + i (bottom-right).
            mask = None
            if ql > 1:
                mask = (jnp.arange(n)[None, :] <= (n - ql) + jnp.arange(ql)[:, None])[None, None]
            outs.append(jax.nn.dot_product_attention(
                qq, kv[0], kv[1], mask=mask if (ql > 1 and ql != n) else None, is_causal=(ql == n and ql > 1),
                scale=s.head_size**-0.5, implementation="cudnn",
            ))  # fmt: skip
        return outs

    return jax.jit(run)


def peer_paged_fn(b: DeviceBatch):
    """jax.experimental.pallas.ops.gpu.paged_attention (decode only; cache in its layout)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention as pa
    k_pages = jnp.transpose(b.kv_cache[0], (2, 0, 1, 3))  # [Hkv, P, S, D]
    v_pages = jnp.transpose(b.kv_cache[1], (2, 0, 1, 3))
    lengths = b.seq_lens
    q = b.q * jnp.asarray(b.spec.head_size**-0.5, b.q.dtype)  # the peer does not scale q
    width = b.block_tables.shape[1]
    tables = jnp.pad(b.block_tables, ((0, 0), (0, -width % 256)))  # its splits x pages per block must divide
    pages_per_seq = tables.shape[1]
    best = None
    for ppcb, splits in ((8, 1), (8, 4), (16, 8), (8, 16), (16, 16)):
        if pages_per_seq % splits or (pages_per_seq // splits) % ppcb:
            continue
        fn = jax.jit(functools.partial(pa.paged_attention, pages_per_compute_block=ppcb, k_splits=splits))
        try:
            t = time_jax(fn, q, k_pages, v_pages, tables, lengths, reps=10, inner=3)
        except Exception:  # noqa: BLE001 - a config the peer rejects
            continue
        if best is None or t < best[0]:
            best = (t, fn, {"pages_per_compute_block": ppcb, "k_splits": splits})
    if best is None:
        raise RuntimeError("no paged_attention configuration ran")
    return best[1], (q, k_pages, v_pages, tables, lengths), best[2]


def torch_sdpa_time(b: DeviceBatch) -> float:
    import torch
    import torch.nn.functional as F

    s = b.spec
    parts = dense_kv(b)
    tq = torch.from_dlpack(b.q)
    qsl = np.concatenate([[0], np.cumsum(b.query_lens)])
    calls = []
    for reqs, n, kv in parts:
        ql = int(b.query_lens[reqs[0]])
        rows = torch.as_tensor(np.concatenate([np.arange(qsl[r], qsl[r + 1]) for r in reqs]), device="cuda")
        qq = tq[rows].reshape(len(reqs), ql, s.num_q_heads, s.head_size).transpose(1, 2).contiguous()
        k = torch.from_dlpack(kv[0]).transpose(1, 2).contiguous()
        v = torch.from_dlpack(kv[1]).transpose(1, 2).contiguous()
        mask = None
        if 1 < ql < n:
            mask = torch.arange(n, device="cuda")[None, :] <= (n - ql) + torch.arange(ql, device="cuda")[:, None]
        calls.append((qq, k, v, mask, ql == n and ql > 1))

    def run():
        sdpa = F.scaled_dot_product_attention
        return [sdpa(q, k, v, attn_mask=m, is_causal=c, enable_gqa=True) for q, k, v, m, c in calls]

    import triton.testing

    return triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median") / 1e3


def device_summary(fn, *args, calls: int = 50) -> dict:
    """``cupti_timing.summarize`` of ``calls`` calls of ``fn(*args)`` (device span per call, medians),
    with ``back_to_back_us``: the same calls issued without waiting."""
    summary = cupti_timing.summarize(cupti_timing.trace_calls({"fn": lambda: fn(*args)}, n=calls)["fn"])
    return cupti_timing.with_back_to_back(summary, lambda: fn(*args), calls)


# --------------------------------------------------------------------------- FlashAttention-3
def fa3_unavailable_reason(fa3_error: str | None, device) -> str | None:
    """Why FA3 rows cannot run here (the import's error, or a GPU other than Hopper), else None."""
    if fa3_error:
        return fa3_error
    cc = getattr(device, "compute_capability", None)
    if cc is not None and str(cc) != "9.0":
        return f"{fa3_peer.FA3_WHEEL} is built for SM90 (Hopper) only; this GPU is {device.device_kind} (sm {cc})"
    return None


@dataclasses.dataclass
class Fa3Config:
    """One FA3 call (or the two of a mixed batch) on inputs already in its layout."""

    impl: str
    fn: object  # jitted
    args: tuple
    rows: np.ndarray | None  # i32[n]: the packed rows its output covers; None: all of them
    to_packed: object  # out -> [n or T, Hq, D]
    extra: dict


def fa3_configs(fa3, b: DeviceBatch, pages: list[int], splits: list[int]) -> tuple[list[Fa3Config], dict]:
    """Every FA3 call to time on ``b``: the paged call per page size x query-length group x
    num_splits (splits swept for groups with cached context, 1 for pure prefill), the dense
    varlen call for batches of several query lengths, dense ``flash_mha`` for a prefill of
    equal lengths. Also returns, per page size, what ``fa3_combined`` needs."""
    s = b.spec
    sm = s.head_size**-0.5
    seq = b.query_lens + b.context_lens
    groups = fa3_peer.call_groups(b.query_lens, seq)
    T, Hq, D = b.q.shape
    out, per_page = [], {}
    for page in pages:
        if page == s.block_size:
            kv, tables = b.kv_cache, np.asarray(b.block_tables)
        else:
            kv, tables = fa3_peer.repage(b.kv_cache, np.asarray(b.block_tables), seq, page)
        kc, vc = kv[0], kv[1]  # bf16[P, S, Hkv, D] each, FA3's paged layout
        del kv
        per_page[page] = []
        for g in groups:
            gargs = (fa3_peer.group_q(b.q, g), kc, vc, fa3_peer.group_tables(tables, g, page),
                     jnp.asarray(seq[g.reqs], jnp.int32))  # fmt: skip
            sweep = splits if int(b.context_lens[g.reqs].max()) > 0 else [1]
            per_page[page].append((g, gargs, sweep))
            for n in sweep:
                suffix = f"_q{g.q_len}" if len(groups) > 1 else ""
                out.append(Fa3Config(
                    f"fa3_paged_p{page}_s{n}{suffix}", jax.jit(fa3_peer.paged_call(fa3, sm_scale=sm, num_splits=n)),
                    gargs, None if len(groups) == 1 else g.rows, lambda o: o.reshape(-1, Hq, D),
                    {"page_size": page, "num_splits": n, "q_len": g.q_len, "requests": len(g.reqs),
                     "call": "flash_mha_with_kvcache"},
                ))  # fmt: skip
    if len(groups) > 1 or (b.context_lens == 0).all():
        k, v, cu_k = fa3_peer.packed_kv(b.kv_cache, np.asarray(b.block_tables), seq)
        if len(groups) > 1:
            fn = fa3_peer.varlen_call(fa3, sm_scale=sm, max_q=int(b.query_lens.max()), max_k=int(seq.max()))
            out.append(Fa3Config("fa3_varlen", jax.jit(fn), (b.q, k, v, b.query_start_loc, cu_k), None,
                                 lambda o: o, {"call": "flash_mha_varlen", "note": "dense packed k/v"}))  # fmt: skip
        elif len(set(seq.tolist())) == 1:
            kd, vd = fa3_peer.dense_kv(k, v, seq)
            q4 = b.q.reshape(len(seq), int(seq[0]), Hq, D)
            fn = jax.jit(fa3_peer.dense_call(fa3, sm_scale=sm))
            out.append(Fa3Config("fa3_dense", fn, (q4, kd, vd), None, lambda o: o.reshape(T, Hq, D),
                                 {"call": "flash_mha", "note": "dense k/v"}))  # fmt: skip
    return out, per_page


def fa3_combined(fa3, b: DeviceBatch, parts: list, best_splits: list[int], page: int) -> Fa3Config:
    """The paged calls of every query-length group in one jit, each at its best num_splits."""
    s = b.spec
    groups = [g for g, _, _ in parts]
    calls = [fa3_peer.paged_call(fa3, sm_scale=s.head_size**-0.5, num_splits=n) for n in best_splits]

    @jax.jit
    def run(*flat):
        return tuple(c(*flat[5 * i : 5 * i + 5]) for i, c in enumerate(calls))

    args = tuple(a for _, gargs, _ in parts for a in gargs)
    return Fa3Config(
        f"fa3_paged_p{page}", run, args, None, lambda outs: fa3_peer.scatter_out(list(outs), groups, b.num_tokens),
        {"page_size": page, "num_splits": best_splits, "q_lens": [g.q_len for g in groups],
         "call": f"flash_mha_with_kvcache x {len(groups)}",
         "note": "one paged call per query length, best splits each"},
    )  # fmt: skip


def run_fa3(fa3, b: DeviceBatch, ref, ours, pages, splits, cupti_calls: int, record, results, log) -> None:
    """Times every ``fa3_configs`` call (host clock and CUPTI) after checking its first output
    against the float32 reference and PALLAS_GPU's output (``ours``, may be None); then the
    best num_splits per page size (by device time) as ``fa3_paged_p<page>`` rows."""
    s = b.spec
    configs, per_page = fa3_configs(fa3, b, pages, splits)
    ref = np.asarray(ref, np.float32)
    ours = None if ours is None else np.asarray(ours, np.float32)

    def check(c: Fa3Config) -> dict:
        got = np.asarray(c.to_packed(c.fn(*c.args)), np.float32)
        rows = slice(None) if c.rows is None else c.rows
        err = {"max_abs_err_vs_f32": float(np.abs(got - ref[rows]).max()), "rel_l2_vs_f32": rel_l2(got, ref[rows])}
        if ours is not None:
            err["max_abs_err_vs_pallas_gpu"] = float(np.abs(got - ours[rows]).max())
        if not np.isfinite(got).all():
            err["nonfinite_outputs"] = int((~np.isfinite(got)).sum())
        return err

    def measure(cs: list[Fa3Config]) -> dict[str, dict]:
        done = {}
        for c in cs:
            try:
                err = check(c)
                done[c.impl] = {"err": err, "host_s": time_jax(c.fn, *c.args, reps=10, inner=5)}
            except Exception as e:  # noqa: BLE001 - a configuration FA3 refuses: say so, go on
                log(f"  {c.impl}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                record_error(c.impl, e)
        thunks = {c.impl: (lambda c=c: c.fn(*c.args)) for c in cs if c.impl in done}
        try:  # one trace for all; if that fails, one trace each, so one bad trace loses one row's device time
            batches = [thunks] if thunks else []
            traced = cupti_timing.trace_calls(thunks, n=cupti_calls) if thunks else {}
        except Exception as e:  # noqa: BLE001
            log(f"  fa3 CUPTI trace of {len(thunks)} calls failed ({type(e).__name__}: {str(e)[:200]}); one each")
            batches, traced = [{k: t} for k, t in thunks.items()], {}
        for batch in batches if not traced else []:
            try:
                traced.update(cupti_timing.trace_calls(batch, n=cupti_calls))
            except Exception as e:  # noqa: BLE001 - host times stand without the trace
                for impl in batch:
                    done[impl]["device_error"] = f"{type(e).__name__}: {e}"[:300]
        for impl, groups in traced.items():
            summary = cupti_timing.summarize(groups)
            done[impl]["device"] = cupti_timing.with_back_to_back(summary, thunks[impl], cupti_calls)
        for c in cs:
            if c.impl not in done:
                continue
            d = done[c.impl]
            counts = None
            if c.rows is not None:
                reqs = np.unique(np.searchsorted(np.asarray(b.query_start_loc), c.rows, side="right") - 1)
                counts = count_floors(s, b.query_lens[reqs], b.context_lens[reqs])
            dev = d.get("device")
            extra = {**c.extra, **d["err"], "device": dev, **({"device_error": d["device_error"]} if
                     "device_error" in d else {})}  # fmt: skip
            record(c.impl, d["host_s"], d["err"]["rel_l2_vs_f32"], extra,
                   device_s=None if dev is None else dev["median_us"] / 1e6, counts=counts)  # fmt: skip
        return done

    def record_error(impl, e):
        results.append({"workload": s.name, "impl": impl, "error": f"{type(e).__name__}: {e}"[:500]})

    done = measure(configs)

    def key(impl):
        d = done.get(impl)
        if d is None:
            return float("inf")
        return d["device"]["median_us"] / 1e6 if "device" in d else d["host_s"]

    combined = []
    for page, parts in per_page.items():
        best = []
        for g, _, sweep in parts:
            suffix = f"_q{g.q_len}" if len(parts) > 1 else ""
            names = [f"fa3_paged_p{page}_s{n}{suffix}" for n in sweep]
            if all(key(n) == float("inf") for n in names):
                best = None
                break
            best.append(sweep[min(range(len(sweep)), key=lambda i: key(names[i]))])
        if best is None:
            continue
        if len(parts) == 1:  # one call: the best row is the sweep's best, not timed again
            name = f"fa3_paged_p{page}_s{best[0]}"
            sweep_ms = {n: (done[f"fa3_paged_p{page}_s{n}"].get("device") or {}).get("median_us")
                        for n in parts[0][2] if f"fa3_paged_p{page}_s{n}" in done}  # fmt: skip
            row = next(r for r in reversed(results) if r["impl"] == name and "ms" in r)
            results_row = {**row, "impl": f"fa3_paged_p{page}", "best_of_sweep": name,
                           "sweep_device_us_by_num_splits": sweep_ms}  # fmt: skip
            results.append(results_row)
            dev_ms = results_row.get("device_ms", float("nan"))
            log(f"  fa3_paged_p{page}: best num_splits {best[0]}, device {dev_ms:.3f} ms")
        else:
            combined.append(fa3_combined(fa3, b, parts, best, page))
    if combined:
        measure(combined)


# --------------------------------------------------------------------------- driver
def table_impls(impls) -> list[tuple[str, str]]:
    """(impl, label) of the rows ``peer_table`` shows among ``impls``, in order: attn-stack's,
    then FA3's best paged row per page size, its varlen and dense rows."""
    fixed = [("pallas_gpu_with_write", "attn-stack, write + attend"), ("pallas_gpu", "attn-stack, attention alone")]
    paged = sorted((int(i[len("fa3_paged_p") :]), i) for i in impls if re.fullmatch(r"fa3_paged_p\d+", i))
    tail = [("fa3_varlen", "FA3 dense varlen"), ("fa3_dense", "FA3 dense")]
    rows = fixed + [(i, f"FA3 paged, page {page}") for page, i in paged] + tail
    return [(i, label) for i, label in rows if i in impls]


def peer_table(results: list[dict]) -> str:
    """A markdown table of device times (CUPTI, median span per call): per workload, attn-stack's
    rows beside FA3's best rows, with TFLOP/s, % of the floor, the error against the f32
    reference, and the kernels' summed time (and per class for the write step) in the note."""
    lines = ["| workload | implementation | device ms | TFLOP/s | % of floor | floor ms | max abs err vs f32 | note |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    for workload in dict.fromkeys(r["workload"] for r in results):
        rows = {r["impl"]: r for r in results if r["workload"] == workload}
        for impl, label in table_impls(rows):
            r = rows[impl]
            if "device_ms" not in r:
                why = r.get("error") or r.get("device_error") or (r.get("device_us_per_step") or {}).get("error")
                lines.append(f"| {workload} | {label} | | | | | | no device time: {str(why)[:80]} |")
                continue
            note = []
            if "num_splits" in r:
                note.append(f"num_splits {r['num_splits']}")
            dev = r.get("device") or r.get("device_step") or {}
            if "median_kernel_sum_us" in dev:
                note.append(f"kernels sum {dev['median_kernel_sum_us']:.1f} us")
            if "back_to_back_us" in dev:
                b2b = dev["back_to_back_us"]
                note.append(f"back to back {b2b:.1f} us a call ({100 * r['floor_ms'] * 1e3 / b2b:.1f} % of floor)")
            if dev.get("median_us_by_class"):
                note.append(", ".join(f"{c} {us:.1f} us" for c, us in dev["median_us_by_class"].items()))
            err = r.get("max_abs_err_vs_f32")
            lines.append(
                f"| {workload} | {label} | {r['device_ms']:.3f} | {r['device_tflop_per_s']:.0f} | "
                f"{r['device_pct_of_floor']:.1f} | {r['floor_ms']:.3f} | {'' if err is None else f'{err:.2e}'} | "
                f"{'; '.join(note)} |"
            )
        if "fa3" in rows and "error" in rows["fa3"]:
            lines.append(f"| {workload} | FlashAttention-3 | | | | | | not run: {rows['fa3']['error'][:100]} |")
    return "\n".join(lines)


def rel_l2(x, ref) -> float:
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def tuned_match(b: DeviceBatch) -> dict:
    s = b.spec
    return {"mode": launch_mode(b.query_lens), "head_size": s.head_size,
            "group": s.num_q_heads // s.num_kv_heads, "page_size": s.block_size,
            "q_dtype": s.dtype, "kv_dtype": s.dtype}  # fmt: skip


def tune_candidates(b: DeviceBatch) -> list[GpuBlockSizes]:
    s = b.spec
    group = s.num_q_heads // s.num_kv_heads
    decode = gpu_batch_mode(b.query_lens) == "decode"
    rows_opts = (16,) if decode else (64, 128)
    tile_opts = (32, 64, 128, 256) if decode else (32, 64, 128)
    h = default_block_sizes(b).num_kv_splits
    # Decode: the heuristic's splits, half and twice them, and 1-8 where its programs are fewer than
    # the SMs (few requests on short contexts, which the heuristic leaves unsplit).
    few = decode and len(b.query_lens) * s.num_kv_heads < H100_NUM_SMS
    split_opts = sorted({max(h // 2, 1), h, 2 * h} | ({1, 2, 4, 8} if few else set())) if decode else (1,)
    # Heads narrower than 128 in decode: one KV head a program up to as many as fill MAX_PACKED_WIDTH
    # columns (kv_heads_to_pack's choice for heads between powers of two; any count for the others,
    # e.g. head 64's 2-4: a token's adjacent heads are one contiguous row); 512 columns ran at half
    # the speed on the H100 (BENCHMARKS.md).
    most = min(s.num_kv_heads, MAX_PACKED_WIDTH // s.head_size) if decode and s.head_size < 128 else 1
    packs = {1, kv_heads_to_pack(s.head_size, s.num_kv_heads)} | set(range(1, most + 1)) if decode else {1}
    out = []
    grid = itertools.product(rows_opts, tile_opts, (4, 8), (2, 3), split_opts, sorted(packs))
    for rows, tile, warps, stages, splits, pack in grid:
        bs = GpuBlockSizes(max(rows // (next_pow2(pack) * next_pow2(group)), 1), max(tile // s.block_size, 1),
                           splits, warps, stages, kv_heads_per_program=pack)  # fmt: skip
        try:
            check_block_sizes(bs, group=group, page_size=s.block_size)
        except ValueError:
            continue
        if splits > 1 and splits > -(-int(b.seq_lens.max()) // bs.tile(s.block_size)):
            continue  # more splits than the longest request has tiles: the extra ones are empty
        out.append(bs)
    return out


def compile_all(fns: list, args: tuple, threads: int | None = None) -> list:
    """``fn.lower(*args).compile()`` for each jitted ``fn``: lowered one by one (Python, under
    the GIL), compiled on ``threads`` threads (XLA's compile and the Triton kernels' ptxas
    release it; default: one per CPU). Returns, in order, each executable or the exception that
    lowering or compiling it raised."""

    def lower(fn):
        try:
            return fn.lower(*args)
        except Exception as e:  # noqa: BLE001 - returned: one candidate's failure is its own
            return e

    def compile_one(lowered):
        if isinstance(lowered, Exception):
            return lowered
        try:
            return lowered.compile()
        except Exception as e:  # noqa: BLE001 - as above
            return e

    lowered = [lower(fn) for fn in fns]
    with concurrent.futures.ThreadPoolExecutor(threads or os.cpu_count()) as pool:
        return list(pool.map(compile_one, lowered))


def tune(b: DeviceBatch, log, cupti_calls: int = 20) -> tuple[GpuBlockSizes, list]:
    """Every ``tune_candidates`` entry compiled (``compile_all``) and run, then ranked by CUPTI
    device time (the median span of ``cupti_calls`` calls each, one trace for all of them): a
    decode kernel of a few microseconds is far below the host's dispatch of one call, which a
    host clock would time. Returns the fastest and a row per candidate (its time or error)."""
    rows, thunks = [], {}
    args = (b.q, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, b.slot_mapping)
    candidates = tune_candidates(b)
    executables = compile_all([pallas_gpu_fn(b, bs, mgpu=False) for bs in candidates], args)
    for i, (bs, exe) in enumerate(zip(candidates, executables, strict=True)):
        try:
            if isinstance(exe, Exception):
                raise exe
            jax.block_until_ready(exe(*args))
        except Exception as e:  # noqa: BLE001 - a config Triton rejects (shared memory, ...)
            rows.append({**dataclasses.asdict(bs), "error": (str(e).splitlines() or [repr(e)])[0][:200]})
            continue
        thunks[i] = (bs, functools.partial(exe, *args))
    traced = cupti_timing.trace_calls({i: thunk for i, (_, thunk) in thunks.items()}, n=cupti_calls)
    for i, (bs, _) in thunks.items():
        us = cupti_timing.summarize(traced[i])["median_us"]
        rows.append({**dataclasses.asdict(bs), "device_us": us})
        log(f"  tune {b.spec.name} {bs}: {us:.1f} us (device)")
    best = min((r for r in rows if "device_us" in r), key=lambda r: r["device_us"])
    fields = {k: best[k] for k in ("block_q", "pages_per_tile", "num_kv_splits", "num_warps", "num_stages",
                                   "kv_heads_per_program")}  # fmt: skip
    return GpuBlockSizes(**fields), rows


def run_metadata(dev, ceilings: dict) -> dict:
    """Device, versions and date of this run, with the measured ceilings."""
    meta = {"device": dev.device_kind, "date": datetime.date.today().isoformat(), "jax": jax.__version__,
            "jaxlib": jax.__version__, "python": platform.python_version(), **ceilings}  # fmt: skip
    for module in ("torch", "triton"):
        try:
            meta[module] = __import__(module).__version__
        except ImportError:
            meta[module] = None
    return meta


def write_results(path: pathlib.Path, meta: dict, results: list) -> None:
    path.write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=float))


IMPLS = ("pallas_gpu", "layer", "xla", "peer_paged", "cudnn", "torch_sdpa", "fa3")
"""What ``--impls`` may name (``pallas_gpu`` includes its write step and split rows)."""


def parse_int_list(name: str, text: str, minimum: int = 1) -> list[int]:
    """``"16,128"`` -> [16, 128]; raises ValueError naming ``name`` for anything else."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < minimum:
        raise ValueError(f"{name} must list integers >= {minimum}, got {text!r}")
    return values


def parse_workloads(names: str, head_sizes: str = "") -> list[WorkloadSpec]:
    """``"D1,P1_p128"`` -> specs: a name of ``WORKLOADS`` with optional ``_p<page size>`` and
    ``_h<head size>`` suffixes; then every one of them again at each of ``head_sizes``."""
    specs = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        base, *suffixes = name.split("_")
        if base not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}: valid bases are {sorted(WORKLOADS)}, suffixes _p<N>, _h<N>")
        spec = dataclasses.replace(WORKLOADS[base], name=name)
        for suf in suffixes:
            if len(suf) < 2 or suf[0] not in "ph" or not suf[1:].isdigit() or int(suf[1:]) < 1:
                raise ValueError(f"workload {name!r}: suffix {suf!r} must be p<page size> or h<head size>")
            field = "block_size" if suf[0] == "p" else "head_size"
            spec = dataclasses.replace(spec, **{field: int(suf[1:])})
        specs.append(spec)
    extra = parse_int_list("--head-sizes", head_sizes) if head_sizes else []
    return specs + [dataclasses.replace(s, name=f"{s.name}_h{h}", head_size=h) for h in extra for s in specs]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="D1,D2,M1,P1", help="names of WORKLOADS, optionally _p<page>/_h<head>")
    p.add_argument("--impls", default="pallas_gpu,xla,peer_paged,cudnn,torch_sdpa", help=f"any of {','.join(IMPLS)}")
    p.add_argument(
        "--tune", default="",
        help="workloads whose Triton launch blocks to sweep (e.g. D1,M1); writes a table, each entry keyed by the "
        "launch the workload runs (a prefill workload's is the mixed launch: with M1 in the same run, M1's is kept)",
    )  # fmt: skip
    p.add_argument("--out", default=None)
    p.add_argument("--head-sizes", default="", help="also run each workload at these head sizes (e.g. 80,96)")
    p.add_argument("--fa3-pages", default="16,128", help="page sizes of FA3's paged calls (default 16,128)")
    p.add_argument(
        "--fa3-splits",
        default="1,2,4,8,16,32",
        help="num_splits swept for FA3's paged calls on cached context (>= 1: the binding refuses 0)",
    )
    p.add_argument("--cupti-calls", type=int, default=50, help="calls per CUPTI median (default 50)")
    p.add_argument(
        "--skip-split-rows",
        action="store_true",
        help="leave out pallas_gpu's other kernel choice (triton_only / mgpu_split) and part_* rows (saves compiles)",
    )
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The parsed command line, lists parsed and checked (``args.specs``, ``args.impl_list``,
    ``args.fa3_page_list``, ``args.fa3_split_list``); exits with the reason on a bad value."""
    p = build_parser()
    args = p.parse_args(argv)
    try:
        args.specs = parse_workloads(args.workloads, args.head_sizes)
        args.impl_list = [i for i in args.impls.split(",") if i]
        unknown = sorted(set(args.impl_list) - set(IMPLS))
        if unknown:
            raise ValueError(f"unknown --impls {unknown}: valid ones are {list(IMPLS)}")
        args.fa3_page_list = parse_int_list("--fa3-pages", args.fa3_pages)
        args.fa3_split_list = parse_int_list("--fa3-splits", args.fa3_splits)
        if args.cupti_calls < 3:
            raise ValueError(f"--cupti-calls must be >= 3, got {args.cupti_calls}")
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    dev = gpu_device()
    if dev is None:
        return 2
    log = functools.partial(print, flush=True)
    slug = dev.device_kind.lower().replace(" ", "_")
    out_path = pathlib.Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"attention_{slug}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    ceilings = measure_ceilings()
    log(f"ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
        f"matmul {ceilings['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")  # fmt: skip
    results, tuned_entries = [], []
    meta = run_metadata(dev, ceilings)
    impls = args.impl_list
    specs = args.specs
    fa3, fa3_reason = None, None
    if "fa3" in impls:
        try:
            fa3, notes = fa3_peer.import_fa3()
            meta["flash_attn3_jax"] = getattr(fa3, "__version__", "unknown")
            meta["flash_attn3_jax_notes"] = notes
        except ImportError as e:
            fa3_reason = str(e)
        fa3_reason = fa3_unavailable_reason(fa3_reason, dev)
        log(f"FlashAttention-3: {fa3_reason or 'flash_attn3_jax ' + meta['flash_attn3_jax']}")
        meta["fa3_unavailable"] = fa3_reason
    fa3_later = []  # (batch, reference, PALLAS_GPU's output, record, attempt, name) per workload
    for spec in specs:
        name = spec.name
        b = make_device_batch(spec)
        nbytes, flops = floors(b)
        floor_s = max(nbytes / ceilings["copy_bytes_per_s"], flops / ceilings["matmul_flops_per_s"])
        t_bytes, t_flops = nbytes / ceilings["copy_bytes_per_s"], flops / ceilings["matmul_flops_per_s"]
        bound = "memory" if t_bytes >= t_flops else "compute"
        op_args = (b.q, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, b.slot_mapping)
        ref = xla_fn(b, jnp.float32)(*op_args)
        log(f"{name}: {nbytes / 1e9:.3f} GB, {flops / 1e12:.3f} TFLOP, floor {floor_s * 1e3:.3f} ms ({bound})"
            f"  [{time.perf_counter() - t_start:.0f} s into the run]")  # fmt: skip
        outputs = {}  # PALLAS_GPU's output, for the peers' checks

        def record(impl, t, err, extra=None, *, device_s=None, counts=None, name=name, nbytes=nbytes, flops=flops):
            """One result row: host-timed ``t`` seconds and, when given, the CUPTI median ``device_s``,
            each against the floors of ``counts`` ((bytes, flops) of the rows it covers; default all)."""
            nb, fl = counts or (nbytes, flops)
            fs = max(nb / ceilings["copy_bytes_per_s"], fl / ceilings["matmul_flops_per_s"])
            row = {"workload": name, "impl": impl, "ms": t * 1e3, "gb_per_s": nb / t / 1e9,
                   "tflop_per_s": fl / t / 1e12, "pct_of_floor": 100 * fs / t, "rel_l2_vs_f32": err,
                   "floor_ms": fs * 1e3, **(extra or {})}  # fmt: skip
            line = (f"  {impl:<24} {t * 1e3:9.3f} ms  {row['gb_per_s']:8.0f} GB/s  {row['tflop_per_s']:7.1f} TFLOP/s"
                    f"  {row['pct_of_floor']:5.1f}% of floor  err {err:.2e}")  # fmt: skip
            if device_s:
                row.update(device_ms=device_s * 1e3, device_gb_per_s=nb / device_s / 1e9,
                           device_tflop_per_s=fl / device_s / 1e12,
                           device_pct_of_floor=100 * fs / device_s)  # fmt: skip
                line += (f"  | device {device_s * 1e3:.3f} ms, {row['device_tflop_per_s']:.1f} TFLOP/s, "
                         f"{row['device_pct_of_floor']:.1f}%")  # fmt: skip
            if counts is not None:
                line += f"  (its rows' floor {fs * 1e3:.3f} ms)"
            results.append(row)
            log(line)

        def attempt(impl, thunk, *, record=record, name=name):
            try:
                thunk()
            except Exception as e:  # noqa: BLE001 - report and go on with the other implementations
                log(f"  {impl}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                results.append({"workload": name, "impl": impl, "error": f"{type(e).__name__}: {e}"[:500]})
                traceback.print_exc(limit=3)

        if "pallas_gpu" in impls:

            def ours(b=b, op_args=op_args, ref=ref, record=record, outputs=outputs):
                bs = default_block_sizes(b)
                fn = pallas_gpu_fn(b, bs)
                extra = {"block_sizes": dataclasses.asdict(bs)}
                outputs["pallas_gpu"] = fn(*op_args)
                try:
                    extra["device"] = device_summary(fn, *op_args, calls=args.cupti_calls)
                    dev_s = extra["device"]["median_us"] / 1e6
                except Exception as e:  # noqa: BLE001 - the host time stands without the trace
                    dev_s, extra["device_error"] = None, f"{type(e).__name__}: {e}"[:300]
                err = rel_l2(outputs["pallas_gpu"], ref)
                diff = np.asarray(outputs["pallas_gpu"], np.float32) - np.asarray(ref, np.float32)
                extra["max_abs_err_vs_f32"] = float(np.abs(diff).max())
                record("pallas_gpu", time_jax(fn, *op_args), err, extra, device_s=dev_s)
                forced = schedules(b, bs, "force")
                if "mgpu_schedule" in forced and not args.skip_split_rows:  # the other kernels' choice, each launch
                    if "mgpu_schedule" in schedules(b, bs, True):
                        impl, fn = "pallas_gpu_triton_only", pallas_gpu_fn(b, bs, mgpu=False)
                    else:
                        impl, fn = "pallas_gpu_mgpu_split", pallas_gpu_fn(b, bs, mgpu="force")
                    other = {"block_sizes": extra["block_sizes"]}
                    other["device"] = device_summary(fn, *op_args, calls=args.cupti_calls)
                    record(impl, time_jax(fn, *op_args), rel_l2(fn(*op_args), ref), other,
                           device_s=other["device"]["median_us"] / 1e6)  # fmt: skip
                    for part, t in split_part_times(b, bs, forced).items():
                        record(
                            part, t, float("nan"), {"note": "one of the two launches alone; rows of the other unset"}
                        )
                if args.tune and b.spec.name in args.tune.split(","):
                    best, rows = tune(b, log, args.cupti_calls)
                    fn = pallas_gpu_fn(b, best)
                    extra = {"block_sizes": dataclasses.asdict(best), "sweep": rows}
                    extra["device"] = device_summary(fn, *op_args, calls=args.cupti_calls)
                    record("pallas_gpu_tuned", time_jax(fn, *op_args), rel_l2(fn(*op_args), ref), extra,
                           device_s=extra["device"]["median_us"] / 1e6)  # fmt: skip
                    fields = {k: v for k, v in extra["block_sizes"].items() if k != "num_kv_splits"}
                    tuned_entries.append({**tuned_match(b), "note": f"workload {b.spec.name}", **fields})

            attempt("pallas_gpu", ours)

            def write(b=b, name=name, record=record):
                row = with_write_ms(b, cupti_calls=args.cupti_calls)
                dev_s = row["device_step"]["median_us"] / 1e6 if "device_step" in row else None
                record("pallas_gpu_with_write", row["write_and_attend_ms"] / 1e3, float("nan"), {**row, "note":
                       "write + attend in one donated jit, timed in a chain of steps (host clock); device_ms: "
                       "CUPTI median step"}, device_s=dev_s)  # fmt: skip
                log(
                    f"    device us per step (CUPTI): {row['device_us_per_step']}; write alone: Pallas "
                    f"{row['pallas_write_ms'] * 1e3:.0f} us, XLA scatter {row['xla_scatter_write_ms'] * 1e3:.0f} us"
                )

            attempt("pallas_gpu_with_write", write)
        if "layer" in impls:  # the public layer: host-built metadata vs metadata traced under jit

            def layer(b=b, record=record):
                times = {}
                for metadata in LAYER_METADATA_PATHS:
                    impl = {"host": "layer_host_metadata", "host_per_step": "layer_host_metadata_per_step",
                            "traced": "layer_traced_metadata"}[metadata]  # fmt: skip
                    note = f"write + attend through Attention.__call__ in a donated jit, host clock ({metadata})"
                    times[metadata] = layer_step_ms(b, metadata)
                    record(impl, times[metadata] / 1e3, float("nan"), {"note": note})
                log(f"    traced / host: {times['traced'] / times['host']:.3f} (metadata reused), "
                    f"{times['traced'] / times['host_per_step']:.3f} (host metadata built every step)")  # fmt: skip

            attempt("layer", layer)
        if "xla" in impls:
            attempt(
                "xla",
                lambda b=b, op_args=op_args, ref=ref, record=record: record(
                    "xla", time_jax(xla_fn(b), *op_args, reps=5, inner=1), rel_l2(xla_fn(b)(*op_args), ref)
                ),
            )
        if "peer_paged" in impls and (b.query_lens == 1).all():

            def peer(b=b, ref=ref, record=record):
                fn, pargs, cfg = peer_paged_fn(b)
                record("jax_pallas_paged_attention", time_jax(fn, *pargs), rel_l2(fn(*pargs), ref), {"config": cfg})

            attempt("jax_pallas_paged_attention", peer)
        if "cudnn" in impls:

            def cudnn(b=b, record=record):
                fn = cudnn_fn(b)
                record("cudnn_dense", time_jax(fn, b.q), float("nan"), {"note": "dense equivalent; error not compared"})

            attempt("cudnn_dense", cudnn)
        if "torch_sdpa" in impls:
            attempt(
                "torch_sdpa_dense",
                lambda b=b, record=record: record(
                    "torch_sdpa_dense", torch_sdpa_time(b), float("nan"), {"note": "dense equivalent"}
                ),
            )
        if "fa3" in impls:  # after every workload's other rows: a crash in the peer cannot lose them
            ours = outputs.get("pallas_gpu")
            fa3_later.append((b, np.asarray(ref, np.float32), None if ours is None else np.asarray(ours, np.float32),
                              record, attempt, name))  # fmt: skip
        del b, ref, op_args
        outputs.clear()
        write_results(out_path, meta, results)

    for b, ref, ours, record, attempt, name in fa3_later:
        log(f"{name}: FlashAttention-3  [{time.perf_counter() - t_start:.0f} s into the run]")
        if fa3_reason is not None:
            log(f"  fa3: not run: {fa3_reason}")
            results.append({"workload": name, "impl": "fa3", "error": fa3_reason})
        else:
            pages, splits = args.fa3_page_list, args.fa3_split_list
            attempt("fa3", functools.partial(run_fa3, fa3, b, ref, ours, pages, splits, args.cupti_calls, record,
                                             results, log))  # fmt: skip
        write_results(out_path, meta, results)
    fa3_later.clear()
    write_results(out_path, meta, results)
    log(f"wrote {out_path} ({time.perf_counter() - t_start:.0f} s)")
    if "fa3" in impls:
        log(peer_table(results))
    if args.tune and tuned_entries:
        tpath = out_path.with_name(f"gpu_{slug}.json") if args.out else TUNED_DIR / f"gpu_{slug}.json"
        committed = TUNED_DIR / f"gpu_{slug}.json"
        old = json.loads(committed.read_text()) if committed.exists() else None
        source = (f"benchmarks/attention.py --tune {args.tune}, {meta['date']}, jax {jax.__version__}, each "
                  "candidate's CUPTI device time")  # fmt: skip
        table, notes = merged_table(old, tuned_entries, dev.device_kind, source)
        for note in notes:
            log(f"  {note}")
        tpath.write_text(json.dumps(table, indent=1))
        log(f"wrote {tpath}")
    return 0


def merged_table(old: dict | None, entries: list[dict], device_kind: str, source: str) -> tuple[dict, list[str]]:
    """The device's table with ``entries`` (this run's, in ``--tune`` order) in it: an entry
    replaces the old one with its match keys, the old entries of other keys stay (a run that
    tunes D1 keeps the table's other shapes), and of this run's entries with the same keys the
    first is kept. Returns the table and a line per entry replaced or dropped."""
    notes, new = [], {}
    for e in entries:
        key = gpu_entry_key(e)
        if key in new:
            notes.append(f"{e.get('note')}: dropped, {new[key].get('note')} has the same match keys {key}")
        else:
            new[key] = e
    kept = []
    for e in (old or {}).get("entries", []):
        if (key := gpu_entry_key(e)) in new:
            notes.append(f"replaced the entry {e.get('note')!r} (match keys {key})")
        else:
            kept.append(e)
    sources = [(old or {}).get("source")] if kept else []
    table = {"device_kind": device_kind, "source": "; ".join(filter(None, [*sources, source])),
             "match_keys": list(GPU_MATCH_KEYS), "entries": kept + list(new.values())}  # fmt: skip
    return table, notes


if __name__ == "__main__":
    sys.exit(main())
