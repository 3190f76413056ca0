"""The CPU's quantized matrix products (ops/cpu/row_products.py): int8 a scale per output channel
and per group of 32, int4 groups of 32 and 64 with and without a zero point, against
nanoeuler_core.quantized.dequantize in float64; and every row the same bits alone on one thread
as among other rows on several, below and above the size from which a product shares its
outputs among the threads (also inside the backend's serial block, where such a product takes
the threads back and gives them up after)."""

import numba
import numpy as np
import pytest

from nanoeuler_core import quantized
from nanoeuler_core.registry import backend
from nanoeuler_ops.cpu import norm_linear
from nanoeuler_ops.cpu.row_products import THREADED_PRODUCTS, quantized_matmul_rows

# (format, group, zero point): per channel, GGUF's Q8_0, Q4_1 and Q4_0 blocks, and 4-bit groups of two blocks
FORMATS = [("int8", 0, True), ("int8", 32, True), ("int4", 32, True), ("int4", 32, False), ("int4", 64, False)]
THREADS = numba.config.NUMBA_NUM_THREADS


def _matrix(rng, O, K, fmt, group, zero_point):
    return quantized.quantize(rng.standard_normal((O, K)) / K ** 0.5, fmt, group, zero_point)


def _product(x, w, threads):
    out = np.full((x.shape[0], w[0].shape[0]), np.nan, np.float32)
    quantized_matmul_rows(x, *w, out, threads)
    return out


# (N, O, K): outputs not a multiple of the 4-output tiles, rows of one group of 64, a product of
# the threaded size, and rows of SmolLM2-135M's down projection
SIZES = [(3, 7, 64), (2, 5, 64), (1, THREADED_PRODUCTS // 576 + 3, 576), (2, 576, 1536)]


@pytest.mark.parametrize("N, O, K", SIZES)
@pytest.mark.parametrize("fmt, group, zero_point", FORMATS)
def test_quantized_products_match_the_dequantized_matrix(N, O, K, fmt, group, zero_point):
    """Within float32's error of a sum of K products: |error| <= K u sum_k |x_k w_k| (u = 2^-24)."""
    rng = np.random.default_rng(0)
    w = _matrix(rng, O, K, fmt, group, zero_point)
    x = rng.standard_normal((N, K)).astype(np.float32)
    exact = x.astype(np.float64) @ quantized.dequantize(*w).T
    bound = K * 2.0 ** -24 * (np.abs(x.astype(np.float64)) @ np.abs(quantized.dequantize(*w)).T)
    for threads in sorted({1, THREADS}):
        out = _product(x, w, threads)
        assert np.all(np.abs(out - exact) <= bound), (threads, np.abs(out - exact).max(), bound.min())


def test_int8_groups_that_are_not_whole_blocks_match_the_dequantized_matrix():
    """Groups of 20 (no 32-weight block) and of 100 (three blocks and 4 weights) go partly through scalar sums."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 200)).astype(np.float32)
    for group in (20, 100):
        w = _matrix(rng, 9, 200, "int8", group, True)
        exact = x.astype(np.float64) @ quantized.dequantize(*w).T
        bound = 200 * 2.0 ** -24 * (np.abs(x.astype(np.float64)) @ np.abs(quantized.dequantize(*w)).T)
        assert np.all(np.abs(_product(x, w, 1) - exact) <= bound)


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
