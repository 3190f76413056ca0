"""Byte-level BPE tokenizer (SPEC.md section 5), saved in the Hugging Face `tokenizers` format.

Ids 0-255 are the raw bytes; each learned token is the merge of two earlier tokens; the special
tokens (at least `</s>`) take the last ids. Text is first split into pretokens with GPT-2's rule
(a single leading space joins the following word; letters, numbers, punctuation runs and
whitespace split apart), so merges never cross those borders.

    tok = Tokenizer.train(text, vocab_size=512)
    ids = tok.encode("It was")          # [...]
    tok.decode(ids)                     # "It was"
    tok.save("tokenizer.json")          # tokenizers.Tokenizer.from_file reads it, same ids

Training counts pretokens once, then runs the merge loop in Numba (`bpe_kernels`). Encoding
applies merges by rank as Hugging Face's BPE model does (in Numba, for the pretokens missing
from a cache of encoded ones); `encode_batch` spreads large batches over all cores.

`Tokenizer.load` also reads byte-level BPE tokenizer.json files made elsewhere (`HFTokenizer`:
the GPT-2, Llama 3 and SmolLM2 families, with their own vocabulary, merges, added tokens and
pre-tokenizer: ByteLevel, Split on a regex, Digits, in a Sequence); they encode as Hugging Face
`tokenizers` does with `encode(text, add_special_tokens=False)`. Such a vocabulary may lack some
byte tokens (bytes that never or hardly ever occur in UTF-8 text): encoding drops those bytes, as
`tokenizers` does, so only text made of the bytes it has round-trips (`missing_bytes` lists them).

Letters, numbers and spaces are those of the running Python's Unicode database (Unicode 14 on
Python 3.11). Code points assigned in later Unicode versions count as punctuation-like here but
may be letters to Hugging Face's regex engine; text using them still round-trips, but can split
differently.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import re
import sys
import unicodedata
from array import array
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import orjson

from nanoeuler_core.text import bpe_kernels

EOS = "</s>"
N_BYTES = 256
_WORD_CACHE_LIMIT = 1 << 20  # encoded pretokens kept per tokenizer before the cache restarts
_CHUNK_CHARS = 1 << 16  # corpus piece size for sampling and counting
_PARALLEL_MIN_CHARS = 1 << 20  # below this, starting worker processes costs more than it saves


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used, or training input that cannot make a tokenizer."""


# ---------------------------------------------------------------------------------------------
# Pretokenization: GPT-2's pattern
#   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
# written for the standard `re` module by spelling out the Unicode classes from `unicodedata`.
# \s is Oniguruma's (the engine of Hugging Face tokenizers): tab to CR, NEL and the Z categories;
# it differs from str.isspace, which also counts U+001C-U+001F.


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
def _unicode_class(name: str, limit: int) -> str:
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
    letter, number, space = (_unicode_class(name, limit) for name in ("L", "N", "space"))
    return re.compile(
        rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{letter}]+| ?[{number}]+| ?[^{space}{letter}{number}]+"
        rf"|[{space}]+(?![^{space}])|[{space}]+"
    )


_ASTRAL = re.compile("[\U00010000-\U0010ffff]")


def _limit(text: str) -> int:
    """The code-point bound of the character classes `text` needs (see `_gpt2_pattern`)."""
    return sys.maxunicode + 1 if _ASTRAL.search(text) else 0x10000


def pretokenize(text: str) -> list[str]:
    """Split `text` into GPT-2 pretokens; merges never cross their borders."""
    return _gpt2_pattern(_limit(text)).findall(text)


def _line_chunks(text: str, size: int) -> list[str]:
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


def _training_chunks(text: str, sample_bytes: int | None) -> list[str]:
    """The corpus in pieces; with `sample_bytes`, evenly spaced pieces totalling about that many bytes."""
    chunks = _line_chunks(text, _CHUNK_CHARS)
    if sample_bytes is None:
        return chunks
    corpus_bytes = len(text.encode("utf-8", "surrogateescape"))
    if corpus_bytes <= sample_bytes:
        return chunks
    n_taken = max(1, round(len(chunks) * sample_bytes / corpus_bytes))
    stride = len(chunks) / n_taken
    return [chunks[int(i * stride)] for i in range(n_taken)]


# ---------------------------------------------------------------------------------------------
# Hugging Face's byte-level alphabet: GPT-2 spells each byte as a printable character.


def _bytes_to_unicode() -> list[str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(N_BYTES) if b not in spelling):
        spelling[b] = chr(N_BYTES + n)
    return [spelling[b] for b in range(N_BYTES)]


BYTE_TO_CHAR = _bytes_to_unicode()
CHAR_TO_BYTE = {char: b for b, char in enumerate(BYTE_TO_CHAR)}


def _hf_spelling(token: bytes) -> str:
    return "".join(BYTE_TO_CHAR[b] for b in token)


# ---------------------------------------------------------------------------------------------


class Tokenizer:
    """Byte-level BPE: 256 byte ids, learned merges, then the special tokens."""

    def __init__(self, merges: Sequence[tuple[int, int]], special_tokens: Sequence[str] = (EOS,)):
        """Build from `merges` in rank order (merge r joins two earlier ids into id 256 + r);
        see `train` to learn them. Each learned token must spell a byte string no other token does."""
        self._token_bytes = [bytes([b]) for b in range(N_BYTES)]
        id_of_bytes = {token: i for i, token in enumerate(self._token_bytes)}
        self._merges: list[tuple[int, int]] = []
        for rank, (left, right) in enumerate(merges):
            left, right = int(left), int(right)
            if not (0 <= left < len(self._token_bytes) and 0 <= right < len(self._token_bytes)):
                raise TokenizerError(f"merge {rank} ({left}, {right}) uses a token id not defined before it")
            spelling = self._token_bytes[left] + self._token_bytes[right]
            if spelling in id_of_bytes:
                raise TokenizerError(
                    f"merge {rank} ({left}, {right}) spells {spelling!r}, already token {id_of_bytes[spelling]}"
                )
            id_of_bytes[spelling] = len(self._token_bytes)
            self._token_bytes.append(spelling)
            self._merges.append((left, right))
        # Sorted pair keys for the Numba encoder's binary search; rank r merges into id 256 + r.
        keys = np.array([(left << 32) | right for left, right in self._merges], dtype=np.int64)
        self._pair_ranks = np.argsort(keys, kind="stable")
        self._pair_keys = keys[self._pair_ranks]

        self._specials = _check_special_tokens(special_tokens)
        learned_spellings = {_hf_spelling(token) for token in self._token_bytes}
        for special in self._specials:
            if special in learned_spellings:
                raise TokenizerError(
                    f"special token {special!r} is also an ordinary token: pick one such as '<|{special}|>'"
                )
            self._specials[special] = len(self._token_bytes)
            self._token_bytes.append(special.encode())
        self._init_added_tokens(self._specials, ordinary=(), normalized=())

    def _init_added_tokens(self, ids: dict[str, int], ordinary: Iterable[str], normalized: Iterable[str]) -> None:
        """Added tokens (`ids`: content -> id, the special ones and the `ordinary` ones, which are
        always recognised); those in `normalized` are looked for after the others, as Hugging
        Face does. Also starts the caches."""
        self._added_ids = dict(ids)
        self._ordinary_added = frozenset(ordinary)
        self._normalized_added = frozenset(normalized)
        self._added_patterns: dict[frozenset[str], list[re.Pattern]] = {}
        self._word_cache: dict[str, tuple[int, ...]] = {}

    def __reduce__(self):  # worker processes rebuild from merges + specials, without the cache
        return Tokenizer, (self._merges, list(self._specials))

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, special_tokens={list(self._specials)})"

    # --- properties ----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids: bytes, learned tokens and special tokens."""
        return len(self._token_bytes)

    @property
    def eos_id(self) -> int:
        """Id of `</s>`, the end-of-document and end-of-reply marker."""
        return self._specials[EOS]

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._specials)

    @property
    def merges(self) -> list[tuple[int, int]]:
        """The merged pairs of ids, in rank order."""
        return list(self._merges)

    @functools.cached_property
    def hash(self) -> str:
        """Hex digest of merges and special tokens: equal digests mean identical encodings."""
        digest = hashlib.sha256(np.asarray(self._merges, dtype="<i4").reshape(-1, 2).tobytes())
        digest.update(orjson.dumps(self._specials))
        return digest.hexdigest()

    @property
    def missing_bytes(self) -> tuple[int, ...]:
        """The bytes that have no token (none here: ids 0-255 are the bytes)."""
        return ()

    def token_id(self, token: str) -> int | None:
        """The id of added token `token` (a special token such as `</s>` or `<|im_end|>`), or None."""
        return self._added_ids.get(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for (a special token's text for specials)."""
        self._check_ids([token_id])
        return self._token_bytes[token_id]

    # --- training ------------------------------------------------------------------------------

    @classmethod
    def train(
        cls,
        text: str,
        vocab_size: int,
        *,
        special_tokens: Sequence[str] = (EOS,),
        sample_bytes: int | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> Tokenizer:
        """Learn merges from `text` until the vocabulary, specials included, has `vocab_size` ids.

        `sample_bytes` trains on evenly spaced pieces of the corpus totalling about that many bytes.
        `progress(done, total)` is called as corpus pieces are counted and then as tokens are learned.
        """
        specials = _check_special_tokens(special_tokens)
        n_new_tokens = vocab_size - N_BYTES - len(specials)
        if n_new_tokens < 0:
            raise TokenizerError(
                f"vocab_size {vocab_size} is too small: the {N_BYTES} bytes and {len(specials)} special "
                f"token(s) need at least {N_BYTES + len(specials)}"
            )
        if sample_bytes is not None and sample_bytes <= 0:
            raise TokenizerError(f"sample_bytes must be positive, got {sample_bytes}")
        if not text:
            raise TokenizerError("the corpus is empty: train on a file that contains text")

        report = progress or (lambda done, total: None)
        chunks = _training_chunks(text, sample_bytes)
        total_work = len(chunks) + n_new_tokens
        word_counts: Counter[str] = Counter()
        for i, chunk in enumerate(chunks):
            word_counts.update(pretokenize(chunk))
            report(i + 1, total_work)

        merges = _learn_merges(word_counts, n_new_tokens, lambda n: report(len(chunks) + n, total_work))
        if len(merges) < n_new_tokens:
            raise TokenizerError(
                f"the corpus yields only {len(merges)} merges but vocab_size {vocab_size} needs {n_new_tokens}: "
                f"use a larger corpus (or sample) or a vocab_size of at most {N_BYTES + len(specials) + len(merges)}"
            )
        return cls(merges, list(specials))

    # --- encoding ------------------------------------------------------------------------------

    def encode(self, text: str, allowed_special: Iterable[str] | str = frozenset()) -> list[int]:
        """Token ids of `text`. Special tokens are recognised only where `allowed_special`
        ("all" or a set of them) allows; elsewhere their text is encoded like any other."""
        allowed = self._allowed_specials(allowed_special) | self._ordinary_added
        if not allowed:
            return self._encode_ordinary(text)
        patterns = self._added_patterns.get(allowed)
        if patterns is None:
            # Tokens matched on the raw text first, then the "normalized" ones (Hugging Face's
            # order); longest first, so a token that extends another wins, as in Hugging Face.
            groups = (allowed - self._normalized_added, allowed & self._normalized_added)
            patterns = self._added_patterns[allowed] = [
                re.compile("|".join(map(re.escape, sorted(group, key=len, reverse=True)))) for group in groups if group
            ]
        ids: list[int] = []
        self._encode_around(text, patterns, ids)
        return ids

    def _encode_around(self, text: str, patterns: list[re.Pattern], ids: list[int]) -> None:
        """Append the ids of `text` to `ids`: added tokens found by the first pattern, the rest between them."""
        if not patterns:
            ids += self._encode_ordinary(text)
            return
        start = 0
        for match in patterns[0].finditer(text):
            self._encode_around(text[start : match.start()], patterns[1:], ids)
            ids.append(self._added_ids[match.group()])
            start = match.end()
        self._encode_around(text[start:], patterns[1:], ids)

    def encode_bytes(self, data: bytes) -> list[int]:
        """Token ids of arbitrary bytes (not necessarily UTF-8); `decode_bytes` gives them back."""
        # surrogateescape carries each invalid byte through the str pretokenizer as U+DC80-U+DCFF,
        # a class-less character, and turns it back into the same byte when the pretoken is encoded.
        return self._encode_ordinary(data.decode("utf-8", "surrogateescape"))

    def encode_batch(
        self,
        texts: Iterable[str],
        allowed_special: Iterable[str] | str = frozenset(),
        *,
        n_workers: int | None = None,
    ) -> list[list[int]]:
        """`encode` for each text; large batches are spread over `n_workers` processes (all cores)."""
        texts = list(texts)
        n_workers = n_workers or _available_cores()
        if n_workers < 2 or len(texts) < 2 or sum(map(len, texts)) < _PARALLEL_MIN_CHARS:
            return [self.encode(text, allowed_special) for text in texts]
        self._allowed_specials(allowed_special)  # fail here, not in a worker
        groups = _contiguous_groups(texts, 4 * n_workers)
        n_local = len(groups) // n_workers  # this process takes its share while the workers run
        with ProcessPoolExecutor(n_workers - 1, initializer=_set_worker_tokenizer, initargs=(self,)) as pool:
            results = pool.map(_encode_in_worker, groups[n_local:], itertools.repeat(allowed_special))
            local = [self.encode(text, allowed_special) for group in groups[:n_local] for text in group]
            return local + [ids.tolist() for group in results for ids in group]

    def _allowed_specials(self, allowed_special: Iterable[str] | str) -> frozenset[str]:
        if isinstance(allowed_special, str):
            if allowed_special != "all":
                raise TokenizerError(
                    f"allowed_special must be 'all' or a set of special tokens, not {allowed_special!r}"
                )
            return frozenset(self._specials)
        allowed = frozenset(allowed_special)
        unknown = allowed - self._specials.keys()
        if unknown:
            raise TokenizerError(
                f"unknown special token(s) {sorted(unknown)}; this tokenizer has {list(self._specials)}"
            )
        return allowed

    def _encode_ordinary(self, text: str) -> list[int]:
        words = self._pretokenize(text)
        cache = self._word_cache
        if len(cache) > _WORD_CACHE_LIMIT:
            cache.clear()
        missing = list(set(words).difference(cache))
        if missing:
            cache.update(zip(missing, self._encode_words([word.encode("utf-8", "surrogateescape") for word in missing])))
        return list(itertools.chain.from_iterable(map(cache.__getitem__, words)))

    def _pretokenize(self, text: str) -> list[str]:
        return pretokenize(text)

    def _encode_words(self, words: list[bytes]) -> list[tuple[int, ...]]:
        """The token ids of each pretoken (given as bytes)."""
        symbols, offsets = _word_table(words)
        lengths = bpe_kernels.apply_merges(symbols, offsets, self._pair_keys, self._pair_ranks)
        return _split_words(symbols, offsets, lengths)

    # --- decoding ------------------------------------------------------------------------------

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The exact bytes `ids` stand for (special tokens as their text)."""
        ids = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
        self._check_ids(ids)
        return b"".join(map(self._token_bytes.__getitem__, ids))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 (a cut inside a character) become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def _check_ids(self, ids: list[int]) -> None:
        if ids and not (0 <= min(ids) and max(ids) < len(self._token_bytes)):
            bad = next(i for i in ids if not 0 <= i < len(self._token_bytes))
            raise TokenizerError(
                f"token id {bad} is out of range: this tokenizer has ids 0 to {len(self._token_bytes) - 1}"
            )

    # --- files ---------------------------------------------------------------------------------

    def to_hf_json(self) -> dict:
        """The Hugging Face `tokenizers` document for this tokenizer (what `save` writes)."""
        n_learned = len(self._token_bytes) - len(self._specials)
        vocab = {_hf_spelling(token): i for i, token in enumerate(self._token_bytes[:n_learned])}
        vocab.update(self._specials)
        spell = [_hf_spelling(token) for token in self._token_bytes[:n_learned]]
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
        return {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [
                {"id": i, "content": s, "special": True, "normalized": False,
                 "single_word": False, "lstrip": False, "rstrip": False}
                for s, i in self._specials.items()
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
                "merges": [f"{spell[left]} {spell[right]}" for left, right in self._merges],
            },
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write `tokenizer.json` atomically (temporary file, fsync, rename)."""
        _write_atomically(Path(path), orjson.dumps(self.to_hf_json(), option=orjson.OPT_INDENT_2))

    @classmethod
    def load(cls, path: str | os.PathLike, eos: str | None = None) -> Tokenizer:
        """Read a `tokenizer.json`: one written by `save`, or a byte-level BPE one made elsewhere
        (an `HFTokenizer`), whose end-of-text token is `eos`, else the `eos_token` of a
        tokenizer_config.json beside it. Raises TokenizerError for anything else."""
        path = Path(path)
        try:
            document = orjson.loads(path.read_bytes())
        except OSError as e:
            raise TokenizerError(f"cannot read tokenizer file {path}: {e.strerror or e}") from None
        except orjson.JSONDecodeError as e:
            raise TokenizerError(
                f"{path} is not valid JSON ({e}): pass a tokenizer.json written by nanoeuler"
            ) from None
        return cls.from_hf_json(document, source=str(path), eos=eos or configured_eos(path.parent))

    @classmethod
    def from_hf_json(cls, document: dict, source: str = "tokenizer.json", eos: str | None = None) -> Tokenizer:
        """Rebuild from a Hugging Face document: nanoeuler's own layout (ids 0-255 the bytes, merge r
        making id 256 + r, `</s>` among the special tokens at the end) gives a `Tokenizer`, any other
        byte-level BPE an `HFTokenizer` with end-of-text token `eos`."""
        own = _own_layout(document)
        return own if own is not None else HFTokenizer(document, eos, source)


class HFTokenizer(Tokenizer):
    """A byte-level BPE tokenizer.json made elsewhere (the GPT-2, Llama 3 and SmolLM2 families):
    its own vocabulary, merges, added tokens and pre-tokenizer, encoding exactly as Hugging Face
    `tokenizers` does with `encode(text, add_special_tokens=False)` (a post-processor's template,
    such as a beginning-of-text token, is not added). Its end-of-text token is `eos` (default: a
    usual name such as `</s>` or `<|endoftext|>` that it has). Bytes without a vocabulary entry
    (`missing_bytes`) are dropped on encoding, or become the model's `unk_token` if it names one."""

    def __init__(self, document: dict, eos: str | None = None, source: str = "tokenizer.json"):
        def refuse(problem: str):
            raise TokenizerError(
                f"{source} {problem}: nanoeuler reads only byte-level BPE tokenizer.json files "
                "(its own, and those of the GPT-2, Llama 3 and SmolLM2 families)"
            )

        if not isinstance(document, dict) or not isinstance(document.get("model"), dict):
            refuse("has no tokenizer model")
        self._document = document
        self._source = source
        model = document["model"]
        if model.get("type") != "BPE":
            refuse(f"holds a {model.get('type')!r} model, not BPE")
        for option in ("continuing_subword_prefix", "end_of_word_suffix", "byte_fallback", "dropout"):
            if model.get(option):
                refuse(f"sets model.{option} = {model[option]!r}")
        if document.get("normalizer") is not None:
            refuse(f"has a normalizer ({document['normalizer'].get('type')!r})")
        self._steps = _pre_tokenizer_steps(document.get("pre_tokenizer"), refuse)

        vocab, merges, added = model.get("vocab"), model.get("merges"), document.get("added_tokens") or []
        if not isinstance(vocab, dict) or not isinstance(merges, list) or not isinstance(added, list):
            refuse("lacks a vocab or merges list")
        if not all(isinstance(i, int) and i >= 0 for i in vocab.values()):
            refuse("has vocabulary ids that are not non-negative integers")
        token_bytes: dict[int, bytes] = {}
        for spelling, i in vocab.items():
            if i in token_bytes:
                refuse(f"gives id {i} to two vocabulary entries")
            token_bytes[i] = _spelled_bytes(spelling)
        added_ids, ordinary, normalized, specials = {}, [], [], {}
        for token in added:
            content, i = token.get("content"), token.get("id")
            if not isinstance(content, str) or not content or not isinstance(i, int) or i < 0:
                refuse(f"has an added token without content or id: {token!r}")
            for option in ("single_word", "lstrip", "rstrip"):
                if token.get(option):
                    refuse(f"sets {option} on added token {content!r}")
            if i in token_bytes and vocab.get(content) != i:
                refuse(f"gives id {i} to added token {content!r} and to another token")
            token_bytes[i] = content.encode()
            added_ids[content] = i
            (specials.__setitem__(content, i) if token.get("special") else ordinary.append(content))
            if token.get("normalized", not token.get("special")):
                normalized.append(content)
        missing = next((i for i in range(len(token_bytes)) if i not in token_bytes), None)
        if missing is not None:
            refuse(f"has no token with id {missing} (ids must run from 0 without gaps)")
        self._token_bytes = [token_bytes[i] for i in range(len(token_bytes))]

        # A byte without a vocabulary entry is dropped from the text, as Hugging Face does (or becomes
        # the unknown token, where the model names one); merges then join its neighbours.
        self._byte_ids = np.array([vocab.get(char, -1) for char in BYTE_TO_CHAR], dtype=np.int32)
        self._unk_id, self._fuse_unk = None, bool(model.get("fuse_unk"))
        unk = model.get("unk_token")
        if self.missing_bytes and unk is not None:
            if unk not in vocab:
                refuse(f"names unk_token {unk!r}, which is not in its vocabulary")
            self._unk_id = vocab[unk]

        # Merge (left, right) -> (rank, id made); a pair listed twice keeps its last rank, as in Hugging Face.
        table: dict[tuple[int, int], tuple[int, int]] = {}
        self._merges = []
        for rank, merge in enumerate(merges):
            parts = merge.split(" ") if isinstance(merge, str) else merge
            if not isinstance(parts, list) or len(parts) != 2 or not all(p in vocab for p in parts):
                refuse(f"has merge {rank} ({merge!r}) that does not name two vocabulary entries")
            made = vocab.get(parts[0] + parts[1])
            if made is None:
                refuse(f"has merge {rank} ({merge!r}) whose result is not in the vocabulary")
            pair = (vocab[parts[0]], vocab[parts[1]])
            table[pair] = (rank, made)
            self._merges.append(pair)
        keys = np.array([(left << 32) | right for left, right in table], dtype=np.int64)
        order = np.argsort(keys, kind="stable")
        self._pair_keys = keys[order]
        self._pair_ranks = np.array([rank for rank, _ in table.values()], dtype=np.int64)[order]
        self._merged_ids = np.array([made for _, made in table.values()], dtype=np.int64)[order]
        # ignore_merges: a pretoken that is a vocabulary entry becomes that token directly.
        self._whole_words = (
            {_spelled_bytes(s): i for s, i in vocab.items() if all(c in CHAR_TO_BYTE for c in s)}
            if model.get("ignore_merges") else {}
        )
        self._specials = specials
        self._eos = eos
        self._init_added_tokens(added_ids, ordinary, normalized)

    def __reduce__(self):
        return HFTokenizer, (self._document, self._eos, self._source)

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, eos={self._eos_token()!r}, source={self._source!r})"

    def _eos_token(self) -> str | None:
        if self._eos is not None:
            return self._eos
        return next((name for name in EOS_NAMES if name in self._added_ids), None)

    @property
    def eos_id(self) -> int:
        """Id of the end-of-text token (`eos` given at loading, or a usual name the tokenizer has)."""
        eos = self._eos_token()
        if eos in self._added_ids:
            return self._added_ids[eos]
        if eos in self._document["model"]["vocab"]:
            return self._document["model"]["vocab"][eos]
        raise TokenizerError(
            f"{self._source} has no end-of-text token{f' {eos!r}' if eos else ''}: name one of its tokens as "
            f"eos_token in a tokenizer_config.json beside it"
        )

    @functools.cached_property
    def missing_bytes(self) -> tuple[int, ...]:
        """The bytes that have no token: text loses them on encoding (see `_byte_symbols`)."""
        return tuple(np.flatnonzero(self._byte_ids < 0).tolist())

    @functools.cached_property
    def hash(self) -> str:
        """Hex digest of the document and the end-of-text token: equal digests mean identical encodings."""
        digest = hashlib.sha256(orjson.dumps(self._document, option=orjson.OPT_SORT_KEYS))
        digest.update(orjson.dumps(self._eos_token()))
        return digest.hexdigest()

    def to_hf_json(self) -> dict:
        """The document this tokenizer was read from (what `save` writes)."""
        return orjson.loads(orjson.dumps(self._document))

    def save(self, path: str | os.PathLike) -> None:
        """Write `tokenizer.json` atomically, and the end-of-text token as `eos_token` of a
        tokenizer_config.json beside it (Hugging Face's place for it, where `load` looks)."""
        super().save(path)
        eos = self._eos_token()
        if eos is not None:
            config_path = Path(path).with_name("tokenizer_config.json")
            try:
                config = orjson.loads(config_path.read_bytes())
            except (OSError, orjson.JSONDecodeError):
                config = {}
            config = {**(config if isinstance(config, dict) else {}), "eos_token": eos}
            _write_atomically(config_path, orjson.dumps(config, option=orjson.OPT_INDENT_2))

    def _byte_symbols(self, data: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Words as bytes (`_word_table`) -> the same words as the ids merging starts from.

        A byte without a token is dropped, or becomes the unknown token where the model names one
        (a run of them one token, with fuse_unk): Hugging Face's BPE model (`merge_word`) does so."""
        symbols = self._byte_ids[data]
        missing = symbols < 0
        if not missing.any():
            return symbols, offsets
        if self._unk_id is None:
            keep = ~missing
        else:
            symbols[missing] = self._unk_id
            keep = np.ones(len(symbols), bool)
            if self._fuse_unk:  # a missing byte right after another in the same word joins its token
                word_starts = np.zeros(len(symbols), bool)
                word_starts[offsets[:-1][offsets[:-1] < len(symbols)]] = True
                keep[1:] = ~(missing[1:] & missing[:-1] & ~word_starts[1:])
        kept_before = np.concatenate(([0], np.cumsum(keep)))
        return symbols[keep], kept_before[offsets]

    def _pretokenize(self, text: str) -> list[str]:
        pieces = [text] if text else []
        for step in self._steps:
            pieces = [piece for part in pieces for piece in step(part)]
        return pieces

    def _encode_words(self, words: list[bytes]) -> list[tuple[int, ...]]:
        merged = [i for i, word in enumerate(words) if word not in self._whole_words]
        symbols, offsets = self._byte_symbols(*_word_table([words[i] for i in merged]))
        lengths = bpe_kernels.apply_merges_queued(symbols, offsets, self._pair_keys, self._pair_ranks, self._merged_ids)
        encoded = [(self._whole_words.get(word, -1),) for word in words]
        for i, ids in zip(merged, _split_words(symbols, offsets, lengths)):
            encoded[i] = ids
        return encoded


# End-of-text tokens by their usual names, for a tokenizer.json loaded without an `eos`.
EOS_NAMES = (EOS, "<|endoftext|>", "<|end_of_text|>", "<|im_end|>", "<eos>", "<|eot_id|>")


def _write_atomically(path: Path, data: bytes) -> None:
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


def _own_layout(document) -> Tokenizer | None:
    """The `Tokenizer` a document describes if it is exactly nanoeuler's layout, else None."""
    try:
        model, pre_tokenizer = document["model"], document.get("pre_tokenizer") or {}
        vocab, merges = model["vocab"], model["merges"]
        if (model.get("type") != "BPE" or document.get("normalizer") is not None
                or pre_tokenizer.get("type") != "ByteLevel" or not pre_tokenizer.get("use_regex", True)
                or pre_tokenizer.get("add_prefix_space") or model.get("ignore_merges") or model.get("dropout")
                or any(model.get(o) for o in ("continuing_subword_prefix", "end_of_word_suffix", "byte_fallback"))
                or not all(vocab.get(BYTE_TO_CHAR[b]) == b for b in range(N_BYTES))):
            return None
        added = document.get("added_tokens") or []
        if any(not t["special"] or t.get("single_word") or t.get("lstrip") or t.get("rstrip") for t in added):
            return None
        pairs = [merge.split(" ") if isinstance(merge, str) else merge for merge in merges]
        specials = {t["content"]: t["id"] for t in added}
        tokenizer = Tokenizer([(vocab[left], vocab[right]) for left, right in pairs], sorted(specials, key=specials.get))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    own = tokenizer.to_hf_json()
    if own["model"]["vocab"] != vocab or tokenizer.special_tokens != specials:
        return None
    return tokenizer


def _spelled_bytes(spelling: str) -> bytes:
    """The bytes a vocabulary entry stands for: its byte-level spelling decoded, else its UTF-8
    (an entry outside the byte alphabet, such as a special token's text)."""
    try:
        return bytes(map(CHAR_TO_BYTE.__getitem__, spelling))
    except KeyError:
        return spelling.encode()


def _split_words(symbols: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> list[tuple[int, ...]]:
    """Per word, its first lengths[w] symbols from offsets[w] (what the merge kernels leave)."""
    ids = symbols.tolist()
    return [tuple(ids[start : start + n]) for start, n in zip(offsets.tolist(), lengths.tolist())]


# ---------------------------------------------------------------------------------------------
# Pre-tokenizers of Hugging Face tokenizer.json files: each step maps a piece of text to pieces.


def _pre_tokenizer_steps(spec, refuse) -> list[Callable[[str], list[str]]]:
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
    for match in make_regex(_limit(text)).finditer(text):
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
    return re.compile(f"[{_unicode_class('N', limit)}]" + ("+" if runs else ""))


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

    Unicode classes are spelled out from `unicodedata`, as for `_gpt2_pattern`: \\p{L}, \\P{N},
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
                out.append(_class_piece(_unicode_class(name, limit), negated, in_class))
            elif escape in "sSdD":
                body = _unicode_class("space" if escape in "sS" else "Nd", limit)
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


def _check_special_tokens(special_tokens: Sequence[str]) -> dict[str, int]:
    """Special tokens as an ordered dict (ids filled in later); `</s>` must be one of them."""
    if isinstance(special_tokens, str) or not all(isinstance(s, str) and s for s in special_tokens):
        raise TokenizerError(f"special_tokens must be a list of non-empty strings, got {special_tokens!r}")
    if len(set(special_tokens)) != len(special_tokens):
        raise TokenizerError(f"special_tokens has duplicates: {list(special_tokens)}")
    if EOS not in special_tokens:
        raise TokenizerError(f"special_tokens must include {EOS!r}, the end-of-document marker")
    return dict.fromkeys(special_tokens, -1)


def _learn_merges(
    word_counts: Counter[str], n_new_tokens: int, on_progress: Callable[[int], None]
) -> list[tuple[int, int]]:
    """Run the Numba merge loop on a word-frequency table; return up to `n_new_tokens` merges."""
    words = [word.encode("utf-8", "surrogateescape") for word in word_counts]
    multi_byte = [i for i, word in enumerate(words) if len(word) > 1]  # single bytes hold no pairs
    symbols, word_offsets = _word_table([words[i] for i in multi_byte])
    counts = np.fromiter(word_counts.values(), np.int64, len(words))[multi_byte]

    learned = np.zeros(1, np.int64)
    # The kernel releases the GIL, so this thread reports progress while another runs it.
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(bpe_kernels.learn_merges, symbols, word_offsets, counts, n_new_tokens, learned)
        finished = False
        while not finished:
            finished = bool(wait([future], timeout=0.1).done)
            on_progress(int(learned[0]))
        merges = future.result()
    return [tuple(pair) for pair in merges.tolist()]


def _word_table(words: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Words as the kernels take them: (L,) int32 bytes end to end, (W+1,) int64 offsets."""
    offsets = np.zeros(len(words) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, words), np.int64, len(words)), out=offsets[1:])
    return np.frombuffer(b"".join(words), np.uint8).astype(np.int32), offsets


def _available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _contiguous_groups(texts: list[str], n_groups: int) -> list[list[str]]:
    """Split `texts`, in order, into about `n_groups` runs of similar total length."""
    target = sum(map(len, texts)) / n_groups
    groups, current, size = [], [], 0
    for text in texts:
        current.append(text)
        size += len(text)
        if size >= target:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


_worker_tokenizer: Tokenizer | None = None


def _set_worker_tokenizer(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _encode_in_worker(texts: list[str], allowed_special) -> list[array]:
    # Compact int arrays pickle far faster than lists of Python ints on the way back.
    return [array("i", _worker_tokenizer.encode(text, allowed_special)) for text in texts]
