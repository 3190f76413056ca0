"""Decoding speed at batch 1: the KV cache against recomputing the whole context, and against
PyTorch eager on the same weights (recomputing the context, as nanoGPT's generate does).

    python bench/bench_generate.py [--preset small] [--backend cpu] [--tokens 100] [--prompt 16]

Greedy decoding from a random prompt; all three produce the same tokens (checked), so only the
speed differs. Prints tokens/s and the ratios.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from nanoeuler_core import Model, ModelConfig
from nanoeuler_core.inference.generate import new_kv_cache, next_logits


def decode_with_cache(model: Model, prompt: list[int], n: int) -> list[int]:
    kv = new_kv_cache(model)
    logits = next_logits(model, prompt, kv, 0)
    out = []
    for position in range(len(prompt), len(prompt) + n):
        out.append(int(np.argmax(logits)))
        if len(out) < n:
            logits = next_logits(model, out[-1:], kv, position)
    return out


def decode_recomputing(model: Model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(model.forward(np.array([ids]))[0, -1])))
    return ids[len(prompt):]


def decode_torch(model: Model, prompt: list[int], n: int) -> list[int]:
    import torch

    from nanoeuler_core.bench.torch_peer import TorchModel

    peer = TorchModel(model.cfg).load(model.params)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, peer.logits(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


def timed(fn, *args) -> tuple[float, list[int]]:
    fn(*args)  # warm-up: compilation, caches
    t = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--tokens", type=int, default=100, help="new tokens per run")
    p.add_argument("--prompt", type=int, default=16, help="prompt length in tokens")
    args = p.parse_args()
    cfg = ModelConfig.preset(args.preset)
    if args.prompt + args.tokens > cfg.ctx_len:
        p.error(f"--prompt + --tokens must fit the context ({cfg.ctx_len})")
    model = Model(cfg, backend=args.backend, seed=0)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt).tolist()

    rows = [("KV cache", *timed(decode_with_cache, model, prompt, args.tokens)),
            ("recompute context", *timed(decode_recomputing, model, prompt, args.tokens))]
    try:
        rows.append(("torch eager (recompute)", *timed(decode_torch, model, prompt, args.tokens)))
    except ImportError:
        print("torch not installed: no peer comparison")
    print(f"preset {args.preset}, backend {args.backend}, batch 1, prompt {args.prompt}, {args.tokens} new tokens, greedy")
    cached = rows[0][1]
    for name, seconds, tokens in rows:
        same = "same tokens" if tokens == rows[0][2] else "DIFFERENT tokens"
        print(f"{name:<26}{args.tokens / seconds:>10.0f} tokens/s   x{seconds / cached:>6.2f} the KV cache's time   {same}")


if __name__ == "__main__":
    main()
