"""One decoding block on the GPU in one launch. See nanoeuler_ops/decode_block.py for the math.

At decoding's few rows a block is a chain of small steps, each waiting on the last; as kernels of
their own, each pays a launch and the GPU's drain. Here one persistent kernel (runtime, "Persistent
kernels") walks them as phases, a grid-wide barrier between two:

  0. q, k, v = rmsnorm(x) attn_norm @ wqkv.T, RoPE     a warp per rotation pair of columns
     q into qkv; k and v into the caches at each row's position
  1. attention over splits of WARP keys                a warp per (row, query head, split): lane = key
  2. the splits combined: o                            a warp per (row, query head): lane = dimension
  3. h = x + o @ wo.T                                  a warp per output column
  4. act = silu(n @ w_gate.T) * (n @ w_up.T)           a warp per hidden feature, n = rmsnorm(h) ffn_norm
  5. y = h + act @ w_down.T                            a warp per output column

Before it waits for the kernel ahead of it, each thread asks for a few lines of the block's
matrices to come into L2: they arrive while that kernel ends, and the phases find them there.

Products. The warp of an output column walks the input's rows ROWS at a time: lane l reads the
column's weight pairs l, l + 32, ... (runtime.pairs: a word per two elements) once per group of rows
and adds each row's products in order; warp_sum then adds the lanes by a fixed tree. So a row's
result depends on the row alone (batch invariance). Phase 0's warp computes the two columns j and
j + D/2 of a head, the pair RoPE rotates together (a value head's two columns are stored as they
are), so the queries leave it rotated and the keys and values go straight into the caches: the
attention reads keys and values from the caches only, as the op's math does.

Attention. Lane l of the warp for (row n, query head hq, split sp) holds key s = sp * WARP + l: its
score against the row's query; the split's max and sum of exponentials over the lanes; then the
split's values are staged in shared memory WARP dimensions at a time, lane = key, and lane l adds
dimension l of them over the keys in order. Every load is made whether or not its lane's key counts
(indices clamped into the cache, the key's weight 0), so a warp's loads all go out at once. The
combine is the decode_attention op's: each head's splits rescaled to the overall max and added in
split order.

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
from nanoeuler_ops.cuda.runtime import (SIMULATOR, WARP, grid_barrier, leave_grid, let_next_start, pair_values, pairs,
                                        prefetch_l2, stored, stored_pair, sync_warp, to_f32, wait_for_previous, warp_max, warp_sum)
from nanoeuler_ops.decode_block import check_shapes

PHASES = 6
WARPS = 2 if SIMULATOR else 8     # warps a block (two keep the simulator quick)
BLOCKS_PER_SM = 2                 # at most: fewer blocks, fewer arrivals at each barrier
MAX_WORDS = 64                    # pairs a lane reads of a matrix row: rows of up to 4096 elements
PREFETCH_WORDS = 16               # words a prefetch asks for (a 128-byte line of float32 pairs)
LINE = 32                         # elements a prefetch of a cache asks for (a 128-byte line of float32)
JIT_OPTIONS = {} if SIMULATOR else {"max_registers": 128}   # two blocks a multiprocessor


def _words(n: int) -> int:
    """Words a lane reads of a row of n elements."""
    return max(1, -(-n // (2 * WARP)))


@cache
def _kernel(D: int, WC: int, WHD: int, WF: int):
    """The kernel for head size D and rows of WC, WHD and WF words a lane (C, H D and F elements)."""
    HALF = D // 2
    PAIR_ROUNDS = -(-HALF // WARP)        # rounds of a warp over a head's pairs of dimensions
    scale = float32(1.0 / math.sqrt(D))

    @cuda.jit(device=True, inline=True)
    def row_dots(w, column, column_2, K, a, n, P, g, scaled, lane):
        # the warp's sums over c of a[n, c] w[column, c] and a[n, c] w[column_2, c] (each w times g[c]
        # where scaled; column_2 < 0: none) and of a[n, c]^2, rows of P pairs (0: nothing): each lane adds
        # its pairs lane, lane + WARP, ... in order, then warp_sum adds the lanes. Loads only, into
        # scalars: the unrolled loop's reads all go out before the first is used.
        dot = float32(0.0)
        dot_2 = float32(0.0)
        squares = float32(0.0)
        row = uint64(n) * uint64(P)
        for k in range(K):
            p = lane + WARP * k
            if p < P:
                a_lo, a_hi = pair_values(a[row + uint64(p)])
                w_lo, w_hi = pair_values(w[uint64(column) * uint64(P) + uint64(p)])
                if scaled:
                    g_lo, g_hi = pair_values(g[p])
                    w_lo, w_hi = w_lo * g_lo, w_hi * g_hi
                dot += a_lo * w_lo + a_hi * w_hi
                squares += a_lo * a_lo + a_hi * a_hi
                if column_2 >= 0:
                    w2_lo, w2_hi = pair_values(w[uint64(column_2) * uint64(P) + uint64(p)])
                    if scaled:
                        w2_lo, w2_hi = w2_lo * g_lo, w2_hi * g_hi
                    dot_2 += a_lo * w2_lo + a_hi * w2_hi
        return warp_sum(dot), warp_sum(dot_2), warp_sum(squares)

    @cuda.jit(device=True, inline=True)
    def prefetch(w, thread, threads):
        for i in range(thread * PREFETCH_WORDS, w.shape[0], threads * PREFETCH_WORDS):
            prefetch_l2(w, i)

    @cuda.jit(cache=True, **JIT_OPTIONS)
    def block(first, last, counter, x, x_pairs, attn_norm, wqkv, k_flat, v_flat, k_pairs, v_pairs, pos, cos, sin, wo,
              ffn_norm, w_gate_up, w_down, eps, B, T, S, H, KV, qkv, q_pairs, part_max, part_sum, part_o, o, o_pairs, h,
              h_pairs, act, act_pairs, y):
        # x (N, C) and its pairs; the norms' and matrices' pairs; the caches (B, S, KV, D) as flat runs and
        # their pairs, pos (B,), cos, sin (S, D/2) -> y (N, C); scratch qkv (N, (H + 2 KV) D) (the rotated
        # queries) and its pairs, part_max, part_sum (N H, splits), part_o (N H, splits, D/2 pairs), o (N, H D)
        # and its pairs, h (N, C), act (N, F); phases first .. last - 1
        N, C = x.shape
        NS = part_max.shape[1]
        F = act.shape[1]
        G = H // KV
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        gw = cuda.blockIdx.x * (cuda.blockDim.x // WARP) + warp     # this warp in the grid
        n_warps = cuda.gridDim.x * (cuda.blockDim.x // WARP)
        shared = cuda.shared.array((WARPS, WARP), float32)          # a warp's weights of its keys or splits
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
            if phase == 0:                                  # q, k, v of each head's column pair j, j + D/2
                thread = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
                threads = cuda.gridDim.x * cuda.blockDim.x
                for b in range(B):                          # the rows' cached keys and values into L2
                    if pos[b] >= 0 and pos[b] < S:
                        row_start = b * S * KV * D
                        for i in range(row_start + thread * LINE, row_start + pos[b] * KV * D, threads * LINE):
                            prefetch_l2(k_flat, i)
                            prefetch_l2(v_flat, i)
                items = (H + 2 * KV) * HALF
                for base in range(0, items, n_warps):
                    item = base + gw
                    head, j = item // HALF, item % HALF
                    column = head * D + j
                    P = C // 2 if item < items else 0
                    for n in range(N):
                        u1, u2, squares = row_dots(wqkv, column, column + HALF, WC, x_pairs, n, P, attn_norm, True,
                                                   lane)
                        b = n // T
                        p = pos[b] + n % T
                        if lane == 0 and P > 0 and p >= 0 and p < S:
                            rstd = float32(1.0) / math.sqrt(squares / float32(C) + eps)
                            u1, u2 = u1 * rstd, u2 * rstd
                            if head < H + KV:               # a query or key head: rotated at p
                                c, sn = cos[p, j], sin[p, j]
                                u1, u2 = u1 * c - u2 * sn, u2 * c + u1 * sn
                            if head < H:
                                qkv[n, column] = stored(qkv, u1)
                                qkv[n, column + HALF] = stored(qkv, u2)
                            else:                           # into the cache at p
                                cache = k_flat if head < H + KV else v_flat
                                at = ((b * S + p) * KV + (head - H) % KV) * D + j
                                cache[at] = stored(cache, u1)
                                cache[at + HALF] = stored(cache, u2)
            elif phase == 1:                                # each split's scores, max, sum and values
                items = N * H * NS
                for base in range(0, items, n_warps):
                    item = base + gw
                    sp = item % NS
                    row = item // NS                        # n * H + hq
                    hq = row % H
                    n = min(row // H, N - 1)
                    b = n // T
                    p = pos[b] + n % T
                    first_key = sp * WARP
                    ok = item < items and p >= 0 and p < S and first_key <= p
                    g = hq // G
                    s = first_key + lane
                    live = ok and s <= p                    # this lane holds a key
                    key_at = ((b * S + (min(s, p) if ok else 0)) * KV + g) * HALF   # pairs
                    q_at = ((n if ok else 0) * (H + 2 * KV) + hq) * HALF
                    dot = float32(0.0)
                    for j in range(HALF):                   # loads only: many in flight at once
                        q_lo, q_hi = pair_values(q_pairs[q_at + j])
                        k_lo, k_hi = pair_values(k_pairs[key_at + j])
                        dot += q_lo * k_lo + q_hi * k_hi
                    score = dot * scale if live else float32(-math.inf)
                    top = warp_max(score)
                    e = math.exp(score - top) if live else float32(0.0)
                    total = warp_sum(e)
                    shared[warp, lane] = e
                    sync_warp()
                    n_keys = min(WARP, p + 1 - first_key) if ok else 0
                    for r in range(PAIR_ROUNDS):            # lane = pair of dimensions: the keys' values in order
                        j = min(r * WARP + lane, HALF - 1)
                        acc_lo = float32(0.0)
                        acc_hi = float32(0.0)
                        for k in range(WARP):
                            if k < n_keys:
                                v_lo, v_hi = pair_values(v_pairs[((b * S + first_key + k) * KV + g) * HALF + j])
                                acc_lo += shared[warp, k] * v_lo
                                acc_hi += shared[warp, k] * v_hi
                        if ok and r * WARP + lane < HALF:
                            part_o[row, sp, 2 * j] = acc_lo
                            part_o[row, sp, 2 * j + 1] = acc_hi
                    if ok and lane == 0:
                        part_max[row, sp] = top
                        part_sum[row, sp] = total
                    sync_warp()                             # the weights are read before the next item's
            elif phase == 2:                                # o: the splits rescaled and added in order
                for base in range(0, N * H, n_warps):
                    row = base + gw
                    n, hq = min(row // H, N - 1), row % H
                    p = pos[n // T] + n % T
                    ok = row < N * H
                    valid = ok and p >= 0 and p < S
                    n_splits = p // WARP + 1 if valid else 0
                    top = float32(-math.inf)                # lane = split sp0 + lane
                    for sp0 in range(0, NS, WARP):
                        if sp0 + lane < n_splits:
                            top = max(top, part_max[row, sp0 + lane])
                    top = warp_max(top)
                    total = float32(0.0)
                    for sp0 in range(0, NS, WARP):
                        if sp0 + lane < n_splits:
                            total += part_sum[row, sp0 + lane] * math.exp(part_max[row, sp0 + lane] - top)
                    total = warp_sum(total)
                    for r in range(PAIR_ROUNDS):            # lane = pair of dimensions
                        j = min(r * WARP + lane, HALF - 1)
                        acc_lo = float32(0.0)
                        acc_hi = float32(0.0)
                        for sp0 in range(0, NS, WARP):
                            shared[warp, lane] = math.exp(part_max[row, sp0 + lane] - top) \
                                if sp0 + lane < n_splits else float32(0.0)
                            sync_warp()
                            for k in range(WARP):
                                if sp0 + k < n_splits:
                                    rescale = shared[warp, k]
                                    acc_lo += part_o[row, sp0 + k, 2 * j] * rescale
                                    acc_hi += part_o[row, sp0 + k, 2 * j + 1] * rescale
                            sync_warp()
                        if ok and r * WARP + lane < HALF:
                            if not valid:
                                total = float32(1.0)        # a skipped token: o is 0
                            o_pairs[(n * H + hq) * HALF + j] = stored_pair(o_pairs, acc_lo / total, acc_hi / total)
            elif phase == 3:                                # h = x + o @ wo.T
                for base in range(0, C, n_warps):
                    col = base + gw
                    P = (H * D) // 2 if col < C else 0
                    for n in range(N):
                        dot, _, _ = row_dots(wo, col, -1, WHD, o_pairs, n, P, ffn_norm, False, lane)
                        if lane == 0 and P > 0:
                            h[n, col] = stored(h, to_f32(x[n, col]) + dot)
            elif phase == 4:                                # act = silu(n @ w_gate.T) * (n @ w_up.T)
                for base in range(0, F, n_warps):
                    f = base + gw
                    P = C // 2 if f < F else 0
                    for n in range(N):
                        gate, up, squares = row_dots(w_gate_up, f, F + f, WC, h_pairs, n, P, ffn_norm, True, lane)
                        if lane == 0 and P > 0:
                            rstd = float32(1.0) / math.sqrt(squares / float32(C) + eps)
                            z = gate * rstd
                            sigmoid = float32(0.5) * (float32(1.0) + math.tanh(float32(0.5) * z))  # no overflow
                            act[n, f] = stored(act, z * sigmoid * (up * rstd))
            else:                                           # y = h + act @ w_down.T
                for base in range(0, C, n_warps):
                    col = base + gw
                    P = F // 2 if col < C else 0
                    for n in range(N):
                        dot, _, _ = row_dots(w_down, col, -1, WF, act_pairs, n, P, ffn_norm, False, lane)
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
    args = (runtime.grid_counter(), rows, pairs(rows), pairs(attn_norm), pairs(wqkv), k_cache.reshape(k_cache.size),
            v_cache.reshape(v_cache.size), pairs(k_cache), pairs(v_cache), pos, cos, sin, pairs(wo), pairs(ffn_norm),
            pairs(w_gate_up), pairs(w_down), float32(eps), B, T, S, H, KV, qkv, pairs(qkv), part_max, part_sum, part_o, o,
            pairs(o), h, pairs(h), act, pairs(act), y)
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
