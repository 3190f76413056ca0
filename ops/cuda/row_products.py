"""The skinny matrix products that the decoding ops norm_linear, norm_swiglu and linear_residual
share: y[n, o] = x[n] . w[o] (after an RMSNorm of x, or plus a residual) for a few rows x (N, C) and
a weight matrix w (O, C), each row's result independent of the others (batch invariance).

Float32 weights, FMA kernels: a warp per output column o, a block WARPS columns. Lane l reads the
features in chunks of CHUNK = 8 (one 16-byte load each): chunks l, l + 32, ..., a trip of several
at once, and sums each chunk in element order; the warp adds its lanes by a fixed shuffle tree.
Rows go in groups of R (`row_group`: 1 for a lone row, else ROWS), the weights read once a group.
bf16 weights, tensor-core kernels (mma.sync m16n8k16): a block per TILE = 16 output columns (the
A operand), GROUP = 8 rows of x at a time (B, each row as hi + lo bf16 parts), its warps splitting
the features BLOCK = 32 at a time; the warps' sums meet in shared memory, added in warp order.
Quantized weights (int8, int4), one FMA kernel for the three ops on the float32 layout
(`quantized_rows`): a lane's 16-byte load is 16 int8 weights or 32 int4, made float32 in registers.
Each kernel asks for its weights (prefetch, first trip) before it waits for the kernel ahead.
docs/cuda.md ("Decoding's matrix products") tells why each choice.
"""

import math

import numpy as np
from numba import cuda, float32, int32, uint32

from nanoeuler_core import quantized
from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.device import (DEVICE, WARP, bf16x2_values, let_next_start, load_16_bytes, load_8_floats,
                                       mma_bf16, pack_bf16x2, prefetch_l2, quad_sum, stored, to_f32, wait_for_previous,
                                       warp_sum)

WARPS = 4       # columns per block
THREADS = WARPS * WARP
ROWS = 4        # rows reduced together: the weights are read once per group of ROWS rows
CHUNK = 8       # features a lane reads at once (16 bytes of bf16)
STEP = WARP * CHUNK   # features from a lane's chunk to its next


def row_group(N: int) -> tuple:
    """The kernels' `group` argument for N rows: a tuple of R zeros, R = 1 for one row, else ROWS. A
    kernel takes R as len(group), a constant when it compiles (a tuple's length is part of its type)."""
    return (int32(0),) * (1 if N == 1 else ROWS)


def vector_ready(a) -> bool:
    """Whether every row of the contiguous array a can be read CHUNK elements per 16-byte load:
    rows a multiple of CHUNK long, the data 16-byte aligned."""
    return a.shape[a.ndim - 1] % CHUNK == 0 and DEVICE.is_aligned(a, 16)


@cuda.jit(cache=True)
def _pad_rows(src, dst):
    # src (N, C) -> dst (N, P), P >= C: each row, then zeros
    i = cuda.grid(1)
    P = dst.shape[1]
    if i < dst.size:
        n, c = i // P, i % P
        dst[n, c] = src[n, c] if c < src.shape[1] else stored(dst, float32(0.0))


def in_chunks(a):
    """a as a 2-D array whose rows `chunk` reads: a itself where `vector_ready`, else a copy with
    rows padded by zeros to whole chunks (shapes no model of ours has, so the copy is rare)."""
    a = a.reshape((1, a.shape[0])) if a.ndim == 1 else a
    if vector_ready(a):
        return a
    padded = runtime.empty((a.shape[0], -(-a.shape[1] // CHUNK) * CHUNK), a.dtype)
    runtime.launch(_pad_rows, runtime.blocks_for(padded.size, 256), 256, a, padded)
    return padded


@cuda.jit(device=True, inline=True)
def column():
    """The output column this warp computes, and its lane."""
    return cuda.blockIdx.x * WARPS + cuda.threadIdx.x // WARP, cuda.threadIdx.x % WARP


@cuda.jit(device=True, inline=True)
def load_trip(c, first, r0, C, stride):
    """Whether a lane loads the weights of its trip from feature c for the group of rows from r0 (its
    trips `stride` features apart): it keeps its first trip's (from `first`) for every group, unless
    a later trip replaced them."""
    return r0 == 0 or c != first or first + stride < C


@cuda.jit(device=True, inline=True)
def no_chunk():
    """Eight float32 zeros: a chunk before its first load."""
    zero = float32(0.0)
    return zero, zero, zero, zero, zero, zero, zero, zero


@cuda.jit(device=True, inline=True)
def prefetch_row(w, row):
    """Ask for row `row` of the contiguous matrix w to come into L2, a line per lane of the warp."""
    C = w.shape[1]
    line_elements = 128 // w.itemsize
    for line in range(cuda.threadIdx.x % WARP * line_elements, C, WARP * line_elements):
        prefetch_l2(w, row * C + line)


@cuda.jit(device=True, inline=True)
def chunk(a, row, c):
    """a[row, c:c+8] as eight float32 (rows of whole chunks); zeros where c is past the row's end,
    read without a branch so that a lane's loads all go out before it uses any."""
    C = a.shape[1]
    v = load_8_floats(a, row, min(c, C - CHUNK))
    keep = c < C
    zero = float32(0.0)
    return (v[0] if keep else zero, v[1] if keep else zero, v[2] if keep else zero, v[3] if keep else zero,
            v[4] if keep else zero, v[5] if keep else zero, v[6] if keep else zero, v[7] if keep else zero)


@cuda.jit(device=True, inline=True)
def product(a, b):
    """a * b element by element, for two chunks."""
    return (a[0] * b[0], a[1] * b[1], a[2] * b[2], a[3] * b[3], a[4] * b[4], a[5] * b[5], a[6] * b[6], a[7] * b[7])


@cuda.jit(device=True, inline=True)
def dot(total, a, b):
    """total + the dot product of chunks a and b, added in element order."""
    total += a[0] * b[0]
    total += a[1] * b[1]
    total += a[2] * b[2]
    total += a[3] * b[3]
    total += a[4] * b[4]
    total += a[5] * b[5]
    total += a[6] * b[6]
    total += a[7] * b[7]
    return total


# ---------------------------------------------------------------- bf16 weights on the tensor cores
# The weights are the A operand of mma.sync m16n8k16 (ptx.py's fragment layout): TILE output columns
# by 16 features; the rows of x are B, GROUP rows at a time. Lane 4i + t of a warp reads features
# c + 8t .. c + 8t + 7 of the tile's weight rows i and i + 8 and of x's row i of the group, each a
# 16-byte load, and feeds them to two products (`mma_block`). A row of x goes in as two bf16
# operands, hi + lo (x's first 16 significant bits of its 24): the products of bf16 weights with
# them are exact, added in float32 (hi's and lo's sums apart). The warps' sums then meet in shared
# memory, added in warp order: the same operations in the same order for a row alone or among
# others, with one kernel for every number of rows. A block's warps (NORM_WARPS, linear_residual's
# MMA_WARPS) split the features; 16 columns a block rather than 8 (twice the blocks, each holding
# as many registers) keeps more of the GPU's registers busy with loads in flight.

TILE = 16       # output columns of a block: the rows of an mma's A operand
GROUP = 8       # rows of x a product takes: the columns of its B operand
BLOCK = 32      # features of a lane's two products


@cuda.jit(device=True, inline=True)
def mma_lane():
    """This thread's warp in the block and its lane 4i + t as (i, t)."""
    lane = cuda.threadIdx.x % WARP
    return cuda.threadIdx.x // WARP, lane // 4, lane % 4


@cuda.jit(device=True, inline=True)
def trip_feature(c0, j, warp, t, warps):
    """The first feature a lane reads for block j of the trip from feature c0: a trip's blocks go to the
    block's `warps` warps in turn, so that every warp has a share of a row however short."""
    return c0 + (j * warps + warp) * BLOCK + 8 * t


@cuda.jit(device=True, inline=True)
def tile_rows(w, first, i):
    """The weight rows of lane i's A operand in the tile from row `first`: i and i + 8, held at w's
    last row past its end (their results are never stored)."""
    last = w.shape[0] - 1
    return min(first + i, last), min(first + i + 8, last)


@cuda.jit(device=True, inline=True)
def words8(a, row, c):
    """The bf16 a[row, c:c+8] as four uint32 (element c in the first's low half), one 16-byte load."""
    return load_16_bytes(a, row * a.shape[1] + c)


@cuda.jit(device=True, inline=True)
def load_words(weights, j, w, top, bottom, c):
    """weights[j] <- the bf16 w[top, c:c+8] and w[bottom, c:c+8] as eight uint32, zeros where c is past
    the rows' end (no branch): a lane's A operands of `mma_block`."""
    C = w.shape[1]
    first = min(c, C - CHUNK)
    a, b = words8(w, top, first), words8(w, bottom, first)
    keep = c < C
    for e in range(4):
        weights[j, e] = a[e] if keep else uint32(0)
        weights[j, 4 + e] = b[e] if keep else uint32(0)


@cuda.jit(device=True, inline=True)
def row_chunk(x, n, c):
    """x[n, c:c+8] as eight float32; zeros for a row n past x's last."""
    v = chunk(x, min(n, x.shape[0] - 1), c)
    keep = n < x.shape[0]
    zero = float32(0.0)
    return (v[0] if keep else zero, v[1] if keep else zero, v[2] if keep else zero, v[3] if keep else zero,
            v[4] if keep else zero, v[5] if keep else zero, v[6] if keep else zero, v[7] if keep else zero)


@cuda.jit(device=True, inline=True)
def normed_chunk(x, g, n, c, sum_squares):
    """x[n, c:c+8] * g[0, c:c+8] (`row_chunk`: a lane's features of its row, scaled by the norm's gains),
    and sum_squares + the squares of x[n, c:c+8]."""
    v = row_chunk(x, n, c)
    return product(v, chunk(g, 0, c)), dot(sum_squares, v, v)


@cuda.jit(device=True, inline=True)
def split(a, b):
    """Two float32 as two bf16x2 words (hi, lo), a ~ hi + lo to 16 significant bits (a in the low halves)."""
    hi = pack_bf16x2(a, b)
    a_hi, b_hi = bf16x2_values(hi)
    return hi, pack_bf16x2(a - a_hi, b - b_hi)


@cuda.jit(device=True, inline=True)
def mma4(weights, j, first, b0, b1, acc):
    """acc + A B, A from weights[j]'s words first and first + 1 of both rows."""
    return mma_bf16(weights[j, first], weights[j, 4 + first], weights[j, first + 1], weights[j, 5 + first], b0, b1,
                    acc[0], acc[1], acc[2], acc[3])


@cuda.jit(device=True, inline=True)
def mma_block(acc, weights, j, v):
    """acc (the sums of the hi and lo parts, `no_sums`) + the products of block j of `weights`
    (load_words) with a lane's eight features v of its row. The first product takes the features
    c + 8t + e for e = 0..3, the second e = 4..7: e = 0, 1 as k = 2t, 2t + 1 and e = 2, 3 as
    k = 2t + 8, 2t + 9, in A as in B, so that the products add to the dot product over the block."""
    h0, l0 = split(v[0], v[1])
    h1, l1 = split(v[2], v[3])
    h2, l2 = split(v[4], v[5])
    h3, l3 = split(v[6], v[7])
    return (mma4(weights, j, 2, h2, h3, mma4(weights, j, 0, h0, h1, acc[0])),
            mma4(weights, j, 2, l2, l3, mma4(weights, j, 0, l0, l1, acc[1])))


@cuda.jit(device=True, inline=True)
def no_sums():
    """An mma's four float32 sums for the hi parts and for the lo parts, before their first product."""
    zero = float32(0.0)
    sums = zero, zero, zero, zero
    return sums, sums


@cuda.jit(device=True, inline=True)
def share_sums(sums, slot, warp, acc):
    """Leave this lane's four results (its D fragment: hi's sums + lo's) in sums[warp, slot]."""
    lane = cuda.threadIdx.x % WARP
    for k in range(4):
        sums[warp, slot, k, lane] = acc[0][k] + acc[1][k]


@cuda.jit(device=True, inline=True)
def share_squares(squares, warp, i, t, sum_squares):
    """Leave the sum of squares of a warp's features of row i (the lanes 4i + t hold parts of it) in
    squares[warp, i]."""
    total = quad_sum(sum_squares)
    if t == 0:
        squares[warp, i] = total


@cuda.jit(device=True, inline=True)
def tile_entry(e):
    """Entry e of a block's results (TILE columns x GROUP rows): its column and row in the tile, and
    the lane and register of the D fragments holding it."""
    col, n = e // GROUP, e % GROUP
    return col, n, 4 * (col % 8) + n // 2, 2 * (col // 8) + n % 2


@cuda.jit(device=True, inline=True)
def warps_total(sums, slot, lane, k, warps):
    """The `warps` warps' sums (share_sums) of one result, added in warp order."""
    total = float32(0.0)
    for warp in range(warps):
        total += sums[warp, slot, k, lane]
    return total


@cuda.jit(device=True, inline=True)
def row_rstd(squares, n, features, eps, warps):
    """1 / the root mean square of row n of the group, from the `warps` warps' sums of squares (share_squares)."""
    total = float32(0.0)
    for warp in range(warps):
        total += squares[warp, n]
    return float32(1.0) / math.sqrt(total / float32(features) + eps)


@cuda.jit(device=True, inline=True)
def swiglu(gate, up):
    """silu(gate) * up."""
    sigmoid = float32(0.5) * (float32(1.0) + math.tanh(float32(0.5) * gate))  # no overflow for large -gate
    return gate * sigmoid * up


NORM_WARPS = 8   # warps of a norm_tiles block
NORM_TRIP = 3   # blocks of features a warp asks for at once: 8 warps x 3 x 32, the `gpu` preset's 768


@cuda.jit(cache=True)
def norm_tiles(x, g, w, features, eps, tiles, y):
    # x (N, C), g (1, C), w (T O, C) bf16 -> y (N, O), C >= features (the rest zeros), T = len(tiles):
    # 1, y = rmsnorm(x; g) @ w.T (norm_linear); 2, y = swiglu of rmsnorm(x; g) @ w[:O].T and @ w[O:].T
    # (norm_swiglu). Block b computes y[:, 16b:16b+16] on the tensor cores, GROUP rows at a time.
    N, C = x.shape
    O = y.shape[1]
    T = len(tiles)
    warp, i, t = mma_lane()
    top, bottom = tile_rows(w[:O], cuda.blockIdx.x * TILE, i)
    weights = cuda.local.array((2, NORM_TRIP, 8), uint32)
    sums = cuda.shared.array((NORM_WARPS, 2, 4, WARP), float32)
    squares = cuda.shared.array((NORM_WARPS, GROUP), float32)
    let_next_start()
    stride = NORM_WARPS * NORM_TRIP * BLOCK
    for r0 in range(0, N, GROUP):
        first = second = no_sums()
        sum_squares = float32(0.0)
        for c0 in range(0, C, stride):   # loads first
            if load_trip(c0, 0, r0, C, stride):
                for j in range(NORM_TRIP):
                    c = trip_feature(c0, j, warp, t, NORM_WARPS)
                    for tile in range(T):
                        load_words(weights[tile], j, w, tile * O + top, tile * O + bottom, c)
            if r0 == 0 and c0 == 0:   # the first trip's weights were asked for before
                wait_for_previous()
            for j in range(NORM_TRIP):
                v, sum_squares = normed_chunk(x, g, r0 + i, trip_feature(c0, j, warp, t, NORM_WARPS), sum_squares)
                first = mma_block(first, weights[0], j, v)
                if T == 2:
                    second = mma_block(second, weights[1], j, v)
        share_sums(sums, 0, warp, first)
        if T == 2:
            share_sums(sums, 1, warp, second)
        share_squares(squares, warp, i, t, sum_squares)
        cuda.syncthreads()
        for e in range(cuda.threadIdx.x, TILE * GROUP, NORM_WARPS * WARP):
            col, m, lane, k = tile_entry(e)
            o, n = cuda.blockIdx.x * TILE + col, r0 + m
            if o < O and n < N:
                rstd = row_rstd(squares, m, features, eps, NORM_WARPS)
                total = warps_total(sums, 0, lane, k, NORM_WARPS) * rstd
                if T == 2:
                    total = swiglu(total, warps_total(sums, 1, lane, k, NORM_WARPS) * rstd)
                y[n, o] = stored(y, total)
        cuda.syncthreads()   # before the next group's sums


def launch_norm_tiles(x, g, w, eps, tiles: int, y) -> None:
    """norm_tiles on x, g and w (bf16) into y, T = tiles matrices stacked in w."""
    runtime.launch(norm_tiles, runtime.blocks_for(y.shape[1], TILE), NORM_WARPS * WARP, in_chunks(x), in_chunks(g),
                   in_chunks(w), x.shape[1], float32(eps), (int32(0),) * tiles, y, overlap=True)



# ---------------------------------------------------------------- quantized weights
# (q, scale, zero) as nanoeuler_core/quantized.py lays them out, on the FMA kernels' layout: a warp per
# output column, lane l reading chunks l, l + 32, l + 64, ... of QCHUNK = 16 bytes of the column's row
# of q: 16 int8 weights, or 32 int4 (one packed block). A trip is the chunks a lane asks for at once
# (as many as the row has for the lane, up to QTRIP: `trip_of`), with the scale (and offset) of each
# chunk's group: a chunk lies in one group. The lane turns a
# chunk into float32 weights eight at a time in registers (`quantized8`) and multiplies them with the
# features in element order, each chunk's products summed apart (`add_chunk`): int8 scales that sum,
# int4 has dequantized each weight (scale * nibble + offset) before its product.

QCHUNK = 16     # bytes of a quantized row a lane loads at once
QTRIP = 4       # chunks a lane asks for at once at most: an int8 row of 2,048 weights (w_down) in one trip
MATRICES = 2    # matrices a warp of quantized_rows reads side by side at most (norm_swiglu's gate and up)


def quantized_layout(q, scale, zero) -> tuple:
    """The kernels' arguments for the quantized matrix (q, scale, zero): (per_byte, group_chunks),
    per_byte a tuple of one zero for int8, two for int4 (the weights a byte holds; a constant when a
    kernel compiles, as `row_group`'s R), group_chunks the chunks of a group. ValueError, one line,
    for int8 groups that are not whole chunks."""
    fmt, group, _ = quantized.weight_format(q, scale, zero)
    per_byte = 2 if fmt == "int4" else 1
    if group % (QCHUNK * per_byte):
        raise ValueError(f"the CUDA kernels read int8 weights in groups of a multiple of {QCHUNK}, not {group}")
    return (int32(0),) * per_byte, group // (QCHUNK * per_byte)


def trip_of(q) -> tuple:
    """The kernels' `trip` argument for q: a tuple of L zeros, L the chunks a lane asks for at once,
    as many as a row of q has for each lane, up to QTRIP (a constant when a kernel compiles: a lane
    holds no more chunks than it reads)."""
    return (int32(0),) * min(QTRIP, -(-q.shape[1] // (QCHUNK * WARP)))


def aligned(q):
    """q itself if its data is 16-byte aligned (its rows are whole chunks), else an aligned copy."""
    if DEVICE.is_aligned(q, QCHUNK):
        return q
    copy = runtime.empty(q.shape, q.dtype)
    runtime.copy(copy, q)
    return copy


@cuda.jit(device=True)
def float_of_bits(bits):
    """The float32 whose bit pattern is the uint32 `bits` (through a local word: a register move)."""
    word = cuda.local.array(1, uint32)
    word[0] = bits
    return word.view(np.float32)[0]


@cuda.jit(device=True, inline=True)
def load_chunks(words, scales, q, scale, zero, row, j0, group_chunks, trip, per_byte):
    """words[i] <- chunk j0 + 32 i of row `row` of q as four uint32, for i < len(trip) and the chunks
    the row has, and scales[i] <- what `quantized8` takes of its group: int8, (scale, 0); int4, (16
    scale, offset - 16 scale)."""
    chunks = q.shape[1] // QCHUNK
    for i in range(len(trip)):
        j = j0 + i * WARP
        if j < chunks:
            loaded = load_16_bytes(q, row * q.shape[1] + j * QCHUNK)
            for k in range(4):
                words[i, k] = loaded[k]
            group = uint32(j) // uint32(group_chunks)
            s = to_f32(scale[row, group])
            if len(per_byte) == 2:
                s *= float32(16.0)
                scales[i, 0], scales[i, 1] = s, to_f32(zero[row, group]) - s
            else:
                scales[i, 0], scales[i, 1] = s, float32(0.0)


@cuda.jit(device=True)
def int8_values(word):
    """The word's four bytes, the first lowest, as the float32 values of int8: a byte xor 0x80 (128 +
    its value) goes into the low bits of the float 2^23 and comes out exact by one subtraction."""
    bias, offset = uint32(0x4B000080), float32(8388736.0)   # the bits of 2^23 + 128, its value
    return (float_of_bits((word & uint32(0xFF)) ^ bias) - offset,
            float_of_bits(((word >> uint32(8)) & uint32(0xFF)) ^ bias) - offset,
            float_of_bits(((word >> uint32(16)) & uint32(0xFF)) ^ bias) - offset,
            float_of_bits((word >> uint32(24)) ^ bias) - offset)


@cuda.jit(device=True)
def nibble_fraction(word, bit):
    """The nibble n at bit `bit` of the word as the float32 1 + n / 16: n shifted to the top of the
    mantissa of 1.0 (bits 19..22)."""
    field = word << uint32(19 - bit) if bit <= 19 else word >> uint32(bit - 19)
    return float_of_bits((field & uint32(0x00780000)) | uint32(0x3F800000))


@cuda.jit(device=True)
def quantized8(words, scales, e, per_byte):
    """Features 8e .. 8e + 7 of the trip's first chunk (load_chunks) as eight float32: int8 (e < 2),
    the weights' integers, the bytes of words 2e and 2e + 1; int4 (e < 4), the weights scale * n +
    offset of the nibbles n of words 2(e % 2) and 2(e % 2) + 1, low nibbles for e < 2, high after,
    each weight one multiply-add of 1 + n / 16 (16 scale (1 + n / 16) + offset - 16 scale)."""
    a, b = words[0, 2 * (e % 2)], words[0, 2 * (e % 2) + 1]
    if len(per_byte) == 1:
        return int8_values(a) + int8_values(b)
    high = 4 * (e // 2)
    s, z = scales[0, 0], scales[0, 1]
    return (s * nibble_fraction(a, high) + z, s * nibble_fraction(a, 8 + high) + z,
            s * nibble_fraction(a, 16 + high) + z, s * nibble_fraction(a, 24 + high) + z,
            s * nibble_fraction(b, high) + z, s * nibble_fraction(b, 8 + high) + z,
            s * nibble_fraction(b, 16 + high) + z, s * nibble_fraction(b, 24 + high) + z)


@cuda.jit(device=True, inline=True)
def add_chunk(total, part, scales, per_byte):
    """total + the sum of products of the trip's first chunk: int8 times its scale; int4 as it is."""
    return total + part if len(per_byte) == 2 else total + scales[0, 0] * part


@cuda.jit(device=True, inline=True)
def next_chunk(words, scales, trip):
    """Turn the trip round by one chunk (chunk 1 first, ..., chunk 0 last), so that a loop over the trip
    reads its first chunk each time: a loop the compiler leaves rolled then indexes nothing at run
    time, and the trip stays in registers. len(trip) turns give the trip as loaded."""
    L = len(trip)
    for k in range(4):
        first = words[0, k]
        for i in range(L - 1):
            words[i, k] = words[i + 1, k]
        words[L - 1, k] = first
    for k in range(2):
        first = scales[0, k]
        for i in range(L - 1):
            scales[i, k] = scales[i + 1, k]
        scales[L - 1, k] = first


@cuda.jit(device=True, inline=True)
def products8(parts, squares, x, g, words, scales, e, c, r0, group, norm, tiles, per_byte):
    """parts[t, r] += features c .. c + 7 of row r0 + r of x times the trip's first chunk's eight
    weights there (its e-th eight) of matrix t, for the R = len(group) rows and T = len(tiles)
    matrices; with the norm (len(norm) == 1) the weights times g's gains, and squares[r] += the
    squares of x's."""
    N = x.shape[0]
    R, T = len(group), len(tiles)
    first = quantized8(words[0], scales[0], e, per_byte)
    second = quantized8(words[1], scales[1], e, per_byte) if T == 2 else first
    if len(norm) == 1:
        gains = load_8_floats(g, 0, c)
        first = product(first, gains)
        second = product(second, gains) if T == 2 else first
    for r in range(R):
        if R == 1 or r0 + r < N:   # (R == 1: no test, the one row is there)
            v = load_8_floats(x, r0 + r, c)
            if len(norm) == 1:
                squares[r] = dot(squares[r], v, v)
            parts[0, r] = dot(parts[0, r], v, first)
            if T == 2:
                parts[1, r] = dot(parts[1, r], v, second)


@cuda.jit(device=True, inline=True)
def chunk_products(sums, squares, parts, x, g, words, scales, j, chunks, r0, group, norm, tiles, per_byte):
    """sums[t, r] += the trip's first chunk (chunk j of the rows of w, if there is one) of matrix t
    times row r0 + r of x (`products8`, its eights unrolled by hand: a loop the compiler left rolled
    would shift by amounts known only at run time)."""
    if j < chunks:
        R, T, P = len(group), len(tiles), len(per_byte)
        for r in range(R):
            for t in range(T):
                parts[t, r] = 0.0
        c = 2 * P * CHUNK * j
        products8(parts, squares, x, g, words, scales, 0, c, r0, group, norm, tiles, per_byte)
        products8(parts, squares, x, g, words, scales, 1, c + CHUNK, r0, group, norm, tiles, per_byte)
        if P == 2:
            products8(parts, squares, x, g, words, scales, 2, c + 2 * CHUNK, r0, group, norm, tiles, per_byte)
            products8(parts, squares, x, g, words, scales, 3, c + 3 * CHUNK, r0, group, norm, tiles, per_byte)
        for r in range(R):
            for t in range(T):
                sums[t, r] = add_chunk(sums[t, r], parts[t, r], scales[t], per_byte)


@cuda.jit(cache=True)
def quantized_rows(x, g, res, q, scale, zero, features, eps, group_chunks, group, norm, tiles, trip, per_byte, y):
    # x (N, C), g (1, C), res (N, O), (q, scale, zero) quantized (T O, K) -> y (N, O), C >= K = features
    # (the rest zeros), T = len(tiles) matrices side by side. With the norm (len(norm) == 1): T = 1,
    # y = rmsnorm(x; g) @ w.T (norm_linear); T = 2, y = swiglu of rmsnorm(x; g) @ w[:O].T and @ w[O:].T
    # (norm_swiglu). Without (norm = ()): y = res + x @ w.T (linear_residual; g unread). The warp of
    # column o computes y[:, o] from rows o (and O + o) of w, R = len(group) rows at a time, a trip of
    # len(trip) chunks a lane.
    N = x.shape[0]
    O = y.shape[1]
    T, R, L = len(tiles), len(group), len(trip)
    chunks = q.shape[1] // QCHUNK
    column_, lane = column()
    o = min(column_, O - 1)   # a warp past the last column repeats it, never stored
    words = cuda.local.array((MATRICES, QTRIP, 4), uint32)
    scales = cuda.local.array((MATRICES, QTRIP, 2), float32)
    sums = cuda.local.array((MATRICES, ROWS), float32)
    parts = cuda.local.array((MATRICES, ROWS), float32)
    squares = cuda.local.array(ROWS, float32)
    let_next_start()
    for t in range(T):
        prefetch_row(q, t * O + o)
    stride = L * WARP
    for r0 in range(0, N, R):
        for r in range(R):
            squares[r] = 0.0
            for t in range(T):
                sums[t, r] = 0.0
        for j0 in range(lane, chunks, stride):   # loads first
            if load_trip(j0, lane, r0, chunks, stride):
                for t in range(T):
                    load_chunks(words[t], scales[t], q, scale, zero, t * O + o, j0, group_chunks, trip, per_byte)
            if r0 == 0 and j0 == lane:   # the first trip's weights were asked for before
                wait_for_previous()
            for i in range(L):
                chunk_products(sums, squares, parts, x, g, words, scales, j0 + i * WARP, chunks, r0, group, norm,
                               tiles, per_byte)
                for t in range(T):
                    next_chunk(words[t], scales[t], trip)
        for r in range(R):
            if R == 1 or r0 + r < N:   # (R == 1: no test, the one row is there)
                total = warp_sum(sums[0, r])
                up = warp_sum(sums[1, r]) if T == 2 else total
                sum_squares = warp_sum(squares[r]) if len(norm) == 1 else total
                if lane == 0 and column_ == o:
                    if len(norm) == 1:
                        rstd = float32(1.0) / math.sqrt(sum_squares / float32(features) + eps)
                        total *= rstd
                        if T == 2:
                            total = swiglu(total, up * rstd)
                    else:
                        total += to_f32(res[r0 + r, o])
                    y[r0 + r, o] = stored(y, total)


def launch_quantized(x, w, y, g=None, eps: float = 0.0, tiles: int = 1, res=None) -> None:
    """quantized_rows on x and the quantized w = (q, scale, zero) into y: with the norm's gains g,
    rmsnorm(x; g) through T = tiles matrices stacked in w; else res + x @ w.T."""
    q, scale, zero = w
    per_byte, group_chunks = quantized_layout(q, scale, zero)
    rows = in_chunks(x)
    norm = () if g is None else (int32(0),)
    runtime.launch(quantized_rows, runtime.blocks_for(y.shape[1], WARPS), THREADS, rows,
                   rows if g is None else in_chunks(g), y if res is None else res, aligned(q), scale, zero,
                   x.shape[1], float32(eps), group_chunks, row_group(x.shape[0]), norm, (int32(0),) * tiles,
                   trip_of(q), per_byte, y, overlap=True)
