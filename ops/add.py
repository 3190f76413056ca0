"""Elementwise sum of two arrays of the same shape (any rank): residual connections and
gradient accumulation.

Shapes: a, b (...) -> y (...) = a + b; saved ().
Backward: da = db = dy. Both gradients are the same array `dy`, not copies: callers read them and
must not write into one.
"""

from nanoeuler_core.registry import ErrorInput, Sample, Tol, define_op


def check_same_shape(a, b):
    """Raise ValueError unless a and b have one shape (no broadcasting: the backward assumes none)."""
    if a.shape != b.shape:
        raise ValueError(f"add needs two arrays of the same shape, got {a.shape} and {b.shape}")


def forward(a, b):
    check_same_shape(a, b)
    return a + b, ()


def backward(dy, saved, a, b):
    return dy, dy


def sample_inputs(rng):
    for shape in ((1,), (7, 13), (2, 5, 3, 7)):
        a = rng.standard_normal(shape)
        b = rng.standard_normal(shape)
        yield Sample((a, b), grad_inputs=(0, 1), name="x".join(map(str, shape)))


def error_inputs(rng):
    # no broadcasting, not even of a shape a NumPy sum would stretch
    for name, a, b in (("2x3_vs_3x2", rng.standard_normal((2, 3)), rng.standard_normal((3, 2))),
                       ("2x3_vs_1x3", rng.standard_normal((2, 3)), rng.standard_normal((1, 3)))):
        yield ErrorInput(Sample((a, b), name=name), match="add needs two arrays of the same shape")


def model_inputs(rng, cfg, rows):
    a, b = rng.standard_normal((rows, cfg.dim)), rng.standard_normal((rows, cfg.dim))
    return Sample((a, b), grad_inputs=(0, 1), name=f"N{rows}_C{cfg.dim}")


OP = define_op(globals(), "Elementwise sum of two same-shape arrays (residuals, gradient accumulation)",
                tol=Tol(rtol=1e-6, atol=1e-6), precisions={"cuda": ("bf16",)})
