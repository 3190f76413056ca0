"""Byte-level BPE tokenizer, saved in the Hugging Face `tokenizers` format (docs/tokenizer.md).

    tok = Tokenizer.train(text, vocab_size=512)
    ids = tok.encode("It was")          # [...]
    tok.decode(ids)                     # "It was"
    tok.save("tokenizer.json")          # tokenizers.Tokenizer.from_file reads it, same ids

Ids 0-255 are the bytes, then the learned merges, then the special tokens (at least `</s>`).
Its parts: GPT-2's pre-tokenization (`pretokenizer`), learning and applying merges (`bpe`, over
the Numba kernels of `bpe_kernels`), tokenizer.json (`hf_json`; `hf_tokenizer` reads files made
elsewhere as an `HFTokenizer`), and `encode_batch` across processes (`worker_pool`).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import re
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import orjson

from nanoeuler_core.text import bpe
from nanoeuler_core.text.bpe import N_BYTES
from nanoeuler_core.text.hf_json import byte_level_document, byte_level_spelling, configured_eos, write_atomically
from nanoeuler_core.text.pretokenizer import pretokenize
from nanoeuler_core.text.worker_pool import PARALLEL_MIN_CHARS, available_cores, encode_in_workers

EOS = "</s>"
_WORD_CACHE_LIMIT = 1 << 20  # encoded pretokens kept per tokenizer before the cache restarts


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used, or training input that cannot make a tokenizer."""


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
        self._pair_keys, self._pair_ranks = bpe.merge_table(self._merges)

        self._specials = _check_special_tokens(special_tokens)
        learned_spellings = {byte_level_spelling(token) for token in self._token_bytes}
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

        merges = bpe.learn_merges(text, n_new_tokens, sample_bytes, progress or (lambda done, total: None))
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
        n_workers = n_workers or available_cores()
        if n_workers < 2 or len(texts) < 2 or sum(map(len, texts)) < PARALLEL_MIN_CHARS:
            return [self.encode(text, allowed_special) for text in texts]
        self._allowed_specials(allowed_special)  # fail here, not in a worker
        return encode_in_workers(self, texts, allowed_special, n_workers)

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
        return bpe.encode_words(words, self._pair_keys, self._pair_ranks)

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
        return byte_level_document(self._token_bytes[:n_learned], self._merges, self._specials)

    def save(self, path: str | os.PathLike) -> None:
        """Write `tokenizer.json` atomically (temporary file, fsync, rename)."""
        write_atomically(Path(path), orjson.dumps(self.to_hf_json(), option=orjson.OPT_INDENT_2))

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
        # imported here, not above: HFTokenizer subclasses Tokenizer, so hf_tokenizer imports this module
        from nanoeuler_core.text.hf_tokenizer import read_document

        return read_document(document, source, eos)


def _check_special_tokens(special_tokens: Sequence[str]) -> dict[str, int]:
    """Special tokens as an ordered dict (ids filled in later); `</s>` must be one of them."""
    if isinstance(special_tokens, str) or not all(isinstance(s, str) and s for s in special_tokens):
        raise TokenizerError(f"special_tokens must be a list of non-empty strings, got {special_tokens!r}")
    if len(set(special_tokens)) != len(special_tokens):
        raise TokenizerError(f"special_tokens has duplicates: {list(special_tokens)}")
    if EOS not in special_tokens:
        raise TokenizerError(f"special_tokens must include {EOS!r}, the end-of-document marker")
    return dict.fromkeys(special_tokens, -1)
