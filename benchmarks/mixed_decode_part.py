"""A mixed batch's decodes in the Triton launch: on the mixed q-blocks or on decode blocks beside
them (issue 25).

The PALLAS_GPU builder gives a mixed batch one Triton launch in two parts
(``pallas_triton.mixed_schedule``): the other rows on the mixed blocks, the decodes on the
bucket's decode blocks (``config.decode_part_block_sizes``). Rows, each the device span of a
call from CUPTI (median of ``--calls``), all in one process: the launch in one part (every row
on the mixed blocks), in two parts, and each part alone (the other part's q-blocks emptied);
``--decode-tiles`` also runs the decode part at other tile widths. ``--two-kernels`` adds the
alternative of two kernels in one jit, the long chunks on the Mosaic GPU prefill and the
decodes on the Triton kernel: whether XLA overlaps them depends on its command-buffer flags,
so run it once per ``XLA_FLAGS`` setting (BENCHMARKS.md); and the PALLAS_GPU op's split with a
decode part, the Triton launch writing the other rows and the decodes into the Mosaic GPU
kernel's output.

    python benchmarks/mixed_decode_part.py --workloads M1,M2 --out /tmp/parts.json
    XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1 \\
        --xla_gpu_command_buffer_scheduling_mode=CONCURRENT" python benchmarks/mixed_decode_part.py --two-kernels
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys

from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder


def workload_rows(name: str, device_kind: str, decode_tiles: list[int], two_kernels: bool, calls: int) -> list[dict]:
    """The rows of one mixed workload (printed as they come)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from attention import default_block_sizes, device_summary, make_device_batch  # benchmarks/

    from attn_jax.backends.pallas_gpu import mgpu_split, split_schedules
    from attn_jax.ops.ragged_paged_attention import pallas_mosaic_gpu, pallas_triton
    from attn_jax.ops.ragged_paged_attention.config import decode_part_block_sizes, mgpu_block_sizes
    from attn_jax.testing.workloads import WORKLOADS

    spec = WORKLOADS[name]
    b = make_device_batch(spec)
    qsl, seq = np.asarray(b.query_start_loc), np.asarray(b.seq_lens)
    num_reqs, num_tokens, sm_scale = len(seq), b.num_tokens, spec.head_size**-0.5
    launch = default_block_sizes(b)
    decode = decode_part_block_sizes(
        launch, default_block_sizes(b, mode="decode"), group=spec.num_q_heads // spec.num_kv_heads,
        page_size=spec.block_size, device_kind=device_kind, head_size=spec.head_size,
        q_dtype=spec.dtype, kv_dtype=spec.dtype,
    )  # fmt: skip
    if decode is None:
        print(f"{name}: the launch's blocks split the KV range ({launch}); no decode part")
        return []
    one = pallas_triton.gpu_schedule(qsl, seq, num_tokens=num_tokens, block_q=launch.block_q, xp=np)
    two = pallas_triton.mixed_schedule(qsl, seq, num_tokens=num_tokens, block_q=launch.block_q, xp=np)
    decodes_only, rest_only = two.copy(), two.copy()
    decodes_only[2, num_reqs:] = decodes_only[1, num_reqs:]  # a q-block with no rows returns at once
    rest_only[2, :num_reqs] = rest_only[1, :num_reqs]

    def triton(schedule, decode_bs):
        schedule = jnp.asarray(schedule)
        return jax.jit(lambda q, kv: pallas_triton._attend(
            q, kv, schedule, b.block_tables, None, None, None, None, None, sm_scale=sm_scale, causal=True,
            sliding_window=None, soft_cap=None, block_sizes=launch, interpret=False, decode_block_sizes=decode_bs,
        )[0])  # fmt: skip

    fns = {"one part (every row on the launch's blocks)": triton(one, None), "two parts": triton(two, decode)}
    fns["two parts, decodes only"] = triton(decodes_only, decode)
    fns["two parts, the other rows only"] = triton(rest_only, decode)
    for keys in decode_tiles:
        other = dataclasses.replace(decode, pages_per_tile=max(keys // spec.block_size, 1))
        fns[f"two parts, decode tiles of {keys} keys"] = triton(two, other)
    if two_kernels:
        mbs = mgpu_block_sizes(head_size=spec.head_size, device_kind=device_kind)
        tiles = jnp.asarray(
            mgpu_split(qsl, seq, num_tokens=num_tokens, block_q=launch.block_q, mgpu_bs=mbs)["mgpu_schedule"]
        )
        is_decode = np.zeros((num_tokens, 1, 1), bool)
        is_decode[qsl[:-1][np.diff(qsl) == 1]] = True
        dec = fns["two parts, decodes only"]
        mosaic = jax.jit(lambda q, kv: pallas_mosaic_gpu.prefill_attention(
            q, kv, tiles, b.block_tables, sm_scale=sm_scale, block_sizes=mbs))  # fmt: skip
        fns["two kernels: Mosaic GPU chunks alone"] = mosaic
        fns["two kernels: chunks + decodes, one jit"] = jax.jit(
            lambda q, kv: jnp.where(jnp.asarray(is_decode), dec(q, kv), mosaic(q, kv))
        )
        # The PALLAS_GPU op's split with a decode part: the Triton launch writes the rest and the
        # decodes (on decode blocks) into the Mosaic GPU kernel's output, no merge.
        _, rest = split_schedules(qsl, seq, num_tokens=num_tokens, block_q=launch.block_q, tile=mbs.tile, xp=np,
                                  decode_part=True)  # fmt: skip
        fns["two kernels: the rest and decodes into the chunks' output"] = jax.jit(
            lambda q, kv: pallas_triton._attend(
                q, kv, jnp.asarray(rest), b.block_tables, None, None, None, None, mosaic(q, kv), sm_scale=sm_scale,
                causal=True, sliding_window=None, soft_cap=None, block_sizes=launch, interpret=False,
                decode_block_sizes=decode,
            )[0]
        )  # fmt: skip
    ref = np.asarray(fns["one part (every row on the launch's blocks)"](b.q, b.kv_cache), np.float32)
    print(f"{name}: launch {launch}, decode part {decode}")
    rows = []
    for label, fn in fns.items():
        out = np.asarray(fn(b.q, b.kv_cache), np.float32)
        summary = device_summary(fn, b.q, b.kv_cache, calls=calls)
        whole = "only" not in label and "alone" not in label
        diff = float(np.abs(out - ref)[: int(qsl[-1])].max()) if whole else None
        rows.append({"workload": name, "row": label, "span_us": summary["median_us"],
                     "kernel_sum_us": summary["median_kernel_sum_us"], "max_abs_diff_vs_one_part": diff})  # fmt: skip
        print(f"  {label:48s} span {summary['median_us']:7.1f} us  kernels {summary['median_kernel_sum_us']:7.1f}"
              f" us  max |diff| {diff}")  # fmt: skip
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="M1,M2", help="mixed WORKLOADS names (default M1,M2)")
    parser.add_argument("--decode-tiles", default="", help="also run the decode part at these key tiles (e.g. 64)")
    parser.add_argument("--two-kernels", action="store_true", help="also the Mosaic GPU chunks + Triton decodes")
    parser.add_argument("--calls", type=int, default=30, help="calls per CUPTI median (default 30)")
    add_output_args(parser, "mixed_decode_part_gpu.json")
    args = parser.parse_args(argv)

    import jax
    from gpu_check import gpu_device  # benchmarks/

    dev = gpu_device()
    if dev is None:
        return 2
    tiles = [int(x) for x in args.decode_tiles.split(",") if x]
    rows = [r for name in args.workloads.split(",")
            for r in workload_rows(name, dev.device_kind, tiles, args.two_kernels, args.calls)]  # fmt: skip
    result = {"benchmark": "mixed_decode_part", "device": dev.device_kind, "date": datetime.date.today().isoformat(),
              "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""), "results": rows}  # fmt: skip
    write_json(output_path(args), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
