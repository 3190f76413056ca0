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
                                        prefetch_l2, stored, sync_warp, to_f32, wait_for_previous, warp_max, warp_sum,
                                        warp_sums)
from nanoeuler_ops.decode_block import check_shapes

PHASES = 6
WARPS = 2 if SIMULATOR else 8     # warps a block (two keep the simulator quick)
BLOCKS_PER_SM = 2                 # at most: fewer blocks, fewer arrivals at each barrier
ROWS = 2                          # rows a warp reduces together: a weight pair read once for them
UNROLL = 8                        # loads a lane makes before it uses them (one trip to memory for all)
MAX_WORDS = 64                    # pairs a lane reads of a matrix row: rows of up to 4096 elements
PREFETCH_WORDS = 16               # words a prefetch asks for (a 128-byte line of float32 pairs)
STAGED = WARP + 1                 # a staged key's row of values, padded: no bank conflicts
JIT_OPTIONS = {} if SIMULATOR else {"max_registers": 128}   # two blocks a multiprocessor


def _words(n: int) -> int:
    """Words a lane reads of a row of n elements."""
    return max(1, -(-n // (2 * WARP)))


@cache
def _kernel(D: int, WC: int, WHD: int, WF: int):
    """The kernel for head size D and rows of WC, WHD and WF words a lane (C, H D and F elements)."""
    HALF = D // 2
    DIM_ROUNDS = -(-D // WARP)
    scale = float32(1.0 / math.sqrt(D))

    @cuda.jit(device=True, inline=True)
    def lane_dots(w, column, column_2, K, a, r0, N, g, scaled, lane, dots, dots_2, squares):
        # dots[r] (dots_2[r]) and squares[r], r < ROWS: the warp's sum_c a[r0 + r, c] w[column, c] (and
        # w[column_2, c]; each times g[c] where scaled) and sum_c a[r0 + r, c]^2, each lane adding its pairs
        # lane, lane + WARP, ... of the rows (P pairs each) in order, then warp_sums; no column: < 0
        P = a.shape[0] // N if column >= 0 else 0
        w_words = cuda.local.array(UNROLL, w.dtype)
        w_words_2 = cuda.local.array(UNROLL, w.dtype)
        g_words = cuda.local.array(UNROLL, g.dtype)
        a_words = cuda.local.array((ROWS, UNROLL), a.dtype)
        for r in range(ROWS):
            dots[r] = float32(0.0)
            dots_2[r] = float32(0.0)
            squares[r] = float32(0.0)
        for k0 in range(0, K, UNROLL):
            for u in range(UNROLL):                 # a group's loads first, all in flight at once
                p = lane + WARP * (k0 + u)
                if p < P:
                    w_words[u] = w[uint64(column) * uint64(P) + uint64(p)]
                    if column_2 >= 0:
                        w_words_2[u] = w[uint64(column_2) * uint64(P) + uint64(p)]
                    if scaled:
                        g_words[u] = g[p]
                    for r in range(ROWS):
                        if r0 + r < N:
                            a_words[r, u] = a[uint64(r0 + r) * uint64(P) + uint64(p)]
            for u in range(UNROLL):
                if lane + WARP * (k0 + u) < P:
                    w_lo, w_hi = pair_values(w_words[u])
                    w2_lo, w2_hi = pair_values(w_words_2[u])
                    if scaled:
                        g_lo, g_hi = pair_values(g_words[u])
                        w_lo, w_hi, w2_lo, w2_hi = w_lo * g_lo, w_hi * g_hi, w2_lo * g_lo, w2_hi * g_hi
                    for r in range(ROWS):
                        if r0 + r < N:
                            a_lo, a_hi = pair_values(a_words[r, u])
                            dots[r] += a_lo * w_lo + a_hi * w_hi
                            dots_2[r] += a_lo * w2_lo + a_hi * w2_hi
                            squares[r] += a_lo * a_lo + a_hi * a_hi
        warp_sums(dots)
        warp_sums(dots_2)
        warp_sums(squares)

    @cuda.jit(device=True, inline=True)
    def prefetch(w, thread, threads):
        for i in range(thread * PREFETCH_WORDS, w.shape[0], threads * PREFETCH_WORDS):
            prefetch_l2(w, i)

    @cuda.jit(cache=True, **JIT_OPTIONS)
    def block(first, last, counter, x, x_pairs, attn_norm, wqkv, k_cache, v_cache, pos, cos, sin, wo, ffn_norm,
              w_gate_up, w_down, eps, T, H, KV, qkv, part_max, part_sum, part_o, o, o_pairs, h, h_pairs, act,
              act_pairs, y):
        # x (N, C) and its pairs; the norms' and matrices' pairs; caches (B, S, KV, D), pos (B,), cos, sin
        # (S, D/2) -> y (N, C); scratch qkv (N, (H + 2 KV) D) (the rotated queries), part_max, part_sum
        # (N H, splits), part_o (N H, splits, D), o (N, H D), h (N, C), act (N, F); phases first .. last - 1
        N, C = x.shape
        S, NS = k_cache.shape[1], part_max.shape[1]
        F = act.shape[1]
        G = H // KV
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        gw = cuda.blockIdx.x * (cuda.blockDim.x // WARP) + warp     # this warp in the grid
        n_warps = cuda.gridDim.x * (cuda.blockDim.x // WARP)
        dots = cuda.local.array(ROWS, float32)
        dots_2 = cuda.local.array(ROWS, float32)
        squares = cuda.local.array(ROWS, float32)
        q_group = cuda.local.array(UNROLL, float32)
        k_group = cuda.local.array(UNROLL, float32)
        staged = cuda.local.array(WARP, float32)
        split_max = cuda.local.array(UNROLL, float32)
        split_sum = cuda.local.array(UNROLL, float32)
        outs = cuda.local.array((DIM_ROUNDS, UNROLL), float32)
        accs = cuda.local.array(DIM_ROUNDS, float32)
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
            if phase == 0:                                  # q, k, v of each head's column pair j, j + D/2
                items = (H + 2 * KV) * HALF
                for base in range(0, items, n_warps):
                    item = base + gw
                    head, j = item // HALF, item % HALF
                    column = head * D + j if item < items else -1
                    for r0 in range(0, N, ROWS):
                        lane_dots(wqkv, column, column + HALF, WC, x_pairs, r0, N, attn_norm, True, lane, dots,
                                  dots_2, squares)
                        if lane < ROWS and r0 + lane < N and column >= 0:
                            n = r0 + lane
                            rstd = float32(1.0) / math.sqrt(squares[lane] / float32(C) + eps)
                            u1, u2 = dots[lane] * rstd, dots_2[lane] * rstd
                            b = n // T
                            p = pos[b] + n % T
                            if head >= H + KV:              # a value head: as it is
                                if p >= 0 and p < S:
                                    v_cache[b, p, head - H - KV, j] = stored(v_cache, u1)
                                    v_cache[b, p, head - H - KV, j + HALF] = stored(v_cache, u2)
                            elif p >= 0 and p < S:          # a query or key head: rotated at p
                                c, sn = cos[p, j], sin[p, j]
                                u1, u2 = u1 * c - u2 * sn, u2 * c + u1 * sn
                                if head < H:
                                    qkv[n, column] = stored(qkv, u1)
                                    qkv[n, column + HALF] = stored(qkv, u2)
                                else:
                                    k_cache[b, p, head - H, j] = stored(k_cache, u1)
                                    k_cache[b, p, head - H, j + HALF] = stored(k_cache, u2)
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
                    key = min(s, p) if ok else 0            # clamped: every lane loads
                    q_n = n if ok else 0
                    dot = float32(0.0)
                    for j0 in range(0, D, UNROLL):
                        for u in range(UNROLL):             # a group's loads first
                            j = min(j0 + u, D - 1)
                            q_group[u] = to_f32(qkv[q_n, hq * D + j])
                            k_group[u] = to_f32(k_cache[b, key, g, j])
                        for u in range(UNROLL):
                            if j0 + u < D:
                                dot += q_group[u] * k_group[u]
                    score = dot * scale if live else float32(-math.inf)
                    top = warp_max(score)
                    e = math.exp(score - top) if live else float32(0.0)
                    total = warp_sum(e)
                    weights_sh[warp, lane] = e
                    n_keys = min(WARP, p + 1 - first_key) if ok else 0
                    for r in range(DIM_ROUNDS):
                        for j in range(WARP):               # stage dimensions r WARP + j: lane = key
                            staged[j] = to_f32(v_cache[b, key, g, min(r * WARP + j, D - 1)])
                        for j in range(WARP):
                            values_sh[warp, lane, j] = staged[j]
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
                        for sp0 in range(0, n_splits, UNROLL):
                            for u in range(UNROLL):         # a group's loads first
                                split_max[u] = part_max[row, min(sp0 + u, NS - 1)]
                            for u in range(UNROLL):
                                if sp0 + u < n_splits:
                                    top = max(top, split_max[u])
                        total = float32(0.0)
                        for r in range(DIM_ROUNDS):
                            accs[r] = float32(0.0)
                        for sp0 in range(0, n_splits, UNROLL):
                            for u in range(UNROLL):
                                sp = min(sp0 + u, NS - 1)
                                split_max[u] = part_max[row, sp]
                                split_sum[u] = part_sum[row, sp]
                                for r in range(DIM_ROUNDS):
                                    outs[r, u] = part_o[row, sp, min(r * WARP + lane, D - 1)]
                            for u in range(UNROLL):
                                if sp0 + u < n_splits:
                                    rescale = math.exp(split_max[u] - top)
                                    total += split_sum[u] * rescale
                                    for r in range(DIM_ROUNDS):
                                        accs[r] += outs[r, u] * rescale
                        for r in range(DIM_ROUNDS):
                            d = r * WARP + lane
                            if d < D:
                                o[n, hq * D + d] = stored(o, accs[r] / total if valid else float32(0.0))
            elif phase == 3:                                # h = x + o @ wo.T
                for base in range(0, C, n_warps):
                    col = base + gw if base + gw < C else -1
                    for r0 in range(0, N, ROWS):
                        lane_dots(wo, col, -1, WHD, o_pairs, r0, N, ffn_norm, False, lane, dots, dots_2, squares)
                        if lane < ROWS and r0 + lane < N and col >= 0:
                            h[r0 + lane, col] = stored(h, to_f32(x[r0 + lane, col]) + dots[lane])
            elif phase == 4:                                # act = silu(n @ w_gate.T) * (n @ w_up.T)
                for base in range(0, F, n_warps):
                    f = base + gw if base + gw < F else -1
                    for r0 in range(0, N, ROWS):
                        lane_dots(w_gate_up, f, F + f, WC, h_pairs, r0, N, ffn_norm, True, lane, dots, dots_2,
                                  squares)
                        if lane < ROWS and r0 + lane < N and f >= 0:
                            rstd = float32(1.0) / math.sqrt(squares[lane] / float32(C) + eps)
                            z = dots[lane] * rstd
                            sigmoid = float32(0.5) * (float32(1.0) + math.tanh(float32(0.5) * z))  # no overflow
                            act[r0 + lane, f] = stored(act, z * sigmoid * (dots_2[lane] * rstd))
            else:                                           # y = h + act @ w_down.T
                for base in range(0, C, n_warps):
                    col = base + gw if base + gw < C else -1
                    for r0 in range(0, N, ROWS):
                        lane_dots(w_down, col, -1, WF, act_pairs, r0, N, ffn_norm, False, lane, dots, dots_2, squares)
                        if lane < ROWS and r0 + lane < N and col >= 0:
                            y[r0 + lane, col] = stored(y, to_f32(h[r0 + lane, col]) + dots[lane])
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
