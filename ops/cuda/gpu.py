"""The real GPU's host side: `DEVICE`, the object through which the CUDA layer launches kernels,
builds CUDA graphs and copies results back on a GPU.

ops/cuda/simulator.py has an object of the same interface for Numba's CUDA simulator, and
ops/cuda/device.py takes the one or the other: the runtime (ops/cuda/runtime.py) and the backend
(ops/cuda/__init__.py) ask `device.DEVICE`, never which one it is. CUDA's Python libraries
(cuda.core, cuda.bindings, nvmath) are imported when a method first needs them.
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np
from numba import cuda
from numba.cuda.cudadrv import devicearray, driver

DEFAULT_SHARED_LIMIT = 48 * 1024   # bytes of dynamic shared memory a kernel may take without raising its limit
NVIDIA_GPUS = "/proc/driver/nvidia/gpus"   # one folder per GPU the driver has, readable without CUDA


class Gpu:
    """An NVIDIA GPU driven through numba-cuda and cuda.core."""

    def __init__(self) -> None:
        self._overlaps: bool | None = None   # whether kernels launched with overlap=True overlap, once asked
        self._compiled: dict = {}         # (kernel, its arguments' kinds) -> (compiled, argument types, driver kernel)
        self._shared_limits: dict = {}    # compiled kernel -> the dynamic shared memory limit raised for it
        self._launch_configs: dict = {}   # (blocks, threads, shared bytes, overlap) -> cuda.core LaunchConfig
        self._core_stream: list = [None, None]   # the stream launched on last, and its cuda.core Stream
        self._pinned: dict[int, list[np.ndarray]] = {}   # bytes -> page-locked host buffers no read-back is using
        self._events: list = []                          # CUDA events no read-back is using
        self._cublas: list = []   # [nvmath's cuBLAS bindings, or None], once looked for

    # -------------------------------------------------------------------- what this GPU is

    def name(self) -> str:
        name = cuda.get_current_device().name
        return name.decode() if isinstance(name, bytes) else str(name)

    def compute_capability(self) -> tuple[int, int]:
        return tuple(cuda.get_current_device().compute_capability)

    def overlaps(self) -> bool:
        """Whether `launch(..., overlap=True)` overlaps kernels here: a GPU of compute capability 9.0
        or later (programmatic dependent launch). The kernels' overlap instructions (ptx.py) compile
        to nothing where it does not."""
        if self._overlaps is None:
            try:
                self._overlaps = self.compute_capability() >= (9, 0)
            except Exception:   # no GPU here (code compiled ahead for another machine)
                return False
        return self._overlaps

    def is_aligned(self, arr, alignment: int) -> bool:
        """Whether the device array's data starts at a multiple of `alignment` bytes."""
        return arr.device_ctypes_pointer.value % alignment == 0

    def cublas_bindings(self):
        """nvmath's cuBLAS bindings, or None where nvmath is not installed."""
        if not self._cublas:
            try:
                from nvmath.bindings import cublas
            except ImportError:
                cublas = None
            self._cublas.append(cublas)
        return self._cublas[0]

    # -------------------------------------------------------------------- ranks

    def gpu_count(self) -> int | None:
        """The GPUs the ranks of this machine may share, counted without starting the driver where it
        has not started (None: unknown until it starts)."""
        if driver.driver.is_initialized:
            return len(cuda.gpus)
        visible = _visible_devices()
        return len(visible) if visible else len(os.listdir(NVIDIA_GPUS)) if os.path.isdir(NVIDIA_GPUS) else None

    def claim(self, local_rank: int) -> str:
        """Make GPU `local_rank` of this machine the only one this process sees (CUDA_VISIBLE_DEVICES,
        set before the driver starts), so that every buffer, kernel and NCCL call of the rank is on it
        whatever library allocates; returns the GPU's UUID."""
        if not driver.driver.is_initialized:
            visible = _visible_devices()
            os.environ["CUDA_VISIBLE_DEVICES"] = visible[local_rank] if visible else str(local_rank)
            if not cuda.is_available() or len(cuda.gpus) == 0:
                raise ValueError(f"rank {local_rank} of this machine sees no GPU (CUDA_VISIBLE_DEVICES="
                                 f"{os.environ['CUDA_VISIBLE_DEVICES']}): start at most one rank per GPU")
            cuda.select_device(0)
        else:   # CUDA started before the ranks were known (an embedding program): choose by ordinal
            cuda.select_device(local_rank)
            from cuda.core import Device

            Device(local_rank).set_current()
        return cuda.get_current_device().uuid

    # -------------------------------------------------------------------- launching

    def launch(self, kernel, blocks, threads, stream, args, shared_bytes: int, overlap: bool) -> None:
        """kernel[blocks, threads](*args) on `stream` with `shared_bytes` of dynamic shared memory
        (above DEFAULT_SHARED_LIMIT, the compiled kernel's limit raised first, once per kernel and
        argument types), with programmatic stream serialization where `overlap` and the GPU overlaps.

        Numba's launch, lean on the host: eager launches (a prompt's prefill, an uncaptured step)
        pay this each time, so the compiled kernel, the launch configuration and the stream are
        looked up once, and device arrays are packed directly as Numba's kernel ABI takes them
        (meminfo, parent, size, itemsize, data, shape, strides)."""
        from cuda.core import LaunchConfig
        from cuda.core import launch as core_launch

        if shared_bytes > DEFAULT_SHARED_LIMIT:
            self._raise_shared_limit(kernel, args, shared_bytes)
        overlap = overlap and self.overlaps()
        compiled, argument_types, function = self._compiled_for(kernel, args)
        if self._core_stream[0] is not stream:
            self._core_stream[:] = stream, driver._to_core_stream(stream)
        core_stream = self._core_stream[1]
        config = self._launch_configs.get((blocks, threads, shared_bytes, overlap))
        if config is None:
            config = self._launch_configs[(blocks, threads, shared_bytes, overlap)] = LaunchConfig(
                grid=blocks, block=threads, shmem_size=shared_bytes, programmatic_stream_serialization=overlap)
        packed, written_back = [], []
        for ty, value in zip(argument_types, args):
            if isinstance(value, devicearray.DeviceNDArray):
                packed += (0, 0, value.size, value.dtype.itemsize, value.device_ctypes_pointer.value or 0,
                           *value.shape, *value.strides)
            else:
                compiled._prepare_args(ty, value, core_stream, written_back, packed)
        core_launch(core_stream, config, function, *packed)
        for write_back in written_back:   # host arrays passed in: copied back, as Numba's launch does
            write_back()

    def _compiled_for(self, kernel, args) -> tuple:
        """(compiled kernel, its argument types, its driver kernel) for `args`, compiled on first use."""
        key = (kernel, tuple(_argument_kind(kernel, a) for a in args))
        entry = self._compiled.get(key)
        if entry is None:
            compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
            entry = self._compiled[key] = (compiled, compiled.argument_types, compiled.library.get_cufunc().kernel)
        return entry

    def _raise_shared_limit(self, kernel, args, shared_bytes: int) -> None:
        """Let the kernel compiled for `args` take `shared_bytes` of dynamic shared memory (the
        driver's CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)."""
        compiled = self._compiled_for(kernel, args)[0]
        if self._shared_limits.get(compiled, DEFAULT_SHARED_LIMIT) >= shared_bytes:
            return
        from cuda.bindings import driver as cu   # the driver API numba-cuda itself runs on

        function = compiled.library.get_cufunc()
        attribute = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        (status,) = cu.cuKernelSetAttribute(attribute, shared_bytes, function.handle, function.device.id)
        if status != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cannot give kernel {kernel.__name__} {shared_bytes} bytes of dynamic shared memory "
                               f"(this GPU allows less): {status}")
        self._shared_limits[compiled] = shared_bytes

    def graph_builder(self):
        """(builder, stream): a cuda.core graph builder on this process's GPU, and the stream its
        graphs replay on (the default stream), for `graphs.capture`."""
        from cuda.core import Device

        device = Device()
        device.set_current()
        return device.create_graph_builder(), device.default_stream

    # -------------------------------------------------------------------- memory

    def memory_in_use(self) -> int:
        free, total = cuda.current_context().get_memory_info()
        return total - free

    def host_visible(self, shape, dtype):
        """(device, host) views of one page-locked host array of zeros, mapped into the GPU's address
        space: a kernel writes `device`, the host reads `host` once that kernel has run, in place of
        a copy queued after the kernel."""
        host = cuda.mapped_array(shape, dtype)
        host[...] = 0
        return devicearray.DeviceNDArray(host.shape, host.strides, host.dtype, gpu_data=host.gpu_data), host

    def to_host(self, arr) -> np.ndarray:
        """A device array's contents in a new host array, once the work queued before it has run. A
        C-contiguous array is copied by one driver call: a decoding step reads two small arrays
        back, and Numba's copy_to_host spends tens of microseconds of host time on each."""
        if not arr.flags["C_CONTIGUOUS"] or arr.size == 0:
            return arr.copy_to_host()
        from cuda.bindings import driver as cu

        host = np.empty(arr.shape, arr.dtype)
        (err,) = cu.cuMemcpyDtoH(host.ctypes.data, arr.device_ctypes_pointer.value, host.nbytes)
        _check(err, f"copying {host.nbytes} bytes from the GPU")
        return host

    def read_back(self, arrays) -> Callable[[], list[np.ndarray]]:
        """Queue copies of the device arrays into page-locked host buffers on the default stream,
        behind the work queued there (a graph replayed on it), and return what waits for them and
        gives their contents in new host arrays. The host is free meanwhile: it can queue the next
        decoding step before this one's results come back. Two read-backs in flight at once must
        not share a buffer, so each takes its buffers and event from pools and gives them back once
        its result is taken. An array one driver call cannot copy (not C-contiguous, or empty) makes
        the read-back copy now."""
        if not all(arr.flags["C_CONTIGUOUS"] and arr.size for arr in arrays):
            copies = [self.to_host(arr) for arr in arrays]
            return lambda: copies
        from cuda.bindings import driver as cu

        buffers = []
        for arr in arrays:
            free = self._pinned.get(arr.nbytes)
            buffer = free.pop() if free else cuda.pinned_array(arr.nbytes, np.uint8)
            buffers.append(buffer)
            # stream 0: the legacy default stream, where kernels launch and captured graphs replay
            (err,) = cu.cuMemcpyDtoHAsync(buffer.ctypes.data, arr.device_ctypes_pointer.value, arr.nbytes, 0)
            _check(err, f"queueing a copy of {arr.nbytes} bytes from the GPU")
        if self._events:
            event = self._events.pop()
        else:
            err, event = cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
            _check(err, "creating a CUDA event")
        (err,) = cu.cuEventRecord(event, 0)
        _check(err, "recording a CUDA event after copies from the GPU")

        taken = []   # the copies, once taken (the buffers and the event are back in the pools then)

        def result() -> list[np.ndarray]:
            if not taken:
                (err,) = cu.cuEventSynchronize(event)
                _check(err, "waiting for copies from the GPU")
                taken.append([buffer.view(arr.dtype).reshape(arr.shape).copy() for buffer, arr in zip(buffers, arrays)])
                for buffer in buffers:
                    self._pinned.setdefault(buffer.nbytes, []).append(buffer)
                self._events.append(event)
            return taken[0]

        return result


def _visible_devices() -> list[str]:
    return [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]


def _argument_kind(kernel, a):
    """What Numba types a kernel argument by: a device array's dtype, rank and layout, a scalar's
    Python type, a tuple's items'; anything else, its Numba type."""
    if isinstance(a, devicearray.DeviceNDArray):
        flags = a.flags
        return a.dtype, a.ndim, flags["C_CONTIGUOUS"], flags["F_CONTIGUOUS"], 0 in a.strides
    if isinstance(a, (int, float, np.generic)):
        return type(a)
    if isinstance(a, tuple):
        return tuple, tuple(_argument_kind(kernel, item) for item in a)
    return kernel.typeof_pyval(a)


def _check(err, what: str) -> None:
    """A driver call's result: RuntimeError, one line, unless it succeeded."""
    from cuda.bindings import driver as cu

    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err.name}")


DEVICE = Gpu()
