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
def _gpt2_pattern(limit: int) -> re.Pattern:
    """GPT-2's pretokenizer for text of code points below `limit`.

    `re` tests classes of code points below U+10000 with a bitmap but scans the ranges above one
    by one, so text without such characters gets a pattern that leaves them out (4x faster).
    """
    categories = list(map(unicodedata.category, map(chr, range(limit))))
    letter = _class_body(cp for cp, cat in enumerate(categories) if cat[0] == "L")
    number = _class_body(cp for cp, cat in enumerate(categories) if cat[0] == "N")
    space = _class_body(cp for cp, cat in enumerate(categories) if _is_space(cat, chr(cp)))
    return re.compile(
        rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{letter}]+| ?[{number}]+| ?[^{space}{letter}{number}]+"
        rf"|[{space}]+(?![^{space}])|[{space}]+"
    )


_ASTRAL = re.compile("[\U00010000-\U0010ffff]")


def pretokenize(text: str) -> list[str]:
    """Split `text` into GPT-2 pretokens; merges never cross their borders."""
    return _gpt2_pattern(sys.maxunicode + 1 if _ASTRAL.search(text) else 0x10000).findall(text)


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
        self._special_patterns: dict[frozenset[str], re.Pattern] = {}
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
        allowed = self._allowed_specials(allowed_special)
        if not allowed:
            return self._encode_ordinary(text)
        pattern = self._special_patterns.get(allowed)
        if pattern is None:
            # Longest first, so a special token that extends another wins, as in Hugging Face.
            alternatives = sorted(allowed, key=len, reverse=True)
            pattern = self._special_patterns[allowed] = re.compile("|".join(map(re.escape, alternatives)))
        ids, start = [], 0
        for match in pattern.finditer(text):
            ids += self._encode_ordinary(text[start : match.start()])
            ids.append(self._specials[match.group()])
            start = match.end()
        ids += self._encode_ordinary(text[start:])
        return ids

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
        words = pretokenize(text)
        cache = self._word_cache
        if len(cache) > _WORD_CACHE_LIMIT:
            cache.clear()
        missing = list(set(words).difference(cache))
        if missing:
            symbols, offsets = _word_table([word.encode("utf-8", "surrogateescape") for word in missing])
            lengths = bpe_kernels.apply_merges(symbols, offsets, self._pair_keys, self._pair_ranks)
            ids = symbols.tolist()
            starts = offsets.tolist()
            cache.update(zip(missing, (tuple(ids[start : start + n]) for start, n in zip(starts, lengths.tolist()))))
        return list(itertools.chain.from_iterable(map(cache.__getitem__, words)))

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
        path = Path(path)
        temporary = path.with_name(f".{path.name}.tmp")
        with open(temporary, "wb") as f:
            f.write(orjson.dumps(self.to_hf_json(), option=orjson.OPT_INDENT_2))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Read a `tokenizer.json` written by `save`. Raises TokenizerError for anything else."""
        try:
            document = orjson.loads(Path(path).read_bytes())
        except OSError as e:
            raise TokenizerError(f"cannot read tokenizer file {path}: {e.strerror or e}") from None
        except orjson.JSONDecodeError as e:
            raise TokenizerError(
                f"{path} is not valid JSON ({e}): pass a tokenizer.json written by nanoeuler"
            ) from None
        return cls.from_hf_json(document, source=str(path))

    @classmethod
    def from_hf_json(cls, document: dict, source: str = "tokenizer.json") -> Tokenizer:
        """Rebuild from a Hugging Face document; it must be nanoeuler's layout of byte-level BPE."""

        def require(condition, problem: str) -> None:
            if not condition:
                raise TokenizerError(
                    f"{source} {problem}: nanoeuler reads only the byte-level BPE tokenizer.json it writes "
                    "(train one with `nanoeuler-run tokenizer train`)"
                ) from None

        require(isinstance(document, dict) and isinstance(document.get("model"), dict), "has no tokenizer model")
        model, pre_tokenizer = document["model"], document.get("pre_tokenizer") or {}
        require(model.get("type") == "BPE", f"holds a {model.get('type')!r} model, not BPE")
        require(
            pre_tokenizer.get("type") == "ByteLevel"
            and pre_tokenizer.get("use_regex", True)
            and not pre_tokenizer.get("add_prefix_space"),
            "does not split text with the byte-level GPT-2 pre-tokenizer",
        )
        require(document.get("normalizer") is None, "normalizes text before splitting it")
        require(not model.get("ignore_merges") and not model.get("dropout"), "uses BPE options nanoeuler lacks")
        vocab, merges = model.get("vocab"), model.get("merges")
        require(isinstance(vocab, dict) and isinstance(merges, list), "lacks a vocab or merges list")
        require(all(vocab.get(BYTE_TO_CHAR[b]) == b for b in range(N_BYTES)), "does not give ids 0-255 to the bytes")
        try:
            pairs = [merge.split(" ") if isinstance(merge, str) else merge for merge in merges]
            merge_ids = [(vocab[left], vocab[right]) for left, right in pairs]
            specials = {t["content"]: t["id"] for t in document.get("added_tokens", []) if t.get("special")}
        except (ValueError, KeyError, TypeError, AttributeError):
            merge_ids = specials = None
        require(merge_ids is not None, "has merges or added tokens that do not name vocabulary entries")
        tokenizer = cls(merge_ids, sorted(specials, key=specials.get))
        require(
            tokenizer.to_hf_json()["model"]["vocab"] == vocab and tokenizer.special_tokens == specials,
            "has token ids that do not follow from its merges",
        )
        return tokenizer


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
