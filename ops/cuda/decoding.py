"""Device code the CUDA decoding ops share.

norm_linear, norm_swiglu and linear_residual: a warp per output column, reducing dot products over
the input features for up to ROWS rows at a time; a block is WARPS such warps (columns).

The features go in chunks of CHUNK = 8: lane l takes chunks l, l + 32, l + 64, ... of a row, in
that order, and sums each chunk's products in element order; the warp then adds its lanes by a
fixed shuffle tree. A row's result thus depends on nothing but the row (batch invariance,
nanoeuler_core/inference/decode.py), not on how many rows the call holds or where the row sits.

At decoding's few rows these kernels are bound by latency, not bandwidth: a column's weights are a
few KB, a whole matrix a few MB. So a lane asks for several chunks of every operand at once before
it uses any, each chunk one 16-byte load with no branch between them (`chunk`; rows of other
lengths are padded to whole chunks first, `in_chunks`), and no warp waits on another. How many
chunks a trip (TRIP in each kernel) is what the kernel's registers allow with every column of the
`gpu` preset's matrices in one wave of blocks: norm_linear 4 (a 768-wide row in one trip),
norm_swiglu 3 of each of its two rows, linear_residual 8 (w_down's 2,048 features in one trip).
The rows go in groups of R (`row_group`): 1 for a lone row (plain decoding at batch 1), else ROWS.
R is known when the kernel compiles (one kernel per R), so a lone row's kernel holds no other row's
sums: fewer registers, and more of its blocks fit beside the kernel ahead of it.
Launched with overlap=True, each kernel first asks for its weight rows to come into L2
(`prefetch_row`, no registers held), loads its first trip of them (a whole row at the `gpu`
preset's sizes) and only then waits for the kernel ahead of it to end: the weights come while that
kernel runs, and only the input rows are read after it. The first trip's weights stay in registers
for every group of rows; later trips, if any, are read again for each group (`load_trip`).
"""

from numba import cuda, float32, int32, types

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.runtime import SIMULATOR, WARP, prefetch_l2, stored, to_f32

WARPS = 2 if SIMULATOR else 4     # columns per block; two keep the simulator quick
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
    return a.shape[a.ndim - 1] % CHUNK == 0 and (SIMULATOR or a.device_ctypes_pointer.value % 16 == 0)


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
def load_trip(c, first, r0, C, trip):
    """Whether a lane loads the weights of its trip from feature c for the group of rows from r0: it
    keeps its first trip's (from `first`) for every group, unless a later trip replaced them."""
    return r0 == 0 or c != first or first + trip * STEP < C


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


if SIMULATOR:
    def vector8(a, row, c):
        return tuple(to_f32(a[row, c + e]) for e in range(CHUNK))
else:
    from numba.cuda.extending import overload

    from nanoeuler_ops.cuda.runtime import bf16x2_values, float_from_bits, load_16_bytes

    def vector8(a, row, c):
        """a[row, c:c+8] as eight float32, by 16-byte loads (c a multiple of 8, the row aligned)."""

    @overload(vector8, inline="always")
    def _vector8(a, row, c):
        if a.dtype == types.uint16:
            def bf16_chunk(a, row, c):
                w0, w1, w2, w3 = load_16_bytes(a, row * a.shape[1] + c)
                e0, e1 = bf16x2_values(w0)
                e2, e3 = bf16x2_values(w1)
                e4, e5 = bf16x2_values(w2)
                e6, e7 = bf16x2_values(w3)
                return e0, e1, e2, e3, e4, e5, e6, e7
            return bf16_chunk

        def f32_chunk(a, row, c):
            i = row * a.shape[1] + c
            w0, w1, w2, w3 = load_16_bytes(a, i)
            w4, w5, w6, w7 = load_16_bytes(a, i + 4)
            return (float_from_bits(w0), float_from_bits(w1), float_from_bits(w2), float_from_bits(w3),
                    float_from_bits(w4), float_from_bits(w5), float_from_bits(w6), float_from_bits(w7))
        return f32_chunk


@cuda.jit(device=True, inline=True)
def chunk(a, row, c):
    """a[row, c:c+8] as eight float32 (rows of whole chunks); zeros where c is past the row's end,
    read without a branch so that a lane's loads all go out before it uses any."""
    C = a.shape[1]
    v = vector8(a, row, min(c, C - CHUNK))
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
