"""How fast a Mosaic GPU kernel can stream a paged latent cache: the read ceiling under the
MLA decode kernel (issue 24).

``ops/mla/decode_pallas_mosaic_gpu.py`` streams MLA-D1's pages (64 rows of 576 bf16, one TMA
each, shuffled) at 1.6-2.0 TB/s whether or not it computes anything (BENCHMARKS.md), below
the measured copy ceiling. This kernel does only the streaming: each CTA reads its share of
one request's pages through a ring of ``slots`` shared-memory slots (a TMA a page, wait,
reissue), one warpgroup, no compute. Varying the ring depth, the CTAs per request
(``splits``) and so the CTAs resident per SM (a slot is 72 KiB: 1 slot lets 3 CTAs share an
SM, 2-3 slots one) says whether more TMAs in flight per SM, or more SMs' worth of CTAs, lift
the rate. Each row: median time by the host clock, GB/s of whole pages, % of the copy ceiling
measured in the same run, and the CUPTI device span of a call (``mla_attention.device_times``:
one kernel's host dispatch can take longer than the kernel, so the host clock may time the
host).

    python benchmarks/paged_stream_ceiling.py                   # MLA-D1's cache, default configs
    python benchmarks/paged_stream_ceiling.py --configs 1:1,1:4,2:1 --out /tmp/stream.json
    python benchmarks/paged_stream_ceiling.py --lower           # lower each config for CUDA (CPU ok)
"""

from __future__ import annotations

import argparse
import datetime
import functools
import sys

from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder

DEFAULT_CONFIGS = "1:1,2:1,3:1,1:2,1:3,2:2,1:6"
"""slots:splits pairs (ring depth, CTAs per request)."""


def stream_pages(cache, table, *, slots: int, splits: int):
    """Reads every page ``table`` names from ``cache`` [P, S, W] into shared memory, ``slots``
    deep, ``splits`` CTAs a request; returns f[R * splits, 8, W] (each CTA's first 8 rows of
    slot 0, so the reads are not dead)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from attn_jax.ops.ragged_paged_attention.pallas_mosaic_gpu import smem_transforms

    num_pages, page, width = cache.shape
    num_reqs, pages_per_req = table.shape
    per_split = -(-pages_per_req // splits)
    kv = cache.reshape(num_pages * page, width)

    def body(table_ref, kv_ref, out_ref, ring, bars):
        cta = lax.axis_index("cta")
        req, split = lax.div(cta, jnp.int32(splits)), lax.rem(cta, jnp.int32(splits))
        lo = split * per_split
        n = jnp.minimum(lo + per_split, pages_per_req) - lo

        def fetch(j, slot):
            row = table_ref[req, lo + j] * page
            plgpu.copy_gmem_to_smem(kv_ref.at[pl.ds(row, page)], ring.at[slot], bars.at[slot])

        for i in range(slots):
            pl.when(i < n)(functools.partial(fetch, i, i))

        @pl.loop(0, n)
        def _(j):
            slot = lax.rem(j, jnp.int32(slots))
            plgpu.barrier_wait(bars.at[slot])
            pl.when(j + slots < n)(lambda: fetch(j + slots, slot))

        plgpu.copy_smem_to_gmem(ring.at[0, pl.ds(0, 8)], out_ref.at[cta])
        plgpu.wait_smem_to_gmem(0)

    def entry(table_ref, kv_ref, out_ref):
        pl.run_scoped(
            functools.partial(body, table_ref, kv_ref, out_ref),
            plgpu.SMEM((slots, page, width), cache.dtype, transforms=smem_transforms(width, cache.dtype)),
            plgpu.Barrier(num_barriers=slots),
        )

    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((num_reqs * splits, 8, width), cache.dtype),
        grid=(num_reqs * splits,),
        grid_names=("cta",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        kernel_name="paged_stream_ceiling",
    )(table, kv)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="MLA-D1", help="an MLA_WORKLOADS decode name (its cache and pages)")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated slots:splits pairs")
    parser.add_argument("--lower", action="store_true", help="only lower each config for CUDA (runs on a CPU)")
    add_output_args(parser, "paged_stream_ceiling_gpu.json")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from attn_jax.testing.mla import MLA_WORKLOADS

    configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
    spec = MLA_WORKLOADS[args.workload]
    pages_per_req = -(-spec.context_len // spec.block_size)
    if args.lower:
        sds = jax.ShapeDtypeStruct
        width = spec.kv_lora_rank + spec.rope_dim
        shapes = (sds((spec.num_reqs * pages_per_req, spec.block_size, width), jnp.bfloat16),
                  sds((spec.num_reqs, pages_per_req), jnp.int32))  # fmt: skip
        for slots, splits in configs:
            f = functools.partial(stream_pages, slots=slots, splits=splits)
            text = jax.export.export(jax.jit(f), platforms=["cuda"])(*shapes).mlir_module()
            print(f"slots={slots} splits={splits}: lowered ({'mosaic_gpu' in text})")
        return 0

    from gpu_check import gpu_device  # benchmarks/, the script's folder
    from mla_attention import device_times, make_batch, measure_ceilings, time_fn  # benchmarks/, the script's folder

    dev = gpu_device()
    if dev is None:
        return 2
    copy = measure_ceilings()["copy_bytes_per_s"]
    _, cache, _, table = make_batch(spec)
    nbytes = table.size * spec.block_size * cache.shape[-1] * cache.dtype.itemsize
    print(f"{args.workload}: {nbytes / 1e9:.3f} GB of pages; copy ceiling {copy / 1e12:.2f} TB/s")
    rows = []
    for slots, splits in configs:
        fn = jax.jit(functools.partial(stream_pages, slots=slots, splits=splits))
        t = time_fn(fn, cache, table)
        span = device_times(fn, cache, table)
        d = span["device_us"] * 1e-6
        rows.append({"slots": slots, "splits": splits, "time_us": t * 1e6, "gb_per_s": nbytes / t / 1e9,
                     "pct_of_copy": 100 * nbytes / t / copy, **span,
                     "device_pct_of_copy": 100 * nbytes / d / copy})  # fmt: skip
        print(f"  slots={slots} splits={splits}: {t * 1e6:7.1f} us {nbytes / t / 1e9:6.0f} GB/s "
              f"{100 * nbytes / t / copy:5.1f} % of copy; device {d * 1e6:7.1f} us "
              f"{100 * nbytes / d / copy:5.1f} % of copy")  # fmt: skip
    result = {"benchmark": "paged_stream_ceiling", "device": dev.device_kind, "date": datetime.date.today().isoformat(),
              "jax": jax.__version__, "workload": args.workload, "copy_bytes_per_s": copy, "results": rows}  # fmt: skip
    write_json(output_path(args), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
