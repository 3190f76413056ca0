"""Token embedding on the GPU. See nanoeuler_ops/embedding.py for the math.

The backward scatters with atomic adds: rows of repeated ids add up without races, at the cost
of a summation order (and so the last bits of dtable) that can vary from run to run.
Ids outside [0, V) raise ValueError in eager mode; while a CUDA graph is captured they are not
checked on the host, and the kernels skip them (zero rows out, nothing added).
"""

from numba import cuda

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.embedding import check_ids

THREADS = 256


@cuda.jit
def _forward(ids, table, out):
    # ids (N,), table (V, C) -> out (N, C); one thread per output element
    i = cuda.grid(1)
    N, C = out.shape
    if i < N * C:
        n, c = i // C, i % C
        row = ids[n]
        out[n, c] = table[row, c] if 0 <= row < table.shape[0] else 0.0


@cuda.jit
def _backward(ids, dout, dtable):
    # ids (N,), dout (N, C) -> dtable (V, C) += dout scattered by id; dtable zeroed before
    i = cuda.grid(1)
    N, C = dout.shape
    if i < N * C:
        n, c = i // C, i % C
        row = ids[n]
        if 0 <= row < dtable.shape[0]:
            cuda.atomic.add(dtable, (row, c), dout[n, c])


def forward(ids, table):
    runtime.check_on_host(check_ids, ids, table.shape[0])
    out = runtime.empty((ids.shape[0], table.shape[1]), table.dtype)
    runtime.launch(_forward, runtime.blocks_for(out.size, THREADS), THREADS, ids, table, out)
    return out, ()


def backward(dout, saved, ids, table):
    dtable = runtime.zeros(table.shape, table.dtype)
    runtime.launch(_backward, runtime.blocks_for(dout.size, THREADS), THREADS, ids, dout, dtable)
    return None, dtable
