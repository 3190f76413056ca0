"""RMSNorm on the CPU. See ops/rmsnorm.py for the math.

The kernels take an optional residual add with them, for add_rmsnorm (ops/cpu/add_rmsnorm.py):
the forward can normalise x + branch, writing the sum too, and the backward can add the gradient
that reaches the sum from the residual stream, each in the same pass over the rows.
"""

import numpy as np
from numba import njit, prange

from nanoeuler_ops import accumulated
from nanoeuler_ops.cpu.common import REDUCE_FASTMATH, n_chunks
from nanoeuler_ops.rmsnorm import check_shapes


def forward(x, w, *, eps):
    # x (N, C), w (C,) -> y (N, C); saved rstd (N,)
    check_shapes(x, w)
    y = np.empty_like(x)
    rstd = np.empty(x.shape[0], dtype=x.dtype)
    normalize_rows(x, x, False, w, np.float32(eps), x, y, rstd)
    return y, (rstd,)


def backward(dy, saved, x, w, *, eps, into=None):
    # dy (N, C) -> dx (N, C), dw (C,), each added into `into`'s array where it has one
    (rstd,) = saved
    dx, dw = backward_rows(dy, x, w, rstd, None)
    return accumulated((dx, dw), into)


def backward_rows(dy, x, w, rstd, ds):
    """dx (N, C) and dw (C,) of y = rmsnorm(x), plus ds (N, C) on dx where not None."""
    dx = np.empty_like(x)
    dw_partial = np.empty((n_chunks(x.shape[0]), x.shape[1]), dtype=x.dtype)
    _backward(dy, x, w, rstd, dy if ds is None else ds, ds is not None, dx, dw_partial)
    return dx, dw_partial.sum(axis=0)


@njit(parallel=True, cache=True, fastmath=REDUCE_FASTMATH)
def normalize_rows(x, branch, add_branch, w, eps, s, y, rstd):
    # x (N, C), w (C,) -> y (N, C) = rmsnorm(x), rstd (N,); with add_branch, of s = x + branch
    # instead, s written too (else branch and s are not read)
    N, C = x.shape
    for n in prange(N):
        row = s[n] if add_branch else x[n]
        if add_branch:
            for c in range(C):
                row[c] = x[n, c] + branch[n, c]
        ss = np.float32(0.0)
        for c in range(C):
            ss += row[c] * row[c]
        r = np.float32(1.0) / np.sqrt(ss / C + eps)
        rstd[n] = r
        for c in range(C):
            y[n, c] = row[c] * r * w[c]


@njit(parallel=True, cache=True, fastmath=REDUCE_FASTMATH)
def _backward(dy, x, w, rstd, ds, add_ds, dx, dw_partial):
    # dy, x (N, C), w (C,), rstd (N,) -> dx (N, C) (+ ds (N, C) with add_ds); dw_partial (P, C):
    # one row per chunk of rows, summed by the caller, so threads never write the same dw element.
    N, C = x.shape
    P = dw_partial.shape[0]
    for p in prange(P):
        for c in range(C):
            dw_partial[p, c] = 0.0
        for n in range(p * N // P, (p + 1) * N // P):
            r = rstd[n]
            dot = np.float32(0.0)
            for c in range(C):
                dot += dy[n, c] * w[c] * x[n, c]
            dot *= r / C
            for c in range(C):
                xhat = x[n, c] * r
                dw_partial[p, c] += dy[n, c] * xhat
                dx[n, c] = r * (dy[n, c] * w[c] - xhat * dot)
            if add_ds:
                for c in range(C):
                    dx[n, c] += ds[n, c]
