"""Cross-entropy on the CPU. See ops/cross_entropy.py for the math."""

import numpy as np
from numba import njit, prange

from nanoeuler_ops.cpu.common import REDUCE_FASTMATH, exp32
from nanoeuler_ops.cross_entropy import check_targets


@njit(parallel=True, cache=True, fastmath=REDUCE_FASTMATH)
def _forward(logits, targets, losses, lse):
    # logits (N, V), targets (N,) -> losses (N,), lse (N,)
    N, V = logits.shape
    for n in prange(N):
        top = logits[n, 0]
        for c in range(1, V):
            top = max(top, logits[n, c])
        total = np.float32(0.0)
        for c in range(V):
            total += exp32(logits[n, c] - top)
        row_lse = top + np.log(total)
        lse[n] = row_lse
        target = targets[n]
        losses[n] = 0.0 if target < 0 else row_lse - logits[n, target]


@njit(parallel=True, cache=True)
def _backward(dlosses, logits, targets, lse, dlogits):
    # dlosses (N,), logits (N, V), targets (N,), lse (N,) -> dlogits (N, V)
    N, V = logits.shape
    for n in prange(N):
        target = targets[n]
        dloss = dlosses[n] if target >= 0 else np.float32(0.0)
        row_lse = lse[n]
        for c in range(V):
            dlogits[n, c] = dloss * exp32(logits[n, c] - row_lse)
        if target >= 0:
            dlogits[n, target] -= dloss


def forward(logits, targets):
    check_targets(targets, logits.shape[1], logits.shape[0])
    losses = np.empty(logits.shape[0], dtype=logits.dtype)
    lse = np.empty_like(losses)
    _forward(logits, targets, losses, lse)
    return losses, (lse,)


def backward(dlosses, saved, logits, targets):
    (lse,) = saved
    dlogits = np.empty_like(logits)
    _backward(dlosses, logits, targets, lse, dlogits)
    return dlogits, None
