"""`nanoeuler-run tokenizer ...`: train a byte-level BPE tokenizer, encode and decode with one."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import typer

from nanoeuler_core.text.base_tokenizer import TokenizerError
from nanoeuler_core.text.hf_tokenizer import HFTokenizer
from nanoeuler_core.text.tokenizer import Tokenizer

app = typer.Typer(
    help="Train a byte-level BPE tokenizer (tokenizer.json) and encode or decode text with it.", no_args_is_help=True
)


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(1)


def _load(path: Path) -> Tokenizer | HFTokenizer:
    try:
        return Tokenizer.load(path)
    except TokenizerError as e:
        raise _fail(str(e)) from None


@app.command()
def train(
    corpus: Path = typer.Argument(..., help="UTF-8 text file to learn merges from."),
    vocab_size: int = typer.Option(..., "--vocab-size", help="Total ids: 256 bytes, learned and special tokens."),
    out: Path = typer.Option(Path("tokenizer.json"), "--out", help="Where to write the tokenizer."),
    sample_bytes: int | None = typer.Option(
        None, "--sample-bytes", help="Learn from evenly spaced pieces of the corpus totalling about this many bytes."
    ),
) -> None:
    """Learn a tokenizer from CORPUS and write it as a Hugging Face tokenizer.json."""
    try:
        text = corpus.read_text(encoding="utf-8")
    except OSError as e:
        raise _fail(f"cannot read corpus {corpus}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise _fail(f"corpus {corpus} is not UTF-8 text (byte {e.start}): convert it to UTF-8 first") from None

    with contextlib.ExitStack() as stack:
        bar = None

        def progress(done: int, total: int) -> None:
            nonlocal bar
            if bar is None:  # opened on the first report, so bad arguments fail without a bar
                bar = stack.enter_context(typer.progressbar(length=total, label="training", file=sys.stderr))
            bar.update(done - bar.pos)

        try:
            tokenizer = Tokenizer.train(text, vocab_size, sample_bytes=sample_bytes, progress=progress)
        except TokenizerError as e:
            raise _fail(str(e)) from None
    try:
        tokenizer.save(out)
    except OSError as e:
        raise _fail(f"cannot write {out}: {e.strerror or e}") from None
    head = text[: 1 << 20]
    bytes_per_token = len(head.encode()) / len(tokenizer.encode(head))
    typer.echo(f"wrote {out}: {tokenizer.vocab_size} tokens, {bytes_per_token:.2f} bytes per token on the corpus")


@app.command()
def encode(
    tokenizer: Path = typer.Argument(..., help="tokenizer.json"),
    text: str = typer.Argument(..., help="Text to encode; special tokens such as </s> are recognised."),
) -> None:
    """Print the token ids of TEXT, space-separated."""
    typer.echo(" ".join(map(str, _load(tokenizer).encode(text, allowed_special="all"))))


@app.command()
def decode(
    tokenizer: Path = typer.Argument(..., help="tokenizer.json"),
    ids: list[int] = typer.Argument(..., help="Token ids."),
) -> None:
    """Print the text of token IDS."""
    try:
        typer.echo(_load(tokenizer).decode(ids))
    except TokenizerError as e:
        raise _fail(str(e)) from None
