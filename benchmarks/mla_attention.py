"""MLA decode on a GPU: DESIGN.md's MLA-D1 (DeepSeek-V3 shape: 128 query heads, latent 512 +
rope 64, page 64, 64 requests x 4096 of context, bf16) and its 16-head (V2-Lite) variant,
against the roofline floors.

Floors: bytes = the latent cache read once (requests x context x 576 x 2) + q read + the
latent output written, over the measured device-to-device copy bandwidth; FLOPs = 2 * (576 +
512) per (query head, key) pair (scores and p @ c_kv), over the measured bf16 matmul rate.
MLA-D1 sits near the ridge (~0.3 GB against ~73 GFLOP), so the row says which floor binds.
Implementations: ``pallas_mla_gpu`` (ops/mla/pallas_triton.py; default block sizes, or a
sweep with --sweep), ``pallas_mla_mgpu`` (ops/mla/decode_pallas_mosaic_gpu.py, Hopper; its
default splits, or each of 1-8 with --sweep) and ``xla_reference`` (the jnp reference); each row has the median
time by the host clock, GB/s, TFLOP/s, % of the binding floor and the relative L2 error
against the reference computed in float32 on the same inputs, and (rows at the defaults) the
CUPTI device span of a call waited for and the time per call issued back to back. MLA-P1 (4 x 4096 causal prefill, 16
heads, q/k 192, v 128) runs the Triton prefill (ops/mla/prefill_pallas_triton.py, a few block
sizes), the jnp prefill (``xla_mla_dense``), the Mosaic GPU kernel on Hopper, and cuDNN and
FlashAttention-3 on the up-projected dense k/v (v zero-padded to 192: their APIs take one
k/v head size) as peers, and the public ``MLAAttention`` layer (latent write + up-projection +
attention, as a model calls it), against the FLOPs floor, by host clock and device span (CUPTI).

MLA-IDX (only when named) times DeepSeek-V3.2's lightning indexer: the Triton kernel
(ops/mla/indexer_pallas_triton.py) against the jnp reference, 4 chunks of 1024 tokens ending
at 4096, against the FLOPs floor, with the share of top-k positions they agree on.

    python benchmarks/mla_attention.py                      # MLA-D1 and MLA-D1-16
    python benchmarks/mla_attention.py --sweep --workloads MLA-D1 --write

Writes benchmarks/results/mla_attention_gpu.json with --write (or --out PATH).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import statistics
import sys
import time

from gpu_check import gpu_device  # benchmarks/, the script's folder
from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder


def time_fn(fn, *args, reps: int = 20, inner: int = 5) -> float:
    """Median seconds per call: ``inner`` calls back to back, synchronised, ``reps`` times."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def device_times(fn, *args, calls: int = 20) -> dict[str, float]:
    """CUPTI device microseconds of ``fn(*args)``: ``device_us``, the median span of ``calls``
    calls each waited for (no host dispatch in it), and ``back_to_back_us``, the same calls
    issued without waiting (``cupti_timing.back_to_back_us``); NaN where a trace cannot say."""
    import cupti_timing

    summary = {"median_us": float("nan")}
    try:
        summary = cupti_timing.summarize(cupti_timing.trace_calls({"call": lambda: fn(*args)}, n=calls)["call"])
    except RuntimeError as e:  # a call whose kernels leave gaps does not split into calls
        print(f"  no device span: {e}")
    summary = cupti_timing.with_back_to_back(summary, lambda: fn(*args), calls)
    if "back_to_back_error" in summary:
        print(f"  no back-to-back time: {summary['back_to_back_error']}")
    return {"device_us": summary["median_us"], "back_to_back_us": summary.get("back_to_back_us", float("nan"))}


def measure_ceilings() -> dict[str, float]:
    """Device-to-device copy bandwidth (bytes read + written) and the bf16 8192^3 matmul rate."""
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.key(1), (1 << 30,), jnp.bfloat16)
    t_copy = time_fn(jax.jit(lambda x: x * jnp.bfloat16(1.0001)), x, reps=10, inner=3)
    del x
    a = jax.random.normal(jax.random.key(2), (8192, 8192), jnp.bfloat16)
    t_mm = time_fn(jax.jit(lambda a, b: a @ b), a, a, reps=10, inner=3)
    return {"copy_bytes_per_s": 2 * 2 * (1 << 30) / t_copy, "matmul_flops_per_s": 2 * 8192**3 / t_mm}


def make_batch(spec, seed: int = 0):
    """Device arrays of one decode call: q, a latent cache holding every request's context at
    shuffled pages (plus spare pages), seq_lens, block tables."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    width = spec.kv_lora_rank + spec.rope_dim
    pages_per_req = -(-spec.context_len // spec.block_size)
    num_blocks = spec.num_reqs * pages_per_req + 8
    k1, k2 = jax.random.split(jax.random.key(seed))
    cache = jax.random.normal(k1, (num_blocks, spec.block_size, width), jnp.bfloat16)
    q = jax.random.normal(k2, (spec.num_reqs, spec.num_heads, width), jnp.bfloat16)
    table = np.random.default_rng(seed).permutation(num_blocks)[: spec.num_reqs * pages_per_req]
    table = jnp.asarray(table.reshape(spec.num_reqs, pages_per_req).astype(np.int32))
    seq_lens = jnp.full((spec.num_reqs,), spec.context_len, jnp.int32)
    return q, cache, seq_lens, table


def floors(spec) -> tuple[float, float]:
    """(bytes, FLOPs) of one decode call."""
    width = spec.kv_lora_rank + spec.rope_dim
    cache_bytes = spec.num_reqs * spec.context_len * width * 2
    qo_bytes = spec.num_reqs * spec.num_heads * (width + spec.kv_lora_rank) * 2
    flops = 2.0 * (width + spec.kv_lora_rank) * spec.num_heads * spec.num_reqs * spec.context_len
    return cache_bytes + qo_bytes, flops


def prefill_rows(spec, ceilings, sweep: bool = False) -> list[dict]:
    """MLA-P1: causal prefill over no context, q/k nope 128 + rope 64, v 128; each row timed by
    the host clock (calls back to back) and by its device span (CUPTI). ``xla_mla_dense``
    (ops/mla/dense.py: latents up-projected per request, then attention in XLA), the Triton
    kernel at four block sizes (``sweep``: block_q x block_k x warps x stages), on Hopper the
    Mosaic GPU kernel (``prefill_pallas_mosaic_gpu``, metadata traced) and the peers on the
    up-projected dense k/v (outside the timing; v zero-padded to 192, their APIs taking one
    k/v head size): cuDNN (``jax.nn.dot_product_attention``) when it runs, FlashAttention-3
    (``fa3_peer``, the ``flash-attn3-jax`` wheel) when it imports."""
    import cupti_timing
    import fa3_peer
    import jax
    import jax.numpy as jnp

    from attn_jax.ops.mla import prefill_pallas_mosaic_gpu, prefill_pallas_triton
    from attn_jax.ops.mla.dense import mla_prefill_dense
    from attn_jax.ops.ragged_paged_attention.config import mgpu_prefill_available

    nope, dv, h, n, r = 128, 128, spec.num_heads, spec.query_len, spec.num_reqs
    q_, cache, _, table = make_batch(spec)
    keys = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(keys[0], (r * n, h, nope + spec.rope_dim), jnp.bfloat16)
    w_uk = jax.random.normal(keys[1], (spec.kv_lora_rank, h, nope), jnp.bfloat16) * spec.kv_lora_rank**-0.5
    w_uv = jax.random.normal(keys[2], (spec.kv_lora_rank, h, dv), jnp.bfloat16) * spec.kv_lora_rank**-0.5
    qsl = jnp.arange(0, (r + 1) * n, n, dtype=jnp.int32)
    lens = jnp.full((r,), n, jnp.int32)
    scale = (nope + spec.rope_dim) ** -0.5
    pairs = r * n * (n + 1) / 2
    flops = 2.0 * (nope + spec.rope_dim + dv) * h * pairs
    nbytes = r * n * (spec.kv_lora_rank + spec.rope_dim) * 2 + q.size * 2 + r * n * h * dv * 2
    floor_s = max(nbytes / ceilings["copy_bytes_per_s"], flops / ceilings["matmul_flops_per_s"])
    print(f"{spec.name}: {flops / 1e12:.3f} TFLOP (causal pairs), floor {floor_s * 1e6:.1f} us (compute-bound)")
    dense = jax.jit(functools.partial(mla_prefill_dense, sm_scale=scale, kv_lora_rank=spec.kv_lora_rank, q_block=n))
    out, refs = [], []

    def row(impl, fn, *args):
        try:
            t = time_fn(fn, *args, reps=10, inner=2)
        except Exception as e:  # noqa: BLE001 - a failing peer is a line, not the end of the run
            print(f"  {impl}: failed: {type(e).__name__}: {str(e)[:200]}")
            return None
        try:  # the call's device span (CUPTI): its kernels, no host dispatch; 30 ms between calls,
            # since the layer's call has host work (its metadata's upload) inside it
            calls = cupti_timing.trace_calls({impl: lambda: fn(*args)}, n=10, gap_s=3e-2)
            d = cupti_timing.summarize(calls[impl])["median_us"]
        except RuntimeError as e:  # a call whose kernels leave gaps does not split into calls
            print(f"  {impl}: no device span: {e}")
            d = float("nan")
        d *= 1e-6
        result = jnp.asarray(fn(*args), jnp.float32)[..., :dv].reshape(r * n, h, dv)
        if not refs:
            refs.append(result)  # the first row (xla_mla_dense) is the others' reference
        err = float(jnp.linalg.norm(result - refs[0]) / jnp.linalg.norm(refs[0]))
        print(f"  {impl:16s} {t * 1e6:9.1f} us {flops / t / 1e12:6.1f} TFLOP/s {100 * floor_s / t:5.1f}% of floor;"
              f" device {d * 1e6:8.1f} us {flops / d / 1e12:6.1f} TFLOP/s  rel L2 vs dense {err:.1e}")  # fmt: skip
        out.append({"workload": spec.name, "impl": impl, "time_us": t * 1e6, "tflop_per_s": flops / t / 1e12,
                    "pct_of_floor": 100 * floor_s / t, "device_us": d * 1e6, "device_tflop_per_s": flops / d / 1e12,
                    "bound": "compute", "rel_l2_vs_xla_mla_dense": err})  # fmt: skip
        return t

    row("xla_mla_dense", dense, q, cache, w_uk, w_uv, qsl, lens, table)
    configs = ((64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (64, 32, 4, 3))
    if sweep:
        configs = tuple(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)))
    for bq, bk, warps, stages in configs:
        kernel = jax.jit(functools.partial(
            prefill_pallas_triton.mla_prefill, sm_scale=scale, kv_lora_rank=spec.kv_lora_rank, q_block=n, block_q=bq,
            block_k=bk, num_warps=warps, num_stages=stages,
        ))  # fmt: skip
        row(f"pallas_mla_gpu bq{bq} bk{bk} w{warps} s{stages}", kernel, q, cache, w_uk, w_uv, qsl, lens, table)
    if mgpu_prefill_available(jax.devices()[0].device_kind):  # PALLAS_MLA_GPU's prefill on Hopper
        mgpu = jax.jit(functools.partial(prefill_pallas_mosaic_gpu.mla_prefill, sm_scale=scale,
                                         kv_lora_rank=spec.kv_lora_rank, q_block=n))  # fmt: skip
        row("pallas_mla_mosaic_gpu", mgpu, q, cache, w_uk, w_uv, qsl, lens, table)
    layer_row(spec, row, q, cache, table, w_uk, w_uv)
    latent = cache[table].reshape(r, n, -1)
    c_kv, k_pe = latent[..., : spec.kv_lora_rank], latent[..., spec.kv_lora_rank :]
    k = jnp.concatenate([jnp.einsum("rlc,chd->rlhd", c_kv, w_uk),
                         jnp.broadcast_to(k_pe[:, :, None], (r, n, h, spec.rope_dim))], axis=-1)  # fmt: skip
    v = jnp.einsum("rlc,chd->rlhd", c_kv, w_uv)
    sdpa = functools.partial(jax.nn.dot_product_attention, scale=scale, is_causal=True, implementation="cudnn")
    v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, nope + spec.rope_dim - dv)))  # jax.nn takes one head size
    cudnn = jax.jit(lambda q, k, v: sdpa(q, k, v)[..., :dv])
    row("cudnn_dense_vpad", cudnn, q.reshape(r, n, h, -1), k, v)
    try:  # FlashAttention-3's dense call (its binding takes one k/v shape: v padded to 192 as for cuDNN)
        fa3, notes = fa3_peer.import_fa3()
    except ImportError as e:
        print(f"  fa3_dense_vpad: skipped: {e}")
    else:
        print(f"  fa3 ({fa3_peer.FA3_WHEEL}): {'; '.join(notes) or 'imported'}")
        flash = jax.jit(lambda q, k, v: fa3.flash_mha(q, k, v, softmax_scale=scale, is_causal=True)[..., :dv])
        row("fa3_dense_vpad", flash, q.reshape(r, n, h, -1), k, v)
    del q_
    return out


def layer_row(spec, row, q, cache, table, w_uk, w_uv) -> None:
    """MLA-P1 through the public ``MLAAttention`` layer as a model calls it: the new latents
    written into the cache (donated; they are the ones it already holds, so the row's output
    is comparable), ``kv_b_proj`` up-projecting them, the backend's attention, inside one
    jitted call that also takes the output's rows, as a model's step program holds its
    layers; metadata built on the host once (``metadata_builder.build``) and put on the
    device once, as the engine's step uploads it once for every layer."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from attn_jax.metadata import MetadataBuckets, build_common_attn_metadata
    from attn_jax.mla_layer import MLAAttention

    nope, dv, c, h = 128, 128, spec.kv_lora_rank, spec.num_heads
    r, n = spec.num_reqs, spec.query_len
    layer = MLAAttention(h, (nope + spec.rope_dim) ** -0.5, nope, spec.rope_dim, dv, None, c,
                         block_size=spec.block_size, dtype=jnp.bfloat16)  # fmt: skip
    buckets = MetadataBuckets((r * n,), (r,), (table.shape[1],))  # the workload's own sizes: no padding
    md = build_common_attn_metadata([n] * r, [n] * r, np.asarray(table), spec.block_size, buckets)
    meta = jax.device_put(layer.metadata_builder.build(0, md))
    pad = md.num_tokens - r * n  # the bucket's padding rows
    latent = jnp.pad(cache[table].reshape(r * n, -1), ((0, pad), (0, 0)))
    kv_b_proj = jnp.concatenate([w_uk, w_uv], axis=-1).reshape(c, h * (nope + dv))

    @functools.partial(jax.jit, donate_argnums=(3,))
    def step(q, kv_c, k_pe, cache, meta, kv_b_proj):
        out, cache = layer(q, kv_c, k_pe, cache, meta, kv_b_proj)
        return out[: r * n].reshape(r * n, h, dv), cache

    state = {"cache": jnp.array(cache)}

    def call(q, kv_c, k_pe):
        out, state["cache"] = step(q, kv_c, k_pe, state["cache"], meta, kv_b_proj)
        return out

    q = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
    row(f"MLAAttention layer ({layer.attn_backend.get_name()})", call, q, latent[:, :c], latent[:, c:])


def indexer_rows(ceilings, *, num_reqs: int = 4, new_tokens: int = 1024, context_len: int = 4096,
                 topk: int = 2048) -> list[dict]:  # fmt: skip
    """DeepSeek-V3.2's lightning indexer (64 index heads of 128, bf16) for ``num_reqs`` chunks of
    ``new_tokens`` ending at ``context_len``: the Triton kernel (``indexer_pallas_triton``) and
    the jnp reference, against the FLOPs floor; ``topk_agree`` is the share of the reference's
    chosen positions the kernel also chose."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from attn_jax.ops.mla import indexer_pallas_triton, sparse_reference

    heads, dim, page = 64, 128, 64
    pages = context_len // page
    keys = jax.random.split(jax.random.key(9), 3)
    k_cache = jax.random.normal(keys[0], (num_reqs * pages + 8, page, dim), jnp.bfloat16)
    table = jnp.asarray(np.random.default_rng(9).permutation(num_reqs * pages + 8)[: num_reqs * pages]
                        .reshape(num_reqs, pages).astype(np.int32))  # fmt: skip
    t = num_reqs * new_tokens
    q_idx = jax.random.normal(keys[1], (t, heads, dim), jnp.bfloat16)
    weights = jax.random.uniform(keys[2], (t, heads), jnp.float32, 0.5, 1.5) * dim**-0.5
    qsl = jnp.arange(0, t + 1, new_tokens, dtype=jnp.int32)
    lens = jnp.full((num_reqs,), context_len, jnp.int32)
    visible = num_reqs * sum(context_len - new_tokens + i + 1 for i in range(new_tokens))
    flops = 2.0 * heads * dim * visible
    floor_s = flops / ceilings["matmul_flops_per_s"]
    print(f"MLA-IDX: {t} tokens over {context_len}, {flops / 1e12:.3f} TFLOP, floor {floor_s * 1e6:.1f} us")
    args = (q_idx, weights, k_cache, qsl, lens, table)
    ref_fn = jax.jit(functools.partial(sparse_reference.lightning_indexer, topk=topk))
    ref = np.asarray(ref_fn(*args))
    rows = []
    for impl, fn in (("pallas_indexer_triton", jax.jit(functools.partial(indexer_pallas_triton.lightning_indexer,
                                                                           topk=topk))),
                     ("xla_reference", ref_fn)):  # fmt: skip
        try:
            sec = time_fn(fn, *args, reps=10, inner=2)
            got = np.asarray(fn(*args))
        except Exception as e:  # noqa: BLE001 - a configuration that fails is a row, not the end of the run
            print(f"  {impl}: failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        agree = float(np.mean([len(set(a) & set(b)) / len(set(b)) for a, b in zip(got, ref, strict=True)]))
        rows.append({"workload": "MLA-IDX", "impl": impl, "time_us": sec * 1e6, "tflop_per_s": flops / sec / 1e12,
                     "pct_of_floor": 100 * floor_s / sec, "topk_agree": agree})  # fmt: skip
        print(f"  {impl:22s} {sec * 1e6:9.1f} us {flops / sec / 1e12:6.1f} TFLOP/s {100 * floor_s / sec:5.1f}% of "
              f"floor  top-k agreement {agree:.4f}")  # fmt: skip
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workloads", default="MLA-D1,MLA-D1-16,MLA-P1",
        help="comma-separated MLA_WORKLOADS names, and MLA-IDX (DeepSeek-V3.2's lightning indexer)",
    )  # fmt: skip
    parser.add_argument("--impls", default="pallas_mla_gpu,pallas_mla_mgpu,xla_reference")
    parser.add_argument(
        "--sweep", action="store_true", help="also time block_h x pages_per_tile x num_kv_splits x num_warps x stages"
    )
    parser.add_argument("--sweep-stages", default="2", help="comma-separated num_stages values for --sweep")
    add_output_args(parser, "mla_attention_gpu.json")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from attn_jax.ops.mla import decode_pallas_mosaic_gpu, pallas_triton, reference
    from attn_jax.ops.mla.pallas_triton import MLADecodeBlockSizes
    from attn_jax.testing.mla import MLA_WORKLOADS

    dev = gpu_device()
    if dev is None:
        return 2
    ceilings = measure_ceilings()
    print(f"ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"bf16 matmul {ceilings['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")  # fmt: skip
    rows = []
    for name in args.workloads.split(","):
        if name == "MLA-IDX":
            rows.extend(indexer_rows(ceilings))
            continue
        spec = MLA_WORKLOADS[name]
        if spec.query_len != 1:
            rows.extend(prefill_rows(spec, ceilings, sweep=args.sweep))
            continue
        q, cache, seq_lens, table = make_batch(spec)
        scale = 192**-0.5
        nbytes, flops = floors(spec)
        t_bytes, t_flops = nbytes / ceilings["copy_bytes_per_s"], flops / ceilings["matmul_flops_per_s"]
        floor_s, bound = max(t_bytes, t_flops), "memory" if t_bytes >= t_flops else "compute"
        print(f"{name}: {nbytes / 1e9:.3f} GB, {flops / 1e12:.3f} TFLOP; floors {t_bytes * 1e6:.1f} us (bytes), "
              f"{t_flops * 1e6:.1f} us (FLOPs): {bound}-bound")  # fmt: skip
        ref = reference.mla_decode(q.astype(jnp.float32), cache.astype(jnp.float32), seq_lens, table,
                                   sm_scale=scale, kv_lora_rank=spec.kv_lora_rank)  # fmt: skip
        ref = np.asarray(ref, np.float64)

        def record(impl, fn, extra=None, *, spec=spec, ref=ref, nbytes=nbytes, flops=flops, floor_s=floor_s,
                   bound=bound, args=(q, cache, seq_lens, table)):  # fmt: skip
            try:
                t = time_fn(fn, *args)
                out = np.asarray(fn(*args), np.float64)
            except Exception as e:  # noqa: BLE001 - a configuration that fails is a row, not the end of the run
                print(f"  {impl} {extra or ''}: failed: {type(e).__name__}: {str(e)[:200]}")
                return
            err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
            span = {} if extra else device_times(fn, *args)  # swept rows: the host clock only
            pct = {f"{k[:-3]}_pct_of_floor": 100 * floor_s / (us * 1e-6) for k, us in span.items()}
            row = {"workload": spec.name, "impl": impl, **(extra or {}), "time_us": t * 1e6,
                   "gb_per_s": nbytes / t / 1e9, "tflop_per_s": flops / t / 1e12,
                   "pct_of_floor": 100 * floor_s / t, "bound": bound, "rel_l2_vs_f32": err, **span, **pct}  # fmt: skip
            rows.append(row)
            device = "".join(f"; {k} {us:.1f} ({pct[f'{k[:-3]}_pct_of_floor']:.1f} %)" for k, us in span.items())
            print(f"  {impl:16s} {str(extra or ''):60s} {t * 1e6:9.1f} us {row['gb_per_s']:7.0f} GB/s "
                  f"{row['tflop_per_s']:6.1f} TFLOP/s {row['pct_of_floor']:5.1f}% of floor  err {err:.1e}"
                  f"{device}")  # fmt: skip

        kw = dict(sm_scale=scale, kv_lora_rank=spec.kv_lora_rank)
        if "pallas_mla_gpu" in args.impls:
            default = functools.partial(pallas_triton.mla_decode, **kw, device_kind=dev.device_kind)  # as the layer
            record("pallas_mla_gpu", jax.jit(default))
            if args.sweep:
                pages = -(-spec.context_len // spec.block_size)
                stages = [int(x) for x in args.sweep_stages.split(",")]
                for bh, ppt, splits, warps, st in itertools.product(
                    (16, 32, 64, 128), (1, 2), (1, 2, 4, 8), (4, 8), stages
                ):
                    if bh > max(16, spec.num_heads * 2) or ppt * spec.block_size > 128 or splits > pages:
                        continue
                    bs = MLADecodeBlockSizes(
                        block_h=bh, pages_per_tile=ppt, num_kv_splits=splits, num_warps=warps, num_stages=st
                    )
                    fn = jax.jit(functools.partial(pallas_triton.mla_decode, **kw, block_sizes=bs))
                    record("pallas_mla_gpu", fn, {"block_sizes": str(bs)})
        if "pallas_mla_mgpu" in args.impls:
            record("pallas_mla_mgpu", jax.jit(functools.partial(decode_pallas_mosaic_gpu.mla_decode, **kw)))
            if args.sweep:
                for splits in (1, 2, 3, 4, 8):
                    fn = jax.jit(functools.partial(decode_pallas_mosaic_gpu.mla_decode, **kw, num_splits=splits))
                    record("pallas_mla_mgpu", fn, {"num_splits": splits})
        if "xla_reference" in args.impls:
            record("xla_reference", jax.jit(functools.partial(reference.mla_decode, **kw)))
    result = {"benchmark": "mla_attention", "device": dev.device_kind, "date": datetime.date.today().isoformat(),
              "jax": jax.__version__, **ceilings, "results": rows}  # fmt: skip
    write_json(output_path(args), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
