"""RMSNorm + linear for decoding on the GPU: y (N, O) = rmsnorm(x (N, C); g) @ w (O, C).T. See
ops/norm_linear.py for the math and ops/cuda/row_products.py for the layout of the work.

Float32 weights: the warp of column o computes y[:, o]: each lane walks its chunks of features once
per group of rows, accumulating both the dot products with w[o] * g and the sums of squares; rstd
is applied at the end. bf16 weights (the decoder's): row_products.norm_tiles, on the tensor cores,
a block per 16 columns, the products of w with x * g, rstd applied at the end. Quantized weights
(q, scale, zero): row_products.quantized_rows, rmsnorm(x; g) rounded to int8 by blocks of 32 in
each block's shared memory, a warp per column as for float32, multiplying integers by dp4a. x and
g may be float32 or bf16, read as float32 and accumulated in float32; y has x's storage.
"""

import math

from numba import cuda, float32

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.device import BF16, let_next_start, stored, wait_for_previous, warp_sum
from nanoeuler_ops.cuda.row_products import (CHUNK, MANY_ROWS, STEP, THREADS, WARPS, chunk, column, dot, in_chunks,
                                             launch_norm_tiles, launch_quantized, load_trip, no_chunk,
                                             prefetch_row, product, row_group, row_slices, slice_rows)
from nanoeuler_ops.norm_linear import check_shapes

TRIP = 4   # chunks of each operand a lane asks for at once (row_products)


@cuda.jit(device=True, inline=True)
def weight_trip(w, g, o, c):
    # a trip's chunks of w[o] * g
    return (product(chunk(w, o, c), chunk(g, 0, c)), product(chunk(w, o, c + STEP), chunk(g, 0, c + STEP)),
            product(chunk(w, o, c + 2 * STEP), chunk(g, 0, c + 2 * STEP)),
            product(chunk(w, o, c + 3 * STEP), chunk(g, 0, c + 3 * STEP)))


@cuda.jit(cache=True)
def _forward(x, g, w, features, eps, group, y):
    # x (N, C), g (1, C), w (O, C) -> y (N, O), C >= features (the rest zeros); the warp of column o
    # computes y[:, o] of its slice's rows, R = len(group) rows at a time
    N, C = x.shape
    R = len(group)
    column_, lane = column()
    o = min(column_, w.shape[0] - 1)   # a warp past the last column repeats it, never stored
    dots = cuda.local.array(MANY_ROWS, float32)
    squares = cuda.local.array(MANY_ROWS, float32)
    let_next_start()
    prefetch_row(w, o)
    first = lane * CHUNK
    w0 = w1 = w2 = w3 = no_chunk()
    lo, hi = slice_rows(N)
    for r0 in range(lo, hi, R):
        for r in range(R):
            dots[r] = 0.0
            squares[r] = 0.0
        for c in range(first, C, TRIP * STEP):   # loads first
            if load_trip(c, first, r0 == lo, C, TRIP * STEP):
                w0, w1, w2, w3 = weight_trip(w, g, o, c)
            if r0 == lo and c == first:   # the first trip's weights were asked for before
                wait_for_previous()
            for r in range(R):
                if R == 1 or r0 + r < N:   # (R == 1: no test, the one row is there)
                    x0 = chunk(x, r0 + r, c)
                    x1 = chunk(x, r0 + r, c + STEP)
                    x2 = chunk(x, r0 + r, c + 2 * STEP)
                    x3 = chunk(x, r0 + r, c + 3 * STEP)
                    dots[r] = dot(dot(dot(dot(dots[r], x0, w0), x1, w1), x2, w2), x3, w3)
                    squares[r] = dot(dot(dot(dot(squares[r], x0, x0), x1, x1), x2, x2), x3, x3)
        for r in range(R):
            if R == 1 or r0 + r < N:   # (R == 1: no test, the one row is there)
                total, sum_squares = warp_sum(dots[r]), warp_sum(squares[r])
                if lane == 0 and column_ == o:
                    rstd = float32(1.0) / math.sqrt(sum_squares / float32(features) + eps)
                    y[r0 + r, o] = stored(y, total * rstd)


def forward(x, g, *w, eps):
    check_shapes(x, g, *w)
    y = runtime.empty((x.shape[0], w[0].shape[0]), x.dtype)
    if len(w) == 3:
        launch_quantized(x, w, y, g, eps, 1)
        return y, ()
    (w,) = w
    if w.dtype == BF16:
        launch_norm_tiles(x, g, w, eps, 1, y)
    else:
        runtime.launch(_forward, (runtime.blocks_for(w.shape[0], WARPS), row_slices(x.shape[0])), THREADS,
                       in_chunks(x), in_chunks(g), in_chunks(w), x.shape[1], float32(eps), row_group(x.shape[0]), y,
                       overlap=True)
    return y, ()
