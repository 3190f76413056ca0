"""SwiGLU on the GPU, forward and backward each one fused elementwise pass.
See nanoeuler_ops/swiglu.py for the math."""

import math

from numba import cuda, float32

from nanoeuler_ops.cuda import runtime

THREADS = 256


@cuda.jit(device=True, inline=True)
def _sigmoid(z):
    return float32(0.5) * (float32(1.0) + math.tanh(float32(0.5) * z))  # 1 / (1 + exp(-z)) without overflow for large -z


@cuda.jit(cache=True)
def _forward(gate, up, y):
    # gate, up (n,) -> y (n,): (N, F) flattened
    i = cuda.grid(1)
    if i < y.shape[0]:
        g = gate[i]
        y[i] = g * _sigmoid(g) * up[i]


@cuda.jit(cache=True)
def _backward(dy, gate, up, dgate, dup):
    # dy, gate, up (n,) -> dgate, dup (n,): (N, F) flattened
    i = cuda.grid(1)
    if i < dy.shape[0]:
        g = gate[i]
        s = _sigmoid(g)
        dgate[i] = dy[i] * up[i] * s * (float32(1.0) + g * (float32(1.0) - s))
        dup[i] = dy[i] * g * s


def _flat(*arrays):
    return tuple(a.reshape(a.size) for a in arrays)


def forward(gate, up):
    y = runtime.empty(gate.shape, gate.dtype)
    runtime.launch(_forward, runtime.blocks_for(gate.size, THREADS), THREADS, *_flat(gate, up, y))
    return y, ()


def backward(dy, saved, gate, up):
    dgate = runtime.empty(gate.shape, gate.dtype)
    dup = runtime.empty(up.shape, up.dtype)
    runtime.launch(_backward, runtime.blocks_for(gate.size, THREADS), THREADS, *_flat(dy, gate, up, dgate, dup))
    return dgate, dup
