"""FlashAttention forward and backward on the GPU (FlashAttention-2 blocking). See ops/attention.py for the math.

Two families of kernels compute it, each a forward kernel and two backward kernels (dq, then
dk/dv), launched the same way (Family.launch):
  SIMT          float32 arithmetic on fp32 or bf16 storage, any head size: each thread computes
                4 x 4 register tiles of products staged in shared memory (simt_kernels).
  tensor-core   bf16 storage, head size a multiple of 16: each warp multiplies 16-row tiles with
                mma.sync m16n8k16 (mma_kernels); on Hopper the forward for head size 64 multiplies
                with the block's four warps together, by wgmma from swizzled shared memory.
`forward` and `backward` below take the tensor-core family where it serves the inputs, else the SIMT one.

In both, no (T, S) matrix is ever stored: a thread block keeps a tile of query rows (or keys) and
streams tiles of the other side past it through shared memory. Tiles wholly in the causal future
are never loaded. Query head h reads key/value head h // (H // KV) in place: repeated K/V are never
materialised.
  forward   block = a tile of query rows of one (b, h), streaming tiles of keys; the online
            softmax (running max and sum per row) stays in registers; writes o and lse.
  dq        block = a tile of query rows of one (b, h), streaming tiles of keys; P recomputed
            from lse; first Di = rowsum(do * o), the FlashAttention-2 backward's correction term,
            for its rows (written out for dkdv).
  dkdv      block = a tile of keys of one (b, kv head), streaming tiles of query rows of every
            query head of its group, so the group's gradients add up in registers: no atomics,
            no races.
Each streamed tile is loaded once, while the previous one is still being multiplied (SIMT: into
registers, then shared memory; tensor-core: by cp.async straight into shared memory). The tiles
live in dynamic shared memory (runtime.launch raises a kernel's limit past 48 KB). The head size D is a compile-time constant (register tiles are unrolled), so each
family's factory compiles its kernels for one D.
"""

import math
from functools import cache
from typing import Callable, NamedTuple

import numpy as np
from numba import cuda, float32, int32, int64, types, uint32, uint64

from nanoeuler_ops.attention import check_shapes
from nanoeuler_ops.cuda import device, runtime
from nanoeuler_ops.cuda.device import (bf16x2_values, lanes_reduce, mma_bf16, pack_bf16x2, quad_max, quad_sum, stored,
                                       to_f32)

SHARED_ALIGN = 16   # 16-byte aligned shared memory
LOG2E = math.log2(math.e)
MASKED = -1e30   # the score of a key in a row's causal future: exp() of it is 0, and unlike -inf it stays
                 # well defined under fastmath


# ================================================================ dispatch

def forward(q, k, v):
    check_shapes(q, k, v)
    B, T, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    o = runtime.empty(q.shape, q.dtype)
    lse = runtime.empty((B, H, T), np.float32)
    scale = float32(1.0 / math.sqrt(D))
    family = _family(q)
    x = family.tensor
    # The tile index is the grid's slow dimension: the blocks with the most keys start first
    family.launch(family.kernels(D).forward, (B * H, T), (x(q), x(k), x(v)), (T, S, H, KV), scale, (x(o), lse))
    return o, (o, lse)


def backward(do, saved, q, k, v):
    o, lse = saved
    B, T, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    scale = float32(1.0 / math.sqrt(D))
    di = runtime.empty((B, H, T), np.float32)
    dq = runtime.empty(q.shape, q.dtype)
    dk = runtime.empty(k.shape, k.dtype)
    dv = runtime.empty(v.shape, v.dtype)
    family = _family(q)
    kernels, x = family.kernels(D), family.tensor
    # As in the forward: blocks start roughly in index order, so those with the most causal steps
    # start first and the grid ends on short ones
    family.launch(kernels.dq, (B * H, T), (x(do), x(q), x(k), x(v), x(o), lse), (T, S, H, KV), scale, (x(dq), di))
    family.launch(kernels.dkdv, (B * KV, S), (x(do), x(q), x(k), x(v), lse, di), (T, S, H, KV), scale,
                  (x(dk), x(dv)))
    return dq, dk, dv


def _family(q) -> "Family":
    """The tensor-core family where it serves the inputs, else the SIMT one."""
    return MMA_FAMILY if mma_supported(q) else SIMT_FAMILY


class Kernel(NamedTuple):
    function: object    # the @cuda.jit kernel
    shared_bytes: int   # the dynamic shared memory it takes


class FlashKernels(NamedTuple):
    """A family's kernels for one head size D. Each takes its inputs, the sizes T, S, H, KV (where
    the family's kernels take them), the float32 scale 1/sqrt(D), then its outputs; tensors q, o,
    do, dq are (B, T, H, D), k, v, dk, dv (B, S, KV, D), in the family's form; lse, di (B, H, T)."""
    forward: Kernel   # q, k, v -> o, lse
    dq: Kernel        # do, q, k, v, o, lse -> dq, di
    dkdv: Kernel      # do, q, k, v, lse, di -> dk, dv


class Family(NamedTuple):
    """A family of FlashAttention kernels and how they are launched."""
    kernels: Callable    # head size D -> its FlashKernels, compiled for D
    rows: int            # rows of a block's tile: query rows (forward, dq) or keys (dkdv)
    threads: int         # threads per block
    tensor: Callable     # a tensor in the form the family's kernels take it
    takes_sizes: bool    # whether the kernels take T, S, H, KV (else they read them from the tensors' shapes)

    def launch(self, kernel: Kernel, grid, inputs, sizes, scale, outputs) -> None:
        """kernel(*inputs, *sizes, scale, *outputs) on the current stream, grid = (heads, rows):
        `heads` blocks by the tiles of `rows` rows."""
        heads, rows = grid
        args = (*inputs, *sizes, scale, *outputs) if self.takes_sizes else (*inputs, scale, *outputs)
        runtime.launch(kernel.function, (heads, runtime.blocks_for(rows, self.rows)), self.threads, *args,
                       shared_bytes=kernel.shared_bytes)


@cuda.jit(device=True, inline=True)
def _zero(acc):
    # a register tile of accumulators (either family's) <- 0
    for i in range(acc.shape[0]):
        for j in range(acc.shape[1]):
            acc[i, j] = 0.0


# ================================================================ SIMT FlashAttention-2 (float32 arithmetic)
#
# A block of THREADS threads computes a TILE x TILE tile of products at a time, each thread a 4 x 4
# register tile of it, so every value read from shared memory feeds several multiply-adds. Tiles
# are read from shared memory as 16-byte quads; a kernel takes ~70-170 KB of it.

# TILE query rows x TILE keys per step; thread (ty, tx) owns the row quads ty + TILE_NY*n
# (a quad = 4 neighbouring rows), and the columns tx + TILE_NX*n of a score tile or the column
# quads tx + TILE_NX*n of an output or gradient tile (see _quad_product).
TILE, TILE_NY, TILE_NX = 64, 16, 16
THREADS = TILE_NY * TILE_NX
# At most 128 registers a thread, so that two blocks share a multiprocessor (65536 registers): the
# extra warps hide more latency than the few spilled registers cost
JIT_OPTIONS = {"max_registers": 128}
QUAD = 4


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


def _cols_padded(D: int) -> int:
    """D rounded up to a multiple of TILE (itself a multiple of QUAD * TILE_NX, the head dims
    one row of an output or gradient tile's threads covers): the head-dim columns of the tiles."""
    return -(-D // TILE) * TILE


@cuda.jit(device=True, inline=True)
def _row_reduce(values, take_max):
    # values[i] <- its max (or sum) over the TILE_NX threads of register-tile row i: neighbouring
    # lanes of one warp (every thread of the block must call this)
    lanes_reduce(values, TILE_NX, take_max)


@cache
def simt_kernels(D: int) -> FlashKernels:
    """The SIMT forward, dq and dk/dv kernels for head size D, each with the dynamic shared memory
    (bytes) it takes. They take tensors as they are, fp32 or bf16 storage."""
    DPB = _cols_padded(D)

    # Every kernel keeps its tiles in one dynamic shared buffer. Tiles staged once per block are
    # k-major (the summed index first), so a thread's four neighbouring rows are one aligned 16-byte
    # load; the tiles streamed per step are stored row by row, as they lie in global memory, and
    # serve both as k-minor operands (products over the head dims) and k-major ones (over rows).
    # The next step's tile is loaded into registers while the current one is multiplied (the loads'
    # latency hides behind the arithmetic) and stored into shared memory once the products are done.
    TW = TILE + QUAD   # row width of a tile indexed by query rows or keys (padded against bank conflicts)
    DW = DPB + QUAD        # row width of a tile indexed by head dims (an odd number of quads, see _quad_product)
    mi, mj, dj = TILE // TILE_NY, TILE // TILE_NX, DPB // TILE_NX
    per_thread = TILE * DPB // THREADS   # elements of a streamed tile each thread loads
    product_over_dims = _quad_product(mi, mj, True)     # tile x tile products over the head dims
    product_over_tile = _quad_product(mi, dj, False)     # tile x head-dim products over the tile's keys or rows

    @cuda.jit(device=True, inline=True)
    def fetch_tile(values, x, b, row0, head, n_rows, scale, tid):
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
    def put_tile(sh, base, values, transposed, tid):
        # the fetched tile into sh[base + d * TW + r] if transposed else sh[base + r * DW + d]
        for n in range(per_thread):
            i = uint64(tid + n * THREADS)
            r, d = i // uint64(DPB), i % uint64(DPB)
            sh[uint64(base) + (d * uint64(TW) + r if transposed else r * uint64(DW) + d)] = values[n]

    # forward shared buffer (offsets in floats): q^T (DPB x TW, staged once), k, v (TILE x DW), P^T (TILE x TW)
    FWD_QT, FWD_K = 0, DPB * TW
    FWD_V = FWD_K + TILE * DW
    FWD_PT = FWD_V + TILE * DW
    forward_shared_bytes = 4 * (FWD_PT + TILE * TW)

    @cuda.jit(fastmath=True, **JIT_OPTIONS)
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
        _zero(acc)
        for i in range(mi):
            row_max[i] = MASKED
            row_sum[i] = 0.0
        fetch_tile(k_next, q, b, t0, h, T, scale, tid)
        put_tile(sh, FWD_QT, k_next, True, tid)
        fetch_tile(k_next, k, b, 0, kv, S, float32(1.0), tid)
        fetch_tile(v_next, v, b, 0, kv, S, float32(1.0), tid)
        put_tile(sh, FWD_K, k_next, False, tid)
        put_tile(sh, FWD_V, v_next, False, tid)
        keys_end = min(S, (S - T) + t0 + TILE)   # the block's newest visible key + 1
        for s0 in range(0, keys_end, TILE):
            cuda.syncthreads()
            _zero(scores)
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
                fetch_tile(k_next, k, b, s0 + TILE, kv, S, float32(1.0), tid)
                fetch_tile(v_next, v, b, s0 + TILE, kv, S, float32(1.0), tid)
            cuda.syncthreads()
            product_over_tile(acc, sh, FWD_PT, TW, FWD_V, DW, ty, tx, TILE)
            cuda.syncthreads()   # k, v and P^T are read: the next keys take their place
            if has_next:
                put_tile(sh, FWD_K, k_next, False, tid)
                put_tile(sh, FWD_V, v_next, False, tid)
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

    # dq shared buffer (offsets in floats): q^T, do^T (DPB x TW, staged once), k, v (TILE x DW), dS^T (TILE x TW)
    DQ_QT, DQ_DOT = 0, DPB * TW
    DQ_K = 2 * DPB * TW
    DQ_V = DQ_K + TILE * DW
    DQ_DST = DQ_V + TILE * DW
    dq_shared_bytes = 4 * (DQ_DST + TILE * TW)

    @cuda.jit(fastmath=True, **JIT_OPTIONS)
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
        _zero(acc)
        fetch_tile(k_next, q, b, t0, h, T, scale, tid)
        put_tile(sh, DQ_QT, k_next, True, tid)
        # Di = rowsum(do * o) of the block's rows: the products go row by row where k will be, one
        # thread sums each row; simt_dkdv_kernel reads Di from global memory after this kernel
        fetch_tile(k_next, do, b, t0, h, T, float32(1.0), tid)
        fetch_tile(v_next, o, b, t0, h, T, float32(1.0), tid)
        put_tile(sh, DQ_DOT, k_next, True, tid)
        for n in range(per_thread):
            v_next[n] *= k_next[n]
        put_tile(sh, DQ_K, v_next, False, tid)
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
        fetch_tile(k_next, k, b, 0, kv, S, float32(1.0), tid)
        fetch_tile(v_next, v, b, 0, kv, S, float32(1.0), tid)
        put_tile(sh, DQ_K, k_next, False, tid)
        put_tile(sh, DQ_V, v_next, False, tid)
        keys_end = min(S, (S - T) + t0 + TILE)
        for s0 in range(0, keys_end, TILE):
            cuda.syncthreads()
            _zero(scores)
            _zero(dp)
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
                fetch_tile(k_next, k, b, s0 + TILE, kv, S, float32(1.0), tid)
                fetch_tile(v_next, v, b, s0 + TILE, kv, S, float32(1.0), tid)
            cuda.syncthreads()
            product_over_tile(acc, sh, DQ_DST, TW, DQ_K, DW, ty, tx, TILE)
            cuda.syncthreads()   # k and dS^T are read: the next keys take their place
            if has_next:
                put_tile(sh, DQ_K, k_next, False, tid)
                put_tile(sh, DQ_V, v_next, False, tid)
        for i in range(mi):
            t = t0 + _quad_index(ty, TILE_NY, i)
            for j in range(dj):
                d = _quad_index(tx, TILE_NX, j)
                if t < T and d < D:
                    dq[b, t, h, d] = stored(dq, acc[i, j] * scale)

    # dkdv shared buffer: k^T, v^T (DPB x TW, staged once), then per query tile q, do (TILE x DW),
    # P, dS (TILE query rows x TW keys), lse, di
    KV_KT, KV_VT = 0, DPB * TW
    KV_Q = 2 * DPB * TW
    KV_DO = KV_Q + TILE * DW
    KV_P = KV_DO + TILE * DW
    KV_DS = KV_P + TILE * TW
    KV_LSE = KV_DS + TILE * TW
    KV_DI = KV_LSE + TILE
    dkdv_shared_bytes = 4 * (KV_DI + TILE)

    @cuda.jit(device=True, inline=True)
    def fetch_query_tile(q_next, do_next, q, do, lse, di, b, h, t0, T, scale, tid):
        # one step's query tile of q and do into registers, and (threads tid < TILE) its row's lse, di
        fetch_tile(q_next, q, b, t0, h, T, scale, tid)
        fetch_tile(do_next, do, b, t0, h, T, float32(1.0), tid)
        inside = tid < TILE and t0 + tid < T
        return (lse[b, h, t0 + tid] if inside else float32(0.0)), (di[b, h, t0 + tid] if inside else float32(0.0))

    @cuda.jit(device=True, inline=True)
    def put_query_tile(sh, q_next, do_next, lse_next, di_next, tid):
        put_tile(sh, KV_Q, q_next, False, tid)
        put_tile(sh, KV_DO, do_next, False, tid)
        if tid < TILE:
            sh[KV_LSE + tid] = lse_next
            sh[KV_DI + tid] = di_next

    @cuda.jit(fastmath=True, **JIT_OPTIONS)
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
        _zero(dk_acc)
        _zero(dv_acc)
        fetch_tile(q_next, k, b, s0, kv, S, float32(1.0), tid)
        put_tile(sh, KV_KT, q_next, True, tid)
        fetch_tile(q_next, v, b, s0, kv, S, float32(1.0), tid)
        put_tile(sh, KV_VT, q_next, True, tid)
        first_query = max(0, s0 - (S - T))   # earlier queries see none of this block's keys
        tiles = (T - first_query + TILE - 1) // TILE   # query tiles per head
        h0 = kv * group
        lse_next, di_next = fetch_query_tile(q_next, do_next, q, do, lse, di, b, h0, first_query, T, scale, tid)
        put_query_tile(sh, q_next, do_next, lse_next, di_next, tid)
        for step in range(group * tiles):
            t0 = first_query + (step % tiles) * TILE
            cuda.syncthreads()
            _zero(scores)
            _zero(dp)
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
                lse_next, di_next = fetch_query_tile(q_next, do_next, q, do, lse, di, b, h0 + next_step // tiles,
                                               first_query + (next_step % tiles) * TILE, T, scale, tid)
            cuda.syncthreads()
            product_over_tile(dv_acc, sh, KV_P, TW, KV_DO, DW, ty, tx, TILE)
            product_over_tile(dk_acc, sh, KV_DS, TW, KV_Q, DW, ty, tx, TILE)
            cuda.syncthreads()   # q, do, P and dS are read: the next query tile takes their place
            if has_next:
                put_query_tile(sh, q_next, do_next, lse_next, di_next, tid)
        for i in range(mi):
            s = s0 + _quad_index(ty, TILE_NY, i)
            for j in range(dj):
                d = _quad_index(tx, TILE_NX, j)
                if s < S and d < D:
                    dk[b, s, kv, d] = stored(dk, dk_acc[i, j])
                    dv[b, s, kv, d] = stored(dv, dv_acc[i, j])

    return FlashKernels(Kernel(simt_forward_kernel, forward_shared_bytes), Kernel(simt_dq_kernel, dq_shared_bytes),
                        Kernel(simt_dkdv_kernel, dkdv_shared_bytes))


SIMT_FAMILY = Family(simt_kernels, TILE, THREADS, tensor=lambda x: x, takes_sizes=False)


# ================================================================ tensor-core FlashAttention-2 (bf16, mma.sync)
#
# bf16 on the tensor cores with mma.sync m16n8k16 (see ptx.py's fragment layout). A block is 4
# warps; each warp owns 16 rows of a 64-row tile (query rows in the forward and dq kernels, keys in
# the dk/dv kernel) and streams 64-row tiles of the other side through shared memory.
# The row side's operands (q and do, or k and v) stay in registers as A fragments for the whole
# kernel; a product's float32 accumulators become the next product's A fragments in registers
# (P for P V, dS for dS K): the FlashAttention-2 register reuse, no shared-memory round trip.
# Tensors travel as uint32 words of two neighbouring bf16 along the head dim (a view of the bf16
# array). Streamed tiles go from global to shared memory by cp.async, row by row (rows padded to
# WS = D/2 + 4 words, so that the eight 16-byte rows an ldmatrix phase reads fall in distinct
# banks), and from there into B fragments by ldmatrix: as stored for a product over the head dims
# (S = Q K^T), transposed (ldmatrix.trans) for a product over the tile's rows (O += P V).
# Index arithmetic is kept off the tile loop: each thread's copy offsets are worked out once
# (copy_plan), indices are 32-bit where they can be, and only the tiles that cross the causal
# diagonal or the last row are masked (bench/attention_sass.py shows each loop's instruction mix).

MMA_ROWS = 64                      # rows of a block's tile and of a streamed tile
MMA_WARPS = MMA_ROWS // 16
MMA_THREADS = MMA_WARPS * device.WARP
MMA_PAD = 4                        # words of padding per shared row
# The most registers a thread of the forward, dq and dk/dv kernels may take (None: no cap). A cap
# lets more blocks share a multiprocessor, at the price of spills or fewer loads in flight: on an
# H100 the forward's 128 (from 134) runs 4 blocks a multiprocessor instead of 3 and 7% faster; the
# backward kernels spill under 128 or 168 (bench/probe_mma_registers.sh, bench/RESULTS.md)
MMA_MAX_REGISTERS = (128, None, None)


def _mma_options(max_registers) -> dict:
    return {"fastmath": True} if max_registers is None else \
        {"fastmath": True, "max_registers": max_registers}


def mma_supported(q) -> bool:
    """Whether the tensor-core kernels serve these inputs: bf16 storage, head size a multiple of 16."""
    return q.dtype == device.BF16 and q.shape[3] % 16 == 0


@cache
def mma_kernels(D: int, hopper: bool | None = None) -> FlashKernels:
    """The bf16 tensor-core forward, dq and dk/dv kernels for head size D, each with the dynamic
    shared memory (bytes) it takes, for this GPU (hopper None) or as for Hopper or not (to compile
    them ahead, e.g. numba.cuda.compile_ptx). They take tensors as flat uint32 words (_words)."""
    W = D // 2                     # words per row of a tile over the head dims
    WS = W + MMA_PAD               # its shared row stride (words)
    TILE_WORDS = MMA_ROWS * WS     # words of a streamed tile in shared memory
    KD = D // 16                   # k-steps of a product over the head dims
    ND = D // 8                    # n-tiles of an output over the head dims
    NR = MMA_ROWS // 8             # n-tiles of a score tile (8 columns each)
    KR = MMA_ROWS // 16            # k-steps of a product over a tile's 64 rows
    CHUNKS_PER_ROW = W // 4        # 16-byte chunks of a tile's row
    COPY_ROWS = MMA_THREADS // CHUNKS_PER_ROW   # rows of a tile the block's threads copy at once
    CHUNKS = -(-MMA_ROWS // COPY_ROWS)          # 16-byte chunks a thread copies per tile
    u32, i32, f32, u64 = uint32, int32, float32, uint64

    # Tensors arrive flat: word w of row `row` of head `head` in batch b sits at
    # ((b * n_rows + row) * heads + head) * W + w. Unsigned indices skip the negative-index wraparound.
    # Streamed tiles live in two stages of one dynamic shared buffer `sh`: while a step multiplies
    # the tiles of one stage, the next tiles are in flight (cp.async) into the other; one barrier a
    # step. A tile is addressed as sh[base + index], base its offset in the buffer.

    @cuda.jit(device=True, inline=True)
    def block_head(heads):
        # the batch row and head of this block (grid x = B * heads), by 32-bit division: a 64-bit one
        # is a subroutine call
        bh, n = u32(cuda.blockIdx.x), u32(heads)
        b = bh // n
        return b, bh - b * n

    @cuda.jit(device=True, inline=True)
    def query_block(H, KV):
        # the forward's and dq's block: its batch row b, query head h and key/value head kv; the
        # thread, its warp and lane (g, t); the block's first query row t0 (the last rows, with the
        # most keys, start first) and its warp's r0
        b, h = block_head(H)
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        t0 = (cuda.gridDim.y - 1 - cuda.blockIdx.y) * MMA_ROWS
        return b, h, h // (u32(H) // u32(KV)), tid, warp, lane, lane // 4, lane % 4, t0, t0 + 16 * warp

    @cuda.jit(device=True, inline=True)
    def rows_of(b, n_rows, head, heads):
        # where rows of (b, head) start in a flat tensor, and the words from one row to the next
        return u64((b * n_rows) * heads + head) * u64(W), u64(heads * W)

    @cuda.jit(device=True, inline=True)
    def copy_plan(stride, tid):
        # the first 16-byte chunk this thread copies of every tile: its row, and its offsets in the
        # tile in shared memory and in global memory (rows `stride` words apart); its next chunks
        # lie COPY_ROWS rows further each. Worked out once per kernel.
        row, col = u32(tid) // u32(CHUNKS_PER_ROW), u32(4) * (u32(tid) % u32(CHUNKS_PER_ROW))
        return i32(row), row * u32(WS) + col, u64(row) * stride + u64(col)

    @cuda.jit(device=True, inline=True)
    def fetch_tiles(sh, sb, base, x, y, start, stride, plan, row0, n_rows, pair=True, row_words=WS, tile_words=TILE_WORDS):
        # start copying rows row0 .. row0 + 63 of x to the tile at sh[base] (row r at base + r row_words,
        # where the plan puts it), and (with pair) of y to the tile tile_words after it (x and y laid out
        # alike: rows from `start`, `stride` words apart); zeros from row n_rows on
        plan_row, plan_at, plan_offset = plan
        tile = start + u64(row0) * stride + plan_offset
        rows_left = i32(n_rows - row0) - plan_row
        for n in range(CHUNKS):
            # (threads past a whole number of rows, and rows past the tile, copy nothing; neither
            # occurs where a row's chunks divide the block's threads)
            if (COPY_ROWS * CHUNKS_PER_ROW == MMA_THREADS or plan_row < COPY_ROWS) and \
                    ((n + 1) * COPY_ROWS <= MMA_ROWS or plan_row + n * COPY_ROWS < MMA_ROWS):
                valid = i32(n * COPY_ROWS) < rows_left
                j = tile + u64(n * COPY_ROWS) * stride if valid else start   # an address in bounds either way
                at = base + plan_at + u32(n * COPY_ROWS * row_words)
                device.cp_async_16(sh, sb, at, x, j, valid)
                if pair:
                    device.cp_async_16(sh, sb, at + u32(tile_words), y, j, valid)

    @cuda.jit(device=True, inline=True)
    def load_fragments(frag, src, b, r0, n_rows, head, heads, g, t):
        # the A fragments of rows r0 + g and r0 + g + 8 over the head dims, straight from global memory
        base = u64((b * n_rows) * heads + head) * u64(W)
        stride = u64(heads * W)
        last = u64(n_rows - 1)
        ra, rb = u64(r0 + g), u64(r0 + g + 8)
        for kc in range(KD):
            for half in range(2):
                w = u64(8 * kc + t + 4 * half)
                a = src[base + min(ra, last) * stride + w]
                c = src[base + min(rb, last) * stride + w]
                frag[kc, 2 * half] = a if ra <= last else u32(0)
                frag[kc, 2 * half + 1] = c if rb <= last else u32(0)

    @cuda.jit(device=True, inline=True)
    def shared_fragments(frag, sh, sb, base, warp, lane):
        # the A fragments of the warp's 16 rows of the tile at sh[base] over the head dims, by ldmatrix:
        # lanes 0..15 address rows 0..15 at word 8 kc, lanes 16..31 the same rows 4 words on
        lane_base = base + u32((16 * warp + lane % 16) * WS + 4 * (lane // 16))
        for kc in range(KD):
            a = device.ldmatrix_x4(sh, sb, lane_base + u32(8 * kc))
            frag[kc, 0], frag[kc, 1], frag[kc, 2], frag[kc, 3] = a[0], a[1], a[2], a[3]

    @cuda.jit(device=True, inline=True)
    def store_rows(dst, acc, scale, b, r0, n_rows, head, heads, g, t):
        # words 4 dn + t of rows r0 + g and r0 + g + 8 = the bf16 pairs of acc * scale
        base = u64((b * n_rows) * heads + head) * u64(W)
        stride = u64(heads * W)
        ra, rb = r0 + g, r0 + g + 8
        for dn in range(ND):
            w = u64(4 * dn + t)
            if ra < n_rows:
                dst[base + u64(ra) * stride + w] = pack_bf16x2(acc[dn, 0] * scale, acc[dn, 1] * scale)
            if rb < n_rows:
                dst[base + u64(rb) * stride + w] = pack_bf16x2(acc[dn, 2] * scale, acc[dn, 3] * scale)

    @cuda.jit(device=True, inline=True)
    def mma(acc, n, a0, a1, a2, a3, b0, b1):
        # acc[n] += A B for one 16 x 8 tile
        c = mma_bf16(a0, a1, a2, a3, b0, b1, acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3])
        acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3] = c[0], c[1], c[2], c[3]

    @cuda.jit(device=True, inline=True)
    def mma_over_dims(acc, frag, sh, sb, base, lane):
        # acc[n] += (A = the warp's 16 rows over D) x (B = tile rows 8n .. 8n+7)^T; one ldmatrix
        # gives the B fragments of n-tiles n and n + 1 (lanes 16..31 address the second's rows)
        lane_base = base + u32((lane % 8 + 8 * (lane // 16)) * WS + 4 * (lane // 8 % 2))
        for n in range(0, NR, 2):
            for kc in range(KD):
                b = device.ldmatrix_x4(sh, sb, lane_base + u32(8 * n * WS + 8 * kc))
                mma(acc, n, frag[kc, 0], frag[kc, 1], frag[kc, 2], frag[kc, 3], b[0], b[1])
                mma(acc, n + 1, frag[kc, 0], frag[kc, 1], frag[kc, 2], frag[kc, 3], b[2], b[3])

    @cuda.jit(device=True, inline=True)
    def row_fragment(scores, kc):
        # the A fragment (bf16) of k-step kc of a product over a tile's rows, from the float32
        # accumulators `scores` (16 x 64) of a product that made them: its n-tiles 2 kc and 2 kc + 1
        return (pack_bf16x2(scores[2 * kc, 0], scores[2 * kc, 1]), pack_bf16x2(scores[2 * kc, 2], scores[2 * kc, 3]),
                pack_bf16x2(scores[2 * kc + 1, 0], scores[2 * kc + 1, 1]),
                pack_bf16x2(scores[2 * kc + 1, 2], scores[2 * kc + 1, 3]))

    @cuda.jit(device=True, inline=True)
    def mma_over_rows(acc, scores, sh, sb, base, lane):
        # acc[dn] += (A = scores, 16 x 64 float32 accumulators, rounded to bf16) x (B = the tile's 64
        # rows over head dims 8dn .. 8dn+7); one ldmatrix.trans gives the B fragments of dn and dn + 1
        lane_base = base + u32((lane % 8 + 8 * (lane // 8 % 2)) * WS + 4 * (lane // 16))
        for kc in range(KR):
            a0, a1, a2, a3 = row_fragment(scores, kc)
            for dn in range(0, ND, 2):
                b = device.ldmatrix_x4_trans(sh, sb, lane_base + u32(16 * kc * WS + 4 * dn))
                mma(acc, dn, a0, a1, a2, a3, b[0], b[1])
                mma(acc, dn + 1, a0, a1, a2, a3, b[2], b[3])

    @cuda.jit(device=True, inline=True)
    def mask_outside(scores, first_a, last_a, first_b, last_b):
        # scores of the columns outside first_a .. last_a (rows g) and first_b .. last_b (rows g + 8)
        # <- MASKED, columns counted from this lane's first (2t); int32 bounds keep the compares 32-bit.
        # Only tiles that cross the causal diagonal or the last row take it.
        for n in range(NR):
            for c in range(2):
                col = 8 * n + c
                if col < first_a or col > last_a:
                    scores[n, c] = f32(MASKED)
                if col < first_b or col > last_b:
                    scores[n, c + 2] = f32(MASKED)

    @cuda.jit(device=True, inline=True)
    def online_softmax(scores, acc, top_a, top_b, sum_a, sum_b, scale2):
        # one key tile of the online softmax for rows g and g + 8: the running maxima (unscaled
        # scores) and this lane's shares of the running sums are updated, acc (the output so far) is
        # rescaled to the new maxima and the scores become exp2(scale2 (score - max)); returns
        # (top_a, top_b, sum_a, sum_b)
        tile_a, tile_b = f32(MASKED), f32(MASKED)
        for n in range(NR):
            for c in range(2):
                tile_a = max(tile_a, scores[n, c])
                tile_b = max(tile_b, scores[n, c + 2])
        new_a, new_b = max(top_a, quad_max(tile_a)), max(top_b, quad_max(tile_b))
        rescale_a, rescale_b = math.exp2((top_a - new_a) * scale2), math.exp2((top_b - new_b) * scale2)
        sum_a *= rescale_a
        sum_b *= rescale_b
        for dn in range(ND):
            acc[dn, 0] *= rescale_a
            acc[dn, 1] *= rescale_a
            acc[dn, 2] *= rescale_b
            acc[dn, 3] *= rescale_b
        shift_a, shift_b = new_a * scale2, new_b * scale2
        for n in range(NR):
            for c in range(2):
                scores[n, c] = math.exp2(scores[n, c] * scale2 - shift_a)
                scores[n, c + 2] = math.exp2(scores[n, c + 2] * scale2 - shift_b)
                sum_a += scores[n, c]
                sum_b += scores[n, c + 2]
        return new_a, new_b, sum_a, sum_b

    @cuda.jit(device=True, inline=True)
    def finish_rows(o, lse, acc, top_a, top_b, sum_a, sum_b, scale, b, h, r0, T, H, g, t):
        # the forward's end for rows r0 + g and r0 + g + 8: lse, and o = acc / the rows' sums
        sum_a, sum_b = quad_sum(sum_a), quad_sum(sum_b)
        if t == 0:
            if r0 + g < T:
                lse[b, h, r0 + g] = top_a * scale + math.log(sum_a)
            if r0 + g + 8 < T:
                lse[b, h, r0 + g + 8] = top_b * scale + math.log(sum_b)
        for dn in range(ND):
            acc[dn, 0] /= sum_a
            acc[dn, 1] /= sum_a
            acc[dn, 2] /= sum_b
            acc[dn, 3] /= sum_b
        store_rows(o, acc, f32(1.0), b, r0, T, h, H, g, t)

    # forward stage: k, v
    FWD_STAGE = 2 * TILE_WORDS

    @cuda.jit(**_mma_options(MMA_MAX_REGISTERS[0]))
    def mma_forward_kernel(q, k, v, T, S, H, KV, scale, o, lse):
        # q, o (B*T*H*D/2,) and k, v (B*S*KV*D/2,) words of bf16 pairs, lse (B, H, T) float32;
        # grid (B * H, T / 64), 128 threads: each warp 16 query rows against 64 keys per step
        b, h, kv, tid, warp, lane, g, t, t0, r0 = query_block(H, KV)
        sh = cuda.shared.array(0, uint32, alignment=SHARED_ALIGN)
        sb = device.shared_base(sh)
        q_frag = cuda.local.array((KD, 4), uint32)
        scores = cuda.local.array((NR, 4), float32)
        acc = cuda.local.array((ND, 4), float32)
        kv_start, kv_stride = rows_of(b, S, kv, KV)
        plan = copy_plan(kv_stride, tid)
        fetch_tiles(sh, sb, u32(0), k, v, kv_start, kv_stride, plan, 0, S)
        # the block's query rows pass through the second stage, free until the loop's first prefetch
        q_start, q_stride = rows_of(b, T, h, H)
        fetch_tiles(sh, sb, u32(FWD_STAGE), q, q, q_start, q_stride, copy_plan(q_stride, tid), t0, T, False)
        device.cp_async_wait_all()
        cuda.syncthreads()
        shared_fragments(q_frag, sh, sb, u32(FWD_STAGE), warp, lane)
        _zero(acc)
        scale2 = scale * f32(LOG2E)                 # exp(scale x) = exp2(scale2 x): one multiply-add and ex2
        top_a, top_b = f32(MASKED), f32(MASKED)     # running max of rows g and g + 8 (unscaled scores)
        sum_a, sum_b = f32(0.0), f32(0.0)           # this lane's share of their running sums
        last_a, last_b = min((S - T) + r0 + g, S - 1), min((S - T) + r0 + g + 8, S - 1)   # the last key each row sees
        diagonal = (S - T) + t0                     # the last key the block's first row sees
        keys_end = min(S, diagonal + MMA_ROWS)
        for s0 in range(0, keys_end, MMA_ROWS):
            stage = u32(u32(s0) // u32(MMA_ROWS) % u32(2) * u32(FWD_STAGE))
            device.cp_async_wait_all()
            cuda.syncthreads()   # this stage has landed; every warp is done reading the other one
            if s0 + MMA_ROWS < keys_end:
                fetch_tiles(sh, sb, u32(FWD_STAGE) - stage, k, v, kv_start, kv_stride, plan, s0 + MMA_ROWS, S)
            _zero(scores)
            mma_over_dims(scores, q_frag, sh, sb, stage, lane)
            if s0 + MMA_ROWS - 1 > diagonal:
                mask_outside(scores, i32(-1), i32(last_a - s0 - 2 * t), i32(-1), i32(last_b - s0 - 2 * t))
            top_a, top_b, sum_a, sum_b = online_softmax(scores, acc, top_a, top_b, sum_a, sum_b, scale2)
            mma_over_rows(acc, scores, sh, sb, stage + u32(TILE_WORDS), lane)
        finish_rows(o, lse, acc, top_a, top_b, sum_a, sum_b, scale, b, h, r0, T, H, g, t)


    # ---- the forward on Hopper's warpgroup products (head size 64; device.wgmma_*): the same
    # blocking and online softmax, Q K^T with both operands in shared memory, P V with P in registers.
    # Tiles are stored unpadded in the 128-byte swizzle (a row is 128 bytes), from a 1024-byte
    # aligned word of the buffer: the query tile, then two stages of k and v.
    WG_TILE = MMA_ROWS * W                      # words of a swizzled tile
    WG_SLACK = 256                              # words the first aligned word may lie past the buffer's start
    WG_GROUP = 8 * 4 * W                        # bytes between groups of 8 rows

    @cuda.jit(device=True, inline=True)
    def swizzled_plan(stride, tid):
        # copy_plan for a swizzled tile: 16-byte chunk c of row r goes to chunk c ^ (r % 8); the rows a
        # thread copies are COPY_ROWS (a multiple of 8) apart, so one plan serves them all
        row, chunk = u32(tid) // u32(CHUNKS_PER_ROW), u32(tid) % u32(CHUNKS_PER_ROW)
        return i32(row), row * u32(W) + u32(4) * (chunk ^ (row % u32(8))), u64(row) * stride + u64(4 * chunk)

    @cuda.jit(**_mma_options(MMA_MAX_REGISTERS[0]))
    def wgmma_forward_kernel(q, k, v, T, S, H, KV, scale, o, lse):
        # as mma_forward_kernel: grid (B * H, T / 64), 128 threads (one warpgroup), 16 query rows a warp
        b, h, kv, tid, warp, lane, g, t, t0, r0 = query_block(H, KV)
        sh = cuda.shared.array(0, uint32, alignment=SHARED_ALIGN)
        sb = device.shared_base(sh)
        q_at = ((u32(1024) - (sb & u32(1023))) & u32(1023)) >> u32(2)
        kv_at = q_at + u32(WG_TILE)
        scores = cuda.local.array((NR, 4), float32)
        acc = cuda.local.array((ND, 4), float32)
        probs = cuda.local.array((KR, 4), uint32)
        kv_start, kv_stride = rows_of(b, S, kv, KV)
        plan = swizzled_plan(kv_stride, tid)
        fetch_tiles(sh, sb, kv_at, k, v, kv_start, kv_stride, plan, 0, S, True, W, WG_TILE)
        q_start, q_stride = rows_of(b, T, h, H)
        fetch_tiles(sh, sb, q_at, q, q, q_start, q_stride, swizzled_plan(q_stride, tid), t0, T, False, W, WG_TILE)
        q_desc = device.smem_descriptor(sb + u32(4) * q_at, u32(WG_GROUP))
        _zero(acc)
        scale2 = scale * f32(LOG2E)
        top_a, top_b = f32(MASKED), f32(MASKED)
        sum_a, sum_b = f32(0.0), f32(0.0)
        last_a, last_b = min((S - T) + r0 + g, S - 1), min((S - T) + r0 + g + 8, S - 1)
        diagonal = (S - T) + t0
        keys_end = min(S, diagonal + MMA_ROWS)
        for s0 in range(0, keys_end, MMA_ROWS):
            stage = u32(u32(s0) // u32(MMA_ROWS) % u32(2) * u32(2 * WG_TILE))
            device.cp_async_wait_all()
            device.proxy_fence()   # the copies' writes, visible to the tensor cores
            cuda.syncthreads()      # this stage has landed; every warp's products of the other are done
            if s0 + MMA_ROWS < keys_end:
                fetch_tiles(sh, sb, kv_at + u32(2 * WG_TILE) - stage, k, v, kv_start, kv_stride, plan, s0 + MMA_ROWS,
                            S, True, W, WG_TILE)
            k_desc = device.smem_descriptor(sb + u32(4) * (kv_at + stage), u32(WG_GROUP))
            v_desc = device.smem_descriptor(sb + u32(4) * (kv_at + stage + u32(WG_TILE)), u32(WG_GROUP))
            device.wgmma_fence(scores, scores)
            for kc in range(KD):   # k-step kc: 32 bytes along the rows of q and k
                device.wgmma_ss(scores, sh, q_desc + u64(2 * kc), k_desc + u64(2 * kc), kc > 0)
            device.wgmma_commit()
            device.wgmma_wait(scores)
            if s0 + MMA_ROWS - 1 > diagonal:
                mask_outside(scores, i32(-1), i32(last_a - s0 - 2 * t), i32(-1), i32(last_b - s0 - 2 * t))
            top_a, top_b, sum_a, sum_b = online_softmax(scores, acc, top_a, top_b, sum_a, sum_b, scale2)
            for kc in range(KR):
                probs[kc, 0], probs[kc, 1], probs[kc, 2], probs[kc, 3] = row_fragment(scores, kc)
            device.wgmma_fence(acc, probs)
            for kc in range(KR):   # k-step kc: 16 rows of v, two groups of 8
                device.wgmma_rs_t(acc, probs[kc, 0], probs[kc, 1], probs[kc, 2], probs[kc, 3], sh,
                                   v_desc + u64(2 * WG_GROUP // 16 * kc), True)
            device.wgmma_commit()
            device.wgmma_wait(acc)
        finish_rows(o, lse, acc, top_a, top_b, sum_a, sum_b, scale, b, h, r0, T, H, g, t)

    # dq stage: k, v
    DQ_STAGE = 2 * TILE_WORDS

    @cuda.jit(**_mma_options(MMA_MAX_REGISTERS[1]))
    def mma_dq_kernel(do, q, k, v, o, lse, T, S, H, KV, scale, dq, di):
        # do, q, o, dq (B*T*H*D/2,) and k, v (B*S*KV*D/2,) words of bf16 pairs, lse, di (B, H, T) float32;
        # grid (B * H, T / 64), 128 threads: each warp 16 query rows against 64 keys per step.
        # Di = rowsum(do * o), the FlashAttention-2 backward's correction, is written for the dk/dv kernel.
        b, h, kv, tid, warp, lane, g, t, t0, r0 = query_block(H, KV)
        sh = cuda.shared.array(0, uint32, alignment=SHARED_ALIGN)
        sb = device.shared_base(sh)
        q_frag = cuda.local.array((KD, 4), uint32)
        do_frag = cuda.local.array((KD, 4), uint32)
        scores = cuda.local.array((NR, 4), float32)
        dp = cuda.local.array((NR, 4), float32)
        acc = cuda.local.array((ND, 4), float32)
        kv_start, kv_stride = rows_of(b, S, kv, KV)
        plan = copy_plan(kv_stride, tid)
        fetch_tiles(sh, sb, u32(0), k, v, kv_start, kv_stride, plan, 0, S)
        load_fragments(do_frag, do, b, r0, T, h, H, g, t)
        load_fragments(q_frag, o, b, r0, T, h, H, g, t)   # o first, for Di; q takes its registers after
        part_a, part_b = f32(0.0), f32(0.0)
        for kc in range(KD):
            for half in range(2):
                lo_do, hi_do = bf16x2_values(do_frag[kc, 2 * half])
                lo_o, hi_o = bf16x2_values(q_frag[kc, 2 * half])
                part_a += lo_do * lo_o + hi_do * hi_o
                lo_do, hi_do = bf16x2_values(do_frag[kc, 2 * half + 1])
                lo_o, hi_o = bf16x2_values(q_frag[kc, 2 * half + 1])
                part_b += lo_do * lo_o + hi_do * hi_o
        load_fragments(q_frag, q, b, r0, T, h, H, g, t)
        row_di_a, row_di_b = quad_sum(part_a), quad_sum(part_b)
        ra, rb = r0 + g, r0 + g + 8
        if t == 0:
            if ra < T:
                di[b, h, ra] = row_di_a
            if rb < T:
                di[b, h, rb] = row_di_b
        scale2 = scale * f32(LOG2E)   # exp(scale x - lse) = exp2(scale2 x - lse log2 e)
        row_lse_a = lse[b, h, min(ra, T - 1)] * f32(LOG2E)
        row_lse_b = lse[b, h, min(rb, T - 1)] * f32(LOG2E)
        _zero(acc)
        last_a, last_b = min((S - T) + ra, S - 1), min((S - T) + rb, S - 1)   # the last key each row sees
        diagonal = (S - T) + t0                     # the last key the block's first row sees
        keys_end = min(S, diagonal + MMA_ROWS)
        for s0 in range(0, keys_end, MMA_ROWS):
            stage = u32(u32(s0) // u32(MMA_ROWS) % u32(2) * u32(DQ_STAGE))
            device.cp_async_wait_all()
            cuda.syncthreads()
            if s0 + MMA_ROWS < keys_end:
                fetch_tiles(sh, sb, u32(DQ_STAGE) - stage, k, v, kv_start, kv_stride, plan, s0 + MMA_ROWS, S)
            _zero(scores)
            _zero(dp)
            mma_over_dims(scores, q_frag, sh, sb, stage, lane)
            mma_over_dims(dp, do_frag, sh, sb, stage + u32(TILE_WORDS), lane)
            if s0 + MMA_ROWS - 1 > diagonal:
                mask_outside(scores, i32(-1), i32(last_a - s0 - 2 * t), i32(-1), i32(last_b - s0 - 2 * t))
            for n in range(NR):
                for c in range(2):
                    p_a = math.exp2(scores[n, c] * scale2 - row_lse_a)
                    p_b = math.exp2(scores[n, c + 2] * scale2 - row_lse_b)
                    dp[n, c] = p_a * (dp[n, c] - row_di_a)
                    dp[n, c + 2] = p_b * (dp[n, c + 2] - row_di_b)
            mma_over_rows(acc, dp, sh, sb, stage, lane)
        store_rows(dq, acc, scale, b, r0, T, h, H, g, t)

    # dk/dv stage: q, do
    KV_STAGE = 2 * TILE_WORDS

    @cuda.jit(**_mma_options(MMA_MAX_REGISTERS[2]))
    def mma_dkdv_kernel(do, q, k, v, lse, di, T, S, H, KV, scale, dk, dv):
        # do, q (B*T*H*D/2,), k, v, dk, dv (B*S*KV*D/2,) words of bf16 pairs, lse, di (B, H, T) float32;
        # grid (B * KV, S / 64), 128 threads: each warp 16 keys against 64 query rows per step, over
        # every query head of the group, so the group's gradients add up in registers: no atomics
        group = H // KV
        b, kv = block_head(KV)
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        s0 = cuda.blockIdx.y * MMA_ROWS   # the first keys, seen by the most query rows, start first
        k0 = s0 + 16 * warp
        sh = cuda.shared.array(0, uint32, alignment=SHARED_ALIGN)
        sb = device.shared_base(sh)
        row_stats = cuda.shared.array((2, 2, MMA_ROWS), float32)   # per stage: lse log2 e and Di of the query rows
        k_frag = cuda.local.array((KD, 4), uint32)
        v_frag = cuda.local.array((KD, 4), uint32)
        scores = cuda.local.array((NR, 4), float32)   # transposed: [key, query row]
        dp = cuda.local.array((NR, 4), float32)
        dk_acc = cuda.local.array((ND, 4), float32)
        dv_acc = cuda.local.array((ND, 4), float32)
        key_a, key_b = k0 + g, k0 + g + 8
        scale2 = scale * f32(LOG2E)   # exp(scale x - lse) = exp2(scale2 x - lse log2 e)
        first_query = max(0, s0 - (S - T))   # earlier queries see none of this block's keys
        tiles = (T - first_query + MMA_ROWS - 1) // MMA_ROWS
        h0 = kv * group
        q_start, q_stride = rows_of(b, T, h0, H)
        plan = copy_plan(q_stride, tid)
        fetch_tiles(sh, sb, u32(0), q, do, q_start, q_stride, plan, first_query, T)
        if tid < MMA_ROWS:
            row = min(first_query + tid, T - 1)
            row_stats[0, 0, tid] = lse[b, h0, row] * f32(LOG2E)
            row_stats[0, 1, tid] = di[b, h0, row]
        load_fragments(k_frag, k, b, k0, S, kv, KV, g, t)
        load_fragments(v_frag, v, b, k0, S, kv, KV, g, t)
        _zero(dk_acc)
        _zero(dv_acc)
        t0, head = first_query, h0   # this step's query rows and head: every tile of a head, then the next head
        for step in range(group * tiles):
            parity = u32(step) % u32(2)
            stage = u32(parity * KV_STAGE)
            device.cp_async_wait_all()
            cuda.syncthreads()
            t_next, h_next = t0 + MMA_ROWS, head
            if t_next >= T:
                t_next, h_next = first_query, head + 1
            if h_next < h0 + group:
                q_start, q_stride = rows_of(b, T, h_next, H)
                fetch_tiles(sh, sb, u32(KV_STAGE) - stage, q, do, q_start, q_stride, plan, t_next, T)
                if tid < MMA_ROWS:
                    row = min(t_next + tid, T - 1)
                    row_stats[u32(1) - parity, 0, tid] = lse[b, h_next, row] * f32(LOG2E)
                    row_stats[u32(1) - parity, 1, tid] = di[b, h_next, row]
            _zero(scores)
            _zero(dp)
            mma_over_dims(scores, k_frag, sh, sb, stage, lane)
            mma_over_dims(dp, v_frag, sh, sb, stage + u32(TILE_WORDS), lane)
            # the columns (query rows t0 + col) keys a and b are seen by: key - (S - T) - t0 .. T - 1 - t0;
            # a tile of rows that all see every key of the block, none past the last row, needs no mask
            if t0 < s0 + MMA_ROWS - 1 - (S - T) or t0 + MMA_ROWS > T:
                last_col = i32(T - 1 - t0 - 2 * t)
                mask_outside(scores, i32(key_a - (S - T) - t0 - 2 * t), last_col,
                             i32(key_b - (S - T) - t0 - 2 * t), last_col)
            for n in range(NR):
                for c in range(2):
                    col = 8 * n + 2 * t + c
                    row_lse, row_di = row_stats[parity, 0, col], row_stats[parity, 1, col]
                    scores[n, c] = math.exp2(scores[n, c] * scale2 - row_lse)
                    scores[n, c + 2] = math.exp2(scores[n, c + 2] * scale2 - row_lse)
                    dp[n, c] = scores[n, c] * (dp[n, c] - row_di)
                    dp[n, c + 2] = scores[n, c + 2] * (dp[n, c + 2] - row_di)
            mma_over_rows(dv_acc, scores, sh, sb, stage + u32(TILE_WORDS), lane)
            mma_over_rows(dk_acc, dp, sh, sb, stage, lane)
            t0, head = t_next, h_next
        store_rows(dk, dk_acc, scale, b, k0, S, kv, KV, g, t)
        store_rows(dv, dv_acc, f32(1.0), b, k0, S, kv, KV, g, t)

    forward = Kernel(wgmma_forward_kernel, 4 * (WG_SLACK + 5 * WG_TILE)) if warpgroup_forward(D, hopper) else \
        Kernel(mma_forward_kernel, 8 * FWD_STAGE)
    return FlashKernels(forward, Kernel(mma_dq_kernel, 8 * DQ_STAGE), Kernel(mma_dkdv_kernel, 8 * KV_STAGE))


def warpgroup_forward(D: int, hopper: bool | None = None) -> bool:
    """Whether the tensor-core forward for head size D runs on warpgroup products: D = 64 on Hopper
    (hopper None: on this GPU, or under the simulator, which runs their twins)."""
    return D == 64 and (runtime.warpgroup_mma() if hopper is None else hopper)


def _words(x):
    """A bf16 array as one flat run of uint32 words, each two neighbouring elements of its last axis."""
    return x.reshape(x.size).view(np.uint32)


def mma_signatures() -> dict:
    """The argument types of the tensor-core forward, dq and dk/dv kernels as forward() and
    backward() launch them: to compile them ahead for a GPU that is not here (numba.cuda.compile_ptx)."""
    words, rows = types.Array(types.uint32, 1, "C"), types.Array(types.float32, 3, "C")
    sizes = (types.int64,) * 4   # T, S, H, KV
    return {"forward": (words, words, words, *sizes, types.float32, words, rows),
            "dq": (words, words, words, words, words, rows, *sizes, types.float32, words, rows),
            "dkdv": (words, words, words, words, rows, rows, *sizes, types.float32, words, words)}


MMA_FAMILY = Family(mma_kernels, MMA_ROWS, MMA_THREADS, tensor=_words, takes_sizes=True)
