"""The fused classifier on the CPU: the chunk schedule of ops/classifier.py (the math
and the fused call are described there), its products on OpenBLAS's sgemm tiled over Numba's
threads (common.gemm, as the linear op's; beta = 1 where a gradient is added), and one Numba
pass over each chunk's rows."""

import numpy as np
from numba import njit, prange

from nanoeuler_ops.classifier import check_shapes, run_chunks
from nanoeuler_ops.cpu.common import REDUCE_FASTMATH, exp32, gemm, max32
from nanoeuler_ops.cross_entropy import check_targets


def forward(h, w, targets, *, chunk_rows=None, dlosses=None, into=None):
    # h (N, C), w (K V, C), targets (K, N) -> losses (K, N); with dlosses (K, N): (dh (N, C), dw (K V, C), None)
    check_targets(targets, check_shapes(h, w, targets)[2])
    return run_chunks(h, w, targets, dlosses, into, chunk_rows, empty=np.empty, matmul=gemm, rows_kernel=_rows)


def backward(dlosses, saved, h, w, targets, *, chunk_rows=None, into=None):
    # dlosses (K, N) -> dh (N, C), dw (K V, C), None; each added into `into`'s array where it has one
    return forward(h, w, targets, chunk_rows=chunk_rows, dlosses=dlosses, into=into)[1]


def _rows(logits, targets, dlosses, losses):
    _softmax_xent(logits, targets, losses if dlosses is None else dlosses, losses, dlosses is not None)


@njit(parallel=True, cache=True, fastmath=REDUCE_FASTMATH)
def _softmax_xent(logits, targets, dlosses, losses, with_grad):
    # logits (R, V), targets (R,), dlosses (R,) -> losses (R,); logits are overwritten by their
    # exponentials, and with_grad by dlogits = dlosses * (softmax - onehot) (0 where ignored)
    R, V = logits.shape
    for r in prange(R):
        top = max32(logits[r], V)
        t = targets[r]
        picked = logits[r, t] if t >= 0 else top   # read before the row is overwritten
        total = np.float32(0.0)
        for c in range(V):
            e = exp32(logits[r, c] - top)
            logits[r, c] = e
            total += e
        losses[r] = 0.0 if t < 0 else top + np.log(total) - picked
        if with_grad:
            dloss = dlosses[r] if t >= 0 else np.float32(0.0)
            scale = dloss / total
            for c in range(V):
                logits[r, c] *= scale
            if t >= 0:
                logits[r, t] -= dloss
