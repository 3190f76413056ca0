"""SwiGLU on the GPU, forward and backward each one fused elementwise pass, float32 or bf16
storage (float32 arithmetic). See nanoeuler_ops/swiglu.py for the math."""

import math

from numba import cuda, float32

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.runtime import stored, to_f32
from nanoeuler_ops.swiglu import check_shape

THREADS = 256


@cuda.jit(device=True, inline=True)
def _sigmoid(z):
    return float32(0.5) * (float32(1.0) + math.tanh(float32(0.5) * z))  # 1 / (1 + exp(-z)) without overflow for large -z


@cuda.jit(cache=True)
def _forward(x, y):
    # x (N, 2F) -> y (N, F); one thread per output element
    i = cuda.grid(1)
    N, F = y.shape
    if i < N * F:
        n, j = i // F, i % F
        g = to_f32(x[n, j])
        y[n, j] = stored(y, g * _sigmoid(g) * to_f32(x[n, F + j]))


@cuda.jit(cache=True)
def _backward(dy, x, dx):
    # dy (N, F), x (N, 2F) -> dx (N, 2F); one thread per element of dy
    i = cuda.grid(1)
    N, F = dy.shape
    if i < N * F:
        n, j = i // F, i % F
        g = to_f32(x[n, j])
        d = to_f32(dy[n, j])
        s = _sigmoid(g)
        dx[n, j] = stored(dx, d * to_f32(x[n, F + j]) * s * (float32(1.0) + g * (float32(1.0) - s)))
        dx[n, F + j] = stored(dx, d * g * s)


def forward(x):
    check_shape(x)
    y = runtime.empty((x.shape[0], x.shape[1] // 2), x.dtype)
    runtime.launch(_forward, runtime.blocks_for(y.size, THREADS), THREADS, x, y)
    return y, ()


def backward(dy, saved, x):
    dx = runtime.empty(x.shape, x.dtype)
    runtime.launch(_backward, runtime.blocks_for(dy.size, THREADS), THREADS, dy, x, dx)
    return (dx,)
