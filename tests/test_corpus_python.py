"""`nanoeuler-run data python-sources`: the Python corpus built from folders of text files (small ones, in tmp)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from nanoeuler_core.cli.data import app
from nanoeuler_core.corpus import downloads, python_sources
from nanoeuler_core.corpus import tokens as data
from test_data import ByteTokenizer


def write_files(root: Path, files: dict[str, bytes]) -> None:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)


def corpus_documents(corpus: Path) -> list[bytes]:
    """The documents of a corpus, each with its final newline; every one is followed by a `</s>` line."""
    text = corpus.read_bytes()
    assert text.endswith(b"\n</s>\n")
    return [part + b"\n" for part in text.split(b"\n</s>\n")[:-1]]


def as_document(content: bytes) -> bytes:
    return content if content.endswith(b"\n") else content + b"\n"


# Good documents under two roots: (root index, path relative to it) -> content
GOOD = {
    (0, "json/__init__.py"): b'"""JSON encoder and decoder."""\nfrom .decoder import JSONDecoder\n',
    (0, "json/decoder.py"): b"class JSONDecoder:\n    pass\n",
    (0, "abc.py"): b"from _abc import get_cache_token\n",
    (0, "README.txt"): b"This folder holds the standard library.",  # no final newline
    (0, "encodings/idna.py"): "# Punycode, \u00e9l\u00e8ve\n".encode(),
    (0, "html/tags.md"): b"Inline a </s> b is text, not a separator line\n",
    (1, "numpy/core/include/ufunc.h"): b"#define NPY_UFUNC 1\r\n",
    (1, "numpy/linalg/lapack.c"): b"int lapack(void) { return 0; }\n",
    (1, "numpy/doc/index.rst"): b"NumPy\n=====\n",
    (1, "pkg/kernel.cu"): b"__global__ void k() {}\n",
    (1, "pkg/kernel.cuh"): b"#pragma once\n",
    (1, "pkg/ext.pyx"): b"cdef int x = 1\n",
    (1, "pkg/ext.pxd"): b"cdef int x\n",
    (1, "pkg/stubs.pyi"): b"def f() -> int: ...\n",
    (1, "pkg/impl.cc"): b"int f() { return 1; }\n",
    (1, "pkg/impl.cpp"): b"int g() { return 2; }\n",
    (1, "pkg/impl.hpp"): b"int g();\n",
}


@pytest.fixture
def roots(tmp_path) -> list[Path]:
    roots = [tmp_path / "stdlib", tmp_path / "site-packages"]
    for (index, name), content in GOOD.items():
        write_files(roots[index], {name: content})
    return roots


def expected_order() -> list[bytes]:
    """The good documents sorted by (root, relative path), then shuffled with default_rng(0)."""
    ordered = [GOOD[key] for key in sorted(GOOD)]
    return [as_document(ordered[i]) for i in np.random.default_rng(0).permutation(len(ordered))]


def test_documents_in_fixed_order_and_built_the_same_twice(roots, tmp_path):
    first = python_sources.build(tmp_path / "a", 10**6, roots)
    assert corpus_documents(first.corpus) == expected_order()
    assert first.documents == len(GOOD) and first.bytes == first.corpus.stat().st_size
    assert first.sha256 == hashlib.sha256(first.corpus.read_bytes()).hexdigest()

    # the same files written in another order into other folders, built by two threads: the same bytes
    other = [tmp_path / "x" / "stdlib", tmp_path / "x" / "site-packages"]
    for (index, name), content in reversed(GOOD.items()):
        write_files(other[index], {name: content})
    second = python_sources.build(tmp_path / "b", 10**6, other, workers=2)
    assert second.corpus.read_bytes() == first.corpus.read_bytes()
    assert second.sha256 == first.sha256

    again = python_sources.build(tmp_path / "a", 10**6, roots)
    assert again.sha256 == first.sha256
    assert downloads.read_manifest(tmp_path / "a") == {"python.txt": first.sha256}


def test_skipped_files_are_counted_by_reason(roots, tmp_path):
    stdlib, site = roots
    write_files(stdlib, {
        "json/copy_of_decoder.py": GOOD[(0, "json/decoder.py")],  # the same bytes: dropped, the first kept
        "latin1.py": "caf\xe9 = 1\n".encode("latin-1"),
        "table.h": b"1,\n" * 400_000,  # 1.2 MB
        "empty.py": b"",
        "blank.txt": b" \n\t\n",
        "sep_lf.txt": b"one\n</s>\ntwo\n",
        "sep_crlf.txt": b"one\r\n</s>\r\ntwo\r\n",
        "sep_cr.txt": b"one\r</s>\rtwo\r",
        "sep_first.md": b"</s>\nafter\n",
        "sep_last.md": b"before\n</s>",
        "__pycache__/cached.py": b"x = 1\n",
        ".git/HEAD.txt": b"ref: refs/heads/main\n",
        "data.json": b"{}\n",  # not a text extension
        "Makefile": b"all:\n",
    })
    outside = tmp_path / "outside.py"
    outside.write_bytes(b"import os\n")
    os.symlink(outside, stdlib / "link_outside.py")
    os.symlink(stdlib / "abc.py", site / "link_inside.py")  # inside the roots: read, and a copy of abc.py
    os.symlink(site / "missing.py", site / "dangling.py")
    os.symlink(tmp_path, site / "folder_link")  # folder links are not followed

    built = python_sources.build(tmp_path / "out", 10**7, roots)
    manifest = json.loads(built.manifest.read_text())
    assert manifest["skipped"] == {"symlink_outside_roots": 1, "too_large": 1, "unreadable": 1, "not_utf8": 1,
                                   "empty": 2, "separator_line": 5, "duplicate": 2}
    assert sorted(corpus_documents(built.corpus)) == sorted(as_document(c) for c in GOOD.values())
    assert manifest["documents"] == len(GOOD) and manifest["documents_left_out"] == 0


def test_max_bytes_takes_whole_documents_in_shuffled_order(roots, tmp_path):
    order = expected_order()
    record_sizes = [len(document) + len(b"</s>\n") for document in order]
    fits = sum(record_sizes[:3])
    built = python_sources.build(tmp_path / "out", fits + record_sizes[3] - 1, roots)
    assert corpus_documents(built.corpus) == order[:3]
    assert built.bytes == fits == built.corpus.stat().st_size
    assert json.loads(built.manifest.read_text())["documents_left_out"] == len(GOOD) - 3

    with pytest.raises(downloads.DatasetError, match="smaller than the first document"):
        python_sources.build(tmp_path / "tiny", record_sizes[0] - 1, roots)


def test_manifest_says_what_the_corpus_was_built_from(roots, tmp_path):
    built = python_sources.build(tmp_path / "out", 10**6, roots)
    manifest = json.loads(built.manifest.read_text())
    assert manifest["sha256"] == built.sha256 and manifest["bytes"] == built.bytes
    assert manifest["corpus"] == "python.txt" and manifest["documents"] == len(GOOD)
    assert manifest["roots"] == [str(root.resolve()) for root in roots]
    assert manifest["extensions"] == list(python_sources.TEXT_EXTENSIONS)
    assert manifest["max_bytes"] == 10**6 and manifest["shuffle_seed"] == 0 and manifest["separator"] == "</s>"
    assert manifest["python"].count(".") == 2
    assert manifest["distributions"]["numpy"] == np.__version__
    assert list(manifest["distributions"]) == sorted(manifest["distributions"], key=str.lower)


def test_nested_roots_and_the_output_folder_are_read_once(roots, tmp_path):
    stdlib, site = roots
    nested = stdlib / "site-packages"  # where a Python built into one prefix keeps its packages
    write_files(nested, {"pkg/mod.py": b"VALUE = 42\n"})
    built = python_sources.build(stdlib / "corpus", 10**6, [stdlib, nested])
    documents = corpus_documents(built.corpus)
    assert documents.count(b"VALUE = 42\n") == 1
    json_manifest = json.loads(built.manifest.read_text())
    assert json_manifest["skipped"]["duplicate"] == 0

    rebuilt = python_sources.build(stdlib / "corpus", 10**6, [stdlib, nested])  # its own output is not read
    assert rebuilt.sha256 == built.sha256


def test_default_roots_are_this_pythons_folders():
    import sysconfig

    roots = python_sources.default_roots()
    expected = [Path(os.path.realpath(sysconfig.get_path(name))) for name in ("stdlib", "purelib", "platlib")]
    assert roots == list(dict.fromkeys(expected))


def test_corpus_loads_with_one_eos_per_document_and_splits_between_documents(roots, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    built = python_sources.build(tmp_path / "out", 10**6, roots)
    tok = ByteTokenizer()
    splits = data.load_tokens(built.corpus, tok, val_fraction=0.3)
    ids = np.concatenate([splits.train, splits.val])
    assert (ids == tok.eos_id).sum() == len(GOOD)
    assert splits.train[-1] == tok.eos_id and splits.val[-1] == tok.eos_id

    def documents(ids):  # the corpus has no NUL byte: an eos becomes one to split on
        return bytes(np.where(ids == tok.eos_id, 0, ids)[:-1].astype(np.uint8)).split(b"\0")

    train, held_out = documents(splits.train), documents(splits.val)
    assert set(train).isdisjoint(held_out) and len(train) + len(held_out) == len(GOOD)


def test_cli_builds_the_corpus_and_names_the_next_command(roots, tmp_path):
    out = tmp_path / "out"
    args = ["python-sources", "--out", str(out), "--max-bytes", "1M"]
    result = CliRunner().invoke(app, args + [arg for root in roots for arg in ("--roots", str(root))])
    assert result.exit_code == 0, result.output
    line = result.stdout.strip()
    sha256 = downloads.read_manifest(out)["python.txt"]
    assert "\n" not in line and f"{len(GOOD)} documents" in line and sha256[:12] in line
    assert (f"nanoeuler-run tokenizer train {out / 'python.txt'} --vocab-size 4096 --sample-bytes 50000000 "
            f"--out {out / 'tokenizer.json'}") in line


def test_cli_errors_are_one_line(roots, tmp_path):
    runner = CliRunner()
    missing = runner.invoke(app, ["python-sources", "--out", str(tmp_path / "out"), "--roots", str(roots[0]),
                                  "--roots", str(tmp_path / "no-such-folder")])
    assert missing.exit_code == 1 and "Traceback" not in missing.output
    assert missing.stderr.strip().splitlines() == [f"error: root {tmp_path / 'no-such-folder'} is not a folder"]
    assert not (tmp_path / "out").exists()

    (tmp_path / "bare").mkdir()
    nothing = runner.invoke(app, ["python-sources", "--out", str(tmp_path / "out"), "--roots", str(tmp_path / "bare")])
    assert nothing.exit_code == 1 and nothing.stderr.strip().splitlines()[-1].startswith("error: no text files")

    assert runner.invoke(app, ["python-sources", "--max-bytes", "lots", "--roots", str(roots[0])]).exit_code == 2
