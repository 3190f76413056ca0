#!/usr/bin/env bash
# Data parallelism on the GPUs of one machine, one rank per GPU (NCCL), against PyTorch DDP on the
# same GPUs. Run it from the project's root on a fresh GPU machine (with .whl/ beside it: see
# bench/gpu_env.sh, which sets everything up). Logs and a summary go to LOG_DIR.
#   bash bench/run_gpu_dist_multi.sh "GPUS" [LOG_DIR] [STEPS]        e.g. GPUS="1 2 4"
# Stages (STAGES="selfcheck steps curves kill", the default; "hosts" on its own):
#   selfcheck  the communicator on every GPU count above 1: eager, captured, bucketed; all-reduce bandwidth
#   steps      the captured step, `gpu` preset, 32 x 512 rows per GPU, bf16: 1 GPU, then every count with
#              the all-reduce (overlapped with the backward, and not: OVERLAP_OFF="4" picks the counts)
#              and with ZeRO-1 and ZeRO-2; PyTorch DDP + compile + bf16 autocast on the same counts
#              (PEERS=0 leaves it out); scaling efficiency, ratio to DDP and memory per GPU
#              (bench/dist_compare.py)
#   curves     the largest count against 1 GPU accumulating as many micro-batches of 16 rows, plain
#              and ZeRO-1, STEPS steps on the bundled corpus: largest relative loss difference
#   kill       kill -9 of rank 1 after KILL_AFTER steps: the job must end within seconds, the last
#              checkpoint load; the run resumes on the same count, then on half as many GPUs
#   hosts      the largest count as two "hosts" of half the GPUs each (NCCL_HOSTID per half: NVLink
#              inside a host, sockets over lo between them, as between two machines): NCCL's
#              transport (NCCL_DEBUG=INFO), the step with fp32 and bf16 sums, all-reduce, ZeRO-1 and
#              ZeRO-2 (HOSTS_VARIANTS picks among them), --grad-accum 1 and 4 (one process per rank for
#              all of them), PyTorch DDP (no compile: its start-up would not fit) with the same NCCL
#              settings, fp32 and its bf16 compression hook, grad-accum 1 and 4; a kill -9 of the last
#              rank (on host B) and the resume. One summary: hosts-summary.txt. On 4 H100/H200 about
#              7-9 minutes with a warm kernel cache (the first bench run of a fresh machine compiles
#              the kernels: run the steps stage first, or STEPS_HOSTS=4 to shorten):
#                STAGES=hosts bash bench/run_gpu_dist_multi.sh "4" gpu-logs-hosts
# ROUNDS=1 repeats the step timings. BACKEND=cpu PRESET=small rehearses it all on CPU cores.
set -uo pipefail
gpus=${1:?usage: bash bench/run_gpu_dist_multi.sh "GPUS" [LOG_DIR] [STEPS]}
log_dir=${2:-gpu-logs-dist}
steps=${3:-200}
mkdir -p "$log_dir"
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
runs=${RUNS_DIR:-/tmp/ne-dist-runs}
backend=${BACKEND:-cuda}
preset=${PRESET:-gpu}
model=(--preset "$preset" --backend "$backend")
stages=" ${STAGES:-selfcheck steps curves kill} "
steps_hosts=${STEPS_HOSTS:-8}
rounds=${ROUNDS:-1}
overlap_off=" ${OVERLAP_OFF:-4} "
kill_after=${KILL_AFTER:-30}
largest=$(echo "$gpus" | tr ' ' '\n' | sort -n | tail -1)
rm -rf "$runs"; mkdir -p "$runs"
run() { echo "+ $*" | tee -a "$log_dir/commands.txt" >&2; "$@"; }
wants() { [[ $stages == *" $1 "* ]]; }
rank_pid() {  # the pid of rank $2 among the processes mpiexec ($1) started
  python3 - "$1" "$2" <<'PY'
import sys
from pathlib import Path
todo, want = [int(sys.argv[1])], f"PMI_RANK={sys.argv[2]}".encode()
while todo:
    pid = todo.pop()
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            todo += [int(c) for c in (task / "children").read_text().split()]
        if want in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            print(pid)
            break
    except OSError:
        pass
PY
}
quiet() { grep -v -E "NumbaPerformanceWarning|warn\(|^\s*$"; }

if [ "$backend" = cuda ]; then
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee "$log_dir/gpu.txt"
  nvidia-smi topo -m > "$log_dir/topology.txt" 2>&1
  python3 -c "import mpi4py, nccl.core; from mpi4py import MPI; print('mpi4py', mpi4py.__version__,
MPI.Get_library_version().splitlines()[0]); print('nccl4py', nccl.core.__version__)" 2>&1 | tee "$log_dir/versions.txt"
fi

# 1. the communicator: expect "nccl self-check passed" for every count
if [ "$backend" = cuda ] && wants selfcheck; then
  for n in $gpus; do [ "$n" -gt 1 ] || continue
    run timeout 180 "$mpiexec" -n "$n" python3 bench/nccl_selfcheck.py 2>&1 | quiet | tee -a "$log_dir/selfcheck.log"
  done
fi

# 2. step times: ours on 1, then N GPUs (all-reduce overlapped / not, ZeRO-1), PyTorch DDP on the same counts
if wants steps; then
  bench=(timeout 240 python3 bench/bench_dist.py "${model[@]}" --batch-size 32 --steps 30 --warmup 5)
  for round in $(seq "$rounds"); do
    for n in $gpus; do
      if [ "$n" -eq 1 ]; then
        run "$mpiexec" -n 1 "${bench[@]}" --variant plain
      else
        run "$mpiexec" -n "$n" "${bench[@]}" --variant allreduce
        [[ $overlap_off == *" $n "* ]] && run "$mpiexec" -n "$n" "${bench[@]}" --variant allreduce --no-overlap
        run "$mpiexec" -n "$n" "${bench[@]}" --variant zero
        run "$mpiexec" -n "$n" "${bench[@]}" --variant zero2
      fi
      if [ "$backend" = cuda ] && [ "${PEERS:-1}" = 1 ]; then
        run timeout 300 python3 -m torch.distributed.run --standalone --nproc_per_node "$n" bench/torch_ddp.py --preset "$preset" \
            --batch-size 32 --steps 30 --warmup 10
      fi
    done
  done 2>&1 | quiet | tee "$log_dir/step_times.jsonl"
  python3 bench/dist_compare.py steps "$log_dir/step_times.jsonl" | tee "$log_dir/summary.txt"
fi

# 3. loss curves on the bundled corpus, 16 rows per micro-batch: 1 GPU accumulating N micro-batches =
#    N GPUs with one each (= with ZeRO-1), up to the precision's rounding
common=("${model[@]}" --steps "$steps" --batch-size 16 --eval-every 100 --ckpt-every 100 --sample-prompt x)
tok=(--tokenizer "$runs/one-gpu/tokenizer.json")
keep() { grep -E "^(run |done:|memory per rank|resuming|error)"; }
if wants curves || wants kill; then
  run timeout 300 python3 -m nanoeuler_core.cli pretrain "${common[@]}" --grad-accum "$largest" --out "$runs/one-gpu" \
      2>&1 | keep | tee "$log_dir/curves.log"
fi
if wants curves; then
  run timeout 300 "$mpiexec" -n "$largest" python3 -m nanoeuler_core.cli pretrain "${common[@]}" "${tok[@]}" \
      --out "$runs/ranks" 2>&1 | keep | tee -a "$log_dir/curves.log"
  run timeout 300 "$mpiexec" -n "$largest" python3 -m nanoeuler_core.cli pretrain "${common[@]}" "${tok[@]}" --zero 1 \
      --out "$runs/zero" 2>&1 | keep | tee -a "$log_dir/curves.log"
  python3 bench/dist_compare.py runs "$runs/one-gpu" "$runs/ranks" "$runs/zero" | tee -a "$log_dir/summary.txt"
  for r in one-gpu ranks zero; do cp "$runs/$r/metrics.jsonl" "$log_dir/metrics-$r.jsonl"; done
fi
if wants hosts; then
  # 5. two "hosts" of half the GPUs each: each half its own NCCL_HOSTID, sockets over lo between them
  half=$(( largest / 2 ))
  two_hosts() { NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 "$mpiexec" -n "$half" -env NCCL_HOSTID hostA "$@" : \
                -n "$half" -env NCCL_HOSTID hostB "$@"; }
  # the transport: expect "nNodes 2" and "via NET/Socket" between the halves, P2P (NVLink) inside them
  NCCL_DEBUG=INFO run two_hosts timeout 120 python3 bench/nccl_selfcheck.py > "$log_dir/hosts-nccl.log" 2>&1
  { grep -E "nccl self-check passed|^FAIL" "$log_dir/hosts-nccl.log"
    grep -o -E "nNodes [0-9]+|via NET/Socket[^ ]*|via P2P/[A-Za-z]+|NET/Socket : Using [^ ]+ [^ ]+" "$log_dir/hosts-nccl.log" \
      | sort | uniq -c; } | tee "$log_dir/hosts-transport.txt"
  # the step: fp32 / bf16 sums x all-reduce / ZeRO-1 / ZeRO-2 x grad-accum 1 / 4, in one start-up
  run two_hosts timeout 300 python3 bench/bench_dist.py "${model[@]}" --batch-size 32 --steps "$steps_hosts" --warmup 2 \
      --variant "${HOSTS_VARIANTS:-allreduce,zero,zero2}" --grad-accum 1,4 --grad-reduce fp32,bf16 2>&1 | quiet \
      | tee "$log_dir/hosts-steps.jsonl"
  if [ "$backend" = cuda ]; then
    for accum in 1 4; do for sums in fp32 bf16; do
      MASTER_PORT=$((29500 + accum * 10 + ${#sums})) run two_hosts timeout 150 python3 bench/torch_ddp.py --preset "$preset" \
          --batch-size 32 --steps "$steps_hosts" --warmup 3 --no-compile --grad-accum "$accum" --grad-reduce "$sums"
    done; done 2>&1 | quiet | tee -a "$log_dir/hosts-steps.jsonl"
  fi
  # a killed rank on host B: the job ends within seconds; the run resumes from its last checkpoint
  rm -rf "$runs/hosts-killed"
  two_hosts python3 -m nanoeuler_core.cli pretrain "${model[@]}" --steps 100000 --batch-size 16 --eval-every 1000 \
      --ckpt-every 5 --sample-prompt x --out "$runs/hosts-killed" > "$log_dir/hosts-killed.log" 2>&1 &
  launcher=$!
  until [ -f "$runs/hosts-killed/metrics.jsonl" ] && [ "$(wc -l < "$runs/hosts-killed/metrics.jsonl")" -ge 12 ]; do
    kill -0 $launcher 2>/dev/null || break; sleep 1
  done
  last_rank=$(( largest - 1 ))
  victim=$(rank_pid "$launcher" "$last_rank")
  echo "killing rank $last_rank (host B, pid $victim) after $(wc -l < "$runs/hosts-killed/metrics.jsonl") steps" \
    | tee "$log_dir/hosts-kill.txt"
  start=$(date +%s.%N)
  kill -9 "$victim"
  wait $launcher
  echo "job ended with status $? after $(python3 -c "print(round($(date +%s.%N) - $start, 1))") s" | tee -a "$log_dir/hosts-kill.txt"
  last=$(python3 -c "from nanoeuler_core.engine import checkpoint as c; print(c.load_tensors('$runs/hosts-killed/model.safetensors')[1]['step'])")
  echo "last checkpoint: step $last" | tee -a "$log_dir/hosts-kill.txt"
  run two_hosts timeout 150 python3 -m nanoeuler_core.cli pretrain --resume "$runs/hosts-killed" --steps $((last + 5)) \
      --sample-prompt x 2>&1 | grep -E "^(run |done:|resuming|error)" | tee -a "$log_dir/hosts-kill.txt"
  { echo "== two hosts of $half GPUs (NCCL_HOSTID), sockets over lo between them"; cat "$log_dir/hosts-transport.txt"
    python3 bench/dist_compare.py steps "$log_dir/hosts-steps.jsonl"; cat "$log_dir/hosts-kill.txt"; } \
    | tee "$log_dir/hosts-summary.txt"
fi

wants kill || exit 0

# 4. kill -9 of rank 1 mid-run (checkpoints every 10 steps): the job must end at once, the last
#    checkpoint load, and the job resume from it on as many GPUs, then on half as many
"$mpiexec" -n "$largest" python3 -m nanoeuler_core.cli pretrain "${common[@]}" "${tok[@]}" --steps 100000 \
    --ckpt-every 10 --out "$runs/killed" > "$log_dir/killed.log" 2>&1 &
launcher=$!
until [ -f "$runs/killed/metrics.jsonl" ] && [ "$(wc -l < "$runs/killed/metrics.jsonl")" -ge "$kill_after" ]; do
  kill -0 $launcher 2>/dev/null || break; sleep 1
done
rank1=$(rank_pid "$launcher" 1)
echo "killing rank 1 (pid $rank1) after $(wc -l < "$runs/killed/metrics.jsonl") steps" | tee "$log_dir/kill.txt"
start=$(date +%s.%N)
kill -9 "$rank1"
wait $launcher
echo "job ended with status $? after $(python3 -c "print(round($(date +%s.%N) - $start, 1))") s" | tee -a "$log_dir/kill.txt"
tail -n 12 "$log_dir/killed.log" | tee -a "$log_dir/kill.txt"
last=$(python3 -c "from nanoeuler_core.engine import checkpoint as c; print(c.load_tensors('$runs/killed/model.safetensors')[1]['step'])")
echo "last checkpoint: step $last" | tee -a "$log_dir/kill.txt"
run timeout 240 "$mpiexec" -n "$largest" python3 -m nanoeuler_core.cli pretrain --resume "$runs/killed" \
    --steps $((last + 20)) --sample-prompt x 2>&1 | keep | tee -a "$log_dir/kill.txt"
half=$(( largest > 1 ? largest / 2 : 1 ))
run timeout 240 "$mpiexec" -n "$half" python3 -m nanoeuler_core.cli pretrain --resume "$runs/killed" \
    --steps $((last + 40)) --grad-accum $((largest / half)) --sample-prompt x 2>&1 | keep | tee -a "$log_dir/kill.txt"
