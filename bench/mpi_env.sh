# Sourced by the GPU scripts. Sets $mpiexec, the launcher on PATH (pip's mpich installed with
# --target puts it there) or beside this Python, and exports MPI4PY_LIBMPI as that launcher's own
# libmpi: mpi4py otherwise loads the first MPI it finds on the machine, and under another MPI's
# launcher every process would see a job of one (nanoeuler stops with an error then).
mpiexec=$(command -v mpiexec || echo "$(python3 -c "import sysconfig; print(sysconfig.get_path('scripts'))")/mpiexec")
libmpi=$(dirname "$(dirname "$(readlink -f "$mpiexec")")")/lib/libmpi.so.12
if [ -z "${MPI4PY_LIBMPI:-}" ] && [ -f "$libmpi" ]; then export MPI4PY_LIBMPI=$libmpi; fi
