"""Evaluation commands: `eval` (HellaSwag, or the loss on a text file) and `plot` (training curves)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import List, Optional

import orjson
import typer

from nanoeuler_core.corpus.downloads import HELLASWAG_DEFAULT
from nanoeuler_core.engine.checkpoint import atomic_write
from nanoeuler_core.eval import curves, hellaswag, text_loss
from nanoeuler_core.inference.loading import load_model
from nanoeuler_core.training.pretrain import Progress

TASKS = ("hellaswag", "loss")


def hellaswag_file(data: Optional[Path]) -> Path:
    """The HellaSwag file to read: `data`, else where `data hellaswag` downloads it."""
    path = data or HELLASWAG_DEFAULT
    if data is None and not path.is_file():
        raise ValueError(f"{path} not found: download it with `nanoeuler-run data hellaswag`, or pass --data FILE")
    return path


def eval_command(
    run_dir: Path = typer.Argument(..., help="a run directory"),
    task: str = typer.Option("hellaswag", help="hellaswag, or loss: the next-token loss on the text file --data"),
    limit: Optional[int] = typer.Option(None, help="score only the first N items"),
    backend: str = typer.Option("cpu", help="cpu, cuda or reference"),
    data: Optional[Path] = typer.Option(None, help=f"the task's data file (default: {HELLASWAG_DEFAULT})"),
    out: Optional[Path] = typer.Option(None, help="also write the result, with every item's scores, to this JSON file"),
    batch_size: int = typer.Option(32, help="sequences scored per forward pass"),
    window: int = typer.Option(1024, help="--task loss: tokens a window predicts (capped at the context)"),
) -> None:
    """Score RUN_DIR on HellaSwag as lm-evaluation-harness does, or its next-token loss on a text
    file; prints the result as JSON."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r} (available: {', '.join(TASKS)})")
    if task == "loss":
        if data is None or not data.is_file() or window < 1 or batch_size < 1:
            raise ValueError("eval --task loss needs --data, an existing text file, and positive --window and --batch-size")
        model, tok = load_model(run_dir, backend)
        result = text_loss.evaluate(model, tok, data, window, batch_size)
        typer.echo(f"loss on {result['tokens']:,} tokens of {data}: {result['loss']:.4f} nats "
                   f"(perplexity {result['perplexity']:.2f})", err=True)
        typer.echo(orjson.dumps(result | {"run": str(run_dir), "data": str(data), "backend": backend}).decode())
        return
    path = hellaswag_file(data)
    items = hellaswag.load_items(path, limit)
    model, tok = load_model(run_dir, backend)
    progress = Progress(len(items) * hellaswag.N_ENDINGS, sys.stderr)
    start = time.perf_counter()

    def report(done: int, total: int) -> None:
        elapsed = time.perf_counter() - start
        progress.update(done, f"hellaswag: {done}/{total} endings scored | {done / max(elapsed, 1e-9):.0f}/s")

    try:
        result, logprobs = hellaswag.evaluate(model, tok, items, batch_size, report)
    finally:
        progress.close()
    result |= {"run": str(run_dir), "data": str(path), "backend": backend,
               "seconds": round(time.perf_counter() - start, 1)}
    typer.echo(f"{task} on {result['n']} items: acc {result['acc']:.1%}, acc_norm {result['acc_norm']:.1%} "
               f"(random: 25%)", err=True)
    typer.echo(orjson.dumps(result).decode())
    if out is not None:
        detail = {**result, "items": [{"label": item.label, "logprobs": scores.tolist()}
                                      for item, scores in zip(items, logprobs)]}
        atomic_write(out, orjson.dumps(detail, option=orjson.OPT_INDENT_2) + b"\n")


def plot_command(
    run_dirs: List[Path] = typer.Argument(..., help="one or more run directories, overlaid"),
    out: Path = typer.Option(Path("curves.png"), help="image to write (png, svg, pdf, ...)"),
    x: str = typer.Option("tokens", help="the horizontal axis: tokens (seen) or seconds (of training)"),
) -> None:
    """Plot training and validation loss and the learning rate against tokens seen or seconds."""
    typer.echo(f"curves of {len(run_dirs)} run(s) in {curves.plot_runs(run_dirs, out, x)}")


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_command)
    app.command("plot")(plot_command)
