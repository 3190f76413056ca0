"""The CPU's quantized matrix products (ops/cpu/row_products.py): activations rounded to 8 bits
by blocks of 32 as nanoeuler_core.quantized.round_activations rounds them (odd lengths: a shorter
last block); int8 a scale per output channel, per group of 32 and groups that are not whole blocks,
int4 groups of 32 and 64 with and without a zero point, against the float64 product of the rounded
activations and the dequantized matrix; the 8-bit block dots (lanes.py) on AVX2 and in generic
vector code; float16 scales read with F16C and without; and every row the same bits alone on one thread as among other rows on several, below
and above the size from which a product shares its outputs among the threads (also inside the
backend's serial block, where such a product takes the threads back and gives them up after)."""

import os
import subprocess
import sys

import numba
import numpy as np
import pytest

from nanoeuler_core import quantized
from nanoeuler_core.registry import backend
from nanoeuler_ops.cpu import lanes, norm_linear
from nanoeuler_ops.cpu.row_products import THREADED_PRODUCTS, kernel_weights, quantized_matmul_rows, round_rows

# (format, group, zero point): per channel, GGUF's Q8_0, Q4_1 and Q4_0 blocks, and 4-bit groups of two blocks
FORMATS = [("int8", 0, True), ("int8", 32, True), ("int4", 32, True), ("int4", 32, False), ("int4", 64, False)]
THREADS = numba.config.NUMBA_NUM_THREADS


def _matrix(rng, O, K, fmt, group, zero_point):
    return quantized.quantize(rng.standard_normal((O, K)) / K ** 0.5, fmt, group, zero_point)


def _product(x, w, threads):
    out = np.full((x.shape[0], w[0].shape[0]), np.nan, np.float32)
    quantized_matmul_rows(x, *kernel_weights(*w), out, threads)
    return out


def _rounded(x):
    """x (N, K) float32 as the kernels round it: (xq * d) in float64, and xq."""
    N, K = x.shape
    xq = np.zeros((N, K), np.int8)
    d = np.zeros((N, -(-K // quantized.QBLOCK)), np.float32)
    round_rows(x, xq, d)
    return xq * np.repeat(d.astype(np.float64), quantized.QBLOCK, axis=1)[:, :K], xq


def _check_product(x, w, threads=(1, THREADS)):
    """The kernel against the float64 product of x as it rounds it and the dequantized matrix, within
    float32's error of a sum of K products: |error| <= K u sum_k |x_k w_k| (u = 2^-24)."""
    rounded, _ = _rounded(x)
    W = quantized.dequantize(*w)
    exact, bound = rounded @ W.T, x.shape[1] * 2.0 ** -24 * (np.abs(rounded) @ np.abs(W).T)
    for t in sorted(set(threads)):
        out = _product(x, w, t)
        assert np.all(np.abs(out - exact) <= bound), (t, np.abs(out - exact).max(), bound.min())


@pytest.mark.parametrize("K", [64, 200, 576, 45, 7])
def test_rows_are_rounded_as_round_activations_rounds_them(K):
    """The same integers as round_activations (computed in float32 both), d within float32's
    rounding of max |x| / 127; a block of zeros stays zero; the last block of an odd K is shorter."""
    rng = np.random.default_rng(K)
    x = (rng.standard_normal((3, K)) * rng.choice([1e-3, 1.0, 30.0], (3, 1))).astype(np.float32)
    x[2, :min(K, 32)] = 0.0
    rounded, xq = _rounded(x)
    reference = quantized.round_activations(x)
    assert np.all(np.abs(xq) <= 127)
    assert np.all(np.abs(rounded - reference) <= 2.0 ** -24 * np.abs(reference)), np.abs(rounded - reference).max()
    assert np.array_equal(rounded == 0, reference == 0)
    assert not rounded[2, :min(K, 32)].any()


def test_a_block_with_nan_or_inf_gives_nan():
    rng = np.random.default_rng(4)
    w = _matrix(rng, 5, 96, "int4", 32, True)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    x[0, 40], x[1, 70] = np.nan, np.inf
    out = _product(x, w, 1)
    assert np.isnan(out[:2]).all() and np.isfinite(out[2]).all()


# (N, O, K): outputs not a multiple of the 4-output tiles, rows of one group of 64, a product of
# the threaded size, and rows of SmolLM2-135M's down projection
SIZES = [(3, 7, 64), (2, 5, 64), (1, THREADED_PRODUCTS // 576 + 3, 576), (2, 576, 1536)]


@pytest.mark.parametrize("N, O, K", SIZES)
@pytest.mark.parametrize("fmt, group, zero_point", FORMATS)
def test_quantized_products_match_the_rounded_rows_times_the_dequantized_matrix(N, O, K, fmt, group, zero_point):
    rng = np.random.default_rng(0)
    _check_product(rng.standard_normal((N, K)).astype(np.float32), _matrix(rng, O, K, fmt, group, zero_point))


@pytest.mark.parametrize("K, group", [(200, 20), (200, 100), (200, 0), (45, 0), (45, 15), (96, 48)])
def test_int8_groups_and_rows_that_are_not_whole_blocks(K, group):
    """Groups of 20 and 15 (no whole block), of 100 and 48 (blocks split between two groups), rows of
    200 and 45 weights (a last block of 8 or 13): those parts go through scalar integer sums."""
    rng = np.random.default_rng(1)
    _check_product(rng.standard_normal((2, K)).astype(np.float32), _matrix(rng, 9, K, "int8", group, True), threads=(1,))


def test_products_of_extreme_integers():
    """Activations rounding to +-127 times int8 weights of +-127 and nibbles of 15: each term is 127 or
    15 times d * 127 = 1 (float32's d), no 16-bit pair sum saturates."""
    K = 64
    x = np.tile(np.float32([1.0, -1.0, 1.0, 1.0]), (1, K // 4))
    q = np.tile(np.int8([127, -127, 127, 127]), (5, K // 4))
    w8 = (q, np.ones((5, 1), np.float32), np.zeros((5, 0), np.float32))
    assert np.allclose(_product(x, w8, 1), 127 * K, rtol=1e-6, atol=0)
    w4 = (np.full((5, K // 2), 0xFF, np.uint8), np.ones((5, K // 32), np.float32), np.zeros((5, K // 32), np.float32))
    assert np.allclose(_product(-x, w4, 1), -15 * K / 2, rtol=1e-6, atol=0)


@pytest.mark.parametrize("fmt, group, zero_point", FORMATS)
def test_each_row_alone_has_the_bits_it_has_among_rows_on_any_threads(fmt, group, zero_point):
    """A row alone stays below THREADED_PRODUCTS (one thread); 16 rows, or a wider matrix even for one
    row, go above it and share their outputs among the threads."""
    rng = np.random.default_rng(2)
    K = 256
    for O in (THREADED_PRODUCTS // K // 4 + 3, THREADED_PRODUCTS // K + 5):   # below, then above for one row
        w = _matrix(rng, O, K, fmt, group, zero_point)
        x = rng.standard_normal((16, K)).astype(np.float32)
        assert 16 * O * K >= THREADED_PRODUCTS
        alone = np.concatenate([_product(x[n:n + 1], w, 1) for n in range(16)])
        for threads in sorted({1, THREADS}):
            assert np.array_equal(_product(x[3:4], w, threads), alone[3:4]), (O, threads)
            assert np.array_equal(_product(x, w, threads), alone), (O, threads)
            assert np.array_equal(_product(x[::-1].copy(), w, threads), alone[::-1]), (O, threads)


def test_a_large_product_takes_the_threads_back_inside_the_serial_block():
    """Inside `serial` (one thread) a product above THREADED_PRODUCTS runs on the threads outside it:
    the same bits as the row computed elsewhere, and the serial block keeps its one thread after."""
    cpu = backend("cpu")
    rng = np.random.default_rng(3)
    K = 576
    w = _matrix(rng, THREADED_PRODUCTS // K + 9, K, "int4", 32, True)
    x = rng.standard_normal((1, K)).astype(np.float32)
    g = np.ones(K, np.float32)
    threads = numba.get_num_threads()
    outside = norm_linear.forward(x, g, *w, eps=1e-5)[0]
    with cpu.serial():
        assert cpu.threads() == threads
        inside = norm_linear.forward(x, g, *w, eps=1e-5)[0]
        assert numba.get_num_threads() == 1
    assert np.array_equal(inside, outside)
    assert numba.get_num_threads() == threads


# The block dots alone: int8 weights and nibbles times int8 activations, random and at the extremes,
# summed over the lanes; run here and, in a process whose Numba compiles without AVX2, on the
# generic vector code
BLOCK_DOTS = """
import numpy as np
from numba import njit
from nanoeuler_ops.cpu.lanes import int8_dot, load_bytes, load_nibble_block, nibble_dot, total

@njit
def block_dots(w, packed, x):
    xb = load_bytes(x, 0)
    return total(int8_dot(load_bytes(w, 0), xb)), total(nibble_dot(load_nibble_block(packed, 0), xb))

def check_block_dots():
    rng = np.random.default_rng(5)
    cases = [(rng.integers(-127, 128, 32), rng.integers(0, 16, 32), rng.integers(-127, 128, 32)) for _ in range(20)]
    cases += [(np.full(32, -127), np.full(32, 15), np.full(32, 127)), (np.full(32, 127), np.full(32, 15), np.full(32, -127))]
    for w, nibbles, x in cases:
        w, nibbles, x = w.astype(np.int8), nibbles.astype(np.uint8), x.astype(np.int8)
        packed = nibbles[:16] | (nibbles[16:] << 4)
        got = block_dots(w, packed, x)
        assert got == (np.dot(w.astype(np.int64), x), np.dot(nibbles.astype(np.int64), x)), (w, nibbles, x, got)
    return block_dots.inspect_asm(block_dots.signatures[0])
"""


def _returned_here(code, check):
    """What the function `check` defined by `code` returns, run in this process."""
    scope = {}
    exec(code, scope)
    return scope[check]()


def test_block_dots_on_avx2():
    if not lanes.AVX2:
        pytest.skip("Numba compiles for a processor without AVX2 here")
    asm = _returned_here(BLOCK_DOTS, "check_block_dots")
    for instruction in ("vpmaddubsw", "vpmaddwd", "vpsignb", "vpabsb"):
        assert instruction in asm, instruction


def _printed_without(features, code, tmp_path):
    """What `code` prints in a process whose Numba compiles without `features` (e.g. "avx2")."""
    from numba.core.codegen import get_host_cpu_features

    compiled = get_host_cpu_features()
    for feature in features:
        compiled = compiled.replace(f"+{feature}", f"-{feature}")
    env = dict(os.environ, NUMBA_CPU_FEATURES=compiled, NUMBA_CACHE_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    return run.stdout.split()


def test_block_dots_without_avx2(tmp_path):
    code = BLOCK_DOTS + ("from nanoeuler_ops.cpu import lanes\nassert not lanes.AVX2\n"
                         "asm = check_block_dots()\nprint('vpmaddubsw' in asm, 'pmaddubsw' in asm)\n")
    assert _printed_without(["avx2"], code, tmp_path) == ["False", "False"]


# Scales as lanes.py reads them: every float16 bit pattern (value, and 8 at a time load_lanes) as its
# float32 value, NaN as NaN; float32 arrays as they are; each lane broadcast. Run here and, in a
# process whose Numba compiles without F16C (and without AVX2), on the integer conversion
SCALES = """
import numpy as np
from numba import njit
from nanoeuler_ops.cpu.lanes import WIDTH, broadcast, load_lanes, total, value

@njit
def read(bits, out, lanes_out):
    for i in range(bits.size):
        out[i] = value(bits, i)
    for i in range(0, bits.size, WIDTH):
        v = load_lanes(bits, i)
        for lane in range(WIDTH):   # 8 times the lane, exactly (zeros keep their sign, inf stays inf)
            lanes_out[i + lane] = total(broadcast(v, lane)) / np.float32(8)

def check_scales():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    expected = bits.view(np.float16).astype(np.float32)
    out, lanes_out = np.zeros(bits.size, np.float32), np.zeros(bits.size, np.float32)
    read(bits, out, lanes_out)
    finite = ~np.isnan(expected)
    for got in (out, lanes_out):
        assert np.array_equal(got.view(np.uint32)[finite], expected.view(np.uint32)[finite])
        assert np.isnan(got[~finite]).all()
    floats = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    out, lanes_out = np.zeros(64, np.float32), np.zeros(64, np.float32)
    read(floats, out, lanes_out)
    assert np.array_equal(out, floats) and np.array_equal(lanes_out, floats)
    return read.inspect_asm(read.signatures[0])
"""


def test_scales_read_with_f16c():
    if not lanes.F16C:
        pytest.skip("Numba compiles for a processor without F16C here")
    assert "vcvtph2ps" in _returned_here(SCALES, "check_scales")


def test_scales_read_without_f16c(tmp_path):
    code = SCALES + ("from nanoeuler_ops.cpu import lanes\nassert not lanes.F16C and not lanes.AVX2\n"
                     "print('vcvtph2ps' in check_scales())\n")
    assert _printed_without(["f16c", "avx2"], code, tmp_path) == ["False"]


@pytest.mark.parametrize("fmt, group, zero_point", FORMATS)
def test_float16_scales_give_the_bits_of_float32_scales_of_their_values(fmt, group, zero_point):
    """The kernels read float16 scales and offsets (as their bits) as the float32 values they hold."""
    rng = np.random.default_rng(6)
    w = _matrix(rng, 13, 320, fmt, group, zero_point)
    x = rng.standard_normal((2, 320)).astype(np.float32)
    assert np.array_equal(_product(x, w, 1), _product(x, (w[0], *(a.astype(np.float32) for a in w[1:])), 1))


def test_kernels_find_the_threading_layer_started_at_import():
    """A cached kernel that reaches a parallel one through another compiled function (norm_linear's,
    calling the threaded quantized product) carries no hook that starts Numba's threading layer when
    it is loaded; common.py starts the layer at import, before any kernel can be loaded."""
    code = ("from nanoeuler_ops.cpu import norm_linear\nfrom numba.np.ufunc import parallel\n"
            "print(parallel._is_initialized)\n")
    env = dict(os.environ, NANOEULER_PIN_THREADS="0")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True"]
