"""Writes docs/performance.md: the latest committed figure of each workload, from
benchmarks/results/*.json, with its device, versions, date and source file.

    python scripts/performance_page.py            # writes docs/performance.md
    python scripts/performance_page.py --check    # exit 1 if docs/performance.md is stale
    python scripts/performance_page.py --stdout   # prints the page

The docs build runs it (docs/hooks.py, before every `mkdocs build`). Only what the result
files hold is shown: a workload missing from them is missing from the page. "Latest" is the
newest date recorded in a file (its own date field, else the date in its name); files whose
names mark a measurement that was not kept (a reverted change, a "before" or baseline run,
a sweep, a profile, a timed-out or no-warm-up run) are left out. Each table names the file
every row comes from, so a figure can be traced to its run and to BENCHMARKS.md's entry.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "performance.md"

# Name fragments of results that record an experiment, not the current code.
NOT_CURRENT = (
    "reverted",
    "before",
    "baseline",
    "first",
    "sort_always",
    "timed_out",
    "no_warmup",
    "_ab",
    "knockout",
    "sweep",
    "profile",
    "clamped",
    "_per_step",
    "traced",
    "compiled_in_traffic",  # a program compiled inside the measured phase: not the steady state
)


def _current(path: pathlib.Path) -> bool:
    return not any(m in path.stem for m in NOT_CURRENT)


def _load(pattern: str) -> list[tuple[str, pathlib.Path, dict]]:
    """(date, path, data) of every current result matching pattern, oldest first."""
    out = []
    for path in sorted(RESULTS.glob(pattern)):
        if not _current(path):
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            out.append((_date(path, data), path, data))
    out.sort(key=lambda t: (t[0], t[1].name))
    return out


def _date(path: pathlib.Path, data: dict) -> str:
    for holder in (data.get("meta"), data.get("machine"), data):
        if isinstance(holder, dict) and isinstance(holder.get("date"), str):
            return holder["date"]
    m = re.search(r"20\d\d-\d\d-\d\d", path.name)
    return m.group(0) if m else "0000-00-00"


def _day(date: str) -> str:
    return date[:10]


def _f(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def _src(path: pathlib.Path) -> str:
    return f"`{path.name}`"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    if not rows:
        return ["_No current result in `benchmarks/results/`._", ""]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines + [""]


def _device(data: dict) -> str:
    for holder in (data.get("meta"), data.get("machine"), data):
        if isinstance(holder, dict) and isinstance(holder.get("device"), str):
            return holder["device"].split(" (")[0]
    if isinstance(data.get("machine"), dict) and data["machine"].get("cpu"):
        m = data["machine"]
        return f"{m['cpu']} ({m.get('cores', '?')} cores)"
    return "?"


def _jax(data: dict) -> str:
    for holder in (data.get("meta"), data.get("machine"), data):
        if isinstance(holder, dict):
            if isinstance(holder.get("jax"), str):
                return holder["jax"]
            if isinstance(holder.get("versions"), dict) and "jax" in holder["versions"]:
                return holder["versions"]["jax"]
    return "?"


# --- attention kernels: D1 / D2 / M1 / P1 beside FlashAttention-3 -------------------------

_FA3_PAGED = re.compile(r"^fa3_paged_p\d+(_s\d+)?$")  # whole-workload calls, not the parts of M1


def attention_section() -> list[str]:
    latest: dict[str, tuple] = {}
    for date, path, data in _load("attention_*.json"):
        if "meta" not in data or "results" not in data:
            continue
        by_wl: dict[str, list[dict]] = {}
        for r in data["results"]:
            by_wl.setdefault(r.get("workload"), []).append(r)
        for wl, rows in by_wl.items():
            ours = [r for r in rows if r.get("impl") == "pallas_gpu_with_write" and r.get("device_ms")]
            peer = any(str(r.get("impl", "")).startswith("fa3") for r in rows)
            if wl and ours and peer:  # whole runs of benchmarks/attention.py, the peer beside
                latest[wl] = (date, path, data, ours[0], rows)
    rows_out = []
    for wl in sorted(latest, key=lambda w: (len(w.split("_")), w)):
        date, path, data, ours, rows = latest[wl]
        paged = [r for r in rows if _FA3_PAGED.match(r.get("impl", "")) and r.get("device_ms")]
        dense = [r for r in rows if r.get("impl") in ("fa3_dense", "fa3_varlen") and r.get("device_ms")]
        best_paged = min(paged, key=lambda r: r["device_ms"]) if paged else None
        rows_out.append(
            [
                f"**{wl}**",
                _f(ours["device_ms"]),
                _f(ours.get("device_pct_of_floor"), 1),
                _f(ours.get("device_tflop_per_s"), 1),
                _f(best_paged["device_ms"]) + f" ({best_paged['impl']})" if best_paged else "–",
                _f(dense[0]["device_ms"]) + f" ({dense[0]['impl']})" if dense else "–",
                _device(data),
                _jax(data),
                _day(date),
                _src(path),
            ]
        )
    return [
        "## Attention kernels",
        "",
        "PALLAS_GPU with its k/v write, CUPTI device time per step (median), bf16; the peer is",
        "FlashAttention-3 in the same run (the fastest paged call of its sweep, and dense / varlen",
        "k/v). Workloads: ARCHITECTURE.md's D1 / D2 / M1 / P1 (`_p128`: P1 with pages of 128);",
        "% of floor: the byte floor for decode, the FLOP floor for prefill, both measured",
        "on the machine. Script: `benchmarks/attention.py`.",
        "",
        *_table(
            [
                "workload",
                "attn-stack ms",
                "% of floor",
                "TFLOP/s",
                "FA3 paged ms",
                "FA3 dense ms",
                "device",
                "jax",
                "date",
                "source",
            ],
            rows_out,
        ),
    ]


def fp8_section() -> list[str]:
    runs = [t for t in _load("attention_fp8_*.json") if "results" in t[2]]
    if not runs:
        return []
    # the latest day; on a day of several runs, the one that measured the most layers
    date, path, data = max(runs, key=lambda t: (_day(t[0]), len(t[2]["results"]), -len(t[1].name)))
    rows = []
    for r in data["results"]:
        rows.append(
            [
                r.get("layer", "?"),
                r.get("kv_cache_dtype", "?"),
                _f(r.get("ms_per_step_incl_write")),
                _f(r.get("tflop_per_s_incl_write"), 1),
                _f(r.get("tflop_per_s_attention_kernels"), 1),
                _f(r.get("rel_l2_vs_quantized_oracle"), 4),
                _f(r.get("rel_l2_vs_unquantized_oracle"), 4),
            ]
        )
    return [
        "## FP8 attention (P1 through the layer)",
        "",
        f"{_device(data)}, jax {_jax(data)}, {_day(date)}, {_src(path)}; `benchmarks/attention_fp8.py`.",
        "",
        *_table(
            [
                "layer",
                "kv cache",
                "ms / step (with write)",
                "TFLOP/s (with write)",
                "TFLOP/s (attention kernels)",
                "rel. L2 vs quantised oracle",
                "rel. L2 vs unquantised",
            ],
            rows,
        ),
    ]


# --- the serving engine ------------------------------------------------------------------


def engine_section() -> list[str]:
    latest: dict[tuple, tuple] = {}
    peers: dict[tuple, tuple] = {}
    for date, path, data in _load("generate_gpu*.json"):
        if "models" not in data or not isinstance(data.get("workload"), dict):
            continue
        w = data["workload"]
        dev = _device(data)
        for m in data["models"]:
            for r in m.get("runs", []):
                key = (
                    dev,
                    m["model"],
                    w.get("dtype"),
                    w.get("prompt_len"),
                    w.get("new_tokens"),
                    r.get("batch"),
                    r.get("num_scheduler_steps") or 1,
                )
                latest[key] = (date, path, data, r)
            for p in m.get("peers", []):
                peers[(dev, m["model"], p.get("batch"), p.get("peer"))] = (date, path, p)
    rows = []
    for key in sorted(latest, key=lambda k: tuple(str(x) for x in k[:5]) + (k[5] or 0, k[6])):
        dev, model, dtype, plen, ntok, batch, steps = key
        date, path, data, r = latest[key]
        ps = [v for (d, mo, b, _), v in peers.items() if (d, mo, b) == (dev, model, batch)]
        best = max(ps, key=lambda v: v[2].get("tokens_per_s", 0)) if ps else None
        peer = f"{_f(best[2]['tokens_per_s'], 0)} ({best[2]['peer']}, {_day(best[0])})" if best else "–"
        rows.append(
            [
                model,
                str(batch),
                str(steps),
                _f(r.get("tokens_per_s"), 0),
                _f(r.get("decode_step_ms_median")),
                peer,
                f"{dtype}, {plen} + {ntok}",
                dev,
                _jax(data),
                _day(date),
                _src(path),
            ]
        )
    return [
        "## Serving engine (offline)",
        "",
        "`Engine` on random weights, greedy, prompt + new tokens as given, tokens/s over the run;",
        "steps: decode steps per device call (`num_scheduler_steps`). The peer is the fastest",
        "transformers configuration measured at that batch on that device (its own date).",
        "Script: `benchmarks/generate_gpu.py`.",
        "",
        *_table(
            [
                "model",
                "batch",
                "steps",
                "tokens/s",
                "decode step ms",
                "transformers tokens/s",
                "workload",
                "device",
                "jax",
                "date",
                "source",
            ],
            rows,
        ),
    ]


def prefix_cache_section() -> list[str]:
    latest: dict[tuple, tuple] = {}
    for date, path, data in _load("prefix_cache_s1_*.json"):
        if not isinstance(data.get("results"), dict):
            continue
        for mode, r in data["results"].items():
            latest[(_device(data), mode)] = (date, path, data, r)
    rows = [
        [
            mode,
            _f(r.get("decode_step_ms_median")),
            _f(r.get("tokens_per_s"), 0),
            _f(r.get("ttft_p50_ms"), 1),
            _f(r.get("prompt_tokens_computed")),
            dev,
            _jax(data),
            _day(date),
            _src(path),
        ]
        for (dev, mode), (date, path, data, r) in sorted(latest.items())
    ]
    return [
        "## Prefix caching and cascade attention (S1)",
        "",
        "S1: 64 requests sharing a 2048-token prefix (SmolLM2-135M shape, random weights, bf16).",
        "Modes: caching off, on, on + cascade attention. Script: `benchmarks/prefix_cache.py`.",
        "",
        *_table(
            [
                "mode",
                "decode step ms",
                "tokens/s",
                "TTFT p50 ms",
                "prompt tokens computed",
                "device",
                "jax",
                "date",
                "source",
            ],
            rows,
        ),
    ]


def server_section() -> list[str]:
    latest: dict[tuple, tuple] = {}
    for date, path, data in _load("serve_load_*.json"):
        w, cl = data.get("workload"), data.get("closed_loop")
        if not isinstance(w, dict) or not isinstance(cl, dict) or data.get("error"):
            continue
        if w.get("logprobs") or w.get("json_schema_fraction"):  # the clients' fields' runs: BENCHMARKS.md
            continue
        steps = w.get("num_scheduler_steps") or 1
        temperature = w.get("temperature") or 0.0  # files before stop 70 ran greedy
        key = (
            _device(data), w.get("model"), w.get("concurrency"), w.get("prompt_len"), w.get("max_tokens"), steps,
            temperature,
        )  # fmt: skip
        latest[key] = (date, path, data)
    rows = []
    for key in sorted(latest, key=lambda k: tuple(str(x) for x in k)):
        dev, model, conc, plen, ntok, steps, temperature = key
        date, path, data = latest[key]
        cl, off = data["closed_loop"], data.get("offline") or {}
        pois = data.get("poisson") or {}
        ratio = (cl.get("output_tokens_per_s") / off["tokens_per_s"]) if off.get("tokens_per_s") else None
        rows.append(
            [
                model,
                str(conc),
                f"{plen} + {ntok}"
                + (f", {steps} steps/call" if steps > 1 else "")
                + (f", temperature {temperature:g}" if temperature else ""),
                _f(cl.get("output_tokens_per_s"), 0),
                _f(off.get("tokens_per_s"), 0),
                _f(ratio, 2),
                _f((cl.get("ttft_ms") or {}).get("p50"), 1),
                _f((pois.get("ttft_ms") or {}).get("p50"), 1)
                + (f" at {data['workload'].get('rate')}/s" if pois else ""),
                dev,
                _jax(data),
                _day(date),
                _src(path),
            ]
        )
    return [
        "## The server (`attn-stack serve`)",
        "",
        "The OpenAI-compatible server under a closed loop of `concurrency` streaming clients",
        "(output tokens/s) beside the offline engine at the same batch on the same device, and",
        "Poisson arrivals (TTFT p50); greedy unless a temperature is given. Script:",
        "`benchmarks/serve_load.py`.",
        "",
        *_table(
            [
                "model",
                "concurrency",
                "prompt + tokens",
                "server tokens/s",
                "offline tokens/s",
                "ratio",
                "TTFT p50 ms",
                "Poisson TTFT p50 ms",
                "device",
                "jax",
                "date",
                "source",
            ],
            rows,
        ),
    ]


def cpu_section() -> list[str]:
    lines = ["## On the CPU", ""]
    gen = [t for t in _load("generate_cpu*.json") if "engine" in t[2]]
    if gen:
        date, path, d = gen[-1]
        m = d.get("machine", {})
        lines += [
            "SmolLM2-135M-Instruct, float32, greedy (`benchmarks/generate_cpu.py`), "
            f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, jax {m.get('jax', '?')}, "
            f"transformers {m.get('transformers', '?')}, {_day(date)}, {_src(path)}:",
            "",
            *_table(
                [
                    "workload",
                    "engine tokens/s",
                    "transformers `generate`",
                    "transformers `generate_batch`",
                    "same tokens as `generate`",
                ],
                [
                    [
                        f"{d['workload'].get('prompts')} prompts × {d['workload'].get('new_tokens')} tokens",
                        _f(d["engine"].get("tokens_per_s"), 1),
                        _f(d["hf_generate"].get("tokens_per_s"), 1),
                        _f(d["hf_generate_batch"].get("tokens_per_s"), 1),
                        str(d.get("sequences_identical_to_hf_generate", "?")),
                    ]
                ],
            ),
        ]
    md = [t for t in _load("metadata_build*.json") if "us_per_build_numpy" in t[2]]
    if md:
        date, path, d = md[-1]
        w = d["workload"]
        lines += [
            f"Host time to build bucketed metadata (`benchmarks/metadata_build.py`), jax {d.get('jax', '?')}, "
            f"{d.get('machine', {}).get('nproc', '?')} cores, {_day(date)}, {_src(path)}:",
            "",
            *_table(
                ["workload", "µs per build (NumPy fields)", "µs with device_put"],
                [
                    [
                        f"{w['num_reqs']} requests, {w['num_prefills']} prefills, {w['num_actual_tokens']} tokens",
                        _f(d["us_per_build_numpy"], 1),
                        _f(d.get("us_per_build_with_device_put"), 1),
                    ]
                ],
            ),
        ]
    return lines if len(lines) > 2 else []


def render() -> str:
    lines = [
        "# Performance",
        "",
        "<!-- Generated by scripts/performance_page.py from benchmarks/results/*.json: do not edit. -->",
        "",
        "The latest committed figure of each workload, generated from `benchmarks/results/` when the",
        "docs are built. The dated log of how each figure came about, with the runs that were not",
        "kept, is `BENCHMARKS.md` at the top of the repository; the workloads are defined in",
        "[Kernels](kernels.md#benchmark-workloads).",
        "A figure moves by a few per cent from run to run and machine to machine, and rows of one",
        "table may come from different runs: compare rows of the same source file.",
        "",
    ]
    for section in (attention_section, fp8_section, engine_section, prefix_cache_section, server_section, cpu_section):
        lines += section()
    return "\n".join(lines).rstrip() + "\n"


def write(path: pathlib.Path = PAGE) -> bool:
    """Writes the page if it changed; True if it did."""
    text = render()
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return True


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", action="store_true", help="exit 1 if docs/performance.md is not current")
    group.add_argument("--stdout", action="store_true", help="print the page instead of writing it")
    args = parser.parse_args()
    if args.stdout:
        sys.stdout.write(render())
    elif args.check:
        current = PAGE.exists() and PAGE.read_text() == render()
        print("docs/performance.md is current" if current else "docs/performance.md is stale: run this script")
        sys.exit(0 if current else 1)
    else:
        print(f"{'wrote' if write() else 'unchanged:'} {PAGE.relative_to(ROOT)}")
