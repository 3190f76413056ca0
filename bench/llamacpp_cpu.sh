#!/usr/bin/env bash
# CPU decoding speed, nanoeuler against llama.cpp, on THREADS cores (default: all) of a machine
# that reaches no network: builds llama.cpp's llama-bench from a source tarball (CMake, Release,
# -march=native), writes SmolLM2-135M-shaped GGUF files with random weights (bench/smol_gguf.py:
# Q4_1 block matrices with a Q8_0 token_embd, and Q8_0 throughout), imports each as a nanoeuler run
# (int4 and int8 decoding weights, the files' own blocks), and times a 128-token prompt and 128 new
# tokens in each tool. Run from the project's root with .whl/ beside it (bench/gpu_env.sh):
#   bash bench/llamacpp_cpu.sh LLAMA_SRC_TARBALL LOG_DIR [THREADS]
# Logs: LOG_DIR/*.log, and LOG_DIR/summary.txt: each tool's tokens/s per file, and nanoeuler's over
# llama.cpp's. SMOL_SHAPE=tiny times a few-layer model instead (a quick check of the script).
set -uo pipefail
fail() { echo "error: $*" >&2; exit 1; }
[ $# -ge 2 ] && [ $# -le 3 ] || { echo "usage: bash bench/llamacpp_cpu.sh LLAMA_SRC_TARBALL LOG_DIR [THREADS]" >&2; exit 1; }
[ -f "$1" ] || fail "$1 not found (the llama.cpp source tarball)"
tarball=$(readlink -f "$1")
threads=${3:-$(nproc)}
[[ "$threads" =~ ^[1-9][0-9]*$ ]] || fail "THREADS must be a positive number, got '$threads'"
cd "$(dirname "$0")/.."
for tool in cmake c++ make; do
    command -v $tool > /dev/null || fail "$tool not found: building llama-bench needs it"
done
source bench/gpu_env.sh || fail "the Python environment could not be set up (bench/gpu_env.sh)"
mkdir -p "$2"
log_dir=$(cd "$2" && pwd)
work=/tmp/nanoeuler-llamacpp   # the build folder is kept: a second run on the same tarball rebuilds nothing
machine="$(lscpu | grep 'Model name' | sed 's/  */ /g'), nproc $(nproc), $threads threads used"
echo "$machine"

rm -rf "$work/src" "$work/gguf" "$work/runs"
mkdir -p "$work/src"
tar -xzf "$tarball" -C "$work/src" 2> /dev/null || fail "cannot unpack $tarball"
src=$(dirname "$(find "$work/src" -maxdepth 3 -path '*/include/llama.h' | head -n 1)")
src=${src%/include}
[ -f "$src/CMakeLists.txt" ] || fail "$tarball holds no llama.cpp source (include/llama.h beside CMakeLists.txt)"
echo "building llama-bench ($log_dir/build.log)"
{ cmake -B "$work/build" -S "$src" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
      -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
      -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON \
  && cmake --build "$work/build" -j"$(nproc)" --target llama-bench; } > "$log_dir/build.log" 2>&1 \
  || fail "llama-bench did not build (see $log_dir/build.log)"
llama_bench=$work/build/bin/llama-bench

python3 bench/smol_gguf.py "$work/gguf" --shape "${SMOL_SHAPE:-smollm2-135m}" > "$log_dir/gguf.log" 2>&1 \
    || fail "the GGUF files were not written (see $log_dir/gguf.log)"
variants=(q4_1 q8_0)
for v in "${variants[@]}"; do
    python3 -m nanoeuler_core.cli import "$work/gguf/smol-$v.gguf" "$work/runs/$v" > "$log_dir/import_$v.log" 2>&1 \
        || fail "nanoeuler could not import smol-$v.gguf (see $log_dir/import_$v.log)"
done

# tokens/s: "<prompt> <decode>" of each tool and variant, for a prompt of n tokens and n new tokens
n=128
declare -A llama ours
for v in "${variants[@]}"; do
    echo "timing smol-$v.gguf: llama.cpp, then nanoeuler"
    "$llama_bench" -m "$work/gguf/smol-$v.gguf" -t "$threads" -p $n -n $n -r 3 -o md \
        > "$log_dir/llama_$v.log" 2> "$log_dir/llama_$v.err" \
        || fail "llama-bench failed on smol-$v.gguf (see $log_dir/llama_$v.err)"
    # the t/s column of the pp<n> and tg<n> rows: "1234.56 ± 7.89"
    llama[$v]=$(awk -F'|' -v n=$n 'NF > 3 && $(NF-2) ~ "pp" n {split($(NF-1), a, " "); p = a[1]}
                                   NF > 3 && $(NF-2) ~ "tg" n {split($(NF-1), a, " "); g = a[1]}
                                   END {if (p != "" && g != "") print p, g}' "$log_dir/llama_$v.log")
    [ -n "${llama[$v]}" ] || fail "llama-bench gave no pp$n and tg$n rows (see $log_dir/llama_$v.log)"
    NUMBA_NUM_THREADS=$threads python3 -m nanoeuler_core.cli bench --generate --run "$work/runs/$v" --no-peers \
        --new-tokens $n --prefill-tokens $n --steps 3 > "$log_dir/nanoeuler_$v.log" 2>&1 \
        || fail "nanoeuler's bench failed on the run of smol-$v.gguf (see $log_dir/nanoeuler_$v.log)"
    # from the milliseconds, which carry more digits than the rounded tokens/s: "nanoeuler plain <tokens/s>
    # <ms/step> ..." and "prefill, <n>-token prompt x 1: nanoeuler plain <tokens/s> tokens/s (<ms> ms)"
    ours[$v]=$(awk -v n=$n '/^nanoeuler plain/ && $4 > 0 {g = 1000 / $4}
                            /^prefill, .*: nanoeuler plain/ {ms = $(NF - 1); sub(/^\(/, "", ms)
                                                             if (ms > 0) p = n * 1000 / ms}
                            END {if (p != "" && g != "") print p, g}' "$log_dir/nanoeuler_$v.log")
    [ -n "${ours[$v]}" ] \
        || fail "nanoeuler's bench gave no plain decoding and prefill figures (see $log_dir/nanoeuler_$v.log)"
done

{
    echo "$machine"
    echo "llama.cpp from $tarball ($(grep -o 'ggml version: .*' "$log_dir/build.log" | head -n 1 | sed 's/: / /'))"
    echo "model: bench/smol_gguf.py --shape ${SMOL_SHAPE:-smollm2-135m}, random weights; tokens/s, median of 3" \
         "(nanoeuler), mean of 3 (llama-bench)"
    for v in "${variants[@]}"; do echo "$v: nanoeuler $(grep -h '^kept quantized' "$log_dir/import_$v.log")"; done
    echo "prompt: a $n-token prompt and its first token (nanoeuler), llama-bench pp$n"
    echo "decode: $n new tokens after a 16-token prompt, its prefill included (nanoeuler), llama-bench tg$n"
    printf '%-6s %-7s %12s %12s %18s\n' file phase llama.cpp nanoeuler "nanoeuler/llama"
    for v in "${variants[@]}"; do
        read -r lp lg <<< "${llama[$v]}"
        read -r np ng <<< "${ours[$v]}"
        awk -v v="$v" -v lp="$lp" -v lg="$lg" -v np="$np" -v ng="$ng" 'BEGIN {
            printf "%-6s %-7s %12.1f %12.1f %18.2f\n", v, "prompt", lp, np, np / lp
            printf "%-6s %-7s %12.1f %12.1f %18.2f\n", v, "decode", lg, ng, ng / lg }'
    done
} > "$log_dir/summary.txt"
cat "$log_dir/summary.txt"
