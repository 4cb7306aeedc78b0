#!/usr/bin/env bash
# Nsight Compute profiles of issue 49's kernels on one Hopper GPU in one call, beside
# FlashAttention-3's: one launch each (the second call's: compiled and warm), `ncu --set full`
# with the clocks left alone (`--clock-control none`, the device tool's METHOD.md).
#
#   p1_mgpu      P1 on PALLAS_GPU: the Mosaic GPU prefill (ragged_paged_prefill_mgpu)
#   p1_fa3       P1 on FA3's dense flash_mha (the flash-attn3-jax wheel, as kernels_beside_fa3.sh)
#   p1_fp8       FP8 P1 through the Attention layer: the same kernel with q.k on FP8 wgmma
#   mla_d1       MLA-D1 on the Mosaic GPU MLA decode (mla_decode_mgpu)
#
# Each profile's details page (every section: throughput, pipes, warp states, registers) is
# $OUT/ncu_<name>_<device>_<date>.txt, or with SASS=1 its source page instead (every SASS
# instruction with its executions and warp-stall samples, CSV) as $OUT/ncu_<name>_sass_<device>_<date>.csv.gz;
# the metrics that compare them side by side are $OUT/ncu_summary_<device>_<date>.md
# (benchmarks/ncu_summary.py). With machine.txt and runs.txt that is seven files for the four
# profiles; NAMES picks some of them. The reports themselves stay under $WORK.
#
#     OUT=/tmp/out bash benchmarks/profile_kernels.sh      # from the repo root, on the GPU machine
#     OUT=/tmp/out NAMES=p1_mgpu,p1_fa3 SASS=1 bash benchmarks/profile_kernels.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/profile_kernels}
BUDGET=${BUDGET:-400}  # seconds for every run together
NAMES=${NAMES:-p1_mgpu,p1_fa3,p1_fp8,mla_d1}
SASS=${SASS:-0}
source benchmarks/gpu_runs.sh  # PY, WORK, STAMP, $OUT/machine.txt, run_cmd, install_fa3
LOG_DIR=$WORK/logs  # the runs' logs stay there (their tails print); $OUT holds the profiles
mkdir -p "$LOG_DIR"
# Kernel replay saves and restores what a kernel may touch: no 75 % pool taken up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
if [ -z "$NCU" ]; then echo "no ncu on this machine" | tee -a "$OUT/runs.txt"; exit 1; fi
"$NCU" --version | tail -n 1 | tee -a "$OUT/machine.txt"
install_fa3

profile() {  # name, kernel-name regex, ncu_one_call.py arguments...
  local name=$1 kernel=$2
  shift 2
  case ",$NAMES," in *",$name,"*) ;; *) return ;; esac
  rm -f "$WORK/ncu_$name.ncu-rep"  # an earlier run's report must not stand in for a failed one
  run_cmd "ncu_run_$name" 150 "$NCU" --set full --clock-control none \
    --kernel-name-base demangled --kernel-name "regex:$kernel" --launch-skip 1 --launch-count 1 \
    --force-overwrite --export "$WORK/ncu_$name" "$PY" benchmarks/ncu_one_call.py "$@"
  if [ -f "$WORK/ncu_$name.ncu-rep" ]; then
    if [ "$SASS" = 1 ]; then
      "$NCU" --import "$WORK/ncu_$name.ncu-rep" --page source --csv --print-source sass 2>&1 |
        gzip >"$OUT/ncu_${name}_sass_$STAMP.csv.gz"
    else
      "$NCU" --import "$WORK/ncu_$name.ncu-rep" --page details >"$OUT/ncu_${name}_$STAMP.txt" 2>&1
    fi
    "$NCU" --import "$WORK/ncu_$name.ncu-rep" --page raw --csv >"$WORK/ncu_${name}_raw.csv" 2>&1
  fi
}

rm -f "$WORK"/ncu_*_raw.csv
profile p1_mgpu ragged_paged_prefill_mgpu --impl pallas_gpu --workload P1
profile p1_fa3 flash --impl fa3_dense --workload P1
profile p1_fp8 ragged_paged_prefill_mgpu --impl fp8_layer
profile mla_d1 mla_decode_mgpu --impl mla_decode
"$PY" benchmarks/ncu_summary.py "$WORK"/ncu_*_raw.csv >"$OUT/ncu_summary_$STAMP.md" 2>&1
cat "$OUT/ncu_summary_$STAMP.md"
