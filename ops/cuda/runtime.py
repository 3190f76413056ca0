"""What every CUDA kernel module shares: the stream kernels launch on, the allocator that hands
out output buffers, bfloat16 storage, and warp/block reductions that also run under Numba's CUDA
simulator.

Streams and capture. Every op launches on `runtime.stream()` (the default stream unless a
caller wraps its work in `on_stream(s)`). A CUDA graph is captured by running the ops inside
`on_stream(graph_builder, capturing=True)`: kernels then go to the builder, cuBLAS calls to its
stream, and the host-side input checks that would synchronise are skipped.

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
from typing import Callable

import numba
import numpy as np
from numba import cuda, float32, float64, types, uint16, uint32, uint64
from numba.cuda.cudadrv import driver
from numba.cuda.cudadrv import devicearray

from nanoeuler_core.registry import bf16_bits, bf16_values  # noqa: F401  (the backend converts with them)

SIMULATOR = bool(numba.config.ENABLE_CUDASIM)
WARP = 32
FULL_MASK = 0xFFFFFFFF


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


DEFAULT_SHARED_LIMIT = 48 * 1024   # bytes of dynamic shared memory a kernel may take without raising its limit
_shared_limits: dict = {}          # compiled kernel -> the dynamic shared memory limit raised for it


def launch(kernel, blocks, threads, *args, shared_bytes=0, overlap=False):
    """kernel[blocks, threads](*args) on the current stream, with `shared_bytes` of dynamic shared
    memory. Above DEFAULT_SHARED_LIMIT, the compiled kernel's limit is raised first, once per kernel
    and argument types. With `overlap`, the kernel may start before the one ahead of it ends (see
    "Overlapping kernels" below): it must call wait_for_previous() before it reads anything an
    earlier kernel writes."""
    if shared_bytes > DEFAULT_SHARED_LIMIT and not SIMULATOR:
        _raise_shared_limit(kernel, args, shared_bytes)
    if SIMULATOR:
        kernel[blocks, threads, _Launch.stream, shared_bytes](*args)
    else:
        _launch(kernel, blocks, threads, args, shared_bytes, overlap and overlaps())


_compiled: dict = {}         # (kernel, its arguments' kinds) -> (compiled kernel, argument types, driver kernel)
_launch_configs: dict = {}   # (blocks, threads, shared bytes, overlap) -> cuda.core LaunchConfig
_core_stream: list = [None, None]   # the stream launched on last, and its cuda.core Stream


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


def _compiled_for(kernel, args) -> tuple:
    """(compiled kernel, its argument types, its driver kernel) for `args`, compiled on first use."""
    key = (kernel, tuple(_argument_kind(kernel, a) for a in args))
    entry = _compiled.get(key)
    if entry is None:
        compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
        entry = _compiled[key] = (compiled, compiled.argument_types, compiled.library.get_cufunc().kernel)
    return entry


def _launch(kernel, blocks, threads, args, shared_bytes: int, overlap: bool) -> None:
    """Numba's launch of the kernel compiled for `args` (with `overlap`, programmatic stream
    serialization on), lean on the host: eager launches (a prompt's prefill, an uncaptured step)
    pay this each time, so the compiled kernel, the launch configuration and the stream are looked
    up once, and device arrays are packed directly as Numba's kernel ABI takes them (meminfo,
    parent, size, itemsize, data, shape, strides)."""
    from cuda.core import LaunchConfig
    from cuda.core import launch as core_launch

    compiled, argument_types, function = _compiled_for(kernel, args)
    if _core_stream[0] is not _Launch.stream:
        _core_stream[:] = _Launch.stream, driver._to_core_stream(_Launch.stream)
    core_stream = _core_stream[1]
    config = _launch_configs.get((blocks, threads, shared_bytes, overlap))
    if config is None:
        config = _launch_configs[(blocks, threads, shared_bytes, overlap)] = LaunchConfig(
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


_overlap: list = []   # [whether this process's GPU starts overlapped kernels], once asked


def overlaps() -> bool:
    """Whether `launch(..., overlap=True)` overlaps kernels here: a GPU of compute capability 9.0 or
    later (programmatic dependent launch), not the simulator."""
    if not _overlap:
        try:
            _overlap.append(not SIMULATOR and compute_capability() >= (9, 0))
        except Exception:   # no GPU here (code compiled ahead for another machine)
            return False
    return _overlap[0]


def _raise_shared_limit(kernel, args, shared_bytes: int) -> None:
    """Let the kernel compiled for `args` take `shared_bytes` of dynamic shared memory (the
    driver's CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)."""
    compiled = _compiled_for(kernel, args)[0]
    if _shared_limits.get(compiled, DEFAULT_SHARED_LIMIT) >= shared_bytes:
        return
    from cuda.bindings import driver as cu   # the driver API numba-cuda itself runs on

    function = compiled.library.get_cufunc()
    attribute = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    (status,) = cu.cuKernelSetAttribute(attribute, shared_bytes, function.handle, function.device.id)
    if status != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cannot give kernel {kernel.__name__} {shared_bytes} bytes of dynamic shared memory "
                           f"(this GPU allows less): {status}")
    _shared_limits[compiled] = shared_bytes


def blocks_for(n: int, threads: int) -> int:
    """Blocks of `threads` threads that cover n items (at least one, so empty inputs still launch)."""
    return max(1, math.ceil(n / threads))


# ---------------------------------------------------------------- allocation

class Arena:
    """Output buffers in call order, so a captured CUDA graph replays on the same memory.

    While recording, memory is recycled: when an array handed out dies (the code dropped its last
    reference, as the backward does with each layer's temporaries), its memory goes to a free
    list and the next request of the same size gets it. Kernels run in stream order, so reusing
    memory that a queued kernel still reads is safe. The recording is the list of (memory, shape,
    dtype) in request order, which replaying hands back; the graph thus needs little more memory
    than the eager step at its peak, instead of one buffer per temporary.
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
        if self._mode == "eager" or SIMULATOR:
            buf = cuda.device_array(shape, dtype)
            if self._mode == "record":
                self._recorded.append((buf, shape, dtype))
            elif self._mode == "replay":
                raise RuntimeError("graphs are not captured under the CUDA simulator")
            return buf
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


def copy(dst, src) -> None:
    """dst <- src for contiguous device arrays of one size, on the current stream (capturable),
    overlapping the kernel ahead; between float32 and bf16 storage the values are converted."""
    kernel, per_block = (_copy, 256) if dst.dtype == src.dtype else (_cast, 256 * CAST_ELEMENTS)
    launch(kernel, blocks_for(dst.size, per_block), 256, dst.reshape(dst.size), src.reshape(src.size), overlap=True)


def host_visible(shape, dtype):
    """(device, host) views of one page-locked host array of zeros, mapped into the GPU's address
    space: a kernel writes `device`, the host reads `host` once that kernel has run."""
    host = cuda.mapped_array(shape, dtype)
    host[...] = 0
    return _view(host.gpu_data, host.shape, host.dtype), host


def to_host(arr) -> np.ndarray:
    """A device array's contents in a new host array, once the work queued before it has run. A
    C-contiguous array is copied by one driver call: a decoding step reads two small arrays back,
    and Numba's copy_to_host spends tens of microseconds of host time on each."""
    if SIMULATOR or not arr.flags["C_CONTIGUOUS"] or arr.size == 0:
        return arr.copy_to_host()
    from cuda.bindings import driver as cu

    host = np.empty(arr.shape, arr.dtype)
    (err,) = cu.cuMemcpyDtoH(host.ctypes.data, arr.device_ctypes_pointer.value, host.nbytes)
    _check(err, f"copying {host.nbytes} bytes from the GPU")
    return host


_pinned: dict[int, list[np.ndarray]] = {}   # bytes -> page-locked host buffers no read-back is using
_events: list = []                          # CUDA events no read-back is using


def read_back(arrays) -> Callable[[], list[np.ndarray]]:
    """Queue copies of C-contiguous, non-empty device arrays into page-locked host buffers on the
    default stream, behind the work queued there (a graph replayed on it), and return what waits
    for them and gives their contents in new host arrays. The host is free meanwhile: it can queue
    the next decoding step before this one's results come back. Two read-backs in flight at once
    must not share a buffer, so each takes its buffers and event from pools and gives them back
    once its result is taken."""
    from cuda.bindings import driver as cu

    buffers = []
    for arr in arrays:
        free = _pinned.get(arr.nbytes)
        buffer = free.pop() if free else cuda.pinned_array(arr.nbytes, np.uint8)
        buffers.append(buffer)
        # stream 0: the legacy default stream, where kernels launch and captured graphs replay
        (err,) = cu.cuMemcpyDtoHAsync(buffer.ctypes.data, arr.device_ctypes_pointer.value, arr.nbytes, 0)
        _check(err, f"queueing a copy of {arr.nbytes} bytes from the GPU")
    if _events:
        event = _events.pop()
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
                _pinned.setdefault(buffer.nbytes, []).append(buffer)
            _events.append(event)
        return taken[0]

    return result


def _check(err, what: str) -> None:
    """A driver call's result: RuntimeError, one line, unless it succeeded."""
    from cuda.bindings import driver as cu

    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err.name}")


# ---------------------------------------------------------------- bfloat16 storage
# NumPy has no bfloat16: a bf16 tensor is stored as its 16-bit patterns (uint16), the upper half of
# the float32 with the same sign, exponent and leading 7 mantissa bits. Kernels are written once
# for both storages: `to_f32(x[i])` reads a stored value as float32 and `y[i] = stored(y, v)`
# rounds a float32 to y's storage (round to nearest even for bf16), so fp32 and bf16 arrays
# compile to their own specialisations of the same kernel.

BF16 = np.dtype(np.uint16)


if SIMULATOR:
    def to_f32(x):
        """A stored value (float32, or bf16 bits) as float32."""
        return bf16_values(np.array([x]))[0] if isinstance(x, np.uint16) else np.float32(x)

    def stored(like, v):
        """The float32 v rounded to the storage of the array `like`."""
        return bf16_bits(np.array([v], np.float32))[0] if like.dtype == BF16 else v

    def pack_bf16x2(lo, hi):
        """Two float32 -> one uint32 holding their bf16 patterns, lo in the low half."""
        bits = bf16_bits(np.array([lo, hi], np.float32)).astype(np.uint32)
        return np.uint32(bits[0] | (bits[1] << np.uint32(16)))

    def bf16x2_values(pair):
        """One uint32 of two bf16 patterns -> (low, high) as float32."""
        low, high = bf16_values(np.array([pair & 0xFFFF, pair >> 16]))
        return low, high
else:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic, overload

    @intrinsic
    def float_from_bits(typingctx, bits):
        # uint32 bit pattern -> float32 with those bits
        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.FloatType())
        return types.float32(types.uint32), codegen

    @intrinsic
    def pack_bf16x2(typingctx, lo, hi):
        """Two float32 -> one uint32 holding their bf16 patterns, lo in the low half (one cvt)."""
        def codegen(context, builder, sig, args):
            i32, f32 = ir.IntType(32), ir.FloatType()
            asm = ir.InlineAsm(ir.FunctionType(i32, [f32, f32]), "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f")
            return builder.call(asm, [args[1], args[0]])   # cvt puts its first source in the high half
        return types.uint32(types.float32, types.float32), codegen

    @cuda.jit(device=True, inline=True)
    def _bf16_to_f32(x):
        return float_from_bits(uint32(x) << uint32(16))

    @cuda.jit(device=True, inline=True)
    def _f32_to_bf16(v):
        return uint16(pack_bf16x2(v, float32(0.0)) & uint32(0xFFFF))

    @cuda.jit(device=True, inline=True)
    def bf16x2_values(pair):
        """One uint32 of two bf16 patterns -> (low, high) as float32."""
        return float_from_bits(pair << uint32(16)), float_from_bits(pair & uint32(0xFFFF0000))

    def to_f32(x):
        """A stored value (float32, or bf16 bits) as float32."""

    def stored(like, v):
        """The float32 v rounded to the storage of the array `like`."""

    @overload(to_f32, inline="always")
    def _to_f32(x):
        if x == types.uint16:
            return lambda x: _bf16_to_f32(x)
        return lambda x: float32(x)

    @overload(stored, inline="always")
    def _stored(like, v):
        if like.dtype == types.uint16:
            return lambda like, v: _f32_to_bf16(float32(v))
        return lambda like, v: float32(v)


# ---------------------------------------------------------------- element pairs
# A kernel may read and write two neighbouring elements in one access: `pairs(arr)` views a float32
# or bf16 array as words of two elements each (uint32: two bf16 patterns; uint64: two float32), the
# first element in the low half. `pair_values(a[i])` reads word i as two float32 and
# `a[i] = stored_pair(a, lo, hi)` rounds two float32 to a's storage (bf16: one cvt for both).


def pairs(arr):
    """A contiguous float32 or bf16 array of even size as one flat run of words, each two
    neighbouring elements (uint32 for bf16 storage, uint64 for float32)."""
    return arr.reshape(arr.size).view(np.uint32 if arr.dtype == BF16 else np.uint64)


if SIMULATOR:
    def pair_values(word):
        """A word of `pairs` -> its (first, second) element as float32."""
        if word.dtype == np.uint32:
            return bf16x2_values(word)
        first, second = np.array([word], np.uint64).view(np.float32)
        return first, second

    def stored_pair(like, lo, hi):
        """Two float32 -> the word of `pairs` array `like` holding them in its storage."""
        if like.dtype == np.uint32:
            return pack_bf16x2(lo, hi)
        return np.array([lo, hi], np.float32).view(np.uint64)[0]
else:
    @intrinsic
    def _bits_from_float(typingctx, value):
        # float32 -> uint32 with the same bits
        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.IntType(32))
        return types.uint32(types.float32), codegen

    def pair_values(word):
        """A word of `pairs` -> its (first, second) element as float32."""

    def stored_pair(like, lo, hi):
        """Two float32 -> the word of `pairs` array `like` holding them in its storage."""

    @overload(pair_values, inline="always")
    def _pair_values(word):
        if word == types.uint32:
            return lambda word: bf16x2_values(word)
        return lambda word: (float_from_bits(uint32(word & uint64(0xFFFFFFFF))),
                             float_from_bits(uint32(word >> uint64(32))))

    @overload(stored_pair, inline="always")
    def _stored_pair(like, lo, hi):
        if like.dtype == types.uint32:
            return lambda like, lo, hi: pack_bf16x2(float32(lo), float32(hi))
        return lambda like, lo, hi: (uint64(_bits_from_float(float32(lo)))
                                     | (uint64(_bits_from_float(float32(hi))) << uint64(32)))


def compute_capability() -> tuple[int, int]:
    return tuple(cuda.get_current_device().compute_capability)


def warpgroup_mma() -> bool:
    """Whether kernels may use the warpgroup products (wgmma_*, below): Hopper (compute capability
    9.0, whose code Numba builds for sm_90a), or the simulator, which runs their twins."""
    return SIMULATOR or compute_capability() == (9, 0)


# ---------------------------------------------------------------- overlapping kernels
# Programmatic dependent launch (compute capability 9.0 and later). A kernel launched with
# `launch(..., overlap=True)` may be scheduled while the kernel ahead of it on the stream still
# runs, once every block of that one has called let_next_start() (or ended). It may read what no
# kernel in flight writes (the weights) at once; wait_for_previous() then blocks until the kernels
# ahead of it have ended and their writes are visible, and only after it may it read their outputs
# or write anything. A decoding step is a chain of small kernels each waiting on the last: each
# asks for its weights to come into L2 (prefetch_l2, which holds no registers) before it waits, so
# they come while the kernel ahead of it runs. Where kernels do not overlap (older GPUs, the
# simulator) both calls compile to nothing.

if SIMULATOR:
    def wait_for_previous():
        pass

    def let_next_start():
        pass

    def prefetch_l2(arr, i):
        pass
else:
    @intrinsic
    def prefetch_l2(typingctx, arr, i):
        """Ask for the 128-byte line holding element i of the contiguous array arr (counted from its
        first element) to be brought into L2, holding no register while it comes."""
        sig = types.void(arr, types.int64)

        def codegen(context, builder, sig, args):
            address = builder.ptrtoint(builder.gep(_data(context, builder, sig.args[0], args[0]), [args[1]]),
                                       ir.IntType(64))
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ir.IntType(64)]),
                               "{ .reg .u64 g; cvta.to.global.u64 g, $0; prefetch.global.L2 [g]; }", "l",
                               side_effect=True)
            builder.call(asm, [address])
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def load_16_bytes(typingctx, arr, i):
        """The 16 bytes from element i of the contiguous array arr on (its data 16-byte aligned
        there) as four uint32, in one load through the read-only path: only for what no kernel
        in flight writes."""
        sig = types.UniTuple(types.uint32, 4)(arr, types.int64)

        def codegen(context, builder, sig, args):
            i32, i64 = ir.IntType(32), ir.IntType(64)
            address = builder.ptrtoint(builder.gep(_data(context, builder, sig.args[0], args[0]), [args[1]]), i64)
            asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([i32] * 4), [i64]),
                               "{ .reg .u64 g; cvta.to.global.u64 g, $4; ld.global.nc.v4.b32 {$0,$1,$2,$3}, [g]; }",
                               "=r,=r,=r,=r,l,~{memory}", side_effect=True)
            words = builder.call(asm, [address])
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(words, k) for k in range(4)])
        return sig, codegen

    def _grid_dependency_control(instruction):
        @intrinsic
        def control(typingctx):
            def codegen(context, builder, sig, args):
                if overlaps():
                    asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), instruction, "~{memory}", side_effect=True)
                    builder.call(asm, [])
                return context.get_dummy_value()
            return types.void(), codegen
        return control

    wait_for_previous = _grid_dependency_control("griddepcontrol.wait;")
    let_next_start = _grid_dependency_control("griddepcontrol.launch_dependents;")


# ---------------------------------------------------------------- reductions
# Every thread of the block must call these (they synchronise the block under the simulator, and
# block_reduce always does): threads with nothing to add pass 0 (or -inf for a max).
# On a GPU the lanes of a warp exchange values by xor shuffles. The simulator has no shuffles: there
# every exchange (the mma_bf16 twin's too) goes through `simulated_lanes`, and a reduction combines
# the lanes' values in lane order.

if SIMULATOR:
    LANE_SLOTS = 8   # values one thread can exchange at once

    @cuda.jit(device=True)
    def simulated_lanes(x, width):
        """The values of x (a value, or a tuple or array of up to LANE_SLOTS values) held by the
        lanes of this thread's group of `width` neighbouring lanes (the warp, or a quad, ...), in
        lane order: shape (lanes,) + shape of x, in x's dtype, lanes = width unless the block ends
        sooner. Simulator only."""
        slots = cuda.shared.array((1024, LANE_SLOTS), float64)
        values = np.asarray(x)
        n_threads = cuda.blockDim.x * cuda.blockDim.y * cuda.blockDim.z
        tid = cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)
        cuda.syncthreads()   # every lane has read the previous exchange
        slots[tid, :values.size] = values.reshape(values.size)
        cuda.syncthreads()
        first = tid - tid % width
        lanes = slots[first:min(first + width, n_threads), :values.size]
        return lanes.astype(values.dtype).reshape((lanes.shape[0],) + values.shape)

    def simulated_reduce(x, width, take_max):
        """Sum (or max, with take_max) of x over this thread's group of `width` neighbouring lanes,
        added in lane order; for an array x, of each of its values. Simulator only."""
        lanes = simulated_lanes(x, width)
        total = lanes[0]
        for value in lanes[1:]:
            total = np.maximum(total, value) if take_max else total + value
        return total

    def warp_sum(x):
        """Sum of x over the 32 lanes of the warp, returned to every lane."""
        return simulated_reduce(x, WARP, False)

    def warp_max(x):
        """Max of x over the 32 lanes of the warp, returned to every lane."""
        return simulated_reduce(x, WARP, True)

    def warp_ballot(predicate):
        """A mask with bit `lane` set where that lane's predicate holds, returned to every lane."""
        lanes = simulated_lanes(bool(predicate), WARP)
        return np.uint32(sum(1 << lane for lane in range(lanes.shape[0]) if lanes[lane]))

    def quad_sum(x):
        """Sum of x over the 4 lanes 4g .. 4g+3 of the warp (one row of an mma tile)."""
        return simulated_reduce(x, 4, False)

    def quad_max(x):
        """Max of x over the 4 lanes 4g .. 4g+3 of the warp (one row of an mma tile)."""
        return simulated_reduce(x, 4, True)
else:
    @cuda.jit(device=True, inline=True)
    def warp_sum(x):
        """Sum of x over the 32 lanes of the warp, returned to every lane."""
        offset = WARP // 2
        while offset > 0:
            x += cuda.shfl_xor_sync(FULL_MASK, x, offset)
            offset //= 2
        return x

    @cuda.jit(device=True, inline=True)
    def warp_max(x):
        """Max of x over the 32 lanes of the warp, returned to every lane."""
        offset = WARP // 2
        while offset > 0:
            x = max(x, cuda.shfl_xor_sync(FULL_MASK, x, offset))
            offset //= 2
        return x

    @cuda.jit(device=True, inline=True)
    def warp_ballot(predicate):
        """A mask with bit `lane` set where that lane's predicate holds, returned to every lane."""
        return cuda.ballot_sync(FULL_MASK, predicate)

    @cuda.jit(device=True, inline=True)
    def quad_sum(x):
        """Sum of x over the 4 lanes 4g .. 4g+3 of the warp (one row of an mma tile)."""
        x += cuda.shfl_xor_sync(FULL_MASK, x, 1)
        return x + cuda.shfl_xor_sync(FULL_MASK, x, 2)

    @cuda.jit(device=True, inline=True)
    def quad_max(x):
        """Max of x over the 4 lanes 4g .. 4g+3 of the warp (one row of an mma tile)."""
        x = max(x, cuda.shfl_xor_sync(FULL_MASK, x, 1))
        return max(x, cuda.shfl_xor_sync(FULL_MASK, x, 2))


# The caller owns block_reduce's shared memory: a shared array declared inside a device function
# that a kernel reaches through two paths is defined twice when the kernel links (NVVM: "symbol
# multiply defined"), so each kernel declares `scratch = cuda.shared.array(32, float64)` once and
# passes it down.

@cuda.jit(device=True)
def block_reduce(x, take_max, scratch):
    """Sum (or max, with take_max) of x over the whole (1-D) block in float64, returned to every
    thread: each warp reduces its lanes, then the warps' results (in scratch, a shared float64
    array of 32) are reduced by the same fixed tree, so the result depends only on the values and
    where they sit in the block."""
    lane = cuda.threadIdx.x % WARP
    warp = cuda.threadIdx.x // WARP
    x = warp_max(float64(x)) if take_max else warp_sum(float64(x))
    if lane == 0:
        scratch[warp] = x
    cuda.syncthreads()
    if lane < (cuda.blockDim.x + WARP - 1) // WARP:
        x = scratch[lane]
    else:
        x = float64(-math.inf) if take_max else float64(0.0)
    x = warp_max(x) if take_max else warp_sum(x)
    cuda.syncthreads()   # scratch may be reused by the next call
    return x


# ---------------------------------------------------------------- tensor cores
# mma.sync.m16n8k16: one warp computes D = A B + C for A (16 x 16) and B (16 x 8) in bf16 and C, D
# (16 x 8) in float32. Fragment layout (PTX ISA, "Matrix Fragments for mma.m16n8k16"), lane = 4 g + t,
# each register of A and B holding two bf16 (the lower index in the low half):
#   A: a0 = A[g, 2t:2t+2]   a1 = A[g+8, 2t:2t+2]   a2 = A[g, 2t+8:2t+10]   a3 = A[g+8, 2t+8:2t+10]
#   B: b0 = B[2t:2t+2, g]   b1 = B[2t+8:2t+10, g]
#   C, D: c0, c1 = C[g, 2t:2t+2]   c2, c3 = C[g+8, 2t:2t+2]
# The simulator cannot run PTX: its twin gathers the warp's fragments (simulated_lanes) and computes
# the same tile, in the same layout. Lanes 4g .. 4g+3 hold one row pair of C: quad_max and quad_sum
# reduce over them (xor shuffles by 1 and 2).

if SIMULATOR:
    # Where each element of A (16 x 16) and B (16 x 8) sits in the warp: lane and register (a0..a3 are
    # registers 0..3, b0 and b1 are 4 and 5) of the pair holding it, and which half of the pair
    _A_LANE = np.array([[4 * (r % 8) + (k % 8) // 2 for k in range(16)] for r in range(16)])
    _A_REG = np.array([[(r >= 8) + 2 * (k >= 8) for k in range(16)] for r in range(16)])
    _B_LANE = np.array([[4 * n + (k % 8) // 2 for n in range(8)] for k in range(16)])
    _B_REG = np.array([[4 + (k >= 8) for n in range(8)] for k in range(16)])
    _A_HALF, _B_HALF = np.arange(16)[None, :] % 2, np.arange(16)[:, None] % 2

    @cuda.jit(device=True)
    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        words = simulated_lanes((a0, a1, a2, a3, b0, b1), WARP).astype(np.uint32)   # (32 lanes, 6 registers)
        halves = np.stack([bf16_values(words & np.uint32(0xFFFF)), bf16_values(words >> np.uint32(16))])
        a = halves[_A_HALF, _A_LANE, _A_REG].astype(np.float64)
        b = halves[_B_HALF, _B_LANE, _B_REG].astype(np.float64)
        lane = cuda.threadIdx.x % WARP
        g, t = lane // 4, lane % 4
        d = a[[g, g, g + 8, g + 8]] @ b[:, [2 * t, 2 * t + 1, 2 * t, 2 * t + 1]]
        return (np.float32(c0 + d[0, 0]), np.float32(c1 + d[1, 1]), np.float32(c2 + d[2, 2]), np.float32(c3 + d[3, 3]))
else:
    @intrinsic
    def mma_bf16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """D = A B + C on the tensor cores (layout above); returns (d0, d1, d2, d3)."""
        sig = types.UniTuple(types.float32, 4)(*([types.uint32] * 6 + [types.float32] * 4))

        def codegen(context, builder, sig, args):
            f32, i32 = ir.FloatType(), ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4),
                               "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                               "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
                               "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
            result = builder.call(asm, args)
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(result, i) for i in range(4)])
        return sig, codegen


# ---------------------------------------------------------------- shared-memory tiles
# Tiles move from global to shared memory by cp.async (16 bytes a thread, no registers on the way)
# and from shared memory to mma fragments by ldmatrix. Both address word i (a uint32 index) of the
# shared uint32 array `sh`, given also `base = shared_base(sh)`: the GPU computes the address as
# base + 4 i in 32 bits, so a constant offset in i folds into the instruction.
#   cp_async_16(sh, base, i, src, j, valid): sh[i:i+4] <- src[j:j+4] (zeros where not valid), in
#       flight until cp_async_wait_all(); i and j multiples of 4 words (16-byte aligned).
#   ldmatrix_x4(sh, base, i): four 8 x 8 bf16 matrices; lanes 8m .. 8m+7 give, as i, the first words
#       of matrix m's rows 0..7 (four words each, 16-byte aligned). Returns register m = matrix m's
#       word t of row g (lane = 4g + t): the B fragment layout of mma_bf16 for a matrix stored
#       n-major (rows = n, words = k pairs).
#   ldmatrix_x4_trans(sh, base, i): the same matrices transposed: register m = the bf16 of matrix m's
#       rows 2t and 2t+1 at column g (low half: row 2t): the B fragment of a matrix stored k-major.
# The simulator twins gather the warp's row addresses (simulated_lanes) and read the same words.

if SIMULATOR:
    def shared_base(sh):
        return np.uint32(0)

    def cp_async_16(sh, base, i, src, j, valid):
        for w in range(4):
            sh[i + w] = src[j + w] if valid else 0

    def cp_async_wait_all():
        pass

    @cuda.jit(device=True)
    def _matrix_rows(i):
        # the row addresses the warp's lanes give, and this lane's g and t
        rows = simulated_lanes(np.uint64(i), WARP).astype(np.uint64)
        lane = cuda.threadIdx.x % WARP
        return rows, lane // 4, lane % 4

    @cuda.jit(device=True)
    def ldmatrix_x4(sh, base, i):
        rows, g, t = _matrix_rows(i)
        return tuple(np.uint32(sh[rows[8 * m + g] + np.uint64(t)]) for m in range(4))

    @cuda.jit(device=True)
    def ldmatrix_x4_trans(sh, base, i):
        rows, g, t = _matrix_rows(i)
        word, shift = np.uint64(g // 2), np.uint32(16 * (g % 2))
        out = []
        for m in range(4):
            lo = (np.uint32(sh[rows[8 * m + 2 * t] + word]) >> shift) & np.uint32(0xFFFF)
            hi = (np.uint32(sh[rows[8 * m + 2 * t + 1] + word]) >> shift) & np.uint32(0xFFFF)
            out.append(np.uint32(lo | (hi << np.uint32(16))))
        return tuple(out)
else:
    def _data(context, builder, array_type, array):
        return context.make_array(array_type)(context, builder, array).data

    def _shared_word(builder, base, i):
        # the 32-bit shared address of word i: base + 4 i
        return builder.add(base, builder.shl(i, ir.Constant(ir.IntType(32), 2)))

    @intrinsic
    def shared_base(typingctx, sh):
        """The 32-bit shared-window address of sh[0]."""
        def codegen(context, builder, sig, args):
            data = _data(context, builder, sig.args[0], args[0])
            shared = builder.addrspacecast(data, ir.PointerType(data.type.pointee, 3))
            return builder.ptrtoint(shared, ir.IntType(32))
        return types.uint32(sh), codegen

    @intrinsic
    def cp_async_16(typingctx, sh, base, i, src, j, valid):
        sig = types.void(sh, types.uint32, types.uint32, src, types.uint64, types.boolean)

        def codegen(context, builder, sig, args):
            i32, i64 = ir.IntType(32), ir.IntType(64)
            dst = _shared_word(builder, args[1], args[2])
            source = builder.ptrtoint(builder.gep(_data(context, builder, sig.args[3], args[3]), [args[4]]), i64)
            size = builder.select(args[5], i32(16), i32(0))   # a source size of 0 fills zeros
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [i32, i64, i32]),
                               "{ .reg .u64 g; cvta.to.global.u64 g, $1; cp.async.cg.shared.global [$0], [g], 16, $2; }",
                               "r,l,r,~{memory}", side_effect=True)
            builder.call(asm, [dst, source, size])
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def cp_async_wait_all(typingctx):
        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "cp.async.wait_all;", "~{memory}",
                               side_effect=True)
            builder.call(asm, [])
            return context.get_dummy_value()
        return types.void(), codegen

    def _ldmatrix(trans):
        @intrinsic
        def load(typingctx, sh, base, i):
            sig = types.UniTuple(types.uint32, 4)(sh, types.uint32, types.uint32)

            def codegen(context, builder, sig, args):
                i32 = ir.IntType(32)
                asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32]),
                                   f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16"
                                   " {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,r,~{memory}", side_effect=True)
                result = builder.call(asm, [_shared_word(builder, args[1], args[2])])
                return context.make_tuple(builder, sig.return_type, [builder.extract_value(result, m) for m in range(4)])
            return sig, codegen
        return load

    ldmatrix_x4 = _ldmatrix(False)
    ldmatrix_x4_trans = _ldmatrix(True)


# ---------------------------------------------------------------- warpgroup tensor cores (Hopper)
# wgmma.mma_async m64n64k16 (sm_90a): the block's four warps (a warpgroup) compute D (64 x 64, float32)
# = A (64 x 16) B (16 x 64) + D in bf16, B and optionally A read by the tensor cores from shared memory.
#   wgmma_ss(acc, sh, desc_a, desc_b, accumulate): A and B both from shared memory, each stored with
#       its k contiguous (A row by row, B column by column: a tile of keys row by row is B for Q K^T).
#   wgmma_rs_t(acc, a0, a1, a2, a3, sh, desc_b, accumulate): A from registers, as mma_bf16's A
#       fragments of the warp's 16 rows; B from shared memory with its n contiguous (a tile of values
#       row by row is B for P V).
# acc is a (8, 4) float32 register tile of the warp's 16 rows in mma_bf16's C layout, n-tile by
# n-tile: acc[j] = mma_bf16's c0..c3 for columns 8j .. 8j+7; without `accumulate` the old acc is
# ignored. Warp w of the group owns rows 16w .. 16w+15. A descriptor (smem_descriptor) names a tile
# in the 128-byte swizzle: rows of 128 bytes (64 bf16) in groups of 8 rows (1024 bytes, the group
# 1024-byte aligned), the 16-byte chunk c of row r stored at chunk c ^ (r % 8). Adding 2 to a
# descriptor moves it 32 bytes (the next k-step within a row), 64 moves it 8 rows.
# The products run asynchronously: wgmma_fence(acc, frag) before the first product that touches
# registers written since (the accumulators, and frag, the registers given as A: acc where none are),
# wgmma_commit() after a batch, and wgmma_wait(acc) before the accumulators are read; the fence and
# the wait pass their arrays through, so the compiler cannot move reads and writes across them. Shared memory written by cp.async must be
# made visible to the tensor cores by proxy_fence() in the writing threads before the barrier.
# The simulator twins decode the descriptors and read the same elements through the same swizzle.


@cuda.jit(device=True, inline=True)
def smem_descriptor(address, group_bytes):
    """The wgmma descriptor of a tile at shared-window address `address` (bytes) in the 128-byte
    swizzle, groups of 8 rows `group_bytes` apart."""
    return (uint64(address & uint32(0x3FFFF)) >> uint64(4)) | (uint64(1) << uint64(16)) | \
        (uint64(group_bytes >> 4) << uint64(32)) | (uint64(1) << uint64(62))


if SIMULATOR:
    def _swizzled_values(sh, desc, i, j):
        # the bf16 values of elements (i, j) of the tile `desc` names: i counts 128-byte rows, j bf16 along one
        start = int(desc & 0x3FFF) << 4
        group = int((desc >> 32) & 0x3FFF) << 4
        byte = start + (i // 8) * group + (i % 8) * 128 + 2 * j
        byte = byte ^ (((byte >> 7) & 7) << 4)
        words = sh[byte >> 2].astype(np.uint32)
        return bf16_values(((words >> (16 * ((byte >> 1) & 1)).astype(np.uint32)) & 0xFFFF)).astype(np.float64)

    @cuda.jit(device=True)
    def _warpgroup_product(acc, a, b, accumulate):
        # acc <- a (the warp's 16 rows) @ b (+ acc): this lane's elements
        lane = cuda.threadIdx.x % WARP
        g, t = lane // 4, lane % 4
        cols = 8 * np.arange(8)[:, None] + 2 * t + np.arange(2)[None, :]   # (n-tile, pair)
        d = a[[g, g + 8]] @ b   # (2, 64)
        for j in range(8):
            for c in range(4):
                value = d[c // 2, cols[j, c % 2]] + (acc[j, c] if accumulate else 0.0)
                acc[j, c] = np.float32(value)

    @cuda.jit(device=True)
    def wgmma_ss(acc, sh, desc_a, desc_b, accumulate):
        warp = cuda.threadIdx.x // WARP % 4
        rows, k = np.arange(16 * warp, 16 * warp + 16)[:, None], np.arange(16)[None, :]
        a = _swizzled_values(sh, desc_a, rows, k)                                   # (16, 16)
        b = _swizzled_values(sh, desc_b, np.arange(64)[None, :], np.arange(16)[:, None])   # (k 16, n 64)
        _warpgroup_product(acc, a, b, accumulate)

    @cuda.jit(device=True)
    def wgmma_rs_t(acc, a0, a1, a2, a3, sh, desc_b, accumulate):
        words = simulated_lanes((a0, a1, a2, a3), WARP).astype(np.uint32)   # (32 lanes, 4 registers)
        halves = np.stack([bf16_values(words & np.uint32(0xFFFF)), bf16_values(words >> np.uint32(16))])
        a = halves[_A_HALF, _A_LANE, _A_REG].astype(np.float64)
        b = _swizzled_values(sh, desc_b, np.arange(16)[:, None], np.arange(64)[None, :])   # (k 16, n 64)
        _warpgroup_product(acc, a, b, accumulate)

    def wgmma_fence(acc, frag):
        pass

    def wgmma_commit():
        pass

    def wgmma_wait(acc):
        pass

    def proxy_fence():
        pass
else:
    def _tied(builder, text, operand_types, operand_constraints, operands, arrays):
        # inline PTX `text` over the elements of `arrays` ((pointer, count, type, constraint letter)
        # each), read before and stored back after: its operands are the elements' outputs ($0 on),
        # then `operands`, then the elements' inputs, each tied to its output
        tied_types, letters, pointers = [], [], []
        for pointer, count, kind, letter in arrays:
            for i in range(count):
                pointers.append(builder.gep(pointer, [ir.Constant(ir.IntType(32), i)]))
                tied_types.append(kind)
                letters.append(letter)
        constraints = ",".join([f"={c}" for c in letters] + operand_constraints + [str(i) for i in range(len(letters))])
        asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType(tied_types), operand_types + tied_types),
                           text, constraints + ",~{memory}", side_effect=True)
        result = builder.call(asm, operands + [builder.load(pointer) for pointer in pointers])
        for i, pointer in enumerate(pointers):
            builder.store(builder.extract_value(result, i), pointer)

    _ACC = 32   # accumulator registers a thread holds
    _D = "{" + ",".join(f"${i}" for i in range(_ACC)) + "}"
    _SHAPE = "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"
    _I32, _I64 = ir.IntType(32), ir.IntType(64)

    def _acc(context, builder, sig, args):
        return (_data(context, builder, sig.args[0], args[0]), _ACC, ir.FloatType(), "f")

    @intrinsic
    def wgmma_ss(typingctx, acc, sh, desc_a, desc_b, accumulate):
        sig = types.void(acc, sh, types.uint64, types.uint64, types.boolean)

        def codegen(context, builder, sig, args):
            text = "{ .reg .pred p; setp.ne.b32 p, $34, 0; " + _SHAPE + f" {_D}, $32, $33, p, 1, 1, 0, 0; }}"
            _tied(builder, text, [_I64, _I64, _I32], ["l", "l", "r"], [args[2], args[3], builder.zext(args[4], _I32)],
                  [_acc(context, builder, sig, args)])
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def wgmma_rs_t(typingctx, acc, a0, a1, a2, a3, sh, desc_b, accumulate):
        sig = types.void(acc, *([types.uint32] * 4), sh, types.uint64, types.boolean)

        def codegen(context, builder, sig, args):
            text = "{ .reg .pred p; setp.ne.b32 p, $37, 0; " + _SHAPE + f" {_D}, {{$32,$33,$34,$35}}, $36, p, 1, 1, 1; }}"
            _tied(builder, text, [_I32] * 4 + [_I64, _I32], ["r"] * 4 + ["l", "r"],
                  [*args[1:5], args[6], builder.zext(args[7], _I32)], [_acc(context, builder, sig, args)])
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def wgmma_fence(typingctx, acc, frag):
        """(frag: a (4, 4) uint32 array of A fragments the next products read, or acc again if none)"""
        def codegen(context, builder, sig, args):
            arrays = [_acc(context, builder, sig, args)]
            if sig.args[1].dtype == types.uint32:
                arrays.append((_data(context, builder, sig.args[1], args[1]), 16, _I32, "r"))
            _tied(builder, "wgmma.fence.sync.aligned;", [], [], [], arrays)
            return context.get_dummy_value()
        return types.void(acc, frag), codegen

    @intrinsic
    def wgmma_wait(typingctx, acc):
        def codegen(context, builder, sig, args):
            _tied(builder, "wgmma.wait_group.sync.aligned 0;", [], [], [], [_acc(context, builder, sig, args)])
            return context.get_dummy_value()
        return types.void(acc), codegen

    def _plain(text):
        @intrinsic
        def instruction(typingctx):
            def codegen(context, builder, sig, args):
                builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}", side_effect=True), [])
                return context.get_dummy_value()
            return types.void(), codegen
        return instruction

    wgmma_commit = _plain("wgmma.commit_group.sync.aligned;")
    proxy_fence = _plain("fence.proxy.async.shared::cta;")
