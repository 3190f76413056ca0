"""Linear layer without bias, weights in PyTorch's (out_features, in_features) layout.

Shapes: x (N, C), w (O, C) -> y (N, O) = x @ w.T; saved ().
Backward: dx = dy @ w (N, C), dw = dy.T @ x (O, C). In bf16, dw (a parameter's gradient) is float32.
"""

from nanoeuler_core.registry import Impl, Op, Sample, Tol


def forward(x, w):
    return x @ w.T, ()


def backward(dy, saved, x, w):
    return dy @ w, dy.T @ x


def sample_inputs(rng):
    # (N, C, O): a single row and feature; odd sizes; O > C and O < C.
    for n, c, o in ((1, 1, 1), (7, 13, 17), (33, 64, 40)):
        x = rng.standard_normal((n, c))
        w = rng.standard_normal((o, c)) / c ** 0.5
        yield Sample((x, w), grad_inputs=(0, 1), name=f"N{n}_C{c}_O{o}")


OP = Op(
    name="linear",
    summary="Matrix product with a transposed weight, y = x @ w.T (no bias)",
    reference=Impl(forward, backward),
    sample_inputs=sample_inputs,
    backends={"cpu": "nanoeuler_ops.cpu.linear", "cuda": "nanoeuler_ops.cuda.linear"},
    tol=Tol(rtol=1e-4, atol=1e-5),
    precisions={"cuda": ("tf32", "bf16")},
)
