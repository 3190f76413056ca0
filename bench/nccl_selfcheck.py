"""First thing to run on a GPU machine: nanoeuler's NCCL communicator (nccl4py) on known arrays,
launched eagerly and inside a captured CUDA graph, one rank per GPU:

    mpiexec -n 2 python bench/nccl_selfcheck.py        # (-n 1 on a single GPU)

Checks, each on every rank: each rank drives a GPU of its own; all-reduce (float32 and the
float64 the sharded AdamW uses), in-place reduce-scatter and all-gather (ZeRO-1), the bucketed
sums the training step starts during the backward (all-reduce, and reduce onto each shard's
owner, on the communication stream; a sum in bf16; ZeRO-2's reduce added into the owner's shard, its
buffer reused once a marker says its sums are done), the host sums over MPI, then the same device
collectives captured with the training step's recipe (Backend.capture) and replayed with new inputs. Prints
one line per check on rank 0, then the all-reduce bandwidth of a gradient buffer of the `gpu`
preset, and ends with "nccl self-check passed" (exit 0), or the first mismatch (exit 1).
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from nanoeuler_core import registry
from nanoeuler_core.collectives import shard
from nanoeuler_core.training import distributed


def main() -> int:
    job = distributed.world()
    job.prepare("cuda")
    from numba import cuda

    comm = job.collectives("cuda")
    be = registry.backend("cuda")
    n, size, rank = 1 << 20, job.size, job.rank  # a multiple of every rank count up to 8 and more
    ranks = np.arange(size, dtype=np.float64)[:, None]
    failures = []

    def check(what: str, got, want) -> None:
        ok = np.array_equal(np.asarray(got), np.asarray(want))
        verdicts = job.allgather(ok)
        if rank == 0:
            print(f"{'ok  ' if all(verdicts) else 'FAIL'} {what} (ranks failing: {[r for r, v in enumerate(verdicts) if not v]})",
                  flush=True)
        if not all(verdicts):
            failures.append(what)

    device = cuda.get_current_device()
    print(f"rank {rank}/{size}: local rank {job.local_rank}, {be.device_name()} {device.uuid}", flush=True)
    check("every rank drives a GPU of its own", True, len(set(job.allgather(device.uuid))) == size)

    # eager, default stream
    base = np.arange(n, dtype=np.float64) % 1000  # small integers: sums are exact in float32
    buf = cuda.to_device((base + rank).astype(np.float32))
    comm.all_reduce_sum(buf)
    check("all-reduce float32", buf.copy_to_host(), (size * base + ranks.sum()).astype(np.float32))

    sq = cuda.to_device(np.array([0.5 + rank], dtype=np.float64))
    comm.all_reduce_sum(sq)
    check("all-reduce float64 (the sum of squares of sharded AdamW)", sq.copy_to_host(), [0.5 * size + ranks.sum()])

    lo, hi = shard(n, rank, size)
    buf = cuda.to_device((base + rank).astype(np.float32))
    comm.reduce_scatter_sum(buf)
    check("reduce-scatter in place", buf.copy_to_host()[lo:hi], (size * base + ranks.sum()).astype(np.float32)[lo:hi])

    full = np.full(n, -1.0, dtype=np.float32)
    full[lo:hi] = base[lo:hi] * (rank + 1)
    buf = cuda.to_device(full)
    comm.all_gather(buf)
    want = np.concatenate([base[a:b] * (r + 1) for r, (a, b) in enumerate(shard(n, r, size) for r in range(size))])
    check("all-gather in place", buf.copy_to_host(), want.astype(np.float32))

    buf = cuda.to_device((base + rank).astype(np.float32))
    comm.all_reduce_sum_async(buf[:n // 3])   # two buckets of unequal size, then the wait
    comm.all_reduce_sum_async(buf[n // 3:])
    comm.wait()
    check("all-reduce in two buckets on the communication stream", buf.copy_to_host(),
          (size * base + ranks.sum()).astype(np.float32))

    small = np.arange(n, dtype=np.float64) % 20   # sums below 256 up to 8 ranks: exact in bf16
    buf = cuda.to_device((small + rank).astype(np.float32))
    wire = be.zeros(n, "bf16")
    comm.all_reduce_sum_async(buf, wire=wire)
    comm.backward_done()
    comm.wait()
    check("all-reduce in bf16 on the communication stream", buf.copy_to_host(),
          (size * small + ranks.sum()).astype(np.float32))
    check("the exposed time is read from CUDA events", True, comm.exposed_ms() >= 0)

    buf = cuda.to_device((base + rank).astype(np.float32))
    for owner in range(size):
        a, b = shard(n, owner, size)
        comm.reduce_sum_async(buf[a:b], owner)
    comm.wait()
    check("reduce onto each shard's owner on the communication stream", buf.copy_to_host()[lo:hi],
          (size * base + ranks.sum()).astype(np.float32)[lo:hi])

    grad_shard, slot, marker = be.zeros(hi - lo), be.zeros(n), None

    def zero_2(values: list) -> None:
        """ZeRO-2's pattern: each micro-batch's values in one slot, reused once the marker of the
        sums that read it last is reached; each part reduced onto its owner and added into its shard."""
        nonlocal marker
        for k, value in enumerate(values):
            if k:
                comm.wait_for(marker)
            be.copy_(slot, value)
            for owner in range(size):
                a, b = shard(n, owner, size)
                comm.reduce_sum_async(slot[a:b], owner, into=grad_shard if owner == rank else None)
            marker = comm.mark(marker)

    be.zero_(grad_shard)
    zero_2([(base + rank + k).astype(np.float32) for k in range(2)])
    comm.wait()
    check("ZeRO-2: two micro-batches reduced onto each shard's owner and added into its shard",
          grad_shard.copy_to_host(), (2 * (size * base + ranks.sum()) + size)[lo:hi].astype(np.float32))

    check("host sum over MPI", comm.host_sum(np.array([rank, 1])), [ranks.sum(), size])
    check("host concat over MPI", comm.host_concat(np.array([rank, rank])), np.repeat(np.arange(size), 2))

    # captured in a CUDA graph (as the training step is), replayed with new inputs
    src = cuda.to_device(np.zeros(n, dtype=np.float32))
    work = be.zeros(n)

    def step():
        be.copy_(work, src)            # a kernel on the capture stream
        comm.all_reduce_sum_async(work[n // 2:])   # NCCL on the communication stream, joined by wait()
        comm.all_reduce_sum_async(work[:n // 2])
        comm.wait()
        comm.reduce_scatter_sum(work)  # then ZeRO-1's pair, in place, on the capture stream
        comm.all_gather(work)
        be.zero_(grad_shard)           # and ZeRO-2's: the result twice into one slot, summed into the shards
        zero_2([work, work])
        comm.wait()
        return work

    replay, result = be.capture(step)
    for round_ in range(3):
        src.copy_to_device((base * (round_ + 1) + rank).astype(np.float32))
        out = replay().copy_to_host()
        expect = size * (size * base * (round_ + 1) + ranks.sum())  # all-reduce, then reduce-scatter sums again
        check(f"captured graph, replay {round_ + 1}: all-reduce, reduce-scatter, all-gather", out,
              expect.astype(np.float32))
        check(f"captured graph, replay {round_ + 1}: ZeRO-2's sums into the shards", grad_shard.copy_to_host(),
              (2 * size * expect)[lo:hi].astype(np.float32))
    grads = be.zeros(116_417_280)   # the `gpu` preset's gradient buffer, float32
    for _ in range(3):
        comm.all_reduce_sum(grads)
    be.synchronize()
    times = []
    for _ in range(10):
        job.barrier()
        t = time.perf_counter()
        comm.all_reduce_sum(grads)
        be.synchronize()
        times.append(time.perf_counter() - t)
    seconds = statistics.median(times)
    if rank == 0:
        bus = 2 * (size - 1) / size * grads.size * 4 / seconds
        print(f"all-reduce of {grads.size * 4 / 1e6:.0f} MB: {seconds * 1e3:.2f} ms, bus bandwidth {bus / 1e9:.0f} GB/s "
              f"({size} ranks)", flush=True)
        print("nccl self-check passed" if not failures else f"nccl self-check FAILED: {', '.join(failures)}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    with distributed.fail_together():
        code = main()
    sys.exit(code)
