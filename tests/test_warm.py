"""Kernels compiled ahead in a second process when a run starts on a cold kernel cache
(nanoeuler_core.cli.warm): the child runs a run's kernels and says when the step's are ready, a
failing child never holds the run up, the CPU backend tells a cold cache, a run compiles ahead only
with a second core and unless switched off, and `pretrain` with the child beside it trains and
samples as without."""

import os
import subprocess
import sys
import time

from typer.testing import CliRunner

from nanoeuler_core.cli import app, warm
from nanoeuler_core.cli.warm import STEP_READY, KernelWarmer
from nanoeuler_ops.cpu import CpuBackend


def test_child_runs_the_step_then_decoding():
    result = subprocess.run([sys.executable, "-m", "nanoeuler_core.cli.warm", "small", "cpu", "fp32", "0", "1", "0.8", "40",
                             "muon"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [STEP_READY]


def test_a_failing_child_does_not_hold_the_run_up():
    warmer = KernelWarmer.__new__(KernelWarmer)
    warmer.start([sys.executable, "-c", "raise SystemExit(3)"])
    start = time.perf_counter()
    with warmer:
        warmer.wait_for_step()
        warmer.wait_for_decoding()
    assert time.perf_counter() - start < 30
    assert warmer.process.returncode == 3


def test_cpu_backend_tells_a_cold_cache(tmp_path):
    check = "from nanoeuler_ops.cpu import BACKEND; print(BACKEND.kernel_cache_cold())"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)})
    assert result.stdout.strip() == "True", result.stderr


def test_compile_ahead_needs_two_cores_and_no_switch_off(monkeypatch):
    monkeypatch.setenv(warm.SWITCH, "1")
    monkeypatch.setattr(warm.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert warm.wanted()
    monkeypatch.setattr(warm.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert not warm.wanted()
    monkeypatch.setattr(warm.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setenv(warm.SWITCH, "0")
    assert not warm.wanted()


def test_pretrain_with_the_child_beside_it(tmp_path, monkeypatch):
    monkeypatch.setenv(warm.SWITCH, "1")
    monkeypatch.setattr(warm, "wanted", lambda: True)   # whatever cores this machine has
    monkeypatch.setattr(CpuBackend, "kernel_cache_cold", lambda self: True)
    started, start = [], KernelWarmer.start

    def recorded(self, command):
        started.append(command)
        start(self, command)

    monkeypatch.setattr(KernelWarmer, "start", recorded)
    result = CliRunner().invoke(app, ["pretrain", "--steps", "2", "--eval-every", "1", "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert len(started) == 1 and started[0][-8:] == ["small", "cpu", "fp32", "0", "1", "0.8", "40", "adamw"]
    assert "--- sample" in result.output and (tmp_path / "run" / "model.safetensors").exists()



def test_an_edit_to_an_imported_module_recompiles_a_cached_kernel(tmp_path):
    """A cached kernel compiles in what it imports: editing only the imported module must not
    leave the old machine code in use (nanoeuler_core.kernel_cache)."""
    package = tmp_path / "kernels"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "kernel.py").write_text(
        "from numba import njit\nfrom kernels.helper import value\n\n\n"
        "@njit(cache=True)\ndef kernel():\n    return value()\n")
    run = [sys.executable, "-c", "import nanoeuler_core; from kernels.kernel import kernel; print(kernel())"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    for value in (1, 2):
        (package / "helper.py").write_text(f"from numba import njit\n\n\n@njit\ndef value():\n    return {value}\n")
        result = subprocess.run(run, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
        assert result.stdout.strip() == str(value), result.stderr
    assert list((package / "__pycache__").glob("kernel.kernel-*.nbi"))   # the kernel was cached
