"""Structured outputs: a row's tokens held to a JSON schema, or to any JSON object, by llguidance's
grammar matcher (docs/http-api.md, "Structured outputs"). Before each token the row's matcher
writes the tokens the grammar allows into the row's mask, which the sample op reads (ops/sample.py);
the token drawn then advances the matcher.

    grammar = response_grammar({"type": "json_schema", "json_schema": {"name": "point", "schema": schema}})
    constraint = Constraint(grammar, tok, tok.eos_id)
    fill_masks([(constraint, b)], masks)   # int32 (B, ceil(V / 32)): row b's tokens allowed next
    constraint.accept(token)               # the token drawn
    constraint.complete                    # the grammar is done: the row ends ("stop")

The JSON is written compactly, ", " and ": " between items and keys, no other white space (a
barely trained model, free to, fills the white space a grammar allows).
"""

from __future__ import annotations

import weakref

import llguidance
import llguidance.numpy
import numpy as np

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def response_grammar(response_format: dict | None) -> str | None:
    """The grammar an OpenAI `response_format` asks for: None for {"type": "text"} (or None), any
    JSON object for {"type": "json_object"}, JSON valid against the schema for {"type":
    "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}} (every schema is
    enforced, strict or not); ValueError, one line, for anything else."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_grammar()
    if kind != "json_schema":
        raise ValueError('response_format must be {"type": "text"}, {"type": "json_object"} or {"type": '
                         '"json_schema", "json_schema": {"name": ..., "schema": {...}}}')
    spec = response_format.get("json_schema")
    if not (isinstance(spec, dict) and isinstance(spec.get("name"), str) and isinstance(spec.get("schema", {}), dict)
            and isinstance(spec.get("strict", False), (bool, type(None)))):
        raise ValueError('response_format.json_schema must be an object {"name": string, "schema": object, '
                         '"strict": boolean}')
    return json_grammar(spec.get("schema"))


def json_grammar(schema: dict | None = None) -> str:
    """The grammar of JSON text valid against `schema` (None: any JSON object); ValueError, one line
    naming what is wrong, where llguidance cannot compile it (an unsupported keyword names it)."""
    schema = {"type": "object"} if schema is None else schema
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except ValueError as exc:
        raise ValueError(f"the JSON schema cannot be used: {_one_line(str(exc))}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"the JSON schema cannot be used: {_one_line(error)}")
    return grammar


def _one_line(message: str) -> str:
    return " ".join(message.split())


class _Vocabulary:
    """Our tokenizer as llguidance's TokenizerWrapper reads it: each id's bytes, the special ids,
    the end token, and bytes -> ids."""

    def __init__(self, tok, eos_id: int):
        self.tok, self.eos_token_id, self.bos_token_id = tok, eos_id, None
        self.tokens = [tok.token_bytes(i) for i in range(tok.vocab_size)]
        self.special_token_ids = sorted(set(tok.special_tokens.values()) | {eos_id})

    def __call__(self, data: bytes) -> list[int]:
        return self.tok.encode_bytes(data)


_LL_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def ll_tokenizer(tok, eos_id: int) -> llguidance.LLTokenizer:
    """llguidance's tokenizer over `tok`'s vocabulary, ending at eos_id: made once per tokenizer and
    end token (its token trie, and the slices of the vocabulary that speed up JSON's masks), then kept."""
    made = _LL_TOKENIZERS.setdefault(tok, {})
    if eos_id not in made:
        made[eos_id] = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tok, eos_id)),
                                              slices=llguidance.LLTokenizer.json_slices())
    return made[eos_id]


class Constraint:
    """One row's grammar (`json_grammar`) over `tok`'s vocabulary, eos_id the token that may end it
    where the grammar is complete but could go on (a number, say)."""

    def __init__(self, grammar: str, tok, eos_id: int):
        self.eos_id = eos_id
        self.matcher = llguidance.LLMatcher(ll_tokenizer(tok, eos_id), grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"the grammar cannot be used: {_one_line(self.matcher.get_error())}")

    def accept(self, token: int) -> None:
        """Advance past `token`, one the mask allowed."""
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {_one_line(self.matcher.get_error())}")

    @property
    def complete(self) -> bool:
        """The grammar allows nothing more: the row ends here."""
        return self.matcher.is_stopped()


_EXECUTOR: list = []   # llguidance's threads, started on first use


def fill_masks(held: list[tuple[Constraint, int]], masks: np.ndarray) -> None:
    """For each (constraint, row) of `held`, the tokens the constraint allows next into masks[row]
    (int32 (B, ceil(V / 32)), C-contiguous; bit v % 32 of word v // 32), the rows computed at once on
    llguidance's threads (without the GIL)."""
    if not _EXECUTOR:
        _EXECUTOR.append(llguidance.LLExecutor())
    llguidance.numpy.fill_next_token_bitmask_par(_EXECUTOR[0], [(c.matcher, b) for c, b in held], masks)
