"""Split a fused q/k/v projection into heads and rotate q and k, on the GPU, float32 or bf16
storage (float32 arithmetic): one pass each way. See nanoeuler_ops/qkv_rope.py for the math.

cos and sin come from the same float64 `cos_sin` as every backend, cast to float32 once and kept
on the GPU per (D, theta) for positions 0 .. L-1 (L doubled whenever a later position shows up),
so a call copies nothing to the GPU and a captured CUDA graph replays it as is."""

import numpy as np
from numba import cuda, uint32, uint64

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.runtime import stored, to_f32
from nanoeuler_ops.qkv_rope import check_shape, cos_sin

THREADS = 256
_tables: dict = {}   # (D, theta) -> (cos, sin), each (L, D/2) on the GPU


def rope_tables(positions: int, D: int, theta: float):
    """Device cos and sin tables (L, D/2) covering positions 0 .. positions-1 at least."""
    cached = _tables.get((D, theta))
    if cached is None or cached[0].shape[0] < positions:
        length = max(64, 1 << (positions - 1).bit_length())
        cos, sin = cos_sin(length, D, theta, 0)
        cached = cuda.to_device(cos.astype(np.float32)), cuda.to_device(sin.astype(np.float32))
        _tables[(D, theta)] = cached
    return cached


# Arrays are passed flat with their dims and indexed with unsigned integers (no negative-index
# wraparound). The grid is (rows bt = b T + t, pair blocks): one thread per rotated pair (head, j),
# j < D/2, head < H + 2 KV, found with 32-bit divisions.

@cuda.jit(device=True, inline=True)
def _pair(T, H, KV, D):
    # (row bt, head, j, t) of this thread's pair; head is H + 2 KV or more past the row's last pair
    k = uint32(cuda.blockIdx.y * THREADS + cuda.threadIdx.x)
    half = uint32(D // 2)
    bt = uint64(cuda.blockIdx.x)
    return bt, uint64(k // half), uint64(k % half), bt % uint64(T)


@cuda.jit(cache=True)
def _split(qkv, T, H, KV, D, cos, sin, start_pos, q, k, v):
    # qkv (B*T*(H + 2 KV)*D,), cos/sin (L, D/2) -> q (B*T*H*D,), k, v (B*T*KV*D,): q and k heads rotated, v copied
    bt, head, j, t = _pair(T, H, KV, D)
    if head < uint64(H + 2 * KV):
        half = uint64(D // 2)
        src = (bt * uint64(H + 2 * KV) + head) * uint64(D) + j
        u1, u2 = to_f32(qkv[src]), to_f32(qkv[src + half])
        if head < uint64(H + KV):
            c, s = cos[uint64(start_pos) + t, j], sin[uint64(start_pos) + t, j]
            u1, u2 = u1 * c - u2 * s, u2 * c + u1 * s
        if head < uint64(H):
            dst = (bt * uint64(H) + head) * uint64(D) + j
            q[dst], q[dst + half] = stored(q, u1), stored(q, u2)
        elif head < uint64(H + KV):
            dst = (bt * uint64(KV) + head - uint64(H)) * uint64(D) + j
            k[dst], k[dst + half] = stored(k, u1), stored(k, u2)
        else:
            dst = (bt * uint64(KV) + head - uint64(H + KV)) * uint64(D) + j
            v[dst], v[dst + half] = stored(v, u1), stored(v, u2)


@cuda.jit(cache=True)
def _gather(dq, dk, dv, T, H, KV, D, cos, sin, start_pos, dqkv):
    # dq (B*T*H*D,), dk, dv (B*T*KV*D,) -> dqkv (B*T*(H + 2 KV)*D,): dq and dk rotated back
    bt, head, j, t = _pair(T, H, KV, D)
    if head < uint64(H + 2 * KV):
        half = uint64(D // 2)
        if head < uint64(H):
            src = (bt * uint64(H) + head) * uint64(D) + j
            u1, u2 = to_f32(dq[src]), to_f32(dq[src + half])
        elif head < uint64(H + KV):
            src = (bt * uint64(KV) + head - uint64(H)) * uint64(D) + j
            u1, u2 = to_f32(dk[src]), to_f32(dk[src + half])
        else:
            src = (bt * uint64(KV) + head - uint64(H + KV)) * uint64(D) + j
            u1, u2 = to_f32(dv[src]), to_f32(dv[src + half])
        if head < uint64(H + KV):
            c, s = cos[uint64(start_pos) + t, j], -sin[uint64(start_pos) + t, j]
            u1, u2 = u1 * c - u2 * s, u2 * c + u1 * s
        dst = (bt * uint64(H + 2 * KV) + head) * uint64(D) + j
        dqkv[dst], dqkv[dst + half] = stored(dqkv, u1), stored(dqkv, u2)


def _flat(x):
    return x.reshape(x.size)


def forward(qkv, *, n_heads, n_kv_heads, theta, start_pos=0):
    check_shape(qkv, n_heads, n_kv_heads)
    B, T, width = qkv.shape
    D = width // (n_heads + 2 * n_kv_heads)
    cos, sin = rope_tables(start_pos + T, D, theta)
    q = runtime.empty((B, T, n_heads, D), qkv.dtype)
    k = runtime.empty((B, T, n_kv_heads, D), qkv.dtype)
    v = runtime.empty((B, T, n_kv_heads, D), qkv.dtype)
    grid = (B * T, runtime.blocks_for(width // 2, THREADS))
    runtime.launch(_split, grid, THREADS, _flat(qkv), T, n_heads, n_kv_heads, D,
                   cos, sin, start_pos, _flat(q), _flat(k), _flat(v))
    return (q, k, v), ()


def backward(dout, saved, qkv, *, n_heads, n_kv_heads, theta, start_pos=0):
    dq, dk, dv = dout
    cos, sin = rope_tables(start_pos + qkv.shape[1], dq.shape[3], theta)
    dqkv = runtime.empty(qkv.shape, qkv.dtype)
    grid = (qkv.shape[0] * qkv.shape[1], runtime.blocks_for(qkv.shape[2] // 2, THREADS))
    runtime.launch(_gather, grid, THREADS, _flat(dq), _flat(dk), _flat(dv),
                   qkv.shape[1], n_heads, n_kv_heads, dq.shape[3], cos, sin, start_pos, _flat(dqkv))
    return (dqkv,)
