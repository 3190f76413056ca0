"""Byte-level BPE on word tables: learning merges from a corpus, and encoding words with them.

Ids 0-255 are the bytes; merge r joins two earlier ids into id 256 + r. A word table holds the
distinct pretokens' bytes end to end with offsets, as the Numba kernels in `bpe_kernels` take it.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Sequence

import numpy as np

from nanoeuler_core.text import bpe_kernels
from nanoeuler_core.text.pretokenizer import line_chunks, pretokenize

N_BYTES = 256
_CHUNK_CHARS = 1 << 16  # corpus piece size for sampling and counting


def learn_merges(
    text: str, n_new_tokens: int, sample_bytes: int | None, progress: Callable[[int, int], None]
) -> list[tuple[int, int]]:
    """Up to `n_new_tokens` merges learned from `text` (or from evenly spaced pieces of it totalling
    about `sample_bytes`): pretokens counted piece by piece, then the Numba merge loop.
    `progress(done, total)` follows both."""
    chunks = _training_chunks(text, sample_bytes)
    total_work = len(chunks) + n_new_tokens
    word_counts: Counter[str] = Counter()
    for i, chunk in enumerate(chunks):
        word_counts.update(pretokenize(chunk))
        progress(i + 1, total_work)
    return _merge_loop(word_counts, n_new_tokens, lambda n: progress(len(chunks) + n, total_work))


def _training_chunks(text: str, sample_bytes: int | None) -> list[str]:
    """The corpus in pieces; with `sample_bytes`, evenly spaced pieces totalling about that many bytes."""
    chunks = line_chunks(text, _CHUNK_CHARS)
    if sample_bytes is None:
        return chunks
    corpus_bytes = len(text.encode("utf-8", "surrogateescape"))
    if corpus_bytes <= sample_bytes:
        return chunks
    n_taken = max(1, round(len(chunks) * sample_bytes / corpus_bytes))
    stride = len(chunks) / n_taken
    return [chunks[int(i * stride)] for i in range(n_taken)]


def _merge_loop(
    word_counts: Counter[str], n_new_tokens: int, on_progress: Callable[[int], None]
) -> list[tuple[int, int]]:
    """Run the Numba merge loop on a word-frequency table; return up to `n_new_tokens` merges."""
    words = [word.encode("utf-8", "surrogateescape") for word in word_counts]
    multi_byte = [i for i, word in enumerate(words) if len(word) > 1]  # single bytes hold no pairs
    symbols, word_offsets = word_table([words[i] for i in multi_byte])
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


def merge_table(merges: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(pair keys ascending, their ranks): the merges as the encoder's binary search takes them."""
    keys = np.array([(left << 32) | right for left, right in merges], dtype=np.int64)
    ranks = np.argsort(keys, kind="stable")
    return keys[ranks], ranks


def encode_words(words: list[bytes], pair_keys: np.ndarray, pair_ranks: np.ndarray) -> list[tuple[int, ...]]:
    """The token ids of each pretoken (given as bytes), merges applied by rank."""
    symbols, offsets = word_table(words)
    lengths = bpe_kernels.apply_merges(symbols, offsets, pair_keys, pair_ranks)
    return split_words(symbols, offsets, lengths)


def word_table(words: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Words as the kernels take them: (L,) int32 bytes end to end, (W+1,) int64 offsets."""
    offsets = np.zeros(len(words) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, words), np.int64, len(words)), out=offsets[1:])
    return np.frombuffer(b"".join(words), np.uint8).astype(np.int32), offsets


def split_words(symbols: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> list[tuple[int, ...]]:
    """Per word, its first lengths[w] symbols from offsets[w] (what the merge kernels leave)."""
    ids = symbols.tolist()
    return [tuple(ids[start : start + n]) for start, n in zip(offsets.tolist(), lengths.tolist())]
