"""The CUDA kernels of the decoding ops on quantized weights (ops/cuda/row_products.py, "quantized
weights": x rounded to int8 by blocks of 32, dp4a): int8 (a scale per row, per group) and int4 (with
and without an offset) against the float64 reference (quantized.product; tests/test_ops.py checks
them against the CPU kernels too), rows whose last block is shorter, the rounding instructions, a
row bit for bit the same alone as among 9 (the kernel of one row against the kernel of groups of 4),
rows longer than a trip, a misaligned matrix, the groups the kernels refuse, and the kernel compiled
for Hopper with its trip in registers. On the simulator here (tests/conftest.py); on a GPU the same
tests run the GPU's kernels."""

import numpy as np
import pytest

from nanoeuler_core import quantized, registry
from nanoeuler_core.engine.gradcheck import run_backend, stored_values
from test_tensor_cores import compiled_without_simulator

OPS = ("norm_linear", "norm_swiglu", "linear_residual")
FORMATS = quantized.SAMPLE_FORMATS   # (format, group, zero point)
# against the reference: float32 sums, and a value the float32 norm rounds to 8 bits the other way now
# and then (one step of its block); x (and g, r) stored as bf16: y rounded to bf16 too
REL_TOL = {"fp32": 1e-4, "bf16": 1e-2}


def op_inputs(name, rng, N, C, O, fmt, group, zero_point=True):
    """(inputs, attrs) of a decoding op on N rows of C features, O outputs, its matrix quantized."""
    def normal(shape):   # float32 values: the reference reads what the kernels read
        return rng.standard_normal(shape).astype(np.float32).astype(np.float64)

    rows = 2 * O if name == "norm_swiglu" else O
    w = quantized.quantize(normal((rows, C)) / C ** 0.5, fmt, group, zero_point)
    if name == "linear_residual":
        return (normal((N, C)), normal((N, O)), *w), {}
    return (normal((N, C)), 1 + np.float32(0.1) * normal(C), *w), {"eps": 1e-5}


def run(name, inputs, attrs, backend, precision="fp32"):
    """The op's output on `backend`, the scales and offsets float16 in every precision."""
    return run_backend(registry.op(name), backend, inputs, attrs, precision=precision, float32_inputs=(3, 4))[0][0]


def rows(name, inputs, taken):
    """The op's inputs with only the rows `taken` (a slice) of its arrays of rows: x, and r."""
    of_rows = (0, 1) if name == "linear_residual" else (0,)
    return tuple(a[taken] if i in of_rows else a for i, a in enumerate(inputs))


def reference(name, inputs, attrs, precision="fp32"):
    """The op's float64 reference on the values the kernels read in `precision` (x and g, or x and r,
    stored in it; the matrix as it is)."""
    stored = tuple(stored_values(a, precision) if i < 2 else a for i, a in enumerate(inputs))
    return registry.op(name).reference.forward(*stored, **attrs)[0]


def rel_err(got, expected) -> float:
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))


def check_against_reference(name, inputs, attrs, precision):
    """CUDA's output, within REL_TOL of the reference (which rounds x as the kernels do: without the
    rounding a product is off by about 1e-2). tests/test_ops.py checks it against the CPU's."""
    cuda = run(name, inputs, attrs, "cuda", precision)
    assert rel_err(cuda, reference(name, inputs, attrs, precision)) <= REL_TOL[precision], precision
    return cuda


@pytest.mark.parametrize("fmt, group, zero_point", FORMATS)
@pytest.mark.parametrize("name", OPS)
def test_quantized_kernels_give_the_reference_and_rows_alone(name, fmt, group, zero_point):
    """9 rows (groups of 4, the last of one) of 320 features (an int4 row: 10 chunks, some lanes
    without one): CUDA gives the reference's results within float32's sums, and row 4 alone (the
    kernel of one row) is bit for bit row 4 of the 9; in bf16 storage of the rows too."""
    inputs, attrs = op_inputs(name, np.random.default_rng(0), 9, 320, 6, fmt, group, zero_point)
    for precision in ("fp32", "bf16"):
        together = check_against_reference(name, inputs, attrs, precision)
        alone = run(name, rows(name, inputs, slice(4, 5)), attrs, "cuda", precision)
        assert np.array_equal(alone[0], together[4]), precision


@pytest.mark.parametrize("name", OPS)
def test_rows_of_two_slices(name):
    """40 rows are two slices of 32 (blocks of their own), in groups of 8: the reference's results,
    and rows of either slice the same alone as among the 40."""
    inputs, attrs = op_inputs(name, np.random.default_rng(5), 40, 128, 5, "int4", 32)
    together = check_against_reference(name, inputs, attrs, "fp32")
    for n in (9, 37):
        assert np.array_equal(run(name, rows(name, inputs, slice(n, n + 1)), attrs, "cuda")[0], together[n])


@pytest.mark.parametrize("group", [0, 16])
@pytest.mark.parametrize("name", OPS)
def test_a_rows_last_block_may_be_shorter(name, group):
    """int8 rows of 80 features round x in blocks of 32, 32 and 16; a group of 16 weights is half a
    block of x."""
    inputs, attrs = op_inputs(name, np.random.default_rng(4), 3, 80, 5, "int8", group)
    check_against_reference(name, inputs, attrs, "fp32")


def test_rounding_is_the_references():
    """x rounded by the kernels' instructions (rint_scaled: the float32 product rounded once, then to
    an integer half to even; dp4a: signed bytes) gives quantized.round_activations' integers, ties
    included."""
    from nanoeuler_ops.cuda.device import dp4a, rint_scaled

    block = np.array([0.5, -0.5, 1.5, 2.5, -2.5, 126.5, -127.0, 3.0], np.float32)
    inverse = np.float32(127) / np.abs(block).max()
    expected = np.rint(block * inverse)
    assert [int(rint_scaled(v, inverse)) for v in block] == list(expected)
    assert np.array_equal(quantized.round_activations(block[None])[0], expected * (np.float64(127.0) / 127))
    word = np.array([-127, 3, 0, 127], np.int8).view(np.uint32)[0]
    assert int(dp4a(word, np.array([2, -5, 9, 1], np.int8).view(np.uint32)[0], np.int32(7))) == 7 - 254 - 15 + 127


@pytest.mark.parametrize("name", ["norm_swiglu", "linear_residual"])
def test_rows_longer_than_a_trip(name):
    """An int8 row of 2,112 weights is 132 chunks, past a trip of 4 x 32: each group of rows reads
    the second trip again (the first stays in registers), in groups of 32 weights; the reference's
    results, and a row alone as among 5."""
    inputs, attrs = op_inputs(name, np.random.default_rng(1), 5, 2112, 2, "int8", 32)
    together = check_against_reference(name, inputs, attrs, "fp32")
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
    assert "dp4a.s32.s32" in ptx and "mul.rn.f32" in ptx and "bar.sync" in ptx, name
    print("compiled", name)
"""


def test_quantized_kernels_compile_for_hopper_with_their_trip_in_registers():
    """quantized_rows compiled to sm_90a PTX through NVVM (no GPU needed): it waits for the kernel
    ahead and lets the next start, loads by 16 bytes, rounds x (mul.rn) into shared memory and
    multiplies by dp4a, and keeps its trip of chunks in registers (no local memory: a trip indexed
    at run time would live there, each use waiting on a load)."""
    assert compiled_without_simulator(HOPPER_COMPILE).count("compiled") == 2
