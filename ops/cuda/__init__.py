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
        try:
            from numba import cuda
        except ImportError:  # numba-cuda not installed: pip install 'nanoeuler[cuda]'
            return False
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

    def copy_(self, dst, src) -> None:
        from nanoeuler_ops.cuda import runtime
        if not isinstance(src, np.ndarray):
            runtime.copy(dst, src)  # device to device: a kernel on the current stream, so it can be captured
        elif runtime.capturing():
            raise RuntimeError("host data cannot be copied inside a captured CUDA graph; copy it before replaying")
        else:
            dst.copy_to_device(np.ascontiguousarray(src, dtype=dst.dtype))

    @property
    def matmul_precision(self) -> str:
        from nanoeuler_ops.cuda import cublas
        return "high" if cublas.ALLOW_TF32 else "highest"

    @matmul_precision.setter
    def matmul_precision(self, value: str) -> None:
        from nanoeuler_ops.cuda import cublas
        cublas.ALLOW_TF32 = value == "high"

    def capture(self, fn):
        """Run fn() once while recording its buffers, then capture it as a CUDA graph.

        Returns (replay, result): replay() launches the graph and returns the same `result`
        objects, now holding the new values. Under the simulator, replay is fn itself.
        """
        from cuda.core import Device

        from nanoeuler_ops.cuda import cublas, runtime
        if runtime.SIMULATOR:
            return fn, fn()
        device = Device()
        device.set_current()
        with runtime.ARENA.recording() as buffers:
            result = fn()
        builder = device.create_graph_builder()
        if cublas.uses_cublas():
            cublas.handle_for(int(builder.stream.handle))
        builder.begin_building()
        with runtime.on_stream(builder, capturing=True), runtime.ARENA.replaying():
            fn()
        graph = builder.end_building().complete()
        stream = device.default_stream

        def replay(buffers=buffers):  # the graph reads and writes these: keep them alive with it
            graph.launch(stream)
            return result

        return replay, result

    def synchronize(self) -> None:
        from numba import cuda
        cuda.synchronize()


BACKEND = CudaBackend()
