"""Decoding attention with a KV cache on the GPU (flash-decoding). See nanoeuler_ops/decode_attention.py
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
     rescaled to the overall max and added in split order.
A query at position p uses the splits 0 .. p // SPLIT, each computed in the same order whatever the
batch or the tokens fed with it: a row's output depends on the row alone.
"""

import math
from functools import cache

import numpy as np
from numba import cuda, float32

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.runtime import WARP, let_next_start, quad_sum, wait_for_previous, warp_max, warp_sum
from nanoeuler_ops.decode_attention import check_shapes
from nanoeuler_ops.qkv_rope import cos_sin

SPLIT = 32                      # keys per block
LANES = 4                       # threads per key
THREADS = SPLIT * LANES         # threads of a team (one query head at a time)
WARPS = THREADS // WARP         # warps of a team
MAX_HEADS_AT_ONCE = 4           # teams a block may have
MAX_HEAD_DIM = 256              # a split's values are staged in shared memory (32 KB at 256)
_tables: dict = {}              # (S, D, theta) -> device cos, sin (S, D/2)


def _table(S: int, D: int, theta: float):
    """Device float32 cos and sin (S, D/2) from the float64 tables every backend shares; made on
    the first (eager) call, before any graph is captured."""
    key = (S, D, theta)
    if key not in _tables:
        cos, sin = cos_sin(S, D, theta, 0)
        _tables[key] = cuda.to_device(cos.astype(np.float32)), cuda.to_device(sin.astype(np.float32))
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

    @cuda.jit(device=True, inline=True)
    def load(src, b, row, head, lane, lo, hi):
        # src (B, rows, heads, D): this thread's pairs of src[b, row, head]
        for i in range(PAIRS):
            j = lane + LANES * i
            if j < half:
                lo[i] = src[b, row, head, j]
                hi[i] = src[b, row, head, j + half]

    @cuda.jit(device=True, inline=True)
    def rotate(lo, hi, cos, sin, p, lane):
        for i in range(PAIRS):
            j = lane + LANES * i
            if j < half:
                c, s = cos[p, j], sin[p, j]
                u1, u2 = lo[i], hi[i]
                lo[i] = u1 * c - u2 * s
                hi[i] = u2 * c + u1 * s

    @cuda.jit(device=True, inline=True)
    def store(dst, b, row, head, lane, lo, hi):
        for i in range(PAIRS):
            j = lane + LANES * i
            if j < half:
                dst[b, row, head, j] = lo[i]
                dst[b, row, head, j + half] = hi[i]

    @cuda.jit(device=True, inline=True)
    def stage_queries(qkv, cos, sin, q_rows, b, t, head0, n_heads, p):
        # the queries of heads head0 .. head0 + n_heads - 1 of token (b, t), rotated at p, into q_rows
        # (the whole block)
        for i in range(cuda.threadIdx.x, n_heads * half, cuda.blockDim.x):
            hq, j = i // half, i % half
            u1, u2 = qkv[b, t, head0 + hq, j], qkv[b, t, head0 + hq, j + half]
            c, sn = cos[p, j], sin[p, j]
            q_rows[hq, j] = u1 * c - u2 * sn
            q_rows[hq, j + half] = u2 * c + u1 * sn

    @cuda.jit(cache=True)
    def attend(qkv, k_cache, v_cache, pos, cos, sin, part_max, part_sum, part_o):
        # qkv (B, T, H + 2KV, D), caches (B, S, KV, D), pos (B,), cos, sin (S, D/2)
        # -> part_max, part_sum (B*T*H, splits), part_o (B*T*H, splits, D); teams of THREADS threads
        B, T, heads, _ = qkv.shape
        S, KV = k_cache.shape[1], k_cache.shape[2]
        H = heads - 2 * KV
        G = H // KV
        item, split = cuda.blockIdx.x, cuda.blockIdx.y
        g, bt = item % KV, item // KV
        b, t = bt // T, bt % T
        first = split * SPLIT
        block_tid = cuda.threadIdx.x
        teams = cuda.blockDim.x // THREADS
        team, tid = block_tid // THREADS, block_tid % THREADS
        let_next_start()
        wait_for_previous()
        p = pos[b] + t
        if p < 0 or p >= S or first > p:       # a finished row (the cache untouched), or no split here
            return
        q_rows = cuda.shared.array((QHEADS, D), float32)
        values = cuda.shared.array((SPLIT, D), float32)
        weights = cuda.shared.array((MAX_HEADS_AT_ONCE, SPLIT), float32)
        value_parts = cuda.shared.array((MAX_HEADS_AT_ONCE, PARTS, D), float32)
        top_part = cuda.shared.array((MAX_HEADS_AT_ONCE, WARPS), float32)
        sum_part = cuda.shared.array((MAX_HEADS_AT_ONCE, WARPS), float32)
        key, lane = tid // LANES, tid % LANES
        warp, wlane = tid // WARP, tid % WARP
        s = first + key
        k_lo = cuda.local.array(PAIRS, float32)
        k_hi = cuda.local.array(PAIRS, float32)
        v_lo = cuda.local.array(PAIRS, float32)
        v_hi = cuda.local.array(PAIRS, float32)
        for i in range(PAIRS):
            k_lo[i], k_hi[i], v_lo[i], v_hi[i] = 0.0, 0.0, 0.0, 0.0
        start = pos[b]
        new_token = s <= p and s >= start     # a token of this call: read from qkv, rotated here
        if new_token:
            load(qkv, b, s - start, H + g, lane, k_lo, k_hi)
            if team == 0:
                load(qkv, b, s - start, H + KV + g, lane, v_lo, v_hi)
        elif s < start:
            load(k_cache, b, s, g, lane, k_lo, k_hi)
            if team == 0:
                load(v_cache, b, s, g, lane, v_lo, v_hi)
        # the first queries while the keys and values are on their way
        stage_queries(qkv, cos, sin, q_rows, b, t, g * G, min(QHEADS, G), p)
        if new_token:
            rotate(k_lo, k_hi, cos, sin, s, lane)
            if s == p and team == 0:          # this block's own token goes into the cache
                store(k_cache, b, p, g, lane, k_lo, k_hi)
                store(v_cache, b, p, g, lane, v_lo, v_hi)
        if team == 0:
            for i in range(PAIRS):
                j = lane + LANES * i
                if j < half:
                    values[key, j] = v_lo[i]
                    values[key, j + half] = v_hi[i]
        n_keys = min(SPLIT, p + 1 - first)
        row0 = bt * H + g * G                 # part_* row of the group's first query head
        for h0 in range(0, G, QHEADS):
            staged = min(QHEADS, G - h0)
            if h0 > 0:
                cuda.syncthreads()            # the previous heads' q_rows are read
                stage_queries(qkv, cos, sin, q_rows, b, t, g * G + h0, staged, p)
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
                        dot += q_rows[hq, j] * k_lo[i] + q_rows[hq, j + half] * k_hi[i]
                dot = quad_sum(dot)
                score = dot * scale if s <= p else float32(-math.inf)
                m = warp_max(score)
                if wlane == 0:
                    top_part[team, warp] = m
                cuda.syncthreads()
                top = top_part[team, 0]
                for w in range(1, WARPS):
                    top = max(top, top_part[team, w])
                e = math.exp(score - top) if s <= p else float32(0.0)
                total = warp_sum(e if lane == 0 else float32(0.0))
                if lane == 0:
                    weights[team, key] = e
                if wlane == 0:
                    sum_part[team, warp] = total
                cuda.syncthreads()
                row = row0 + h0 + hq
                # one dimension of the weighted values: PARTS threads add PART_KEYS keys each, in order,
                # then their sums are added in order
                for i in range(tid, PARTS * D, THREADS):
                    part, d = i // D, i % D
                    acc = float32(0.0)
                    for k in range(part * PART_KEYS, min(n_keys, (part + 1) * PART_KEYS)):
                        acc += weights[team, k] * values[k, d]
                    value_parts[team, part, d] = acc
                cuda.syncthreads()
                if mine:
                    for d in range(tid, D, THREADS):
                        acc = value_parts[team, 0, d]
                        for part in range(1, PARTS):
                            acc += value_parts[team, part, d]
                        part_o[row, split, d] = acc
                    if tid == 0:
                        total = sum_part[team, 0]
                        for w in range(1, WARPS):
                            total += sum_part[team, w]
                        part_max[row, split] = top
                        part_sum[row, split] = total
                cuda.syncthreads()            # weights and the partial sums are read

    @cuda.jit(cache=True)
    def combine(part_max, part_sum, part_o, pos, S, KV, o):
        # part_* of `attend`, pos (B,) -> o (B, T, H, D); block (b * T + t) * KV + g: the group's heads
        B, T, H, _ = o.shape
        G = H // KV
        item = cuda.blockIdx.x
        g, bt = item % KV, item // KV
        b, t = bt // T, bt % T
        tid = cuda.threadIdx.x
        let_next_start()
        wait_for_previous()
        p = pos[b] + t
        n_splits = p // SPLIT + 1
        maxes = cuda.local.array(CHUNK, float32)
        sums = cuda.local.array(CHUNK, float32)
        outs = cuda.local.array(CHUNK, float32)
        for i in range(tid, G * D, cuda.blockDim.x):   # a thread per output where the block holds them
            hq, d = i // D, i % D
            if p < 0 or p >= S:                   # a finished row: o is 0
                o[b, t, g * G + hq, d] = 0.0
                continue
            row = bt * H + g * G + hq
            top = float32(-math.inf)
            for sp0 in range(0, n_splits, CHUNK):     # CHUNK splits' loads in flight at once
                for u in range(CHUNK):
                    maxes[u] = part_max[row, sp0 + u] if sp0 + u < n_splits else float32(-math.inf)
                for u in range(CHUNK):
                    top = max(top, maxes[u])
            total = float32(0.0)
            acc = float32(0.0)
            for sp0 in range(0, n_splits, CHUNK):
                for u in range(CHUNK):
                    if sp0 + u < n_splits:
                        maxes[u], sums[u], outs[u] = part_max[row, sp0 + u], part_sum[row, sp0 + u], \
                            part_o[row, sp0 + u, d]
                for u in range(CHUNK):
                    if sp0 + u < n_splits:
                        rescale = math.exp(maxes[u] - top)
                        total += sums[u] * rescale
                        acc += outs[u] * rescale
            o[b, t, g * G + hq, d] = acc / total

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
    part_max = runtime.empty((B * T * H, n_splits), np.float32)
    part_sum = runtime.empty((B * T * H, n_splits), np.float32)
    part_o = runtime.empty((B * T * H, n_splits, D), np.float32)
    o = runtime.empty((B, T, H, D), qkv.dtype)
    attend, combine = _kernels(D)
    teams = min(MAX_HEADS_AT_ONCE, H // KV)
    runtime.launch(attend, (B * T * KV, n_splits), teams * THREADS, qkv, k_cache, v_cache, pos, cos, sin, part_max,
                   part_sum, part_o, overlap=True)
    combine_threads = min(1024, -(-(H // KV) * D // WARP) * WARP)
    runtime.launch(combine, B * T * KV, combine_threads, part_max, part_sum, part_o, pos, S, KV, o, overlap=True)
    return o, ()
