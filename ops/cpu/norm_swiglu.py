"""RMSNorm + gate/up projections + SwiGLU for decoding on the CPU. See ops/norm_swiglu.py
for the math and ops/cpu/row_products.py for how rows stay independent of the batch; a quantized
matrix multiplies the normed rows rounded to 8 bits there."""

import numpy as np
from numba import njit, prange

from nanoeuler_ops.cpu import BACKEND
from nanoeuler_ops.cpu.row_products import kernel_weights, matmul_rows, quantized_matmul_rows, rmsnorm_rows
from nanoeuler_ops.cpu.common import exp32
from nanoeuler_ops.norm_swiglu import check_shapes

THREADED_ELEMENTS = 1 << 14   # outputs from which the SwiGLU shares its rows among the threads


@njit(cache=True)
def _silu_product(gate_up, y, n):
    # y[n] = silu(gate) * up of row n; silu(z) = z / (1 + exp(-z)), and exp32 saturates instead of
    # overflowing, so every z is fine
    F = y.shape[1]
    for f in range(F):
        z = gate_up[n, f]
        y[n, f] = z / (np.float32(1.0) + exp32(-z)) * gate_up[n, F + f]


@njit(cache=True, parallel=True)
def _silu_product_threaded(gate_up, y):
    for n in prange(y.shape[0]):
        _silu_product(gate_up, y, n)


@njit(cache=True)
def _silu_products(gate_up, y):
    # y (N, F) = silu(gate_up[:, :F]) * gate_up[:, F:]
    if y.size >= THREADED_ELEMENTS:   # a prompt's prefill; a token's step stays on one thread
        _silu_product_threaded(gate_up, y)
    else:
        for n in range(y.shape[0]):
            _silu_product(gate_up, y, n)


@njit(cache=True)
def _forward(x, g, w, eps, h, gate_up, y, threads):
    # x (N, C), g (C,), w (2F, C) -> h (N, C), gate_up (N, 2F) (scratch), y (N, F)
    rmsnorm_rows(x, g, eps, h)
    matmul_rows(h, w, gate_up, threads)
    _silu_products(gate_up, y)


@njit(cache=True)
def _forward_quantized(x, g, q, scale, zero, eps, h, gate_up, y, threads):
    # _forward with w quantized (q, scale, zero)
    rmsnorm_rows(x, g, eps, h)
    quantized_matmul_rows(h, q, scale, zero, gate_up, threads)
    _silu_products(gate_up, y)


def forward(x, g, *w, eps):
    check_shapes(x, g, *w)
    N, F = x.shape[0], w[0].shape[0] // 2
    h = np.empty(x.shape, dtype=x.dtype)
    gate_up = np.empty((N, 2 * F), dtype=x.dtype)
    y = np.empty((N, F), dtype=x.dtype)
    if len(w) == 1:
        BACKEND.launch(_forward, x, g, w[0], np.float32(eps), h, gate_up, y, BACKEND.threads())
    else:
        BACKEND.launch(_forward_quantized, x, g, *kernel_weights(*w), np.float32(eps), h, gate_up, y, BACKEND.threads())
    return y, ()
