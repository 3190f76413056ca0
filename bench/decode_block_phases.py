"""Where the GPU's decode_block launch spends its time: the kernel timed (a captured graph of 16
launches back to back, as a step's 16 blocks run, replayed 30 times after a warm-up: GPU time and
the graph's launch, a median) running its phases 0 .. k - 1 for k = 1 .. 6, at the `gpu` preset's sizes
with bf16 matrices, one token per row at position 200; and with no rows at all (the barriers, the
prefetch and the launch alone):

    python bench/decode_block_phases.py [--rows R] [--blocks-per-sm N] [--warps W]
"""

import argparse
import statistics
import time

import numpy as np
from numba import cuda

from nanoeuler_core import registry
from nanoeuler_core.registry import bf16_bits
from nanoeuler_ops.cuda import decode_block, runtime

C, H, KV, D, F, S = 768, 12, 4, 64, 2048, 515   # the gpu preset (S: its cache with 3 positions of slack)
LAYERS = 16


def launches(rows: int):
    """The (kernel, blocks, threads, args) of one decode_block call over `rows` rows."""
    rng = np.random.default_rng(0)

    def bf16(*shape, scale=0.03):
        return cuda.to_device(bf16_bits((scale * rng.standard_normal(shape)).astype(np.float32)))

    x = cuda.to_device(rng.standard_normal((rows, 1, C)).astype(np.float32))
    caches = [cuda.to_device(rng.standard_normal((rows, S, KV, D)).astype(np.float32)) for _ in range(2)]
    pos = cuda.to_device(np.full(rows, 200, np.int64))
    seen = []
    real_launch = runtime.launch
    runtime.launch = lambda kernel, blocks, threads, *args, **kw: seen.append((kernel, blocks, threads, args[2:]))
    try:
        decode_block.forward(x, bf16(C, scale=1.0), bf16((H + 2 * KV) * D, C), *caches, pos, bf16(C, H * D),
                             bf16(C, scale=1.0), bf16(2 * F, C), bf16(C, F), n_kv_heads=KV, theta=10000.0, eps=1e-5)
    finally:
        runtime.launch = real_launch
    return seen[0]


def timed(kernel, blocks, threads, args, last: int) -> float:
    """Median microseconds a launch running phases 0 .. last - 1 takes among LAYERS in a graph."""
    be = registry.backend("cuda")

    def layers():
        for _ in range(LAYERS):
            runtime.launch(kernel, blocks, threads, 0, last, *args, overlap=True)

    replay, _ = be.capture(layers)
    for _ in range(5):
        replay()
    times = []
    for _ in range(30):
        be.synchronize()
        start = time.perf_counter()
        replay()
        be.synchronize()
        times.append((time.perf_counter() - start) / LAYERS)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--blocks-per-sm", type=int, default=decode_block.BLOCKS_PER_SM)
    parser.add_argument("--warps", type=int, default=decode_block.WARPS)
    parser.add_argument("--ptx", help="write the kernel's PTX here")
    args = parser.parse_args()
    decode_block.BLOCKS_PER_SM, decode_block.WARPS = args.blocks_per_sm, args.warps
    kernel, blocks, threads, call = launches(args.rows)
    compiled = runtime._compiled_for(kernel, (0, decode_block.PHASES, *call))[0]
    print(f"{blocks} blocks of {threads} threads, {args.rows} rows; {compiled.regs_per_thread} registers a thread, "
          f"{compiled.local_mem_per_thread} bytes of local memory")
    if args.ptx:
        with open(args.ptx, "w") as f:
            f.write(compiled.inspect_asm(cuda.get_current_device().compute_capability))
    for last in range(1, decode_block.PHASES + 1):
        print(f"phases 0..{last - 1}: {timed(kernel, blocks, threads, call, last):8.1f} us")
    kernel, blocks, threads, call = launches(0)
    print(f"no rows, all phases: {timed(kernel, blocks, threads, call, decode_block.PHASES):8.1f} us")


if __name__ == "__main__":
    main()
