"""Muon step over a flat buffer of matrices, with global gradient-norm clipping.

Shapes: params, grads, momentum (P,); sched (2,) = [lr, step] -> grad_norm (1,); saved ().
params and momentum are updated in place; step is unused (Muon has no bias correction), it is
there so that one sched array serves both optimizers. There is no backward: this is an optimizer.

The buffers hold `repeats` copies of `pattern`, a tuple of (rows, cols): matrix j of repeat r is
the (rows, cols) row-major block at r * period + sum of the sizes of pattern[:j], where period =
sum(rows * cols) and P = repeats * period (in the model: one transformer block's wq, wk, wv, wo,
w_gate, w_up, w_down, repeated over the blocks).

    sum_squares = sum_i grads[i]^2                             (float64, a (1,) backend array)
    reduce_sum_squares(sum_squares)                            (optional, in place: see ops/adamw.py)
    norm = sqrt(sum_squares)                                   (returned, before clipping)
    scale = min(1, max_grad_norm / (norm + 1e-6)) if max_grad_norm > 0 else 1
    for each matrix, G, M, W its views in grads, momentum, params, shape (R, C):
      g = scale * G
      M = beta * M + (1 - beta) * g
      U = (1 - beta) * g + beta * M  if nesterov else M
      O = newton_schulz(U):  X = U^T if R > C else U;  X = X / max(||X||_F, eps)
                             ns_steps times: A = X X^T;  B = b A + c A A;  X = a X + B X
                             O = X^T if R > C else X
      W = W - lr * weight_decay * W                            (decoupled decay)
      W = W - lr * 0.2 * sqrt(max(R, C)) * O

(a, b, c) = (3.4445, -4.7750, 2.0315): a quintic steep at 0. After the normalization X's singular
values lie in (0, 1]; five steps bring them into about [0.7, 1.2] (all but those below about
1/500), near the 1s of the orthogonal factor P Q^T of U's SVD P S Q^T, which the update
approximates. 0.2 sqrt(max(R, C)) gives the update the RMS of an AdamW update, so that one learning
rate serves both optimizers. This is PyTorch's torch.optim.Muon(nesterov=True,
adjust_lr_fn="match_rms_adamw"), with the clipping added.

Attributes: pattern, repeats, weight_decay, max_grad_norm (0: no clipping), beta (0.95), nesterov
(True), ns_steps (5), eps (1e-7), reduce_sum_squares (None; for data-parallel shards, as adamw's).
"""

import math

import numpy as np

from nanoeuler_core.registry import ErrorInput, Sample, Tol, define_op
from nanoeuler_ops.adamw import CLIP_EPS, ScaleSumSquares

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
RMS_MATCH = 0.2     # the update's RMS, 0.2 sqrt(max(R, C)) times O's: about AdamW's


def layout(pattern, repeats, size):
    """(period, [(first, rows, cols) for each pattern entry]): matrix j of repeat r starts at
    first_j + r * period. ValueError unless pattern is (rows, cols) pairs of positive integers and
    repeats * period == size."""
    def positive(n):
        return isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n > 0

    if not pattern or not all(isinstance(e, (tuple, list)) and len(e) == 2 and all(map(positive, e))
                              for e in pattern):
        raise ValueError(f"muon: pattern must be (rows, cols) pairs of positive integers, got {pattern!r}")
    if not positive(repeats):
        raise ValueError(f"muon: repeats must be a positive integer, got {repeats!r}")
    matrices, first = [], 0
    for rows, cols in pattern:
        matrices.append((first, int(rows), int(cols)))
        first += rows * cols
    if repeats * first != size:
        raise ValueError(f"muon: the buffers hold {size} values, but {repeats} repeats of the pattern "
                         f"hold {repeats} * {first} = {repeats * first}")
    return first, matrices


def check_args(params, grads, momentum, sched, pattern, repeats):
    """Raise ValueError unless the buffers are one flat length P, sched is [lr, step] and the
    pattern's repeats fill P exactly; returns `layout` (every backend calls this)."""
    if params.ndim != 1 or not params.shape == grads.shape == momentum.shape:
        raise ValueError(f"muon: params, grads and momentum must be flat buffers of one length, got shapes "
                         f"{params.shape}, {grads.shape}, {momentum.shape}")
    if sched.shape != (2,):
        raise ValueError(f"muon: sched must be [lr, step], got shape {sched.shape}")
    return layout(pattern, repeats, params.shape[0])


def newton_schulz(U, steps, eps):
    """U (R, C) -> O (R, C), about U's nearest semi-orthogonal matrix (see the module's docstring)."""
    a, b, c = NS_COEFFICIENTS
    tall = U.shape[0] > U.shape[1]
    X = U.T if tall else U
    X = X / max(np.linalg.norm(X), eps)
    for _ in range(steps):
        A = X @ X.T
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.T if tall else X


def forward(params, grads, momentum, sched, *, pattern, repeats, weight_decay, max_grad_norm, beta=0.95,
            nesterov=True, ns_steps=5, eps=1e-7, reduce_sum_squares=None):
    period, matrices = check_args(params, grads, momentum, sched, pattern, repeats)
    lr = sched[0]
    sum_squares = np.array([np.sum(grads * grads)])
    if reduce_sum_squares is not None:
        reduce_sum_squares(sum_squares)
    norm = np.sqrt(sum_squares[0])
    scale = min(1.0, max_grad_norm / (norm + CLIP_EPS)) if max_grad_norm > 0 else 1.0
    for r in range(repeats):
        for first, R, C in matrices:
            at = slice(r * period + first, r * period + first + R * C)
            G, M, W = (buf[at].reshape(R, C) for buf in (grads, momentum, params))   # views
            g = scale * G
            M[:] = beta * M + (1 - beta) * g
            U = (1 - beta) * g + beta * M if nesterov else M
            O = newton_schulz(U, ns_steps, eps)
            W -= lr * weight_decay * W
            W -= lr * RMS_MATCH * math.sqrt(max(R, C)) * O
    return np.array([norm]), ()


TEST_ATTRS = {"weight_decay": 0.1, "max_grad_norm": 1.0}   # the checks' calls


def sample_inputs(rng):
    # (pattern, repeats, attrs): wide, tall and square matrices; one repeat and three; clipping on
    # (norm well above the bound), off (0) and not reached (a bound above the norm); nesterov on and
    # off; decay and none; an even number of Newton-Schulz steps and none at all; matrices of two
    # 32 x 32 tiles and of two 16 x 16 product tiles (the CUDA kernels' and the simulator's), the
    # last ones short; a shard whose norm is summed with three others' (clipping by the global norm).
    cases = ((((6, 10),), 1, {}),
             (((12, 5), (7, 7)), 3, {"max_grad_norm": 0.0, "nesterov": False, "weight_decay": 0.0}),
             (((40, 20), (20, 40), (9, 9)), 1, {"max_grad_norm": 100.0, "beta": 0.9}),
             (((8, 16), (16, 8)), 3, {"max_grad_norm": 20.0, "ns_steps": 2,
                                      "reduce_sum_squares": ScaleSumSquares(4.0)}),
             (((5, 3), (3, 5)), 3, {"ns_steps": 0, "nesterov": False}))
    for pattern, repeats, attrs in cases:
        size = repeats * sum(rows * cols for rows, cols in pattern)
        params = rng.standard_normal(size)
        grads = rng.standard_normal(size)
        momentum = 0.1 * rng.standard_normal(size)
        sched = np.array([1e-2, 3.0])
        name = "_".join(f"{rows}x{cols}" for rows, cols in pattern) + f"_r{repeats}" + \
            ("_sharded" if "reduce_sum_squares" in attrs else "")
        yield Sample((params, grads, momentum, sched),
                     {**TEST_ATTRS, "pattern": pattern, "repeats": repeats, **attrs}, name=name)


def error_inputs(rng):
    # (lengths of params, grads, momentum; sched's length; pattern; repeats)
    cases = (("grads_23_for_24", (24, 23, 24), 2, ((4, 6),), 1, "must be flat buffers of one length"),
             ("momentum_25_for_24", (24, 24, 25), 2, ((4, 6),), 1, "must be flat buffers of one length"),
             ("sched_3", (24, 24, 24), 3, ((4, 6),), 1, r"sched must be \[lr, step\]"),
             ("24_for_2x4x6", (24, 24, 24), 2, ((4, 6),), 2, r"2 repeats of the pattern hold 2 \* 24 = 48"),
             ("pattern_4x6x1", (24, 24, 24), 2, ((4, 6, 1),), 1, r"pattern must be \(rows, cols\) pairs"),
             ("pattern_0x6", (24, 24, 24), 2, ((4, 6), (0, 6)), 1, r"pattern must be \(rows, cols\) pairs"),
             ("pattern_4.0x6", (24, 24, 24), 2, ((4.0, 6),), 1, r"pattern must be \(rows, cols\) pairs"),
             ("repeats_0", (24, 24, 24), 2, ((4, 6),), 0, "repeats must be a positive integer"))
    for name, sizes, sched_size, pattern, repeats, match in cases:
        params, grads, momentum = (rng.standard_normal(n) for n in sizes)
        sched = np.array([1e-2, 1.0, 0.0][:sched_size])
        yield ErrorInput(Sample((params, grads, momentum, sched),
                                {**TEST_ATTRS, "pattern": pattern, "repeats": repeats}, name=name), match=match)


def model_inputs(rng, cfg, rows):
    """One call over the model's block matrices (the 2-D weights of a layer, in the buffer's order),
    repeated over its layers (`rows` does not matter)."""
    pattern = tuple(shape for name, shape in cfg.param_shapes().items()
                    if name.startswith("layers.0.") and len(shape) == 2)
    size = cfg.n_layers * sum(r * c for r, c in pattern)
    normal = rng.standard_normal
    return Sample((normal(size), normal(size), 0.1 * normal(size), np.array([3e-4, 5.0])),
                  {**TEST_ATTRS, "pattern": pattern, "repeats": cfg.n_layers}, name=f"L{cfg.n_layers}_C{cfg.dim}")


# The CUDA kernels run Newton-Schulz in bf16 (8 significant bits, through 3 ns_steps products), which
# leaves O a few percent off the float64 one. The params move by lr 0.2 sqrt(max(R, C)) O, about 2e-3
# an element in the samples (lr 1e-2); bf16 puts them up to 3e-4 away from the reference's (the samples
# drawn from 20 seeds), hence atol 5e-4. The momentum and the norm are float32 arithmetic on every backend.
TOL = Tol(rtol=1e-4, atol=5e-4)

OP = define_op(globals(), "Muon step: momentum orthogonalized by Newton-Schulz, global gradient-norm clipping "
                          "(in place)", inplace=(0, 2), tol=TOL)
