"""Real corpora, as the original pipeline had them: Project Gutenberg books, a FineWeb-Edu slice, Alpaca;
and the HellaSwag validation set for evaluation.

Every download goes through `download`: progress reported to a callback, a partial download kept
as `<file>.part` and resumed with an HTTP Range request (also retried within one call), and a
SHA-256 checked against a pinned digest where the caller gives one. Each output folder holds a
`SHA256SUMS` manifest (the `sha256sum` format, so `sha256sum -c SHA256SUMS` works) recording every
file downloaded or written there; a file already present is reused only if it still matches its
entry. Every function takes its URL or base URL, so a mirror (or a test's local server) works the
same way as the real site.

Output layout (`out` is the folder given to each function):

    gutenberg: out/raw/pg<ID>.txt (as downloaded), out/gutenberg.txt (the corpus)
    fineweb:   out/raw/<shard>.parquet,             out/fineweb.txt   (the corpus)
    alpaca:    <folder of out>/alpaca_data.json,    out               (JSONL, one example a line)
    hellaswag: out                                                    (JSONL, as published)

In the FineWeb corpus, documents are separated by a line holding only `</s>`; `load_tokens`
turns that line into the tokenizer's end-of-document id (nanoeuler_core/corpus/tokens.py). Gutenberg
books are separated by two blank lines, as the books themselves separate chapters.
"""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Iterable, Mapping

from nanoeuler_core.engine.checkpoint import atomic_write, atomic_writer
from nanoeuler_core.corpus.records import text_fields  # the same field rules as `sft --data`
from nanoeuler_core.corpus.tokens import DOC_SEPARATOR, file_sha256

GUTENBERG_URL = "https://www.gutenberg.org/cache/epub"
FINEWEB_URL = "https://huggingface.co/datasets/HuggingFaceFW/fineweb-edu/resolve/main/sample/10BT"
FINEWEB_SHARDS = tuple(f"{i:03d}_00000.parquet" for i in range(14))  # about 2 GB each
ALPACA_URL = "https://raw.githubusercontent.com/tatsu-lab/stanford_alpaca/main/alpaca_data.json"
HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
# 12,246,618 bytes, 10,042 items; the digest tensorflow_datasets pins for the same URL
HELLASWAG_SHA256 = "0aa3b88843990f3f10a97b9575c94d7b71fb2205240ba04ae4884d9e9c992588"
HELLASWAG_DEFAULT = Path("corpora/hellaswag/hellaswag_val.jsonl")  # where `data hellaswag` puts it and `eval` looks
MANIFEST = "SHA256SUMS"
USER_AGENT = "nanoeuler-data/0.1"
BLOCK_SIZE = 1 << 16

# (name, bytes done, bytes in total or None when the server does not say)
Progress = Callable[[str, int, "int | None"], None]

# The default Gutenberg corpus: public-domain English prose, about 30 MB once stripped.
GUTENBERG_BOOKS: dict[int, str] = {
    1342: "Pride and Prejudice (Jane Austen)",
    158: "Emma (Jane Austen)",
    161: "Sense and Sensibility (Jane Austen)",
    105: "Persuasion (Jane Austen)",
    84: "Frankenstein (Mary Shelley)",
    11: "Alice's Adventures in Wonderland (Lewis Carroll)",
    1661: "The Adventures of Sherlock Holmes (Arthur Conan Doyle)",
    2852: "The Hound of the Baskervilles (Arthur Conan Doyle)",
    2701: "Moby Dick (Herman Melville)",
    98: "A Tale of Two Cities (Charles Dickens)",
    1400: "Great Expectations (Charles Dickens)",
    46: "A Christmas Carol (Charles Dickens)",
    730: "Oliver Twist (Charles Dickens)",
    345: "Dracula (Bram Stoker)",
    174: "The Picture of Dorian Gray (Oscar Wilde)",
    74: "The Adventures of Tom Sawyer (Mark Twain)",
    76: "Adventures of Huckleberry Finn (Mark Twain)",
    1260: "Jane Eyre (Charlotte Bronte)",
    768: "Wuthering Heights (Emily Bronte)",
    145: "Middlemarch (George Eliot)",
    35: "The Time Machine (H. G. Wells)",
    36: "The War of the Worlds (H. G. Wells)",
    120: "Treasure Island (Robert Louis Stevenson)",
    43: "The Strange Case of Dr. Jekyll and Mr. Hyde (Robert Louis Stevenson)",
    219: "Heart of Darkness (Joseph Conrad)",
    16: "Peter Pan (J. M. Barrie)",
    55: "The Wonderful Wizard of Oz (L. Frank Baum)",
    215: "The Call of the Wild (Jack London)",
    829: "Gulliver's Travels (Jonathan Swift)",
    2814: "Dubliners (James Joyce)",
}


class DatasetError(Exception):
    """A download or a dataset file went wrong; the message says what happened and what to do."""


class DownloadError(DatasetError):
    """The server could not be reached or refused the file."""


class ChecksumError(DatasetError):
    """A file's SHA-256 differs from the pinned or recorded one."""


# ---------------------------------------------------------------------------------------------
# Downloads


def download(url: str, dest: Path, *, sha256: str | None = None, progress: Progress | None = None,
             attempts: int = 3, retry_delay: float = 2.0, timeout: float = 60.0) -> str:
    """Download `url` to `dest` through `dest.part`, resuming what an earlier try left there.

    Returns the file's SHA-256 (hex). With `sha256`, a file that does not match is deleted and
    ChecksumError raised. Connection failures are retried `attempts` times, each resuming; after
    the last, the `.part` file stays for the next call to resume.
    """
    part = dest.with_name(dest.name + ".part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, attempts + 1):
        try:
            _download_part(url, part, dest.name, progress, timeout)
            break
        except urllib.error.HTTPError as e:
            if e.code not in (408, 429) and e.code < 500:  # the request itself is wrong: retrying won't help
                raise DownloadError(f"{url}: HTTP {e.code} {e.reason}") from None
            failure = f"HTTP {e.code} {e.reason}"
        except urllib.error.URLError as e:
            failure = str(e.reason)
        except (OSError, http.client.HTTPException) as e:
            failure = str(e) or type(e).__name__
        if attempt == attempts:
            kept = f"; {part.stat().st_size} bytes kept in {part}, run again to resume" if part.exists() else ""
            raise DownloadError(f"{url}: {failure}{kept}")
        time.sleep(retry_delay * attempt)

    digest = file_sha256(part).hex()
    if sha256 is not None and digest != sha256.lower():
        part.unlink()
        raise ChecksumError(f"{url}: SHA-256 {digest} does not match the pinned {sha256}; the download was deleted")
    part.replace(dest)
    return digest


def _download_part(url: str, part: Path, name: str, progress: Progress | None, timeout: float) -> None:
    """Bring `part` up to the whole file, asking only for the bytes it lacks."""
    have = part.stat().st_size if part.exists() else 0
    headers = {"User-Agent": USER_AGENT}
    if have:
        headers["Range"] = f"bytes={have}-"
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # nothing left to send: the part is complete, or larger than the file
            if _content_range_total(e.headers.get("Content-Range")) == have:
                return
            part.unlink()
            raise ConnectionError("the partial download is longer than the file; starting over") from None
        raise
    with response:
        resumed = response.status == 206
        if resumed and _content_range_start(response.headers.get("Content-Range")) != have:
            part.unlink(missing_ok=True)
            raise ConnectionError("the server sent a different byte range than asked for; starting over")
        if not resumed:
            have = 0  # the server sent the whole file (it ignores Range): start the part afresh
        length = response.headers.get("Content-Length")
        total = have + int(length) if length is not None else None
        done = have
        if progress:
            progress(name, done, total)
        with open(part, "ab" if resumed else "wb") as f:
            while block := response.read(BLOCK_SIZE):
                f.write(block)
                done += len(block)
                if progress:
                    progress(name, done, total)
    if total is not None and done < total:
        raise ConnectionError(f"connection closed after {done} of {total} bytes")


def _content_range_start(header: str | None) -> int | None:
    match = re.fullmatch(r"bytes (\d+)-\d+/(?:\d+|\*)", (header or "").strip())
    return int(match.group(1)) if match else None


def _content_range_total(header: str | None) -> int | None:
    match = re.fullmatch(r"bytes (?:\*|\d+-\d+)/(\d+)", (header or "").strip())
    return int(match.group(1)) if match else None


def read_manifest(folder: Path) -> dict[str, str]:
    """File name (relative to `folder`) -> SHA-256 hex, from `folder/SHA256SUMS`."""
    path = folder / MANIFEST
    if not path.exists():
        return {}
    entries = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        digest, sep, name = line.partition(" ")
        if sep:
            entries[name.lstrip(" *")] = digest.lower()  # "  name" (text mode) or " *name" (binary mode)
    return entries


def record_checksums(folder: Path, entries: Mapping[str, str]) -> None:
    manifest = read_manifest(folder) | dict(entries)
    lines = "".join(f"{digest}  {name}\n" for name, digest in sorted(manifest.items()))
    atomic_write(folder / MANIFEST, lines.encode("utf-8"))


def fetch(url: str, folder: Path, name: str, *, sha256: str | None = None, progress: Progress | None = None,
          **download_options) -> Path:
    """`folder/name`: the copy already there if it still matches SHA256SUMS, else downloaded and recorded."""
    dest = folder / name
    recorded = read_manifest(folder).get(name)
    if dest.exists() and recorded is not None:
        digest = file_sha256(dest).hex()
        if digest != recorded:
            raise ChecksumError(f"{dest} changed since it was downloaded (its SHA-256 differs from "
                                f"{folder / MANIFEST}); delete it to download it again")
        if sha256 is not None and digest != sha256.lower():
            raise ChecksumError(f"{dest}: SHA-256 {digest} does not match the pinned {sha256}; "
                                "delete it to download it again")
        if progress:
            size = dest.stat().st_size
            progress(dest.name, size, size)
        return dest
    record_checksums(folder, {name: download(url, dest, sha256=sha256, progress=progress, **download_options)})
    return dest


# ---------------------------------------------------------------------------------------------
# Project Gutenberg

# "*** START OF THE PROJECT GUTENBERG EBOOK FRANKENSTEIN ***"; older files say "THIS ... EBOOK"
# (sometimes "E-BOOK" or "ETEXT"), with or without spaces after the asterisks.
_GUTENBERG_START = re.compile(r"^\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG E-?(?:BOOK|TEXT)\b.*$", re.I | re.M)
_GUTENBERG_END = re.compile(r"^\*{3}\s*END OF (?:THE|THIS) PROJECT GUTENBERG E-?(?:BOOK|TEXT)\b.*$", re.I | re.M)
# Older files also close the text with "End of the Project Gutenberg EBook of ..." or
# "End of Project Gutenberg's ..." just before the END marker.
_GUTENBERG_OLD_CLOSING = re.compile(r"\n\s*End of (?:the |this )?Project Gutenberg\b[^\n]*\s*\Z", re.I)


def strip_gutenberg(text: str, source: str = "book") -> str:
    """The text of a Project Gutenberg book without its licence header and footer."""
    text = text.lstrip("\ufeff").replace("\r\n", "\n")
    start = _GUTENBERG_START.search(text)
    end = _GUTENBERG_END.search(text, start.end()) if start else None
    if start is None or end is None:
        raise DatasetError(f"{source}: no '*** START/END OF THE PROJECT GUTENBERG EBOOK' markers, "
                           "so this is not a Project Gutenberg text file")
    body = _GUTENBERG_OLD_CLOSING.sub("", text[start.end():end.start()])
    return body.strip()


def gutenberg(out: Path, books: Iterable[int] | None = None, *, base_url: str = GUTENBERG_URL,
              pinned: Mapping[str, str] | None = None, progress: Progress | None = None,
              **download_options) -> Path:
    """Download the books (default GUTENBERG_BOOKS), strip each one's licence text, and join them
    into `out/gutenberg.txt`, books separated by two blank lines. Returns the corpus path.

    `pinned` maps file names such as "raw/pg84.txt" to the SHA-256 they must have.
    """
    pinned = pinned or {}
    bodies = []
    for book_id in books or GUTENBERG_BOOKS:
        name = f"raw/pg{book_id}.txt"
        raw = fetch(f"{base_url.rstrip('/')}/{book_id}/pg{book_id}.txt", out, name, sha256=pinned.get(name),
                    progress=progress, **download_options)
        try:
            bodies.append(strip_gutenberg(raw.read_text(encoding="utf-8"), source=str(raw)))
        except UnicodeDecodeError:
            raise DatasetError(f"{raw}: not UTF-8 text") from None
    corpus = out / "gutenberg.txt"
    atomic_write(corpus, ("\n\n\n".join(bodies) + "\n").encode("utf-8"))
    record_checksums(out, {corpus.name: file_sha256(corpus).hex()})
    return corpus


# ---------------------------------------------------------------------------------------------
# FineWeb-Edu


def fineweb(out: Path, max_bytes: int, *, base_url: str = FINEWEB_URL, shards: Iterable[str] = FINEWEB_SHARDS,
            pinned: Mapping[str, str] | None = None, progress: Progress | None = None,
            **download_options) -> Path:
    """Write the first documents of FineWeb-Edu, at most `max_bytes` of UTF-8 in whole documents,
    to `out/fineweb.txt`, each followed by a `</s>` line. Shards are downloaded only as far as
    needed and kept in `out/raw/` for the next, larger slice. Returns the corpus path."""
    parquet = _import_parquet()
    if max_bytes < 1:
        raise DatasetError(f"max_bytes must be positive, got {max_bytes}")
    pinned = pinned or {}

    def documents() -> Iterable[str]:
        for shard in shards:  # lazily: a shard is downloaded only once the previous ones ran out
            name = f"raw/{shard}"
            path = fetch(f"{base_url.rstrip('/')}/{shard}", out, name, sha256=pinned.get(name),
                         progress=progress, **download_options)
            yield from _parquet_texts(parquet, path)

    corpus = out / "fineweb.txt"
    written = 0
    with atomic_writer(corpus) as f:
        for document in documents():
            record = f"{document}\n{DOC_SEPARATOR}\n".encode("utf-8")
            if written + len(record) > max_bytes:
                break
            f.write(record)
            written += len(record)
            if progress:
                progress(corpus.name, written, max_bytes)
        if written == 0:
            raise DatasetError(f"max_bytes {max_bytes} is smaller than the first document; nothing was written")
    record_checksums(out, {corpus.name: file_sha256(corpus).hex()})
    return corpus


def _import_parquet():
    try:
        import pyarrow.parquet
    except ImportError:
        raise DatasetError("reading FineWeb's parquet files needs pyarrow: pip install 'nanoeuler[data]'") from None
    return pyarrow.parquet


def _parquet_texts(parquet, path: Path) -> Iterable[str]:
    """The non-empty values of the `text` column, in file order, one row group at a time."""
    import pyarrow

    try:
        table = parquet.ParquetFile(path)
        if "text" not in table.schema_arrow.names:
            raise DatasetError(f"{path}: no 'text' column (columns: {', '.join(table.schema_arrow.names)})")
        for batch in table.iter_batches(columns=["text"], batch_size=1024):
            yield from (text for text in batch.column(0).to_pylist() if text)
    except pyarrow.ArrowException as e:
        raise DatasetError(f"{path}: not a readable parquet file ({e}); delete it to download it again") from None


# ---------------------------------------------------------------------------------------------
# Alpaca


def alpaca(out: Path, *, url: str = ALPACA_URL, pinned_sha256: str | None = None,
           progress: Progress | None = None, **download_options) -> Path:
    """Download the Alpaca instruction set (a JSON list) beside `out`, validate every example and
    write it to `out` as JSONL: one {"instruction", "input", "output"} object a line."""
    folder = out.parent
    raw = fetch(url, folder, "alpaca_data.json", sha256=pinned_sha256, progress=progress, **download_options)
    examples = parse_alpaca(raw.read_bytes(), source=str(raw))
    lines = "".join(json.dumps(example, ensure_ascii=False) + "\n" for example in examples)
    atomic_write(out, lines.encode("utf-8"))
    record_checksums(folder, {out.name: file_sha256(out).hex()})
    return out


def parse_alpaca(data: bytes, source: str = "alpaca") -> list[dict[str, str]]:
    """The examples of an Alpaca JSON list; `input` may be empty or absent, the others must be text."""
    try:
        items = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetError(f"{source}: not valid JSON ({e})") from None
    if not isinstance(items, list):
        raise DatasetError(f"{source}: expected a JSON list of examples, got {type(items).__name__}")

    examples = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise DatasetError(f"{source}: example {i} is a {type(item).__name__}, not an object")
        try:
            examples.append(text_fields(item, f"{source}: example {i}", ("instruction", "output"), ("input",)))
        except ValueError as e:
            raise DatasetError(str(e)) from None
    return examples


# ---------------------------------------------------------------------------------------------
# HellaSwag


def hellaswag(out: Path, *, url: str = HELLASWAG_URL, sha256: str | None = HELLASWAG_SHA256,
              progress: Progress | None = None, **download_options) -> Path:
    """Download the HellaSwag validation set (JSONL, 10,042 items) to `out`, checked against its
    pinned SHA-256 and recorded in the folder's manifest."""
    return fetch(url, out.parent, out.name, sha256=sha256, progress=progress, **download_options)
