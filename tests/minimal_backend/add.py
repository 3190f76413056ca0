"""add on the minimal backend: the op's reference, stored in float32."""

from minimal_backend import float32_kernels
from nanoeuler_ops import add

forward, backward = float32_kernels(add)
