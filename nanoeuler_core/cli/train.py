"""Pretraining and sampling commands: `pretrain`, `generate`."""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path
from typing import Optional

import typer

from nanoeuler_core.inference.decode import DecodeStats
from nanoeuler_core.inference.generate import check_sampling
from nanoeuler_core.inference.loading import load_model
from nanoeuler_core.training import pretrain as training

DEFAULT = {f.name: f.default for f in fields(training.TrainConfig)}
PRECISION_HELP = "fp32, tf32 or bf16 (default: bf16 on a CUDA GPU with tensor cores, fp32 on the CPU)"


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
    precision: Optional[str] = typer.Option(None, help=PRECISION_HELP + "; with --resume: the run's own"),
    eager: bool = typer.Option(False, help="CUDA: launch each kernel from Python instead of replaying the captured step"),
) -> None:
    """Pretrain a model; with no arguments, the `small` preset on the bundled corpus on the CPU."""
    log = lambda msg: typer.echo(msg, err=True)  # noqa: E731
    if resume is not None:
        overrides = {"backend": backend, "precision": precision, "eager": eager} | ({"steps": steps} if steps is not None else {})
        run = training.resume_run(resume, overrides, log)
    else:
        tc = training.TrainConfig(preset=preset, backend=backend, corpus=str(corpus) if corpus else None,
                                  tokenizer=str(tokenizer) if tokenizer else None, steps=steps or DEFAULT["steps"],
                                  batch_size=batch_size,
                                  lr=lr, warmup=warmup, decay_steps=decay_steps, seed=seed, eval_every=eval_every,
                                  ckpt_every=ckpt_every, precision=precision, eager=eager)
        run = training.start_run(out, tc, log)
    cfg = run.model.cfg
    log(f"run {run.dir}: {cfg.n_params():,} parameters ({run.config.preset}), backend {run.config.backend} "
        f"({run.config.precision}), "
        f"batch {run.config.batch_size} x {cfg.ctx_len}, steps {run.optimizer.step_count} -> {run.config.steps}")
    log(f"unigram baseline loss: {run.unigram_loss:.3f} nats (a model that ignores context)")
    row, interrupted = training.train(run, log)
    if interrupted:
        raise typer.Exit(130)
    if row:
        log(f"done: step {row['step']}, train loss {row['loss']:.3f} (mean of the {cfg.n_mtp} heads), validation "
            f"{row.get('val_loss', float('nan')):.3f}, next-token validation {row.get('val_next_token_loss', float('nan')):.3f} "
            f"(unigram baseline {run.unigram_loss:.3f}); run saved in {run.dir}")
    typer.echo(f"--- sample ({sample_prompt!r}, temperature 0.8, top-k 40) ---")
    typer.echo(sample_prompt, nl=False)
    run.model.generate(run.tok, sample_prompt, max_new_tokens=200, temperature=0.8, top_k=40, seed=run.config.seed,
                       on_text=stream_text)
    typer.echo("")


def stream_text(piece: str) -> None:
    """Print generated text as it comes."""
    sys.stdout.write(piece)
    sys.stdout.flush()


SPECULATIVE_HELP = ("self-speculative decoding with the multi-token-prediction heads: the same greedy output, "
                    "the same sampling distribution (default: on where it is usually faster, --backend cuda)")


def generate(
    run_dir: Path = typer.Argument(..., help="a run directory (from pretrain or sft)"),
    prompt: str = typer.Argument("", help="text to continue"),
    max_new_tokens: int = typer.Option(200, help="tokens to generate at most"),
    temperature: float = typer.Option(0.8, help="0 = greedy"),
    top_k: Optional[int] = typer.Option(None, help="sample among the k most likely tokens"),
    top_p: Optional[float] = typer.Option(None, help="sample among the most likely tokens holding this probability"),
    seed: Optional[int] = typer.Option(None, help="seed for reproducible samples (sample i uses seed + i)"),
    num_samples: int = typer.Option(1, help="continuations of PROMPT, generated together as one batch"),
    speculative: Optional[bool] = typer.Option(None, "--speculative/--no-speculative", help=SPECULATIVE_HELP),
    backend: str = typer.Option("cpu", help="cpu, cuda or reference"),
) -> None:
    """Continue PROMPT with the model in RUN_DIR, streaming tokens as they come (several samples:
    each printed whole, separated by a line '---'); speed and acceptance go to stderr."""
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    if num_samples < 1:
        raise ValueError(f"--num-samples must be at least 1, got {num_samples}")
    model, tok = load_model(run_dir, backend)
    stats = DecodeStats()
    sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                    speculative=speculative, stats=stats)
    if num_samples == 1:
        typer.echo(prompt, nl=False)
        model.generate(tok, prompt, on_text=stream_text, **sampling)
        typer.echo("")
    else:
        texts = model.generate_batch(tok, [prompt] * num_samples, **sampling)
        typer.echo("\n---\n".join(prompt + text for text in texts))
    typer.echo(stats.line(), err=True)


def register(app: typer.Typer) -> None:
    app.command()(pretrain)
    app.command()(generate)
