#!/usr/bin/env bash
# GPU figures of bench/RESULTS.md, in stages; logs under LOG_DIR. Run from the project's root on a
# fresh GPU machine, with .whl/ beside it (bench/gpu_env.sh installs what the machine lacks).
#   bash bench/run_gpu.sh [LOG_DIR] [tests] [training] [generation] [dist]
#   tests:      every GPU test (pytest -m gpu), the tensor-core tests (CI runs them under the simulator;
#               here on the GPU), the selftest in bf16, and the bf16 training step against PyTorch
#               (bf16 autocast, eager and torch.compile), with the per-op profile
#   training:   per-kernel timings in bf16, the TF32 step, and 500 steps of bf16, fp32 and PyTorch bf16
#               from the same weights and batches
#   generation: a `gpu` model trained 300 steps (GEN_STEPS) on the bundled corpus (or CORPUS, e.g. from
#               `nanoeuler-run data python-sources`), decoding tests and the decoding benchmark
#               (batch 1 against PyTorch, 8 and 32)
#   decode:     the decoding tests, then the captured step alone at 1, 8 and 32 rows (bench/decode_step.py)
#   dist:       the NCCL communicator and the captured step with the all-reduce inside (one rank)
#   attention:  the attention tests on the GPU, its kernels against SDPA, and (where ncu runs) their hardware
#               counters
#   sizes:      the step of gpu-medium and gpu-large (context 1024) against PyTorch, with and without
#               --recompute
#   serve:      the load test of `nanoeuler-run serve` on a `gpu` model: 1, 16 and 64 streaming clients
#   cpu:        the CPU step against PyTorch on 2 of the machine's cores (taskset) and on 16, then on 16 the
#               step's matrix products one by one (alone, against OpenBLAS's threads and MKL, and inside the
#               step) and every op's scaling from 1 to 16 threads
#   startup:    seconds from `nanoeuler-run pretrain` (small, CPU, 2 cores) to the end of its first step,
#               with an empty kernel cache and then with the cache it filled
# (default: tests training generation dist; TESTS_K=expr limits the GPU tests to pytest -k expr)
set -uo pipefail
log_dir=${1:-gpu-logs}
shift || true
stages=${*:-tests training generation dist}
mkdir -p "$log_dir"
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$log_dir/gpu.txt"
quiet() { grep -v -E "NumbaPerformanceWarning|warn\(errors"; }
NE="python3 -m nanoeuler_core.cli"

for stage in $stages; do case $stage in
tests)
    # four processes at once: the GPU tests spend most of their time compiling kernels, on the CPU
    # (tests/test_tensor_cores.py runs whole: CI runs it under the simulator, here on the GPU)
    groups=("-m gpu tests/test_cuda.py" "-m gpu tests/test_cuda_model.py tests/test_model.py tests/test_eval.py tests/test_interop.py"
            "-m gpu tests/test_generate_gpu.py tests/test_generate.py tests/test_distributed.py" "tests/test_tensor_cores.py")
    for i in "${!groups[@]}"; do
        timeout 480 python3 -m pytest -q -o addopts="" ${groups[$i]} -p no:cacheprovider \
            ${TESTS_K:+-k "$TESTS_K"} -W ignore::numba.core.errors.NumbaPerformanceWarning --durations=5 \
            > "$log_dir/tests_$i.log" 2>&1 &
    done
    wait
    tail -n 20 "$log_dir"/tests_*.log
    timeout 200 $NE selftest --backend cuda --precision bf16 2>&1 | quiet | tee "$log_dir/selftest_bf16.log"
    timeout 240 $NE bench --preset gpu --backend cuda --batch-size 32 --precision bf16 --steps 20 --warmup 3 --profile \
        2>&1 | quiet | tee "$log_dir/bench_bf16.log"
    ;;
training)
    timeout 120 python3 bench/bench_kernels_cuda.py --precision bf16 2>&1 | quiet | tee "$log_dir/kernels_bf16.log"
    timeout 90 $NE bench --preset gpu --backend cuda --batch-size 32 --precision tf32 --steps 10 --warmup 3 --no-peers \
        2>&1 | quiet | tee "$log_dir/bench_tf32.log"
    timeout 240 python3 bench/loss_parity.py --preset gpu --steps 500 --batch-size 8 2>&1 | quiet | tee "$log_dir/loss_parity.log"
    ;;
generation)
    run_dir=/tmp/nanoeuler-gen/run
    rm -rf /tmp/nanoeuler-gen
    steps=${GEN_STEPS:-300}
    timeout $((120 + steps / 10)) $NE pretrain --preset gpu --backend cuda --steps "$steps" --batch-size 16 \
        ${CORPUS:+--corpus "$CORPUS"} --eval-every $((steps / 3)) --ckpt-every "$steps" --sample-prompt "ROMEO:" \
        --out "$run_dir" 2>&1 | tail -n 8 \
        | tee "$log_dir/pretrain_gpu.log"
    timeout 200 $NE bench --generate --preset gpu --backend cuda --run "$run_dir" --batch-size 1 --prompt-tokens 16 \
        --new-tokens 256 2>&1 | quiet | tee "$log_dir/generate_b1.log"
    timeout 120 $NE bench --generate --preset gpu --backend cuda --run "$run_dir" --batch-size 8 --prompt-tokens 16 \
        --new-tokens 256 --no-peers 2>&1 | quiet | tee "$log_dir/generate_b8.log"
    timeout 120 $NE bench --generate --preset gpu --backend cuda --run "$run_dir" --batch-size 32 --prompt-tokens 16 \
        --new-tokens 256 --no-peers 2>&1 | quiet | tee "$log_dir/generate_b32.log"
    timeout 200 python3 -m pytest -q -o addopts="" -m gpu tests/test_generate_gpu.py -p no:cacheprovider \
        -W ignore::numba.core.errors.NumbaPerformanceWarning 2>&1 | tail -n 8 | tee "$log_dir/generate_tests.log"
    ;;
decode)
    timeout 300 python3 -m pytest -q -o addopts="" -m gpu tests/test_generate_gpu.py -p no:cacheprovider \
        -W ignore::numba.core.errors.NumbaPerformanceWarning --durations=5 2>&1 | tail -n 14 | tee "$log_dir/decode_tests.log"
    for rows in 1 8 32; do
        timeout 120 python3 bench/decode_step.py --rows $rows 2>&1 | quiet
    done | tee "$log_dir/decode_step.log"
    ;;
dist)
    timeout 120 "$mpiexec" -n 1 python3 bench/nccl_selfcheck.py 2>&1 | quiet | tee "$log_dir/nccl_selfcheck.log"
    for variant in plain allreduce zero plain allreduce zero; do
        timeout 90 "$mpiexec" -n 1 python3 bench/bench_dist.py --variant "$variant" --batch-size 32 --steps 20 --warmup 3
    done 2>&1 | quiet | tee "$log_dir/dist_steps.jsonl"
    python3 bench/dist_compare.py steps "$log_dir/dist_steps.jsonl" | tee "$log_dir/dist_summary.txt"
    ;;
attention)
    timeout 300 python3 -m pytest -q -o addopts="" -m gpu tests/test_cuda.py -k attention -p no:cacheprovider \
        -W ignore::numba.core.errors.NumbaPerformanceWarning 2>&1 | tail -n 5 | tee "$log_dir/attention_tests.log"
    timeout 120 python3 bench/bench_kernels_cuda.py --precision bf16 --ops attention 2>&1 | quiet | tee "$log_dir/kernels_attention.log"
    if command -v ncu > /dev/null; then
        for kernel in forward dq dkdv; do
            timeout 300 ncu --clock-control none -k regex:"mma_${kernel}_kernel" -c 1 --section SpeedOfLight \
                --section Occupancy --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \
                python3 bench/bench_kernels_cuda.py --precision bf16 --ops attention > "$log_dir/ncu_attention_$kernel.log" 2>&1
        done
    fi
    ;;
sizes)
    for preset in gpu-medium gpu-large; do
        timeout 300 $NE bench --preset $preset --backend cuda --batch-size 16 --precision bf16 --steps 10 --warmup 3 \
            2>&1 | quiet | tee "$log_dir/bench_$preset.log"
        timeout 120 $NE bench --preset $preset --backend cuda --batch-size 16 --precision bf16 --steps 10 --warmup 3 \
            --recompute --no-peers 2>&1 | quiet | tee "$log_dir/bench_${preset}_recompute.log"
    done
    ;;
serve)
    run_dir=/tmp/nanoeuler-serve/run
    rm -rf /tmp/nanoeuler-serve
    timeout 120 $NE pretrain --preset gpu --backend cuda --steps 30 --batch-size 16 --eval-every 30 --ckpt-every 30 \
        --out "$run_dir" 2>&1 | tail -n 3 | tee "$log_dir/pretrain_serve.log"
    timeout 420 python3 bench/load_serve.py "$run_dir" --backend cuda --clients 1,16,64 --duration ${SERVE_SECONDS:-60} \
        --log "$log_dir/serve_server.log" 2>&1 | tee "$log_dir/serve_load.log"
    ;;
cpu)
    for threads in 2 16; do
        for preset in small cpu-medium; do   # Numba's, OpenBLAS's and PyTorch's threads: one per core given
            NUMBA_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads timeout 200 taskset -c 0-$((threads - 1)) $NE bench --preset $preset --backend cpu --steps 10 --warmup 3 \
                2>&1 | quiet | tee "$log_dir/bench_cpu_${preset}_$threads.log"
        done
    done
    export NUMBA_NUM_THREADS=16 OPENBLAS_NUM_THREADS=16
    for how in "" --in-step; do
        timeout 200 taskset -c 0-15 python3 bench/cpu_products.py --preset cpu-medium $how 2>&1 | quiet
    done | tee "$log_dir/cpu_products.log"
    timeout 300 taskset -c 0-15 python3 bench/cpu_scaling.py --preset cpu-medium 2>&1 | quiet | tee "$log_dir/cpu_scaling.log"
    unset NUMBA_NUM_THREADS OPENBLAS_NUM_THREADS
    ;;
startup)
    cache=$(mktemp -d)
    for state in cold warm; do
        rm -rf /tmp/nanoeuler-startup
        start=$(date +%s.%N)
        NUMBA_CACHE_DIR=$cache NUMBA_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 timeout 300 taskset -c 0-1 $NE pretrain \
            --steps 1 --eval-every 1 --ckpt-every 1 --out /tmp/nanoeuler-startup >> "$log_dir/startup.txt" 2>&1
        status=$?
        echo "startup $state: $(python3 -c "print(f'{$(date +%s.%N) - $start:.1f}')") s (exit $status)" | tee -a "$log_dir/startup.txt"
    done
    ;;
esac; done
