"""Training speed of the engine against PyTorch on the same model, batch and machine.

Each engine runs in its own process, so thread pools, compilation caches and peak memory stay
separate: nanoeuler (its captured training step: forward, backward, clipping, AdamW), then,
where torch is installed, the same architecture in PyTorch (eager, and with torch.compile on a
GPU), with the same AdamW settings and the same precision (TF32 matrix products for tf32; bf16
autocast with float32 master weights for bf16). Times are medians over the timed steps after
warm-up, with the device synchronised around each step.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from nanoeuler_core.bench.measure import memory_mb, run_worker

MODULE = "nanoeuler_core.bench.training"

# Dense tensor-core / FP32 peaks (vendor datasheets, SXM parts), for model FLOPs utilisation.
PEAK_TFLOPS = {"H100": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}, "H200": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}}


def _batch(cfg, batch_size: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab_size, (batch_size, cfg.ctx_len + 1))
    return ids[:, :-1], ids[:, 1:]


def worker_nanoeuler(preset: str, backend: str, batch_size: int, steps: int, warmup: int, precision: str,
                     profile: bool, recompute: bool = False) -> dict:
    from nanoeuler_core import Model, ModelConfig
    from nanoeuler_core.engine.optim import AdamW
    from nanoeuler_core.training.step import TrainStep

    cfg = ModelConfig.preset(preset)
    model = Model(cfg, backend=backend, seed=0, precision=precision, recompute=recompute)
    step = TrainStep(model, AdamW(model))
    inputs, targets = _batch(cfg, batch_size)
    times, memory = [], 0.0
    for i in range(warmup + steps):
        t = time.perf_counter()
        step(inputs, targets, 1e-4)
        model.backend.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t)
        memory = max(memory, memory_mb(model.backend))
    result = {"median_s": statistics.median(times), "memory_mb": memory}
    if profile:
        result["ops"] = profile_ops(model, inputs, targets)
    return result


def profile_ops(model, inputs, targets, repeats: int = 3) -> list[tuple[str, float]]:
    """Milliseconds per training step spent in each op (forward and backward apart), eager, the
    device synchronised around every call: the ops to optimise next, largest first."""
    from types import SimpleNamespace

    from nanoeuler_core.registry import Impl

    totals: dict[str, float] = {}
    be = model.backend

    def timed(fn, key):
        def call(*args, **kwargs):
            be.synchronize()
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            be.synchronize()
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - t
            return out
        return call

    plain = model.ops
    model.ops = SimpleNamespace(**{
        name: Impl(timed(impl.forward, f"{name} fwd"), impl.backward and timed(impl.backward, f"{name} bwd"))
        for name, impl in vars(plain).items()})
    try:
        model.loss_and_backward(inputs, targets)
        totals.clear()
        for _ in range(repeats):
            model.loss_and_backward(inputs, targets)
    finally:
        model.ops = plain
    return sorted(((k, v / repeats * 1e3) for k, v in totals.items()), key=lambda kv: -kv[1])


def worker_torch(preset: str, backend: str, batch_size: int, steps: int, warmup: int, precision: str,
                 compile: bool) -> dict:
    import torch

    from nanoeuler_core import Model, ModelConfig, registry
    from nanoeuler_core.bench.torch_peer import TorchModel, peer_memory_mb, synchronize

    device = registry.backend(backend).peer_device
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16")
    on_cpu = torch.device(device).type == "cpu"
    if on_cpu:
        torch.set_num_threads(cpu_threads())
    cfg = ModelConfig.preset(preset)
    model = TorchModel(cfg, device=device).load(Model(cfg, backend="cpu", seed=0).params).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            fused=not on_cpu)
    loss_fn = torch.compile(model.loss) if compile else model.loss
    inputs, targets = (torch.tensor(a, device=device) for a in _batch(cfg, batch_size))
    times = []
    for i in range(warmup + steps):
        synchronize(device)
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = loss_fn(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return {"median_s": statistics.median(times), "memory_mb": peer_memory_mb(device), "torch": torch.__version__}


def cpu_threads() -> int:
    """The threads a CPU engine gets here: NUMBA_NUM_THREADS where set (nanoeuler's count), else the
    cores this process may run on (its affinity: `taskset -c 0,1` makes a 2-core machine)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return int(os.environ.get("NUMBA_NUM_THREADS") or 0) or cores


def start_time(cache_dir: str) -> float:
    """Seconds for a fresh process to import nanoeuler, build a `small` model and run one
    forward+backward on the CPU, with Numba's kernel cache in `cache_dir`."""
    code = ("import time; t = time.perf_counter()\n"
            "import numpy as np\n"
            "from nanoeuler_core import Model, ModelConfig\n"
            "m = Model(ModelConfig.preset('small'))\n"
            "x = np.full((2, 128), 7)\n"
            "m.loss_and_backward(x, x)\n"
            "print(time.perf_counter() - t)\n")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "NUMBA_CACHE_DIR": cache_dir},
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def run(preset: str, backend: str, batch_size: int, steps: int, warmup: int, precision: str, profile: bool,
        peers: bool, echo=print, recompute: bool = False) -> dict:
    """Measure nanoeuler and its PyTorch peers; print a table; return the numbers."""
    from nanoeuler_core import ModelConfig, registry

    be = registry.backend(backend)
    cfg = ModelConfig.preset(preset)
    tokens = batch_size * cfg.ctx_len
    machine = be.device_name() + (f", {cpu_threads()} threads" if be.peer_device == "cpu" else "")
    echo(f"preset {preset} ({cfg.n_params():,} parameters), batch {batch_size} x {cfg.ctx_len}, {machine}, "
         f"training step (forward, backward, clipping, AdamW), median of {steps} after {warmup} warm-up"
         + ("; nanoeuler recomputes activations (--recompute)" if recompute else ""))
    common = dict(preset=preset, backend=backend, batch_size=batch_size, steps=steps, warmup=warmup, precision=precision)
    rows = {f"nanoeuler {backend} {precision}": run_worker({**common, "engine": "nanoeuler", "profile": profile,
                                                            "recompute": recompute}, MODULE)}
    if peers:
        try:
            import torch  # noqa: F401  (only to know whether the peers can run)
        except ImportError:
            echo("torch is not installed: no peer comparison (pip install 'nanoeuler[bench]')")
        else:
            rows[f"torch eager {precision}"] = run_worker({**common, "engine": "torch", "compile": False}, MODULE)
            if be.peer_device != "cpu":   # torch.compile's CPU code is not what its users run
                rows[f"torch compile {precision}"] = run_worker({**common, "engine": "torch", "compile": True}, MODULE)
    peak = next((v[precision] for k, v in PEAK_TFLOPS.items() if k in machine), None)
    echo(f"{'engine':<28}{'ms/step':>10}{'tokens/s':>12}{'MFU':>8}{'memory MB':>12}{'vs ours':>9}")
    ours = rows[f"nanoeuler {backend} {precision}"]
    for name, r in rows.items():
        if r is None:
            continue
        tps = tokens / r["median_s"]
        mfu = f"{tps * cfg.flops_per_token() / (peak * 1e12):.1%}" if peak else "-"
        ratio = f"{r['median_s'] / ours['median_s']:.2f}" if ours else "-"
        echo(f"{name:<28}{r['median_s'] * 1e3:>10.1f}{tps:>12.0f}{mfu:>8}{r['memory_mb']:>12.0f}{ratio:>9}")
        r["tokens_per_s"] = tps
    if ours:
        for name, r in rows.items():
            if r is not None and name.startswith("torch"):
                echo(f"ratio nanoeuler / {name} (tokens/s): {r['median_s'] / ours['median_s']:.2f}")
        if profile and ours.get("ops"):
            echo("per-op time in an eager step (ms, device synchronised around each call):")
            for name, ms in ours["ops"][:12]:
                echo(f"  {name:<22}{ms:>9.2f}")
    return {"machine": machine, "rows": rows}


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    engine = spec.pop("engine")
    result = worker_nanoeuler(**spec) if engine == "nanoeuler" else worker_torch(**spec)
    print(json.dumps(result))
