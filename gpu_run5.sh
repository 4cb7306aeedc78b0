#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt; date -u +%FT%TZ | tee -a $OUT/device.txt
timeout 200 python -m pytest -p no:cacheprovider -o addopts="" -m gpu -q -rs --timeout 180 tests/ops/test_pallas_mosaic_gpu.py tests/serving/test_cascade_engine.py > $OUT/gpu_tests.log 2>&1
echo "tests rc=$?"; tail -4 $OUT/gpu_tests.log
timeout 330 python benchmarks/prefix_cache.py --repeats 2 --profile-calls 2 --out $OUT/s1.json > $OUT/s1.log 2>&1
echo "s1 rc=$?"; grep -v wrote $OUT/s1.log | tail -16
timeout 150 python -m pytest -p no:cacheprovider -o addopts="" -m gpu -q --timeout 140 tests/ops/test_pallas_triton.py tests/ops/test_cascade.py > $OUT/gpu_tests_triton.log 2>&1
echo "triton tests rc=$?"; tail -3 $OUT/gpu_tests_triton.log
