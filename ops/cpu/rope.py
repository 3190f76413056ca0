"""Rotary position embedding on the CPU. See nanoeuler_ops/rope.py for the math."""

from functools import lru_cache

import numpy as np
from numba import njit, prange

from nanoeuler_ops.rope import cos_sin


@njit(parallel=True, cache=True)
def rotate_into(x, cos, sin, y):
    # x (B, T, H, D), cos, sin (T, D/2) -> y (B, T, H, D); the backward passes -sin
    B, T, H, D = x.shape
    half = D // 2
    for bt in prange(B * T):
        b, t = bt // T, bt % T
        for h in range(H):
            for j in range(half):
                x1, x2 = x[b, t, h, j], x[b, t, h, j + half]
                y[b, t, h, j] = x1 * cos[t, j] - x2 * sin[t, j]
                y[b, t, h, j + half] = x2 * cos[t, j] + x1 * sin[t, j]


@lru_cache(maxsize=32)
def tables(T, D, theta, start_pos):
    """float32 cos, sin and -sin (T, D/2), read-only: a training step reuses them in every layer,
    forward and backward, and building them costs more than the rotation itself."""
    cos, sin = cos_sin(T, D, theta, start_pos)
    tables = cos.astype(np.float32), sin.astype(np.float32), (-sin).astype(np.float32)
    for table in tables:
        table.flags.writeable = False
    return tables


def forward(x, *, theta, start_pos=0):
    cos, sin, _ = tables(x.shape[1], x.shape[3], float(theta), int(start_pos))
    y = np.empty(x.shape, dtype=x.dtype)
    rotate_into(x, cos, sin, y)
    return y, ()


def backward(dy, saved, x, *, theta, start_pos=0):
    cos, _, neg_sin = tables(x.shape[1], x.shape[3], float(theta), int(start_pos))
    dx = np.empty(dy.shape, dtype=dy.dtype)
    rotate_into(dy, cos, neg_sin, dx)
    return (dx,)
