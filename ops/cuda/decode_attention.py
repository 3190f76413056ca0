"""Decoding attention with a KV cache on the GPU (flash-decoding). See nanoeuler_ops/decode_attention.py
for the math.

Three kernels, all reading positions from `pos` in device memory (so a captured CUDA graph serves
every step):
  1. rope_append: one thread per rotated pair: RoPE of the new queries (into a scratch q) and keys
     at p = pos[b] + t, keys and values written into the cache at p.
  2. attend: one block per (query, split of SPLIT keys): each thread scores one key, the block
     takes the split's max and sum of exponentials, then each thread sums one dimension of the
     split's weighted values, keys in order.
  3. combine: one block per query: the splits' partial results rescaled to the overall max and
     added in split order.
A query at position p uses the splits 0 .. p // SPLIT: the same for every batch and step shape.
"""

import math

import numpy as np
from numba import cuda, float32, float64

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.runtime import block_reduce
from nanoeuler_ops.decode_attention import check_shapes
from nanoeuler_ops.qkv_rope import cos_sin

SPLIT = 64            # keys per block in `attend` (and its threads)
MAX_HEAD_DIM = 256    # the query is staged in shared memory
THREADS = 256         # threads per block of rope_append
_tables: dict = {}    # (S, D, theta) -> device cos, sin (S, D/2)


def _table(S: int, D: int, theta: float):
    """Device float32 cos and sin (S, D/2) from the float64 tables every backend shares; made on
    the first (eager) call, before any graph is captured."""
    key = (S, D, theta)
    if key not in _tables:
        cos, sin = cos_sin(S, D, theta, 0)
        _tables[key] = cuda.to_device(cos.astype(np.float32)), cuda.to_device(sin.astype(np.float32))
    return _tables[key]


@cuda.jit(cache=True)
def _rope_append(qkv, k_cache, v_cache, pos, cos, sin, q):
    # qkv (B, T, H + 2KV, D), caches (B, S, KV, D), pos (B,), cos, sin (S, D/2) -> q (B, T, H, D)
    # rotated; caches written at p = pos[b] + t. One thread per (b, t, head, j < D/2).
    B, T, heads, D = qkv.shape
    S, KV = k_cache.shape[1], k_cache.shape[2]
    H = heads - 2 * KV
    half = D // 2
    i = cuda.grid(1)
    if i >= B * T * heads * half:
        return
    j = i % half
    head = (i // half) % heads
    bt = i // (half * heads)
    b, t = bt // T, bt % T
    p = pos[b] + t
    if p < 0 or p >= S:
        return
    u1 = qkv[b, t, head, j]
    u2 = qkv[b, t, head, j + half]
    if head >= H + KV:                      # value head: copied
        v_cache[b, p, head - H - KV, j] = u1
        v_cache[b, p, head - H - KV, j + half] = u2
        return
    c, s = cos[p, j], sin[p, j]
    r1 = u1 * c - u2 * s
    r2 = u2 * c + u1 * s
    if head < H:
        q[b, t, head, j] = r1
        q[b, t, head, j + half] = r2
    else:
        k_cache[b, p, head - H, j] = r1
        k_cache[b, p, head - H, j + half] = r2


@cuda.jit(cache=True)
def _attend(q, k_cache, v_cache, pos, part_max, part_sum, part_o):
    # q (B, T, H, D), caches (B, S, KV, D), pos (B,) -> per (b, t, h) and split of SPLIT keys:
    # part_max, part_sum (B*T*H, n_splits), part_o (B*T*H, n_splits, D). Block (b*T*H + t*H + h, split).
    B, T, H, D = q.shape
    S, KV = k_cache.shape[1], k_cache.shape[2]
    bth = cuda.blockIdx.x
    split = cuda.blockIdx.y
    b, t, h = bth // (T * H), bth // H % T, bth % H
    p = pos[b] + t
    first = split * SPLIT
    if p < 0 or p >= S or first > p:
        return                              # the whole block leaves: no split here
    g = h // (H // KV)
    tid = cuda.threadIdx.x
    q_row = cuda.shared.array(MAX_HEAD_DIM, float32)
    weights = cuda.shared.array(SPLIT, float32)
    scratch = cuda.shared.array(32, float64)
    for d in range(tid, D, SPLIT):
        q_row[d] = q[b, t, h, d]
    cuda.syncthreads()
    key = first + tid
    score = float32(-math.inf)
    if key <= p:   # the key's row, four loads in flight at a time (D is even; the sums stay in order)
        dot = float32(0.0)
        d = 0
        while d + 3 < D:
            k0, k1, k2, k3 = k_cache[b, key, g, d], k_cache[b, key, g, d + 1], k_cache[b, key, g, d + 2], \
                k_cache[b, key, g, d + 3]
            dot += q_row[d] * k0
            dot += q_row[d + 1] * k1
            dot += q_row[d + 2] * k2
            dot += q_row[d + 3] * k3
            d += 4
        while d < D:
            dot += q_row[d] * k_cache[b, key, g, d]
            d += 1
        score = dot * (float32(1.0) / math.sqrt(float32(D)))
    top = float32(block_reduce(score, True, scratch))
    e = math.exp(score - top) if key <= p else float32(0.0)
    weights[tid] = e
    total = block_reduce(e, False, scratch)   # synchronises: weights are complete after it
    n_keys = min(SPLIT, p + 1 - first)
    for d in range(tid, D, SPLIT):   # one dimension of the weighted values, keys in order, four loads in flight
        acc = float32(0.0)
        i = 0
        while i + 3 < n_keys:
            v0, v1, v2, v3 = v_cache[b, first + i, g, d], v_cache[b, first + i + 1, g, d], \
                v_cache[b, first + i + 2, g, d], v_cache[b, first + i + 3, g, d]
            acc += weights[i] * v0
            acc += weights[i + 1] * v1
            acc += weights[i + 2] * v2
            acc += weights[i + 3] * v3
            i += 4
        while i < n_keys:
            acc += weights[i] * v_cache[b, first + i, g, d]
            i += 1
        part_o[bth, split, d] = acc
    if tid == 0:
        part_max[bth, split] = top
        part_sum[bth, split] = total


@cuda.jit(cache=True)
def _combine(part_max, part_sum, part_o, pos, S, o):
    # part_* of `attend`, pos (B,) -> o (B, T, H, D); block b*T*H + t*H + h, threads over D
    B, T, H, D = o.shape
    bth = cuda.blockIdx.x
    b, t, h = bth // (T * H), bth // H % T, bth % H
    p = pos[b] + t
    if p < 0 or p >= S:
        for d in range(cuda.threadIdx.x, D, cuda.blockDim.x):
            o[b, t, h, d] = 0.0
        return
    n_splits = p // SPLIT + 1
    top = float32(-math.inf)
    for s in range(n_splits):
        top = max(top, part_max[bth, s])
    total = float32(0.0)
    for s in range(n_splits):
        total += part_sum[bth, s] * math.exp(part_max[bth, s] - top)
    for d in range(cuda.threadIdx.x, D, cuda.blockDim.x):
        acc = float32(0.0)
        for s in range(n_splits):
            acc += part_o[bth, s, d] * math.exp(part_max[bth, s] - top)
        o[b, t, h, d] = acc / total


def forward(qkv, k_cache, v_cache, pos, *, n_kv_heads, theta):
    check_shapes(qkv, k_cache, v_cache, pos, n_kv_heads)
    B, T, heads, D = qkv.shape
    S = k_cache.shape[1]
    H = heads - 2 * n_kv_heads
    if D > MAX_HEAD_DIM:
        raise ValueError(f"decode_attention on the GPU supports head sizes up to {MAX_HEAD_DIM}, got {D}")
    cos, sin = _table(S, D, float(theta))
    q = runtime.empty((B, T, H, D), qkv.dtype)
    runtime.launch(_rope_append, runtime.blocks_for(B * T * heads * D // 2, THREADS), THREADS,
                   qkv, k_cache, v_cache, pos, cos, sin, q)
    n_splits = (S + SPLIT - 1) // SPLIT
    part_max = runtime.empty((B * T * H, n_splits), qkv.dtype)
    part_sum = runtime.empty((B * T * H, n_splits), qkv.dtype)
    part_o = runtime.empty((B * T * H, n_splits, D), qkv.dtype)
    runtime.launch(_attend, (B * T * H, n_splits), SPLIT, q, k_cache, v_cache, pos, part_max, part_sum, part_o)
    o = runtime.empty((B, T, H, D), qkv.dtype)
    runtime.launch(_combine, B * T * H, min(D, 128), part_max, part_sum, part_o, pos, S, o)
    return o, ()
