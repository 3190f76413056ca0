"""A small model trained on a pattern it can learn in a few steps, for decoding tests: greedy tokens
then follow the pattern rather than ties between untrained logits."""

import numpy as np

from nanoeuler_core.engine.model import Model
from nanoeuler_core.engine.optim import AdamW
from nanoeuler_core.training.step import TrainStep


def cycle_trained(cfg, steps: int = 25) -> Model:
    """cfg trained `steps` steps on sequences where token x is followed by cycle[x] 85% of the time."""
    model = Model(cfg, backend="cpu", seed=1)
    rng = np.random.default_rng(0)
    cycle = rng.permutation(cfg.vocab_size)
    step = TrainStep(model, AdamW(model))
    for _ in range(steps):
        seqs = np.empty((16, cfg.ctx_len + 1), dtype=np.int64)
        for row in seqs:
            x = rng.integers(cfg.vocab_size)
            for t in range(row.size):
                row[t] = x
                x = cycle[x] if rng.random() > 0.15 else rng.integers(cfg.vocab_size)
        step(seqs[:, :-1], seqs[:, 1:], 1e-2)
    return model
