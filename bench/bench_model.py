"""Training-step speed of the nanoeuler engine against PyTorch eager, same model, batch and machine.

    python bench/bench_model.py [--preset small] [--batch-size 8] [--iters 20] [--backend cpu]

Each engine runs in its own process (so thread pools and peak memory stay separate): one
forward+backward of the MTP loss per iteration, medians after warm-up. Also reports the cold and
warm start of a `small` forward+backward (Numba compiling into an empty cache, then loading it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def batch(cfg, batch_size, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab_size, (batch_size, cfg.ctx_len + 1))
    return ids[:, :-1], ids[:, 1:]


def worker_nanoeuler(args) -> dict:
    from nanoeuler_core import Model, ModelConfig

    cfg = ModelConfig.preset(args.preset)
    model = Model(cfg, backend=args.backend, seed=0)
    inputs, targets = batch(cfg, args.batch_size)
    for _ in range(args.warmup):
        model.loss_and_backward(inputs, targets)
    times = []
    for _ in range(args.iters):
        t = time.perf_counter()
        model.loss_and_backward(inputs, targets)
        model.backend.synchronize()
        times.append(time.perf_counter() - t)
    return {"median_s": statistics.median(times)}


def worker_torch(args) -> dict:
    import torch

    sys.path.insert(0, str(HERE))
    from torch_model import TorchModel

    from nanoeuler_core import Model, ModelConfig

    torch.set_num_threads(args.threads)
    cfg = ModelConfig.preset(args.preset)
    model = TorchModel(cfg).load(Model(cfg, backend="reference", seed=0).params)
    inputs, targets = (torch.tensor(a) for a in batch(cfg, args.batch_size))
    times = []
    for i in range(args.warmup + args.iters):
        t = time.perf_counter()
        model.zero_grad(set_to_none=True)
        model.loss(inputs, targets).backward()
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    return {"median_s": statistics.median(times), "torch": torch.__version__}


def start_time(cache_dir: str) -> float:
    """Seconds for a fresh process to import, build a `small` model and run one forward+backward."""
    code = ("import time; t = time.perf_counter()\n"
            "from nanoeuler_core import Model, ModelConfig\n"
            "import numpy as np\n"
            "m = Model(ModelConfig.preset('small'))\n"
            "x = np.zeros((2, 128), dtype=np.int64) + 7\n"
            "m.loss_and_backward(x, x)\n"
            "print(time.perf_counter() - t)\n")
    env = {**os.environ, "NUMBA_CACHE_DIR": cache_dir}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def run_worker(name: str, args) -> dict | None:
    cmd = [sys.executable, __file__, "--worker", name] + [f"--{k.replace('_', '-')}={v}" for k, v in
                                                         vars(args).items() if k not in ("worker", "no_start")]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        print(f"{name} worker failed:\n{out.stderr.strip()[-2000:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--no-start", action="store_true", help="skip the cold/warm start measurement")
    p.add_argument("--worker", choices=["nanoeuler", "torch"], help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.worker:
        result = (worker_nanoeuler if args.worker == "nanoeuler" else worker_torch)(args)
        result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(result))
        return

    from nanoeuler_core import ModelConfig

    cfg = ModelConfig.preset(args.preset)
    tokens = args.batch_size * cfg.ctx_len
    print(f"preset {args.preset} ({cfg.n_params():,} params), batch {args.batch_size} x {cfg.ctx_len}, "
          f"backend {args.backend}, {os.cpu_count()} cores, forward+backward, median of {args.iters}")
    if not args.no_start:
        with tempfile.TemporaryDirectory() as cache:
            cold, warm = start_time(cache), start_time(cache)
        print(f"start of a small forward+backward: cold {cold:.1f} s (compiling), warm {warm:.1f} s (cached kernels)")
    ours = run_worker("nanoeuler", args)
    peer = None
    try:
        import torch  # noqa: F401
        peer = run_worker("torch", args)
    except ImportError:
        print("torch not installed: no peer comparison (pip install 'nanoeuler[bench]')")
    print(f"{'engine':<22}{'ms/step':>10}{'tokens/s':>12}{'peak RSS MB':>14}")
    for name, r in (("nanoeuler " + args.backend, ours), (f"torch eager {peer.get('torch', '') if peer else ''}", peer)):
        if r:
            print(f"{name:<22}{r['median_s'] * 1e3:>10.1f}{tokens / r['median_s']:>12.0f}{r['peak_rss_mb']:>14.0f}")
    if ours and peer:
        print(f"ratio nanoeuler / torch (tokens/s): {peer['median_s'] / ours['median_s']:.2f}")


if __name__ == "__main__":
    main()
