#!/usr/bin/env bash
# Data parallelism on N GPUs of one host, one rank per GPU (NCCL): the self-check; the captured step
# on 1 GPU against N (scaling efficiency) and with ZeRO-1 (memory per GPU); the `gpu` preset's loss
# curve on N GPUs against 1 GPU accumulating N micro-batches of the same size, with and without
# ZeRO-1; a rank killed mid-run and the job resumed from its last checkpoint. Logs go to LOG_DIR.
# Needs the [dist-cuda] packages (bench/RESULTS.md, "Data-parallel training: GPU set-up").
#   bash bench/run_gpu_dist_multi.sh N [LOG_DIR] [STEPS]
# STAGES="selfcheck steps curves kill" (the default) picks stages; ROUNDS=2 repeats the step timings;
# KILL_AFTER=50 is the step count after which rank 1 is killed (checkpoints every 10 steps).
# (BACKEND=cpu PRESET=small rehearses the same steps on CPU cores, without the NCCL self-check.)
set -uo pipefail
n=${1:?usage: bash bench/run_gpu_dist_multi.sh N [LOG_DIR] [STEPS]}
log_dir=${2:-gpu-logs-dist-$n}
steps=${3:-300}
mkdir -p "$log_dir"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # never NVLink multicast on shared machines
source "$(dirname "$0")/mpi_env.sh"
runs=${RUNS_DIR:-/tmp/ne-dist-runs}
backend=${BACKEND:-cuda}
preset=${PRESET:-gpu}
model=(--preset "$preset" --backend "$backend")
stages=" ${STAGES:-selfcheck steps curves kill} "
rounds=${ROUNDS:-2}
kill_after=${KILL_AFTER:-50}
rm -rf "$runs"; mkdir -p "$runs"
run() { echo "+ $*" | tee -a "$log_dir/commands.txt"; "$@"; }
wants() { [[ $stages == *" $1 "* ]]; }

nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee "$log_dir/gpu.txt"
nvidia-smi topo -m > "$log_dir/topology.txt" 2>&1

# 1. the communicator on N GPUs, eager and captured: expect "nccl self-check passed"
[ "$backend" = cuda ] && wants selfcheck && run "$mpiexec" -n "$n" python3 bench/nccl_selfcheck.py 2>&1 | tee "$log_dir/selfcheck.log"

# 2. step time and memory: 1 GPU (no communicator) vs N GPUs, the same 32 x 512 rows per GPU, in the
#    backend's default precision (bf16 on a GPU);
#    scaling efficiency = (tokens/s per rank on N) / (tokens/s on 1); ZeRO-1's memory by rank vs plain's
wants steps && for round in $(seq "$rounds"); do
  run "$mpiexec" -n 1 python3 bench/bench_dist.py "${model[@]}" --variant plain --batch-size 32 --steps 30 --warmup 5
  run "$mpiexec" -n "$n" python3 bench/bench_dist.py "${model[@]}" --variant allreduce --batch-size 32 --steps 30 --warmup 5
  run "$mpiexec" -n "$n" python3 bench/bench_dist.py "${model[@]}" --variant zero --batch-size 32 --steps 30 --warmup 5
done 2>&1 | tee "$log_dir/step_times.jsonl"
wants steps && python3 bench/dist_compare.py steps "$log_dir/step_times.jsonl" | tee "$log_dir/summary.txt"

# 3. loss curves, `gpu` preset on the bundled corpus, 16 rows per micro-batch: 1 GPU accumulating N
#    micro-batches = N GPUs with one each (= N GPUs with ZeRO-1), up to the precision's rounding
common=("${model[@]}" --steps "$steps" --batch-size 16 --eval-every 100 --ckpt-every 100
        --sample-prompt x)
tok=(--tokenizer "$runs/one-gpu/tokenizer.json")
if wants curves || wants kill; then
run python3 -m nanoeuler_core.cli pretrain "${common[@]}" --grad-accum "$n" --out "$runs/one-gpu" 2>&1 \
    | grep -E "^(run |done:|memory per rank|error)" | tee "$log_dir/curves.log"
fi
if wants curves; then
run "$mpiexec" -n "$n" python3 -m nanoeuler_core.cli pretrain "${common[@]}" "${tok[@]}" --out "$runs/ranks" 2>&1 \
    | grep -E "^(run |done:|memory per rank|error)" | tee -a "$log_dir/curves.log"
run "$mpiexec" -n "$n" python3 -m nanoeuler_core.cli pretrain "${common[@]}" "${tok[@]}" --zero 1 --out "$runs/zero" 2>&1 \
    | grep -E "^(run |done:|memory per rank|error)" | tee -a "$log_dir/curves.log"
python3 bench/dist_compare.py runs "$runs/one-gpu" "$runs/ranks" "$runs/zero" | tee -a "$log_dir/summary.txt"
for r in one-gpu ranks zero; do cp "$runs/$r/metrics.jsonl" "$log_dir/metrics-$r.jsonl"; done
fi
wants kill || exit 0

# 4. kill -9 rank 1 mid-run (checkpoints every 10 steps): the job must end at once, the last
#    checkpoint load, and the resumed job continue from it
"$mpiexec" -n "$n" python3 -m nanoeuler_core.cli pretrain "${common[@]}" "${tok[@]}" --steps 100000 --ckpt-every 10 \
    --out "$runs/killed" > "$log_dir/killed.log" 2>&1 &
launcher=$!
until [ -f "$runs/killed/metrics.jsonl" ] && [ "$(wc -l < "$runs/killed/metrics.jsonl")" -ge "$kill_after" ]; do
  kill -0 $launcher 2>/dev/null || break; sleep 1
done
rank1=$(python3 - "$launcher" <<'PY'
import sys
from pathlib import Path
todo = [int(sys.argv[1])]
while todo:
    pid = todo.pop()
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            todo += [int(c) for c in (task / "children").read_text().split()]
        if b"PMI_RANK=1" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            print(pid)
            break
    except OSError:
        pass
PY
)
echo "killing rank 1 (pid $rank1) after $(wc -l < "$runs/killed/metrics.jsonl") steps" | tee "$log_dir/kill.txt"
start=$(date +%s.%N)
kill -9 "$rank1"
wait $launcher
echo "job ended with status $? after $(python3 -c "print(round($(date +%s.%N) - $start, 1))") s" | tee -a "$log_dir/kill.txt"
tail -n 12 "$log_dir/killed.log" | tee -a "$log_dir/kill.txt"
last=$(python3 -c "from nanoeuler_core.engine import checkpoint as c; print(c.load_tensors('$runs/killed/model.safetensors')[1]['step'])")
run "$mpiexec" -n "$n" python3 -m nanoeuler_core.cli pretrain --resume "$runs/killed" --steps $((last + 20)) \
    --sample-prompt x 2>&1 | grep -E "resuming|done:|error" | tee -a "$log_dir/kill.txt"
