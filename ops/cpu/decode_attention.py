"""Decoding attention with a KV cache on the CPU. See nanoeuler_ops/decode_attention.py for the math.

One thread walks the rows and their new tokens in order; each query's scores over its row of the
cache are computed, exponentiated and summed into o in the order of the keys.
"""

from functools import lru_cache

import numpy as np
from numba import njit

from nanoeuler_ops.cpu.common import REDUCE_FASTMATH, exp32
from nanoeuler_ops.decode_attention import check_shapes
from nanoeuler_ops.qkv_rope import cos_sin


@lru_cache(maxsize=8)
def _tables(S, D, theta):
    """float32 cos and sin (S, D/2) of every cache position, from the float64 tables all backends share."""
    cos, sin = cos_sin(S, D, theta, 0)
    return cos.astype(np.float32), sin.astype(np.float32)


@njit(cache=True, fastmath=REDUCE_FASTMATH)
def _forward(qkv, k_cache, v_cache, pos, cos, sin, o, q, scores):
    # qkv (B, T, H + 2KV, D), k_cache, v_cache (B, S, KV, D), pos (B,), cos, sin (S, D/2)
    # -> o (B, T, H, D); caches written at the new positions; q (H, D) and scores (S,) are scratch
    B, T, heads, D = qkv.shape
    S, KV = k_cache.shape[1], k_cache.shape[2]
    H = heads - 2 * KV
    group = H // KV
    half = D // 2
    scale = np.float32(1.0 / np.sqrt(D))
    for b in range(B):
        for t in range(T):
            p = pos[b] + t
            if p < 0 or p >= S:
                o[b, t] = 0.0
                continue
            for j in range(half):
                c, s = cos[p, j], sin[p, j]
                for h in range(H):
                    u1, u2 = qkv[b, t, h, j], qkv[b, t, h, j + half]
                    q[h, j] = u1 * c - u2 * s
                    q[h, j + half] = u2 * c + u1 * s
                for g in range(KV):
                    u1, u2 = qkv[b, t, H + g, j], qkv[b, t, H + g, j + half]
                    k_cache[b, p, g, j] = u1 * c - u2 * s
                    k_cache[b, p, g, j + half] = u2 * c + u1 * s
            for g in range(KV):
                for d in range(D):
                    v_cache[b, p, g, d] = qkv[b, t, H + KV + g, d]
            for h in range(H):
                g = h // group
                top = np.float32(-np.inf)
                for s in range(p + 1):
                    dot = np.float32(0.0)
                    for d in range(D):
                        dot += q[h, d] * k_cache[b, s, g, d]
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


def forward(qkv, k_cache, v_cache, pos, *, n_kv_heads, theta):
    check_shapes(qkv, k_cache, v_cache, pos, n_kv_heads)
    B, T, heads, D = qkv.shape
    S, H = k_cache.shape[1], heads - 2 * n_kv_heads
    cos, sin = _tables(S, D, float(theta))
    o = np.empty((B, T, H, D), dtype=qkv.dtype)
    _forward(qkv, k_cache, v_cache, pos, cos, sin, o, np.empty((H, D), dtype=qkv.dtype),
             np.empty(S, dtype=qkv.dtype))
    return o, ()
