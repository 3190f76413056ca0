"""RMSNorm over the last axis: y = x / sqrt(mean(x^2) + eps) * w.

Shapes: x (N, C), w (C,) -> y (N, C); saved rstd (N,) = 1 / sqrt(mean(x^2) + eps).
Backward, with xhat = x * rstd:
    dw = sum_n dy * xhat
    dx = rstd * (dy * w - xhat * mean(dy * w * xhat))
"""

import numpy as np

from nanoeuler_core.registry import ErrorInput, Sample, define_op
from nanoeuler_ops import accumulated


def check_shapes(x, w):
    """Raise ValueError unless x is (N, C) and w (C,) (every backend calls this)."""
    if x.ndim != 2 or w.shape != (x.shape[1],):
        raise ValueError(f"rmsnorm: need x (N, C) and w (C,), got {x.shape} and {w.shape}")


def forward(x, w, *, eps):
    check_shapes(x, w)
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1) + eps)
    return x * rstd[:, None] * w, (rstd,)


def backward(dy, saved, x, w, *, eps, into=None):
    (rstd,) = saved
    xhat = x * rstd[:, None]
    dw = np.sum(dy * xhat, axis=0)
    dxhat = dy * w
    dx = rstd[:, None] * (dxhat - xhat * np.mean(dxhat * xhat, axis=-1, keepdims=True))
    return accumulated((dx, dw), into)


def sample_inputs(rng):
    for n, c in ((1, 4), (7, 16), (33, 96)):
        x = rng.standard_normal((n, c))
        w = 1.0 + 0.1 * rng.standard_normal(c)
        yield Sample((x, w), {"eps": 1e-5}, grad_inputs=(0, 1), name=f"N{n}_C{c}")


def error_inputs(rng):
    normal = rng.standard_normal
    for name, x, w in (("C4_w5", normal((3, 4)), normal(5)), ("x_3d", normal((2, 3, 4)), normal(4))):
        yield ErrorInput(Sample((x, w), {"eps": 1e-5}, name=name), match=r"rmsnorm: need x \(N, C\) and w \(C,\)")


def model_inputs(rng, cfg, rows):
    x = rng.standard_normal((rows, cfg.dim))
    w = 1.0 + 0.1 * rng.standard_normal(cfg.dim)
    return Sample((x, w), {"eps": 1e-5}, grad_inputs=(0, 1), name=f"N{rows}_C{cfg.dim}")


OP = define_op(globals(), "RMSNorm over the last axis with a learned scale",
                accumulates=(1,), precisions={"cuda": ("bf16",)})
