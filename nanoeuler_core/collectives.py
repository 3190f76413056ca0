"""Communication among data-parallel ranks: the interface the optimizer uses, and its MPI
implementation on host arrays (the CPU backends). A backend with device memory supplies its own
(`Backend.collectives`: NCCL for CUDA); the engine knows only this interface.

The `*_async` calls start a collective that may overlap the work queued after it (the rest of
the backward pass): the CUDA backend runs them on a stream of their own, inside the captured
training step; `wait()` makes the work queued after it see every started collective's result.
Ranks must start collectives in the same order. On host arrays they simply run at once."""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from nanoeuler_core.registry import bf16_bits, bf16_values


class Collectives(Protocol):
    """Communication among `size` data-parallel ranks, this one being `rank`.

    Backend arrays are flat and reduced in place; `shard(n)` is the slice [lo, hi) of an n-long
    buffer that this rank owns (n must be a multiple of size).
    """

    rank: int
    size: int

    def all_reduce_sum(self, buf) -> None:
        """buf <- the sum of every rank's buf."""

    def reduce_scatter_sum(self, buf) -> None:
        """buf[lo:hi] <- the sum of every rank's buf[lo:hi], for this rank's shard; the rest of buf is left undefined."""

    def all_gather(self, buf) -> None:
        """buf[shard of rank r] <- rank r's buf[shard of rank r], for every r."""

    def all_reduce_sum_async(self, buf, wire=None) -> None:
        """Start buf <- the sum of every rank's buf; complete once `wait()` returns. With `wire`, a
        bf16 buffer of buf's size, the sum travels in bfloat16 (see the module docstring)."""

    def reduce_sum_async(self, buf, root: int, wire=None, into=None) -> None:
        """Start buf <- the sum of every rank's buf on rank `root` (buf is undefined elsewhere), and
        with `into` (given on `root` alone: an array of buf's size) into <- into + that sum; complete
        once `wait()` returns. `wire` as for `all_reduce_sum_async`."""

    def wait(self) -> None:
        """Work queued after this call sees the results of every collective started before it."""

    def mark(self, marker=None):
        """A marker of the collectives started so far (`marker` recorded again, or a new one), for
        `wait_for`."""

    def wait_for(self, marker) -> None:
        """Work queued after this call sees the results of the collectives started before `marker`
        was recorded (ZeRO-2 reuses a bucket's memory once its sums are done), not of later ones."""

    def backward_done(self) -> None:
        """The backward pass has ended (as queued): `exposed_ms` counts from here."""

    def exposed_ms(self) -> float:
        """Milliseconds from the last `backward_done` to the end of the last `wait`: the time the
        step spent waiting for its sums after the backward (read after the step has run)."""

    def host_sum(self, values: np.ndarray) -> np.ndarray:
        """The sum over the ranks of a small host array."""

    def host_concat(self, values: np.ndarray) -> np.ndarray:
        """Every rank's host array, concatenated in rank order (on every rank)."""


def shard(n: int, rank: int, size: int) -> tuple[int, int]:
    """The slice [lo, hi) of an n-long buffer that `rank` of `size` owns."""
    per_rank = n // size
    return rank * per_rank, (rank + 1) * per_rank


class MpiCollectives:
    """Collectives over MPI (mpi4py) on host (NumPy) arrays. Every sum blocks until it is done, so
    none overlaps the backward: the exposed time counts the sums started during the backward too."""

    def __init__(self, comm):
        from mpi4py import MPI

        self.comm, self.MPI = comm, MPI
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._backward_done = 0.0
        self._during_backward = 0.0   # seconds in the sums started before `backward_done`
        self._exposed = 0.0

    def all_reduce_sum(self, buf) -> None:
        self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)

    def reduce_scatter_sum(self, buf) -> None:
        lo, hi = shard(buf.size, self.rank, self.size)
        mine = np.empty(hi - lo, dtype=buf.dtype)  # MPI forbids a receive buffer inside the send buffer
        self.comm.Reduce_scatter_block(buf, mine, op=self.MPI.SUM)
        buf[lo:hi] = mine

    def all_gather(self, buf) -> None:
        self.comm.Allgather(self.MPI.IN_PLACE, buf)

    def all_reduce_sum_async(self, buf, wire=None) -> None:
        start = time.perf_counter()
        if wire is not None:
            self._bf16_sum(buf, None)
        else:
            self.all_reduce_sum(buf)
        self._count(start)

    def reduce_sum_async(self, buf, root: int, wire=None, into=None) -> None:
        start = time.perf_counter()
        if wire is not None:
            self._bf16_sum(buf, root)
        elif self.rank == root:
            self.comm.Reduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM, root=root)
        else:
            self.comm.Reduce(buf, None, op=self.MPI.SUM, root=root)
        if into is not None:
            into += buf
        self._count(start)

    def wait(self) -> None:
        if self._backward_done:
            self._exposed = self._during_backward + time.perf_counter() - self._backward_done
        self._backward_done = self._during_backward = 0.0

    def mark(self, marker=None):
        return None   # every sum is done when its call returns

    def wait_for(self, marker) -> None:
        pass

    def backward_done(self) -> None:
        self._backward_done = time.perf_counter()

    def exposed_ms(self) -> float:
        return self._exposed * 1e3

    def _count(self, start: float) -> None:
        """A sum started during the backward held it up this long."""
        if not self._backward_done:
            self._during_backward += time.perf_counter() - start

    def _bf16_sum(self, buf, root: int | None) -> None:
        """buf <- every rank's buf rounded to bf16, summed in float32, rounded to bf16 (on `root`
        alone, or on every rank for None)."""
        bits = bf16_bits(buf)
        every = np.empty((self.size, bits.size), dtype=np.uint16) if root in (None, self.rank) else None
        if root is None:
            self.comm.Allgather(bits, every)
        else:
            self.comm.Gather(bits, every, root=root)
        if every is not None:
            total = np.zeros(bits.size, dtype=np.float32)
            for part in every:   # in rank order: the same sum on every rank
                total += bf16_values(part)
            buf[:] = bf16_values(bf16_bits(total))

    def host_sum(self, values: np.ndarray) -> np.ndarray:
        values = np.ascontiguousarray(values)
        total = np.empty_like(values)
        self.comm.Allreduce(values, total, op=self.MPI.SUM)
        return total

    def host_concat(self, values: np.ndarray) -> np.ndarray:
        values = np.ascontiguousarray(values)
        out = np.empty(self.size * values.size, dtype=values.dtype)
        self.comm.Allgather(values, out)
        return out
