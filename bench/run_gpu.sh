#!/usr/bin/env bash
# GPU validation and benchmarks in one go (what bench/RESULTS.md's GPU figures come from):
# the GPU tests (kernels and whole model, selftest included), the training benchmark against
# PyTorch, and a short `gpu`-preset pretraining run. Logs go to LOG_DIR (default: gpu-logs/).
#   bash bench/run_gpu.sh [LOG_DIR]
set -uo pipefail
log_dir=${1:-gpu-logs}
mkdir -p "$log_dir"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$log_dir/gpu.txt"
python3 -m pytest -q -m gpu tests/test_cuda.py tests/test_cuda_model.py -p no:cacheprovider 2>&1 | tee "$log_dir/gpu_tests.log"
python3 -m nanoeuler_core.cli bench --preset gpu --backend cuda --batch-size 32 --steps 10 --warmup 3 --profile \
    2>&1 | tee "$log_dir/bench_gpu.log"
python3 -m nanoeuler_core.cli pretrain --preset gpu --backend cuda --steps 60 --batch-size 32 --eval-every 30 \
    --ckpt-every 60 --out /tmp/nanoeuler-run-gpu 2>&1 | tail -n 8 | tee "$log_dir/pretrain_gpu.log"
