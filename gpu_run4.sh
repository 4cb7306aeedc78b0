#!/bin/bash
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 ATTN_STACK_CACHE_DIR=/tmp/attn-cache
pip install -q --no-index --no-deps --target /tmp/site .whl/serve/*.whl > $OUT/pip.log 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt; date -u +%FT%TZ | tee -a $OUT/device.txt
COMMON="--model smollm2-135m --dtype bfloat16 --concurrency 64 --requests-per-client 16 --warmup-requests-per-client 2 --prompt-len 128 --max-tokens 128 --rate 8 --poisson-requests 64 --poisson-warmup-requests 16 --num-scheduler-steps 8 --warmup-rounds 1 --client-procs 4 --tokenizer-dir .whl/smollm2-tokenizer"
timeout 380 python benchmarks/serve_load.py $COMMON --gil-switch-interval-ms 0.5 --time-budget-s 360 --out $OUT/serve_load_switch05.json > $OUT/serve_load_switch05.log 2>&1
echo "A rc=$?"; grep -E "warm-up|clients|Poisson|server /|closed_loop:" $OUT/serve_load_switch05.log
timeout 190 python benchmarks/serve_load.py $COMMON --time-budget-s 180 --out $OUT/serve_load_switch5_cached.json > $OUT/serve_load_switch5_cached.log 2>&1
echo "B rc=$?"; grep -E "warm-up|clients|Poisson|server /|closed_loop:" $OUT/serve_load_switch5_cached.log
