"""Token embedding on the GPU. See nanoeuler_ops/embedding.py for the math.

The backward gives each table row to one thread block, which scans the ids in order and adds
the matching rows of dout: no atomics, so the sum's order, and dtable to the last bit, is the
same on every run (a replayed CUDA graph and the eager step agree exactly).
Ids outside [0, V) raise ValueError in eager mode; while a CUDA graph is captured they are not
checked on the host, and the kernels skip them (zero rows out, nothing added).
"""

from numba import cuda, int64

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.embedding import check_ids

THREADS = 256
CHUNK = 1024  # ids staged in shared memory at a time by the backward


@cuda.jit(cache=True)
def _forward(ids, table, out):
    # ids (N,), table (V, C) -> out (N, C); one thread per output element
    i = cuda.grid(1)
    N, C = out.shape
    if i < N * C:
        n, c = i // C, i % C
        row = ids[n]
        out[n, c] = table[row, c] if 0 <= row < table.shape[0] else 0.0


@cuda.jit(cache=True)
def _backward(ids, dout, dtable):
    # ids (N,), dout (N, C) -> dtable (V, C), zeroed before; block v owns row v: it scans the ids,
    # CHUNK at a time through shared memory, and adds dout[n] for every n with ids[n] == v, in order
    v = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    N, C = dout.shape
    chunk = cuda.shared.array(CHUNK, int64)
    for start in range(0, N, CHUNK):
        cuda.syncthreads()
        for i in range(tid, CHUNK, THREADS):
            chunk[i] = ids[start + i] if start + i < N else -1
        cuda.syncthreads()
        for i in range(min(CHUNK, N - start)):
            if chunk[i] == v:
                for c in range(tid, C, THREADS):
                    dtable[v, c] += dout[start + i, c]


def forward(ids, table):
    runtime.check_on_host(check_ids, ids, table.shape[0])
    out = runtime.empty((ids.shape[0], table.shape[1]), table.dtype)
    runtime.launch(_forward, runtime.blocks_for(out.size, THREADS), THREADS, ids, table, out)
    return out, ()


def backward(dout, saved, ids, table):
    dtable = runtime.zeros(table.shape, table.dtype)
    runtime.launch(_backward, table.shape[0], THREADS, ids, dout, dtable)
    return None, dtable
