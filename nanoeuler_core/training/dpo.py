"""Direct Preference Optimization (DPO): training on pairs of a preferred and a rejected response.

A pair is a prompt (an instruction, optional input, rendered in the base run's chat template as
SFT renders it: Alpaca unless the run has its own) with a `chosen` and a `rejected` response. Each
response is scored by its summed log-probability (the end-of-turn token included) under the
policy being trained and under the reference model, the starting weights, frozen. The reference
never changes, so its scores are computed once, before training. Each step:

    logp = token_logprobs(chosen and rejected rows).sum(axis=1)     policy scores (2P,)
    losses, saved = dpo_loss.forward(logp_chosen, logp_rejected, ref_chosen, ref_rejected, beta)
    d_chosen, d_rejected = dpo_loss.backward(1 / P, saved, ...)     the registered op, by hand
    logprob_backward(rows, weights = d_row on every response token)  gradient of the mean loss
    AdamW step                                                      (`loss_and_backward`, then `DPOTrainer.step`)

With --grad-accum and under mpiexec, a step's pairs are every micro-batch of every rank: each
micro-batch adds its pairs' share of the mean loss's gradient, and AdamW sums it over the ranks.

Evaluation on held-out pairs: preference accuracy (the policy scores the chosen response above
the rejected one), the mean reward margin beta * ((pc - rc) - (pr - rr)), which is 0 before
training since the policy is the reference, and the reward accuracy (pairs whose margin is > 0).
"""

from __future__ import annotations

import importlib.resources
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from nanoeuler_core import registry
from nanoeuler_core.engine.optim import lr_at
from nanoeuler_core.corpus.records import read_records, text_fields
from nanoeuler_core.inference.template import ChatTemplate, render_prompt
from nanoeuler_core.training import distributed
from nanoeuler_core.training.sft import (Encoded, collate, encode_example, epoch_indices, new_run_from, sft_template,
                                        split_heldout)
from nanoeuler_core.training.pretrain import Bookkeeping, Run, TrainConfig, rows_per_step


@dataclass(frozen=True)
class Pair:
    instruction: str
    input: str
    chosen: str
    rejected: str

    @property
    def prompt(self) -> str:
        """The prompt in the Alpaca template (`ChatTemplate.instruction_prompt` renders it in another)."""
        return render_prompt(self.instruction, self.input)


def bundled_pairs() -> Path:
    """The preference pairs shipped with the project, built from the bundled tasks."""
    return Path(str(importlib.resources.files("nanoeuler_data") / "dpo_pairs.jsonl"))


def load_pairs(path: Path) -> list[Pair]:
    """Preference pairs from a JSON list or JSONL file: instruction (or prompt), optional input,
    chosen, rejected."""
    pairs = []
    for where, item in read_records(path):
        if "prompt" in item and "instruction" not in item:
            item = {**item, "instruction": item["prompt"]}
        fields = text_fields(item, where, ("instruction", "chosen", "rejected"), ("input",))
        if fields["chosen"] == fields["rejected"]:
            raise ValueError(f"{where}: 'chosen' and 'rejected' are the same response")
        pairs.append(Pair(**fields))
    return pairs


@dataclass
class EncodedPairs:
    """Pairs as token sequences, with their reference scores (n, 2): chosen, rejected."""

    chosen: list[Encoded]
    rejected: list[Encoded]
    pad_id: int
    reference: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.chosen)

    def rows(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """inputs and targets (2P, T) of pairs `indices`: the chosen rows, then the rejected rows."""
        indices = list(indices)
        sequences = [self.chosen[i] for i in indices] + [self.rejected[i] for i in indices]
        return collate(sequences, self.pad_id)


def encode_pairs(tok, pairs: list[Pair], ctx_len: int, template: ChatTemplate | None = None
                 ) -> tuple[EncodedPairs, int]:
    """The pairs as sequences in `template` (default Alpaca), and how many sequences were truncated
    to fit the context."""
    template = template or ChatTemplate.alpaca()
    chat_tok = template.tokenizer(tok)
    prompts = [template.instruction_prompt(p.instruction, p.input) for p in pairs]
    chosen = [encode_example(chat_tok, prompt, p.chosen, ctx_len) for prompt, p in zip(prompts, pairs)]
    rejected = [encode_example(chat_tok, prompt, p.rejected, ctx_len) for prompt, p in zip(prompts, pairs)]
    return EncodedPairs(chosen, rejected, tok.eos_id), sum(s.truncated for s in chosen + rejected)


def sequence_logprobs(model, pairs: EncodedPairs, batch_size: int) -> np.ndarray:
    """Summed response log-probabilities (n, 2) of every pair's chosen and rejected response."""
    scores = np.empty((len(pairs), 2))
    for start in range(0, len(pairs), batch_size):
        indices = range(start, min(start + batch_size, len(pairs)))
        logp = model.token_logprobs(*pairs.rows(indices)).sum(axis=1)
        scores[start:start + len(indices)] = logp.reshape(2, -1).T
    return scores


def preference_metrics(scores: np.ndarray, reference: np.ndarray, beta: float) -> dict[str, float]:
    """Preference accuracy (the policy scores chosen above rejected), the mean reward margin, the
    reward accuracy (margin > 0: the policy moved towards chosen more than the reference had) and
    the DPO loss."""
    margin = beta * ((scores[:, 0] - reference[:, 0]) - (scores[:, 1] - reference[:, 1]))
    return {"accuracy": float(np.mean(scores[:, 0] > scores[:, 1])), "reward_margin": float(margin.mean()),
            "reward_accuracy": float(np.mean(margin > 0)), "loss": float(np.mean(np.logaddexp(0.0, -margin)))}


def evaluate(model, pairs: EncodedPairs, beta: float, batch_size: int) -> dict[str, float]:
    return preference_metrics(sequence_logprobs(model, pairs, batch_size), pairs.reference, beta)


def loss_and_backward(model, loss_op, inputs, targets, reference: np.ndarray, beta: float,
                      n_pairs: int | None = None, accumulate: bool = False, grads_ready=None) -> tuple[float, np.ndarray]:
    """The DPO loss of P pairs, rows (2P, T) = chosen rows then rejected rows, reference scores
    (P, 2), as their share of the mean over `n_pairs` pairs (default P: their mean); fills the
    model's gradient buffer with its gradient (adds it, with `accumulate`; the backward reports to
    `grads_ready`, Model.forward_backward's). Returns the loss share and the policy scores (P, 2)."""
    be = model.backend
    P = len(reference)
    n_pairs = n_pairs or P
    scores = model.token_logprobs(inputs, targets).sum(axis=1).reshape(2, P).T
    args = tuple(be.asarray(np.ascontiguousarray(x)) for x in (scores[:, 0], scores[:, 1], reference[:, 0], reference[:, 1]))
    losses, saved = loss_op.forward(*args, beta=beta)
    d_chosen, d_rejected, _, _ = loss_op.backward(be.asarray(np.full(P, 1.0 / n_pairs)), saved, *args, beta=beta)
    d_rows = np.concatenate([be.to_host(d_chosen), be.to_host(d_rejected)])  # d loss / d (row's summed log-prob)
    model.logprob_backward(inputs, targets, np.repeat(d_rows[:, None], inputs.shape[1], axis=1), accumulate, grads_ready)
    return float(be.to_host(losses).sum() / n_pairs), scores


class DPOTrainer:
    """The DPO loop on a run whose model is the policy; `pairs.reference` holds the frozen scores."""

    def __init__(self, run: Run, pairs: EncodedPairs, heldout: EncodedPairs | None, beta: float):
        self.run, self.pairs, self.heldout, self.beta = run, pairs, heldout, beta
        self.loss_op = registry.op("dpo_loss").impl(run.model.backend_name)

    def step(self, step: int) -> dict[str, float]:
        """One update on the pairs of `step` (every micro-batch of every rank); returns their loss,
        accuracy and margin."""
        tc, optimizer, job = self.run.config, self.run.optimizer, distributed.world()
        comm, n_pairs = optimizer.comm, rows_per_step(tc)
        loss, scores, reference = 0.0, [], []
        for k, part in enumerate(range(job.rank * tc.grad_accum, (job.rank + 1) * tc.grad_accum)):
            indices = epoch_indices(len(self.pairs), tc.seed, step * n_pairs + part * tc.batch_size, tc.batch_size)
            reference.append(self.pairs.reference[indices])
            share, part_scores = loss_and_backward(self.run.model, self.loss_op, *self.pairs.rows(indices), reference[-1],
                                                   self.beta, n_pairs, accumulate=k > 0,
                                                   grads_ready=optimizer.grads_ready_hook(final=k == tc.grad_accum - 1))
            loss += share
            scores.append(part_scores)
        lr = lr_at(step, tc.lr, tc.warmup, tc.decay_steps, tc.final_lr_ratio)
        grad_norm = self.run.optimizer.step(lr)
        scores, reference = np.concatenate(scores), np.concatenate(reference)
        if comm is not None:
            loss = float(comm.host_sum(np.array([loss]))[0])
            scores, reference = (comm.host_concat(x.reshape(-1)).reshape(-1, 2) for x in (scores, reference))
        metrics = preference_metrics(scores, reference, self.beta)
        return {"loss": loss, "lr": lr, "grad_norm": grad_norm, "accuracy": metrics["accuracy"],
                "reward_margin": metrics["reward_margin"]}

    def train(self, log: Callable[[str], None] = print) -> tuple[dict, bool]:
        """Train to `config.steps`, evaluating every `eval_every` steps and checkpointing every
        `ckpt_every` and at the end; returns the last metrics row and whether Ctrl-C stopped it
        (after saving the last finished step)."""
        run, tc = self.run, self.run.config
        start = time.perf_counter()
        row: dict = {}
        with Bookkeeping(run, "DPO training") as book:
            while run.optimizer.step_count < tc.steps and not book.interrupted:
                step = run.optimizer.step_count + 1
                row = {"step": step, **{k: round(v, 5) for k, v in self.step(step).items()}}
                if not math.isfinite(row["loss"]):
                    raise FloatingPointError(f"DPO loss became {row['loss']} at step {step}: lower --lr or --beta")
                row["time"] = round(time.perf_counter() - start, 3)
                if self.heldout is not None and (step % tc.eval_every == 0 or step == tc.steps):
                    held = evaluate(run.model, self.heldout, self.beta, tc.batch_size)
                    row |= {f"val_{k}": round(v, 5) for k, v in held.items()}
                book.end_step(step, row, f"step {step}/{tc.steps} | loss {row['loss']:.3f} | "
                                         f"batch accuracy {row['accuracy']:.2f} | margin {row['reward_margin']:.3f}")
        if book.interrupted:
            log(f"interrupted: step {run.optimizer.step_count} saved in {run.dir}")
        return row, book.interrupted


def start_dpo(base_dir: Path, data: Path, out_dir: Path, tc: TrainConfig, beta: float,
              log: Callable[[str], None] = print) -> DPOTrainer:
    """A DPO run in `out_dir` from the run in `base_dir`, with the reference scores of every pair
    computed from the starting weights; the last `tc.val_fraction` of the pairs are held out."""
    if not beta > 0:
        raise ValueError(f"--beta must be positive, got {beta}")
    train_pairs, heldout_pairs = split_heldout(load_pairs(data), tc.val_fraction)
    template = sft_template(base_dir)
    model, tok, optimizer = new_run_from(base_dir, out_dir, tc, {"stage": "dpo", "beta": beta, "data": str(data)},
                                         log, template)
    ctx_len = model.cfg.ctx_len
    train_enc, n_truncated = encode_pairs(tok, train_pairs, ctx_len, template)
    heldout_enc, n_truncated_heldout = (encode_pairs(tok, heldout_pairs, ctx_len, template) if heldout_pairs
                                        else (None, 0))
    log(f"data {data}: {len(train_pairs)} training and {len(heldout_pairs)} held-out pairs"
        + (f"; {n_truncated + n_truncated_heldout} sequences truncated from the prompt side to fit {ctx_len} tokens"
           if n_truncated + n_truncated_heldout else ""))
    for encoded in (train_enc, heldout_enc):
        if encoded is not None:
            encoded.reference = sequence_logprobs(model, encoded, tc.batch_size)
    run = Run(Path(out_dir), tc, model, optimizer, tok, train_loader=None, val_loader=None, unigram_loss=float("nan"))
    return DPOTrainer(run, train_enc, heldout_enc, beta)
