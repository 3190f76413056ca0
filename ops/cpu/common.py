"""Helpers shared by the CPU kernels."""

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic


def n_chunks(rows: int) -> int:
    """How many row chunks a parallel reduction splits into: a few per thread, at most one per row."""
    return max(1, min(rows, 4 * numba.get_num_threads()))


# Float flags for kernels whose inner loops are sums (dot products, softmax denominators): letting
# LLVM reorder the additions and fuse multiply-adds is what vectorizes a reduction. NaN and inf
# keep their IEEE meaning (no "nnan"/"ninf"), so a diverging run still shows up as NaN.
REDUCE_FASTMATH = {"reassoc", "contract"}


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose IEEE-754 bit pattern is the int32 `bits`."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@njit(inline="always")
def exp32(x):
    """exp(x) for float32 x, within 2 ulp on [-87, 88]; below -87 it returns about 1.6e-38 instead of
    flushing to 0, above 88 it saturates at exp(88) (float32's largest power range), and NaN stays NaN. Plain arithmetic (no libm call), so loops over it vectorize.

    exp(x) = 2^n * exp(f) with n = round(x / ln 2), |f| <= ln(2) / 2, exp(f) by its Taylor series to
    degree 7 (truncation below 1e-8); 2^n is built from its exponent bits.
    """
    x = np.float32(-87.0) if x < np.float32(-87.0) else x  # comparisons written so that NaN passes through
    x = np.float32(88.0) if x > np.float32(88.0) else x
    n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
    f = x - n * np.float32(0.693145751953125) - n * np.float32(1.428606765330187e-06)  # ln 2 in two parts
    p = np.float32(1 / 5040)
    for coef in (1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0, 1.0):
        p = p * f + np.float32(coef)
    return p * _float32_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))
