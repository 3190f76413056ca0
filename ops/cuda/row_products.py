"""The skinny matrix products that the decoding ops norm_linear, norm_swiglu and linear_residual
share: y[n, o] = x[n] . w[o] (after an RMSNorm of x, or plus a residual) for a few rows x (N, C) and
a weight matrix w (O, C), each row's result independent of the others (batch invariance).

Float32 weights, FMA kernels: a warp per output column o, a block WARPS columns. Lane l reads the
features in chunks of CHUNK = 8 (one 16-byte load each): chunks l, l + 32, ..., a trip of several
at once, and sums each chunk in element order; the warp adds its lanes by a fixed shuffle tree.
Rows go in groups of R (`row_group`: 1 for a lone row, ROWS for a few, MANY_ROWS for a slice), the
weights read once a group.
bf16 weights, tensor-core kernels (mma.sync m16n8k16): a block per TILE = 16 output columns (the
A operand), GROUP = 8 rows of x at a time (B, each row as hi + lo bf16 parts), a slice's groups
through each trip of weights together (`tile_groups`), its warps splitting the features BLOCK = 32
at a time; the warps' sums meet in shared memory, added in warp order.
Quantized weights (int8, int4), one kernel for the three ops on the float32 layout (`quantized_rows`):
each block rounds x to int8 by blocks of 32 into shared memory (after the norm), and a lane's 16-byte
load of 16 int8 weights or 32 int4 multiplies x's bytes by dp4a, four products an instruction.
Every kernel's grid has a second dimension over slices of SLICE rows (`row_slices`): a block computes
its columns for one slice, so that many rows (a prompt's chunk) run on many blocks side by side, not
group after group on one; a row's sums are added in the same order whichever block computes them.
Each kernel asks for its weights (prefetch, first trip) before it waits for the kernel ahead.
docs/cuda.md ("Decoding's matrix products") tells why each choice.
"""

import math

from numba import cuda, float32, int32, uint32

from nanoeuler_core import quantized
from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.device import (DEVICE, WARP, bf16x2_values, dp4a, let_next_start, load_16_bytes,
                                       load_8_floats, mma_bf16, pack_bf16x2, prefetch_l2, quad_max, quad_sum,
                                       rint_scaled, stored, to_f32, wait_for_previous, warp_sum)

WARPS = 4       # columns per block
THREADS = WARPS * WARP
ROWS = 4        # rows reduced together: the weights are read once per group of ROWS rows
MANY_ROWS = 8   # rows reduced together where there are a slice's worth or more
SLICE = 32      # rows a block computes at most (a multiple of every group: ROWS, MANY_ROWS, GROUP)
CHUNK = 8       # features a lane reads at once (16 bytes of bf16)
STEP = WARP * CHUNK   # features from a lane's chunk to its next


def row_group(N: int) -> tuple:
    """The kernels' `group` argument for N rows: a tuple of R zeros, R = 1 for one row, ROWS below a
    slice, else MANY_ROWS. A kernel takes R as len(group), a constant when it compiles (a tuple's
    length is part of its type)."""
    return (int32(0),) * (1 if N == 1 else ROWS if N < SLICE else MANY_ROWS)


def row_slices(N: int) -> int:
    """The grid's second dimension for N rows: a block per SLICE rows."""
    return max(1, -(-N // SLICE))


@cuda.jit(device=True, inline=True)
def slice_rows(N):
    """The rows lo..hi-1 of x this block computes: the slice at its y in the grid."""
    lo = cuda.blockIdx.y * SLICE
    return lo, min(N, lo + SLICE)


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
def load_trip(c, first, first_group, C, stride):
    """Whether a lane loads the weights of its trip from feature c for a group of rows (the block's
    first group or not; its trips `stride` features apart): it keeps its first trip's (from `first`)
    for every group, unless a later trip replaced them."""
    return first_group or c != first or first + stride < C


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
# others, whichever kernel (one group, or a slice's four at once) and block compute it. A block's warps (NORM_WARPS, linear_residual's
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
def sums_at(warp, slot, k, lane, slots):
    """Where lane `lane`'s result k of `slot` lies in a block's shared sums, (warps, slots, 4, WARP) flat."""
    return ((warp * slots + slot) * 4 + k) * WARP + lane


def sums_bytes(warps: int, slots: int) -> int:
    """The dynamic shared memory of a block's sums (`share_sums`): `slots` results of `warps` warps."""
    return 4 * warps * slots * 4 * WARP


@cuda.jit(device=True, inline=True)
def share_sums(sums, slot, slots, warp, acc):
    """Leave this lane's four results (its D fragment: hi's sums + lo's) at `slot` of the block's sums."""
    lane = cuda.threadIdx.x % WARP
    for k in range(4):
        sums[sums_at(warp, slot, k, lane, slots)] = acc[0][k] + acc[1][k]


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
def warps_total(sums, slot, slots, lane, k, warps):
    """The `warps` warps' sums (share_sums) of one result, added in warp order."""
    total = float32(0.0)
    for warp in range(warps):
        total += sums[sums_at(warp, slot, k, lane, slots)]
    return total


@cuda.jit(device=True, inline=True)
def row_rstd(squares, n, features, eps, warps):
    """1 / the root mean square of the block's row n, from the `warps` warps' sums of squares (share_squares)."""
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
SLICE_GROUPS = 4   # groups of rows in a slice (SLICE / GROUP), written out in the kernels: a loop over
                   # them that the compiler left rolled would index their sums at run time (local memory)


def tile_groups(N: int) -> tuple:
    """The tensor-core kernels' `groups` argument for N rows: a tuple of G zeros, G the groups of
    GROUP rows a block multiplies at once, 1 for a step's few rows (N <= GROUP: one group's sums in
    registers), else a slice's SLICE_GROUPS (a constant when a kernel compiles, as `row_group`'s R)."""
    return (int32(0),) * (1 if N <= GROUP else SLICE_GROUPS)


@cuda.jit(device=True, inline=True)
def norm_group_trip(acc, sum_squares, weights, x, g, row, c0, warp, t, T):
    """A group's sums (acc: the T matrices' `no_sums`) and its row's sum of squares, plus the products
    of a trip of weights with features c0.. of the group's rows (this lane's: `row`)."""
    first, second = acc
    for j in range(NORM_TRIP):
        v, sum_squares = normed_chunk(x, g, row, trip_feature(c0, j, warp, t, NORM_WARPS), sum_squares)
        first = mma_block(first, weights[0], j, v)
        if T == 2:
            second = mma_block(second, weights[1], j, v)
    return (first, second), sum_squares


@cuda.jit(device=True, inline=True)
def share_norm_group(sums, squares, group, G, T, warp, i, t, acc, sum_squares):
    """A group's sums and sums of squares (norm_group_trip) into the block's shared memory."""
    for tile in range(T):
        share_sums(sums, group * T + tile, G * T, warp, acc[tile])
    share_squares(squares, warp, group * GROUP + i, t, sum_squares)


@cuda.jit(cache=True)
def norm_tiles(x, g, w, features, eps, tiles, groups, y):
    # x (N, C), g (1, C), w (T O, C) bf16 -> y (N, O), C >= features (the rest zeros), T = len(tiles):
    # 1, y = rmsnorm(x; g) @ w.T (norm_linear); 2, y = swiglu of rmsnorm(x; g) @ w[:O].T and @ w[O:].T
    # (norm_swiglu). Block (b, s) computes y[:, 16b:16b+16] of slice s's rows on the tensor cores, its
    # G = len(groups) groups of GROUP rows through each trip of weights before the next trip; the
    # warps' sums in dynamic shared memory, sums_bytes(NORM_WARPS, T G).
    N, C = x.shape
    O = y.shape[1]
    T, G = len(tiles), len(groups)
    warp, i, t = mma_lane()
    top, bottom = tile_rows(w[:O], cuda.blockIdx.x * TILE, i)
    weights = cuda.local.array((2, NORM_TRIP, 8), uint32)
    sums = cuda.shared.array(0, float32)
    squares = cuda.shared.array((NORM_WARPS, SLICE), float32)
    let_next_start()
    stride = NORM_WARPS * NORM_TRIP * BLOCK
    lo, hi = slice_rows(N)
    acc0 = acc1 = acc2 = acc3 = (no_sums(), no_sums())
    squares0 = squares1 = squares2 = squares3 = float32(0.0)
    for c0 in range(0, C, stride):   # loads first
        for j in range(NORM_TRIP):
            c = trip_feature(c0, j, warp, t, NORM_WARPS)
            for tile in range(T):
                load_words(weights[tile], j, w, tile * O + top, tile * O + bottom, c)
        if c0 == 0:   # the first trip's weights were asked for before
            wait_for_previous()
        acc0, squares0 = norm_group_trip(acc0, squares0, weights, x, g, lo + i, c0, warp, t, T)
        if G > 1:   # groups past the slice's rows are skipped by every warp
            if lo + GROUP < hi:
                acc1, squares1 = norm_group_trip(acc1, squares1, weights, x, g, lo + GROUP + i, c0, warp, t, T)
            if lo + 2 * GROUP < hi:
                acc2, squares2 = norm_group_trip(acc2, squares2, weights, x, g, lo + 2 * GROUP + i, c0, warp, t, T)
            if lo + 3 * GROUP < hi:
                acc3, squares3 = norm_group_trip(acc3, squares3, weights, x, g, lo + 3 * GROUP + i, c0, warp, t, T)
    share_norm_group(sums, squares, 0, G, T, warp, i, t, acc0, squares0)
    if G > 1:
        share_norm_group(sums, squares, 1, G, T, warp, i, t, acc1, squares1)
        share_norm_group(sums, squares, 2, G, T, warp, i, t, acc2, squares2)
        share_norm_group(sums, squares, 3, G, T, warp, i, t, acc3, squares3)
    cuda.syncthreads()
    for e in range(cuda.threadIdx.x, TILE * GROUP * G, NORM_WARPS * WARP):
        group = e // (TILE * GROUP)
        col, m, lane, k = tile_entry(e % (TILE * GROUP))
        o, n = cuda.blockIdx.x * TILE + col, lo + group * GROUP + m
        if o < O and n < hi:
            rstd = row_rstd(squares, group * GROUP + m, features, eps, NORM_WARPS)
            total = warps_total(sums, group * T, G * T, lane, k, NORM_WARPS) * rstd
            if T == 2:
                total = swiglu(total, warps_total(sums, group * T + 1, G * T, lane, k, NORM_WARPS) * rstd)
            y[n, o] = stored(y, total)


def launch_norm_tiles(x, g, w, eps, tiles: int, y) -> None:
    """norm_tiles on x, g and w (bf16) into y, T = tiles matrices stacked in w."""
    groups = tile_groups(x.shape[0])
    runtime.launch(norm_tiles, (runtime.blocks_for(y.shape[1], TILE), row_slices(x.shape[0])), NORM_WARPS * WARP,
                   in_chunks(x), in_chunks(g), in_chunks(w), x.shape[1], float32(eps), (int32(0),) * tiles, groups, y,
                   shared_bytes=sums_bytes(NORM_WARPS, tiles * len(groups)), overlap=True)


# ---------------------------------------------------------------- quantized weights
# (q, scale, zero) as nanoeuler_core/quantized.py lays them out, times x rounded to 8 bits by blocks of
# QBLOCK = 32 features (quantized.round_activations), both factors multiplied as integers by dp4a.
#
# Rounding (`round_rows`), once a group of rows in every block, after the wait: thread t takes chunks
# t, t + THREADS, ... of 8 features of a row (zeros past its end, up to whole blocks), so the four
# lanes of a quad hold one block and find its max |x| by two shuffles; each value becomes
# rint(x * (127 / max)) (`rint_scaled`: the float32 product rounded once, as the reference rounds
# it), four to a word, in shared memory beside the block's d = max / 127. With the norm the block first
# adds each row's squares (its warps' sums meet in shared memory) and rounds x * rstd * g.
#
# Products: a warp per output column, lane l reading chunks l, l + 32, ... of QCHUNK = 16 bytes of
# the column's row of q: 16 int8 weights (half a block of x), or 32 int4 (one packed block: byte j
# holds weights j and j + 16). A trip is the chunks a lane asks for at once (as many as the row has
# for the lane, up to QTRIP: `trip_of`), each with its group's float16 scale (and offset) made float32:
# a chunk lies in one group. int8: four dp4a of the chunk's words with x's; int4: the low nibbles of word k
# (w & 0x0F0F0F0F) with x's word k, its high nibbles with word k + 4, eight dp4a. The chunk's integer
# sum becomes float32 once, times the block's d and the group's scale; int4 adds offset * d * (the
# block's sum of x's integers, which the rounding leaves beside d).

QCHUNK = 16     # bytes of a quantized row a lane loads at once
QTRIP = 4       # chunks a lane asks for at once at most: an int8 row of 2,048 weights (w_down) in one trip
MATRICES = 2    # matrices a warp of quantized_rows reads side by side at most (norm_swiglu's gate and up)
QBLOCK = quantized.QBLOCK   # features of x rounded together
QWORDS = QBLOCK // 4        # words of a rounded block of x: its 32 int8


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


def rounded_bytes(R: int, K: int) -> int:
    """The shared memory quantized_rows takes for R rows of K features rounded: a block of 32 is
    QWORDS words of int8, its d and its d * (sum of its integers), float32."""
    return 4 * R * -(-K // QBLOCK) * (QWORDS + 2)


def aligned(q):
    """q itself if its data is 16-byte aligned (its rows are whole chunks), else an aligned copy."""
    if DEVICE.is_aligned(q, QCHUNK):
        return q
    copy = runtime.empty(q.shape, q.dtype)
    runtime.copy(copy, q)
    return copy


@cuda.jit(device=True, inline=True)
def load_chunks(words, scales, q, scale, zero, row, j0, group_chunks, trip, per_byte):
    """words[i] <- chunk j0 + 32 i of row `row` of q as four uint32, for i < len(trip) and the chunks
    the row has, and scales[i] <- its group's (scale, offset) (int8: offset 0)."""
    chunks = q.shape[1] // QCHUNK
    for i in range(len(trip)):
        j = j0 + i * WARP
        if j < chunks:
            loaded = load_16_bytes(q, row * q.shape[1] + j * QCHUNK)
            for k in range(4):
                words[i, k] = loaded[k]
            group = uint32(j) // uint32(group_chunks)
            scales[i, 0] = to_f32(scale[row, group])
            scales[i, 1] = to_f32(zero[row, group]) if len(per_byte) == 2 else float32(0.0)


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
def int8x4(a, b, c, d):
    """Four integers of -127..127 as the bytes of one word, a the lowest."""
    byte = uint32(0xFF)
    return uint32((uint32(a) & byte) | ((uint32(b) & byte) << uint32(8)) | ((uint32(c) & byte) << uint32(16))
                  | (uint32(d) << uint32(24)))


@cuda.jit(device=True, inline=True)
def round_chunk(v, inverse):
    """Eight float32 values, each rint(v * inverse), as two words of int8, and their sum."""
    q0, q1, q2, q3 = (rint_scaled(v[0], inverse), rint_scaled(v[1], inverse), rint_scaled(v[2], inverse),
                      rint_scaled(v[3], inverse))
    q4, q5, q6, q7 = (rint_scaled(v[4], inverse), rint_scaled(v[5], inverse), rint_scaled(v[6], inverse),
                      rint_scaled(v[7], inverse))
    return int8x4(q0, q1, q2, q3), int8x4(q4, q5, q6, q7), int32(q0 + q1 + q2 + q3 + q4 + q5 + q6 + q7)


@cuda.jit(device=True, inline=True)
def round_rows(xs, ds, squares, x, g, r0, features, eps, group, norm, per_byte):
    """Rows r0 .. r0 + R - 1 of x (R = len(group), zeros past x's last), with the norm rmsnorm(x; g),
    rounded to int8 by blocks of 32 (quantized.round_activations) into the block's shared memory:
    row r's block b as the words xs[(r B + b) QWORDS:][:QWORDS] (B = the row's blocks), its d at
    ds[r B + b] and, for int4 (len(per_byte) == 2), d * its sum of integers at ds[(R + r) B + b].
    Every thread of the block calls it; squares (WARPS, MANY_ROWS) holds the warps' sums of squares."""
    R = len(group)
    tid = cuda.threadIdx.x
    B = (features + QBLOCK - 1) // QBLOCK
    chunks = B * (QBLOCK // CHUNK)   # chunks of 8 features in a row's whole blocks
    if len(norm) == 1:
        for r in range(R):
            sum_squares = float32(0.0)
            for c in range(tid, chunks, THREADS):
                v = row_chunk(x, r0 + r, c * CHUNK)
                sum_squares = dot(sum_squares, v, v)
            sum_squares = warp_sum(sum_squares)
            if tid % WARP == 0:
                squares[tid // WARP, r] = sum_squares
        cuda.syncthreads()
    for r in range(R):
        rstd = row_rstd(squares, r, features, eps, WARPS) if len(norm) == 1 else float32(1.0)
        for c0 in range(0, chunks, THREADS):   # every lane of a warp goes round as often: they shuffle
            c = c0 + tid
            v = row_chunk(x, r0 + r, c * CHUNK)
            if len(norm) == 1:
                v = product(product(v, (rstd, rstd, rstd, rstd, rstd, rstd, rstd, rstd)), chunk(g, 0, c * CHUNK))
            largest = quad_max(max(abs(v[0]), abs(v[1]), abs(v[2]), abs(v[3]), abs(v[4]), abs(v[5]), abs(v[6]),
                                   abs(v[7])))
            inverse = float32(127.0) / largest if largest > float32(0.0) else float32(0.0)
            low, high, total = round_chunk(v, inverse)
            if len(per_byte) == 2:
                total = quad_sum(total)
            if c < chunks:
                xs[(r * B * QBLOCK + c * CHUNK) // 4] = low
                xs[(r * B * QBLOCK + c * CHUNK) // 4 + 1] = high
                if c % 4 == 0:
                    d = largest / float32(127.0)
                    ds[r * B + c // 4] = d
                    if len(per_byte) == 2:
                        ds[(R + r) * B + c // 4] = d * float32(total)


@cuda.jit(device=True, inline=True)
def chunk_sum(words, xs, i, per_byte):
    """The integer dot product of the trip's first chunk (words[0]) with x's rounded words from xs[i]:
    int8, its four words with four of x's; int4, the low nibbles of word k with x's word k and its
    high nibbles with word k + 4 (nibbles are below 128: bytes dp4a reads as they are)."""
    if len(per_byte) == 1:
        return dp4a(words[0, 3], xs[i + 3], dp4a(words[0, 2], xs[i + 2], dp4a(words[0, 1], xs[i + 1],
                                                                              dp4a(words[0, 0], xs[i], int32(0)))))
    nibbles = uint32(0x0F0F0F0F)
    low = high = int32(0)
    for k in range(4):
        low = dp4a(words[0, k] & nibbles, xs[i + k], low)
        high = dp4a((words[0, k] >> uint32(4)) & nibbles, xs[i + 4 + k], high)
    return int32(low + high)


@cuda.jit(device=True, inline=True)
def chunk_products(sums, xs, ds, words, scales, j, chunks, r0, N, B, group, tiles, per_byte):
    """sums[t, r] += the trip's first chunk (chunk j of the rows of w, if there is one) of matrix t times
    row r0 + r of x rounded (round_rows): its integer sum (`chunk_sum`) as float32, times the block's
    d, times the group's scale; for int4 plus the group's offset times the block's d * sum."""
    if j < chunks:
        R, T, P = len(group), len(tiles), len(per_byte)
        b = j * P // 2   # the block of x the chunk lies in
        for r in range(R):
            if R == 1 or r0 + r < N:   # (R == 1: no test, the one row is there)
                i = (r * B * QBLOCK + j * P * QCHUNK) // 4
                d = ds[r * B + b]
                for t in range(T):
                    part = scales[t, 0, 0] * (float32(chunk_sum(words[t], xs, i, per_byte)) * d)
                    if P == 2:
                        part += scales[t, 0, 1] * ds[(R + r) * B + b]
                    sums[t, r] += part


@cuda.jit(cache=True)
def quantized_rows(x, g, res, q, scale, zero, features, eps, group_chunks, group, norm, tiles, trip, per_byte, y):
    # x (N, C), g (1, C), res (N, O), (q, scale, zero) quantized (T O, K) -> y (N, O), C >= K = features
    # (the rest zeros), T = len(tiles) matrices side by side. With the norm (len(norm) == 1): T = 1,
    # y = rmsnorm(x; g) @ w.T (norm_linear); T = 2, y = swiglu of rmsnorm(x; g) @ w[:O].T and @ w[O:].T
    # (norm_swiglu). Without (norm = ()): y = res + x @ w.T (linear_residual; g unread). x is read
    # rounded to int8 by blocks of 32 (round_rows; dynamic shared memory: rounded_bytes(R, K)). The warp
    # of column o computes y[:, o] of its slice's rows from rows o (and O + o) of w, R = len(group) rows
    # at a time, a trip of len(trip) chunks a lane.
    N = x.shape[0]
    O = y.shape[1]
    T, R, L = len(tiles), len(group), len(trip)
    chunks = q.shape[1] // QCHUNK
    B = (features + QBLOCK - 1) // QBLOCK
    column_, lane = column()
    o = min(column_, O - 1)   # a warp past the last column repeats it, never stored
    words = cuda.local.array((MATRICES, QTRIP, 4), uint32)
    scales = cuda.local.array((MATRICES, QTRIP, 2), float32)
    sums = cuda.local.array((MATRICES, MANY_ROWS), float32)
    squares = cuda.shared.array((WARPS, MANY_ROWS), float32)
    xs = cuda.shared.array(0, uint32)
    ds = cuda.shared.array(0, float32)[R * B * QWORDS:]   # after xs, in the same memory
    let_next_start()
    for t in range(T):
        prefetch_row(q, t * O + o)
        load_chunks(words[t], scales[t], q, scale, zero, t * O + o, lane, group_chunks, trip, per_byte)
    wait_for_previous()   # the first trip's weights were asked for before
    stride = L * WARP
    lo, hi = slice_rows(N)
    for r0 in range(lo, hi, R):
        round_rows(xs, ds, squares, x, g, r0, features, eps, group, norm, per_byte)
        cuda.syncthreads()
        for r in range(R):
            for t in range(T):
                sums[t, r] = 0.0
        for j0 in range(lane, chunks, stride):
            if j0 != lane or (r0 > lo and lane + stride < chunks):   # a later trip replaced the first
                for t in range(T):
                    load_chunks(words[t], scales[t], q, scale, zero, t * O + o, j0, group_chunks, trip, per_byte)
            for i in range(L):
                chunk_products(sums, xs, ds, words, scales, j0 + i * WARP, chunks, r0, N, B, group, tiles, per_byte)
                for t in range(T):
                    next_chunk(words[t], scales[t], trip)
        for r in range(R):
            if R == 1 or r0 + r < N:   # (R == 1: no test, the one row is there)
                total = warp_sum(sums[0, r])
                up = warp_sum(sums[1, r]) if T == 2 else total
                if lane == 0 and column_ == o:
                    if len(norm) == 0:
                        total += to_f32(res[r0 + r, o])
                    elif T == 2:
                        total = swiglu(total, up)
                    y[r0 + r, o] = stored(y, total)
        cuda.syncthreads()   # before the next group's rounding


def launch_quantized(x, w, y, g=None, eps: float = 0.0, tiles: int = 1, res=None) -> None:
    """quantized_rows on x and the quantized w = (q, scale, zero) into y: with the norm's gains g,
    rmsnorm(x; g) through T = tiles matrices stacked in w; else res + x @ w.T."""
    q, scale, zero = w
    per_byte, group_chunks = quantized_layout(q, scale, zero)
    rows, group = in_chunks(x), row_group(x.shape[0])
    norm = () if g is None else (int32(0),)
    runtime.launch(quantized_rows, (runtime.blocks_for(y.shape[1], WARPS), row_slices(x.shape[0])), THREADS, rows,
                   rows if g is None else in_chunks(g), y if res is None else res, aligned(q), scale, zero,
                   x.shape[1], float32(eps), group_chunks, group, norm, (int32(0),) * tiles, trip_of(q), per_byte, y,
                   shared_bytes=rounded_bytes(len(group), x.shape[1]), overlap=True)
