#!/usr/bin/env bash
# One GPU call: install, the CUDA kernel tests, kernel timings, the training step against PyTorch.
# Logs under $1 (default gpu-logs/).
set -uo pipefail
log_dir=${1:-gpu-logs}
mkdir -p "$log_dir"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$log_dir/gpu.txt"
timeout 300 python3 -m pytest -q -x -m gpu tests/test_tensor_cores.py tests/test_cuda.py -p no:cacheprovider \
    -W ignore::numba.core.errors.NumbaPerformanceWarning 2>&1 | tail -n 15 | tee "$log_dir/tests.log"
timeout 200 python3 bench/bench_kernels_cuda.py --precision bf16 2>&1 | grep -v Warn | tee "$log_dir/kernels_bf16.log"
timeout 300 python3 -m nanoeuler_core.cli bench --preset gpu --backend cuda --batch-size 32 --precision bf16 \
    --steps 10 --warmup 3 --profile 2>&1 | tee "$log_dir/bench_bf16.log"
