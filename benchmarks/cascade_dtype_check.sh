#!/usr/bin/env bash
# Issue 49 ("cascade never slower than the plain path") on one GPU in one call, under 4 minutes:
#
#  1. benchmarks/prefix_cache.py on S1 scaled to 16 x (1024 shared + 32 own) prompt tokens, 128
#     new, SmolLM2-135M shapes, in float32 and then bfloat16, modes
#       off                prefix caching off (the reference tokens),
#       on                 caching on, cascade off (the plain path),
#       on+cascade         caching on, cascade as the builder chooses it (float32: its dot-work model),
#       on+cascade-forced  caching on, cascade wherever the thresholds allow (the model left out),
#     with the decode step's time (cascade and plain calls apart) and a CUPTI profile of 2
#     decode calls per mode (attention kernel time per step);
#  2. benchmarks/cascade_blocks.py --grid rows at that decode step (16 x (1024 + 96) tokens),
#     one layer per call: the prefix part's q-block rows (16, 32, 64) in float32, then bfloat16.
#
# Each run has its own time limit (and the whole a budget), writes its JSON and log under $OUT
# (default /tmp/cascade_dtype_check) and $OUT/summary.json gathers the numbers. Needs only
# jax with CUDA and numpy (no install: attn_jax is imported from this tree).
#
#     OUT=/tmp/out bash benchmarks/cascade_dtype_check.sh      # from the repo root, on the GPU machine
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cascade_dtype_check}
source benchmarks/gpu_runs.sh  # PY, $OUT/machine.txt, run; BUDGET defaults to 230 s

S1_SCALED=(--requests 16 --prefix-len 1024 --unique-len 32 --new-tokens 128 --profile-calls 2
           --modes off on on+cascade on+cascade-forced)
run prefix_cache_float32 95 benchmarks/prefix_cache.py --dtype float32 "${S1_SCALED[@]}" \
  --out "$OUT/prefix_cache_float32.json"
run prefix_cache_bfloat16 85 benchmarks/prefix_cache.py --dtype bfloat16 "${S1_SCALED[@]}" \
  --out "$OUT/prefix_cache_bfloat16.json"
ROWS=(--grid rows --requests 16 --prefix-len 1024 --suffix-len 96 --calls 20)
run cascade_rows_float32 30 benchmarks/cascade_blocks.py --dtype float32 "${ROWS[@]}" \
  --out "$OUT/cascade_rows_float32.json"
run cascade_rows_bfloat16 25 benchmarks/cascade_blocks.py --dtype bfloat16 "${ROWS[@]}" \
  --out "$OUT/cascade_rows_bfloat16.json"

"$PY" - "$OUT" <<'EOF'
import json, pathlib, sys

out = pathlib.Path(sys.argv[1])
summary = {}
for dtype in ("float32", "bfloat16"):
    path = out / f"prefix_cache_{dtype}.json"
    if not path.exists():
        continue
    results = json.loads(path.read_text()).get("results", {})
    rows = {}
    for mode, r in results.items():
        if "error" in r:
            rows[mode] = {"error": r["error"][:300]}
            continue
        keys = ("decode_step_ms_median", "decode_step_ms_median_cascade", "decode_step_ms_median_plain",
                "cascade_decode_calls", "decode_calls", "tokens_per_s", "greedy_token_agreement_with_off")
        rows[mode] = {k: r.get(k) for k in keys}
        rows[mode]["attention_us_per_step"] = r.get("decode_profile", {}).get("per_step_us", {}).get("attention")
    on = rows.get("on", {}).get("decode_step_ms_median")
    for mode in ("on+cascade", "on+cascade-forced"):
        step = rows.get(mode, {}).get("decode_step_ms_median")
        if on and step:
            rows[mode]["step_over_on"] = step / on
    summary[f"prefix_cache_{dtype}"] = rows
for dtype in ("float32", "bfloat16"):
    path = out / f"cascade_rows_{dtype}.json"
    if path.exists():
        data = json.loads(path.read_text())
        summary[f"cascade_rows_{dtype}"] = {
            name: {"kernel_sum_us": r["median_kernel_sum_us"], "attention_kernels_us": r["median_attention_kernel_us"]}
            for name, r in data["results"].items()
        }
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
EOF
