"""The CPU backend: float32 NumPy arrays, kernels compiled by Numba (`@njit(parallel=True)`),
cached on disk so each signature compiles once per machine. Kernels: `nanoeuler_ops.cpu.<op>`."""

import ctypes
import threading
from contextlib import contextmanager

import numpy as np

from nanoeuler_ops import HostBackend


class CpuBackend(HostBackend):
    name = "cpu"
    dtype = np.float32
    kernel_packages = ("nanoeuler_ops.cpu",)

    def __init__(self) -> None:
        self._outside_serial: dict[int, int] = {}   # thread id -> its thread count before its first serial block

    def device_name(self) -> str:
        from nanoeuler_ops.cpu.common import pins_threads

        return super().device_name() + (" (one Numba thread a core)" if pins_threads() else "")

    def kernel_cache_cold(self) -> bool:
        # judged by two kernels every run compiles: AdamW's update and the sampler (Numba's index
        # files, missing or stamped for other sources)
        from nanoeuler_ops.cpu import adamw, sample

        try:
            return not all(kernel._cache._cache_file._load_index() for kernel in (adamw._update, sample._sample))
        except AttributeError:   # a Numba that keeps its cache elsewhere: nothing is warmed ahead
            return False

    @contextmanager
    def computing(self):
        _keep_freed_memory()
        if not _PINNED:
            from nanoeuler_ops.cpu.common import pin_threads

            _PINNED.append(pin_threads())
        yield

    @contextmanager
    def serial(self):
        # Kernels called inside run on one thread: most of a decoding step's kernels are too small
        # to pay for waking a second one. Its matrix products from THREADED_PRODUCTS multiply-adds
        # (ops/cpu/row_products.py) are not, and take the block's threads back, `threads()`, for
        # themselves: a second thread then needs a core of its own (a machine whose cores other
        # work keeps busy may make it wait for one: NUMBA_NUM_THREADS=1 keeps decoding on one)
        yield from self._threads(1)

    @contextmanager
    def parallel(self):
        yield from self._threads(self.threads())

    def threads(self) -> int:
        """The Numba threads a kernel whose work pays for them may use: the count outside the calling
        thread's serial block, else its current count."""
        outside = self._outside_serial.get(threading.get_ident())
        if outside is None:
            import numba

            return numba.get_num_threads()
        return outside

    def _threads(self, n: int):
        # Numba's thread count for the calling thread (thread-local: other threads keep theirs), the
        # count outside the outermost serial block remembered for `parallel`
        import numba

        threads, me = numba.get_num_threads(), threading.get_ident()
        outermost = me not in self._outside_serial
        if outermost:
            self._outside_serial[me] = threads
        numba.set_num_threads(n)
        try:
            yield
        finally:
            numba.set_num_threads(threads)
            if outermost:
                del self._outside_serial[me]


_PINNED: list = []      # [whether Numba's threads were bound to cores (common.pin_threads)], once tried
_ALLOCATOR: list = []   # [whether glibc's malloc was told to keep freed memory], once done


def _keep_freed_memory() -> None:
    """Have glibc's malloc serve large blocks from its heap and keep what is freed there, once per
    process, before the first computation. By default a block over 128 KB (up to 32 MB as the
    threshold adapts) is mapped fresh and unmapped when freed, so every step's activations (a
    `cpu-medium` step makes hundreds of MB) fault in new zeroed pages; kept, the next step reuses
    them. The process then holds its peak memory, as PyTorch's caching allocators do on GPUs."""
    if _ALLOCATOR:
        return
    _ALLOCATOR.append(True)
    try:
        libc = ctypes.CDLL(None)
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3   # glibc's mallopt parameters
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)   # (an int: 2 GB)
    except (OSError, AttributeError):   # not glibc (macOS, musl): its allocator as it is
        pass


BACKEND = CpuBackend()
