"""The speedrun: wall time to a held-out loss on the benchmark corpus (docs/corpus.md), for four
contenders on the same model, initial weights, tokenizer, batches, schedule and evaluation:

    torch-adamw      PyTorch, bf16 autocast, torch.compile, fused AdamW (nanoGPT's recipe)
    torch-muon       PyTorch, the same, with torch.optim.Muon for the blocks' matrices
    nanoeuler-adamw  nanoeuler's captured bf16 training step with AdamW
    nanoeuler-muon   the same with Muon (the `muon` op)

Each contender trains `--steps` steps of `--batch-size` x ctx_len tokens with the schedule laid over
those steps, and evaluates head 0's next-token loss on the same `--eval-batches` held-out batches
every `--eval-every` steps and at the last. The clock runs while it trains and stops while it
evaluates; compilation and graph capture happen in warm-up steps before it starts (the weights
and optimizer state are then put back). Both engines clip each optimizer's parameters by their own
gradient norm (Muon's group and AdamW's). A run directory per contender holds config.json and
metrics.jsonl, so `nanoeuler-run plot DIRS --x seconds` overlays them.

    python bench/speedrun.py prepare --corpus C --tokenizer T          # encode once (cached beside C)
    python bench/speedrun.py train ENGINE-OPTIMIZER --corpus C --tokenizer T --steps N --out DIR/NAME
    python bench/speedrun.py report DIR [--target LOSS]                 # the table, and DIR/speedrun.png
    bash bench/run_gpu_speedrun.sh LOG_DIR                               # on a GPU machine: all of it

`report` takes as target L the final held-out loss of torch-adamw (unless --target is given) and
prints, for each run, the time and tokens until its first evaluation at or below L, their ratios,
and the held-out losses of the engines at the same steps (parity).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import orjson

from nanoeuler_core import Model, ModelConfig
from nanoeuler_core.corpus.tokens import BatchLoader, load_tokens
from nanoeuler_core.engine.optim import lr_at, make_optimizer
from nanoeuler_core.text.tokenizer import Tokenizer
from nanoeuler_core.training.step import TrainStep

CONTENDERS = ("torch-adamw", "torch-muon", "nanoeuler-adamw", "nanoeuler-muon")
WARMUP_STEPS = 3          # compile and capture, before the clock starts
VAL_FRACTION = 0.01
BETAS, EPS, WEIGHT_DECAY, CLIP, MOMENTUM = (0.9, 0.95), 1e-8, 0.1, 1.0, 0.95


def splits(args):
    tok = Tokenizer.load(args.tokenizer)
    return tok, load_tokens(Path(args.corpus), tok, val_fraction=VAL_FRACTION)


class NanoeulerContender:
    def __init__(self, cfg, optimizer: str, initial: dict, muon_lr_ratio: float, device: str):
        gpu = device == "cuda"
        self.model = Model(cfg, backend="cuda" if gpu else "cpu", seed=0, precision="bf16" if gpu else "fp32")
        self.model.load_params(initial)
        extra = {"momentum": MOMENTUM, "lr_ratio": muon_lr_ratio} if optimizer == "muon" else {}
        self.optimizer = make_optimizer(optimizer, self.model, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                        max_grad_norm=CLIP, **extra)
        self.train_step = TrainStep(self.model, self.optimizer)

    def step(self, inputs, targets, lr: float) -> None:
        self.train_step(inputs, targets, lr)

    def synchronize(self) -> None:
        pass   # every step returns its loss to the host

    def reset(self, initial: dict) -> None:
        self.model.load_params(initial)
        self.optimizer.reset()

    def val_loss(self, batches) -> float:
        return float(np.mean([self.model.head_losses(*batch)[0] for batch in batches]))

    def memory_gb(self) -> float:
        return (self.model.backend.memory_in_use() or 0) / 1e9


class TorchContender:
    def __init__(self, cfg, optimizer: str, initial: dict, muon_lr_ratio: float, device: str):
        import torch

        from nanoeuler_core.bench.torch_peer import TorchModel

        self.torch, self.optimizer_name, self.muon_lr_ratio, self.device = torch, optimizer, muon_lr_ratio, device
        self.autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
        self.model = TorchModel(cfg, device=device).load(initial).to(device)
        self.loss_fn = torch.compile(self.model.loss)
        self.hidden = [self.model.w(n) for n, s in cfg.param_shapes().items() if len(s) == 2 and n.startswith("layers.")]
        self._make_optimizers()

    def _make_optimizers(self) -> None:
        torch, model = self.torch, self.model
        shapes = model.cfg.param_shapes()
        matrices = [model.w(n) for n, s in shapes.items() if len(s) == 2]
        vectors = [model.w(n) for n, s in shapes.items() if len(s) == 1]
        if self.optimizer_name == "muon":
            hidden_ids = {id(p) for p in self.hidden}
            rest = [p for p in matrices if id(p) not in hidden_ids]
            muon = torch.optim.Muon(self.hidden, lr=self.muon_lr_ratio, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM,
                                    nesterov=True, adjust_lr_fn="match_rms_adamw")
            adamw = torch.optim.AdamW([{"params": rest, "weight_decay": WEIGHT_DECAY},
                                       {"params": vectors, "weight_decay": 0.0}], lr=1.0, betas=BETAS, eps=EPS,
                                      fused=self.device == "cuda")
            self.groups = [(muon, self.hidden, self.muon_lr_ratio), (adamw, rest + vectors, 1.0)]
        else:
            adamw = torch.optim.AdamW([{"params": matrices, "weight_decay": WEIGHT_DECAY},
                                       {"params": vectors, "weight_decay": 0.0}], lr=1.0, betas=BETAS, eps=EPS,
                                      fused=self.device == "cuda")
            self.groups = [(adamw, matrices + vectors, 1.0)]

    def step(self, inputs, targets, lr: float) -> None:
        torch = self.torch
        inputs, targets = (torch.from_numpy(a).to(self.device, non_blocking=True) for a in (inputs, targets))
        for optimizer, _, _ in self.groups:
            optimizer.zero_grad(set_to_none=True)
        with self.autocast:
            loss = self.loss_fn(inputs, targets)
        loss.backward()
        for optimizer, params, ratio in self.groups:
            torch.nn.utils.clip_grad_norm_(params, CLIP)
            for group in optimizer.param_groups:
                group["lr"] = lr * ratio
            optimizer.step()

    def synchronize(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def reset(self, initial: dict) -> None:
        self.model.load(initial)
        self._make_optimizers()

    def val_loss(self, batches) -> float:
        torch = self.torch
        losses = []
        with torch.no_grad(), self.autocast:
            for inputs, targets in batches:
                logits = self.model.logits(torch.from_numpy(inputs).to(self.device)).float()
                losses.append(float(torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                                      torch.from_numpy(targets).to(self.device).flatten())))
        return float(np.mean(losses))

    def memory_gb(self) -> float:
        if self.device != "cuda":
            return 0.0
        free, total = self.torch.cuda.mem_get_info()
        return (total - free) / 1e9


def train(args) -> None:
    engine, optimizer = args.contender.split("-")
    tok, data = splits(args)
    cfg = ModelConfig.preset(args.preset, vocab_size=tok.vocab_size)
    loader = BatchLoader(data.train, args.batch_size, cfg.ctx_len, args.seed)
    val = BatchLoader(data.val, args.batch_size, cfg.ctx_len, args.seed + 1)
    val_batches = [val.batch(i) for i in range(args.eval_batches)]
    initial = Model(cfg, backend="cpu", seed=args.seed).params
    contender = (TorchContender if engine == "torch" else NanoeulerContender)(cfg, optimizer, initial,
                                                                              args.muon_lr / args.lr, args.device)
    for s in range(WARMUP_STEPS):   # compile, capture; batches the run never draws
        contender.step(*loader.batch(10**9 + s), 0.0)
    contender.synchronize()
    contender.reset(initial)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokens_per_step = args.batch_size * cfg.ctx_len
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    (out / "config.json").write_text(json.dumps({"ctx_len": cfg.ctx_len, "training": {"batch_size": args.batch_size},
                                                 "speedrun": settings, "parameters": cfg.n_params(),
                                                 "corpus_train_tokens": len(data.train)}, indent=1))
    warmup = max(1, round(args.warmup_fraction * args.steps))
    clock, rows = 0.0, []
    with open(out / "metrics.jsonl", "wb") as metrics:
        start = time.perf_counter()
        for step in range(1, args.steps + 1):
            lr = lr_at(step, args.lr, warmup, args.steps, args.final_lr_ratio, args.schedule)
            contender.step(*loader.batch(step), lr)
            if step % args.eval_every and step != args.steps:
                continue
            contender.synchronize()
            clock += time.perf_counter() - start
            row = {"step": step, "time": round(clock, 3), "tokens": step * tokens_per_step, "lr": lr,
                   "val_loss": round(contender.val_loss(val_batches), 5)}
            rows.append(row)
            metrics.write(orjson.dumps(row) + b"\n")
            metrics.flush()
            print(f"{args.contender} step {step} | {clock:.1f} s | val {row['val_loss']:.4f} | "
                  f"{step * tokens_per_step / clock / 1e3:.1f}k tok/s", flush=True)
            if args.target_loss is not None and row["val_loss"] <= args.target_loss:
                break
            start = time.perf_counter()
    summary = {"contender": args.contender, "steps": rows[-1]["step"], "seconds": rows[-1]["time"],
               "tokens_per_s": round(rows[-1]["tokens"] / rows[-1]["time"]), "val_loss": rows[-1]["val_loss"],
               "memory_gb": round(contender.memory_gb(), 2)}
    (out / "summary.json").write_text(json.dumps(summary))
    print(json.dumps(summary), flush=True)


def first_at_or_below(rows: list[dict], target: float) -> dict | None:
    return next((row for row in rows if row["val_loss"] <= target), None)


def report(args) -> None:
    root = Path(args.dir)
    runs = {}
    for d in sorted(p for p in root.iterdir() if (p / "metrics.jsonl").is_file()):
        rows = [orjson.loads(line) for line in (d / "metrics.jsonl").read_bytes().splitlines() if line.strip()]
        summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").is_file() else {}
        runs[d.name] = (rows, summary)
    if not runs:
        sys.exit(f"error: no run directories with metrics under {root}")
    target = args.target
    if target is None:
        if "torch-adamw" not in runs:
            sys.exit("error: no torch-adamw run to take the target from: pass --target")
        target = runs["torch-adamw"][0][-1]["val_loss"]
    print(f"target: held-out loss {target:.4f}" + (" (torch-adamw's final)" if args.target is None else ""))
    print(f"{'run':<26}{'steps':>7}{'seconds':>9}{'tokens/s':>11}{'final val':>11}{'memory GB':>11}"
          f"{'to target: s':>14}{'tokens':>14}")
    reached = {}
    for name, (rows, summary) in runs.items():
        hit = first_at_or_below(rows, target)
        reached[name] = hit
        last = rows[-1]
        print(f"{name:<26}{last['step']:>7}{last['time']:>9.1f}{last['tokens'] / last['time']:>11,.0f}"
              f"{last['val_loss']:>11.4f}{summary.get('memory_gb', float('nan')):>11.2f}"
              + (f"{hit['time']:>14.1f}{hit['tokens']:>14,}" if hit else f"{'not reached':>14}{'':>14}"))
    for a, b in (("nanoeuler-adamw", "torch-adamw"), ("nanoeuler-muon", "torch-muon"), ("nanoeuler-muon", "torch-adamw")):
        for name_a in [n for n in runs if n.startswith(a)]:
            for name_b in [n for n in runs if n.startswith(b)]:
                if reached.get(name_a) and reached.get(name_b):
                    print(f"time to target, {name_b} / {name_a}: {reached[name_b]['time'] / reached[name_a]['time']:.2f}x")
    for a, b in (("nanoeuler-adamw", "torch-adamw"), ("nanoeuler-muon", "torch-muon")):
        if a in runs and b in runs:
            at_b = {row["step"]: row["val_loss"] for row in runs[b][0]}
            common = [(row["step"], row["val_loss"], at_b[row["step"]]) for row in runs[a][0] if row["step"] in at_b]
            if common:
                worst = max(abs(x - y) / y for _, x, y in common)
                step, x, y = common[-1]
                print(f"parity {a} vs {b}: at step {step} {x:.4f} vs {y:.4f} ({(x - y) / y:+.2%}); the largest "
                      f"relative gap over {len(common)} evaluations {worst:.2%}")
    try:
        from nanoeuler_core.eval.curves import plot_runs
        print(f"plot: {plot_runs(sorted(root / name for name in runs), root / 'speedrun.png', x='seconds')}")
    except ValueError as exc:
        print(f"no plot: {exc}")


def prepare(args) -> None:
    tok, data = splits(args)
    print(f"{args.corpus}: {len(data.train):,} training and {len(data.val):,} held-out tokens "
          f"({tok.vocab_size}-entry tokenizer), cached in {data.cache}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(required=True)
    for name, func in (("prepare", prepare), ("train", train)):
        sub = commands.add_parser(name)
        sub.set_defaults(func=func)
        sub.add_argument("--corpus", required=True)
        sub.add_argument("--tokenizer", required=True)
        if name == "train":
            sub.add_argument("contender", choices=CONTENDERS)
            sub.add_argument("--out", required=True)
            sub.add_argument("--preset", default="gpu")
            sub.add_argument("--steps", type=int, required=True)
            sub.add_argument("--batch-size", type=int, default=32)
            sub.add_argument("--lr", type=float, default=6e-4, help="AdamW's peak (nanoGPT's)")
            sub.add_argument("--muon-lr", type=float, default=6e-4, help="Muon's peak (its update's RMS matched to AdamW's)")
            sub.add_argument("--schedule", default="cosine", choices=("cosine", "wsd"))
            sub.add_argument("--warmup-fraction", type=float, default=0.05)
            sub.add_argument("--final-lr-ratio", type=float, default=0.1)
            sub.add_argument("--eval-every", type=int, default=250)
            sub.add_argument("--eval-batches", type=int, default=16)
            sub.add_argument("--target-loss", type=float, default=None, help="stop at the first evaluation at or below it")
            sub.add_argument("--seed", type=int, default=0)
            sub.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a check in fp32")
    sub = commands.add_parser("report")
    sub.set_defaults(func=report)
    sub.add_argument("dir")
    sub.add_argument("--target", type=float, default=None)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
