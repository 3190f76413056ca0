"""Decoding attention with a KV cache on the GPU (flash-decoding). See ops/decode_attention.py
for the math.

Two kernels, both reading positions from `pos` in device memory (so a captured CUDA graph serves
every step), each launched to overlap the kernel ahead of it (runtime.launch's overlap):
  1. attend: block (item, split), item = (b, t, key/value head g), covers the SPLIT keys
     split * SPLIT .. of the query at p = pos[b] + t, for every query head of g's group. The block
     is up to MAX_HEADS_AT_ONCE teams of THREADS threads, team i taking the group's query heads
     i, i + teams, ...: the heads' softmax and weighted sums, each a chain of barriers and
     reductions, run side by side rather than one after another.
       - in each team four threads share a key (quad_sum adds their parts of a dot product); thread
         `lane` of the four holds the rotation pairs (j, j + D/2), j = lane, lane + 4, ... of the
         key and the value, so RoPE never crosses threads (every team holds the split's keys);
       - a key of this call (position >= pos[b]) is read from qkv and rotated in the block: no block
         waits for another to write it. The block whose split holds p writes the key and value of
         its own token into the cache; no block of this call reads the cache there;
       - per query head: scores, the split's max and sum of exponentials (fixed trees), and the
         weighted values (PARTS threads per dimension, each adding a run of keys in order), into
         part_*.
  2. combine: block item, a thread per output of its heads (1,024 at most): each head's splits
     rescaled to the overall max and added in split order (CHUNK splits' results loaded at once).
A query at position p uses the splits 0 .. p // SPLIT, each computed in the same order whatever the
batch or the tokens fed with it: a row's output depends on the row alone.
"""

import math
from functools import cache

import numpy as np
from numba import cuda, float32, uint32 as u32, uint64 as u64

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.device import WARP, let_next_start, quad_sum, wait_for_previous, warp_max, warp_sum
from nanoeuler_ops.decode_attention import check_shapes
from nanoeuler_ops.qkv_rope import cos_sin

SPLIT = 32                      # keys per block
LANES = 4                       # threads per key
THREADS = SPLIT * LANES         # threads of a team (one query head at a time)
WARPS = THREADS // WARP         # warps of a team
MAX_HEADS_AT_ONCE = 4           # teams a block may have
MAX_HEAD_DIM = 256              # a split's values are staged in shared memory (32 KB at 256)
_tables: dict = {}              # (S, D, theta) -> device cos, sin (S, D/2), flat


def _table(S: int, D: int, theta: float):
    """Device float32 cos and sin (S, D/2), flat, from the float64 tables every backend shares; made
    on the first (eager) call, before any graph is captured."""
    key = (S, D, theta)
    if key not in _tables:
        cos, sin = cos_sin(S, D, theta, 0)
        _tables[key] = tuple(cuda.to_device(np.ascontiguousarray(a, np.float32).ravel()) for a in (cos, sin))
    return _tables[key]


@cache
def _kernels(D: int):
    """The kernels for head size D (the per-thread register arrays are unrolled over D)."""
    half = D // 2
    PAIRS = -(-half // LANES)                 # rotation pairs per thread
    QHEADS = max(1, 2048 // D)                # query heads staged in shared memory at once
    PARTS = max(1, THREADS // D)              # threads sharing a dimension of the weighted values
    PART_KEYS = SPLIT // PARTS                # keys each of them adds
    CHUNK = 8                                 # splits' results loaded together when adding them up
    scale = float32(1.0 / math.sqrt(D))
    # the sizes of the flat shared arrays (Numba needs each as one constant)
    Q_SIZE, VALUES_SIZE, WEIGHTS_SIZE = QHEADS * D, SPLIT * D, MAX_HEADS_AT_ONCE * SPLIT
    PARTS_SIZE, REDUCE_SIZE = MAX_HEADS_AT_ONCE * PARTS * D, MAX_HEADS_AT_ONCE * WARPS

    # Arrays are read flat, at unsigned indices: Numba then emits no negative-index wraparound, which
    # was most of this kernel's instructions (each a step of a thread's chain: the kernel is bound by
    # the latency of those chains, not by memory).

    @cuda.jit(device=True, inline=True)
    def load(src, base, lane, lo, hi):
        # this thread's rotation pairs of the D-vector at src[base:base + D] (src flat)
        for i in range(PAIRS):
            j = lane + LANES * i
            if j < half:
                lo[i] = src[u64(base + j)]
                hi[i] = src[u64(base + j + half)]

    @cuda.jit(device=True, inline=True)
    def rotate(lo, hi, cos, sin, p, lane):
        for i in range(PAIRS):
            j = lane + LANES * i
            if j < half:
                c, s = cos[u64(p * half + j)], sin[u64(p * half + j)]
                u1, u2 = lo[i], hi[i]
                lo[i] = u1 * c - u2 * s
                hi[i] = u2 * c + u1 * s

    @cuda.jit(device=True, inline=True)
    def store(dst, base, lane, lo, hi):
        for i in range(PAIRS):
            j = lane + LANES * i
            if j < half:
                dst[u64(base + j)] = lo[i]
                dst[u64(base + j + half)] = hi[i]

    @cuda.jit(device=True, inline=True)
    def stage_queries(qkv, cos, sin, q_rows, base, n_heads, p):
        # the n_heads query vectors at qkv[base:] (flat), rotated at p, into q_rows (the whole block)
        for i in range(cuda.threadIdx.x, n_heads * half, cuda.blockDim.x):
            hq, j = u32(i) // u32(half), u32(i) % u32(half)
            at = base + hq * D + j
            u1, u2 = qkv[u64(at)], qkv[u64(at + half)]
            c, sn = cos[u64(p * half + j)], sin[u64(p * half + j)]
            q_rows[u64(hq * D + j)] = u1 * c - u2 * sn
            q_rows[u64(hq * D + j + half)] = u2 * c + u1 * sn

    @cuda.jit(cache=True)
    def attend(qkv, k_cache, v_cache, B, T, S, H, KV, pos, cos, sin, part_max, part_sum, part_o):
        # qkv (B, T, H + 2KV, D), caches (B, S, KV, D), cos, sin (S, D/2), part_max, part_sum (B*T*H,
        # splits), part_o (B*T*H, splits, D), all flat; pos (B,); teams of THREADS threads
        G = H // KV
        heads = H + 2 * KV
        n_splits = (S + SPLIT - 1) // SPLIT
        item, split = u32(cuda.blockIdx.x), u32(cuda.blockIdx.y)
        g, bt = item % u32(KV), item // u32(KV)
        b, t = bt // u32(T), bt % u32(T)
        first = split * SPLIT
        block_tid = u32(cuda.threadIdx.x)
        teams = u32(cuda.blockDim.x) // u32(THREADS)
        team, tid = block_tid // u32(THREADS), block_tid % u32(THREADS)
        let_next_start()
        wait_for_previous()
        p = pos[u64(b)] + t
        if p < 0 or p >= S or first > p:       # a finished row (the cache untouched), or no split here
            return
        q_rows = cuda.shared.array(Q_SIZE, float32)             # [head, d]
        values = cuda.shared.array(VALUES_SIZE, float32)        # [key, d]
        weights = cuda.shared.array(WEIGHTS_SIZE, float32)      # [team, key]
        value_parts = cuda.shared.array(PARTS_SIZE, float32)    # [team, part, d]
        top_part = cuda.shared.array(REDUCE_SIZE, float32)      # [team, warp]
        sum_part = cuda.shared.array(REDUCE_SIZE, float32)
        key, lane = tid // u32(LANES), tid % u32(LANES)
        warp, wlane = tid // u32(WARP), tid % u32(WARP)
        s = first + key
        k_lo = cuda.local.array(PAIRS, float32)
        k_hi = cuda.local.array(PAIRS, float32)
        v_lo = cuda.local.array(PAIRS, float32)
        v_hi = cuda.local.array(PAIRS, float32)
        for i in range(PAIRS):
            k_lo[i], k_hi[i], v_lo[i], v_hi[i] = 0.0, 0.0, 0.0, 0.0
        start = pos[u64(b)]
        new_token = s <= p and s >= start     # a token of this call: read from qkv, rotated here
        token_row = (b * T + s - start) * heads   # qkv's row of that token, its first head
        cache_row = ((b * S + s) * KV + g) * D    # the caches' row of key s
        if new_token:
            load(qkv, (token_row + H + g) * D, lane, k_lo, k_hi)
            if team == 0:
                load(qkv, (token_row + H + KV + g) * D, lane, v_lo, v_hi)
        elif s < start:
            load(k_cache, cache_row, lane, k_lo, k_hi)
            if team == 0:
                load(v_cache, cache_row, lane, v_lo, v_hi)
        # the first queries while the keys and values are on their way
        query_base = (bt * heads + g * G) * D
        stage_queries(qkv, cos, sin, q_rows, query_base, min(QHEADS, G), p)
        if new_token:
            rotate(k_lo, k_hi, cos, sin, s, lane)
            if s == p and team == 0:          # this block's own token goes into the cache
                store(k_cache, cache_row, lane, k_lo, k_hi)
                store(v_cache, cache_row, lane, v_lo, v_hi)
        if team == 0:
            for i in range(PAIRS):
                j = lane + LANES * i
                if j < half:
                    values[u64(key * D + j)] = v_lo[i]
                    values[u64(key * D + j + half)] = v_hi[i]
        n_keys = min(SPLIT, p + 1 - first)
        row0 = bt * H + g * G                 # part_* row of the group's first query head
        for h0 in range(0, G, QHEADS):
            staged = min(QHEADS, G - h0)
            if h0 > 0:
                cuda.syncthreads()            # the previous heads' q_rows are read
                stage_queries(qkv, cos, sin, q_rows, query_base + h0 * D, staged, p)
            cuda.syncthreads()
            for first_head in range(0, staged, teams):
                # every team runs every barrier and reduction; a team past the last head computes head
                # 0 again and writes nothing
                hq = first_head + team
                mine = hq < staged
                if not mine:
                    hq = 0
                dot = float32(0.0)
                for i in range(PAIRS):
                    j = lane + LANES * i
                    if j < half:
                        dot += q_rows[u64(hq * D + j)] * k_lo[i] + q_rows[u64(hq * D + j + half)] * k_hi[i]
                dot = quad_sum(dot)
                score = dot * scale if s <= p else float32(-math.inf)
                m = warp_max(score)
                if wlane == 0:
                    top_part[u64(team * WARPS + warp)] = m
                cuda.syncthreads()
                top = top_part[u64(team * WARPS)]
                for w in range(1, WARPS):
                    top = max(top, top_part[u64(team * WARPS + w)])
                e = math.exp(score - top) if s <= p else float32(0.0)
                total = warp_sum(e if lane == 0 else float32(0.0))
                if lane == 0:
                    weights[u64(team * SPLIT + key)] = e
                if wlane == 0:
                    sum_part[u64(team * WARPS + warp)] = total
                cuda.syncthreads()
                row = row0 + h0 + hq
                # one dimension of the weighted values: PARTS threads add PART_KEYS keys each, in order,
                # then their sums are added in order
                for i in range(tid, PARTS * D, THREADS):
                    part, d = u32(i) // u32(D), u32(i) % u32(D)
                    acc = float32(0.0)
                    for k in range(part * PART_KEYS, min(n_keys, (part + 1) * PART_KEYS)):
                        acc += weights[u64(team * SPLIT + k)] * values[u64(k * D + d)]
                    value_parts[u64((team * PARTS + part) * D + d)] = acc
                cuda.syncthreads()
                if mine:
                    for d in range(tid, D, THREADS):
                        acc = value_parts[u64(team * PARTS * D + d)]
                        for part in range(1, PARTS):
                            acc += value_parts[u64((team * PARTS + part) * D + d)]
                        part_o[u64((row * n_splits + split) * D + d)] = acc
                    if tid == 0:
                        total = sum_part[u64(team * WARPS)]
                        for w in range(1, WARPS):
                            total += sum_part[u64(team * WARPS + w)]
                        part_max[u64(row * n_splits + split)] = top
                        part_sum[u64(row * n_splits + split)] = total
                cuda.syncthreads()            # weights and the partial sums are read

    @cuda.jit(cache=True)
    def combine(part_max, part_sum, part_o, pos, T, S, H, KV, o):
        # part_* of `attend`, pos (B,) -> o (B, T, H, D), all but pos flat; block (b * T + t) * KV + g:
        # the group's heads
        G = H // KV
        stride = (S + SPLIT - 1) // SPLIT           # part_*'s splits a row
        item = u32(cuda.blockIdx.x)
        g, bt = item % u32(KV), item // u32(KV)
        b, t = bt // u32(T), bt % u32(T)
        tid = u32(cuda.threadIdx.x)
        let_next_start()
        wait_for_previous()
        p = pos[u64(b)] + t
        n_splits = p // SPLIT + 1
        maxes = cuda.local.array(CHUNK, float32)
        sums = cuda.local.array(CHUNK, float32)
        outs = cuda.local.array(CHUNK, float32)
        for i in range(tid, G * D, cuda.blockDim.x):   # a thread per output where the block holds them
            hq, d = u32(i) // u32(D), u32(i) % u32(D)
            row = bt * H + g * G + hq
            if p < 0 or p >= S:                   # a finished row: o is 0
                o[u64(row * D + d)] = 0.0
                continue
            # CHUNK splits' loads in flight at once; what was added before a chunk with a larger max is
            # rescaled to it (a row of at most CHUNK splits: one trip to memory, nothing rescaled)
            top = float32(-math.inf)
            total = float32(0.0)
            acc = float32(0.0)
            for sp0 in range(0, n_splits, CHUNK):
                for u in range(CHUNK):
                    at = row * stride + min(sp0 + u, n_splits - 1)
                    maxes[u], sums[u], outs[u] = part_max[u64(at)], part_sum[u64(at)], part_o[u64(at * D + d)]
                chunk_top = top
                for u in range(CHUNK):
                    if sp0 + u < n_splits:
                        chunk_top = max(chunk_top, maxes[u])
                if chunk_top > top:
                    rescale = math.exp(top - chunk_top)
                    total *= rescale
                    acc *= rescale
                    top = chunk_top
                for u in range(CHUNK):
                    if sp0 + u < n_splits:
                        rescale = math.exp(maxes[u] - top)
                        total += sums[u] * rescale
                        acc += outs[u] * rescale
            o[u64(row * D + d)] = acc / total

    return attend, combine


def forward(qkv, k_cache, v_cache, pos, *, n_kv_heads, theta):
    check_shapes(qkv, k_cache, v_cache, pos, n_kv_heads)
    B, T, heads, D = qkv.shape
    S = k_cache.shape[1]
    KV = n_kv_heads
    H = heads - 2 * KV
    if D > MAX_HEAD_DIM:
        raise ValueError(f"decode_attention on the GPU supports head sizes up to {MAX_HEAD_DIM}, got {D}")
    cos, sin = _table(S, D, float(theta))
    n_splits = (S + SPLIT - 1) // SPLIT
    # the splits' results, flat as the kernels read them: (B*T*H, splits) and (B*T*H, splits, D)
    part_max = runtime.empty((B * T * H * n_splits,), np.float32)
    part_sum = runtime.empty((B * T * H * n_splits,), np.float32)
    part_o = runtime.empty((B * T * H * n_splits * D,), np.float32)
    o = runtime.empty((B * T * H * D,), qkv.dtype)
    attend, combine = _kernels(D)
    teams = min(MAX_HEADS_AT_ONCE, H // KV)
    flat_caches = k_cache.reshape(k_cache.size), v_cache.reshape(v_cache.size)
    runtime.launch(attend, (B * T * KV, n_splits), teams * THREADS, qkv.reshape(qkv.size), *flat_caches, B, T, S, H, KV,
                   pos, cos, sin, part_max, part_sum, part_o, overlap=True)
    combine_threads = min(1024, -(-(H // KV) * D // WARP) * WARP)
    runtime.launch(combine, B * T * KV, combine_threads, part_max, part_sum, part_o, pos, T, S, H, KV, o, overlap=True)
    return o.reshape((B, T, H, D)), ()
