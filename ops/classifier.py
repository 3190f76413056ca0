"""The K output heads and their cross-entropy in one op, as llm.c's fused_classifier: the logits
are made in chunks of rows, and each chunk is reduced to its losses and overwritten by its own
gradient in place, so that no more than one chunk of one head's logits exists at a time.

Shapes: h (N, C) the final hidden state; w (K V, C) the K head matrices stacked by rows (head j
is rows [j V, (j + 1) V)); targets (K, N) int64 in [-1, V), head j's target for each row
-> losses (K, N); saved ().

    logits_j = h @ w_j.T                                        (N, V)
    losses[j, n] = cross_entropy(logits_j[n], targets[j, n])    (0 where the target is -1)

Backward, with dlogits_j = dlosses[j, :, None] * (softmax(logits_j) - onehot(targets[j])), rows
whose target is -1 zero:

    dh = sum_j dlogits_j @ w_j     (N, C)
    dw_j = dlogits_j.T @ h         (V, C)

Both can be added into the caller's arrays (`into`): dw into the gradient buffer's heads, dh
into a gradient the final hidden state already has.

The fused call. Training knows dlosses (each row's weight in the objective) before the forward,
so one call does both: `forward(h, w, targets, dlosses=..., into=...)` returns `(losses, (dh, dw,
None))`, the backward's result in the place of `saved`. The kernels (`run_chunks`) walk the
heads, and each head's rows `chunk_rows` at a time: one matrix product makes the chunk's logits
(in the storage of h: bf16 in bf16, with float32 statistics), one pass per row gives its
log-sum-exp and loss and, when gradients are asked for, writes dlogits over the logits, which two
products then add into dh and dw_j. `backward` is the same call with its losses dropped, so the
registry's checks of backward check the path training takes. In bf16, dh is bf16 and dw and the
losses float32.
"""

import numpy as np

from nanoeuler_core.registry import ErrorInput, Sample, define_op
from nanoeuler_ops import accumulated, cross_entropy
from nanoeuler_ops.cross_entropy import IGNORE, check_targets

LOGITS_PER_CHUNK = 1 << 24   # logits in one chunk by default: 32 MiB in bf16, 4,096 rows of a 4,096-entry vocabulary


def check_shapes(h, w, targets, chunk_rows=None) -> tuple[int, int, int, int]:
    """(K, N, V, rows per chunk) of a call; ValueError unless the shapes fit together (every
    backend calls this; the target values are checked by cross_entropy.check_targets)."""
    if len(h.shape) != 2 or len(w.shape) != 2 or len(targets.shape) != 2:
        raise ValueError(f"classifier: h (N, C), w (K V, C) and targets (K, N) must be 2-D, got shapes "
                         f"{h.shape}, {w.shape}, {targets.shape}")
    (N, C), (K, n_targets) = h.shape, targets.shape
    if n_targets != N or K < 1 or w.shape[0] % K or w.shape[1] != C:
        raise ValueError(f"classifier: h {h.shape}, w {w.shape} and targets {targets.shape} do not fit "
                         f"h (N, C), w (K V, C), targets (K, N)")
    V = w.shape[0] // K
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"classifier: chunk_rows must be at least 1, got {chunk_rows}")
    rows = chunk_rows or max(1, LOGITS_PER_CHUNK // V)
    return K, N, V, max(1, min(rows, N))


def run_chunks(h, w, targets, dlosses, into, chunk_rows, *, empty, matmul, rows_kernel):
    """The fused call's schedule, which every backend runs with its own primitives: `empty(shape,
    dtype)` allocates, `matmul(a, b, out, trans_a, trans_b, accumulate)` is out (+)= op(a) @ op(b)
    (nanoeuler_ops.cuda.cublas.matmul's signature), and `rows_kernel(logits, targets, dlosses,
    losses)` fills the chunk rows' losses and, given dlosses, writes their gradient over their logits.
    Returns (losses (K, N) float32, (dh, dw, None) or () without dlosses)."""
    K, N, V, rows = check_shapes(h, w, targets, chunk_rows)
    losses = empty((K, N), np.float32)
    logits = empty((rows, V), h.dtype)   # the one chunk of logits
    if dlosses is not None:
        dh_into, dw_into = (into or (None, None))[:2]
        dh = empty(h.shape, h.dtype) if dh_into is None else dh_into
        dw = empty(w.shape, np.float32) if dw_into is None else dw_into
    for j in range(K):
        w_j = w[j * V:(j + 1) * V]
        for r0 in range(0, N, rows):
            r1 = min(N, r0 + rows)
            chunk, h_rows = logits[:r1 - r0], h[r0:r1]
            matmul(h_rows, w_j, chunk, trans_b=True)
            rows_kernel(chunk, targets[j, r0:r1], None if dlosses is None else dlosses[j, r0:r1], losses[j, r0:r1])
            if dlosses is not None:   # chunk now holds dlogits
                matmul(chunk, w_j, dh[r0:r1], accumulate=j > 0 or dh_into is not None)
                matmul(chunk, h_rows, dw[j * V:(j + 1) * V], trans_a=True, accumulate=r0 > 0 or dw_into is not None)
    return losses, (() if dlosses is None else (dh, dw, None))


# ------------------------------------------------------------------------------------------------
# the float64 reference: each head whole, through cross_entropy's reference

def _heads(w, K):
    V = w.shape[0] // K
    return [w[j * V:(j + 1) * V] for j in range(K)]


def forward(h, w, targets, *, chunk_rows=None, dlosses=None, into=None):
    K, _, V, _ = check_shapes(h, w, targets, chunk_rows)
    check_targets(targets, V)
    losses = np.stack([cross_entropy.forward(h @ w_j.T, targets[j])[0] for j, w_j in enumerate(_heads(w, K))])
    if dlosses is None:
        return losses, ()
    return losses, backward(dlosses, (), h, w, targets, chunk_rows=chunk_rows, into=into)


def backward(dlosses, saved, h, w, targets, *, chunk_rows=None, into=None):
    dh, dw = np.zeros_like(h), []
    for j, w_j in enumerate(_heads(w, targets.shape[0])):
        logits = h @ w_j.T
        _, ce_saved = cross_entropy.forward(logits, targets[j])
        dlogits, _ = cross_entropy.backward(dlosses[j], ce_saved, logits, targets[j])
        dh += dlogits @ w_j
        dw.append(dlogits.T @ h)
    return accumulated((dh, np.concatenate(dw), None), into)


def sample_inputs(rng):
    # (N, C, V, K, chunk_rows): two chunks of each head, the last one short, in every precision;
    # the default chunking (a chunk a head, more rows than a CUDA block takes). Small: the CUDA
    # simulator is slow.
    for n, c, v, k, rows in ((5, 5, 11, 2, 3), (10, 8, 20, 3, None)):
        h = rng.standard_normal((n, c))
        w = 2.0 * rng.standard_normal((k * v, c)) / c ** 0.5
        targets = rng.integers(0, v, (k, n))
        for j in range(k):
            targets[j, rng.integers(n)] = IGNORE
        yield Sample((h, w, targets), {"chunk_rows": rows}, grad_inputs=(0, 1), name=f"N{n}_V{v}_K{k}_rows{rows}",
                     precisions=("fp32", "tf32", "bf16") if rows else ("fp32",))


def error_inputs(rng):
    # h (3, 4) against (w's shape, targets' shape, chunk_rows, a target out of range): K = 2 heads of
    # V = 5 fit w (10, 4) and targets (2, 3)
    cases = (("targets_K2_N4_for_N3", (10, 4), (2, 4), None, False, "do not fit"),
             ("w_rows_not_K_V", (9, 4), (2, 3), None, False, "do not fit"),
             ("w_C5_for_C4", (10, 5), (2, 3), None, False, "do not fit"),
             ("targets_1d", (10, 4), (3,), None, False, "must be 2-D"),
             ("chunk_rows_0", (10, 4), (2, 3), 0, False, "chunk_rows must be at least 1"),
             ("target_V", (10, 4), (2, 3), None, True, r"targets must lie in \[-1, 5\)"))
    for name, w_shape, targets_shape, chunk_rows, out_of_range, match in cases:
        h, w = rng.standard_normal((3, 4)), rng.standard_normal(w_shape)
        targets = rng.integers(0, 5, targets_shape)
        if out_of_range:
            targets[0, 1] = 5
        yield ErrorInput(Sample((h, w, targets), {"chunk_rows": chunk_rows}, name=name), match=match)


OP = define_op(globals(), "The K output heads' logits and cross-entropy, fused, in chunks of rows "
                          "(loss and gradients in one pass)",
               accumulates=(0, 1), precisions={"cuda": ("tf32", "bf16")})
