"""Nsight Compute pages side by side.

- Raw pages (``ncu --import REPORT --page raw --csv``, one file a kernel, named
  ``ncu_<name>_raw.csv``; ``benchmarks/profile_kernels.sh`` writes them): one markdown table of
  the metrics that compare attention kernels (time, SM and tensor-pipe use, issue slots,
  registers, occupancy, shared-memory bank conflicts, local-memory spills, DRAM), then each
  kernel's warp-stall samples by reason. Each file holds a header row of metric names, a row of
  units and a row per profiled launch (the first is used).
- Source pages (``--page source --csv --print-source sass``, ``ncu_<name>_sass*.csv[.gz]``;
  ``profile_kernels.sh`` with ``SASS=1``): each kernel's executed warp instructions and stall
  samples by SASS opcode, the opcodes that differ most between the kernels first.

    python benchmarks/ncu_summary.py /tmp/work/ncu_*_raw.csv > summary.md
    python benchmarks/ncu_summary.py results/ncu/ncu_p1_*_sass_*.csv.gz
"""

from __future__ import annotations

import argparse
import csv
import gzip
import pathlib
import re
import sys

METRICS = (
    ("gpu__time_duration.sum", "duration"),
    ("sm__cycles_elapsed.avg.per_second", "SM clock"),
    ("launch__grid_size", "grid"),
    ("launch__block_size", "threads a CTA"),
    ("launch__registers_per_thread", "registers a thread (launch)"),
    ("launch__shared_mem_per_block_dynamic", "dynamic shared memory a CTA"),
    ("sm__throughput.avg.pct_of_peak_sustained_elapsed", "SM throughput, % of peak"),
    ("sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active", "tensor pipe (wgmma) active, %"),
    ("sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active", "wgmma instructions, % of peak"),
    ("smsp__issue_active.avg.pct_of_peak_sustained_active", "issue slots busy, %"),
    ("smsp__inst_executed.sum", "instructions executed"),
    ("sm__warps_active.avg.pct_of_peak_sustained_active", "achieved occupancy, %"),
    ("dram__throughput.avg.pct_of_peak_sustained_elapsed", "DRAM throughput, % of peak"),
    ("lts__t_sector_hit_rate.pct", "L2 hit rate, %"),
    ("l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum", "shared-memory bank conflicts"),
    ("l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum", "local-memory load sectors (spills)"),
    ("l1tex__t_sectors_pipe_lsu_mem_local_op_st.sum", "local-memory store sectors (spills)"),
)
STALL = re.compile(r"^smsp__pcsamp_warps_issue_stalled_(\w+)$")
STALLS_SHOWN = 10


def read_raw(path: pathlib.Path) -> tuple[dict[str, str], dict[str, str]]:
    """(metric -> value, metric -> unit) of the first launch in one raw CSV page; {} if none."""
    rows = list(csv.reader(line for line in path.read_text().splitlines() if line.startswith('"')))
    if len(rows) < 3:
        return {}, {}
    names, units, values = rows[0], rows[1], rows[2]
    return dict(zip(names, values, strict=False)), dict(zip(names, units, strict=False))


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def stall_shares(values: dict[str, str]) -> dict[str, float]:
    """Warp-stall reason -> share of all stall samples (%)."""
    counts = {m.group(1): number(v) or 0.0 for k, v in values.items() if (m := STALL.match(k))}
    total = sum(counts.values())
    return {r: 100 * c / total for r, c in counts.items()} if total else {}


SASS_ROWS_SHOWN = 24


def read_sass(path: pathlib.Path) -> dict[str, tuple[float, float]]:
    """SASS opcode (its mnemonic without modifiers) -> (warp instructions executed, warp-stall
    samples) summed over one source page's instructions."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if "Source" in r and "Instructions Executed" in r)
    cols = rows[head]
    src, execd = cols.index("Source"), cols.index("Instructions Executed")
    samples = next((i for i, c in enumerate(cols) if c.startswith("Warp Stall Sampling (All")), None)
    out: dict[str, tuple[float, float]] = {}
    for r in rows[head + 1 :]:
        if len(r) <= execd or not r[src].strip():
            continue
        words = [w for w in r[src].split() if not w.startswith("@")]  # drop a predicate
        op = words[0].split(".")[0] if words else "?"
        e, sm = number(r[execd]) or 0.0, (number(r[samples]) or 0.0) if samples is not None else 0.0
        a, b = out.get(op, (0.0, 0.0))
        out[op] = (a + e, b + sm)
    return out


def sass_main(paths: list[pathlib.Path]) -> int:
    kernels = {p.name.removeprefix("ncu_").split("_sass")[0]: read_sass(p) for p in paths}
    names = list(kernels)
    ops = {op for k in kernels.values() for op in k}
    spread = {op: max(k.get(op, (0, 0))[0] for k in kernels.values()) - min(k.get(op, (0, 0))[0]
              for k in kernels.values()) for op in ops}  # fmt: skip
    order = sorted(ops, key=lambda op: -(spread[op] if len(names) > 1 else kernels[names[0]][op][0]))
    print("| SASS opcode | " + " | ".join(f"{n}: M warp instr. | {n}: stall % " for n in names) + " |")
    print("| --- |" + " ---: | ---: |" * len(names))
    totals = {n: (sum(e for e, _ in k.values()), sum(s for _, s in k.values()) or 1.0) for n, k in kernels.items()}
    for op in [*order[:SASS_ROWS_SHOWN]]:
        cells = []
        for n in names:
            e, s = kernels[n].get(op, (0.0, 0.0))
            cells.append(f"{e / 1e6:.1f} | {100 * s / totals[n][1]:.1f}")
        print(f"| {op} | " + " | ".join(cells) + " |")
    print("| all | " + " | ".join(f"{totals[n][0] / 1e6:.1f} | 100" for n in names) + " |")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pages", nargs="+", help="ncu_<name>_raw.csv files, or ncu_<name>_sass*.csv[.gz] files")
    paths = p.parse_args(argv).pages
    sass = [pathlib.Path(p) for p in paths if "_sass" in pathlib.Path(p).name]
    if sass:
        return sass_main(sass)
    kernels = {}
    for p in map(pathlib.Path, paths):
        name = p.name.removeprefix("ncu_").removesuffix("_raw.csv")
        values, units = read_raw(p)
        if not values:
            print(f"- {name}: no profiled launch in {p.name} ({p.read_text()[:200]!r})")
            continue
        kernels[name] = (values, units)
    if not kernels:
        print("no profiles")
        return 1
    names = list(kernels)
    print("| metric | " + " | ".join(names) + " |")
    print("| --- |" + " ---: |" * len(names))
    for key, label in METRICS:
        cells = []
        for n in names:
            values, units = kernels[n]
            v = values.get(key)
            cells.append("-" if v is None else f"{v} {units.get(key, '')}".strip())
        print(f"| {label} (`{key}`) | " + " | ".join(cells) + " |")
    for n in names:
        shares = sorted(stall_shares(kernels[n][0]).items(), key=lambda kv: -kv[1])[:STALLS_SHOWN]
        text = ", ".join(f"{r} {s:.1f} %" for r, s in shares) or "no samples"
        print(f"\n- **{n}**, warp-stall samples by reason: {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
