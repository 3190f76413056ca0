"""SwiGLU on the GPU, forward and backward each one fused elementwise pass, float32 or bf16
storage (float32 arithmetic). See nanoeuler_ops/swiglu.py for the math."""

import math

from numba import cuda, float32, uint64

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.runtime import stored, to_f32
from nanoeuler_ops.swiglu import check_shape

THREADS = 256


@cuda.jit(device=True, inline=True)
def _sigmoid(z):
    return float32(0.5) * (float32(1.0) + math.tanh(float32(0.5) * z))  # 1 / (1 + exp(-z)) without overflow for large -z


# Arrays are passed flat and indexed with unsigned integers; the grid is (rows, column blocks), so
# no thread divides to find its row.

@cuda.jit(cache=True)
def _forward(x, y, F):
    # x (N * 2F,) = rows [gate | up], y (N * F,); grid (N, F / THREADS), one thread per output element
    j = cuda.blockIdx.y * THREADS + cuda.threadIdx.x
    if j < F:
        gate = uint64(cuda.blockIdx.x) * uint64(2 * F) + uint64(j)
        g = to_f32(x[gate])
        y[uint64(cuda.blockIdx.x) * uint64(F) + uint64(j)] = stored(y, g * _sigmoid(g) * to_f32(x[gate + uint64(F)]))


@cuda.jit(cache=True)
def _backward(dy, x, F, dx):
    # dy (N * F,), x (N * 2F,) -> dx (N * 2F,); grid (N, F / THREADS), one thread per element of dy
    j = cuda.blockIdx.y * THREADS + cuda.threadIdx.x
    if j < F:
        gate = uint64(cuda.blockIdx.x) * uint64(2 * F) + uint64(j)
        up = gate + uint64(F)
        g = to_f32(x[gate])
        d = to_f32(dy[uint64(cuda.blockIdx.x) * uint64(F) + uint64(j)])
        s = _sigmoid(g)
        dx[gate] = stored(dx, d * to_f32(x[up]) * s * (float32(1.0) + g * (float32(1.0) - s)))
        dx[up] = stored(dx, d * g * s)


def forward(x):
    check_shape(x)
    y = runtime.empty((x.shape[0], x.shape[1] // 2), x.dtype)
    grid = (x.shape[0], runtime.blocks_for(y.shape[1], THREADS))
    runtime.launch(_forward, grid, THREADS, x.reshape(x.size), y.reshape(y.size), y.shape[1])
    return y, ()


def backward(dy, saved, x):
    dx = runtime.empty(x.shape, x.dtype)
    grid = (x.shape[0], runtime.blocks_for(dy.shape[1], THREADS))
    runtime.launch(_backward, grid, THREADS, dy.reshape(dy.size), x.reshape(x.size), dy.shape[1], dx.reshape(dx.size))
    return (dx,)
