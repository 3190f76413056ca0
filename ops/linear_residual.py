"""A linear layer added onto the residual stream, for decoding (forward only).

Shapes: x (N, I), w (O, I), r (N, O) -> y (N, O) = r + x @ w.T; saved ().

The Euler steps' updates: r is the stream, x the attention output (w = wo) or the SwiGLU
activation (w = w_down). Batch-invariant (see norm_linear).
"""

from nanoeuler_core.registry import ErrorInput, Sample, define_op


def check_shapes(x, w, r):
    """Raise ValueError unless x (N, I), w (O, I) and r (N, O) fit together (every backend calls this)."""
    if x.ndim != 2 or w.ndim != 2 or w.shape[1] != x.shape[1] or r.shape != (x.shape[0], w.shape[0]):
        raise ValueError(f"linear_residual: need x (N, I), w (O, I), r (N, O), got {x.shape}, {w.shape}, {r.shape}")


def forward(x, w, r):
    check_shapes(x, w, r)
    return r + x @ w.T, ()


def sample_inputs(rng):
    # (N, I, O): one row; sizes off every block; fewer outputs than inputs (w_down); features past the
    # GPU kernel's last whole chunk; rows of whole chunks over more than one trip.
    for n, i, o in ((1, 3, 4), (6, 21, 7), (9, 72, 12), (5, 300, 3), (2, 2104, 3)):
        x = rng.standard_normal((n, i))
        w = rng.standard_normal((o, i)) / i ** 0.5
        r = rng.standard_normal((n, o))
        yield Sample((x, w, r), name=f"N{n}_I{i}_O{o}")


def error_inputs(rng):
    # (x, w, r shapes): w's inputs not x's; r's rows or outputs not y's
    for name, shapes in (("w_I5_for_I4", ((2, 4), (3, 5), (2, 3))), ("r_rows_3_for_2", ((2, 4), (3, 4), (3, 3))),
                         ("r_O4_for_O3", ((2, 4), (3, 4), (2, 4)))):
        yield ErrorInput(Sample(tuple(rng.standard_normal(s) for s in shapes), name=name),
                         match=r"linear_residual: need x \(N, I\), w \(O, I\), r \(N, O\)")


def model_inputs(rng, cfg, rows):
    """The feed-forward's down product onto the stream (the wider of the two it serves)."""
    C, F = cfg.dim, cfg.hidden_dim
    normal = rng.standard_normal
    return Sample((normal((rows, F)), 0.02 * normal((C, F)), normal((rows, C))), name=f"N{rows}_I{F}_O{C}")


OP = define_op(globals(), "Decoding: r + x @ w.T (a residual update), batch-invariant (forward only)",
                precisions={"cuda": ("bf16",)})
