"""Split a fused q/k/v projection into heads and rotate q and k, on the GPU, float32 or bf16
storage (float32 arithmetic): one pass each way. See ops/qkv_rope.py for the math.

cos and sin come from the same float64 `cos_sin` as every backend, cast to float32 once and kept
on the GPU per (D, theta) for positions 0 .. L-1 (L doubled whenever a later position shows up),
so a call copies nothing to the GPU and a captured CUDA graph replays it as is."""

import numpy as np
from numba import cuda, float32, uint32, uint64

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.device import WARP, stored, to_f32
from nanoeuler_ops.qkv_rope import check_shape, cos_sin

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
# wraparound; a uint64 meeting an int64 would make a float). The grid is (rows bt = b T + t, pair
# blocks). A row's rotated pairs (head, j), j < D/2, are numbered head * D/2 + j; thread i of pair
# block c takes the pairs c * n * PAIRS + i + p * n, p < PAIRS, n threads a block, and asks for all
# their inputs (and angles) before it computes or stores anything: a thread with one bf16 pair had
# 4 bytes in flight at a time, too few to keep the memory busy.
PAIRS = 4   # rotated pairs a thread takes


@cuda.jit(device=True, inline=True)
def _pair(p, half):
    # (head, j) of this thread's pair p (a head of H + 2 KV or more: none)
    n = uint32(cuda.blockDim.x)
    k = uint32(uint32(cuda.blockIdx.y) * n * uint32(PAIRS) + uint32(cuda.threadIdx.x) + uint32(p) * n)
    return k // half, k % half   # 32-bit: Numba's products of uint32 are 64-bit, and so their division


@cuda.jit(device=True, inline=True)
def _row(T, H, KV, D, start_pos):
    # the sizes in 32 bits, half of D, the heads of a row of qkv, and the block's row bt and position
    H, KV, D = uint32(H), uint32(KV), uint32(D)
    bt = uint32(cuda.blockIdx.x)
    return H, KV, D, D // uint32(2), H + uint32(2) * KV, uint64(bt), uint64(start_pos) + uint64(bt % uint32(T))


@cuda.jit(device=True, inline=True)
def _rotated_pair(pairs, p, half, rotated_heads):
    # (head, j) of this thread's pair p and its halves, rotated by its angle in a head below rotated_heads
    head, j = _pair(p, half)
    u1, u2, c, s = pairs[0, p], pairs[1, p], pairs[2, p], pairs[3, p]
    if head < rotated_heads:
        return head, j, u1 * c - u2 * s, u2 * c + u1 * s
    return head, j, u1, u2


@cuda.jit(cache=True)
def _split(qkv, T, H, KV, D, cos, sin, start_pos, q, k, v):
    # qkv (B*T*(H + 2 KV)*D,), cos/sin (L, D/2) -> q (B*T*H*D,), k, v (B*T*KV*D,): q and k heads rotated, v copied
    H, KV, D, half, heads, row, position = _row(T, H, KV, D, start_pos)
    pairs = cuda.local.array((4, PAIRS), float32)   # each pair's halves u1, u2 and its angle's cos, sin
    for p in range(PAIRS):
        head, j = _pair(p, half)
        if head < heads:
            src = row * uint64(heads * D) + uint64(head * D + j)
            pairs[0, p], pairs[1, p] = to_f32(qkv[src]), to_f32(qkv[src + uint64(half)])
            pairs[2, p], pairs[3, p] = cos[position, uint64(j)], sin[position, uint64(j)]
    for p in range(PAIRS):
        head, j, u1, u2 = _rotated_pair(pairs, p, half, H + KV)
        if head < H:
            dst = row * uint64(H * D) + uint64(head * D + j)
            q[dst], q[dst + uint64(half)] = stored(q, u1), stored(q, u2)
        elif head < H + KV:
            dst = row * uint64(KV * D) + uint64((head - H) * D + j)
            k[dst], k[dst + uint64(half)] = stored(k, u1), stored(k, u2)
        elif head < heads:
            dst = row * uint64(KV * D) + uint64((head - H - KV) * D + j)
            v[dst], v[dst + uint64(half)] = stored(v, u1), stored(v, u2)


@cuda.jit(cache=True)
def _gather(dq, dk, dv, T, H, KV, D, cos, sin, start_pos, dqkv):
    # dq (B*T*H*D,), dk, dv (B*T*KV*D,) -> dqkv (B*T*(H + 2 KV)*D,): dq and dk rotated back
    H, KV, D, half, heads, row, position = _row(T, H, KV, D, start_pos)
    pairs = cuda.local.array((4, PAIRS), float32)   # each pair's halves u1, u2 and its angle's cos, sin
    for p in range(PAIRS):
        head, j = _pair(p, half)
        if head < H:
            src = row * uint64(H * D) + uint64(head * D + j)
            pairs[0, p], pairs[1, p] = to_f32(dq[src]), to_f32(dq[src + uint64(half)])
        elif head < H + KV:
            src = row * uint64(KV * D) + uint64((head - H) * D + j)
            pairs[0, p], pairs[1, p] = to_f32(dk[src]), to_f32(dk[src + uint64(half)])
        elif head < heads:
            src = row * uint64(KV * D) + uint64((head - H - KV) * D + j)
            pairs[0, p], pairs[1, p] = to_f32(dv[src]), to_f32(dv[src + uint64(half)])
        if head < heads:
            pairs[2, p], pairs[3, p] = cos[position, uint64(j)], -sin[position, uint64(j)]
    for p in range(PAIRS):
        head, j, u1, u2 = _rotated_pair(pairs, p, half, H + KV)
        if head < heads:
            dst = row * uint64(heads * D) + uint64(head * D + j)
            dqkv[dst], dqkv[dst + uint64(half)] = stored(dqkv, u1), stored(dqkv, u2)


def _launch(kernel, B, T, pairs_in_row, *args):
    """kernel over B*T rows of pairs_in_row rotated pairs: the fewest threads a block (whole warps, at
    most 1,024) that take a row's pairs PAIRS each, and more pair blocks where a row needs them."""
    threads = min(1024, -(-pairs_in_row // (PAIRS * WARP)) * WARP)
    runtime.launch(kernel, (B * T, runtime.blocks_for(pairs_in_row, threads * PAIRS)), threads, *args)


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
    _launch(_split, B, T, width // 2, _flat(qkv), T, n_heads, n_kv_heads, D, cos, sin, start_pos,
            _flat(q), _flat(k), _flat(v))
    return (q, k, v), ()


def backward(dout, saved, qkv, *, n_heads, n_kv_heads, theta, start_pos=0):
    dq, dk, dv = dout
    cos, sin = rope_tables(start_pos + qkv.shape[1], dq.shape[3], theta)
    dqkv = runtime.empty(qkv.shape, qkv.dtype)
    B, T, width = qkv.shape
    _launch(_gather, B, T, width // 2, _flat(dq), _flat(dk), _flat(dv), T, n_heads, n_kv_heads, dq.shape[3],
            cos, sin, start_pos, _flat(dqkv))
    return (dqkv,)
