"""AdamW step over the flat parameter buffer, with global gradient-norm clipping.

Shapes: params, grads, m, v (P,); sched (2,) = [lr, step] -> grad_norm (1,); saved ().
params, m and v are updated in place. sched lives in an array, not in the attributes, so a
captured CUDA graph replays with a new learning rate and step.

    sum_squares = sum_i grads[i]^2                             (float64, a (1,) backend array)
    reduce_sum_squares(sum_squares)                            (optional, in place; see below)
    norm = sqrt(sum_squares)                                   (returned, before clipping)
    scale = min(1, max_grad_norm / (norm + 1e-6)) if max_grad_norm > 0 else 1
    g = scale * grads
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g^2
    mhat = m / (1 - beta1^step),  vhat = v / (1 - beta2^step)
    params[i] -= lr * weight_decay * params[i]                 (only i < n_decay: decoupled decay)
    params -= lr * mhat / (sqrt(vhat) + eps)

The model lays out its buffer with every decayed matrix first, so decay is one index range.
There is no backward: this is the optimizer.

Sharded optimizer state (ZeRO-1): each data-parallel rank calls the op on its slice [lo, hi) of
the buffers, with n_decay = clamp(n_decay - lo, 0, hi - lo), and passes `reduce_sum_squares`, a
callable that all-reduces (sums) the slice's sum of squares across the ranks in place, so every
rank clips with the norm of the whole gradient. It is called once, between the two passes over
the gradients, with backend work only (a captured CUDA graph holds it).
"""

import numpy as np

from nanoeuler_core.registry import ErrorInput, Sample, define_op

CLIP_EPS = 1e-6


def check_buffers(params, grads, m, v, sched, n_decay):
    """Raise ValueError unless the buffers are one flat length P, sched is [lr, step] and
    0 <= n_decay <= P (every backend calls this)."""
    if params.ndim != 1 or not params.shape == grads.shape == m.shape == v.shape:
        raise ValueError(f"adamw: params, grads, m and v must be flat buffers of one length, got shapes "
                         f"{params.shape}, {grads.shape}, {m.shape}, {v.shape}")
    if sched.shape != (2,):
        raise ValueError(f"adamw: sched must be [lr, step], got shape {sched.shape}")
    if not 0 <= n_decay <= params.shape[0]:
        raise ValueError(f"adamw: n_decay must lie in [0, {params.shape[0]}], got {n_decay}")


def forward(params, grads, m, v, sched, *, beta1, beta2, eps, weight_decay, n_decay, max_grad_norm,
            reduce_sum_squares=None):
    check_buffers(params, grads, m, v, sched, n_decay)
    lr, step = sched
    sum_squares = np.array([np.sum(grads * grads)])
    if reduce_sum_squares is not None:
        reduce_sum_squares(sum_squares)
    norm = np.sqrt(sum_squares[0])
    scale = min(1.0, max_grad_norm / (norm + CLIP_EPS)) if max_grad_norm > 0 else 1.0
    g = scale * grads
    m[:] = beta1 * m + (1 - beta1) * g
    v[:] = beta2 * v + (1 - beta2) * g * g
    mhat = m / (1 - beta1 ** step)
    vhat = v / (1 - beta2 ** step)
    params[:n_decay] -= lr * weight_decay * params[:n_decay]
    params -= lr * mhat / (np.sqrt(vhat) + eps)
    return np.array([norm]), ()


class ScaleSumSquares:
    """A stand-in for the all-reduce of a sharded step: multiplies the sum of squares by `factor`
    in place, as `factor` ranks holding shards like this one would (host or device arrays)."""

    def __init__(self, factor: float):
        self.factor = factor

    def __call__(self, sum_squares) -> None:
        if isinstance(sum_squares, np.ndarray):
            sum_squares *= self.factor
        else:  # a device array: through the host (never called inside a captured graph)
            sum_squares.copy_to_device(sum_squares.copy_to_host() * self.factor)


TEST_ATTRS = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "max_grad_norm": 1.0}   # the checks' calls


def sample_inputs(rng):
    # (P, n_decay, step, max_grad_norm, hook): clipping on (norm well above 1) and off (0 = never,
    # or a bound above the norm), decay over part of the buffer, none of it, and all of it; a
    # shard whose norm is summed with three others' (clipping by the global norm); a buffer of
    # several GPU blocks, the last one partly filled.
    for size, n_decay, step, max_grad_norm, hook in ((10, 6, 1, 1.0, None), (300, 157, 7, 0.0, None),
                                                     (77, 0, 3, 100.0, None), (1000, 1000, 12, 0.5, None),
                                                     (200, 120, 5, 20.0, ScaleSumSquares(4.0)),
                                                     (2500, 1700, 4, 1.0, None)):
        params = rng.standard_normal(size)
        grads = rng.standard_normal(size)
        m = 0.1 * rng.standard_normal(size)
        v = 0.01 * rng.random(size)
        sched = np.array([1e-2, float(step)])
        attrs = {**TEST_ATTRS, "n_decay": n_decay, "max_grad_norm": max_grad_norm, "reduce_sum_squares": hook}
        yield Sample((params, grads, m, v, sched), attrs,
                     name=f"P{size}_decay{n_decay}_step{step}" + ("_sharded" if hook else ""))


def error_inputs(rng):
    # (lengths of params, grads, m, v; sched's length; n_decay)
    cases = (("grads_9_for_10", (10, 9, 10, 10), 2, 5, "must be flat buffers of one length"),
             ("v_11_for_10", (10, 10, 10, 11), 2, 5, "must be flat buffers of one length"),
             ("sched_3", (10, 10, 10, 10), 3, 5, r"sched must be \[lr, step\]"),
             ("n_decay_11", (10, 10, 10, 10), 2, 11, r"n_decay must lie in \[0, 10\]"))
    for name, sizes, sched_size, n_decay, match in cases:
        params, grads, m, v = (rng.standard_normal(n) for n in sizes)
        sched = np.array([1e-2, 1.0, 0.0][:sched_size])
        yield ErrorInput(Sample((params, grads, m, v, sched), {**TEST_ATTRS, "n_decay": n_decay}, name=name),
                         match=match)


def model_inputs(rng, cfg, rows):
    """Three million parameters, two thirds of them decayed (the sizes do not depend on cfg)."""
    P = 3_000_001
    normal = rng.standard_normal
    return Sample((normal(P), normal(P), 0.1 * normal(P), 0.01 * rng.random(P), np.array([3e-4, 5.0])),
                  {**TEST_ATTRS, "n_decay": 2_000_000}, name=f"P{P}")


OP = define_op(globals(), "AdamW step with decoupled weight decay and global gradient-norm clipping (in place)",
                inplace=(0, 2, 3))
