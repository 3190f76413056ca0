# Sourced by the GPU scripts (bench/run_gpu*.sh): makes a fresh GPU machine ready on the first try.
#
# On a machine with NVIDIA GPUs and the wheels in .whl/ (bench/gpu_wheels.sh fills it on a machine with a
# package registry; this one reaches none), they and the project go into a virtual environment at
# $NE_VENV (/tmp/ne-venv) that also sees the image's own packages (torch, llvmlite, cuda-bindings):
# `pip install --target` would keep MPICH's mpiexec but drop its libmpi, and mpi4py would then load
# another MPI, where every process is a job of one. Elsewhere the current Python is used as it is.
# Then: $mpiexec is the launcher that belongs to mpi4py's MPI (MPI4PY_LIBMPI names its libmpi),
# and NVLink multicast stays off (a program using it on a shared machine can take its GPUs down).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NE_VENV=${NE_VENV:-/tmp/ne-venv}
if compgen -G "$_root/.whl/*.whl" > /dev/null && command -v nvidia-smi > /dev/null; then
  if [ ! -f "$NE_VENV/installed" ]; then   # --ignore-installed: the image's own numba-cuda must not stand in
    rm -rf "$NE_VENV"
    _site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
    python3 -m venv --system-site-packages "$NE_VENV" || return 1
    echo "$_site" > "$("$NE_VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')/image_site.pth"
    "$NE_VENV/bin/python" -m pip install -q --no-index --no-deps --no-build-isolation --ignore-installed \
        "$_root"/.whl/*.whl || return 1
    touch "$NE_VENV/installed"
  fi
  # the project again whenever its sources differ from those installed (a machine kept warm between
  # calls gets each call's tree)
  _sources=$(cd "$_root" && find nanoeuler_core ops data plugins pyproject.toml -type f \
      \( -name '*.py' -o -name '*.toml' -o -name '*.html' -o -name '*.json' \) -print0 | sort -z | xargs -0 cat | md5sum)
  if [ "$_sources" != "$(cat "$NE_VENV/sources" 2>/dev/null)" ]; then
    "$NE_VENV/bin/python" -m pip install -q --no-index --no-deps --no-build-isolation --force-reinstall "$_root" || return 1
    echo "$_sources" > "$NE_VENV/sources"
  fi
  source "$NE_VENV/bin/activate"
fi
mpiexec=$(command -v mpiexec || echo "$(python3 -c "import sysconfig; print(sysconfig.get_path('scripts'))")/mpiexec")
_libmpi=$(dirname "$(dirname "$(readlink -f "$mpiexec")")")/lib/libmpi.so.12
if [ -z "${MPI4PY_LIBMPI:-}" ] && [ -f "$_libmpi" ]; then export MPI4PY_LIBMPI=$_libmpi; fi
