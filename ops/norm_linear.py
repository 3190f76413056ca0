"""RMSNorm fused into the linear layer that reads it, for decoding (forward only).

Shapes: x (N, C), g (C,), w (O, C) -> y (N, O); attrs eps; saved ().
w is one float matrix or a quantized one, (q, scale, zero) (nanoeuler_core/quantized.py), read as
the matrix it stands for, times x rounded to 8 bits by blocks of 32 (quantized.product).

    rstd[n] = 1 / sqrt(mean_c x[n, c]^2 + eps)
    y[n, o] = sum_c (x[n, c] * rstd[n] * g[c]) * w[o, c]

Batch-invariant, as every decoding op: a backend computes row n of y with the same operations
in the same order whatever N is and wherever the row sits, so a token's result does not depend
on the tokens decoded beside it (docs/decoding.md says why that matters).
The decoder reads the attention's q, k and v projections (w = [wq; wk; wv]) and the output heads
(w = [heads.0; heads.1; ...]) through it.
"""

import numpy as np

from nanoeuler_core import quantized
from nanoeuler_core.registry import ErrorInput, Sample, Tol, define_op


def check_shapes(x, g, *w):
    """Raise ValueError unless x (N, C), g (C,) and w (O, C) fit together (every backend calls this)."""
    O, C = quantized.shape(*w)
    if x.ndim != 2 or g.shape != (x.shape[1],) or C != x.shape[1]:
        raise ValueError(f"norm_linear: need x (N, C), g (C,), w (O, C), got {x.shape}, {g.shape}, {(O, C)}")


def forward(x, g, *w, eps):
    check_shapes(x, g, *w)
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1) + eps)
    return quantized.product(x * rstd[:, None] * g, *w), ()


def sample_inputs(rng):
    # (N, C, O): one row; rows and features off every block size; more outputs than inputs; features
    # past the GPU kernel's last whole chunk; rows of whole chunks over more than one trip.
    for n, c, o in ((1, 4, 3), (5, 19, 10), (9, 40, 13), (2, 300, 3), (2, 1096, 3)):
        x = rng.standard_normal((n, c))
        g = 1.0 + 0.1 * rng.standard_normal(c)
        w = rng.standard_normal((o, c)) / c ** 0.5
        yield Sample((x, g, w), {"eps": 1e-5}, name=f"N{n}_C{c}_O{o}")
    # quantized weights: one row; rows of one group; several groups, rows of whole chunks over several trips
    for n, c, o in ((1, 64, 5), (5, 128, 13), (2, 320, 3)):
        x = rng.standard_normal((n, c))
        g = 1.0 + 0.1 * rng.standard_normal(c)
        for label, w in quantized.sample_matrices(rng, o, c):
            yield Sample((x, g, *w), {"eps": 1e-5}, name=f"N{n}_C{c}_O{o}_{label}", float32_inputs=(3, 4),
                         tol=Tol(*quantized.SAMPLE_TOL))


def error_inputs(rng):
    # (x, g, w shapes): g's size or w's inputs not x's features
    for name, shapes in (("g5_for_C4", ((2, 4), (5,), (3, 4))), ("w_C5_for_C4", ((2, 4), (4,), (3, 5)))):
        yield ErrorInput(Sample(tuple(rng.standard_normal(s) for s in shapes), {"eps": 1e-5}, name=name),
                         match=r"norm_linear: need x \(N, C\), g \(C,\), w \(O, C\)")


def model_inputs(rng, cfg, rows):
    """The output heads' product, the widest: K heads of the vocabulary."""
    C, O = cfg.dim, cfg.n_mtp * cfg.vocab_size
    normal = rng.standard_normal
    return Sample((normal((rows, C)), 1 + 0.1 * normal(C), 0.02 * normal((O, C))), {"eps": 1e-5},
                  name=f"N{rows}_C{C}_O{O}")


OP = define_op(globals(), "Decoding: rmsnorm(x; g) @ w.T in one pass, batch-invariant (forward only)",
                precisions={"cuda": ("bf16",)})
