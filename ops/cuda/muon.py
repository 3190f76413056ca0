"""Muon on the GPU, Newton-Schulz in bf16 on the tensor cores. See ops/muon.py for the math.

The clipping norm is adamw's (two launches: the squares of the gradients summed per block in
float64, then the partials in a fixed order). Then, for each pattern entry, whose `repeats`
matrices have one shape (R, C), on bf16 buffers X, X' (repeats, m, n) and A, B (repeats, m, m),
m = min(R, C), n = max(R, C):
  1. _momentum: each block takes a 32 x 32 tile of one matrix: clips the gradients, updates the
     momentum, writes U to X in bf16 (transposed through shared memory when R > C, so that both the
     reads and the writes are coalesced) and the sum of squares of the tile's bf16 values;
  2. _frobenius_norms: one block a matrix adds its tiles' sums (fixed order): ||X||_F, at least eps;
  3. _normalize: X /= ||X||_F;
  4. ns_steps times, each a cuBLAS strided-batched product over the entry's matrices, float32
     accumulation, bf16 out: A = X X^T; B = A, then B = c A A + b B; X' = X, then X' = B X + a X';
     X and X' swap;
  5. _update: the parameters, from X (transposed back through shared memory when R > C).
No host synchronisation: the norm, the learning rate (sched, a device array) and the clipping
scale are read on the device, every temporary comes from the arena, and cuBLAS's alpha and beta
are constants; a captured CUDA graph replays the whole step.
"""

import math

import numpy as np
from numba import cuda, float32, float64

from nanoeuler_ops.adamw import CLIP_EPS
from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.adamw import global_sum_squares
from nanoeuler_ops.cuda.cublas import matmul_batched
from nanoeuler_ops.cuda.device import BF16, block_reduce, stored, to_f32
from nanoeuler_ops.muon import NS_COEFFICIENTS, RMS_MATCH, check_args

TILE = 32                    # a block's tile of a matrix in _momentum and _update,
PADDED = TILE + 1            # held in shared memory in rows of PADDED: reads down a column hit 32 banks
THREADS = 256                # threads a block: a thread takes TILE * TILE / THREADS elements of a tile,
ROWS = THREADS // TILE       # ROWS rows apart
ELEMENTS = 4                 # elements of X a thread of _normalize takes


@cuda.jit(device=True, inline=True)
def _tile_position(first, period):
    # (tx, ty, z, i0, j0, at): the thread's column and first row in the block's tile, which starts
    # at row i0 and column j0 of matrix z = grid z, whose first element is at `at` in the buffers
    z = cuda.blockIdx.z
    return (cuda.threadIdx.x % TILE, cuda.threadIdx.x // TILE, z, cuda.blockIdx.y * TILE, cuda.blockIdx.x * TILE,
            first + z * period)


@cuda.jit(cache=True)
def _momentum(grads, momentum, x, partial, sum_squares, norm_out, first, period, R, C, beta, nesterov,
              max_grad_norm):
    # grads, momentum (P,), sum_squares (1,) float64: matrix z (R, C) at first + z * period, z = grid z,
    # a TILE x TILE tile of it per block -> momentum updated in place, x (repeats, m, n) bf16 = U (U^T
    # when R > C), partial (repeats, tiles) float64 = the sum of squares of each tile's bf16 values,
    # norm_out (1,) = sqrt(sum_squares) (block 0 of each entry's launch writes it: the same value)
    tile = cuda.shared.array((TILE, PADDED), float32)
    scratch = cuda.shared.array(32, float64)
    tx, ty, z, i0, j0, at = _tile_position(first, period)
    norm = float32(math.sqrt(sum_squares[0]))
    if z == 0 and i0 == 0 and j0 == 0 and cuda.threadIdx.x == 0:
        norm_out[0] = norm
    scale = float32(1.0)
    if max_grad_norm > 0:
        scale = min(float32(1.0), max_grad_norm / (norm + float32(CLIP_EPS)))
    one = float32(1.0)
    tall = R > C
    total = float32(0.0)
    for k in range(0, TILE, ROWS):
        i = i0 + ty + k
        j = j0 + tx
        u = float32(0.0)
        if i < R and j < C:
            e = at + i * C + j
            g = grads[e] * scale
            mk = beta * momentum[e] + (one - beta) * g
            momentum[e] = mk
            u = (one - beta) * g + beta * mk if nesterov else mk
            bits = stored(x, u)
            u = to_f32(bits)
            total += u * u
            if not tall:
                x[z, i, j] = bits
        if tall:
            tile[ty + k, tx] = u
    if tall:   # X[j, i] = U[i, j]: read down the tile's columns, write along X's rows
        cuda.syncthreads()
        for k in range(0, TILE, ROWS):
            j = j0 + ty + k
            i = i0 + tx
            if i < R and j < C:
                x[z, j, i] = stored(x, tile[tx, ty + k])
    total = block_reduce(total, False, scratch)
    if cuda.threadIdx.x == 0:
        partial[z, cuda.blockIdx.y * cuda.gridDim.x + cuda.blockIdx.x] = total


@cuda.jit(cache=True)
def _frobenius_norms(partial, norms, eps):
    # partial (repeats, tiles) float64 -> norms (repeats,) = max(sqrt(sum of the row), eps); a block a matrix
    scratch = cuda.shared.array(32, float64)
    z = cuda.blockIdx.x
    total = float64(0.0)
    for t in range(cuda.threadIdx.x, partial.shape[1], cuda.blockDim.x):
        total += partial[z, t]
    total = block_reduce(total, False, scratch)
    if cuda.threadIdx.x == 0:
        norms[z] = max(float32(math.sqrt(total)), eps)


@cuda.jit(cache=True)
def _normalize(x, norms):
    # x (repeats, m n) bf16 /= norms (repeats,): matrix z = grid y; thread t of block b takes the
    # elements b * THREADS * ELEMENTS + t + k * THREADS, k < ELEMENTS
    z = cuda.blockIdx.y
    first = cuda.blockIdx.x * (THREADS * ELEMENTS) + cuda.threadIdx.x
    norm = norms[z]
    for k in range(ELEMENTS):
        e = first + k * THREADS
        if e < x.shape[1]:
            x[z, e] = stored(x, to_f32(x[z, e]) / norm)


@cuda.jit(cache=True)
def _update(params, x, sched, first, period, R, C, weight_decay, rms_scale):
    # params (P,): matrix z (R, C) at first + z * period, z = grid z, a TILE x TILE tile of it per
    # block; x (repeats, m, n) bf16 = O (O^T when R > C); sched (2,) = [lr, step] ->
    # W -= lr weight_decay W;  W -= lr rms_scale O
    tile = cuda.shared.array((TILE, PADDED), float32)
    tx, ty, z, i0, j0, at = _tile_position(first, period)
    lr = sched[0]
    tall = R > C
    if tall:   # tile[jj, ii] = X[j0 + jj, i0 + ii] = O[i0 + ii, j0 + jj], read along X's rows
        for k in range(0, TILE, ROWS):
            j = j0 + ty + k
            i = i0 + tx
            tile[ty + k, tx] = to_f32(x[z, j, i]) if i < R and j < C else float32(0.0)
        cuda.syncthreads()
    for k in range(0, TILE, ROWS):
        i = i0 + ty + k
        j = j0 + tx
        if i < R and j < C:
            o = tile[tx, ty + k] if tall else to_f32(x[z, i, j])
            e = at + i * C + j
            p = params[e]
            p -= lr * weight_decay * p
            params[e] = p - lr * rms_scale * o


def forward(params, grads, momentum, sched, *, pattern, repeats, weight_decay, max_grad_norm, beta=0.95,
            nesterov=True, ns_steps=5, eps=1e-7, reduce_sum_squares=None):
    period, matrices = check_args(params, grads, momentum, sched, pattern, repeats)
    sum_squares = global_sum_squares(grads, reduce_sum_squares)
    norm = runtime.empty((1,), params.dtype)
    a, b, c = NS_COEFFICIENTS
    for first, R, C in matrices:
        m, n = min(R, C), max(R, C)
        tiles = (runtime.blocks_for(C, TILE), runtime.blocks_for(R, TILE), repeats)
        x, x_next = runtime.empty((repeats, m, n), BF16), runtime.empty((repeats, m, n), BF16)
        gram, poly = runtime.empty((repeats, m, m), BF16), runtime.empty((repeats, m, m), BF16)
        partial = runtime.empty((repeats, tiles[0] * tiles[1]), np.float64)
        norms = runtime.empty((repeats,), np.float32)
        runtime.launch(_momentum, tiles, THREADS, grads, momentum, x, partial, sum_squares, norm, first, period, R, C,
                       float32(beta), bool(nesterov), float32(max_grad_norm))
        runtime.launch(_frobenius_norms, repeats, THREADS, partial, norms, float32(eps))
        runtime.launch(_normalize, (runtime.blocks_for(m * n, THREADS * ELEMENTS), repeats), THREADS,
                       x.reshape(repeats, m * n), norms)
        for _ in range(ns_steps):
            matmul_batched(x, x, gram, trans_b=True)          # A = X X^T
            runtime.copy(poly, gram)
            matmul_batched(gram, gram, poly, alpha=c, beta=b)  # B = c A A + b A
            runtime.copy(x_next, x)
            matmul_batched(poly, x, x_next, beta=a)            # X' = B X + a X
            x, x_next = x_next, x
        runtime.launch(_update, tiles, THREADS, params, x, sched, first, period, R, C, float32(weight_decay),
                       float32(RMS_MATCH * math.sqrt(n)))
    return norm, ()
