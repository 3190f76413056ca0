"""FlashAttention forward and backward on the GPU (FlashAttention-2 blocking). See ops/attention.py for the math.

No (T, S) matrix is ever stored: a thread block stages a tile of query rows (or keys) in shared
memory and streams tiles of the other side past it, and each thread computes a 4 x 4 register tile
of their products, so every value read from shared memory feeds several multiply-adds. Tiles
wholly in the causal future are never loaded. Query head h reads key/value head h // (H // KV) in
place: repeated K/V are never materialised.

Kernels:
  _forward   block = TILE query rows of one (b, h), streaming TILE keys per step; the online
             softmax (running max and sum per row) stays in registers; writes o and lse.
  _dq        block = TILE query rows of one (b, h), streaming TILE keys per step;
             P recomputed from lse; first Di = rowsum(do * o), the FlashAttention-2 backward's
             correction term, for its rows (written out for _dkdv).
  _dkdv      block = TILE keys of one (b, kv head), streaming TILE query rows per step
             of every query head of its group, so the group's gradients add up in registers:
             no atomics, no races.
Each kernel keeps its tiles (read as 16-byte quads) in ~70-100 KB of dynamic shared memory, a limit
raised once per compiled kernel. Each streamed tile is loaded once, into registers while the
previous one is still being multiplied. The head size D is a compile-time constant (register tiles
are unrolled), so each D gets its own kernels.
"""

import math
from functools import cache

from numba import cuda, float32, int64, uint64

from nanoeuler_ops.attention import check_shapes
from nanoeuler_ops.cuda import runtime

# TILE query rows x TILE keys per step; thread (ty, tx) owns the row quads ty + TILE_NY*n
# (a quad = 4 neighbouring rows), and the columns tx + TILE_NX*n of a score tile or the column
# quads tx + TILE_NX*n of an output or gradient tile (see _quad_product).
TILE, TILE_NY, TILE_NX = 64, 16, 16
THREADS = TILE_NY * TILE_NX
# At most 128 registers a thread, so that two blocks share a multiprocessor (65536 registers): the
# extra warps hide more latency than the few spilled registers cost (the simulator takes no limit)
JIT_OPTIONS = {} if runtime.SIMULATOR else {"max_registers": 128}
QUAD = 4
SHARED_ALIGN = None if runtime.SIMULATOR else 16   # 16-byte aligned shared memory (the simulator takes no alignment)
STATIC_SHARED_LIMIT = 48 * 1024   # bytes a kernel gets without raising its dynamic shared memory limit
MASKED = -1e30   # the score of a key in a row's causal future: exp() of it is 0, and unlike -inf it stays
                 # well defined under fastmath


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


if runtime.SIMULATOR:
    @cuda.jit(device=True)
    def _row_reduce(values, take_max):
        # The simulator has no shuffles: a row's threads exchange through shared memory (every
        # thread of the block must call this)
        slots = cuda.shared.array(THREADS, float32)
        tid = cuda.threadIdx.x
        first = tid - tid % TILE_NX
        for i in range(values.shape[0]):
            cuda.syncthreads()
            slots[tid] = values[i]
            cuda.syncthreads()
            total = slots[first]
            for lane in range(first + 1, first + TILE_NX):
                total = max(total, slots[lane]) if take_max else total + slots[lane]
            values[i] = total
        cuda.syncthreads()
else:
    @cuda.jit(device=True, inline=True)
    def _row_reduce(values, take_max):
        # values[i] <- its max (or sum) over the TILE_NX threads of register-tile row i: neighbouring
        # lanes of one warp, so xor shuffles below TILE_NX stay among them; the rows' shuffles interleave
        offset = TILE_NX // 2
        while offset > 0:
            for i in range(values.shape[0]):
                other = cuda.shfl_xor_sync(runtime.FULL_MASK, values[i], offset)
                values[i] = max(values[i], other) if take_max else values[i] + other
            offset //= 2


@cache
def _kernels(D: int):
    """The three attention kernels compiled for head size D, each with its shared memory bytes."""
    DPB = _cols_padded(D)

    @cuda.jit(device=True, inline=True)
    def zero(acc):
        for i in range(acc.shape[0]):
            for j in range(acc.shape[1]):
                acc[i, j] = 0.0

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
    def fetch(values, x, b, row0, head, n_rows, scale, tid):
        # values[n] = scale * x[b, row0 + r, head, d] for element i = tid + n * THREADS = r * DPB + d
        # of a TILE x DPB tile; zero past n_rows and D. The load reads a clamped, in-bounds element
        # and the value is dropped outside, so no branch separates the loads; unsigned indices skip
        # the negative-index wraparound.
        for n in range(per_thread):
            i = uint64(tid + n * THREADS)
            r, d = int64(i // uint64(DPB)), int64(i % uint64(DPB))
            row = row0 + r
            value = x[uint64(b), uint64(min(row, n_rows - 1)), uint64(head), uint64(min(d, D - 1))]
            values[n] = value * scale if row < n_rows and d < D else float32(0.0)

    @cuda.jit(device=True, inline=True)
    def put(sh, base, values, transposed, tid):
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
    def forward_kernel(q, k, v, scale, o, lse):
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
        fetch(k_next, q, b, t0, h, T, scale, tid)
        put(sh, FWD_QT, k_next, True, tid)
        fetch(k_next, k, b, 0, kv, S, float32(1.0), tid)
        fetch(v_next, v, b, 0, kv, S, float32(1.0), tid)
        put(sh, FWD_K, k_next, False, tid)
        put(sh, FWD_V, v_next, False, tid)
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
                fetch(k_next, k, b, s0 + TILE, kv, S, float32(1.0), tid)
                fetch(v_next, v, b, s0 + TILE, kv, S, float32(1.0), tid)
            cuda.syncthreads()
            product_over_tile(acc, sh, FWD_PT, TW, FWD_V, DW, ty, tx, TILE)
            cuda.syncthreads()   # k, v and P^T are read: the next keys take their place
            if has_next:
                put(sh, FWD_K, k_next, False, tid)
                put(sh, FWD_V, v_next, False, tid)
        _row_reduce(row_sum, False)   # each row's whole sum
        for i in range(mi):
            t = t0 + _quad_index(ty, TILE_NY, i)
            if tx == 0 and t < T:
                lse[b, h, t] = row_max[i] + math.log(row_sum[i])
            inv_sum = float32(1.0) / row_sum[i]
            for j in range(dj):
                d = _quad_index(tx, TILE_NX, j)
                if t < T and d < D:
                    o[b, t, h, d] = acc[i, j] * inv_sum

    # dq shared buffer (offsets in floats): q^T, do^T (DPB x TW, staged once), k, v (TILE x DW), dS^T (TILE x TW)
    DQ_QT, DQ_DOT = 0, DPB * TW
    DQ_K = 2 * DPB * TW
    DQ_V = DQ_K + TILE * DW
    DQ_DST = DQ_V + TILE * DW
    dq_shared_bytes = 4 * (DQ_DST + TILE * TW)

    @cuda.jit(fastmath=True, **JIT_OPTIONS)
    def dq_kernel(do, q, k, v, o, lse, scale, dq, di):
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
        fetch(k_next, q, b, t0, h, T, scale, tid)
        put(sh, DQ_QT, k_next, True, tid)
        # Di = rowsum(do * o) of the block's rows: the products go row by row where k will be, one
        # thread sums each row; dkdv_kernel reads Di from global memory after this kernel
        fetch(k_next, do, b, t0, h, T, float32(1.0), tid)
        fetch(v_next, o, b, t0, h, T, float32(1.0), tid)
        put(sh, DQ_DOT, k_next, True, tid)
        for n in range(per_thread):
            v_next[n] *= k_next[n]
        put(sh, DQ_K, v_next, False, tid)
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
        fetch(k_next, k, b, 0, kv, S, float32(1.0), tid)
        fetch(v_next, v, b, 0, kv, S, float32(1.0), tid)
        put(sh, DQ_K, k_next, False, tid)
        put(sh, DQ_V, v_next, False, tid)
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
                fetch(k_next, k, b, s0 + TILE, kv, S, float32(1.0), tid)
                fetch(v_next, v, b, s0 + TILE, kv, S, float32(1.0), tid)
            cuda.syncthreads()
            product_over_tile(acc, sh, DQ_DST, TW, DQ_K, DW, ty, tx, TILE)
            cuda.syncthreads()   # k and dS^T are read: the next keys take their place
            if has_next:
                put(sh, DQ_K, k_next, False, tid)
                put(sh, DQ_V, v_next, False, tid)
        for i in range(mi):
            t = t0 + _quad_index(ty, TILE_NY, i)
            for j in range(dj):
                d = _quad_index(tx, TILE_NX, j)
                if t < T and d < D:
                    dq[b, t, h, d] = acc[i, j] * scale

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
    def fetch_rows(q_next, do_next, q, do, lse, di, b, h, t0, T, scale, tid):
        # one step's query tile of q and do into registers, and (threads tid < TILE) its row's lse, di
        fetch(q_next, q, b, t0, h, T, scale, tid)
        fetch(do_next, do, b, t0, h, T, float32(1.0), tid)
        inside = tid < TILE and t0 + tid < T
        return (lse[b, h, t0 + tid] if inside else float32(0.0)), (di[b, h, t0 + tid] if inside else float32(0.0))

    @cuda.jit(device=True, inline=True)
    def put_rows(sh, q_next, do_next, lse_next, di_next, tid):
        put(sh, KV_Q, q_next, False, tid)
        put(sh, KV_DO, do_next, False, tid)
        if tid < TILE:
            sh[KV_LSE + tid] = lse_next
            sh[KV_DI + tid] = di_next

    @cuda.jit(fastmath=True, **JIT_OPTIONS)
    def dkdv_kernel(do, q, k, v, lse, di, scale, dk, dv):
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
        fetch(q_next, k, b, s0, kv, S, float32(1.0), tid)
        put(sh, KV_KT, q_next, True, tid)
        fetch(q_next, v, b, s0, kv, S, float32(1.0), tid)
        put(sh, KV_VT, q_next, True, tid)
        first_query = max(0, s0 - (S - T))   # earlier queries see none of this block's keys
        tiles = (T - first_query + TILE - 1) // TILE   # query tiles per head
        h0 = kv * group
        lse_next, di_next = fetch_rows(q_next, do_next, q, do, lse, di, b, h0, first_query, T, scale, tid)
        put_rows(sh, q_next, do_next, lse_next, di_next, tid)
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
                lse_next, di_next = fetch_rows(q_next, do_next, q, do, lse, di, b, h0 + next_step // tiles,
                                               first_query + (next_step % tiles) * TILE, T, scale, tid)
            cuda.syncthreads()
            product_over_tile(dv_acc, sh, KV_P, TW, KV_DO, DW, ty, tx, TILE)
            product_over_tile(dk_acc, sh, KV_DS, TW, KV_Q, DW, ty, tx, TILE)
            cuda.syncthreads()   # q, do, P and dS are read: the next query tile takes their place
            if has_next:
                put_rows(sh, q_next, do_next, lse_next, di_next, tid)
        for i in range(mi):
            s = s0 + _quad_index(ty, TILE_NY, i)
            for j in range(dj):
                d = _quad_index(tx, TILE_NX, j)
                if s < S and d < D:
                    dk[b, s, kv, d] = dk_acc[i, j]
                    dv[b, s, kv, d] = dv_acc[i, j]

    return (forward_kernel, forward_shared_bytes), (dq_kernel, dq_shared_bytes), (dkdv_kernel, dkdv_shared_bytes)


def forward(q, k, v):
    check_shapes(q, k, v)
    B, T, H, D = q.shape
    kernel, shared_bytes = _kernels(D)[0]
    o = runtime.empty(q.shape, q.dtype)
    lse = runtime.empty((B, H, T), q.dtype)
    # The tile index is the grid's slow dimension: the blocks with the most keys start first
    _launch_with_shared(kernel, (B * H, runtime.blocks_for(T, TILE)), THREADS, shared_bytes,
                        q, k, v, float32(1.0 / math.sqrt(D)), o, lse)
    return o, (o, lse)


_shared_limit_raised = set()


def _launch_with_shared(kernel, blocks, threads, shared_bytes, *args):
    """runtime.launch with `shared_bytes` of dynamic shared memory, first raising the compiled
    kernel's limit where that is above the default (once per kernel and argument types)."""
    if shared_bytes > STATIC_SHARED_LIMIT and not runtime.SIMULATOR:
        compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
        if compiled not in _shared_limit_raised:
            from cuda.bindings import driver as cu   # the driver API numba-cuda itself runs on

            function = compiled.library.get_cufunc()
            attribute = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            (status,) = cu.cuKernelSetAttribute(attribute, shared_bytes, function.handle, function.device.id)
            if status != cu.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"attention: cannot give a kernel {shared_bytes} bytes of shared memory: {status}")
            _shared_limit_raised.add(compiled)
    runtime.launch(kernel, blocks, threads, *args, shared_bytes=shared_bytes)


def backward(do, saved, q, k, v):
    o, lse = saved
    B, T, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    _, (dq_kernel, dq_shared_bytes), (dkdv_kernel, dkdv_shared_bytes) = _kernels(D)
    scale = float32(1.0 / math.sqrt(D))
    di = runtime.empty((B, H, T), q.dtype)
    dq = runtime.empty(q.shape, q.dtype)
    dk = runtime.empty(k.shape, k.dtype)
    dv = runtime.empty(v.shape, v.dtype)
    # As in the forward: blocks start roughly in index order, so those with the most causal steps
    # start first and the grid ends on short ones
    _launch_with_shared(dq_kernel, (B * H, runtime.blocks_for(T, TILE)), THREADS, dq_shared_bytes,
                        do, q, k, v, o, lse, scale, dq, di)
    _launch_with_shared(dkdv_kernel, (B * KV, runtime.blocks_for(S, TILE)), THREADS, dkdv_shared_bytes,
                        do, q, k, v, lse, di, scale, dk, dv)
    return dq, dk, dv
