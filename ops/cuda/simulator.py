"""The CUDA layer on Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1): the twin of ops/cuda/gpu.py
(`DEVICE`, the host side) and of ops/cuda/ptx.py (the device library's instructions), name for name.

ops/cuda/device.py imports this module instead of those two when the simulator is on; nothing else
asks which one runs. The kernels are the GPU's, same shapes and all: the simulator runs each CUDA
thread as a Python thread, and the twins below give each instruction's result from NumPy. A warp's
lanes meet to exchange values (`_exchange`) where the GPU shuffles.

Importing this module also changes numba-cuda 0.30.4's simulator (the version pyproject.toml pins):
a block's threads are pooled and meet at barriers of their own (`_run_blocks_on_pooled_threads`),
device functions are called directly (`_call_device_functions_directly`), Numba's scalar types
cast as NumPy's do (`_cast_scalars_directly`), and it takes what the
kernels pass for the GPU, `alignment=` for shared arrays and `max_registers=` for kernels, both
ignored (`_take_gpu_options`). docs/cuda.md says more.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
from types import SimpleNamespace
from typing import Callable

import numpy as np
from numba import cuda
from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray, FakeWithinKernelCUDAArray

from nanoeuler_core.registry import bf16_values

__all__ = ["DEVICE", "WARP", "to_f32", "stored", "pack_bf16x2", "bf16x2_values", "pair_values", "stored_pair",
           "wait_for_previous", "let_next_start", "prefetch_l2", "load_16_bytes", "load_8_floats",
           "dp4a", "rint_scaled", "warp_sum", "warp_max", "warp_ballot", "quad_sum", "quad_max", "lanes_reduce",
           "block_reduce", "mma_bf16",
           "shared_base", "cp_async_16", "cp_async_wait_all", "ldmatrix_x4", "ldmatrix_x4_trans",
           "wgmma_ss", "wgmma_rs_t", "wgmma_fence", "wgmma_commit", "wgmma_wait", "proxy_fence"]

WARP = 32


class Simulator:
    """The host side of Numba's CUDA simulator: kernels run as they are launched, on host memory."""

    def name(self) -> str:
        return "Numba's CUDA simulator"

    def compute_capability(self) -> tuple[int, int]:
        """A Hopper's: every instruction the kernels use, wgmma included, has its twin here."""
        return 9, 0

    def overlaps(self) -> bool:
        """False: kernels run one after another here."""
        return False

    def is_aligned(self, arr, alignment: int) -> bool:
        """Whether the array's data (host memory here) starts at a multiple of `alignment` bytes."""
        return arr.ctypes.data % alignment == 0

    def cublas_bindings(self):
        """None: cuBLAS cannot read the simulator's arrays (matrix products take the Numba kernel)."""
        return None

    def gpu_count(self) -> int:
        return len(cuda.gpus)

    def claim(self, local_rank: int) -> str:
        """One simulated GPU, which every rank may share: nothing to claim."""
        return ""

    def launch(self, kernel, blocks, threads, stream, args, shared_bytes: int, overlap: bool) -> None:
        """Run the kernel now (kernels never overlap here)."""
        kernel[blocks, threads, stream, shared_bytes](*args)

    def graph_builder(self) -> None:
        """None: no graphs here (`graphs.capture` then replays by running the function again)."""
        return None

    def memory_in_use(self) -> None:
        """None: the simulator's arrays are host memory."""
        return None

    def host_visible(self, shape, dtype):
        """One array of zeros seen both ways: the simulator's arrays are host memory already."""
        arr = cuda.to_device(np.zeros(shape, dtype))
        return arr, arr

    def to_host(self, arr) -> np.ndarray:
        return arr.copy_to_host()

    def read_back(self, arrays) -> Callable[[], list[np.ndarray]]:
        """The arrays copied now: the kernels before have run already."""
        copies = [arr.copy_to_host() for arr in arrays]
        return lambda: copies


DEVICE = Simulator()


# ---------------------------------------------------------------- bfloat16 storage and element pairs
# One value at a time, on Python integers: the bits of nanoeuler_core.registry's bf16_bits and
# bf16_values, without their arrays.

def _bf16_bits(v) -> int:
    # a float32 value -> its bf16 pattern, rounded to nearest even; NaN stays NaN
    f = np.float32(v)
    if f != f:
        return 0x7FC0
    bits = int(f.view(np.uint32))
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def _bf16_value(bits: int):
    return np.uint32(bits << 16).view(np.float32)


def to_f32(x):
    """A stored value (float32, float16, or bf16 bits) as float32."""
    return _bf16_value(int(x)) if isinstance(x, np.uint16) else np.float32(x)


def stored(like, v):
    """The float32 v rounded to the storage of the array `like`."""
    return np.uint16(_bf16_bits(v)) if like.dtype == np.uint16 else v


def pack_bf16x2(lo, hi):
    """Two float32 -> one uint32 holding their bf16 patterns, lo in the low half."""
    return np.uint32(_bf16_bits(lo) | (_bf16_bits(hi) << 16))


def bf16x2_values(pair):
    """One uint32 of two bf16 patterns -> (low, high) as float32."""
    return _bf16_value(int(pair) & 0xFFFF), _bf16_value(int(pair) >> 16)


def pair_values(word):
    """A word of `pairs` -> its (first, second) element as float32."""
    if word.dtype == np.uint32:
        return bf16x2_values(word)
    first, second = np.array([word], np.uint64).view(np.float32)
    return first, second


def stored_pair(like, lo, hi):
    """Two float32 -> the word of `pairs` array `like` holding them in its storage."""
    if like.dtype == np.uint32:
        return pack_bf16x2(lo, hi)
    return np.array([lo, hi], np.float32).view(np.uint64)[0]


# ---------------------------------------------------------------- overlapping kernels and loads
# Kernels run one after another here: nothing to wait for, nothing to let start, no cache to fill.

def wait_for_previous():
    pass


def let_next_start():
    pass


def prefetch_l2(arr, i):
    pass


def _host(arr) -> np.ndarray:
    # the NumPy array a simulated device array wraps (inside a kernel, wrapped twice)
    if isinstance(arr, FakeWithinKernelCUDAArray):
        arr = arr._item
    return arr._ary if isinstance(arr, FakeCUDAArray) else arr


def load_16_bytes(arr, i):
    """The 16 bytes from element i of the contiguous array arr on, as four uint32."""
    flat = _host(arr).reshape(-1)
    return tuple(flat[i:i + 16 // flat.itemsize].view(np.uint32))


def load_8_floats(a, row, c):
    """a[row, c:c+8] of a float32 or bf16 matrix as eight float32."""
    values = _host(a)[row, c:c + 8]
    return tuple((values.astype(np.uint32) << np.uint32(16)).view(np.float32) if values.dtype == np.uint16 else values)


# ---------------------------------------------------------------- 8-bit integer products

def dp4a(a, b, c):
    """c + the sum of the products of the four bytes of a with those of b, each a signed int8."""
    bytes_a, bytes_b = (np.array([word], np.uint32).view(np.int8).astype(np.int64) for word in (a, b))
    return np.int32(int(c) + int(bytes_a @ bytes_b))


def rint_scaled(v, s):
    """The integer nearest the float32 product v * s (rounded to float32 once), half to even, as int32."""
    return np.int32(np.rint(np.float32(v) * np.float32(s)))


# ---------------------------------------------------------------- warp reductions
# The lanes of a simulated warp exchange values at a meeting of theirs (`_exchange`): each gives its
# value, the last to arrive combines them all, once for the warp, and each takes the combination.
# Every lane of the warp must call these. A reduction adds the lanes' values in lane order.

def _lane() -> int:
    return threading.current_thread().lane


def _exchange(value, combine):
    """combine({lane: value} of this thread's warp, lanes still running), computed once for the
    warp when its last lane gives its value; every lane gets the result."""
    thread = threading.current_thread()
    return thread._manager.warps[thread.warp].exchange(thread.lane, value, combine)


def _group_totals(width, take_max, values):
    # {group: its lanes' values combined in lane order} for the groups of `width` neighbouring lanes
    totals = {}
    for lane in sorted(values):
        group, value = lane // width, values[lane]
        if group not in totals:
            totals[group] = value
        else:
            totals[group] = np.maximum(totals[group], value) if take_max else totals[group] + value
    return totals


def _reduce(x, width, take_max):
    """Sum (or max, with take_max) of x over this thread's group of `width` neighbouring lanes,
    added in lane order; for an array x, of each of its values."""
    values = np.array(x)   # a copy: lanes_reduce writes over its array
    totals = _exchange(values, functools.partial(_group_totals, width, take_max))
    return totals[_lane() // width].astype(values.dtype)


def warp_sum(x):
    """Sum of x over the 32 lanes of the warp, returned to every lane."""
    return _reduce(x, WARP, False)


def warp_max(x):
    """Max of x over the 32 lanes of the warp, returned to every lane."""
    return _reduce(x, WARP, True)


def warp_ballot(predicate):
    """A mask with bit `lane` set where that lane's predicate holds, returned to every lane."""
    return np.uint32(_exchange(bool(predicate), lambda given: sum(1 << lane for lane in given if given[lane])))


def quad_sum(x):
    """Sum of x over the 4 lanes 4g .. 4g+3 of the warp (one row of an mma tile)."""
    return _reduce(x, 4, False)


def quad_max(x):
    """Max of x over the 4 lanes 4g .. 4g+3 of the warp (one row of an mma tile)."""
    return _reduce(x, 4, True)


def lanes_reduce(values, width, take_max):
    """values[i] <- its max (or sum) over this lane's group of `width` neighbouring lanes, for every i."""
    values[:] = _reduce(values, width, take_max)


def _block_total(take_max, given):
    # ptx.py's block_reduce with this module's warp reductions: each warp's lanes in lane order, then
    # the warps' totals (a warp's worth of them, the identity past the last warp) in warp order
    threads = next(iter(given.values()))[1]
    warps = _group_totals(WARP, take_max, {tid: value for tid, (value, _) in given.items()})
    identity = np.float64(-math.inf) if take_max else np.float64(0.0)
    lanes = {lane: warps.get(lane, identity) if lane < -(-threads // WARP) else identity for lane in range(WARP)}
    return _group_totals(WARP, take_max, lanes)[0]


def block_reduce(x, take_max, scratch):
    """Sum (or max, with take_max) of x over the whole (1-D) block in float64, returned to every
    thread: what ptx.py's block_reduce gives from this module's warp reductions, the block meeting
    once instead of four times."""
    thread = threading.current_thread()
    given = (np.float64(x), math.prod(thread._manager._block_dim))
    return thread._manager.barrier.exchange(thread.thread_id, given, functools.partial(_block_total, take_max))


# ---------------------------------------------------------------- tensor cores
# The warp's fragments, gathered from its lanes, in ptx.py's layout, multiplied once for the warp.
# Where each element of A (16 x 16) and B (16 x 8) sits in the warp: lane and register (a0..a3 are
# registers 0..3, b0 and b1 are 4 and 5) of the pair holding it, and which half of the pair
_A_LANE = np.array([[4 * (r % 8) + (k % 8) // 2 for k in range(16)] for r in range(16)])
_A_REG = np.array([[(r >= 8) + 2 * (k >= 8) for k in range(16)] for r in range(16)])
_B_LANE = np.array([[4 * n + (k % 8) // 2 for n in range(8)] for k in range(16)])
_B_REG = np.array([[4 + (k >= 8) for n in range(8)] for k in range(16)])
_A_HALF, _B_HALF = np.arange(16)[None, :] % 2, np.arange(16)[:, None] % 2


def _halves(words):
    # (32 lanes, registers) uint32 -> (2, 32, registers) float64: each register's low and high bf16
    return np.stack([bf16_values(words & np.uint32(0xFFFF)), bf16_values(words >> np.uint32(16))]).astype(np.float64)


def _mma_tile(given):
    # A B (16 x 8, float64) from the warp's registers a0..a3, b0, b1
    halves = _halves(np.stack([given[lane] for lane in range(WARP)]))
    return halves[_A_HALF, _A_LANE, _A_REG] @ halves[_B_HALF, _B_LANE, _B_REG]


def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """D = A B + C, the warp's tile (ptx.py's layout); returns (d0, d1, d2, d3)."""
    d = _exchange(np.array([a0, a1, a2, a3, b0, b1], np.uint32), _mma_tile)
    g, t = _lane() // 4, _lane() % 4
    return (np.float32(c0 + d[g, 2 * t]), np.float32(c1 + d[g, 2 * t + 1]), np.float32(c2 + d[g + 8, 2 * t]),
            np.float32(c3 + d[g + 8, 2 * t + 1]))


# ---------------------------------------------------------------- shared-memory tiles
# Copies happen at once; ldmatrix gathers the warp's row addresses and reads the same words.

def shared_base(sh):
    return np.uint32(0)


def cp_async_16(sh, base, i, src, j, valid):
    for w in range(4):
        sh[i + w] = src[j + w] if valid else 0


def cp_async_wait_all():
    pass


def _matrix_rows(i):
    # the row addresses the warp's lanes give, and this lane's g and t
    rows = _exchange(np.uint64(i), lambda given: np.array([given[lane] for lane in range(WARP)], np.uint64))
    return rows, _lane() // 4, _lane() % 4


def ldmatrix_x4(sh, base, i):
    rows, g, t = _matrix_rows(i)
    return tuple(np.uint32(sh[rows[8 * m + g] + np.uint64(t)]) for m in range(4))


def ldmatrix_x4_trans(sh, base, i):
    rows, g, t = _matrix_rows(i)
    word, shift = np.uint64(g // 2), np.uint32(16 * (g % 2))
    out = []
    for m in range(4):
        lo = (np.uint32(sh[rows[8 * m + 2 * t] + word]) >> shift) & np.uint32(0xFFFF)
        hi = (np.uint32(sh[rows[8 * m + 2 * t + 1] + word]) >> shift) & np.uint32(0xFFFF)
        out.append(np.uint32(lo | (hi << np.uint32(16))))
    return tuple(out)


# ---------------------------------------------------------------- warpgroup tensor cores
# The products happen at once, once for each warp: decode the descriptors and read the same elements
# through the same swizzle as the tensor cores.

def _swizzled_values(sh, desc, i, j):
    # the bf16 values of elements (i, j) of the tile `desc` names: i counts 128-byte rows, j bf16 along one
    start = int(desc & 0x3FFF) << 4
    group = int((desc >> 32) & 0x3FFF) << 4
    byte = start + (i // 8) * group + (i % 8) * 128 + 2 * j
    byte = byte ^ (((byte >> 7) & 7) << 4)
    words = sh[byte >> 2].astype(np.uint32)
    return bf16_values(((words >> (16 * ((byte >> 1) & 1)).astype(np.uint32)) & 0xFFFF)).astype(np.float64)


def _add_rows(acc, d, accumulate):
    # acc <- the warp's 16 rows of d (16 x 64) (+ acc): this lane's elements
    g, t = _lane() // 4, _lane() % 4
    cols = 8 * np.arange(8)[:, None] + 2 * t + np.arange(2)[None, :]   # (n-tile, pair)
    for j in range(8):
        for c in range(4):
            value = d[g + 8 * (c // 2), cols[j, c % 2]] + (acc[j, c] if accumulate else 0.0)
            acc[j, c] = np.float32(value)


def _ss_product(given):
    # A (the warp's 16 rows) B, both read from shared memory
    warp, sh, desc_a, desc_b = next(iter(given.values()))
    rows, k = np.arange(16 * warp, 16 * warp + 16)[:, None], np.arange(16)[None, :]
    a = _swizzled_values(sh, desc_a, rows, k)                                          # (16, 16)
    return a @ _swizzled_values(sh, desc_b, np.arange(64)[None, :], np.arange(16)[:, None])   # (k 16, n 64)


def wgmma_ss(acc, sh, desc_a, desc_b, accumulate):
    d = _exchange((threading.current_thread().warp % 4, sh, desc_a, desc_b), _ss_product)
    _add_rows(acc, d, accumulate)


def _rs_product(given):
    # A (the warp's 16 rows, from its registers) B, read from shared memory
    halves = _halves(np.stack([given[lane][0] for lane in range(WARP)]))
    _, sh, desc_b = given[0]
    return halves[_A_HALF, _A_LANE, _A_REG] @ _swizzled_values(sh, desc_b, np.arange(16)[:, None],
                                                               np.arange(64)[None, :])   # (k 16, n 64)


def wgmma_rs_t(acc, a0, a1, a2, a3, sh, desc_b, accumulate):
    d = _exchange((np.array([a0, a1, a2, a3], np.uint32), sh, desc_b), _rs_product)
    _add_rows(acc, d, accumulate)


def wgmma_fence(acc, frag):
    pass


def wgmma_commit():
    pass


def wgmma_wait(acc):
    pass


def proxy_fence():
    pass


# ---------------------------------------------------------------- the simulator itself

class _Meeting:
    """Threads of a simulated block (or a warp's lanes) meeting: each waits until every thread still
    running has arrived (a thread that has returned no longer counts, as Numba's simulator has it),
    and at an exchange the last to arrive combines what each gave, for all of them. abort() releases
    the waiting threads with an error when one thread has failed (as does an error in combining).
    Each waiting thread blocks on a lock of its own."""

    def __init__(self, threads: int) -> None:
        self._live, self._broken = threads, False
        self._lock = threading.Lock()   # guards what follows
        self._waiting: list = []
        self._given: dict = {}
        self._combine = self._result = self._error = None

    def wait(self) -> None:
        """syncthreads (of a block's meeting)."""
        self._meet()

    def exchange(self, key, value, combine):
        """combine({key: value} of every thread still running), for each of them."""
        with self._lock:
            self._given[key] = value
            self._combine = combine
        self._meet()
        if self._error is not None:
            raise self._error
        return self._result   # a thread gives its next value only once every one has taken this

    def leave(self) -> None:
        with self._lock:
            self._live -= 1
            if self._waiting and len(self._waiting) == self._live:
                self._release()

    def abort(self) -> None:
        with self._lock:
            self._broken = True
            if self._waiting:
                self._waiting[0].release()
            self._waiting = []

    def _meet(self) -> None:
        with self._lock:
            if self._broken:
                raise RuntimeError("another thread of the block failed")
            waiting = threading.Lock()
            waiting.acquire()
            arrived, at = self._waiting, len(self._waiting)
            arrived.append(waiting)
            if len(arrived) == self._live:
                self._release()
        _wake_next()
        waiting.acquire()   # until the thread that arrived before it (the last to arrive, for the first) blocks
        if at + 1 < len(arrived):
            threading.current_thread().wake_next = arrived[at + 1]
        if self._broken:
            raise RuntimeError("another thread of the block failed")

    def _release(self) -> None:
        self._result = self._error = None
        try:
            if self._given and not self._broken:
                self._result = self._combine(self._given)
        except Exception as e:
            self._error = e
        self._given = {}
        arrived, self._waiting = self._waiting, []
        _wake_next()   # (a thread that returns may release two meetings)
        threading.current_thread().wake_next = arrived[0]


def _wake_next() -> None:
    """Release the thread this one is to wake, before it blocks (or ends its block): the threads a
    meeting lets go run one after the other, each woken as the one before it stops, so that it finds
    the interpreter free instead of all of them waking at once to contend for it."""
    thread = threading.current_thread()
    waiting = getattr(thread, "wake_next", None)
    if waiting is not None:
        thread.wake_next = None
        waiting.release()


def _take_gpu_options() -> None:
    """Let the simulator take the options kernels give the GPU: `alignment=` of a shared array (the
    simulator's arrays are NumPy's, aligned enough) and `max_registers=` of a kernel, both ignored.
    A shared array is found by its caller's frame, not by a whole extracted stack per thread as in
    numba-cuda's FakeCUDAShared.array (which every thread of every block built for every array)."""
    from numba.cuda.simulator import kernelapi

    def shared_array(self, shape, dtype, alignment=None):
        if isinstance(dtype, kernelapi.types.Type):
            dtype = kernelapi.numpy_support.as_dtype(dtype)
        if shape == 0:   # dynamic shared memory: every such array shares the one buffer
            return np.frombuffer(self._dynshared.data, dtype=dtype, count=self._dynshared_size // dtype.itemsize)
        caller = sys._getframe(1)   # an array is its caller's file and line, as in numba-cuda
        key = (caller.f_code.co_filename, caller.f_lineno)
        found = self._allocations.get(key)
        return found if found is not None else self._allocations.setdefault(key, np.empty(shape, dtype))

    simulator_jit = cuda.jit

    def jit(*args, max_registers=None, **options):
        return simulator_jit(*args, **options)

    kernelapi.FakeCUDAShared.array = shared_array
    cuda.jit = jit


def _run_blocks_on_pooled_threads() -> None:
    """Numba's CUDA simulator runs each CUDA thread of a block as a Python thread, started for that
    block, and a manager thread polls them in a loop to release them together at syncthreads: every
    block pays for starting its threads, and every barrier waits for the loop to come round while
    the loop competes with the threads for the GIL. Here (numba-cuda 0.30.4's BlockManager.run and
    BlockThread.syncthreads replaced: the version pyproject.toml pins) a pool of threads, one per
    thread position of a block shape, runs block after block, and a block's threads meet at a
    barrier, a warp's lanes at their own (`_Meeting`): nothing is started per block and nothing
    polls."""
    from numba.cuda.simulator import kernel

    class PooledThread(kernel.BlockThread):
        """One thread position of a block shape, running the blocks handed to it one at a time."""

        def __init__(self, block_dim, thread_point):
            super().__init__(None, SimpleNamespace(_block_dim=block_dim), (0, 0, 0), thread_point, False)
            self.warp, self.lane = divmod(self.thread_id, WARP)
            self.block = None                      # (manager, grid point, args, finished) of the next block
            self.ready = threading.Event()

        def run(self):
            while True:
                self.ready.wait()
                self.ready.clear()
                manager, grid_point, args, finished = self.block
                self._manager, self.blockIdx, self.exception = manager, kernel.Dim3(*grid_point), None
                try:
                    manager._f(*args)
                except Exception as e:
                    message = f"tid={list(self.threadIdx)} ctaid={list(self.blockIdx)}"
                    self.exception = (type(e)(f"{message}: {e}" if str(e) else message), sys.exc_info()[2])
                    manager.failed.append(self)
                    for meeting in [manager.barrier, *manager.warps]:
                        meeting.abort()
                finally:
                    manager.barrier.leave()
                    manager.warps[self.warp].leave()
                    _wake_next()
                    finished()

    pools: dict = {}    # block shape -> its pooled threads

    def run(self, grid_point, *args):
        block_dim = tuple(self._block_dim)
        if block_dim not in pools:
            pools[block_dim] = [PooledThread(block_dim, point) for point in np.ndindex(*block_dim)]
            for t in pools[block_dim]:
                t.start()
        threads = pools[block_dim]
        self.barrier, self.failed = _Meeting(len(threads)), []
        self.warps = [_Meeting(min(WARP, len(threads) - first)) for first in range(0, len(threads), WARP)]
        done = threading.Condition()
        left = [len(threads)]

        def finished():
            with done:
                left[0] -= 1
                if left[0] == 0:
                    done.notify()

        for t in threads:
            t.block = (self, grid_point, args, finished)
            t.ready.set()
        with done:
            while left[0]:
                done.wait()
        for t in self.failed[:1]:   # the first thread that failed, not those the abort released
            raise t.exception[0].with_traceback(t.exception[1])

    def syncthreads(self):
        self._manager.barrier.wait()

    kernel.BlockManager.run = run
    kernel.BlockThread.syncthreads = syncthreads


def _call_device_functions_directly() -> None:
    """numba-cuda's simulator swaps the numba.cuda of a device function's module for the kernel's
    simulated one on every call (two locks, a context manager, sometimes a scan of the module's
    globals). Here a device function called in a kernel whose code does not name that module is
    called as it is."""
    from numba.cuda.simulator import kernel, kernelapi

    def names_cuda(fn) -> bool:
        codes, names = [fn.__code__], set()
        while codes:
            code = codes.pop()
            names.update(code.co_names)
            codes += [c for c in code.co_consts if hasattr(c, "co_names")]
        return any(fn.__globals__.get(name) is cuda or isinstance(fn.__globals__.get(name), kernelapi.FakeCUDAModule)
                   for name in names)

    call = kernel.FakeCUDAKernel.__call__

    def device_call(self, *args):
        if self._device and kernel._kernel_context is not None:
            swaps = self.__dict__.get("_names_cuda")
            if swaps is None:
                swaps = self._names_cuda = names_cuda(self.fn)
            if not swaps:
                return self.fn(*args)
        return call(self, *args)

    kernel.FakeCUDAKernel.__call__ = device_call


def _cast_scalars_directly() -> None:
    """Kernels cast as they would compile, `uint64(i)`, `float32(0.0)`: in Python each such call of
    a Numba type imports, checks the argument against Numba's abstract types, then calls NumPy's
    scalar type. Here Numba's integer and float types call NumPy's straight away (the same value)
    when given a Python or NumPy scalar."""
    from numba.core import types

    numpy_types = {name: getattr(np, name) for name in ("int8", "int16", "int32", "int64", "uint8", "uint16",
                                                        "uint32", "uint64", "float16", "float32", "float64")}
    scalars = {int, float, bool, *numpy_types.values()}
    for numba_type in (types.Integer, types.Float):
        as_signature = numba_type.__call__

        def cast(self, *args, as_signature=as_signature):
            if len(args) == 1 and type(args[0]) in scalars:
                return numpy_types[self.name](args[0])
            return as_signature(self, *args)

        numba_type.__call__ = cast


_take_gpu_options()
_run_blocks_on_pooled_threads()
_call_device_functions_directly()
_cast_scalars_directly()
