"""The CPU backend: float32 NumPy arrays, kernels compiled by Numba (`@njit(parallel=True)`),
cached on disk so each signature compiles once per machine. Kernels: `nanoeuler_ops.cpu.<op>`."""

import os
from contextlib import contextmanager

import numpy as np

from nanoeuler_ops import HostBackend


class CpuBackend(HostBackend):
    name = "cpu"
    dtype = np.float32
    kernel_packages = ("nanoeuler_ops.cpu",)

    def kernel_cache_cold(self) -> bool:
        # judged by two kernels every run compiles: AdamW's update and the sampler (Numba's index files)
        from nanoeuler_ops.cpu import adamw, sample

        try:
            return not all(os.path.exists(kernel._cache._cache_file._index_path) for kernel in (adamw._update, sample._sample))
        except AttributeError:   # a Numba that keeps its cache elsewhere: nothing is warmed ahead
            return False

    @contextmanager
    def serial(self):
        import numba

        threads = numba.get_num_threads()
        numba.set_num_threads(1)  # thread-local: other threads keep their setting
        try:
            yield
        finally:
            numba.set_num_threads(threads)


BACKEND = CpuBackend()
