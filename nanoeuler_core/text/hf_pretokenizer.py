"""The pre_tokenizer of a Hugging Face tokenizer.json as steps, each mapping a piece of text to
pieces: ByteLevel (GPT-2's split), Split on a string or an Oniguruma regex (translated for `re`),
Digits, in a Sequence. See docs/tokenizer.md."""

from __future__ import annotations

import functools
import re
from typing import Callable, NoReturn

from nanoeuler_core.text.pretokenizer import code_point_limit, pretokenize, unicode_class


def pre_tokenizer_steps(spec, refuse: Callable[[str], NoReturn]) -> list[Callable[[str], list[str]]]:
    """The steps of a tokenizer.json's pre_tokenizer; it must end with ByteLevel (no prefix space)."""
    specs = _flatten_sequence(spec)
    steps = []
    for i, step in enumerate(specs):
        kind = step.get("type")
        if kind == "ByteLevel":
            if i != len(specs) - 1:
                refuse("uses ByteLevel before another pre-tokenizer")
            if step.get("add_prefix_space"):
                refuse("sets add_prefix_space on its ByteLevel pre-tokenizer")
            if step.get("use_regex", True):
                steps.append(pretokenize)
        elif kind == "Split":
            pattern, behavior = step.get("pattern") or {}, step.get("behavior")
            if behavior != "Isolated":
                refuse(f"splits with behavior {behavior!r} (only 'Isolated' is supported)")
            if "String" in pattern:
                steps.append(functools.partial(_split_isolated, functools.partial(_literal_regex, pattern["String"])))
            elif "Regex" in pattern:
                try:
                    _translated_regex(pattern["Regex"], 0x10000)
                except (ValueError, re.error) as e:
                    refuse(f"has a Split regex nanoeuler cannot run ({e})")
                steps.append(functools.partial(_split_isolated, functools.partial(_translated_regex, pattern["Regex"])))
            else:
                refuse(f"has a Split pre-tokenizer without a pattern: {step!r}")
        elif kind == "Digits":
            runs = not step.get("individual_digits")
            steps.append(functools.partial(_split_isolated, functools.partial(_numeric_regex, runs)))
        else:
            refuse(f"uses the {kind!r} pre-tokenizer (supported: ByteLevel, Split, Digits, Sequence)")
    if not specs or specs[-1].get("type") != "ByteLevel":
        refuse("does not end its pre-tokenizer with ByteLevel (not a byte-level tokenizer)")
    return steps


def _flatten_sequence(spec) -> list[dict]:
    if not isinstance(spec, dict):
        return []
    if spec.get("type") == "Sequence":
        return [step for inner in spec.get("pretokenizers") or [] for step in _flatten_sequence(inner)]
    return [spec]


def _split_isolated(make_regex: Callable[[int], re.Pattern], text: str) -> list[str]:
    """`text` cut around every match of the regex, matches and the text between them as pieces
    (Hugging Face's Split with behavior Isolated); `make_regex(limit)` builds it for the code points of `text`."""
    pieces, start = [], 0
    for match in make_regex(code_point_limit(text)).finditer(text):
        if match.start() > start:
            pieces.append(text[start : match.start()])
        if match.end() > match.start():
            pieces.append(match.group())
        start = match.end()
    if start < len(text):
        pieces.append(text[start:])
    return pieces


@functools.cache
def _numeric_regex(runs: bool, limit: int) -> re.Pattern:
    """Rust's char::is_numeric (categories Nd, Nl, No): one such character, or runs of them (Digits)."""
    return re.compile(f"[{unicode_class('N', limit)}]" + ("+" if runs else ""))


@functools.cache
def _literal_regex(text: str, limit: int) -> re.Pattern:
    return re.compile(re.escape(text))


# Oniguruma escapes `re` lacks or reads differently; \p{..} and \s, \S, \d, \D are translated.
_UNSUPPORTED_ESCAPES = set("wWbBhHRXKGzZAyYQEgk")
_CATEGORIES = {
    "L", "M", "N", "P", "S", "Z", "C", "Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No",
    "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po",
    "Sm", "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Co", "Cs", "Cn"}


@functools.cache
def _translated_regex(pattern: str, limit: int) -> re.Pattern:
    """An Oniguruma regex (Hugging Face's Split) as a `re` pattern over code points below `limit`.

    Unicode classes are spelled out from `unicodedata`, as for GPT-2's pattern (`pretokenizer`): \\p{L}, \\P{N},
    \\p{Lu}, ... and \\s (Oniguruma's white space), \\d (Nd), inside and outside brackets. Raises
    ValueError for what it cannot translate faithfully (\\w, \\b, nested classes, ...).
    """
    out, i, in_class = [], 0, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\" and i + 1 < len(pattern):
            escape = pattern[i + 1]
            i += 2
            if escape in "pP":
                if pattern.startswith("{", i):
                    end = pattern.find("}", i)
                    if end == -1:
                        raise ValueError(f"unclosed \\{escape}{{ in {pattern!r}")
                    name, i = pattern[i + 1 : end], end + 1
                else:
                    name, i = pattern[i : i + 1], i + 1
                negated = (escape == "P") != name.startswith("^")
                name = name.lstrip("^")
                if name not in _CATEGORIES:
                    raise ValueError(f"unsupported Unicode property \\{escape}{{{name}}}")
                out.append(_class_piece(unicode_class(name, limit), negated, in_class))
            elif escape in "sSdD":
                body = unicode_class("space" if escape in "sS" else "Nd", limit)
                out.append(_class_piece(body, escape.isupper(), in_class))
            elif escape in _UNSUPPORTED_ESCAPES:
                raise ValueError(f"unsupported escape \\{escape}")
            elif escape == "x" and pattern.startswith("{", i):
                end = pattern.index("}", i)
                out.append(re.escape(chr(int(pattern[i + 1 : end], 16))))
                i = end + 1
            else:
                out.append("\\" + escape)
            continue
        if char == "[":
            if in_class:
                raise ValueError("nested character classes are not supported")
            in_class = True
            out.append(char)
            if pattern.startswith("^", i + 1):
                out.append("^")
                i += 1
            if pattern.startswith("]", i + 1):  # a leading ] is literal in both engines
                out.append("\\]")
                i += 1
        elif char == "]" and in_class:
            in_class = False
            out.append(char)
        elif in_class and char in "&-~|" and pattern.startswith(char * 2, i):
            raise ValueError(f"set operation {char * 2} inside a class is not supported")
        else:
            out.append(char)
        i += 1
    return re.compile("".join(out))


def _class_piece(body: str, negated: bool, in_class: bool) -> str:
    if not in_class:
        return f"[{'^' if negated else ''}{body}]"
    if negated:
        raise ValueError("a negated property inside a character class is not supported")
    return body
