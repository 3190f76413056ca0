"""FlashAttention forward and backward on the GPU (FlashAttention-2 blocking). See ops/attention.py for the math.

No (T, S) matrix is ever stored: a thread block stages a tile of query rows and a tile of keys
in shared memory, and each thread computes a small register tile of their scores, so every
value read from shared memory feeds several multiply-adds. The forward keeps a running max and
sum per query row (the online softmax). Tiles wholly in the causal future are never loaded.
Query head h reads key/value head h // (H // KV) in place: repeated K/V are never materialised.

Kernels:
  _forward   block = FWD_ROWS query rows of one (b, h), streaming FWD_KEYS keys per tile; thread
             (ty, tx) owns the register-tile rows ty + NY*i and columns tx + NX*j; writes o and lse.
  _row_dot   Di = rowsum(do * o), the FlashAttention-2 backward's correction term; one warp a row.
  _dq        block = BWD_TILE query rows of one (b, h), streaming BWD_TILE keys per step;
             P recomputed from lse.
  _dkdv      block = BWD_TILE keys of one (b, kv head), streaming BWD_TILE query rows per step
             of every query head of its group, so the group's gradients add up in registers:
             no atomics, no races.
The forward's tiles fit the 48 KB of static shared memory; the backward's larger tiles (8 x 4
register tiles per thread, read as 16-byte quads) take ~100 KB of dynamic shared memory, a limit
raised once per compiled kernel. The head size D is a compile-time constant (register tiles are
unrolled), so each D gets its own kernels.
"""

import math
from functools import cache

from numba import cuda, float32, uint64

from nanoeuler_ops.attention import check_shapes
from nanoeuler_ops.cuda import runtime

FWD_ROWS, FWD_KEYS, FWD_THREADS = 64, 32, 128
NX = 8           # threads along the forward's register-tile columns (keys or head dims)
# Backward: BWD_TILE query rows x BWD_TILE keys per step; thread (ty, tx) owns the row quads
# ty + BWD_NY*n and the column quads tx + BWD_NX*n (a quad = 4 neighbouring rows or columns).
BWD_TILE, BWD_NY, BWD_NX = 64, 8, 16
BWD_THREADS = BWD_NY * BWD_NX
QUAD = 4
STAGE_BATCH = 8   # global loads each thread has in flight while staging a tile into shared memory
SHARED_ALIGN = None if runtime.SIMULATOR else 16   # 16-byte aligned shared memory (the simulator takes no alignment)
STATIC_SHARED_LIMIT = 48 * 1024   # bytes a kernel gets without raising its dynamic shared memory limit
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


@cuda.jit(device=True, inline=True)
def _quad_index(thread, n_threads, i):
    # the i-th row (or column) a thread owns: quads thread, thread + n_threads, ... of QUAD each
    return (thread + n_threads * (i // QUAD)) * QUAD + i % QUAD


@cache
def _quad_product(MI, MJ):
    """A device function acc[i, j] += sum_{k < n} A[k, row i] * B[k, column j] over one backward
    thread's MI x MJ register tile, A and B k-major in the shared buffer sh: A[k, r] at
    sh[a + k * a_width + r], B[k, c] at sh[b + k * b_width + c]. Offsets and widths are multiples of
    QUAD, and unsigned indices (no negative-index wraparound) let the compiler load each quad at once."""

    @cuda.jit(device=True, inline=True)
    def product(acc, sh, a, a_width, b, b_width, ty, tx, n):
        for k in range(n):
            a_k = a + k * a_width + ty * QUAD
            b_k = b + k * b_width + tx * QUAD
            for i in range(MI):
                a_ki = sh[uint64(a_k + BWD_NY * QUAD * (i // QUAD)) + uint64(i % QUAD)]
                for j in range(MJ):
                    acc[i, j] += a_ki * sh[uint64(b_k + BWD_NX * QUAD * (j // QUAD)) + uint64(j % QUAD)]

    return product


def _bwd_cols_padded(D: int) -> int:
    """D rounded up to a multiple of BWD_TILE (itself a multiple of QUAD * BWD_NX): the head-dim
    columns of the backward's tiles, so P and dS fit where q^T and do^T were."""
    return -(-D // BWD_TILE) * BWD_TILE


@cache
def _kernels(D: int):
    """The four attention kernels compiled for head size D (the backward two with their shared memory bytes)."""
    DP = _cols_padded(D)
    W = DP + 1   # shared row width: the +1 puts the rows a warp reads at one column in distinct banks
    DJ = DP // NX   # head-dim columns per thread
    fwd_p_width = FWD_KEYS + 1
    DPB = _bwd_cols_padded(D)

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

    # The backward kernels keep every tile in one dynamic shared buffer, k-major (the summed index
    # first), so a thread's four neighbouring rows or columns are one aligned 16-byte load.
    TW = BWD_TILE + QUAD   # row width of a tile indexed by query rows or keys (padded against bank conflicts)
    DW = DPB + QUAD        # row width of a tile indexed by head dims
    mi, mj, dj = BWD_TILE // BWD_NY, BWD_TILE // BWD_NX, DPB // BWD_NX
    bwd_scores = _quad_product(mi, mj)   # tile x tile products over the head dims
    bwd_grads = _quad_product(mi, dj)    # tile x head-dim products over the tile's keys or rows

    @cuda.jit(device=True, inline=True)
    def stage(sh, base, width, transposed, x, b, row0, head, n_rows, scale, tid):
        # BWD_TILE rows of scale * x[b, row0 + r, head, :D] (zeros past n_rows and D, up to DPB) into
        # sh[base + d * width + r] if transposed else sh[base + r * width + d]
        # STAGE_BATCH loads are issued before their stores, so their latencies overlap
        values = cuda.local.array(STAGE_BATCH, float32)
        for i0 in range(tid, BWD_TILE * DPB, BWD_THREADS * STAGE_BATCH):
            for n in range(STAGE_BATCH):
                i = i0 + n * BWD_THREADS
                r, d = i // DPB, i % DPB
                inside = i < BWD_TILE * DPB and row0 + r < n_rows and d < D
                values[n] = x[b, row0 + r, head, d] * scale if inside else float32(0.0)
            for n in range(STAGE_BATCH):
                i = i0 + n * BWD_THREADS
                r, d = i // DPB, i % DPB
                if i < BWD_TILE * DPB:
                    sh[base + d * width + r if transposed else base + r * width + d] = values[n]

    # dq shared buffer (offsets in floats): q^T, do^T, k^T, v^T (DPB x TW), k (BWD_TILE x DW), dS^T (BWD_TILE x TW)
    DQ_QT, DQ_DOT, DQ_KT, DQ_VT = 0, DPB * TW, 2 * DPB * TW, 3 * DPB * TW
    DQ_K = 4 * DPB * TW
    DQ_DST = DQ_K + BWD_TILE * DW
    dq_shared_bytes = 4 * (DQ_DST + BWD_TILE * TW)

    @cuda.jit(fastmath=True)
    def dq_kernel(do, q, k, v, lse, di, scale, dq):
        # do, q (B, T, H, D), k, v (B, S, KV, D), lse, di (B, H, T) -> dq (B, T, H, D);
        # grid (T / BWD_TILE, B * H), BWD_THREADS threads: BWD_TILE query rows against BWD_TILE keys per step
        B, T, H, _ = q.shape
        S, KV = k.shape[1], k.shape[2]
        b, h = cuda.blockIdx.y // H, cuda.blockIdx.y % H
        kv = h // (H // KV)
        tid = cuda.threadIdx.x
        ty, tx = tid // BWD_NX, tid % BWD_NX
        t0 = cuda.blockIdx.x * BWD_TILE
        sh = cuda.shared.array(0, float32, alignment=SHARED_ALIGN)
        scores = cuda.local.array((mi, mj), float32)
        dp = cuda.local.array((mi, mj), float32)
        acc = cuda.local.array((mi, dj), float32)
        row_lse = cuda.local.array(mi, float32)
        row_di = cuda.local.array(mi, float32)
        zero(acc)
        stage(sh, DQ_QT, TW, True, q, b, t0, h, T, scale, tid)
        stage(sh, DQ_DOT, TW, True, do, b, t0, h, T, float32(1.0), tid)
        for i in range(mi):
            t = t0 + _quad_index(ty, BWD_NY, i)
            row_lse[i] = lse[b, h, t] if t < T else float32(0.0)
            row_di[i] = di[b, h, t] if t < T else float32(0.0)
        keys_end = min(S, (S - T) + t0 + BWD_TILE)
        for s0 in range(0, keys_end, BWD_TILE):
            cuda.syncthreads()
            stage(sh, DQ_KT, TW, True, k, b, s0, kv, S, float32(1.0), tid)
            stage(sh, DQ_VT, TW, True, v, b, s0, kv, S, float32(1.0), tid)
            stage(sh, DQ_K, DW, False, k, b, s0, kv, S, float32(1.0), tid)
            cuda.syncthreads()
            zero(scores)
            zero(dp)
            bwd_scores(scores, sh, DQ_QT, TW, DQ_KT, TW, ty, tx, D)
            bwd_scores(dp, sh, DQ_DOT, TW, DQ_VT, TW, ty, tx, D)
            for i in range(mi):
                r = _quad_index(ty, BWD_NY, i)
                last_key = (S - T) + t0 + r
                for j in range(mj):
                    c = _quad_index(tx, BWD_NX, j)
                    ds = float32(0.0)
                    if s0 + c <= last_key:
                        ds = math.exp(scores[i, j] - row_lse[i]) * (dp[i, j] - row_di[i])
                    sh[DQ_DST + c * TW + r] = ds
            cuda.syncthreads()
            bwd_grads(acc, sh, DQ_DST, TW, DQ_K, DW, ty, tx, BWD_TILE)
        for i in range(mi):
            t = t0 + _quad_index(ty, BWD_NY, i)
            for j in range(dj):
                d = _quad_index(tx, BWD_NX, j)
                if t < T and d < D:
                    dq[b, t, h, d] = acc[i, j] * scale

    # dkdv shared buffer: k^T, v^T (DPB x TW, staged once), then per query tile q^T, do^T (DPB x TW; once
    # the scores are done, P and dS (BWD_TILE x TW) overwrite them), q, do (BWD_TILE x DW), lse, di
    KV_KT, KV_VT, KV_QT, KV_DOT = 0, DPB * TW, 2 * DPB * TW, 3 * DPB * TW
    KV_P, KV_DS = KV_QT, KV_DOT
    KV_Q = 4 * DPB * TW
    KV_DO = KV_Q + BWD_TILE * DW
    KV_LSE = KV_DO + BWD_TILE * DW
    KV_DI = KV_LSE + BWD_TILE
    dkdv_shared_bytes = 4 * (KV_DI + BWD_TILE)

    @cuda.jit(fastmath=True)
    def dkdv_kernel(do, q, k, v, lse, di, scale, dk, dv):
        # do, q (B, T, H, D), k, v (B, S, KV, D), lse, di (B, H, T) -> dk, dv (B, S, KV, D);
        # grid (S / BWD_TILE, B * KV), BWD_THREADS threads: BWD_TILE keys against BWD_TILE query rows per
        # step, over every query head of the group, so the group's gradients add up in registers
        B, T, H, _ = q.shape
        S, KV = k.shape[1], k.shape[2]
        group = H // KV
        b, kv = cuda.blockIdx.y // KV, cuda.blockIdx.y % KV
        tid = cuda.threadIdx.x
        ty, tx = tid // BWD_NX, tid % BWD_NX
        s0 = cuda.blockIdx.x * BWD_TILE
        sh = cuda.shared.array(0, float32, alignment=SHARED_ALIGN)
        scores = cuda.local.array((mi, mj), float32)   # transposed: [key, query row]
        dp = cuda.local.array((mi, mj), float32)
        row_lse = cuda.local.array(mj, float32)
        row_di = cuda.local.array(mj, float32)
        dk_acc = cuda.local.array((mi, dj), float32)
        dv_acc = cuda.local.array((mi, dj), float32)
        zero(dk_acc)
        zero(dv_acc)
        stage(sh, KV_KT, TW, True, k, b, s0, kv, S, float32(1.0), tid)
        stage(sh, KV_VT, TW, True, v, b, s0, kv, S, float32(1.0), tid)
        first_query = max(0, s0 - (S - T))   # earlier queries see none of this block's keys
        for h in range(kv * group, (kv + 1) * group):
            for t0 in range(first_query, T, BWD_TILE):
                cuda.syncthreads()
                stage(sh, KV_QT, TW, True, q, b, t0, h, T, scale, tid)
                stage(sh, KV_DOT, TW, True, do, b, t0, h, T, float32(1.0), tid)
                stage(sh, KV_Q, DW, False, q, b, t0, h, T, scale, tid)
                stage(sh, KV_DO, DW, False, do, b, t0, h, T, float32(1.0), tid)
                if tid < BWD_TILE:
                    inside = t0 + tid < T
                    sh[KV_LSE + tid] = lse[b, h, t0 + tid] if inside else float32(0.0)
                    sh[KV_DI + tid] = di[b, h, t0 + tid] if inside else float32(0.0)
                cuda.syncthreads()
                zero(scores)
                zero(dp)
                bwd_scores(scores, sh, KV_KT, TW, KV_QT, TW, ty, tx, D)
                bwd_scores(dp, sh, KV_VT, TW, KV_DOT, TW, ty, tx, D)
                for j in range(mj):
                    c = _quad_index(tx, BWD_NX, j)
                    row_lse[j] = sh[KV_LSE + c]
                    row_di[j] = sh[KV_DI + c]
                cuda.syncthreads()   # q^T and do^T are read: P and dS take their place
                for i in range(mi):
                    r = _quad_index(ty, BWD_NY, i)
                    for j in range(mj):
                        c = _quad_index(tx, BWD_NX, j)
                        p = float32(0.0)
                        if t0 + c < T and s0 + r <= (S - T) + t0 + c:
                            p = math.exp(scores[i, j] - row_lse[j])
                        sh[KV_P + c * TW + r] = p
                        sh[KV_DS + c * TW + r] = p * (dp[i, j] - row_di[j])
                cuda.syncthreads()
                bwd_grads(dv_acc, sh, KV_P, TW, KV_DO, DW, ty, tx, BWD_TILE)
                bwd_grads(dk_acc, sh, KV_DS, TW, KV_Q, DW, ty, tx, BWD_TILE)
        for i in range(mi):
            s = s0 + _quad_index(ty, BWD_NY, i)
            for j in range(dj):
                d = _quad_index(tx, BWD_NX, j)
                if s < S and d < D:
                    dk[b, s, kv, d] = dk_acc[i, j]
                    dv[b, s, kv, d] = dv_acc[i, j]

    return forward, row_dot, (dq_kernel, dq_shared_bytes), (dkdv_kernel, dkdv_shared_bytes)


def forward(q, k, v):
    check_shapes(q, k, v)
    B, T, H, D = q.shape
    kernel = _kernels(D)[0]
    o = runtime.empty(q.shape, q.dtype)
    lse = runtime.empty((B, H, T), q.dtype)
    runtime.launch(kernel, (runtime.blocks_for(T, FWD_ROWS), B * H), FWD_THREADS,
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
    _, row_dot, (dq_kernel, dq_shared_bytes), (dkdv_kernel, dkdv_shared_bytes) = _kernels(D)
    scale = float32(1.0 / math.sqrt(D))
    di = runtime.empty((B, H, T), q.dtype)
    dq = runtime.empty(q.shape, q.dtype)
    dk = runtime.empty(k.shape, k.dtype)
    dv = runtime.empty(v.shape, v.dtype)
    rows_per_block = ROW_DOT_THREADS // runtime.WARP
    runtime.launch(row_dot, runtime.blocks_for(B * T * H, rows_per_block), ROW_DOT_THREADS, do, o, di)
    _launch_with_shared(dq_kernel, (runtime.blocks_for(T, BWD_TILE), B * H), BWD_THREADS, dq_shared_bytes,
                        do, q, k, v, lse, di, scale, dq)
    _launch_with_shared(dkdv_kernel, (runtime.blocks_for(S, BWD_TILE), B * KV), BWD_THREADS, dkdv_shared_bytes,
                        do, q, k, v, lse, di, scale, dk, dv)
    return dq, dk, dv
