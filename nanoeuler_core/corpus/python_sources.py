"""The benchmark corpus built offline (docs/corpus.md): the text files of this machine's Python
installation (the standard library and the installed packages), in a fixed order, filtered, shuffled
with a fixed seed and cut to a size in whole documents, each followed by a `</s>` line. The same
files give the same bytes.

Output: out/python.txt (the corpus), out/python.json (what it was built from, to compare two
machines' builds), and the corpus's line in out/SHA256SUMS.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import re
import sys
import sysconfig
from collections import Counter, deque
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from nanoeuler_core.corpus.downloads import DatasetError, Progress, record_checksums
from nanoeuler_core.corpus.tokens import DOC_SEPARATOR
from nanoeuler_core.engine.checkpoint import atomic_writer, write_json

TEXT_EXTENSIONS = (".py", ".pyi", ".pyx", ".pxd", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".cuh",
                   ".md", ".rst", ".txt")
SKIPPED_FOLDERS = frozenset({"__pycache__", ".git"})
MAX_DOCUMENT_BYTES = 1_000_000  # larger files are mostly generated tables
SHUFFLE_SEED = 0
CORPUS_NAME = "python.txt"
MANIFEST_NAME = "python.json"
SKIP_REASONS = ("symlink_outside_roots", "too_large", "unreadable", "not_utf8", "empty", "separator_line",
                "duplicate")
# A line of a document that `load_tokens` would read as a separator: `</s>` between line ends as
# Python's universal newlines split them ("\n", "\r", "\r\n").
_SEPARATOR = DOC_SEPARATOR.encode()
_SEPARATOR_LINE = re.compile(rb"(?:\A|[\r\n])" + re.escape(_SEPARATOR) + rb"(?:[\r\n]|\Z)")
_SEPARATOR_RECORD = _SEPARATOR + b"\n"
_FILES_PER_TASK = 64  # files one worker reads per task: few enough to balance, many enough to amortize


@dataclass(frozen=True)
class Document:
    path: str
    sha256: bytes
    record_bytes: int  # its bytes in the corpus: the text, a final newline if it lacks one, the separator line


@dataclass(frozen=True)
class PythonCorpus:
    corpus: Path
    manifest: Path
    documents: int
    bytes: int
    sha256: str


def default_roots() -> list[Path]:
    """This Python's standard library, purelib and platlib folders, then every other package folder
    it imports from (a site-packages or dist-packages folder on sys.path: a virtual environment that
    sees another installation's packages through a .pth file reads those too), each once, in that
    order."""
    own = [Path(sysconfig.get_path(name)) for name in ("stdlib", "purelib", "platlib")]
    seen = [Path(p) for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    return _unique_real_folders(own + seen)


def build(out: Path, max_bytes: int, roots: Sequence[Path] | None = None, *, progress: Progress | None = None,
          workers: int | None = None) -> PythonCorpus:
    """Write out/python.txt from the text files under `roots` (default: `default_roots()`), at most
    `max_bytes` in whole documents, with its manifest out/python.json, by the rules of docs/corpus.md."""
    if max_bytes < 1:
        raise DatasetError(f"max_bytes must be positive, got {max_bytes}")
    for root in roots or ():
        if not Path(root).is_dir():
            raise DatasetError(f"root {root} is not a folder")
    roots = _unique_real_folders(roots) if roots else default_roots()
    out = Path(out)
    workers = workers or os.cpu_count() or 1

    candidates, skipped = _candidates(roots, exclude=os.path.realpath(out))
    documents = _documents(candidates, skipped, workers, progress)
    if not documents:
        raise DatasetError(f"no text files to take under {', '.join(map(str, roots))}")
    taken = []
    size = 0
    for i in np.random.default_rng(SHUFFLE_SEED).permutation(len(documents)):
        if size + documents[i].record_bytes > max_bytes:
            break
        taken.append(documents[i])
        size += documents[i].record_bytes
    if not taken:
        raise DatasetError(f"max_bytes {max_bytes} is smaller than the first document; nothing was written")

    corpus, manifest = out / CORPUS_NAME, out / MANIFEST_NAME
    digest = _write(corpus, taken, size, workers, progress)
    write_json(manifest, {
        "corpus": CORPUS_NAME,
        "sha256": digest,
        "bytes": size,
        "documents": len(taken),
        "documents_left_out": len(documents) - len(taken),  # valid documents past max_bytes
        "skipped": {reason: skipped[reason] for reason in SKIP_REASONS},
        "max_bytes": max_bytes,
        "max_document_bytes": MAX_DOCUMENT_BYTES,
        "shuffle_seed": SHUFFLE_SEED,
        "separator": DOC_SEPARATOR,
        "extensions": list(TEXT_EXTENSIONS),
        "roots": [str(root) for root in roots],
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "distributions": installed_distributions(),
    })
    record_checksums(out, {CORPUS_NAME: digest})
    return PythonCorpus(corpus, manifest, len(taken), size, digest)


def installed_distributions() -> dict[str, str]:
    """Name -> version of the distributions this Python imports, by name (case-insensitive)."""
    found: dict[str, tuple[str, str]] = {}
    for dist in importlib.metadata.distributions():  # in sys.path order: the first is the one imported
        name = dist.metadata["Name"]
        if name:
            found.setdefault(name.lower(), (name, dist.version))
    return dict(found[key] for key in sorted(found))


def _unique_real_folders(folders) -> list[Path]:
    unique: list[Path] = []
    for folder in folders:
        real = Path(os.path.realpath(folder))
        if real not in unique:
            unique.append(real)
    return unique


def _candidates(roots: list[Path], exclude: str) -> tuple[list[tuple[str, int]], Counter]:
    """(path, size) of the text files to read, in corpus order, and the counts of those passed over."""
    real_roots = [str(root) for root in roots]
    prefixes = [os.path.join(root, "") for root in real_roots]
    skipped: Counter = Counter()
    keyed = []
    for index, root in enumerate(real_roots):
        other_roots = {r for r in real_roots if r != root}
        for entry in _text_files(root, prune=other_roots | {exclude}):
            if entry.is_symlink():
                target = os.path.realpath(entry.path)
                if not any(target.startswith(prefix) for prefix in prefixes):
                    skipped["symlink_outside_roots"] += 1
                    continue
            try:
                size = entry.stat().st_size if entry.is_file() else None
            except OSError:
                size = None
            if size is None:  # a dangling link, a pipe, a device, a file gone since it was listed
                skipped["unreadable"] += 1
                continue
            if size > MAX_DOCUMENT_BYTES:
                skipped["too_large"] += 1
                continue
            relative = entry.path[len(prefixes[index]):].replace(os.sep, "/")
            keyed.append(((index, relative), entry.path, size))
    keyed.sort()
    return [(path, size) for _, path, size in keyed], skipped


def _text_files(root: str, prune: set[str]) -> Iterator[os.DirEntry]:
    """Files under `root` with a text extension; folder links, SKIPPED_FOLDERS and `prune` not entered."""
    folders = [root]
    while folders:
        try:
            entries = list(os.scandir(folders.pop()))
        except OSError:  # an unreadable folder is passed over like an unreadable file
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                if entry.name not in SKIPPED_FOLDERS and entry.path not in prune:
                    folders.append(entry.path)
            elif entry.name.endswith(TEXT_EXTENSIONS):
                yield entry


def _documents(candidates: list[tuple[str, int]], skipped: Counter, workers: int,
               progress: Progress | None) -> list[Document]:
    """Read every candidate (in parallel) and keep the documents, in order; count the rest in `skipped`."""
    tasks = [candidates[i:i + _FILES_PER_TASK] for i in range(0, len(candidates), _FILES_PER_TASK)]
    total = sum(size for _, size in candidates)
    documents: list[Document] = []
    seen: set[bytes] = set()
    done = 0
    with ThreadPoolExecutor(workers) as pool:  # reading and hashing release the GIL
        for task, results in zip(tasks, _in_order(pool, _examine_files, tasks, 4 * workers)):
            for (path, size), (reason, digest, record_bytes) in zip(task, results):
                done += size
                if reason is None and digest in seen:
                    reason = "duplicate"
                if reason is not None:
                    skipped[reason] += 1
                    continue
                seen.add(digest)
                documents.append(Document(path, digest, record_bytes))
            if progress:
                progress("reading files", done, total)
    return documents


def _in_order(pool: Executor, fn: Callable, tasks: Iterable, window: int) -> Iterator:
    """fn(task) for each task, in order, with at most `window` tasks submitted and not yet taken:
    what is read runs ahead of what is used by a bounded amount."""
    pending: deque = deque()
    for task in tasks:
        pending.append(pool.submit(fn, task))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _examine_files(candidates: list[tuple[str, int]]) -> list[tuple[str | None, bytes, int]]:
    return [_examine(path) for path, _ in candidates]


def _examine(path: str) -> tuple[str | None, bytes, int]:
    """(reason to skip or None, SHA-256 of the bytes, bytes in the corpus) of one file."""
    try:
        data = _read(path)
    except OSError:
        return "unreadable", b"", 0
    if len(data) > MAX_DOCUMENT_BYTES:  # grown since it was listed
        return "too_large", b"", 0
    if not data.isascii():  # ASCII is UTF-8: most files need no decoding
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return "not_utf8", b"", 0
    if not data or data.isspace():
        return "empty", b"", 0
    if _SEPARATOR in data and _SEPARATOR_LINE.search(data):
        return "separator_line", b"", 0
    final_newline = 0 if data.endswith(b"\n") else 1
    return None, hashlib.sha256(data).digest(), len(data) + final_newline + len(_SEPARATOR_RECORD)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _record(data: bytes) -> bytes:
    """A document as the corpus holds it: its text ending in a newline, then the separator line."""
    return data + (b"" if data.endswith(b"\n") else b"\n") + _SEPARATOR_RECORD


def _write(corpus: Path, documents: list[Document], size: int, workers: int, progress: Progress | None) -> str:
    """Write the documents' records to `corpus` atomically; returns its SHA-256 (hex)."""
    digest = hashlib.sha256()
    written = 0
    tasks = [documents[i:i + _FILES_PER_TASK] for i in range(0, len(documents), _FILES_PER_TASK)]
    with atomic_writer(corpus) as f, ThreadPoolExecutor(workers) as pool:
        for records in _in_order(pool, _read_records, tasks, 4 * workers):
            for record in records:
                f.write(record)
                digest.update(record)
                written += len(record)
            if progress:
                progress(corpus.name, written, size)
    return digest.hexdigest()


def _read_records(documents: list[Document]) -> list[bytes]:
    records = []
    for document in documents:
        data = _read(document.path)
        if hashlib.sha256(data).digest() != document.sha256:
            raise DatasetError(f"{document.path} changed while the corpus was being built; run the command again")
        records.append(_record(data))
    return records
