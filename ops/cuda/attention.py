"""FlashAttention forward and backward on the GPU. See nanoeuler_ops/attention.py for the math.

No (T, S) matrix is ever stored: keys and values stream through shared memory in tiles, and
each query row keeps a running max, sum and output (the online softmax). Tiles wholly in a
block's causal future are never loaded. Query head h reads key/value head h // (H // KV) in
place: repeated K/V are never materialised.

Kernels, one thread per query row (forward, dq) or per key row (dk, dv):
  _forward   block = BQ query rows of one (b, h); writes o and lse.
  _row_dot   Di = rowsum(do * o), the FlashAttention-2 backward's correction term.
  _dq        block = BQ query rows of one (b, h); P recomputed from lse.
  _dkdv      block = BK key rows of one (b, kv head), looping over every query head of its group,
             so the group's gradients add up in registers: no atomics, no races.
The head size D is a compile-time constant (per-thread accumulators live in registers), so
each D gets its own compiled kernels.
"""

import math
from functools import cache

from numba import cuda, float32

from nanoeuler_ops.attention import check_shapes
from nanoeuler_ops.cuda import runtime

BQ = 64          # query rows per block (forward, dq)
BK = 32          # keys per shared-memory tile (forward)
BK_DQ = 16       # keys per tile (dq: its q and do rows also sit in shared memory)
BK_DKDV = 64     # key rows per block (dk, dv)
BQ_DKDV = 16     # query rows per shared-memory tile (dk, dv)


@cache
def _kernels(D: int):
    """The four attention kernels compiled for head size D."""
    DP = D + 1   # padded shared row: threads reading one row each hit distinct banks

    @cuda.jit(fastmath=True)
    def forward(q, k, v, scale, o, lse):
        # q (B, T, H, D), k, v (B, S, KV, D) -> o (B, T, H, D), lse (B, H, T);
        # grid (T / BQ, B * H), one thread per query row
        B, T, H, _ = q.shape
        S, KV = k.shape[1], k.shape[2]
        b, h = cuda.blockIdx.y // H, cuda.blockIdx.y % H
        kv = h // (H // KV)
        tid = cuda.threadIdx.x
        t0 = cuda.blockIdx.x * BQ
        t = t0 + tid
        k_tile = cuda.shared.array((BK, D), float32)
        v_tile = cuda.shared.array((BK, D), float32)
        q_row = cuda.local.array(D, float32)
        acc = cuda.local.array(D, float32)
        scores = cuda.local.array(BK, float32)
        for d in range(D):
            q_row[d] = q[b, t, h, d] * scale if t < T else float32(0.0)
            acc[d] = 0.0
        row_max = float32(-math.inf)
        row_sum = float32(0.0)
        last_key = (S - T) + t                              # this row's newest visible key
        keys_end = min(S, (S - T) + t0 + BQ)                # the block's newest visible key + 1
        for s0 in range(0, keys_end, BK):
            cuda.syncthreads()
            for i in range(tid, BK * D, BQ):
                s, d = s0 + i // D, i % D
                k_tile[i // D, d] = k[b, s, kv, d] if s < S else float32(0.0)
                v_tile[i // D, d] = v[b, s, kv, d] if s < S else float32(0.0)
            cuda.syncthreads()
            tile_max = float32(-math.inf)
            for j in range(BK):
                score = float32(0.0)
                for d in range(D):
                    score += q_row[d] * k_tile[j, d]
                if s0 + j > last_key:
                    score = float32(-math.inf)
                scores[j] = score
                tile_max = max(tile_max, score)
            if tile_max > -math.inf:
                new_max = max(row_max, tile_max)
                rescale = math.exp(row_max - new_max)
                row_sum *= rescale
                for d in range(D):
                    acc[d] *= rescale
                for j in range(BK):
                    p = math.exp(scores[j] - new_max)
                    row_sum += p
                    for d in range(D):
                        acc[d] += p * v_tile[j, d]
                row_max = new_max
        if t < T:
            inv_sum = float32(1.0) / row_sum
            for d in range(D):
                o[b, t, h, d] = acc[d] * inv_sum
            lse[b, h, t] = row_max + math.log(row_sum)

    @cuda.jit(fastmath=True)
    def row_dot(do, o, di):
        # do, o (B, T, H, D) -> di (B, H, T) = sum_d do * o; one thread per (b, h, t)
        B, T, H, _ = o.shape
        i = cuda.grid(1)
        if i < B * H * T:
            b, h, t = i // (H * T), (i // T) % H, i % T
            total = float32(0.0)
            for d in range(D):
                total += do[b, t, h, d] * o[b, t, h, d]
            di[b, h, t] = total

    @cuda.jit(fastmath=True)
    def dq_kernel(do, q, k, v, lse, di, scale, dq):
        # do, q (B, T, H, D), k, v (B, S, KV, D), lse, di (B, H, T) -> dq (B, T, H, D);
        # grid (T / BQ, B * H), one thread per query row
        B, T, H, _ = q.shape
        S, KV = k.shape[1], k.shape[2]
        b, h = cuda.blockIdx.y // H, cuda.blockIdx.y % H
        kv = h // (H // KV)
        tid = cuda.threadIdx.x
        t0 = cuda.blockIdx.x * BQ
        t = t0 + tid
        q_rows = cuda.shared.array((BQ, DP), float32)
        do_rows = cuda.shared.array((BQ, DP), float32)
        k_tile = cuda.shared.array((BK_DQ, D), float32)
        v_tile = cuda.shared.array((BK_DQ, D), float32)
        acc = cuda.local.array(D, float32)
        for i in range(tid, BQ * D, BQ):
            r, d = i // D, i % D
            inside = t0 + r < T
            q_rows[r, d] = q[b, t0 + r, h, d] * scale if inside else float32(0.0)
            do_rows[r, d] = do[b, t0 + r, h, d] if inside else float32(0.0)
        for d in range(D):
            acc[d] = 0.0
        row_lse = lse[b, h, t] if t < T else float32(0.0)
        row_di = di[b, h, t] if t < T else float32(0.0)
        last_key = (S - T) + t
        keys_end = min(S, (S - T) + t0 + BQ)
        for s0 in range(0, keys_end, BK_DQ):
            cuda.syncthreads()
            for i in range(tid, BK_DQ * D, BQ):
                s, d = s0 + i // D, i % D
                k_tile[i // D, d] = k[b, s, kv, d] if s < S else float32(0.0)
                v_tile[i // D, d] = v[b, s, kv, d] if s < S else float32(0.0)
            cuda.syncthreads()
            for j in range(BK_DQ):
                if s0 + j <= last_key:
                    score = float32(0.0)
                    dp = float32(0.0)
                    for d in range(D):
                        score += q_rows[tid, d] * k_tile[j, d]
                        dp += do_rows[tid, d] * v_tile[j, d]
                    ds = math.exp(score - row_lse) * (dp - row_di)
                    for d in range(D):
                        acc[d] += ds * k_tile[j, d]
        if t < T:
            for d in range(D):
                dq[b, t, h, d] = acc[d] * scale

    @cuda.jit(fastmath=True)
    def dkdv_kernel(do, q, k, v, lse, di, scale, dk, dv):
        # do, q (B, T, H, D), k, v (B, S, KV, D), lse, di (B, H, T) -> dk, dv (B, S, KV, D);
        # grid (S / BK_DKDV, B * KV), one thread per key row, looping over the group's query heads
        B, T, H, _ = q.shape
        S, KV = k.shape[1], k.shape[2]
        group = H // KV
        b, kv = cuda.blockIdx.y // KV, cuda.blockIdx.y % KV
        tid = cuda.threadIdx.x
        s0 = cuda.blockIdx.x * BK_DKDV
        s = s0 + tid
        k_rows = cuda.shared.array((BK_DKDV, DP), float32)
        v_rows = cuda.shared.array((BK_DKDV, DP), float32)
        q_tile = cuda.shared.array((BQ_DKDV, D), float32)
        do_tile = cuda.shared.array((BQ_DKDV, D), float32)
        lse_tile = cuda.shared.array(BQ_DKDV, float32)
        di_tile = cuda.shared.array(BQ_DKDV, float32)
        dk_acc = cuda.local.array(D, float32)
        dv_acc = cuda.local.array(D, float32)
        for i in range(tid, BK_DKDV * D, BK_DKDV):
            r, d = i // D, i % D
            inside = s0 + r < S
            k_rows[r, d] = k[b, s0 + r, kv, d] if inside else float32(0.0)
            v_rows[r, d] = v[b, s0 + r, kv, d] if inside else float32(0.0)
        for d in range(D):
            dk_acc[d] = 0.0
            dv_acc[d] = 0.0
        first_query = max(0, s0 - (S - T))   # earlier queries see none of this block's keys
        for h in range(kv * group, (kv + 1) * group):
            for t0 in range(first_query, T, BQ_DKDV):
                cuda.syncthreads()
                for i in range(tid, BQ_DKDV * D, BK_DKDV):
                    t, d = t0 + i // D, i % D
                    q_tile[i // D, d] = q[b, t, h, d] * scale if t < T else float32(0.0)
                    do_tile[i // D, d] = do[b, t, h, d] if t < T else float32(0.0)
                if tid < BQ_DKDV:
                    inside = t0 + tid < T
                    lse_tile[tid] = lse[b, h, t0 + tid] if inside else float32(0.0)
                    di_tile[tid] = di[b, h, t0 + tid] if inside else float32(0.0)
                cuda.syncthreads()
                for i in range(BQ_DKDV):
                    if t0 + i < T and s <= (S - T) + t0 + i:
                        score = float32(0.0)
                        dp = float32(0.0)
                        for d in range(D):
                            score += q_tile[i, d] * k_rows[tid, d]
                            dp += do_tile[i, d] * v_rows[tid, d]
                        p = math.exp(score - lse_tile[i])
                        ds = p * (dp - di_tile[i])
                        for d in range(D):
                            dv_acc[d] += p * do_tile[i, d]
                            dk_acc[d] += ds * q_tile[i, d]
        if s < S:
            for d in range(D):
                dk[b, s, kv, d] = dk_acc[d]
                dv[b, s, kv, d] = dv_acc[d]

    return forward, row_dot, dq_kernel, dkdv_kernel


def forward(q, k, v):
    check_shapes(q, k, v)
    B, T, H, D = q.shape
    kernel = _kernels(D)[0]
    o = runtime.empty(q.shape, q.dtype)
    lse = runtime.empty((B, H, T), q.dtype)
    runtime.launch(kernel, (runtime.blocks_for(T, BQ), B * H), BQ, q, k, v, float32(1.0 / math.sqrt(D)), o, lse)
    return o, (o, lse)


def backward(do, saved, q, k, v):
    o, lse = saved
    B, T, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    _, row_dot, dq_kernel, dkdv_kernel = _kernels(D)
    scale = float32(1.0 / math.sqrt(D))
    di = runtime.empty((B, H, T), q.dtype)
    dq = runtime.empty(q.shape, q.dtype)
    dk = runtime.empty(k.shape, k.dtype)
    dv = runtime.empty(v.shape, v.dtype)
    runtime.launch(row_dot, runtime.blocks_for(B * H * T, 256), 256, do, o, di)
    runtime.launch(dq_kernel, (runtime.blocks_for(T, BQ), B * H), BQ, do, q, k, v, lse, di, scale, dq)
    runtime.launch(dkdv_kernel, (runtime.blocks_for(S, BK_DKDV), B * KV), BK_DKDV, do, q, k, v, lse, di, scale, dk, dv)
    return dq, dk, dv
