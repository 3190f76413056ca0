"""The engine commands as a user runs them: `nanoeuler-run ops` and `nanoeuler-run gradcheck`."""

import subprocess
import sys

from nanoeuler_core import registry


def run(*args):
    return subprocess.run([sys.executable, "-m", "nanoeuler_core.cli", *args], capture_output=True, text=True, timeout=600)


def test_ops_lists_every_op_with_backends_and_package():
    result = run("ops")
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines()[1:-1]}
    assert set(lines) == set(registry.ops())
    assert "nanoeuler-gelu" in lines["gelu"]
    assert "reference* cpu*" in lines["attention"]


def test_gradcheck_passes_and_prints_the_model_table():
    result = run("gradcheck", "--backend", "cpu")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gradcheck passed" in result.stdout
    assert "ok   tok_emb:" in result.stdout and "ok   heads.3:" not in result.stdout  # the tiny model has 2 heads
    for name in registry.ops():
        assert f"ok   {name} " in result.stdout


def test_gradcheck_unknown_backend_is_one_line():
    result = run("gradcheck", "--backend", "tpu")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == ["error: unknown backend 'tpu' (choose from: cpu, cuda, reference)"]
