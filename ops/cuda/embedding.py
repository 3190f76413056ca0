"""Token embedding on the GPU. See ops/embedding.py for the math. The table may be
float32 or bf16 (the output has its storage); the table's gradient is float32.

The backward gives each block a few table rows: it scans the ids in order, 32 at a time per warp
(a ballot marks the ids in its rows), and adds the matching rows of dout, each thread its own
columns. No atomics: the sum's order, and dtable to the last bit, is the same on every run (a
replayed CUDA graph and the eager step agree exactly). The ids are read once per block, not once
per table row.
Ids outside [0, V) raise ValueError in eager mode; while a CUDA graph is captured they are not
checked on the host, and the kernels skip them (zero rows out, nothing added).
"""

from functools import cache

import numpy as np
from numba import cuda, float32, int64, uint32, uint64

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.device import WARP, stored, to_f32, warp_ballot
from nanoeuler_ops.embedding import check_ids

THREADS = 256
ROWS = 8       # table rows a backward block owns
CHUNK = 1024   # ids staged in shared memory at a time by the backward


@cuda.jit(cache=True)
def _forward(ids, table, out):
    # ids (N,), table (V, C) -> out (N, C); one thread per output element
    i = cuda.grid(1)
    N, C = out.shape
    if i < N * C:
        n, c = i // C, i % C
        row = ids[n]
        out[n, c] = stored(out, to_f32(table[row, c]) if 0 <= row < table.shape[0] else float32(0.0))


@cache
def _backward(cols: int):
    """The backward kernel for rows of at most cols * THREADS elements."""

    @cuda.jit
    def backward(ids, dout, dtable, accumulate):
        # ids (N,), dout (N, C) -> dtable (V, C) float32 (+ dtable with accumulate); block owns rows
        # v0 .. v0 + ROWS - 1, thread tid the columns tid + THREADS j
        N, C = dout.shape
        v0 = cuda.blockIdx.x * ROWS
        tid = cuda.threadIdx.x
        lane = tid % WARP
        chunk = cuda.shared.array(CHUNK, int64)
        acc = cuda.local.array((ROWS, cols), float32)
        for r in range(ROWS):
            for j in range(cols):
                acc[r, j] = float32(0.0)
        for start in range(0, N, CHUNK):
            cuda.syncthreads()
            for i in range(tid, CHUNK, THREADS):
                chunk[i] = ids[start + i] if start + i < N else -1
            cuda.syncthreads()
            for group in range(0, min(CHUNK, N - start), WARP):
                row = chunk[group + lane] - v0
                mask = uint64(uint32(warp_ballot(0 <= row < ROWS)))   # zero-extended: 32 bits at most
                while mask:
                    first = cuda.ffs(mask) - 1
                    mask &= mask - uint64(1)
                    n = start + group + first
                    match = chunk[group + first] - v0
                    for r in range(ROWS):   # unrolled: acc stays in registers
                        if r == match:
                            for j in range(cols):
                                c = tid + THREADS * j
                                if c < C:
                                    acc[r, j] += to_f32(dout[n, c])
        for r in range(ROWS):
            if v0 + r < dtable.shape[0]:
                for j in range(cols):
                    c = tid + THREADS * j
                    if c < C:
                        dtable[v0 + r, c] = acc[r, j] + dtable[v0 + r, c] if accumulate else acc[r, j]

    return backward


def forward(ids, table):
    runtime.check_on_host(check_ids, ids, table.shape[0])
    out = runtime.empty((ids.shape[0], table.shape[1]), table.dtype)
    runtime.launch(_forward, runtime.blocks_for(out.size, THREADS), THREADS, ids, table, out)
    return out, ()


def backward(dout, saved, ids, table, *, into=None):
    V, C = table.shape
    dtable_into = into[1] if into else None
    dtable = runtime.empty(table.shape, np.float32) if dtable_into is None else dtable_into
    runtime.launch(_backward(runtime.blocks_for(C, THREADS)), runtime.blocks_for(V, ROWS), THREADS, ids, dout, dtable,
                   dtable_into is not None)
    return None, dtable
