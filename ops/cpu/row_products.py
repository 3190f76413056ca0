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

Quantized matrices (nanoeuler_core/quantized.py) multiply x rounded to 8 bits by blocks of 32
(quantized.round_activations), as integers: each row of x becomes int8 values and a scale per
block once per product, and a block of 32 weights (int8, or int4 nibbles) times its 32 values is
one round of 8-bit SIMD multiply-adds (lanes.py), its integer sums made float once and scaled by
the block's scale, the group's sum by the group's scale. A product at batch 1 reads its matrix
once from memory: each tile asks for the bytes of the tile PREFETCH_TILES ahead while it
computes, which the processor's own prefetch does not guess from 4 rows read side by side.
"""

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from nanoeuler_core.quantized import QBLOCK
from nanoeuler_ops.cpu.common import REDUCE_FASTMATH, threads_for
from nanoeuler_ops.cpu.lanes import (WIDTH, broadcast, int8_dot, load_bytes, load_lanes, load_nibble_block, nibble_dot,
                                     prefetch, splat, total, value)

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
# (q, scale, zero) as nanoeuler_core/quantized.py lays them out, times x rounded to 8 bits by
# blocks of 32 (quantized.round_activations). `round_rows` makes each row of x int8 values and a
# scale d per block, once per product; a tile of 4 outputs then multiplies each block of 32 as
# integers (lanes.py's dots: 8 lanes of sums of 4 products), makes the lanes float once, adds them
# times the block's d into the group's lanes and those times the group's scale into the output's
# lanes (groups of one block: times scale * d at once), summed once at the end. int4's offset adds
# zero * (the group's sum of x as rounded). The tile at the end of an odd count recomputes the last
# output in its spare places. The tiles' functions keep no reference counts (_nrt=False; they
# allocate nothing): Numba would count references to their seven arrays in and out of each call,
# atomic operations that cost about as much as a tile's products, and more where threads share the
# counts.


@njit(inline="always")
def _tile_rows(o, O):
    # the 4 outputs a tile from o computes: o, o + 1, ..., clamped to the last
    return o, min(o + 1, O - 1), min(o + 2, O - 1), min(o + 3, O - 1)


@njit(cache=True)
def round_rows(x, xq, d):
    # x (N, K) -> xq (N, K) int8, d (N, blocks): block b of row n (k from 32 b; the last may be
    # shorter) is d[n, b] * xq[n, k], d = max |x| / 127, xq = rint(x * (127 / max |x|)) in float32
    # as quantized.round_activations; a NaN or inf in a block makes its d NaN or inf
    N, K = x.shape
    for n in range(N):
        for b in range(d.shape[1]):
            start, end = b * QBLOCK, min(K, (b + 1) * QBLOCK)
            amax = np.float32(0.0)
            for k in range(start, end):
                a = abs(x[n, k])
                amax = a if a > amax or a != a else amax
            inverse = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
            for k in range(start, end):
                xq[n, k] = np.int8(np.rint(x[n, k] * inverse))
            d[n, b] = amax / np.float32(127.0)


@njit(cache=True)
def _group_sums(xq, d, sums):
    # xq (N, K), d (N, blocks) -> sums (N, groups): each group's sum of x as rounded, groups of whole blocks
    N = xq.shape[0]
    groups = sums.shape[1]
    per_group = d.shape[1] // groups
    for n in range(N):
        for j in range(groups):
            s = np.float32(0.0)
            for b in range(j * per_group, (j + 1) * per_group):
                block = 0
                for k in range(b * QBLOCK, (b + 1) * QBLOCK):
                    block += xq[n, k]
                s += d[n, b] * np.float32(block)
            sums[n, j] = s


@njit(cache=True, _nrt=False)
def _int8_tile(xq, d, x_sums, q, scale, zero, out, n, o):
    # _blocks_tile for int8 groups that are not whole blocks (and rows whose last block is shorter):
    # scale * d times each whole block's dot, the parts of blocks through scalar integer sums
    K = xq.shape[1]
    groups = scale.shape[1]
    group = K // groups
    o0, o1, o2, o3 = _tile_rows(o, out.shape[1])
    zero_lanes = splat(np.float32(0.0))
    a0 = a1 = a2 = a3 = zero_lanes
    r0 = r1 = r2 = r3 = np.float32(0.0)
    for j in range(groups):
        prefetch(scale, (o + 4 * PREFETCH_TILES) * groups + 4 * j)   # the tile ahead's scales, 4 a group
        k, end = j * group, (j + 1) * group
        while k < end:
            b = k // QBLOCK
            stop = min(end, (b + 1) * QBLOCK)
            if stop - k == QBLOCK:
                ahead = (o + 4 * PREFETCH_TILES) * K + 4 * k   # and its weights, 128 bytes a block
                prefetch(q, ahead)
                prefetch(q, ahead + 64)
                xb = load_bytes(xq, n * K + k)
                a0 = splat(value(scale, o0 * groups + j) * d[n, b]) * int8_dot(load_bytes(q, o0 * K + k), xb) + a0
                a1 = splat(value(scale, o1 * groups + j) * d[n, b]) * int8_dot(load_bytes(q, o1 * K + k), xb) + a1
                a2 = splat(value(scale, o2 * groups + j) * d[n, b]) * int8_dot(load_bytes(q, o2 * K + k), xb) + a2
                a3 = splat(value(scale, o3 * groups + j) * d[n, b]) * int8_dot(load_bytes(q, o3 * K + k), xb) + a3
            else:
                i0 = i1 = i2 = i3 = 0
                for i in range(k, stop):
                    i0 += q[o0, i] * xq[n, i]
                    i1 += q[o1, i] * xq[n, i]
                    i2 += q[o2, i] * xq[n, i]
                    i3 += q[o3, i] * xq[n, i]
                r0 += value(scale, o0 * groups + j) * d[n, b] * np.float32(i0)
                r1 += value(scale, o1 * groups + j) * d[n, b] * np.float32(i1)
                r2 += value(scale, o2 * groups + j) * d[n, b] * np.float32(i2)
                r3 += value(scale, o3 * groups + j) * d[n, b] * np.float32(i3)
            k = stop
    out[n, o0] = total(a0) + r0
    out[n, o1] = total(a1) + r1
    out[n, o2] = total(a2) + r2
    out[n, o3] = total(a3) + r3


def _weights_dot(q, o, b, xb):
    """Lanes: block b of row o of q (int8, or int4 nibbles) times the int8 activations xb (lanes.py's dots)."""


@overload(_weights_dot)
def _weights_dot_of(q, o, b, xb):
    if q.dtype == types.uint8:
        return lambda q, o, b, xb: nibble_dot(load_nibble_block(q, o * q.shape[1] + (QBLOCK // 2) * b), xb)
    return lambda q, o, b, xb: int8_dot(load_bytes(q, o * q.shape[1] + QBLOCK * b), xb)


@njit(inline="always")
def _offsets_term(zero, o, x_sums, n):
    # sum_j zero[o, j] * x_sums[n, j]: int4's offsets times their groups' sums of x (8 groups at a time)
    groups = zero.shape[1]
    lanes = splat(np.float32(0.0))
    j = 0
    while j + WIDTH <= groups:
        lanes = load_lanes(zero, o * groups + j) * load_lanes(x_sums, n * groups + j) + lanes
        j += WIDTH
    r = total(lanes)
    for j in range(j, groups):
        r += value(zero, o * groups + j) * x_sums[n, j]
    return r


@njit(inline="always")
def _scaled_block(xq, q, n, o0, o1, o2, o3, b, s0, s1, s2, s3, a0, a1, a2, a3):
    # the lanes a0..a3 of rows o0..o3 plus block b's products, times the lanes s0..s3 (each all its scale)
    xb = load_bytes(xq, n * xq.shape[1] + QBLOCK * b)
    return (s0 * _weights_dot(q, o0, b, xb) + a0, s1 * _weights_dot(q, o1, b, xb) + a1,
            s2 * _weights_dot(q, o2, b, xb) + a2, s3 * _weights_dot(q, o3, b, xb) + a3)


@njit(cache=True, _nrt=False)
def _block_scales_tile(xq, d, x_sums, q, scale, zero, out, n, o):
    # out[n, o:o+4] = x[n] @ w[o:o+4].T for groups of one block (GGUF's Q8_0, Q4_0 and Q4_1): w[o, k] =
    # scale[o, b] * q[o, k] (+ zero[o, b] in int4; b = k // 32), x[n, k] = d[n, b] * xq[n, k]. The
    # factors scale * d of 8 blocks are one vector product a row; each block's integer products then
    # go into the output's lanes in one multiply-add, by its factor broadcast from those lanes
    row, blocks = q.shape[1], scale.shape[1]   # row: bytes of a row of q
    o0, o1, o2, o3 = _tile_rows(o, out.shape[1])
    a0 = a1 = a2 = a3 = splat(np.float32(0.0))
    ahead = (o + 4 * PREFETCH_TILES) * row   # the tile ahead's weights, 64 or 128 bytes a block
    step = 4 * (row // blocks)
    b = 0
    while b + WIDTH <= blocks:
        scales_ahead = (o + 4 * PREFETCH_TILES) * blocks + 4 * b   # and its scales and offsets
        prefetch(scale, scales_ahead)
        prefetch(scale, scales_ahead + 16)
        if zero.shape[1]:   # (int8's offsets are empty: no address to ask for)
            prefetch(zero, scales_ahead)
            prefetch(zero, scales_ahead + 16)
        db = load_lanes(d, n * d.shape[1] + b)
        f0 = load_lanes(scale, o0 * blocks + b) * db
        f1 = load_lanes(scale, o1 * blocks + b) * db
        f2 = load_lanes(scale, o2 * blocks + b) * db
        f3 = load_lanes(scale, o3 * blocks + b) * db
        for i in range(WIDTH):
            prefetch(q, ahead + step * (b + i))
            prefetch(q, ahead + step * (b + i) + 64)
            a0, a1, a2, a3 = _scaled_block(xq, q, n, o0, o1, o2, o3, b + i, broadcast(f0, i), broadcast(f1, i),
                                           broadcast(f2, i), broadcast(f3, i), a0, a1, a2, a3)
        b += WIDTH
    for b in range(b, blocks):   # the last blocks, fewer than 8, a factor at a time
        prefetch(q, ahead + step * b)
        prefetch(q, ahead + step * b + 64)
        a0, a1, a2, a3 = _scaled_block(xq, q, n, o0, o1, o2, o3, b, splat(value(scale, o0 * blocks + b) * d[n, b]),
                                       splat(value(scale, o1 * blocks + b) * d[n, b]),
                                       splat(value(scale, o2 * blocks + b) * d[n, b]),
                                       splat(value(scale, o3 * blocks + b) * d[n, b]), a0, a1, a2, a3)
    out[n, o0] = total(a0) + _offsets_term(zero, o0, x_sums, n)
    out[n, o1] = total(a1) + _offsets_term(zero, o1, x_sums, n)
    out[n, o2] = total(a2) + _offsets_term(zero, o2, x_sums, n)
    out[n, o3] = total(a3) + _offsets_term(zero, o3, x_sums, n)


@njit(cache=True, _nrt=False)
def _blocks_tile(xq, d, x_sums, q, scale, zero, out, n, o):
    # out[n, o:o+4] = x[n] @ w[o:o+4].T for groups of several whole blocks, int8 or int4: w[o, k] =
    # scale[o, j] * q[o, k] (+ zero[o, j] in int4; j = k // group), x[n, k] = d[n, k // 32] * xq[n, k]:
    # d times each block's integer products into the group's lanes, those times scale into the
    # output's, then zero times x_sums[n, j] (the group's sum of x) a group
    K = xq.shape[1]
    row, blocks, groups = q.shape[1], K // QBLOCK, scale.shape[1]   # row: bytes of a row of q
    per_group = blocks // groups
    o0, o1, o2, o3 = _tile_rows(o, out.shape[1])
    zero_lanes = splat(np.float32(0.0))
    a0 = a1 = a2 = a3 = p0 = p1 = p2 = p3 = zero_lanes   # the outputs' lanes, their group's lanes
    j, left = 0, per_group   # the blocks' group, and its blocks from b on
    for b in range(blocks):
        ahead = (o + 4 * PREFETCH_TILES) * groups + 4 * j   # the tile ahead's scales and offsets, 4 a group
        prefetch(scale, ahead)
        if zero.shape[1]:
            prefetch(zero, ahead)
        ahead = (o + 4 * PREFETCH_TILES) * row + 4 * (row // blocks) * b   # and its weights, 64 or 128 bytes a block
        prefetch(q, ahead)
        prefetch(q, ahead + 64)
        db = splat(d[n, b])
        p0, p1, p2, p3 = _scaled_block(xq, q, n, o0, o1, o2, o3, b, db, db, db, db, p0, p1, p2, p3)
        left -= 1
        if left == 0:   # the group's end: its lanes times its scale
            a0 = splat(value(scale, o0 * groups + j)) * p0 + a0
            a1 = splat(value(scale, o1 * groups + j)) * p1 + a1
            a2 = splat(value(scale, o2 * groups + j)) * p2 + a2
            a3 = splat(value(scale, o3 * groups + j)) * p3 + a3
            p0 = p1 = p2 = p3 = zero_lanes
            j, left = j + 1, per_group
    out[n, o0] = total(a0) + _offsets_term(zero, o0, x_sums, n)
    out[n, o1] = total(a1) + _offsets_term(zero, o1, x_sums, n)
    out[n, o2] = total(a2) + _offsets_term(zero, o2, x_sums, n)
    out[n, o3] = total(a3) + _offsets_term(zero, o3, x_sums, n)


@njit(inline="always")
def _whole_blocks_tile(xq, d, x_sums, q, scale, zero, out, n, o):
    # _block_scales_tile for groups of one block, else _blocks_tile
    if xq.shape[1] == QBLOCK * scale.shape[1]:
        _block_scales_tile(xq, d, x_sums, q, scale, zero, out, n, o)
    else:
        _blocks_tile(xq, d, x_sums, q, scale, zero, out, n, o)


def _tile(xq, d, x_sums, q, scale, zero, out, n, o):
    """_whole_blocks_tile, or for int8 groups that are not whole blocks _int8_tile."""


@overload(_tile, inline="always")
def _tile_of(xq, d, x_sums, q, scale, zero, out, n, o):
    if q.dtype == types.uint8:   # int4 groups are whole blocks
        return lambda xq, d, x_sums, q, scale, zero, out, n, o: \
            _whole_blocks_tile(xq, d, x_sums, q, scale, zero, out, n, o)

    def int8_tile(xq, d, x_sums, q, scale, zero, out, n, o):
        if (xq.shape[1] // scale.shape[1]) % QBLOCK == 0:
            _whole_blocks_tile(xq, d, x_sums, q, scale, zero, out, n, o)
        else:
            _int8_tile(xq, d, x_sums, q, scale, zero, out, n, o)
    return int8_tile


@njit(cache=True, _nrt=False)
def _tiles(xq, d, x_sums, q, scale, zero, out, first, last):
    # tiles first..last-1 of 4 outputs, every row of x each
    for t in range(first, last):
        for n in range(xq.shape[0]):
            _tile(xq, d, x_sums, q, scale, zero, out, n, 4 * t)


@njit(cache=True, parallel=True)
def _tiles_threaded(xq, d, x_sums, q, scale, zero, out, tiles):
    # _tiles 0..tiles-1 shared among the threads
    for t in prange(tiles):
        _tiles(xq, d, x_sums, q, scale, zero, out, t, t + 1)


def kernel_weights(q, scale, zero) -> tuple:
    """The quantized matrix (q, scale, zero) as the kernels take it: float16 scales and offsets as their
    bit patterns (uint16), which the kernels read through lanes.py (Numba's CPU types have no float16);
    float32 ones as they are."""
    if scale.dtype == np.float16:
        return q, scale.view(np.uint16), zero.view(np.uint16)
    return q, scale, zero


@njit(cache=True)
def quantized_matmul_rows(x, q, scale, zero, out, threads):
    # x (N, K), (q, scale, zero) (O, K) quantized (`kernel_weights`) -> out (N, O) = (x rounded to 8
    # bits by blocks of 32) @ w.T, its tiles shared among `threads` threads from THREADED_PRODUCTS multiply-adds
    N, K = x.shape
    O = out.shape[1]
    xq = np.empty((N, K), dtype=np.int8)
    d = np.empty((N, (K + QBLOCK - 1) // QBLOCK), dtype=np.float32)
    x_sums = np.empty((N, zero.shape[1]), dtype=np.float32)   # int4's offsets (int8 has none)
    round_rows(x, xq, d)
    if zero.shape[1]:
        _group_sums(xq, d, x_sums)
    tiles = (O + 3) // 4
    if threads > 1 and N * O * K >= THREADED_PRODUCTS:
        had = threads_for(threads)
        _tiles_threaded(xq, d, x_sums, q, scale, zero, out, tiles)
        threads_for(had)
    else:
        _tiles(xq, d, x_sums, q, scale, zero, out, 0, tiles)
