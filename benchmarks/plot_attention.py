"""Roofline plot and markdown table of a ``benchmarks/attention.py`` results file (runs on the CPU).

    python benchmarks/plot_attention.py benchmarks/results/attention_nvidia_h100_80gb_hbm3.json --write

Prints the table BENCHMARKS.md holds; ``--write`` draws the roofline to ``<results>.png``
beside the JSON (the committed plot), ``--out PATH`` to PATH.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def load(path: pathlib.Path) -> dict:
    return json.loads(path.read_text())


def workload_intensity(results: list[dict]) -> dict[str, tuple[float, float]]:
    """workload -> (bytes, flops), recovered from any timed row (gb_per_s * s, tflop_per_s * s)."""
    out = {}
    for r in results:
        if "ms" in r and r["workload"] not in out:
            s = r["ms"] / 1e3
            out[r["workload"]] = (r["gb_per_s"] * 1e9 * s, r["tflop_per_s"] * 1e12 * s)
    return out


def table(data: dict) -> str:
    rows = ["| workload | implementation | time (ms) | GB/s | TFLOP/s | % of floor | rel. L2 vs f32 |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in data["results"]:
        if "error" in r:
            rows.append(f"| {r['workload']} | {r['impl']} | failed: {r['error'][:60]} | | | | |")
            continue
        if "ms" not in r:  # the k/v write overhead rows
            continue
        err = "—" if r["rel_l2_vs_f32"] != r["rel_l2_vs_f32"] else f"{r['rel_l2_vs_f32']:.1e}"
        rows.append(f"| {r['workload']} | {r['impl']} | {r['ms']:.3f} | {r['gb_per_s']:.0f} | "
                    f"{r['tflop_per_s']:.1f} | {r['pct_of_floor']:.1f} | {err} |")  # fmt: skip
    return "\n".join(rows)


def roofline(data: dict, out: pathlib.Path) -> None:
    meta, results = data["meta"], data["results"]
    bw, peak = meta["copy_bytes_per_s"], meta["matmul_flops_per_s"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = np.logspace(-1, 4, 200)
    ax.loglog(x, np.minimum(peak, x * bw) / 1e12, "k-", lw=1, label="measured roof (copy BW, bf16 matmul)")
    markers = {"pallas_gpu": "o", "pallas_gpu_tuned": "*", "pallas_gpu_with_write": "D",
               "pallas_gpu_triton_only": "P", "pallas_gpu_mgpu_split": "X", "xla": "x",
               "jax_pallas_paged_attention": "s", "cudnn_dense": "^", "torch_sdpa_dense": "v"}  # fmt: skip
    intensity = workload_intensity(results)
    colors = dict(zip(intensity, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for r in results:
        if "ms" not in r or r["impl"].startswith("part_"):  # one launch of a split batch: not the workload
            continue
        nbytes, flops = intensity[r["workload"]]
        ax.scatter(flops / nbytes, r["tflop_per_s"], marker=markers.get(r["impl"], "."), color=colors[r["workload"]],
                   s=60 if r["impl"].startswith("pallas") else 30)  # fmt: skip
    for w, c in colors.items():
        ax.scatter([], [], color=c, label=w)
    for impl, m in markers.items():
        ax.scatter([], [], marker=m, color="gray", label=impl)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"Ragged paged attention, {meta['device']} (jax {meta['jax']}, {meta['date']})", fontsize=9)
    ax.legend(fontsize=7, loc="lower right", ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=pathlib.Path, help="a benchmarks/attention.py results JSON file")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--write", action="store_true", help="draw the roofline to <results>.png (the committed plot)")
    where.add_argument("--out", type=pathlib.Path, default=None, metavar="PATH", help="draw the roofline to PATH")
    args = parser.parse_args(argv)
    data = load(args.results)
    print(table(data))
    png = args.out if args.out is not None else args.results.with_suffix(".png") if args.write else None
    if png is not None:
        roofline(data, png)
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
