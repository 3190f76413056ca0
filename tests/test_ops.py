"""Op tests generated from the registry: every op, every sample, every pair of its backends, in
every precision the op declares, and the reference backward against finite differences; and
every backend refuses each call the op declares in `error_inputs`, with the message it declares.
A new op, backend or precision is tested for free."""

import numpy as np
import pytest

from nanoeuler_core import registry
from nanoeuler_core.engine.gradcheck import check_op, op_precisions, refusal_checks

OPS = sorted(registry.ops())
CASES = [(name, precision) for name in OPS for precision in op_precisions(registry.op(name))]
REFUSING = [name for name in OPS if registry.op(name).error_inputs is not None]


@pytest.mark.parametrize("name, precision", CASES)
def test_op_gradcheck(name, precision):
    checks = check_op(registry.op(name), precision=precision)
    assert checks, f"op '{name}' produced no {precision} checks: its sample_inputs yields nothing"
    failed = [c.line() for c in checks if not c.ok]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("name", REFUSING)
def test_op_refuses_its_error_inputs_on_every_backend(name):
    op = registry.op(name)
    checks = refusal_checks(op)
    assert checks, f"op '{name}' declares error_inputs but yields none"
    usable = {name for name, be in registry.backends().items() if be.available()}
    assert {c.backend for c in checks} == set(op.backends) & usable
    failed = [c.line() for c in checks if not c.ok]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("name", OPS)
def test_op_has_cpu_and_samples(name):
    op = registry.op(name)
    assert "cpu" in op.backends, f"op '{name}' has no cpu implementation"
    assert list(op.sample_inputs(np.random.default_rng(0)))
