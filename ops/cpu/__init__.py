"""The CPU backend: float32 NumPy arrays, kernels compiled by Numba (`@njit(parallel=True)`),
cached on disk so each signature compiles once per machine. Kernels: `nanoeuler_ops.cpu.<op>`."""

from contextlib import contextmanager

import numpy as np

from nanoeuler_ops import HostBackend


class CpuBackend(HostBackend):
    name = "cpu"
    dtype = np.float32
    kernel_packages = ("nanoeuler_ops.cpu",)

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
