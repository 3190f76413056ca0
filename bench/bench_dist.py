"""The data-parallel training step, timed: one optimizer step (every micro-batch, the gradients
summed over the ranks, AdamW) of the captured TrainStep.

Run it under mpiexec, one rank per GPU (or CPU share):

    mpiexec -n 1 python bench/bench_dist.py --variant plain       # no communicator: the 1-GPU step
    mpiexec -n 2 python bench/bench_dist.py --variant allreduce   # NCCL (cuda) / MPI (cpu) all-reduce in the step
    mpiexec -n 2 python bench/bench_dist.py --variant zero        # ZeRO-1: moments sharded over the ranks
    mpiexec -n 2 python bench/bench_dist.py --variant zero2       # ZeRO-2: and the summed gradients

Options: --preset gpu --backend cuda --batch-size 32 --grad-accum 1 --steps 20 --warmup 3
[--precision fp32|tf32|bf16] [--no-overlap: sum the gradients after the backward, not during it]
[--grad-reduce fp32|bf16: what the sums travel in].
The batches come from (seed, step, row), as in training, from a random token stream, so runs of
different shapes see the same rows (the PyTorch DDP peer, bench/torch_ddp.py, draws the same).
Several variants, grad-accums or grad-reduces (comma-separated) run one after the other in the same
processes (one start-up and NCCL communicator for all; the memory figure is then the largest so
far). Rank 0 prints one JSON line per configuration: median ms per step, tokens/s in all and per rank, device memory in
use per rank (GPU) or peak RSS (CPU), the bytes each rank holds (`held_bytes_per_rank`: parameters,
gradients, optimizer state, the bf16 copy of the sums; Optimizer.memory), the exposed communication (the median over the steps of the
time from the end of the backward to the end of the last sum: CUDA events inside the captured
step on a GPU, the wall clock on the CPU, where MPI sums block; rank 0's, and the largest rank's),
and the loss and gradient norm of every step (to compare variants: they must agree).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from nanoeuler_core.bench.measure import memory_mb
from nanoeuler_core.corpus.tokens import BatchLoader
from nanoeuler_core.engine.config import ModelConfig
from nanoeuler_core.engine.model import Model
from nanoeuler_core.engine.optim import AdamW
from nanoeuler_core.training import distributed
from nanoeuler_core.training.step import TrainStep


ZERO_LEVEL = {"plain": 0, "allreduce": 0, "zero": 1, "zero2": 2}   # variant -> --zero


def batches(cfg, batch_size: int, grad_accum: int, rank: int):
    """Step s's micro-batches of this rank: rows from (seed 0, s, part) of a random token stream."""
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 2_000_000).astype(np.uint16)
    loader = BatchLoader(tokens, batch_size, cfg.ctx_len, seed=0)
    parts = range(rank * grad_accum, (rank + 1) * grad_accum)
    return lambda step: [loader.batch(step, p) for p in parts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="allreduce", help="plain, allreduce, zero (ZeRO-1) or zero2 (ZeRO-2); "
                                                               "several: comma-separated")
    parser.add_argument("--preset", default="gpu")
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per micro-batch, on each rank")
    parser.add_argument("--grad-accum", default="1", help="micro-batches per step; several: comma-separated")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--precision", default=None, help="fp32, tf32 or bf16 (default: the backend's)")
    parser.add_argument("--no-overlap", dest="overlap", action="store_false",
                        help="sum the gradients after the backward instead of during it")
    parser.add_argument("--grad-reduce", default="fp32", help="what the sums travel in: fp32 or bf16; several: "
                                                              "comma-separated")
    args = parser.parse_args()

    job = distributed.world()
    variants = args.variant.split(",")
    if not set(variants) <= set(ZERO_LEVEL):
        raise SystemExit(f"--variant takes {', '.join(ZERO_LEVEL)}, got {args.variant}")
    if "plain" in variants and job.size > 1:
        raise SystemExit("--variant plain runs one rank (mpiexec -n 1)")
    job.prepare(args.backend)
    for variant in variants:
        for accum in map(int, args.grad_accum.split(",")):
            for grad_reduce in args.grad_reduce.split(",") if variant != "plain" else ["fp32"]:
                measure(args, job, variant, accum, grad_reduce)


def measure(args, job, variant: str, grad_accum: int, grad_reduce: str) -> None:
    """Time one configuration; rank 0 prints its JSON line."""
    cfg = ModelConfig.preset(args.preset)
    model = Model(cfg, backend=args.backend, seed=0, precision=args.precision)
    comm = None if variant == "plain" else job.collectives(args.backend)
    optimizer = AdamW(model, comm=comm, zero=ZERO_LEVEL[variant], overlap=args.overlap, grad_reduce=grad_reduce)
    step = TrainStep(model, optimizer)
    step_batches = batches(cfg, args.batch_size, grad_accum, job.rank)

    times, exposed, history, memory = [], [], [], 0.0
    for i in range(args.warmup + args.steps):
        micro = step_batches(i + 1)
        job.barrier()  # every rank starts the step together: the time is the step's, not a rank's lag
        t = time.perf_counter()
        loss, norm = step.micro_batches(micro, 1e-4)  # returns once the step is done (host copies)
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
            if comm is not None:
                exposed.append(comm.exposed_ms())
        history.append((round(loss, 6), round(norm, 6)))
        memory = max(memory, memory_mb(model.backend))
    memory_by_rank = job.allgather(memory)
    exposed_by_rank = job.allgather(statistics.median(exposed) if exposed else None)
    seconds = statistics.median(times)
    tokens_per_step = job.size * grad_accum * args.batch_size * cfg.ctx_len
    if job.rank == 0:
        print(json.dumps({
            "engine": "nanoeuler", "variant": variant, "overlap": args.overlap and comm is not None,
            "ranks": job.size, "preset": args.preset, "backend": args.backend, "device": model.backend.device_name(),
            "batch_size": args.batch_size, "grad_accum": grad_accum, "precision": model.precision.name,
            "grad_reduce": grad_reduce if comm is not None else None, "ms_per_step": round(seconds * 1e3, 2),
            "exposed_comm_ms": None if comm is None else round(exposed_by_rank[0], 3),
            "exposed_comm_ms_max_rank": None if comm is None else round(max(exposed_by_rank), 3),
            "tokens_per_s": round(tokens_per_step / seconds),
            "tokens_per_s_per_rank": round(tokens_per_step / seconds / job.size),
            "memory_gb_by_rank": [round(m * 2**20 / 1e9, 3) for m in memory_by_rank],
            "held_bytes_per_rank": optimizer.memory(),
            "loss_and_norm": history}), flush=True)


if __name__ == "__main__":
    with distributed.fail_together():
        main()
