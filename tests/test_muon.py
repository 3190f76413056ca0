"""The muon op's float64 reference: Newton-Schulz orthogonalizes, one step matches a hand
computation, and steps match PyTorch's torch.optim.Muon. The registry's tests (tests/test_ops.py)
hold the CPU and CUDA kernels to this reference. And the batched product the CUDA kernels run
Newton-Schulz on (cuBLAS on a GPU, the Numba fallback on the simulator) against NumPy, and the
kernels compiled for a GPU."""

import math

import numpy as np
import pytest

from nanoeuler_core import registry
from nanoeuler_core.registry import bf16_values
from nanoeuler_ops.muon import newton_schulz
from test_tensor_cores import compiled_without_simulator


@pytest.mark.parametrize("shape", [(32, 64), (96, 48)])
def test_newton_schulz_brings_every_singular_value_near_one(shape):
    # A gaussian U's singular values spread over a factor of about 5 here; five steps of the quintic
    # bring each into about [0.7, 1.2], not to 1 (the coefficients trade that for speed). Square
    # matrices are left out: their smallest singular values come arbitrarily close to 0, which five
    # steps lift only from about 1/500 of ||U||_F.
    rng = np.random.default_rng(0)
    for _ in range(10):
        U = rng.standard_normal(shape)
        O = newton_schulz(U, 5, 1e-7)
        assert O.shape == shape
        singular = np.linalg.svd(O, compute_uv=False)
        assert singular.min() > 0.6 and singular.max() < 1.3, singular


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_one_step_by_hand(backend):
    # Two repeats of a (1, 2) and a (2, 1) matrix. Without Newton-Schulz steps and without nesterov,
    # O = M / ||M||_F = G / ||G||_F per matrix, whatever the clipping and beta: each matrix's own
    # norm, so the layout shows. The clipping scales the momentum only.
    grads = np.array([3.0, 4.0, 0.6, 0.8, 0.0, 2.0, 5.0, 12.0])
    params = np.ones(8)
    momentum = np.zeros(8)
    sched = np.array([0.1, 1.0])
    impl = registry.op("muon").impl(backend)
    be = registry.backend(backend)
    args = [be.asarray(x) for x in (params, grads, momentum, sched)]
    norm, saved = impl.forward(*args, pattern=((1, 2), (2, 1)), repeats=2, weight_decay=0.5, max_grad_norm=1.0,
                               beta=0.5, nesterov=False, ns_steps=0)
    total = math.sqrt(9 + 16 + 0.36 + 0.64 + 4 + 25 + 144)
    O = np.array([0.6, 0.8, 0.6, 0.8, 0.0, 1.0, 5 / 13, 12 / 13])
    # W = W - lr wd W - lr 0.2 sqrt(max(R, C)) O = 1 - 0.05 - 0.02 sqrt(2) O
    np.testing.assert_allclose(args[0], 0.95 - 0.02 * math.sqrt(2) * O, rtol=1e-6)
    np.testing.assert_allclose(args[2], 0.5 * grads / (total + 1e-6), rtol=1e-6)
    np.testing.assert_allclose(norm, [total], rtol=1e-6)
    assert saved == ()


def test_steps_match_torch_muon():
    """Three steps on two repeats of a wide, a tall and a square matrix, against torch.optim.Muon
    with nesterov and the AdamW-matched learning rate, which runs Newton-Schulz in bf16: the
    momentum agrees to float64 rounding, the updates to bf16's few percent."""
    torch = pytest.importorskip("torch")
    pattern, repeats = ((24, 40), (40, 24), (16, 16)), 2
    rng = np.random.default_rng(1)
    shapes = [shape for _ in range(repeats) for shape in pattern]
    weights = [rng.standard_normal(shape) for shape in shapes]
    params = np.concatenate([w.reshape(-1) for w in weights])
    momentum = np.zeros_like(params)
    tensors = [torch.tensor(w, requires_grad=True) for w in weights]
    optimizer = torch.optim.Muon(tensors, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                                 adjust_lr_fn="match_rms_adamw")
    impl = registry.op("muon").reference
    for _ in range(3):
        before = params.copy()
        grads = [rng.standard_normal(shape) for shape in shapes]
        impl.forward(params, np.concatenate([g.reshape(-1) for g in grads]), momentum, np.array([0.02, 1.0]),
                     pattern=pattern, repeats=repeats, weight_decay=0.1, max_grad_norm=0.0)
        for t, g in zip(tensors, grads):
            t.grad = torch.tensor(g)
        optimizer.step()
        theirs = np.concatenate([t.detach().numpy().reshape(-1) for t in tensors])
        their_momentum = np.concatenate([optimizer.state[t]["momentum_buffer"].numpy().reshape(-1) for t in tensors])
        np.testing.assert_allclose(momentum, their_momentum, rtol=1e-12, atol=1e-12)
        update, their_update = params - before, theirs - before
        assert np.linalg.norm(update - their_update) < 3e-2 * np.linalg.norm(update)
        params[:] = theirs   # the next step from the same weights


@pytest.mark.parametrize("trans_b, alpha, beta", [(True, 1.0, 0.0), (False, 2.0315, -4.775)])
def test_matmul_batched_bf16(trans_b, alpha, beta):
    """Newton-Schulz's two forms, A = X X^T and B = c A A + b B, on three (20, 24) by (24, 18)
    products (two 16 x 16 fallback tiles each way, the last short): bf16 storage, float32 sums."""
    from nanoeuler_ops.cuda import BACKEND
    from nanoeuler_ops.cuda.cublas import matmul_batched

    rng = np.random.default_rng(2)
    a, out = rng.standard_normal((3, 20, 24)), rng.standard_normal((3, 20, 18))
    b = rng.standard_normal((3, 18, 24) if trans_b else (3, 24, 18))
    a_dev, b_dev, out_dev = (BACKEND.asarray(x, "bf16") for x in (a, b, out))
    a, b, out = (bf16_values(x.copy_to_host()).astype(np.float64) for x in (a_dev, b_dev, out_dev))
    matmul_batched(a_dev, b_dev, out_dev, trans_b=trans_b, alpha=alpha, beta=beta)
    expected = alpha * a @ (b.transpose(0, 2, 1) if trans_b else b) + beta * out
    # out rounded to bf16: off by at most 2^-8 of its value; the float32 sums by far less
    np.testing.assert_allclose(BACKEND.to_host(out_dev), expected, rtol=2 ** -8, atol=1e-5 * np.abs(expected).max())


GPU_COMPILE = """
import sys
from types import SimpleNamespace
from numba import types
from numba.cuda import compile_ptx
from numba.cuda.cudadrv import nvvm
if not nvvm.is_available():
    sys.exit(77)
import numba.cuda.dispatcher   # overloads are typed for the current GPU: here there is none, so a Hopper
numba.cuda.dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=(9, 0))
from nanoeuler_ops.cuda import cublas, muon
f32, f64, i64, flag = types.float32, types.float64, types.int64, types.boolean
def array(dtype, ndim):
    return types.Array(dtype, ndim, "C")
flat, bf16 = array(f32, 1), types.uint16
kernels = {"momentum": (muon._momentum, (flat, flat, array(bf16, 3), array(f64, 2), array(f64, 1), flat) + (i64,) * 4
                        + (f32, flag, f32)),
           "frobenius_norms": (muon._frobenius_norms, (array(f64, 2), flat, f32)),
           "normalize": (muon._normalize, (array(bf16, 2), flat)),
           "update": (muon._update, (flat, array(bf16, 3), flat) + (i64,) * 4 + (f32, f32)),
           "matmul_tiled bf16": (cublas._matmul_tiled, (array(bf16, 3),) * 3 + (flag, flag, f32, f32)),
           "matmul_tiled fp32": (cublas._matmul_tiled, (array(f32, 3),) * 3 + (flag, flag, f32, f32))}
for name, (kernel, argtypes) in kernels.items():
    compile_ptx(kernel.py_func, argtypes, cc=(9, 0))
    print("compiled", name)
"""


def test_kernels_compile_for_a_gpu():
    """The simulator runs a kernel as Python and accepts what the compiler refuses (a shared array
    sized by an expression, mixed float types): Muon's kernels and the batched fallback product,
    compiled to PTX through NVVM in a process without the simulator (no GPU needed)."""
    assert compiled_without_simulator(GPU_COMPILE).count("compiled") == 6
