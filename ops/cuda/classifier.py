"""The fused classifier on the GPU: the chunk schedule of ops/classifier.py (the math and
the fused call are described there), its products on cuBLAS (cublas.matmul; beta = 1 where a
gradient is added), and one kernel over each chunk's rows. The chunk of logits, and the dlogits
written over it, are float32 or bf16 storage (h's); losses and the row statistics are float32.

One warp per row: each lane keeps a running max and a sum of exponentials rescaled to it (an
online softmax, one pass), the warp combines them by shuffles, then, for a gradient, each lane
rewrites its logits as dlosses * (softmax - onehot). The target's logit is picked up in the first
pass, before anything is overwritten. Targets outside [-1, V) raise ValueError in eager mode;
while a CUDA graph is captured they are not checked on the host, and such a row's loss is NaN
(and its gradient row zero).
"""

import functools
import math

import numpy as np
from numba import cuda, float32

from nanoeuler_ops.classifier import check_shapes, run_chunks
from nanoeuler_ops.cross_entropy import IGNORE, check_targets
from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.cublas import matmul
from nanoeuler_ops.cuda.device import WARP, stored, to_f32, warp_max, warp_sum

ROWS = 8   # rows (warps) per block, fewer for a chunk of fewer rows


def forward(h, w, targets, *, chunk_rows=None, dlosses=None, into=None, precision):
    # h (N, C), w (K V, C), targets (K, N) -> losses (K, N); with dlosses (K, N): (dh (N, C), dw (K V, C), None)
    runtime.check_on_host(check_targets, targets, check_shapes(h, w, targets)[2])
    return run_chunks(h, w, targets, dlosses, into, chunk_rows, empty=runtime.empty,
                      matmul=functools.partial(matmul, tf32=precision.tf32), rows_kernel=_rows)


def backward(dlosses, saved, h, w, targets, *, chunk_rows=None, into=None, precision):
    # dlosses (K, N) -> dh (N, C), dw (K V, C), None; each added into `into`'s array where it has one
    return forward(h, w, targets, chunk_rows=chunk_rows, dlosses=dlosses, into=into, precision=precision)[1]


def _rows(logits, targets, dlosses, losses):
    rows = min(ROWS, logits.shape[0])
    runtime.launch(_softmax_xent, runtime.blocks_for(logits.shape[0], rows), rows * WARP, logits, targets,
                   losses if dlosses is None else dlosses, losses, dlosses is not None)


@cuda.jit(cache=True)
def _softmax_xent(logits, targets, dlosses, losses, with_grad):
    # logits (R, V), targets (R,), dlosses (R,) -> losses (R,); with_grad, logits <- dlogits in place
    R, V = logits.shape
    n = cuda.blockIdx.x * (cuda.blockDim.x // WARP) + cuda.threadIdx.x // WARP
    lane = cuda.threadIdx.x % WARP
    t = targets[n] if n < R else IGNORE
    row_lse, picked = _row_statistics(logits, n, t, lane)
    if n < R:
        valid = 0 <= t < V
        if lane == 0:
            losses[n] = float32(0.0) if t == IGNORE else row_lse - picked if valid else math.nan
        if with_grad:
            weight = dlosses[n] if valid else float32(0.0)
            for c in range(lane, V, WARP):
                onehot = float32(1.0) if c == t else float32(0.0)
                logits[n, c] = stored(logits, weight * (math.exp(to_f32(logits[n, c]) - row_lse) - onehot))


@cuda.jit(device=True)
def _row_statistics(logits, n, t, lane):
    """(log-sum-exp of row n of logits, its logit at column t, 0 if none), to every lane of the
    row's warp, in one pass: each lane sums the exponentials of its columns against its running
    max, rescaling the sum when the max rises, then the lanes combine. Every lane of the warp calls
    it (the shuffles), a row past the last one (n >= R) with nothing to add."""
    R, V = logits.shape
    top, total, picked = float32(-math.inf), float32(0.0), float32(0.0)
    for c in range(lane, V if n < R else 0, WARP):
        z = to_f32(logits[n, c])
        picked = z if c == t else picked
        if z > top:
            total, top = total * math.exp(top - z) + float32(1.0), z
        else:
            total += math.exp(z - top)
    row_top = warp_max(top)
    total = warp_sum(total * math.exp(top - row_top) if top > -math.inf else float32(0.0))
    picked = warp_sum(picked)
    return (row_top + math.log(total) if n < R else float32(0.0)), picked
