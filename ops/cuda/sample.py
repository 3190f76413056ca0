"""Choosing the next tokens on the GPU. See ops/sample.py for the rules and the random numbers (the
very `uniform` function compiled for the device).

One block of THREADS threads per row of logits (B, T, K, V). The row's decisions (accept, refuse,
which token) are taken by every thread alike from block-wide results, so the block follows one
path; the work over the vocabulary is split among its threads:
  argmax     each thread keeps its first largest logit, then a tree over threads (ties: lowest id);
  top-k      the k-th largest logit by bisection over the logits' bits (ordered as integers),
             counting with block sums: exact, whatever the order of the sums;
  top-p      the cut-off probability by bisection over the probabilities' bits, weighing with
             block sums;
  a draw     each thread sums a contiguous chunk of the weights, thread 0 walks the chunk sums and
             then the chosen chunk, in vocabulary order.
A token the row's mask leaves out is read as logit -inf (`_logit`). The distributions are written
to scratch rows in global memory, so any vocabulary size fits.
The helpers take their shared memory from the kernel (see device.block_reduce for why).
"""

import math

import numpy as np
from numba import cuda, float32, float64, int64

from nanoeuler_ops import sample as spec
from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.device import block_reduce, let_next_start, wait_for_previous
from nanoeuler_ops.sample import STREAM_ACCEPT, STREAM_DRAFT, STREAM_RESIDUAL, STREAM_SAMPLE, check_args

THREADS = 256   # a power of two
_uniform = cuda.jit(device=True)(spec.uniform)


@cuda.jit(device=True, inline=True)
def _key(bits):
    """The int32 bit pattern of a float32 as an integer with the floats' order."""
    b = int64(bits)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@cuda.jit(device=True, inline=True)
def _allowed(mask_row, i):
    """Whether the row's mask (ceil(V/32),) allows token i."""
    return (mask_row[i >> 5] >> (i & 31)) & 1 != 0


@cuda.jit(device=True, inline=True)
def _better(best, best_i, x, i, V, mask_row):
    """(best, best_i) after logit x at index i (ignored past V and where the mask leaves it out),
    indices visited in increasing order."""
    if i < V and _allowed(mask_row, i) and (x > best or best_i == V):
        return x, i
    return best, best_i


@cuda.jit(device=True)
def _argmax(row, mask_row, values, index):
    # row (V,) -> the first index of its largest value the mask (ceil(V/32),) allows, to every
    # thread; values, index (THREADS,) shared.
    # A thread asks for 8 of its logits at once before comparing any (one trip to memory, not 8).
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    V = row.shape[0]
    best, best_i = float32(-math.inf), int64(V)
    for i in range(tid, V, 8 * nt):
        x0, x1, x2, x3 = row[i], row[min(i + nt, V - 1)], row[min(i + 2 * nt, V - 1)], row[min(i + 3 * nt, V - 1)]
        x4, x5 = row[min(i + 4 * nt, V - 1)], row[min(i + 5 * nt, V - 1)]
        x6, x7 = row[min(i + 6 * nt, V - 1)], row[min(i + 7 * nt, V - 1)]
        best, best_i = _better(best, best_i, x0, i, V, mask_row)
        best, best_i = _better(best, best_i, x1, i + nt, V, mask_row)
        best, best_i = _better(best, best_i, x2, i + 2 * nt, V, mask_row)
        best, best_i = _better(best, best_i, x3, i + 3 * nt, V, mask_row)
        best, best_i = _better(best, best_i, x4, i + 4 * nt, V, mask_row)
        best, best_i = _better(best, best_i, x5, i + 5 * nt, V, mask_row)
        best, best_i = _better(best, best_i, x6, i + 6 * nt, V, mask_row)
        best, best_i = _better(best, best_i, x7, i + 7 * nt, V, mask_row)
    values[tid] = best
    index[tid] = best_i
    cuda.syncthreads()
    stride = nt // 2
    while stride > 0:
        if tid < stride:
            other, other_i = values[tid + stride], index[tid + stride]
            if other > values[tid] or (other == values[tid] and other_i < index[tid]):
                values[tid] = other
                index[tid] = other_i
        cuda.syncthreads()
        stride //= 2
    result = index[0]
    cuda.syncthreads()   # the arrays may be reused by the next call
    return result


@cuda.jit(device=True)
def _warp(z, z_bits, mask_row, temperature, top_k, top_p, p, p_bits, scratch):
    # logits z (V,) and their bits, the tokens the mask (ceil(V/32),) allows -> p (V,) the
    # distribution to draw from (p_bits: its bits); scratch: shared (32,) float64
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    V = z.shape[0]
    cut = int64(-(2**31))
    if 0 < top_k < V:   # cut = the k-th largest key: the largest key with >= top_k keys at or above it
        low, high = int64(-(2**31)), int64(2**31 - 1)
        while low < high:
            mid = low + (high - low + 1) // 2
            count = 0.0
            for i in range(tid, V, nt):
                if _allowed(mask_row, i) and _key(z_bits[i]) >= mid:
                    count += 1.0
            if block_reduce(count, False, scratch) >= top_k:
                low = mid
            else:
                high = mid - 1
        cut = low
    top = float32(-math.inf)
    for i in range(tid, V, nt):
        if _allowed(mask_row, i) and _key(z_bits[i]) >= cut:
            top = max(top, z[i] / temperature)
    top = float32(block_reduce(top, True, scratch))
    total = 0.0
    for i in range(tid, V, nt):
        e = math.exp(z[i] / temperature - top) if _allowed(mask_row, i) and _key(z_bits[i]) >= cut else float32(0.0)
        p[i] = e
        total += e
    total = block_reduce(total, False, scratch)
    for i in range(tid, V, nt):
        p[i] = p[i] / total
    if top_p < 1:   # cut = the largest probability whose tokens at or above it hold >= top_p of the mass
        low, high = int64(0), int64(0x7F800000)
        while low < high:
            mid = low + (high - low + 1) // 2
            mass = 0.0
            for i in range(tid, V, nt):
                if p_bits[i] >= mid:
                    mass += p[i]
            if block_reduce(mass, False, scratch) >= top_p:
                low = mid
            else:
                high = mid - 1
        total = 0.0
        for i in range(tid, V, nt):
            if p_bits[i] < low:
                p[i] = 0.0
            total += p[i]
        total = block_reduce(total, False, scratch)
        for i in range(tid, V, nt):
            p[i] = p[i] / total
    cuda.syncthreads()   # p complete for every thread


@cuda.jit(device=True)
def _draw(p, q, residual, u, chunk_sums, chosen, scratch):
    # weights p (V,), or max(p - q, 0) when `residual` (p when that is all 0) -> the first index
    # whose cumulative weight exceeds u times the total, to every thread; shared chunk_sums
    # (THREADS,) float64, chosen (1,) int64, scratch (32,) float64
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    V = p.shape[0]
    if residual:
        mass = 0.0
        for i in range(tid, V, nt):
            mass += max(p[i] - q[i], float32(0.0))
        residual = int64(1) if block_reduce(mass, False, scratch) > 0 else int64(0)
    chunk = (V + nt - 1) // nt
    first, last = tid * chunk, min(V, (tid + 1) * chunk)
    s = 0.0
    for i in range(first, last):
        s += max(p[i] - q[i], float32(0.0)) if residual else p[i]
    chunk_sums[tid] = s
    cuda.syncthreads()
    if tid == 0:
        total = 0.0
        for t in range(nt):
            total += chunk_sums[t]
        target = u * total
        cum = 0.0
        result = int64(-1)
        for t in range(nt):
            if cum + chunk_sums[t] > target and chunk_sums[t] > 0:
                for i in range(t * chunk, min(V, (t + 1) * chunk)):
                    w = max(p[i] - q[i], float32(0.0)) if residual else p[i]
                    if w > 0:
                        result = i
                        cum += w
                        if cum > target:
                            break
                break
            cum += chunk_sums[t]
        if result < 0:   # rounding left the target at the very end: the last token with weight
            for i in range(V):
                if (max(p[i] - q[i], float32(0.0)) if residual else p[i]) > 0:
                    result = i
        chosen[0] = result
    cuda.syncthreads()
    result = chosen[0]
    cuda.syncthreads()
    return result


@cuda.jit(cache=True)
def _sample(logits, logit_bits, tokens, drafts, draft_bits, seeds, counters, pos, temperatures, top_ks, top_ps,
            mask, max_pos, accepted, probs, prob_bits):
    # logits (B, T, K, V) (and their bits), tokens (B, K), drafts (B, K-1, V) (and bits), seeds,
    # counters, pos (B,), each row's temperature, top_k, top_p (B,), mask (B, ceil(V/32)) -> accepted (B,);
    # tokens, drafts, counters, pos updated; probs (B, V) scratch. Block b handles row b.
    B, T, K, V = logits.shape
    b = cuda.blockIdx.x
    values = cuda.shared.array(THREADS, float32)
    index = cuda.shared.array(THREADS, int64)
    chunk_sums = cuda.shared.array(THREADS, float64)
    chosen = cuda.shared.array(1, int64)
    scratch = cuda.shared.array(32, float64)
    let_next_start()
    wait_for_previous()
    temperature, top_k, top_p = float32(temperatures[b]), int64(top_ks[b]), float64(top_ps[b])
    greedy = temperature == 0
    seed, n, start, allowed = seeds[b], counters[b], pos[b], mask[b]
    m = 1
    following = int64(-1)
    for i in range(1, max(1, min(T, max_pos - start))):
        y = tokens[b, i]
        if greedy:
            best = _argmax(logits[b, i - 1, 0], allowed, values, index)
            if y != best:
                following = best
                break
        else:
            _warp(logits[b, i - 1, 0], logit_bits[b, i - 1, 0], allowed, temperature, top_k, top_p, probs[b],
                  prob_bits[b], scratch)
            if not _uniform(seed, n + i, STREAM_ACCEPT) * drafts[b, i - 1, y] < probs[b, y]:
                following = _draw(probs[b], drafts[b, i - 1], int64(1), _uniform(seed, n + i, STREAM_RESIDUAL),
                                  chunk_sums, chosen, scratch)
                break
        m += 1
    if following < 0:
        if greedy:
            following = _argmax(logits[b, m - 1, 0], allowed, values, index)
        else:
            _warp(logits[b, m - 1, 0], logit_bits[b, m - 1, 0], allowed, temperature, top_k, top_p, probs[b],
                  prob_bits[b], scratch)
            following = _draw(probs[b], probs[b], int64(0), _uniform(seed, n + m, STREAM_SAMPLE), chunk_sums, chosen,
                              scratch)
    for j in range(1, K):   # the row's state is written by thread 0 alone, after every thread has read it
        if greedy:
            proposal = _argmax(logits[b, m - 1, j], allowed, values, index)
        else:
            _warp(logits[b, m - 1, j], logit_bits[b, m - 1, j], allowed, temperature, top_k, top_p, drafts[b, j - 1],
                  draft_bits[b, j - 1], scratch)
            proposal = _draw(drafts[b, j - 1], drafts[b, j - 1], int64(0), _uniform(seed, n + m + j, STREAM_DRAFT),
                             chunk_sums, chosen, scratch)
        if cuda.threadIdx.x == 0:
            tokens[b, j] = proposal
    if cuda.threadIdx.x == 0:
        tokens[b, 0] = following
        counters[b] = n + m
        pos[b] = start + m
        accepted[b] = m


def forward(logits, tokens, drafts, seeds, counters, pos, temperature, top_k, top_p, mask, *, max_pos):
    check_args(logits, tokens, drafts, seeds, counters, pos, temperature, top_k, top_p, mask)
    B, T, K, V = logits.shape
    accepted = runtime.empty((B,), np.int64)
    probs = runtime.empty((B, V), logits.dtype)
    runtime.launch(_sample, B, THREADS, logits, logits.view(np.int32), tokens, drafts, drafts.view(np.int32), seeds,
                   counters, pos, temperature, top_k, top_p, mask, int64(max_pos), accepted, probs, probs.view(np.int32),
                   overlap=True)
    return accepted, ()
