"""RMSNorm on the GPU, plain and after a residual add (ops add_rmsnorm and rmsnorm share these
kernels). See ops/rmsnorm.py and add_rmsnorm.py for the math. x, w, y and dx are float32
or bf16 storage; the statistics, rstd and dw are float32.

Rows are read and written in pairs of neighbouring elements (`device.pairs`: one 4-byte word per
two bf16, one 8-byte word per two float32), so C must be even. One warp takes one row at a time:
lane l holds the row's pairs l, l + 32, l + 64, ... in registers, loaded once; nothing is read twice
from memory. How many pairs a lane holds (K = ceil(C / 64), at most MAX_WORDS) must be known when a
kernel compiles, so that its loops unroll and its arrays live in registers: the kernels take it as
`lane_words`, a tuple of K zeros, whose length Numba knows (one compilation per K). Rows of more
than 64 * MAX_WORDS elements are refused.

Forward: one warp per row; the sum of squares reduced with warp shuffles, then y from the registers.
With a residual, the warp first writes s = x + branch and normalises s as stored.
Backward: each block walks a share of the rows (grid-stride), one warp per row; in one pass over the
row in registers a lane adds its columns' dy * xhat into its own slots of a shared-memory buffer
(so no two threads write one dw element) and the row's dot(dy * w, xhat) is reduced over the warp;
then dx (plus the stream's gradient ds where there is one) from the same registers. Each block
writes one partial row of dw, and `_sum_partials` adds the partial rows up, many threads per
column, in a fixed order: deterministic, no atomics.
"""

import math

import numpy as np
from numba import cuda, float32, uint64

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.device import WARP, pair_values, pairs, stored_pair, warp_sum
from nanoeuler_ops.rmsnorm import check_shapes

MAX_WORDS = 32             # pairs of a row one lane may hold: rows of up to 2 * 32 * 32 = 2048 elements
FORWARD_ROWS = 4           # rows (warps) per block in the forward
BACKWARD_WARPS = 8         # warps per block in the backward (dw buffer: 8 * C * 4 bytes of shared memory)
MIN_ROWS_PER_WARP = 2      # the backward's blocks are few enough that each warp walks several rows
MAX_PARTIALS = 256         # blocks of the backward: enough to fill the GPU, few partial rows to sum
SLICES = 8                 # threads that sum one column of the partials, each a fixed share of the rows


# Rows are passed as flat runs of pair words, (N * P,) with P = C / 2 pairs a row, and indexed with
# unsigned integers: no negative-index wraparound. u64(n) * P + p is pair p of row n.

@cuda.jit(device=True, inline=True)
def _load_row(a, n, P, lane, K, words):
    # words[k] <- pair lane + 32 k of row n of a, k < K (P pairs a row, P = 0 for no row); one warp
    row = uint64(n) * uint64(P)
    for k in range(K):
        p = lane + WARP * k
        if p < P:
            words[k] = a[row + uint64(p)]


@cuda.jit(device=True, inline=True)
def _normalize_row(s, w, eps, n, P, lane, K, y, rstd):
    # row n of y = s * rstd * w, rstd[n] = 1 / sqrt(mean(s^2) + eps), from the row's pairs s held as by
    # _load_row (P pairs a row, P = 0 for no row: the warp still joins the reduction); one warp
    ss = float32(0.0)
    for k in range(K):
        if lane + WARP * k < P:
            lo, hi = pair_values(s[k])
            ss += lo * lo + hi * hi
    ss = warp_sum(ss)
    if P > 0:
        r = float32(1.0) / math.sqrt(ss / float32(2 * P) + eps)
        if lane == 0:
            rstd[n] = r
        row = uint64(n) * uint64(P)
        for k in range(K):
            p = lane + WARP * k
            if p < P:
                lo, hi = pair_values(s[k])
                w_lo, w_hi = pair_values(w[p])
                y[row + uint64(p)] = stored_pair(y, lo * r * w_lo, hi * r * w_hi)


@cuda.jit(cache=True)
def _forward(x, w, eps, N, lane_words, y, rstd):
    # x (N * P pairs), w (P pairs) -> y (N * P pairs), rstd (N,); one warp per row
    K = len(lane_words)
    n = cuda.blockIdx.x * (cuda.blockDim.x // WARP) + cuda.threadIdx.x // WARP
    lane = cuda.threadIdx.x % WARP
    P = w.shape[0] if n < N else 0
    row = cuda.local.array(MAX_WORDS, x.dtype)
    _load_row(x, n, P, lane, K, row)
    _normalize_row(row, w, eps, n, P, lane, K, y, rstd)


@cuda.jit(cache=True)
def _add_forward(x, branch, w, eps, N, lane_words, s, y, rstd):
    # x, branch (N * P pairs), w (P pairs) -> s = x + branch, y = rmsnorm(s) (N * P pairs), rstd (N,);
    # one warp per row
    K = len(lane_words)
    n = cuda.blockIdx.x * (cuda.blockDim.x // WARP) + cuda.threadIdx.x // WARP
    lane = cuda.threadIdx.x % WARP
    P = w.shape[0] if n < N else 0
    row_x = cuda.local.array(MAX_WORDS, x.dtype)
    row_branch = cuda.local.array(MAX_WORDS, branch.dtype)
    row_s = cuda.local.array(MAX_WORDS, s.dtype)
    _load_row(x, n, P, lane, K, row_x)
    _load_row(branch, n, P, lane, K, row_branch)
    row = uint64(n) * uint64(P)
    for k in range(K):
        p = lane + WARP * k
        if p < P:
            x_lo, x_hi = pair_values(row_x[k])
            b_lo, b_hi = pair_values(row_branch[k])
            row_s[k] = stored_pair(s, x_lo + b_lo, x_hi + b_hi)
            s[row + uint64(p)] = row_s[k]
    _normalize_row(row_s, w, eps, n, P, lane, K, y, rstd)


@cuda.jit(cache=True)
def _backward(dy, x, w, rstd, ds, has_ds, N, lane_words, dx, dw_partial):
    # dy, x (N * P pairs), w (P pairs), rstd (N,), ds (N * P pairs) if has_ds -> dx (N * P pairs) (+ ds),
    # dw_partial (blocks, 2 P); rows grid-stride, one warp per row. Shared dw buffer (warps, 2, P): a
    # warp's sums for the first and the second element of each pair, lane-owned slots (no conflicts).
    K = len(lane_words)
    P = w.shape[0]
    warps = cuda.blockDim.x // WARP
    warp = cuda.threadIdx.x // WARP
    lane = cuda.threadIdx.x % WARP
    dw_warp = cuda.shared.array(0, float32)
    lo_slot = uint64(warp) * uint64(2 * P)     # dw_warp[lo_slot + p]: the first elements; + P: the second
    for p in range(lane, P, WARP):
        dw_warp[lo_slot + uint64(p)] = 0.0
        dw_warp[lo_slot + uint64(P + p)] = 0.0
    row_dy = cuda.local.array(MAX_WORDS, dy.dtype)
    row_x = cuda.local.array(MAX_WORDS, x.dtype)
    row_ds = cuda.local.array(MAX_WORDS, ds.dtype)
    for first in range(cuda.blockIdx.x * warps, N, cuda.gridDim.x * warps):
        n = first + warp
        pairs_here = P if n < N else 0
        _load_row(dy, n, pairs_here, lane, K, row_dy)
        _load_row(x, n, pairs_here, lane, K, row_x)
        if has_ds:
            _load_row(ds, n, pairs_here, lane, K, row_ds)
        r = rstd[n] if n < N else float32(0.0)
        dot = float32(0.0)
        for k in range(K):
            p = lane + WARP * k
            if p < pairs_here:
                d_lo, d_hi = pair_values(row_dy[k])
                x_lo, x_hi = pair_values(row_x[k])
                w_lo, w_hi = pair_values(w[p])
                dot += d_lo * w_lo * x_lo + d_hi * w_hi * x_hi
                dw_warp[lo_slot + uint64(p)] += d_lo * (x_lo * r)
                dw_warp[lo_slot + uint64(P + p)] += d_hi * (x_hi * r)
        dot = warp_sum(dot) * r / float32(2 * P)
        row = uint64(n) * uint64(P)
        for k in range(K):
            p = lane + WARP * k
            if p < pairs_here:
                d_lo, d_hi = pair_values(row_dy[k])
                x_lo, x_hi = pair_values(row_x[k])
                w_lo, w_hi = pair_values(w[p])
                g_lo = r * (d_lo * w_lo - x_lo * r * dot)
                g_hi = r * (d_hi * w_hi - x_hi * r * dot)
                if has_ds:
                    s_lo, s_hi = pair_values(row_ds[k])
                    g_lo += s_lo
                    g_hi += s_hi
                dx[row + uint64(p)] = stored_pair(dx, g_lo, g_hi)
    cuda.syncthreads()
    for c in range(cuda.threadIdx.x, 2 * P, cuda.blockDim.x):
        slot = uint64(c // 2 + (c % 2) * P)    # element c is the first (c even) or second of pair c // 2
        total = float32(0.0)
        for i in range(warps):
            total += dw_warp[uint64(i) * uint64(2 * P) + slot]
        dw_partial[cuda.blockIdx.x, c] = total


@cuda.jit(cache=True)
def _sum_partials(partial, out, accumulate):
    # partial (B, C) -> out (C,) = partial summed over its rows (+ out with accumulate); B <= MAX_PARTIALS.
    # Block (32, SLICES): a column per threadIdx.x; slice j sums rows j, j + SLICES, ..., then slice 0
    # adds the slices in order.
    c = cuda.blockIdx.x * WARP + cuda.threadIdx.x
    j = cuda.threadIdx.y
    sums = cuda.shared.array((SLICES, WARP), float32)
    total = float32(0.0)
    if c < out.shape[0]:
        for i in range(MAX_PARTIALS // SLICES):   # a fixed trip count: unrolled, every load in flight
            b = j + SLICES * i
            if b < partial.shape[0]:
                total += partial[b, c]
    sums[j, cuda.threadIdx.x] = total
    cuda.syncthreads()
    if j == 0 and c < out.shape[0]:
        total = float32(0.0)
        for i in range(SLICES):
            total += sums[i, cuda.threadIdx.x]
        out[c] = out[c] + total if accumulate else total


def _lane_words(C):
    """`lane_words` for rows of C elements: a tuple of as many zeros as pairs a lane holds."""
    if C % 2 or C > 2 * WARP * MAX_WORDS:
        raise ValueError(f"rmsnorm on the GPU takes rows of an even number of elements, at most "
                         f"{2 * WARP * MAX_WORDS}; got {C}")
    return (0,) * max(1, -(-C // (2 * WARP)))


def forward(x, w, *, eps):
    check_shapes(x, w)
    N, C = x.shape
    y = runtime.empty(x.shape, x.dtype)
    rstd = runtime.empty((N,), np.float32)
    runtime.launch(_forward, runtime.blocks_for(N, FORWARD_ROWS), FORWARD_ROWS * WARP,
                   pairs(x), pairs(w), float32(eps), N, _lane_words(C), pairs(y), rstd)
    return y, (rstd,)


def add_forward(x, branch, w, *, eps):
    N, C = x.shape
    s = runtime.empty(x.shape, x.dtype)
    y = runtime.empty(x.shape, x.dtype)
    rstd = runtime.empty((N,), np.float32)
    runtime.launch(_add_forward, runtime.blocks_for(N, FORWARD_ROWS), FORWARD_ROWS * WARP,
                   pairs(x), pairs(branch), pairs(w), float32(eps), N, _lane_words(C), pairs(s), pairs(y), rstd)
    return (s, y), (s, rstd)


def backward(dy, saved, x, w, *, eps, ds=None, into=None):
    """dx (N, C) and dw (C,) (added into into[1] where given); with ds, the stream's gradient, dx
    includes it (add_rmsnorm's backward)."""
    (rstd,) = saved
    N, C = x.shape
    lane_words = _lane_words(C)
    blocks = min(MAX_PARTIALS, runtime.blocks_for(N, BACKWARD_WARPS * MIN_ROWS_PER_WARP))
    dx = runtime.empty(x.shape, x.dtype)
    dw_partial = runtime.empty((blocks, C), np.float32)
    dw_into = into[1] if into else None
    dw = runtime.empty((C,), np.float32) if dw_into is None else dw_into
    runtime.launch(_backward, blocks, BACKWARD_WARPS * WARP, pairs(dy), pairs(x), pairs(w), rstd,
                   pairs(dy if ds is None else ds), ds is not None, N, lane_words, pairs(dx), dw_partial,
                   shared_bytes=4 * BACKWARD_WARPS * C)
    runtime.launch(_sum_partials, runtime.blocks_for(C, WARP), (WARP, SLICES), dw_partial, dw, dw_into is not None)
    return dx, dw
