"""Residual linear update for decoding on the GPU: y (N, O) = r (N, O) + x (N, I) @ w (O, I).T. See
ops/linear_residual.py for the math and ops/cuda/row_products.py for the layout of the work: for
float32 weights the warp of column o computes y[:, o]; for bf16 weights (the decoder's) a block per
16 columns computes them on the tensor cores, its MMA_WARPS warps splitting the features (w_down's
2,048 go faster over 16 warps than over 8); for quantized weights (q, scale, zero) x is rounded to
int8 by blocks of 32 in each block's shared memory and the warp of column o multiplies its row of q
with it by dp4a (row_products.quantized_rows).
x and r may be float32 or bf16, read as float32 and accumulated in float32; y has r's storage."""

from numba import cuda, float32, uint32

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.device import BF16, let_next_start, stored, to_f32, wait_for_previous, warp_sum
from nanoeuler_ops.cuda.row_products import (BLOCK, CHUNK, GROUP, MANY_ROWS, STEP, THREADS, TILE, WARP, WARPS,
                                             chunk, column, dot, in_chunks, launch_quantized, load_trip, load_words,
                                             mma_block, mma_lane, no_chunk, no_sums, prefetch_row, row_chunk,
                                             row_group, row_slices, share_sums, slice_rows, sums_bytes, tile_entry,
                                             tile_groups, tile_rows, trip_feature, warps_total)
from nanoeuler_ops.linear_residual import check_shapes

TRIP = 8   # chunks of each operand a lane asks for at once (row_products)
MMA_WARPS = 16   # warps of a tensor-core block
MMA_TRIP = 4   # blocks of features a warp asks for at once: 16 warps x 4 x 32, w_down's 2,048


@cuda.jit(device=True, inline=True)
def weight_trip(w, o, c):
    return (chunk(w, o, c), chunk(w, o, c + STEP), chunk(w, o, c + 2 * STEP), chunk(w, o, c + 3 * STEP),
            chunk(w, o, c + 4 * STEP), chunk(w, o, c + 5 * STEP), chunk(w, o, c + 6 * STEP), chunk(w, o, c + 7 * STEP))


@cuda.jit(cache=True)
def _forward(x, w, res, group, y):
    # x (N, I), w (O, I), res (N, O) -> y (N, O) = res + x @ w.T (I past the features: zeros); the warp
    # of column o computes y[:, o] of its slice's rows, R = len(group) rows at a time
    N, I = x.shape
    R = len(group)
    column_, lane = column()
    o = min(column_, w.shape[0] - 1)   # a warp past the last column repeats it, never stored
    dots = cuda.local.array(MANY_ROWS, float32)
    let_next_start()
    prefetch_row(w, o)
    first = lane * CHUNK
    w0 = w1 = w2 = w3 = w4 = w5 = w6 = w7 = no_chunk()
    lo, hi = slice_rows(N)
    for r0 in range(lo, hi, R):
        for r in range(R):
            dots[r] = 0.0
        for c in range(first, I, TRIP * STEP):   # loads first
            if load_trip(c, first, r0 == lo, I, TRIP * STEP):
                w0, w1, w2, w3, w4, w5, w6, w7 = weight_trip(w, o, c)
            if r0 == lo and c == first:   # the first trip's weights were asked for before
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


@cuda.jit(device=True, inline=True)
def mma_group_trip(acc, weights, x, row, c0, warp, t):
    """A group's sums (`no_sums`) plus the products of a trip of weights with features c0.. of the
    group's rows (this lane's: `row`)."""
    for j in range(MMA_TRIP):
        acc = mma_block(acc, weights, j, row_chunk(x, row, trip_feature(c0, j, warp, t, MMA_WARPS)))
    return acc


@cuda.jit(cache=True)
def _forward_mma(x, w, res, groups, y):
    # x (N, I), w (O, I) bf16, res (N, O) -> y (N, O) = res + x @ w.T (I past the features: zeros);
    # block (b, s) computes y[:, 16b:16b+16] of slice s's rows on the tensor cores, its G = len(groups)
    # groups of GROUP rows through each trip of weights before the next trip (row_products.norm_tiles);
    # the warps' sums in dynamic shared memory, sums_bytes(MMA_WARPS, G)
    N, I = x.shape
    G = len(groups)
    warp, i, t = mma_lane()
    top, bottom = tile_rows(w, cuda.blockIdx.x * TILE, i)
    weights = cuda.local.array((MMA_TRIP, 8), uint32)
    sums = cuda.shared.array(0, float32)
    let_next_start()
    stride = MMA_WARPS * MMA_TRIP * BLOCK
    lo, hi = slice_rows(N)
    acc0 = acc1 = acc2 = acc3 = no_sums()
    for c0 in range(0, I, stride):   # loads first
        for j in range(MMA_TRIP):
            load_words(weights, j, w, top, bottom, trip_feature(c0, j, warp, t, MMA_WARPS))
        if c0 == 0:   # the first trip's weights were asked for before
            wait_for_previous()
        acc0 = mma_group_trip(acc0, weights, x, lo + i, c0, warp, t)
        if G > 1:   # groups past the slice's rows are skipped by every warp
            if lo + GROUP < hi:
                acc1 = mma_group_trip(acc1, weights, x, lo + GROUP + i, c0, warp, t)
            if lo + 2 * GROUP < hi:
                acc2 = mma_group_trip(acc2, weights, x, lo + 2 * GROUP + i, c0, warp, t)
            if lo + 3 * GROUP < hi:
                acc3 = mma_group_trip(acc3, weights, x, lo + 3 * GROUP + i, c0, warp, t)
    share_sums(sums, 0, G, warp, acc0)
    if G > 1:
        share_sums(sums, 1, G, warp, acc1)
        share_sums(sums, 2, G, warp, acc2)
        share_sums(sums, 3, G, warp, acc3)
    cuda.syncthreads()
    for e in range(cuda.threadIdx.x, TILE * GROUP * G, MMA_WARPS * WARP):
        group = e // (TILE * GROUP)
        col, m, lane, k = tile_entry(e % (TILE * GROUP))
        o, n = cuda.blockIdx.x * TILE + col, lo + group * GROUP + m
        if o < w.shape[0] and n < hi:
            y[n, o] = stored(y, to_f32(res[n, o]) + warps_total(sums, group, G, lane, k, MMA_WARPS))


def forward(x, r, *w):
    check_shapes(x, r, *w)
    y = runtime.empty(r.shape, r.dtype)
    if len(w) == 3:
        launch_quantized(x, w, y, res=r)
        return y, ()
    (w,) = w
    if w.dtype == BF16:
        groups = tile_groups(x.shape[0])
        runtime.launch(_forward_mma, (runtime.blocks_for(w.shape[0], TILE), row_slices(x.shape[0])), MMA_WARPS * WARP,
                       in_chunks(x), in_chunks(w), r, groups, y, shared_bytes=sums_bytes(MMA_WARPS, len(groups)),
                       overlap=True)
    else:
        runtime.launch(_forward, (runtime.blocks_for(w.shape[0], WARPS), row_slices(x.shape[0])), THREADS,
                       in_chunks(x), in_chunks(w), r, row_group(x.shape[0]), y, overlap=True)
    return y, ()
