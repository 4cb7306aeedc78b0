#!/bin/bash
# one device call: serve load (full warm-up), then the batch-1 step with XLA command-buffer variants
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
pip install -q --no-index --no-deps --target /tmp/site .whl/serve/*.whl > $OUT/pip.log 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
date -u +%FT%TZ | tee -a $OUT/device.txt
timeout 400 python benchmarks/serve_load.py --model smollm2-135m --dtype bfloat16 --concurrency 64 \
  --requests-per-client 16 --warmup-requests-per-client 2 --prompt-len 128 --max-tokens 128 --rate 8 \
  --poisson-requests 64 --poisson-warmup-requests 16 --num-scheduler-steps 8 --warmup-rounds 1 \
  --client-procs 4 --tokenizer-dir .whl/smollm2-tokenizer --time-budget-s 380 --out $OUT/serve_load.json > $OUT/serve_load.log 2>&1
echo "serve_load rc=$?"; tail -25 $OUT/serve_load.log
i=0
for flags in "" "--xla_gpu_enable_command_buffer=" "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"; do
  echo "== XLA_FLAGS='$flags'" | tee -a $OUT/gen_flags.log
  XLA_FLAGS="$flags" timeout 60 python benchmarks/generate_gpu.py --batch 1 --num-scheduler-steps 1 --new-tokens 256 >> $OUT/gen_flags.log 2>&1
  echo "rc=$?" >> $OUT/gen_flags.log
done
grep -E "==|tokens/s|rc=|Error" $OUT/gen_flags.log
