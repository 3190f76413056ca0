"""Op tests generated from the registry: every op, every sample, every pair of its backends, in
every precision the op declares, and the reference backward against finite differences. A new
op, backend or precision is tested for free."""

import numpy as np
import pytest

from nanoeuler_core import registry
from nanoeuler_core.engine.gradcheck import check_op, op_precisions

OPS = sorted(registry.ops())
CASES = [(name, precision) for name in OPS for precision in op_precisions(registry.op(name))]


@pytest.mark.parametrize("name, precision", CASES)
def test_op_gradcheck(name, precision):
    checks = check_op(registry.op(name), precision=precision)
    assert checks, f"op '{name}' produced no {precision} checks: its sample_inputs yields nothing"
    failed = [c.line() for c in checks if not c.ok]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("name", OPS)
def test_op_has_cpu_and_samples(name):
    op = registry.op(name)
    assert "cpu" in op.backends, f"op '{name}' has no cpu implementation"
    assert list(op.sample_inputs(np.random.default_rng(0)))
