"""The CPU step's matrix products alone, one by one: the linear layers' forward and both gradients
at a preset's shapes (batch x context tokens), timed through the CPU backend's `gemm` (one
OpenBLAS tile per Numba thread; also with 2 and 4 tiles a thread), OpenBLAS's own threads (NumPy's
product), and PyTorch's CPU product where PyTorch is installed. Median of `--repeats` after a
warm-up; GFLOP/s per product and the step's products in all. With --in-step, the same products
timed where they run, inside training steps of the model (each `gemm` call of the linear layers
timed; median per shape over the steps), beside the step's own time:

    NUMBA_NUM_THREADS=16 OPENBLAS_NUM_THREADS=16 taskset -c 0-15 python bench/cpu_products.py --preset cpu-medium [--in-step]
"""

import argparse
import statistics
import time

from nanoeuler_core.engine.config import ModelConfig   # first: it sets the thread pools' waiting before NumPy loads
from nanoeuler_ops.cpu import common

import numba  # noqa: E402
import numpy as np  # noqa: E402


def products(cfg: ModelConfig, tokens: int):
    """(name, M, N, K, trans_a, trans_b, count) of every linear product a training step runs, count the
    layers; out (M, N) = op(a) (M, K) @ op(b) (K, N)."""
    C, F = cfg.dim, cfg.hidden_dim
    qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    L = cfg.n_layers
    for name, I, O in (("qkv", C, qkv), ("wo", C, C), ("gate_up", C, 2 * F), ("down", F, C)):
        yield f"{name} forward", tokens, O, I, False, True, L     # y = x @ w.T
        yield f"{name} dx", tokens, I, O, False, False, L         # dx = dy @ w
        yield f"{name} dw", O, I, tokens, True, False, L          # dw = dy.T @ x


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def in_step(cfg: ModelConfig, batch_size: int, steps: int) -> None:
    """Each linear product's time inside training steps (medians per shape and step) and the step's."""
    from collections import defaultdict

    from nanoeuler_core import Model
    from nanoeuler_core.bench.training import _batch
    from nanoeuler_core.engine.optim import AdamW
    from nanoeuler_core.training.step import TrainStep
    from nanoeuler_ops.cpu import linear

    model = Model(cfg, backend="cpu", seed=0)
    step = TrainStep(model, AdamW(model))
    inputs, targets = _batch(cfg, batch_size)
    calls = defaultdict(list)   # (M, N, K, trans_a, trans_b, accumulate) -> seconds of each call
    plain = linear.gemm

    def timed_gemm(a, b, out, trans_a=False, trans_b=False, accumulate=False):
        start = time.perf_counter()
        result = plain(a, b, out, trans_a, trans_b, accumulate)
        M, N = out.shape
        calls[(M, N, a.shape[0] if trans_a else a.shape[1], trans_a, trans_b, accumulate)].append(
            time.perf_counter() - start)
        return result

    linear.gemm = timed_gemm
    step_times = []
    for i in range(steps + 2):
        if i == 2:
            calls.clear()
        start = time.perf_counter()
        step(inputs, targets, 1e-4)
        step_times.append(time.perf_counter() - start)
    linear.gemm = plain
    total = 0.0
    print(f"{'M x N x K':>18s} trans acc  calls/step  median ms  (GFLOP/s)  ms/step")
    for (M, N, K, ta, tb, acc), times in sorted(calls.items()):
        per_step = sum(times) / steps
        total += per_step
        median = statistics.median(times)
        print(f"{f'{M}x{N}x{K}':>18s} {'T' if ta else '-'}{'T' if tb else '-'}    {'+' if acc else '-'}  "
              f"{len(times) / steps:10.0f} {median * 1e3:10.3f} ({2 * M * N * K / median / 1e9:6.0f}) {per_step * 1e3:8.1f}")
    print(f"linear products {total * 1e3:.1f} ms of a {statistics.median(step_times[2:]) * 1e3:.1f} ms step (median)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="cpu-medium")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--in-step", action="store_true", help="time the products inside training steps")
    args = parser.parse_args()
    cfg = ModelConfig.preset(args.preset)
    if args.in_step:
        return in_step(cfg, args.batch_size, args.repeats)
    threads = numba.get_num_threads()
    try:
        import torch
        torch.set_num_threads(threads)
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    engines = ["gemm", "gemm 2/thread", "gemm 4/thread", "openblas threads"] + (["torch"] if torch else [])
    totals = dict.fromkeys(engines, 0.0)
    print(f"{args.preset}, {args.batch_size} x {cfg.ctx_len} tokens, {threads} threads; ms (GFLOP/s)")
    print(f"{'product':16s} {'M x N x K':>18s} " + " ".join(f"{e:>18s}" for e in engines))
    for name, M, N, K, ta, tb, count in products(cfg, args.batch_size * cfg.ctx_len):
        a = rng.standard_normal((K, M) if ta else (M, K), dtype=np.float32)
        b = rng.standard_normal((N, K) if tb else (K, N), dtype=np.float32)
        out = np.empty((M, N), np.float32)

        def tiles(per_thread):   # as gemm runs them, OpenBLAS held to one thread around the tiles
            rows, cols = common._tiles(M, N, K, threads * per_thread)

            def run():
                with common.one_blas_thread():
                    common._gemm_tiles(a, b, out, ta, tb, np.float32(0.0), rows, cols)
            return run

        op_a, op_b = (a.T if ta else a), (b.T if tb else b)
        runs = {"gemm": lambda: common.gemm(a, b, out, ta, tb),
                "gemm 2/thread": tiles(2), "gemm 4/thread": tiles(4),
                "openblas threads": lambda: np.matmul(op_a, op_b, out=out)}
        if torch:
            ta_, tb_, to_ = torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(out)
            runs["torch"] = lambda: torch.matmul(ta_.T if ta else ta_, tb_.T if tb else tb_, out=to_)
        cells = []
        for engine in engines:
            seconds = timed(runs[engine], args.repeats)
            totals[engine] += seconds * count
            cells.append(f"{seconds * 1e3:8.3f} ({2 * M * N * K / seconds / 1e9:6.0f})")
        print(f"{name:16s} {f'{M}x{N}x{K}':>18s} " + " ".join(f"{c:>18s}" for c in cells))
    print(f"{'a step, in all':35s} " + " ".join(f"{totals[e] * 1e3:15.1f} ms" for e in engines))


if __name__ == "__main__":
    main()
