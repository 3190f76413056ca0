"""Per-kernel timings of the CUDA backend at the `gpu` preset's shapes, against the roofline and,
where torch is installed, the same operation in PyTorch on the same card, in one precision.

    python bench/bench_kernels_cuda.py [--batch-size 32] [--precision bf16|tf32|fp32] [--ops rmsnorm,add_rmsnorm]
                                       [--json results.json]
    python bench/bench_kernels_cuda.py --decode [--ops norm_swiglu] [--json results.json]

In bf16 the activations are bf16 in both engines (PyTorch: bf16 tensors, SDPA's flash kernel);
AdamW stays float32 (master weights).

--decode times the weight-reading decoding kernels instead (norm_linear, linear_residual,
norm_swiglu) at 1, 4, 8 and 32 rows, as a decoding step runs them: bf16 weights, float32 activations.
Their roofline is reading the weights once: the figure is weight bytes per second.

Each figure is the median over several timed batches of GPU time per call, measured with CUDA
events after a warm-up. A sleep kernel queued ahead of each batch lets the host queue the whole
batch before the GPU reaches it, so launch latency stays out of the per-kernel numbers (the
graph-replayed training step hides it the same way). Output buffers come from the arena in
replay mode, so no allocation happens inside a timed batch.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import numpy as np
from numba import cuda

from nanoeuler_core import registry
from nanoeuler_ops.cuda import BACKEND, cublas, runtime
from nanoeuler_ops.cuda import (adamw, add, add_rmsnorm, attention, cross_entropy, embedding, linear, linear_residual,
                                norm_linear, norm_swiglu, qkv_rope, rmsnorm, swiglu)

C, H, KV, D, F, V, THETA = 768, 12, 4, 64, 2048, 4096, 10000.0   # the gpu preset
PARAMS = 116_417_280
PEAK = {"fp32": 67e12, "tf32": 495e12, "bf16": 989e12}   # Hopper SXM datasheet, dense (H100 and H200 alike)
REPS, BATCHES = 20, 5
DECODE_ROWS = (1, 4, 8, 32)   # a step over 1 row, 1 row fed 4 tokens (speculative), 8 rows, 8 rows fed 4 tokens each
SLEEP_NS = 20_000_000


@cuda.jit
def _sleep(ns):
    # a single thread idles ~ns nanoseconds, so launches queued behind it wait on the GPU
    for _ in range(ns // 1_000_000):
        cuda.nanosleep(1_000_000)


def time_numba(fn) -> float:
    """Median GPU milliseconds per call of fn (which launches on the default stream)."""
    # Run as inside a captured step: host-side input checks (a copy and a sync) are skipped.
    with runtime.on_stream(0, capturing=True):
        with runtime.ARENA.recording():
            fn()
        cuda.synchronize()
        times = []
        for _ in range(BATCHES):
            start, end = cuda.event(), cuda.event()
            _sleep[1, 1](SLEEP_NS)
            start.record()
            for _ in range(REPS):
                with runtime.ARENA.replaying():
                    fn()
            end.record()
            end.synchronize()
            times.append(cuda.event_elapsed_time(start, end) / REPS)
    return statistics.median(times)


def time_torch(torch, fn) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(BATCHES):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_NS)   # cycles, ~ns at Hopper clocks: the same queue-filling role
        start.record()
        for _ in range(REPS):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / REPS)
    return statistics.median(times)


@cuda.jit
def _copy(src, dst):
    # src (n,) -> dst (n,)
    i = cuda.grid(1)
    if i < src.shape[0]:
        dst[i] = src[i]


def copy_bandwidth(torch) -> tuple[float, str]:
    """The memory roofline: a 1 GiB device-to-device copy, bytes read + written per second
    (PyTorch's copy where torch is installed, else a plain Numba copy kernel)."""
    if torch is not None:
        src = torch.ones(1 << 28, device="cuda")
        dst = torch.empty_like(src)
        return 2 * src.nbytes / (time_torch(torch, lambda: dst.copy_(src)) * 1e-3), "torch copy"
    src = cuda.device_array(1 << 28, np.float32)
    runtime.fill(src, 1.0)
    dst = cuda.device_array_like(src)
    ms = time_numba(lambda: _copy[runtime.blocks_for(src.size, 256), 256](src, dst))
    return 2 * src.nbytes / (ms * 1e-3), "numba copy kernel"


def cases(B: int, rng, precision: str):
    """(op, pass, numba fn, key of the torch twin ("" if none), bytes moved, flops) at batch size B."""
    N, T = B * 512, 512
    storage = "bf16" if precision == "bf16" else None
    computing_in = registry.precision(precision)   # what the products take: TF32 or exact float32
    f32 = lambda *shape: BACKEND.asarray(rng.standard_normal(shape), storage)   # noqa: E731
    x, x2, w_norm = f32(N, C), f32(N, C), BACKEND.asarray(1.0 + 0.1 * rng.standard_normal(C))
    w_norm = BACKEND.asarray(1.0 + 0.1 * rng.standard_normal(C), storage)
    w_gate, gate_up = f32(F, C), f32(N, 2 * F)
    qkv = f32(B, T, (H + 2 * KV) * D)
    rope_attrs = dict(n_heads=H, n_kv_heads=KV, theta=THETA)
    q, k, v = f32(B, T, H, D), f32(B, T, KV, D), f32(B, T, KV, D)
    ids, table = BACKEND.asarray(rng.integers(0, V, N)), f32(V, C)
    logits = f32(N, V)
    targets_host = rng.integers(0, V, N)
    targets_host[::10] = -1
    targets = BACKEND.asarray(targets_host)
    dy_nc, dy_nf = f32(N, C), f32(N, F)
    dq_shape = f32(B, T, H, D)
    params, grads = BACKEND.asarray(rng.standard_normal(PARAMS)), BACKEND.asarray(rng.standard_normal(PARAMS))
    m, vv = BACKEND.asarray(0.1 * rng.standard_normal(PARAMS)), BACKEND.asarray(0.01 * rng.random(PARAMS))
    sched = BACKEND.asarray(np.array([3e-4, 10.0]))
    adam_attrs = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, n_decay=PARAMS - 16 * 2 * C,
                      max_grad_norm=1.0)

    _, norm_saved = rmsnorm.forward(x, w_norm, eps=1e-5)
    _, add_norm_saved = add_rmsnorm.forward(x, x2, w_norm, eps=1e-5)
    _, attn_saved = attention.forward(q, k, v)
    _, ce_saved = cross_entropy.forward(logits, targets)
    losses_grad = BACKEND.asarray(np.full(N, 1.0 / N))

    size = 2 if precision == "bf16" else 4
    nc, nf, nv = N * C * size, N * F * size, N * V * size
    attn_flops = 4 * B * H * T * T * D / 2
    qkv_bytes = (q.nbytes + k.nbytes + v.nbytes)
    return [
        ("embedding", "fwd", lambda: embedding.forward(ids, table), "embedding_fwd", 2 * nc, 0),
        ("embedding", "bwd", lambda: embedding.backward(dy_nc, (), ids, table), "embedding_bwd",
         2 * nc + table.nbytes, 0),
        ("rmsnorm", "fwd", lambda: rmsnorm.forward(x, w_norm, eps=1e-5), "rmsnorm_fwd", 2 * nc, 0),
        ("rmsnorm", "bwd", lambda: rmsnorm.backward(dy_nc, norm_saved, x, w_norm, eps=1e-5), "rmsnorm_bwd",
         3 * nc, 0),
        ("linear C->F", "fwd", lambda: linear.forward(x, w_gate, precision=computing_in), "linear_fwd", nc + nf, 2 * N * C * F),
        ("linear C->F", "bwd", lambda: linear.backward(dy_nf, (), x, w_gate, precision=computing_in), "linear_bwd", 2 * (nc + nf),
         4 * N * C * F),
        ("add_rmsnorm", "fwd", lambda: add_rmsnorm.forward(x, x2, w_norm, eps=1e-5), "add_rmsnorm_fwd", 4 * nc, 0),
        ("add_rmsnorm", "bwd", lambda: add_rmsnorm.backward((dy_nc, x2), add_norm_saved, None, None, w_norm, eps=1e-5),
         "add_rmsnorm_bwd", 4 * nc, 0),
        ("qkv_rope", "fwd", lambda: qkv_rope.forward(qkv, **rope_attrs), "qkv_rope_fwd", 2 * qkv.nbytes, 0),
        ("attention", "fwd", lambda: attention.forward(q, k, v), "attention_fwd", 2 * qkv_bytes, attn_flops),
        ("attention", "bwd", lambda: attention.backward(dq_shape, attn_saved, q, k, v), "attention_bwd",
         4 * qkv_bytes, 2.5 * attn_flops),
        ("swiglu", "fwd", lambda: swiglu.forward(gate_up), "swiglu_fwd", 3 * nf, 0),
        ("swiglu", "bwd", lambda: swiglu.backward(dy_nf, (), gate_up), "swiglu_bwd", 5 * nf, 0),
        ("add", "fwd", lambda: add.forward(x, x2), "add_fwd", 3 * nc, 0),
        ("cross_entropy", "fwd", lambda: cross_entropy.forward(logits, targets), "ce_fwd", nv, 0),
        ("cross_entropy", "bwd", lambda: cross_entropy.backward(losses_grad, ce_saved, logits, targets), "ce_bwd",
         2 * nv, 0),
        ("adamw", "step", lambda: adamw.forward(params, grads, m, vv, sched, **adam_attrs), "adamw", 8 * PARAMS * 4,
         0),
    ]


def torch_fns(torch, B: int, precision: str):
    """The same operations in PyTorch (float32 or bf16 activations), keyed as in `cases`."""
    import torch.nn.functional as tf
    N, T = B * 512, 512
    dev = "cuda"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    r = lambda *shape, grad=False: torch.randn(*shape, device=dev, dtype=dtype, requires_grad=grad)   # noqa: E731
    x, x2, w_norm = r(N, C, grad=True), r(N, C), r(C, grad=True)
    w_gate = r(F, C, grad=True)
    gate_up = r(N, 2 * F, grad=True)
    qkv = r(B, T, (H + 2 * KV) * D)
    q, k, v = r(B, H, T, D, grad=True), r(B, KV, T, D, grad=True), r(B, KV, T, D, grad=True)
    ids, table = torch.randint(0, V, (N,), device=dev), r(V, C, grad=True)
    logits, targets = r(N, V, grad=True), torch.randint(0, V, (N,), device=dev)
    targets[::10] = -1
    dy_nc, dy_nf = r(N, C), r(N, F)
    inv_freq = THETA ** (-torch.arange(0, D // 2, device=dev, dtype=torch.float64) * 2 / D)
    angles = torch.arange(T, device=dev, dtype=torch.float64)[:, None] * inv_freq
    cos, sin = angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]
    def rotate(u):
        a, b = u[..., :D // 2], u[..., D // 2:]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    def qkv_rope_fwd():
        q, k, v = qkv.view(B, T, H + 2 * KV, D).split((H, KV, KV), dim=2)
        return rotate(q), rotate(k), v.contiguous()

    def add_rmsnorm_fwd():
        s = x + x2
        return s, tf.rms_norm(s, (C,), w_norm, 1e-5)

    add_norm_out = add_rmsnorm_fwd()

    emb = tf.embedding(ids, table)
    norm_out = tf.rms_norm(x, (C,), w_norm, 1e-5)
    lin_out = tf.linear(x, w_gate)
    attn_out = tf.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    glu_out = tf.silu(gate_up[:, :F]) * gate_up[:, F:]
    ce_out = tf.cross_entropy(logits, targets, ignore_index=-1, reduction="none")
    params = torch.nn.Parameter(torch.randn(PARAMS, device=dev, dtype=torch.float32))
    params.grad = torch.randn(PARAMS, device=dev, dtype=torch.float32)
    opt = torch.optim.AdamW([params], lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def adamw_step():
        torch.nn.utils.clip_grad_norm_([params], 1.0)
        opt.step()

    grad = lambda out, inputs, dout: torch.autograd.grad(out, inputs, dout, retain_graph=True)   # noqa: E731
    return {
        "embedding_fwd": lambda: tf.embedding(ids, table),
        "embedding_bwd": lambda: grad(emb, [table], dy_nc),
        "rmsnorm_fwd": lambda: tf.rms_norm(x, (C,), w_norm, 1e-5),
        "rmsnorm_bwd": lambda: grad(norm_out, [x, w_norm], dy_nc),
        "linear_fwd": lambda: tf.linear(x, w_gate),
        "linear_bwd": lambda: grad(lin_out, [x, w_gate], dy_nf),
        "qkv_rope_fwd": qkv_rope_fwd,
        "add_rmsnorm_fwd": add_rmsnorm_fwd,
        "add_rmsnorm_bwd": lambda: grad(add_norm_out[1], [x, w_norm], dy_nc),
        "attention_fwd": lambda: tf.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "attention_bwd": lambda: grad(attn_out, [q, k, v], torch.ones_like(attn_out)),
        "swiglu_fwd": lambda: tf.silu(gate_up[:, :F]) * gate_up[:, F:],
        "swiglu_bwd": lambda: grad(glu_out, [gate_up], dy_nf),
        "add_fwd": lambda: x + x2,
        "ce_fwd": lambda: tf.cross_entropy(logits, targets, ignore_index=-1, reduction="none"),
        "ce_bwd": lambda: grad(ce_out, [logits], torch.full_like(ce_out, 1.0 / N)),
        "adamw": adamw_step,
    }


def decode_cases(rows: int, rng, dims=(C, F, (H + 2 * KV) * D)):
    """(op, shape, numba fn, weight bytes) of the decoding ops at `rows` rows, as a decoding step
    calls them: bf16 weights and norm scales, float32 activations. dims = (C, F, q/k/v outputs)."""
    dim, hidden, qkv_out = dims
    bf16 = lambda *shape: BACKEND.asarray(0.02 * rng.standard_normal(shape), "bf16")   # noqa: E731
    f32 = lambda *shape: BACKEND.asarray(rng.standard_normal(shape))   # noqa: E731
    x, act = f32(rows, dim), f32(rows, hidden)
    g = BACKEND.asarray(1.0 + 0.1 * rng.standard_normal(dim), "bf16")
    wqkv, wo, w_gate_up, w_down = bf16(qkv_out, dim), bf16(dim, dim), bf16(2 * hidden, dim), bf16(dim, hidden)
    return [
        ("norm_linear", f"{qkv_out}x{dim}", lambda: norm_linear.forward(x, g, wqkv, eps=1e-5), wqkv.nbytes),
        ("linear_residual", f"{dim}x{dim}", lambda: linear_residual.forward(x, wo, x), wo.nbytes),
        ("norm_swiglu", f"{2 * hidden}x{dim}", lambda: norm_swiglu.forward(x, g, w_gate_up, eps=1e-5),
         w_gate_up.nbytes),
        ("linear_residual", f"{dim}x{hidden}", lambda: linear_residual.forward(act, w_down, x), w_down.nbytes),
    ]


def time_decode_cases(args, rng, bandwidth) -> list[dict]:
    """Time every decoding case at each of DECODE_ROWS rows; print a line each."""
    rows = []
    for n in DECODE_ROWS:
        for op, shape, fn, nbytes in decode_cases(n, rng):
            if args.ops and op not in args.ops.split(","):
                continue
            ms = time_numba(fn)
            rate = nbytes / (ms * 1e-3)
            rows.append(dict(op=op, shape=shape, rows=n, us=ms * 1e3, weight_bytes=nbytes, achieved=rate,
                             roofline_fraction=rate / bandwidth))
            print(f"{op:<16} {shape:>9}  {n:3d} rows  {ms * 1e3:8.2f} us  {rate / 1e9:7.0f} GB/s of weights  "
                  f"{100 * rate / bandwidth:5.1f}% of copy bandwidth", flush=True)
    return rows


def time_cases(args, rng, torch, torch_ops, bandwidth) -> list[dict]:
    """Time every case (ours, and the PyTorch peer where there is one); print a line each."""
    rows = []
    for op, phase, fn, key, nbytes, flops in cases(args.batch_size, rng, args.precision):
        if args.ops and op not in args.ops.split(","):
            continue
        ms = time_numba(fn)
        torch_ms = math.nan
        if torch is not None and key:
            torch_ms = time_torch(torch, torch_ops[key])
        seconds = ms * 1e-3
        if flops:
            rate, peak = flops / seconds, PEAK[args.precision]
            achieved = f"{rate / 1e12:7.1f} TFLOP/s"
        else:
            rate, peak = nbytes / seconds, bandwidth
            achieved = f"{rate / 1e9:7.0f} GB/s   "
        rows.append(dict(op=op, phase=phase, ms=ms, torch_ms=torch_ms, achieved=rate, roofline_fraction=rate / peak,
                         bytes=nbytes, flops=flops))
        print(f"{op:<22} {phase:<4} {ms:8.3f} ms  {achieved}  {100 * rate / peak:5.1f}% of roofline  "
              f"torch {torch_ms:8.3f} ms  torch/ours {torch_ms / ms:5.2f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--precision", choices=("fp32", "tf32", "bf16"), default="bf16")
    parser.add_argument("--ops", help="time only these ops, comma-separated (e.g. rmsnorm,add_rmsnorm)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--decode", action="store_true",
                        help="time the decoding kernels (bf16 weights, float32 rows) at 1, 4, 8 and 32 rows instead")
    args = parser.parse_args()
    if args.decode:
        decode_main(args)
        return
    try:
        import torch
        torch.backends.cuda.matmul.allow_tf32 = args.precision == "tf32"
        torch.backends.cudnn.allow_tf32 = args.precision == "tf32"
    except ImportError:
        torch = None

    name = cuda.get_current_device().name
    name = name.decode() if isinstance(name, bytes) else name
    bandwidth, measured_by = copy_bandwidth(torch)
    print(f"{name}; batch {args.batch_size} x 512; {args.precision}; cuBLAS: {cublas.uses_cublas()}; copy bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s ({measured_by}); {args.precision} peak {PEAK[args.precision] / 1e12:.0f} TFLOP/s")
    rng = np.random.default_rng(0)
    torch_ops = torch_fns(torch, args.batch_size, args.precision) if torch is not None else {}
    rows = time_cases(args, rng, torch, torch_ops, bandwidth)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, batch_size=args.batch_size, precision=args.precision, copy_bandwidth=bandwidth,
                           rows=rows), f, indent=1)


def decode_main(args) -> None:
    name = cuda.get_current_device().name
    name = name.decode() if isinstance(name, bytes) else name
    bandwidth, measured_by = copy_bandwidth(None)
    print(f"{name}; decoding kernels, bf16 weights, float32 rows; copy bandwidth {bandwidth / 1e9:.0f} GB/s "
          f"({measured_by})")
    rows = time_decode_cases(args, np.random.default_rng(0), bandwidth)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, mode="decode", copy_bandwidth=bandwidth, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
