#!/usr/bin/env bash
# The remaining GPU figures in one call, most important first (see bench/run_gpu.sh for the stages).
set -uo pipefail
log_dir=$1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
NE="python3 -m nanoeuler_core.cli"
quiet() { grep -v -E "NumbaPerformanceWarning|warn\(errors"; }
timeout 150 $NE bench --preset gpu --backend cuda --batch-size 32 --precision bf16 --steps 20 --warmup 3 --profile \
    2>&1 | quiet | tee "$log_dir/bench_bf16.log"
run_dir=/tmp/nanoeuler-gen/run
timeout 90 $NE pretrain --preset gpu --backend cuda --steps 300 --batch-size 16 --eval-every 100 --ckpt-every 300 \
    --sample-prompt "ROMEO:" --out "$run_dir" 2>&1 | tail -n 6 | tee "$log_dir/pretrain_gpu.log"
timeout 150 python3 bench/bench_generate.py --preset gpu --backend cuda --run "$run_dir" --batch-size 1 --prompt 16 \
    --tokens 256 2>&1 | quiet | tee "$log_dir/generate_b1.log"
timeout 60 mpiexec -n 1 python3 bench/nccl_selfcheck.py 2>&1 | quiet | tail -n 12 | tee "$log_dir/nccl_selfcheck.log"
for variant in plain allreduce zero; do
    timeout 60 mpiexec -n 1 python3 bench/bench_dist.py --variant "$variant" --batch-size 32 --steps 20 --warmup 3
done 2>&1 | quiet | tee "$log_dir/dist_steps.jsonl"
python3 bench/dist_compare.py steps "$log_dir/dist_steps.jsonl" 2>&1 | tee "$log_dir/dist_summary.txt"
timeout 120 $NE selftest --backend cuda --precision bf16 2>&1 | quiet | tee "$log_dir/selftest_bf16.log"
