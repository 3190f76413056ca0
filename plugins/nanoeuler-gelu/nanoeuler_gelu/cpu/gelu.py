"""GELU on nanoeuler's CPU backend (float32, Numba). See nanoeuler_gelu/gelu.py for the math."""

import numpy as np
from numba import njit, prange

from nanoeuler_gelu.gelu import CUBIC, SQRT_2_OVER_PI


@njit(parallel=True, cache=True)
def _forward(x, y):
    # x, y (n,): flattened, so one compiled kernel serves every rank
    k, a = np.float32(SQRT_2_OVER_PI), np.float32(CUBIC)
    for i in prange(x.shape[0]):
        v = x[i]
        y[i] = np.float32(0.5) * v * (np.float32(1.0) + np.tanh(k * (v + a * v * v * v)))


@njit(parallel=True, cache=True)
def _backward(dy, x, dx):
    # dy, x -> dx, all (n,)
    k, a = np.float32(SQRT_2_OVER_PI), np.float32(CUBIC)
    for i in prange(x.shape[0]):
        v = x[i]
        t = np.tanh(k * (v + a * v * v * v))
        dt_dx = (np.float32(1.0) - t * t) * k * (np.float32(1.0) + np.float32(3.0) * a * v * v)
        dx[i] = dy[i] * np.float32(0.5) * (np.float32(1.0) + t + v * dt_dx)


def forward(x):
    y = np.empty(x.shape, dtype=x.dtype)
    _forward(x.reshape(-1), y.reshape(-1))
    return y, ()


def backward(dy, saved, x):
    dx = np.empty(x.shape, dtype=x.dtype)
    _backward(dy.reshape(-1), x.reshape(-1), dx.reshape(-1))
    return (dx,)
