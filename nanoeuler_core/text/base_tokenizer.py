"""What nanoeuler's `Tokenizer` and a foreign tokenizer.json's `HFTokenizer` share: the ids and
the bytes they stand for, added tokens, encoding, decoding and saving. See docs/tokenizer.md."""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path
from typing import Iterable

import numpy as np
import orjson

from nanoeuler_core.text.hf_json import write_atomically
from nanoeuler_core.text.worker_pool import PARALLEL_MIN_CHARS, available_cores, encode_in_workers

EOS = "</s>"
_WORD_CACHE_LIMIT = 1 << 20  # encoded pretokens kept per tokenizer before the cache restarts


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used, or training input that cannot make a tokenizer."""


class BaseTokenizer:
    """A byte-level BPE tokenizer. A subclass sets `_token_bytes` (the bytes of each id),
    `_specials` (special token -> id) and `_merges`, calls `_init_added_tokens`, and defines
    `_pretokenize` (text -> pretokens), `_encode_words` (pretokens -> ids) and `to_hf_json`."""

    def _init_added_tokens(self, ids: dict[str, int], ordinary: Iterable[str], normalized: Iterable[str]) -> None:
        """Added tokens (`ids`: content -> id, the special ones and the `ordinary` ones, which are
        always recognised); those in `normalized` are looked for after the others, as Hugging
        Face does. Also starts the caches."""
        self._added_ids = dict(ids)
        self._ordinary_added = frozenset(ordinary)
        self._normalized_added = frozenset(normalized)
        self._added_patterns: dict[frozenset[str], list[re.Pattern]] = {}
        self._word_cache: dict[str, tuple[int, ...]] = {}

    # --- properties ----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids: bytes, learned tokens and special tokens."""
        return len(self._token_bytes)

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._specials)

    @property
    def merges(self) -> list[tuple[int, int]]:
        """The merged pairs of ids, in rank order."""
        return list(self._merges)

    def token_id(self, token: str) -> int | None:
        """The id of added token `token` (a special token such as `</s>` or `<|im_end|>`), or None."""
        return self._added_ids.get(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for (a special token's text for specials)."""
        self._check_ids([token_id])
        return self._token_bytes[token_id]

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

    def save(self, path: str | os.PathLike) -> None:
        """Write `tokenizer.json` atomically (temporary file, fsync, rename)."""
        write_atomically(Path(path), orjson.dumps(self.to_hf_json(), option=orjson.OPT_INDENT_2))
