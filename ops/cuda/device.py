"""The device the CUDA kernels run on: `DEVICE`, its host side (what ops/cuda/runtime.py launches,
captures and copies through), and the device library kernels import their building blocks from:

  bf16 storage    BF16, to_f32, stored, pack_bf16x2, bf16x2_values; pairs, pair_values, stored_pair
  reductions      warp_sum, warp_max, warp_ballot, quad_sum, quad_max, lanes_reduce, block_reduce
  tensor cores    mma_bf16; shared_base, cp_async_16, cp_async_wait_all, ldmatrix_x4(_trans);
                  smem_descriptor, wgmma_ss, wgmma_rs_t, wgmma_fence, wgmma_commit, wgmma_wait, proxy_fence
  overlap, loads  wait_for_previous, let_next_start, prefetch_l2, load_16_bytes, load_8_floats
  8-bit integers  dp4a, rint_scaled

Which device is chosen here, once: a GPU (ops/cuda/gpu.py, and the instructions of ops/cuda/ptx.py,
whose comments give each one's semantics and layout) or, with NUMBA_ENABLE_CUDASIM=1, Numba's CUDA
simulator (ops/cuda/simulator.py: the same names). The rest of this module is written once for both.
"""

import numpy as np
from numba import config, cuda, uint32, uint64
from numba.cuda.core.caching import CacheImpl

from nanoeuler_core.kernel_cache import stamp_sources

stamp_sources(CacheImpl)   # a cached CUDA kernel is checked against the modules it imports too

if config.ENABLE_CUDASIM:
    from nanoeuler_ops.cuda.simulator import *  # noqa: F403
else:
    from nanoeuler_ops.cuda.gpu import DEVICE  # noqa: F401
    from nanoeuler_ops.cuda.ptx import *  # noqa: F403

# NumPy has no bfloat16: a bf16 tensor is stored as its 16-bit patterns (uint16), the upper half of
# the float32 with the same sign, exponent and leading 7 mantissa bits. Kernels are written once
# for both storages: `to_f32(x[i])` reads a stored value as float32 and `y[i] = stored(y, v)`
# rounds a float32 to y's storage (round to nearest even for bf16), so fp32 and bf16 arrays
# compile to their own specialisations of the same kernel.
BF16 = np.dtype(np.uint16)


# A kernel may read and write two neighbouring elements in one access: `pairs(arr)` views a float32
# or bf16 array as words of two elements each (uint32: two bf16 patterns; uint64: two float32), the
# first element in the low half. `pair_values(a[i])` reads word i as two float32 and
# `a[i] = stored_pair(a, lo, hi)` rounds two float32 to a's storage (bf16: one cvt for both).

def pairs(arr):
    """A contiguous float32 or bf16 array of even size as one flat run of words, each two
    neighbouring elements (uint32 for bf16 storage, uint64 for float32)."""
    return arr.reshape(arr.size).view(np.uint32 if arr.dtype == BF16 else np.uint64)


@cuda.jit(device=True, inline=True)
def smem_descriptor(address, group_bytes):
    """The wgmma descriptor (ptx.py's warpgroup section) of a tile at shared-window address `address`
    (bytes) in the 128-byte swizzle, groups of 8 rows `group_bytes` apart."""
    return (uint64(address & uint32(0x3FFFF)) >> uint64(4)) | (uint64(1) << uint64(16)) | \
        (uint64(group_bytes >> 4) << uint64(32)) | (uint64(1) << uint64(62))
