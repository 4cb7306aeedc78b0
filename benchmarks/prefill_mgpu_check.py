"""On a Hopper GPU: the Mosaic GPU prefill kernel and the Pallas k/v write, checked and timed in one run.

1. ``pallas_mosaic_gpu.prefill_attention`` against the float32 jnp reference on ragged batches
   (NaN in every cache slot no request uses), for several head sizes, page sizes and
   block sizes: relative L2 error and NaN count on the rows it serves.
2. P1 (4 x 4096 causal, DESIGN.md) with the kernel alone for a few block sizes (at each of
   ``--p1-head-sizes``), beside
   JAX's dense ``attention_mgpu`` on the same shapes.
3. The k/v write: ``kv_write.write_kv`` against ``write_to_kv_cache`` (XLA scatters), cache
   donated, on P1's and D1's new tokens, in GB/s of bytes moved (k and v read + written).

    python benchmarks/prefill_mgpu_check.py [--out results.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax.kv_cache import write_to_kv_cache
from attn_jax.ops.ragged_paged_attention import kv_write, pallas_mosaic_gpu, reference
from attn_jax.ops.ragged_paged_attention.config import MOSAIC_GPU_SMEM_BYTES
from attn_jax.testing.workloads import WORKLOADS, make_ragged_batch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from attention import floors, make_device_batch, measure_ceilings, rel_l2, time_jax  # noqa: E402

log = functools.partial(print, flush=True)


def check_case(name, lens, ctx, *, heads, head_size, page, bs, seed=0):
    batch = make_ragged_batch(seed, query_lens=lens, context_lens=ctx, num_q_heads=heads[0], num_kv_heads=heads[1],
                              head_size=head_size, block_size=page, dtype=jnp.bfloat16, extra_blocks=3)  # fmt: skip
    q, k, v, cache, qsl, seq, bt, slots = batch.op_args
    scale = head_size**-0.5
    cache = write_to_kv_cache(batch.kv_cache, k, v, slots)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    ref, _ = reference.ragged_paged_attention(f32(q), None, None, f32(cache), qsl, seq, bt, slots, sm_scale=scale)
    sched, (lo, hi) = pallas_mosaic_gpu.mgpu_schedule(np.asarray(qsl), np.asarray(seq), num_tokens=q.shape[0],
                                              tile=bs.tile, xp=np)  # fmt: skip
    out = pallas_mosaic_gpu.prefill_attention(q, cache, jnp.asarray(sched), bt, sm_scale=scale, block_sizes=bs)
    out, ref = np.asarray(out, np.float32), np.asarray(ref)
    rows = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi, strict=True)])
    err = rel_l2(out[rows], ref[rows])
    nans = int(np.isnan(out[rows]).sum())
    log(
        f"check {name}: rel L2 {err:.2e}, NaN {nans}, rows {len(rows)}, "
        f"max abs {np.abs(out[rows] - ref[rows]).max():.3e}"
    )
    return {"case": name, "rel_l2": err, "nan": nans, "ok": bool(err < 1e-2 and nans == 0)}


def diagnose(log=log):
    """Where NaN or error shows on a ragged batch: per tile, per row half, per head; with the
    cache's NaN replaced by zeros; with the tail zeroing off; with a deeper ring."""
    B = pallas_mosaic_gpu.MgpuBlockSizes
    batch = make_ragged_batch(0, query_lens=[300, 1, 128, 140, 5, 1000], context_lens=[100, 50, 0, 37, 3, 20],
                              num_q_heads=8, num_kv_heads=2, head_size=128, block_size=16, dtype=jnp.bfloat16,
                              extra_blocks=3)  # fmt: skip
    q, k, v, cache, qsl, seq, bt, slots = batch.op_args
    cache = write_to_kv_cache(batch.kv_cache, k, v, slots)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    ref, _ = reference.ragged_paged_attention(f32(q), None, None, f32(cache), qsl, seq, bt, slots, sm_scale=0.0884)
    ref = np.asarray(ref)
    finite = jnp.nan_to_num(cache)
    out = {}
    for label, c, bs, zt in (("nan", cache, B(64, 128, 2), True),
                             ("finite", finite, B(64, 128, 2), True),
                             ("finite_no_zero", finite, B(64, 128, 2), False),
                             ("nan_ring3", cache, B(64, 128, 3), True),
                             ("nan_kv64", cache, B(64, 64, 2), True)):  # fmt: skip
        sched, (lo, hi) = pallas_mosaic_gpu.mgpu_schedule(np.asarray(qsl), np.asarray(seq), num_tokens=q.shape[0],
                                                  tile=bs.tile, xp=np)  # fmt: skip
        res = []
        for rep in range(2):
            o = np.asarray(pallas_mosaic_gpu.prefill_attention(q, c, jnp.asarray(sched), bt, sm_scale=0.0884,
                                                         block_sizes=bs, zero_tail=zt), np.float32)  # fmt: skip
            for req, tok, pos, kv_len in sched.T:
                if kv_len == 0:
                    continue
                for half in (0, 1):
                    rows = slice(tok + 64 * half, tok + 64 * half + 64)
                    nan = np.isnan(o[rows])
                    err = rel_l2(np.nan_to_num(o[rows]), ref[rows])
                    if nan.any() or err > 1e-2:
                        res.append(dict(rep=rep, req=int(req), pos=int(pos), kv_len=int(kv_len), half=half,
                                        nan=int(nan.sum()), err=err, heads=np.nonzero(nan.any((0, 2)))[0].tolist(),
                                        rows=np.nonzero(nan.any((1, 2)))[0].tolist()[:20],
                                        dims=int(nan.any((0, 1)).sum())))  # fmt: skip
        log(f"diag {label}: {len(res)} bad (tile, half) pairs; {res[:6]}")
        out[label] = res
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--only", default="", help="diag: only the NaN / error diagnosis")
    p.add_argument("--skip", default="", help="comma list of: checks, peer, write")
    p.add_argument("--p1-head-sizes", default="128", help="head sizes of the P1 block sweep (default 128)")
    p.add_argument(
        "--p1-block-sizes",
        default="64x128x2,64x64x2,64x64x3,64x64x4,64x128x3",
        help="the P1 sweep's Mosaic GPU block sizes, block_q x block_kv x steps_in_flight (default: five)",
    )
    args = p.parse_args(argv)
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
           "checks": [], "p1": [], "write": []}  # fmt: skip
    B = pallas_mosaic_gpu.MgpuBlockSizes

    def attempt(label, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            log(f"{label}: FAILED {type(e).__name__}: {str(e)[:1500]}")
            traceback.print_exc(limit=4)
            return {"case": label, "error": f"{type(e).__name__}: {str(e)[:400]}"}

    cases = [
        ("d128_p16_kv128", dict(heads=(8, 2), head_size=128, page=16, bs=B(64, 128, 2))),
        ("d64_p32_kv64", dict(heads=(4, 1), head_size=64, page=32, bs=B(64, 64, 3))),
        ("d128_p64_kv128_mha", dict(heads=(2, 2), head_size=128, page=64, bs=B(64, 128, 2))),
        ("d128_p256_kv128", dict(heads=(4, 2), head_size=128, page=256, bs=B(64, 128, 2))),
        # A persistent grid: 32 CTAs over 144 and 72 (tile, head) items.
        ("d128_p16_kv128_persistent", dict(heads=(8, 2), head_size=128, page=16, bs=B(64, 128, 2, 32))),
        ("d64_p32_kv64_persistent", dict(heads=(4, 1), head_size=64, page=32, bs=B(64, 64, 3, 32))),
    ]
    lens, ctx = [300, 1, 128, 140, 5, 1000], [100, 50, 0, 37, 3, 20]
    if "diag" in args.only:
        res["diag"] = diagnose()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1, default=float)
        return 0
    if "checks" not in args.skip:
        for name, kw in cases:
            res["checks"].append(attempt(name, functools.partial(check_case, name, lens, ctx, **kw)))

    ceil = measure_ceilings()
    res["ceilings"] = ceil
    log(
        f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
        f"matmul {ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s"
    )
    for head in [int(h) for h in args.p1_head_sizes.split(",") if h]:
        b = make_device_batch(dataclasses.replace(WORKLOADS["P1"], head_size=head))
        _, flops = floors(b)
        qsl, seq = np.asarray(b.query_start_loc), np.asarray(b.seq_lens)
        for bs in (B(*map(int, c.split("x"))) for c in args.p1_block_sizes.split(",") if c):
            if bs.smem_bytes(head, b.q.dtype) > MOSAIC_GPU_SMEM_BYTES:
                continue
            sched = jnp.asarray(
                pallas_mosaic_gpu.mgpu_schedule(qsl, seq, num_tokens=b.num_tokens, tile=bs.tile, xp=np)[0]
            )
            fn = jax.jit(functools.partial(pallas_mosaic_gpu.prefill_attention, sm_scale=head**-0.5, block_sizes=bs))

            def run(fn=fn, sched=sched, bs=bs, b=b, flops=flops, head=head):
                t = time_jax(fn, b.q, b.kv_cache, sched, b.block_tables)
                row = {"head_size": head, "block_sizes": str(bs), "ms": t * 1e3, "tflop_per_s": flops / t / 1e12}
                log(f"P1 head {head} mgpu {bs}: {t * 1e3:.3f} ms, {flops / t / 1e12:.0f} TFLOP/s")
                return row

            res["p1"].append(attempt(f"P1 head {head} {bs}", run))
        del b
    b = make_device_batch(WORKLOADS["P1"])
    _, flops = floors(b)

    def peer():
        from jax.experimental.pallas.ops.gpu import attention_mgpu as am

        # attention_mgpu's shared-memory buffers are float16, so its inputs are too.
        qd = (b.q.reshape(4, 4096, 32, 128) * jnp.bfloat16(128**-0.5)).astype(jnp.float16)
        kd = jax.random.normal(jax.random.key(3), (4, 4096, 8, 128), jnp.float16)
        out = {}
        for bkv in (128, 64):
            cfg = am.TuningConfig(block_q=64, block_kv=bkv, max_concurrent_steps=2, causal=True)
            fn = jax.jit(functools.partial(am.attention, config=cfg))
            t = time_jax(fn, qd, kd, kd)
            out[f"block_kv={bkv}"] = {"ms": t * 1e3, "tflop_per_s": flops / t / 1e12}
            log(f"P1 attention_mgpu dense block_kv={bkv}: {t * 1e3:.3f} ms, {flops / t / 1e12:.0f} TFLOP/s")
        return out

    if "peer" not in args.skip:
        res["p1_peer_attention_mgpu"] = attempt("peer", peer)

    for wname in () if "write" in args.skip else ("P1", "D1", "M1"):
        wb = make_device_batch(WORKLOADS[wname])
        s = wb.spec
        k = jax.random.normal(jax.random.key(5), (wb.num_tokens, s.num_kv_heads, s.head_size), jnp.bfloat16)
        nbytes = 2 * 2 * k.size * 2  # k and v, read and written

        for impl, f in (("xla_scatter", write_to_kv_cache), ("pallas_write", kv_write.write_kv)):
            step = jax.jit(lambda c, k, sl, f=f: f(c, k, k, sl), donate_argnums=0)

            def run(step=step, impl=impl, wb=wb, k=k, nbytes=nbytes, wname=wname):
                cache = jnp.array(wb.kv_cache)
                cache = step(cache, k, wb.slot_mapping)
                ref = write_to_kv_cache(jnp.array(wb.kv_cache), k, k, wb.slot_mapping)
                same = bool(jnp.array_equal(cache, ref))
                del ref
                times = []
                for _ in range(30):
                    jax.block_until_ready(cache)
                    t0 = time.perf_counter()
                    for _ in range(5):
                        cache = step(cache, k, wb.slot_mapping)
                    jax.block_until_ready(cache)
                    times.append((time.perf_counter() - t0) / 5)
                t = float(np.median(times))
                log(f"write {wname} {impl}: {t * 1e6:.1f} us, {nbytes / t / 1e9:.0f} GB/s, matches scatter {same}")
                return {"workload": wname, "impl": impl, "us": t * 1e6, "gb_per_s": nbytes / t / 1e9, "same": same}

            res["write"].append(attempt(f"write {wname} {impl}", run))
        del wb
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
