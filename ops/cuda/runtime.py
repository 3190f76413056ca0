"""The host runtime every CUDA op uses: the stream kernels launch on, `launch`, the arena that hands
out output buffers, and fill/copy kernels. Device-specific host work (how a launch reaches the GPU,
CUDA graphs, copies back to the host) is DEVICE's, ops/cuda/device.py's choice of a GPU or Numba's
simulator.

Streams and capture. Every op launches on `runtime.stream()` (the default stream unless a
caller wraps its work in `on_stream(s)`). A CUDA graph is captured (ops/cuda/graphs.py) by running the
ops inside `on_stream(graph_builder, capturing=True)`: kernels then go to the builder, cuBLAS calls
to its stream, and the host-side input checks that would synchronise are skipped.

Allocation. A captured graph bakes in the addresses of every buffer it touches, so replaying it
must find the same buffers. `ARENA` hands out buffers in call order: inside `ARENA.recording()`
each request is allocated and remembered; inside `ARENA.replaying()` the same requests, made in
the same order, get the remembered buffers back. Outside both, each request is a fresh
allocation (the eager path).
"""

from __future__ import annotations

import math
import weakref
from contextlib import contextmanager

import numpy as np
from numba import cuda, float32
from numba.cuda.cudadrv import driver

from nanoeuler_ops.cuda.device import DEVICE, let_next_start, stored, to_f32, wait_for_previous


# ---------------------------------------------------------------- streams

class _Launch:
    stream = 0            # a numba Stream, a cuda.core GraphBuilder, or 0 (the default stream)
    capturing = False


def stream():
    """The stream (or graph builder) kernels launch on now."""
    return _Launch.stream


def stream_handle() -> int:
    """The raw CUstream handle of `stream()`, for libraries such as cuBLAS (0 = default stream)."""
    s = _Launch.stream
    if s == 0:
        return 0
    if hasattr(s, "begin_building"):   # cuda.core GraphBuilder: its capture stream
        return int(s.stream.handle)
    return int(s)


def host_copy_stream():
    """`stream()` as the numba Stream a copy from the host takes (the default stream's too): a copy
    given none waits for all the work queued so far before it starts, and the host with it."""
    s = _Launch.stream
    return cuda.default_stream() if s == 0 else s


def capturing() -> bool:
    """True while a CUDA graph is being captured: no host copies or synchronisation allowed."""
    return _Launch.capturing


def check_on_host(check, arr, *args) -> None:
    """Run a host-side input check (e.g. ids within the vocabulary) on a copy of `arr`, except
    while capturing, where the copy would synchronise; kernels then guard their indexing instead."""
    if not _Launch.capturing:
        check(arr.copy_to_host(), *args)


@contextmanager
def on_stream(s, capturing: bool = False):
    """Launch every op inside the block on `s` (set `capturing` when `s` is a graph builder)."""
    saved = (_Launch.stream, _Launch.capturing)
    _Launch.stream, _Launch.capturing = s, capturing
    try:
        yield
    finally:
        _Launch.stream, _Launch.capturing = saved


def launch(kernel, blocks, threads, *args, shared_bytes=0, overlap=False):
    """kernel[blocks, threads](*args) on the current stream, with `shared_bytes` of dynamic shared
    memory (the GPU raises a kernel's limit for more than 48 KB). With `overlap`, the kernel may
    start before the one ahead of it ends (see "overlapping kernels" in ops/cuda/ptx.py): it must
    call wait_for_previous() before it reads anything an earlier kernel writes."""
    DEVICE.launch(kernel, blocks, threads, _Launch.stream, args, shared_bytes, overlap)


def blocks_for(n: int, threads: int) -> int:
    """Blocks of `threads` threads that cover n items (at least one, so empty inputs still launch)."""
    return max(1, math.ceil(n / threads))


def warpgroup_mma() -> bool:
    """Whether kernels may use the warpgroup products (wgmma_*): Hopper (compute capability 9.0,
    whose code Numba builds for sm_90a)."""
    return DEVICE.compute_capability() == (9, 0)


# ---------------------------------------------------------------- allocation

class Arena:
    """Output buffers in call order, so a captured CUDA graph replays on the same memory.

    While recording, memory is recycled: when an array handed out dies (the code dropped its last
    reference, as the backward does with each layer's temporaries), its memory goes to a free
    list and the next request of the same size gets it. Kernels run in stream order, so reusing
    memory that a queued kernel still reads is safe. The recording is the list of (memory, shape,
    dtype) in request order, which replaying hands back; the graph thus needs little more memory
    than the eager step at its peak, instead of one buffer per temporary. (Recording takes GPU
    memory: graphs.capture records on a GPU; on the simulator it runs the function as it is.)
    """

    def __init__(self) -> None:
        self._recorded: list = []            # (memory, shape, dtype) in request order
        self._free: dict[int, list] = {}     # size in bytes -> recyclable memory
        self._mode = "eager"
        self._next = 0

    @contextmanager
    def recording(self):
        """Allocate (recycling dead buffers) and remember each buffer, forgetting any earlier recording.

        Yields the recording: whoever replays a graph over it must keep it alive.
        """
        self._recorded, self._mode = [], "record"
        try:
            yield self._recorded
        finally:
            self._mode = "eager"

    @contextmanager
    def replaying(self):
        """Hand back the recorded buffers, in the order they were recorded."""
        self._mode, self._next = "replay", 0
        try:
            yield
        finally:
            self._mode = "eager"

    def empty(self, shape, dtype=np.float32):
        """An uninitialised device array of `shape` and `dtype`."""
        shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
        dtype = np.dtype(dtype)
        if self._mode == "eager":
            return cuda.device_array(shape, dtype)
        if self._mode == "replay":
            if self._next >= len(self._recorded):
                raise RuntimeError(f"replay asked for buffer {self._next + 1} of {len(self._recorded)} recorded: "
                                   f"the replayed code must allocate exactly as the recorded code did")
            memory, rec_shape, rec_dtype = self._recorded[self._next]
            if rec_shape != shape or rec_dtype != dtype:
                raise RuntimeError(f"replay buffer {self._next} was recorded as {rec_shape} {rec_dtype}, "
                                   f"now asked for {shape} {dtype}: the replayed code must allocate as recorded")
            self._next += 1
            return _view(memory, shape, dtype)
        nbytes = max(1, int(np.prod(shape)) * dtype.itemsize)
        free = self._free.get(nbytes)
        memory = free.pop() if free else cuda.current_context().memalloc(nbytes)
        self._recorded.append((memory, shape, dtype))
        # Every array made from this one (reshapes, slices) keeps `lease` alive through its memory
        # pointer's owner; once the last is gone, the memory is free for the next request.
        lease = _Lease()
        pointer = driver.MemoryPointer(memory.context, memory.device_pointer, nbytes, owner=lease)
        weakref.finalize(lease, self._free.setdefault(nbytes, []).append, memory)
        return _view(pointer, shape, dtype)

    def zeros(self, shape, dtype=np.float32):
        """A device array of zeros, filled by a kernel on the current stream (capturable)."""
        buf = self.empty(shape, dtype)
        fill(buf, 0)
        return buf


class _Lease:
    """Stands for one hand-out of recycled memory while any array over it lives."""

    __slots__ = ("__weakref__",)


def _view(memory, shape, dtype):
    """A C-contiguous device array of `shape` over `memory` (which stays owned by the arena)."""
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    strides, step = [], dtype.itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return DeviceNDArray(shape, tuple(reversed(strides)), dtype, gpu_data=memory)


ARENA = Arena()
empty = ARENA.empty
zeros = ARENA.zeros


@cuda.jit(cache=True)
def _fill(flat, value):
    # flat (n,) <- value
    i = cuda.grid(1)
    if i < flat.shape[0]:
        flat[i] = value


def fill(arr, value) -> None:
    """Set every element of a contiguous device array to `value`, on the current stream."""
    flat = arr.reshape(arr.size)
    launch(_fill, blocks_for(arr.size, 256), 256, flat, arr.dtype.type(value))


@cuda.jit(cache=True)
def _copy(dst, src):
    # dst (n,) <- src (n,), one dtype
    i = cuda.grid(1)
    let_next_start()
    wait_for_previous()
    if i < dst.shape[0]:
        dst[i] = src[i]


CAST_ELEMENTS = 4   # elements a thread of `_cast` takes


@cuda.jit(cache=True)
def _cast(dst, src):
    # dst (n,) <- src (n,) between float32 and bf16 storage; thread t of block b takes the elements
    # b * 256 * CAST_ELEMENTS + t + k * 256 and reads them all before it writes any (the bf16 copy of
    # the weights each training step refreshes: 4 bytes a thread in flight were too few)
    first = cuda.blockIdx.x * (256 * CAST_ELEMENTS) + cuda.threadIdx.x
    values = cuda.local.array(CAST_ELEMENTS, float32)
    let_next_start()
    wait_for_previous()
    for k in range(CAST_ELEMENTS):
        i = first + k * 256
        if i < dst.shape[0]:
            values[k] = to_f32(src[i])
    for k in range(CAST_ELEMENTS):
        i = first + k * 256
        if i < dst.shape[0]:
            dst[i] = stored(dst, values[k])


@cuda.jit(cache=True)
def _copy_rows(dst, src):
    # dst (P, N) <- src (P, N), one dtype, each row contiguous and the rows apart (a run of positions
    # in every plane of a KV cache)
    i = cuda.grid(1)
    N = dst.shape[1]
    let_next_start()
    wait_for_previous()
    if i < dst.size:
        dst[i // N, i % N] = src[i // N, i % N]


def copy(dst, src) -> None:
    """dst <- src for device arrays of one shape, on the current stream (capturable), overlapping
    the kernel ahead: contiguous ones (between float32 and bf16 storage the values are converted),
    or 2-D views whose rows are each contiguous, of one dtype."""
    if not (dst.is_c_contiguous() and src.is_c_contiguous()):
        if dst.ndim != 2 or dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"a copy between strided arrays takes 2-D views of one shape and dtype, got "
                             f"{dst.shape} {dst.dtype} and {src.shape} {src.dtype}")
        launch(_copy_rows, blocks_for(dst.size, 256), 256, dst, src, overlap=True)
        return
    kernel, per_block = (_copy, 256) if dst.dtype == src.dtype else (_cast, 256 * CAST_ELEMENTS)
    launch(kernel, blocks_for(dst.size, per_block), 256, dst.reshape(dst.size), src.reshape(src.size), overlap=True)

