#!/usr/bin/env bash
# The decoding step of several source trees against each other, on one GPU, in one go:
#   bash bench/ab_trees.sh LOG_DIR TREE... [-- decode_step.py arguments (default: --rows 1 --replay-only)]
# A TREE is a source tree beside this one, e.g. `git archive REV | tar -x -C baseline/REV` (baseline/ is
# not tracked: carry it to the GPU machine). Each runs this tree's bench/decode_step.py on its own
# packages (nanoeuler_core, ops as nanoeuler_ops, data as nanoeuler_data, ahead on the path) and its
# own kernel cache. The caches are warmed all at once (compiling is CPU work; a fresh machine takes
# a minute or two), then the trees run in turn, twice round, so that drift in the machine falls on
# all of them. Only decode_step.py separates trees this way: `python -m nanoeuler_core.cli` puts the
# working directory first on the path and would mix this tree's core with another's ops.
set -uo pipefail
log_dir=$1; shift
trees=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do trees+=("$(cd "$1" && pwd)"); shift; done
[ "${1:-}" = "--" ] && shift
if [ $# -gt 0 ]; then step_args=("$@"); else step_args=(--rows 1 --replay-only); fi
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
mkdir -p "$log_dir"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$log_dir/gpu.txt"

run_tree() {   # run_tree TREE COMMAND...: COMMAND on TREE's packages and kernel cache
    local tree=$1 name; shift
    name=$(basename "$tree")
    mkdir -p "/tmp/ab-trees/$name"
    ln -sfn "$tree/nanoeuler_core" "/tmp/ab-trees/$name/nanoeuler_core"
    ln -sfn "$tree/ops" "/tmp/ab-trees/$name/nanoeuler_ops"
    ln -sfn "$tree/data" "/tmp/ab-trees/$name/nanoeuler_data"
    PYTHONPATH="/tmp/ab-trees/$name" NUMBA_CACHE_DIR="/tmp/ab-trees/$name.cache" "$@"
}

for tree in "${trees[@]}"; do
    (run_tree "$tree" timeout 400 python3 bench/decode_step.py "${step_args[@]}" > "$log_dir/warm_$(basename "$tree").log" 2>&1) &
done
wait
for round in 1 2; do
    for tree in "${trees[@]}"; do
        echo "== $(basename "$tree"), round $round: ${step_args[*]}"
        run_tree "$tree" timeout 120 python3 bench/decode_step.py "${step_args[@]}" 2>&1 \
            | tee -a "$log_dir/step_$(basename "$tree").log" | grep -E "us a step|ms \(median"
    done
done
