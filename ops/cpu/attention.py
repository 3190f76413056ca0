"""Causal GQA attention on the CPU, flash-style. See nanoeuler_ops/attention.py for the math.

The forward walks each query row over blocks of keys with an online softmax, so no (T, S) score
matrix exists; only lse is kept. The backward recomputes P from lse one score at a time.
"""

import numpy as np
from numba import njit, prange

from nanoeuler_ops.attention import check_shapes
from nanoeuler_ops.cpu.common import REDUCE_FASTMATH, exp32

QUERY_BLOCK = 16   # query rows per forward task: enough tasks to balance the causal triangle
KEY_BLOCK = 64     # keys per online-softmax step: the scores of one block fit in L1


@njit(parallel=True, cache=True, fastmath=REDUCE_FASTMATH)
def _forward(q, k, v, o, lse):
    # q (B, T, H, D), k, v (B, S, KV, D) -> o (B, T, H, D), lse (B, H, T)
    B, T, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    group = H // KV
    scale = np.float32(1.0 / np.sqrt(D))
    n_blocks = (T + QUERY_BLOCK - 1) // QUERY_BLOCK
    for task in prange(B * H * n_blocks):
        b, h, block = task // (H * n_blocks), task // n_blocks % H, task % n_blocks
        kv = h // group
        scores = np.empty(KEY_BLOCK, dtype=np.float32)
        for t in range(block * QUERY_BLOCK, min(T, (block + 1) * QUERY_BLOCK)):
            q_row, o_row = q[b, t, h], o[b, t, h]
            o_row[:] = 0.0
            n_keys = S - T + t + 1  # causal: keys 0 .. S - T + t
            row_max = np.float32(-np.inf)
            row_sum = np.float32(0.0)
            for s0 in range(0, n_keys, KEY_BLOCK):
                s1 = min(s0 + KEY_BLOCK, n_keys)
                block_max = np.float32(-np.inf)
                for s in range(s0, s1):
                    dot = np.float32(0.0)
                    for d in range(D):
                        dot += q_row[d] * k[b, s, kv, d]
                    score = dot * scale
                    scores[s - s0] = score
                    block_max = max(block_max, score)
                # rescale what the earlier blocks summed to the new running max
                new_max = max(row_max, block_max)
                rescale = exp32(row_max - new_max)
                row_max = new_max
                row_sum *= rescale
                for d in range(D):
                    o_row[d] *= rescale
                for s in range(s0, s1):
                    p = exp32(scores[s - s0] - row_max)
                    row_sum += p
                    for d in range(D):
                        o_row[d] += p * v[b, s, kv, d]
            for d in range(D):
                o_row[d] /= row_sum
            lse[b, h, t] = row_max + np.log(row_sum)


@njit(parallel=True, cache=True, fastmath=REDUCE_FASTMATH)
def _backward(do, q, k, v, o, lse, dq, dk, dv):
    # do, q, o (B, T, H, D), k, v (B, S, KV, D), lse (B, H, T) -> dq (B, T, H, D), dk, dv (B, S, KV, D)
    # One task per (b, kv head): it owns dk and dv of that head and dq of the query heads that read
    # it, so no two tasks write the same element.
    B, T, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    group = H // KV
    scale = np.float32(1.0 / np.sqrt(D))
    for task in prange(B * KV):
        b, kv = task // KV, task % KV
        dk[b, :, kv] = 0.0
        dv[b, :, kv] = 0.0
        for h in range(kv * group, (kv + 1) * group):
            for t in range(T):
                q_row, do_row, dq_row = q[b, t, h], do[b, t, h], dq[b, t, h]
                dq_row[:] = 0.0
                di = np.float32(0.0)
                for d in range(D):
                    di += do_row[d] * o[b, t, h, d]
                row_lse = lse[b, h, t]
                for s in range(S - T + t + 1):
                    qk = np.float32(0.0)
                    dp = np.float32(0.0)
                    for d in range(D):
                        qk += q_row[d] * k[b, s, kv, d]
                        dp += do_row[d] * v[b, s, kv, d]
                    p = exp32(qk * scale - row_lse)
                    dscore = p * (dp - di) * scale
                    for d in range(D):
                        dv[b, s, kv, d] += p * do_row[d]
                        dk[b, s, kv, d] += dscore * q_row[d]
                        dq_row[d] += dscore * k[b, s, kv, d]


def forward(q, k, v):
    check_shapes(q, k, v)
    B, T, H, D = q.shape
    o = np.empty_like(q)
    lse = np.empty((B, H, T), dtype=q.dtype)
    _forward(q, k, v, o, lse)
    return o, (o, lse)


def backward(do, saved, q, k, v):
    o, lse = saved
    dq = np.empty_like(q)
    dk = np.empty_like(k)
    dv = np.empty_like(v)
    _backward(do, q, k, v, o, lse, dq, dk, dv)
    return dq, dk, dv
