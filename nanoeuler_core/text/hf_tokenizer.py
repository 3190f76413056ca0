"""`HFTokenizer`: a byte-level BPE tokenizer.json made elsewhere, as `Tokenizer.load` reads it.
See docs/tokenizer.md."""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import numpy as np
import orjson

from nanoeuler_core.text import bpe_kernels
from nanoeuler_core.text.base_tokenizer import EOS, BaseTokenizer, TokenizerError
from nanoeuler_core.text.bpe import split_words, word_table
from nanoeuler_core.text.hf_json import BYTE_TO_CHAR, CHAR_TO_BYTE, save_eos, spelled_bytes
from nanoeuler_core.text.hf_pretokenizer import pre_tokenizer_steps

# End-of-text tokens by their usual names, for a tokenizer.json loaded without an `eos`.
EOS_NAMES = (EOS, "<|endoftext|>", "<|end_of_text|>", "<|im_end|>", "<eos>", "<|eot_id|>")


class HFTokenizer(BaseTokenizer):
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
        self._steps = pre_tokenizer_steps(document.get("pre_tokenizer"), refuse)

        vocab, merges, added = model.get("vocab"), model.get("merges"), document.get("added_tokens") or []
        if not isinstance(vocab, dict) or not isinstance(merges, list) or not isinstance(added, list):
            refuse("lacks a vocab or merges list")
        if not all(isinstance(i, int) and i >= 0 for i in vocab.values()):
            refuse("has vocabulary ids that are not non-negative integers")
        token_bytes: dict[int, bytes] = {}
        for spelling, i in vocab.items():
            if i in token_bytes:
                refuse(f"gives id {i} to two vocabulary entries")
            token_bytes[i] = spelled_bytes(spelling)
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
            {spelled_bytes(s): i for s, i in vocab.items() if all(c in CHAR_TO_BYTE for c in s)}
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
            save_eos(Path(path), eos)

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
        symbols, offsets = self._byte_symbols(*word_table([words[i] for i in merged]))
        lengths = bpe_kernels.apply_merges_queued(symbols, offsets, self._pair_keys, self._pair_ranks, self._merged_ids)
        encoded = [(self._whole_words.get(word, -1),) for word in words]
        for i, ids in zip(merged, split_words(symbols, offsets, lengths)):
            encoded[i] = ids
        return encoded
