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
equivalent (when torch with CUDA is there).

    python benchmarks/attention.py                       # all workloads, all implementations
    python benchmarks/attention.py --tune M1,P1          # + block-size sweeps, writes tuned/gpu_*.json
    python benchmarks/attention.py --workloads D1 --impls pallas_gpu

Writes benchmarks/results/attention_<device>.json (or --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import json
import pathlib
import platform
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax import Attention, CommonAttentionMetadata
from attn_jax.backends import pallas_gpu as pallas_gpu_backend
from attn_jax.backends.pallas_gpu import mgpu_split
from attn_jax.kv_cache import write_to_kv_cache
from attn_jax.ops.ragged_paged_attention import kv_write, pallas_mosaic_gpu, pallas_triton, reference
from attn_jax.ops.ragged_paged_attention.config import (
    GPU_MATCH_KEYS,
    TUNED_DIR,
    GpuBlockSizes,
    check_block_sizes,
    gpu_batch_mode,
    gpu_block_sizes,
    mgpu_prefill_available,
    next_pow2,
)
from attn_jax.registry import AttentionBackendEnum
from attn_jax.testing.workloads import WORKLOADS, WorkloadSpec

ROOT = pathlib.Path(__file__).resolve().parents[1]


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


def floors(b: DeviceBatch) -> tuple[float, float]:
    """(bytes, flops): KV read once + q read + out written; 4 * D per visible pair per q head."""
    s = b.spec
    item = jnp.dtype(s.dtype).itemsize
    seq = b.query_lens + b.context_lens
    kv_bytes = 2 * int(seq.sum()) * s.num_kv_heads * s.head_size * item
    qo_bytes = 2 * b.num_tokens * s.num_q_heads * s.head_size * item
    # Query token i of request r (position c + i) sees c + i + 1 keys (causal).
    pairs = sum(int(q) * int(c) + int(q) * (int(q) + 1) // 2 for q, c in zip(b.query_lens, b.context_lens, strict=True))
    return kv_bytes + qo_bytes, 4.0 * s.head_size * s.num_q_heads * pairs


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
    (the Mosaic GPU split for prefill batches on Hopper); ``mgpu=False`` leaves the split
    out (the Triton kernel serves all), ``mgpu="force"`` makes it for any batch."""
    qsl, seq = np.asarray(b.query_start_loc), np.asarray(b.seq_lens)
    out = {"schedule": jnp.asarray(pallas_triton.gpu_schedule(qsl, seq, num_tokens=b.num_tokens,
                                                            block_q=block_sizes.block_q, xp=np))}  # fmt: skip
    hopper = mgpu_prefill_available(jax.devices()[0].device_kind)
    if hopper and (mgpu == "force" or (mgpu and gpu_batch_mode(b.query_lens) == "prefill")):
        out.update(mgpu_split(qsl, seq, num_tokens=b.num_tokens, block_q=block_sizes.block_q))
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
        block_sizes=bs, interpret=False,
    )  # fmt: skip

    times = {"part_mgpu_prefill": time_jax(mgpu, b.q, b.kv_cache, sched["mgpu_schedule"], b.block_tables)}
    if sched["rest_schedule"] is not None:
        times["part_triton_rest"] = time_jax(
            lambda q, c, sc, bt: rest(q, c, sc, bt, None, None, None, None, None),
            b.q, b.kv_cache, sched["rest_schedule"], b.block_tables,
        )  # fmt: skip
    return times


def with_write_ms(b: DeviceBatch, reps: int = 30, inner: int = 5) -> dict[str, float]:
    """Median ms per step of write + attend (the op as a layer calls it, cache donated, one jit),
    and of the k/v write alone by the Pallas kernel and by XLA's scatter, each in place."""
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

    try:  # per-kernel device times of the same step (CUPTI through jax.profiler)
        out_ms["device_us_per_step"] = device_kernel_us(one_step)
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
"""(class, substring of the kernel name) for ``device_kernel_us``; first match wins, the rest is "other"."""


def device_kernel_us(call, steps: int = 20) -> dict[str, float]:
    """Device microseconds per step of each kernel class in ``KERNEL_CLASSES``, from a
    jax.profiler (CUPTI) trace of ``steps`` calls of ``call()`` (which returns what to wait on).
    Empty on a platform whose trace has no GPU stream events."""
    import collections
    import glob
    import tempfile

    from jax.profiler import ProfileData

    jax.block_until_ready(call())
    totals = collections.Counter()
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir):
            for _ in range(steps):
                out = call()
            jax.block_until_ready(out)
        files = glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True)
        data = ProfileData.from_file(files[0])
        for plane in data.planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                if not line.name.startswith("Stream"):
                    continue
                for ev in line.events:
                    cls = next((c for c, sub in KERNEL_CLASSES if sub in ev.name.lower()), "other")
                    totals[cls] += ev.duration_ns
    return {c: totals[c] / 1e3 / steps for c in sorted(totals)}


def default_block_sizes(b: DeviceBatch) -> GpuBlockSizes:
    s = b.spec
    return gpu_block_sizes(
        num_reqs=len(b.query_lens), pages_per_req=int(b.block_tables.shape[1]), page_size=s.block_size,
        head_size=s.head_size, num_kv_heads=s.num_kv_heads, group=s.num_q_heads // s.num_kv_heads,
        mode=gpu_batch_mode(b.query_lens), q_dtype=s.dtype, kv_dtype=s.dtype, device_kind=jax.devices()[0].device_kind,
    )  # fmt: skip


def layer_step_ms(b: DeviceBatch, traced: bool, reps: int = 30, inner: int = 5) -> float:
    """Median ms per step of write + attend through the public ``Attention`` layer (PALLAS_GPU,
    cache donated): ``traced`` passes ``CommonAttentionMetadata`` into ``jax.jit(layer.__call__)``
    as the README's example does; else ``layer.prepare(md)`` builds the backend's metadata on
    the host first, as the engine does."""
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
    attn_md = md if traced else layer.prepare(md)
    step = jax.jit(layer.__call__, donate_argnums=3)
    state = {"cache": jnp.array(b.kv_cache)}
    times = []
    for i in range(reps + 1):
        jax.block_until_ready(state["cache"])
        t0 = time.perf_counter()
        for _ in range(inner):
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


# --------------------------------------------------------------------------- driver
def rel_l2(x, ref) -> float:
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def tuned_match(b: DeviceBatch) -> dict:
    s = b.spec
    return {"mode": gpu_batch_mode(b.query_lens), "head_size": s.head_size,
            "group": s.num_q_heads // s.num_kv_heads, "page_size": s.block_size,
            "q_dtype": s.dtype, "kv_dtype": s.dtype}  # fmt: skip


def tune_candidates(b: DeviceBatch) -> list[GpuBlockSizes]:
    s = b.spec
    group = s.num_q_heads // s.num_kv_heads
    decode = gpu_batch_mode(b.query_lens) == "decode"
    rows_opts = (16,) if decode else (64, 128)
    tile_opts = (64, 128, 256) if decode else (32, 64, 128)
    h = default_block_sizes(b).num_kv_splits
    split_opts = sorted({max(h // 2, 1), h, 2 * h}) if decode else (1,)
    out = []
    for rows, tile, warps, stages, splits in itertools.product(rows_opts, tile_opts, (4, 8), (2, 3), split_opts):
        bs = GpuBlockSizes(max(rows // next_pow2(group), 1), max(tile // s.block_size, 1), splits, warps, stages)
        try:
            check_block_sizes(bs, group=group, page_size=s.block_size)
        except ValueError:
            continue
        out.append(bs)
    return out


def tune(b: DeviceBatch, log) -> tuple[GpuBlockSizes, float, list]:
    rows = []
    args = (b.q, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, b.slot_mapping)
    for bs in tune_candidates(b):
        try:
            t = time_jax(pallas_gpu_fn(b, bs, mgpu=False), *args, reps=5, inner=3)
        except Exception as e:  # noqa: BLE001 - a config Triton rejects (shared memory, ...)
            rows.append({**dataclasses.asdict(bs), "error": str(e).splitlines()[0][:200]})
            continue
        rows.append({**dataclasses.asdict(bs), "ms": t * 1e3})
        log(f"  tune {b.spec.name} {bs}: {t * 1e3:.3f} ms")
    ok = [r for r in rows if "ms" in r]
    best = min(ok, key=lambda r: r["ms"])
    fields = {k: best[k] for k in ("block_q", "pages_per_tile", "num_kv_splits", "num_warps", "num_stages")}
    return GpuBlockSizes(**fields), best["ms"] / 1e3, rows


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="D1,D2,M1,P1")
    p.add_argument("--impls", default="pallas_gpu,xla,peer_paged,cudnn,torch_sdpa")
    p.add_argument("--tune", default="", help="workloads whose block sizes to sweep (e.g. M1,P1); writes a table")
    p.add_argument("--out", default=None)
    p.add_argument("--head-sizes", default="", help="also run each workload at these head sizes (e.g. 80,96)")
    args = p.parse_args(argv)
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        print(f"this benchmark needs a GPU; jax sees {dev.platform}", file=sys.stderr)
        return 2
    log = functools.partial(print, flush=True)
    slug = dev.device_kind.lower().replace(" ", "_")
    out_path = pathlib.Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"attention_{slug}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    ceilings = measure_ceilings()
    log(f"ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
        f"matmul {ceilings['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")  # fmt: skip
    results, tuned_entries = [], []
    meta = run_metadata(dev, ceilings)
    impls = args.impls.split(",")
    base = [WORKLOADS[name] for name in args.workloads.split(",")]
    specs = base + [
        dataclasses.replace(s, name=f"{s.name}_h{h}", head_size=int(h))
        for h in filter(None, args.head_sizes.split(","))
        for s in base
    ]
    for spec in specs:
        name = spec.name
        b = make_device_batch(spec)
        nbytes, flops = floors(b)
        floor_s = max(nbytes / ceilings["copy_bytes_per_s"], flops / ceilings["matmul_flops_per_s"])
        t_bytes, t_flops = nbytes / ceilings["copy_bytes_per_s"], flops / ceilings["matmul_flops_per_s"]
        bound = "memory" if t_bytes >= t_flops else "compute"
        op_args = (b.q, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, b.slot_mapping)
        ref = xla_fn(b, jnp.float32)(*op_args)
        log(f"{name}: {nbytes / 1e9:.3f} GB, {flops / 1e12:.3f} TFLOP, floor {floor_s * 1e3:.3f} ms ({bound})")

        def record(impl, t, err, extra=None, *, b=b, name=name, nbytes=nbytes, flops=flops, floor_s=floor_s):
            row = {"workload": name, "impl": impl, "ms": t * 1e3, "gb_per_s": nbytes / t / 1e9,
                   "tflop_per_s": flops / t / 1e12, "pct_of_floor": 100 * floor_s / t, "rel_l2_vs_f32": err,
                   **(extra or {})}  # fmt: skip
            results.append(row)
            log(f"  {impl:<22} {t * 1e3:9.3f} ms  {row['gb_per_s']:8.0f} GB/s  {row['tflop_per_s']:7.1f} TFLOP/s"
                f"  {row['pct_of_floor']:5.1f}% of floor  err {err:.2e}")  # fmt: skip

        def attempt(impl, thunk, *, record=record, name=name):
            try:
                thunk()
            except Exception as e:  # noqa: BLE001 - report and go on with the other implementations
                log(f"  {impl}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                results.append({"workload": name, "impl": impl, "error": f"{type(e).__name__}: {e}"[:500]})
                traceback.print_exc(limit=3)

        if "pallas_gpu" in impls:

            def ours(b=b, op_args=op_args, ref=ref, record=record):
                bs = default_block_sizes(b)
                fn = pallas_gpu_fn(b, bs)
                extra = {"block_sizes": dataclasses.asdict(bs)}
                record("pallas_gpu", time_jax(fn, *op_args), rel_l2(fn(*op_args), ref), extra)
                forced = schedules(b, bs, "force")
                if "mgpu_schedule" in forced:  # the other choice of kernels for this batch, and each launch alone
                    if "mgpu_schedule" in schedules(b, bs, True):
                        impl, fn = "pallas_gpu_triton_only", pallas_gpu_fn(b, bs, mgpu=False)
                    else:
                        impl, fn = "pallas_gpu_mgpu_split", pallas_gpu_fn(b, bs, mgpu="force")
                    record(impl, time_jax(fn, *op_args), rel_l2(fn(*op_args), ref), extra)
                    for part, t in split_part_times(b, bs, forced).items():
                        record(
                            part, t, float("nan"), {"note": "one of the two launches alone; rows of the other unset"}
                        )
                if args.tune and b.spec.name in args.tune.split(","):
                    best, t, rows = tune(b, log)
                    fn = pallas_gpu_fn(b, best)
                    t = time_jax(fn, *op_args)
                    extra = {"block_sizes": dataclasses.asdict(best), "sweep": rows}
                    record("pallas_gpu_tuned", t, rel_l2(fn(*op_args), ref), extra)
                    fields = {k: v for k, v in extra["block_sizes"].items() if k != "num_kv_splits"}
                    tuned_entries.append({**tuned_match(b), "note": f"workload {b.spec.name}", **fields})

            attempt("pallas_gpu", ours)

            def write(b=b, name=name, record=record):
                row = with_write_ms(b)
                record("pallas_gpu_with_write", row["write_and_attend_ms"] / 1e3, float("nan"), {**row, "note":
                       "write + attend in one donated jit, timed in a chain of steps (host clock)"})  # fmt: skip
                log(
                    f"    device us per step (CUPTI): {row['device_us_per_step']}; write alone: Pallas "
                    f"{row['pallas_write_ms'] * 1e3:.0f} us, XLA scatter {row['xla_scatter_write_ms'] * 1e3:.0f} us"
                )

            attempt("pallas_gpu_with_write", write)
        if "layer" in impls:  # the public layer: host-built metadata vs metadata traced under jit

            def layer(b=b, record=record):
                for traced in (False, True):
                    impl = "layer_traced_metadata" if traced else "layer_host_metadata"
                    note = "write + attend through Attention.__call__ in a donated jit, host clock"
                    record(impl, layer_step_ms(b, traced) / 1e3, float("nan"), {"note": note})

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
        del b, ref, op_args
        write_results(out_path, meta, results)

    write_results(out_path, meta, results)
    log(f"wrote {out_path}")
    if args.tune and tuned_entries:
        table = {"device_kind": dev.device_kind, "source": f"benchmarks/attention.py --tune, {meta['date']}, "
                 f"jax {jax.__version__}, median of a sweep per workload", "match_keys": list(GPU_MATCH_KEYS),
                 "entries": tuned_entries}  # fmt: skip
        tpath = out_path.with_name(f"gpu_{slug}.json") if args.out else TUNED_DIR / f"gpu_{slug}.json"
        tpath.write_text(json.dumps(table, indent=1))
        log(f"wrote {tpath}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
