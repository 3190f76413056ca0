"""`nanoeuler-run`: the command line. Each group of commands lives in a module of this package."""

from __future__ import annotations

import os
import sys

import typer

from nanoeuler_core.cli import data, engine, evaluate, finetune, interop, serve, tokenizer, train
from nanoeuler_core.errors import USER_ERRORS, one_line

app = typer.Typer(help="nanoeuler: train, check and sample a GPT-2-class model on a hand-written Numba engine.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
app.add_typer(tokenizer.app, name="tokenizer")
app.add_typer(data.app, name="data")
engine.register(app)
train.register(app)
finetune.register(app)
interop.register(app)
evaluate.register(app)
serve.register(app)


def main() -> None:
    """Run the CLI; errors a user can cause end in one line on stderr and exit code 1.

    Set NANOEULER_DEBUG=1 to see the full traceback instead.
    """
    try:
        app()
    except USER_ERRORS as exc:
        if os.environ.get("NANOEULER_DEBUG"):
            raise
        print(f"error: {one_line(exc)}", file=sys.stderr)
        sys.exit(1)
