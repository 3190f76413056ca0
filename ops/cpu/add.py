"""Elementwise sum on the CPU. See ops/add.py for the math."""

import numpy as np
from numba import njit, prange

from nanoeuler_ops.add import check_same_shape


@njit(parallel=True, cache=True)
def _add(a, b, y):
    # a, b, y (n,): the arrays flattened, so one compiled kernel serves every rank
    for i in prange(y.shape[0]):
        y[i] = a[i] + b[i]


def forward(a, b):
    check_same_shape(a, b)
    y = np.empty(a.shape, dtype=a.dtype)
    _add(a.reshape(-1), b.reshape(-1), y.reshape(-1))
    return y, ()


def backward(dy, saved, a, b):
    return dy, dy
