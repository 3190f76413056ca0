"""What the FlashAttention families share: the kernel types they return, the masked score, and
(in one section) what differs under Numba's CUDA simulator."""

import math
from typing import NamedTuple

from numba import cuda

from nanoeuler_ops.cuda import runtime

LOG2E = math.log2(math.e)
MASKED = -1e30   # the score of a key in a row's causal future: exp() of it is 0, and unlike -inf it stays
                 # well defined under fastmath


class Kernel(NamedTuple):
    function: object    # the @cuda.jit kernel
    shared_bytes: int   # the dynamic shared memory it takes


class FlashKernels(NamedTuple):
    """A family's kernels for one head size D. Each takes its inputs, the sizes T, S, H, KV (where
    the family's kernels take them), the float32 scale 1/sqrt(D), then its outputs; tensors q, o,
    do, dq are (B, T, H, D), k, v, dk, dv (B, S, KV, D), in the family's form; lse, di (B, H, T)."""
    forward: Kernel   # q, k, v -> o, lse
    dq: Kernel        # do, q, k, v, o, lse -> dq, di
    dkdv: Kernel      # do, q, k, v, lse, di -> dk, dv


@cuda.jit(device=True, inline=True)
def zero(acc):
    # a register tile of accumulators (any family's) <- 0
    for i in range(acc.shape[0]):
        for j in range(acc.shape[1]):
            acc[i, j] = 0.0


# ---------------------------------------------------------------- under the simulator

SHARED_ALIGN = None if runtime.SIMULATOR else 16   # 16-byte aligned shared memory (the simulator takes no alignment)


def kernel_options(max_registers: int | None) -> dict:
    """@cuda.jit's options for a kernel: fastmath, and at most max_registers registers a thread
    (None: no cap; the simulator takes none)."""
    return {"fastmath": True} if runtime.SIMULATOR or max_registers is None else \
        {"fastmath": True, "max_registers": max_registers}


def lane_reduce(width: int):
    """A device function values[i] <- its max (or sum, take_max False) over the `width`
    neighbouring lanes of this thread's group, for each i (every thread of the block must call it)."""
    if runtime.SIMULATOR:
        def reduce(values, take_max):
            values[:] = runtime.simulated_reduce(values, width, take_max)
        return reduce

    @cuda.jit(device=True, inline=True)
    def reduce(values, take_max):
        # xor shuffles below `width` stay among the group's lanes; the values' shuffles interleave
        offset = width // 2
        while offset > 0:
            for i in range(values.shape[0]):
                other = cuda.shfl_xor_sync(runtime.FULL_MASK, values[i], offset)
                values[i] = max(values[i], other) if take_max else values[i] + other
            offset //= 2
    return reduce
