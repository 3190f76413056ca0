"""RMSNorm + linear for decoding on the CPU. See ops/norm_linear.py for the math and
ops/cpu/row_products.py for how rows stay independent of the batch; a quantized matrix multiplies
the normed rows rounded to 8 bits there."""

import numpy as np
from numba import njit

from nanoeuler_ops.cpu import BACKEND
from nanoeuler_ops.cpu.row_products import kernel_weights, matmul_rows, quantized_matmul_rows, rmsnorm_rows
from nanoeuler_ops.norm_linear import check_shapes


@njit(cache=True)
def _forward(x, g, w, eps, h, y, threads):
    # x (N, C), g (C,), w (O, C) -> h (N, C) the normed rows (scratch), y (N, O)
    rmsnorm_rows(x, g, eps, h)
    matmul_rows(h, w, y, threads)


@njit(cache=True)
def _forward_quantized(x, g, q, scale, zero, eps, h, y, threads):
    # _forward with w quantized (q, scale, zero)
    rmsnorm_rows(x, g, eps, h)
    quantized_matmul_rows(h, q, scale, zero, y, threads)


def forward(x, g, *w, eps):
    check_shapes(x, g, *w)
    h = np.empty(x.shape, dtype=x.dtype)
    y = np.empty((x.shape[0], w[0].shape[0]), dtype=x.dtype)
    if len(w) == 1:
        BACKEND.launch(_forward, x, g, w[0], np.float32(eps), h, y, BACKEND.threads())
    else:
        BACKEND.launch(_forward_quantized, x, g, *kernel_weights(*w), np.float32(eps), h, y, BACKEND.threads())
    return y, ()
