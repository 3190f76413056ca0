#!/usr/bin/env bash
# This tree against a baseline tree on a machine of 4 GPUs, in one go (about 9 minutes): the same
# benchmarks from each tree's own code, alternating A B A B (ROUNDS=2 times round; serving once) so
# that drift falls on both, plus every GPU test of this tree. Run from the project's root with .whl/ beside it (bench/gpu_env.sh):
#   git archive REV | (mkdir -p baseline/REV && tar -x -C baseline/REV)      # baseline/ is not tracked
#   bash bench/run_gpu_ab.sh LOG_DIR baseline/REV
# GPU 0: the bf16 training step of the `gpu` preset, 32 x 512 (then PyTorch eager and torch.compile
#        on the same model once, from this tree);
# GPU 1: a `gpu` model trained GEN_STEPS (300) steps here, then decoding it at batch 1 (greedy, 256
#        tokens; plain, speculative and the default policy), then `serve` under 1, 16 and 64
#        streaming clients (SERVE_CLIENTS; SERVE_SECONDS each, 32 rows; SERVE_ROUNDS times round);
# GPU 2: decoding the same model at batches 8 and 32;
# GPU 3: the GPU tests of this tree, four groups at once (they mostly compile on the CPU).
# On a machine of fewer GPUs, everything runs on GPU 0, one part after the other. PARTS picks parts
# (default: "training decoding decoding_batches tests").
# Logs: LOG_DIR/*.log, and LOG_DIR/summary.txt with the lines that carry the figures.
set -uo pipefail
[ $# -eq 2 ] && [ -d "$2/nanoeuler_core" ] || { echo "usage: bash bench/run_gpu_ab.sh LOG_DIR BASELINE_TREE" >&2; exit 1; }
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
source bench/in_tree.sh
mkdir -p "$1"
log_dir=$(cd "$1" && pwd)
here=$PWD
base=$(cd "$2" && pwd)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$log_dir/gpu.txt"
NE="python3 -m nanoeuler_core.cli"
parts=${PARTS:-training decoding decoding_batches tests}
if [ "$(nvidia-smi -L | wc -l)" -ge 4 ]; then gpus=(0 1 2 3); else gpus=(0 0 0 0); fi
run_dir=/tmp/nanoeuler-ab/run

on_gpu() {   # on_gpu NAME TREE GPU LIMIT CMD...: in_tree (bench/in_tree.sh) on one GPU, warnings left out
    local name=$1 tree=$2 gpu=$3 limit=$4
    shift 4
    CUDA_VISIBLE_DEVICES=$gpu in_tree "$name" "$tree" "$limit" "$@" 2>&1 | grep -v -E "NumbaPerformanceWarning|warn\("
}

ab() {   # ab GPU LOG LIMIT CMD...: CMD in each tree, alternating, ROUNDS times round (the benchmarks warm up
    # before they time, so a first round that compiles still counts)
    local gpu=$1 log=$2 limit=$3
    shift 3
    for round in $(seq "${ROUNDS:-2}"); do
        for name in base here; do
            tree=$here; [ $name = base ] && tree=$base
            echo "== $name, round $round: $*"
            on_gpu $name "$tree" "$gpu" "$limit" "$@"
        done
    done > "$log_dir/$log" 2>&1
}

training() {
    ab ${gpus[0]} train.log 150 $NE bench --preset gpu --backend cuda --batch-size 32 --precision bf16 --steps 20 --warmup 3 --no-peers
    on_gpu here "$here" ${gpus[0]} 240 $NE bench --preset gpu --backend cuda --batch-size 32 --precision bf16 --steps 20 \
        --warmup 3 > "$log_dir/train_peers.log" 2>&1
}

decoding() {
    on_gpu here "$here" ${gpus[1]} 200 $NE pretrain --preset gpu --backend cuda --steps "${GEN_STEPS:-300}" --batch-size 16 \
        --eval-every "${GEN_STEPS:-300}" --ckpt-every "${GEN_STEPS:-300}" --out "$run_dir" > "$log_dir/pretrain.log" 2>&1
    touch /tmp/nanoeuler-ab/trained
    [ "${1:-}" = serving ] || ab ${gpus[1]} decode_b1.log 150 $NE bench --generate --preset gpu --backend cuda --run "$run_dir" --batch-size 1 \
        --prompt-tokens 16 --new-tokens 256 --no-peers
    ROUNDS=${SERVE_ROUNDS:-1} ab ${gpus[1]} serve.log 200 python3 bench/load_serve.py "$run_dir" --backend cuda --max-batch 32 \
        --clients "${SERVE_CLIENTS:-1,16,64}" \
        --duration "${SERVE_SECONDS:-15}" --log /tmp/nanoeuler-ab/serve_server.log
}

serving() {
    decoding serving
}

decoding_batches() {
    while [ ! -f /tmp/nanoeuler-ab/trained ]; do sleep 5; done   # decoding() trains the model
    for rows in 8 32; do
        ab ${gpus[2]} "decode_b$rows.log" 150 $NE bench --generate --preset gpu --backend cuda --run "$run_dir" --batch-size $rows \
            --prompt-tokens 16 --new-tokens 256 --no-peers
    done
}

tests() {
    local groups=("-m gpu tests/test_cuda.py" "-m gpu tests/test_cuda_model.py tests/test_model.py tests/test_eval.py tests/test_interop.py"
                  "-m gpu tests/test_generate_gpu.py tests/test_generate.py tests/test_distributed.py" "tests/test_tensor_cores.py tests/test_teaching_kernels.py")
    for i in "${!groups[@]}"; do
        CUDA_VISIBLE_DEVICES=${gpus[3]} timeout 480 python3 -m pytest -q -o addopts="" ${groups[$i]} -p no:cacheprovider \
            -W ignore::numba.core.errors.NumbaPerformanceWarning --durations=3 > "$log_dir/tests_$i.log" 2>&1 &
    done
    wait
}

rm -rf /tmp/nanoeuler-ab /tmp/nanoeuler-trees
mkdir -p /tmp/nanoeuler-ab
if [ "${gpus[0]}" = "${gpus[3]}" ]; then
    for part in $parts; do $part; done
else
    for part in $parts; do $part & done
    wait
fi
grep -h -E "^== |^nanoeuler|^torch|ratio|passed|failed|rror|clients" "$log_dir"/*.log > "$log_dir/summary.txt" 2>&1
cat "$log_dir/summary.txt"
