"""The RMSNorm rows and matrix products that the CPU decoding ops norm_linear, norm_swiglu and
linear_residual share, each row's result independent of the batch.

Decoding needs a token's result to be the same whether it is computed alone, beside other rows
of a batch, or beside speculative proposals (docs/decoding.md). A BLAS sgemm
does not promise that: it picks kernels and blockings by the matrix sizes. Here every row runs
through the same instructions: loops go over tiles of 4 outputs (sharing the loads of one x
row) and, inside, over rows one at a time, never blocking a row with its neighbours, whose
number would change the vectorised code. A product of THREADED_PRODUCTS multiply-adds or more
shares its tiles among the threads it is given (the count outside the backend's `serial` block:
a decoding step runs on one thread, but its products of a model's size take the threads back);
a tile's instructions are the same on any thread, so no bit changes.

Quantized matrices (nanoeuler_core/quantized.py) are read as they are stored, in blocks of 32
weights: int8 widened to float, int4 nibbles unpacked to float, in 8-lane registers (lanes.py),
each output keeping one accumulator of lanes across its groups and summing the lanes once at the
end. A product at batch 1 reads its matrix once from memory: each tile asks for the bytes of the
tile PREFETCH_TILES ahead while it computes, which the processor's own prefetch does not guess
from 4 rows read side by side.
"""

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from nanoeuler_core.quantized import QBLOCK
from nanoeuler_ops.cpu.common import REDUCE_FASTMATH, threads_for
from nanoeuler_ops.cpu.lanes import WIDTH, load, load_int8, load_nibbles, prefetch, splat, store, total

# Multiply-adds of a product from which sharing its outputs among the threads pays for waking them
# (a few microseconds where the cores are free): at batch 1, every product of SmolLM2-135M (from its
# 576 x 576 output projection, 332K), none of the `small` preset's (at most 262K)
THREADED_PRODUCTS = 300_000
PREFETCH_TILES = 2   # how far ahead a quantized tile asks for its successor's bytes (tiles)


@njit(cache=True, fastmath=REDUCE_FASTMATH)
def rmsnorm_rows(x, g, eps, h):
    # x (N, C), g (C,) -> h (N, C) = x / sqrt(mean(x^2) + eps) * g
    N, C = x.shape
    for n in range(N):
        ss = np.float32(0.0)
        for c in range(C):
            ss += x[n, c] * x[n, c]
        r = np.float32(1.0) / np.sqrt(ss / C + eps)
        for c in range(C):
            h[n, c] = x[n, c] * r * g[c]


@njit(cache=True, fastmath=REDUCE_FASTMATH)
def _four_outputs(x, w, out, o):
    # out[:, o:o+4] = x @ w[o:o+4].T: the four outputs share the loads of each x[n]; rows one at a time
    N, I = x.shape
    for n in range(N):
        a0 = a1 = a2 = a3 = np.float32(0.0)
        for i in range(I):
            xi = x[n, i]
            a0 += xi * w[o, i]
            a1 += xi * w[o + 1, i]
            a2 += xi * w[o + 2, i]
            a3 += xi * w[o + 3, i]
        out[n, o] = a0
        out[n, o + 1] = a1
        out[n, o + 2] = a2
        out[n, o + 3] = a3


@njit(cache=True, fastmath=REDUCE_FASTMATH, parallel=True)
def _four_outputs_threaded(x, w, out, blocks):
    # _four_outputs over blocks 0..blocks-1 of four outputs, the blocks shared among the threads
    for block in prange(blocks):
        _four_outputs(x, w, out, 4 * block)


@njit(cache=True, fastmath=REDUCE_FASTMATH)
def matmul_rows(x, w, out, threads):
    # x (N, I), w (O, I) -> out (N, O) = x @ w.T, on `threads` threads from THREADED_PRODUCTS
    # multiply-adds. Each output is the same loop over i whichever thread runs it, so threading
    # changes no bit
    N, I = x.shape
    O = w.shape[0]
    O4 = O - O % 4
    if threads > 1 and N * O * I >= THREADED_PRODUCTS:
        had = threads_for(threads)
        _four_outputs_threaded(x, w, out, O4 // 4)
        threads_for(had)
    else:
        for o in range(0, O4, 4):
            _four_outputs(x, w, out, o)
    for o in range(O4, O):
        for n in range(N):
            a0 = np.float32(0.0)
            for i in range(I):
                a0 += x[n, i] * w[o, i]
            out[n, o] = a0


# ---------------------------------------------------------------- quantized weights
# (q, scale, zero) as nanoeuler_core/quantized.py lays them out. Each output keeps one 8-lane
# accumulator over its row: a group's products x * q (int8) or x * nibble (int4) are summed in
# lanes, then scaled into the accumulator (the 4-bit offset as zero times the group's lane sums
# of x), and the lanes are summed once at the end. Tiles of 4 outputs share the loads of x; the
# tile at the end of an odd count recomputes the last output in its spare places.


@njit(inline="always")
def _tile_rows(o, O):
    # the 4 outputs a tile from o computes: o, o + 1, ..., clamped to the last
    return o, min(o + 1, O - 1), min(o + 2, O - 1), min(o + 3, O - 1)


@njit(inline="always")
def _int8_products(q, qk, x, xk, part):
    # part + the 32 products x[xk : xk + 32] * q[qk : qk + 32], in lanes
    return load(x, xk) * load_int8(q, qk) + (load(x, xk + 8) * load_int8(q, qk + 8) + (
        load(x, xk + 16) * load_int8(q, qk + 16) + (load(x, xk + 24) * load_int8(q, qk + 24) + part)))


@njit(cache=True)
def _int8_tile(x, x_sums, q, scale, zero, out, n, o):
    # out[n, o:o+4] = x[n] @ w[o:o+4].T, w[o, k] = scale[o, k // group] * q[o, k]: per group, scale
    # times the lane sums of x * q; a group's weights past its last whole 32 (groups that are not
    # whole 32s) go through a scalar sum
    N, K = x.shape
    groups = scale.shape[1]
    group = K // groups
    blocks = group - group % QBLOCK
    o0, o1, o2, o3 = _tile_rows(o, out.shape[1])
    zero_lanes = splat(np.float32(0.0))
    a0 = a1 = a2 = a3 = zero_lanes
    r0 = r1 = r2 = r3 = np.float32(0.0)
    for j in range(groups):
        prefetch(scale, (o + 4 * PREFETCH_TILES) * groups + 4 * j)   # the tile ahead's scales, 4 a group
        p0 = p1 = p2 = p3 = zero_lanes
        for k in range(j * group, j * group + blocks, QBLOCK):
            ahead = (o + 4 * PREFETCH_TILES) * K + 4 * k   # and its weights, 128 bytes a block
            prefetch(q, ahead)
            prefetch(q, ahead + 64)
            xk = n * K + k
            p0 = _int8_products(q, o0 * K + k, x, xk, p0)
            p1 = _int8_products(q, o1 * K + k, x, xk, p1)
            p2 = _int8_products(q, o2 * K + k, x, xk, p2)
            p3 = _int8_products(q, o3 * K + k, x, xk, p3)
        a0 = splat(scale[o0, j]) * p0 + a0
        a1 = splat(scale[o1, j]) * p1 + a1
        a2 = splat(scale[o2, j]) * p2 + a2
        a3 = splat(scale[o3, j]) * p3 + a3
        for k in range(j * group + blocks, (j + 1) * group):
            r0 += scale[o0, j] * (x[n, k] * np.float32(q[o0, k]))
            r1 += scale[o1, j] * (x[n, k] * np.float32(q[o1, k]))
            r2 += scale[o2, j] * (x[n, k] * np.float32(q[o2, k]))
            r3 += scale[o3, j] * (x[n, k] * np.float32(q[o3, k]))
    out[n, o0] = total(a0) + r0
    out[n, o1] = total(a1) + r1
    out[n, o2] = total(a2) + r2
    out[n, o3] = total(a3) + r3


@njit(inline="always")
def _nibble_products(q, xk, qk, x, part):
    # part + the 32 products of block x[xk : xk + 32] with the nibbles of q[qk : qk + 16], in lanes
    n0, n1, n2, n3 = load_nibbles(q, qk)
    return load(x, xk) * n0 + (load(x, xk + 8) * n1 + (load(x, xk + 16) * n2 + (load(x, xk + 24) * n3 + part)))


@njit(cache=True)
def _int4_tile(x, x_sums, q, scale, zero, out, n, o):
    # out[n, o:o+4] = x[n] @ w[o:o+4].T, w[o, k] = scale[o, j] * nibble[o, k] + zero[o, j] (j = k // group):
    # per group, scale times the lane sums of x * nibble plus zero times x_sums[n, j] (its lane sums of x)
    N, K = x.shape
    groups = scale.shape[1]
    half, group = K // 2, K // groups
    o0, o1, o2, o3 = _tile_rows(o, out.shape[1])
    zero_lanes = splat(np.float32(0.0))
    a0 = a1 = a2 = a3 = zero_lanes
    for j in range(groups):
        ahead = (o + 4 * PREFETCH_TILES) * groups + 4 * j   # the tile ahead's scales and offsets, 4 a group
        prefetch(scale, ahead)
        prefetch(zero, ahead)
        p0 = p1 = p2 = p3 = zero_lanes
        for k in range(j * group, (j + 1) * group, QBLOCK):
            prefetch(q, (o + 4 * PREFETCH_TILES) * half + 2 * k)   # and its weights, 64 bytes a block
            xk = n * K + k
            p0 = _nibble_products(q, xk, o0 * half + k // 2, x, p0)
            p1 = _nibble_products(q, xk, o1 * half + k // 2, x, p1)
            p2 = _nibble_products(q, xk, o2 * half + k // 2, x, p2)
            p3 = _nibble_products(q, xk, o3 * half + k // 2, x, p3)
        sums = load(x_sums, (n * groups + j) * WIDTH)
        a0 = splat(scale[o0, j]) * p0 + (splat(zero[o0, j]) * sums + a0)
        a1 = splat(scale[o1, j]) * p1 + (splat(zero[o1, j]) * sums + a1)
        a2 = splat(scale[o2, j]) * p2 + (splat(zero[o2, j]) * sums + a2)
        a3 = splat(scale[o3, j]) * p3 + (splat(zero[o3, j]) * sums + a3)
    out[n, o0] = total(a0)
    out[n, o1] = total(a1)
    out[n, o2] = total(a2)
    out[n, o3] = total(a3)


@njit(cache=True)
def _lane_sums(x, groups, x_sums):
    # x (N, K) -> x_sums (N, groups, 8): lane l of group j sums x[n, k] over the group's k = l mod 8
    N, K = x.shape
    group = K // groups
    for n in range(N):
        for j in range(groups):
            s = splat(np.float32(0.0))
            for k in range(j * group, (j + 1) * group, WIDTH):
                s = s + load(x, n * K + k)
            store(x_sums, (n * groups + j) * WIDTH, s)


def _tile(x, x_sums, q, scale, zero, out, n, o):
    """_int8_tile or _int4_tile, chosen by q's dtype when a kernel is compiled."""


@overload(_tile)
def _tile_of(x, x_sums, q, scale, zero, out, n, o):
    kernel = _int4_tile if q.dtype == types.uint8 else _int8_tile
    return lambda x, x_sums, q, scale, zero, out, n, o: kernel(x, x_sums, q, scale, zero, out, n, o)


@njit(cache=True)
def _tiles(x, x_sums, q, scale, zero, out, first, last):
    # tiles first..last-1 of 4 outputs, every row of x each
    for t in range(first, last):
        for n in range(x.shape[0]):
            _tile(x, x_sums, q, scale, zero, out, n, 4 * t)


@njit(cache=True, parallel=True)
def _tiles_threaded(x, x_sums, q, scale, zero, out, tiles):
    # _tiles 0..tiles-1 shared among the threads
    for t in prange(tiles):
        _tiles(x, x_sums, q, scale, zero, out, t, t + 1)


@njit(cache=True)
def quantized_matmul_rows(x, q, scale, zero, out, threads):
    # x (N, K), (q, scale, zero) (O, K) quantized -> out (N, O) = x @ w.T, its tiles shared among
    # `threads` threads from THREADED_PRODUCTS multiply-adds
    N, K = x.shape
    O = out.shape[1]
    groups = scale.shape[1]
    x_sums = np.empty((N, groups, WIDTH), dtype=np.float32)
    if zero.shape[1]:   # int4 (int8 has no offsets)
        _lane_sums(x, groups, x_sums)
    tiles = (O + 3) // 4
    if threads > 1 and N * O * K >= THREADED_PRODUCTS:
        had = threads_for(threads)
        _tiles_threaded(x, x_sums, q, scale, zero, out, tiles)
        threads_for(had)
    else:
        _tiles(x, x_sums, q, scale, zero, out, 0, tiles)
