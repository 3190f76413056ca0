"""FlashAttention's forward in one plain kernel, to read first; the model runs the families of
simt.py, mma.py and wgmma.py instead, which compute the same with more work per thread.

Grid (B * H, T / ROWS): a block takes ROWS query rows of one (batch row b, query head h), one
thread per row. It streams the keys its rows can see in tiles of ROWS: the block's threads copy a
tile of k and v (ROWS x D each) into shared memory together, then each thread runs its row against
the tile's keys, one at a time, with the online softmax: the running max m of the row's scores,
the running sum l of exp(score - m), and the output so far acc (D floats, in registers), rescaled
by exp(m_old - m_new) whenever the max grows. At the end o = acc / l and lse = m + log l, which
the backward reads to recompute the probabilities. No (T, S) matrix is ever stored.
  causal  query t sits at position S - T + t and sees the keys s <= S - T + t
  GQA     query head h reads key/value head h // (H // KV), in place
float32 tensors; the head size D is a compile-time constant (the register arrays' size).
"""

import math
from functools import cache

import numpy as np
from numba import cuda, float32

from nanoeuler_ops.attention import check_shapes

ROWS = 32   # query rows (= threads) of a block, and keys of a streamed tile


def forward(q, k, v):
    # q (B, T, H, D), k, v (B, S, KV, D) float32 device arrays -> o (B, T, H, D); saved (o, lse (B, H, T))
    check_shapes(q, k, v)
    B, T, H, D = q.shape
    o = cuda.device_array(q.shape, np.float32)
    lse = cuda.device_array((B, H, T), np.float32)
    _forward_kernel(D)[(B * H, -(-T // ROWS)), ROWS](q, k, v, float32(1.0 / math.sqrt(D)), o, lse)
    return o, (o, lse)


@cache
def _forward_kernel(D: int):
    @cuda.jit
    def teaching_forward_kernel(q, k, v, scale, o, lse):
        T, H, S, KV = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
        b, h = cuda.blockIdx.x // H, cuda.blockIdx.x % H
        kv = h // (H // KV)                       # GQA: the key/value head this query head reads
        row = cuda.threadIdx.x
        t = cuda.blockIdx.y * ROWS + row          # this thread's query row
        last_key = (S - T) + t                    # causal: the newest key it sees
        k_tile = cuda.shared.array((ROWS, D), float32)
        v_tile = cuda.shared.array((ROWS, D), float32)
        q_row = cuda.local.array(D, float32)
        acc = cuda.local.array(D, float32)
        for d in range(D):
            q_row[d] = q[b, min(t, T - 1), h, d] * scale   # rows past T compute along, never written
            acc[d] = 0.0
        m, l = float32(-math.inf), float32(0.0)
        keys_end = min(S, (S - T) + cuda.blockIdx.y * ROWS + ROWS)   # the keys the block's last row sees
        for s0 in range(0, keys_end, ROWS):
            s = min(s0 + row, S - 1)              # thread `row` copies key s0 + row of the tile
            for d in range(D):
                k_tile[row, d] = k[b, s, kv, d]
                v_tile[row, d] = v[b, s, kv, d]
            cuda.syncthreads()                    # the whole tile is in shared memory
            for j in range(min(ROWS, keys_end - s0)):
                if s0 + j <= last_key:
                    score = float32(0.0)
                    for d in range(D):
                        score += q_row[d] * k_tile[j, d]
                    m_new = max(m, score)
                    rescale = math.exp(m - m_new)   # what was summed under the old max, to the new one
                    p = math.exp(score - m_new)
                    l = l * rescale + p
                    for d in range(D):
                        acc[d] = acc[d] * rescale + p * v_tile[j, d]
                    m = m_new
            cuda.syncthreads()                    # every thread is done with the tile: the next may overwrite it
        if t < T:
            for d in range(D):
                o[b, t, h, d] = acc[d] / l
            lse[b, h, t] = m + math.log(l)

    return teaching_forward_kernel
