"""Helpers shared by the CPU kernels."""

import contextlib
import os

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
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


@intrinsic
def _bits_of_float32(typingctx, x):
    """The IEEE-754 bit pattern of the float32 `x`, as an int32."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(types.float32), codegen


@njit(inline="always")
def _ordered(bits):
    # float32 bits -> an int32 in the floats' order (negative floats have their magnitude bits
    # flipped); the map is its own inverse
    return bits ^ ((bits >> np.int32(31)) & np.int32(0x7FFFFFFF))


@njit(inline="always")
def max32(x, n):
    """The largest of x[0], ..., x[n - 1] (n >= 1; float32). Compared as integers in the floats'
    order, so the loop vectorizes (a float max reduction does not, without fast-math's no-NaN
    assumption). A NaN with the sign bit clear is the largest and comes back; one with it set
    is the smallest, yet reaches any sum of exp(x - max) all the same."""
    top = np.int32(-(2 ** 31))
    for i in range(n):
        top = max(top, _ordered(_bits_of_float32(x[i])))
    return _float32_from_bits(_ordered(top))


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


# ------------------------------------------------------------------------------------------------
# Numba's thread count, inside a kernel. A decoding step runs on one thread (the backend's
# `serial` block); a kernel whose work pays for more takes the step's threads back for itself
# (`threads_for`) and gives them up after. Numba's own set_num_threads, called from a kernel,
# makes it uncacheable (it holds a ctypes function); these call the same functions of Numba's
# threading layer by the names it gives them (its parallel loops read the count the same way),
# resolved when a kernel is linked. The layer registers them, and its parallel loops' own entry
# points, when it starts, so it starts here, at import, before any kernel is loaded. Numba starts
# it when it compiles a parallel kernel or loads one from its cache, but a cached kernel that
# reaches a parallel one through another compiled function (norm_linear's, calling the threaded
# quantized product) keeps no record that it must: loaded as a process's first parallel code, it
# would call unresolved addresses and crash.
numba.get_num_threads()   # starts Numba's threading layer
_get_num_threads = types.ExternalFunction("get_num_threads", types.intc())
_set_num_threads = types.ExternalFunction("set_num_threads", types.void(types.intc))


@njit(inline="always")
def threads_for(threads):
    """Give the calling thread `threads` of Numba's threads for the parallel kernels it calls next;
    returns the count it had, for `threads_for` to give back."""
    had = _get_num_threads()
    _set_num_threads(np.intc(threads))
    return had


# ------------------------------------------------------------------------------------------------
# Matrix products on Numba's threads.
#
# NumPy's products run on OpenBLAS's own thread pool, beside Numba's: every product wakes one pool
# and every kernel after it the other, and under any other load on the machine OpenBLAS's threads,
# which wait for each other inside a product, lose most of their time (a step of the `small`
# model went from 60 to 300 ms on a machine that was not quiet). `gemm` instead cuts the output
# into one tile per Numba thread and has each thread call OpenBLAS's sgemm on its tile, with
# OpenBLAS held to one thread for the call: one pool for the whole step, one wake-up per product,
# and the tiles can add into their output (beta = 1) where a gradient accumulates, with no
# temporary. It needs an OpenBLAS with 64-bit integers (NumPy's wheels bundle one) or, on x86-64,
# any OpenBLAS; anywhere else `gemm` is NumPy's product.


def _find_openblas():
    """(sgemm, set_num_threads, get_num_threads) of the OpenBLAS NumPy loaded, as ctypes functions,
    and whether sgemm takes 64-bit integers; None if NumPy's BLAS is not an OpenBLAS this can use."""
    import ctypes
    import platform

    try:
        with open("/proc/self/maps") as maps:   # the libraries this process has loaded (Linux)
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower() and ".so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix, ilp64 in (("scipy_", "64_", True), ("", "64_", True), ("", "", False)):
            names = [f"{prefix}cblas_sgemm{suffix}", f"{prefix}openblas_set_num_threads{suffix}",
                     f"{prefix}openblas_get_num_threads{suffix}"]
            if all(hasattr(lib, n) for n in names) and (ilp64 or platform.machine().lower() in ("x86_64", "amd64")):
                # 32-bit integer arguments are passed as 64-bit ones: on x86-64 every argument takes
                # an 8-byte register or stack slot, whose low half the callee reads
                sgemm, set_threads, get_threads = (getattr(lib, n) for n in names)
                set_threads.argtypes, get_threads.restype = [ctypes.c_int], ctypes.c_int
                return sgemm, set_threads, get_threads
    return None


_OPENBLAS = None if os.environ.get("NANOEULER_NUMPY_MATMUL") else _find_openblas()
if _OPENBLAS is not None:
    import ctypes

    import llvmlite.binding

    # The kernels call sgemm by this name, resolved when they are linked: compiled kernels stay cacheable.
    llvmlite.binding.add_symbol("nanoeuler_cblas_sgemm", ctypes.cast(_OPENBLAS[0], ctypes.c_void_p).value)
_i64, _f32, _ptr = types.int64, types.float32, types.uintp
_cblas_sgemm = types.ExternalFunction("nanoeuler_cblas_sgemm", types.void(
    types.int32, types.int32, types.int32, _i64, _i64, _i64, _f32, _ptr, _i64, _ptr, _i64, _f32, _ptr, _i64))
_ROW_MAJOR, _NO_TRANS, _TRANS = np.int32(101), np.int32(111), np.int32(112)   # CBLAS's enumerations
_SMALL = 1 << 16   # multiply-adds below which one thread does the whole product


def gemm(a, b, out, trans_a=False, trans_b=False, accumulate=False):
    """out (M, N) = op(a) @ op(b), or out += op(a) @ op(b) with `accumulate`; op(x) is x.T where
    trans_x. Tiled over Numba's threads where the arrays are float32 and C-contiguous (ask for a
    transpose rather than passing one), else NumPy's product."""
    op_a, op_b = (a.T if trans_a else a), (b.T if trans_b else b)
    arrays = (a, b, out)
    if _OPENBLAS is None or not all(x.dtype == np.float32 and x.flags.c_contiguous for x in arrays):
        if accumulate:
            out += op_a @ op_b
        else:
            np.matmul(op_a, op_b, out=out)
        return out
    (M, K), N = op_a.shape, op_b.shape[1]
    tile_rows, tile_cols = _tiles(M, N, K, numba.get_num_threads())
    _, set_threads, get_threads = _OPENBLAS
    blas_threads = get_threads()
    set_threads(1)   # process-wide: the tiles run concurrently, each on the thread that calls it
    try:
        _gemm_tiles(a, b, out, trans_a, trans_b, np.float32(1.0 if accumulate else 0.0), tile_rows, tile_cols)
    finally:
        set_threads(blas_threads)
    return out


def _tiles(M: int, N: int, K: int, threads: int) -> tuple[int, int]:
    """Rows and columns of the grid of tiles, one tile per thread, that read the least of a and b
    (a tile reads its rows of op(a) and its columns of op(b): M K / rows + ... summed over tiles)."""
    if threads == 1 or M * N * K < _SMALL * threads:
        return 1, 1
    best = None
    for rows in range(1, threads + 1):
        if threads % rows:
            continue
        cols = threads // rows
        if rows > M or cols > N:
            continue
        cost = M * cols + N * rows
        if best is None or cost < best[0]:
            best = (cost, rows, cols)
    return (1, 1) if best is None else best[1:]


@njit(parallel=True, cache=True)
def _gemm_tiles(a, b, c, trans_a, trans_b, beta, tile_rows, tile_cols):
    # c (M, N) = op(a) (M, K) @ op(b) (K, N) + beta c, one sgemm call per tile of a tile_rows x tile_cols grid
    M, N = c.shape
    K = a.shape[0] if trans_a else a.shape[1]
    lda, ldb = a.shape[1], b.shape[1]
    for tile in prange(tile_rows * tile_cols):
        i, j = tile // tile_cols, tile % tile_cols
        r0, r1 = i * M // tile_rows, (i + 1) * M // tile_rows
        c0, c1 = j * N // tile_cols, (j + 1) * N // tile_cols
        if r1 == r0 or c1 == c0:
            continue
        _cblas_sgemm(_ROW_MAJOR, _TRANS if trans_a else _NO_TRANS, _TRANS if trans_b else _NO_TRANS,
                     r1 - r0, c1 - c0, K, np.float32(1.0),
                     _address(a, r0 if trans_a else r0 * lda), lda,   # op(a)[r0:r1, :]
                     _address(b, c0 * ldb if trans_b else c0), ldb,   # op(b)[:, c0:c1]
                     beta, _address(c, r0 * N + c0), N)


@njit(inline="always")
def _address(x, offset):
    # the address of element `offset` of the float32 array x, counted in its memory order
    return x.ctypes.data + np.uintp(4 * offset)


# ------------------------------------------------------------------------------------------------
# sgemm on blocks inside a kernel (attention): each task of a parallel kernel calls `sgemm` on
# blocks of strided arrays, with OpenBLAS held to one thread around the kernel (`one_blas_thread`).
# Where no usable OpenBLAS was found, the symbol `_cblas_sgemm` calls is `_loop_sgemm`, the same
# product in plain loops compiled by Numba: a kernel has one code path, and its cached machine
# code links against whichever sgemm this process has.


@njit(inline="always")
def sgemm(trans_a, trans_b, M, N, K, alpha, a, a_at, lda, b, b_at, ldb, beta, c, c_at, ldc):
    """CBLAS's row-major sgemm on blocks of float32 arrays: c (M, N) = alpha op(a) (M, K) op(b) (K, N)
    + beta c (c is not read where beta = 0). op(x) is x or, where trans_x, its transpose; each
    block starts at element x_at of x, counted in memory order, and its rows are ldx elements
    apart: a block of rows (or keys) of one head in a (B, T, H, D) array is a_at = ((b T + t) H + h) D,
    lda = H D. One thread: call it from a kernel run inside `one_blas_thread()`."""
    _cblas_sgemm(_ROW_MAJOR, _TRANS if trans_a else _NO_TRANS, _TRANS if trans_b else _NO_TRANS,
                 M, N, K, np.float32(alpha), _address(a, a_at), lda, _address(b, b_at), ldb,
                 np.float32(beta), _address(c, c_at), ldc)


@contextlib.contextmanager
def one_blas_thread():
    """Hold OpenBLAS to one thread (process-wide) while a kernel's tasks call `sgemm` concurrently."""
    if _OPENBLAS is None:
        yield
        return
    _, set_threads, get_threads = _OPENBLAS
    blas_threads = get_threads()
    set_threads(1)
    try:
        yield
    finally:
        set_threads(blas_threads)


def _loop_sgemm(order, trans_a, trans_b, M, N, K, alpha, a_ptr, lda, b_ptr, ldb, beta, c_ptr, ldc):
    # cblas_sgemm (row-major) in plain loops, for machines without a usable OpenBLAS
    a_row, a_col = (1, lda) if trans_a == _TRANS else (lda, 1)   # op(a)[i, p] = a[i a_row + p a_col]
    b_row, b_col = (1, ldb) if trans_b == _TRANS else (ldb, 1)
    a = numba.carray(a_ptr, (M - 1) * a_row + (K - 1) * a_col + 1)
    b = numba.carray(b_ptr, (K - 1) * b_row + (N - 1) * b_col + 1)
    c = numba.carray(c_ptr, (M - 1) * ldc + N)
    for i in range(M):
        for j in range(N):
            c[i * ldc + j] = 0.0 if beta == 0.0 else beta * c[i * ldc + j]
        for p in range(K):
            x = alpha * a[i * a_row + p * a_col]
            for j in range(N):
                c[i * ldc + j] += x * b[p * b_row + j * b_col]


if _OPENBLAS is None:
    import llvmlite.binding

    _f32_ptr = types.CPointer(types.float32)
    _loop_sgemm_c = numba.cfunc(types.void(types.int32, types.int32, types.int32, _i64, _i64, _i64, _f32,
                                           _f32_ptr, _i64, _f32_ptr, _i64, _f32, _f32_ptr, _i64),
                                cache=True, fastmath=REDUCE_FASTMATH)(_loop_sgemm)
    llvmlite.binding.add_symbol("nanoeuler_cblas_sgemm", _loop_sgemm_c.address)


# ------------------------------------------------------------------------------------------------
# Numba's threads, each kept on one core. A step is hundreds of parallel kernels; a thread that
# the OS moves to another core between them finds none of its tile's data in that core's caches
# (the products give each thread the same tile of the same weights every step). Where the
# process has as many cores as Numba has threads, `pin_threads` binds worker thread t to the
# process's t-th core, once. The calling (main) thread stays free: threads it starts later (other
# libraries' pools) inherit its affinity, not one core.

_sched_setaffinity = types.ExternalFunction("sched_setaffinity", types.int32(types.int32, types.uintp, types.uintp))


@njit(parallel=True, cache=True)
def _pin(masks, failed):
    # masks (threads, words) uint64: the CPU set of each thread; each worker sets its own (pid 0 =
    # the calling thread), as often as the scheduler hands it an iteration
    for _ in prange(masks.shape[0] * 16):
        t = numba.get_thread_id()
        if t > 0 and _sched_setaffinity(0, masks.shape[1] * 8, masks[t].ctypes.data) != 0:
            failed[t] = True


def pins_threads() -> bool:
    """Whether `pin_threads` binds Numba's threads here: NANOEULER_PIN_THREADS=1 always, 0 never; by
    default where the process may use exactly as many cores as Numba has threads (Linux only)."""
    setting = os.environ.get("NANOEULER_PIN_THREADS", "")
    if setting == "0" or not hasattr(os, "sched_getaffinity") or numba.get_num_threads() < 2:
        return False
    return setting == "1" or numba.get_num_threads() == len(os.sched_getaffinity(0))


def pin_threads() -> bool:
    """Bind Numba's worker threads to one core each where `pins_threads`; returns whether every
    worker was bound."""
    if not pins_threads():
        return False
    cpus = sorted(os.sched_getaffinity(0))
    threads = numba.get_num_threads()
    masks = np.zeros((threads, max(cpus) // 64 + 1), np.uint64)
    for t in range(threads):
        cpu = cpus[t % len(cpus)]
        masks[t, cpu // 64] |= np.uint64(1) << np.uint64(cpu % 64)
    failed = np.zeros(threads, np.bool_)
    try:
        _pin(masks, failed)
    except (numba.core.errors.NumbaError, OSError, RuntimeError):   # a libc without the call: threads stay free
        return False
    return not failed.any()
