"""RMSNorm + gate/up projections + SwiGLU for decoding on the GPU: y (N, F) = swiglu of
rmsnorm(x (N, C); g) @ w[:F].T and @ w[F:].T, w (2F, C). See ops/norm_swiglu.py for the math and
ops/cuda/row_products.py for the layout of the work.

Float32 weights: the warp of column f computes y[:, f] from the gate row w[f] and the up row
w[F + f], read side by side. bf16 weights (the decoder's): row_products.norm_tiles, on the tensor
cores, a block per 16 columns, its gate rows and its up rows side by side. Quantized weights
(q, scale, zero): row_products.quantized_rows, rmsnorm(x; g) rounded to int8 by blocks of 32 in
each block's shared memory, the warp of column f multiplying the gate row and the up row with it
side by side by dp4a. x and g may be float32 or bf16, read as float32 and accumulated in float32; y
has x's storage.
"""

import math

from numba import cuda, float32

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.device import BF16, let_next_start, stored, wait_for_previous, warp_sum
from nanoeuler_ops.cuda.row_products import (CHUNK, MANY_ROWS, STEP, THREADS, WARPS, chunk, column, dot, in_chunks,
                                             launch_norm_tiles, launch_quantized, load_trip, no_chunk,
                                             prefetch_row, product, row_group, row_slices, slice_rows, swiglu)
from nanoeuler_ops.norm_swiglu import check_shapes

TRIP = 3   # chunks of each operand a lane asks for at once (row_products)


@cuda.jit(device=True, inline=True)
def weight_trip(w, g, f, F, c):
    # a trip's chunks of the gate row w[f] * g, then of the up row w[F + f] * g
    g0, g1, g2 = chunk(g, 0, c), chunk(g, 0, c + STEP), chunk(g, 0, c + 2 * STEP)
    return (product(chunk(w, f, c), g0), product(chunk(w, f, c + STEP), g1), product(chunk(w, f, c + 2 * STEP), g2),
            product(chunk(w, F + f, c), g0), product(chunk(w, F + f, c + STEP), g1),
            product(chunk(w, F + f, c + 2 * STEP), g2))


@cuda.jit(cache=True)
def _forward(x, g, w, features, eps, group, y):
    # x (N, C), g (1, C), w (2F, C) -> y (N, F), C >= features (the rest zeros); the warp of column f
    # computes y[:, f] of its slice's rows, R = len(group) rows at a time
    N, C = x.shape
    F = y.shape[1]
    R = len(group)
    column_, lane = column()
    f = min(column_, F - 1)   # a warp past the last column repeats it, never stored
    gates = cuda.local.array(MANY_ROWS, float32)
    ups = cuda.local.array(MANY_ROWS, float32)
    squares = cuda.local.array(MANY_ROWS, float32)
    let_next_start()
    prefetch_row(w, f)
    prefetch_row(w, F + f)
    first = lane * CHUNK
    gate0 = gate1 = gate2 = up0 = up1 = up2 = no_chunk()
    lo, hi = slice_rows(N)
    for r0 in range(lo, hi, R):
        for r in range(R):
            gates[r] = 0.0
            ups[r] = 0.0
            squares[r] = 0.0
        for c in range(first, C, TRIP * STEP):   # loads first
            if load_trip(c, first, r0 == lo, C, TRIP * STEP):
                gate0, gate1, gate2, up0, up1, up2 = weight_trip(w, g, f, F, c)
            if r0 == lo and c == first:   # the first trip's weights were asked for before
                wait_for_previous()
            for r in range(R):
                if R == 1 or r0 + r < N:   # (R == 1: no test, the one row is there)
                    x0, x1, x2 = chunk(x, r0 + r, c), chunk(x, r0 + r, c + STEP), chunk(x, r0 + r, c + 2 * STEP)
                    gates[r] = dot(dot(dot(gates[r], x0, gate0), x1, gate1), x2, gate2)
                    ups[r] = dot(dot(dot(ups[r], x0, up0), x1, up1), x2, up2)
                    squares[r] = dot(dot(dot(squares[r], x0, x0), x1, x1), x2, x2)
        for r in range(R):
            if R == 1 or r0 + r < N:   # (R == 1: no test, the one row is there)
                gate, up, sum_squares = warp_sum(gates[r]), warp_sum(ups[r]), warp_sum(squares[r])
                if lane == 0 and column_ == f:
                    rstd = float32(1.0) / math.sqrt(sum_squares / float32(features) + eps)
                    y[r0 + r, f] = stored(y, swiglu(gate * rstd, up * rstd))


def forward(x, g, *w, eps):
    check_shapes(x, g, *w)
    F = w[0].shape[0] // 2
    y = runtime.empty((x.shape[0], F), x.dtype)
    if len(w) == 3:
        launch_quantized(x, w, y, g, eps, 2)
        return y, ()
    (w,) = w
    if w.dtype == BF16:
        launch_norm_tiles(x, g, w, eps, 2, y)
    else:
        runtime.launch(_forward, (runtime.blocks_for(F, WARPS), row_slices(x.shape[0])), THREADS, in_chunks(x),
                       in_chunks(g), in_chunks(w), x.shape[1], float32(eps), row_group(x.shape[0]), y, overlap=True)
    return y, ()
