"""Corpus token cache, batch loader, and the dataset downloads (offline: a local HTTP server serves fixtures)."""

from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from nanoeuler_core.corpus import downloads as datasets
from nanoeuler_core.corpus import tokens as data
from nanoeuler_core.cli.data import app

FIXTURES = Path(__file__).parent / "fixtures"


class ByteTokenizer:
    """Bytes as ids 0-255 and `</s>` as 256: the interface load_tokens needs, nothing more."""

    vocab_size = 257
    eos_id = 256

    def __init__(self, hash: str = "0123456789abcdef" * 4):
        self.hash = hash
        self.encoded_texts: list[str] = []

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        self.encoded_texts += texts
        return [list(text.encode("utf-8")) for text in texts]


@pytest.fixture
def corpus(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    path = tmp_path / "corpus" / "text.txt"
    path.parent.mkdir()
    path.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 20)
    return path


def all_ids(splits: data.TokenSplits) -> np.ndarray:
    return np.concatenate([splits.train, splits.val])


# ---------------------------------------------------------------------------------------------
# Token cache


def test_ids_are_cached_next_to_the_corpus_and_reused(corpus):
    tok = ByteTokenizer()
    splits = data.load_tokens(corpus, tok, val_fraction=0.1)
    expected = np.frombuffer(corpus.read_bytes(), dtype=np.uint8)
    assert splits.train.dtype == np.uint16 and splits.val.dtype == np.uint16
    np.testing.assert_array_equal(all_ids(splits), expected)
    assert len(splits.val) == round(0.1 * len(expected))
    assert splits.cache == corpus.with_name(f"text.txt.{tok.hash[:12]}.tokens")
    assert splits.cache.exists()

    tok.encoded_texts.clear()
    again = data.load_tokens(corpus, tok, val_fraction=0.1)
    assert tok.encoded_texts == []  # served from the cache
    np.testing.assert_array_equal(all_ids(again), expected)


def test_cache_rebuilt_when_the_corpus_changes(corpus):
    tok = ByteTokenizer()
    data.load_tokens(corpus, tok)
    text = corpus.read_text()
    corpus.write_text(text.replace("speak.", "SPEAK.", 1))  # same size: only the content digest differs
    tok.encoded_texts.clear()
    splits = data.load_tokens(corpus, tok)
    assert tok.encoded_texts
    np.testing.assert_array_equal(all_ids(splits), np.frombuffer(corpus.read_bytes(), dtype=np.uint8))


def test_cache_rebuilt_when_the_tokenizer_hash_changes(corpus):
    first = ByteTokenizer(hash="abcdef012345" + "0" * 52)
    same_prefix = ByteTokenizer(hash="abcdef012345" + "1" * 52)  # same file name, different full hash
    cache = data.load_tokens(corpus, first).cache
    assert data.load_tokens(corpus, same_prefix).cache == cache
    assert same_prefix.encoded_texts
    first.encoded_texts.clear()
    data.load_tokens(corpus, first)
    assert first.encoded_texts  # the cache now belongs to the other tokenizer

    other = ByteTokenizer(hash="fedcba987654" + "0" * 52)
    assert data.load_tokens(corpus, other).cache != cache


@pytest.mark.parametrize("damage", ["flip a token", "truncate", "append", "garbage"])
def test_corrupt_cache_is_rebuilt(corpus, damage):
    tok = ByteTokenizer()
    cache = data.load_tokens(corpus, tok).cache
    raw = bytearray(cache.read_bytes())
    if damage == "flip a token":
        raw[-3] ^= 0x01
    elif damage == "truncate":
        del raw[-10:]
    elif damage == "append":
        raw += b"\0\0"
    else:
        raw = bytearray(b"not a token cache")
    cache.write_bytes(raw)
    tok.encoded_texts.clear()
    splits = data.load_tokens(corpus, tok)
    assert tok.encoded_texts
    np.testing.assert_array_equal(all_ids(splits), np.frombuffer(corpus.read_bytes(), dtype=np.uint8))
    assert data.load_tokens(corpus, tok).cache == cache  # rewritten intact


def test_read_only_corpus_folder_caches_in_the_user_cache(corpus, monkeypatch, tmp_path):
    real_write = data.atomic_write

    def write_unless_corpus_folder(path, payload):
        if path.parent == corpus.parent.resolve():
            raise PermissionError(13, "Permission denied")
        real_write(path, payload)

    monkeypatch.setattr(data, "atomic_write", write_unless_corpus_folder)
    tok = ByteTokenizer()
    cache = data.load_tokens(corpus, tok).cache
    assert cache.parent == tmp_path / "user-cache" / "nanoeuler"
    tok.encoded_texts.clear()
    assert data.load_tokens(corpus, tok).cache == cache
    assert tok.encoded_texts == []


def test_document_separator_lines_become_eos(corpus):
    corpus.write_text("one\n</s>\ntwo\r\n</s>\r\nthree")
    ids = all_ids(data.load_tokens(corpus, ByteTokenizer(), val_fraction=0.0))
    expected = list(b"one\n") + [256] + list(b"two\r\n") + [256] + list(b"three")
    assert ids.tolist() == expected


def test_held_out_split_starts_after_a_document_end(corpus):
    documents = [f"document {i}: " + "words " * (3 + i % 7) + "\n" for i in range(40)]
    corpus.write_text("".join(f"{document}</s>\n" for document in documents))
    tok = ByteTokenizer()
    splits = data.load_tokens(corpus, tok, val_fraction=0.2)
    ids = all_ids(splits)
    nominal = len(ids) - round(0.2 * len(ids))
    ends = np.flatnonzero(ids == tok.eos_id)
    assert ids[nominal - 1] != tok.eos_id  # the nominal cut falls inside a document here
    assert len(splits.train) == ends[ends >= nominal][0] + 1  # just after the first end at or after it
    assert splits.train[-1] == tok.eos_id and splits.val[0] != tok.eos_id

    def texts(ids):
        return set(bytes(ids[ids != tok.eos_id].tolist()).decode().splitlines(keepends=True))

    assert texts(splits.train) | texts(splits.val) == set(documents)
    assert texts(splits.train).isdisjoint(texts(splits.val))


@pytest.mark.parametrize("text, val_ids", [
    ("abcdefgh" * 5, 8),                    # no separator: the cut as it was
    ("abcdefgh" * 4 + "abcdefg\n</s>\n", 8),  # the only end is the last id: nothing would be held out
    ("x" * 31 + "\n</s>\n" + "y" * 7 + "\n", 8),  # an end just before the cut already marks a boundary
])
def test_held_out_split_stays_where_no_document_ends_in_it(corpus, text, val_ids):
    corpus.write_text(text)
    splits = data.load_tokens(corpus, ByteTokenizer(), val_fraction=0.2)
    assert len(splits.train) + len(splits.val) == len(text) - 4 * text.count("</s>\n")
    assert len(splits.val) == val_ids


def test_corpus_is_encoded_in_chunks_cut_at_line_ends(corpus, monkeypatch):
    monkeypatch.setattr(data, "CHUNK_CHARS", 50)
    monkeypatch.setattr(data, "CHUNKS_PER_CORE", 1)
    monkeypatch.setattr(data, "available_cores", lambda: 3)   # batches of 3 chunks
    tok = ByteTokenizer()
    splits = data.load_tokens(corpus, tok)
    assert len(tok.encoded_texts) > 3
    assert all(text.endswith("\n") for text in tok.encoded_texts)
    assert "".join(tok.encoded_texts) == corpus.read_text()
    np.testing.assert_array_equal(all_ids(splits), np.frombuffer(corpus.read_bytes(), dtype=np.uint8))


def test_bad_inputs(corpus, tmp_path):
    huge = ByteTokenizer()
    huge.vocab_size = 70_000
    with pytest.raises(ValueError, match="uint16"):
        data.load_tokens(corpus, huge)
    with pytest.raises(ValueError, match="cannot read corpus"):
        data.load_tokens(tmp_path / "missing.txt", ByteTokenizer())
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        data.load_tokens(tmp_path / "latin1.txt", ByteTokenizer())


def test_corpus_shorter_than_a_context_window(corpus):
    corpus.write_text("too short\n" * 30)  # 300 tokens: 270 train, 30 validation
    splits = data.load_tokens(corpus, ByteTokenizer(), val_fraction=0.1)
    data.check_length(splits, ctx_len=16)
    with pytest.raises(ValueError, match=r"30 validation tokens, fewer than one context window of 32"):
        data.check_length(splits, ctx_len=32)
    with pytest.raises(ValueError, match=r"270 training tokens, fewer than one context window of 512"):
        data.check_length(splits, ctx_len=512)


def test_default_corpus_is_the_bundled_shakespeare():
    path = data.default_corpus()
    assert path.name == "tinyshakespeare.txt"
    assert path.read_text(encoding="utf-8").startswith("First Citizen:")


# ---------------------------------------------------------------------------------------------
# Batch loader


def test_batch_loader_windows_and_targets():
    tokens = np.arange(1000, dtype=np.uint16)
    inputs, targets = data.BatchLoader(tokens, batch_size=4, ctx_len=16, seed=0).batch(0)
    assert inputs.shape == targets.shape == (4, 16)
    assert inputs.dtype == targets.dtype == np.int64
    for row_in, row_target in zip(inputs, targets):
        np.testing.assert_array_equal(row_in, np.arange(row_in[0], row_in[0] + 16))  # contiguous windows
        np.testing.assert_array_equal(row_target, row_in + 1)  # targets are the next tokens


def test_batch_loader_is_deterministic_per_seed_and_step():
    tokens = np.random.default_rng(1).integers(0, 512, size=5000).astype(np.uint16)
    loader = data.BatchLoader(tokens, batch_size=8, ctx_len=32, seed=7)
    later = [loader.batch(step)[0] for step in range(5)]
    resumed = data.BatchLoader(tokens, batch_size=8, ctx_len=32, seed=7)  # a fresh loader, as after --resume
    np.testing.assert_array_equal(resumed.batch(3)[0], later[3])
    assert not np.array_equal(later[0], later[1])
    assert not np.array_equal(data.BatchLoader(tokens, 8, 32, seed=8).batch(0)[0], later[0])


def test_batch_loader_reaches_the_last_token_and_rejects_short_arrays():
    tokens = np.arange(18, dtype=np.uint16)  # only two possible windows of 16 + 1
    inputs, targets = data.BatchLoader(tokens, batch_size=64, ctx_len=16, seed=0).batch(0)
    assert set(inputs[:, 0].tolist()) == {0, 1}
    assert targets.max() == 17
    with pytest.raises(ValueError, match="fewer than one context window"):
        data.BatchLoader(tokens, batch_size=1, ctx_len=18, seed=0)


# ---------------------------------------------------------------------------------------------
# Downloads


class FixtureServer:
    """Serves `files` (URL path -> bytes) on 127.0.0.1 with Range support.

    A path in `cut_once` gets, on its next request, half of the body its headers promise and
    then a closed connection, like a dropped download.
    """

    def __init__(self, files: dict[str, bytes]):
        self.files = files
        self.requests: list[tuple[str, str | None]] = []
        self.cut_once: set[str] = set()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                requested_range = self.headers.get("Range")
                server.requests.append((self.path, requested_range))
                body = server.files.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                start = int(re.fullmatch(r"bytes=(\d+)-", requested_range)[1]) if requested_range else 0
                if start >= len(body) and requested_range:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(body)}")
                    self.end_headers()
                    return
                self.send_response(206 if requested_range else 200)
                if requested_range:
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                payload = body[start:]
                if self.path in server.cut_once:
                    server.cut_once.discard(self.path)
                    payload = payload[: len(payload) // 2]
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        return Handler

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    files = {f"/{n}/pg{n}.txt": (FIXTURES / "gutenberg" / f"pg{n}.txt").read_bytes() for n in (84, 11)}
    files["/big.bin"] = np.random.default_rng(0).integers(0, 256, size=300_000, dtype=np.uint8).tobytes()
    files["/alpaca_data.json"] = (FIXTURES / "alpaca_data.json").read_bytes()
    running = FixtureServer(files)
    yield running
    running.close()


def sha256_hex(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def test_download_reports_progress_and_returns_the_digest(server, tmp_path):
    reports = []
    digest = datasets.download(f"{server.url}/big.bin", tmp_path / "big.bin",
                               progress=lambda name, done, total: reports.append((name, done, total)))
    body = server.files["/big.bin"]
    assert (tmp_path / "big.bin").read_bytes() == body
    assert digest == sha256_hex(body)
    assert reports[0] == ("big.bin", 0, len(body)) and reports[-1] == ("big.bin", len(body), len(body))
    assert [done for _, done, _ in reports] == sorted(done for _, done, _ in reports)


def test_dropped_download_resumes_from_the_part_file(server, tmp_path):
    body, dest = server.files["/big.bin"], tmp_path / "big.bin"
    server.cut_once.add("/big.bin")
    with pytest.raises(datasets.DownloadError, match="150000 of 300000 bytes.*run again to resume"):
        datasets.download(f"{server.url}/big.bin", dest, attempts=1)
    part = tmp_path / "big.bin.part"
    assert part.stat().st_size == len(body) // 2 and not dest.exists()

    datasets.download(f"{server.url}/big.bin", dest, sha256=sha256_hex(body))
    assert server.requests[-1] == ("/big.bin", f"bytes={len(body) // 2}-")  # only the missing half
    assert dest.read_bytes() == body and not part.exists()


def test_dropped_download_is_retried_within_one_call(server, tmp_path):
    server.cut_once.add("/big.bin")
    datasets.download(f"{server.url}/big.bin", tmp_path / "big.bin", attempts=2, retry_delay=0)
    assert [r for _, r in server.requests] == [None, "bytes=150000-"]
    assert (tmp_path / "big.bin").read_bytes() == server.files["/big.bin"]


def test_complete_part_file_is_finished_without_a_transfer(server, tmp_path):
    body = server.files["/big.bin"]
    (tmp_path / "big.bin.part").write_bytes(body)
    datasets.download(f"{server.url}/big.bin", tmp_path / "big.bin")  # the server answers 416
    assert (tmp_path / "big.bin").read_bytes() == body


def test_server_without_range_support_restarts_the_part(tmp_path):
    source = tmp_path / "source.bin"
    source.write_bytes(b"the whole file")
    (tmp_path / "copy.bin.part").write_bytes(b"stale bytes")  # file:// ignores Range, like a plain server
    datasets.download(source.as_uri(), tmp_path / "copy.bin")
    assert (tmp_path / "copy.bin").read_bytes() == b"the whole file"


def test_pinned_checksum_mismatch_deletes_the_download(server, tmp_path):
    with pytest.raises(datasets.ChecksumError, match="does not match the pinned"):
        datasets.download(f"{server.url}/big.bin", tmp_path / "big.bin", sha256="0" * 64)
    assert list(tmp_path.iterdir()) == []


def test_unreachable_server(tmp_path):
    with pytest.raises(datasets.DownloadError, match="127.0.0.1:9/x.bin: .*refused"):
        datasets.download("http://127.0.0.1:9/x.bin", tmp_path / "x.bin", attempts=1)


def test_http_errors_are_not_retried(server, tmp_path):
    with pytest.raises(datasets.DownloadError, match="HTTP 404"):
        datasets.download(f"{server.url}/missing.txt", tmp_path / "x.txt", attempts=3, retry_delay=10)
    assert len(server.requests) == 1


# ---------------------------------------------------------------------------------------------
# Project Gutenberg


def test_strip_gutenberg_current_format():
    text = datasets.strip_gutenberg((FIXTURES / "gutenberg" / "pg84.txt").read_text(encoding="utf-8"))
    assert text.startswith("Frankenstein;\n\nor, the Modern Prometheus")
    assert text.endswith("success\nof my undertaking.")
    assert "Gutenberg" not in text and "\r" not in text and "\ufeff" not in text


def test_strip_gutenberg_older_format():
    text = datasets.strip_gutenberg((FIXTURES / "gutenberg" / "pg11.txt").read_text(encoding="utf-8"))
    assert text.startswith("ALICE'S ADVENTURES IN WONDERLAND")
    assert text.endswith("'without pictures or\nconversations?'")
    assert "Gutenberg" not in text


def test_strip_gutenberg_rejects_other_text():
    with pytest.raises(datasets.DatasetError, match="not a Project Gutenberg text"):
        datasets.strip_gutenberg("Just some text.\n*** END OF THE PROJECT GUTENBERG EBOOK X ***\n")


def test_gutenberg_corpus_and_manifest(server, tmp_path):
    out = tmp_path / "gutenberg"
    corpus = datasets.gutenberg(out, [84, 11], base_url=server.url)
    books = [datasets.strip_gutenberg((FIXTURES / "gutenberg" / f"pg{n}.txt").read_text(encoding="utf-8"))
             for n in (84, 11)]
    assert corpus.read_text(encoding="utf-8") == books[0] + "\n\n\n" + books[1] + "\n"
    manifest = datasets.read_manifest(out)
    assert manifest == {name: sha256_hex((out / name).read_bytes())
                        for name in ("raw/pg84.txt", "raw/pg11.txt", "gutenberg.txt")}

    requests = len(server.requests)
    datasets.gutenberg(out, [84, 11], base_url=server.url)
    assert len(server.requests) == requests  # verified copies reused, nothing downloaded

    (out / "raw" / "pg11.txt").write_text("tampered")
    with pytest.raises(datasets.ChecksumError, match="changed since it was downloaded"):
        datasets.gutenberg(out, [84, 11], base_url=server.url)


# ---------------------------------------------------------------------------------------------
# FineWeb-Edu


def write_shard(path: Path, texts: list[str | None], row_group_size: int = 2) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"text": texts, "url": [f"https://example.org/{i}" for i in range(len(texts))]})
    pq.write_table(table, path, row_group_size=row_group_size)


@pytest.fixture
def fineweb_shards(server, tmp_path):
    pytest.importorskip("pyarrow")
    documents = [f"Document {i}: photosynthesis turns light into chemical energy.\n\nSecond paragraph." for i in range(10)]
    for name, texts in (("000_00000.parquet", documents[:5] + [None, ""]), ("001_00000.parquet", documents[5:])):
        write_shard(tmp_path / name, texts)
        server.files[f"/{name}"] = (tmp_path / name).read_bytes()
    return documents


def record(document: str) -> str:
    return f"{document}\n</s>\n"


def test_fineweb_slice_spans_shards_and_keeps_whole_documents(server, tmp_path, fineweb_shards):
    budget = len("".join(record(d) for d in fineweb_shards[:7]).encode()) + 10
    corpus = datasets.fineweb(tmp_path / "fw", budget, base_url=server.url,
                              shards=["000_00000.parquet", "001_00000.parquet"])
    assert corpus.read_text(encoding="utf-8") == "".join(record(d) for d in fineweb_shards[:7])

    splits = data.load_tokens(corpus, ByteTokenizer(), val_fraction=0.0)
    assert int(np.sum(splits.train == ByteTokenizer.eos_id)) == 7


def test_fineweb_downloads_only_the_shards_it_needs(server, tmp_path, fineweb_shards):
    budget = len(record(fineweb_shards[0]).encode()) * 2
    corpus = datasets.fineweb(tmp_path / "fw", budget, base_url=server.url,
                              shards=["000_00000.parquet", "001_00000.parquet"])
    assert corpus.read_text(encoding="utf-8") == record(fineweb_shards[0]) + record(fineweb_shards[1])
    assert [path for path, _ in server.requests] == ["/000_00000.parquet"]
    assert set(datasets.read_manifest(tmp_path / "fw")) == {"raw/000_00000.parquet", "fineweb.txt"}


def test_fineweb_rejects_a_shard_without_text(server, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "bad.parquet")
    server.files["/000_00000.parquet"] = (tmp_path / "bad.parquet").read_bytes()
    with pytest.raises(datasets.DatasetError, match="no 'text' column"):
        datasets.fineweb(tmp_path / "fw", 1000, base_url=server.url)
    assert not (tmp_path / "fw" / "fineweb.txt").exists()


def test_fineweb_without_pyarrow_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(datasets.DatasetError, match=r"pip install 'nanoeuler\[data\]'"):
        datasets.fineweb(tmp_path, 1000, base_url="http://127.0.0.1:9")


# ---------------------------------------------------------------------------------------------
# Alpaca


def test_alpaca_json_becomes_jsonl(server, tmp_path):
    out = datasets.alpaca(tmp_path / "alpaca.jsonl", url=f"{server.url}/alpaca_data.json")
    examples = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert examples == json.loads((FIXTURES / "alpaca_data.json").read_text(encoding="utf-8"))
    assert set(datasets.read_manifest(tmp_path)) == {"alpaca_data.json", "alpaca.jsonl"}


@pytest.mark.parametrize("payload, message", [
    (b"{not json", "not valid JSON"),
    (b'{"instruction": "x"}', "expected a JSON list"),
    (b'[{"instruction": "Add 2 and 3.", "input": ""}]', "example 0: missing field 'output'"),
    (b'[{"instruction": "Add 2 and 3.", "output": 5}]', "example 0: field 'output' must be a string"),
    (b'[{"instruction": "Add.", "output": "5"}, {"instruction": " ", "output": "5"}]', "example 1: field 'instruction' is empty"),
])
def test_alpaca_validation(payload, message):
    with pytest.raises(datasets.DatasetError, match=re.escape(message)):
        datasets.parse_alpaca(payload)


def test_alpaca_input_is_optional():
    assert datasets.parse_alpaca(b'[{"instruction": "Add 2 and 3.", "output": "5"}]') == [
        {"instruction": "Add 2 and 3.", "input": "", "output": "5"}]


# ---------------------------------------------------------------------------------------------
# CLI


def test_cli_gutenberg(server, tmp_path):
    result = CliRunner().invoke(app, ["gutenberg", "--out", str(tmp_path), "--books", "84,11", "--base-url", server.url])
    assert result.exit_code == 0, result.output
    corpus = tmp_path / "gutenberg.txt"
    assert f"nanoeuler-run pretrain --corpus {corpus}" in result.stdout
    assert "2 books" in result.stdout and corpus.exists()


def test_cli_fineweb_and_alpaca(server, tmp_path, fineweb_shards):
    result = CliRunner().invoke(app, ["fineweb", "--out", str(tmp_path / "fw"), "--max-bytes", "0.2K",
                                      "--base-url", server.url])
    assert result.exit_code == 0, result.output
    corpus = tmp_path / "fw" / "fineweb.txt"
    assert corpus.stat().st_size <= 200 and f"--corpus {corpus}" in result.stdout

    result = CliRunner().invoke(app, ["alpaca", "--out", str(tmp_path / "a.jsonl"), "--url", f"{server.url}/alpaca_data.json"])
    assert result.exit_code == 0, result.output
    assert "3 instruction examples" in result.stdout and "--data" in result.stdout


def one_line_error(result) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    last_line = result.stderr.strip().splitlines()[-1]  # after the progress display
    assert last_line.startswith("error: ")
    return last_line


def test_cli_failures_are_one_line(server, tmp_path):
    runner = CliRunner()
    missing_book = runner.invoke(app, ["gutenberg", "--out", str(tmp_path / "g"), "--books", "999", "--base-url", server.url])
    assert "HTTP 404" in one_line_error(missing_book)

    runner.invoke(app, ["gutenberg", "--out", str(tmp_path / "g"), "--books", "84", "--base-url", server.url])
    (tmp_path / "g" / "raw" / "pg84.txt").write_text("tampered")
    tampered = runner.invoke(app, ["gutenberg", "--out", str(tmp_path / "g"), "--books", "84", "--base-url", server.url])
    assert "changed since it was downloaded" in one_line_error(tampered)

    (tmp_path / "a-file").write_text("")
    unwritable = runner.invoke(app, ["alpaca", "--out", str(tmp_path / "a-file" / "alpaca.jsonl"),
                                     "--url", f"{server.url}/alpaca_data.json"])
    assert "a-file" in one_line_error(unwritable)


def test_cli_rejects_bad_sizes_and_book_ids(tmp_path):
    runner = CliRunner()
    assert runner.invoke(app, ["fineweb", "--out", str(tmp_path), "--max-bytes", "lots"]).exit_code == 2
    assert runner.invoke(app, ["gutenberg", "--out", str(tmp_path), "--books", "84,x"]).exit_code == 2
