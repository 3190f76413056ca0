"""Cross-entropy of each row of logits against its target, with the softmax fused in.

Shapes: logits (N, V), targets (N,) int64 in [-1, V) -> losses (N,); saved lse (N,).
A target of -1 marks a row to ignore: its loss is 0 and it gets no gradient.

    lse[n] = log(sum_c exp(logits[n, c]))
    losses[n] = lse[n] - logits[n, targets[n]]                   (0 where targets[n] == -1)

Backward, with softmax[n, c] = exp(logits[n, c] - lse[n]):

    dlogits[n, c] = dlosses[n] * (softmax[n, c] - [c == targets[n]])   (0 rows where ignored)
"""

import numpy as np

from nanoeuler_core.registry import ErrorInput, Sample, define_op

IGNORE = -1


def check_targets(targets, vocab_size, n_rows=None):
    """Raise ValueError unless every target is a class id in [0, V) or IGNORE, and, given n_rows,
    there is one target per row of logits (every backend calls this)."""
    if n_rows is not None and targets.shape != (n_rows,):
        raise ValueError(f"cross_entropy: {n_rows} rows of logits need targets of shape ({n_rows},), "
                         f"got {targets.shape}")
    if targets.size and (targets.min() < IGNORE or targets.max() >= vocab_size):
        raise ValueError(f"cross_entropy: targets must lie in [{IGNORE}, {vocab_size}) "
                         f"(-1 = ignore), got values from {targets.min()} to {targets.max()}")


def forward(logits, targets):
    check_targets(targets, logits.shape[1], logits.shape[0])
    top = logits.max(axis=1)
    lse = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
    kept = targets != IGNORE
    picked = np.take_along_axis(logits, np.where(kept, targets, 0)[:, None], axis=1)[:, 0]
    return np.where(kept, lse - picked, 0.0), (lse,)


def backward(dlosses, saved, logits, targets):
    (lse,) = saved
    kept = targets != IGNORE
    dlogits = np.exp(logits - lse[:, None])
    dlogits[np.flatnonzero(kept), targets[kept]] -= 1.0
    dlogits *= np.where(kept, dlosses, 0.0)[:, None]
    return dlogits, None


def sample_inputs(rng):
    for n, v, ignored in ((1, 3, 0), (9, 17, 3), (37, 130, 10), (4, 8, 4)):
        logits = 3.0 * rng.standard_normal((n, v))
        targets = rng.integers(0, v, n)
        targets[rng.choice(n, ignored, replace=False)] = IGNORE
        yield Sample((logits, targets), grad_inputs=(0,), name=f"N{n}_V{v}_ignore{ignored}")


def error_inputs(rng):
    logits = rng.standard_normal((3, 5))
    shape, values = r"3 rows of logits need targets of shape \(3,\)", r"targets must lie in \[-1, 5\)"
    for name, targets, match in (("targets_4_for_3_rows", [0, 1, 2, 3], shape), ("target_V", [0, 5, 1], values),
                                 ("target_minus_2", [0, -2, 1], values)):
        yield ErrorInput(Sample((logits, np.array(targets, dtype=np.int64)), name=name), match=match)


def model_inputs(rng, cfg, rows):
    """The first head's logits over the vocabulary, a tenth of the targets ignored."""
    V = cfg.vocab_size
    targets = rng.integers(0, V, rows)
    targets[rng.choice(rows, rows // 10, replace=False)] = IGNORE
    return Sample((3.0 * rng.standard_normal((rows, V)), targets), grad_inputs=(0,), name=f"N{rows}_V{V}")


OP = define_op(globals(), "Per-row softmax cross-entropy; a target of -1 is ignored",
                precisions={"cuda": ("bf16",)})
