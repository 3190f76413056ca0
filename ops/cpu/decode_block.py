"""One decoding block on the CPU: the decoding ops' CPU kernels one after another. See
nanoeuler_ops/decode_block.py for the math."""

from nanoeuler_ops.cpu import decode_attention, linear_residual, norm_linear, norm_swiglu
from nanoeuler_ops.decode_block import composed

forward = composed(norm_linear.forward, decode_attention.forward, linear_residual.forward, norm_swiglu.forward)
