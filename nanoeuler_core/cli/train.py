"""Pretraining and sampling commands: `pretrain`, `generate`."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import fields
from pathlib import Path
from typing import Optional

import typer

from nanoeuler_core import registry
from nanoeuler_core.cli import warm
from nanoeuler_core.cli.evaluate import hellaswag_file
from nanoeuler_core.eval import hellaswag
from nanoeuler_core.inference.decoder import DecodeStats
from nanoeuler_core.inference.generate import check_sampling, generate_batch, prompt_ids
from nanoeuler_core.inference.generate import generate as generate_text
from nanoeuler_core.inference.loading import load_model
from nanoeuler_core.training import distributed
from nanoeuler_core.training import pretrain as training

DEFAULT = {f.name: f.default for f in fields(training.TrainConfig)}
NO_STEP_LIMIT = 10**12   # --time-budget without --steps: the budget alone ends the run
PRECISION_HELP = "fp32, tf32 or bf16 (default: bf16 on a CUDA GPU with tensor cores, fp32 on the CPU)"
SAMPLE_TEMPERATURE, SAMPLE_TOP_K = 0.8, 40   # the sample printed at the end of a run
ZERO_HELP = ("1: shard the AdamW moments over the mpiexec ranks (ZeRO-1); 2: and the summed gradients, the whole "
             "gradient living only bucket by bucket (ZeRO-2)")
GRAD_REDUCE_HELP = ("fp32 or bf16: what the gradients' sums over the mpiexec ranks travel in (bf16: half the bytes, "
                    "the sums rounded to bf16; default: fp32")
RECOMPUTE_HELP = ("activation recomputation (llm.c's -r): keep only each block's input and run its forward again "
                  "in the backward; about one block's activations instead of all of them, for one more forward pass "
                  "of the blocks; the same gradients")


def pretrain(
    preset: str = typer.Option("small", help="model preset: small (CPU, minutes), cpu-medium (14M), gpu "
                                             "(116M parameters), gpu-medium (292M) or gpu-large (634M)"),
    backend: Optional[str] = typer.Option(None, help="cpu, cuda or reference (default: cpu; with --resume: the run's own)"),
    corpus: Optional[Path] = typer.Option(None, help="UTF-8 text file (default: the bundled Shakespeare)"),
    tokenizer: Optional[Path] = typer.Option(None, help="tokenizer.json to use (default: train one on the corpus)"),
    steps: Optional[int] = typer.Option(None, help=f"train until this step (default: {DEFAULT['steps']}; "
                                                   f"with --resume: the run's own)"),
    batch_size: int = typer.Option(DEFAULT["batch_size"], help="sequences per micro-batch (each ctx_len tokens), on each rank"),
    grad_accum: Optional[int] = typer.Option(None, help="micro-batches per optimizer step (default: 1; with --resume: "
                                                        "the run's own)"),
    zero: Optional[int] = typer.Option(None, help=ZERO_HELP + "; a checkpoint resumes with or without it"),
    grad_reduce: Optional[str] = typer.Option(None, help=GRAD_REDUCE_HELP + "; with --resume: the run's own)"),
    lr: Optional[float] = typer.Option(None, help="peak learning rate (default: 1e-3 small, 3e-4 otherwise)"),
    warmup: Optional[int] = typer.Option(None, help="warm-up steps (default: 5% of --decay-steps)"),
    decay_steps: Optional[int] = typer.Option(None, help="the schedule's horizon (default: --steps)"),
    schedule: str = typer.Option("cosine", help="cosine, or wsd: warmup-stable-decay (the peak held, then a "
                                                "linear decay over the last 20% of the steps after warm-up)"),
    optimizer: str = typer.Option("adamw", help="adamw, or muon: Muon (momentum orthogonalized by Newton-Schulz) "
                                                "for the blocks' matrices, AdamW for the embeddings, heads and norms"),
    muon_lr: Optional[float] = typer.Option(None, help="with --optimizer muon: the Muon group's peak learning rate "
                                                       "(default: --lr), on the same schedule"),
    target_loss: Optional[float] = typer.Option(None, help="stop once the held-out next-token loss (checked every --eval-every "
                                                           "steps) reaches this, with a checkpoint, and print the time"),
    time_budget: Optional[float] = typer.Option(None, help="train for this many minutes (no --steps limit unless "
                                                           "given): the schedule is laid over them, its decay ending "
                                                           "with them, then a last evaluation and checkpoint"),
    seed: int = typer.Option(DEFAULT["seed"], help="seed of the initial weights and the batches"),
    eval_every: int = typer.Option(DEFAULT["eval_every"], help="validation loss every N steps"),
    ckpt_every: int = typer.Option(DEFAULT["ckpt_every"], help="checkpoint every N steps (and at the end, and on Ctrl-C)"),
    out: Path = typer.Option(Path("runs/pretrain"), help="run directory to create"),
    resume: Optional[Path] = typer.Option(None, help="continue the run in this directory (its settings are kept; "
                                                      "--steps and --backend may change)"),
    sample_prompt: str = typer.Option("\n", help="prompt of the sample printed at the end"),
    precision: Optional[str] = typer.Option(None, help=PRECISION_HELP + "; with --resume: the run's own"),
    eager: bool = typer.Option(False, help="CUDA: launch each kernel from Python instead of replaying the captured step"),
    recompute: Optional[bool] = typer.Option(None, "--recompute/--no-recompute",
                                             help=RECOMPUTE_HELP + " (default: off; with --resume: the run's own)"),
    tie_embeddings: bool = typer.Option(False, help="head 0 reads the embedding table instead of a matrix of its own "
                                                    "(Llama's tie_word_embeddings; with --resume: the run's own)"),
    eval_hellaswag_every: Optional[int] = typer.Option(None, help="HellaSwag acc and acc_norm every N steps "
                                                                  "into metrics.jsonl (default: never)"),
    hellaswag_file: Optional[Path] = typer.Option(None, help="HellaSwag JSONL (default: where `data hellaswag` "
                                                             "puts it)"),
    hellaswag_limit: Optional[int] = typer.Option(None, help="score only the first N HellaSwag items"),
) -> None:
    """Pretrain a model; with no arguments, the `small` preset on the bundled corpus on the CPU.

    Under `mpiexec -n N`, N data-parallel ranks train it (one GPU each with --backend cuda)."""
    with contextlib.ExitStack() as cleanup:
        warmer = None
        with distributed.fail_together():
            job = distributed.world()
            log = rank0_log(job)
            hellaswag_settings = {name: value for name, value in (
                ("eval_hellaswag_every", eval_hellaswag_every), ("hellaswag_file", hellaswag_file and str(hellaswag_file)),
                ("hellaswag_limit", hellaswag_limit)) if value is not None}
            if resume is not None:
                overrides = ({"precision": precision, "eager": eager}
                             | {k: v for k, v in (("backend", backend), ("steps", steps), ("grad_accum", grad_accum),
                                                  ("zero", zero), ("grad_reduce", grad_reduce), ("recompute", recompute),
                                                  ("target_loss", target_loss), ("time_budget", time_budget)) if v is not None})
                run = training.resume_run(resume, overrides | hellaswag_settings, log)
            else:
                tc = training.TrainConfig(preset=preset, backend=backend or "cpu", corpus=str(corpus) if corpus else None,
                                          tokenizer=str(tokenizer) if tokenizer else None, steps=steps or (NO_STEP_LIMIT if time_budget else DEFAULT["steps"]),
                                          batch_size=batch_size, grad_accum=1 if grad_accum is None else grad_accum,
                                          zero=zero or 0, grad_reduce=grad_reduce or "fp32",
                                          lr=lr, warmup=warmup, decay_steps=decay_steps, schedule=schedule, optimizer=optimizer, muon_lr=muon_lr, target_loss=target_loss, time_budget=time_budget, seed=seed,
                                          eval_every=eval_every,
                                          ckpt_every=ckpt_every, precision=precision, eager=eager,
                                          recompute=bool(recompute), tie_embeddings=tie_embeddings,
                                          **hellaswag_settings)
                if tc.eval_hellaswag_every:
                    hellaswag_path(tc)  # a missing file fails now, not after minutes of tokenizer training
                tc.resolve_precision()
                if job.size == 1 and warm.wanted() and registry.backend(tc.backend).kernel_cache_cold():
                    # a cold kernel cache compiles on a second core, while the tokenizer trains
                    warmer = cleanup.enter_context(warm.KernelWarmer(tc.preset, tc.backend, tc.precision, tc.recompute,
                                                                not tc.eager, SAMPLE_TEMPERATURE, SAMPLE_TOP_K,
                                                                tc.optimizer))
                run = training.start_run(out, tc, log)
            if warmer:
                warmer.wait_for_step()
            log_run(run, log)
            log(f"unigram baseline loss: {run.unigram_loss:.3f} nats (a model that ignores context)")
            extra_evals = []
            if run.config.eval_hellaswag_every:
                extra_evals.append((run.config.eval_hellaswag_every, hellaswag.training_metrics(
                    run.tok, hellaswag_path(run.config), run.model.cfg.ctx_len, run.config.hellaswag_limit)))
            row, interrupted = training.train(run, log, extra_evals)
            log(distributed.memory_line(run.model, run.optimizer))
        if interrupted:
            raise typer.Exit(130)
        if job.rank != 0:
            return
        cfg = run.model.cfg
        if row:
            log(f"done: step {row['step']}, train loss {row['loss']:.3f} (mean of the {cfg.n_mtp} heads), validation "
                f"{row.get('val_loss', float('nan')):.3f}, next-token validation {row.get('val_next_token_loss', float('nan')):.3f} "
                f"(unigram baseline {run.unigram_loss:.3f}); run saved in {run.dir}")
            if "hellaswag_acc_norm" in row:
                log(f"HellaSwag: acc {row['hellaswag_acc']:.1%}, acc_norm {row['hellaswag_acc_norm']:.1%} (random: 25%)")
        log(f"plot its curves: nanoeuler-run plot {run.dir} --out {run.dir / 'curves.png'}")
        if warmer:
            warmer.wait_for_decoding()
        typer.echo(f"--- sample ({sample_prompt!r}, temperature {SAMPLE_TEMPERATURE}, top-k {SAMPLE_TOP_K}) ---")
        typer.echo(sample_prompt, nl=False)
        generate_text(run.model, run.tok, sample_prompt, max_new_tokens=200, temperature=SAMPLE_TEMPERATURE,
                      top_k=SAMPLE_TOP_K, seed=run.config.seed, on_text=stream_text)
        typer.echo("")


def rank0_log(job):
    """Log lines to stderr from rank 0 only (every rank of a data-parallel job has the same to say)."""
    return (lambda msg: typer.echo(msg, err=True)) if job.rank == 0 else (lambda msg: None)


def log_run(run, log) -> None:
    """What a run trains: model, backend, batch (micro-batches, ranks) and steps."""
    tc, cfg = run.config, run.model.cfg
    ranks = distributed.world().size
    shape = f"batch {tc.batch_size} x {cfg.ctx_len}"
    if tc.grad_accum > 1 or ranks > 1:
        notes = ", ".join(n for n in (run.optimizer.sharded, "sums in bf16" if run.optimizer.sums_in_bf16 else "") if n)
        notes = f" ({notes})" if notes else ""
        shape += (f" per micro-batch, {tc.grad_accum} micro-batch{'es' if tc.grad_accum > 1 else ''} on each of "
                  f"{ranks} rank{'s' if ranks > 1 else ''}{notes}: "
                  f"{training.rows_per_step(tc)} sequences per step")
    log(f"run {run.dir}: {cfg.n_params():,} parameters ({tc.preset}), backend {tc.backend} ({tc.precision}), {shape}, "
        f"steps {run.optimizer.step_count} -> " + (f"{tc.steps}" if tc.time_budget is None else
                                                   f"what {tc.time_budget:g} min of training allow")
        + (", activations recomputed" if tc.recompute else ""))


def hellaswag_path(tc: training.TrainConfig) -> Path:
    return hellaswag_file(Path(tc.hellaswag_file) if tc.hellaswag_file else None)


def stream_text(piece: str) -> None:
    """Print generated text as it comes."""
    sys.stdout.write(piece)
    sys.stdout.flush()


SPECULATIVE_HELP = ("self-speculative decoding with the multi-token-prediction heads: the same greedy output, "
                    "the same sampling distribution (default: greedy steps speculate where measured faster; "
                    "sampled ones where the backend's wide steps are cheap, --backend cuda)")
DECODE_WEIGHTS_HELP = ("the weights decoding reads: bf16, fp32, int8 or int4 (quantized as the run is if it is, else "
                       "as `quantize` does; default: a quantized run's own, else bf16 where the backend runs it, a GPU)")


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
    decode_weights: Optional[str] = typer.Option(None, help=DECODE_WEIGHTS_HELP),
    backend: str = typer.Option("cpu", help="cpu, cuda or reference"),
) -> None:
    """Continue PROMPT with the model in RUN_DIR, streaming tokens as they come (several samples:
    each printed whole, separated by a line '---'); speed and acceptance go to stderr."""
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    if num_samples < 1:
        raise ValueError(f"--num-samples must be at least 1, got {num_samples}")
    model, tok = load_model(run_dir, backend)
    prompt_ids(tok, prompt, model.cfg.ctx_len)  # a prompt longer than the context is refused before it is echoed
    stats = DecodeStats()
    sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                    speculative=speculative, stats=stats, weights=decode_weights)
    if num_samples == 1:
        typer.echo(prompt, nl=False)
        generate_text(model, tok, prompt, on_text=stream_text, **sampling)
        typer.echo("")
    else:
        texts = generate_batch(model, tok, [prompt] * num_samples, **sampling)
        typer.echo("\n---\n".join(prompt + text for text in texts))
    typer.echo(stats.line(), err=True)


def register(app: typer.Typer) -> None:
    app.command()(pretrain)
    app.command()(generate)
