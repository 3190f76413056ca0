"""Backends own their kernels: a third, minimal backend (tests/minimal_backend: add, linear and
swiglu only) registered at run time, or through an entry point as an installed package would be,
is checked for the ops it has and refused, in one line, for the ops it lacks; a package of extra
kernels fills a backend's gap but never replaces a kernel the backend has."""

import importlib.metadata
from types import SimpleNamespace

import numba
import numpy as np
import pytest
from numba import cuda
from typer.testing import CliRunner

from minimal_backend import BACKEND as MINIMAL
from nanoeuler_core import registry
from nanoeuler_core.cli import app
from nanoeuler_core.engine import gradcheck
from nanoeuler_core.engine.gradcheck import check_op
from nanoeuler_core.engine.config import ModelConfig
from nanoeuler_core.engine.model import Model
from nanoeuler_core.registry import BACKENDS_GROUP, KERNELS_GROUP, Impl, Registry

MINIMAL_OPS = {"add", "linear", "swiglu"}


@pytest.fixture
def minimal():
    with registry.REGISTRY.extra_backend(MINIMAL):
        yield MINIMAL


def test_ops_are_found_by_name_in_the_backends_kernel_package(minimal):
    has = {name for name, op in registry.ops().items() if "minimal" in op.backend_names()}
    assert has == MINIMAL_OPS
    assert registry.op("linear").backends["minimal"] == "minimal_backend.linear"
    with pytest.raises(KeyError, match="the minimal backend has no kernels for op 'attention'"):
        registry.op("attention").impl("minimal")


def test_ops_command_shows_what_a_backend_lacks(minimal):
    result = CliRunner().invoke(app, ["ops"])
    assert result.exit_code == 0, result.output
    header, *rows = result.output.splitlines()[:-1]
    has, lacks = (slice(header.index(a), header.index(b)) for a, b in (("backends", "lacking on"), ("lacking on", "package")))
    lines = {line.split()[0]: line for line in rows}
    for name in registry.ops():
        assert ("minimal*" in lines[name][has].split()) == (name in MINIMAL_OPS)
        assert ("minimal" in lines[name][lacks].split()) == (name not in MINIMAL_OPS)


def test_gradcheck_checks_the_ops_it_has_and_skips_the_others(minimal):
    checks = check_op(registry.op("linear"), ["minimal"])
    pairs = {(c.a, c.b) for c in checks}
    assert ("reference", "minimal") in pairs
    assert all(c.ok for c in checks), [c.line() for c in checks if not c.ok]
    assert any(c.what.endswith("+=") for c in checks)   # linear adds its gradients in place on it too
    assert "minimal" not in gradcheck.available_backends(registry.op("attention"))
    assert not gradcheck.runs_model("minimal") and gradcheck.runs_model("cpu")


def test_every_backend_is_held_to_the_calls_an_op_must_refuse(minimal, monkeypatch):
    op = registry.op("add")
    checks = gradcheck.refusal_checks(op, ["minimal"])
    assert {c.backend for c in checks} == {"reference", "minimal"} and all(c.ok for c in checks)
    # a kernel that forgot the spec's check: NumPy broadcasts one error input and words the other its own way
    monkeypatch.setitem(op._loaded, ("minimal", "fp32"), Impl(lambda a, b: (a + b, ()), lambda dy, saved, a, b: (dy, dy)))
    failed = {c.sample: c.line() for c in gradcheck.refusal_checks(op, ["minimal"]) if not c.ok}
    assert set(failed) == {"2x3_vs_1x3", "2x3_vs_3x2"}
    assert failed["2x3_vs_1x3"].endswith("; got no error")
    assert "; got the message 'operands could not be broadcast" in failed["2x3_vs_3x2"]
    result = CliRunner().invoke(app, ["gradcheck", "--op", "add", "--op", "attention", "--backend", "minimal"])
    assert result.exit_code == 1
    assert "minimal: checked; lacks op attention" in result.output
    assert "gradcheck FAILED: 2 check(s) out of bounds" in result.output


def test_model_on_a_backend_lacking_an_op_is_refused_in_one_line(minimal):
    with pytest.raises(ValueError) as err:
        Model(gradcheck.tiny_config(), backend="minimal")
    assert str(err.value).startswith("the minimal backend has no kernels for op 'embedding', which the model needs")
    assert "\n" not in str(err.value)


def test_contributed_kernels_fill_a_gap_but_never_replace_a_backends_own(minimal):
    assert "minimal" not in registry.op("rmsnorm").backend_names()
    registry.REGISTRY.register_kernels("minimal", "minimal_kernels")
    registry.REGISTRY.register_kernels("cpu", "minimal_kernels")
    try:
        assert registry.op("rmsnorm").backends["minimal"] == "minimal_kernels.rmsnorm"
        checks = check_op(registry.op("rmsnorm"), ["minimal"])
        assert checks and all(c.ok for c in checks), [c.line() for c in checks if not c.ok]
        assert registry.op("linear").backends["cpu"] == "nanoeuler_ops.cpu.linear"
        x = np.ones((2, 3), dtype=np.float32)
        y, _ = registry.op("linear").impl("cpu").forward(x, x)   # the contributed linear would raise
        np.testing.assert_allclose(y, 3 * np.ones((2, 2)))
    finally:
        registry.REGISTRY._kernels["cpu"].remove("minimal_kernels")
        registry.op("rmsnorm")._loaded.pop(("minimal", "fp32"), None)


class FakeEntryPoint:
    """An entry point as an installed distribution `package` would declare it: `name = "value"`."""

    def __init__(self, group: str, name: str, value: str, package: str):
        self.group, self.name, self.value = group, name, value
        self.dist = SimpleNamespace(name=package)

    def load(self):
        return importlib.metadata.EntryPoint(self.name, self.value, self.group).load()


def test_a_package_adds_a_backend_and_kernels_through_entry_points(monkeypatch):
    real = importlib.metadata.entry_points
    extra = {BACKENDS_GROUP: [FakeEntryPoint(BACKENDS_GROUP, "minimal", "minimal_backend:BACKEND", "nanoeuler-minimal")],
             KERNELS_GROUP: [FakeEntryPoint(KERNELS_GROUP, "minimal", "minimal_kernels", "nanoeuler-minimal-extra")]}

    def entry_points(**selection):
        return list(real(**selection)) + extra.get(selection.get("group"), [])

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    reg = Registry()
    assert reg.backend("minimal") is MINIMAL
    assert reg.contributed_kernels("minimal") == ["minimal_kernels"]
    assert set(reg.backends()) >= {"reference", "cpu", "minimal"}


def test_cpu_threads_serial_for_steps_and_parallel_for_a_prefill_inside():
    """Decoding runs its steps in `serial` (one thread) and a prompt's prefill in `parallel` inside it:
    the thread count before the outermost serial block comes back, and each block restores its own."""
    import numba

    be, threads = registry.backend("cpu"), numba.get_num_threads()
    with be.serial():
        assert numba.get_num_threads() == 1
        with be.parallel():
            assert numba.get_num_threads() == threads
            with be.serial():
                assert numba.get_num_threads() == 1
            assert numba.get_num_threads() == threads
        assert numba.get_num_threads() == 1
    assert numba.get_num_threads() == threads
    with be.parallel():   # outside any serial block: nothing changes
        assert numba.get_num_threads() == threads


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="glibc's malloc settings")
def test_cpu_steps_reuse_their_memory_instead_of_faulting_in_fresh_pages():
    """A step's large activations (here a 16 MB gate/up product) come back from malloc's heap at the
    next step: glibc would otherwise map each afresh and fault in zeroed pages, every step."""
    import resource

    cfg = ModelConfig(vocab_size=64, dim=384, n_layers=1, n_heads=6, n_kv_heads=2, hidden_dim=1024, ctx_len=256,
                      n_mtp=1)
    model = Model(cfg, backend="cpu")
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, cfg.ctx_len + 1))
    for _ in range(2):   # the heap grows to the step's peak
        model.loss_and_backward(ids[:, :-1], ids[:, 1:])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    model.loss_and_backward(ids[:, :-1], ids[:, 1:])
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < 1000   # a 16 MB block alone is 4,096 pages


@pytest.mark.skipif(not numba.config.ENABLE_CUDASIM, reason="the CUDA simulator's thread blocks")
def test_simulated_blocks_meet_at_barriers_and_report_the_failing_thread():
    """The simulator as the CUDA backend runs it (ops/cuda/simulator.py): threads that return early
    leave the block's barriers, a failing thread's error names it (and does not hang the others),
    the block's threads serve later launches, and a shared array takes the GPU's alignment."""
    from nanoeuler_ops.cuda import device  # noqa: F401  (the simulator, set up as the backend runs it)

    @cuda.jit
    def reverse(a, fail):
        t = cuda.threadIdx.x
        staged = cuda.shared.array(64, np.float32, alignment=16)
        if t >= 40:
            return
        staged[t] = t
        cuda.syncthreads()
        a[cuda.blockIdx.x, t] = staged[39 - t]
        if fail and t == 7:
            a[100, 0] = 1.0
        cuda.syncthreads()

    a = np.zeros((3, 64), np.float32)
    reverse[3, 64](a, False)
    assert a[2, 0] == 39 and a[1, 39] == 0 and a[0, 40] == 0
    with pytest.raises(IndexError, match=r"tid=\[7, 0, 0\]"):
        reverse[3, 64](a, True)
    a[:] = 0
    reverse[3, 64](a, False)
    assert a[0, 1] == 38


def test_simulator_twins_the_gpu_name_for_name():
    """ops/cuda/simulator.py stands in for ops/cuda/gpu.py's DEVICE and ops/cuda/ptx.py's
    instructions: the same names, and a device object with the same methods (read from the source,
    so that neither module needs importing where it cannot run)."""
    import ast
    import pathlib

    cuda_dir = pathlib.Path(__file__).parent.parent / "ops" / "cuda"

    def module(name):
        return ast.parse((cuda_dir / f"{name}.py").read_text())

    def exported(tree):
        return next(set(ast.literal_eval(node.value)) for node in tree.body
                    if isinstance(node, ast.Assign) and node.targets[0].id == "__all__")

    def methods(tree, cls):
        body = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == cls).body
        return {node.name for node in body if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")}

    simulator = module("simulator")
    assert exported(simulator) == exported(module("ptx")) | {"DEVICE"}
    assert methods(simulator, "Simulator") == methods(module("gpu"), "Gpu")


@pytest.mark.skipif(not numba.config.ENABLE_CUDASIM and not cuda.is_available(), reason="needs the CUDA backend")
def test_device_copies_convert_between_storages_over_many_blocks():
    """The CUDA backend's device-to-device copy (its kernels): float32 to bf16 rounds to nearest even,
    as the host's conversion does, bf16 to float32 is exact, one storage to the same copies the bits;
    every element of arrays of one to several blocks, the last one part-filled."""
    from nanoeuler_ops.cuda import device, runtime

    rng = np.random.default_rng(0)
    for n in (1, 1000, 3001):
        values = rng.standard_normal(n).astype(np.float32)
        bits = registry.bf16_bits(values)
        wide, narrow = cuda.to_device(values), cuda.to_device(np.zeros(n, device.BF16))
        again, copied = cuda.to_device(np.zeros(n, np.float32)), cuda.to_device(np.zeros(n, np.float32))
        runtime.copy(narrow, wide)
        runtime.copy(again, narrow)
        runtime.copy(copied, again)
        assert np.array_equal(narrow.copy_to_host(), bits)
        assert np.array_equal(again.copy_to_host(), registry.bf16_values(bits))
        assert np.array_equal(copied.copy_to_host(), again.copy_to_host())
