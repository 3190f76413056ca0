"""A third backend, as small as a backend can be: float32 NumPy arrays in host memory, and kernels
for three ops only (add, linear, swiglu), each a module named after its op, each the op's own
reference with its results stored in float32. tests/test_backends.py registers it to show what a
backend that lacks ops gets: listed as lacking them, skipped by the gradient checker, refused by
the model with one line."""

import numpy as np

from nanoeuler_ops import HostBackend


class MinimalBackend(HostBackend):
    name = "minimal"
    dtype = np.float32
    kernel_packages = ("minimal_backend",)


BACKEND = MinimalBackend()


def float32_kernels(op_module):
    """(forward, backward) that run an op's float64 reference and store what it returns in float32."""
    def stored(arrays):
        return tuple(a.astype(np.float32) if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a for a in arrays)

    def forward(*inputs, **attrs):
        out, saved = op_module.forward(*inputs, **attrs)
        return (stored(out) if isinstance(out, tuple) else stored((out,))[0]), stored(saved)

    def backward(dout, saved, *inputs, **attrs):
        return stored(op_module.backward(dout, saved, *inputs, **attrs))

    return forward, backward
