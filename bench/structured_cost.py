"""What holding decoding to a JSON schema costs per token on the host: each grammar library that is
installed (llguidance, which nanoeuler uses; xgrammar; outlines-core) builds its tokenizer object
from a byte-level BPE vocabulary's token bytes, compiles a schema (nested objects, enums, arrays,
bounded strings), then walks it: before each token the mask of allowed tokens, then the advance past
a token drawn at random among them (restarting where the JSON ends). Printed: the one-off costs, and
microseconds per token of mask + advance; beside them, free decoding's per token (plain greedy
`generate` of a model of the `gpu` preset's shape, random weights, at the vocabulary's size, on the
CPU backend). Times are CPU time (the process's, every thread), which a machine shared with other
work inflates less than wall-clock time.

    python bench/structured_cost.py [TOKENIZER.json ...] [--tokens N]

Vocabularies: the project's own tokenizer (bench/speedrun/tokenizer.json) unless told others (an
imported Hugging Face tokenizer.json, a run directory's). xgrammar is not a dependency of nanoeuler
(it needs torch): `pip install xgrammar` to measure it; outlines-core is in the `bench` extra.
"""

import argparse
import importlib
import json
import time
from pathlib import Path

import numpy as np

from nanoeuler_core.text.tokenizer import Tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "kind", "address", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "kind": {"enum": ["person", "company", "place"]},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "zip": {"type": "integer", "minimum": 0, "maximum": 99999}}},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4}}}


def allowed_ids(bits: np.ndarray, V: int) -> np.ndarray:
    """The ids set in a bitmask of int32 words (bit v % 32 of word v // 32)."""
    return np.nonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")[:V])[0]


class LLGuidance:
    name, module = "llguidance", "llguidance"

    def __init__(self, tok):
        from nanoeuler_core.inference.constraint import ll_tokenizer, response_grammar

        self.tok, self.V = tok, tok.vocab_size
        ll_tokenizer(tok, tok.eos_id)
        self.grammar = response_grammar({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
        self.bits = np.full((1, (tok.vocab_size + 31) // 32), -1, dtype=np.int32)

    def start(self):
        from nanoeuler_core.inference.constraint import Constraint

        self.constraint = Constraint(self.grammar, self.tok, self.tok.eos_id)

    def mask(self) -> np.ndarray:
        from nanoeuler_core.inference.constraint import fill_masks

        fill_masks([(self.constraint, 0)], self.bits)
        return self.bits[0]

    def advance(self, token: int) -> bool:
        self.constraint.accept(token)
        return self.constraint.complete


class XGrammar:
    name, module = "xgrammar", "xgrammar"

    def __init__(self, tok):
        import xgrammar

        self.V = tok.vocab_size
        info = xgrammar.TokenizerInfo([tok.token_bytes(i) for i in range(tok.vocab_size)],
                                      xgrammar.VocabType.RAW, stop_token_ids=[tok.eos_id])
        compiler = xgrammar.GrammarCompiler(info)
        self.compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                     separators=(", ", ": "))
        self.xgrammar, self.bitmask = xgrammar, xgrammar.allocate_token_bitmask(1, tok.vocab_size)

    def start(self):
        self.matcher = self.xgrammar.GrammarMatcher(self.compiled)

    def mask(self) -> np.ndarray:
        self.matcher.fill_next_token_bitmask(self.bitmask)
        return self.bitmask.numpy()[0]

    def advance(self, token: int) -> bool:
        assert self.matcher.accept_token(token)
        return self.matcher.is_terminated()


class OutlinesCore:
    name, module = "outlines-core", "outlines_core"

    def __init__(self, tok):
        import outlines_core

        self.V, self.outlines_core = tok.vocab_size, outlines_core
        tokens = {}
        for i in range(tok.vocab_size):
            if i != tok.eos_id:
                tokens.setdefault(tok.token_bytes(i), []).append(i)
        regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA), r"")
        regex = regex.replace(r'\,', ", ").replace(r'\:', ": ")   # the separators the others write
        self.index = outlines_core.Index(regex, outlines_core.Vocabulary(tok.eos_id, tokens))
        self.bits = np.zeros((tok.vocab_size + 31) // 32, dtype=np.int32)

    def start(self):
        self.guide = self.outlines_core.Guide(self.index)

    def mask(self) -> np.ndarray:
        self.guide.write_mask_into(self.bits.ctypes.data, self.bits.size, 4)
        return self.bits

    def advance(self, token: int) -> bool:
        self.guide.advance(token, return_tokens=False)
        return self.guide.is_finished()


def walk(library, tokens: int, rng) -> float:
    """Microseconds per token of mask + advance over `tokens` tokens drawn at random among those allowed."""
    spent = 0.0
    library.start()
    for _ in range(tokens):
        start = time.process_time()
        bits = library.mask()
        spent += time.process_time() - start
        token = int(rng.choice(allowed_ids(bits, library.V)))
        start = time.process_time()
        done = library.advance(token)
        spent += time.process_time() - start
        if done:
            library.start()
    return 1e6 * spent / tokens


def free_decoding_us(V: int, tokens: int = 32) -> float:
    """Microseconds per token of plain greedy decoding, one row, a `gpu`-preset-shaped model of V tokens."""
    from nanoeuler_core import Model, ModelConfig
    from nanoeuler_core.inference.decoder import DecodeStats, Sampling, decoder_for

    model = Model(ModelConfig.preset("gpu", vocab_size=V), backend="cpu", seed=0)
    decoder = decoder_for(model, 1, False, Sampling(0.0))
    decoder.generate([[1, 2, 3]], 4, [0])   # compiled and warm
    stats = DecodeStats()
    start = time.process_time()
    decoder.generate([[1, 2, 3]], tokens, [0], stats=stats)
    return 1e6 * (time.process_time() - start) / stats.tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tokenizers", nargs="*", default=[str(Path(__file__).parent / "speedrun" / "tokenizer.json")])
    parser.add_argument("--tokens", type=int, default=2000, help="tokens each walk times")
    args = parser.parse_args()
    for path in args.tokenizers:
        tok = Tokenizer.load(path)
        print(f"{path}: {type(tok).__name__}, {tok.vocab_size} tokens")
        print(f"  free decoding, gpu preset, cpu backend  {free_decoding_us(tok.vocab_size):9.1f} us/token")
        for kind in (LLGuidance, XGrammar, OutlinesCore):
            try:
                importlib.import_module(kind.module)
            except ImportError:
                print(f"  {kind.name:14s} not installed")
                continue
            start = time.process_time()
            library = kind(tok)
            setup = time.process_time() - start
            us = walk(library, args.tokens, np.random.default_rng(0))
            print(f"  {kind.name:14s} mask + advance {us:9.1f} us/token   (tokenizer + schema compiled once: "
                  f"{setup:.2f} s CPU)")


if __name__ == "__main__":
    main()
