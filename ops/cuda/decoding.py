"""Device code the CUDA decoding ops share.

norm_linear, norm_swiglu and linear_residual: one block per output column, reducing dot products
over the input features for up to ROWS rows at a time.

Batch invariance (nanoeuler_core/inference/decode.py): thread tid sums the features c = tid,
tid + THREADS, ... in that order (four at a time, loads first, so each thread keeps four reads of
the weight row in flight), each warp reduces its threads by a fixed shuffle tree, and the block
adds its warps in order. A row's result thus depends on nothing but the row, not on how many rows
the call holds or where the row sits among them. Decoding reads each weight once per call, so the
kernels are bound by memory bandwidth: one block per output row keeps enough reads in flight.
"""

from numba import cuda, float32

from nanoeuler_ops.cuda.runtime import SIMULATOR, WARP, warp_sum

THREADS = 64 if SIMULATOR else 128   # threads per block (one block per output column); two warps keep the simulator quick
WARPS = THREADS // WARP
ROWS = 4                 # rows reduced together: the weights are read once per group of ROWS rows
UNROLL = 4               # features per thread loaded before they are used


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

