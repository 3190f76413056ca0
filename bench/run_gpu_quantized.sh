#!/usr/bin/env bash
# Quantized decoding on one GPU, in one go (about 8 minutes on an H200): the GPU tests of the
# decoding ops, the products alone (bench/quantized_gpu.py), then a `gpu` model trained GEN_STEPS
# (300) steps on the bundled corpus, decoded at batch 1 with bf16, int8 and int4 weights (plain,
# speculative and the default policy; PyTorch's peers once, with bf16), and its int8 and int4
# quantized runs sampled. Run from the project's root with .whl/ beside it (bench/gpu_env.sh):
#   bash bench/run_gpu_quantized.sh LOG_DIR
# Logs: LOG_DIR/*.log, and LOG_DIR/summary.txt with the lines that carry the figures.
set -uo pipefail
[ $# -eq 1 ] || { echo "usage: bash bench/run_gpu_quantized.sh LOG_DIR" >&2; exit 1; }
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
mkdir -p "$1"
log_dir=$(cd "$1" && pwd)
NE="python3 -m nanoeuler_core.cli"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$log_dir/gpu.txt"

python3 -m pytest -q -o addopts="" -m gpu -p no:cacheprovider tests/test_quantized_cuda.py \
    tests/test_generate_gpu.py > "$log_dir/gpu_tests.log" 2>&1
$NE selftest --backend cuda 2>&1 | grep -E "norm_linear|norm_swiglu|linear_residual|FAIL|selftest" \
    > "$log_dir/selftest.log"
python3 bench/quantized_gpu.py > "$log_dir/products.log" 2>&1

run_dir=/tmp/nanoeuler-quantized/run
rm -rf /tmp/nanoeuler-quantized
$NE pretrain --preset gpu --backend cuda --steps "${GEN_STEPS:-300}" --batch-size 16 --eval-every 100 \
    --ckpt-every "${GEN_STEPS:-300}" --out "$run_dir" > "$log_dir/pretrain.log" 2>&1
bench() { $NE bench --generate --preset gpu --backend cuda --run "$run_dir" --batch-size 1 --prompt-tokens 16 \
    --new-tokens 256 "$@" 2>&1 | grep -v -E "NumbaPerformanceWarning|warn\("; }
bench --decode-weights bf16 > "$log_dir/bench_bf16.log"
for w in int8 int4; do bench --decode-weights $w --no-peers > "$log_dir/bench_$w.log"; done
for bits in 8 4; do
    $NE quantize "$run_dir" "$run_dir-q$bits" --bits $bits > "$log_dir/quantize_$bits.log" 2>&1
    $NE generate "$run_dir-q$bits" "def " --max-new-tokens 64 --temperature 0 --backend cuda \
        >> "$log_dir/quantize_$bits.log" 2>&1
done

{
    cat "$log_dir/gpu.txt"
    grep -hE "passed|failed|error" "$log_dir/gpu_tests.log" | tail -n 1
    tail -n 1 "$log_dir/selftest.log"
    cat "$log_dir/products.log"
    for w in bf16 int8 int4; do
        echo "--- decoding weights $w"
        grep -hE "^(nanoeuler|torch|bandwidth|speculative:|default:|ratio)" "$log_dir/bench_$w.log"
    done
    for bits in 8 4; do echo "--- quantize --bits $bits"; tail -n 3 "$log_dir/quantize_$bits.log"; done
} > "$log_dir/summary.txt"
cat "$log_dir/summary.txt"
