"""Tensor-core FlashAttention-2 with mma.sync: bf16 storage, head size D a multiple of 16.

Block: MMA_THREADS = 128 threads, 4 warps, on a tile of MMA_ROWS = 64 rows: query rows (forward,
dq) or keys (dkdv). Each warp owns 16 of them and multiplies them with mma.sync m16n8k16
(device.mma_bf16, its fragment layout in ops/cuda/ptx.py) against 64-row tiles of the other side.
  in registers, the whole kernel:  the warp's rows as A fragments over the head dims (q; q and do;
                                   k and v), its float32 accumulators (16 x D), and the forward's
                                   running max and sum of each row
  streamed, two tiles a step:      k and v (forward, dq), q and do (dkdv), by cp.async into one of
                                   two stages of shared memory while the other is multiplied; one
                                   barrier a step
  per step, in registers:          the scores (16 x 64 accumulators), which become the next
                                   product's A fragments (P for P V, dS for dS K): the
                                   FlashAttention-2 register reuse, no shared-memory round trip
Tensors travel as uint32 words of two neighbouring bf16 along the head dim (as_words). Shared rows
are padded to WS = D/2 + 4 words, so that the eight 16-byte rows an ldmatrix phase reads fall in
distinct banks; ldmatrix gives the B fragments as stored for a product over the head dims
(S = Q K^T), transposed (ldmatrix.trans) for a product over a tile's rows (O += P V).
Index arithmetic is kept off the tile loop: each thread's copy offsets are worked out once
(copy_plan), indices are 32-bit where they can be, and only the tiles that cross the causal
diagonal or the last row are masked (bench/attention_sass.py shows each loop's instruction mix).
wgmma.py runs this family's forward on Hopper's warpgroup products, with the helpers here.
"""

import math
from functools import cache
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, int32, types, uint32, uint64

from nanoeuler_ops.cuda import device
from nanoeuler_ops.cuda.attention.common import LOG2E, MASKED, SHARED_ALIGN, FlashKernels, Kernel, kernel_options, \
    zero
from nanoeuler_ops.cuda.device import bf16x2_values, mma_bf16, pack_bf16x2, quad_max, quad_sum


def mma_supported(q) -> bool:
    """Whether the tensor-core kernels serve these inputs: bf16 storage, head size a multiple of 16."""
    return q.dtype == device.BF16 and q.shape[3] % 16 == 0


@cache
def mma_kernels(D: int) -> FlashKernels:
    """The mma.sync forward, dq and dk/dv kernels for head size D, each with the dynamic shared
    memory (bytes) it takes. They take tensors as flat uint32 words (as_words)."""
    return FlashKernels(_forward_kernel(D), _dq_kernel(D), _dkdv_kernel(D))


def as_words(x):
    """A bf16 array as one flat run of uint32 words, each two neighbouring elements of its last axis."""
    return x.reshape(x.size).view(np.uint32)


def mma_signatures() -> dict:
    """The argument types of the tensor-core forward, dq and dk/dv kernels as forward() and
    backward() launch them: to compile them ahead for a GPU that is not here (numba.cuda.compile_ptx)."""
    words, rows = types.Array(types.uint32, 1, "C"), types.Array(types.float32, 3, "C")
    sizes = (types.int64,) * 4   # T, S, H, KV
    return {"forward": (words, words, words, *sizes, types.float32, words, rows),
            "dq": (words, words, words, words, words, rows, *sizes, types.float32, words, rows),
            "dkdv": (words, words, words, words, rows, rows, *sizes, types.float32, words, words)}


MMA_ROWS = 64                      # rows of a block's tile and of a streamed tile
MMA_WARPS = MMA_ROWS // 16
MMA_THREADS = MMA_WARPS * device.WARP
MMA_PAD = 4                        # words of padding per shared row
NR = MMA_ROWS // 8                 # n-tiles of a score tile (8 columns each)
KR = MMA_ROWS // 16                # k-steps of a product over a tile's 64 rows
# The most registers a thread of the forward, dq and dk/dv kernels may take (None: no cap). A cap
# lets more blocks share a multiprocessor, at the price of spills or fewer loads in flight: under
# 128 the forward runs one block more a multiprocessor; the backward kernels would spill under a cap
# (bench/probe_mma_registers.sh tries caps)
MMA_MAX_REGISTERS = (128, None, None)
u32, i32, f32, u64 = uint32, int32, float32, uint64


class Sizes(NamedTuple):
    """Head size D's tile sizes: compile-time constants of its kernels."""
    W: int                # words per row of a tile over the head dims
    WS: int               # its shared row stride (words)
    TILE_WORDS: int       # words of a streamed tile in shared memory
    KD: int               # k-steps of a product over the head dims
    ND: int               # n-tiles of an output over the head dims
    CHUNKS_PER_ROW: int   # 16-byte chunks of a tile's row
    COPY_ROWS: int        # rows of a tile the block's threads copy at once
    CHUNKS: int           # 16-byte chunks a thread copies per tile


def sizes(D: int) -> Sizes:
    W = D // 2
    CHUNKS_PER_ROW = W // 4
    COPY_ROWS = MMA_THREADS // CHUNKS_PER_ROW
    return Sizes(W, W + MMA_PAD, MMA_ROWS * (W + MMA_PAD), D // 16, D // 8, CHUNKS_PER_ROW, COPY_ROWS,
                 -(-MMA_ROWS // COPY_ROWS))


# ---------------------------------------------------------------- a warp's pieces, any head size

@cuda.jit(device=True, inline=True)
def block_head(heads):
    # the batch row and head of this block (grid x = B * heads), by 32-bit division: a 64-bit one
    # is a subroutine call
    bh, n = u32(cuda.blockIdx.x), u32(heads)
    b = bh // n
    return b, bh - b * n


@cuda.jit(device=True, inline=True)
def query_block(H, KV):
    # the forward's and dq's block: its batch row b, query head h and key/value head kv; the
    # thread, its warp and lane (g, t); the block's first query row t0 (the last rows, with the
    # most keys, start first) and its warp's r0
    b, h = block_head(H)
    tid = cuda.threadIdx.x
    warp, lane = tid // 32, tid % 32
    t0 = (cuda.gridDim.y - 1 - cuda.blockIdx.y) * MMA_ROWS
    return b, h, h // (u32(H) // u32(KV)), tid, warp, lane, lane // 4, lane % 4, t0, t0 + 16 * warp


@cuda.jit(device=True, inline=True)
def mma_tile(acc, n, a0, a1, a2, a3, b0, b1):
    # acc[n] += A B for one 16 x 8 tile
    c = mma_bf16(a0, a1, a2, a3, b0, b1, acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3])
    acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3] = c[0], c[1], c[2], c[3]


@cuda.jit(device=True, inline=True)
def row_fragment(scores, kc):
    # the A fragment (bf16) of k-step kc of a product over a tile's rows, from the float32
    # accumulators `scores` (16 x 64) of a product that made them: its n-tiles 2 kc and 2 kc + 1
    return (pack_bf16x2(scores[2 * kc, 0], scores[2 * kc, 1]), pack_bf16x2(scores[2 * kc, 2], scores[2 * kc, 3]),
            pack_bf16x2(scores[2 * kc + 1, 0], scores[2 * kc + 1, 1]),
            pack_bf16x2(scores[2 * kc + 1, 2], scores[2 * kc + 1, 3]))


@cuda.jit(device=True, inline=True)
def mask_outside(scores, first_a, last_a, first_b, last_b):
    # scores of the columns outside first_a .. last_a (rows g) and first_b .. last_b (rows g + 8)
    # <- MASKED, columns counted from this lane's first (2t); int32 bounds keep the compares 32-bit.
    # Only tiles that cross the causal diagonal or the last row take it.
    for n in range(NR):
        for c in range(2):
            col = 8 * n + c
            if col < first_a or col > last_a:
                scores[n, c] = f32(MASKED)
            if col < first_b or col > last_b:
                scores[n, c + 2] = f32(MASKED)


# ---------------------------------------------------------------- head size D's pieces

class TileCopies(NamedTuple):
    """Head size D's device functions that move tiles: global memory -> shared memory (cp.async)
    or fragments, shared memory -> fragments (ldmatrix), accumulators -> global memory."""
    rows_of: object
    copy_plan: object
    copy_tiles: object
    load_fragments: object
    shared_fragments: object
    store_rows: object


@cache
def tile_copies(D: int) -> TileCopies:
    # Tensors arrive flat: word w of row `row` of head `head` in batch b sits at
    # ((b * n_rows + row) * heads + head) * W + w. Unsigned indices skip the negative-index wraparound.
    # Streamed tiles live in two stages of one dynamic shared buffer `sh`: while a step multiplies
    # the tiles of one stage, the next tiles are in flight (cp.async) into the other; one barrier a
    # step. A tile is addressed as sh[base + index], base its offset in the buffer.
    W, WS, TILE_WORDS, KD, ND, CHUNKS_PER_ROW, COPY_ROWS, CHUNKS = sizes(D)

    @cuda.jit(device=True, inline=True)
    def rows_of(b, n_rows, head, heads):
        # where rows of (b, head) start in a flat tensor, and the words from one row to the next
        return u64((b * n_rows) * heads + head) * u64(W), u64(heads * W)

    @cuda.jit(device=True, inline=True)
    def copy_plan(stride, tid):
        # the first 16-byte chunk this thread copies of every tile: its row, and its offsets in the
        # tile in shared memory and in global memory (rows `stride` words apart); its next chunks
        # lie COPY_ROWS rows further each. Worked out once per kernel.
        row, col = u32(tid) // u32(CHUNKS_PER_ROW), u32(4) * (u32(tid) % u32(CHUNKS_PER_ROW))
        return i32(row), row * u32(WS) + col, u64(row) * stride + u64(col)

    @cuda.jit(device=True, inline=True)
    def copy_tiles(sh, sb, base, x, y, start, stride, plan, row0, n_rows, pair=True, row_words=WS,
                   tile_words=TILE_WORDS):
        # start copying rows row0 .. row0 + 63 of x to the tile at sh[base] (row r at base + r row_words,
        # where the plan puts it), and (with pair) of y to the tile tile_words after it (x and y laid out
        # alike: rows from `start`, `stride` words apart); zeros from row n_rows on
        plan_row, plan_at, plan_offset = plan
        tile = start + u64(row0) * stride + plan_offset
        rows_left = i32(n_rows - row0) - plan_row
        for n in range(CHUNKS):
            # (threads past a whole number of rows, and rows past the tile, copy nothing; neither
            # occurs where a row's chunks divide the block's threads)
            if (COPY_ROWS * CHUNKS_PER_ROW == MMA_THREADS or plan_row < COPY_ROWS) and \
                    ((n + 1) * COPY_ROWS <= MMA_ROWS or plan_row + n * COPY_ROWS < MMA_ROWS):
                valid = i32(n * COPY_ROWS) < rows_left
                j = tile + u64(n * COPY_ROWS) * stride if valid else start   # an address in bounds either way
                at = base + plan_at + u32(n * COPY_ROWS * row_words)
                device.cp_async_16(sh, sb, at, x, j, valid)
                if pair:
                    device.cp_async_16(sh, sb, at + u32(tile_words), y, j, valid)

    @cuda.jit(device=True, inline=True)
    def load_fragments(frag, src, b, r0, n_rows, head, heads, g, t):
        # the A fragments of rows r0 + g and r0 + g + 8 over the head dims, straight from global memory
        base = u64((b * n_rows) * heads + head) * u64(W)
        stride = u64(heads * W)
        last = u64(n_rows - 1)
        ra, rb = u64(r0 + g), u64(r0 + g + 8)
        for kc in range(KD):
            for half in range(2):
                w = u64(8 * kc + t + 4 * half)
                a = src[base + min(ra, last) * stride + w]
                c = src[base + min(rb, last) * stride + w]
                frag[kc, 2 * half] = a if ra <= last else u32(0)
                frag[kc, 2 * half + 1] = c if rb <= last else u32(0)

    @cuda.jit(device=True, inline=True)
    def shared_fragments(frag, sh, sb, base, warp, lane):
        # the A fragments of the warp's 16 rows of the tile at sh[base] over the head dims, by ldmatrix:
        # lanes 0..15 address rows 0..15 at word 8 kc, lanes 16..31 the same rows 4 words on
        lane_base = base + u32((16 * warp + lane % 16) * WS + 4 * (lane // 16))
        for kc in range(KD):
            a = device.ldmatrix_x4(sh, sb, lane_base + u32(8 * kc))
            frag[kc, 0], frag[kc, 1], frag[kc, 2], frag[kc, 3] = a[0], a[1], a[2], a[3]

    @cuda.jit(device=True, inline=True)
    def store_rows(dst, acc, scale, b, r0, n_rows, head, heads, g, t):
        # words 4 dn + t of rows r0 + g and r0 + g + 8 = the bf16 pairs of acc * scale
        base = u64((b * n_rows) * heads + head) * u64(W)
        stride = u64(heads * W)
        ra, rb = r0 + g, r0 + g + 8
        for dn in range(ND):
            w = u64(4 * dn + t)
            if ra < n_rows:
                dst[base + u64(ra) * stride + w] = pack_bf16x2(acc[dn, 0] * scale, acc[dn, 1] * scale)
            if rb < n_rows:
                dst[base + u64(rb) * stride + w] = pack_bf16x2(acc[dn, 2] * scale, acc[dn, 3] * scale)

    return TileCopies(rows_of, copy_plan, copy_tiles, load_fragments, shared_fragments, store_rows)


class TileProducts(NamedTuple):
    """Head size D's device functions that compute on a warp's fragments and accumulators."""
    mma_over_dims: object
    mma_over_rows: object
    online_softmax: object
    finish_rows: object


@cache
def tile_products(D: int) -> TileProducts:
    s = sizes(D)
    WS, KD, ND = s.WS, s.KD, s.ND
    store_rows = tile_copies(D).store_rows

    @cuda.jit(device=True, inline=True)
    def mma_over_dims(acc, frag, sh, sb, base, lane):
        # acc[n] += (A = the warp's 16 rows over D) x (B = tile rows 8n .. 8n+7)^T; one ldmatrix
        # gives the B fragments of n-tiles n and n + 1 (lanes 16..31 address the second's rows)
        lane_base = base + u32((lane % 8 + 8 * (lane // 16)) * WS + 4 * (lane // 8 % 2))
        for n in range(0, NR, 2):
            for kc in range(KD):
                b = device.ldmatrix_x4(sh, sb, lane_base + u32(8 * n * WS + 8 * kc))
                mma_tile(acc, n, frag[kc, 0], frag[kc, 1], frag[kc, 2], frag[kc, 3], b[0], b[1])
                mma_tile(acc, n + 1, frag[kc, 0], frag[kc, 1], frag[kc, 2], frag[kc, 3], b[2], b[3])

    @cuda.jit(device=True, inline=True)
    def mma_over_rows(acc, scores, sh, sb, base, lane):
        # acc[dn] += (A = scores, 16 x 64 float32 accumulators, rounded to bf16) x (B = the tile's 64
        # rows over head dims 8dn .. 8dn+7); one ldmatrix.trans gives the B fragments of dn and dn + 1
        lane_base = base + u32((lane % 8 + 8 * (lane // 8 % 2)) * WS + 4 * (lane // 16))
        for kc in range(KR):
            a0, a1, a2, a3 = row_fragment(scores, kc)
            for dn in range(0, ND, 2):
                b = device.ldmatrix_x4_trans(sh, sb, lane_base + u32(16 * kc * WS + 4 * dn))
                mma_tile(acc, dn, a0, a1, a2, a3, b[0], b[1])
                mma_tile(acc, dn + 1, a0, a1, a2, a3, b[2], b[3])

    @cuda.jit(device=True, inline=True)
    def online_softmax(scores, acc, top_a, top_b, sum_a, sum_b, scale2):
        # one key tile of the online softmax for rows g and g + 8: the running maxima (unscaled
        # scores) and this lane's shares of the running sums are updated, acc (the output so far) is
        # rescaled to the new maxima and the scores become exp2(scale2 (score - max)); returns
        # (top_a, top_b, sum_a, sum_b)
        tile_a, tile_b = f32(MASKED), f32(MASKED)
        for n in range(NR):
            for c in range(2):
                tile_a = max(tile_a, scores[n, c])
                tile_b = max(tile_b, scores[n, c + 2])
        new_a, new_b = max(top_a, quad_max(tile_a)), max(top_b, quad_max(tile_b))
        rescale_a, rescale_b = math.exp2((top_a - new_a) * scale2), math.exp2((top_b - new_b) * scale2)
        sum_a *= rescale_a
        sum_b *= rescale_b
        for dn in range(ND):
            acc[dn, 0] *= rescale_a
            acc[dn, 1] *= rescale_a
            acc[dn, 2] *= rescale_b
            acc[dn, 3] *= rescale_b
        shift_a, shift_b = new_a * scale2, new_b * scale2
        for n in range(NR):
            for c in range(2):
                scores[n, c] = math.exp2(scores[n, c] * scale2 - shift_a)
                scores[n, c + 2] = math.exp2(scores[n, c + 2] * scale2 - shift_b)
                sum_a += scores[n, c]
                sum_b += scores[n, c + 2]
        return new_a, new_b, sum_a, sum_b

    @cuda.jit(device=True, inline=True)
    def finish_rows(o, lse, acc, top_a, top_b, sum_a, sum_b, scale, b, h, r0, T, H, g, t):
        # the forward's end for rows r0 + g and r0 + g + 8: lse, and o = acc / the rows' sums
        sum_a, sum_b = quad_sum(sum_a), quad_sum(sum_b)
        if t == 0:
            if r0 + g < T:
                lse[b, h, r0 + g] = top_a * scale + math.log(sum_a)
            if r0 + g + 8 < T:
                lse[b, h, r0 + g + 8] = top_b * scale + math.log(sum_b)
        for dn in range(ND):
            acc[dn, 0] /= sum_a
            acc[dn, 1] /= sum_a
            acc[dn, 2] /= sum_b
            acc[dn, 3] /= sum_b
        store_rows(o, acc, f32(1.0), b, r0, T, h, H, g, t)

    return TileProducts(mma_over_dims, mma_over_rows, online_softmax, finish_rows)


# ---------------------------------------------------------------- forward

def _forward_kernel(D: int) -> Kernel:
    s = sizes(D)
    TILE_WORDS, KD, ND = s.TILE_WORDS, s.KD, s.ND
    rows_of, copy_plan, copy_tiles, _, shared_fragments, _ = tile_copies(D)
    mma_over_dims, mma_over_rows, online_softmax, finish_rows = tile_products(D)
    FWD_STAGE = 2 * TILE_WORDS   # a stage: k, v

    @cuda.jit(**kernel_options(MMA_MAX_REGISTERS[0]))
    def mma_forward_kernel(q, k, v, T, S, H, KV, scale, o, lse):
        # q, o (B*T*H*D/2,) and k, v (B*S*KV*D/2,) words of bf16 pairs, lse (B, H, T) float32;
        # grid (B * H, T / 64), 128 threads: each warp 16 query rows against 64 keys per step
        b, h, kv, tid, warp, lane, g, t, t0, r0 = query_block(H, KV)
        sh = cuda.shared.array(0, uint32, alignment=SHARED_ALIGN)
        sb = device.shared_base(sh)
        q_frag = cuda.local.array((KD, 4), uint32)
        scores = cuda.local.array((NR, 4), float32)
        acc = cuda.local.array((ND, 4), float32)
        kv_start, kv_stride = rows_of(b, S, kv, KV)
        plan = copy_plan(kv_stride, tid)
        copy_tiles(sh, sb, u32(0), k, v, kv_start, kv_stride, plan, 0, S)
        # the block's query rows pass through the second stage, free until the loop's first prefetch
        q_start, q_stride = rows_of(b, T, h, H)
        copy_tiles(sh, sb, u32(FWD_STAGE), q, q, q_start, q_stride, copy_plan(q_stride, tid), t0, T, False)
        device.cp_async_wait_all()
        cuda.syncthreads()
        shared_fragments(q_frag, sh, sb, u32(FWD_STAGE), warp, lane)
        zero(acc)
        scale2 = scale * f32(LOG2E)                 # exp(scale x) = exp2(scale2 x): one multiply-add and ex2
        top_a, top_b = f32(MASKED), f32(MASKED)     # running max of rows g and g + 8 (unscaled scores)
        sum_a, sum_b = f32(0.0), f32(0.0)           # this lane's share of their running sums
        last_a, last_b = min((S - T) + r0 + g, S - 1), min((S - T) + r0 + g + 8, S - 1)   # the last key each row sees
        diagonal = (S - T) + t0                     # the last key the block's first row sees
        keys_end = min(S, diagonal + MMA_ROWS)
        for s0 in range(0, keys_end, MMA_ROWS):
            stage = u32(u32(s0) // u32(MMA_ROWS) % u32(2) * u32(FWD_STAGE))
            device.cp_async_wait_all()
            cuda.syncthreads()   # this stage has landed; every warp is done reading the other one
            if s0 + MMA_ROWS < keys_end:
                copy_tiles(sh, sb, u32(FWD_STAGE) - stage, k, v, kv_start, kv_stride, plan, s0 + MMA_ROWS, S)
            zero(scores)
            mma_over_dims(scores, q_frag, sh, sb, stage, lane)
            if s0 + MMA_ROWS - 1 > diagonal:
                mask_outside(scores, i32(-1), i32(last_a - s0 - 2 * t), i32(-1), i32(last_b - s0 - 2 * t))
            top_a, top_b, sum_a, sum_b = online_softmax(scores, acc, top_a, top_b, sum_a, sum_b, scale2)
            mma_over_rows(acc, scores, sh, sb, stage + u32(TILE_WORDS), lane)
        finish_rows(o, lse, acc, top_a, top_b, sum_a, sum_b, scale, b, h, r0, T, H, g, t)

    return Kernel(mma_forward_kernel, 8 * FWD_STAGE)


# ---------------------------------------------------------------- backward: dq (and Di), then dk and dv

def _dq_kernel(D: int) -> Kernel:
    s = sizes(D)
    TILE_WORDS, KD, ND = s.TILE_WORDS, s.KD, s.ND
    rows_of, copy_plan, copy_tiles, load_fragments, _, store_rows = tile_copies(D)
    mma_over_dims, mma_over_rows, _, _ = tile_products(D)
    DQ_STAGE = 2 * TILE_WORDS   # a stage: k, v

    @cuda.jit(**kernel_options(MMA_MAX_REGISTERS[1]))
    def mma_dq_kernel(do, q, k, v, o, lse, T, S, H, KV, scale, dq, di):
        # do, q, o, dq (B*T*H*D/2,) and k, v (B*S*KV*D/2,) words of bf16 pairs, lse, di (B, H, T) float32;
        # grid (B * H, T / 64), 128 threads: each warp 16 query rows against 64 keys per step.
        # Di = rowsum(do * o), the FlashAttention-2 backward's correction, is written for the dk/dv kernel.
        b, h, kv, tid, warp, lane, g, t, t0, r0 = query_block(H, KV)
        sh = cuda.shared.array(0, uint32, alignment=SHARED_ALIGN)
        sb = device.shared_base(sh)
        q_frag = cuda.local.array((KD, 4), uint32)
        do_frag = cuda.local.array((KD, 4), uint32)
        scores = cuda.local.array((NR, 4), float32)
        dp = cuda.local.array((NR, 4), float32)
        acc = cuda.local.array((ND, 4), float32)
        kv_start, kv_stride = rows_of(b, S, kv, KV)
        plan = copy_plan(kv_stride, tid)
        copy_tiles(sh, sb, u32(0), k, v, kv_start, kv_stride, plan, 0, S)
        load_fragments(do_frag, do, b, r0, T, h, H, g, t)
        load_fragments(q_frag, o, b, r0, T, h, H, g, t)   # o first, for Di; q takes its registers after
        part_a, part_b = f32(0.0), f32(0.0)
        for kc in range(KD):
            for half in range(2):
                lo_do, hi_do = bf16x2_values(do_frag[kc, 2 * half])
                lo_o, hi_o = bf16x2_values(q_frag[kc, 2 * half])
                part_a += lo_do * lo_o + hi_do * hi_o
                lo_do, hi_do = bf16x2_values(do_frag[kc, 2 * half + 1])
                lo_o, hi_o = bf16x2_values(q_frag[kc, 2 * half + 1])
                part_b += lo_do * lo_o + hi_do * hi_o
        load_fragments(q_frag, q, b, r0, T, h, H, g, t)
        row_di_a, row_di_b = quad_sum(part_a), quad_sum(part_b)
        ra, rb = r0 + g, r0 + g + 8
        if t == 0:
            if ra < T:
                di[b, h, ra] = row_di_a
            if rb < T:
                di[b, h, rb] = row_di_b
        scale2 = scale * f32(LOG2E)   # exp(scale x - lse) = exp2(scale2 x - lse log2 e)
        row_lse_a = lse[b, h, min(ra, T - 1)] * f32(LOG2E)
        row_lse_b = lse[b, h, min(rb, T - 1)] * f32(LOG2E)
        zero(acc)
        last_a, last_b = min((S - T) + ra, S - 1), min((S - T) + rb, S - 1)   # the last key each row sees
        diagonal = (S - T) + t0                     # the last key the block's first row sees
        keys_end = min(S, diagonal + MMA_ROWS)
        for s0 in range(0, keys_end, MMA_ROWS):
            stage = u32(u32(s0) // u32(MMA_ROWS) % u32(2) * u32(DQ_STAGE))
            device.cp_async_wait_all()
            cuda.syncthreads()
            if s0 + MMA_ROWS < keys_end:
                copy_tiles(sh, sb, u32(DQ_STAGE) - stage, k, v, kv_start, kv_stride, plan, s0 + MMA_ROWS, S)
            zero(scores)
            zero(dp)
            mma_over_dims(scores, q_frag, sh, sb, stage, lane)
            mma_over_dims(dp, do_frag, sh, sb, stage + u32(TILE_WORDS), lane)
            if s0 + MMA_ROWS - 1 > diagonal:
                mask_outside(scores, i32(-1), i32(last_a - s0 - 2 * t), i32(-1), i32(last_b - s0 - 2 * t))
            for n in range(NR):
                for c in range(2):
                    p_a = math.exp2(scores[n, c] * scale2 - row_lse_a)
                    p_b = math.exp2(scores[n, c + 2] * scale2 - row_lse_b)
                    dp[n, c] = p_a * (dp[n, c] - row_di_a)
                    dp[n, c + 2] = p_b * (dp[n, c + 2] - row_di_b)
            mma_over_rows(acc, dp, sh, sb, stage, lane)
        store_rows(dq, acc, scale, b, r0, T, h, H, g, t)

    return Kernel(mma_dq_kernel, 8 * DQ_STAGE)


def _dkdv_kernel(D: int) -> Kernel:
    s = sizes(D)
    TILE_WORDS, KD, ND = s.TILE_WORDS, s.KD, s.ND
    rows_of, copy_plan, copy_tiles, load_fragments, _, store_rows = tile_copies(D)
    mma_over_dims, mma_over_rows, _, _ = tile_products(D)
    KV_STAGE = 2 * TILE_WORDS   # a stage: q, do

    @cuda.jit(**kernel_options(MMA_MAX_REGISTERS[2]))
    def mma_dkdv_kernel(do, q, k, v, lse, di, T, S, H, KV, scale, dk, dv):
        # do, q (B*T*H*D/2,), k, v, dk, dv (B*S*KV*D/2,) words of bf16 pairs, lse, di (B, H, T) float32;
        # grid (B * KV, S / 64), 128 threads: each warp 16 keys against 64 query rows per step, over
        # every query head of the group, so the group's gradients add up in registers: no atomics
        group = H // KV
        b, kv = block_head(KV)
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        s0 = cuda.blockIdx.y * MMA_ROWS   # the first keys, seen by the most query rows, start first
        k0 = s0 + 16 * warp
        sh = cuda.shared.array(0, uint32, alignment=SHARED_ALIGN)
        sb = device.shared_base(sh)
        row_stats = cuda.shared.array((2, 2, MMA_ROWS), float32)   # per stage: lse log2 e and Di of the query rows
        k_frag = cuda.local.array((KD, 4), uint32)
        v_frag = cuda.local.array((KD, 4), uint32)
        scores = cuda.local.array((NR, 4), float32)   # transposed: [key, query row]
        dp = cuda.local.array((NR, 4), float32)
        dk_acc = cuda.local.array((ND, 4), float32)
        dv_acc = cuda.local.array((ND, 4), float32)
        key_a, key_b = k0 + g, k0 + g + 8
        scale2 = scale * f32(LOG2E)   # exp(scale x - lse) = exp2(scale2 x - lse log2 e)
        first_query = max(0, s0 - (S - T))   # earlier queries see none of this block's keys
        tiles = (T - first_query + MMA_ROWS - 1) // MMA_ROWS
        h0 = kv * group
        q_start, q_stride = rows_of(b, T, h0, H)
        plan = copy_plan(q_stride, tid)
        copy_tiles(sh, sb, u32(0), q, do, q_start, q_stride, plan, first_query, T)
        if tid < MMA_ROWS:
            row = min(first_query + tid, T - 1)
            row_stats[0, 0, tid] = lse[b, h0, row] * f32(LOG2E)
            row_stats[0, 1, tid] = di[b, h0, row]
        load_fragments(k_frag, k, b, k0, S, kv, KV, g, t)
        load_fragments(v_frag, v, b, k0, S, kv, KV, g, t)
        zero(dk_acc)
        zero(dv_acc)
        t0, head = first_query, h0   # this step's query rows and head: every tile of a head, then the next head
        for step in range(group * tiles):
            parity = u32(step) % u32(2)
            stage = u32(parity * KV_STAGE)
            device.cp_async_wait_all()
            cuda.syncthreads()
            t_next, h_next = t0 + MMA_ROWS, head
            if t_next >= T:
                t_next, h_next = first_query, head + 1
            if h_next < h0 + group:
                q_start, q_stride = rows_of(b, T, h_next, H)
                copy_tiles(sh, sb, u32(KV_STAGE) - stage, q, do, q_start, q_stride, plan, t_next, T)
                if tid < MMA_ROWS:
                    row = min(t_next + tid, T - 1)
                    row_stats[u32(1) - parity, 0, tid] = lse[b, h_next, row] * f32(LOG2E)
                    row_stats[u32(1) - parity, 1, tid] = di[b, h_next, row]
            zero(scores)
            zero(dp)
            mma_over_dims(scores, k_frag, sh, sb, stage, lane)
            mma_over_dims(dp, v_frag, sh, sb, stage + u32(TILE_WORDS), lane)
            # the columns (query rows t0 + col) keys a and b are seen by: key - (S - T) - t0 .. T - 1 - t0;
            # a tile of rows that all see every key of the block, none past the last row, needs no mask
            if t0 < s0 + MMA_ROWS - 1 - (S - T) or t0 + MMA_ROWS > T:
                last_col = i32(T - 1 - t0 - 2 * t)
                mask_outside(scores, i32(key_a - (S - T) - t0 - 2 * t), last_col,
                             i32(key_b - (S - T) - t0 - 2 * t), last_col)
            for n in range(NR):
                for c in range(2):
                    col = 8 * n + 2 * t + c
                    row_lse, row_di = row_stats[parity, 0, col], row_stats[parity, 1, col]
                    scores[n, c] = math.exp2(scores[n, c] * scale2 - row_lse)
                    scores[n, c + 2] = math.exp2(scores[n, c + 2] * scale2 - row_lse)
                    dp[n, c] = scores[n, c] * (dp[n, c] - row_di)
                    dp[n, c + 2] = scores[n, c + 2] * (dp[n, c + 2] - row_di)
            mma_over_rows(dv_acc, scores, sh, sb, stage + u32(TILE_WORDS), lane)
            mma_over_rows(dk_acc, dp, sh, sb, stage, lane)
            t0, head = t_next, h_next
        store_rows(dk, dk_acc, scale, b, k0, S, kv, KV, g, t)
        store_rows(dv, dv_acc, f32(1.0), b, k0, S, kv, KV, g, t)

    return Kernel(mma_dkdv_kernel, 8 * KV_STAGE)
