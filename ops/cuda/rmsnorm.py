"""RMSNorm on the GPU, plain and after a residual add (ops add_rmsnorm and rmsnorm share these
kernels). See nanoeuler_ops/rmsnorm.py and add_rmsnorm.py for the math. x, w, y and dx are float32
or bf16 storage; the statistics, rstd and dw are float32.

Forward: one warp per row, the sum of squares reduced with warp shuffles; with a residual, the
warp first writes s = x + branch and normalises s as stored.
Backward: each block walks a share of the rows, one warp per row (dx needs the row's
dot(dy * w, xhat), a warp reduction), adding the stream's gradient ds where there is one; each
warp adds its rows' dy * xhat into its own row of a shared-memory buffer, so no two threads write
one dw element. Each block then writes one partial row, and a second kernel sums the partials:
deterministic, no atomics.
"""

import math

import numpy as np
from numba import cuda, float32, uint64

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.runtime import WARP, stored, to_f32, warp_sum

FORWARD_ROWS = 4           # rows (warps) per block in the forward
SHARED_BYTES = 48 * 1024   # the default per-block limit of dynamic shared memory
MAX_PARTIALS = 256         # blocks of the backward: enough to fill the GPU, few partial rows for _sum_rows


# Rows are passed flat, (N * C,), and indexed with unsigned integers: no negative-index
# wraparound per element. u64(n) * C + c is element c of row n.

@cuda.jit(device=True, inline=True)
def _normalize_row(x, w, eps, ss, n, N, lane, y, rstd):
    # row n of y = x * rstd * w, rstd = 1 / sqrt(ss / C + eps), ss the row's sum of squares; one warp
    C = w.shape[0]
    if n < N:
        row = uint64(n) * uint64(C)
        r = float32(1.0) / math.sqrt(ss / float32(C) + eps)
        if lane == 0:
            rstd[n] = r
        for c in range(lane, C, WARP):
            i = row + uint64(c)
            y[i] = stored(y, to_f32(x[i]) * r * to_f32(w[uint64(c)]))


@cuda.jit(cache=True)
def _forward(x, w, eps, N, y, rstd):
    # x (N * C,), w (C,) -> y (N * C,), rstd (N,); one warp per row
    C = w.shape[0]
    n = cuda.blockIdx.x * (cuda.blockDim.x // WARP) + cuda.threadIdx.x // WARP
    lane = cuda.threadIdx.x % WARP
    row = uint64(n) * uint64(C)
    ss = float32(0.0)
    if n < N:
        for c in range(lane, C, WARP):
            xv = to_f32(x[row + uint64(c)])
            ss += xv * xv
    _normalize_row(x, w, eps, warp_sum(ss), n, N, lane, y, rstd)


@cuda.jit(cache=True)
def _add_forward(x, branch, w, eps, N, s, y, rstd):
    # x, branch (N * C,), w (C,) -> s = x + branch, y = rmsnorm(s) (N * C,), rstd (N,); one warp per row
    C = w.shape[0]
    n = cuda.blockIdx.x * (cuda.blockDim.x // WARP) + cuda.threadIdx.x // WARP
    lane = cuda.threadIdx.x % WARP
    row = uint64(n) * uint64(C)
    ss = float32(0.0)
    if n < N:
        for c in range(lane, C, WARP):
            i = row + uint64(c)
            stored_sum = stored(s, to_f32(x[i]) + to_f32(branch[i]))
            s[i] = stored_sum
            sv = to_f32(stored_sum)
            ss += sv * sv
    _normalize_row(s, w, eps, warp_sum(ss), n, N, lane, y, rstd)


@cuda.jit(cache=True)
def _backward(dy, x, w, rstd, ds, has_ds, N, dx, dw_partial):
    # dy, x (N * C,), w (C,), rstd (N,), ds (N * C,) if has_ds -> dx (N * C,) (+ ds), dw_partial (P, C)
    # with P = gridDim.x; one warp per row, warps of a block accumulate dw in shared (warps, C)
    C = w.shape[0]
    warps = cuda.blockDim.x // WARP
    warp = cuda.threadIdx.x // WARP
    lane = cuda.threadIdx.x % WARP
    dw_warp = cuda.shared.array(0, float32)
    for c in range(lane, C, WARP):
        dw_warp[warp * C + c] = 0.0
    for first in range(cuda.blockIdx.x * warps, N, cuda.gridDim.x * warps):
        n = first + warp
        row = uint64(n) * uint64(C)
        dot = float32(0.0)
        if n < N:
            for c in range(lane, C, WARP):
                i = row + uint64(c)
                dot += to_f32(dy[i]) * to_f32(w[uint64(c)]) * to_f32(x[i])
        dot = warp_sum(dot)
        if n < N:
            r = rstd[n]
            dot = dot * r / float32(C)
            for c in range(lane, C, WARP):
                i = row + uint64(c)
                xhat = to_f32(x[i]) * r
                d = to_f32(dy[i])
                dw_warp[warp * C + c] += d * xhat
                grad = r * (d * to_f32(w[uint64(c)]) - xhat * dot)
                if has_ds:
                    grad += to_f32(ds[i])
                dx[i] = stored(dx, grad)
    cuda.syncthreads()
    for c in range(cuda.threadIdx.x, C, cuda.blockDim.x):
        total = float32(0.0)
        for i in range(warps):
            total += dw_warp[i * C + c]
        dw_partial[cuda.blockIdx.x, c] = total


@cuda.jit(cache=True)
def _sum_rows(partial, out, accumulate):
    # partial (P, C) -> out (C,) = partial summed over its rows (+ out with accumulate); one thread per column
    c = cuda.grid(1)
    if c < out.shape[0]:
        total = out[c] if accumulate else float32(0.0)
        for p in range(partial.shape[0]):
            total += partial[p, c]
        out[c] = total


def _flat(x):
    return x.reshape(x.size)


def forward(x, w, *, eps):
    N, C = x.shape
    y = runtime.empty(x.shape, x.dtype)
    rstd = runtime.empty((N,), np.float32)
    runtime.launch(_forward, runtime.blocks_for(N, FORWARD_ROWS), FORWARD_ROWS * WARP,
                   _flat(x), w, float32(eps), N, _flat(y), rstd)
    return y, (rstd,)


def add_forward(x, branch, w, *, eps):
    N, C = x.shape
    s = runtime.empty(x.shape, x.dtype)
    y = runtime.empty(x.shape, x.dtype)
    rstd = runtime.empty((N,), np.float32)
    runtime.launch(_add_forward, runtime.blocks_for(N, FORWARD_ROWS), FORWARD_ROWS * WARP,
                   _flat(x), _flat(branch), w, float32(eps), N, _flat(s), _flat(y), rstd)
    return (s, y), (s, rstd)


def backward(dy, saved, x, w, *, eps, ds=None, into=None):
    """dx (N, C) and dw (C,) (added into into[1] where given); with ds, the stream's gradient, dx
    includes it (add_rmsnorm's backward)."""
    (rstd,) = saved
    N, C = x.shape
    warps = min(8, SHARED_BYTES // (4 * C))
    if warps < 1:
        raise ValueError(f"rmsnorm on the GPU supports rows of at most {SHARED_BYTES // 4} elements, got {C}")
    blocks = min(MAX_PARTIALS, runtime.blocks_for(N, warps))
    dx = runtime.empty(x.shape, x.dtype)
    dw_partial = runtime.empty((blocks, C), np.float32)
    dw_into = into[1] if into else None
    dw = runtime.empty((C,), np.float32) if dw_into is None else dw_into
    runtime.launch(_backward, blocks, warps * WARP, _flat(dy), _flat(x), w, rstd, _flat(dy if ds is None else ds),
                   ds is not None, N, _flat(dx), dw_partial, shared_bytes=4 * warps * C)
    runtime.launch(_sum_rows, runtime.blocks_for(C, 256), 256, dw_partial, dw, dw_into is not None)
    return dx, dw
