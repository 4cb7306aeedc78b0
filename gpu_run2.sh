#!/bin/bash
# S1 with the host fixes; the batch-1 step with graph flags, alternated
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt; date -u +%FT%TZ | tee -a $OUT/device.txt
G="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
for flags in "$G" "" "$G" ""; do
  echo "== XLA_FLAGS='$flags'" >> $OUT/gen_flags.log
  XLA_FLAGS="$flags" timeout 60 python benchmarks/generate_gpu.py --batch 1 --num-scheduler-steps 1 --new-tokens 256 >> $OUT/gen_flags.log 2>&1
done
grep -E "==|tokens/s" $OUT/gen_flags.log
timeout 330 python benchmarks/prefix_cache.py --repeats 2 --out $OUT/s1.json > $OUT/s1.log 2>&1; echo "s1 rc=$?"; cat $OUT/s1.log | grep -v wrote
