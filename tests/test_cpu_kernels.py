"""CPU kernel paths the registry's gradcheck does not reach with its small samples: the matrix
product cut into one tile per thread (ops/cpu/common.py's gemm), and attention over
several blocks of query rows (the causal limit of each block, dk and dv summed over the blocks and
the query heads of a group), on one thread and on several, and on the plain-loop sgemm used where
OpenBLAS is missing. Each against float64 NumPy, and run twice for the same bits. And the
decoding kernels at a prompt's size, where they share their work among the threads: every row
the same bits as that row computed alone on one thread."""

import os
import subprocess
import sys

import numba
import numpy as np
import pytest

from nanoeuler_ops import attention as attention_reference
from nanoeuler_ops.cpu import attention, common, decode_attention, linear_residual, norm_linear, norm_swiglu


@pytest.mark.parametrize("M, N, K", [(1024, 688, 128), (688, 128, 1024), (129, 343, 65), (3, 1000, 200)])
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (False, True), (True, False), (True, True)])
def test_gemm_tiles_match_numpy(M, N, K, trans_a, trans_b):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((K, M) if trans_a else (M, K), dtype=np.float32)
    b = rng.standard_normal((N, K) if trans_b else (K, N), dtype=np.float32)
    c = rng.standard_normal((M, N), dtype=np.float32)
    exact = (a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b).astype(np.float64)
    scale = np.abs(exact).max()
    for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
        numba.set_num_threads(threads)
        try:
            out = common.gemm(a, b, np.full((M, N), np.nan, np.float32), trans_a, trans_b)
            again = common.gemm(a, b, np.empty((M, N), np.float32), trans_a, trans_b)
            added = common.gemm(a, b, c.copy(), trans_a, trans_b, accumulate=True)
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        assert np.abs(out - exact).max() < 1e-5 * scale
        assert np.abs(added - (c + exact)).max() < 1e-5 * scale
        assert np.array_equal(out, again)


def test_gemm_tiles_cover_the_output():
    for threads in (1, 2, 3, 16, 64):
        for M, N, K in ((1024, 688, 128), (688, 128, 1024), (5, 7, 100000), (1, 4096, 128)):
            rows, cols = common._tiles(M, N, K, threads)
            assert 1 <= rows <= max(1, M) and 1 <= cols <= max(1, N) and rows * cols <= threads


# several query blocks with a short last one (300, 129 = 4 x 32 + 1), GQA, odd head size, S > T
ATTENTION_CASES = [(2, 300, 300, 4, 2, 16), (1, 70, 260, 2, 1, 8), (2, 129, 129, 2, 2, 6)]


def _attention_errors_and_results(B, T, S, H, KV, D):
    """Relative errors of the CPU attention (o, lse, dq, dk, dv) against float64, and those results."""
    rng = np.random.default_rng(1)
    q, do = (rng.standard_normal((B, T, H, D)) for _ in range(2))
    k, v = (rng.standard_normal((B, S, KV, D)) for _ in range(2))
    o, saved = attention.forward(*(x.astype(np.float32) for x in (q, k, v)))
    grads = attention.backward(do.astype(np.float32), saved, *(x.astype(np.float32) for x in (q, k, v)))
    o_ref, saved_ref = attention_reference.forward(q, k, v)
    grads_ref = attention_reference.backward(do, saved_ref, q, k, v)
    got, want = (o, saved[1], *grads), (o_ref, saved_ref[1], *grads_ref)
    return [float(np.abs(g - w).max() / max(1.0, np.abs(w).max())) for g, w in zip(got, want)], got


@pytest.mark.parametrize("B, T, S, H, KV, D", ATTENTION_CASES)
def test_attention_over_several_query_blocks(B, T, S, H, KV, D):
    assert T > attention.QUERY_BLOCK
    errors, results = _attention_errors_and_results(B, T, S, H, KV, D)
    assert max(errors) < 2e-5, errors
    for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):   # the same bits again, on 1 thread and on all
        numba.set_num_threads(threads)
        try:
            _, again = _attention_errors_and_results(B, T, S, H, KV, D)
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        assert all(np.array_equal(a, b) for a, b in zip(results, again))


def test_attention_without_openblas():
    # NANOEULER_NUMPY_MATMUL hides OpenBLAS: the kernels' sgemm calls reach common._loop_sgemm
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_cpu_kernels as t\n"
            "from nanoeuler_ops.cpu import common; assert common._OPENBLAS is None\n"
            "print(max(max(t._attention_errors_and_results(*case)[0]) for case in t.ATTENTION_CASES))\n")
    env = dict(os.environ, NANOEULER_NUMPY_MATMUL="1")
    run = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert float(run.stdout.split()[-1]) < 2e-5


def test_decoding_kernels_threaded_give_each_row_its_bits_alone():
    """Above their thresholds (a 128-token prefill) the decoding kernels share outputs, rows and
    queries among the threads; each row must still come out as a one-token step computes it."""
    rng = np.random.default_rng(0)
    T, C, H, KV, D, F = 128, 128, 4, 2, 32, 344
    x = rng.standard_normal((T, C), dtype=np.float32)
    g = rng.standard_normal(C, dtype=np.float32)
    wqkv = rng.standard_normal(((H + 2 * KV) * D, C), dtype=np.float32)
    wgu = rng.standard_normal((2 * F, C), dtype=np.float32)
    wd = rng.standard_normal((C, F), dtype=np.float32)
    act = rng.standard_normal((T, F), dtype=np.float32)
    assert T * wqkv.shape[0] * C >= 1 << 22 and T * F >= 1 << 14   # the threaded paths
    rows = {"norm_linear": (lambda r: norm_linear.forward(x[r], g, wqkv, eps=1e-5)[0]),
            "norm_swiglu": (lambda r: norm_swiglu.forward(x[r], g, wgu, eps=1e-5)[0]),
            "linear_residual": (lambda r: linear_residual.forward(act[r], x[r], wd)[0])}
    for name, run in rows.items():
        whole = run(slice(0, T))
        alone = np.concatenate([run(slice(t, t + 1)) for t in range(T)])
        assert np.array_equal(whole, alone), name
    # the prompt in one pass against token by token, caches included
    qkv = rng.standard_normal((1, T, H + 2 * KV, D), dtype=np.float32)
    caches = [np.zeros((1, T, KV, D), np.float32) for _ in range(4)]
    whole, _ = decode_attention.forward(qkv, caches[0], caches[1], np.zeros(1, np.int64), n_kv_heads=KV, theta=1e4)
    steps = [decode_attention.forward(qkv[:, t:t + 1], caches[2], caches[3], np.array([t]), n_kv_heads=KV,
                                      theta=1e4)[0] for t in range(T)]
    assert H * T * (T + 1) // 2 * D >= 1 << 18   # the threaded path
    assert np.array_equal(whole, np.concatenate(steps, axis=1))
    assert np.array_equal(caches[0], caches[2]) and np.array_equal(caches[1], caches[3])


PINNED_AFFINITIES = """
import os
from nanoeuler_ops.cpu.common import pin_threads
print(pin_threads())
print([len(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")].count(1))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux's thread affinity and two cores")
@pytest.mark.parametrize("setting", ["1", "0"])
def test_pin_threads_binds_each_worker_to_one_core(setting):
    # Numba's worker (thread 1 of 2) gets one core where asked; the main thread keeps the process's
    # cores. Run alone: the binding would stay for the rest of a test process.
    env = {**os.environ, "NANOEULER_PIN_THREADS": setting, "NUMBA_NUM_THREADS": "2"}
    pinned, threads_on_one_core = subprocess.run([sys.executable, "-c", PINNED_AFFINITIES], env=env,
                                                 capture_output=True, text=True, check=True).stdout.split()
    assert pinned == str(setting == "1")
    assert int(threads_on_one_core) == (1 if setting == "1" else 0)
