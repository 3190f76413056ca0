#!/usr/bin/env bash
# Fast generation on a GPU, in one go: the decoding tests on the GPU, the CUDA selftest
# lines of the decoding ops, a `gpu`-preset model trained 300 steps on the bundled corpus (unless
# a run directory is given), then the decoding benchmark against PyTorch (batch 1, 16-token
# prompt, 256 new tokens, greedy; then batch 8, and sampling) and a final table.
#   bash bench/run_gpu_generate.sh [RUN_DIR] [LOG_DIR]
# Needs torch for the peers (pip install 'nanoeuler[bench]'); about 10 minutes on an H200.
set -uo pipefail
run_dir=${1:-}
log_dir=${2:-gpu-logs/generate}
mkdir -p "$log_dir"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$log_dir/gpu.txt"
python3 -m pytest -q -o addopts="" -m gpu tests/test_generate_gpu.py -p no:cacheprovider 2>&1 | tee "$log_dir/gpu_tests.log"
python3 -m nanoeuler_core.cli selftest --backend cuda 2>&1 \
    | grep -E "norm_linear|norm_swiglu|linear_residual|decode_attention| sample|FAIL|selftest" | tee "$log_dir/selftest.log"
if [ -z "$run_dir" ]; then
    run_dir=$(mktemp -d /tmp/nanoeuler-gen-XXXX)/run
    python3 -m nanoeuler_core.cli pretrain --preset gpu --backend cuda --steps 300 --batch-size 16 --eval-every 100 \
        --ckpt-every 300 --out "$run_dir" 2>&1 | tail -n 6 | tee "$log_dir/pretrain.log"
fi
bench() { python3 -m nanoeuler_core.cli bench --generate --preset gpu --backend cuda --run "$run_dir" "$@"; }
bench --batch-size 1 --prompt-tokens 16 --new-tokens 256 2>&1 | tee "$log_dir/bench_b1.log"
bench --batch-size 8 --prompt-tokens 16 --new-tokens 256 2>&1 | tee "$log_dir/bench_b8.log"
bench --batch-size 1 --prompt-tokens 16 --new-tokens 256 --temperature 0.8 --no-peers 2>&1 | tee "$log_dir/bench_b1_sampling.log"
python3 -m nanoeuler_core.cli generate "$run_dir" "ROMEO:" --max-new-tokens 64 --temperature 0 --backend cuda \
    > "$log_dir/sample.txt" 2> "$log_dir/sample_stats.txt"
echo "=== summary (tokens/s; targets: plain >= 1000, speculative >= 1.5x plain, >= torch compile)"
grep -hE "passed|failed|error" "$log_dir/gpu_tests.log" | tail -n 1
grep -h "selftest" "$log_dir/selftest.log" | tail -n 1
for f in bench_b1 bench_b8 bench_b1_sampling; do
    echo "--- $f"
    grep -hE "^(nanoeuler|torch|speculative decoding|ratio)" "$log_dir/$f.log"
done
echo "--- generate (greedy, 64 tokens):"; cat "$log_dir/sample_stats.txt"
