#!/usr/bin/env bash
# The speedrun (bench/speedrun.py) on a GPU machine, in one go: build the benchmark corpus from this
# machine's Python installation (docs/corpus.md), encode it with the benchmark tokenizer
# (bench/speedrun/tokenizer.json; trained on the corpus first where it is missing), then train the
# runs, one per GPU at once (a GPU takes its runs one after another where there are more runs than
# GPUs), and report. Run from the project's root with .whl/ beside it (bench/gpu_env.sh):
#   STEPS=12000 bash bench/run_gpu_speedrun.sh LOG_DIR [NAME=CONTENDER[,ARG...] ...]
# e.g. `muon-lr-2e-3=nanoeuler-muon,--muon-lr,2e-3` (a run's own arguments come last, so they win); by default the four contenders of
# bench/speedrun.py under their own names. STEPS (12000), EVAL_EVERY (STEPS / 40), CORPUS_BYTES
# (600M) and TRAIN_ARGS (more arguments for every run) set the rest; RUN_LIMIT bounds each run (s).
# Logs: LOG_DIR/<name>.log, LOG_DIR/runs/<name>/ (metrics), LOG_DIR/report.txt and speedrun.png.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: bash bench/run_gpu_speedrun.sh LOG_DIR [NAME=CONTENDER[,ARG...] ...]" >&2; exit 1; }
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
mkdir -p "$1/runs"
log_dir=$(cd "$1" && pwd)
shift
specs=("$@")
[ ${#specs[@]} -gt 0 ] || specs=(torch-adamw=torch-adamw torch-muon=torch-muon nanoeuler-adamw=nanoeuler-adamw
                                 nanoeuler-muon=nanoeuler-muon)
steps=${STEPS:-12000}
built=/tmp/speedrun
corpus=$built/python.txt
tokenizer=bench/speedrun/tokenizer.json
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$log_dir/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$log_dir/gpu.txt"

if [ ! -f "$corpus" ]; then
    /usr/bin/time -f "corpus built in %e s" python3 -m nanoeuler_core.cli data python-sources --out "$built" \
        --max-bytes "${CORPUS_BYTES:-600M}" 2>&1 | tee "$log_dir/corpus.log" || exit 1
    cp "$built/python.json" "$log_dir/corpus_manifest.json"
fi
if [ ! -f "$tokenizer" ]; then
    mkdir -p "$(dirname "$tokenizer")"
    /usr/bin/time -f "tokenizer trained in %e s" python3 -m nanoeuler_core.cli tokenizer train "$corpus" \
        --vocab-size 4096 --sample-bytes 50000000 \
        --out "$tokenizer" 2>&1 | tee "$log_dir/tokenizer.log" || exit 1
    cp "$tokenizer" "$log_dir/tokenizer.json"
fi
/usr/bin/time -f "encoded in %e s" python3 bench/speedrun.py prepare --corpus "$corpus" --tokenizer "$tokenizer" \
    2>&1 | tee "$log_dir/prepare.log" || exit 1

gpus=$(nvidia-smi -L | wc -l)
for gpu in $(seq 0 $((gpus - 1))); do
    (
        for i in "${!specs[@]}"; do
            [ $((i % gpus)) -eq "$gpu" ] || continue
            name=${specs[$i]%%=*}
            IFS=, read -r -a args <<< "${specs[$i]#*=}"
            CUDA_VISIBLE_DEVICES=$gpu NUMBA_CACHE_DIR=/tmp/numba-cache.$gpu timeout "${RUN_LIMIT:-590}" \
                python3 bench/speedrun.py train --corpus "$corpus" --tokenizer "$tokenizer" --steps "$steps" \
                --eval-every "${EVAL_EVERY:-$((steps / 40))}" --out "$log_dir/runs/$name" ${TRAIN_ARGS:-} "${args[@]}" \
                > "$log_dir/$name.log" 2>&1
        done
    ) &
done
wait
python3 bench/speedrun.py report "$log_dir/runs" ${TARGET:+--target "$TARGET"} 2>&1 | tee "$log_dir/report.txt"
