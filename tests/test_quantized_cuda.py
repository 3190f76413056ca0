"""The CUDA kernels of the decoding ops on quantized weights (ops/cuda/row_products.py, "quantized
weights"): int8 and int4 against the CPU kernels, a row bit for bit the same alone as among 9 (the
kernel of one row against the kernel of groups of 4), rows longer than a trip, a misaligned matrix,
the groups the kernels refuse, and the kernel compiled for Hopper with its trip in registers. On the
simulator here (tests/conftest.py); on a GPU the same tests run the GPU's kernels."""

import numpy as np
import pytest

from nanoeuler_core import quantized, registry
from nanoeuler_core.engine.gradcheck import run_backend
from test_tensor_cores import compiled_without_simulator

OPS = ("norm_linear", "norm_swiglu", "linear_residual")
FORMATS = (("int8", 0, True), ("int4", 32, True), ("int4", 64, False))   # (format, group, zero point)
REL_TOL = {"fp32": 1e-5, "bf16": 1e-2}   # x (and g, r) stored as bf16: y rounded to bf16 too


def op_inputs(name, rng, N, C, O, fmt, group, zero_point=True):
    """(inputs, attrs) of a decoding op on N rows of C features, O outputs, its matrix quantized."""
    normal = rng.standard_normal
    rows = 2 * O if name == "norm_swiglu" else O
    w = quantized.quantize(normal((rows, C)) / C ** 0.5, fmt, group, zero_point)
    if name == "linear_residual":
        return (normal((N, C)), normal((N, O)), *w), {}
    return (normal((N, C)), 1 + 0.1 * normal(C), *w), {"eps": 1e-5}


def run(name, inputs, attrs, backend, precision="fp32"):
    """The op's output on `backend`, the scales and offsets float32 in every precision."""
    return run_backend(registry.op(name), backend, inputs, attrs, precision=precision, float32_inputs=(3, 4))[0][0]


def rows(name, inputs, taken):
    """The op's inputs with only the rows `taken` (a slice) of its arrays of rows: x, and r."""
    of_rows = (0, 1) if name == "linear_residual" else (0,)
    return tuple(a[taken] if i in of_rows else a for i, a in enumerate(inputs))


@pytest.mark.parametrize("fmt, group, zero_point", FORMATS)
@pytest.mark.parametrize("name", OPS)
def test_quantized_kernels_give_the_cpus_results_and_rows_alone(name, fmt, group, zero_point):
    """9 rows (groups of 4, the last of one) of 320 features (an int4 row: 10 chunks, some lanes
    without one): CUDA gives the CPU's results within float32's sums, and row 4 alone (the kernel of
    one row) is bit for bit row 4 of the 9; in bf16 storage of the rows too."""
    inputs, attrs = op_inputs(name, np.random.default_rng(0), 9, 320, 6, fmt, group, zero_point)
    for precision in ("fp32", "bf16"):
        cpu, together = run(name, inputs, attrs, "cpu", precision), run(name, inputs, attrs, "cuda", precision)
        assert np.linalg.norm(together - cpu) <= REL_TOL[precision] * np.linalg.norm(cpu), precision
        alone = run(name, rows(name, inputs, slice(4, 5)), attrs, "cuda", precision)
        assert np.array_equal(alone[0], together[4]), precision


@pytest.mark.parametrize("name", ["norm_swiglu", "linear_residual"])
def test_rows_longer_than_a_trip(name):
    """An int8 row of 2,112 weights is 132 chunks, past a trip of 4 x 32: each group of rows reads
    the second trip again (the first stays in registers), in groups of 32 weights; the CPU's
    results, and a row alone as among 5."""
    inputs, attrs = op_inputs(name, np.random.default_rng(1), 5, 2112, 2, "int8", 32)
    cpu, together = run(name, inputs, attrs, "cpu"), run(name, inputs, attrs, "cuda")
    assert np.linalg.norm(together - cpu) <= REL_TOL["fp32"] * np.linalg.norm(cpu)
    assert np.array_equal(run(name, rows(name, inputs, slice(4, 5)), attrs, "cuda")[0], together[4])


def test_a_misaligned_matrix_is_read_from_an_aligned_copy():
    """q starting 8 bytes into its buffer (a view the 16-byte loads cannot read) gives the results of
    the same matrix aligned."""
    from nanoeuler_ops.cuda import linear_residual

    be = registry.backend("cuda")
    (x, r, q, scale, zero), _ = op_inputs("linear_residual", np.random.default_rng(2), 3, 128, 5, "int4", 32)
    buffer = be.asarray(np.concatenate([np.zeros(8, np.uint8), q.reshape(-1)]))
    shifted = buffer[8:].reshape(q.shape)
    args = [be.asarray(a) for a in (x, r, q, scale, zero)]
    assert be.to_host(shifted).tobytes() == q.tobytes()
    expected = be.to_host(linear_residual.forward(*args)[0])
    got = be.to_host(linear_residual.forward(args[0], args[1], shifted, args[3], args[4])[0])
    assert np.array_equal(got, expected)


def test_int8_groups_the_kernels_cannot_read_are_refused_in_one_line():
    inputs, attrs = op_inputs("norm_linear", np.random.default_rng(3), 2, 72, 3, "int8", 24)
    with pytest.raises(ValueError, match=r"^the CUDA kernels read int8 weights in groups of a multiple of 16, not 24$"):
        run("norm_linear", inputs, attrs, "cuda")


HOPPER_COMPILE = """
import sys
from types import SimpleNamespace
from numba import types
from numba.cuda import compile_ptx
from numba.cuda.cudadrv import nvvm
if not nvvm.is_available():
    sys.exit(77)
import numba.cuda.dispatcher
numba.cuda.dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=(9, 0))
from nanoeuler_ops.cuda import device, row_products
device.DEVICE._overlaps = True
matrix = lambda t: types.Array(t, 2, "C")
ints = lambda n: types.UniTuple(types.int32, n) if n else types.Tuple(())
scales, i64, f32 = matrix(types.float32), types.int64, types.float32
# (name, rows' storage, q, weights a byte, rows a group, norm, matrices, chunks a trip): the largest
# kernel (norm_swiglu, int4, bf16 rows, 4 rows a group, 2 chunks a trip) and linear_residual's int8
# kernel of a lone row, 4 chunks a trip (w_down's)
for name, x, q, per_byte, R, norm, T, L in (("norm_swiglu int4", types.uint16, types.uint8, 2, 4, 1, 2, 2),
                                           ("linear_residual int8", types.float32, types.int8, 1, 1, 0, 1, 4)):
    x = matrix(x)
    args = (x, x, x, matrix(q), scales, scales, i64, f32, i64, ints(R), ints(norm), ints(T), ints(L), ints(per_byte),
            x)
    ptx, _ = compile_ptx(row_products.quantized_rows.py_func, args, cc=(9, 0))
    assert "griddepcontrol.launch_dependents" in ptx and "griddepcontrol.wait" in ptx, name
    assert "ld.global.nc.v4" in ptx and "ld.local" not in ptx and "st.local" not in ptx, name
    print("compiled", name)
"""


def test_quantized_kernels_compile_for_hopper_with_their_trip_in_registers():
    """quantized_rows compiled to sm_90a PTX through NVVM (no GPU needed): it waits for the kernel
    ahead and lets the next start, loads by 16 bytes, and keeps its trip of chunks in registers
    (no local memory: a trip indexed at run time would live there, each use waiting on a load)."""
    assert compiled_without_simulator(HOPPER_COMPILE).count("compiled") == 2
