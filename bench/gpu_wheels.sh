#!/usr/bin/env bash
# Download, on a machine with a package registry, the wheels an offline GPU machine needs to run
# nanoeuler (Python 3.12, x86-64 Linux, CUDA 13), into .whl/ at the root of this checkout. Carry the
# checkout there with .whl/ in it; bench/gpu_env.sh (which most GPU scripts source) installs them.
#   bash bench/gpu_wheels.sh                  # one GPU
#   bash bench/gpu_wheels.sh --dist           # several GPUs too: MPI and NCCL (mpiexec, data parallel)
#   bash bench/gpu_wheels.sh [--dist] PACKAGE==VERSION... # and wheels of anything else the machine's Python lacks
# numpy is held at 2.4: numba-cuda 0.30.4 fails to compile any kernel under numpy 2.5 (it calls
# np.row_stack, which 2.5 removed). docs/gpu-setup.md says what each wheel is for.
set -euo pipefail
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
specs=("numpy==2.4.6" "numba==0.68.1" "numba-cuda==0.30.4" "nvmath-python==1.0.0" "orjson" "starlette==1.10.0" "uvicorn==0.54.0" "gguf==0.19.0" "pyyaml==6.0.3" "llguidance==1.9.1" "prometheus_client==0.26.0")
if [ "${1:-}" = "--dist" ]; then
    shift
    specs+=("mpich==5.0.2" "mpi4py==4.1.2" "nccl4py==0.6.0" "cuda-core==1.2.2" "cuda-pathfinder==1.9.1")
fi
specs+=("$@")
mkdir -p .whl   # ignored by git (.gitignore)
platforms=()
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform any -d .whl "${specs[@]}"
ls -1 .whl
du -sh .whl
echo "Keep one version of each package in .whl/: pip refuses to install two. On the GPU machine, from" \
     "this checkout's root: source bench/gpu_env.sh (docs/gpu-setup.md)."
