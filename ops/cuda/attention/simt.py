"""SIMT FlashAttention-2: float32 arithmetic on fp32 or bf16 storage, any head size D.

Block: THREADS = 256 threads as 16 x 16 (ty, tx), on a tile of TILE = 64 rows: query rows (forward,
dq) or keys (dkdv). Each step multiplies it against a streamed 64-row tile of the other side.
Thread (ty, tx) computes a 4 x 4 register tile of each 64 x 64 score tile (row quads ty + 16 n,
columns tx + 16 n) and a 4 x DPB/16 register tile of the 64 x D output (D padded to DPB, a multiple
of 64), so every value read from shared memory feeds several multiply-adds.
  staged once (k-major):     q^T (forward), q^T and do^T (dq), k^T and v^T (dkdv)
  streamed (row by row):     k, v (forward, dq); q, do and their lse, Di (dkdv); the next tile is
                             loaded into registers while this one is multiplied
  through shared memory:     P^T (forward), dS^T (dq), P and dS (dkdv), between the two products
  in registers:              the score tiles, the output (or gradient) accumulators, and the online
                             softmax's running max and sum of each row (forward)
Shared memory takes about 70-170 KB a block (dynamic; runtime.launch raises the 48 KB limit).
"""

import math
from functools import cache
from typing import NamedTuple

from numba import cuda, float32, int64, uint64

from nanoeuler_ops.cuda.attention.common import MASKED, SHARED_ALIGN, FlashKernels, Kernel, kernel_options, zero
from nanoeuler_ops.cuda.device import lanes_reduce, stored, to_f32


@cache
def simt_kernels(D: int) -> FlashKernels:
    """The SIMT forward, dq and dk/dv kernels for head size D, each with the dynamic shared memory
    (bytes) it takes. They take tensors as they are, fp32 or bf16 storage."""
    return FlashKernels(_forward_kernel(D), _dq_kernel(D), _dkdv_kernel(D))


# TILE query rows x TILE keys per step; thread (ty, tx) owns the row quads ty + TILE_NY*n
# (a quad = 4 neighbouring rows), and the columns tx + TILE_NX*n of a score tile or the column
# quads tx + TILE_NX*n of an output or gradient tile (see _quad_product).
TILE, TILE_NY, TILE_NX = 64, 16, 16
THREADS = TILE_NY * TILE_NX
QUAD = 4
# At most 128 registers a thread, so that two blocks share a multiprocessor (65536 registers): the
# extra warps hide more latency than the few spilled registers cost
MAX_REGISTERS = 128


@cuda.jit(device=True, inline=True)
def _row_reduce(values, take_max):
    # values[i] <- its max (or sum) over the TILE_NX threads of register-tile row i: neighbouring
    # lanes of one warp (every thread of the block must call this)
    lanes_reduce(values, TILE_NX, take_max)


class _Sizes(NamedTuple):
    """Head size D's tile sizes: compile-time constants of its kernels."""
    DPB: int          # D rounded up to a multiple of TILE: the head-dim columns of the tiles
    TW: int           # row width of a tile indexed by query rows or keys (padded against bank conflicts)
    DW: int           # row width of a tile indexed by head dims (an odd number of quads, see _quad_product)
    mi: int           # register-tile rows of a thread
    mj: int           # register-tile columns of a thread in a score tile
    dj: int           # ... and in an output or gradient tile
    per_thread: int   # elements of a streamed tile each thread loads


def _sizes(D: int) -> _Sizes:
    # DPB: TILE is itself a multiple of QUAD * TILE_NX, the head dims one row of an output or
    # gradient tile's threads covers
    DPB = -(-D // TILE) * TILE
    return _Sizes(DPB, TILE + QUAD, DPB + QUAD, TILE // TILE_NY, TILE // TILE_NX, DPB // TILE_NX,
                  TILE * DPB // THREADS)


@cuda.jit(device=True, inline=True)
def _quad_index(thread, n_threads, i):
    # the i-th row (or column) a thread owns: quads thread, thread + n_threads, ... of QUAD each
    return (thread + n_threads * (i // QUAD)) * QUAD + i % QUAD


@cache
def _quad_product(MI, MJ, b_by_col):
    """A device function acc[i, j] += sum_{k < n} A[k, row i] * B[k, column j] over one
    thread's MI x MJ register tile, k running on to the next multiple of QUAD (the tiles hold zeros
    past n). A is k-major in the shared buffer sh,
    A[k, r] at sh[a + k * a_width + r], the thread's rows in quads (_quad_index(ty, TILE_NY, i)).
    B is k-major too, B[k, c] at sh[b + k * b_width + c] with columns in quads (_quad_index(tx,
    TILE_NX, j)), or if b_by_col stored by column, B[k, c] at sh[b + c * b_width + k] with columns
    tx + TILE_NX * j, read as quads along k (a quarter warp then reads 8 neighbouring rows, which an
    odd number of quads per row puts in distinct banks). Offsets and widths are multiples of QUAD,
    and unsigned indices (no negative-index wraparound) let the compiler load each quad at once."""

    @cuda.jit(device=True, inline=True)
    def product(acc, sh, a, a_width, b, b_width, ty, tx, n):
        b_k = cuda.local.array((QUAD, MJ), float32)   # B[k0 + kk, column j]
        for k0 in range(0, n, QUAD):
            if b_by_col:
                for j in range(MJ):
                    column = uint64(b + (tx + TILE_NX * j) * b_width + k0)
                    for kk in range(QUAD):
                        b_k[kk, j] = sh[column + uint64(kk)]
            for kk in range(QUAD):
                a_k = a + (k0 + kk) * a_width + ty * QUAD
                if not b_by_col:
                    row = b + (k0 + kk) * b_width + tx * QUAD
                    for j in range(MJ):
                        b_k[kk, j] = sh[uint64(row + TILE_NX * QUAD * (j // QUAD)) + uint64(j % QUAD)]
                for i in range(MI):
                    a_ki = sh[uint64(a_k + TILE_NY * QUAD * (i // QUAD)) + uint64(i % QUAD)]
                    for j in range(MJ):
                        acc[i, j] += a_ki * b_k[kk, j]

    return product


@cache
def _tile_functions(D: int):
    """Head size D's device functions (load_tile, store_tile, product_over_dims, product_over_tile):
    a streamed tile from global memory into registers, and from registers into shared memory, each
    thread per_thread elements of it; the tile x tile products over the head dims, and the tile x
    head-dim products over a tile's rows (keys or query rows)."""
    DPB, TW, DW, mi, mj, dj, per_thread = _sizes(D)

    @cuda.jit(device=True, inline=True)
    def load_tile(values, x, b, row0, head, n_rows, scale, tid):
        # values[n] = scale * x[b, row0 + r, head, d] for element i = tid + n * THREADS = r * DPB + d
        # of a TILE x DPB tile; zero past n_rows and D. The load reads a clamped, in-bounds element
        # and the value is dropped outside, so no branch separates the loads; unsigned indices skip
        # the negative-index wraparound.
        for n in range(per_thread):
            i = uint64(tid + n * THREADS)
            r, d = int64(i // uint64(DPB)), int64(i % uint64(DPB))
            row = row0 + r
            value = to_f32(x[uint64(b), uint64(min(row, n_rows - 1)), uint64(head), uint64(min(d, D - 1))])
            values[n] = value * scale if row < n_rows and d < D else float32(0.0)

    @cuda.jit(device=True, inline=True)
    def store_tile(sh, base, values, transposed, tid):
        # the loaded tile into sh[base + d * TW + r] if transposed else sh[base + r * DW + d]
        for n in range(per_thread):
            i = uint64(tid + n * THREADS)
            r, d = i // uint64(DPB), i % uint64(DPB)
            sh[uint64(base) + (d * uint64(TW) + r if transposed else r * uint64(DW) + d)] = values[n]

    return load_tile, store_tile, _quad_product(mi, mj, True), _quad_product(mi, dj, False)


# ---------------------------------------------------------------- forward

def _forward_kernel(D: int) -> Kernel:
    DPB, TW, DW, mi, mj, dj, per_thread = _sizes(D)
    load_tile, store_tile, product_over_dims, product_over_tile = _tile_functions(D)
    # shared buffer (offsets in floats): q^T (DPB x TW, staged once), k, v (TILE x DW), P^T (TILE x TW)
    FWD_QT, FWD_K = 0, DPB * TW
    FWD_V = FWD_K + TILE * DW
    FWD_PT = FWD_V + TILE * DW

    @cuda.jit(**kernel_options(MAX_REGISTERS))
    def simt_forward_kernel(q, k, v, scale, o, lse):
        # q (B, T, H, D), k, v (B, S, KV, D) -> o (B, T, H, D), lse (B, H, T);
        # grid (B * H, T / TILE), THREADS threads: TILE query rows against TILE keys per step
        B, T, H, _ = q.shape
        S, KV = k.shape[1], k.shape[2]
        b, h = cuda.blockIdx.x // H, cuda.blockIdx.x % H
        kv = h // (H // KV)
        tid = cuda.threadIdx.x
        ty, tx = tid // TILE_NX, tid % TILE_NX
        t0 = (cuda.gridDim.y - 1 - cuda.blockIdx.y) * TILE   # the last rows, with the most keys, start first
        sh = cuda.shared.array(0, float32, alignment=SHARED_ALIGN)
        scores = cuda.local.array((mi, mj), float32)   # the scores, then exp(score - row max)
        acc = cuda.local.array((mi, dj), float32)
        row_max = cuda.local.array(mi, float32)   # running max of each row's scores (the same in all its threads)
        row_sum = cuda.local.array(mi, float32)   # this thread's share of each row's running sum of exp
        tile_max = cuda.local.array(mi, float32)   # each row's max over the tile's keys
        k_next = cuda.local.array(per_thread, float32)   # the next key tile (first q, on its way to q^T)
        v_next = cuda.local.array(per_thread, float32)
        zero(acc)
        for i in range(mi):
            row_max[i] = MASKED
            row_sum[i] = 0.0
        load_tile(k_next, q, b, t0, h, T, scale, tid)
        store_tile(sh, FWD_QT, k_next, True, tid)
        load_tile(k_next, k, b, 0, kv, S, float32(1.0), tid)
        load_tile(v_next, v, b, 0, kv, S, float32(1.0), tid)
        store_tile(sh, FWD_K, k_next, False, tid)
        store_tile(sh, FWD_V, v_next, False, tid)
        keys_end = min(S, (S - T) + t0 + TILE)   # the block's newest visible key + 1
        for s0 in range(0, keys_end, TILE):
            cuda.syncthreads()
            zero(scores)
            product_over_dims(scores, sh, FWD_QT, TW, FWD_K, DW, ty, tx, D)
            for i in range(mi):
                last_key = (S - T) + t0 + _quad_index(ty, TILE_NY, i)
                tile_max[i] = MASKED
                for j in range(mj):
                    if s0 + tx + TILE_NX * j > last_key:
                        scores[i, j] = MASKED
                    tile_max[i] = max(tile_max[i], scores[i, j])
            _row_reduce(tile_max, True)
            for i in range(mi):   # online softmax; key 0 is visible to every row, so the max is finite
                new_max = max(row_max[i], tile_max[i])
                rescale = math.exp(row_max[i] - new_max)
                row_max[i] = new_max
                row_sum[i] *= rescale
                for j in range(mj):
                    scores[i, j] = math.exp(scores[i, j] - new_max)
                    row_sum[i] += scores[i, j]
                for j in range(dj):
                    acc[i, j] *= rescale
            for j in range(mj):   # P^T, a quad of rows as one 16-byte store
                c = tx + TILE_NX * j
                for i0 in range(0, mi, QUAD):
                    r = _quad_index(ty, TILE_NY, i0)
                    for n in range(QUAD):
                        sh[uint64(FWD_PT + c * TW + r) + uint64(n)] = scores[i0 + n, j]
            has_next = s0 + TILE < keys_end
            if has_next:
                load_tile(k_next, k, b, s0 + TILE, kv, S, float32(1.0), tid)
                load_tile(v_next, v, b, s0 + TILE, kv, S, float32(1.0), tid)
            cuda.syncthreads()
            product_over_tile(acc, sh, FWD_PT, TW, FWD_V, DW, ty, tx, TILE)
            cuda.syncthreads()   # k, v and P^T are read: the next keys take their place
            if has_next:
                store_tile(sh, FWD_K, k_next, False, tid)
                store_tile(sh, FWD_V, v_next, False, tid)
        _row_reduce(row_sum, False)   # each row's whole sum
        for i in range(mi):
            t = t0 + _quad_index(ty, TILE_NY, i)
            if tx == 0 and t < T:
                lse[b, h, t] = row_max[i] + math.log(row_sum[i])
            inv_sum = float32(1.0) / row_sum[i]
            for j in range(dj):
                d = _quad_index(tx, TILE_NX, j)
                if t < T and d < D:
                    o[b, t, h, d] = stored(o, acc[i, j] * inv_sum)

    return Kernel(simt_forward_kernel, 4 * (FWD_PT + TILE * TW))


# ---------------------------------------------------------------- backward: dq (and Di), then dk and dv

def _dq_kernel(D: int) -> Kernel:
    DPB, TW, DW, mi, mj, dj, per_thread = _sizes(D)
    load_tile, store_tile, product_over_dims, product_over_tile = _tile_functions(D)
    # shared buffer (offsets in floats): q^T, do^T (DPB x TW, staged once), k, v (TILE x DW), dS^T (TILE x TW)
    DQ_QT, DQ_DOT = 0, DPB * TW
    DQ_K = 2 * DPB * TW
    DQ_V = DQ_K + TILE * DW
    DQ_DST = DQ_V + TILE * DW

    @cuda.jit(**kernel_options(MAX_REGISTERS))
    def simt_dq_kernel(do, q, k, v, o, lse, scale, dq, di):
        # do, q, o (B, T, H, D), k, v (B, S, KV, D), lse (B, H, T) -> dq (B, T, H, D), di (B, H, T);
        # grid (B * H, T / TILE), THREADS threads: TILE query rows against TILE keys per step
        B, T, H, _ = q.shape
        S, KV = k.shape[1], k.shape[2]
        b, h = cuda.blockIdx.x // H, cuda.blockIdx.x % H
        kv = h // (H // KV)
        tid = cuda.threadIdx.x
        ty, tx = tid // TILE_NX, tid % TILE_NX
        t0 = (cuda.gridDim.y - 1 - cuda.blockIdx.y) * TILE   # the last rows, with the most keys, start first
        sh = cuda.shared.array(0, float32, alignment=SHARED_ALIGN)
        scores = cuda.local.array((mi, mj), float32)
        dp = cuda.local.array((mi, mj), float32)
        acc = cuda.local.array((mi, dj), float32)
        row_lse = cuda.local.array(mi, float32)
        row_di = cuda.local.array(mi, float32)
        ds_quad = cuda.local.array(QUAD, float32)
        k_next = cuda.local.array(per_thread, float32)   # the next key tile (first q, do and o, on their way)
        v_next = cuda.local.array(per_thread, float32)
        zero(acc)
        load_tile(k_next, q, b, t0, h, T, scale, tid)
        store_tile(sh, DQ_QT, k_next, True, tid)
        # Di = rowsum(do * o) of the block's rows: the products go row by row where k will be, one
        # thread sums each row; simt_dkdv_kernel reads Di from global memory after this kernel
        load_tile(k_next, do, b, t0, h, T, float32(1.0), tid)
        load_tile(v_next, o, b, t0, h, T, float32(1.0), tid)
        store_tile(sh, DQ_DOT, k_next, True, tid)
        for n in range(per_thread):
            v_next[n] *= k_next[n]
        store_tile(sh, DQ_K, v_next, False, tid)
        cuda.syncthreads()
        if tid < TILE:
            total = float32(0.0)
            for d in range(D):
                total += sh[DQ_K + tid * DW + d]
            sh[DQ_DST + tid] = total   # dS^T's space is free until the first step
            if t0 + tid < T:
                di[b, h, t0 + tid] = total
        cuda.syncthreads()
        for i in range(mi):
            t = t0 + _quad_index(ty, TILE_NY, i)
            row_lse[i] = lse[b, h, t] if t < T else float32(0.0)
            row_di[i] = sh[DQ_DST + _quad_index(ty, TILE_NY, i)]
        load_tile(k_next, k, b, 0, kv, S, float32(1.0), tid)
        load_tile(v_next, v, b, 0, kv, S, float32(1.0), tid)
        store_tile(sh, DQ_K, k_next, False, tid)
        store_tile(sh, DQ_V, v_next, False, tid)
        keys_end = min(S, (S - T) + t0 + TILE)
        for s0 in range(0, keys_end, TILE):
            cuda.syncthreads()
            zero(scores)
            zero(dp)
            product_over_dims(scores, sh, DQ_QT, TW, DQ_K, DW, ty, tx, D)
            product_over_dims(dp, sh, DQ_DOT, TW, DQ_V, DW, ty, tx, D)
            for j in range(mj):
                c = tx + TILE_NX * j
                for i0 in range(0, mi, QUAD):   # a quad of rows goes out as one 16-byte store
                    r = _quad_index(ty, TILE_NY, i0)
                    for n in range(QUAD):
                        visible = s0 + c <= (S - T) + t0 + r + n
                        x = scores[i0 + n, j] - row_lse[i0 + n] if visible else float32(MASKED)
                        ds_quad[n] = math.exp(x) * (dp[i0 + n, j] - row_di[i0 + n])
                    for n in range(QUAD):
                        sh[uint64(DQ_DST + c * TW + r) + uint64(n)] = ds_quad[n]
            has_next = s0 + TILE < keys_end
            if has_next:
                load_tile(k_next, k, b, s0 + TILE, kv, S, float32(1.0), tid)
                load_tile(v_next, v, b, s0 + TILE, kv, S, float32(1.0), tid)
            cuda.syncthreads()
            product_over_tile(acc, sh, DQ_DST, TW, DQ_K, DW, ty, tx, TILE)
            cuda.syncthreads()   # k and dS^T are read: the next keys take their place
            if has_next:
                store_tile(sh, DQ_K, k_next, False, tid)
                store_tile(sh, DQ_V, v_next, False, tid)
        for i in range(mi):
            t = t0 + _quad_index(ty, TILE_NY, i)
            for j in range(dj):
                d = _quad_index(tx, TILE_NX, j)
                if t < T and d < D:
                    dq[b, t, h, d] = stored(dq, acc[i, j] * scale)

    return Kernel(simt_dq_kernel, 4 * (DQ_DST + TILE * TW))


def _dkdv_kernel(D: int) -> Kernel:
    DPB, TW, DW, mi, mj, dj, per_thread = _sizes(D)
    load_tile, store_tile, product_over_dims, product_over_tile = _tile_functions(D)
    # shared buffer: k^T, v^T (DPB x TW, staged once), then per query tile q, do (TILE x DW),
    # P, dS (TILE query rows x TW keys), lse, di
    KV_KT, KV_VT = 0, DPB * TW
    KV_Q = 2 * DPB * TW
    KV_DO = KV_Q + TILE * DW
    KV_P = KV_DO + TILE * DW
    KV_DS = KV_P + TILE * TW
    KV_LSE = KV_DS + TILE * TW
    KV_DI = KV_LSE + TILE

    @cuda.jit(device=True, inline=True)
    def load_query_tile(q_next, do_next, q, do, lse, di, b, h, t0, T, scale, tid):
        # one step's query tile of q and do into registers, and (threads tid < TILE) its row's lse, di
        load_tile(q_next, q, b, t0, h, T, scale, tid)
        load_tile(do_next, do, b, t0, h, T, float32(1.0), tid)
        inside = tid < TILE and t0 + tid < T
        return (lse[b, h, t0 + tid] if inside else float32(0.0)), (di[b, h, t0 + tid] if inside else float32(0.0))

    @cuda.jit(device=True, inline=True)
    def store_query_tile(sh, q_next, do_next, lse_next, di_next, tid):
        store_tile(sh, KV_Q, q_next, False, tid)
        store_tile(sh, KV_DO, do_next, False, tid)
        if tid < TILE:
            sh[KV_LSE + tid] = lse_next
            sh[KV_DI + tid] = di_next

    @cuda.jit(**kernel_options(MAX_REGISTERS))
    def simt_dkdv_kernel(do, q, k, v, lse, di, scale, dk, dv):
        # do, q (B, T, H, D), k, v (B, S, KV, D), lse, di (B, H, T) -> dk, dv (B, S, KV, D);
        # grid (B * KV, S / TILE), THREADS threads: TILE keys against TILE query rows per
        # step, over every query head of the group, so the group's gradients add up in registers
        B, T, H, _ = q.shape
        S, KV = k.shape[1], k.shape[2]
        group = H // KV
        b, kv = cuda.blockIdx.x // KV, cuda.blockIdx.x % KV
        tid = cuda.threadIdx.x
        ty, tx = tid // TILE_NX, tid % TILE_NX
        s0 = cuda.blockIdx.y * TILE   # the first keys, seen by the most query rows, start first
        sh = cuda.shared.array(0, float32, alignment=SHARED_ALIGN)
        scores = cuda.local.array((mi, mj), float32)   # transposed: [key, query row]
        dp = cuda.local.array((mi, mj), float32)
        row_lse = cuda.local.array(mj, float32)
        row_di = cuda.local.array(mj, float32)
        dk_acc = cuda.local.array((mi, dj), float32)
        dv_acc = cuda.local.array((mi, dj), float32)
        p_quad = cuda.local.array(QUAD, float32)
        ds_quad = cuda.local.array(QUAD, float32)
        q_next = cuda.local.array(per_thread, float32)   # the next query tile (first k and v, on their way to k^T, v^T)
        do_next = cuda.local.array(per_thread, float32)
        zero(dk_acc)
        zero(dv_acc)
        load_tile(q_next, k, b, s0, kv, S, float32(1.0), tid)
        store_tile(sh, KV_KT, q_next, True, tid)
        load_tile(q_next, v, b, s0, kv, S, float32(1.0), tid)
        store_tile(sh, KV_VT, q_next, True, tid)
        first_query = max(0, s0 - (S - T))   # earlier queries see none of this block's keys
        tiles = (T - first_query + TILE - 1) // TILE   # query tiles per head
        h0 = kv * group
        lse_next, di_next = load_query_tile(q_next, do_next, q, do, lse, di, b, h0, first_query, T, scale, tid)
        store_query_tile(sh, q_next, do_next, lse_next, di_next, tid)
        for step in range(group * tiles):
            t0 = first_query + (step % tiles) * TILE
            cuda.syncthreads()
            zero(scores)
            zero(dp)
            product_over_dims(scores, sh, KV_KT, TW, KV_Q, DW, ty, tx, D)
            product_over_dims(dp, sh, KV_VT, TW, KV_DO, DW, ty, tx, D)
            for j in range(mj):
                c = tx + TILE_NX * j
                row_lse[j] = sh[KV_LSE + c]
                row_di[j] = sh[KV_DI + c]
            for j in range(mj):
                c = tx + TILE_NX * j
                for i0 in range(0, mi, QUAD):   # a quad of keys goes out as one 16-byte store
                    r = _quad_index(ty, TILE_NY, i0)
                    for n in range(QUAD):
                        visible = (t0 + c < T) & (s0 + r + n <= (S - T) + t0 + c)
                        p_quad[n] = math.exp(scores[i0 + n, j] - row_lse[j] if visible else float32(MASKED))
                        ds_quad[n] = p_quad[n] * (dp[i0 + n, j] - row_di[j])
                    for n in range(QUAD):
                        sh[uint64(KV_P + c * TW + r) + uint64(n)] = p_quad[n]
                    for n in range(QUAD):
                        sh[uint64(KV_DS + c * TW + r) + uint64(n)] = ds_quad[n]
            has_next = step + 1 < group * tiles
            if has_next:
                next_step = step + 1
                lse_next, di_next = load_query_tile(q_next, do_next, q, do, lse, di, b, h0 + next_step // tiles,
                                                    first_query + (next_step % tiles) * TILE, T, scale, tid)
            cuda.syncthreads()
            product_over_tile(dv_acc, sh, KV_P, TW, KV_DO, DW, ty, tx, TILE)
            product_over_tile(dk_acc, sh, KV_DS, TW, KV_Q, DW, ty, tx, TILE)
            cuda.syncthreads()   # q, do, P and dS are read: the next query tile takes their place
            if has_next:
                store_query_tile(sh, q_next, do_next, lse_next, di_next, tid)
        for i in range(mi):
            s = s0 + _quad_index(ty, TILE_NY, i)
            for j in range(dj):
                d = _quad_index(tx, TILE_NX, j)
                if s < S and d < D:
                    dk[b, s, kv, d] = stored(dk, dk_acc[i, j])
                    dv[b, s, kv, d] = stored(dv, dv_acc[i, j])

    return Kernel(simt_dkdv_kernel, 4 * (KV_DI + TILE))
