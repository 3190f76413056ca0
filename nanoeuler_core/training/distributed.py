"""Data-parallel training across processes: ranks from MPI, gradients summed by MPI or NCCL.

    mpiexec -n 4 nanoeuler-run pretrain --backend cuda ...

Each process (rank) holds the whole model. A step's global batch is ranks x micro-batches x
--batch-size rows; rank r computes micro-batches r*K .. r*K + K - 1 of it and its gradients are
summed in the model's buffer (nanoeuler_core.engine.optim); the optimizer then sums them over the
ranks with the backend's collectives: MPI (mpi4py) all-reduces the host buffer for the CPU
backends, NCCL (nccl4py) the device buffer for the CUDA backend, on the stream being captured, so
the all-reduce is part of the step's CUDA graph. Before anything else, each rank claims its share
of the machine from the backend (one GPU per rank, by local rank; or its share of the cores) and
the ranks check that no two of them drive the same device. With ZeRO-1 (--zero 1) the gradients
are reduce-scattered, each rank updates its shard of the parameters with its shard of the AdamW
moments, and the shards are all-gathered; with ZeRO-2 (--zero 2) each rank keeps only its shard of
the summed gradients as well. With --grad-reduce bf16 the sums travel in bfloat16.

Started without mpiexec, everything runs as one process and nothing here imports MPI.

Failure: with MPICH, mpiexec ends the whole job as soon as one rank exits abnormally. A rank that
meets an error prints it and leaves at once, without the MPI finalisation that would wait for the
others (`fail_together`); the other ranks print nothing of the same error (rank 0 reports it),
so a failure every rank shares gives one line. A rank waiting on one that hangs stops after
NANOEULER_DIST_TIMEOUT seconds without progress (`Watchdog`). Checkpoints are written by rank 0
alone, atomically, so a job killed at any moment leaves the last one intact.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

from nanoeuler_core import registry
from nanoeuler_core.collectives import Collectives
from nanoeuler_core.errors import USER_ERRORS, one_line

# Set in every process that mpiexec starts: MPICH (Hydra) and Intel MPI, Open MPI, PMIx launchers.
LAUNCHER_SIZE_ENV = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")
LAUNCHER_RANK_ENV = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
TIMEOUT_ENV = "NANOEULER_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0   # a step, an evaluation and a checkpoint must fit in it
REPORT_DELAY_S = 3.0        # ranks other than 0 wait this long before reporting an error (see fail_together)
INSTALL_HINT = "pip install 'nanoeuler[dist]'"


def launched_by_mpiexec() -> bool:
    return any(name in os.environ for name in LAUNCHER_SIZE_ENV)


def _launcher_value(names: tuple[str, ...], default: int) -> int:
    """This process's rank or job size as the launcher's environment gives it."""
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    return default


def _launcher_rank() -> int:
    """This process's rank as the launcher's environment gives it (0 without a launcher)."""
    return _launcher_value(LAUNCHER_RANK_ENV, 0)


@dataclass
class World:
    """The ranks of this job. `mpi` is mpi4py's COMM_WORLD, or None for one process without mpiexec."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0   # among the ranks on this machine: which GPU this rank drives
    local_size: int = 1
    mpi: object = None
    _collectives: dict | None = None
    _device_ready: bool = False

    @property
    def distributed(self) -> bool:
        return self.mpi is not None

    def barrier(self) -> None:
        if self.mpi is not None:
            self.mpi.Barrier()

    def any(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on any rank."""
        if self.mpi is None:
            return bool(flag)
        return bool(self.mpi.allreduce(int(bool(flag))))

    def allgather(self, obj) -> list:
        """Every rank's (small, picklable) object, in rank order."""
        return [obj] if self.mpi is None else self.mpi.allgather(obj)

    def prepare(self, backend: str) -> None:
        """Share this machine among its ranks before any model exists, as the backend does it (one
        GPU per rank, by local rank; the cores), then check that no two ranks of a machine drive
        the same device: one line naming them if they do."""
        if self.mpi is None or self._device_ready:
            return
        device = registry.backend(backend).claim_device(self.local_rank, self.local_size)
        claims = self.mpi.allgather((os.uname().nodename, device))
        for r, claim in enumerate(claims):
            if claim[1] and claim in claims[:r]:
                raise ValueError(f"ranks {claims.index(claim)} and {r} both drive the device {claim[1]} on "
                                 f"{claim[0]}: each rank needs a device of its own (CUDA_VISIBLE_DEVICES "
                                 f"lists the GPUs the ranks of a machine share out)")
        self._device_ready = True

    def collectives(self, backend: str) -> Collectives | None:
        """The gradient communicator of this job on `backend` (None for one process without mpiexec)."""
        if self.mpi is None:
            return None
        self.prepare(backend)
        self._collectives = self._collectives or {}
        if backend not in self._collectives:
            self._collectives[backend] = registry.backend(backend).collectives(self.mpi)
        return self._collectives[backend]


_WORLD: World | None = None


def world() -> World:
    """The job's ranks: from MPI when mpiexec started this process, else one process (rank 0 of 1)."""
    global _WORLD
    if _WORLD is None:
        _WORLD = _init_world() if launched_by_mpiexec() else World()
    return _WORLD


def _init_world() -> World:
    try:
        with warnings.catch_warnings():  # mpi4py's warning of a foreign launcher: the check below says more
            warnings.simplefilter("ignore", RuntimeWarning)
            from mpi4py import MPI
    except ImportError:
        raise ValueError(f"started by mpiexec, but mpi4py is not installed: {INSTALL_HINT}") from None
    comm = MPI.COMM_WORLD
    launched = _launcher_value(LAUNCHER_SIZE_ENV, 1)
    if launched > 1 and comm.Get_size() == 1:
        # Each process would train alone as rank 0, all writing the same run directory.
        library = " ".join(MPI.Get_library_version().split("\n")[0].split())
        raise ValueError(f"mpiexec started {launched} processes but MPI sees a job of {comm.Get_size()}: mpi4py "
                         f"loaded another MPI library ({library}) than the launcher's; run the mpiexec of that "
                         "library, or set MPI4PY_LIBMPI to the launcher's libmpi")
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    return World(rank=comm.Get_rank(), size=comm.Get_size(), local_rank=local.Get_rank(),
                 local_size=local.Get_size(), mpi=comm)


def memory_line(model, optimizer) -> str:
    """What each rank holds (Optimizer.memory): parameters, gradients (with ZeRO-2 a few buckets
    and its shard), optimizer state (its share where sharded), the bf16 copy the sums travel in,
    and, on GPUs, the device memory in use on each rank's GPU. Every rank must call it."""
    held = optimizer.memory()
    line = (f"memory per rank: parameters {held['parameters'] / 1e6:,.1f} MB, gradients {held['gradients'] / 1e6:,.1f} "
            f"MB, optimizer state {held['optimizer_state'] / 1e6:,.1f} MB"
            + (f" ({optimizer.sharded})" if optimizer.sharded else ""))
    if held["bf16_sums"]:
        line += f", bf16 gradients for the sums {held['bf16_sums'] / 1e6:,.1f} MB"
    in_use = world().allgather(model.backend.memory_in_use())
    if in_use[0] is not None:
        line += "; device memory in use " + ", ".join(f"{b / 1e9:.2f}" for b in in_use) + " GB (by rank)"
    return line


# ------------------------------------------------------------------------------------------------
# failure


@contextmanager
def fail_together():
    """In a job of several ranks, end this rank at once on an error: one line for a user's error
    (the traceback for anything else), then exit 1 without MPI's finalisation, which would wait
    forever for ranks blocked in a collective; mpiexec then stops the others. Ranks other than 0
    hold their report for a moment, so an error they all meet is reported once, by rank 0.

    One process without mpiexec: errors pass through unchanged.
    """
    try:
        yield
    except (Exception, KeyboardInterrupt) as exc:
        # the launcher's word where MPI did not start (mpi4py missing)
        size = _WORLD.size if _WORLD is not None else _launcher_value(LAUNCHER_SIZE_ENV, 1)
        if size <= 1:
            raise
        rank = _WORLD.rank if _WORLD is not None else _launcher_rank()
        user_error = isinstance(exc, USER_ERRORS)
        if isinstance(exc, KeyboardInterrupt):
            message = "interrupted twice: stopping at once"
        elif user_error and not os.environ.get("NANOEULER_DEBUG"):
            message = one_line(exc)
        else:
            message = "".join(traceback.format_exception(exc)).rstrip()
        if rank != 0:
            if _WORLD is None:  # MPI did not start: mpiexec will not stop the others; rank 0 speaks for all
                os._exit(1)
            time.sleep(REPORT_DELAY_S)
        print(f"error: {message}" if rank == 0 else f"error: rank {rank}: {message}", file=sys.stderr, flush=True)
        os._exit(130 if isinstance(exc, KeyboardInterrupt) else 1)


class Watchdog:
    """Ends this rank if the training loop makes no progress for `timeout` seconds: a rank
    waiting in a collective for one that hangs (or died under a launcher that does not stop the
    job) would otherwise wait forever. Until the first beat the allowance is DEFAULT_TIMEOUT_S at
    least: the first step compiles the kernels, which on a busy machine outlasts a short timeout."""

    def __init__(self, job: World, what: str, timeout: float | None = None):
        self.job, self.what = job, what
        self.timeout = timeout if timeout is not None else float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
        self.last = time.monotonic()
        self.beaten = False
        self.note = ""  # where things stand (the last checkpoint), for the report
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="nanoeuler-watchdog")

    def __enter__(self) -> "Watchdog":
        if self.job.distributed:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def beat(self) -> None:
        """Progress: the countdown starts again."""
        self.last, self.beaten = time.monotonic(), True

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            allowance = self.timeout if self.beaten else max(self.timeout, DEFAULT_TIMEOUT_S)
            if time.monotonic() - self.last > allowance:
                rank = f"rank {self.job.rank}: " if self.job.rank else ""
                print(f"error: {rank}{self.what} made no progress for {self.timeout:.0f} s (another rank died or hangs); "
                      f"stopping{self.note}", file=sys.stderr, flush=True)
                os._exit(1)
