"""Pretraining: the loop, validation, checkpoints and exact resume (docs/training.md and docs/files.md).

A run directory holds config.json (model + training config), tokenizer.json, model.safetensors,
optimizer.safetensors and metrics.jsonl. Checkpoints are committed as one unit
(`checkpoint.commit_files`), every `ckpt_every` steps, at the end and on Ctrl-C. Batches depend
only on (seed, step), so a resumed run continues exactly as an uninterrupted one would.

A step trains on `grad_accum` micro-batches of `batch_size` rows on each data-parallel rank
(nanoeuler_core.training.distributed): rows [p * batch_size, (p + 1) * batch_size) of the step's
global batch, p = rank * grad_accum + k. Rank 0 alone writes the run directory, the metrics and
the progress line; every rank computes the same validation batches' share and resumes from the
same checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import orjson

from nanoeuler_core.engine import checkpoint
from nanoeuler_core.engine.checkpoint import CheckpointError
from nanoeuler_core.engine.config import PRESETS, ModelConfig
from nanoeuler_core.corpus.tokens import BatchLoader, check_length, default_corpus, load_tokens
from nanoeuler_core.engine import optim
from nanoeuler_core.engine.optim import OPTIMIZERS, SCHEDULES, Optimizer, lr_at
from nanoeuler_core.errors import unreadable
from nanoeuler_core.inference.loading import load_model
from nanoeuler_core.engine.model import Model
from nanoeuler_core import registry
from nanoeuler_core.registry import usable_backend
from nanoeuler_core.training import distributed
from nanoeuler_core.training.step import TrainStep

@dataclass
class TrainConfig:
    preset: str = "small"
    backend: str = "cpu"
    corpus: str | None = None           # default: the bundled Shakespeare text
    tokenizer: str | None = None        # default: trained on the corpus with the preset's vocab_size
    steps: int = 4000                   # about 4 minutes of the `small` preset on 2 CPU cores
    batch_size: int = 8
    lr: float | None = None             # default: 1e-3 for `small`, 3e-4 otherwise (docs/training.md)
    warmup: int | None = None           # default: 5% of decay_steps
    decay_steps: int | None = None      # the schedule's horizon; default: steps
    schedule: str = "cosine"            # or "wsd": warmup-stable-decay (engine/optim.py lr_at)
    optimizer: str = "adamw"            # or "muon": Muon for the blocks' matrices, AdamW for the rest
    target_loss: float | None = None    # stop (with a checkpoint) once the held-out next-token loss reaches it
    time_budget: float | None = None    # minutes of training: the schedule laid over them, ending with them
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 250
    eval_batches: int = 8
    ckpt_every: int = 500
    val_fraction: float = 0.1
    precision: str | None = None        # fp32, tf32 or bf16 (docs/model.md); default: the backend's
                                        # (bf16 on a CUDA GPU with tensor cores, fp32 on the CPU)
    eager: bool = False                 # launch every kernel from Python instead of replaying a captured step
    recompute: bool = False             # activation recomputation: the backward runs each block's forward again
                                        # from its input (Model.recompute): less memory, the same gradients
    tie_embeddings: bool = False        # head 0 reads the embedding table (ModelConfig.tie_embeddings)
    grad_accum: int = 1                 # micro-batches of batch_size rows per optimizer step (on each rank)
    zero: int = 0                       # 1: AdamW moments sharded over the data-parallel ranks (ZeRO-1);
                                        # 2: and the summed gradients (ZeRO-2)
    grad_reduce: str = "fp32"           # what the gradients' sums over the ranks travel in: fp32 or bf16
    muon_lr: float | None = None        # Muon's peak learning rate (default: --lr), on the same schedule
    muon_momentum: float = 0.95         # Muon's momentum (Nesterov)
    eval_hellaswag_every: int = 0       # HellaSwag acc/acc_norm every N steps into metrics.jsonl (0: never)
    hellaswag_file: str | None = None   # default: corpora/hellaswag/hellaswag_val.jsonl (`data hellaswag`)
    hellaswag_limit: int | None = None  # score only the first N items (default: all)

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset '{self.preset}' (choose from: {', '.join(PRESETS)})")
        if self.lr is None:
            self.lr = 1e-3 if self.preset == "small" else 3e-4
        if self.decay_steps is None:
            self.decay_steps = self.steps
        if self.warmup is None:
            self.warmup = max(1, self.decay_steps // 20)
        for name in ("steps", "batch_size", "eval_every", "eval_batches", "ckpt_every", "decay_steps", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got '{self.optimizer}'")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule must be one of {', '.join(SCHEDULES)}, got '{self.schedule}'")
        if self.time_budget is not None and not (self.time_budget > 0 and math.isfinite(self.time_budget)):
            raise ValueError(f"--time-budget must be a positive number of minutes, got {self.time_budget}")
        if self.target_loss is not None and not (self.target_loss > 0 and math.isfinite(self.target_loss)):
            raise ValueError(f"--target-loss must be a positive number, got {self.target_loss}")
        if self.zero not in optim.ZERO:
            raise ValueError(f"--zero must be 0 (off), 1 (sharded optimizer state) or 2 (and sharded gradients), "
                             f"got {self.zero}")
        if self.grad_reduce not in optim.GRAD_REDUCE:
            raise ValueError(f"--grad-reduce must be one of {', '.join(optim.GRAD_REDUCE)}, got '{self.grad_reduce}'")
        for name in ("lr", "muon_lr"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number, got {value}")
        if self.seed < 0:
            raise ValueError(f"--seed must be non-negative, got {self.seed}")
        if self.eval_hellaswag_every < 0:
            raise ValueError(f"--eval-hellaswag-every must be non-negative, got {self.eval_hellaswag_every}")

    def resolve_precision(self) -> None:
        """Fix `precision` to what the backend runs (its default if unset); ValueError if it cannot.
        Under mpiexec the rank first claims its device: nothing may start a GPU before that."""
        distributed.world().prepare(self.backend)
        backend = usable_backend(self.backend)
        self.precision = backend.check_precision(self.precision or backend.default_precision).name

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        if "tf32" in d and "precision" not in d:   # runs written before precisions had names: their flag
            tf32 = d["tf32"] and "tf32" in registry.backend(d.get("backend", "cpu")).implements   # counted where it ran
            d = {**d, "precision": "tf32" if tf32 else "fp32"}
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class Run:
    """Everything a training run holds in memory."""

    dir: Path
    config: TrainConfig
    model: Model
    optimizer: Optimizer
    tok: object
    train_loader: BatchLoader
    val_loader: BatchLoader | None
    unigram_loss: float
    elapsed: float = 0.0  # training seconds before this process (carried across resumes)


def unigram_loss(ids: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats) of predicting every token from the corpus's token frequencies."""
    p = np.bincount(ids, minlength=vocab_size).astype(np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum())


def _tokenizer(tc: TrainConfig, corpus: Path, vocab_size: int, log: Callable[[str], None]):
    from nanoeuler_core.text.tokenizer import Tokenizer

    if tc.tokenizer:
        return Tokenizer.load(tc.tokenizer)
    log(f"training a {vocab_size}-entry tokenizer on {corpus.name} (pass --tokenizer to reuse one)")
    try:
        text = corpus.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(unreadable("corpus", corpus, exc)) from None
    return Tokenizer.train(text, vocab_size)


def _data(run_dir: Path, tc: TrainConfig, tok, ctx_len: int) -> tuple[BatchLoader, BatchLoader | None, float]:
    corpus = Path(tc.corpus) if tc.corpus else default_corpus()
    splits = load_tokens(corpus, tok, val_fraction=tc.val_fraction)
    check_length(splits, ctx_len)
    train = BatchLoader(splits.train, tc.batch_size, ctx_len, tc.seed)
    val = BatchLoader(splits.val, tc.batch_size, ctx_len, tc.seed + 1) if len(splits.val) > ctx_len else None
    return train, val, unigram_loss(splits.train, tok.vocab_size)


def make_optimizer(model: Model, tc: TrainConfig) -> Optimizer:
    """The optimizer of a run with settings `tc`, over the job's data-parallel ranks."""
    comm = distributed.world().collectives(tc.backend)
    muon = {"momentum": tc.muon_momentum, "lr_ratio": (tc.muon_lr or tc.lr) / tc.lr} if tc.optimizer == "muon" else {}
    return optim.make_optimizer(tc.optimizer, model, betas=(tc.beta1, tc.beta2), eps=tc.eps, weight_decay=tc.weight_decay,
                                max_grad_norm=tc.grad_clip, comm=comm, zero=tc.zero if comm is not None else 0,
                                grad_reduce=tc.grad_reduce, **muon)


def rows_per_step(tc: TrainConfig) -> int:
    """Sequences in one optimizer step: every micro-batch of every rank."""
    return tc.batch_size * tc.grad_accum * distributed.world().size


def start_run(run_dir: Path, tc: TrainConfig, log: Callable[[str], None] = print) -> Run:
    """A fresh run in `run_dir` (which must not already hold one). Rank 0 trains the tokenizer
    and writes the run directory; the other ranks then read the tokenizer (and the token cache)."""
    run_dir = Path(run_dir)
    job = distributed.world()
    tc.resolve_precision()  # the backend and precision are checked before minutes of tokenizer training
    if job.rank == 0:
        if (run_dir / "config.json").exists():
            raise ValueError(f"{run_dir} already holds a run: continue it with --resume {run_dir}, or choose another --out")
        corpus = Path(tc.corpus) if tc.corpus else default_corpus()
        if not corpus.is_file():
            raise ValueError(f"corpus {corpus} not found")
        tok = _tokenizer(tc, corpus, PRESETS[tc.preset]["vocab_size"], log)
        cfg = ModelConfig.preset(tc.preset, vocab_size=tok.vocab_size, tie_embeddings=tc.tie_embeddings)
        data = _data(run_dir, tc, tok, cfg.ctx_len)  # encodes and caches the corpus
        run_dir.mkdir(parents=True, exist_ok=True)
        tok.save(run_dir / "tokenizer.json")
    job.barrier()
    if job.rank != 0:
        from nanoeuler_core.text.tokenizer import Tokenizer

        tok = Tokenizer.load(run_dir / "tokenizer.json")
        cfg = ModelConfig.preset(tc.preset, vocab_size=tok.vocab_size, tie_embeddings=tc.tie_embeddings)
        data = _data(run_dir, tc, tok, cfg.ctx_len)  # from rank 0's cache
    train, val, unigram = data
    # the same seed: the same weights on every rank
    model = Model(cfg, backend=tc.backend, seed=tc.seed, precision=tc.precision, recompute=tc.recompute)
    optimizer = make_optimizer(model, tc)
    if job.rank == 0:
        model.save(run_dir, training=asdict(tc))
        (run_dir / "metrics.jsonl").write_bytes(b"")
    return Run(run_dir, tc, model, optimizer, tok, train, val, unigram)


def resume_run(run_dir: Path, overrides: dict, log: Callable[[str], None] = print) -> Run:
    """The run in `run_dir`, from its last complete checkpoint; `overrides` replace training settings."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"run directory {run_dir} does not exist")
    saved = checkpoint.read_json(run_dir / "config.json")
    stage = saved.get("training", {}).get("stage")
    if stage:
        raise ValueError(f"{run_dir} is a {stage} run, not a pretraining run: fine-tune further with "
                         f"`nanoeuler-run {stage} --base {run_dir}`")
    training = saved.get("training", {})
    overrides = dict(overrides)
    if overrides.get("precision") is None:   # the run's own precision, or on another backend that one's default
        overrides.pop("precision", None)
        if overrides.get("backend", training.get("backend")) != training.get("backend"):
            overrides["precision"] = None
    tc = TrainConfig.from_dict({**training, **overrides})
    job = distributed.world()
    tc.resolve_precision()
    if job.rank == 0:  # finish or undo a checkpoint that a crash interrupted, before anyone reads it
        checkpoint.recover(run_dir, checkpoint.CHECKPOINT_FILES)
    job.barrier()
    model, tok = load_model(run_dir, tc.backend, tc.precision)
    model.recompute = tc.recompute
    optimizer = make_optimizer(model, tc)
    if (run_dir / "optimizer.safetensors").exists():
        tensors, meta = checkpoint.load_tensors(run_dir / "optimizer.safetensors")
        _, model_meta = checkpoint.load_tensors(run_dir / "model.safetensors")
        if meta.get("step") != model_meta.get("step", "0"):
            raise CheckpointError(f"{run_dir}: model (step {model_meta.get('step')}) and optimizer (step {meta.get('step')}) "
                                  f"checkpoints disagree")
        try:
            optimizer.load_state(tensors, meta)
        except ValueError as exc:
            raise CheckpointError(f"{run_dir / 'optimizer.safetensors'}: {exc}") from None
    train, val, unigram = _data(run_dir, tc, tok, model.cfg.ctx_len)
    elapsed = _truncate_metrics(run_dir / "metrics.jsonl", optimizer.step_count) if job.rank == 0 else 0.0
    log(f"resuming {run_dir} at step {optimizer.step_count}")
    return Run(run_dir, tc, model, optimizer, tok, train, val, unigram, elapsed)


def _truncate_metrics(path: Path, step: int) -> float:
    """Drop metric lines past `step` (written after the last checkpoint); return the training time so far."""
    if not path.exists():
        return 0.0
    kept, elapsed = [], 0.0
    for line in path.read_bytes().splitlines():
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # a line cut short by a crash
        if row.get("step", 0) <= step:
            kept.append(line)
            elapsed = row.get("time", elapsed)
    checkpoint.atomic_write(path, b"".join(line + b"\n" for line in kept))
    return elapsed


def save_checkpoint(run: Run) -> None:
    """Commit model and optimizer state at the optimizer's current step (every rank calls it:
    sharded optimizer state is gathered; rank 0 writes)."""
    meta = {"step": str(run.optimizer.step_count), "seed": str(run.config.seed)}
    tensors, opt_meta = run.optimizer.state()
    if distributed.world().rank != 0:
        return
    checkpoint.commit_files(run.dir, [
        ("optimizer.safetensors", checkpoint.tensors_bytes(tensors, {**opt_meta, **meta})),
        ("model.safetensors", checkpoint.tensors_bytes(run.model.params, meta)),
    ])


def evaluate(run: Run) -> tuple[float, float]:
    """Validation loss (mean over the heads) and head 0's next-token loss, over the same
    `eval_batches` batches every time (shared out among the data-parallel ranks)."""
    if run.val_loader is None:
        return float("nan"), float("nan")
    job = distributed.world()
    mine = {i: run.model.head_losses(*run.val_loader.batch(i)) for i in range(job.rank, run.config.eval_batches, job.size)}
    every = {i: losses for part in job.allgather(mine) for i, losses in part.items()}
    heads = np.array([every[i] for i in range(run.config.eval_batches)])
    return float(np.nanmean(heads)), float(np.nanmean(heads[:, 0]))


class Progress:
    """One status line: redrawn in place on a terminal, printed every few percent otherwise."""

    def __init__(self, total: int, stream=sys.stderr):
        self.total, self.stream = total, stream
        self.tty = stream.isatty()
        self.every = max(1, total // 20)

    def update(self, step: int, text: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + text)
            self.stream.flush()
        elif step % self.every == 0 or step == self.total:
            self.stream.write(text + "\n")

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


def _eta(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class CtrlC:
    """While active, Ctrl-C (SIGINT) only sets `requested`: the loop finishes its step, saves a
    checkpoint and returns; a second Ctrl-C raises KeyboardInterrupt at once."""

    def __init__(self):
        self.requested = False
        self._previous = None
        self._main_thread = threading.current_thread() is threading.main_thread()  # signals only work there

    def _on_sigint(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> "CtrlC":
        if self._main_thread:
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        if self._main_thread:
            signal.signal(signal.SIGINT, self._previous)


class Bookkeeping:
    """What every training loop does around its steps, on every rank: Ctrl-C finishes the step
    (`CtrlC`) and the ranks agree to stop after the same one; rank 0 appends the metrics row and
    redraws the progress line; a checkpoint is saved every `ckpt_every` steps, at the last and
    when stopping; a watchdog ends a rank that waits in vain for the others."""

    def __init__(self, run: Run, what: str):
        self.run, self.job = run, distributed.world()
        self.ctrl_c, self.watchdog = CtrlC(), distributed.Watchdog(self.job, what)
        # a line every 5% of the steps, or with a time budget (steps unknown) every evaluation
        tc = run.config
        self.progress = Progress(tc.steps if tc.time_budget is None else 20 * tc.eval_every)
        self.interrupted = False
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "Bookkeeping":
        self._stack.enter_context(self.ctrl_c)
        self._stack.enter_context(self.watchdog)
        if self.job.rank == 0:
            self._metrics = self._stack.enter_context(open(self.run.dir / "metrics.jsonl", "ab"))
            self._stack.callback(self.progress.close)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def end_step(self, step: int, row: dict, progress: str, last: bool = False) -> None:
        """Log step `step`'s metrics `row` and `progress` line, checkpoint if due (or `last`); sets
        `interrupted`."""
        self.interrupted = self.job.any(self.ctrl_c.requested)
        if self.job.rank == 0:
            self._metrics.write(orjson.dumps(row) + b"\n")
            self._metrics.flush()
            self.progress.update(step, progress)
        tc = self.run.config
        if step % tc.ckpt_every == 0 or step == tc.steps or self.interrupted or last:
            save_checkpoint(self.run)
            self.watchdog.note = f"; the checkpoint of step {step} in {self.run.dir} is intact"
        self.watchdog.beat()


def train(run: Run, log: Callable[[str], None] = print,
          extra_evals: Sequence[tuple[int, Callable[[Model], dict]]] = ()) -> tuple[dict, bool]:
    """Train from the run's current step to `config.steps`; returns the last metrics row and
    whether Ctrl-C stopped it. Each (every, metrics) of `extra_evals` adds metrics(model) to the
    row every `every` steps and at the last (HellaSwag, from the eval room, is one).

    Ctrl-C lets the current step finish, saves a checkpoint and returns; a second Ctrl-C stops at
    once. Under mpiexec every rank stops after the same step (mpiexec passes Ctrl-C to each).
    """
    tc, model, opt = run.config, run.model, run.optimizer
    job = distributed.world()
    train_step = TrainStep(model, opt, capture=not tc.eager)
    tokens_per_step = rows_per_step(tc) * model.cfg.ctx_len
    row: dict = {}
    val_loss = val_next = float("nan")
    start, first_step = time.perf_counter(), opt.step_count
    reached = False   # the held-out next-token loss (head 0's, as other engines report it) is at tc.target_loss or below
    budget_ms = None if tc.time_budget is None else round(tc.time_budget * 60_000)
    spent = budget_ms is not None and 1000 * run.elapsed >= budget_ms   # (a resumed run may have used it up)
    with Bookkeeping(run, "training") as book:
        while opt.step_count < tc.steps and not (book.interrupted or reached or spent):
            step = opt.step_count + 1
            t0 = time.perf_counter()
            if budget_ms is None:
                lr = lr_at(step, tc.lr, tc.warmup, tc.decay_steps, tc.final_lr_ratio, tc.schedule)
            else:   # the schedule over the budget's milliseconds, warm-up its first 5%, at this step's start
                ms = job.allgather(round(1000 * (run.elapsed + t0 - start)) + 1)[0]   # rank 0's clock for all
                lr = lr_at(ms, tc.lr, max(1, budget_ms // 20), budget_ms, tc.final_lr_ratio, tc.schedule)
            parts = range(job.rank * tc.grad_accum, (job.rank + 1) * tc.grad_accum)
            loss, grad_norm = train_step.micro_batches([run.train_loader.batch(step, p) for p in parts], lr)
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss became {loss} at step {step}: lower --lr or check the data")
            dt = time.perf_counter() - t0
            row = {"step": step, "loss": round(loss, 5), "lr": lr, "grad_norm": round(grad_norm, 5),
                   "tokens_per_s": round(tokens_per_step / dt, 1),
                   "time": round(run.elapsed + time.perf_counter() - start, 3)}
            spent = budget_ms is not None and job.any(1000 * row["time"] >= budget_ms)   # every rank stops together
            if step % tc.eval_every == 0 or step == tc.steps or spent:
                val_loss, val_next = evaluate(run)
                row["val_loss"], row["val_next_token_loss"] = round(val_loss, 5), round(val_next, 5)
                reached = tc.target_loss is not None and val_next <= tc.target_loss
            for every, extra_metrics in extra_evals:
                if step % every == 0 or step == tc.steps:
                    row |= extra_metrics(model)
            rate = (time.perf_counter() - start) / (step - first_step)
            val = f" | val {val_loss:.3f} (next token {val_next:.3f})" if math.isfinite(val_loss) else ""
            left = rate * (tc.steps - step) if budget_ms is None else max(0.0, budget_ms / 1000 - row["time"])
            book.end_step(step, row, f"step {step}{'' if budget_ms else f'/{tc.steps}'} | loss {loss:.3f}{val} | "
                                     f"{row['tokens_per_s'] / 1e3:.1f}k tok/s | {_eta(left)} left",
                         last=reached or spent)
    if spent and not reached:   # (no row: a resumed run whose budget was already spent)
        log(f"time budget of {tc.time_budget:g} min spent at step {opt.step_count}" +
            (f", after {opt.step_count * tokens_per_step:,} tokens; held-out loss {val_loss:.4f} (next token "
             f"{val_next:.4f})" if row else ""))
    if reached:
        log(f"reached held-out next-token loss {val_next:.4f} (target {tc.target_loss}) at step {opt.step_count}, after "
            f"{row['time']:.1f} s of training and {opt.step_count * tokens_per_step:,} tokens")
    if book.interrupted:
        log(f"interrupted: checkpoint at step {opt.step_count} saved in {run.dir}; continue with --resume {run.dir}")
    return row, book.interrupted
