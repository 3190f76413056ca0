"""Split a fused q/k/v projection into heads and rotate q and k, on the CPU. See nanoeuler_ops/qkv_rope.py."""

import numpy as np

from nanoeuler_ops.cpu.rope import rotate_into, tables
from nanoeuler_ops.qkv_rope import _heads, check_shape


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
