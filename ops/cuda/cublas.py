"""Row-major matrix products on Numba device arrays: cuBLAS through the nvmath-python bindings,
or a Numba shared-memory tiled kernel where the device has no cuBLAS (nvmath absent, the simulator).

Operands are float32 (exact, or on the TF32 tensor cores with `tf32`) or bf16 storage (tensor
cores, float32 accumulation); the output is float32 or bf16, whichever `out` is. With `accumulate`, the product is added to what `out` holds (cuBLAS's beta = 1),
as the gradient buffers are. `matmul_batched` takes a batch of products of one shape in one call, with
cuBLAS's general alpha and beta.

cuBLAS is column-major. A row-major (r, c) buffer read column-major is its transpose, so the
row-major product out = op(a) @ op(b) is the column-major out^T = op(b)^T op(a)^T: call gemm
with b first, and each operand's transpose flag unchanged.
"""

from functools import cache

import numpy as np
from numba import cuda, float32

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.device import BF16, DEVICE, stored, to_f32

TILE = 16            # the fallback kernel's output tile (TILE x TILE threads per block)

_ONE = np.array(1.0, np.float32)    # alpha and beta live on the host (cuBLAS's default pointer mode)
_ZERO = np.array(0.0, np.float32)

WORKSPACE_BYTES = 32 << 20   # cuBLAS's recommendation for Hopper


@cache
def _workspace():
    """The one device workspace every handle's products use, set explicitly as cuBLAS advises for
    CUDA graphs: a handle then allocates nothing of its own while a graph is captured (each new
    capture would otherwise take more memory), and its products have the same workspace to choose
    their kernels by, captured or run eagerly. One buffer serves every handle because all our
    products, captured or not, run in order on one stream."""
    return cuda.device_array(WORKSPACE_BYTES, np.uint8)


@cache
def handle_for(stream_handle: int) -> int:
    """The cuBLAS handle bound to a stream, created on first use (call it before capturing a graph
    on that stream: creating a handle allocates)."""
    cublas = DEVICE.cublas_bindings()
    handle = cublas.create()
    cublas.set_stream(handle, stream_handle)
    cublas.set_workspace(handle, _workspace().device_ctypes_pointer.value, WORKSPACE_BYTES)
    return handle


def uses_cublas() -> bool:
    """Whether matmul runs on cuBLAS here (else on the Numba fallback kernel)."""
    return DEVICE.cublas_bindings() is not None


@cuda.jit(cache=True)
def _matmul_tiled(a, b, out, trans_a, trans_b, alpha, beta):
    # op(a[z]) (M, K), op(b[z]) (K, N) -> out[z] (M, N) = alpha op(a[z]) op(b[z]) + beta out[z] for the
    # batch z on grid z, op = transpose where the flag is set (out is not read where beta = 0);
    # one TILE x TILE tile of out[z] per block, K walked in TILE steps through shared memory
    a_tile = cuda.shared.array((TILE, TILE), float32)
    b_tile = cuda.shared.array((TILE, TILE), float32)
    M, N = out.shape[1], out.shape[2]
    K = a.shape[1] if trans_a else a.shape[2]
    z = cuda.blockIdx.z
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    row = cuda.blockIdx.y * TILE + ty
    col = cuda.blockIdx.x * TILE + tx
    acc = float32(0.0)
    for k0 in range(0, K, TILE):
        ka = k0 + tx
        kb = k0 + ty
        a_tile[ty, tx] = to_f32(a[z, ka, row] if trans_a else a[z, row, ka]) if row < M and ka < K else float32(0.0)
        b_tile[ty, tx] = to_f32(b[z, col, kb] if trans_b else b[z, kb, col]) if col < N and kb < K else float32(0.0)
        cuda.syncthreads()
        for kk in range(TILE):
            acc += a_tile[ty, kk] * b_tile[kk, tx]
        cuda.syncthreads()
    if row < M and col < N:
        acc *= alpha
        if beta != float32(0.0):
            acc += beta * to_f32(out[z, row, col])
        out[z, row, col] = stored(out, acc)


def _tiled(a, b, out, trans_a, trans_b, alpha, beta) -> None:
    # the fallback kernel's launch over (n, r, k) arrays: one block per tile of each out[z]
    n, M, N = out.shape
    blocks = (runtime.blocks_for(N, TILE), runtime.blocks_for(M, TILE), n)
    runtime.launch(_matmul_tiled, blocks, (TILE, TILE), a, b, out, trans_a, trans_b, float32(alpha), float32(beta))


CUDA_R_32F, CUDA_R_16BF = 0, 14   # cudaDataType


def _types(cublas, a, out, tf32):
    # (operand type, output type, compute type) of a product of a's storage into out's
    low = a.dtype == BF16
    compute = cublas.ComputeType.COMPUTE_32F_FAST_TF32 if tf32 and not low else cublas.ComputeType.COMPUTE_32F
    return CUDA_R_16BF if low else CUDA_R_32F, CUDA_R_16BF if out.dtype == BF16 else CUDA_R_32F, compute


def _op(cublas, trans):
    return cublas.Operation.T if trans else cublas.Operation.N


def matmul(a, b, out, trans_a: bool = False, trans_b: bool = False, accumulate: bool = False,
           tf32: bool = False) -> None:
    """out (M, N) = op(a) @ op(b) (+ out, with accumulate) for contiguous row-major device arrays;
    a and b of one storage; float32 operands rounded to TF32 on the tensor cores with `tf32`."""
    M, N = out.shape
    K = a.shape[0] if trans_a else a.shape[1]
    cublas = DEVICE.cublas_bindings()
    if cublas is None:
        _tiled(a.reshape(1, *a.shape), b.reshape(1, *b.shape), out.reshape(1, M, N), trans_a, trans_b, 1.0,
               1.0 if accumulate else 0.0)
        return
    ab_type, out_type, compute = _types(cublas, a, out, tf32)
    cublas.gemm_ex(handle_for(runtime.stream_handle()), _op(cublas, trans_b), _op(cublas, trans_a), N, M, K,
                   _ONE.ctypes.data, b.device_ctypes_pointer.value, ab_type, b.shape[1], a.device_ctypes_pointer.value,
                   ab_type, a.shape[1], (_ONE if accumulate else _ZERO).ctypes.data, out.device_ctypes_pointer.value,
                   out_type, N, compute, cublas.GemmAlgo.DEFAULT)


def matmul_batched(a, b, out, trans_b: bool = False, alpha: float = 1.0, beta: float = 0.0) -> None:
    """out[z] (M, N) = alpha a[z] @ op(b[z]) + beta out[z] for each z of contiguous (n, r, k)
    device arrays (op(b) = b^T with trans_b), a and b of one storage; out is not read where beta
    = 0. One cuBLAS strided-batched call (alpha and beta are host scalars, taken as the call is
    made, so a captured graph keeps them)."""
    n, M, N = out.shape
    K = a.shape[2]
    cublas = DEVICE.cublas_bindings()
    if cublas is None:
        _tiled(a, b, out, False, trans_b, alpha, beta)
        return
    ab_type, out_type, compute = _types(cublas, a, out, False)
    alpha, beta = np.array(alpha, np.float32), np.array(beta, np.float32)
    cublas.gemm_strided_batched_ex(
        handle_for(runtime.stream_handle()), _op(cublas, trans_b), cublas.Operation.N, N, M, K, alpha.ctypes.data,
        b.device_ctypes_pointer.value, ab_type, b.shape[2], b.shape[1] * b.shape[2],
        a.device_ctypes_pointer.value, ab_type, K, M * K, beta.ctypes.data,
        out.device_ctypes_pointer.value, out_type, N, M * N, n, compute, cublas.GemmAlgo.DEFAULT)
