"""Byte-level BPE tokenizer, saved in the Hugging Face `tokenizers` format (docs/tokenizer.md).

    tok = Tokenizer.train(text, vocab_size=512)
    ids = tok.encode("It was")          # [...]
    tok.decode(ids)                     # "It was"
    tok.save("tokenizer.json")          # tokenizers.Tokenizer.from_file reads it, same ids

Ids 0-255 are the bytes, then the learned merges, then the special tokens (at least `</s>`).
Its parts: encoding and decoding (`base_tokenizer`, shared with `hf_tokenizer`'s `HFTokenizer`,
which `load` gives for files made elsewhere), GPT-2's pre-tokenization (`pretokenizer`), learning
and applying merges (`bpe`, over the Numba kernels of `bpe_kernels`), tokenizer.json (`hf_json`),
and `encode_batch` across processes (`worker_pool`).
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import orjson

from nanoeuler_core.text import bpe
from nanoeuler_core.text.base_tokenizer import EOS, BaseTokenizer, TokenizerError
from nanoeuler_core.text.bpe import N_BYTES
from nanoeuler_core.text.hf_json import BYTE_TO_CHAR, byte_level_document, byte_level_spelling, configured_eos
from nanoeuler_core.text.hf_tokenizer import HFTokenizer
from nanoeuler_core.text.pretokenizer import pretokenize


class Tokenizer(BaseTokenizer):
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

    def __reduce__(self):  # worker processes rebuild from merges + specials, without the cache
        return Tokenizer, (self._merges, list(self._specials))

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, special_tokens={list(self._specials)})"

    # --- properties ----------------------------------------------------------------------------

    @property
    def eos_id(self) -> int:
        """Id of `</s>`, the end-of-document and end-of-reply marker."""
        return self._specials[EOS]

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

    def _pretokenize(self, text: str) -> list[str]:
        return pretokenize(text)

    def _encode_words(self, words: list[bytes]) -> list[tuple[int, ...]]:
        """The token ids of each pretoken (given as bytes)."""
        return bpe.encode_words(words, self._pair_keys, self._pair_ranks)

    # --- files ---------------------------------------------------------------------------------

    def to_hf_json(self) -> dict:
        """The Hugging Face `tokenizers` document for this tokenizer (what `save` writes)."""
        n_learned = len(self._token_bytes) - len(self._specials)
        return byte_level_document(self._token_bytes[:n_learned], self._merges, self._specials)

    @classmethod
    def load(cls, path: str | os.PathLike, eos: str | None = None) -> Tokenizer | HFTokenizer:
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
    def from_hf_json(
        cls, document: dict, source: str = "tokenizer.json", eos: str | None = None
    ) -> Tokenizer | HFTokenizer:
        """Rebuild from a Hugging Face document: nanoeuler's own layout (ids 0-255 the bytes, merge r
        making id 256 + r, `</s>` among the special tokens at the end) gives a `Tokenizer`, any other
        byte-level BPE an `HFTokenizer` with end-of-text token `eos`."""
        own = _own_layout(document)
        return own if own is not None else HFTokenizer(document, eos, source)


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


def _check_special_tokens(special_tokens: Sequence[str]) -> dict[str, int]:
    """Special tokens as an ordered dict (ids filled in later); `</s>` must be one of them."""
    if isinstance(special_tokens, str) or not all(isinstance(s, str) and s for s in special_tokens):
        raise TokenizerError(f"special_tokens must be a list of non-empty strings, got {special_tokens!r}")
    if len(set(special_tokens)) != len(special_tokens):
        raise TokenizerError(f"special_tokens has duplicates: {list(special_tokens)}")
    if EOS not in special_tokens:
        raise TokenizerError(f"special_tokens must include {EOS!r}, the end-of-document marker")
    return dict.fromkeys(special_tokens, -1)
