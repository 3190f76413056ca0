"""SwiGLU gating on the CPU. See nanoeuler_ops/swiglu.py for the math.

The sigmoid needs exp, and Numba's np.exp calls the scalar C library function once per element,
which keeps the loop from being vectorised; `exp_f32` below is plain float arithmetic that LLVM
turns into SIMD code, 3-4x faster here and as accurate (within 1.5 ulp).
"""

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic


@intrinsic
def _exp2_int(typingctx, n):
    """2^n for an integer-valued float32 n in [-126, 127], written straight into the exponent bits."""
    if n != types.float32:
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        biased = builder.add(builder.fptosi(args[0], i32), ir.Constant(i32, 127))
        return builder.bitcast(builder.shl(biased, ir.Constant(i32, 23)), ir.FloatType())

    return types.float32(types.float32), codegen


@njit(inline="always", cache=True)
def exp_f32(x):
    """e^x for a float32 x (Cephes expf): e^x = 2^n e^r, n = round(x / ln 2), |r| <= ln(2) / 2,
    e^r by its degree-7 polynomial. x is clamped to [-87, 88], where 2^n stays a normal float32."""
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))
    n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
    r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)  # ln 2 in two parts: r exact
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * _exp2_int(n)


@njit(parallel=True, cache=True)
def _forward(gate, up, y):
    # gate, up, y (N*F,): flattened, so the threads share the work evenly whatever N is
    for i in prange(y.shape[0]):
        g = gate[i]
        y[i] = g * up[i] / (np.float32(1.0) + exp_f32(-g))


@njit(parallel=True, cache=True)
def _backward(dy, gate, up, dgate, dup):
    # dy, gate, up -> dgate, dup, all (N*F,)
    for i in prange(dy.shape[0]):
        g = gate[i]
        s = np.float32(1.0) / (np.float32(1.0) + exp_f32(-g))
        dgate[i] = dy[i] * up[i] * s * (np.float32(1.0) + g * (np.float32(1.0) - s))
        dup[i] = dy[i] * g * s


def forward(gate, up):
    y = np.empty(gate.shape, dtype=gate.dtype)
    _forward(gate.reshape(-1), up.reshape(-1), y.reshape(-1))
    return y, ()


def backward(dy, saved, gate, up):
    dgate = np.empty(gate.shape, dtype=gate.dtype)
    dup = np.empty(up.shape, dtype=up.dtype)
    _backward(dy.reshape(-1), gate.reshape(-1), up.reshape(-1), dgate.reshape(-1), dup.reshape(-1))
    return dgate, dup
