"""What the FlashAttention families share: the kernel types they return, the masked score, the
shared-memory alignment and the compiler options."""

import math
from typing import NamedTuple

from numba import cuda

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


SHARED_ALIGN = 16   # 16-byte aligned shared memory: cp.async, ldmatrix and the wgmma swizzle need it


def kernel_options(max_registers: int | None) -> dict:
    """@cuda.jit's options for a kernel: fastmath, and at most max_registers registers a thread
    (None: no cap)."""
    return {"fastmath": True} if max_registers is None else {"fastmath": True, "max_registers": max_registers}
