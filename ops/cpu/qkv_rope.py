"""Split a fused q/k/v projection into heads and rotate q and k, on the CPU. See nanoeuler_ops/qkv_rope.py."""

from functools import lru_cache

import numpy as np
from numba import njit, prange

from nanoeuler_ops.qkv_rope import _heads, check_shape, cos_sin


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


def forward(qkv, *, n_heads, n_kv_heads, theta, start_pos=0):
    # qkv (B, T, (H + 2 KV) D) -> q (B, T, H, D), k, v (B, T, KV, D)
    check_shape(qkv, n_heads, n_kv_heads)
    q_in, k_in, v_in = _heads(qkv, n_heads, n_kv_heads)
    cos, sin, _ = tables(qkv.shape[1], q_in.shape[3], float(theta), int(start_pos))
    q, k = np.empty(q_in.shape, qkv.dtype), np.empty(k_in.shape, qkv.dtype)
    rotate_into(q_in, cos, sin, q)
    rotate_into(k_in, cos, sin, k)
    return (q, k, np.ascontiguousarray(v_in)), ()


def backward(dout, saved, qkv, *, n_heads, n_kv_heads, theta, start_pos=0):
    # (dq, dk, dv) -> dqkv (B, T, (H + 2 KV) D)
    dq, dk, dv = dout
    cos, _, neg_sin = tables(qkv.shape[1], dq.shape[3], float(theta), int(start_pos))
    dqkv = np.empty(qkv.shape, qkv.dtype)
    dq_out, dk_out, dv_out = _heads(dqkv, n_heads, n_kv_heads)
    rotate_into(dq, cos, neg_sin, dq_out)
    rotate_into(dk, cos, neg_sin, dk_out)
    dv_out[...] = dv
    return (dqkv,)
