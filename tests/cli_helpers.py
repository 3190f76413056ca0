"""Running `nanoeuler-run` inside the test process, as the tests of several commands do."""

import sys

import pytest

from nanoeuler_core.cli import main


def run_cli(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """`nanoeuler-run ARGS...` in this process: (exit code, stdout, stderr) of that call alone."""
    capsys.readouterr()  # drop what came before
    monkeypatch.setattr(sys, "argv", ["nanoeuler-run", *map(str, args)])
    with pytest.raises(SystemExit) as exit_:
        main()
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err
