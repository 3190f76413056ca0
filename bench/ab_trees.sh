#!/usr/bin/env bash
# One benchmark over several source trees, on one machine, in one go:
#   bash bench/ab_trees.sh LOG_DIR TREE... [-- COMMAND...]
# COMMAND (default: python3 bench/decode_step.py --rows 1 --replay-only, the decoding step) runs in
# each TREE's own directory, on that tree's packages (its nanoeuler_core, ops as nanoeuler_ops, data
# as nanoeuler_data, ahead on the path) and its own kernel cache, so a tree's bench scripts and
# `python3 -m nanoeuler_core.cli` run that tree's code alone. For example:
#   bash bench/ab_trees.sh LOG baseline/main . -- python3 bench/bench_kernels_cuda.py --precision bf16 --ops swiglu
#   bash bench/ab_trees.sh LOG baseline/main . -- python3 -m nanoeuler_core.cli bench --preset gpu --backend cuda \
#       --batch-size 32 --precision bf16 --no-peers
# A TREE is a source tree, e.g. `git archive REV | tar -x -C baseline/REV` (baseline/ is not tracked:
# carry it to the GPU machine), or this one. The kernel caches are filled by a first run of every
# tree at once (compiling is CPU work; a fresh machine takes a minute or two), then the trees run
# in turn, twice round, so that drift in the machine falls on all of them. Logs: LOG_DIR/TREE.log.
set -uo pipefail
usage() { echo "usage: bash bench/ab_trees.sh LOG_DIR TREE... [-- COMMAND...]" >&2; exit 1; }
[ $# -ge 1 ] || usage
log_dir=$1; shift
trees=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    [ -d "$1/nanoeuler_core" ] || { echo "error: $1 is not a nanoeuler source tree (no nanoeuler_core/ in it)" >&2; exit 1; }
    trees+=("$(cd "$1" && pwd)"); shift
done
[ ${#trees[@]} -gt 0 ] || usage
[ "${1:-}" = "--" ] && shift
if [ $# -gt 0 ]; then command=("$@"); else command=(python3 bench/decode_step.py --rows 1 --replay-only); fi
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
source bench/in_tree.sh
mkdir -p "$log_dir"
log_dir=$(cd "$log_dir" && pwd)
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$log_dir/gpu.txt"

name_of() {   # a tree's name in logs and caches: its directory's name (this tree: "here")
    local name
    name=$(basename "$1")
    [ "$1" = "$PWD" ] && name=here
    echo "$name"
}

run_tree() {   # run_tree TREE LIMIT: COMMAND in TREE on its packages and kernel cache, within LIMIT seconds
    in_tree "$(name_of "$1")" "$1" "$2" "${command[@]}"
}

for tree in "${trees[@]}"; do
    (run_tree "$tree" 400 > "$log_dir/warm_$(name_of "$tree").log" 2>&1) &
done
wait
for round in 1 2; do
    for tree in "${trees[@]}"; do
        echo "== $(name_of "$tree"), round $round: ${command[*]}"
        run_tree "$tree" 300 2>&1 | grep -v -E "Warning|warn\(" | tee -a "$log_dir/$(name_of "$tree").log"
    done
done
