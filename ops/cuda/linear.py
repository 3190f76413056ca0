"""Linear layer on the GPU: three matrix products (cublas.matmul). See ops/linear.py.
Activations keep their storage (float32 or bf16); the weight gradient is float32. Float32 products
run on the TF32 tensor cores where the caller's precision says so (`precision`, given by the registry). A gradient
added into the caller's array (`into`) is cuBLAS's beta = 1: no temporary, no extra pass."""

import numpy as np

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.cublas import matmul
from nanoeuler_ops.linear import check_shapes


def forward(x, w, *, precision):
    # x (N, C), w (O, C) -> y (N, O) = x @ w.T
    check_shapes(x, w)
    y = runtime.empty((x.shape[0], w.shape[0]), x.dtype)
    matmul(x, w, y, trans_b=True, tf32=precision.tf32)
    return y, ()


def backward(dy, saved, x, w, *, into=None, precision):
    # dy (N, O) -> dx (N, C) = dy @ w, dw (O, C) = dy.T @ x, each added into `into`'s array where it has one
    dx_into, dw_into = into or (None, None)
    dx = runtime.empty(x.shape, x.dtype) if dx_into is None else dx_into
    dw = runtime.empty(w.shape, np.float32) if dw_into is None else dw_into
    matmul(dy, w, dx, accumulate=dx_into is not None, tf32=precision.tf32)
    matmul(dy, x, dw, trans_a=True, accumulate=dw_into is not None, tf32=precision.tf32)
    return dx, dw
