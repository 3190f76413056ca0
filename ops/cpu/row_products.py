"""The RMSNorm rows and matrix products that the CPU decoding ops norm_linear, norm_swiglu and
linear_residual share, each row's result independent of the batch.

Decoding needs a token's result to be the same whether it is computed alone, beside other rows
of a batch, or beside speculative proposals (docs/decoding.md). A BLAS sgemm
does not promise that: it picks kernels and blockings by the matrix sizes. Here every row runs
through the same instructions: loops go over blocks of 4 outputs (sharing the loads of one x
row) and, inside, over rows one at a time, never blocking a row with its neighbours, whose
number would change the vectorised code. Small products run on one thread: at decoding sizes
(one token, a few hundred kilobytes of weights) waking a second thread costs more than the work;
larger ones (a prompt's prefill) share blocks of outputs among the threads.
"""

import numpy as np
from numba import njit, prange

from nanoeuler_ops.cpu.common import REDUCE_FASTMATH

# Multiply-adds of a product from which sharing its outputs among the threads pays for waking them
# (a token's step at batch 1 stays on one thread; a 127-token prefill of `small` does not)
THREADED_PRODUCTS = 1 << 22


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
def _four_outputs(x, w, out, o):
    # out[:, o:o+4] = x @ w[o:o+4].T: the four outputs share the loads of each x[n]; rows one at a time
    N, I = x.shape
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


@njit(cache=True, fastmath=REDUCE_FASTMATH, parallel=True)
def _four_outputs_threaded(x, w, out, blocks):
    # _four_outputs over blocks 0..blocks-1 of four outputs, the blocks shared among the threads
    for block in prange(blocks):
        _four_outputs(x, w, out, 4 * block)


@njit(cache=True, fastmath=REDUCE_FASTMATH)
def matmul_rows(x, w, out):
    # x (N, I), w (O, I) -> out (N, O) = x @ w.T. Each output is the same loop over i whichever
    # thread runs it, so threading (a prompt's prefill, a wide batch) changes no bit
    N, I = x.shape
    O = w.shape[0]
    O4 = O - O % 4
    if N * O * I >= THREADED_PRODUCTS:
        _four_outputs_threaded(x, w, out, O4 // 4)
    else:
        for o in range(0, O4, 4):
            _four_outputs(x, w, out, o)
    for o in range(O4, O):
        for n in range(N):
            a0 = np.float32(0.0)
            for i in range(I):
                a0 += x[n, i] * w[o, i]
            out[n, o] = a0


# ---------------------------------------------------------------- quantized weights
# (q, scale, zero) as nanoeuler_core/quantized.py lays them out; each output is one loop over its
# groups whichever thread runs it and however many rows there are.

@njit(cache=True, fastmath=REDUCE_FASTMATH)
def _int8_output(x, q, scale, n, o):
    # x[n] . w[o], w[o, k] = scale[o, k // group] * q[o, k]
    groups = scale.shape[1]
    group = q.shape[1] // groups
    total = np.float32(0.0)
    for j in range(groups):
        part = np.float32(0.0)
        for k in range(j * group, (j + 1) * group):
            part += x[n, k] * np.float32(q[o, k])
        total += scale[o, j] * part
    return total


@njit(cache=True, fastmath=REDUCE_FASTMATH)
def _int4_output(x, x_sums, q, scale, zero, n, o):
    # x[n] . w[o], w[o, k] = scale[o, k // group] * nibble[o, k] + zero[o, k // group]: each group's
    # sum of x times nibbles, scaled, plus its offset times the group's sum of x (x_sums)
    groups = scale.shape[1]
    group = 2 * q.shape[1] // groups
    total = np.float32(0.0)
    for j in range(groups):
        part = np.float32(0.0)
        for block in range(j * group, (j + 1) * group, 32):
            half = block // 2
            for i in range(16):
                byte = q[o, half + i]
                part += x[n, block + i] * np.float32(byte & 15) + x[n, block + 16 + i] * np.float32(byte >> 4)
        total += scale[o, j] * part + zero[o, j] * x_sums[n, j]
    return total


@njit(cache=True, fastmath=REDUCE_FASTMATH)
def _group_sums(x, groups, x_sums):
    # x_sums[n, j] = the sum of x[n] over group j
    N, K = x.shape
    group = K // groups
    for n in range(N):
        for j in range(groups):
            s = np.float32(0.0)
            for k in range(j * group, (j + 1) * group):
                s += x[n, k]
            x_sums[n, j] = s


@njit(cache=True, fastmath=REDUCE_FASTMATH, parallel=True)
def quantized_matmul_rows(x, q, scale, zero, out):
    # x (N, K), (q, scale, zero) (O, K) quantized -> out (N, O) = x @ w.T; outputs shared among the threads
    N, O = out.shape
    int4 = q.shape[1] != x.shape[1]
    x_sums = np.empty((N, scale.shape[1]), dtype=np.float32)
    if int4:
        _group_sums(x, scale.shape[1], x_sums)
    for o in prange(O):
        for n in range(N):
            out[n, o] = _int4_output(x, x_sums, q, scale, zero, n, o) if int4 else _int8_output(x, q, scale, n, o)

