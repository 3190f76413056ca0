"""The CUDA backend: float32 Numba device arrays, every op as `@cuda.jit` kernels (one module
per op, named as in `cpu/`), matrix products through cuBLAS.

Importing this package stays cheap (the registry imports it on every start): numba.cuda is
imported only when a backend method runs or an op's kernels are first used. With
NUMBA_ENABLE_CUDASIM=1 the same kernels run, slowly, on Numba's CUDA simulator.
"""

import numpy as np

from nanoeuler_core.registry import Backend


class CudaBackend(Backend):
    name = "cuda"
    dtype = np.float32

    def available(self) -> bool:
        from numba import cuda
        return cuda.is_available()

    def asarray(self, host, dtype=None):
        from numba import cuda
        host = np.asarray(host)
        if dtype is None:
            dtype = {"f": self.dtype, "i": np.int64, "u": np.int64}.get(host.dtype.kind, host.dtype)
        return cuda.to_device(np.ascontiguousarray(host, dtype=dtype))

    def to_host(self, arr):
        return arr.copy_to_host()

    def zeros(self, shape, dtype=None):
        from nanoeuler_ops.cuda import runtime
        return runtime.zeros(shape, dtype or self.dtype)

    def synchronize(self) -> None:
        from numba import cuda
        cuda.synchronize()


BACKEND = CudaBackend()
