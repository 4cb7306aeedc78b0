#!/usr/bin/env bash
# Issue 49's kernel table on one Hopper GPU in one call, beside FlashAttention-3, in about 5 minutes:
#
#  1. benchmarks/attention.py: D1, D2, M1, M2, P1 on PALLAS_GPU (alone and with its k/v write,
#     CUPTI device time) and FA3 (paged at page 128 with 1, 4 and 8 splits, dense, varlen);
#  2. benchmarks/mla_attention.py: MLA-D1 and MLA-P1 on the Mosaic GPU MLA kernels;
#  3. benchmarks/attention_fp8.py: FP8 P1 against bf16 P1 through the public layer.
#
# FA3 is the `flash-attn3-jax` 0.2.3 cp312 wheel, never a dependency: when it does not import,
# the first `flash_attn3_jax-*.whl` under .whl/ (or .whl/fa3/) is installed with
# `pip install --no-deps --target` into $WORK/site, which joins PYTHONPATH. Each run has its own
# time limit (and the whole a budget) and writes its JSON and log under $OUT (default
# /tmp/kernels_beside_fa3), named for the device and the date: eight files with machine.txt and
# runs.txt. JAX's compilation cache and the wheel go under $WORK (gpu_runs.sh), so a second run on
# one machine compiles nothing; attn_jax is imported from this tree.
#
#     OUT=/tmp/out bash benchmarks/kernels_beside_fa3.sh      # from the repo root, on the GPU machine
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kernels_beside_fa3}
BUDGET=${BUDGET:-420}  # seconds for every run together
source benchmarks/gpu_runs.sh  # PY, WORK, STAMP, $OUT/machine.txt, run, install_fa3
install_fa3

run "attention_fa3_d1_d2_m1_m2_p1_$STAMP" 220 benchmarks/attention.py --workloads D1,D2,M1,M2,P1 \
  --impls pallas_gpu,fa3 --fa3-pages 128 --fa3-splits 1,4,8 --skip-split-rows \
  --out "$OUT/attention_fa3_d1_d2_m1_m2_p1_$STAMP.json"
run "mla_attention_mla_d1_p1_$STAMP" 110 benchmarks/mla_attention.py --workloads MLA-D1,MLA-P1 \
  --impls pallas_mla_mgpu --out "$OUT/mla_attention_mla_d1_p1_$STAMP.json"
run "attention_fp8_$STAMP" 90 benchmarks/attention_fp8.py --layers bf16,fp8_attention --rows 32 \
  --out "$OUT/attention_fp8_$STAMP.json"
