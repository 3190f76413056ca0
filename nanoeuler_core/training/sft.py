"""Supervised fine-tuning (SFT) on instruction data in the Alpaca format.

Each example (instruction, optional input, output) is rendered with a chat template
(nanoeuler_core/inference/template.py): `--template` ("alpaca" or a Jinja file), else the base
run's own (an imported instruct model's, or the one it was fine-tuned with), else the standard
Alpaca template. A Jinja template gets the instruction as a user message (the input after a blank
line); the response is the output followed by the template's end-of-turn token (`</s>` for Alpaca,
`<|im_end|>` for ChatML). The model is trained on the whole
sequence but the loss counts the response tokens only: every target that predicts a prompt
token, and every padding target, is -1 (docs/model.md). An example longer than the context
loses tokens from the start of its prompt (the response is kept whole where it fits).

    prompt ids                       response ids + </s>
    [p0 p1 ... p(n-1)]               [r0 r1 ... </s>]
    inputs  = p0 ... p(n-1) r0 ...   (the sequence minus its last token)
    targets = -1 ... -1     r0 r1 ... </s>   (the sequence minus its first token; -1 before r0)

Fine-tuning starts from a pretrained run directory and writes a new one in the same format, its
config.json marking `"template": "alpaca"` (or "chat_template", the Jinja template then saved in
its tokenizer_config.json) so that `chat` wraps what the user types the same way.
The last `val_fraction` of the examples are held out: validation loss and exact-match accuracy.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from nanoeuler_core.corpus.records import read_records, text_fields
from nanoeuler_core.engine import checkpoint
from nanoeuler_core.engine.config import PRESETS
from nanoeuler_core.inference.generate import generate
from nanoeuler_core.inference.loading import load_model
from nanoeuler_core.inference.template import ChatTemplate, render_prompt
from nanoeuler_core.training import distributed
from nanoeuler_core.training.pretrain import Run, TrainConfig, make_optimizer, rows_per_step

IGNORE = -1


# ------------------------------------------------------------------------------------------------
# data files


@dataclass(frozen=True)
class Example:
    instruction: str
    input: str
    output: str
    task: str = ""  # optional label (the bundled tasks name theirs), for per-task accuracy

    @property
    def prompt(self) -> str:
        """The prompt in the Alpaca template (`ChatTemplate.instruction_prompt` renders it in another)."""
        return render_prompt(self.instruction, self.input)


def bundled_tasks() -> Path:
    """The instruction set shipped with the project (data/make_tasks.py writes it)."""
    return Path(str(importlib.resources.files("nanoeuler_data") / "sft_tasks.jsonl"))


def load_examples(path: Path) -> list[Example]:
    """Alpaca examples from a JSON list or a JSONL file: instruction, optional input, output."""
    return [Example(**text_fields(item, where, ("instruction", "output"), ("input", "task")))
            for where, item in read_records(path)]


def split_heldout(items: list, val_fraction: float) -> tuple[list, list]:
    """(training, held-out): the last `val_fraction` of the items are held out."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    n_heldout = int(round(len(items) * val_fraction))
    if n_heldout == len(items):
        n_heldout = 0  # too few items to hold any out
    return items[:len(items) - n_heldout], items[len(items) - n_heldout:]


# ------------------------------------------------------------------------------------------------
# token sequences and batches


@dataclass(frozen=True)
class Encoded:
    """One example as token ids: the prompt's `n_prompt` ids, then the response's ids and `</s>`."""

    ids: np.ndarray  # int64, at most ctx_len + 1 long (ctx_len inputs and their targets)
    n_prompt: int
    truncated: bool


def encode_example(tok, prompt: str, response: str, ctx_len: int) -> Encoded:
    """Prompt and response as one sequence; if too long, prompt tokens go from the start (at least one
    stays), then, for a response longer than the context, response tokens from the end."""
    prompt_ids = tok.encode(prompt)
    response_ids = tok.encode(response) + [tok.eos_id]
    limit = ctx_len + 1
    n_prompt = max(1, min(len(prompt_ids), limit - len(response_ids)))
    ids = prompt_ids[len(prompt_ids) - n_prompt:] + response_ids[:limit - n_prompt]
    truncated = len(ids) < len(prompt_ids) + len(response_ids)
    return Encoded(np.array(ids, dtype=np.int64), n_prompt, truncated)


def encode_examples(tok, examples: list[Example], ctx_len: int, template: ChatTemplate | None = None
                    ) -> tuple[list[Encoded], int]:
    """Every example as a sequence in `template` (default Alpaca), and how many of them were
    truncated to fit the context."""
    template = template or ChatTemplate.alpaca()
    chat_tok = template.tokenizer(tok)  # prompts encode as chat sends them; responses end with the end-of-turn token
    sequences = [encode_example(chat_tok, template.instruction_prompt(e.instruction, e.input), e.output, ctx_len)
                 for e in examples]
    return sequences, sum(s.truncated for s in sequences)


def collate(sequences: list[Encoded], pad_id: int, length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """inputs (B, T) and targets (B, T), T = `length` or the longest sequence's length - 1; targets
    that predict prompt tokens or padding are -1."""
    T = length or max(len(s.ids) for s in sequences) - 1
    inputs = np.full((len(sequences), T), pad_id, dtype=np.int64)
    targets = np.full((len(sequences), T), IGNORE, dtype=np.int64)
    for b, s in enumerate(sequences):
        n = len(s.ids) - 1
        inputs[b, :n] = s.ids[:-1]
        targets[b, :n] = s.ids[1:]
        targets[b, :s.n_prompt - 1] = IGNORE  # targets[t] is token t + 1: a prompt token while t + 1 < n_prompt
    return inputs, targets


def epoch_indices(n: int, seed: int, start: int, count: int) -> np.ndarray:
    """The items at positions start .. start + count - 1 of an endless sequence of epochs, each
    visiting all n items in an order drawn from (seed, epoch). A step's rows are consecutive
    positions, so its batch depends only on (seed, step) (a resumed run draws what an
    uninterrupted one would) and splits into micro-batches and over ranks without changing."""
    positions = start + np.arange(count)
    epochs = positions // n
    indices = np.empty(count, dtype=np.int64)
    for epoch in np.unique(epochs):
        order = np.random.default_rng([seed, int(epoch)]).permutation(n)
        in_epoch = epochs == epoch
        indices[in_epoch] = order[positions[in_epoch] % n]
    return indices


class SFTLoader:
    """Batches of fine-tuning sequences with the pretraining BatchLoader's interface:
    `batch(step, part)` returns (inputs, targets) (B, T), rows [part * B, (part + 1) * B) of the
    `rows_per_step` rows of step `step` (every micro-batch of every rank), the same for the same
    (seed, step).

    Every batch is padded to the longest sequence of the set, so all have one shape (a backend
    that captures the training step captures it once).
    """

    def __init__(self, sequences: list[Encoded], batch_size: int, ctx_len: int, seed: int, pad_id: int,
                 rows_per_step: int | None = None):
        if not sequences:
            raise ValueError("no examples to train on")
        if batch_size < 1 or seed < 0:
            raise ValueError(f"batch_size must be positive and seed non-negative, got {batch_size} and {seed}")
        self.sequences = sequences
        self.batch_size, self.ctx_len, self.seed, self.pad_id = batch_size, ctx_len, seed, pad_id
        self.rows_per_step = rows_per_step or batch_size
        self.length = max(len(s.ids) for s in sequences) - 1

    def batch(self, step: int, part: int = 0) -> tuple[np.ndarray, np.ndarray]:
        start = step * self.rows_per_step + part * self.batch_size
        chosen = epoch_indices(len(self.sequences), self.seed, start, self.batch_size)
        return collate([self.sequences[i] for i in chosen], self.pad_id, self.length)


# ------------------------------------------------------------------------------------------------
# runs


def new_run_from(base_dir: Path, out_dir: Path, tc: TrainConfig, stage: dict, log: Callable[[str], None],
                 template: ChatTemplate | None = None):
    """The base run's model and tokenizer, a fresh optimizer, and `out_dir` started as a new run
    directory holding them; `stage` (what kind of fine-tuning, on which data) and the name of the
    chat `template` join the training section of its config.json (a Jinja template is saved in its
    tokenizer_config.json). Returns (model, tok, optimizer). Under mpiexec, rank 0 writes."""
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    job = distributed.world()
    job.prepare(tc.backend)
    if job.rank == 0:
        if (out_dir / "config.json").exists():
            raise ValueError(f"{out_dir} already holds a run: choose another --out")
        if out_dir.resolve() == base_dir.resolve():
            raise ValueError("--out must differ from --base: fine-tuning writes a new run directory")
    job.barrier()
    model, tok = load_model(base_dir, tc.backend, tc.precision)
    model.recompute = tc.recompute
    log(f"base {base_dir}: {model.cfg.n_params():,} parameters, context {model.cfg.ctx_len} tokens")
    optimizer = make_optimizer(model, tc)
    if job.rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        tok.save(out_dir / "tokenizer.json")
        if template is not None:
            template.save(out_dir)
            stage = {**stage, "template": template.training_name}
        model.save(out_dir, training={**asdict(tc), "base": str(base_dir), **stage})
        (out_dir / "metrics.jsonl").write_bytes(b"")
    return model, tok, optimizer


def fine_tune_config(base_dir: Path, **settings) -> TrainConfig:
    """The training settings of a fine-tuning run: `settings` (steps, batch_size, lr, ...) and the
    base run's preset."""
    base_dir = Path(base_dir)
    if not (base_dir / "config.json").is_file():
        raise checkpoint.CheckpointError(f"base run {base_dir} not found: pass --base a run directory "
                                         f"written by pretrain, sft or dpo")
    preset = checkpoint.read_json(base_dir / "config.json").get("training", {}).get("preset")
    tc = TrainConfig(preset=preset if preset in PRESETS else "small", **settings)
    tc.resolve_precision()
    return tc


def sft_template(base_dir: Path, choice: str | Path | None = None) -> ChatTemplate:
    """The template fine-tuning renders examples in: `choice` ("alpaca" or a Jinja file), else the
    base run's own, else Alpaca."""
    return ChatTemplate.for_run(base_dir, choice) or ChatTemplate.alpaca()


def start_sft(base_dir: Path, data: Path, out_dir: Path, tc: TrainConfig, log: Callable[[str], None] = print,
              template: ChatTemplate | None = None) -> tuple[Run, list[Example]]:
    """A fine-tuning run in `out_dir` from the run in `base_dir`, ready for `train.train`, its
    examples rendered in `template` (default: `sft_template(base_dir)`); returns it with the
    held-out examples (the last `tc.val_fraction` of the data file)."""
    template = template or sft_template(base_dir)
    examples = load_examples(data)
    train_examples, heldout = split_heldout(examples, tc.val_fraction)
    model, tok, optimizer = new_run_from(base_dir, out_dir, tc, {"stage": "sft", "data": str(data)}, log, template)
    ctx_len = model.cfg.ctx_len
    train_seqs, n_truncated = encode_examples(tok, train_examples, ctx_len, template)
    heldout_seqs, n_truncated_heldout = encode_examples(tok, heldout, ctx_len, template)
    log(f"data {data}: {len(train_examples)} training and {len(heldout)} held-out examples"
        + (f"; {n_truncated + n_truncated_heldout} truncated from the prompt side to fit {ctx_len} tokens"
           if n_truncated + n_truncated_heldout else ""))
    train_loader = SFTLoader(train_seqs, tc.batch_size, ctx_len, tc.seed, tok.eos_id, rows_per_step(tc))
    val_loader = SFTLoader(heldout_seqs, tc.batch_size, ctx_len, tc.seed + 1, tok.eos_id) if heldout else None
    return Run(Path(out_dir), tc, model, optimizer, tok, train_loader, val_loader, float("nan")), heldout


# ------------------------------------------------------------------------------------------------
# evaluation


def exact_match(model, tok, examples: list[Example], template: ChatTemplate | None = None
                ) -> tuple[float, dict[str, float]]:
    """Fraction of examples whose greedy response in `template` (default Alpaca; up to its
    end-of-turn token) equals the expected output, surrounding whitespace ignored; overall and per
    task label."""
    if not examples:
        raise ValueError("no held-out examples to evaluate: raise --val-fraction or add examples")
    template = template or ChatTemplate.alpaca()
    chat_tok = template.tokenizer(tok)
    hits: dict[str, list[bool]] = {}
    for e in examples:
        expected = e.output.strip()
        # room for the answer, the end of turn and a stray space: a longer reply is wrong anyway
        reply = generate(model, chat_tok, template.instruction_prompt(e.instruction, e.input),
                         max_new_tokens=len(tok.encode(expected)) + 2, temperature=0.0)
        hits.setdefault(e.task or "all", []).append(reply.strip() == expected)
    every = [h for task_hits in hits.values() for h in task_hits]
    return float(np.mean(every)), {task: float(np.mean(h)) for task, h in sorted(hits.items())}
