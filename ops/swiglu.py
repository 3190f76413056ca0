"""SwiGLU gating: silu of the first half of each row times its second half.

Shapes: x (N, 2F) = [gate | up] -> y (N, F) = silu(gate) * up; saved (). The model computes gate
and up with one matrix product against the stacked weights [w_gate; w_up] (adjacent in its
parameter buffer).
silu(z) = z * s with s = sigmoid(z) = 1 / (1 + exp(-z)), and silu'(z) = s * (1 + z * (1 - s)).
Backward: dx = [dgate | dup], dgate = dy * up * s * (1 + gate * (1 - s)), dup = dy * gate * s.
"""

import numpy as np

from nanoeuler_core.registry import ErrorInput, Sample, define_op


def _sigmoid(z):
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # equals 1 / (1 + exp(-z)) without overflow for large -z


def check_shape(x):
    """Raise ValueError unless x is (N, 2F) (every backend calls this)."""
    if x.ndim != 2 or x.shape[1] % 2:
        raise ValueError(f"swiglu: need x (N, 2F) = [gate | up], got shape {x.shape}")


def forward(x):
    check_shape(x)
    gate, up = np.split(x, 2, axis=1)
    return gate * _sigmoid(gate) * up, ()


def backward(dy, saved, x):
    gate, up = np.split(x, 2, axis=1)
    s = _sigmoid(gate)
    return (np.concatenate((dy * up * s * (1.0 + gate * (1.0 - s)), dy * gate * s), axis=1),)


def sample_inputs(rng):
    for n, f in ((1, 1), (5, 11), (17, 43), (2, 1100)):   # the last: columns past one GPU block's 1,024
        gate = 2.0 * rng.standard_normal((n, f))  # wide enough to reach both tails of the sigmoid
        up = rng.standard_normal((n, f))
        yield Sample((np.concatenate((gate, up), axis=1),), grad_inputs=(0,), name=f"N{n}_F{f}")


def error_inputs(rng):
    for name, shape in (("odd_width", (3, 5)), ("x_3d", (2, 3, 4))):
        yield ErrorInput(Sample((rng.standard_normal(shape),), name=name), match=r"swiglu: need x \(N, 2F\)")


def model_inputs(rng, cfg, rows):
    gate = 2.0 * rng.standard_normal((rows, cfg.hidden_dim))
    up = rng.standard_normal((rows, cfg.hidden_dim))
    return Sample((np.concatenate((gate, up), axis=1),), grad_inputs=(0,), name=f"N{rows}_F{cfg.hidden_dim}")


OP = define_op(globals(), "SwiGLU gating silu(gate) * up of x = [gate | up]", precisions={"cuda": ("bf16",)})
