"""RMSNorm on the CPU. See nanoeuler_ops/rmsnorm.py for the math."""

import numpy as np
from numba import njit, prange

from nanoeuler_ops import accumulated
from nanoeuler_ops.cpu.common import n_chunks


@njit(parallel=True, cache=True)
def _forward(x, w, eps, y, rstd):
    # x (N, C), w (C,) -> y (N, C), rstd (N,)
    N, C = x.shape
    for n in prange(N):
        ss = np.float32(0.0)
        for c in range(C):
            ss += x[n, c] * x[n, c]
        r = np.float32(1.0) / np.sqrt(ss / C + eps)
        rstd[n] = r
        for c in range(C):
            y[n, c] = x[n, c] * r * w[c]


@njit(parallel=True, cache=True)
def _backward(dy, x, w, rstd, dx, dw_partial):
    # dy, x (N, C), w (C,), rstd (N,) -> dx (N, C); dw_partial (P, C): one row per chunk of rows,
    # summed by the caller, so threads never write the same dw element.
    N, C = x.shape
    P = dw_partial.shape[0]
    for p in prange(P):
        for c in range(C):
            dw_partial[p, c] = 0.0
        for n in range(p * N // P, (p + 1) * N // P):
            r = rstd[n]
            dot = np.float32(0.0)
            for c in range(C):
                dot += dy[n, c] * w[c] * x[n, c] * r
            dot /= C
            for c in range(C):
                xhat = x[n, c] * r
                dw_partial[p, c] += dy[n, c] * xhat
                dx[n, c] = r * (dy[n, c] * w[c] - xhat * dot)


def forward(x, w, *, eps):
    y = np.empty_like(x)
    rstd = np.empty(x.shape[0], dtype=x.dtype)
    _forward(x, w, np.float32(eps), y, rstd)
    return y, (rstd,)


def backward(dy, saved, x, w, *, eps, into=None):
    (rstd,) = saved
    dx = np.empty_like(x)
    dw_partial = np.empty((n_chunks(x.shape[0]), x.shape[1]), dtype=x.dtype)
    _backward(dy, x, w, rstd, dx, dw_partial)
    return accumulated((dx, dw_partial.sum(axis=0)), into)
