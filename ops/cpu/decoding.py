"""Kernels the CPU decoding ops norm_linear, norm_swiglu and linear_residual share: RMSNorm rows
and matrix products whose row n does not depend on the batch.

Decoding needs a token's result to be the same whether it is computed alone, beside other rows
of a batch, or beside speculative proposals (nanoeuler_core/inference/decode.py). A BLAS sgemm
does not promise that: it picks kernels and blockings by the matrix sizes. Here every row runs
through the same instructions: loops go over blocks of 4 outputs (sharing the loads of one x
row) and, inside, over rows one at a time, never blocking a row with its neighbours, whose
number would change the vectorised code. These loops run on one thread: at decoding sizes
(one token, a few hundred kilobytes of weights) waking a second thread costs more than the work.
"""

import numpy as np
from numba import njit

from nanoeuler_ops.cpu.common import REDUCE_FASTMATH


@njit(cache=True, fastmath=REDUCE_FASTMATH)
def rmsnorm_rows(x, g, eps, h):
    # x (N, C), g (C,) -> h (N, C) = x / sqrt(mean(x^2) + eps) * g
    N, C = x.shape
    for n in range(N):
        ss = np.float32(0.0)
        for c in range(C):
            ss += x[n, c] * x[n, c]
        r = np.float32(1.0) / np.sqrt(ss / C + eps)
        for c in range(C):
            h[n, c] = x[n, c] * r * g[c]


@njit(cache=True, fastmath=REDUCE_FASTMATH)
def matmul_rows(x, w, out):
    # x (N, I), w (O, I) -> out (N, O) = x @ w.T; four outputs at a time share the loads of x[n]
    N, I = x.shape
    O = w.shape[0]
    O4 = O - O % 4
    for o in range(0, O4, 4):
        for n in range(N):
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for i in range(I):
                xi = x[n, i]
                a0 += xi * w[o, i]
                a1 += xi * w[o + 1, i]
                a2 += xi * w[o + 2, i]
                a3 += xi * w[o + 3, i]
            out[n, o] = a0
            out[n, o + 1] = a1
            out[n, o + 2] = a2
            out[n, o + 3] = a3
    for o in range(O4, O):
        for n in range(N):
            a0 = np.float32(0.0)
            for i in range(I):
                a0 += x[n, i] * w[o, i]
            out[n, o] = a0
