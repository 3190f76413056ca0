"""`nanoeuler-run data ...`: download real corpora, or build one from this machine's Python files,
and turn them into files `pretrain` and `sft` read.

Each command shows its progress on stderr, resumes partial downloads when run again, and checks
files against the `SHA256SUMS` manifest it keeps in the output folder. `--base-url` (or `--url`
for alpaca) points a command at a mirror with the same file layout, for example a local copy
served with `python -m http.server`.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Iterator

import typer
from rich.console import Console
from rich.filesize import decimal
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from nanoeuler_core.corpus import downloads as datasets
from nanoeuler_core.corpus import python_sources

app = typer.Typer(
    help="Download real corpora (Project Gutenberg books, a FineWeb-Edu slice, the Alpaca instruction set) "
         "and the HellaSwag validation set, or build the Python corpus offline.",
    no_args_is_help=True,
)

SIZE_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}


@app.command()
def gutenberg(
    out: Annotated[Path, typer.Option(help="Folder for the books and the corpus.")] = Path("corpora/gutenberg"),
    books: Annotated[str | None, typer.Option(help="Comma-separated Project Gutenberg ids, e.g. 84,1342 "
                                                   "(default: 30 classic English-language books).")] = None,
    base_url: Annotated[
        str, typer.Option(help="Mirror laid out like gutenberg.org/cache/epub.")
    ] = datasets.GUTENBERG_URL,
) -> None:
    """Public-domain books, licence header and footer stripped, joined into one corpus."""
    book_ids = _parse_book_ids(books) if books else list(datasets.GUTENBERG_BOOKS)
    with _progress_session() as progress:
        corpus = datasets.gutenberg(out, book_ids, base_url=base_url, progress=progress)
    _report_corpus(corpus, f"{len(book_ids)} books")


@app.command()
def fineweb(
    out: Annotated[Path, typer.Option(help="Folder for the parquet shards and the corpus.")] = Path("corpora/fineweb"),
    max_bytes: Annotated[str, typer.Option(help="Corpus size: bytes, or with a K, M or G suffix.")] = "100M",
    base_url: Annotated[
        str, typer.Option(help="Mirror laid out like FineWeb-Edu's sample/10BT.")
    ] = datasets.FINEWEB_URL,
) -> None:
    """A slice of FineWeb-Edu (educational web pages), whole documents, `</s>` between them."""
    size = _parse_size(max_bytes)
    with _progress_session() as progress:
        corpus = datasets.fineweb(out, size, base_url=base_url, progress=progress)
    _report_corpus(corpus, "FineWeb-Edu documents")


@app.command("python-sources")
def python_sources_corpus(
    out: Annotated[Path, typer.Option(help="Folder for the corpus and its manifest.")] = Path("corpora/python"),
    max_bytes: Annotated[str, typer.Option(help="Corpus size: bytes, or with a K, M or G suffix.")] = "600M",
    roots: Annotated[list[Path] | None, typer.Option(
        "--roots", help="A folder to read instead of this Python's stdlib, purelib and platlib; repeat for more.")
    ] = None,
) -> None:
    """The text files of this Python installation (the standard library and the installed packages'
    sources and documentation), shuffled whole documents, `</s>` between them: no network needed."""
    size = _parse_size(max_bytes)
    with _progress_session("interrupted: nothing was written") as progress:
        built = python_sources.build(out, size, roots, progress=progress)
    tokenizer = (f"nanoeuler-run tokenizer train {built.corpus} --vocab-size 4096 --sample-bytes 50000000 "
                 f"--out {out / 'tokenizer.json'}")
    _report_corpus(built.corpus, f"{built.documents:,} documents, SHA-256 {built.sha256[:12]}, manifest "
                                 f"{built.manifest.name}", f"train its tokenizer: {tokenizer}")


@app.command()
def alpaca(
    out: Annotated[Path, typer.Option(help="JSONL file to write.")] = Path("corpora/alpaca.jsonl"),
    url: Annotated[str, typer.Option(help="Where to download alpaca_data.json from.")] = datasets.ALPACA_URL,
) -> None:
    """The Stanford Alpaca instruction set, validated, as JSONL for supervised fine-tuning."""
    with _progress_session() as progress:
        path = datasets.alpaca(out, url=url, progress=progress)
    with open(path, encoding="utf-8") as lines:
        examples = sum(1 for _ in lines)
    typer.echo(f"{examples} instruction examples in {path}; fine-tune on them: "
               f"nanoeuler-run sft --base RUN_DIR --data {path}")


@app.command()
def hellaswag(
    out: Annotated[Path, typer.Option(help="JSONL file to write.")] = datasets.HELLASWAG_DEFAULT,
    url: Annotated[str, typer.Option(help="Where to download hellaswag_val.jsonl from.")] = datasets.HELLASWAG_URL,
) -> None:
    """The HellaSwag validation set (10,042 items), checked against its pinned SHA-256."""
    with _progress_session() as progress:
        path = datasets.hellaswag(out, url=url, progress=progress)
    typer.echo(f"HellaSwag validation set in {path}; score a run on it: nanoeuler-run eval RUN_DIR --task hellaswag "
               f"--data {path}")


@contextmanager
def _progress_session(
    interrupted: str = "interrupted: partial downloads are kept and resume on the next run",
) -> Iterator[datasets.Progress]:
    """A progress display on stderr; failures become one line on stderr and a non-zero exit."""
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                      TimeRemainingColumn(), console=Console(stderr=True)) as display:
            tasks: dict[str, int] = {}

            def report(name: str, done: int, total: int | None) -> None:
                if name not in tasks:
                    tasks[name] = display.add_task(name, total=total)
                display.update(tasks[name], completed=done, total=total)

            yield report
    except (datasets.DatasetError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo(interrupted, err=True)
        raise typer.Exit(130) from None


def _report_corpus(corpus: Path, contents: str, next_step: str | None = None) -> None:
    next_step = next_step or f"train on it: nanoeuler-run pretrain --corpus {corpus}"
    typer.echo(f"Corpus: {corpus} ({decimal(corpus.stat().st_size)}, {contents}); {next_step}")


def _parse_book_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated book ids such as 84,1342, got {text!r}",
                                 param_hint="--books") from None
    if not ids or min(ids) < 1:
        raise typer.BadParameter(f"expected positive book ids, got {text!r}", param_hint="--books")
    return ids


def _parse_size(text: str) -> int:
    """'100M' -> 100_000_000 (decimal units, like download sizes)."""
    number, suffix = text.strip().upper().rstrip("B"), ""
    if number[-1:] in SIZE_SUFFIXES:
        number, suffix = number[:-1], number[-1]
    try:
        size = int(float(number) * SIZE_SUFFIXES[suffix])
    except (ValueError, OverflowError):
        size = 0
    if size < 1:
        raise typer.BadParameter(f"expected a positive size such as 50M or 2G, got {text!r}", param_hint="--max-bytes")
    return size
