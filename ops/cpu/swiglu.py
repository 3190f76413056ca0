"""SwiGLU gating on the CPU. See ops/swiglu.py for the math."""

import numpy as np
from numba import njit, prange

from nanoeuler_ops.cpu.common import exp32
from nanoeuler_ops.swiglu import check_shape


@njit(inline="always")
def _sigmoid(z):
    # exp32 of -|z| <= 0 only: in range for every z, and vectorizable where np.exp (a libm call) is not
    e = exp32(-abs(z))
    return np.float32(1.0) / (np.float32(1.0) + e) if z >= 0 else e / (np.float32(1.0) + e)


@njit(parallel=True, cache=True)
def _forward(x, y):
    # x (N, 2F) -> y (N, F)
    N, F = y.shape
    for n in prange(N):
        for j in range(F):
            g = x[n, j]
            y[n, j] = g * _sigmoid(g) * x[n, F + j]


@njit(parallel=True, cache=True)
def _backward(dy, x, dx):
    # dy (N, F), x (N, 2F) -> dx (N, 2F)
    N, F = dy.shape
    for n in prange(N):
        for j in range(F):
            g = x[n, j]
            s = _sigmoid(g)
            dx[n, j] = dy[n, j] * x[n, F + j] * s * (np.float32(1.0) + g * (np.float32(1.0) - s))
            dx[n, F + j] = dy[n, j] * g * s


def forward(x):
    check_shape(x)
    y = np.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
    _forward(x, y)
    return y, ()


def backward(dy, saved, x):
    dx = np.empty(x.shape, dtype=x.dtype)
    _backward(dy, x, dx)
    return (dx,)
