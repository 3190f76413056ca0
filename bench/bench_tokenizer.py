"""Tokenizer benchmark: nanoeuler's byte-level BPE against Hugging Face `tokenizers` (and tiktoken's
GPT-2 encoder where installed), on one machine in one run.

    python bench/bench_tokenizer.py                      # 10 MB, 4096 entries
    python bench/bench_tokenizer.py --mb 2 --vocab-size 1024

Measures training a vocabulary on an N MB sample and encoding N MB (the bundled 1.1 MB corpus is
repeated to reach N MB when it is shorter), single-thread and on all cores, then bytes per token
on the bundled corpus at 512 and 4096 entries. Hugging Face's single-thread numbers come from a
child process started with RAYON_NUM_THREADS=1, since its thread pool is sized once per process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nanoeuler_core.text.tokenizer import Tokenizer

CORPUS = Path(__file__).parents[1] / "data" / "tinyshakespeare.txt"
DOCUMENT_CHARS = 10_000


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def bench_text(corpus: str, megabytes: float) -> str:
    """`corpus` repeated (whole lines) until it holds `megabytes` MB of UTF-8."""
    target = int(megabytes * 1e6)
    repeats = -(-target // len(corpus.encode()))
    text = (corpus if corpus.endswith("\n") else corpus + "\n") * repeats
    return text.encode()[:target].decode("utf-8", errors="ignore")


def documents(text: str) -> list[str]:
    """Line-aligned documents of about DOCUMENT_CHARS characters, as a batch encoder sees them."""
    docs, current, size = [], [], 0
    for line in text.splitlines(keepends=True):
        current.append(line)
        size += len(line)
        if size >= DOCUMENT_CHARS:
            docs.append("".join(current))
            current, size = [], 0
    return docs + (["".join(current)] if current else [])


def hf_measure(text_path: str, tokenizer_path: str, vocab_size: int) -> dict:
    """Hugging Face: train a byte-level BPE on the text, and encode it with nanoeuler's tokenizer.json."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    text = Path(text_path).read_text(encoding="utf-8")
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    train_s, _ = timed(lambda: hf.train_from_iterator(text.splitlines(keepends=True), trainer))
    encoder = tokenizers.Tokenizer.from_file(tokenizer_path)
    encode_s, encoded = timed(lambda: encoder.encode_batch(documents(text)))
    return {"train_s": train_s, "encode_s": encode_s, "n_tokens": sum(len(e.ids) for e in encoded)}


def hf_in_child(text_path: str, tokenizer_path: str, vocab_size: int, threads: int | None) -> dict:
    env = dict(os.environ)
    if threads is not None:
        env["RAYON_NUM_THREADS"] = str(threads)
    else:
        env.pop("RAYON_NUM_THREADS", None)
    command = [sys.executable, __file__, "--hf-child", text_path, tokenizer_path, str(vocab_size)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def tiktoken_encode_s(text: str) -> float | None:
    try:
        import tiktoken
    except ImportError:
        return None
    encoder = tiktoken.get_encoding("gpt2")
    docs = documents(text)
    return timed(lambda: encoder.encode_ordinary_batch(docs, num_threads=1))[0]


def bytes_per_token(corpus: str, vocab_size: int) -> float:
    return len(corpus.encode()) / len(Tokenizer.train(corpus, vocab_size).encode(corpus))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=10.0, help="MB of text to train on and to encode")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    args = parser.parse_args()

    corpus = args.corpus.read_text(encoding="utf-8")
    text = bench_text(corpus, args.mb)
    megabytes = len(text.encode()) / 1e6
    repeats = megabytes * 1e6 / len(corpus.encode())
    print(f"text: {megabytes:.1f} MB = {args.corpus.name} ({len(corpus.encode()) / 1e6:.2f} MB) "
          f"repeated {repeats:.1f} times; {os.cpu_count()} cores")

    compile_s, _ = timed(lambda: Tokenizer.train(corpus[:20_000], 300))  # Numba compile or cache load
    train_s, tok = timed(lambda: Tokenizer.train(text, args.vocab_size))
    docs = documents(text)
    fresh = Tokenizer(tok.merges)  # empty pretoken cache, as on a new corpus
    encode_cold_s, ids = timed(lambda: fresh.encode(text))
    encode_warm_s, _ = timed(lambda: fresh.encode(text))
    batch_s, batch_ids = timed(lambda: Tokenizer(tok.merges).encode_batch(docs))

    with tempfile.TemporaryDirectory() as tmp:
        text_path, tokenizer_path = str(Path(tmp) / "text.txt"), str(Path(tmp) / "tokenizer.json")
        Path(text_path).write_text(text, encoding="utf-8")
        tok.save(tokenizer_path)
        hf_one = hf_in_child(text_path, tokenizer_path, args.vocab_size, threads=1)
        hf_all = hf_in_child(text_path, tokenizer_path, args.vocab_size, threads=None)
    assert hf_one["n_tokens"] == sum(map(len, batch_ids)), "Hugging Face and nanoeuler disagree on the ids"
    tiktoken_s = tiktoken_encode_s(text)

    rows = [
        ("train", "nanoeuler", "1 core + Numba", train_s, hf_one["train_s"]),
        ("train", "HF tokenizers", "1 thread", hf_one["train_s"], hf_one["train_s"]),
        ("train", "HF tokenizers", "all cores", hf_all["train_s"], hf_one["train_s"]),
        ("encode", "nanoeuler encode (cold cache)", "1 core", encode_cold_s, hf_one["encode_s"]),
        ("encode", "nanoeuler encode (warm cache)", "1 core", encode_warm_s, hf_one["encode_s"]),
        ("encode", "nanoeuler encode_batch", "all cores", batch_s, hf_one["encode_s"]),
        ("encode", "HF encode_batch", "1 thread", hf_one["encode_s"], hf_one["encode_s"]),
        ("encode", "HF encode_batch", "all cores", hf_all["encode_s"], hf_one["encode_s"]),
    ]
    if tiktoken_s is not None:
        rows.append(("encode", "tiktoken gpt2", "1 thread", tiktoken_s, hf_one["encode_s"]))
    print(f"\n{'task':7} {'implementation':31} {'threads':15} {'seconds':>8} {'MB/s':>7} {'speed vs HF 1 thread':>21}")
    for task, name, threads, seconds, hf_seconds in rows:
        print(f"{task:7} {name:31} {threads:15} {seconds:8.2f} {megabytes / seconds:7.1f} {hf_seconds / seconds:20.2f}x")
    if tiktoken_s is None:
        print("tiktoken: not installed, skipped")
    print(f"nanoeuler first training call in this process (Numba compile or cache load): {compile_s:.2f} s")

    print(f"\nbytes per token on {args.corpus.name}:")
    for vocab_size in (512, 4096):
        print(f"  {vocab_size:5} entries: {bytes_per_token(corpus, vocab_size):.2f}")
    print(f"  {args.vocab_size:5} entries from the {megabytes:.0f} MB text, on it: {len(text.encode()) / len(ids):.2f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--hf-child"]:
        print(json.dumps(hf_measure(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
    else:
        main()
