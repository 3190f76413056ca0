"""AdamW with global gradient-norm clipping on the GPU. See ops/adamw.py for the math.

Three launches and no host synchronisation, so a captured CUDA graph replays the whole step:
  1. each block sums the squares of its share of the gradients (float64) into partial[block];
  2. one block adds the partials into sum_squares (1,) in device memory (which
     `reduce_sum_squares`, if given, then all-reduces across data-parallel ranks);
  3. each thread reads sum_squares and sched = [lr, step] from device memory, works out the step's
     clipping scale and bias corrections once, then clips and updates ELEMENTS parameters (and
     their m and v) in place, a block's threads side by side (coalesced); thread 0 also writes the
     norm. The constants cost more than an element's update (two powers, a float64 square root,
     a division), and a memory-bound update has no instructions to spare for them.
Partials are summed in a fixed order: the norm is the same on every run.
"""

import math

import numpy as np
from numba import cuda, float32, float64

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.adamw import check_buffers
from nanoeuler_ops.cuda.device import block_reduce

THREADS = 256
ELEMENTS = 4          # parameters a thread of the update takes
MAX_PARTIALS = 1024
CLIP_EPS = 1e-6


@cuda.jit(cache=True)
def _sum_squares(grads, partial):
    # grads (P,) -> partial (blocks,): each block's sum of squares, grid-stride over grads
    scratch = cuda.shared.array(32, float64)
    total = float64(0.0)
    for i in range(cuda.grid(1), grads.shape[0], cuda.gridsize(1)):
        g = float64(grads[i])
        total += g * g
    total = block_reduce(total, False, scratch)
    if cuda.threadIdx.x == 0:
        partial[cuda.blockIdx.x] = total


@cuda.jit(cache=True)
def _total(partial, sum_squares):
    # partial (blocks,) -> sum_squares (1,) float64 = sum of partials; a single block
    scratch = cuda.shared.array(32, float64)
    total = float64(0.0)
    for i in range(cuda.threadIdx.x, partial.shape[0], cuda.blockDim.x):
        total += partial[i]
    total = block_reduce(total, False, scratch)
    if cuda.threadIdx.x == 0:
        sum_squares[0] = total


@cuda.jit(cache=True)
def _update(params, grads, m, v, sched, sum_squares, norm_out, beta1, beta2, eps, weight_decay, n_decay,
            max_grad_norm):
    # params, grads, m, v (P,), sched (2,) = [lr, step], sum_squares (1,) float64 -> params, m, v
    # updated in place, norm_out (1,) = sqrt(sum_squares); thread t of block b takes the parameters
    # b * THREADS * ELEMENTS + t + k * THREADS, k < ELEMENTS
    first = cuda.blockIdx.x * (THREADS * ELEMENTS) + cuda.threadIdx.x
    P = params.shape[0]
    g_in = cuda.local.array(ELEMENTS, float32)
    m_in = cuda.local.array(ELEMENTS, float32)
    v_in = cuda.local.array(ELEMENTS, float32)
    p_in = cuda.local.array(ELEMENTS, float32)
    for k in range(ELEMENTS):   # every load out first: a store (even the norm's) could alias a later load
        i = first + k * THREADS
        if i < P:
            g_in[k], m_in[k], v_in[k], p_in[k] = grads[i], m[i], v[i], params[i]
    norm = float32(math.sqrt(sum_squares[0]))
    if first == 0:
        norm_out[0] = norm
    lr = sched[0]
    step = sched[1]
    scale = float32(1.0)
    if max_grad_norm > 0:
        scale = min(float32(1.0), max_grad_norm / (norm + float32(CLIP_EPS)))
    correction1 = float32(1.0) - beta1 ** step
    correction2 = float32(1.0) - beta2 ** step
    for k in range(ELEMENTS):
        i = first + k * THREADS
        if i < P:
            g = g_in[k] * scale
            mi = beta1 * m_in[k] + (float32(1.0) - beta1) * g
            vi = beta2 * v_in[k] + (float32(1.0) - beta2) * g * g
            m[i] = mi
            v[i] = vi
            mhat = mi / correction1
            vhat = vi / correction2
            p = p_in[k]
            if i < n_decay:
                p -= lr * weight_decay * p
            params[i] = p - lr * mhat / (math.sqrt(vhat) + eps)


def global_sum_squares(grads, reduce_sum_squares=None):
    """The sum of grads^2 as a (1,) float64 device array, all-reduced in place by
    `reduce_sum_squares` where given (launches 1 and 2: the optimizers' clipping norm)."""
    blocks = min(MAX_PARTIALS, runtime.blocks_for(grads.shape[0], THREADS))
    partial = runtime.empty((blocks,), np.float64)
    sum_squares = runtime.empty((1,), np.float64)
    runtime.launch(_sum_squares, blocks, THREADS, grads, partial)
    runtime.launch(_total, 1, THREADS, partial, sum_squares)
    if reduce_sum_squares is not None:
        reduce_sum_squares(sum_squares)
    return sum_squares


def forward(params, grads, m, v, sched, *, beta1, beta2, eps, weight_decay, n_decay, max_grad_norm,
            reduce_sum_squares=None):
    check_buffers(params, grads, m, v, sched, n_decay)
    size = params.shape[0]
    sum_squares = global_sum_squares(grads, reduce_sum_squares)
    norm = runtime.empty((1,), params.dtype)
    runtime.launch(_update, runtime.blocks_for(size, THREADS * ELEMENTS), THREADS, params, grads, m, v, sched,
                   sum_squares, norm, float32(beta1), float32(beta2), float32(eps), float32(weight_decay), n_decay,
                   float32(max_grad_norm))
    return norm, ()
