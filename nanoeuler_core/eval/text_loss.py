"""The next-token loss of a model on a text file: how well it predicts text it did not train on.

The text is encoded with the run's tokenizer and cut into windows of `window` + 1 tokens, each
token the target of the one before it within its window (the last window shorter). The result is
the mean cross-entropy in nats over every target, and its perplexity exp(loss).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import numpy as np


def windows(ids: list[int], window: int) -> list[list[int]]:
    """ids cut into pieces of window + 1 tokens, the next starting at the last of the previous."""
    return [ids[start:start + window + 1] for start in range(0, max(1, len(ids) - 1), window)]


def evaluate(model, tok, path: Path, window: int, batch_size: int,
             report: Callable[[int, int], None] = lambda done, total: None) -> dict:
    """{"tokens", "loss", "perplexity"} of `model` on the text file `path` (UTF-8)."""
    ids = tok.encode(Path(path).read_text(encoding="utf-8"))
    if len(ids) < 2:
        raise ValueError(f"{path} holds fewer than 2 tokens: nothing to predict")
    pieces = windows(ids, min(window, model.cfg.ctx_len))
    total, targets = 0.0, 0
    for first in range(0, len(pieces), batch_size):
        batch = pieces[first:first + batch_size]
        T = max(len(p) for p in batch) - 1
        inputs = np.zeros((len(batch), T), dtype=np.int64)
        labels = np.full((len(batch), T), -1, dtype=np.int64)
        for row, piece in enumerate(batch):
            inputs[row, :len(piece) - 1] = piece[:-1]
            labels[row, :len(piece) - 1] = piece[1:]
        total -= float(model.token_logprobs(inputs, labels).sum())
        targets += int((labels >= 0).sum())
        report(min(first + batch_size, len(pieces)), len(pieces))
    loss = total / targets
    return {"tokens": targets, "loss": loss, "perplexity": math.exp(loss)}
