"""Device code the CUDA decoding ops share.

norm_linear, norm_swiglu and linear_residual: one block per output column, reducing dot products
over the input features for up to ROWS rows at a time.

Batch invariance (nanoeuler_core/inference/decode.py): thread tid sums the features c = tid,
tid + THREADS, ... in that order (four at a time, loads first, so each thread keeps four reads of
the weight row in flight), each warp reduces its threads by a fixed shuffle tree, and the block
adds its warps in order. A row's result thus depends on nothing but the row, not on how many rows
the call holds or where the row sits among them.

At decoding's few rows these kernels are bound by latency, not bandwidth (the GPU reads a matrix of
a few MB in a microsecond or two). Launched with overlap=True, each first asks for its weight rows
to come into L2 (`prefetch_row`, no registers held), then waits for the kernel ahead of it to end:
the weights come while that kernel runs, and the reads after the wait find them in L2.
"""

from numba import cuda, float32

from nanoeuler_ops.cuda.runtime import SIMULATOR, WARP, prefetch_l2, warp_sum

THREADS = 64 if SIMULATOR else 128   # threads per block (one block per output column); two warps keep the simulator quick
WARPS = THREADS // WARP
ROWS = 4                 # rows reduced together: the weights are read once per group of ROWS rows
UNROLL = 4               # features per thread loaded before they are used
LINE = 32                # elements of a 128-byte line of float32 (two lines of bf16: each asked for)


@cuda.jit(device=True)
def to_partials(acc, partial, slot):
    """partial[slot, warp, r] = this warp's sum of acc[r] for r < ROWS. Every thread calls it."""
    lane = cuda.threadIdx.x % WARP
    warp = cuda.threadIdx.x // WARP
    for r in range(ROWS):
        total = warp_sum(acc[r])
        if lane == 0:
            partial[slot, warp, r] = total


@cuda.jit(device=True)
def block_total(partial, slot, r):
    """The block's sum for row r: its warps' partial sums added in order."""
    total = float32(0.0)
    for w in range(WARPS):
        total += partial[slot, w, r]
    return total


@cuda.jit(device=True, inline=True)
def prefetch_row(w, row):
    """Ask for row `row` of the contiguous matrix w to come into L2, a line per thread."""
    C = w.shape[1]
    for line in range(cuda.threadIdx.x * LINE, C, THREADS * LINE):
        prefetch_l2(w, row * C + line)
