"""SwiGLU gating: the elementwise product of silu(gate) and up.

Shapes: gate (N, F), up (N, F) -> y (N, F) = silu(gate) * up; saved ().
silu(z) = z * s with s = sigmoid(z) = 1 / (1 + exp(-z)), and silu'(z) = s * (1 + z * (1 - s)).
Backward: dgate = dy * up * s * (1 + gate * (1 - s)), dup = dy * gate * s.
"""

import numpy as np

from nanoeuler_core.registry import Impl, Op, Sample, Tol


def _sigmoid(z):
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # equals 1 / (1 + exp(-z)) without overflow for large -z


def forward(gate, up):
    return gate * _sigmoid(gate) * up, ()


def backward(dy, saved, gate, up):
    s = _sigmoid(gate)
    dgate = dy * up * s * (1.0 + gate * (1.0 - s))
    dup = dy * gate * s
    return dgate, dup


def sample_inputs(rng):
    for n, f in ((1, 1), (5, 11), (17, 43)):
        gate = 2.0 * rng.standard_normal((n, f))  # wide enough to reach both tails of the sigmoid
        up = rng.standard_normal((n, f))
        yield Sample((gate, up), grad_inputs=(0, 1), name=f"N{n}_F{f}")


OP = Op(
    name="swiglu",
    summary="SwiGLU gating silu(gate) * up",
    reference=Impl(forward, backward),
    sample_inputs=sample_inputs,
    backends={"cpu": "nanoeuler_ops.cpu.swiglu", "cuda": "nanoeuler_ops.cuda.swiglu"},
    tol=Tol(rtol=1e-4, atol=1e-5),
)
