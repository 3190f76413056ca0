"""Pretraining and sampling commands: `pretrain`, `generate`."""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path
from typing import Optional

import typer

from nanoeuler_core.cli.evaluate import hellaswag_file
from nanoeuler_core.eval import hellaswag
from nanoeuler_core.inference.loading import load_model
from nanoeuler_core.training import pretrain as training

DEFAULT = {f.name: f.default for f in fields(training.TrainConfig)}
from nanoeuler_core.inference.generate import check_sampling


def pretrain(
    preset: str = typer.Option("small", help="model preset: small (CPU, minutes) or gpu (116M parameters)"),
    backend: str = typer.Option("cpu", help="cpu, cuda or reference"),
    corpus: Optional[Path] = typer.Option(None, help="UTF-8 text file (default: the bundled Shakespeare)"),
    tokenizer: Optional[Path] = typer.Option(None, help="tokenizer.json to use (default: train one on the corpus)"),
    steps: Optional[int] = typer.Option(None, help=f"train until this step (default: {DEFAULT['steps']}; "
                                                   f"with --resume: the run's own)"),
    batch_size: int = typer.Option(DEFAULT["batch_size"], help="sequences per step (each ctx_len tokens)"),
    lr: Optional[float] = typer.Option(None, help="peak learning rate (default: 1e-3 small, 3e-4 otherwise)"),
    warmup: Optional[int] = typer.Option(None, help="warm-up steps (default: 5% of --decay-steps)"),
    decay_steps: Optional[int] = typer.Option(None, help="cosine decay horizon (default: --steps)"),
    seed: int = typer.Option(DEFAULT["seed"], help="seed of the initial weights and the batches"),
    eval_every: int = typer.Option(DEFAULT["eval_every"], help="validation loss every N steps"),
    ckpt_every: int = typer.Option(DEFAULT["ckpt_every"], help="checkpoint every N steps (and at the end, and on Ctrl-C)"),
    out: Path = typer.Option(Path("runs/pretrain"), help="run directory to create"),
    resume: Optional[Path] = typer.Option(None, help="continue the run in this directory (its settings are kept; "
                                                      "--steps and --backend may change)"),
    sample_prompt: str = typer.Option("\n", help="prompt of the sample printed at the end"),
    tf32: bool = typer.Option(True, help="CUDA: TF32 tensor-core matrix products"),
    eager: bool = typer.Option(False, help="CUDA: launch each kernel from Python instead of replaying the captured step"),
    eval_hellaswag_every: Optional[int] = typer.Option(None, help="HellaSwag acc and acc_norm every N steps "
                                                                  "into metrics.jsonl (default: never)"),
    hellaswag_file: Optional[Path] = typer.Option(None, help="HellaSwag JSONL (default: where `data hellaswag` "
                                                             "puts it)"),
    hellaswag_limit: Optional[int] = typer.Option(None, help="score only the first N HellaSwag items"),
) -> None:
    """Pretrain a model; with no arguments, the `small` preset on the bundled corpus on the CPU."""
    log = lambda msg: typer.echo(msg, err=True)  # noqa: E731
    hellaswag_settings = {name: value for name, value in (
        ("eval_hellaswag_every", eval_hellaswag_every), ("hellaswag_file", hellaswag_file and str(hellaswag_file)),
        ("hellaswag_limit", hellaswag_limit)) if value is not None}
    if resume is not None:
        overrides = {"backend": backend, "tf32": tf32, "eager": eager} | ({"steps": steps} if steps is not None else {})
        run = training.resume_run(resume, overrides | hellaswag_settings, log)
    else:
        tc = training.TrainConfig(preset=preset, backend=backend, corpus=str(corpus) if corpus else None,
                                  tokenizer=str(tokenizer) if tokenizer else None, steps=steps or DEFAULT["steps"],
                                  batch_size=batch_size,
                                  lr=lr, warmup=warmup, decay_steps=decay_steps, seed=seed, eval_every=eval_every,
                                  ckpt_every=ckpt_every, tf32=tf32, eager=eager, **hellaswag_settings)
        if tc.eval_hellaswag_every:
            hellaswag_path(tc)  # a missing file fails now, not after minutes of tokenizer training
        run = training.start_run(out, tc, log)
    cfg = run.model.cfg
    log(f"run {run.dir}: {cfg.n_params():,} parameters ({run.config.preset}), backend {run.config.backend}, "
        f"batch {run.config.batch_size} x {cfg.ctx_len}, steps {run.optimizer.step_count} -> {run.config.steps}")
    log(f"unigram baseline loss: {run.unigram_loss:.3f} nats (a model that ignores context)")
    extra_evals = []
    if run.config.eval_hellaswag_every:
        extra_evals.append((run.config.eval_hellaswag_every, hellaswag.training_metrics(
            run.tok, hellaswag_path(run.config), cfg.ctx_len, run.config.hellaswag_limit)))
    row, interrupted = training.train(run, log, extra_evals)
    if interrupted:
        raise typer.Exit(130)
    if row:
        log(f"done: step {row['step']}, train loss {row['loss']:.3f} (mean of the {cfg.n_mtp} heads), validation "
            f"{row.get('val_loss', float('nan')):.3f}, next-token validation {row.get('val_next_token_loss', float('nan')):.3f} "
            f"(unigram baseline {run.unigram_loss:.3f}); run saved in {run.dir}")
        if "hellaswag_acc_norm" in row:
            log(f"HellaSwag: acc {row['hellaswag_acc']:.1%}, acc_norm {row['hellaswag_acc_norm']:.1%} (random: 25%)")
    log(f"plot its curves: nanoeuler-run plot {run.dir} --out {run.dir / 'curves.png'}")
    typer.echo(f"--- sample ({sample_prompt!r}, temperature 0.8, top-k 40) ---")
    typer.echo(sample_prompt, nl=False)
    run.model.generate(run.tok, sample_prompt, max_new_tokens=200, temperature=0.8, top_k=40, seed=run.config.seed,
                       on_text=stream_text)
    typer.echo("")


def hellaswag_path(tc: training.TrainConfig) -> Path:
    return hellaswag_file(Path(tc.hellaswag_file) if tc.hellaswag_file else None)


def stream_text(piece: str) -> None:
    """Print generated text as it comes."""
    sys.stdout.write(piece)
    sys.stdout.flush()


def generate(
    run_dir: Path = typer.Argument(..., help="a run directory (from pretrain or sft)"),
    prompt: str = typer.Argument("", help="text to continue"),
    max_new_tokens: int = typer.Option(200, help="tokens to generate at most"),
    temperature: float = typer.Option(0.8, help="0 = greedy"),
    top_k: Optional[int] = typer.Option(None, help="sample among the k most likely tokens"),
    top_p: Optional[float] = typer.Option(None, help="sample among the most likely tokens holding this probability"),
    seed: Optional[int] = typer.Option(None, help="seed for reproducible samples"),
    backend: str = typer.Option("cpu", help="cpu, cuda or reference"),
) -> None:
    """Continue PROMPT with the model in RUN_DIR, streaming tokens as they come."""
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    model, tok = load_model(run_dir, backend)
    typer.echo(prompt, nl=False)
    model.generate(tok, prompt, max_new_tokens, temperature, top_k, top_p, seed, on_text=stream_text)
    typer.echo("")


def register(app: typer.Typer) -> None:
    app.command()(pretrain)
    app.command()(generate)
