"""What a prompt's prefill through the decoding ops costs: a chunk of W tokens of one row
(DecodeForward.hidden, as Prefill runs it) for a model of random weights (the `gpu` preset unless
told), op by op (each at one block's shapes, times the blocks) and whole (eager, and captured where
the backend captures), in tokens/s, against the model's own forward (the training ops: matrix
products over all W tokens) over the same tokens; then the time to the first token of a prompt of
511 tokens (or the context less one) through `Decoder.admit`, with no prefix cache and with the
prefix cache holding all its whole blocks but the last token's (496 of 511 tokens).

GPU times come from CUDA events around the work (the device's time alone), CPU times from the
clock; each is the median of --repeats runs after warm-up runs.

    python bench/prefill_chunk.py [--preset gpu --backend cuda] [--widths 16 64 256] [--position P]
                                  [--prompt 511] [--repeats 20]
"""

import argparse
import statistics
import time

import numpy as np

from nanoeuler_core.bench.generation import load_weights
from nanoeuler_core.inference.decoder import Decoder, Sampling

WARM_UP = 3   # runs before the timed ones


def timer(be, backend: str):
    """fn -> the median seconds of `repeats` runs of fn after WARM_UP: CUDA events on the cuda
    backend (the device's time alone), else the clock with the backend synchronised."""
    if backend == "cuda":
        from numba import cuda

        def device_time(fn):
            start, end = cuda.event(), cuda.event()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3   # ms
    else:
        def device_time(fn):
            be.synchronize()
            start = time.perf_counter()
            fn()
            be.synchronize()
            return time.perf_counter() - start

    def median(fn, repeats: int) -> float:
        for _ in range(WARM_UP):
            fn()
        return statistics.median(device_time(fn) for _ in range(repeats))

    return median


def chunk_runs(model, decoder, W: int, position: int) -> tuple[dict, object]:
    """The ops of one block over a chunk of W tokens of one row from `position` (name -> a call of
    it, with the inputs the block's forward gives it), and the whole chunk through every block
    (DecodeForward.hidden) into a row of caches of its own."""
    be, cfg, forward = model.backend, model.cfg, decoder.forward
    f, L = forward.f, forward.w.layers[0]
    H, KV, D, eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps
    shape = (1, decoder.cache.S, KV, D)
    kv = [(be.zeros(shape), be.zeros(shape)) for _ in range(cfg.n_layers)]
    rng = np.random.default_rng(0)
    ids = be.asarray(rng.integers(0, cfg.vocab_size, W).astype(np.int64))
    pos = be.asarray(np.array([position], dtype=np.int64))
    with be.parallel(), be.computing():
        x, _ = f.embedding.forward(ids, forward.w.tok_emb)
        qkv, _ = f.norm_linear.forward(x, L.attn_norm, *L.wqkv, eps=eps)
        qkv = qkv.reshape(1, W, H + 2 * KV, D)
        o, _ = f.decode_attention.forward(qkv, *kv[0], pos, n_kv_heads=KV, theta=cfg.rope_theta)
        o = o.reshape(W, H * D)
        x_attn, _ = f.linear_residual.forward(o, x, *L.wo)
        act, _ = f.norm_swiglu.forward(x_attn, L.ffn_norm, *L.w_gate_up, eps=eps)
    ops = {
        "norm_linear (wqkv)": lambda: f.norm_linear.forward(x, L.attn_norm, *L.wqkv, eps=eps),
        "decode_attention": lambda: f.decode_attention.forward(qkv, *kv[0], pos, n_kv_heads=KV, theta=cfg.rope_theta),
        "linear_residual (wo)": lambda: f.linear_residual.forward(o, x, *L.wo),
        "norm_swiglu": lambda: f.norm_swiglu.forward(x_attn, L.ffn_norm, *L.w_gate_up, eps=eps),
        "linear_residual (w_down)": lambda: f.linear_residual.forward(act, x_attn, *L.w_down),
    }

    def whole():
        with be.parallel(), be.computing():
            return forward.hidden(ids, 1, W, kv, pos)

    return ops, whole


def model_forward(model, decoder, W: int):
    """The model's own forward over W tokens of one row from position 0 (the blocks and the final
    norm, nothing kept), with the weights the decoder reads."""
    be = model.backend
    ids = be.asarray(np.random.default_rng(0).integers(0, model.cfg.vocab_size, W).astype(np.int64))

    def run():
        with be.parallel(), be.computing():
            return model._forward(ids, 1, W, weights=decoder.forward.w.forward)

    return run


def rate(W: int, seconds: float) -> str:
    return f"{seconds * 1e6:10.1f} us {W / seconds:12,.0f} tokens/s"


def first_token_seconds(decoder, prompt: list[int], repeats: int) -> float:
    """The median time `admit` takes to prefill `prompt` into row 0 and keep its first token."""
    times = []
    for i in range(WARM_UP + repeats):
        start = time.perf_counter()
        decoder.admit(0, prompt, 0, Sampling(0.0), 1)
        times.append(time.perf_counter() - start)
        decoder.retire(0)
    return statistics.median(times[WARM_UP:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpu")
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--widths", type=int, nargs="+", default=[16, 64, 256], help="tokens of a chunk")
    parser.add_argument("--position", type=int, default=0, help="where the chunk's first token goes")
    parser.add_argument("--prompt", type=int, default=511, help="tokens of the prompt whose first token is timed")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    model, _ = load_weights(args.preset, None, args.backend)
    cfg, be = model.cfg, model.backend
    median = timer(be, args.backend)
    decoder = Decoder(model, 1, False, Sampling(0.0), prefix_cache_tokens=0)
    print(f"{args.preset} preset (dim {cfg.dim}, {cfg.n_layers} blocks, {cfg.n_heads} heads, {cfg.n_kv_heads} "
          f"key/value heads, hidden {cfg.hidden_dim}) on {be.device_name()}, {decoder.weights} weights; "
          f"chunks of 1 row from position {args.position}, median of {args.repeats}")
    for W in args.widths:
        if args.position + W > cfg.ctx_len:
            print(f"W = {W}: past the context ({cfg.ctx_len}), skipped")
            continue
        ops, whole = chunk_runs(model, decoder, W, args.position)
        print(f"\nW = {W} tokens")
        total = 0.0
        for name, op in ops.items():
            seconds = median(op, args.repeats) * cfg.n_layers
            total += seconds
            print(f"  {name:26s} x {cfg.n_layers} blocks {rate(W, seconds)}")
        print(f"  {'the ops above, summed':37s} {rate(W, total)}")
        print(f"  {'DecodeForward.hidden, eager':37s} {rate(W, median(whole, args.repeats))}")
        if be.captures:
            replay, _ = be.capture(whole)
            print(f"  {'DecodeForward.hidden, captured':37s} {rate(W, median(replay, args.repeats))}")
        print(f"  {'the model forward (training ops)':37s} {rate(W, median(model_forward(model, decoder, W), args.repeats))}")
    P = min(args.prompt, cfg.ctx_len - 1)
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, P).tolist()
    cached = Decoder(model, 1, False, Sampling(0.0))
    for d in (decoder, cached):
        d.warm_up()
    reused = cached.prefix_cache.block * ((P - 1) // cached.prefix_cache.block)
    print(f"\nfirst token of a {P}-token prompt (Decoder.admit, median of {args.repeats}):")
    print(f"  no prefix cache                      {first_token_seconds(decoder, prompt, args.repeats) * 1e3:8.2f} ms")
    print(f"  prefix cache holding {reused:4d} tokens    {first_token_seconds(cached, prompt, args.repeats) * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
