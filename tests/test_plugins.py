"""Ops from other packages: the nanoeuler-gelu plugin is found through its entry point, and a broken
plugin (one that fails to import, names something that is not an Op, or reuses a registered name)
is skipped with a RuntimeWarning naming its package while everything else keeps working.

The broken plugins are fakes: `importlib.metadata.entry_points` is patched to list them beside
nanoeuler's own entry points, and each test loads a fresh `Registry`, so nothing is installed and
the process-wide registry is untouched."""

import importlib.metadata
from types import SimpleNamespace

import numpy as np
import pytest

from nanoeuler_core import registry
from nanoeuler_core.registry import OPS_GROUP, Op, Registry
from nanoeuler_ops import rmsnorm

REAL_ENTRY_POINTS = importlib.metadata.entry_points

# What a plugin that ships its own "rmsnorm" would register.
PLUGIN_RMSNORM = Op(name="rmsnorm", summary="a plugin's own RMSNorm", reference=rmsnorm.OP.reference,
                    sample_inputs=rmsnorm.OP.sample_inputs)
BUILTIN_OPS = {op.name for op in __import__("nanoeuler_ops").OPS}


class FakeEntryPoint:
    """An op entry point as an installed distribution `package` would declare it: `name = "value"`."""

    group = OPS_GROUP

    def __init__(self, name: str, value: str, package: str):
        self.name, self.value = name, value
        self.dist = SimpleNamespace(name=package)

    def load(self):
        return importlib.metadata.EntryPoint(self.name, self.value, self.group).load()


def builtin_op_entry_point():
    """The entry point of nanoeuler's own ops (the ops package lists them all)."""
    (ep,) = [ep for ep in REAL_ENTRY_POINTS(group=OPS_GROUP) if ep.value == "nanoeuler_ops:OPS"]
    return ep


@pytest.fixture
def op_entry_points(monkeypatch):
    """Call with entry points, in order: they become the whole `nanoeuler.ops` group (backends stay real)."""
    def install(*eps):
        def entry_points(**selection):
            return list(eps) if selection.get("group") == OPS_GROUP else REAL_ENTRY_POINTS(**selection)
        monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    return install


def assert_rmsnorm_runs_on_cpu(reg):
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    w = np.ones(8, dtype=np.float32)
    y, _ = reg.op("rmsnorm").impl("cpu").forward(x, w, eps=1e-5)
    np.testing.assert_allclose(y, x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5), rtol=1e-5)


def test_gelu_plugin_is_registered_from_its_package():
    ops = registry.ops()
    assert "gelu" in ops, "the gelu plugin is not installed: pip install -e plugins/nanoeuler-gelu"
    assert ops["gelu"].source == "nanoeuler-gelu"
    assert ops["gelu"].backends == {"reference": "nanoeuler_gelu.gelu", "cpu": "nanoeuler_gelu.cpu.gelu"}


@pytest.mark.parametrize("value, error", [
    ("nanoeuler_no_such_plugin:OP", "ModuleNotFoundError: No module named 'nanoeuler_no_such_plugin'"),
    ("nanoeuler_ops.rmsnorm:forward", "TypeError: entry point must name an nanoeuler_core.registry.Op"),
], ids=["fails_to_import", "not_an_op"])
def test_broken_plugin_is_skipped_with_a_warning(op_entry_points, value, error):
    op_entry_points(builtin_op_entry_point(), FakeEntryPoint("broken", value, "nanoeuler-broken"))
    reg = Registry()
    with pytest.warns(RuntimeWarning, match=f"entry point 'broken' from package 'nanoeuler-broken': {error}"):
        assert set(reg.ops()) == BUILTIN_OPS
    assert_rmsnorm_runs_on_cpu(reg)


@pytest.mark.parametrize("plugin_listed_first", [False, True], ids=["after_builtin", "before_builtin"])
def test_plugin_reusing_a_registered_name_is_skipped_with_a_warning(op_entry_points, plugin_listed_first):
    # importlib.metadata lists distributions in sys.path order, so a plugin may come first: the
    # built-in op must win either way, and the warning must blame the plugin.
    builtin = builtin_op_entry_point()
    clone = FakeEntryPoint("rmsnorm", f"{__name__}:PLUGIN_RMSNORM", "nanoeuler-rmsnorm-clone")
    op_entry_points(*((clone, builtin) if plugin_listed_first else (builtin, clone)))
    reg = Registry()
    with pytest.warns(RuntimeWarning, match="entry point 'rmsnorm' from package 'nanoeuler-rmsnorm-clone': "
                                            "ValueError: op 'rmsnorm' is already registered by nanoeuler"):
        op = reg.op("rmsnorm")
    assert op is rmsnorm.OP and op.source == "nanoeuler"
    assert_rmsnorm_runs_on_cpu(reg)


def test_every_package_folder_is_installed():
    """A non-editable install (a wheel) carries exactly the packages pyproject.toml lists: every
    folder with an __init__.py under a mapped root must be among them."""
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parent.parent
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join((name, *init.parent.relative_to(root / folder).parts))
             for name, folder in setup["package-dir"].items() for init in (root / folder).rglob("__init__.py")}
    assert found == set(setup["packages"])
