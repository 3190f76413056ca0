"""How many tokens a decoding step would keep with prompt-lookup proposals (the next k tokens after
the latest earlier occurrence of the context's last n tokens) against greedy decoding of a trained
run: prompts of 16 tokens from the last tenth of the corpus it trained on, decoded greedily to the
end of the context, then each step replayed with those proposals. Compare with `bench --generate --run`'s
tokens per row and step for the multi-token heads:

    python bench/draft_lookup.py RUN_DIR [--prompts 10] [--proposals 3]
"""

import argparse

import numpy as np

from nanoeuler_core.bench.generation import run_corpus
from nanoeuler_core.inference.decoder import Sampling, decoder_for
from nanoeuler_core.inference.loading import load_model


def lookup_steps(seq: list[int], start: int, k: int, n: int) -> int:
    """Steps that decode seq[start:] when each step keeps the prompt-lookup proposals (up to k) that
    equal the tokens decoded, and one token more."""
    t, steps = start, 0
    while t < len(seq):
        context, proposals = seq[:t], []
        for i in range(len(context) - n - 1, -1, -1):   # the latest earlier occurrence of the last n tokens
            if context[i:i + n] == context[-n:]:
                proposals = context[i + n:i + n + k]
                break
        kept = 0
        while kept < len(proposals) and t + kept < len(seq) and proposals[kept] == seq[t + kept]:
            kept += 1
        t, steps = t + 1 + kept, steps + 1
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--proposals", type=int, default=3)
    args = parser.parse_args()
    model, tok = load_model(args.run, "cpu")
    text = run_corpus(args.run).read_text(encoding="utf-8")   # the corpus the run trained on
    corpus = tok.encode(text[int(len(text) * 0.9):int(len(text) * 0.9) + 20000])
    decoder = decoder_for(model, 1, False, Sampling(0.0), None)
    rng = np.random.default_rng(0)
    tokens, steps = 0, {2: 0, 3: 0}
    for _ in range(args.prompts):
        first = int(rng.integers(0, len(corpus) - 16))
        prompt = corpus[first:first + 16]
        new = decoder.generate([prompt], model.cfg.ctx_len - 16, [0])[0]
        tokens += len(new)
        for n in steps:
            steps[n] += lookup_steps(prompt + new, 16, args.proposals, n)
    for n, count in steps.items():
        print(f"prompt lookup, last {n} tokens matched, {args.proposals} proposals: {tokens / count:.2f} tokens a step "
              f"({tokens} greedy tokens)")


if __name__ == "__main__":
    main()
