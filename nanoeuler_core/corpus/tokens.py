"""Corpus -> token ids (encoded once, cached next to the corpus) and the random-window batch loader.

A corpus is UTF-8 text. A line that is exactly `</s>` separates documents (the FineWeb slice and
the Python corpus are written that way): it becomes the tokenizer's `eos_id`, so the model learns
where a document ends and generation can stop there. Everything else is encoded as it stands.

The last `val_fraction` of the ids are held out, from the first document boundary there: no
document is split between training and validation (see `split_at_document`).

The ids are cached as `<corpus>.<tokenizer hash[:12]>.tokens`:

    header (little-endian, CACHE_HEADER)          the ids
    magic | version | tokenizer hash | corpus     uint16[n_tokens]
    size | corpus SHA-256 | n_tokens | ids SHA-256

The cache is reused only while the corpus content and the tokenizer hash match and the ids'
own checksum verifies; anything else (edited corpus, new tokenizer, truncated or damaged file)
is rebuilt. If the corpus folder cannot be written (a read-only install), the cache goes to the
user cache folder instead.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

import numpy as np

from nanoeuler_core.engine.checkpoint import atomic_write
from nanoeuler_core.text.worker_pool import available_cores

DOC_SEPARATOR = "</s>"
CACHE_MAGIC = b"NEULTOKS"
CACHE_VERSION = 1
# magic, version, tokenizer hash (ASCII hex, NUL-padded), corpus size, corpus SHA-256, n_tokens, ids SHA-256
CACHE_HEADER = struct.Struct("<8sI128sQ32sQ32s")
MAX_VOCAB = 1 << 16  # ids are stored as uint16
CHUNK_CHARS = 1 << 20  # corpus text is encoded in chunks of about this size, cut at line ends
CHUNKS_PER_CORE = 8  # chunks handed to one encode_batch call, per core (it starts a pool of processes each call)


class TokenizerLike(Protocol):
    hash: str
    vocab_size: int
    eos_id: int

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...


@dataclass(frozen=True)
class TokenSplits:
    """A corpus's ids: the first part for training, about the last `val_fraction` for validation,
    cut at a document boundary where there is one (`split_at_document`)."""

    corpus: Path
    train: np.ndarray  # uint16
    val: np.ndarray  # uint16
    cache: Path | None  # where the ids are cached (None if no folder could be written)


def default_corpus() -> Path:
    """The bundled public-domain Shakespeare text, so training needs no download."""
    return Path(str(importlib.resources.files("nanoeuler_data") / "tinyshakespeare.txt"))


def user_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nanoeuler"


def cache_paths(corpus: Path, tok: TokenizerLike) -> list[Path]:
    """Where the ids may be cached, in order of preference: beside the corpus, then the user cache."""
    corpus = Path(corpus).resolve()
    name = f"{corpus.name}.{tok.hash[:12]}.tokens"
    # Corpora of the same name in different folders must not share a user-cache entry.
    folder_digest = hashlib.sha256(str(corpus.parent).encode()).hexdigest()[:8]
    return [corpus.with_name(name), user_cache_dir() / f"{folder_digest}.{name}"]


def load_tokens(corpus: Path, tok: TokenizerLike, *, val_fraction: float = 0.1) -> TokenSplits:
    """Token ids of `corpus` (from the cache when it is still valid, else encoded and cached), split
    into training and held-out ids by `split_at_document`."""
    corpus = Path(corpus)
    if tok.vocab_size > MAX_VOCAB:
        raise ValueError(f"vocab_size {tok.vocab_size} does not fit uint16 token ids (at most {MAX_VOCAB})")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if len(tok.hash.encode("ascii")) > 128:
        raise ValueError("tokenizer hash longer than 128 characters")
    try:
        corpus_size = corpus.stat().st_size
        corpus_digest = file_sha256(corpus)
    except OSError as e:
        raise ValueError(f"cannot read corpus {corpus}: {e.strerror}") from None

    expected = (tok.hash, corpus_size, corpus_digest)
    ids, cache = None, None
    for path in cache_paths(corpus, tok):
        ids = _read_cache(path, *expected)
        if ids is not None:
            cache = path
            break
    if ids is None:
        ids = encode_corpus(corpus, tok)
        cache = _write_cache_somewhere(cache_paths(corpus, tok), ids, *expected)

    cut = split_at_document(ids, tok.eos_id, val_fraction)
    return TokenSplits(corpus, ids[:cut], ids[cut:], cache)


def split_at_document(ids: np.ndarray, eos_id: int, val_fraction: float) -> int:
    """Where the held-out ids start: the last `val_fraction` of them, the cut moved forward to just
    after the first `eos_id` at or after it, so that no document spans training and validation.

    The cut stays where it is when the held-out ids hold no `eos_id` before their last id (a corpus
    without separators, or one whose last document is longer than the held-out part); an `eos_id`
    just before the cut already marks a boundary."""
    n_val = int(round(len(ids) * val_fraction))
    cut = len(ids) - n_val
    if n_val == 0:
        return cut
    # ids[cut - 1] is the last training id; an eos at the very end would leave nothing held out
    ends = np.flatnonzero(ids[cut - 1 : len(ids) - 1] == eos_id)
    return cut + int(ends[0]) if len(ends) else cut


def check_length(splits: TokenSplits, ctx_len: int) -> None:
    """Raise ValueError unless each non-empty split holds one context window plus its last target."""
    need = ctx_len + 1
    for name, ids in (("training", splits.train), ("validation", splits.val)):
        if name == "validation" and len(splits.val) == 0:
            continue
        if len(ids) < need:
            raise ValueError(
                f"corpus {splits.corpus} gives {len(ids)} {name} tokens, fewer than one context window "
                f"of {ctx_len} tokens plus its target ({need}): use a longer corpus"
            )


def encode_corpus(corpus: Path, tok: TokenizerLike) -> np.ndarray:
    """Encode the whole corpus to uint16 ids, `</s>` separator lines becoming `tok.eos_id`."""
    parts: list[np.ndarray] = []
    eos = np.array([tok.eos_id], dtype=np.uint16)
    batch: list[tuple[str, bool]] = []

    def flush() -> None:
        for ids, (_, ends_document) in zip(tok.encode_batch([text for text, _ in batch]), batch):
            parts.append(np.asarray(ids, dtype=np.uint16))
            if ends_document:
                parts.append(eos)
        batch.clear()

    try:
        for chunk in _corpus_chunks(corpus):
            batch.append(chunk)
            if len(batch) == CHUNKS_PER_CORE * available_cores():
                flush()
        flush()
    except UnicodeDecodeError as e:
        raise ValueError(f"corpus {corpus} is not UTF-8 text (byte {e.start})") from None
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def _corpus_chunks(corpus: Path) -> Iterator[tuple[str, bool]]:
    """(text, ends_document) chunks of about CHUNK_CHARS, each ending at a line end or a separator."""
    pending: list[str] = []
    size = 0
    # newline="" keeps "\r\n" as written: the ids must decode back to the exact corpus text.
    with open(corpus, encoding="utf-8", newline="") as f:
        for line in f:
            if line.rstrip("\r\n") == DOC_SEPARATOR:
                yield "".join(pending), True
                pending, size = [], 0
                continue
            pending.append(line)
            size += len(line)
            if size >= CHUNK_CHARS:
                yield "".join(pending), False
                pending, size = [], 0
    if pending:
        yield "".join(pending), False


def file_sha256(path: Path) -> bytes:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.digest()


def _read_cache(path: Path, tok_hash: str, corpus_size: int, corpus_digest: bytes) -> np.ndarray | None:
    """The cached ids if the file is complete, intact and made from this corpus and tokenizer."""
    try:
        with open(path, "rb") as f:
            header = f.read(CACHE_HEADER.size)
            if len(header) != CACHE_HEADER.size:
                return None
            magic, version, cached_hash, size, digest, n_tokens, ids_digest = CACHE_HEADER.unpack(header)
            if (magic, version) != (CACHE_MAGIC, CACHE_VERSION):
                return None
            if (cached_hash.rstrip(b"\0").decode("ascii", "replace"), size, digest) != (
                tok_hash, corpus_size, corpus_digest
            ):
                return None
            payload = f.read(2 * n_tokens + 1)  # one byte more to notice trailing garbage
    except OSError:
        return None
    if len(payload) != 2 * n_tokens or hashlib.sha256(payload).digest() != ids_digest:
        return None
    return np.frombuffer(payload, dtype="<u2").astype(np.uint16, copy=False)


def _write_cache_somewhere(paths: list[Path], ids: np.ndarray, tok_hash: str, corpus_size: int,
                           corpus_digest: bytes) -> Path | None:
    """Write the cache to the first writable path; warn and return None if none is."""
    payload = ids.astype("<u2", copy=False).tobytes()
    header = CACHE_HEADER.pack(CACHE_MAGIC, CACHE_VERSION, tok_hash.encode("ascii"), corpus_size,
                               corpus_digest, len(ids), hashlib.sha256(payload).digest())
    errors = []
    for path in paths:
        try:
            atomic_write(path, header + payload)
            return path
        except OSError as e:
            errors.append(f"{path.parent}: {e.strerror or e}")
    warnings.warn(f"token ids not cached (no writable folder: {'; '.join(errors)})", stacklevel=3)
    return None


class BatchLoader:
    """Random context windows from a token array, the same batch for the same (seed, step).

    The generator is derived from (seed, step) alone, so a resumed run draws exactly the
    batches the uninterrupted run would have drawn. A step's rows form one sequence: row i of
    step s is the i-th window drawn from (seed, s), whatever the batch size, so `batch(s, part)`,
    the rows [part * batch_size, (part + 1) * batch_size), splits a large batch into micro-batches
    and over data-parallel ranks without changing it.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, ctx_len: int, seed: int):
        if batch_size < 1 or ctx_len < 1:
            raise ValueError(f"batch_size and ctx_len must be positive, got {batch_size} and {ctx_len}")
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        if len(tokens) < ctx_len + 1:
            raise ValueError(f"{len(tokens)} tokens are fewer than one context window of {ctx_len} plus its target")
        self.tokens = tokens
        self.batch_size = batch_size
        self.ctx_len = ctx_len
        self.seed = seed
        self._offsets = np.arange(ctx_len + 1)

    def batch(self, step: int, part: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """inputs (B, T) and targets (B, T) int64, with targets[:, t] the token after inputs[:, t]:
        rows [part * B, (part + 1) * B) of step `step`."""
        rng = np.random.default_rng([self.seed, step])
        # Bounded integers are drawn one after another from the stream: the first n of a longer
        # draw are the n of a draw of n.
        starts = rng.integers(0, len(self.tokens) - self.ctx_len, size=(part + 1) * self.batch_size)[part * self.batch_size:]
        windows = self.tokens[starts[:, None] + self._offsets].astype(np.int64)  # (B, T + 1)
        return windows[:, :-1], windows[:, 1:]
