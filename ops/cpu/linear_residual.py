"""Residual linear update for decoding on the CPU. See ops/linear_residual.py for the
math and ops/cpu/row_products.py for how rows stay independent of the batch."""

import numpy as np
from numba import njit

from nanoeuler_ops.cpu import BACKEND
from nanoeuler_ops.cpu.row_products import kernel_weights, matmul_rows, quantized_matmul_rows
from nanoeuler_ops.linear_residual import check_shapes


@njit(cache=True)
def _add(r, y):
    # y += r
    N, O = y.shape
    for n in range(N):
        for o in range(O):
            y[n, o] += r[n, o]


@njit(cache=True)
def _forward(x, r, w, y, threads):
    # x (N, I), r (N, O), w (O, I) -> y (N, O) = r + x @ w.T
    matmul_rows(x, w, y, threads)
    _add(r, y)


@njit(cache=True)
def _forward_quantized(x, r, q, scale, zero, y, threads):
    # _forward with w quantized (q, scale, zero)
    quantized_matmul_rows(x, q, scale, zero, y, threads)
    _add(r, y)


def forward(x, r, *w):
    check_shapes(x, r, *w)
    y = np.empty(r.shape, dtype=r.dtype)
    if len(w) == 1:
        BACKEND.launch(_forward, x, r, w[0], y, BACKEND.threads())
    else:
        BACKEND.launch(_forward_quantized, x, r, *kernel_weights(*w), y, BACKEND.threads())
    return y, ()
