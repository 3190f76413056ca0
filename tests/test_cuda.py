"""The CUDA kernels against their CPU twins at the `gpu` preset's sizes, on a real GPU only
(the simulator covers small shapes through tests/test_ops.py). Every registered op with CUDA
kernels is here: at model sizes where its spec declares `model_inputs`, else on its ordinary
samples. Agreement is measured as ||cuda - cpu|| / ||cpu|| per output, float32 accumulations in
different orders on each side."""

import numba
import numpy as np
import pytest
from numba import cuda

from nanoeuler_core import registry
from nanoeuler_core.engine.config import ModelConfig
from nanoeuler_core.engine.gradcheck import random_like, run_backend, stored_values

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(bool(numba.config.ENABLE_CUDASIM) or not cuda.is_available(),
                                 reason="needs a real CUDA GPU")]

GPU = ModelConfig.preset("gpu")
N = 4 * GPU.ctx_len   # rows of a batch of 4 sequences
C, H, KV, D, F = GPU.dim, GPU.n_heads, GPU.n_kv_heads, GPU.head_dim, GPU.hidden_dim
REL_TOL = 2e-5
BF16_REL_TOL = 1e-2   # bf16 storage of outputs and intermediates (8 significant bits), float32 sums
CUDA_OPS = sorted(name for name, op in registry.ops().items() if "cuda" in op.backends)
BF16_OPS = [name for name in CUDA_OPS if "bf16" in registry.op(name).precisions_on("cuda")]


def _samples(name, rng, precision="fp32"):
    """The op's call at the gpu preset's sizes, or its ordinary samples where it declares none."""
    op = registry.op(name)
    if op.model_inputs is not None:
        return [op.model_inputs(rng, GPU, N)]
    return [sample for sample in op.sample_inputs(rng) if precision in sample.precisions]


def _rel_err(x, y):
    return float(np.linalg.norm(np.asarray(x, np.float64) - y) / max(np.linalg.norm(y), 1e-30))


def _compare_backends(name, inputs, attrs, rng, precision="fp32"):
    op = registry.op(name)
    inputs = tuple(stored_values(x, precision) if x.dtype.kind == "f" else x for x in inputs)
    dout = None
    if op.differentiable:
        dout = random_like(op.impl("cpu").forward(*inputs, **attrs)[0], rng, precision)
    cpu_out, cpu_grads = run_backend(op, "cpu", inputs, attrs, dout)
    gpu_out, gpu_grads = run_backend(op, "cuda", inputs, attrs, dout, precision)
    errors = {f"out{i}": _rel_err(g, c) for i, (g, c) in enumerate(zip(gpu_out, cpu_out))}
    for i, (g, c) in enumerate(zip(gpu_grads or (), cpu_grads or ())):
        if c is not None:
            errors[f"grad{i}"] = _rel_err(g, c)
    return errors


@pytest.mark.parametrize("name", CUDA_OPS)
def test_cuda_matches_cpu_at_model_size(name):
    rng = np.random.default_rng(0)
    for sample in _samples(name, rng):
        errors = _compare_backends(name, sample.inputs, sample.attrs, rng)
        assert all(np.isfinite(e) and e < REL_TOL for e in errors.values()), f"{name} {sample.name}: {errors}"


@pytest.mark.parametrize("name", BF16_OPS)
def test_cuda_bf16_matches_cpu_at_model_size(name):
    """bf16 storage on the GPU against float32 on the CPU, from the same bf16-rounded inputs."""
    rng = np.random.default_rng(0)
    for sample in _samples(name, rng, "bf16"):
        errors = _compare_backends(name, sample.inputs, sample.attrs, rng, "bf16")
        assert all(np.isfinite(e) and e < BF16_REL_TOL for e in errors.values()), f"{name} {sample.name}: {errors}"


@pytest.mark.parametrize("b, t, s, h, kv, d", [(2, 77, 77, 6, 2, 32), (3, 1, 130, 4, 4, 64), (1, 200, 333, 8, 1, 64),
                                               (2, 130, 200, 4, 2, 128), (2, 512, 512, 12, 4, 64)])
def test_attention_bf16_tensor_cores(b, t, s, h, kv, d):
    """The tensor-core kernels: lengths off the 64-row tiles, decoding (S > T), GQA groups of 1 to 8,
    head sizes 32 to 128, and the gpu preset's shape."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((b, t, h, d))
    k, v = rng.standard_normal((2, b, s, kv, d))
    errors = _compare_backends("attention", (q, k, v), {}, rng, "bf16")
    assert all(e < BF16_REL_TOL for e in errors.values()), errors


def test_attention_decode_with_kv_cache():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 3, H, D))
    k, v = rng.standard_normal((2, 2, 300, KV, D))
    errors = _compare_backends("attention", (q, k, v), {}, rng)
    assert all(e < REL_TOL for e in errors.values()), errors


@pytest.mark.parametrize("b, t, s, h, kv, d", [(2, 77, 77, 6, 2, 36), (3, 1, 130, 4, 4, 64), (1, 200, 333, 8, 1, 64),
                                               (2, 130, 200, 4, 2, 128)])
def test_attention_odd_shapes(b, t, s, h, kv, d):
    """Lengths off every kernel tile, a head size off the register tile (padded columns),
    single-query decoding, plain multi-head, one key/value head for all queries, and a head
    size spanning two backward tiles."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((b, t, h, d))
    k, v = rng.standard_normal((2, b, s, kv, d))
    errors = _compare_backends("attention", (q, k, v), {}, rng)
    assert all(e < REL_TOL for e in errors.values()), errors


def test_linear_tf32_within_its_bound():
    from nanoeuler_ops.cuda import cublas
    if not cublas.uses_cublas():
        pytest.skip("cuBLAS (nvmath-python) not installed")
    rng = np.random.default_rng(2)
    sample = registry.op("linear").model_inputs(rng, GPU, N)
    errors = _compare_backends("linear", sample.inputs, sample.attrs, rng, "tf32")
    assert all(e < 2e-3 for e in errors.values()), errors


def test_graph_replay_matches_eager():
    """BACKEND.capture: a CUDA graph of a few ops replays on the arena's buffers and tracks new inputs."""
    from nanoeuler_ops.cuda import BACKEND, linear, rmsnorm, swiglu

    rng = np.random.default_rng(3)
    x = BACKEND.asarray(rng.standard_normal((N, C)))
    norm_w = BACKEND.asarray(1.0 + 0.1 * rng.standard_normal(C))
    w_gate_up = BACKEND.asarray(0.02 * rng.standard_normal((2 * F, C)))

    def step():
        h, _ = rmsnorm.forward(x, norm_w, eps=1e-5)
        y, _ = swiglu.forward(linear.forward(h, w_gate_up, precision=registry.FP32)[0])
        return y

    replay, first = BACKEND.capture(step)
    x.copy_to_device(rng.standard_normal((N, C)).astype(np.float32))
    replayed = replay()
    BACKEND.synchronize()
    assert replayed is first  # the same buffers, new values
    assert np.array_equal(replayed.copy_to_host(), step().copy_to_host())
