"""Launch sweep of PALLAS_GPU through the public ``Attention`` layer: every configuration the
backend's ``validate_configuration`` accepts must launch and match the float64 oracle.

Dimensions: dtype {float32, bfloat16, float16, fp8 (bfloat16 activations, fp8_e4m3 cache
with scales)} x head size {32, 64, 80, 96, 112, 128, 192, 256} x q heads per kv head
{1, 2, 4, 8, 16} x page {16, 32, 64, 128} x batch mode {decode, prefill, mixed} x feature
{none, sliding window, soft cap, sinks, ALiBi}. Covered (``sweep_configs``): the full
product at head 128 and at float32 (feature none), and a greedy pairwise cover of all six
dimensions (every pair of values of any two dimensions at least once). Each configuration
runs twice: metadata built on the host (``layer.prepare``, the engine's way) and
``CommonAttentionMetadata`` traced into ``jax.jit(layer.__call__)`` (the README's way).
Batches are small (2 kv heads, 3-4 requests, NaN in every unused cache slot).

    python benchmarks/gpu_launch_sweep.py --workers 12 --out results.json   # on the GPU
    python benchmarks/gpu_launch_sweep.py --limit 2 --interpret              # CPU smoke run

``--calibrate`` first compiles a set of Triton block sizes chosen to overflow shared
memory and records what the compiler requested against ``config.triton_smem_bytes``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import itertools
import json
import os
import pathlib
import re
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # tests.ops.ragged_checks (the oracle checks), in spawned workers too
    sys.path.insert(0, str(ROOT))

DTYPES = ("float32", "bfloat16", "float16", "fp8")
HEAD_SIZES = (32, 64, 80, 96, 112, 128, 192, 256)
GROUPS = (1, 2, 4, 8, 16)
PAGE_SIZES = (16, 32, 64, 128)
MODES = ("decode", "prefill", "mixed")
FEATURES = ("none", "window", "soft_cap", "sinks", "alibi")
NUM_KV_HEADS = 2

# (query_lens, context_lens) per mode: a 150-token request is long enough for the Mosaic GPU
# prefill (an 8-aligned span of one 128-row tile) where the configuration allows it.
MODE_LENS = {
    "decode": ([1, 1, 1], [36, 299, 4]),
    "prefill": ([150, 7, 40], [0, 20, 100]),
    "mixed": ([1, 150, 1, 33], [40, 10, 200, 0]),
}


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    dtype: str
    head_size: int
    group: int
    page_size: int
    mode: str
    feature: str = "none"

    @property
    def name(self) -> str:
        return f"{self.dtype}-h{self.head_size}-g{self.group}-p{self.page_size}-{self.mode}-{self.feature}"


DIMS = (DTYPES, HEAD_SIZES, GROUPS, PAGE_SIZES, MODES, FEATURES)


def pairwise_cover(dims=DIMS) -> list[tuple]:
    """A greedy set of tuples holding every pair of values of any two dimensions at least once."""
    n = len(dims)
    uncovered = {(i, a, j, b) for i, j in itertools.combinations(range(n), 2) for a in dims[i] for b in dims[j]}

    def pair(k, v, m, w):
        return (k, v, m, w) if k < m else (m, w, k, v)

    rows = []
    while uncovered:
        i, a, j, b = min(uncovered)  # deterministic: one uncovered pair, the other values chosen greedily
        row = {i: a, j: b}
        for k in range(n):
            if k not in row:
                row[k] = max(dims[k], key=lambda v, k=k: sum(pair(k, v, m, w) in uncovered for m, w in row.items()))
        rows.append(tuple(row[k] for k in range(n)))
        uncovered -= {(p, row[p], q, row[q]) for p, q in itertools.combinations(range(n), 2)}
    return rows


def sweep_configs() -> list[SweepConfig]:
    full = {
        SweepConfig(d, h, g, p, m)
        for d, h, g, p, m in itertools.product(DTYPES, HEAD_SIZES, GROUPS, PAGE_SIZES, MODES)
        if h == 128 or d == "float32"
    }
    pairs = {SweepConfig(*row) for row in pairwise_cover()}
    return sorted(full | pairs, key=lambda c: c.name)


# --------------------------------------------------------------------------- one configuration
def run_config(cfg: SweepConfig, interpret: bool = False) -> list[dict]:
    """Runs ``cfg`` with host-built and traced metadata; one result row each."""
    import jax
    import jax.numpy as jnp

    from attn_jax import Attention
    from attn_jax.backends.pallas_gpu import PallasGPUAttentionBackend, uses_mosaic_gpu
    from attn_jax.ops.ragged_paged_attention.config import triton_smem_bytes
    from attn_jax.registry import AttentionBackendEnum
    from attn_jax.testing.workloads import make_ragged_batch
    from tests.ops.ragged_checks import check_cache, check_output, make_options

    act = {"float32": jnp.float32, "float16": jnp.float16}.get(cfg.dtype, jnp.bfloat16)
    cache_str = "fp8_e4m3" if cfg.dtype == "fp8" else "auto"
    base = {"config": cfg.name, **dataclasses.asdict(cfg)}
    reasons = PallasGPUAttentionBackend.validate_configuration(cfg.head_size, act, cache_str, cfg.page_size,
                                                               has_sink=cfg.feature == "sinks")  # fmt: skip
    if reasons:
        return [{**base, "status": "rejected", "reasons": reasons}]
    qlens, clens = MODE_LENS[cfg.mode]
    num_q_heads = NUM_KV_HEADS * cfg.group
    batch = make_ragged_batch(
        hash(cfg.name) % 2**31, qlens, clens, num_q_heads=num_q_heads, num_kv_heads=NUM_KV_HEADS,
        head_size=cfg.head_size, block_size=cfg.page_size, dtype=act, cache_dtype_str=cache_str,
        num_tokens=-(-sum(qlens) // 16) * 16 + 3, extra_blocks=2,
    )  # fmt: skip
    options = make_options(
        batch, sliding_window=24 if cfg.feature == "window" else None,
        logits_soft_cap=20.0 if cfg.feature == "soft_cap" else None,
        alibi=cfg.feature == "alibi", sinks=cfg.feature == "sinks",
    )  # fmt: skip
    layer = Attention(
        num_q_heads, cfg.head_size, options["sm_scale"], NUM_KV_HEADS, alibi_slopes=options["alibi_slopes"],
        logits_soft_cap=options["logits_soft_cap"], per_layer_sliding_window=options["sliding_window"],
        attn_backend=AttentionBackendEnum.PALLAS_GPU, block_size=cfg.page_size, kv_cache_dtype=cache_str,
        sinks=options["sinks"], dtype=act,
    )  # fmt: skip
    if interpret:
        layer.impl.interpret = True
    if batch.k_scale is not None:
        layer.k_scale, layer.v_scale = jnp.float32(batch.k_scale), jnp.float32(batch.v_scale)
    md = batch.common_metadata()
    T = batch.q.shape[0]
    q, k, v = (x.reshape(T, -1) for x in (batch.q, batch.k, batch.v))
    rows = []
    for traced in (False, True):
        row = {**base, "metadata": "traced" if traced else "host"}
        t0 = time.perf_counter()
        try:
            attn_md = md if traced else layer.prepare(md)
            step = jax.jit(layer.__call__)
            out, cache = step(q, k, v, batch.kv_cache, attn_md)
            jax.block_until_ready(out)
            row["seconds"] = round(time.perf_counter() - t0, 2)
            used = attn_md if not traced else jax.jit(lambda m: layer.metadata_builder.build(0, m))(md)
            bs = used.block_sizes
            mgpu = uses_mosaic_gpu(
                batch.q, cache, interpret=interpret, block_sizes=bs, mgpu_schedule=used.mgpu_schedule,
                mgpu_block_sizes=used.mgpu_block_sizes, **{k: v for k, v in options.items() if k != "sm_scale"},
            )  # fmt: skip
            decode_bs = None if mgpu else used.decode_block_sizes  # a mixed batch's decodes, same launch
            row["kernel"] = ("mosaic_gpu+triton" if mgpu else "triton") + f" {dataclasses.astuple(bs)}"
            if decode_bs is not None:
                row["kernel"] += f" decodes {dataclasses.astuple(decode_bs)}"
            row["smem_estimate"] = max(
                triton_smem_bytes(x, group=cfg.group, page_size=cfg.page_size, head_size=cfg.head_size, q_dtype=act,
                                  kv_dtype=cache.dtype)
                for x in (bs, decode_bs) if x is not None
            )  # fmt: skip
            check_output(batch, options, out.reshape(batch.q.shape), cache)
            check_cache(batch, cache)
            row["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - the sweep records every failure and goes on
            row["status"] = "error"
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]
            row["traceback"] = traceback.format_exc(limit=4)[-1500:]
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- calibration
def calibrate() -> list[dict]:
    """Triton block sizes chosen to overflow the H100's shared memory, compiled through the
    kernel: what the compiler requested (from its error) against ``triton_smem_bytes``."""
    import jax.numpy as jnp

    from attn_jax.ops.ragged_paged_attention import config, pallas_triton
    from attn_jax.testing.workloads import make_ragged_batch

    rows = []
    for dtype, head, stages, ppt, block_q, cache in itertools.product(
        ("float32", "bfloat16"), (128, 256), (2, 3, 4), (4, 8, 16), (4, 16), ("auto", "fp8_e4m3")
    ):
        if dtype == "float32" and cache != "auto":
            continue
        bs = config.GpuBlockSizes(block_q=block_q, pages_per_tile=ppt, num_stages=stages)
        kv_dtype = "float8_e4m3fn" if cache != "auto" else dtype
        est = config.triton_smem_bytes(bs, group=4, page_size=16, head_size=head, q_dtype=dtype, kv_dtype=kv_dtype)
        if est < 200_000:
            continue  # fits anyway: nothing to learn
        batch = make_ragged_batch(0, [1, 40], [300, 10], num_q_heads=8, num_kv_heads=2, head_size=head,
                                  block_size=16, dtype=getattr(jnp, dtype), cache_dtype_str=cache)  # fmt: skip
        row = {"dtype": dtype, "kv_dtype": kv_dtype, "head_size": head, "block_sizes": dataclasses.asdict(bs),
               "estimate": est}  # fmt: skip
        try:
            out, _ = pallas_triton.ragged_paged_attention(*batch.op_args, sm_scale=0.1, block_sizes=bs,
                                                          **batch.op_kwargs)  # fmt: skip
            out.block_until_ready()
            row["requested"] = None  # launched: at most the device's limit
        except Exception as e:  # noqa: BLE001
            m = re.search(r"requested (\d+)", str(e))
            row["requested"] = int(m.group(1)) if m else None
            row["error"] = str(e).splitlines()[0][:200]
        rows.append(row)
        print(f"calibrate {row}", flush=True)
    return rows


# --------------------------------------------------------------------------- driver
def _worker(names: list[str], interpret: bool, partial: str | None = None) -> list[dict]:
    """Runs ``names`` in order; each configuration's rows are also appended to ``partial``
    (JSON lines) as they finish, so a run cut short keeps what it measured."""
    by_name = {c.name: c for c in sweep_configs()}
    out = []
    for name in names:
        rows = run_config(by_name[name], interpret)
        if partial:
            with open(partial, "a") as f:
                f.writelines(json.dumps({k: v for k, v in r.items() if k != "traceback"}) + "\n" for r in rows)
        for r in rows:
            print(f"{r['config']:<40} {r.get('metadata', '-'):<6} {r['status']:<8} {r.get('kernel', '')} "
                  f"{r.get('error', '')}", flush=True)  # fmt: skip
        out += rows
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=1, help="processes sharing the GPU (compilation is CPU-bound)")
    p.add_argument("--limit", type=int, default=0, help="run only the first N configurations (0: all)")
    p.add_argument("--only", default="", help="a regex on configuration names")
    p.add_argument("--interpret", action="store_true", help="the Pallas interpreter (CPU smoke runs)")
    p.add_argument("--calibrate", action="store_true")
    p.add_argument(
        "--skip-ok", default=None, help="a JSON-lines file of an earlier run: skip its passing configurations"
    )
    p.add_argument("--risky-first", action="store_true", help="float32 and large pages/heads first (a run cut short)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.workers > 1:  # several processes share the GPU: none may take most of its memory
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    configs = [c for c in sweep_configs() if re.search(args.only, c.name)]
    if args.skip_ok:
        rows = [json.loads(line) for line in open(args.skip_ok)]
        done = {r["config"] for r in rows if r["status"] == "ok"} - {r["config"] for r in rows if r["status"] != "ok"}
        configs = [c for c in configs if c.name not in done]
    if args.risky_first:
        configs.sort(key=lambda c: (c.dtype != "float32", -c.page_size * c.head_size))
    if args.limit:
        configs = configs[: args.limit]
    import jax

    meta = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "configs": len(configs)}  # fmt: skip
    print(f"{len(configs)} configurations x 2 metadata paths on {meta['device']}", flush=True)
    t0 = time.perf_counter()
    calibration = calibrate() if args.calibrate else []
    names = [c.name for c in configs]
    partial = f"{args.out}.partial.jsonl" if args.out else None
    if args.workers > 1:
        chunks = [names[i :: args.workers] for i in range(args.workers)]
        ctx = __import__("multiprocessing").get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=ctx) as pool:
            runs = pool.map(_worker, chunks, [args.interpret] * len(chunks), [partial] * len(chunks))
            results = [r for rows in runs for r in rows]
    else:
        results = _worker(names, args.interpret, partial)
    meta["seconds"] = round(time.perf_counter() - t0, 1)
    ran = [r for r in results if r["status"] != "rejected"]
    bad = [r for r in ran if r["status"] != "ok"]
    meta.update(runs=len(ran), failures=len(bad), rejected=len(results) - len(ran))
    print(f"{len(ran)} runs, {len(bad)} failures, {meta['rejected']} rejected, {meta['seconds']} s", flush=True)
    for r in bad:
        print(f"FAIL {r['config']} {r['metadata']}: {r['error']}", flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"meta": meta, "calibration": calibration,
                                                      "results": results}, indent=0))  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
