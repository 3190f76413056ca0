"""The CPU backend: float32 NumPy arrays, kernels compiled by Numba (`@njit(parallel=True)`),
cached on disk so each signature compiles once per machine."""

import numpy as np

from nanoeuler_ops import ReferenceBackend


class CpuBackend(ReferenceBackend):
    name = "cpu"
    dtype = np.float32


BACKEND = CpuBackend()
