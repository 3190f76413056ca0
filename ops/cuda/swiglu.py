"""SwiGLU on the GPU, forward and backward each one fused elementwise pass, float32 or bf16
storage (float32 arithmetic). See ops/swiglu.py for the math."""

import math

from numba import cuda, float32, uint64

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.device import stored, to_f32
from nanoeuler_ops.swiglu import check_shape

THREADS = 256
ELEMENTS = 4   # columns of a row a thread takes


@cuda.jit(device=True, inline=True)
def _sigmoid(z):
    return float32(0.5) * (float32(1.0) + math.tanh(float32(0.5) * z))  # 1 / (1 + exp(-z)) without overflow for large -z


# Arrays are passed flat and indexed with unsigned integers; the grid is (rows, column blocks), so
# no thread divides to find its row. Thread t of column block c takes the row's columns
# c * THREADS * ELEMENTS + t + k * THREADS, k < ELEMENTS, and asks for all their inputs before it
# computes or stores anything: a thread with one bf16 column had 2 bytes in flight at a time, too
# few to keep the memory busy.

@cuda.jit(device=True, inline=True)
def _first_column():
    return cuda.blockIdx.y * (THREADS * ELEMENTS) + cuda.threadIdx.x


@cuda.jit(device=True, inline=True)
def _load_gates_ups(x, row, first, F, gates, ups):
    # gates[k], ups[k] <- the gate and up inputs of this thread's columns of the row (x (N * 2F,))
    for k in range(ELEMENTS):
        j = first + k * THREADS
        if j < F:
            gate = row * uint64(2 * F) + uint64(j)
            gates[k], ups[k] = to_f32(x[gate]), to_f32(x[gate + uint64(F)])


@cuda.jit(cache=True)
def _forward(x, y, F):
    # x (N * 2F,) = rows [gate | up], y (N * F,); grid (N, F / (THREADS * ELEMENTS))
    row, first = uint64(cuda.blockIdx.x), _first_column()
    gates = cuda.local.array(ELEMENTS, float32)
    ups = cuda.local.array(ELEMENTS, float32)
    _load_gates_ups(x, row, first, F, gates, ups)
    for k in range(ELEMENTS):
        j = first + k * THREADS
        if j < F:
            g = gates[k]
            y[row * uint64(F) + uint64(j)] = stored(y, g * _sigmoid(g) * ups[k])


@cuda.jit(cache=True)
def _backward(dy, x, F, dx):
    # dy (N * F,), x (N * 2F,) -> dx (N * 2F,); grid (N, F / (THREADS * ELEMENTS))
    row, first = uint64(cuda.blockIdx.x), _first_column()
    gates = cuda.local.array(ELEMENTS, float32)
    ups = cuda.local.array(ELEMENTS, float32)
    grads = cuda.local.array(ELEMENTS, float32)
    _load_gates_ups(x, row, first, F, gates, ups)
    for k in range(ELEMENTS):
        j = first + k * THREADS
        if j < F:
            grads[k] = to_f32(dy[row * uint64(F) + uint64(j)])
    for k in range(ELEMENTS):
        j = first + k * THREADS
        if j < F:
            gate = row * uint64(2 * F) + uint64(j)
            g, d = gates[k], grads[k]
            s = _sigmoid(g)
            dx[gate] = stored(dx, d * ups[k] * s * (float32(1.0) + g * (float32(1.0) - s)))
            dx[gate + uint64(F)] = stored(dx, d * g * s)


def forward(x):
    check_shape(x)
    y = runtime.empty((x.shape[0], x.shape[1] // 2), x.dtype)
    grid = (x.shape[0], runtime.blocks_for(y.shape[1], THREADS * ELEMENTS))
    runtime.launch(_forward, grid, THREADS, x.reshape(x.size), y.reshape(y.size), y.shape[1])
    return y, ()


def backward(dy, saved, x):
    dx = runtime.empty(x.shape, x.dtype)
    grid = (x.shape[0], runtime.blocks_for(dy.shape[1], THREADS * ELEMENTS))
    runtime.launch(_backward, grid, THREADS, dy.reshape(dy.size), x.reshape(x.size), dy.shape[1], dx.reshape(dx.size))
    return (dx,)
