"""rmsnorm for the minimal backend, from another package: the op's reference, stored in float32."""

from minimal_backend import float32_kernels
from nanoeuler_ops import rmsnorm

forward, backward = float32_kernels(rmsnorm)
