"""The peer of bench/bench_dist.py: PyTorch DistributedDataParallel with torch.compile and bf16
autocast (fp32 master weights, fused AdamW, gradient clipping), on the same model, the same
initial weights and the same rows per GPU, one process per GPU:

    python3 -m torch.distributed.run --standalone --nproc_per_node N bench/torch_ddp.py [--batch-size 32 --steps 30 --warmup 10]
        [--grad-accum K] [--grad-reduce fp32|bf16]

or under MPICH's mpiexec, one process per GPU (the ranks from PMI_RANK, PMI_SIZE and MPI_LOCALRANKID,
the rendezvous at MASTER_ADDR:MASTER_PORT, 127.0.0.1:29500 unless set), which lets the two-host
rehearsal give each pair of ranks its own NCCL_HOSTID (bench/run_gpu_dist_multi.sh):

    mpiexec -n 2 -env NCCL_HOSTID hostA python3 bench/torch_ddp.py : -n 2 -env NCCL_HOSTID hostB python3 bench/torch_ddp.py

DDP all-reduces its gradients in 25 MB buckets during the backward, NCCL on a stream of its own,
into the gradients themselves (gradient_as_bucket_view); with --grad-reduce bf16 through its bf16
compression hook (the bucket cast to bf16, all-reduced, cast back), as nanoeuler's --grad-reduce
bf16 does. With --grad-accum K, the first K - 1 micro-batches run under no_sync().
Rank 0 prints one JSON line with the fields of bench_dist.py's ("engine": "torch-ddp").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from nanoeuler_core import Model, ModelConfig
from nanoeuler_core.bench.torch_peer import TorchModel

from bench_dist import batches


class Loss(torch.nn.Module):
    """DDP wraps a module's forward: here the model's training loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, targets):
        return self.model.loss(ids, targets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpu")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--grad-reduce", default="fp32", choices=("fp32", "bf16"))
    args = parser.parse_args()
    if "RANK" not in os.environ:   # started by mpiexec
        os.environ.update(RANK=os.environ["PMI_RANK"], WORLD_SIZE=os.environ["PMI_SIZE"],
                          LOCAL_RANK=os.environ["MPI_LOCALRANKID"])
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
    rank, local, size = (int(os.environ[v]) for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    cfg = ModelConfig.preset(args.preset)
    model = TorchModel(cfg, device=device).load(Model(cfg, backend="cpu", seed=0).params)
    ddp = torch.nn.parallel.DistributedDataParallel(Loss(model), device_ids=[local], gradient_as_bucket_view=True)
    if args.grad_reduce == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

        ddp.register_comm_hook(None, bf16_compress_hook)
    loss_fn = torch.compile(ddp) if args.compile else ddp
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    step_batches = batches(cfg, args.batch_size, args.grad_accum, rank)
    times = []
    for i in range(args.warmup + args.steps):
        micro = [[torch.tensor(a, device=device) for a in batch] for batch in step_batches(i + 1)]
        dist.barrier()
        torch.cuda.synchronize()
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for k, (inputs, targets) in enumerate(micro):
            with ddp.no_sync() if k < len(micro) - 1 else contextlib.nullcontext():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = loss_fn(inputs, targets) / len(micro)
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    free, total = torch.cuda.mem_get_info()
    memory = [None] * size
    dist.all_gather_object(memory, (total - free) / 1e9)
    seconds = statistics.median(times)
    tokens_per_step = size * args.grad_accum * args.batch_size * cfg.ctx_len
    if rank == 0:
        print(json.dumps({
            "engine": "torch-ddp" + ("+compile" if args.compile else ""), "variant": "ddp", "overlap": True,
            "ranks": size, "preset": args.preset, "backend": "torch", "device": torch.cuda.get_device_name(),
            "batch_size": args.batch_size, "grad_accum": args.grad_accum, "precision": "bf16",
            "grad_reduce": args.grad_reduce, "torch": torch.__version__,
            "ms_per_step": round(seconds * 1e3, 2), "tokens_per_s": round(tokens_per_step / seconds),
            "tokens_per_s_per_rank": round(tokens_per_step / seconds / size),
            "memory_gb_by_rank": [round(m, 3) for m in memory]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
