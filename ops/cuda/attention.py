"""FlashAttention forward and backward on the GPU (FlashAttention-2 blocking). See ops/attention.py for the math.

No (T, S) matrix is ever stored: a thread block stages a tile of query rows and a tile of keys
in shared memory, and each thread computes a small register tile of their scores, so every
value read from shared memory feeds several multiply-adds. The forward keeps a running max and
sum per query row (the online softmax). Tiles wholly in the causal future are never loaded.
Query head h reads key/value head h // (H // KV) in place: repeated K/V are never materialised.

Kernels (thread (ty, tx) of a block owns the register-tile rows ty + NY*i and columns tx + NX*j):
  _forward   block = FWD_ROWS query rows of one (b, h), streaming FWD_KEYS keys per tile;
             writes o and lse.
  _row_dot   Di = rowsum(do * o), the FlashAttention-2 backward's correction term; one warp a row.
  _dq        block = DQ_ROWS query rows of one (b, h), streaming DQ_KEYS keys per tile;
             P recomputed from lse.
  _dkdv      block = DKDV_KEYS keys of one (b, kv head), streaming DKDV_ROWS query rows per tile
             of every query head of its group, so the group's gradients add up in registers:
             no atomics, no races.
Every block's shared memory stays within the 48 KB a kernel gets without opting in. The head
size D is a compile-time constant (register tiles are unrolled), so each D gets its own kernels.
"""

import math
from functools import cache

from numba import cuda, float32

from nanoeuler_ops.attention import check_shapes
from nanoeuler_ops.cuda import runtime

FWD_ROWS, FWD_KEYS, FWD_THREADS = 64, 32, 128
DQ_ROWS, DQ_KEYS, DQ_THREADS = 64, 16, 128
DKDV_KEYS, DKDV_ROWS, DKDV_THREADS = 32, 32, 64
NX = 8           # threads along a register tile's columns (keys or head dims) in every kernel
ROW_DOT_THREADS = 256
MASKED = -1e30   # the score of a key in a row's causal future: exp() of it is 0, and unlike -inf it stays
                 # well defined under fastmath


def _cols_padded(D: int) -> int:
    """D rounded up to a multiple of NX: head-dim columns of the register tiles (the extra ones are zeros)."""
    return -(-D // NX) * NX


@cache
def _tile_product(MI, MJ, NY, a_by_row, b_by_col):
    """A device function acc[i, j] += sum_{k < n} A[ty + NY*i, k] * B[k, tx + NX*j] over one thread's
    MI x MJ register tile. A is stored as a[row, k] if a_by_row else a[k, row]; B as b[col, k] if
    b_by_col else b[k, col] (so S = Q K^T is (True, True), O += P V is (True, False), dV += P^T dO is
    (False, False))."""

    @cuda.jit(device=True, inline=True)
    def product(acc, a, b, ty, tx, n):
        for k in range(n):
            for i in range(MI):
                a_ik = a[ty + NY * i, k] if a_by_row else a[k, ty + NY * i]
                for j in range(MJ):
                    acc[i, j] += a_ik * (b[tx + NX * j, k] if b_by_col else b[k, tx + NX * j])

    return product


@cache
def _kernels(D: int):
    """The four attention kernels compiled for head size D."""
    DP = _cols_padded(D)
    W = DP + 1   # shared row width: the +1 puts the rows a warp reads at one column in distinct banks
    DJ = DP // NX   # head-dim columns per thread
    fwd_p_width, dq_ds_width, kv_p_width = FWD_KEYS + 1, DQ_KEYS + 1, DKDV_KEYS + 1

    @cuda.jit(device=True, inline=True)
    def load_rows(tile, x, b, row0, head, n_rows, scale, tid, n_threads):
        # tile[r, d] = scale * x[b, row0 + r, head, d] for d < DP; zero past n_rows and for d >= D
        for i in range(tid, tile.shape[0] * DP, n_threads):
            r, d = i // DP, i % DP
            inside = row0 + r < n_rows and d < D
            tile[r, d] = x[b, row0 + r, head, d] * scale if inside else float32(0.0)

    @cuda.jit(device=True, inline=True)
    def zero(acc):
        for i in range(acc.shape[0]):
            for j in range(acc.shape[1]):
                acc[i, j] = 0.0

    # forward: scores tile FWD_ROWS x FWD_KEYS, output tile FWD_ROWS x DP
    fwd_ny = FWD_THREADS // NX
    fwd_mi, fwd_mj = FWD_ROWS // fwd_ny, FWD_KEYS // NX
    fwd_scores = _tile_product(fwd_mi, fwd_mj, fwd_ny, True, True)
    fwd_values = _tile_product(fwd_mi, DJ, fwd_ny, True, False)

    @cuda.jit(fastmath=True)
    def forward(q, k, v, scale, o, lse):
        # q (B, T, H, D), k, v (B, S, KV, D) -> o (B, T, H, D), lse (B, H, T);
        # grid (T / FWD_ROWS, B * H), FWD_THREADS threads
        B, T, H, _ = q.shape
        S, KV = k.shape[1], k.shape[2]
        b, h = cuda.blockIdx.y // H, cuda.blockIdx.y % H
        kv = h // (H // KV)
        tid = cuda.threadIdx.x
        ty, tx = tid // NX, tid % NX
        t0 = cuda.blockIdx.x * FWD_ROWS
        q_tile = cuda.shared.array((FWD_ROWS, W), float32)
        k_tile = cuda.shared.array((FWD_KEYS, W), float32)
        v_tile = cuda.shared.array((FWD_KEYS, DP), float32)
        p_tile = cuda.shared.array((FWD_ROWS, fwd_p_width), float32)
        row_factor = cuda.shared.array(FWD_ROWS, float32)   # per tile the rescale of o, at the end 1 / sum
        scores = cuda.local.array((fwd_mi, fwd_mj), float32)
        acc = cuda.local.array((fwd_mi, DJ), float32)
        zero(acc)
        load_rows(q_tile, q, b, t0, h, T, scale, tid, FWD_THREADS)
        row_max = float32(MASKED)   # running max and sum of row tid (threads tid < FWD_ROWS)
        row_sum = float32(0.0)
        keys_end = min(S, (S - T) + t0 + FWD_ROWS)   # the block's newest visible key + 1
        for s0 in range(0, keys_end, FWD_KEYS):
            cuda.syncthreads()
            load_rows(k_tile, k, b, s0, kv, S, float32(1.0), tid, FWD_THREADS)
            load_rows(v_tile, v, b, s0, kv, S, float32(1.0), tid, FWD_THREADS)
            cuda.syncthreads()
            zero(scores)
            fwd_scores(scores, q_tile, k_tile, ty, tx, D)
            for i in range(fwd_mi):
                last_key = (S - T) + t0 + ty + fwd_ny * i
                for j in range(fwd_mj):
                    visible = s0 + tx + NX * j <= last_key
                    p_tile[ty + fwd_ny * i, tx + NX * j] = scores[i, j] if visible else float32(MASKED)
            cuda.syncthreads()
            if tid < FWD_ROWS:   # online softmax of one row; key 0 is visible to all, so the max is finite
                tile_max = float32(MASKED)
                for c in range(FWD_KEYS):
                    tile_max = max(tile_max, p_tile[tid, c])
                new_max = max(row_max, tile_max)
                tile_sum = float32(0.0)
                for c in range(FWD_KEYS):
                    p = math.exp(p_tile[tid, c] - new_max)
                    p_tile[tid, c] = p
                    tile_sum += p
                rescale = math.exp(row_max - new_max)
                row_sum = row_sum * rescale + tile_sum
                row_max = new_max
                row_factor[tid] = rescale
            cuda.syncthreads()
            for i in range(fwd_mi):
                rescale = row_factor[ty + fwd_ny * i]
                for j in range(DJ):
                    acc[i, j] *= rescale
            fwd_values(acc, p_tile, v_tile, ty, tx, FWD_KEYS)
        cuda.syncthreads()
        if tid < FWD_ROWS:
            row_factor[tid] = float32(1.0) / row_sum
            if t0 + tid < T:
                lse[b, h, t0 + tid] = row_max + math.log(row_sum)
        cuda.syncthreads()
        for i in range(fwd_mi):
            t = t0 + ty + fwd_ny * i
            inv_sum = row_factor[ty + fwd_ny * i]
            for j in range(DJ):
                d = tx + NX * j
                if t < T and d < D:
                    o[b, t, h, d] = acc[i, j] * inv_sum

    @cuda.jit(fastmath=True)
    def row_dot(do, o, di):
        # do, o (B, T, H, D) -> di (B, H, T) = sum_d do * o; one warp per (b, t, h) row
        B, T, H, _ = o.shape
        row = cuda.blockIdx.x * (ROW_DOT_THREADS // runtime.WARP) + cuda.threadIdx.x // runtime.WARP
        lane = cuda.threadIdx.x % runtime.WARP
        b, t, h = row // (T * H), (row // H) % T, row % H
        inside = row < B * T * H
        total = float32(0.0)
        for d in range(lane, D, runtime.WARP):
            if inside:
                total += do[b, t, h, d] * o[b, t, h, d]
        total = runtime.warp_sum(total)
        if inside and lane == 0:
            di[b, h, t] = total

    # dq: scores tile DQ_ROWS x DQ_KEYS, dq tile DQ_ROWS x DP
    dq_ny = DQ_THREADS // NX
    dq_mi, dq_mj = DQ_ROWS // dq_ny, DQ_KEYS // NX
    dq_scores = _tile_product(dq_mi, dq_mj, dq_ny, True, True)
    dq_keys = _tile_product(dq_mi, DJ, dq_ny, True, False)

    @cuda.jit(fastmath=True)
    def dq_kernel(do, q, k, v, lse, di, scale, dq):
        # do, q (B, T, H, D), k, v (B, S, KV, D), lse, di (B, H, T) -> dq (B, T, H, D);
        # grid (T / DQ_ROWS, B * H), DQ_THREADS threads
        B, T, H, _ = q.shape
        S, KV = k.shape[1], k.shape[2]
        b, h = cuda.blockIdx.y // H, cuda.blockIdx.y % H
        kv = h // (H // KV)
        tid = cuda.threadIdx.x
        ty, tx = tid // NX, tid % NX
        t0 = cuda.blockIdx.x * DQ_ROWS
        q_tile = cuda.shared.array((DQ_ROWS, W), float32)
        do_tile = cuda.shared.array((DQ_ROWS, W), float32)
        k_tile = cuda.shared.array((DQ_KEYS, W), float32)
        v_tile = cuda.shared.array((DQ_KEYS, W), float32)
        ds_tile = cuda.shared.array((DQ_ROWS, dq_ds_width), float32)
        scores = cuda.local.array((dq_mi, dq_mj), float32)
        dp = cuda.local.array((dq_mi, dq_mj), float32)
        acc = cuda.local.array((dq_mi, DJ), float32)
        row_lse = cuda.local.array(dq_mi, float32)
        row_di = cuda.local.array(dq_mi, float32)
        zero(acc)
        load_rows(q_tile, q, b, t0, h, T, scale, tid, DQ_THREADS)
        load_rows(do_tile, do, b, t0, h, T, float32(1.0), tid, DQ_THREADS)
        for i in range(dq_mi):
            t = t0 + ty + dq_ny * i
            row_lse[i] = lse[b, h, t] if t < T else float32(0.0)
            row_di[i] = di[b, h, t] if t < T else float32(0.0)
        keys_end = min(S, (S - T) + t0 + DQ_ROWS)
        for s0 in range(0, keys_end, DQ_KEYS):
            cuda.syncthreads()
            load_rows(k_tile, k, b, s0, kv, S, float32(1.0), tid, DQ_THREADS)
            load_rows(v_tile, v, b, s0, kv, S, float32(1.0), tid, DQ_THREADS)
            cuda.syncthreads()
            zero(scores)
            zero(dp)
            dq_scores(scores, q_tile, k_tile, ty, tx, D)
            dq_scores(dp, do_tile, v_tile, ty, tx, D)
            for i in range(dq_mi):
                last_key = (S - T) + t0 + ty + dq_ny * i
                for j in range(dq_mj):
                    ds = float32(0.0)
                    if s0 + tx + NX * j <= last_key:
                        ds = math.exp(scores[i, j] - row_lse[i]) * (dp[i, j] - row_di[i])
                    ds_tile[ty + dq_ny * i, tx + NX * j] = ds
            cuda.syncthreads()
            dq_keys(acc, ds_tile, k_tile, ty, tx, DQ_KEYS)
        for i in range(dq_mi):
            t = t0 + ty + dq_ny * i
            for j in range(DJ):
                d = tx + NX * j
                if t < T and d < D:
                    dq[b, t, h, d] = acc[i, j] * scale

    # dk, dv: scores tile DKDV_ROWS x DKDV_KEYS, dk and dv tiles DKDV_KEYS x DP
    kv_ny = DKDV_THREADS // NX
    kv_mi, kv_mj, kv_mk = DKDV_ROWS // kv_ny, DKDV_KEYS // NX, DKDV_KEYS // kv_ny
    kv_scores = _tile_product(kv_mi, kv_mj, kv_ny, True, True)
    kv_grads = _tile_product(kv_mk, DJ, kv_ny, False, False)

    @cuda.jit(fastmath=True)
    def dkdv_kernel(do, q, k, v, lse, di, scale, dk, dv):
        # do, q (B, T, H, D), k, v (B, S, KV, D), lse, di (B, H, T) -> dk, dv (B, S, KV, D);
        # grid (S / DKDV_KEYS, B * KV), DKDV_THREADS threads, looping over the group's query heads
        B, T, H, _ = q.shape
        S, KV = k.shape[1], k.shape[2]
        group = H // KV
        b, kv = cuda.blockIdx.y // KV, cuda.blockIdx.y % KV
        tid = cuda.threadIdx.x
        ty, tx = tid // NX, tid % NX
        s0 = cuda.blockIdx.x * DKDV_KEYS
        k_tile = cuda.shared.array((DKDV_KEYS, W), float32)
        v_tile = cuda.shared.array((DKDV_KEYS, W), float32)
        q_tile = cuda.shared.array((DKDV_ROWS, W), float32)
        do_tile = cuda.shared.array((DKDV_ROWS, W), float32)
        p_tile = cuda.shared.array((DKDV_ROWS, kv_p_width), float32)
        ds_tile = cuda.shared.array((DKDV_ROWS, kv_p_width), float32)
        lse_tile = cuda.shared.array(DKDV_ROWS, float32)
        di_tile = cuda.shared.array(DKDV_ROWS, float32)
        scores = cuda.local.array((kv_mi, kv_mj), float32)
        dp = cuda.local.array((kv_mi, kv_mj), float32)
        dk_acc = cuda.local.array((kv_mk, DJ), float32)
        dv_acc = cuda.local.array((kv_mk, DJ), float32)
        zero(dk_acc)
        zero(dv_acc)
        load_rows(k_tile, k, b, s0, kv, S, float32(1.0), tid, DKDV_THREADS)
        load_rows(v_tile, v, b, s0, kv, S, float32(1.0), tid, DKDV_THREADS)
        first_query = max(0, s0 - (S - T))   # earlier queries see none of this block's keys
        for h in range(kv * group, (kv + 1) * group):
            for t0 in range(first_query, T, DKDV_ROWS):
                cuda.syncthreads()
                load_rows(q_tile, q, b, t0, h, T, scale, tid, DKDV_THREADS)
                load_rows(do_tile, do, b, t0, h, T, float32(1.0), tid, DKDV_THREADS)
                if tid < DKDV_ROWS:
                    inside = t0 + tid < T
                    lse_tile[tid] = lse[b, h, t0 + tid] if inside else float32(0.0)
                    di_tile[tid] = di[b, h, t0 + tid] if inside else float32(0.0)
                cuda.syncthreads()
                zero(scores)
                zero(dp)
                kv_scores(scores, q_tile, k_tile, ty, tx, D)
                kv_scores(dp, do_tile, v_tile, ty, tx, D)
                for i in range(kv_mi):
                    r = ty + kv_ny * i
                    for j in range(kv_mj):
                        p = float32(0.0)
                        if t0 + r < T and s0 + tx + NX * j <= (S - T) + t0 + r:
                            p = math.exp(scores[i, j] - lse_tile[r])
                        p_tile[r, tx + NX * j] = p
                        ds_tile[r, tx + NX * j] = p * (dp[i, j] - di_tile[r])
                cuda.syncthreads()
                kv_grads(dv_acc, p_tile, do_tile, ty, tx, DKDV_ROWS)
                kv_grads(dk_acc, ds_tile, q_tile, ty, tx, DKDV_ROWS)
        for i in range(kv_mk):
            s = s0 + ty + kv_ny * i
            for j in range(DJ):
                d = tx + NX * j
                if s < S and d < D:
                    dk[b, s, kv, d] = dk_acc[i, j]
                    dv[b, s, kv, d] = dv_acc[i, j]

    return forward, row_dot, dq_kernel, dkdv_kernel


def forward(q, k, v):
    check_shapes(q, k, v)
    B, T, H, D = q.shape
    kernel = _kernels(D)[0]
    o = runtime.empty(q.shape, q.dtype)
    lse = runtime.empty((B, H, T), q.dtype)
    runtime.launch(kernel, (runtime.blocks_for(T, FWD_ROWS), B * H), FWD_THREADS,
                   q, k, v, float32(1.0 / math.sqrt(D)), o, lse)
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
    rows_per_block = ROW_DOT_THREADS // runtime.WARP
    runtime.launch(row_dot, runtime.blocks_for(B * T * H, rows_per_block), ROW_DOT_THREADS, do, o, di)
    runtime.launch(dq_kernel, (runtime.blocks_for(T, DQ_ROWS), B * H), DQ_THREADS, do, q, k, v, lse, di, scale, dq)
    runtime.launch(dkdv_kernel, (runtime.blocks_for(S, DKDV_KEYS), B * KV), DKDV_THREADS,
                   do, q, k, v, lse, di, scale, dk, dv)
    return dq, dk, dv
