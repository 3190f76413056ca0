"""Token embedding on the CPU. See ops/embedding.py for the math."""

import numpy as np
from numba import njit, prange

from nanoeuler_ops.cpu import BACKEND
from nanoeuler_ops.embedding import check_ids


@njit(parallel=True, cache=True)
def _forward(ids, table, out):
    # ids (N,), table (V, C) -> out (N, C)
    N, C = out.shape
    for n in prange(N):
        row = ids[n]
        for c in range(C):
            out[n, c] = table[row, c]


@njit(parallel=True, cache=True)
def _backward(order, starts, dout, dtable, accumulate):
    # order (N,) positions sorted by id, starts (V+1,): id v was at positions order[starts[v]:starts[v+1]];
    # dout (N, C) -> dtable (V, C) (+ dtable with accumulate). Each thread owns whole rows of dtable, so
    # a repeated id never has two threads adding into one element, and every row is summed in position
    # order (deterministic).
    V, C = dtable.shape
    for v in prange(V):
        if not accumulate:
            for c in range(C):
                dtable[v, c] = 0.0
        for k in range(starts[v], starts[v + 1]):
            n = order[k]
            for c in range(C):
                dtable[v, c] += dout[n, c]


def forward(ids, table):
    check_ids(ids, table.shape[0])
    out = np.empty((ids.shape[0], table.shape[1]), dtype=table.dtype)
    BACKEND.launch(_forward, ids, table, out)   # ids of any integer type: no copy a replay would miss
    return out, ()


def backward(dout, saved, ids, table, *, into=None):
    order = np.argsort(ids, kind="stable")
    starts = np.searchsorted(ids[order], np.arange(table.shape[0] + 1))
    dtable_into = into[1] if into else None
    dtable = np.empty(table.shape, dtype=table.dtype) if dtable_into is None else dtable_into
    _backward(order, starts, dout, dtable, dtable_into is not None)
    return None, dtable
