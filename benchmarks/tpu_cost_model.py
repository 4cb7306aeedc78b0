"""What the Pallas TPU kernel moves and computes on DESIGN.md's workloads, and the time
that takes at each TPU generation's peak HBM bandwidth and bf16 matmul rate.

A model, not a measurement: no TPU is lent to this project. Bytes and FLOPs come from
``pallas_mosaic_tpu.workload_cost`` (the kernel's own schedule walked on the host: the KV pages
each q-block DMAs, whole pages; the rows x keys its matmuls execute), with the block
sizes the kernel would pick on that generation (``config.tpu_block_sizes``: the tuned
table, decode block sizes for decode-only batches). Peaks are per TensorCore, from
``jax._src.tpu_info`` (jax 0.11.2); a v7x chip has two TensorCores, so a kernel split over
both (the head axis is "parallel") could approach twice the v7x rates. The floor is
DESIGN.md's: KV read once + q + out, and 4 * D FLOPs per visible (q, k) pair per head.

Run: .venv/bin/python benchmarks/tpu_cost_model.py [--write]   (--write: benchmarks/results/tpu_cost_model.json)
"""

import argparse

import numpy as np
from jax._src.tpu_info import ChipVersion, get_tpu_info_for_chip
from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder

from attn_jax.ops.ragged_paged_attention import pallas_mosaic_tpu
from attn_jax.ops.ragged_paged_attention.config import next_pow2, tpu_block_sizes
from attn_jax.testing.workloads import WORKLOADS

CHIPS = {"v5e": (ChipVersion.TPU_V5E, "TPU v5 lite"), "v6e": (ChipVersion.TPU_V6E, "TPU v6 lite"),
         "v7x": (ChipVersion.TPU_7X, "TPU7x")}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_args(parser, "tpu_cost_model.json")
    args = parser.parse_args()
    rows = []
    for name, spec in WORKLOADS.items():
        q, c = np.asarray(spec.query_lens), np.asarray(spec.context_lens)
        seq = q + c
        group = spec.num_q_heads // spec.num_kv_heads
        d, page = spec.head_size, spec.block_size
        floor_bytes = int(seq.sum() * spec.num_kv_heads * 2 * d * 2 + 2 * q.sum() * spec.num_q_heads * d * 2)
        for chip, (version, device_kind) in CHIPS.items():
            info = get_tpu_info_for_chip(version, 1)
            bs = tpu_block_sizes(
                q_dtype="bfloat16", kv_dtype="bfloat16", group=group, head_size=d, page_size=page,
                num_kv_heads=spec.num_kv_heads, num_tokens=next_pow2(int(q.sum())),
                pages_per_req=next_pow2(int(-(-seq.max() // page))), decode_only=bool((q <= 1).all()),
                max_query_len=int(q.max()),
                device_kind=device_kind,
            )  # fmt: skip
            cost = pallas_mosaic_tpu.workload_cost(
                q, c, num_q_heads=spec.num_q_heads, num_kv_heads=spec.num_kv_heads, head_size=d, page_size=page,
                q_itemsize=2, kv_itemsize=2, block_sizes=bs,
            )  # fmt: skip
            kernel_bytes = cost["kv_bytes"] + cost["qo_bytes"] + cost["write_bytes"]
            bw, flops = info.mem_bw_bytes_per_second, info.bf16_ops_per_second
            rows.append(dict(
                workload=name, chip=chip, block_sizes=[bs.q_tokens_per_block, bs.kv_pages_per_block],
                floor_bytes=floor_bytes, **cost, kernel_bytes=kernel_bytes,
                hbm_bw=bw, bf16_flops=flops,
                floor_us=floor_bytes / bw * 1e6, kernel_bytes_us=kernel_bytes / bw * 1e6,
                with_layout_us=(kernel_bytes + cost["layout_bytes"]) / bw * 1e6,
                useful_flops_us=cost["useful_flops"] / flops * 1e6, mxu_flops_us=cost["mxu_flops"] / flops * 1e6,
            ))  # fmt: skip
    print(
        "| workload | chip | (q tokens, pages) / block | floor GB | kernel GB | useful TFLOP | MXU TFLOP "
        "| floor us | kernel bytes us | useful FLOPs us | MXU FLOPs us |"
    )
    print("|" + " --- |" * 11)
    for r in rows:
        print(f"| {r['workload']} | {r['chip']} | {tuple(r['block_sizes'])} | {r['floor_bytes'] / 1e9:.3f} "
              f"| {r['kernel_bytes'] / 1e9:.3f} | {r['useful_flops'] / 1e12:.3f} | {r['mxu_flops'] / 1e12:.3f} "
              f"| {r['floor_us']:.0f} | {r['kernel_bytes_us']:.0f} | {r['useful_flops_us']:.0f} "
              f"| {r['mxu_flops_us']:.0f} |")  # fmt: skip
    write_json(output_path(args), rows)


if __name__ == "__main__":
    main()
