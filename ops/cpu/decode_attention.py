"""Decoding attention with a KV cache on the CPU. See ops/decode_attention.py for the math.

The new tokens' keys and values go into the caches first; then each (row, token, head) query's
scores over its row of the cache are computed, exponentiated and summed into o in the order of the
keys, the same instructions whichever thread runs it. A step of a few tokens stays on one thread;
a prompt's prefill shares its queries among the threads.
"""

from functools import lru_cache

import numpy as np
from numba import njit, prange

from nanoeuler_ops.cpu import BACKEND
from nanoeuler_ops.cpu.common import REDUCE_FASTMATH, exp32
from nanoeuler_ops.decode_attention import check_shapes
from nanoeuler_ops.qkv_rope import cos_sin

# Multiply-adds (queries x cached keys x head size) from which sharing the queries among the threads
# pays for waking them
THREADED_WORK = 1 << 18


@lru_cache(maxsize=8)
def _tables(S, D, theta):
    """float32 cos and sin (S, D/2) of every cache position, from the float64 tables all backends share."""
    cos, sin = cos_sin(S, D, theta, 0)
    return cos.astype(np.float32), sin.astype(np.float32)


@njit(cache=True, fastmath=REDUCE_FASTMATH)
def _write_cache(qkv, k_cache, v_cache, b, t, p, cos, sin):
    # row b's new token t into the caches at position p: its keys rotated, its values as they are
    H = qkv.shape[2] - 2 * k_cache.shape[2]
    KV, D = k_cache.shape[2], k_cache.shape[3]
    half = D // 2
    for g in range(KV):
        for j in range(half):
            c, s = cos[p, j], sin[p, j]
            u1, u2 = qkv[b, t, H + g, j], qkv[b, t, H + g, j + half]
            k_cache[b, p, g, j] = u1 * c - u2 * s
            k_cache[b, p, g, j + half] = u2 * c + u1 * s
        for d in range(D):
            v_cache[b, p, g, d] = qkv[b, t, H + KV + g, d]


@njit(cache=True, fastmath=REDUCE_FASTMATH)
def _attend(qkv, k_cache, v_cache, b, t, h, p, cos, sin, o, q, scores):
    # o[b, t, h] = softmax over cache positions 0..p of (rotated query h) . keys, times the values;
    # q (D,) and scores (S,) are scratch
    KV, D = k_cache.shape[2], k_cache.shape[3]
    g = h // ((qkv.shape[2] - 2 * KV) // KV)
    half = D // 2
    scale = np.float32(1.0 / np.sqrt(D))
    for j in range(half):
        c, s = cos[p, j], sin[p, j]
        u1, u2 = qkv[b, t, h, j], qkv[b, t, h, j + half]
        q[j] = u1 * c - u2 * s
        q[j + half] = u2 * c + u1 * s
    top = np.float32(-np.inf)
    for s in range(p + 1):
        dot = np.float32(0.0)
        for d in range(D):
            dot += q[d] * k_cache[b, s, g, d]
        scores[s] = dot * scale
        top = max(top, scores[s])
    total = np.float32(0.0)
    for s in range(p + 1):
        scores[s] = exp32(scores[s] - top)
        total += scores[s]
    for d in range(D):
        o[b, t, h, d] = 0.0
    for s in range(p + 1):
        weight = scores[s]
        for d in range(D):
            o[b, t, h, d] += weight * v_cache[b, s, g, d]
    inv = np.float32(1.0) / total
    for d in range(D):
        o[b, t, h, d] *= inv


@njit(cache=True, fastmath=REDUCE_FASTMATH, parallel=True)
def _attend_threaded(qkv, k_cache, v_cache, pos, cos, sin, o):
    # _attend for every (row, token, head), shared among the threads
    B, T, H = o.shape[0], o.shape[1], o.shape[2]
    S, D = k_cache.shape[1], k_cache.shape[3]
    for i in prange(B * T * H):
        b, t, h = i // (T * H), i // H % T, i % H
        p = pos[b] + t
        if 0 <= p < S:
            _attend(qkv, k_cache, v_cache, b, t, h, p, cos, sin, o, np.empty(D, o.dtype), np.empty(S, o.dtype))


@njit(cache=True, fastmath=REDUCE_FASTMATH)
def _forward(qkv, k_cache, v_cache, pos, cos, sin, o, q, scores):
    # qkv (B, T, H + 2KV, D), k_cache, v_cache (B, S, KV, D), pos (B,), cos, sin (S, D/2)
    # -> o (B, T, H, D); caches written at the new positions first, then every query attends;
    # q (D,) and scores (S,) are scratch
    B, T, H = o.shape[0], o.shape[1], o.shape[2]
    S, D = k_cache.shape[1], k_cache.shape[3]
    work = 0
    for b in range(B):
        for t in range(T):
            p = pos[b] + t
            if 0 <= p < S:
                _write_cache(qkv, k_cache, v_cache, b, t, p, cos, sin)
                work += H * (p + 1) * D
            else:
                o[b, t] = 0.0
    if work >= THREADED_WORK:
        _attend_threaded(qkv, k_cache, v_cache, pos, cos, sin, o)
        return
    for b in range(B):
        for t in range(T):
            p = pos[b] + t
            if 0 <= p < S:
                for h in range(H):
                    _attend(qkv, k_cache, v_cache, b, t, h, p, cos, sin, o, q, scores)


def forward(qkv, k_cache, v_cache, pos, *, n_kv_heads, theta):
    check_shapes(qkv, k_cache, v_cache, pos, n_kv_heads)
    B, T, heads, D = qkv.shape
    S, H = k_cache.shape[1], heads - 2 * n_kv_heads
    cos, sin = _tables(S, D, float(theta))
    o = np.empty((B, T, H, D), dtype=qkv.dtype)
    BACKEND.launch(_forward, qkv, k_cache, v_cache, pos, cos, sin, o, np.empty(D, dtype=qkv.dtype),
                   np.empty(S, dtype=qkv.dtype))
    return o, ()
