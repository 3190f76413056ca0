"""Causal GQA attention on the CPU, on sgemm blocks. See ops/attention.py for the math.

As in PyTorch's CPU path, no (T, S) score matrix exists: a task walks its query rows in blocks
of QUERY_BLOCK and holds only one block's scores against the keys it sees (QUERY_BLOCK x S floats).
The products (scores = q k^T and o = P v in the forward, five in the backward) are sgemm calls,
one OpenBLAS thread per task, on blocks of the arrays in place (common.sgemm: the rows of one head
in q (B, T, H, D) are H * D floats apart); only the keys (and, in the backward, the values) of a
head are copied, transposed to (D, S). Why: a head has only D = 32 or 64 elements, too short for
hand-written loops to keep the vector units busy (the flash-style loop kernel this replaces ran at
~30 GFLOP/s per core), while sgemm's packed micro-kernels run near the core's peak. Between the
products, each row's softmax is a few vectorized passes (max32, exp32). Without a usable OpenBLAS,
the same sgemm calls run plain loops (common._loop_sgemm): one algorithm either way.

Forward: one task per (batch, query head). A block of rows t0 .. t1 - 1 multiplies against the
keys 0 .. S - T + t1 - 1 (its last row's); the keys past a row's own last one get probability 0.
lse is saved, and the backward recomputes P = exp(scores - lse) instead of storing it
(FlashAttention-2).

Backward: one task per (batch, key/value head) owns dk and dv of that head, summed with beta = 1
sgemm over the group's query heads and their query blocks in a fixed order, and writes dq of the
group's query heads. No two tasks write one element, and no sum depends on the thread count: deterministic.
"""

import numpy as np
from numba import njit, prange

from nanoeuler_ops.attention import check_shapes
from nanoeuler_ops.cpu.common import REDUCE_FASTMATH, exp32, max32, one_blas_thread, sgemm

QUERY_BLOCK = 32   # query rows per block: sgemm is as fast on 32 rows as on 64, and the causal
                   # triangle wasted in the block on the diagonal is half as large


def forward(q, k, v):
    # q (B, T, H, D), k, v (B, S, KV, D) -> o (B, T, H, D); saved (o, lse (B, H, T))
    check_shapes(q, k, v)
    q, k, v = (np.ascontiguousarray(x, dtype=np.float32) for x in (q, k, v))   # sgemm's layout
    B, T, H, D = q.shape
    o = np.empty_like(q)
    lse = np.empty((B, H, T), dtype=np.float32)
    with one_blas_thread():
        _forward(q, k, v, o, lse)
    return o, (o, lse)


def backward(do, saved, q, k, v):
    # do (B, T, H, D) -> dq (B, T, H, D), dk, dv (B, S, KV, D)
    o, lse = saved
    do, q, k, v = (np.ascontiguousarray(x, dtype=np.float32) for x in (do, q, k, v))
    dq = np.empty_like(q)
    dk = np.empty_like(k)
    dv = np.empty_like(v)
    with one_blas_thread():
        _backward(do, q, k, v, o, lse, dq, dk, dv)
    return dq, dk, dv


# ------------------------------------------------------------------------------------------------
# the kernels. In sgemm's terms (element offset, rows apart): a query block of one head is
# rows x D at q_at of q, do, o or dq, H * D apart; the values (keys) of one head are S x D at kv_at
# of v, dv or dk, KV * D apart; k_t and v_t, their transposes, D x S, S apart; a block's scores
# (probabilities, dS) are rows x n in p (ds), n apart, of which n are the keys its last row sees.


@njit(parallel=True, cache=True, fastmath=REDUCE_FASTMATH)
def _forward(q, k, v, o, lse):
    # q (B, T, H, D), k, v (B, S, KV, D) -> o (B, T, H, D), lse (B, H, T): one task per (b, query head)
    B, T, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    scale = np.float32(1.0 / np.sqrt(D))
    for task in prange(B * H):
        b, h = task // H, task % H
        kv = h // (H // KV)
        kv_at = (b * S * KV + kv) * D
        k_t = _transposed(k, b, kv)
        p = np.empty(QUERY_BLOCK * S, dtype=np.float32)
        for t0 in range(0, T, QUERY_BLOCK):
            rows = min(T - t0, QUERY_BLOCK)
            n = S - T + t0 + rows   # the keys the block's last row sees
            q_at = ((b * T + t0) * H + h) * D
            # p (rows, n) = scale q_block k[:n]^T, then each row's softmax; o_block = p v[:n]
            sgemm(False, False, rows, n, D, scale, q, q_at, H * D, k_t, 0, S, 0.0, p, 0, n)
            for i in range(rows):
                lse[b, h, t0 + i] = _softmax_row(p[i * n:(i + 1) * n], n - rows + i + 1)
            sgemm(False, False, rows, D, n, 1.0, p, 0, n, v, kv_at, KV * D, 0.0, o, q_at, H * D)


@njit(parallel=True, cache=True, fastmath=REDUCE_FASTMATH)
def _backward(do, q, k, v, o, lse, dq, dk, dv):
    # do, q, o (B, T, H, D), k, v (B, S, KV, D), lse (B, H, T) -> dq (B, T, H, D), dk, dv (B, S, KV, D):
    # one task per (b, key/value head) owns dk and dv of that head and dq of the group's query heads
    B, T, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    group = H // KV
    scale = np.float32(1.0 / np.sqrt(D))
    for task in prange(B * KV):
        b, kv = task // KV, task % KV
        kv_at = (b * S * KV + kv) * D
        dk[b, :, kv, :] = 0.0
        dv[b, :, kv, :] = 0.0
        k_t, v_t = _transposed(k, b, kv), _transposed(v, b, kv)
        p = np.empty(QUERY_BLOCK * S, dtype=np.float32)    # probabilities P of a block
        ds = np.empty(QUERY_BLOCK * S, dtype=np.float32)   # do v^T, then dS / scale
        for h in range(kv * group, (kv + 1) * group):
            for t0 in range(0, T, QUERY_BLOCK):
                rows = min(T - t0, QUERY_BLOCK)
                n = S - T + t0 + rows
                q_at = ((b * T + t0) * H + h) * D
                # p (rows, n) = scale q_block k[:n]^T, ds = do_block v[:n]^T; then row by row P and dS / scale
                sgemm(False, False, rows, n, D, scale, q, q_at, H * D, k_t, 0, S, 0.0, p, 0, n)
                sgemm(False, False, rows, n, D, 1.0, do, q_at, H * D, v_t, 0, S, 0.0, ds, 0, n)
                for i in range(rows):
                    t = t0 + i
                    di = np.float32(0.0)
                    for d in range(D):
                        di += do[b, t, h, d] * o[b, t, h, d]
                    _probs_and_dscores_row(p[i * n:(i + 1) * n], ds[i * n:(i + 1) * n], n - rows + i + 1,
                                           lse[b, h, t], di)
                # dq_block = scale dS k[:n]; dk[:n] += scale dS^T q_block; dv[:n] += P^T do_block
                sgemm(False, False, rows, D, n, scale, ds, 0, n, k, kv_at, KV * D, 0.0, dq, q_at, H * D)
                sgemm(True, False, n, D, rows, scale, ds, 0, n, q, q_at, H * D, 1.0, dk, kv_at, KV * D)
                sgemm(True, False, n, D, rows, 1.0, p, 0, n, do, q_at, H * D, 1.0, dv, kv_at, KV * D)


# ------------------------------------------------------------------------------------------------
# their building blocks


@njit
def _transposed(x, b, head):
    # x (B, S, KV, D) -> x[b, :, head, :]^T, (D, S): sgemm multiplies by it untransposed; given the
    # (S, D) rows to transpose, it ran at 57 % (32 query rows) to 80 % (64) of that speed
    S, D = x.shape[1], x.shape[3]
    x_t = np.empty((D, S), dtype=np.float32)
    for s in range(S):
        for d in range(D):
            x_t[d, s] = x[b, s, head, d]
    return x_t


# one row of a block: its n scores, of which the row sees the first `seen` (the rest become 0)


@njit(fastmath=REDUCE_FASTMATH)
def _softmax_row(p, seen):
    # scores p -> probabilities in place; returns lse = log(sum_j exp(p[j]))
    top = max32(p, seen)
    total = np.float32(0.0)
    for j in range(seen):
        e = exp32(p[j] - top)
        p[j] = e
        total += e
    inv = np.float32(1.0) / total
    for j in range(seen):
        p[j] *= inv
    p[seen:] = 0.0
    return top + np.log(total)


@njit(fastmath=REDUCE_FASTMATH)
def _probs_and_dscores_row(p, ds, seen, row_lse, di):
    # scores p -> P = exp(p - lse); ds = do . v -> dS / scale = P (do . v - Di), both in place
    for j in range(seen):
        e = exp32(p[j] - row_lse)
        p[j] = e
        ds[j] = e * (ds[j] - di)
    p[seen:] = 0.0
    ds[seen:] = 0.0
