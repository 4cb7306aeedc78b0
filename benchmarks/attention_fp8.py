"""FP8 attention on a GPU through the public layer: FP8 P1 (4 x 4096 causal prefill, 32 q / 8 kv
heads, head 128, page 16) against the bf16 layer, with errors against a float64 oracle.

Three layers on the same random bf16 q, k, v (PALLAS_GPU, cache donated, metadata built on the
host with ``layer.prepare``, as the engine does):

- ``fp8_attention``: ``Attention(..., kv_cache_dtype="fp8", query_quant=True)``: the query
  quantised to e4m3 with ``layer.q_scale`` (vLLM's ``calc_kv_scales`` rule on this batch),
  q.k on e4m3 x e4m3 dots with float32 accumulation (on Hopper the Mosaic GPU prefill kernel,
  p @ v in float16 over V converted from e4m3; elsewhere the Triton kernel, p @ v in e4m3);
- ``fp8_kv_cache``: the same cache, ``query_quant=False`` (k/v dequantised to bf16 in the kernel);
- ``bf16``: the default layer (bf16 cache; the Mosaic GPU prefill kernel on Hopper).

For each: ms per layer step (k/v write + attention), the attention kernels' device time from a
CUPTI trace when there is one, TFLOP/s on both (4 * D per visible (q, k) pair per query head),
and the relative L2 error of ``--rows`` sampled token rows (every head) against two float64
oracles: ``rel_l2_vs_quantized_oracle`` on the values the layer attends over (the query rounded
to e4m3 with q_scale for FP8 attention, keys and values as its cache holds them), bounded by
``FP8_REL_L2_BOUND`` (3e-2) for FP8 attention, and ``rel_l2_vs_unquantized_oracle`` on the bf16
inputs (what e4m3 storage of q, k and v costs on top: about 4 % on standard-normal inputs).

    python benchmarks/attention_fp8.py --sweep --out /tmp/attention_fp8.json   # FP8 P1 on the GPU
    python benchmarks/attention_fp8.py --query-lens 40,24 --num-q-heads 4 --num-kv-heads 2 \\
        --head-size 32 --rows 16 --reps 1                                       # tiny (CPU: interpreter)

Exits 1 when FP8 attention's error exceeds the bound, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from results_io import add_output_args, output_path, write_json  # noqa: E402

from attn_jax import Attention, CommonAttentionMetadata  # noqa: E402
from attn_jax.registry import AttentionBackendEnum  # noqa: E402

FP8_REL_L2_BOUND = 3e-2
"""FP8 attention's relative L2 error bound against the float64 oracle on its quantised inputs."""

LAYERS = {
    "fp8_attention": dict(kv_cache_dtype="fp8", query_quant=True),
    "fp8_kv_cache": dict(kv_cache_dtype="fp8"),
    "bf16": dict(kv_cache_dtype="auto"),
}


def make_inputs(query_lens, *, num_q_heads, num_kv_heads, head_size, block_size, seed=0):
    """(q, k, v bf16[T, H, D], CommonAttentionMetadata, num_blocks): prefills from an empty cache,
    pages shuffled over the cache."""
    rng = np.random.default_rng(seed)
    qlens = np.asarray(query_lens, np.int32)
    pages = -(-qlens // block_size)
    num_blocks = int(pages.sum()) + 1
    ids = rng.permutation(num_blocks).astype(np.int32)
    tables = np.zeros((len(qlens), int(pages.max())), np.int32)
    slots, start = [], 0
    for r, n in enumerate(qlens):
        tables[r, : pages[r]] = ids[start : start + pages[r]]
        start += pages[r]
        pos = np.arange(n)
        slots.append(tables[r, pos // block_size] * block_size + pos % block_size)
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    T = int(qsl[-1])
    md = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=qlens, seq_lens_cpu=qlens,
        num_computed_tokens_cpu=np.zeros_like(qlens), num_reqs=len(qlens), num_actual_tokens=T,
        max_query_len=int(qlens.max()), block_table_tensor=tables, slot_mapping=np.concatenate(slots).astype(np.int32),
    )  # fmt: skip
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (T, num_q_heads, head_size), jnp.bfloat16)
    k = jax.random.normal(kk, (T, num_kv_heads, head_size), jnp.bfloat16)
    v = jax.random.normal(kv, (T, num_kv_heads, head_size), jnp.bfloat16)
    return q, k, v, md, num_blocks


def flops(query_lens, num_q_heads: int, head_size: int) -> float:
    """4 * D per visible (q, k) pair per query head: causal prefills from an empty cache."""
    pairs = sum(int(n) * (int(n) + 1) // 2 for n in query_lens)
    return 4.0 * head_size * num_q_heads * pairs


def run_layer(layer, q, k, v, md, num_blocks, reps: int, inner: int = 5):
    """(median ms per donated write + attend step, out f32[T, Hq, D], the cache after the steps, the
    jitted step, the backend's metadata)."""
    T = q.shape[0]
    attn_md = layer.prepare(md)
    step = jax.jit(layer.__call__, donate_argnums=3)
    cache = layer.init_kv_cache(num_blocks)
    args = (q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1))
    for _ in range(2):  # compiles (the donated cache's second call may compile once more)
        out, cache = step(*args, cache, attn_md)  # the same k/v land in the same slots every step
    jax.block_until_ready(cache)
    times = []
    for _ in range(reps):  # `inner` steps back to back per timing: dispatch overlaps the device
        t0 = time.perf_counter()
        for _ in range(inner):
            out, cache = step(*args, cache, attn_md)
        jax.block_until_ready((out, cache))
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times) * 1e3, np.asarray(out.astype(jnp.float32)).reshape(q.shape), cache, step, attn_md


def attention_kernel_us(step, args, cache, attn_md) -> tuple[dict[str, float], float | None, jax.Array]:
    """(device microseconds per step by kernel class (CUPTI medians of 20 calls, ``cupti_timing``;
    {} off GPU), the step's median device span (first kernel's start to last kernel's end; None
    off GPU), the cache after the traced steps: ``cache`` itself is donated to them)."""
    if jax.default_backend() != "gpu":
        return {}, None, cache
    import cupti_timing
    from attention import KERNEL_CLASSES

    state = {"cache": cache}

    def call():
        out, state["cache"] = step(*args, state["cache"], attn_md)
        return out, state["cache"]

    try:
        groups = cupti_timing.trace_calls({"step": call}, n=20, gap_s=3e-2)["step"]  # host work inside a step
        summary = cupti_timing.summarize(groups, KERNEL_CLASSES)
        kernels, span = summary["median_us_by_class"], summary["median_us"]
    except Exception as e:  # noqa: BLE001 - the wall-clock timing stands without the trace
        print(f"  (no CUPTI kernel times: {type(e).__name__}: {str(e).splitlines()[0][:200]})", flush=True)
        kernels, span = {}, None
    return kernels, span, state["cache"]


SWEEP = [
    dict(block_q=bq, pages_per_tile=ppt, num_warps=w, num_stages=st)
    for bq, ppt, w, st in [(16, 8, 4, 2), (32, 4, 8, 2), (32, 8, 8, 2), (32, 8, 8, 3), (64, 4, 8, 2), (64, 8, 8, 2)]
]  # fmt: skip
"""Triton block sizes ``--sweep`` times for the FP8 attention kernel (block_q x group 4 = 64..256 rows)."""


def sweep_block_sizes(layer, q, cache, md, reps: int, log) -> list[dict]:
    """FP8 attention alone (no k/v write) on the Triton kernel at each of ``SWEEP``: ms and TFLOP/s."""
    from attn_jax.ops.ragged_paged_attention import pallas_triton
    from attn_jax.ops.ragged_paged_attention.config import GpuBlockSizes

    qsl, seq = np.asarray(md.query_start_loc_cpu), np.asarray(md.seq_lens_cpu)
    total = flops(np.diff(qsl), q.shape[1], q.shape[2])
    default = layer.prepare(md).block_sizes
    rows = []
    for fields in [None, *SWEEP]:
        bs = default if fields is None else GpuBlockSizes(**fields)
        if fields is not None and bs == default:
            continue
        try:
            schedule = pallas_triton.gpu_schedule(qsl, seq, num_tokens=q.shape[0], block_q=bs.block_q, xp=np)
            fn = jax.jit(functools.partial(
                pallas_triton.ragged_paged_attention, sm_scale=q.shape[2] ** -0.5, block_sizes=bs,
                schedule=jnp.asarray(schedule), k_scale=layer.k_scale, v_scale=layer.v_scale, q_scale=layer.q_scale,
            ))  # fmt: skip
            args = (q, None, None, cache, jnp.asarray(qsl), jnp.asarray(seq), jnp.asarray(md.block_table_tensor),
                    jnp.asarray(md.slot_mapping))  # fmt: skip
            jax.block_until_ready(fn(*args))
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                for _ in range(5):
                    out = fn(*args)
                jax.block_until_ready(out)
                times.append((time.perf_counter() - t0) / 5)
            ms = statistics.median(times) * 1e3
            row = {"block_sizes": str(bs), "default": fields is None, "ms": ms, "tflop_per_s": total / ms / 1e9}
            log(f"    {'default ' if fields is None else ''}{bs}: {ms:.3f} ms = {row['tflop_per_s']:.0f} TFLOP/s")
        except Exception as e:  # noqa: BLE001 - a configuration that does not compile is a result too
            row = {"block_sizes": str(bs), "default": fields is None, "error": f"{type(e).__name__}: {e}"[:300]}
            log(f"    {bs}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        rows.append(row)
    return rows


def sample_rows(query_lens, rows: int, seed: int = 1) -> np.ndarray:
    """About ``rows`` distinct token rows spread over the batch, plus the last row of each request."""
    total = int(np.sum(query_lens))
    ends = np.cumsum(query_lens) - 1
    rng = np.random.default_rng(seed)
    picked = rng.choice(total, size=min(rows, total), replace=False)
    return np.unique(np.concatenate([picked, ends]))


def oracle_rows(q64, k_seqs, v_seqs, query_lens, rows, sm_scale):
    """f64[len(rows), Hq, D]: causal attention of the sampled rows in float64 (NumPy, per row).

    q64 f64[T, Hq, D]; k_seqs / v_seqs: each request's keys and values f64[L, Hkv, D]."""
    qsl = np.concatenate([[0], np.cumsum(query_lens)])
    num_q_heads, head_size = q64.shape[1:]
    out = np.zeros((len(rows), num_q_heads, head_size))
    for i, t in enumerate(rows):
        r = int(np.searchsorted(qsl[1:], t, side="right"))
        p = t - qsl[r]  # position: prefills from an empty cache
        keys, values = k_seqs[r][: p + 1], v_seqs[r][: p + 1]  # [p+1, Hkv, D]
        group = num_q_heads // keys.shape[1]
        qg = q64[t].reshape(keys.shape[1], group, head_size)
        s = np.einsum("kgd,lkd->kgl", qg, keys) * sm_scale
        w = np.exp(s - s.max(-1, keepdims=True))
        out[i] = (np.einsum("kgl,lkd->kgd", w, values) / w.sum(-1)[..., None]).reshape(num_q_heads, head_size)
    return out


def cache_seqs(layer, cache, md, query_lens) -> tuple[list, list]:
    """Each request's keys and values f64[L, Hkv, D] as ``cache`` holds them, dequantised."""
    arr = np.asarray(cache.astype(jnp.float32), np.float64)  # [2, P, S, Hkv, D]
    fp8 = np.dtype(cache.dtype).itemsize == 1
    k_scale, v_scale = (float(layer.k_scale), float(layer.v_scale)) if fp8 else (1.0, 1.0)
    S = arr.shape[2]
    tables = np.asarray(md.block_table_tensor)
    ks, vs = [], []
    for r, n in enumerate(query_lens):
        j = np.arange(n)
        ks.append(arr[0, tables[r, j // S], j % S] * k_scale)
        vs.append(arr[1, tables[r, j // S], j % S] * v_scale)
    return ks, vs


def quantized_query(q64, q_scale: float) -> np.ndarray:
    """q as FP8 attention sees it: q / q_scale rounded to e4m3 (saturating), times q_scale."""
    limit = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
    x = np.clip((q64 / q_scale).astype(np.float32), -limit, limit)
    return x.astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * q_scale


def rel_l2(x, ref) -> float:
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--query-lens", default="4096,4096,4096,4096", help="new tokens per request (default: P1)")
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", default=",".join(LAYERS), help=f"which of {list(LAYERS)} (default: all)")
    p.add_argument("--rows", type=int, default=128, help="token rows checked against the oracles (default: 128)")
    p.add_argument("--reps", type=int, default=20, help="timed steps per layer (default: 20)")
    p.add_argument(
        "--sweep", action="store_true", help=f"also time FP8 attention alone at {len(SWEEP)} Triton block sizes"
    )
    add_output_args(p, "attention_fp8_{device}.json")
    args = p.parse_args(argv)
    try:
        query_lens = [int(x) for x in args.query_lens.split(",")]
        layers = args.layers.split(",")
        bad = [x for x in layers if x not in LAYERS]
        if bad or any(n <= 0 for n in query_lens):
            raise ValueError(f"--layers {bad} not in {list(LAYERS)}" if bad else "--query-lens must be positive")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dev = jax.devices()[0]
    args.device = dev.device_kind.lower().replace(" ", "_")
    log = functools.partial(print, flush=True)
    if dev.platform != "gpu":
        log(f"note: no GPU (jax sees {dev.platform}): PALLAS_GPU runs in the Pallas interpreter, timings mean nothing")
    H, Hkv, D = args.num_q_heads, args.num_kv_heads, args.head_size
    q, k, v, md, num_blocks = make_inputs(query_lens, num_q_heads=H, num_kv_heads=Hkv, head_size=D,
                                          block_size=args.block_size)  # fmt: skip
    total_flops = flops(query_lens, H, D)
    rows = sample_rows(query_lens, args.rows)
    q64 = np.asarray(q.astype(jnp.float32), np.float64)
    k64, v64 = (np.asarray(x.astype(jnp.float32), np.float64) for x in (k, v))
    qsl = np.concatenate([[0], np.cumsum(query_lens)])
    unquantized = oracle_rows(
        q64, [k64[a:b] for a, b in zip(qsl[:-1], qsl[1:], strict=True)],
        [v64[a:b] for a, b in zip(qsl[:-1], qsl[1:], strict=True)], query_lens, rows, D**-0.5,
    )  # fmt: skip
    log(f"device {dev.device_kind}; query lens {query_lens}, {H} q / {Hkv} kv heads, head {D}, page "
        f"{args.block_size}: {total_flops / 1e12:.3f} TFLOP; {len(rows)} rows against the float64 oracles")  # fmt: skip
    results, failed = [], False
    for name in layers:
        try:
            layer = Attention(H, D, D**-0.5, Hkv, block_size=args.block_size, dtype=jnp.bfloat16,
                              attn_backend=AttentionBackendEnum.PALLAS_GPU, **LAYERS[name])  # fmt: skip
            if layer.kv_cache_dtype != "auto":
                layer.calc_kv_scales(q, k, v)  # vLLM's rule (max|x| / 200, 200, 100) on this batch
            ms, out, cache, step, attn_md = run_layer(layer, q, k, v, md, num_blocks, args.reps)
            T = q.shape[0]
            args3 = (q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1))
            kernels, span, cache = attention_kernel_us(step, args3, cache, attn_md)  # the old cache was donated
            attn_us = sum(t for c, t in kernels.items() if c.startswith("attention_"))
            q_used = quantized_query(q64, float(layer.q_scale)) if layer.query_quant else q64
            quantized = oracle_rows(q_used, *cache_seqs(layer, cache, md, query_lens), query_lens, rows, D**-0.5)
            row = {
                "layer": name, **LAYERS[name], "ms_per_step_incl_write": ms,
                "tflop_per_s_incl_write": total_flops / ms / 1e9, "kernel_us": kernels,
                "attention_kernel_us": attn_us or None, "device_span_us": span,
                "tflop_per_s_device_span": total_flops / span / 1e6 if span else None,
                "tflop_per_s_attention_kernels": total_flops / attn_us / 1e6 if attn_us else None,
                "rel_l2_vs_quantized_oracle": rel_l2(out[rows], quantized),
                "rel_l2_vs_unquantized_oracle": rel_l2(out[rows], unquantized),
                "q_scale": float(layer.q_scale), "k_scale": float(layer.k_scale), "v_scale": float(layer.v_scale),
                "finite": bool(np.isfinite(out).all()),
            }  # fmt: skip
            if layer.query_quant and args.sweep:
                log("  FP8 attention alone (no k/v write), Triton block sizes:")
                row["sweep"] = sweep_block_sizes(layer, q, cache, md, args.reps, log)
            if layer.query_quant:
                row["bound"] = FP8_REL_L2_BOUND
                row["within_bound"] = row["rel_l2_vs_quantized_oracle"] <= FP8_REL_L2_BOUND and row["finite"]
                failed |= not row["within_bound"]
            results.append(row)
            kernel_txt = ""
            if attn_us:
                kernel_txt = f", kernels {attn_us:.1f} us = {row['tflop_per_s_attention_kernels']:.0f} TFLOP/s"
            if span:
                kernel_txt += f", device span {span:.1f} us = {row['tflop_per_s_device_span']:.0f} TFLOP/s"
            log(f"  {name:<14} {ms:8.3f} ms/step incl. write = {row['tflop_per_s_incl_write']:7.1f} TFLOP/s"
                f"{kernel_txt}; "
                f"rel L2 {row['rel_l2_vs_quantized_oracle']:.2e} vs quantised oracle, "
                f"{row['rel_l2_vs_unquantized_oracle']:.2e} vs unquantised")  # fmt: skip
        except Exception as e:  # noqa: BLE001 - report and go on with the other layers
            failed = True
            log(f"  {name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            results.append({"layer": name, "error": f"{type(e).__name__}: {e}"[:1000]})
            traceback.print_exc(limit=5)
    fp8 = next((r for r in results if r.get("layer") == "fp8_attention" and "error" not in r), None)
    if fp8 is not None:
        verdict = "within" if fp8["within_bound"] else "OVER"
        log(f"FP8 attention: rel L2 {fp8['rel_l2_vs_quantized_oracle']:.2e} vs the float64 oracle on its quantised "
            f"inputs ({verdict} the bound {FP8_REL_L2_BOUND:g})")  # fmt: skip
    write_json(output_path(args), {
        "device": dev.device_kind, "jax": jax.__version__, "query_lens": query_lens, "num_q_heads": H,
        "num_kv_heads": Hkv, "head_size": D, "block_size": args.block_size, "tflop": total_flops / 1e12,
        "rows_checked": len(rows), "results": results,
    })  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
