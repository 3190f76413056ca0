"""RMSNorm + gate/up projections + SwiGLU for decoding on the GPU. See nanoeuler_ops/norm_swiglu.py
for the math and nanoeuler_ops.cuda.decoding.py for the layout of the work.

Block f computes y[:, f] from the gate row w[f] and the up row w[F + f], read side by side. Any
input may be float32 or bf16 (the decoder's bf16 weights beside float32 activations), read as
float32 and accumulated in float32; y has x's storage.
"""

import math

from numba import cuda, float32

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.decoding import ROWS, THREADS, UNROLL, WARPS, block_total, prefetch_row, to_partials
from nanoeuler_ops.cuda.runtime import let_next_start, stored, to_f32, wait_for_previous
from nanoeuler_ops.norm_swiglu import check_shapes


@cuda.jit(cache=True)
def _forward(x, g, w, eps, y):
    # x (N, C), g (C,), w (2F, C) -> y (N, F); block f computes column f, ROWS rows at a time
    N, C = x.shape
    F = y.shape[1]
    f = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    partial = cuda.shared.array((3, WARPS, ROWS), float32)   # [gate, up, sum of squares] per warp and row
    gate = cuda.local.array(ROWS, float32)
    up = cuda.local.array(ROWS, float32)
    squares = cuda.local.array(ROWS, float32)
    wg = cuda.local.array(UNROLL, float32)
    wu = cuda.local.array(UNROLL, float32)
    let_next_start()
    prefetch_row(w, f)
    prefetch_row(w, F + f)
    wait_for_previous()
    for r0 in range(0, N, ROWS):
        for r in range(ROWS):
            gate[r] = 0.0
            up[r] = 0.0
            squares[r] = 0.0
        c = tid
        while c + (UNROLL - 1) * THREADS < C:   # UNROLL features per thread, loads first
            for u in range(UNROLL):
                cu = c + u * THREADS
                gc = to_f32(g[cu])
                wg[u] = to_f32(w[f, cu]) * gc
                wu[u] = to_f32(w[F + f, cu]) * gc
            for r in range(ROWS):
                if r0 + r < N:
                    for u in range(UNROLL):
                        xv = to_f32(x[r0 + r, c + u * THREADS])
                        gate[r] += xv * wg[u]
                        up[r] += xv * wu[u]
                        squares[r] += xv * xv
            c += UNROLL * THREADS
        while c < C:                             # the remaining features, one at a time, same order
            gc = to_f32(g[c])
            wgv = to_f32(w[f, c]) * gc
            wuv = to_f32(w[F + f, c]) * gc
            for r in range(ROWS):
                if r0 + r < N:
                    xv = to_f32(x[r0 + r, c])
                    gate[r] += xv * wgv
                    up[r] += xv * wuv
                    squares[r] += xv * xv
            c += THREADS
        to_partials(gate, partial, 0)
        to_partials(up, partial, 1)
        to_partials(squares, partial, 2)
        cuda.syncthreads()
        if tid < ROWS and r0 + tid < N:
            rstd = float32(1.0) / math.sqrt(block_total(partial, 2, tid) / float32(C) + eps)
            z = block_total(partial, 0, tid) * rstd
            sigmoid = float32(0.5) * (float32(1.0) + math.tanh(float32(0.5) * z))  # no overflow for large -z
            y[r0 + tid, f] = stored(y, z * sigmoid * (block_total(partial, 1, tid) * rstd))
        cuda.syncthreads()


def forward(x, g, w, *, eps):
    check_shapes(x, g, w)
    F = w.shape[0] // 2
    y = runtime.empty((x.shape[0], F), x.dtype)
    runtime.launch(_forward, F, THREADS, x, g, w, float32(eps), y, overlap=True)
    return y, ()
