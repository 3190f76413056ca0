"""The op and backend registry.

An op is one `Op` object: its NumPy float64 `reference` (forward and backward, written for
clarity), `sample_inputs(rng)` that yields valid test cases and, optionally, `error_inputs(rng)`
that yields calls it must refuse (docs/ops.md has the whole contract). A backend is a `Backend` object:
the array operations the model needs (allocate, copy to and from the host), its traits (how a
process claims a device, which collectives sum gradients, memory in use, ...), and where its
kernels live. An op's kernels on a backend are found by the op's name: the module
`<kernel package>.<op name>` in one of the backend's kernel packages, imported on first use. No
op lists its backends and no backend lists its ops: a kernel module is the whole registration.

Ops, backends and kernel packages are found through entry points, so a third-party package adds
any of them by declaring, in its own pyproject.toml:

    [project.entry-points."nanoeuler.ops"]          # an op (or a list of ops)
    gelu = "my_package.gelu:OP"
    [project.entry-points."nanoeuler.backends"]     # a backend
    opencl = "my_backend:BACKEND"
    [project.entry-points."nanoeuler.kernels"]      # more kernels for a backend: my_package/cpu/<op>.py
    cpu = "my_package.cpu"

A backend's own packages come first, then the contributed ones in load order, so a plugin fills
in ops a backend lacks but never replaces a built-in kernel.

Calling conventions, the same on every backend (arrays are the backend's own arrays):

    out, saved = impl.forward(*inputs, **attrs)
    grads = impl.backward(dout, saved, *inputs, **attrs)   # one entry per input, None if not differentiable
    grads = impl.backward(dout, saved, *inputs, into=(None, dw), **attrs)

`saved` is whatever the backward needs beyond the inputs (a tuple of arrays); the model keeps
it in its activation cache. An op with several outputs returns them as a tuple, and its backward
takes a tuple of their gradients as `dout`. An op with `inplace` inputs (the optimizer) updates
them and has no backward. `into`, for the inputs an op lists in `accumulates`, gives arrays the
backward adds the gradient to (`+=`, as llm.c accumulates into its gradient buffer) and returns;
a None entry asks for a new array as usual.

Precision is a dimension of the registry, not a fork of the kernels: a `Precision` object (FP32,
TF32, BF16) says how values are stored and how matrix products run. An op lists, per backend, the
precisions it runs besides fp32. A kernel sees the precision in its inputs' storage (bf16 arrays)
and, where that does not say it all (float32 products, exact or on TF32 tensor cores), in a keyword
`precision` its forward and backward declare: the registry passes it to the implementation asked
for in a precision (`Op.impl(backend, precision)`, `kernels_on(backend, names, precision)`). In bf16 an op's float inputs and the gradients it returns for them are
bf16, except the gradients of parameters (weights, tables, norm scales), which stay float32, and
outputs that are reductions (losses, norms, log-sum-exps), which are float32. The gradient checker
compares each precision against the float32 backends with that precision's tolerance.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

OPS_GROUP = "nanoeuler.ops"
BACKENDS_GROUP = "nanoeuler.backends"
KERNELS_GROUP = "nanoeuler.kernels"


@dataclass(frozen=True)
class Impl:
    """One backend's implementation of an op."""

    forward: Callable[..., tuple[Any, tuple]]
    backward: Callable[..., tuple] | None = None

    def in_precision(self, precision: "Precision") -> "Impl":
        """This implementation with `precision` given to those of its functions that take it."""
        return Impl(*(_with_precision(fn, precision) for fn in (self.forward, self.backward)))


def _with_precision(fn, precision):
    """fn with its keyword `precision` set, if it has one (the kernels that choose how to multiply)."""
    if fn is None or "precision" not in inspect.signature(fn).parameters:
        return fn
    return functools.partial(fn, precision=precision)


@dataclass(frozen=True)
class Tol:
    """Agreement bound between two backends: |a - b| <= atol + rtol * |b|."""

    rtol: float = 1e-4
    atol: float = 1e-5


@dataclass(frozen=True, eq=False)
class Precision:
    """How a backend computes. `storage`: how activations and the weights' compute copy are stored
    ("fp32", or "bf16": bfloat16 with float32 accumulation, products on bf16 tensor cores);
    `tf32`: whether float32 matrix products may round their operands to TF32 (tensor cores).
    `tol` bounds a result against float32's, unless an op states its own. A precision equals its
    name (`model.precision == "bf16"`), which is how configs and the command line spell it."""

    name: str
    storage: str
    tf32: bool
    tol: Tol

    def __str__(self) -> str:
        return self.name

    def __eq__(self, other) -> bool:
        return self.name == (other.name if isinstance(other, Precision) else other)

    def __hash__(self) -> int:
        return hash(self.name)


FP32 = Precision("fp32", storage="fp32", tf32=False, tol=Tol())
# TF32 keeps 10 mantissa bits of each product operand, bf16 keeps 7 of every stored value.
TF32 = Precision("tf32", storage="fp32", tf32=True, tol=Tol(rtol=5e-3, atol=5e-3))
BF16 = Precision("bf16", storage="bf16", tf32=False, tol=Tol(rtol=3e-2, atol=3e-2))
PRECISIONS = {p.name: p for p in (FP32, TF32, BF16)}


def precision(name: "str | Precision") -> Precision:
    """The Precision called `name` (a Precision passes through); ValueError for an unknown name."""
    if isinstance(name, Precision):
        return name
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision '{name}' (choose from: {', '.join(PRECISIONS)})")
    return PRECISIONS[name]


@dataclass
class Sample:
    """One valid call of an op: positional array inputs and keyword attributes.

    `grad_inputs` lists the positions of the inputs that receive a gradient (float inputs);
    integer inputs such as token ids are never differentiated. `precisions` limits the
    precisions the sample is checked in (a slow simulated kernel needs only a few cases).
    `float32_inputs` are float inputs stored as they are in every precision, never in bf16 (a
    quantized matrix's float16 scales and offsets). `tol`, where given, is the least bound
    the sample is checked with in every precision (a product that rounds its activations to 8 bits
    may round a value the other way than the float64 reference, by one step of its block).
    """

    inputs: tuple
    attrs: dict = field(default_factory=dict)
    grad_inputs: tuple[int, ...] = ()
    name: str = ""
    precisions: tuple[str, ...] = tuple(PRECISIONS)
    float32_inputs: tuple[int, ...] = ()
    tol: Tol | None = None


@dataclass
class ErrorInput:
    """A call an op must refuse (as PyTorch's OpInfo ErrorInput): `sample` raises `error` on every
    backend that has the op, with a message `match` (a regular expression) finds. `host_values`:
    the refusal reads values of arrays a device backend keeps on the device, where its caller
    checks them (a decoding step's sampling settings): only backends with host arrays refuse it."""

    sample: Sample
    error: type = ValueError
    match: str = ""
    host_values: bool = False


def bf16_bits(host: np.ndarray) -> np.ndarray:
    """Float values -> bfloat16 bit patterns (uint16: the upper half of the float32), rounded to
    nearest even; NaN stays NaN. NumPy has no bfloat16: backends store bf16 tensors this way."""
    host = np.asarray(host, dtype=np.float32)
    bits = np.ascontiguousarray(host).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    return np.where(np.isnan(host), np.uint16(0x7FC0), rounded)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 values."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


class Backend:
    """A backend: its arrays, its traits, and where its kernels live.

    Subclasses set `name`, `dtype` and `kernel_packages` (the packages holding one module per op,
    named after the op) and override what their device does differently.
    """

    name: str = ""
    dtype: type = np.float32
    kernel_packages: tuple[str, ...] = ()
    install_hint: str = ""            # what it takes to make an unavailable backend usable here
    simulator: str = ""               # what runs its kernels where its device is missing (e.g. a GPU simulator)
    simulator_env: dict[str, str] = {}   # the environment that turns the simulator on, read as its libraries load
    implements: tuple[str, ...] = ("fp32",)   # the precisions it has kernels for (`precisions`: those it runs here)
    ground_truth = False              # runs the ops' own float64 references: what the others are checked against
    multi_token_step_cheap = False    # a decoding step over K tokens costs about one over 1 token
    captures = False                  # `capture` records work once and replays it for less than running it
    peer_device = "cpu"               # the PyTorch device a peer benchmark of this backend runs on

    def available(self) -> bool:
        return True

    def simulated(self) -> bool:
        """Whether this backend's kernels run on its simulator in this process (its environment set)."""
        return bool(self.simulator_env) and all(os.environ.get(k) == v for k, v in self.simulator_env.items())

    def kernel_cache_cold(self) -> bool:
        """Whether the kernels compile on first use into a cache on disk that lacks them now: a run
        then has another process compile them ahead (nanoeuler_core.cli.warm)."""
        return False

    # -------------------------------------------------------------------- kernels

    def kernels(self, op: "Op") -> Impl | None:
        """`op`'s implementation here, or None if no kernel package has a module named after it."""
        module_name = self.kernel_module(op)
        if module_name is None:
            return None
        module = importlib.import_module(module_name)
        return Impl(module.forward, getattr(module, "backward", None))

    def kernel_module(self, op: "Op") -> str | None:
        """The module that holds `op`'s kernels here: `<package>.<op name>` in the first of this
        backend's kernel packages (its own, then the contributed ones) that has one; else None."""
        for package in self.kernel_packages + tuple(REGISTRY.contributed_kernels(self.name)):
            try:
                if importlib.util.find_spec(f"{package}.{op.name}") is not None:
                    return f"{package}.{op.name}"
            except ModuleNotFoundError:   # the package itself is missing
                continue
        return None

    # -------------------------------------------------------------------- precision

    @property
    def precisions(self) -> tuple[Precision, ...]:
        """The precisions this backend can run here, fp32 first."""
        return (FP32,)

    @property
    def default_precision(self) -> Precision:
        return FP32

    def check_precision(self, name: "str | Precision") -> Precision:
        """The Precision `name` if this backend runs it here, else a ValueError saying why not."""
        p = precision(name)
        if p not in self.precisions:
            raise ValueError(f"precision {p.name} is not available on the {self.name} backend here "
                             f"(it runs: {', '.join(q.name for q in self.precisions)})")
        return p

    def computing(self):
        """A block inside which the model's kernels run: where a backend sets up its process before
        its first computation (the CPU's allocator and threads)."""
        return nullcontext()

    # -------------------------------------------------------------------- arrays

    def asarray(self, host: np.ndarray, storage: str | None = None):
        """A backend array holding a copy of the host array (floats converted to `self.dtype`, or
        stored as bfloat16 with storage="bf16")."""
        raise NotImplementedError

    def to_host(self, arr) -> np.ndarray:
        """A host copy of `arr` (bf16 storage comes back as float32 values)."""
        raise NotImplementedError

    def zeros(self, shape, dtype=None):
        """A new array of zeros (dtype "bf16" for bfloat16 storage)."""
        raise NotImplementedError

    def zero_(self, arr) -> None:
        """Set every element of `arr` to 0 (backend work: a captured step includes it)."""
        raise NotImplementedError

    def copy_(self, dst, src) -> None:
        """Copy `src` (a host array or an array of this backend, same shape) into `dst`; between two
        arrays of this backend, either may be a 2-D view whose rows are each contiguous but apart
        (a run of positions over every plane of a KV cache: KVPlanes.span)."""
        raise NotImplementedError

    def read_back(self, arrays) -> Callable[[], list[np.ndarray]]:
        """What gives the host copies of `arrays` (as `to_host` makes them) as they are once the
        work queued so far has run, without waiting for that work here: a backend that queues work
        (a GPU) copies in the background and waits only when the copies are asked for, so that the
        host can queue more work meanwhile. By default the work has run already: copied now (a
        host backend's `to_host` may give the array itself, which later work would change)."""
        copies = [np.array(self.to_host(arr)) for arr in arrays]
        return lambda: copies

    def host_visible(self, shape, dtype):
        """(device, host): one array of zeros seen two ways. Backend work (a copy into `device`, in a
        captured step too) writes it and the host reads `host` with no copy, once that work has run
        (`read_back([])` waits for it): a few results a step, brought back without a transfer of
        their own. A host backend's arrays are the host's: the same array twice."""
        arr = self.zeros(shape, dtype)
        return arr, arr

    def synchronize(self) -> None:
        pass

    def stream_handle(self) -> int:
        """The raw handle of the stream this backend's work goes to now (a graph's capture stream
        while one is captured), for libraries that launch on it (NCCL); 0 without streams."""
        return 0

    def capture(self, fn):
        """Prepare fn (no arguments, reading and writing buffers that stay put) for repeated runs.

        Returns (replay, result of a first run). A backend with graphs (CUDA) captures fn once
        and replays it; by default replay is fn itself.
        """
        return fn, fn()

    # -------------------------------------------------------------------- traits

    def claim_device(self, local_rank: int, local_size: int) -> str:
        """Take this process's share of the machine, as rank `local_rank` of the `local_size` ranks
        started on it, before any array exists; returns what identifies the device it now drives
        (two ranks of one machine must not return the same non-empty string). By default the
        ranks share the cores (Numba's threads and, where threadpoolctl is installed, the BLAS's),
        unless the user chose a thread count."""
        if local_size > 1 and not any(name in os.environ for name in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS")):
            import numba

            threads = max(1, (os.cpu_count() or 1) // local_size)
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
            try:
                from threadpoolctl import threadpool_limits
            except ImportError:
                pass
            else:
                threadpool_limits(threads, user_api="blas")
        return ""

    def collectives(self, comm):
        """The gradient communicator over the MPI communicator `comm` (mpi4py) for this backend's
        arrays (nanoeuler_core.collectives.Collectives). By default: MPI on host arrays."""
        from nanoeuler_core.collectives import MpiCollectives

        return MpiCollectives(comm)

    def memory_in_use(self) -> int | None:
        """Bytes of device memory in use by this process's device, or None for host memory."""
        return None

    def memory_limit(self) -> int | None:
        """The most bytes a plan (a decoder's KV cache) should count on before allocating, or None
        where the allocation itself says (a GPU's out-of-memory error)."""
        return int(0.8 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    def device_name(self) -> str:
        """The device, for reports (e.g. "NVIDIA H100 80GB HBM3", "16-core CPU")."""
        return f"{os.cpu_count()}-core CPU"

    def serial(self):
        """A block inside which kernels run on the calling thread alone: a decoding step is dozens
        of calls on one token's data, where waking a thread pool costs more than the work."""
        return nullcontext()

    def parallel(self):
        """Inside a `serial` block, a block whose kernels use the threads again (a prompt's prefill:
        products over the whole prompt)."""
        return nullcontext()


@dataclass
class Op:
    """A registered op: its spec (reference, samples, tolerances). Its kernels are found by name."""

    name: str
    summary: str
    reference: Impl
    sample_inputs: Callable[[np.random.Generator], Iterable[Sample]]
    error_inputs: Callable[[np.random.Generator], Iterable[ErrorInput]] | None = None   # calls to refuse
    model_inputs: Callable[..., Sample] | None = None   # (rng, cfg, rows): one call at a model's sizes
    tol: Tol = Tol()
    inplace: tuple[int, ...] = ()
    accumulates: tuple[int, ...] = ()      # inputs whose gradient backward can add into `into`
    precisions: dict[str, tuple[str, ...]] = field(default_factory=dict)   # backend -> precisions beyond fp32
    tols: dict[str, Tol] = field(default_factory=dict)    # precision -> bound, when the Precision's does not fit
    source: str = "nanoeuler"
    _loaded: dict[tuple[str, str], Impl] = field(default_factory=dict, repr=False)   # (backend, precision) ->

    @property
    def differentiable(self) -> bool:
        return self.reference.backward is not None

    def impl(self, backend: str, precision: "str | Precision" = "fp32") -> Impl:
        """The implementation on `backend` in `precision`, importing its kernels on first use;
        KeyError if the backend has none."""
        key = (backend, str(precision))
        if key not in self._loaded:
            impl = REGISTRY.backend(backend).kernels(self)
            if impl is None:
                raise KeyError(f"the {backend} backend has no kernels for op '{self.name}' "
                               f"(backends with it: {', '.join(self.backend_names())})")
            self._loaded[key] = impl.in_precision(PRECISIONS[key[1]])
        return self._loaded[key]

    def backend_names(self) -> list[str]:
        """The registered backends that have this op: the ground truth first, then in registration order."""
        return list(self.backends)

    @property
    def backends(self) -> dict[str, str]:
        """Backend name -> the module holding this op's kernels there (the ground truth first)."""
        found = {name: module for name, be in REGISTRY.backends().items() if (module := be.kernel_module(self))}
        return dict(sorted(found.items(), key=lambda item: not REGISTRY.backend(item[0]).ground_truth))

    def precisions_on(self, backend: str) -> tuple[str, ...]:
        """The precisions (names) this op runs in on `backend`, fp32 first."""
        return ("fp32", *self.precisions.get(backend, ()))

    def tol_for(self, name: str, sample: Sample | None = None) -> Tol:
        tol = self.tol if name == "fp32" else self.tols.get(name, PRECISIONS[name].tol)
        if sample is None or sample.tol is None:
            return tol
        return Tol(max(tol.rtol, sample.tol.rtol), max(tol.atol, sample.tol.atol))


def define_op(namespace: dict, summary: str, **options) -> Op:
    """The op a module defines by convention (call it with the module's `globals()`): named after
    the module, with its float64 reference `forward` (and `backward`, if it has one), its
    `sample_inputs` and, where it has them, `error_inputs` and `model_inputs`; `options` are Op's
    other fields (tol, inplace, accumulates, precisions, ...). docs/ops.md describes the contract."""
    return Op(name=namespace["__name__"].rsplit(".", 1)[-1], summary=summary,
              reference=Impl(namespace["forward"], namespace.get("backward")),
              sample_inputs=namespace["sample_inputs"], error_inputs=namespace.get("error_inputs"),
              model_inputs=namespace.get("model_inputs"), **options)


def _package(ep) -> str:
    """The distribution that declared an entry point (its module path when that is unknown)."""
    return ep.dist.name if ep.dist is not None else ep.value.split(":")[0]


def _load_order(ep) -> tuple[bool, str]:
    """nanoeuler's own entry points first, then by name: a plugin that reuses a built-in name is the
    one skipped, whatever order importlib.metadata lists the distributions in."""
    return _package(ep) != "nanoeuler", ep.name


class Registry:
    """Name -> Op and name -> Backend, and the contributed kernel packages, filled from entry points
    on first use."""

    def __init__(self) -> None:
        self._ops: dict[str, Op] = {}
        self._backends: dict[str, Backend] = {}
        self._kernels: dict[str, list[str]] = {}
        self._loaded = False

    def register_op(self, op: Op, source: str = "") -> None:
        if not isinstance(op, Op):
            raise TypeError(f"entry point must name an nanoeuler_core.registry.Op, got {type(op).__name__}")
        if op.name in self._ops:
            raise ValueError(f"op '{op.name}' is already registered by {self._ops[op.name].source}")
        op.source = source or op.source
        self._ops[op.name] = op

    def register_backend(self, backend: Backend, source: str = "") -> None:
        if not isinstance(backend, Backend):
            raise TypeError(f"entry point must name an nanoeuler_core.registry.Backend, got {type(backend).__name__}")
        if backend.name in self._backends:
            raise ValueError(f"backend '{backend.name}' is already registered")
        self._backends[backend.name] = backend

    def unregister_backend(self, name: str) -> None:
        """Forget a backend (and the kernel packages contributed to it), e.g. one a test registered."""
        self._backends.pop(name, None)
        self._kernels.pop(name, None)
        for op in self._ops.values():
            for key in [key for key in op._loaded if key[0] == name]:
                del op._loaded[key]

    def register_kernels(self, backend: str, package: str, source: str = "") -> None:
        """Search `package` for kernels of `backend` (modules named after ops), after its own."""
        self._kernels.setdefault(backend, []).append(package)

    def contributed_kernels(self, backend: str) -> list[str]:
        self._load()
        return self._kernels.get(backend, [])

    def _register_ops(self, obj, source: str) -> None:
        for op in obj if isinstance(obj, (list, tuple)) else (obj,):
            self.register_op(op, source)

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        groups = ((BACKENDS_GROUP, lambda ep, source: self.register_backend(ep.load(), source)),
                  (OPS_GROUP, lambda ep, source: self._register_ops(ep.load(), source)),
                  (KERNELS_GROUP, lambda ep, source: self.register_kernels(ep.name, ep.value, source)))
        for group, register in groups:
            for ep in sorted(importlib.metadata.entry_points(group=group), key=_load_order):
                package = _package(ep)
                try:
                    register(ep, package)
                except Exception as exc:  # a broken plugin must not take the engine down
                    warnings.warn(f"nanoeuler: skipped {group} entry point '{ep.name}' from package "
                                  f"'{package}': {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)

    def ops(self) -> dict[str, Op]:
        self._load()
        return dict(self._ops)

    def op(self, name: str) -> Op:
        self._load()
        if name not in self._ops:
            raise KeyError(f"no op named '{name}' (registered: {', '.join(sorted(self._ops))})")
        return self._ops[name]

    def backends(self) -> dict[str, Backend]:
        self._load()
        return dict(self._backends)

    def backend(self, name: str) -> Backend:
        self._load()
        if name not in self._backends:
            raise ValueError(f"unknown backend '{name}' (choose from: {', '.join(self._backends)})")
        return self._backends[name]

    @contextmanager
    def extra_backend(self, backend: Backend, kernel_packages: Iterable[str] = ()):
        """Register `backend` (and kernel packages for it) inside the block only."""
        self.register_backend(backend)
        for package in kernel_packages:
            self.register_kernels(backend.name, package)
        try:
            yield backend
        finally:
            self.unregister_backend(backend.name)


REGISTRY = Registry()
op = REGISTRY.op
ops = REGISTRY.ops
backend = REGISTRY.backend
backends = REGISTRY.backends


def usable_backend(name: str) -> Backend:
    """The registered backend `name`, if it can run here; else a ValueError saying why not."""
    be = backend(name)
    if not be.available():
        hint = f" ({be.install_hint})" if be.install_hint else ""
        raise ValueError(f"backend '{name}' is not available on this machine{hint}")
    return be


def kernels_on(backend_name: str, names: Iterable[str], precision: "str | Precision" = "fp32"):
    """name -> Impl of each op on the backend in `precision`, as attributes; ValueError naming the
    first op the backend lacks (one line, for a Model or decoder built on a backend that cannot run it)."""
    from types import SimpleNamespace

    found = {}
    for name in names:
        try:
            found[name] = op(name).impl(backend_name, precision)
        except KeyError:
            raise ValueError(f"the {backend_name} backend has no kernels for op '{name}', which the model "
                             f"needs (`nanoeuler-run ops` lists what each backend has)") from None
    return SimpleNamespace(**found)
