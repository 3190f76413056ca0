"""The whole model on a real GPU: selftest, training that follows the CPU, and runs that move
between backends (one run-directory format). Skipped where there is no GPU."""

import subprocess
import sys

import numba
import orjson
import pytest
from numba import cuda

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(bool(numba.config.ENABLE_CUDASIM) or not cuda.is_available(),
                                 reason="needs a real CUDA GPU")]


def cli(*args):
    return subprocess.run([sys.executable, "-m", "nanoeuler_core.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=900)


def losses(run_dir):
    return [orjson.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]


def test_selftest_passes():
    result = cli("selftest", "--backend", "cuda")
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "selftest passed" in result.stdout


def test_gpu_training_follows_cpu_and_runs_move_between_backends(tmp_path):
    common = ("--steps", 20, "--batch-size", 4, "--eval-every", 10, "--ckpt-every", 10, "--seed", 3)
    cpu = cli("pretrain", "--backend", "cpu", "--out", tmp_path / "cpu", *common)
    assert cpu.returncode == 0, cpu.stderr
    gpu = cli("pretrain", "--backend", "cuda", "--precision", "fp32", "--out", tmp_path / "gpu", "--tokenizer",
              tmp_path / "cpu" / "tokenizer.json", *common)
    assert gpu.returncode == 0, gpu.stderr
    for a, b in zip(losses(tmp_path / "cpu"), losses(tmp_path / "gpu")):
        assert abs(a - b) < 1e-3 * abs(a), (losses(tmp_path / "cpu"), losses(tmp_path / "gpu"))
    # a GPU run resumes and samples on the CPU, and a CPU run on the GPU
    assert cli("pretrain", "--resume", tmp_path / "gpu", "--steps", 25, "--backend", "cpu").returncode == 0
    assert cli("pretrain", "--resume", tmp_path / "cpu", "--steps", 25, "--backend", "cuda").returncode == 0
    sample = cli("generate", tmp_path / "gpu", "It was", "--max-new-tokens", 20, "--seed", 0, "--backend", "cuda")
    assert sample.returncode == 0 and sample.stdout.startswith("It was"), sample.stderr
