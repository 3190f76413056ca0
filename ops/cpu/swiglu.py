"""SwiGLU gating on the CPU. See nanoeuler_ops/swiglu.py for the math."""

import numpy as np
from numba import njit, prange

from nanoeuler_ops.cpu.common import exp32


@njit(inline="always")
def _sigmoid(z):
    # exp32 of -|z| <= 0 only: in range for every z, and vectorizable where np.exp (a libm call) is not
    e = exp32(-abs(z))
    return np.float32(1.0) / (np.float32(1.0) + e) if z >= 0 else e / (np.float32(1.0) + e)


@njit(parallel=True, cache=True)
def _forward(gate, up, y):
    # gate, up, y (N*F,): flattened, so the threads share the work evenly whatever N is
    for i in prange(y.shape[0]):
        g = gate[i]
        y[i] = g * _sigmoid(g) * up[i]


@njit(parallel=True, cache=True)
def _backward(dy, gate, up, dgate, dup):
    # dy, gate, up -> dgate, dup, all (N*F,)
    for i in prange(dy.shape[0]):
        g = gate[i]
        s = _sigmoid(g)
        dgate[i] = dy[i] * up[i] * s * (np.float32(1.0) + g * (np.float32(1.0) - s))
        dup[i] = dy[i] * g * s


def forward(gate, up):
    y = np.empty(gate.shape, dtype=gate.dtype)
    _forward(gate.reshape(-1), up.reshape(-1), y.reshape(-1))
    return y, ()


def backward(dy, saved, gate, up):
    dgate = np.empty(gate.shape, dtype=gate.dtype)
    dup = np.empty(up.shape, dtype=up.dtype)
    _backward(dy.reshape(-1), gate.reshape(-1), up.reshape(-1), dgate.reshape(-1), dup.reshape(-1))
    return dgate, dup
