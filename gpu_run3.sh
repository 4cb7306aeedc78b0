#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt; date -u +%FT%TZ | tee -a $OUT/device.txt
timeout 280 python -m pytest -p no:cacheprovider -o addopts="" -m gpu -q -rs --timeout 250 tests/ops/test_pallas_mosaic_gpu.py tests/serving/test_cascade_engine.py > $OUT/gpu_tests.log 2>&1
echo "tests rc=$?"; tail -30 $OUT/gpu_tests.log
timeout 280 python benchmarks/prefix_cache.py --modes on on+cascade --profile-calls 2 --out $OUT/s1_profile.json > $OUT/s1_profile.log 2>&1
echo "s1 rc=$?"; grep -v wrote $OUT/s1_profile.log | tail -12
