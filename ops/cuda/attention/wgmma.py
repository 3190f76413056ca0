"""The tensor-core forward on Hopper's warpgroup products (wgmma): head size 64, bf16 storage.

Block, grid and online softmax as mma.py's forward: MMA_THREADS = 128 threads (4 warps, one
warpgroup) on 64 query rows, 16 rows a warp, 64-key tiles of k and v streamed in two stages by
cp.async. The products are wgmma's, the four warps multiplying together:
  S = Q K^T (64 x 64)   both operands read from shared memory through descriptors
  O += P V (64 x 64)    P from registers (the scores' accumulators rounded to bf16 fragments), V from
                        shared memory, transposed by the descriptor
  in registers:         per warp the 16 x 64 score and output accumulators, P's fragments, the
                        running max and sum of each row
Tiles are stored unpadded in the 128-byte swizzle (a row is 128 bytes), from a 1024-byte aligned
word of the buffer: the query tile, then two stages of k and v. ops/cuda/ptx.py's wgmma_* section has the
descriptors, fences and the simulator's twins.
"""

from functools import cache

from numba import cuda, float32, int32, uint32, uint64

from nanoeuler_ops.cuda import device, runtime
from nanoeuler_ops.cuda.attention.common import LOG2E, MASKED, SHARED_ALIGN, Kernel, kernel_options, zero
from nanoeuler_ops.cuda.attention.mma import KR, MMA_MAX_REGISTERS, MMA_ROWS, NR, mask_outside, query_block, \
    row_fragment, sizes, tile_copies, tile_products

u32, i32, f32, u64 = uint32, int32, float32, uint64


def wgmma_supported(D: int, hopper: bool | None = None) -> bool:
    """Whether the tensor-core forward for head size D runs on warpgroup products: D = 64 on Hopper
    (hopper None: on this GPU, or under the simulator, which runs their twins)."""
    return D == 64 and (runtime.warpgroup_mma() if hopper is None else hopper)


@cache
def wgmma_forward(D: int) -> Kernel:
    """The forward kernel on warpgroup products for head size D, with the dynamic shared memory
    (bytes) it takes; it takes its arguments as mma.py's forward does."""
    s = sizes(D)
    W, KD, ND, CHUNKS_PER_ROW = s.W, s.KD, s.ND, s.CHUNKS_PER_ROW
    copies, products = tile_copies(D), tile_products(D)
    rows_of, copy_tiles = copies.rows_of, copies.copy_tiles
    online_softmax, finish_rows = products.online_softmax, products.finish_rows
    WG_TILE = MMA_ROWS * W                      # words of a swizzled tile
    WG_SLACK = 256                              # words the first aligned word may lie past the buffer's start
    WG_GROUP = 8 * 4 * W                        # bytes between groups of 8 rows

    @cuda.jit(device=True, inline=True)
    def swizzled_plan(stride, tid):
        # mma.py's copy_plan for a swizzled tile: 16-byte chunk c of row r goes to chunk c ^ (r % 8);
        # the rows a thread copies are COPY_ROWS (a multiple of 8) apart, so one plan serves them all
        row, chunk = u32(tid) // u32(CHUNKS_PER_ROW), u32(tid) % u32(CHUNKS_PER_ROW)
        return i32(row), row * u32(W) + u32(4) * (chunk ^ (row % u32(8))), u64(row) * stride + u64(4 * chunk)

    @cuda.jit(**kernel_options(MMA_MAX_REGISTERS[0]))
    def wgmma_forward_kernel(q, k, v, T, S, H, KV, scale, o, lse):
        # as mma_forward_kernel: grid (B * H, T / 64), 128 threads (one warpgroup), 16 query rows a warp
        b, h, kv, tid, warp, lane, g, t, t0, r0 = query_block(H, KV)
        sh = cuda.shared.array(0, uint32, alignment=SHARED_ALIGN)
        sb = device.shared_base(sh)
        q_at = ((u32(1024) - (sb & u32(1023))) & u32(1023)) >> u32(2)
        kv_at = q_at + u32(WG_TILE)
        scores = cuda.local.array((NR, 4), float32)
        acc = cuda.local.array((ND, 4), float32)
        probs = cuda.local.array((KR, 4), uint32)
        kv_start, kv_stride = rows_of(b, S, kv, KV)
        plan = swizzled_plan(kv_stride, tid)
        copy_tiles(sh, sb, kv_at, k, v, kv_start, kv_stride, plan, 0, S, True, W, WG_TILE)
        q_start, q_stride = rows_of(b, T, h, H)
        copy_tiles(sh, sb, q_at, q, q, q_start, q_stride, swizzled_plan(q_stride, tid), t0, T, False, W, WG_TILE)
        q_desc = device.smem_descriptor(sb + u32(4) * q_at, u32(WG_GROUP))
        zero(acc)
        scale2 = scale * f32(LOG2E)
        top_a, top_b = f32(MASKED), f32(MASKED)
        sum_a, sum_b = f32(0.0), f32(0.0)
        last_a, last_b = min((S - T) + r0 + g, S - 1), min((S - T) + r0 + g + 8, S - 1)
        diagonal = (S - T) + t0
        keys_end = min(S, diagonal + MMA_ROWS)
        for s0 in range(0, keys_end, MMA_ROWS):
            stage = u32(u32(s0) // u32(MMA_ROWS) % u32(2) * u32(2 * WG_TILE))
            device.cp_async_wait_all()
            device.proxy_fence()   # the copies' writes, visible to the tensor cores
            cuda.syncthreads()      # this stage has landed; every warp's products of the other are done
            if s0 + MMA_ROWS < keys_end:
                copy_tiles(sh, sb, kv_at + u32(2 * WG_TILE) - stage, k, v, kv_start, kv_stride, plan, s0 + MMA_ROWS,
                           S, True, W, WG_TILE)
            k_desc = device.smem_descriptor(sb + u32(4) * (kv_at + stage), u32(WG_GROUP))
            v_desc = device.smem_descriptor(sb + u32(4) * (kv_at + stage + u32(WG_TILE)), u32(WG_GROUP))
            device.wgmma_fence(scores, scores)
            for kc in range(KD):   # k-step kc: 32 bytes along the rows of q and k
                device.wgmma_ss(scores, sh, q_desc + u64(2 * kc), k_desc + u64(2 * kc), kc > 0)
            device.wgmma_commit()
            device.wgmma_wait(scores)
            if s0 + MMA_ROWS - 1 > diagonal:
                mask_outside(scores, i32(-1), i32(last_a - s0 - 2 * t), i32(-1), i32(last_b - s0 - 2 * t))
            top_a, top_b, sum_a, sum_b = online_softmax(scores, acc, top_a, top_b, sum_a, sum_b, scale2)
            for kc in range(KR):
                probs[kc, 0], probs[kc, 1], probs[kc, 2], probs[kc, 3] = row_fragment(scores, kc)
            device.wgmma_fence(acc, probs)
            for kc in range(KR):   # k-step kc: 16 rows of v, two groups of 8
                device.wgmma_rs_t(acc, probs[kc, 0], probs[kc, 1], probs[kc, 2], probs[kc, 3], sh,
                                   v_desc + u64(2 * WG_GROUP // 16 * kc), True)
            device.wgmma_commit()
            device.wgmma_wait(acc)
        finish_rows(o, lse, acc, top_a, top_b, sum_a, sum_b, scale, b, h, r0, T, H, g, t)

    return Kernel(wgmma_forward_kernel, 4 * (WG_SLACK + 5 * WG_TILE))
