"""Cascade attention's block sizes on a GPU, at S1's decode step (issue 23).

The batch: ``--requests`` requests of one new token each over a shared ``--prefix-len``
prefix and ``--suffix-len`` tokens of their own (S1 mid-decode: 64 x (2048 + 128)), with
SmolLM2-135M's attention (9 query / 3 KV heads, head 64, page 16, bf16). Device time per
call from one CUPTI trace (``cupti_timing``), the k/v write included, as the kernels' sum
and the span. One layer per call: the span carries the metadata's transfers and the
cascade op's schedule ops (about 50 small XLA kernels), which a model's step computes once
for all its layers, so the kernel sum is the figure to compare:

- ``no cascade``: the public ``Attention`` layer (PALLAS_GPU), metadata from ``layer.prepare``;
- ``cascade (builder)``: the same layer with the builder's cascade metadata
  (``metadata_builder.build(prefix_len, md)``), as the engine runs it;
- the op (``cascade_ragged_paged_attention``, the fused merge) with the prefix part's blocks
  swept (q-block, pages per tile, KV splits) at the builder's suffix blocks, then the
  suffix part's blocks at the best prefix blocks.

    python benchmarks/cascade_blocks.py --out /tmp/cascade_blocks.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools

from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder

SHAPE = dict(num_q_heads=9, num_kv_heads=3, head_size=64, block_size=16)  # SmolLM2-135M's attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--suffix-len", type=int, default=128)
    parser.add_argument("--calls", type=int, default=30, help="timed calls per configuration (medians reported)")
    add_output_args(parser, "cascade_blocks_{device}.json")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    from cupti_timing import summarize, trace_calls  # benchmarks/, the script's folder

    from attn_jax import Attention
    from attn_jax.backends import pallas_gpu
    from attn_jax.ops.ragged_paged_attention.cascade import cascade_ragged_paged_attention
    from attn_jax.ops.ragged_paged_attention.config import GpuBlockSizes
    from attn_jax.registry import AttentionBackendEnum
    from attn_jax.testing.workloads import make_ragged_batch

    device = jax.devices()[0].device_kind
    args.device = device.lower().replace(" ", "_")
    n = args.requests
    batch = make_ragged_batch(
        0, [1] * n, [args.prefix_len + args.suffix_len] * n, **SHAPE, dtype=jnp.bfloat16, shuffle_blocks=False
    ).with_shared_prefix(args.prefix_len)
    layer = Attention(SHAPE["num_q_heads"], SHAPE["head_size"], SHAPE["head_size"] ** -0.5, SHAPE["num_kv_heads"],
                      block_size=SHAPE["block_size"], dtype=jnp.bfloat16,
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
    op = functools.partial(pallas_gpu.ragged_paged_attention, interpret=jax.default_backend() != "gpu")

    @functools.partial(jax.jit, static_argnames=("prefix_bs", "suffix_bs"), donate_argnums=3)
    def cascade(q, k, v, cache, prefix_bs, suffix_bs):
        return cascade_ragged_paged_attention(
            q, k, v, cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, batch.slot_mapping,
            prefix_len=args.prefix_len, sm_scale=SHAPE["head_size"] ** -0.5, op=op, fuse_merge=True,
            prefix_kwargs=dict(block_sizes=prefix_bs), suffix_kwargs=dict(block_sizes=suffix_bs),
        )  # fmt: skip

    builder_prefix = cascade_md.cascade_block_sizes
    builder_suffix = plain_md.block_sizes
    prefix_grid = [
        GpuBlockSizes(block_q=bq, pages_per_tile=ppt, num_kv_splits=splits, num_warps=warps)
        for bq, ppt, splits, warps in itertools.product((4, 16, 32), (4, 8), (4, 8, 16, 32), (4,))
    ]
    for bs in prefix_grid:
        calls[f"prefix {bs}"] = functools.partial(run, cascade, batch.q, batch.k, batch.v, bs, builder_suffix)
    results = {name: summarize(groups) for name, groups in trace_calls(calls, n=args.calls, gap_s=5e-3).items()}
    swept = {name: r for name, r in results.items() if name.startswith("prefix ")}
    best_prefix = prefix_grid[list(swept).index(min(swept, key=lambda x: swept[x]["median_us"]))]
    suffix_grid = [
        GpuBlockSizes(block_q=4, pages_per_tile=ppt, num_warps=warps) for ppt in (1, 2, 4, 8) for warps in (4, 8)
    ]
    suffix_calls = {
        f"suffix {bs}": functools.partial(run, cascade, batch.q, batch.k, batch.v, best_prefix, bs)
        for bs in suffix_grid
    }
    results |= {name: summarize(groups) for name, groups in trace_calls(suffix_calls, n=args.calls, gap_s=5e-3).items()}
    for name, r in sorted(results.items(), key=lambda x: x[1]["median_kernel_sum_us"]):
        kernels, span, events = r["median_kernel_sum_us"], r["median_us"], r["events_per_call"]
        print(f"{kernels:8.1f} us kernels {span:8.1f} us span {events:3d} events  {name}", flush=True)
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
                "dtype": "bfloat16",
            },
            "builder_prefix_block_sizes": str(builder_prefix),
            "builder_suffix_block_sizes": str(builder_suffix),
            "best_prefix_block_sizes": str(best_prefix),
            "median_us": {name: r["median_us"] for name, r in results.items()},
            "results": results,
        },  # fmt: skip
    )


if __name__ == "__main__":
    main()
