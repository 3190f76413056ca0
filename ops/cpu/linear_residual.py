"""Residual linear update for decoding on the CPU. See ops/linear_residual.py for the
math and ops/cpu/row_products.py for how rows stay independent of the batch."""

import numpy as np
from numba import njit

from nanoeuler_ops.cpu.row_products import matmul_rows
from nanoeuler_ops.linear_residual import check_shapes


@njit(cache=True)
def _forward(x, w, r, y):
    # x (N, I), w (O, I), r (N, O) -> y (N, O) = r + x @ w.T
    matmul_rows(x, w, y)
    N, O = y.shape
    for n in range(N):
        for o in range(O):
            y[n, o] += r[n, o]


def forward(x, w, r):
    check_shapes(x, w, r)
    y = np.empty(r.shape, dtype=r.dtype)
    _forward(x, w, r, y)
    return y, ()
