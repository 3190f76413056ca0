"""The CPU backend: float32 NumPy arrays, kernels compiled by Numba (`@njit(parallel=True)`),
cached on disk so each signature compiles once per machine. Kernels: `nanoeuler_ops.cpu.<op>`."""

import ctypes
import functools
import threading
from contextlib import contextmanager

import numpy as np

from nanoeuler_core.registry import Impl
from nanoeuler_ops import HostBackend


class CpuBackend(HostBackend):
    name = "cpu"
    dtype = np.float32
    kernel_packages = ("nanoeuler_ops.cpu",)
    # Its capture saves the host's work on the ops, not the kernels': no queue for a step to run
    # ahead on, and a padded prefill would compute more for nothing (registry.Backend.captures)
    captures = False

    def __init__(self) -> None:
        self._outside_serial: dict[int, int] = {}   # thread id -> its thread count before its first serial block
        self._local = threading.local()              # .recording: the calling thread's capture in progress, if any

    # -------------------------------------------------------------------- captured work
    # A decoding step is some 150 op calls on one token's data; their checks, allocations and calls
    # through the registry cost the host a few milliseconds a token, a fifth of the step. A captured
    # step is the kernels those calls launched, with the arrays they launched them on, launched again
    # over the same arrays: the ops' Python runs once, at the capture.

    def capture(self, fn):
        """fn recorded as the kernels its ops launch (`launch`) and replayed by launching them again,
        where every op fn calls launches all its work so (the decoding ops do); else replay is fn.
        fn must be backend work only, as for any backend's capture: ops and `copy_`/`zero_` on
        buffers that stay put. A replay runs with the threads the capture's kernels were given."""
        recording = self._local.recording = _Recording()
        try:
            result = fn()
        finally:
            self._local.recording = None
        if not recording.complete:
            return fn, result
        launches = tuple(recording.launches)

        def replay():
            for kernel, args in launches:
                kernel(*args)
            return result

        return replay, result

    def launch(self, kernel, *args) -> None:
        """kernel(*args) (a kernel and its arrays), recorded for replay inside `capture`. A kernel
        module launches through here all the work of an op it wants captured, and nothing else."""
        recording = getattr(self._local, "recording", None)
        if recording is not None:
            recording.launches.append((kernel, args))
        kernel(*args)

    def kernels(self, op):
        impl = super().kernels(op)
        return impl and Impl(*(fn and self._checked(fn) for fn in (impl.forward, impl.backward)))

    def _checked(self, fn):
        """fn (an op's forward or backward), which inside a capture must launch some kernel, else the
        capture is incomplete: an op that does its work otherwise is replayed by running fn again."""
        @functools.wraps(fn)
        def call(*args, **kwargs):
            recording = getattr(self._local, "recording", None)
            if recording is None:
                return fn(*args, **kwargs)
            launched = len(recording.launches)
            out = fn(*args, **kwargs)
            recording.complete &= len(recording.launches) > launched
            return out
        return call

    def zero_(self, arr) -> None:
        self.launch(_zero, arr)

    def copy_(self, dst, src) -> None:
        self.launch(_assign, dst, src)

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


class _Recording:
    """A capture in progress: the launches so far, and whether every op so far launched its work."""

    def __init__(self) -> None:
        self.launches: list = []
        self.complete = True


def _zero(arr) -> None:
    arr[...] = 0


def _assign(dst, src) -> None:
    dst[...] = src


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
