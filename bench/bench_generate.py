"""Decoding speed: nanoeuler plain and self-speculative decoding against PyTorch (eager with a KV
cache; on a GPU also torch.compile with a static cache and CUDA graphs) on the same weights.

    python bench/bench_generate.py [--preset small] [--backend cpu] [--run RUN_DIR] [--batch-size 1]
                                   [--prompt 16] [--tokens 256] [--repeats 3] [--temperature 0]

Prints tokens/s, ms per token, memory, the speed relative to plain decoding, how many tokens each
greedy decoding shares with nanoeuler's plain one, and the speculative acceptance rate. Pass the
run directory of a trained model (nanoeuler-run pretrain ...) for a meaningful acceptance rate.
"""

from __future__ import annotations

import argparse

from nanoeuler_core.bench import generation


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", help="model preset when no --run is given (random weights)")
    p.add_argument("--backend", default="cpu", help="cpu or cuda")
    p.add_argument("--run", default=None, help="run directory whose weights (and tokenizer, for the prompt) to use")
    p.add_argument("--batch-size", type=int, default=1, help="rows decoded together (the same prompt)")
    p.add_argument("--prompt", type=int, default=16, help="prompt length in tokens")
    p.add_argument("--tokens", type=int, default=256, help="new tokens per row (capped to fit the context)")
    p.add_argument("--repeats", type=int, default=3, help="timed generations (the median is reported)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the PyTorch peers run only then)")
    p.add_argument("--no-peers", action="store_true", help="skip PyTorch")
    args = p.parse_args()
    if args.batch_size < 1 or args.prompt < 1 or args.tokens < 1 or args.repeats < 1:
        p.error("--batch-size, --prompt, --tokens and --repeats must be positive")
    generation.run(args.preset, args.backend, args.run, args.batch_size, args.prompt, args.tokens, args.repeats,
                   args.temperature, not args.no_peers)


if __name__ == "__main__":
    main()
