"""A residual connection followed by RMSNorm, fused: s = x + branch, y = rmsnorm(s; w).

Shapes: x, branch (N, C), w (C,) -> (s (N, C), y (N, C)); saved (s, rstd (N,)). Attr: eps.
The model's residual stream goes through one of these at every Euler step's end: s is the new
stream, y the next step's normalised input. Backward, with ds the gradient reaching s from the
stream and dy from the norm (ds may be None: no gradient reaches the stream):

    dx = dbranch = ds + rmsnorm_backward(dy; s, w)          dw as in ops/rmsnorm.py

The backward reads only `saved` and w (callers may pass None for x and branch). In bf16 the norm
is taken of s as stored (rounded), so the fused op equals add then rmsnorm exactly.
"""

from nanoeuler_core.registry import ErrorInput, Sample, define_op
from nanoeuler_ops import rmsnorm
from nanoeuler_ops.add import check_same_shape


def check_shapes(x, branch, w):
    """Raise ValueError unless x and branch are one (N, C) shape and w is (C,) (every backend calls this)."""
    check_same_shape(x, branch)
    rmsnorm.check_shapes(x, w)


def forward(x, branch, w, *, eps):
    check_shapes(x, branch, w)
    s = x + branch
    y, (rstd,) = rmsnorm.forward(s, w, eps=eps)
    return (s, y), (s, rstd)


def backward(dout, saved, x, branch, w, *, eps, into=None):
    ds, dy = dout
    s, rstd = saved
    dx, dw = rmsnorm.backward(dy, (rstd,), s, w, eps=eps, into=(None, into[2]) if into else None)
    if ds is not None:
        dx = dx + ds
    return dx, dx, dw


def sample_inputs(rng):
    for n, c in ((1, 4), (7, 16), (33, 96)):
        x, branch = rng.standard_normal((2, n, c))
        w = 1.0 + 0.1 * rng.standard_normal(c)
        yield Sample((x, branch, w), {"eps": 1e-5}, grad_inputs=(0, 1, 2), name=f"N{n}_C{c}")


def error_inputs(rng):
    normal = rng.standard_normal
    yield ErrorInput(Sample((normal((3, 4)), normal((4, 3)), normal(4)), {"eps": 1e-5}, name="branch_4x3"),
                     match="add needs two arrays of the same shape")
    yield ErrorInput(Sample((normal((3, 4)), normal((3, 4)), normal(5)), {"eps": 1e-5}, name="w5"),
                     match=r"rmsnorm: need x \(N, C\) and w \(C,\)")


def model_inputs(rng, cfg, rows):
    normal = rng.standard_normal
    x, branch, w = normal((rows, cfg.dim)), normal((rows, cfg.dim)), 1.0 + 0.1 * normal(cfg.dim)
    return Sample((x, branch, w), {"eps": 1e-5}, grad_inputs=(0, 1, 2), name=f"N{rows}_C{cfg.dim}")


OP = define_op(globals(), "Residual add then RMSNorm, fused: (x + branch, rmsnorm(x + branch))",
                accumulates=(2,), precisions={"cuda": ("bf16",)})
