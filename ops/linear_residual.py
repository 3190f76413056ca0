"""A linear layer added onto the residual stream, for decoding (forward only).

Shapes: x (N, I), r (N, O), w (O, I) -> y (N, O) = r + x @ w.T; saved ().
w is one float matrix or a quantized one, (q, scale, zero) (nanoeuler_core/quantized.py), read as
the matrix it stands for, times x rounded to 8 bits by blocks of 32 (quantized.product); it comes
last so that it may be either.

The Euler steps' updates: r is the stream, x the attention output (w = wo) or the SwiGLU
activation (w = w_down). Batch-invariant (see norm_linear).
"""

from nanoeuler_core import quantized
from nanoeuler_core.registry import ErrorInput, Sample, Tol, define_op


def check_shapes(x, r, *w):
    """Raise ValueError unless x (N, I), r (N, O) and w (O, I) fit together (every backend calls this)."""
    O, I = quantized.shape(*w)
    if x.ndim != 2 or I != x.shape[1] or r.shape != (x.shape[0], O):
        raise ValueError(f"linear_residual: need x (N, I), r (N, O), w (O, I), got {x.shape}, {r.shape}, {(O, I)}")


def forward(x, r, *w):
    check_shapes(x, r, *w)
    return r + quantized.product(x, *w), ()


def sample_inputs(rng):
    # (N, I, O): one row; sizes off every block; fewer outputs than inputs (w_down); features past the
    # GPU kernel's last whole chunk; rows of whole chunks over more than one trip.
    for n, i, o in ((1, 3, 4), (6, 21, 7), (9, 72, 12), (5, 300, 3), (2, 2104, 3)):
        x = rng.standard_normal((n, i))
        w = rng.standard_normal((o, i)) / i ** 0.5
        r = rng.standard_normal((n, o))
        yield Sample((x, r, w), name=f"N{n}_I{i}_O{o}")
    # quantized weights: one row; rows of one group; several groups, rows of whole chunks over several trips
    for n, i, o in ((1, 64, 4), (6, 128, 7), (2, 576, 3)):
        x = rng.standard_normal((n, i))
        r = rng.standard_normal((n, o))
        for label, w in quantized.sample_matrices(rng, o, i):
            yield Sample((x, r, *w), name=f"N{n}_I{i}_O{o}_{label}", float32_inputs=(3, 4),
                         tol=Tol(*quantized.SAMPLE_TOL))


def error_inputs(rng):
    # (x, r, w shapes): w's inputs not x's; r's rows or outputs not y's
    for name, shapes in (("w_I5_for_I4", ((2, 4), (2, 3), (3, 5))), ("r_rows_3_for_2", ((2, 4), (3, 3), (3, 4))),
                         ("r_O4_for_O3", ((2, 4), (2, 4), (3, 4)))):
        yield ErrorInput(Sample(tuple(rng.standard_normal(s) for s in shapes), name=name),
                         match=r"linear_residual: need x \(N, I\), r \(N, O\), w \(O, I\)")


def model_inputs(rng, cfg, rows):
    """The feed-forward's down product onto the stream (the wider of the two it serves)."""
    C, F = cfg.dim, cfg.hidden_dim
    normal = rng.standard_normal
    return Sample((normal((rows, F)), normal((rows, C)), 0.02 * normal((C, F))), name=f"N{rows}_I{F}_O{C}")


OP = define_op(globals(), "Decoding: r + x @ w.T (a residual update), batch-invariant (forward only)",
                precisions={"cuda": ("bf16",)})
