"""AdamW on the CPU. See ops/adamw.py for the math."""

import numpy as np
from numba import njit, prange

from nanoeuler_ops.adamw import CLIP_EPS, check_buffers
from nanoeuler_ops.cpu.common import REDUCE_FASTMATH


@njit(parallel=True, cache=True, fastmath=REDUCE_FASTMATH)
def _sum_squares(grads):
    # grads (P,) -> sum of squares (float64: a million float32 squares would lose digits)
    total = 0.0
    for i in prange(grads.shape[0]):
        total += np.float64(grads[i]) * grads[i]
    return total


def global_norm(grads, reduce_sum_squares=None):
    """sqrt(sum of grads^2), float64, the sum all-reduced by `reduce_sum_squares` first where given
    (the optimizers' clipping norm)."""
    sum_squares = np.array([_sum_squares(grads)])
    if reduce_sum_squares is not None:
        reduce_sum_squares(sum_squares)
    return np.sqrt(sum_squares[0])


@njit(parallel=True, cache=True)
def _update(params, grads, m, v, norm, lr, step, beta1, beta2, eps, weight_decay, n_decay, max_grad_norm):
    # params, grads, m, v (P,); norm float64; the hyperparameters float32, n_decay int;
    # params, m, v updated in place.
    scale = np.float32(1.0)
    if max_grad_norm > 0:
        scale = np.float32(min(1.0, max_grad_norm / (norm + CLIP_EPS)))
    one = np.float32(1.0)
    # bias corrections in float64: beta2^step stays close to 1 for thousands of steps
    mhat_scale = np.float32(1.0 / (1.0 - np.float64(beta1) ** step))
    vhat_scale = np.float32(1.0 / (1.0 - np.float64(beta2) ** step))
    decay = one - lr * weight_decay
    for i in prange(params.shape[0]):
        g = grads[i] * scale
        m_i = beta1 * m[i] + (one - beta1) * g
        v_i = beta2 * v[i] + (one - beta2) * g * g
        m[i] = m_i
        v[i] = v_i
        p = params[i] * decay if i < n_decay else params[i]
        params[i] = p - lr * (m_i * mhat_scale) / (np.sqrt(v_i * vhat_scale) + eps)


def forward(params, grads, m, v, sched, *, beta1, beta2, eps, weight_decay, n_decay, max_grad_norm,
            reduce_sum_squares=None):
    check_buffers(params, grads, m, v, sched, n_decay)
    lr, step = sched
    norm = global_norm(grads, reduce_sum_squares)
    f32 = np.float32
    _update(params, grads, m, v, norm, f32(lr), f32(step), f32(beta1), f32(beta2), f32(eps),
            f32(weight_decay), n_decay, f32(max_grad_norm))
    return np.array([norm], dtype=params.dtype), ()
