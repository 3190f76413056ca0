"""Cross-entropy with the softmax fused in, on the GPU. See ops/cross_entropy.py.
Logits (and their gradient) are float32 or bf16 storage; losses and lse are float32.

One warp per row: each lane keeps a running max and a sum of exponentials rescaled to it (an
online softmax, one pass over the logits), then the warp combines the lanes' pairs by shuffles.
Targets outside [-1, V) raise ValueError in eager mode; while a CUDA graph is captured they are
not checked on the host, and such a row's loss is NaN (and its gradient row zero).
"""

import math

import numpy as np
from numba import cuda, float32

from nanoeuler_ops.cross_entropy import IGNORE, check_targets
from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.device import WARP, stored, to_f32, warp_max, warp_sum

ROWS = 8   # rows (warps) per block


@cuda.jit(cache=True)
def _forward(logits, targets, losses, lse):
    # logits (N, V), targets (N,) -> losses (N,), lse (N,); one warp per row
    N, V = logits.shape
    n = cuda.blockIdx.x * ROWS + cuda.threadIdx.x // WARP
    lane = cuda.threadIdx.x % WARP
    top = float32(-math.inf)
    total = float32(0.0)
    if n < N:
        for c in range(lane, V, WARP):
            z = to_f32(logits[n, c])
            if z > top:
                total = total * math.exp(top - z) + float32(1.0)
                top = z
            else:
                total += math.exp(z - top)
    row_top = warp_max(top)
    total = warp_sum(total * math.exp(top - row_top) if top > -math.inf else float32(0.0))
    if n < N and lane == 0:
        row_lse = row_top + math.log(total)
        lse[n] = row_lse
        t = targets[n]
        if t == IGNORE:
            losses[n] = 0.0
        elif 0 <= t < V:
            losses[n] = row_lse - to_f32(logits[n, t])
        else:
            losses[n] = math.nan


@cuda.jit(cache=True)
def _backward(dlosses, logits, targets, lse, dlogits):
    # dlosses (N,), logits (N, V), targets (N,), lse (N,) -> dlogits (N, V); one warp per row
    N, V = logits.shape
    n = cuda.blockIdx.x * ROWS + cuda.threadIdx.x // WARP
    lane = cuda.threadIdx.x % WARP
    if n < N:
        t = targets[n]
        weight = dlosses[n] if 0 <= t < V else float32(0.0)
        row_lse = lse[n]
        for c in range(lane, V, WARP):
            onehot = float32(1.0) if c == t else float32(0.0)
            dlogits[n, c] = stored(dlogits, weight * (math.exp(to_f32(logits[n, c]) - row_lse) - onehot))


def forward(logits, targets):
    runtime.check_on_host(check_targets, targets, logits.shape[1], logits.shape[0])
    N = logits.shape[0]
    losses = runtime.empty((N,), np.float32)
    lse = runtime.empty((N,), np.float32)
    runtime.launch(_forward, runtime.blocks_for(N, ROWS), ROWS * WARP, logits, targets, losses, lse)
    return losses, (lse,)


def backward(dlosses, saved, logits, targets):
    (lse,) = saved
    dlogits = runtime.empty(logits.shape, logits.dtype)
    runtime.launch(_backward, runtime.blocks_for(logits.shape[0], ROWS), ROWS * WARP,
                   dlosses, logits, targets, lse, dlogits)
    return dlogits, None
