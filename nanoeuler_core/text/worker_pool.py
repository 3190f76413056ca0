"""`Tokenizer.encode_batch` across processes: the texts in contiguous groups of similar length,
encoded by worker processes (each with its own copy of the tokenizer) while this one takes its
share."""

from __future__ import annotations

import itertools
import os
from array import array
from concurrent.futures import ProcessPoolExecutor

PARALLEL_MIN_CHARS = 1 << 20  # below this, starting worker processes costs more than it saves


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def encode_in_workers(tokenizer, texts: list[str], allowed_special, n_workers: int) -> list[list[int]]:
    """`tokenizer.encode(text, allowed_special)` of each text, in order, by this process and
    `n_workers - 1` others."""
    groups = _contiguous_groups(texts, 4 * n_workers)
    n_local = len(groups) // n_workers  # this process takes its share while the workers run
    with ProcessPoolExecutor(n_workers - 1, initializer=_set_worker_tokenizer, initargs=(tokenizer,)) as pool:
        results = pool.map(_encode_in_worker, groups[n_local:], itertools.repeat(allowed_special))
        local = [tokenizer.encode(text, allowed_special) for group in groups[:n_local] for text in group]
        return local + [ids.tolist() for group in results for ids in group]


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


_worker_tokenizer = None  # the tokenizer of a worker process (pickled by its __reduce__)


def _set_worker_tokenizer(tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _encode_in_worker(texts: list[str], allowed_special) -> list[array]:
    # Compact int arrays pickle far faster than lists of Python ints on the way back.
    return [array("i", _worker_tokenizer.encode(text, allowed_special)) for text in texts]
