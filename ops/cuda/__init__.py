"""The CUDA backend: float32 (and bfloat16-storage) Numba device arrays, every op as `@cuda.jit`
kernels (one module per op, named as in `cpu/`), matrix products through cuBLAS.

Importing this package stays cheap (the registry imports it on every start): numba.cuda is
imported only when a backend method runs or an op's kernels are first used, and nothing here
initialises the CUDA driver before `claim_device` has chosen this process's GPU. With
NUMBA_ENABLE_CUDASIM=1 the same kernels run, slowly, on Numba's CUDA simulator.
"""

import os
from contextlib import contextmanager

import numpy as np

from nanoeuler_core import registry
from nanoeuler_core.registry import Backend, Precision

TENSOR_CORE_CAPABILITY = (8, 0)   # bf16 and TF32 tensor cores (Ampere and newer)
NVIDIA_GPUS = "/proc/driver/nvidia/gpus"   # one folder per GPU the driver has, readable without CUDA


class CudaBackend(Backend):
    name = "cuda"
    dtype = np.float32
    kernel_packages = ("nanoeuler_ops.cuda",)
    install_hint = "it needs an NVIDIA GPU and pip install 'nanoeuler[cuda]'"
    simulator = "Numba's CUDA simulator"
    simulator_env = {"NUMBA_ENABLE_CUDASIM": "1"}
    implements = ("fp32", "tf32", "bf16")   # tf32 and bf16 where the GPU has tensor cores
    multi_token_step_cheap = True   # reading the weights dominates a step: K tokens cost about what 1 does
    captures = True                 # a CUDA graph: one launch for the kernels of a step or a prefill
    peer_device = "cuda"

    def __init__(self) -> None:
        self.precision: Precision = registry.FP32   # what the kernels launched now compute in (see `computing`)

    def available(self) -> bool:
        try:
            from numba import cuda
        except ImportError:  # numba-cuda not installed: pip install 'nanoeuler[cuda]'
            return False
        return cuda.is_available()

    # -------------------------------------------------------------------- precision

    @property
    def precisions(self) -> tuple[Precision, ...]:
        from nanoeuler_ops.cuda import runtime
        if runtime.SIMULATOR or runtime.compute_capability() >= TENSOR_CORE_CAPABILITY:
            return (registry.FP32, registry.TF32, registry.BF16)
        return (registry.FP32,)

    @property
    def default_precision(self) -> Precision:
        return registry.BF16 if registry.BF16 in self.precisions else registry.FP32

    def check_precision(self, name) -> Precision:
        from nanoeuler_ops.cuda import runtime

        p = registry.precision(name)
        if p is not registry.FP32 and p not in self.precisions:
            major, minor = runtime.compute_capability()
            raise ValueError(f"--precision {p.name} needs tensor cores of compute capability 8.0 or newer; "
                             f"this GPU is {major}.{minor}: use --precision fp32")
        return super().check_precision(p)

    @contextmanager
    def computing(self, precision: Precision):
        saved, self.precision = self.precision, precision
        try:
            yield
        finally:
            self.precision = saved

    # -------------------------------------------------------------------- arrays

    def asarray(self, host, storage=None):
        from numba import cuda

        from nanoeuler_ops.cuda import runtime
        host = np.asarray(host)
        if storage == "bf16" and host.dtype.kind == "f":
            return cuda.to_device(runtime.bf16_bits(host))
        dtype = {"f": self.dtype, "i": np.int64, "u": np.int64}.get(host.dtype.kind, host.dtype)
        return cuda.to_device(np.ascontiguousarray(host, dtype=dtype))

    def to_host(self, arr):
        from nanoeuler_ops.cuda import runtime
        host = runtime.to_host(arr)
        return runtime.bf16_values(host) if host.dtype == runtime.BF16 else host

    def read_back(self, arrays):
        """Copies queued behind the work so far (see `runtime.read_back`); under the simulator, or for
        an array one driver call cannot copy (not C-contiguous, or empty), copied now."""
        from nanoeuler_ops.cuda import runtime
        if runtime.SIMULATOR or not all(arr.flags["C_CONTIGUOUS"] and arr.size for arr in arrays):
            return super().read_back(arrays)
        copies = runtime.read_back(arrays)
        return lambda: [runtime.bf16_values(host) if host.dtype == runtime.BF16 else host for host in copies()]

    def host_visible(self, shape, dtype):
        """Page-locked host memory mapped into the GPU's address space: kernels write it over the bus
        as they run, in place of a copy queued after them (a copy costs a step about 8 us on an H100)."""
        from nanoeuler_ops.cuda import runtime
        if runtime.SIMULATOR:
            return super().host_visible(shape, dtype)
        return runtime.host_visible(shape, dtype)

    def zeros(self, shape, dtype=None):
        from nanoeuler_ops.cuda import runtime
        return runtime.zeros(shape, runtime.BF16 if dtype == "bf16" else dtype or self.dtype)

    def zero_(self, arr) -> None:
        from nanoeuler_ops.cuda import runtime
        runtime.fill(arr, 0)

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

    def synchronize(self) -> None:
        from numba import cuda
        cuda.synchronize()

    def stream_handle(self) -> int:
        from nanoeuler_ops.cuda import runtime
        return runtime.stream_handle()

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

    # -------------------------------------------------------------------- traits

    def claim_device(self, local_rank: int, local_size: int) -> str:
        """Make GPU `local_rank` of this machine the only one this process sees (CUDA_VISIBLE_DEVICES,
        set before the driver starts), so that every buffer, kernel and NCCL call of the rank is on
        it whatever library allocates; returns the GPU's UUID."""
        import numba
        from numba import cuda
        from numba.cuda.cudadrv import driver

        if numba.config.ENABLE_CUDASIM:   # one simulated GPU, shared by nothing
            if local_size > len(cuda.gpus):
                raise _too_many_ranks(local_size, len(cuda.gpus))
            return ""
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        if not driver.driver.is_initialized:
            n_gpus = len(visible) if visible else len(os.listdir(NVIDIA_GPUS)) if os.path.isdir(NVIDIA_GPUS) else None
            if n_gpus is not None and local_size > n_gpus:
                raise _too_many_ranks(local_size, n_gpus)
            os.environ["CUDA_VISIBLE_DEVICES"] = visible[local_rank] if visible else str(local_rank)
            if not cuda.is_available() or len(cuda.gpus) == 0:
                raise ValueError(f"rank {local_rank} of this machine sees no GPU (CUDA_VISIBLE_DEVICES="
                                 f"{os.environ['CUDA_VISIBLE_DEVICES']}): start at most one rank per GPU")
            cuda.select_device(0)
        else:   # CUDA started before the ranks were known (an embedding program): choose by ordinal
            if local_size > len(cuda.gpus):
                raise _too_many_ranks(local_size, len(cuda.gpus))
            cuda.select_device(local_rank)
            from cuda.core import Device

            Device(local_rank).set_current()
        return cuda.get_current_device().uuid

    def collectives(self, comm):
        from nanoeuler_ops.cuda.collectives import NcclCollectives

        return NcclCollectives(comm, self)

    def memory_in_use(self) -> int | None:
        from nanoeuler_ops.cuda import runtime
        if runtime.SIMULATOR:
            return None
        from numba import cuda

        free, total = cuda.current_context().get_memory_info()
        return total - free

    def memory_limit(self) -> int | None:
        return None

    def device_name(self) -> str:
        from numba import cuda

        name = cuda.get_current_device().name
        return name.decode() if isinstance(name, bytes) else str(name)


def _too_many_ranks(local_size: int, n_gpus: int) -> ValueError:
    return ValueError(f"{local_size} ranks on this machine but {n_gpus} GPU{'s' if n_gpus != 1 else ''}: "
                      f"start at most one rank per GPU (mpiexec -n {n_gpus})")


BACKEND = CudaBackend()
