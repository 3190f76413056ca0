"""The op and backend registry.

An op is one `Op` object: its NumPy float64 `reference` (forward and backward, written for
clarity), `sample_inputs(rng)` that yields valid test cases, and the modules that implement it on
each backend (`"cpu"`, `"cuda"`, ...), imported only when first used. Backends are `Backend`
objects: the few array operations the model needs (allocate, copy to and from the host).

Both are found through entry points, the built-in ones too, so a third-party package adds an op
or a backend by declaring, in its own pyproject.toml:

    [project.entry-points."nanoeuler.ops"]
    gelu = "my_package.gelu:OP"

Calling conventions, the same on every backend (arrays are the backend's own arrays):

    out, saved = impl.forward(*inputs, **attrs)
    grads = impl.backward(dout, saved, *inputs, **attrs)   # one entry per input, None if not differentiable

`saved` is whatever the backward needs beyond the inputs (a tuple of arrays); the model keeps
it in its activation cache. An op with several outputs returns them as a tuple, and its backward
takes a tuple of their gradients as `dout`. An op with `inplace` inputs (the optimizer) updates them and has no
backward.

Precision is a dimension of the registry, not a fork of the kernels: "fp32" (exact float32),
"tf32" (float32 storage, TF32 tensor-core products) and "bf16" (bfloat16 storage, float32
accumulation). An op lists, per backend, the precisions it runs besides fp32; a kernel sees the
precision in its inputs' storage (bf16 arrays) or in the backend's matrix-product mode (tf32).
In bf16 an op's float inputs and the gradients it returns for them are bf16, except the
gradients of parameters (weights, tables, norm scales), which stay float32, and outputs that
are reductions (losses, norms, log-sum-exps), which are float32. The gradient checker compares
each precision against the float32 backends with that precision's tolerance.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

OPS_GROUP = "nanoeuler.ops"
BACKENDS_GROUP = "nanoeuler.backends"
PRECISIONS = ("fp32", "tf32", "bf16")


@dataclass(frozen=True)
class Impl:
    """One backend's implementation of an op."""

    forward: Callable[..., tuple[Any, tuple]]
    backward: Callable[..., tuple] | None = None


@dataclass
class Sample:
    """One valid call of an op: positional array inputs and keyword attributes.

    `grad_inputs` lists the positions of the inputs that receive a gradient (float inputs);
    integer inputs such as token ids are never differentiated. `precisions` limits the
    precisions the sample is checked in (a slow simulated kernel needs only a few cases).
    """

    inputs: tuple
    attrs: dict = field(default_factory=dict)
    grad_inputs: tuple[int, ...] = ()
    name: str = ""
    precisions: tuple[str, ...] = PRECISIONS


@dataclass(frozen=True)
class Tol:
    """Agreement bound between two backends: |a - b| <= atol + rtol * |b|."""

    rtol: float = 1e-4
    atol: float = 1e-5


# Bounds of a reduced precision against float32, unless an op states its own: TF32 keeps 10
# mantissa bits of each product operand, bf16 keeps 7 of every stored value.
PRECISION_TOL = {"tf32": Tol(rtol=5e-3, atol=5e-3), "bf16": Tol(rtol=3e-2, atol=3e-2)}


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
    """Array operations the model needs from a backend. Subclasses set `name` and `dtype`."""

    name: str = ""
    dtype: type = np.float32

    def available(self) -> bool:
        return True

    @property
    def precisions(self) -> tuple[str, ...]:
        """The precisions this backend can run here (see PRECISIONS), fp32 first."""
        return ("fp32",)

    @property
    def default_precision(self) -> str:
        return "fp32"

    def check_precision(self, precision: str) -> str:
        """`precision` if this backend runs it here, else a ValueError saying why not."""
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision '{precision}' (choose from: {', '.join(PRECISIONS)})")
        if precision not in self.precisions:
            raise ValueError(f"precision {precision} is not available on the {self.name} backend here "
                             f"(it runs: {', '.join(self.precisions)})")
        return precision

    @contextmanager
    def matmul_mode(self, precision: str):
        """Run matrix products inside the block in `precision`'s mode (TF32 tensor cores for "tf32")."""
        yield

    def asarray(self, host: np.ndarray, dtype=None):
        """A backend array holding a copy of the host array (floats converted to `self.dtype`, or
        to bfloat16 storage with dtype="bf16")."""
        raise NotImplementedError

    def to_host(self, arr) -> np.ndarray:
        """A host copy of `arr` (bf16 storage comes back as float32 values)."""
        raise NotImplementedError

    def zeros(self, shape, dtype=None):
        raise NotImplementedError

    def copy_(self, dst, src) -> None:
        """Copy `src` (a host array or an array of this backend, same shape) into `dst`."""
        raise NotImplementedError

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


@dataclass
class Op:
    """A registered op. `backends` maps backend name -> module path providing `forward`/`backward`."""

    name: str
    summary: str
    reference: Impl
    sample_inputs: Callable[[np.random.Generator], Iterable[Sample]]
    backends: dict[str, str] = field(default_factory=dict)
    tol: Tol = Tol()
    inplace: tuple[int, ...] = ()
    precisions: dict[str, tuple[str, ...]] = field(default_factory=dict)   # backend -> precisions beyond fp32
    tols: dict[str, Tol] = field(default_factory=dict)    # precision -> bound, when PRECISION_TOL's does not fit
    source: str = "nanoeuler"
    _loaded: dict[str, Impl] = field(default_factory=dict, repr=False)

    @property
    def differentiable(self) -> bool:
        return self.reference.backward is not None

    def impl(self, backend: str) -> Impl:
        """The implementation on `backend` ("reference" included), importing it on first use."""
        if backend == "reference":
            return self.reference
        if backend not in self._loaded:
            if backend not in self.backends:
                raise KeyError(f"op '{self.name}' has no '{backend}' implementation "
                               f"(it has: {', '.join(self.backend_names())})")
            module = importlib.import_module(self.backends[backend])
            self._loaded[backend] = Impl(module.forward, getattr(module, "backward", None))
        return self._loaded[backend]

    def backend_names(self) -> list[str]:
        return ["reference", *self.backends]

    def precisions_on(self, backend: str) -> tuple[str, ...]:
        """The precisions this op runs in on `backend`, fp32 first."""
        return ("fp32", *self.precisions.get(backend, ()))

    def tol_for(self, precision: str) -> Tol:
        return self.tol if precision == "fp32" else self.tols.get(precision, PRECISION_TOL[precision])


def _package(ep) -> str:
    """The distribution that declared an entry point (its module path when that is unknown)."""
    return ep.dist.name if ep.dist is not None else ep.value.split(":")[0]


def _load_order(ep) -> tuple[bool, str]:
    """nanoeuler's own entry points first, then by name: a plugin that reuses a built-in name is the
    one skipped, whatever order importlib.metadata lists the distributions in."""
    return _package(ep) != "nanoeuler", ep.name


class Registry:
    """Name -> Op and name -> Backend, filled from entry points on first use."""

    def __init__(self) -> None:
        self._ops: dict[str, Op] = {}
        self._backends: dict[str, Backend] = {}
        self._loaded = False

    def register_op(self, op: Op, source: str = "") -> None:
        if op.name in self._ops:
            raise ValueError(f"op '{op.name}' is already registered by {self._ops[op.name].source}")
        op.source = source or op.source
        self._ops[op.name] = op

    def register_backend(self, backend: Backend) -> None:
        if backend.name in self._backends:
            raise ValueError(f"backend '{backend.name}' is already registered")
        self._backends[backend.name] = backend

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for group, register in ((BACKENDS_GROUP, self.register_backend), (OPS_GROUP, self._register_entry_op)):
            for ep in sorted(importlib.metadata.entry_points(group=group), key=_load_order):
                package = _package(ep)
                try:
                    obj = ep.load()
                    register(obj) if group == BACKENDS_GROUP else register(obj, package)
                except Exception as exc:  # a broken plugin must not take the engine down
                    warnings.warn(f"nanoeuler: skipped {group} entry point '{ep.name}' from package "
                                  f"'{package}': {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)

    def _register_entry_op(self, op: Op, package: str) -> None:
        if not isinstance(op, Op):
            raise TypeError(f"entry point must name an nanoeuler_core.registry.Op, got {type(op).__name__}")
        self.register_op(op, package)

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


REGISTRY = Registry()
op = REGISTRY.op
ops = REGISTRY.ops
backend = REGISTRY.backend
backends = REGISTRY.backends
