"""Does bf16 train like fp32, and like PyTorch bf16? The same model, initial weights, batches and
optimizer schedule, trained in several precisions and engines; prints the loss curves side by side
and the final losses' relative differences.

    python bench/loss_parity.py [--preset gpu] [--steps 500] [--batch-size 8] [--engines bf16,fp32,torch-bf16]

Under mpiexec, the engines sums-fp32 and sums-bf16 train data-parallel over the ranks (bf16 products,
each rank its own rows of every step) with the gradients' sums in float32 or in bfloat16
(--grad-reduce), the question being whether bf16 sums train as float32 ones:

    mpiexec -n 4 python bench/loss_parity.py --engines sums-fp32,sums-bf16 --steps 500

Engines: nanoeuler in fp32, tf32 or bf16 (its captured training step), and torch-bf16: the same
architecture in PyTorch (nanoeuler_core/bench/torch_peer.py) with bf16 autocast and fused AdamW,
the same weight decay groups, clipping and learning-rate schedule. The reported loss of a step is
the MTP training loss; "final" is the mean over the last 20 steps, and "val" the mean head loss on
8 fixed held-out batches after the last step.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from nanoeuler_core import Model, ModelConfig
from nanoeuler_core.corpus.tokens import BatchLoader, default_corpus, load_tokens
from nanoeuler_core.engine.optim import AdamW, lr_at
from nanoeuler_core.training import distributed
from nanoeuler_core.training.step import TrainStep
from nanoeuler_core.text.tokenizer import Tokenizer
from nanoeuler_core.training.pretrain import TrainConfig

LAST = 20
VAL_BATCHES = 8


def nanoeuler_curve(cfg, precision, tc, train, val, grad_reduce=None):
    """A curve of the captured step in `precision`; with `grad_reduce`, data-parallel over the
    job's ranks (rank r trains on part r of each step's rows) with the sums in that format."""
    job = distributed.world()
    model = Model(cfg, backend="cuda", seed=tc.seed, precision=precision)
    comm = job.collectives("cuda") if grad_reduce else None
    step = TrainStep(model, AdamW(model, betas=(tc.beta1, tc.beta2), eps=tc.eps, weight_decay=tc.weight_decay,
                                  max_grad_norm=tc.grad_clip, comm=comm, grad_reduce=grad_reduce or "fp32"))
    losses = [step.micro_batches([train.batch(s, job.rank)], lr_at(s, tc.lr, tc.warmup, tc.decay_steps,
                                                                   tc.final_lr_ratio))[0]
              for s in range(1, tc.steps + 1)]
    val_loss = float(np.mean([np.nanmean(model.head_losses(*val.batch(i))) for i in range(VAL_BATCHES)]))
    return losses, val_loss


def torch_curve(cfg, tc, train, val):
    import torch

    from nanoeuler_core.bench.torch_peer import TorchModel

    model = TorchModel(cfg, device="cuda").load(Model(cfg, backend="cpu", seed=tc.seed).params).cuda()
    matrices = [p for p in model.parameters() if p.ndim == 2]
    vectors = [p for p in model.parameters() if p.ndim == 1]
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": tc.weight_decay}, {"params": vectors, "weight_decay": 0.0}],
                            lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps, fused=True)
    losses = []
    for s in range(1, tc.steps + 1):
        inputs, targets = (torch.tensor(a, device="cuda") for a in train.batch(s))
        for group in opt.param_groups:
            group["lr"] = lr_at(s, tc.lr, tc.warmup, tc.decay_steps, tc.final_lr_ratio)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.loss(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        losses.append(float(loss))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        val_loss = float(np.mean([float(model.loss(*(torch.tensor(a, device="cuda") for a in val.batch(i))))
                                  for i in range(VAL_BATCHES)]))
    return losses, val_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpu")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--engines", default="bf16,fp32,torch-bf16")
    args = parser.parse_args()
    job = distributed.world()
    job.prepare("cuda")
    say = print if job.rank == 0 else (lambda *a, **k: None)
    tc = TrainConfig(preset=args.preset, backend="cuda", steps=args.steps, batch_size=args.batch_size)
    cfg0 = ModelConfig.preset(args.preset)
    corpus = default_corpus()
    tok = Tokenizer.train(corpus.read_text(encoding="utf-8"), cfg0.vocab_size)
    cfg = ModelConfig.preset(args.preset, vocab_size=tok.vocab_size)
    splits = load_tokens(corpus, tok)
    train = BatchLoader(splits.train, tc.batch_size, cfg.ctx_len, tc.seed)
    val = BatchLoader(splits.val, tc.batch_size, cfg.ctx_len, tc.seed + 1)
    say(f"preset {args.preset}, batch {tc.batch_size} x {cfg.ctx_len}" + (f" on each of {job.size} ranks" if job.size > 1 else "")
        + f", {tc.steps} steps, lr {tc.lr}, warm-up {tc.warmup}, seed {tc.seed}, corpus {corpus.name}")
    curves = {}
    for engine in args.engines.split(","):
        t = time.perf_counter()
        if engine == "torch-bf16":
            curves[engine] = torch_curve(cfg, tc, train, val)
        elif engine.startswith("sums-"):
            curves[engine] = nanoeuler_curve(cfg, "bf16", tc, train, val, grad_reduce=engine.removeprefix("sums-"))
        else:
            curves[engine] = nanoeuler_curve(cfg, engine, tc, train, val)
        say(f"{engine}: {time.perf_counter() - t:.0f} s", flush=True)
    names = list(curves)
    say("step  " + "".join(f"{n:>12}" for n in names))
    for s in list(range(0, tc.steps, max(1, tc.steps // 10))) + [tc.steps - 1]:
        say(f"{s + 1:>4}  " + "".join(f"{curves[n][0][s]:>12.4f}" for n in names))
    final = {n: float(np.mean(curves[n][0][-LAST:])) for n in names}
    say(f"final (mean of the last {LAST})  " + "  ".join(f"{n} {final[n]:.4f}" for n in names))
    say("val (8 held-out batches)  " + "  ".join(f"{n} {curves[n][1]:.4f}" for n in names))
    base = names[0]
    for n in names[1:]:
        say(f"{base} vs {n}: final {abs(final[base] - final[n]) / final[n]:.2%}, "
              f"val {abs(curves[base][1] - curves[n][1]) / curves[n][1]:.2%} (relative)")


if __name__ == "__main__":
    with distributed.fail_together():
        main()
