"""nanoeuler's built-in ops: one module per op (spec, NumPy float64 reference, registration),
with its Numba kernels under `cpu/` and `cuda/` in modules of the same name. `OPS` is every op
of this package (each module's `OP`): a new op is a new module here, and nothing else.

This package also defines the `reference` backend: plain NumPy float64 arrays, whose kernels
are the ops' own references.
"""

import importlib
import pkgutil

import numpy as np

from nanoeuler_core.registry import Backend, Impl, Op

def accumulated(grads: tuple, into) -> tuple:
    """`grads` with each entry that has an array in `into` added to that array (in place) and
    replaced by it: the `into` convention of backward (nanoeuler_core.registry) on host arrays."""
    if into is None:
        return grads
    out = []
    for grad, target in zip(grads, into):
        if target is not None and grad is not None:
            target += grad
            grad = target
        out.append(grad)
    return tuple(out)


OPS = [importlib.import_module(f"{__name__}.{m.name}").OP for m in pkgutil.iter_modules(__path__) if not m.ispkg]


class HostBackend(Backend):
    """A backend whose arrays are NumPy arrays of `dtype` in host memory."""

    def asarray(self, host, storage=None):
        host = np.asarray(host)   # float16 (quantized weights' scales) as it is
        dtype = self.dtype if host.dtype.kind == "f" and host.dtype != np.float16 else host.dtype
        return np.array(host, dtype=dtype, order="C", copy=True)

    def to_host(self, arr):
        return np.asarray(arr)

    def zeros(self, shape, dtype=None):
        return np.zeros(shape, dtype=dtype if dtype not in (None, "bf16") else self.dtype)

    def zero_(self, arr):
        arr[...] = 0

    def copy_(self, dst, src):
        dst[...] = src


class ReferenceBackend(HostBackend):
    """NumPy float64: slow, exact enough for finite differences, the ground truth."""

    name = "reference"
    dtype = np.float64
    ground_truth = True

    def kernels(self, op: Op) -> Impl:
        return op.reference

    def kernel_module(self, op: Op) -> str:
        return op.reference.forward.__module__


REFERENCE = ReferenceBackend()
