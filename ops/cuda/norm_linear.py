"""RMSNorm + linear for decoding on the GPU. See nanoeuler_ops/norm_linear.py for the math and
nanoeuler_ops.cuda.decoding.py for the layout of the work.

Block o computes y[:, o]: each thread walks its features once per group of rows, accumulating
both the dot products with w[o] * g and the sums of squares; rstd is applied at the end. Any input
may be float32 or bf16 (the decoder's bf16 weights beside float32 activations), read as float32
and accumulated in float32; y has x's storage.
"""

import math

from numba import cuda, float32

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.decoding import ROWS, THREADS, UNROLL, WARPS, block_total, prefetch_row, to_partials
from nanoeuler_ops.cuda.runtime import let_next_start, stored, to_f32, wait_for_previous
from nanoeuler_ops.norm_linear import check_shapes


@cuda.jit(cache=True)
def _forward(x, g, w, eps, y):
    # x (N, C), g (C,), w (O, C) -> y (N, O); block o computes column o, ROWS rows at a time
    N, C = x.shape
    o = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    partial = cuda.shared.array((2, WARPS, ROWS), float32)   # [dot, sum of squares] per warp and row
    dot = cuda.local.array(ROWS, float32)
    squares = cuda.local.array(ROWS, float32)
    wg = cuda.local.array(UNROLL, float32)
    let_next_start()
    prefetch_row(w, o)
    wait_for_previous()
    for r0 in range(0, N, ROWS):
        for r in range(ROWS):
            dot[r] = 0.0
            squares[r] = 0.0
        c = tid
        while c + (UNROLL - 1) * THREADS < C:   # UNROLL features per thread, loads first
            for u in range(UNROLL):
                wg[u] = to_f32(w[o, c + u * THREADS]) * to_f32(g[c + u * THREADS])
            for r in range(ROWS):
                if r0 + r < N:
                    for u in range(UNROLL):
                        xv = to_f32(x[r0 + r, c + u * THREADS])
                        dot[r] += xv * wg[u]
                        squares[r] += xv * xv
            c += UNROLL * THREADS
        while c < C:                             # the remaining features, one at a time, same order
            wv = to_f32(w[o, c]) * to_f32(g[c])
            for r in range(ROWS):
                if r0 + r < N:
                    xv = to_f32(x[r0 + r, c])
                    dot[r] += xv * wv
                    squares[r] += xv * xv
            c += THREADS
        to_partials(dot, partial, 0)
        to_partials(squares, partial, 1)
        cuda.syncthreads()
        if tid < ROWS and r0 + tid < N:
            rstd = float32(1.0) / math.sqrt(block_total(partial, 1, tid) / float32(C) + eps)
            y[r0 + tid, o] = stored(y, block_total(partial, 0, tid) * rstd)
        cuda.syncthreads()


def forward(x, g, w, *, eps):
    check_shapes(x, g, w)
    y = runtime.empty((x.shape[0], w.shape[0]), x.dtype)
    runtime.launch(_forward, w.shape[0], THREADS, x, g, w, float32(eps), y, overlap=True)
    return y, ()
