"""The decoding ops' matrix products on a GPU in each weight format: float32 (FMA kernels), bf16 (the
tensor-core kernels the decoder reads by default), int8 and int4 (the quantized kernels), at the
shapes of a model preset's decoding step (`gpu` unless told) and N rows (1: plain decoding).

    python bench/quantized_gpu.py [--preset gpu] [--rows 1,4,16] [--json results.json]

Each product is timed as bench/bench_kernels_cuda.py times the decoding kernels (CUDA events around
batches of back-to-back launches queued behind a sleep kernel, the median batch, after a warm-up
call), each launch reading the next of enough copies of its weights that they come from HBM, not
L2, as a decoding step's do. A line per product and format: microseconds, weight bytes (with the
scales and offsets) per second, and the time against bf16's; then a step's products added up
(each layer's four, and the output head of plain decoding).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import numba
import numpy as np
from numba import cuda

FORMATS = ("fp32", "bf16", "int8", "int4")
COLD_BYTES = 256 << 20   # weights each product cycles through: 5x an H200's 50 MB of L2


def products(cfg) -> list[tuple[str, str, int, int, int]]:
    """(op, matrix, outputs O, inputs K, times a decoding step runs it) of the preset's step."""
    C, F, V = cfg.dim, cfg.hidden_dim, cfg.vocab_size
    KV = cfg.n_kv_heads * cfg.head_dim
    return [("norm_linear", "wqkv", C + 2 * KV, C, cfg.n_layers),
            ("linear_residual", "wo", C, C, cfg.n_layers),
            ("norm_swiglu", "w_gate_up", 2 * F, C, cfg.n_layers),
            ("linear_residual", "w_down", C, F, cfg.n_layers),
            ("norm_linear", "head", V, C, 1)]


def weight_copies(backend, w: np.ndarray, fmt: str) -> tuple[list[tuple], int]:
    """Copies of the matrix w in `fmt` on the GPU, each a weight argument ((w,) or (q, scale, zero)),
    as many as make COLD_BYTES; and one copy's bytes."""
    from nanoeuler_core import quantized

    if fmt in ("fp32", "bf16"):
        host, storage, nbytes = (w,), ("bf16" if fmt == "bf16" else None), w.size * (2 if fmt == "bf16" else 4)
    else:
        host, storage = quantized.quantize(w, fmt, quantized.DEFAULT_GROUP[fmt]), None
        nbytes = quantized.nbytes(*host)
    return [tuple(backend.asarray(a, storage) for a in host) for _ in range(-(-COLD_BYTES // nbytes))], nbytes


def timed(time_numba, op: str, rows: int, O: int, K: int, copies, rng, backend) -> float:
    """Median microseconds of one launch of `op` at `rows` rows, cycling through the weight copies
    (O outputs: linear_residual's residual)."""
    from nanoeuler_ops.cuda import linear_residual, norm_linear, norm_swiglu

    x = backend.asarray(rng.standard_normal((rows, K)))
    turn = itertools.cycle(copies)
    if op == "linear_residual":
        r = backend.asarray(rng.standard_normal((rows, O)))
        return 1e3 * time_numba(lambda: linear_residual.forward(x, r, *next(turn)))
    g = backend.asarray(1.0 + 0.1 * rng.standard_normal(K), "bf16")
    forward = norm_linear.forward if op == "norm_linear" else norm_swiglu.forward
    return 1e3 * time_numba(lambda: forward(x, g, *next(turn), eps=1e-5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpu", help="model preset whose decoding shapes to time (default gpu)")
    parser.add_argument("--rows", default="1", help="rows a product takes, comma-separated (default 1)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()
    if numba.config.ENABLE_CUDASIM or not cuda.is_available():
        sys.exit("bench/quantized_gpu.py times kernels on a GPU, and there is none here"
                 + (" (NUMBA_ENABLE_CUDASIM is set)" if numba.config.ENABLE_CUDASIM else ""))
    from bench_kernels_cuda import time_numba
    from nanoeuler_core.engine.config import ModelConfig
    from nanoeuler_ops.cuda import BACKEND

    try:
        cfg = ModelConfig.preset(args.preset)
        row_counts = [int(n) for n in args.rows.split(",")]
    except ValueError as e:
        sys.exit(f"bench/quantized_gpu.py: {e}")
    name = cuda.get_current_device().name
    name = name.decode() if isinstance(name, bytes) else name
    print(f"{name}; the {args.preset} preset's decoding products; float32 rows, bf16 norm gains; int8 groups "
          f"of a row, int4 groups of 32 with offsets; weights read from HBM, not L2")
    rng = np.random.default_rng(0)
    results = []
    for rows in row_counts:
        step = dict.fromkeys(FORMATS, 0.0)
        for op, matrix, O, K, per_step in products(cfg):
            w = 0.02 * rng.standard_normal((O, K))
            timings = {}
            for fmt in FORMATS:
                copies, nbytes = weight_copies(BACKEND, w, fmt)
                timings[fmt] = timed(time_numba, op, rows, O, K, copies, rng, BACKEND), nbytes
            for fmt, (us, nbytes) in timings.items():
                step[fmt] += per_step * us
                speed = timings["bf16"][0] / us
                results.append(dict(rows=rows, op=op, matrix=matrix, shape=[O, K], format=fmt, us=us,
                                    weight_bytes=nbytes, bytes_per_s=nbytes / (us * 1e-6), speed_over_bf16=speed))
                print(f"{rows:2d} rows  {op:<15} {matrix:<9} {O:5d}x{K:<5d} {fmt:<4}  {us:8.2f} us  "
                      f"{nbytes / (us * 1e-6) / 1e9:7.0f} GB/s  {speed:5.2f}x bf16's speed", flush=True)
        print(f"{rows:2d} rows  a step's products ({cfg.n_layers} layers x 4, the head): " + ", ".join(
            f"{fmt} {step[fmt]:.1f} us ({step['bf16'] / step[fmt]:.2f}x bf16's speed)" for fmt in FORMATS), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, preset=args.preset, results=results), f, indent=1)


if __name__ == "__main__":
    main()
