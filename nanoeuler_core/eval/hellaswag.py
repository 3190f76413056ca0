"""HellaSwag (Zellers et al., 2019): choose the ending of a scene description among four, the way
lm-evaluation-harness's `hellaswag` task scores a causal language model (zero-shot).

Each item becomes a context and four continuations, with the harness's preprocessing:

    context      = preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize())
    continuation = " " + preprocess(ending)
    preprocess   = strip; " [title]" -> ". "; drop "[...]" tags; "  " -> " "

An ending's score is the summed log-probability of its tokens given the context (the tokens are
those of context + continuation after the context's own tokens, as the harness splits them);
a pair longer than the context window keeps its last ctx_len + 1 tokens. Metrics, as the harness
defines them:

    acc       the highest summed log-probability is the right ending
    acc_norm  the highest log-probability per character of the ending is the right one

Random guessing scores 25% on both. All continuations are scored in padded batches, longest
first, through `Model.token_logprobs` (targets -1 ignored).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from nanoeuler_core.corpus.records import read_records

N_ENDINGS = 4
VALIDATION_ITEMS = 10_042


@dataclass(frozen=True)
class Item:
    context: str
    endings: tuple[str, ...]
    label: int


def preprocess(text: str) -> str:
    """lm-evaluation-harness's clean-up of HellaSwag text (WikiHow's bracketed tags)."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def item_from_record(record: dict, where: str) -> Item:
    """An Item from one line of the dataset: activity_label, ctx_a, ctx_b, endings, label."""
    try:
        context = preprocess(record["activity_label"] + ": " + record["ctx_a"] + " " + record["ctx_b"].capitalize())
        endings = tuple(preprocess(ending) for ending in record["endings"])
        label = int(record["label"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"{where}: not a HellaSwag item (needs activity_label, ctx_a, ctx_b, endings, "
                         f"label; {type(exc).__name__}: {exc})") from None
    if len(endings) != N_ENDINGS or not 0 <= label < N_ENDINGS or not all(endings):
        raise ValueError(f"{where}: a HellaSwag item has {N_ENDINGS} non-empty endings and a label 0-3")
    return Item(context, endings, label)


def load_items(path: Path, limit: int | None = None) -> list[Item]:
    """The items of a HellaSwag JSONL file (the first `limit` of them)."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be at least 1, got {limit}")
    items = []
    for where, record in read_records(Path(path)):
        items.append(item_from_record(record, where))
        if limit is not None and len(items) == limit:
            break
    if not items:
        raise ValueError(f"{path} holds no HellaSwag items")
    return items


# ------------------------------------------------------------------------------------------------
# scoring


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context and continuation ids as the harness splits them: the continuation's ids are those of
    context + continuation after the context's own (trailing spaces of the context move over)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    context_ids = tok.encode(context)
    whole = tok.encode(context + continuation)
    return context_ids or [tok.eos_id], whole[len(context_ids):]


def scoring_rows(tok, items: list[Item], ctx_len: int) -> list[tuple[list[int], int]]:
    """Per (item, ending), in order: the token sequence to feed (at most ctx_len + 1 tokens, the
    tail when longer) and how many of its last tokens are the ending's."""
    rows = []
    for item in items:
        for ending in item.endings:
            context_ids, ending_ids = encode_pair(tok, item.context, " " + ending)
            sequence = (context_ids + ending_ids)[-(ctx_len + 1):]
            rows.append((sequence, min(len(ending_ids), len(sequence) - 1)))
    return rows


def score(model, rows: list[tuple[list[int], int]], pad_id: int, batch_size: int = 32,
          progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """Summed log-probability of each row's scored tokens (`scoring_rows`), (len(rows),) float64.

    `progress(done, total)` is called after each batch, counting rows.
    """
    if batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {batch_size}")
    order = sorted(range(len(rows)), key=lambda r: -len(rows[r][0]))  # similar lengths share a batch
    sums = np.zeros(len(rows))
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        T = len(rows[batch[0]][0]) - 1
        inputs = np.full((len(batch), T), pad_id, dtype=np.int64)
        targets = np.full((len(batch), T), -1, dtype=np.int64)
        for b, r in enumerate(batch):
            sequence, n_scored = rows[r]
            n = len(sequence) - 1
            inputs[b, :n] = sequence[:-1]
            targets[b, n - n_scored:n] = sequence[n + 1 - n_scored:]
        sums[batch] = model.token_logprobs(inputs, targets).sum(axis=1)
        if progress:
            progress(min(start + batch_size, len(rows)), len(rows))
    return sums


def metrics(items: list[Item], logprobs: np.ndarray) -> dict:
    """acc and acc_norm (with the harness's standard errors) from per-ending log-probabilities."""
    labels = np.array([item.label for item in items])
    lengths = np.array([[len(ending) for ending in item.endings] for item in items], dtype=np.float64)
    result = {"task": "hellaswag", "n": len(items)}
    for name, scores in (("acc", logprobs), ("acc_norm", logprobs / lengths)):
        hits = (np.argmax(scores, axis=1) == labels).astype(np.float64)
        result[name] = float(hits.mean())
        result[f"{name}_stderr"] = float(hits.std(ddof=1) / math.sqrt(len(hits))) if len(hits) > 1 else float("nan")
    return result


def evaluate(model, tok, items: list[Item], batch_size: int = 32,
             progress: Callable[[int, int], None] | None = None) -> tuple[dict, np.ndarray]:
    """The metrics of `model` on `items`, and the per-ending log-probabilities (N, 4).

    `progress(done, total)` counts scored endings."""
    rows = scoring_rows(tok, items, model.cfg.ctx_len)
    logprobs = score(model, rows, tok.eos_id, batch_size, progress).reshape(len(items), N_ENDINGS)
    return metrics(items, logprobs), logprobs


def training_metrics(tok, path: Path, ctx_len: int, limit: int | None = None,
                     batch_size: int = 32) -> Callable[[object], dict]:
    """For `pretrain` (its extra_evals): model -> {"hellaswag_acc", "hellaswag_acc_norm"} on the
    items of `path`, tokenized once."""
    items = load_items(path, limit)
    rows = scoring_rows(tok, items, ctx_len)

    def measure(model) -> dict:
        result = metrics(items, score(model, rows, tok.eos_id, batch_size).reshape(len(items), N_ENDINGS))
        return {"hellaswag_acc": round(result["acc"], 5), "hellaswag_acc_norm": round(result["acc_norm"], 5)}

    return measure
