"""Fine-tuning and chat commands: `sft`, `dpo`, `chat`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator, Optional

import typer

from nanoeuler_core.cli.train import (DECODE_WEIGHTS_HELP, GRAD_REDUCE_HELP, PRECISION_HELP, RECOMPUTE_HELP,
                                     SPECULATIVE_HELP, ZERO_HELP, log_run, rank0_log, stream_text)
from nanoeuler_core.inference.chat import Conversation
from nanoeuler_core.inference.decoder import DecodeStats
from nanoeuler_core.inference.generate import check_sampling, generate, prompt_ids
from nanoeuler_core.inference.loading import load_model
from nanoeuler_core.inference.template import ChatTemplate
from nanoeuler_core.training import distributed, dpo, sft
from nanoeuler_core.training import pretrain as training


def _log(msg: str) -> None:
    typer.echo(msg, err=True)


SFT_TEMPLATE_HELP = ("'alpaca' or a Jinja chat template file (default: the base run's own, from its "
                     "tokenizer_config.json or its fine-tuning; else Alpaca)")
CHAT_TEMPLATE_HELP = ("'alpaca' or a Jinja chat template file (default: the run's own, from its tokenizer_config.json "
                      "or its fine-tuning)")


def _accuracy_line(name: str, overall: float, per_task: dict[str, float]) -> str:
    tasks = ", ".join(f"{task} {value:.0%}" for task, value in per_task.items())
    return f"{name}: exact match {overall:.1%}" + (f" ({tasks})" if len(per_task) > 1 else "")


def sft_command(
    base: Path = typer.Option(..., help="run directory of the pretrained model to start from"),
    data: Optional[Path] = typer.Option(None, help="Alpaca JSON or JSONL file (default: the bundled tasks)"),
    out: Path = typer.Option(Path("runs/sft"), help="run directory to create"),
    steps: int = typer.Option(3000, help="optimizer steps (about 6 minutes for `small` on 2 CPU cores)"),
    batch_size: int = typer.Option(16, help="examples per micro-batch, on each rank"),
    grad_accum: int = typer.Option(1, help="micro-batches per optimizer step"),
    zero: int = typer.Option(0, help=ZERO_HELP),
    grad_reduce: str = typer.Option("fp32", help=GRAD_REDUCE_HELP + ")"),
    lr: float = typer.Option(1e-3, help="peak learning rate"),
    seed: int = typer.Option(0, help="seed of the example order"),
    val_fraction: float = typer.Option(0.1, help="the last fraction of the examples held out for evaluation"),
    eval_every: int = typer.Option(100, help="held-out loss every N steps"),
    backend: str = typer.Option("cpu", help="cpu, cuda or reference"),
    precision: Optional[str] = typer.Option(None, help=PRECISION_HELP),
    recompute: bool = typer.Option(False, help=RECOMPUTE_HELP),
    template: Optional[str] = typer.Option(None, help=SFT_TEMPLATE_HELP),
) -> None:
    """Fine-tune a pretrained run on instructions; reports held-out exact match before and after.

    Under `mpiexec -n N`, N data-parallel ranks train it; rank 0 evaluates."""
    data = data or sft.bundled_tasks()
    with distributed.fail_together():
        job = distributed.world()
        log = rank0_log(job)
        tc = sft.fine_tune_config(base, backend=backend, steps=steps, batch_size=batch_size, grad_accum=grad_accum,
                                  zero=zero, grad_reduce=grad_reduce, lr=lr, seed=seed, eval_every=eval_every,
                                  val_fraction=val_fraction, precision=precision, recompute=recompute)
        chat_template = sft.sft_template(base, template)
        run, heldout = sft.start_sft(base, data, out, tc, log, chat_template)
        log_run(run, log)
        log(f"examples rendered in {chat_template.name}")
        if heldout and job.rank == 0:
            log(_accuracy_line("base model on the held-out examples",
                               *sft.exact_match(run.model, run.tok, heldout, chat_template)))
        job.barrier()  # the others wait here, not in the first step where the watchdog counts
        row, interrupted = training.train(run, log)
    if interrupted:
        raise typer.Exit(130)
    if job.rank != 0:
        return
    _log(f"done: step {row['step']}, train loss {row['loss']:.3f}, held-out loss {row.get('val_loss', float('nan')):.3f}; "
         f"run saved in {run.dir}")
    if heldout:
        typer.echo(_accuracy_line("fine-tuned model on the held-out examples",
                                  *sft.exact_match(run.model, run.tok, heldout, chat_template)))
    typer.echo(f"chat with it: nanoeuler-run chat {run.dir}")


def dpo_command(
    base: Path = typer.Option(..., help="run directory to align (usually an sft run)"),
    data: Optional[Path] = typer.Option(None, help="JSONL of {instruction, chosen, rejected} pairs "
                                                   "(default: the bundled pairs)"),
    out: Path = typer.Option(Path("runs/dpo"), help="run directory to create"),
    beta: float = typer.Option(0.1, help="DPO temperature: how far the policy may move from the reference"),
    steps: int = typer.Option(200, help="optimizer steps"),
    batch_size: int = typer.Option(8, help="pairs per micro-batch, on each rank"),
    grad_accum: int = typer.Option(1, help="micro-batches per optimizer step"),
    zero: int = typer.Option(0, help=ZERO_HELP),
    grad_reduce: str = typer.Option("fp32", help=GRAD_REDUCE_HELP + ")"),
    lr: float = typer.Option(1e-4, help="peak learning rate"),
    seed: int = typer.Option(0, help="seed of the pair order"),
    val_fraction: float = typer.Option(0.1, help="the last fraction of the pairs held out for evaluation"),
    eval_every: int = typer.Option(50, help="held-out preference accuracy every N steps"),
    backend: str = typer.Option("cpu", help="cpu, cuda or reference"),
    precision: Optional[str] = typer.Option(None, help=PRECISION_HELP),
    recompute: bool = typer.Option(False, help=RECOMPUTE_HELP),
) -> None:
    """Align a run with preference pairs (DPO); reports held-out preference accuracy before and after.

    Under `mpiexec -n N`, N data-parallel ranks train it."""
    data = data or dpo.bundled_pairs()
    with distributed.fail_together():
        job = distributed.world()
        log = rank0_log(job)
        tc = sft.fine_tune_config(base, backend=backend, steps=steps, batch_size=batch_size, grad_accum=grad_accum,
                                  zero=zero, grad_reduce=grad_reduce, lr=lr, seed=seed, eval_every=eval_every,
                                  val_fraction=val_fraction, precision=precision, recompute=recompute)
        trainer = dpo.start_dpo(base, data, out, tc, beta, log)
        log_run(trainer.run, log)
        heldout = trainer.heldout
        if heldout is not None:
            before = dpo.preference_metrics(heldout.reference, heldout.reference, beta)
            log(f"before DPO, held-out pairs: preference accuracy {before['accuracy']:.1%}")
        _, interrupted = trainer.train(log)
    if interrupted:
        raise typer.Exit(130)
    if job.rank != 0:
        return
    if heldout is not None:
        after = dpo.evaluate(trainer.run.model, heldout, beta, batch_size)
        typer.echo(f"after DPO, held-out pairs: preference accuracy {after['accuracy']:.1%} "
                   f"(before {before['accuracy']:.1%}), reward margin {after['reward_margin']:.3f}, "
                   f"reward accuracy {after['reward_accuracy']:.1%}")
    typer.echo(f"run saved in {trainer.run.dir}; chat with it: nanoeuler-run chat {trainer.run.dir}")


def _lines(prompt: str) -> Iterator[str]:
    """What the user types: with a prompt on a terminal, one line at a time from a pipe."""
    if sys.stdin.isatty():
        while True:
            try:
                yield input(prompt)
            except EOFError:
                typer.echo("", err=True)
                return
    else:
        for line in sys.stdin:
            yield line.rstrip("\r\n")


def chat_command(
    run_dir: Path = typer.Argument(..., help="a run directory (from sft or dpo; a pretrained run continues text)"),
    max_new_tokens: int = typer.Option(100, help="tokens per reply at most"),
    temperature: float = typer.Option(0.7, help="0 = greedy"),
    top_k: Optional[int] = typer.Option(40, help="sample among the k most likely tokens"),
    top_p: Optional[float] = typer.Option(None, help="sample among the most likely tokens holding this probability"),
    seed: Optional[int] = typer.Option(None, help="seed for reproducible replies"),
    speculative: Optional[bool] = typer.Option(None, "--speculative/--no-speculative", help=SPECULATIVE_HELP),
    decode_weights: Optional[str] = typer.Option(None, help=DECODE_WEIGHTS_HELP),
    backend: str = typer.Option("cpu", help="cpu, cuda or reference"),
    template: Optional[str] = typer.Option(None, help=CHAT_TEMPLATE_HELP),
    system: Optional[str] = typer.Option(None, help="a system message opening the conversation (for templates "
                                                    "that take one)"),
) -> None:
    """Talk to the model in RUN_DIR, one line per message; /reset starts over, /quit leaves. The
    conversation is rendered in the run's chat template (--template overrides); a run without one
    continues each line. A message that does not fit the context is refused with one line (and,
    when input is piped, ends the chat with status 1)."""
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    model, tok = load_model(run_dir, backend)
    chat_template = ChatTemplate.for_run(run_dir, template)
    if chat_template is None and system is not None:
        raise ValueError(f"{run_dir} has no chat template, so no system message: pass --template too")
    conversation = Conversation(chat_template, system)
    if chat_template is not None:  # a template that refuses these roles says so now, not at the first message
        chat_template.render(conversation.messages + [{"role": "user", "content": "?"}])
    mode = f"a conversation in {chat_template.name}" if chat_template else "each line continued (a pretrained model)"
    _log(f"{run_dir}: {mode}; /reset starts over, /quit leaves")
    stats = DecodeStats()
    for turn, line in enumerate(_lines("> ")):
        if line.strip() == "/quit":
            break
        if line.strip() == "/reset":
            conversation.reset()
            _log("(conversation cleared)")
            continue
        if not line.strip():
            continue
        sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        seed=None if seed is None else seed + turn, on_text=stream_text, speculative=speculative,
                        stats=stats, weights=decode_weights)
        try:
            if chat_template:
                conversation.say(model, tok, line, **sampling)
            else:
                prompt_ids(tok, line, model.cfg.ctx_len, "the message")  # refused before it is echoed
                typer.echo(line, nl=False)
                generate(model, tok, line, **sampling)
        except ValueError as exc:
            if not sys.stdin.isatty():
                raise
            _log(f"error: {exc}")
            continue
        typer.echo("")
    if stats.tokens:
        _log(stats.line())


def register(app: typer.Typer) -> None:
    app.command("sft")(sft_command)
    app.command("dpo")(dpo_command)
    app.command("chat")(chat_command)
