"""The data-parallel training step, timed: one optimizer step (every micro-batch, the gradient
all-reduce or ZeRO-1's reduce-scatter and all-gather, AdamW) of the captured TrainStep.

Run it under mpiexec, one rank per GPU (or CPU share):

    mpiexec -n 1 python bench/bench_dist.py --variant plain       # no communicator: today's step
    mpiexec -n 1 python bench/bench_dist.py --variant allreduce   # NCCL (cuda) / MPI (cpu) all-reduce in the step
    mpiexec -n 2 python bench/bench_dist.py --variant zero        # ZeRO-1: moments sharded over the ranks

Options: --preset gpu --backend cuda --batch-size 32 --grad-accum 1 --steps 20 --warmup 3 [--precision fp32|tf32|bf16].
The batches come from (seed, step, row), as in training, from a random token stream, so runs of
different shapes see the same rows. Rank 0 prints one JSON line: median ms per step, tokens/s in
all and per rank, device memory in use per rank (GPU) or peak RSS (CPU), and the loss and
gradient norm of every step (to compare variants: they must agree).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import numpy as np

from nanoeuler_core.corpus.tokens import BatchLoader
from nanoeuler_core.engine.config import ModelConfig
from nanoeuler_core.engine.model import Model
from nanoeuler_core.engine.optim import AdamW, TrainStep
from nanoeuler_core.training import distributed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=("plain", "allreduce", "zero"), default="allreduce")
    parser.add_argument("--preset", default="gpu")
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per micro-batch, on each rank")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--precision", default=None, help="fp32, tf32 or bf16 (default: the backend's)")
    args = parser.parse_args()

    job = distributed.world()
    if args.variant == "plain" and job.size > 1:
        raise SystemExit("--variant plain runs one rank (mpiexec -n 1)")
    job.prepare(args.backend)
    cfg = ModelConfig.preset(args.preset)
    model = Model(cfg, backend=args.backend, seed=0, precision=args.precision)
    comm = None if args.variant == "plain" else job.collectives(args.backend)
    step = TrainStep(model, AdamW(model, comm=comm, zero=args.variant == "zero"))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 2_000_000).astype(np.uint16)
    loader = BatchLoader(tokens, args.batch_size, cfg.ctx_len, seed=0)
    parts = range(job.rank * args.grad_accum, (job.rank + 1) * args.grad_accum)

    times, history, memory = [], [], 0
    for i in range(args.warmup + args.steps):
        batches = [loader.batch(i + 1, p) for p in parts]
        job.barrier()  # every rank starts the step together: the time is the step's, not a rank's lag
        t = time.perf_counter()
        loss, norm = step.micro_batches(batches, 1e-4)  # returns once the step is done (host copies)
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
        history.append((round(loss, 6), round(norm, 6)))
        if args.backend == "cuda":
            from numba import cuda

            free, total = cuda.current_context().get_memory_info()
            memory = max(memory, total - free)
    memory = memory or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    memory_by_rank = job.allgather(memory)
    seconds = statistics.median(times)
    tokens_per_step = job.size * args.grad_accum * args.batch_size * cfg.ctx_len
    if job.rank == 0:
        print(json.dumps({
            "variant": args.variant, "ranks": job.size, "preset": args.preset, "backend": args.backend,
            "batch_size": args.batch_size, "grad_accum": args.grad_accum, "precision": model.precision,
            "ms_per_step": round(seconds * 1e3, 2), "tokens_per_s": round(tokens_per_step / seconds),
            "tokens_per_s_per_rank": round(tokens_per_step / seconds / job.size),
            "memory_gb_by_rank": [round(m / 1e9, 3) for m in memory_by_rank],
            "loss_and_norm": history}), flush=True)


if __name__ == "__main__":
    with distributed.fail_together():
        main()
