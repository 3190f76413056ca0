"""Rotary position embedding on the GPU, float32 or bf16 storage. See nanoeuler_ops/rope.py for the math.

cos and sin come from the same float64 `cos_sin` as every backend, cast to float32 once and kept
on the GPU per (D, theta) for positions 0 .. L-1 (L doubled whenever a later position shows up),
so a call copies nothing to the GPU and a captured CUDA graph replays it as is.
"""

import numpy as np
from numba import cuda

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.runtime import stored, to_f32
from nanoeuler_ops.rope import cos_sin

THREADS = 256
_tables: dict = {}   # (D, theta) -> (cos, sin), each (L, D/2) on the GPU


def _table(positions: int, D: int, theta: float):
    """Device cos and sin tables (L, D/2) covering positions 0 .. positions-1 at least."""
    cached = _tables.get((D, theta))
    if cached is None or cached[0].shape[0] < positions:
        length = max(64, 1 << (positions - 1).bit_length())
        cos, sin = cos_sin(length, D, theta, 0)
        cached = cuda.to_device(cos.astype(np.float32)), cuda.to_device(sin.astype(np.float32))
        _tables[(D, theta)] = cached
    return cached


@cuda.jit(cache=True)
def _rotate(x, cos, sin, start_pos, sign, y):
    # x (B, T, H, D), cos/sin (L, D/2), sign = +1 (forward) or -1 (backward) -> y (B, T, H, D);
    # one thread per rotated pair (b, t, h, j), j < D/2
    i = cuda.grid(1)
    B, T, H, D = x.shape
    half = D // 2
    if i < B * T * H * half:
        j = i % half
        h = (i // half) % H
        t = (i // (half * H)) % T
        b = i // (half * H * T)
        c = cos[start_pos + t, j]
        s = sign * sin[start_pos + t, j]
        u1 = to_f32(x[b, t, h, j])
        u2 = to_f32(x[b, t, h, j + half])
        y[b, t, h, j] = stored(y, u1 * c - u2 * s)
        y[b, t, h, j + half] = stored(y, u2 * c + u1 * s)


def _apply(x, theta, start_pos, sign):
    B, T, H, D = x.shape
    if D % 2:
        raise ValueError(f"rope needs an even head dimension, got {D}")
    cos, sin = _table(start_pos + T, D, theta)
    y = runtime.empty(x.shape, x.dtype)
    runtime.launch(_rotate, runtime.blocks_for(B * T * H * D // 2, THREADS), THREADS,
                   x, cos, sin, start_pos, np.float32(sign), y)
    return y


def forward(x, *, theta, start_pos=0):
    return _apply(x, theta, start_pos, 1), ()


def backward(dy, saved, x, *, theta, start_pos=0):
    return (_apply(dy, theta, start_pos, -1),)
