"""The CUDA backend: float32 (and bfloat16-storage) Numba device arrays, every op as `@cuda.jit`
kernels (one module per op, named as in `cpu/`), matrix products through cuBLAS.

Importing this package stays cheap (the registry imports it on every start): numba.cuda is
imported only when a backend method runs or an op's kernels are first used, and nothing here
initialises the CUDA driver before `claim_device` has chosen this process's GPU. Whatever depends
on the device (a GPU, or Numba's CUDA simulator: docs/cuda.md) the backend asks `device.DEVICE`.
"""

import numpy as np

from nanoeuler_core import registry
from nanoeuler_core.registry import Backend, Precision

TENSOR_CORE_CAPABILITY = (8, 0)   # bf16 and TF32 tensor cores (Ampere and newer)


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

    def available(self) -> bool:
        try:
            from numba import cuda
        except ImportError:  # numba-cuda not installed: pip install 'nanoeuler[cuda]'
            return False
        return cuda.is_available()

    # -------------------------------------------------------------------- precision

    @property
    def precisions(self) -> tuple[Precision, ...]:
        from nanoeuler_ops.cuda.device import DEVICE
        if DEVICE.compute_capability() >= TENSOR_CORE_CAPABILITY:
            return (registry.FP32, registry.TF32, registry.BF16)
        return (registry.FP32,)

    @property
    def default_precision(self) -> Precision:
        return registry.BF16 if registry.BF16 in self.precisions else registry.FP32

    def check_precision(self, name) -> Precision:
        from nanoeuler_ops.cuda.device import DEVICE

        p = registry.precision(name)
        if p is not registry.FP32 and p not in self.precisions:
            major, minor = DEVICE.compute_capability()
            raise ValueError(f"--precision {p.name} needs tensor cores of compute capability 8.0 or newer; "
                             f"this GPU is {major}.{minor}: use --precision fp32")
        return super().check_precision(p)

    # -------------------------------------------------------------------- arrays

    def asarray(self, host, storage=None):
        from numba import cuda

        host = np.asarray(host)
        if storage == "bf16" and host.dtype.kind == "f":
            return cuda.to_device(registry.bf16_bits(host))
        # integers (token ids, positions) as int64; bytes and float16 (quantized weights, their scales) as they are
        dtype = host.dtype if host.dtype.itemsize == 1 or host.dtype == np.float16 else \
            {"f": self.dtype, "i": np.int64, "u": np.int64}.get(host.dtype.kind, host.dtype)
        return cuda.to_device(np.ascontiguousarray(host, dtype=dtype))

    def to_host(self, arr):
        from nanoeuler_ops.cuda.device import DEVICE
        return _values(DEVICE.to_host(arr))

    def read_back(self, arrays):
        """Copies queued behind the work so far (see `DEVICE.read_back`)."""
        from nanoeuler_ops.cuda.device import DEVICE
        copies = DEVICE.read_back(arrays)
        return lambda: [_values(host) for host in copies()]

    def host_visible(self, shape, dtype):
        """On a GPU, page-locked host memory mapped into the GPU's address space: kernels write it
        over the bus as they run, in place of a copy queued after them."""
        from nanoeuler_ops.cuda.device import DEVICE
        return DEVICE.host_visible(shape, dtype)

    def zeros(self, shape, dtype=None):
        from nanoeuler_ops.cuda import runtime
        from nanoeuler_ops.cuda.device import BF16
        return runtime.zeros(shape, BF16 if dtype == "bf16" else dtype or self.dtype)

    def zero_(self, arr) -> None:
        from nanoeuler_ops.cuda import runtime
        runtime.fill(arr, 0)

    def copy_(self, dst, src) -> None:
        from nanoeuler_ops.cuda import runtime
        from nanoeuler_ops.cuda.device import BF16
        if not isinstance(src, np.ndarray):
            runtime.copy(dst, src)  # device to device (casting between storages): a kernel on the current stream
        elif runtime.capturing():
            raise RuntimeError("host data cannot be copied inside a captured CUDA graph; copy it before replaying")
        else:   # queued behind the work ahead on the stream; the host's bytes are staged before this returns
            host = registry.bf16_bits(src) if dst.dtype == BF16 else np.ascontiguousarray(src, dtype=dst.dtype)
            dst.copy_to_device(host, stream=runtime.host_copy_stream())

    def synchronize(self) -> None:
        from numba import cuda
        cuda.synchronize()

    def stream_handle(self) -> int:
        from nanoeuler_ops.cuda import runtime
        return runtime.stream_handle()

    def capture(self, fn):
        """On a GPU, fn captured as a CUDA graph (ops/cuda/graphs.py); on the simulator, fn itself."""
        from nanoeuler_ops.cuda import graphs
        return graphs.capture(fn)

    # -------------------------------------------------------------------- traits

    def claim_device(self, local_rank: int, local_size: int) -> str:
        """Make GPU `local_rank` of this machine the only one this process drives (`DEVICE.claim`),
        before the driver starts; returns the GPU's UUID ("" on the simulator, which ranks share)."""
        from nanoeuler_ops.cuda.device import DEVICE

        n_gpus = DEVICE.gpu_count()
        if n_gpus is not None and local_size > n_gpus:
            raise ValueError(f"{local_size} ranks on this machine but {n_gpus} GPU{'s' if n_gpus != 1 else ''}: "
                             f"start at most one rank per GPU (mpiexec -n {n_gpus})")
        return DEVICE.claim(local_rank)

    def collectives(self, comm):
        from nanoeuler_ops.cuda.collectives import NcclCollectives

        return NcclCollectives(comm, self)

    def memory_in_use(self) -> int | None:
        from nanoeuler_ops.cuda.device import DEVICE
        return DEVICE.memory_in_use()

    def memory_limit(self) -> int | None:
        return None

    def device_name(self) -> str:
        from nanoeuler_ops.cuda.device import DEVICE
        return DEVICE.name()


def _values(host: np.ndarray) -> np.ndarray:
    """A host copy as the backend gives it: bf16 storage (uint16 patterns) as float32 values."""
    return registry.bf16_values(host) if host.dtype == np.uint16 else host


BACKEND = CudaBackend()
