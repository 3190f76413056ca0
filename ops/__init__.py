"""nanoeuler's built-in ops: one module per op (spec, NumPy float64 reference, registration),
with its Numba kernels under `cpu/` and `cuda/` in modules of the same name.

This package also defines the `reference` backend: plain NumPy float64 arrays.
"""

import numpy as np

from nanoeuler_core.registry import Backend


class ReferenceBackend(Backend):
    """NumPy float64: slow, exact enough for finite differences, the ground truth."""

    name = "reference"
    dtype = np.float64

    def asarray(self, host, dtype=None):
        host = np.asarray(host)
        if dtype is None:
            dtype = self.dtype if host.dtype.kind == "f" else host.dtype
        return np.array(host, dtype=dtype, copy=True)

    def to_host(self, arr):
        return np.asarray(arr)

    def zeros(self, shape, dtype=None):
        return np.zeros(shape, dtype=dtype or self.dtype)

    def copy_(self, dst, src):
        dst[...] = src


REFERENCE = ReferenceBackend()
