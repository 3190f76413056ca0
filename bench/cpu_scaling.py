"""How each op of the CPU training step scales with threads: the per-op profile of an eager step
(`nanoeuler-run bench --profile`'s) at 1, 2, 4, ... threads, one column each, and the speed-up of
the last column over the first:

    NUMBA_NUM_THREADS=16 OPENBLAS_NUM_THREADS=16 taskset -c 0-15 python bench/cpu_scaling.py --preset cpu-medium
"""

import argparse

from nanoeuler_core import Model, ModelConfig   # first: it sets the thread pools' waiting before NumPy loads
from nanoeuler_core.bench.training import _batch, profile_ops

import numba  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="cpu-medium")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", default=None, help="comma-separated thread counts (default: 1, 2, 4, ... all)")
    args = parser.parse_args()
    most = numba.config.NUMBA_NUM_THREADS
    counts = [int(n) for n in args.threads.split(",")] if args.threads else \
        sorted({min(most, 1 << i) for i in range(most.bit_length() + 1)})
    cfg = ModelConfig.preset(args.preset)
    model = Model(cfg, backend="cpu", seed=0)
    inputs, targets = _batch(cfg, args.batch_size)
    table: dict[str, dict[int, float]] = {}
    for n in counts:
        numba.set_num_threads(n)
        for name, ms in profile_ops(model, inputs, targets):
            table.setdefault(name, {})[n] = ms
    print(f"{args.preset}, batch {args.batch_size} x {cfg.ctx_len}: ms per step in each op (eager, synchronised)")
    print(f"{'op':18s}" + "".join(f"{f'{n} thr':>10s}" for n in counts) + f"{'speed-up':>10s}")
    for name, row in sorted(table.items(), key=lambda kv: -kv[1][counts[-1]]):
        print(f"{name:18s}" + "".join(f"{row[n]:10.2f}" for n in counts) + f"{row[counts[0]] / row[counts[-1]]:9.1f}x")
    totals = {n: sum(row[n] for row in table.values()) for n in counts}
    print(f"{'in all':18s}" + "".join(f"{totals[n]:10.1f}" for n in counts) + f"{totals[counts[0]] / totals[counts[-1]]:9.1f}x")


if __name__ == "__main__":
    main()
