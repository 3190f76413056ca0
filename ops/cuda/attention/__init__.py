"""FlashAttention forward and backward on the GPU (FlashAttention-2 blocking). See ops/attention.py
for the math, teaching.py for the algorithm in one plain kernel, and docs/cuda.md.

Three families of kernels compute it, a file each, each a forward kernel and two backward kernels
(dq, then dk/dv) launched the same way (Family.launch):
  simt.py    float32 arithmetic on fp32 or bf16 storage, any head size: each thread computes
             4 x 4 register tiles of products staged in shared memory
  mma.py     bf16 storage, head size a multiple of 16: each warp multiplies 16-row tiles with
             mma.sync m16n8k16 on the tensor cores
  wgmma.py   mma.py's forward on Hopper for head size 64: the block's four warps multiply together,
             by wgmma from swizzled shared memory
`forward` and `backward` take the tensor-core kernels where they serve the inputs, else the SIMT ones.

In all, no (T, S) matrix is ever stored: a thread block keeps a tile of query rows (or keys) and
streams tiles of the other side past it through shared memory. Tiles wholly in the causal future
are never loaded. Query head h reads key/value head h // (H // KV) in place: repeated K/V are never
materialised.
  forward   block = a tile of query rows of one (b, h), streaming tiles of keys; the online
            softmax (running max and sum per row) stays in registers; writes o and lse.
  dq        block = a tile of query rows of one (b, h), streaming tiles of keys; P recomputed
            from lse; first Di = rowsum(do * o), the FlashAttention-2 backward's correction term,
            for its rows (written out for dkdv).
  dkdv      block = a tile of keys of one (b, kv head), streaming tiles of query rows of every
            query head of its group, so the group's gradients add up in registers: no atomics,
            no races.
Each streamed tile is loaded while the previous one is being multiplied. The tiles live in dynamic
shared memory (runtime.launch raises a kernel's limit past 48 KB). The head size D is a
compile-time constant (register tiles are unrolled), so each family compiles its kernels per D.
"""

import math
from functools import cache
from typing import Callable, NamedTuple

import numpy as np
from numba import float32

from nanoeuler_ops.attention import check_shapes
from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.attention import mma, simt, wgmma
from nanoeuler_ops.cuda.attention.common import FlashKernels, Kernel


def forward(q, k, v):
    check_shapes(q, k, v)
    B, T, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    o = runtime.empty(q.shape, q.dtype)
    lse = runtime.empty((B, H, T), np.float32)
    scale = float32(1.0 / math.sqrt(D))
    family = _family(q)
    x = family.tensor
    # The tile index is the grid's slow dimension: the blocks with the most keys start first
    family.launch(family.kernels(D).forward, (B * H, T), (x(q), x(k), x(v)), (T, S, H, KV), scale, (x(o), lse))
    return o, (o, lse)


def backward(do, saved, q, k, v):
    o, lse = saved
    B, T, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    scale = float32(1.0 / math.sqrt(D))
    di = runtime.empty((B, H, T), np.float32)
    dq = runtime.empty(q.shape, q.dtype)
    dk = runtime.empty(k.shape, k.dtype)
    dv = runtime.empty(v.shape, v.dtype)
    family = _family(q)
    kernels, x = family.kernels(D), family.tensor
    # As in the forward: blocks start roughly in index order, so those with the most causal steps
    # start first and the grid ends on short ones
    family.launch(kernels.dq, (B * H, T), (x(do), x(q), x(k), x(v), x(o), lse), (T, S, H, KV), scale, (x(dq), di))
    family.launch(kernels.dkdv, (B * KV, S), (x(do), x(q), x(k), x(v), lse, di), (T, S, H, KV), scale,
                  (x(dk), x(dv)))
    return dq, dk, dv


def _family(q) -> "Family":
    """The tensor-core family where it serves the inputs, else the SIMT one."""
    return TENSOR_CORE_FAMILY if mma.mma_supported(q) else SIMT_FAMILY


@cache
def tensor_core_kernels(D: int, hopper: bool | None = None) -> FlashKernels:
    """The bf16 tensor-core kernels for head size D: mma.py's, with wgmma.py's forward where it
    serves (on this GPU with hopper None, else as for Hopper or not: to compile them ahead, e.g.
    numba.cuda.compile_ptx)."""
    kernels = mma.mma_kernels(D)
    return kernels._replace(forward=wgmma.wgmma_forward(D)) if wgmma.wgmma_supported(D, hopper) else kernels


class Family(NamedTuple):
    """A family of FlashAttention kernels and how they are launched."""
    kernels: Callable    # head size D -> its FlashKernels, compiled for D
    rows: int            # rows of a block's tile: query rows (forward, dq) or keys (dkdv)
    threads: int         # threads per block
    tensor: Callable     # a tensor in the form the family's kernels take it
    takes_sizes: bool    # whether the kernels take T, S, H, KV (else they read them from the tensors' shapes)

    def launch(self, kernel: Kernel, grid, inputs, sizes, scale, outputs) -> None:
        """kernel(*inputs, *sizes, scale, *outputs) on the current stream, grid = (heads, rows):
        `heads` blocks by the tiles of `rows` rows."""
        heads, rows = grid
        args = (*inputs, *sizes, scale, *outputs) if self.takes_sizes else (*inputs, scale, *outputs)
        runtime.launch(kernel.function, (heads, runtime.blocks_for(rows, self.rows)), self.threads, *args,
                       shared_bytes=kernel.shared_bytes)


SIMT_FAMILY = Family(simt.simt_kernels, simt.TILE, simt.THREADS, tensor=lambda x: x, takes_sizes=False)
TENSOR_CORE_FAMILY = Family(tensor_core_kernels, mma.MMA_ROWS, mma.MMA_THREADS, tensor=mma.as_words, takes_sizes=True)
