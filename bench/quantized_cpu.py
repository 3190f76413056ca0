"""One decoding token's matrix products on the CPU at SmolLM2-135M's sizes (dim 576, 30 layers,
9 heads and 3 kv heads of 64, hidden 1536, vocabulary 49152): each layer's norm_linear (wqkv
960 x 576), linear_residual (wo 576 x 576), norm_swiglu (w_gate_up 3072 x 576) and
linear_residual (w_down 576 x 1536), then the head's norm_linear (49152 x 576), through the CPU
kernels the decoder calls, inside the backend's `serial()` block as the decoder runs a step.
Every layer has its own matrices, so a token reads them all from memory as decoding does.

Formats: fp32; int8 a scale per output channel (the default), int8 groups of 32 (GGUF's Q8_0);
int4 groups of 32 with a zero point (Q4_1), head int8 groups of 32 as llama.cpp's Q4_1 files
keep it. Prints the median over --repeats tokens (and the fastest and slowest) as tokens/s, and
the weights' bytes read per second. --weights DIR takes the matrices of a nanoeuler run
(model.safetensors) instead of random ones:

    python bench/quantized_cpu.py [--formats fp32,int8,int8g32,int4] [--repeats 30] [--weights /path/to/run]
"""

import argparse
import statistics
import time

import numpy as np

from nanoeuler_core import quantized
from nanoeuler_core.registry import backend
from nanoeuler_ops.cpu import linear_residual, norm_linear, norm_swiglu

DIM, LAYERS, HIDDEN, VOCAB, QKV = 576, 30, 1536, 49152, 960
SHAPES = {"wqkv": (QKV, DIM), "wo": (DIM, DIM), "w_gate_up": (2 * HIDDEN, DIM), "w_down": (DIM, HIDDEN)}
STACKS = {"wqkv": ("wq", "wk", "wv"), "wo": ("wo",), "w_gate_up": ("w_gate", "w_up"), "w_down": ("w_down",)}
FORMATS = {   # name -> (blocks' format and group, head's format and group); None: float32
    "fp32": (None, None), "int8": (("int8", 0), ("int8", 0)), "int8g32": (("int8", 32), ("int8", 32)),
    "int4": (("int4", 32), ("int8", 32)),
}


def float_matrices(weights: str | None, rng):
    """{(layer, matrix): float32 (O, K)} and the head (VOCAB, DIM): a run's or random ones."""
    if weights:
        from nanoeuler_core.engine.checkpoint import load_tensors

        tensors, _ = load_tensors(f"{weights}/model.safetensors")
        layers = {(i, m): np.concatenate([tensors[f"layers.{i}.{p}"] for p in STACKS[m]])
                  for i in range(LAYERS) for m in SHAPES}
        head = tensors.get("head", tensors["tok_emb"])
        return layers, np.ascontiguousarray(head, np.float32)
    layers = {(i, m): (rng.standard_normal(SHAPES[m], np.float32) / np.sqrt(SHAPES[m][1])).astype(np.float32)
              for i in range(LAYERS) for m in SHAPES}
    return layers, (0.02 * rng.standard_normal((VOCAB, DIM), np.float32)).astype(np.float32)


def stored(w: np.ndarray, fmt) -> tuple:
    """The weight argument of w in `fmt` ((format, group) or None for float32)."""
    return (w,) if fmt is None else quantized.quantize(w, fmt[0], fmt[1])


def token(layers, head, x, g):
    """One token's products: the decoder's weight ops, layer by layer, then the head."""
    for wqkv, wo, w_gate_up, w_down in layers:
        norm_linear.forward(x, g, *wqkv, eps=1e-5)
        x, _ = linear_residual.forward(x, x, *wo)
        act, _ = norm_swiglu.forward(x, g, *w_gate_up, eps=1e-5)
        x, _ = linear_residual.forward(act, x, *w_down)
        x *= np.float32(0.5)   # keeps the residual stream's scale (random weights)
    return norm_linear.forward(x, g, *head, eps=1e-5)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated: " + ", ".join(FORMATS))
    parser.add_argument("--repeats", type=int, default=30, help="tokens timed per format (after two warm-ups)")
    parser.add_argument("--weights", help="a nanoeuler run directory whose matrices to use (else random)")
    args = parser.parse_args()
    formats = args.formats.split(",")
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise SystemExit(f"unknown format(s) {', '.join(unknown)}: choose from {', '.join(FORMATS)}")
    rng = np.random.default_rng(0)
    float_layers, float_head = float_matrices(args.weights, rng)
    x = rng.standard_normal((1, DIM)).astype(np.float32)
    g = np.ones(DIM, np.float32)
    cpu = backend("cpu")
    print(f"one token's products, SmolLM2-135M sizes, batch 1, {'weights of ' + args.weights if args.weights else 'random weights'}")
    for name in formats:
        block_fmt, head_fmt = FORMATS[name]
        layers = [tuple(stored(float_layers[i, m], block_fmt) for m in SHAPES) for i in range(LAYERS)]
        head = stored(float_head, head_fmt)
        nbytes = sum(a.nbytes for L in layers for w in L for a in w) + sum(a.nbytes for a in head)
        times = []
        with cpu.computing(), cpu.serial():
            for repeat in range(args.repeats + 2):
                start = time.perf_counter()
                token(layers, head, x.copy(), g)
                times.append(time.perf_counter() - start)
        times = sorted(times[2:])
        median = statistics.median(times)
        print(f"{name:8s} {nbytes / 1e6:7.1f} MB  {1 / median:7.1f} tokens/s (fastest {1 / times[0]:.1f}, "
              f"slowest {1 / times[-1]:.1f})  {nbytes / median / 1e9:5.1f} GB/s  {1e3 * median:6.2f} ms")


if __name__ == "__main__":
    main()
