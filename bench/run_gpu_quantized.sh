#!/usr/bin/env bash
# Quantized decoding on one GPU, in one go: the products alone (bench/quantized_gpu.py: each format's
# microseconds and speed against bf16), then a `gpu` model trained GEN_STEPS (300) steps on the
# bundled corpus, decoded at batch 1 with bf16, int8 and int4 weights (plain, speculative and the
# default policy), the decoding ops checked against the CPU and the float64 reference (gradcheck),
# and the int8 and int4 quantized runs sampled. PEERS=1 adds PyTorch's peers to the bf16 decoding.
# Run from the project's root with .whl/ beside it (bench/gpu_env.sh):
#   bash bench/run_gpu_quantized.sh LOG_DIR
# Logs: LOG_DIR/*.log, and LOG_DIR/summary.txt with the lines that carry the figures (plain decoding's
# tokens/s in each format against bf16's last).
set -uo pipefail
[ $# -eq 1 ] || { echo "usage: bash bench/run_gpu_quantized.sh LOG_DIR" >&2; exit 1; }
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
mkdir -p "$1"
log_dir=$(cd "$1" && pwd)
NE="python3 -m nanoeuler_core.cli"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$log_dir/gpu.txt"

python3 bench/quantized_gpu.py > "$log_dir/products.log" 2>&1

run_dir=/tmp/nanoeuler-quantized/run
rm -rf /tmp/nanoeuler-quantized
$NE pretrain --preset gpu --backend cuda --steps "${GEN_STEPS:-300}" --batch-size 16 --eval-every 100 \
    --ckpt-every "${GEN_STEPS:-300}" --out "$run_dir" > "$log_dir/pretrain.log" 2>&1
bench() { $NE bench --generate --preset gpu --backend cuda --run "$run_dir" --batch-size 1 --prompt-tokens 16 \
    --new-tokens 256 "$@" 2>&1 | grep -v -E "NumbaPerformanceWarning|warn\("; }
[ "${PEERS:-0}" = 1 ] && peers=--peers || peers=--no-peers
bench --decode-weights bf16 $peers > "$log_dir/bench_bf16.log"
for w in int8 int4; do bench --decode-weights $w --no-peers > "$log_dir/bench_$w.log"; done
# the decoding ops' kernels on this GPU against the CPU's and the float64 reference (quantized samples included)
$NE gradcheck --op norm_linear --op linear_residual --op norm_swiglu > "$log_dir/gradcheck.log" 2>&1
$NE gradcheck --precision bf16 --op norm_linear --op linear_residual --op norm_swiglu >> "$log_dir/gradcheck.log" 2>&1
for bits in 8 4; do
    $NE quantize "$run_dir" "$run_dir-q$bits" --bits $bits > "$log_dir/quantize_$bits.log" 2>&1
    $NE generate "$run_dir-q$bits" "def " --max-new-tokens 64 --temperature 0 --backend cuda \
        >> "$log_dir/quantize_$bits.log" 2>&1
done

{
    cat "$log_dir/gpu.txt"
    cat "$log_dir/products.log"
    for w in bf16 int8 int4; do
        echo "--- decoding weights $w"
        grep -hE "^(nanoeuler|torch|bandwidth|speculative:|default:|ratio)" "$log_dir/bench_$w.log"
    done
    echo "--- gradcheck"; grep -vE "^  " "$log_dir/gradcheck.log" | tail -n 12
    for bits in 8 4; do echo "--- quantize --bits $bits"; tail -n 3 "$log_dir/quantize_$bits.log"; done
    echo "--- plain decoding at batch 1, tokens/s"
    plain() { awk '/^nanoeuler plain/ {print $3; exit}' "$log_dir/bench_$1.log"; }
    bf16=$(plain bf16)
    for w in bf16 int8 int4; do
        awk -v w="$w" -v t="$(plain $w)" -v b="$bf16" \
            'BEGIN { if (t > 0 && b > 0) printf "%s %s (%.2fx bf16)\n", w, t, t / b; else print w, "failed" }'
    done
} > "$log_dir/summary.txt"
cat "$log_dir/summary.txt"
