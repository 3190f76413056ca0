"""The CUDA backend: float32 (and bfloat16-storage) Numba device arrays, every op as `@cuda.jit`
kernels (one module per op, named as in `cpu/`), matrix products through cuBLAS.

Importing this package stays cheap (the registry imports it on every start): numba.cuda is
imported only when a backend method runs or an op's kernels are first used. With
NUMBA_ENABLE_CUDASIM=1 the same kernels run, slowly, on Numba's CUDA simulator.
"""

from contextlib import contextmanager

import numpy as np

from nanoeuler_core.registry import Backend

TENSOR_CORE_CAPABILITY = (8, 0)   # bf16 and TF32 tensor cores (Ampere and newer)


class CudaBackend(Backend):
    name = "cuda"
    dtype = np.float32

    def available(self) -> bool:
        try:
            from numba import cuda
        except ImportError:  # numba-cuda not installed: pip install 'nanoeuler[cuda]'
            return False
        return cuda.is_available()

    @property
    def precisions(self) -> tuple[str, ...]:
        from nanoeuler_ops.cuda import runtime
        if runtime.SIMULATOR or runtime.compute_capability() >= TENSOR_CORE_CAPABILITY:
            return ("fp32", "tf32", "bf16")
        return ("fp32",)

    @property
    def default_precision(self) -> str:
        return "bf16" if "bf16" in self.precisions else "fp32"

    def check_precision(self, precision: str) -> str:
        from nanoeuler_ops.cuda import runtime
        if precision in ("tf32", "bf16") and precision not in self.precisions:
            major, minor = runtime.compute_capability()
            raise ValueError(f"--precision {precision} needs tensor cores of compute capability 8.0 or newer; "
                             f"this GPU is {major}.{minor}: use --precision fp32")
        return super().check_precision(precision)

    def stream_handle(self) -> int:
        from nanoeuler_ops.cuda import runtime
        return runtime.stream_handle()

    @contextmanager
    def matmul_mode(self, precision: str):
        from nanoeuler_ops.cuda import cublas
        saved, cublas.ALLOW_TF32 = cublas.ALLOW_TF32, precision == "tf32"
        try:
            yield
        finally:
            cublas.ALLOW_TF32 = saved

    def asarray(self, host, dtype=None):
        from numba import cuda

        from nanoeuler_ops.cuda import runtime
        host = np.asarray(host)
        if dtype == "bf16":
            return cuda.to_device(runtime.bf16_bits(host))
        if dtype is None:
            dtype = {"f": self.dtype, "i": np.int64, "u": np.int64}.get(host.dtype.kind, host.dtype)
        return cuda.to_device(np.ascontiguousarray(host, dtype=dtype))

    def to_host(self, arr):
        from nanoeuler_ops.cuda import runtime
        host = arr.copy_to_host()
        return runtime.bf16_values(host) if host.dtype == runtime.BF16 else host

    def zeros(self, shape, dtype=None):
        from nanoeuler_ops.cuda import runtime
        return runtime.zeros(shape, runtime.BF16 if dtype == "bf16" else dtype or self.dtype)

    def copy_(self, dst, src) -> None:
        from nanoeuler_ops.cuda import runtime
        if not isinstance(src, np.ndarray):
            runtime.copy(dst, src)  # device to device (casting between storages): a kernel on the current stream
        elif dst.dtype == runtime.BF16:
            dst.copy_to_device(runtime.bf16_bits(src))
        elif runtime.capturing():
            raise RuntimeError("host data cannot be copied inside a captured CUDA graph; copy it before replaying")
        else:
            dst.copy_to_device(np.ascontiguousarray(src, dtype=dst.dtype))

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
