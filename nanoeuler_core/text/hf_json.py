"""Hugging Face's tokenizer.json: the byte-level alphabet, the document nanoeuler writes, and
the files beside it (tokenizer_config.json's `eos_token`). Reading one is `Tokenizer.load`'s."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import orjson

from nanoeuler_core.text.bpe import N_BYTES


def _bytes_to_unicode() -> list[str]:
    """GPT-2's spelling of each byte as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(N_BYTES) if b not in spelling):
        spelling[b] = chr(N_BYTES + n)
    return [spelling[b] for b in range(N_BYTES)]


BYTE_TO_CHAR = _bytes_to_unicode()
CHAR_TO_BYTE = {char: b for b, char in enumerate(BYTE_TO_CHAR)}


def byte_level_spelling(token: bytes) -> str:
    """A token's vocabulary entry: its bytes in the byte-level alphabet."""
    return "".join(BYTE_TO_CHAR[b] for b in token)


def spelled_bytes(spelling: str) -> bytes:
    """The bytes a vocabulary entry stands for: its byte-level spelling decoded, else its UTF-8
    (an entry outside the byte alphabet, such as a special token's text)."""
    try:
        return bytes(map(CHAR_TO_BYTE.__getitem__, spelling))
    except KeyError:
        return spelling.encode()


def byte_level_document(
    token_bytes: Sequence[bytes], merges: Sequence[tuple[int, int]], specials: dict[str, int]
) -> dict:
    """The tokenizer.json of nanoeuler's layout: `token_bytes` the bytes and learned tokens by id,
    `merges` in rank order, `specials` the special tokens' ids after them."""
    spell = [byte_level_spelling(token) for token in token_bytes]
    vocab = {spelling: i for i, spelling in enumerate(spell)}
    vocab.update(specials)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": s, "special": True, "normalized": False,
             "single_word": False, "lstrip": False, "rstrip": False}
            for s, i in specials.items()
        ],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            # Byte-level spellings never contain a space (byte 0x20 is spelled "Ġ"), so the
            # "left right" form that every tokenizers version reads is unambiguous.
            "merges": [f"{spell[left]} {spell[right]}" for left, right in merges],
        },
    }


def write_atomically(path: Path, data: bytes) -> None:
    """Replace `path` with `data`: temporary file, fsync, rename."""
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def configured_eos(folder: Path) -> str | None:
    """The `eos_token` of `folder/tokenizer_config.json` (Hugging Face's layout), if there is one."""
    try:
        eos = orjson.loads((Path(folder) / "tokenizer_config.json").read_bytes()).get("eos_token")
    except (OSError, orjson.JSONDecodeError, AttributeError):
        return None
    if isinstance(eos, dict):  # {"content": "</s>", ...} in older files
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


def save_eos(path: Path, eos: str) -> None:
    """Set `eos_token` in the tokenizer_config.json beside `path` (Hugging Face's place for it,
    where `configured_eos` looks), keeping its other keys."""
    config_path = path.with_name("tokenizer_config.json")
    try:
        config = orjson.loads(config_path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        config = {}
    config = {**(config if isinstance(config, dict) else {}), "eos_token": eos}
    write_atomically(config_path, orjson.dumps(config, option=orjson.OPT_INDENT_2))
