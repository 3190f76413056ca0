"""One decoding block on the GPU in one launch. See nanoeuler_ops/decode_block.py for the math.

At decoding's few rows a block is a chain of small steps, each waiting on the last; as kernels of
their own, each pays a launch and the GPU's drain. Here one persistent kernel (runtime, "Persistent
kernels") walks them as phases, a grid-wide barrier between two:

  0. qkv = rmsnorm(x) attn_norm @ wqkv.T      a warp per output column
  1. attention over splits of WARP keys        a warp per (row, query head, split): lane = key
  2. the splits combined: o                    a warp per (row, query head): lane = dimension
  3. h = x + o @ wo.T                          a warp per output column
  4. act = silu(n @ w_gate.T) * (n @ w_up.T)   a warp per hidden feature, n = rmsnorm(h) ffn_norm
  5. y = h + act @ w_down.T                    a warp per output column

Before it waits for the kernel ahead of it, each thread asks for a few lines of the block's
matrices to come into L2: they arrive while that kernel ends, and the phases find them there.

Products. The warp of output column o holds row o of the matrix in registers, lane l its pairs l,
l + 32, ... (runtime.pairs: a word per two elements; as many words a lane as the row needs, fixed
when the kernel compiles), and walks the input's rows one at a time: each lane adds its pairs'
products in order, then warp_sum adds the lanes by a fixed tree. So a row's result depends on the
row alone (batch invariance), and the matrix is read once whatever the rows.

Attention. Lane l of the warp for (row n, query head hq, split sp) holds key s = sp * WARP + l: its
score against the row's query (rotated at the row's position p by every lane alike), the key read
from the cache (s < pos[b]) or from this call's qkv and rotated at s (a token of this call: no warp
waits for another to write it into the cache); the split's max and sum of exponentials over the
lanes; then the split's values are staged in shared memory WARP dimensions at a time, lane = key,
and lane l adds dimension l of them over the keys in order. The warp of the group's first query head
whose lane holds s == p writes the row's own key and value into the cache at p; no warp of this call
reads the cache there. The combine is the decode_attention op's: each head's splits rescaled to the
overall max and added in split order.

In each phase every warp walks the same number of rounds (a warp past the last item works on nothing
and writes nothing), so every lane joins every shuffle, and every thread the simulator's reductions,
which synchronise the block.
"""

import math
from functools import cache

import numpy as np
from numba import cuda, float32, uint64

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.cuda.decode_attention import rope_table
from nanoeuler_ops.cuda.rmsnorm import load_row
from nanoeuler_ops.cuda.runtime import (SIMULATOR, WARP, grid_barrier, leave_grid, let_next_start, pair_values, pairs,
                                        prefetch_l2, stored, sync_warp, to_f32, wait_for_previous, warp_max, warp_sum)
from nanoeuler_ops.decode_block import check_shapes

PHASES = 6
WARPS = 2 if SIMULATOR else 8     # warps a block (two keep the simulator quick)
BLOCKS_PER_SM = 2                 # at most: fewer blocks, fewer arrivals at each barrier
MAX_WORDS = 64                    # pairs a lane holds of a matrix row: rows of up to 4096 elements
PREFETCH_WORDS = 16               # words a prefetch asks for (a 128-byte line of float32 pairs)
STAGED = WARP + 1                 # a staged key's row of values, padded: no bank conflicts


def _words(n: int) -> int:
    """Words a lane holds of a row of n elements."""
    return max(1, -(-n // (2 * WARP)))


@cache
def _kernel(D: int, WC: int, WHD: int, WF: int):
    """The kernel for head size D and rows of WC, WHD and WF words a lane (C, H D and F elements)."""
    HALF = D // 2
    DIM_ROUNDS = -(-D // WARP)
    WORDS = max(WC, WHD, WF)
    scale = float32(1.0 / math.sqrt(D))

    @cuda.jit(device=True, inline=True)
    def lane_dot(weights, K, g, scaled, a, n, P, lane):
        # this lane's part of sum_c a[n, c] w[c] (times g[c] where scaled) and of sum_c a[n, c]^2, over
        # its pairs lane, lane + WARP, ... of a's row n (P pairs a row, 0 for none), in order
        dot = float32(0.0)
        squares = float32(0.0)
        row = uint64(n) * uint64(P)
        for k in range(K):
            p = lane + WARP * k
            if p < P:
                a_lo, a_hi = pair_values(a[row + uint64(p)])
                w_lo, w_hi = pair_values(weights[k])
                if scaled:
                    g_lo, g_hi = pair_values(g[p])
                    w_lo *= g_lo
                    w_hi *= g_hi
                dot += a_lo * w_lo + a_hi * w_hi
                squares += a_lo * a_lo + a_hi * a_hi
        return dot, squares

    @cuda.jit(device=True, inline=True)
    def prefetch(w, thread, threads):
        for i in range(thread * PREFETCH_WORDS, w.shape[0], threads * PREFETCH_WORDS):
            prefetch_l2(w, i)

    @cuda.jit(cache=True)
    def block(first, last, counter, x, x_pairs, attn_norm, wqkv, k_cache, v_cache, pos, cos, sin, wo, ffn_norm,
              w_gate_up, w_down, eps, T, H, KV, qkv, part_max, part_sum, part_o, o, o_pairs, h, h_pairs, act,
              act_pairs, y):
        # x (N, C) and its pairs; the norms' and matrices' pairs; caches (B, S, KV, D), pos (B,), cos, sin
        # (S, D/2) -> y (N, C); scratch qkv (N, (H + 2 KV) D), part_max, part_sum (N H, splits), part_o
        # (N H, splits, D), o (N, H D), h (N, C), act (N, F); phases first .. last - 1
        N, C = x.shape
        S, NS = k_cache.shape[1], part_max.shape[1]
        HD, F = o.shape[1], act.shape[1]
        G = H // KV
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        gw = cuda.blockIdx.x * (cuda.blockDim.x // WARP) + warp     # this warp in the grid
        n_warps = cuda.gridDim.x * (cuda.blockDim.x // WARP)
        words = cuda.local.array(WORDS, wqkv.dtype)
        words_up = cuda.local.array(WC, wqkv.dtype)
        weights_sh = cuda.shared.array((WARPS, WARP), float32)
        values_sh = cuda.shared.array((WARPS, WARP, STAGED), float32)
        if first == 0:
            thread = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
            threads = cuda.gridDim.x * cuda.blockDim.x
            prefetch(wqkv, thread, threads)
            prefetch(wo, thread, threads)
            prefetch(w_gate_up, thread, threads)
            prefetch(w_down, thread, threads)
        let_next_start()
        wait_for_previous()
        for phase in range(first, last):
            if phase > first:
                grid_barrier(counter, phase - first)
            if phase == 0:                                  # qkv = rmsnorm(x) attn_norm @ wqkv.T
                for base in range(0, qkv.shape[1], n_warps):
                    col = base + gw
                    P = C // 2 if col < qkv.shape[1] else 0
                    load_row(wqkv, col, P, lane, WC, words)
                    for n in range(N):
                        dot, squares = lane_dot(words, WC, attn_norm, True, x_pairs, n, P, lane)
                        dot = warp_sum(dot)
                        squares = warp_sum(squares)
                        if lane == 0 and P > 0:
                            rstd = float32(1.0) / math.sqrt(squares / float32(C) + eps)
                            qkv[n, col] = stored(qkv, dot * rstd)
            elif phase == 1:                                # each split's scores, max, sum and values
                items = N * H * NS
                for base in range(0, items, n_warps):
                    item = base + gw
                    sp = item % NS
                    row = item // NS                        # n * H + hq
                    hq = row % H
                    n = min(row // H, N - 1)
                    b = n // T
                    start = pos[b]
                    p = start + n % T
                    first_key = sp * WARP
                    ok = item < items and p >= 0 and p < S and first_key <= p
                    g = hq // G
                    s = first_key + lane
                    live = ok and s <= p                    # this lane holds a key
                    new = live and s >= start               # ... of this call: from qkv
                    source = b * T + s - start              # its row of qkv
                    writer = live and s == p and hq == g * G
                    dot = float32(0.0)
                    for j in range(HALF):
                        if live:
                            c, sn = cos[p, j], sin[p, j]
                            q1, q2 = to_f32(qkv[n, hq * D + j]), to_f32(qkv[n, hq * D + j + HALF])
                            qa, qb = q1 * c - q2 * sn, q2 * c + q1 * sn
                            if new:
                                c, sn = cos[s, j], sin[s, j]
                                k1 = to_f32(qkv[source, (H + g) * D + j])
                                k2 = to_f32(qkv[source, (H + g) * D + j + HALF])
                                ka, kb = k1 * c - k2 * sn, k2 * c + k1 * sn
                                if writer:
                                    k_cache[b, p, g, j] = stored(k_cache, ka)
                                    k_cache[b, p, g, j + HALF] = stored(k_cache, kb)
                            else:
                                ka, kb = to_f32(k_cache[b, s, g, j]), to_f32(k_cache[b, s, g, j + HALF])
                            dot += qa * ka + qb * kb
                    score = dot * scale if live else float32(-math.inf)
                    top = warp_max(score)
                    e = math.exp(score - top) if live else float32(0.0)
                    total = warp_sum(e)
                    weights_sh[warp, lane] = e
                    n_keys = min(WARP, p + 1 - first_key) if ok else 0
                    for r in range(DIM_ROUNDS):
                        for j in range(WARP):               # stage dimensions r WARP + j: lane = key
                            d = r * WARP + j
                            value = float32(0.0)
                            if live and d < D:
                                if new:
                                    value = to_f32(qkv[source, (H + KV + g) * D + d])
                                    if writer:
                                        v_cache[b, p, g, d] = stored(v_cache, value)
                                else:
                                    value = to_f32(v_cache[b, s, g, d])
                            values_sh[warp, lane, j] = value
                        sync_warp()
                        acc = float32(0.0)                  # lane = dimension
                        for k in range(WARP):
                            if k < n_keys:
                                acc += weights_sh[warp, k] * values_sh[warp, k, lane]
                        d = r * WARP + lane
                        if ok and d < D:
                            part_o[row, sp, d] = acc
                        sync_warp()                         # the values are read before the next ones
                    if ok and lane == 0:
                        part_max[row, sp] = top
                        part_sum[row, sp] = total
            elif phase == 2:                                # o: the splits rescaled and added in order
                for base in range(0, N * H, n_warps):
                    row = base + gw
                    if row < N * H:
                        n, hq = row // H, row % H
                        p = pos[n // T] + n % T
                        valid = p >= 0 and p < S
                        n_splits = p // WARP + 1 if valid else 0
                        top = float32(-math.inf)
                        for sp in range(n_splits):
                            top = max(top, part_max[row, sp])
                        total = float32(0.0)
                        for sp in range(n_splits):
                            total += part_sum[row, sp] * math.exp(part_max[row, sp] - top)
                        for r in range(DIM_ROUNDS):
                            d = r * WARP + lane
                            if d < D:
                                acc = float32(0.0)
                                for sp in range(n_splits):
                                    acc += part_o[row, sp, d] * math.exp(part_max[row, sp] - top)
                                o[n, hq * D + d] = stored(o, acc / total if valid else float32(0.0))
            elif phase == 3:                                # h = x + o @ wo.T
                for base in range(0, C, n_warps):
                    col = base + gw
                    P = HD // 2 if col < C else 0
                    load_row(wo, col, P, lane, WHD, words)
                    for n in range(N):
                        dot, _ = lane_dot(words, WHD, ffn_norm, False, o_pairs, n, P, lane)
                        dot = warp_sum(dot)
                        if lane == 0 and P > 0:
                            h[n, col] = stored(h, to_f32(x[n, col]) + dot)
            elif phase == 4:                                # act = silu(n @ w_gate.T) * (n @ w_up.T)
                for base in range(0, F, n_warps):
                    f = base + gw
                    P = C // 2 if f < F else 0
                    load_row(w_gate_up, f, P, lane, WC, words)
                    load_row(w_gate_up, F + f if P > 0 else 0, P, lane, WC, words_up)
                    for n in range(N):
                        gate, squares = lane_dot(words, WC, ffn_norm, True, h_pairs, n, P, lane)
                        up, _ = lane_dot(words_up, WC, ffn_norm, True, h_pairs, n, P, lane)
                        gate = warp_sum(gate)
                        up = warp_sum(up)
                        squares = warp_sum(squares)
                        if lane == 0 and P > 0:
                            rstd = float32(1.0) / math.sqrt(squares / float32(C) + eps)
                            z = gate * rstd
                            sigmoid = float32(0.5) * (float32(1.0) + math.tanh(float32(0.5) * z))  # no overflow
                            act[n, f] = stored(act, z * sigmoid * (up * rstd))
            else:                                           # y = h + act @ w_down.T
                for base in range(0, C, n_warps):
                    col = base + gw
                    P = F // 2 if col < C else 0
                    load_row(w_down, col, P, lane, WF, words)
                    for n in range(N):
                        dot, _ = lane_dot(words, WF, ffn_norm, False, act_pairs, n, P, lane)
                        dot = warp_sum(dot)
                        if lane == 0 and P > 0:
                            y[n, col] = stored(y, to_f32(h[n, col]) + dot)
        if last - first > 1:
            leave_grid(counter)

    return block


def forward(x, attn_norm, wqkv, k_cache, v_cache, pos, wo, ffn_norm, w_gate_up, w_down, *, n_kv_heads, theta, eps):
    check_shapes(x, attn_norm, wqkv, k_cache, v_cache, pos, wo, ffn_norm, w_gate_up, w_down, n_kv_heads)
    B, T, C = x.shape
    S, KV, D = k_cache.shape[1:]
    H = wqkv.shape[0] // D - 2 * KV
    F = w_gate_up.shape[0] // 2
    if len({w.dtype for w in (attn_norm, wqkv, wo, ffn_norm, w_gate_up, w_down)}) > 1:
        raise ValueError("decode_block on the GPU reads the norms and matrices in one storage (all float32 or all bf16)")
    if max(C, H * D, F) > 2 * WARP * MAX_WORDS or C % 2 or F % 2:
        raise ValueError(f"decode_block on the GPU takes an even width and hidden size of at most "
                         f"{2 * WARP * MAX_WORDS} (and heads of at most that), got {C}, {F} and {H} x {D}")
    N, NS = B * T, -(-S // WARP)
    rows = x.reshape(N, C)
    cos, sin = rope_table(S, D, float(theta))
    qkv = runtime.empty((N, wqkv.shape[0]), x.dtype)
    part_max = runtime.empty((N * H, NS), np.float32)
    part_sum = runtime.empty((N * H, NS), np.float32)
    part_o = runtime.empty((N * H, NS, D), np.float32)
    o = runtime.empty((N, H * D), x.dtype)
    h = runtime.empty((N, C), x.dtype)
    act = runtime.empty((N, F), x.dtype)
    y = runtime.empty((N, C), x.dtype)
    args = (runtime.grid_counter(), rows, pairs(rows), pairs(attn_norm), pairs(wqkv), k_cache, v_cache, pos, cos, sin,
            pairs(wo), pairs(ffn_norm), pairs(w_gate_up), pairs(w_down), float32(eps), T, H, KV, qkv, part_max,
            part_sum, part_o, o, pairs(o), h, pairs(h), act, pairs(act), y)
    kernel = _kernel(D, _words(C), _words(H * D), _words(F))
    threads = WARPS * WARP
    if SIMULATOR:       # no barrier opens there: a launch a phase
        for phase in range(PHASES):
            runtime.launch(kernel, 2, threads, phase, phase + 1, *args)
    else:
        sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
        blocks = min(BLOCKS_PER_SM * sms, runtime.resident_blocks(kernel, threads, 0, PHASES, *args))
        runtime.launch(kernel, blocks, threads, 0, PHASES, *args, overlap=True)
    return y.reshape(B, T, C), ()
