"""Linear layer on the GPU: three matrix products (cublas.matmul). See nanoeuler_ops/linear.py.
Activations keep their storage (float32 or bf16); the weight gradient is float32."""

import numpy as np

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.cublas import matmul


def forward(x, w):
    # x (N, C), w (O, C) -> y (N, O) = x @ w.T
    y = runtime.empty((x.shape[0], w.shape[0]), x.dtype)
    matmul(x, w, y, trans_b=True)
    return y, ()


def backward(dy, saved, x, w):
    # dy (N, O) -> dx (N, C) = dy @ w, dw (O, C) = dy.T @ x
    dx = runtime.empty(x.shape, x.dtype)
    dw = runtime.empty(w.shape, np.float32)
    matmul(dy, w, dx)
    matmul(dy, x, dw, trans_a=True)
    return dx, dw
