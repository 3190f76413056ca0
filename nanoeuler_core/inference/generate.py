"""Generation: text in, text out, one prompt or a batch, plain or self-speculative decoding
(nanoeuler_core/inference/decoder/ does the decoding; docs/decoding.md explains it).

    generate(model, tok, "It was", max_new_tokens=50, temperature=0.8, top_k=40, seed=0) -> str
    generate_batch(model, tok, ["It was", "The king"], max_new_tokens=50, seed=0) -> list[str]
    generate(model, tok, "A point:", response_format={"type": "json_object"}) -> str (a JSON object)

Row i of a batch generates exactly what generate(prompts[i], seed=seed + i) does (each row has its
own random stream, and a row's computation does not depend on the batch), so `--num-samples N`
of one prompt gives N different samples, each reproducible alone.

`speculative`: None runs the decoder's policy (docs/decoding.md: greedy steps speculate where that is
measured to be faster; sampled rows run the mode the backend's traits give); True or False forces
speculative or plain decoding. Speculative decoding gives the same greedy output as plain decoding,
and samples from the same distribution. `weights`: "bf16" or "fp32" (default: bf16 where the
backend runs it; docs/decoding.md says how its greedy tokens compare).

`response_format`: OpenAI's (inference/constraint.py, `response_grammar`): {"type": "json_object"}
or {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}} holds every token to the
grammar of that JSON (plain decoding: one token a step), and the text ends where the JSON does; cut
by max_new_tokens, the JSON is incomplete.

Prompts: up to ctx_len tokens (an empty prompt starts from `</s>`); a longer one is an error.
Generation may run past the context: the cache then slides by half a context (docs/decoding.md).
"""

from __future__ import annotations

import codecs

import numpy as np

from nanoeuler_core.inference.constraint import Constraint, response_grammar
from nanoeuler_core.inference.decoder import MAX_SEED, DecodeStats, Sampling, decoder_for


def generate(model, tok, prompt: str, max_new_tokens: int = 50, temperature: float = 0.8, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, on_text=None, stop_at_eos: bool = True,
             speculative: bool | None = None, stats: DecodeStats | None = None, weights: str | None = None,
             response_format: dict | None = None) -> str:
    """Continue `prompt`; returns the new text (without the prompt), stopping at `</s>` unless
    stop_at_eos is False. `on_text(piece)` receives the text as it is produced (whole UTF-8
    characters). `stats`, if given, is filled with what the decoding did (DecodeStats)."""
    return _generate(model, tok, [prompt], max_new_tokens, temperature, top_k, top_p, seed, stop_at_eos,
                     speculative, stats, on_text, weights, response_format)[0]


def generate_batch(model, tok, prompts: list[str], max_new_tokens: int = 50, temperature: float = 0.8,
                   top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                   stop_at_eos: bool = True, speculative: bool | None = None,
                   stats: DecodeStats | None = None, weights: str | None = None,
                   response_format: dict | None = None) -> list[str]:
    """Continue every prompt at once; row i equals generate(prompts[i], seed=seed + i)."""
    return _generate(model, tok, list(prompts), max_new_tokens, temperature, top_k, top_p, seed, stop_at_eos,
                     speculative, stats, None, weights, response_format)


def _generate(model, tok, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_at_eos, speculative,
              stats, on_text, weights, response_format) -> list[str]:
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    grammar = response_grammar(response_format)
    if tok.vocab_size != model.cfg.vocab_size:
        raise ValueError(f"the tokenizer has {tok.vocab_size} entries but the model's vocab_size is "
                         f"{model.cfg.vocab_size}: use the tokenizer.json saved with the model")
    if not prompts:
        raise ValueError("no prompts: pass at least one")
    ids = [prompt_ids(tok, prompt, model.cfg.ctx_len, f"prompt {i}" if len(prompts) > 1 else "the prompt")
           for i, prompt in enumerate(prompts)]
    decoder = decoder_for(model, len(prompts), speculative, Sampling(temperature, top_k, top_p), weights)
    base = int(np.random.SeedSequence().entropy % MAX_SEED) if seed is None else seed
    texts = [TextStream(tok, on_text) for _ in prompts]
    constraints = [Constraint(grammar, tok, tok.eos_id) for _ in prompts] if grammar else None
    decoder.generate(ids, max_new_tokens, [base + i for i in range(len(prompts))],
                     tok.eos_id if stop_at_eos else None, lambda row, token: texts[row].add(token), stats,
                     constraints=constraints)
    return [text.finish() for text in texts]


def prompt_ids(tok, prompt: str, ctx_len: int, what: str = "the prompt") -> list[int]:
    """The prompt's token ids (`</s>` for an empty prompt); ValueError if it exceeds the context."""
    ids = tok.encode(prompt) or [tok.eos_id]
    if len(ids) > ctx_len:
        raise ValueError(f"{what} is {len(ids)} tokens, longer than the model's context of {ctx_len} tokens: "
                         f"shorten it")
    return ids


class TextStream:
    """Token ids to text as they come: whole UTF-8 characters only, passed to on_text(piece)."""

    def __init__(self, tok, on_text=None):
        self.tok, self.on_text = tok, on_text
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.pieces: list[str] = []

    def add(self, token: int) -> None:
        self._piece(self.decoder.decode(self.tok.token_bytes(token)))

    def finish(self) -> str:
        self._piece(self.decoder.decode(b"", final=True))
        return "".join(self.pieces)

    def _piece(self, piece: str) -> None:
        if piece:
            self.pieces.append(piece)
            if self.on_text:
                self.on_text(piece)


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None) -> None:
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be non-negative, got {max_new_tokens}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
