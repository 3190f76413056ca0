r"""GPT-2's pre-tokenization: text split into pretokens, which merges never cross.

    's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+

written for the standard `re` module by spelling out the Unicode classes from `unicodedata`
(`unicode_class`, which the tokenizer.json regex translator in `hf_pretokenizer` uses too). \s is
Oniguruma's (the engine of Hugging Face tokenizers): tab to CR, NEL and the Z categories; it
differs from str.isspace, which also counts U+001C-U+001F. See docs/tokenizer.md.
"""

from __future__ import annotations

import functools
import itertools
import re
import sys
import unicodedata
from typing import Iterable


def _is_space(category: str, char: str) -> bool:
    return category in ("Zs", "Zl", "Zp") or char in "\t\n\x0b\x0c\r\x85"


def _class_body(codepoints: Iterable[int]) -> str:
    """A character-class body (what goes between [ and ]) matching exactly `codepoints`, ascending."""
    ranges = []
    for _, run in itertools.groupby(enumerate(codepoints), key=lambda item: item[1] - item[0]):
        run = list(run)
        first, last = chr(run[0][1]), chr(run[-1][1])
        ranges.append(re.escape(first) if first == last else f"{re.escape(first)}-{re.escape(last)}")
    return "".join(ranges)


@functools.cache
def _categories(limit: int) -> list[str]:
    return list(map(unicodedata.category, map(chr, range(limit))))


@functools.cache
def unicode_class(name: str, limit: int) -> str:
    """Class body of the code points below `limit` in general category `name` ("L", "Nd", ...),
    or "space" (Oniguruma's \\s)."""
    categories = _categories(limit)
    if name == "space":
        return _class_body(cp for cp, cat in enumerate(categories) if _is_space(cat, chr(cp)))
    return _class_body(cp for cp, cat in enumerate(categories) if cat.startswith(name))


@functools.cache
def _gpt2_pattern(limit: int) -> re.Pattern:
    """GPT-2's pretokenizer for text of code points below `limit`.

    `re` tests classes of code points below U+10000 with a bitmap but scans the ranges above one
    by one, so text without such characters gets a pattern that leaves them out (4x faster).
    """
    letter, number, space = (unicode_class(name, limit) for name in ("L", "N", "space"))
    return re.compile(
        rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{letter}]+| ?[{number}]+| ?[^{space}{letter}{number}]+"
        rf"|[{space}]+(?![^{space}])|[{space}]+"
    )


_ASTRAL = re.compile("[\U00010000-\U0010ffff]")


def code_point_limit(text: str) -> int:
    """The code-point bound of the character classes `text` needs (see `_gpt2_pattern`)."""
    return sys.maxunicode + 1 if _ASTRAL.search(text) else 0x10000


def pretokenize(text: str) -> list[str]:
    """Split `text` into GPT-2 pretokens; merges never cross their borders."""
    return _gpt2_pattern(code_point_limit(text)).findall(text)


def line_chunks(text: str, size: int) -> list[str]:
    """Split `text` into pieces of about `size` characters that pretokenize exactly as the whole.

    Each cut falls just before a newline that follows a non-space character (str.isspace covers
    every pattern space): a pretoken always ends there, and the pattern never looks behind, so the pieces'
    pretokens are the text's.
    """
    pieces, start = [], 0
    while len(text) - start > size:
        cut = text.find("\n", start + size)
        while cut != -1 and text[cut - 1].isspace():
            cut = text.find("\n", cut + 1)
        if cut == -1:
            break
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces
