"""GELU, the tanh approximation (as GPT-2), registered as the nanoeuler op `gelu`.

Shapes: x (...) -> y (...), elementwise, any rank; saved ().
    y = 0.5 x (1 + t),  t = tanh(u),  u = k (x + a x^3),  k = sqrt(2 / pi),  a = 0.044715
Backward:
    dx = dy * (0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 a x^2))
"""

import numpy as np

from nanoeuler_core.registry import Sample, define_op

SQRT_2_OVER_PI = float(np.sqrt(2.0 / np.pi))
CUBIC = 0.044715


def forward(x):
    t = np.tanh(SQRT_2_OVER_PI * (x + CUBIC * x ** 3))
    return 0.5 * x * (1.0 + t), ()


def backward(dy, saved, x):
    t = np.tanh(SQRT_2_OVER_PI * (x + CUBIC * x ** 3))
    dt_dx = (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * CUBIC * x * x)
    return (dy * (0.5 * (1.0 + t) + 0.5 * x * dt_dx),)


def sample_inputs(rng):
    for shape in ((1,), (7, 13), (3, 5, 11)):
        x = 3.0 * rng.standard_normal(shape)  # wide enough to reach both flat tails of the tanh
        yield Sample((x,), grad_inputs=(0,), name="x".join(map(str, shape)))


OP = define_op(globals(), "GELU activation, tanh approximation (GPT-2)", source="nanoeuler-gelu")
