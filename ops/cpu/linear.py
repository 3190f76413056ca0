"""Linear layer on the CPU: OpenBLAS's sgemm (blocked, vectorised), one tile per Numba thread
(ops/cpu/common.py's `gemm`), the gradients added into `into` by the product itself.
See ops/linear.py."""

import numpy as np

from nanoeuler_ops.cpu.common import gemm
from nanoeuler_ops.linear import check_shapes


def forward(x, w):
    # x (N, C), w (O, C) -> y (N, O)
    check_shapes(x, w)
    y = np.empty((x.shape[0], w.shape[0]), dtype=x.dtype)
    return gemm(x, w, y, trans_b=True), ()


def backward(dy, saved, x, w, *, into=None):
    # dy (N, O) -> dx (N, C) = dy @ w, dw (O, C) = dy.T @ x, each added into `into`'s array where it has one
    dx_into, dw_into = into or (None, None)
    dx = gemm(dy, w, np.empty(x.shape, x.dtype) if dx_into is None else dx_into, accumulate=dx_into is not None)
    dw = gemm(dy, x, np.empty(w.shape, w.dtype) if dw_into is None else dw_into, trans_a=True,
              accumulate=dw_into is not None)
    return dx, dw
