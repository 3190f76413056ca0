"""Muon on the CPU, float32 throughout. See ops/muon.py for the math.

One kernel per pattern entry: its `repeats` matrices (one shape) are shared among the threads,
each thread taking every matrix of its share from the gradient to the update: momentum, then
Newton-Schulz through sgemm calls on its own workspace (ops/cpu/common.py's `sgemm`, OpenBLAS held
to one thread: the matrices are the parallel work), then the update. The products have the
shapes of the reference's: X (m, n), m = min(R, C) <= n, A = X X^T and B (m, m).
"""

import math

import numba
import numpy as np
from numba import njit, prange

from nanoeuler_ops.adamw import CLIP_EPS
from nanoeuler_ops.cpu.adamw import global_norm
from nanoeuler_ops.cpu.common import REDUCE_FASTMATH, one_blas_thread, sgemm
from nanoeuler_ops.muon import NS_COEFFICIENTS, RMS_MATCH, check_args

NS_A, NS_B, NS_C = (np.float32(k) for k in NS_COEFFICIENTS)


@njit(cache=True)
def _newton_schulz(x, gram, t, steps):
    # x (tasks, 2, m, n), gram (tasks, 2, m, m) float32: task t's X in x[t, 0] -> the index s of
    # x[t, s] that holds X after `steps` steps (the two halves take turns as the product's output)
    m, n = x.shape[2], x.shape[3]
    at_x, at_gram = t * 2 * m * n, t * 2 * m * m   # x[t, 0] and gram[t, 0] (A); then x[t, 1], gram[t, 1] (B)
    s = 0
    for _ in range(steps):
        src, dst = at_x + s * m * n, at_x + (1 - s) * m * n
        sgemm(False, True, m, m, n, 1.0, x, src, n, x, src, n, 0.0, gram, at_gram, m)          # A = X X^T
        gram[t, 1] = gram[t, 0]
        sgemm(False, False, m, m, m, NS_C, gram, at_gram, m, gram, at_gram, m, NS_B, gram, at_gram + m * m, m)
        x[t, 1 - s] = x[t, s]                                                                 # B = c A A + b A
        sgemm(False, False, m, n, m, 1.0, gram, at_gram + m * m, m, x, src, n, NS_A, x, dst, n)  # X = a X + B X
        s = 1 - s
    return s


@njit(parallel=True, cache=True, fastmath=REDUCE_FASTMATH)
def _step_matrices(params, grads, momentum, first, period, R, C, repeats, scale, lr, beta, nesterov, ns_steps,
                   weight_decay, eps, rms_scale, x, gram):
    # params, grads, momentum (P,): matrices (R, C) at first + r * period, r < repeats, updated in
    # place; x (tasks, 2, m, n), gram (tasks, 2, m, m) float32 workspaces, m = min(R, C), n = max(R, C):
    # task t takes the matrices r = t, t + tasks, ...
    tasks = x.shape[0]
    tall = R > C
    one = np.float32(1.0)
    for t in prange(tasks):
        for r in range(t, repeats, tasks):
            at = first + r * period
            total = 0.0
            for i in range(R):   # momentum; X = U (U^T for a tall matrix)
                for j in range(C):
                    k = at + i * C + j
                    g = scale * grads[k]
                    mk = beta * momentum[k] + (one - beta) * g
                    momentum[k] = mk
                    u = (one - beta) * g + beta * mk if nesterov else mk
                    if tall:
                        x[t, 0, j, i] = u
                    else:
                        x[t, 0, i, j] = u
                    total += np.float64(u) * u
            inv_norm = np.float32(1.0 / max(math.sqrt(total), eps))
            for i in range(x.shape[2]):
                for j in range(x.shape[3]):
                    x[t, 0, i, j] *= inv_norm
            s = _newton_schulz(x, gram, t, ns_steps)
            decay = lr * weight_decay
            step = lr * rms_scale
            for i in range(R):   # W -= lr wd W;  W -= lr 0.2 sqrt(max(R, C)) O
                for j in range(C):
                    k = at + i * C + j
                    o = x[t, s, j, i] if tall else x[t, s, i, j]
                    p = params[k] - decay * params[k]
                    params[k] = p - step * o


def forward(params, grads, momentum, sched, *, pattern, repeats, weight_decay, max_grad_norm, beta=0.95,
            nesterov=True, ns_steps=5, eps=1e-7, reduce_sum_squares=None):
    period, matrices = check_args(params, grads, momentum, sched, pattern, repeats)
    norm = global_norm(grads, reduce_sum_squares)
    scale = min(1.0, max_grad_norm / (norm + CLIP_EPS)) if max_grad_norm > 0 else 1.0
    f32 = np.float32
    tasks = min(repeats, numba.get_num_threads())
    with one_blas_thread():
        for first, R, C in matrices:
            m, n = min(R, C), max(R, C)
            x = np.empty((tasks, 2, m, n), np.float32)
            gram = np.empty((tasks, 2, m, m), np.float32)
            _step_matrices(params, grads, momentum, first, period, R, C, repeats, f32(scale), f32(sched[0]), f32(beta),
                           bool(nesterov), ns_steps, f32(weight_decay), f32(eps), f32(RMS_MATCH * math.sqrt(n)),
                           x, gram)
    return np.array([norm], dtype=params.dtype), ()
