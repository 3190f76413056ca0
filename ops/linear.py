"""Linear layer without bias, weights in PyTorch's (out_features, in_features) layout.

Shapes: x (N, C), w (O, C) -> y (N, O) = x @ w.T; saved ().
Backward: dx = dy @ w (N, C), dw = dy.T @ x (O, C). In bf16, dw (a parameter's gradient) is float32.
Both can be added into the caller's arrays (`into`): dw into the gradient buffer, dx into the
gradient of an input that feeds several products (the model's final hidden state, the K heads).
"""

from nanoeuler_core.registry import ErrorInput, Sample, define_op
from nanoeuler_ops import accumulated


def check_shapes(x, w):
    """Raise ValueError unless x (N, C) and w (O, C) fit together (every backend calls this)."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear: need x (N, C) and w (O, C), got {x.shape} and {w.shape}")


def forward(x, w):
    check_shapes(x, w)
    return x @ w.T, ()


def backward(dy, saved, x, w, *, into=None):
    return accumulated((dy @ w, dy.T @ x), into)


def sample_inputs(rng):
    # (N, C, O): a single row and feature; odd sizes; O > C and O < C; two tiles of rows, of
    # outputs and of features, the last ones short (the CUDA simulator's matmul takes 16 x 16 tiles).
    for n, c, o in ((1, 1, 1), (7, 13, 17), (17, 20, 18)):
        x = rng.standard_normal((n, c))
        w = rng.standard_normal((o, c)) / c ** 0.5
        yield Sample((x, w), grad_inputs=(0, 1), name=f"N{n}_C{c}_O{o}")


def error_inputs(rng):
    normal = rng.standard_normal
    yield ErrorInput(Sample((normal((3, 4)), normal((5, 6))), name="C4_vs_C6"), match=r"linear: need x \(N, C\)")
    yield ErrorInput(Sample((normal((2, 3, 4)), normal((5, 4))), name="x_3d"), match=r"linear: need x \(N, C\)")


def model_inputs(rng, cfg, rows):
    """The feed-forward's gate and up product: rows x dim against (hidden_dim, dim)."""
    x = rng.standard_normal((rows, cfg.dim))
    w = 0.02 * rng.standard_normal((cfg.hidden_dim, cfg.dim))
    return Sample((x, w), grad_inputs=(0, 1), name=f"N{rows}_C{cfg.dim}_O{cfg.hidden_dim}")


OP = define_op(globals(), "Matrix product with a transposed weight, y = x @ w.T (no bias)",
                accumulates=(0, 1), precisions={"cuda": ("tf32", "bf16")})
