"""Residual linear update for decoding on the GPU. See nanoeuler_ops/linear_residual.py for the
math and nanoeuler_ops.cuda.decoding.py for the layout of the work (block o computes y[:, o]). Any
input may be float32 or bf16 (the decoder's bf16 weights beside float32 activations), read as
float32 and accumulated in float32; y has r's storage."""

from numba import cuda, float32

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.decoding import ROWS, THREADS, UNROLL, WARPS, block_total, prefetch_row, to_partials
from nanoeuler_ops.cuda.runtime import let_next_start, stored, to_f32, wait_for_previous
from nanoeuler_ops.linear_residual import check_shapes


@cuda.jit(cache=True)
def _forward(x, w, res, y):
    # x (N, I), w (O, I), res (N, O) -> y (N, O) = res + x @ w.T; block o computes column o
    N, I = x.shape
    o = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    partial = cuda.shared.array((1, WARPS, ROWS), float32)
    dot = cuda.local.array(ROWS, float32)
    wc = cuda.local.array(UNROLL, float32)
    let_next_start()
    prefetch_row(w, o)
    wait_for_previous()
    for r0 in range(0, N, ROWS):
        for r in range(ROWS):
            dot[r] = 0.0
        c = tid
        while c + (UNROLL - 1) * THREADS < I:   # UNROLL features per thread, loads first
            for u in range(UNROLL):
                wc[u] = to_f32(w[o, c + u * THREADS])
            for r in range(ROWS):
                if r0 + r < N:
                    for u in range(UNROLL):
                        dot[r] += to_f32(x[r0 + r, c + u * THREADS]) * wc[u]
            c += UNROLL * THREADS
        while c < I:                             # the remaining features, one at a time, same order
            wv = to_f32(w[o, c])
            for r in range(ROWS):
                if r0 + r < N:
                    dot[r] += to_f32(x[r0 + r, c]) * wv
            c += THREADS
        to_partials(dot, partial, 0)
        cuda.syncthreads()
        if tid < ROWS and r0 + tid < N:
            y[r0 + tid, o] = stored(y, to_f32(res[r0 + tid, o]) + block_total(partial, 0, tid))
        cuda.syncthreads()


def forward(x, w, r):
    check_shapes(x, w, r)
    y = runtime.empty(r.shape, r.dtype)
    runtime.launch(_forward, w.shape[0], THREADS, x, w, r, y, overlap=True)
    return y, ()
