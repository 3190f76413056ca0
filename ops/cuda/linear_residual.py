"""Residual linear update for decoding on the GPU. See nanoeuler_ops/linear_residual.py for the
math and nanoeuler_ops.cuda.decoding.py for the layout of the work (the warp of column o computes
y[:, o]). Any input may be float32 or bf16 (the decoder's bf16 weights beside float32
activations), read as float32 and accumulated in float32; y has r's storage."""

from numba import cuda, float32

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.decoding import (CHUNK, ROWS, STEP, THREADS, WARPS, chunk, column,
                                         dot, in_chunks, load_trip, no_chunk, prefetch_row, row_group)
from nanoeuler_ops.cuda.runtime import let_next_start, stored, to_f32, wait_for_previous, warp_sum
from nanoeuler_ops.linear_residual import check_shapes

TRIP = 8   # chunks of each operand a lane asks for at once (nanoeuler_ops.cuda.decoding)


@cuda.jit(device=True, inline=True)
def weight_trip(w, o, c):
    return (chunk(w, o, c), chunk(w, o, c + STEP), chunk(w, o, c + 2 * STEP), chunk(w, o, c + 3 * STEP),
            chunk(w, o, c + 4 * STEP), chunk(w, o, c + 5 * STEP), chunk(w, o, c + 6 * STEP), chunk(w, o, c + 7 * STEP))


@cuda.jit(cache=True)
def _forward(x, w, res, group, y):
    # x (N, I), w (O, I), res (N, O) -> y (N, O) = res + x @ w.T (I past the features: zeros); the warp
    # of column o computes y[:, o], R = len(group) rows at a time
    N, I = x.shape
    R = len(group)
    column_, lane = column()
    o = min(column_, w.shape[0] - 1)   # a warp past the last column repeats it, never stored
    dots = cuda.local.array(ROWS, float32)
    let_next_start()
    prefetch_row(w, o)
    first = lane * CHUNK
    w0 = w1 = w2 = w3 = w4 = w5 = w6 = w7 = no_chunk()
    for r0 in range(0, N, R):
        for r in range(R):
            dots[r] = 0.0
        for c in range(first, I, TRIP * STEP):   # loads first
            if load_trip(c, first, r0, I, TRIP):
                w0, w1, w2, w3, w4, w5, w6, w7 = weight_trip(w, o, c)
            if r0 == 0 and c == first:   # the first trip's weights were asked for before
                wait_for_previous()
            for r in range(R):
                if R == 1 or r0 + r < N:   # (R == 1: no test, the one row is there)
                    n = r0 + r
                    a = dot(dot(dot(dot(dots[r], chunk(x, n, c), w0), chunk(x, n, c + STEP), w1),
                                chunk(x, n, c + 2 * STEP), w2), chunk(x, n, c + 3 * STEP), w3)
                    dots[r] = dot(dot(dot(dot(a, chunk(x, n, c + 4 * STEP), w4), chunk(x, n, c + 5 * STEP), w5),
                                      chunk(x, n, c + 6 * STEP), w6), chunk(x, n, c + 7 * STEP), w7)
        for r in range(R):
            if R == 1 or r0 + r < N:   # (R == 1: no test, the one row is there)
                total = warp_sum(dots[r])
                if lane == 0 and column_ == o:
                    y[r0 + r, o] = stored(y, to_f32(res[r0 + r, o]) + total)


def forward(x, w, r):
    check_shapes(x, w, r)
    y = runtime.empty(r.shape, r.dtype)
    runtime.launch(_forward, runtime.blocks_for(w.shape[0], WARPS), THREADS, in_chunks(x), in_chunks(w), r,
                   row_group(x.shape[0]), y, overlap=True)
    return y, ()
