"""The engine commands as a user runs them: `nanoeuler-run ops`, `gradcheck` and `bench`."""

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


def test_bench_times_training_and_decoding():
    train = run("bench", "--preset", "small", "--batch-size", "2", "--steps", "1", "--warmup", "1", "--no-peers")
    assert train.returncode == 0, train.stderr
    assert "tokens/s" in train.stdout
    decode = run("bench", "--generate", "--preset", "small", "--prompt-tokens", "4", "--new-tokens", "8",
                 "--steps", "1", "--no-peers")
    assert decode.returncode == 0, decode.stderr
    rows = {line.split("  ")[0]: line.split() for line in decode.stdout.splitlines() if line.startswith("nanoeuler")}
    assert set(rows) == {"nanoeuler plain", "nanoeuler speculative"}
    assert rows["nanoeuler plain"][-1] == "8/8" and rows["nanoeuler speculative"][-1] == "8/8"  # greedy: same tokens
    assert "speculative decoding:" in decode.stdout


def test_bench_errors_are_one_line(tmp_path):
    cases = [(("--generate", "--precision", "bf16"), "decoding runs in float32"),
             (("--generate", "--run", str(tmp_path)), "is not a nanoeuler run directory"),
             (("--generate", "--new-tokens", "0"), "positive --prompt-tokens and --new-tokens"),
             (("--steps", "0",), "positive --steps")]
    for args, message in cases:
        result = run("bench", *args)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1 and message in lines[0], (args, result.stderr)
