"""Cascade attention's block sizes on a GPU, at S1's decode step (issue 23).

The batch: ``--requests`` requests of one new token each over a shared ``--prefix-len``
prefix and ``--suffix-len`` tokens of their own (S1 mid-decode: 64 x (2048 + 128)), with
SmolLM2-135M's attention (9 query / 3 KV heads, head 64, page 16, bf16 or --dtype). Every call goes
through the public ``Attention`` layer (PALLAS_GPU) with host-built metadata, as the engine
runs it, so a call's events are the k/v write and the attention kernels alone. Device time
per call from one CUPTI trace (``cupti_timing``): each attention kernel's, the kernels' sum
and the span.

- ``no cascade``: metadata from ``layer.prepare``;
- ``cascade (builder)``: the builder's cascade metadata (``metadata_builder.build(prefix_len, md)``);
- the builder's metadata with the prefix part's blocks (pages per tile, KV splits, stages)
  and the suffix part's (the builder's, the batch's, other tiles and warps) swept together,
  their q-blocks rebuilt for them (the prefix part's splits are what the suffix part's
  kernel folds in) (``--grid full``, the default);
- ``--grid rows``: the prefix part's q-block rows alone (16, 32 and 64: 4, 8 and 16 tokens
  of the head group padded to 4), each split as the builder splits it, on the builder's
  suffix blocks: what issue 49 turned on (float32 dots are FMA loops, whose work grows
  with the rows; the builder used 64 there, and now 16).

``--dtype float32`` runs the layer (activations and cache) in float32.

    python benchmarks/cascade_blocks.py --out /tmp/cascade_blocks.json
    python benchmarks/cascade_blocks.py --dtype float32 --grid rows --requests 16 --prefix-len 1024 \\
        --suffix-len 96 --out /tmp/cascade_rows_f32.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import statistics

from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder

SHAPE = dict(num_q_heads=9, num_kv_heads=3, head_size=64, block_size=16)  # SmolLM2-135M's attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--suffix-len", type=int, default=128)
    parser.add_argument("--calls", type=int, default=30, help="timed calls per configuration (medians reported)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--grid", default="full", choices=["full", "rows"], help="what to sweep (the docstring)")
    add_output_args(parser, "cascade_blocks_{device}.json")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    from cupti_timing import summarize, trace_calls  # benchmarks/, the script's folder

    from attn_jax import Attention
    from attn_jax.ops.ragged_paged_attention.config import H100_NUM_SMS, GpuBlockSizes
    from attn_jax.registry import AttentionBackendEnum
    from attn_jax.testing.workloads import make_ragged_batch

    device = jax.devices()[0].device_kind
    args.device = device.lower().replace(" ", "_")
    n = args.requests
    dtype = jnp.dtype(args.dtype)
    batch = make_ragged_batch(
        0, [1] * n, [args.prefix_len + args.suffix_len] * n, **SHAPE, dtype=dtype, shuffle_blocks=False
    ).with_shared_prefix(args.prefix_len)
    layer = Attention(SHAPE["num_q_heads"], SHAPE["head_size"], SHAPE["head_size"] ** -0.5, SHAPE["num_kv_heads"],
                      block_size=SHAPE["block_size"], dtype=dtype,
                      attn_backend=AttentionBackendEnum.PALLAS_GPU)  # fmt: skip
    md = batch.common_metadata()
    q, k, v = (x.reshape(x.shape[0], -1) for x in (batch.q, batch.k, batch.v))
    state = {"cache": jnp.array(batch.kv_cache)}  # donated through every call: the write is in place
    layer_step = jax.jit(layer.__call__, donate_argnums=3)

    def run(fn, *args):
        out, state["cache"] = fn(*args[:3], state["cache"], *args[3:])
        return out

    plain_md = layer.prepare(md)
    cascade_md = layer.metadata_builder.build(args.prefix_len, md)
    if cascade_md.cascade_prefix_len is None:
        raise SystemExit("the builder declined cascade attention for this batch: nothing to sweep")
    calls = {
        "no cascade": functools.partial(run, layer_step, q, k, v, plain_md),
        "cascade (builder)": functools.partial(run, layer_step, q, k, v, cascade_md),
    }
    prefix_grid = [
        GpuBlockSizes(block_q=16, pages_per_tile=ppt, num_kv_splits=splits, num_stages=stages)
        for ppt, splits, stages in itertools.product((4, 8), (8, 16, 32), (2, 3))
    ]
    suffix_grid = [cascade_md.cascade_suffix_block_sizes, cascade_md.block_sizes] + [
        GpuBlockSizes(block_q=4, pages_per_tile=ppt, num_warps=warps) for ppt, warps in ((1, 4), (2, 8))
    ]
    if args.grid == "rows":  # the prefix part's rows, split as the builder splits them (cascade_block_sizes)
        prefix_bs = cascade_md.cascade_block_sizes
        pages = cascade_md.block_tables.shape[1]
        tiles = pages * SHAPE["block_size"] // prefix_bs.tile(SHAPE["block_size"])
        prefix_grid = []
        for block_q in (4, 8, 16):  # 16, 32, 64 rows: the head group of 3 padded to 4
            programs = -(-cascade_md.slot_mapping.shape[0] // block_q) * SHAPE["num_kv_heads"]
            splits = max(1, min(2 * H100_NUM_SMS // programs, tiles // 2))
            prefix_grid.append(dataclasses.replace(prefix_bs, block_q=block_q, num_kv_splits=splits))
        suffix_grid = [cascade_md.cascade_suffix_block_sizes]
    for prefix_bs, suffix_bs in itertools.product(prefix_grid, suffix_grid):
        swept_md = layer.metadata_builder.with_cascade_blocks(cascade_md, prefix_bs, suffix_bs)
        calls[f"prefix {prefix_bs} | suffix {suffix_bs}"] = functools.partial(run, layer_step, q, k, v, swept_md)
    results = {}
    for name, groups in trace_calls(calls, n=args.calls, gap_s=5e-3).items():
        results[name] = summarize(groups)
        parts = [[e.duration_ns / 1e3 for e in g if "ragged_paged_attention" in e.name] for g in groups]
        results[name]["median_attention_kernel_us"] = [statistics.median(x) for x in zip(*parts, strict=True)]
    for name, r in sorted(results.items(), key=lambda x: x[1]["median_kernel_sum_us"]):
        kernels, span, events = r["median_kernel_sum_us"], r["median_us"], r["events_per_call"]
        each = " + ".join(f"{x:.1f}" for x in r["median_attention_kernel_us"])
        print(f"{kernels:7.1f} us kernels ({each}) {span:7.1f} us span {events:2d} events  {name}", flush=True)
    write_json(
        output_path(args),
        {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": device,
            "jax": jax.__version__,
            "workload": {
                **SHAPE,
                "requests": n,
                "prefix_len": args.prefix_len,
                "suffix_len": args.suffix_len,
                "dtype": args.dtype,
                "grid": args.grid,
            },
            "builder_prefix_block_sizes": str(cascade_md.cascade_block_sizes),
            "builder_suffix_block_sizes": str(cascade_md.cascade_suffix_block_sizes),
            "batch_block_sizes": str(cascade_md.block_sizes),
            "best": min(results, key=lambda name: results[name]["median_kernel_sum_us"]),
            "median_us": {name: r["median_us"] for name, r in results.items()},
            "results": results,
        },  # fmt: skip
    )


if __name__ == "__main__":
    main()
