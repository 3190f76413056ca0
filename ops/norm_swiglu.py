"""The first half of the feed-forward step fused for decoding (forward only): RMSNorm, the gate
and up projections, and SwiGLU.

Shapes: x (N, C), g (C,), w (2F, C) = [w_gate; w_up] -> y (N, F); attrs eps; saved ().
w is one float matrix or a quantized one, (q, scale, zero) (nanoeuler_core/quantized.py), read as
the matrix it stands for, times x rounded to 8 bits by blocks of 32 (quantized.product).

    h = rmsnorm(x; g)                                  (as in norm_linear)
    y[n, f] = silu(h[n] . w[f]) * (h[n] . w[F + f]),   silu(z) = z * sigmoid(z)

Batch-invariant (see norm_linear). The model stores w_gate and w_up next to each other, so the
decoder passes one view of both.
"""

import numpy as np

from nanoeuler_core import quantized
from nanoeuler_core.registry import ErrorInput, Sample, Tol, define_op
from nanoeuler_ops.swiglu import forward as swiglu


def check_shapes(x, g, *w):
    """Raise ValueError unless x (N, C), g (C,) and w (2F, C) fit together (every backend calls this)."""
    O, C = quantized.shape(*w)
    if x.ndim != 2 or g.shape != (x.shape[1],) or C != x.shape[1] or O % 2:
        raise ValueError(f"norm_swiglu: need x (N, C), g (C,), w (2F, C), got {x.shape}, {g.shape}, {(O, C)}")


def forward(x, g, *w, eps):
    check_shapes(x, g, *w)
    h = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g
    return swiglu(quantized.product(h, *w))[0], ()   # h @ w.T is [gate | up]


def sample_inputs(rng):
    # (N, C, F): one row; sizes off every block; a wide hidden layer; features past the GPU kernel's
    # last whole chunk; rows of whole chunks over more than one trip.
    for n, c, f in ((1, 4, 3), (5, 19, 11), (7, 24, 9), (2, 300, 2), (2, 1096, 2)):
        x = rng.standard_normal((n, c))
        g = 1.0 + 0.1 * rng.standard_normal(c)
        w = 2.0 * rng.standard_normal((2 * f, c)) / c ** 0.5  # gates reaching both tails of the sigmoid
        yield Sample((x, g, w), {"eps": 1e-5}, name=f"N{n}_C{c}_F{f}")
    # quantized weights: one row; rows of one group; several groups, rows of whole chunks over several trips
    for n, c, f in ((1, 64, 3), (5, 128, 6), (2, 320, 2)):
        x = rng.standard_normal((n, c))
        g = 1.0 + 0.1 * rng.standard_normal(c)
        for label, w in quantized.sample_matrices(rng, 2 * f, c, scale=2.0):
            yield Sample((x, g, *w), {"eps": 1e-5}, name=f"N{n}_C{c}_F{f}_{label}", float32_inputs=(3, 4),
                         tol=Tol(*quantized.SAMPLE_TOL))


def error_inputs(rng):
    # (x, g, w shapes): g's size or w's inputs not x's features; w of an odd number of rows
    for name, shapes in (("g5_for_C4", ((2, 4), (5,), (6, 4))), ("w_C5_for_C4", ((2, 4), (4,), (6, 5))),
                         ("w_rows_5", ((2, 4), (4,), (5, 4)))):
        yield ErrorInput(Sample(tuple(rng.standard_normal(s) for s in shapes), {"eps": 1e-5}, name=name),
                         match=r"norm_swiglu: need x \(N, C\), g \(C,\), w \(2F, C\)")


def model_inputs(rng, cfg, rows):
    C, F = cfg.dim, cfg.hidden_dim
    normal = rng.standard_normal
    return Sample((normal((rows, C)), 1 + 0.1 * normal(C), 0.05 * normal((2 * F, C))), {"eps": 1e-5},
                  name=f"N{rows}_C{C}_F{F}")


OP = define_op(globals(), "Decoding: silu(h w_gate.T) * (h w_up.T) with h = rmsnorm(x; g), batch-invariant (forward only)",
                precisions={"cuda": ("bf16",)})
