"""Split a fused q/k/v projection into heads and rotate q and k, on the CPU, in one pass over the
rows each way. See ops/qkv_rope.py."""

from functools import lru_cache

import numpy as np
from numba import njit, prange

from nanoeuler_ops.qkv_rope import _heads, check_shape, cos_sin


def forward(qkv, *, n_heads, n_kv_heads, theta, start_pos=0):
    # qkv (B, T, (H + 2 KV) D) -> q (B, T, H, D), k, v (B, T, KV, D)
    check_shape(qkv, n_heads, n_kv_heads)
    q_in, k_in, v_in = _heads(qkv, n_heads, n_kv_heads)
    cos, sin, _ = tables(qkv.shape[1], q_in.shape[3], float(theta), int(start_pos))
    q, k, v = np.empty(q_in.shape, qkv.dtype), np.empty(k_in.shape, qkv.dtype), np.empty(v_in.shape, qkv.dtype)
    _rotate_heads(qkv.reshape(*qkv.shape[:2], -1, q.shape[3]), cos, sin, q, k, v, False)
    return (q, k, v), ()


def backward(dout, saved, qkv, *, n_heads, n_kv_heads, theta, start_pos=0):
    # (dq, dk, dv) -> dqkv (B, T, (H + 2 KV) D): rotated back by the negative angle
    dq, dk, dv = dout
    cos, _, neg_sin = tables(qkv.shape[1], dq.shape[3], float(theta), int(start_pos))
    dqkv = np.empty(qkv.shape, qkv.dtype)
    _rotate_heads(dqkv.reshape(*qkv.shape[:2], -1, dq.shape[3]), cos, neg_sin, dq, dk, dv, True)
    return (dqkv,)


@lru_cache(maxsize=32)
def tables(T, D, theta, start_pos):
    """float32 cos, sin and -sin (T, D/2), read-only: a training step reuses them in every layer,
    forward and backward, and building them costs more than the rotation itself."""
    cos, sin = cos_sin(T, D, theta, start_pos)
    tables = cos.astype(np.float32), sin.astype(np.float32), (-sin).astype(np.float32)
    for table in tables:
        table.flags.writeable = False
    return tables


@njit(parallel=True, cache=True)
def _rotate_heads(heads, cos, sin, q, k, v, to_heads):
    # heads (B, T, H + 2 KV, D) <-> q (B, T, H, D), k, v (B, T, KV, D): the query and key heads
    # rotated (by -sin to undo a rotation), the value heads copied; from heads into q, k, v, or
    # with to_heads from q, k, v into heads
    B, T, H, D = q.shape
    KV = k.shape[2]
    half = D // 2
    for bt in prange(B * T):
        b, t = bt // T, bt % T
        for h in range(H + 2 * KV):
            split = q[b, t, h] if h < H else k[b, t, h - H] if h < H + KV else v[b, t, h - H - KV]
            x, y = (split, heads[b, t, h]) if to_heads else (heads[b, t, h], split)
            if h < H + KV:
                for j in range(half):
                    x1, x2 = x[j], x[j + half]
                    y[j] = x1 * cos[t, j] - x2 * sin[t, j]
                    y[j + half] = x2 * cos[t, j] + x1 * sin[t, j]
            else:
                for d in range(D):
                    y[d] = x[d]
