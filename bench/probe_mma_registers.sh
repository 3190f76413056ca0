#!/usr/bin/env bash
# How the register cap of each tensor-core attention kernel (MMA_MAX_REGISTERS in ops/cuda/attention/mma.py)
# changes its time: for each cap, the kernels' durations and occupancy under ncu, and the attention
# timings against SDPA. Then the fastest cap of each kernel is written back and the training step timed.
# Edits ops/cuda/attention/mma.py in place: run it on a copy of the tree (the GPU machine's).
#   bash bench/probe_mma_registers.sh LOG_DIR ["None, None, None" "128, 128, 128" ...]
set -uo pipefail
log_dir=$1; shift
caps=("$@"); [ ${#caps[@]} -gt 0 ] || caps=("None, None, None" "128, 128, 128" "168, 168, 168")
mkdir -p "$log_dir"
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
set_caps() {
    sed -i "s/^MMA_MAX_REGISTERS = .*/MMA_MAX_REGISTERS = ($1)/" ops/cuda/attention/mma.py
    python3 -m pip install -q --no-deps --no-build-isolation --force-reinstall --no-index . > /dev/null 2>&1
}
for cap in "${caps[@]}"; do
    set_caps "$cap"
    tag=$(echo "$cap" | tr -d ' ' | tr ',' '-')
    python3 bench/bench_kernels_cuda.py --precision bf16 --ops attention 2>&1 | grep "^attention" | sed "s/^/($cap) /" \
        | tee -a "$log_dir/kernels.log"
    timeout 300 ncu --clock-control none -k regex:"mma_(forward|dq|dkdv)" -c 3 --section SpeedOfLight \
        --section LaunchStats --section Occupancy --section WarpStateStats \
        python3 bench/bench_kernels_cuda.py --precision bf16 --ops attention > "$log_dir/ncu_$tag.log" 2>&1
done
best=$(python3 - "$log_dir" "${caps[@]}" <<'PY'
import re, sys
log_dir, caps = sys.argv[1], sys.argv[2:]
best = []
for kernel in ("mma_forward", "mma_dq", "mma_dkdv"):
    times = {}
    for cap in caps:
        text = open(f"{log_dir}/ncu_{cap.replace(' ', '').replace(',', '-')}.log").read()
        part = text.split(kernel + "_kernel", 1)[1] if kernel + "_kernel" in text else ""
        found = re.search(r"Duration\s+(\w+)\s+([\d.,]+)", part)
        if found:
            times[cap] = float(found.group(2).replace(",", "")) * (1000 if found.group(1) == "ms" else 1)
    print(kernel, times, file=sys.stderr)
    best.append(min(times, key=times.get).split(",")[len(best)].strip() if times else "None")
print(", ".join(best))
PY
)
echo "fastest caps: ($best)" | tee -a "$log_dir/kernels.log"
set_caps "$best"
python3 bench/bench_kernels_cuda.py --precision bf16 --ops attention 2>&1 | grep "^attention" | tee -a "$log_dir/kernels.log"
timeout 300 python3 -m nanoeuler_core.cli bench --preset gpu --backend cuda --batch-size 32 --precision bf16 --steps 20 \
    --warmup 3 2>&1 | grep -v -E "NumbaPerformanceWarning|warn\(errors" | tee "$log_dir/bench_bf16.log"
