"""RMSNorm on the GPU. See nanoeuler_ops/rmsnorm.py for the math.

Forward: one warp per row, the sum of squares reduced with warp shuffles.
Backward: each block walks a share of the rows, one warp per row (dx needs the row's
dot(dy * w, xhat), a warp reduction); each warp adds its rows' dy * xhat into its own row of a
shared-memory buffer, so no two threads write one dw element. Each block then writes one
partial row, and a second kernel sums the partials: deterministic, no atomics.
"""

import math

from numba import cuda, float32

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.runtime import WARP, warp_sum

FORWARD_ROWS = 4           # rows (warps) per block in the forward
SHARED_BYTES = 48 * 1024   # the default per-block limit of dynamic shared memory
MAX_PARTIALS = 256         # blocks of the backward: enough to fill the GPU, few partial rows


@cuda.jit(cache=True)
def _forward(x, w, eps, y, rstd):
    # x (N, C), w (C,) -> y (N, C), rstd (N,); one warp per row
    N, C = x.shape
    n = cuda.blockIdx.x * (cuda.blockDim.x // WARP) + cuda.threadIdx.x // WARP
    lane = cuda.threadIdx.x % WARP
    ss = float32(0.0)
    if n < N:
        for c in range(lane, C, WARP):
            ss += x[n, c] * x[n, c]
    ss = warp_sum(ss)
    if n < N:
        r = float32(1.0) / math.sqrt(ss / float32(C) + eps)
        if lane == 0:
            rstd[n] = r
        for c in range(lane, C, WARP):
            y[n, c] = x[n, c] * r * w[c]


@cuda.jit(cache=True)
def _backward(dy, x, w, rstd, dx, dw_partial):
    # dy, x (N, C), w (C,), rstd (N,) -> dx (N, C), dw_partial (P, C) with P = gridDim.x;
    # one warp per row, warps of a block accumulate dw in shared (warps, C)
    N, C = x.shape
    warps = cuda.blockDim.x // WARP
    warp = cuda.threadIdx.x // WARP
    lane = cuda.threadIdx.x % WARP
    dw_warp = cuda.shared.array(0, float32)
    for c in range(lane, C, WARP):
        dw_warp[warp * C + c] = 0.0
    for first in range(cuda.blockIdx.x * warps, N, cuda.gridDim.x * warps):
        n = first + warp
        dot = float32(0.0)
        if n < N:
            for c in range(lane, C, WARP):
                dot += dy[n, c] * w[c] * x[n, c]
        dot = warp_sum(dot)
        if n < N:
            r = rstd[n]
            dot = dot * r / float32(C)
            for c in range(lane, C, WARP):
                xhat = x[n, c] * r
                dw_warp[warp * C + c] += dy[n, c] * xhat
                dx[n, c] = r * (dy[n, c] * w[c] - xhat * dot)
    cuda.syncthreads()
    for c in range(cuda.threadIdx.x, C, cuda.blockDim.x):
        total = float32(0.0)
        for i in range(warps):
            total += dw_warp[i * C + c]
        dw_partial[cuda.blockIdx.x, c] = total


@cuda.jit(cache=True)
def _sum_rows(partial, out):
    # partial (P, C) -> out (C,) = partial summed over its rows; one thread per column
    c = cuda.grid(1)
    if c < out.shape[0]:
        total = float32(0.0)
        for p in range(partial.shape[0]):
            total += partial[p, c]
        out[c] = total


def forward(x, w, *, eps):
    N, C = x.shape
    y = runtime.empty(x.shape, x.dtype)
    rstd = runtime.empty((N,), x.dtype)
    runtime.launch(_forward, runtime.blocks_for(N, FORWARD_ROWS), FORWARD_ROWS * WARP,
                   x, w, float32(eps), y, rstd)
    return y, (rstd,)


def backward(dy, saved, x, w, *, eps):
    (rstd,) = saved
    N, C = x.shape
    warps = min(8, SHARED_BYTES // (4 * C))
    if warps < 1:
        raise ValueError(f"rmsnorm on the GPU supports rows of at most {SHARED_BYTES // 4} elements, got {C}")
    blocks = min(MAX_PARTIALS, runtime.blocks_for(N, warps))
    dx = runtime.empty(x.shape, x.dtype)
    dw_partial = runtime.empty((blocks, C), x.dtype)
    dw = runtime.empty((C,), x.dtype)
    runtime.launch(_backward, blocks, warps * WARP, dy, x, w, rstd, dx, dw_partial, shared_bytes=4 * warps * C)
    runtime.launch(_sum_rows, runtime.blocks_for(C, 256), 256, dw_partial, dw)
    return dx, dw
