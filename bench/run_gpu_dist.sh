#!/usr/bin/env bash
# Data parallelism on ONE GPU: the NCCL communicator self-check (eager and captured), the captured
# training step with the NCCL all-reduce inside (one rank) and with ZeRO-1, timed against the plain
# step (interleaved repeats, the same warm GPU), gradient accumulation on the GPU against one big
# batch, the CLI end to end under mpiexec, and the GPU tests. Logs go to LOG_DIR.
# Needs the [dist-cuda] packages (docs/gpu-setup.md: bench/gpu_wheels.sh --dist).
#   bash bench/run_gpu_dist.sh [LOG_DIR]
set -uo pipefail
log_dir=${1:-gpu-logs-dist}
mkdir -p "$log_dir"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # never NVLink multicast on shared machines
source "$(dirname "$0")/gpu_env.sh"
run() { echo "+ $*" | tee -a "$log_dir/commands.txt"; "$@"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$log_dir/gpu.txt"
python3 -c "import mpi4py, nccl.core, cuda.core; from mpi4py import MPI
print('mpi4py', mpi4py.__version__, MPI.Get_library_version().splitlines()[0]); print('nccl4py', nccl.core.__version__,
'NCCL', nccl.core.get_version()); print('cuda.core', cuda.core.__version__)" 2>&1 | tee "$log_dir/versions.txt"

# 1. the communicator on known arrays, eager and inside a captured graph: expect "nccl self-check passed"
run "$mpiexec" -n 1 python3 bench/nccl_selfcheck.py 2>&1 | tee "$log_dir/selfcheck.log"

# 2. the captured step (gpu preset, batch 32 x 512, bf16): plain vs NCCL all-reduce (1 rank) vs ZeRO-1 (1 rank),
#    3 interleaved rounds; expect the same ms/step within noise, and the same losses ("losses = plain's": True)
for round in 1 2 3; do
  for variant in plain allreduce zero; do
    run "$mpiexec" -n 1 python3 bench/bench_dist.py --variant "$variant" --batch-size 32 --steps 30 --warmup 5
  done
done 2>&1 | tee "$log_dir/step_times.jsonl"

# 3. gradient accumulation on the GPU, FP32 products: 2 micro-batches of 16 rows and 4 of 8 against 32 rows
for shape in "32 1" "16 2" "8 4"; do
  set -- $shape
  run "$mpiexec" -n 1 python3 bench/bench_dist.py --variant plain --batch-size "$1" --grad-accum "$2" --steps 5 \
      --warmup 0 --precision fp32
done 2>&1 | tee "$log_dir/accum.jsonl"
python3 bench/dist_compare.py steps "$log_dir/step_times.jsonl" | tee "$log_dir/summary.txt"
python3 -c "
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
base = [l for l, _ in rows[0]['loss_and_norm']]
for r in rows[1:]:
    diff = max(abs(l - b) / b for (l, _), b in zip(r['loss_and_norm'], base))
    print(f\"grad-accum {r['grad_accum']} x {r['batch_size']} vs 1 x {rows[0]['batch_size']}: max rel loss diff {diff:.1e}\")
" "$log_dir/accum.jsonl" | tee -a "$log_dir/summary.txt"

# 4. the CLI end to end: one process accumulating 2 micro-batches vs mpiexec -n 1 with ZeRO-1 (NCCL, captured)
common=(--preset gpu --backend cuda --steps 30 --batch-size 16 --grad-accum 2 --eval-every 15 --ckpt-every 15
        --sample-prompt x)
rm -rf /tmp/ne-dist-plain /tmp/ne-dist-zero
run python3 -m nanoeuler_core.cli pretrain "${common[@]}" --out /tmp/ne-dist-plain 2>&1 | grep -E "^(run |done:|memory per rank|error)" | tee "$log_dir/cli.log"
run "$mpiexec" -n 1 python3 -m nanoeuler_core.cli pretrain "${common[@]}" --zero 1 --tokenizer /tmp/ne-dist-plain/tokenizer.json \
    --out /tmp/ne-dist-zero 2>&1 | grep -E "^(run |done:|memory per rank|error)" | tee -a "$log_dir/cli.log"
python3 bench/dist_compare.py runs /tmp/ne-dist-plain /tmp/ne-dist-zero | tee -a "$log_dir/summary.txt"

# 5. this feature's tests, on the GPU (micro-batches in a captured graph, NCCL and ZeRO-1 on one rank) and the CPU
python3 -m pytest -q -o addopts="" tests/test_distributed.py -p no:cacheprovider 2>&1 | tee "$log_dir/tests.log"
