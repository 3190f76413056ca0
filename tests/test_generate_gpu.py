"""Decoding on a real GPU: the decoding ops against their CPU twins at the `gpu` preset's sizes (with
int8 and int4 matrices, against the float64 reference), batch invariance of the CUDA kernels bit
for bit, and whole generations (captured CUDA graphs against eager launches, speculative against
plain, batches against rows alone; bf16, int8 and int4 weights). Skipped where there is no GPU (the
simulator covers small shapes through tests/test_ops.py, test_generate.py and test_quantized_cuda.py)."""

import numba
import numpy as np
import pytest
from numba import cuda

from nanoeuler_core import quantized, registry
from nanoeuler_core.engine.config import ModelConfig
from nanoeuler_core.engine.gradcheck import run_backend
from nanoeuler_core.inference.decoder import DecodeStats, Sampling
from nanoeuler_core.inference.decoder.forward import DECODE_OPS
from nanoeuler_core.inference.decoder.weights import WEIGHT_OPS
from nanoeuler_ops.sample import warped
from test_generate import (MATRIX_OPS, PROMPTS, cycle_model, decode, on_backend,  # noqa: F401  (a fixture)
                           run_with_bf16_weights)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(bool(numba.config.ENABLE_CUDASIM) or not cuda.is_available(),
                                 reason="needs a real CUDA GPU")]

GPU = ModelConfig.preset("gpu")
K, V = GPU.n_mtp, GPU.vocab_size
REL_TOL = 2e-5


def _inputs(name, rng, rows):
    """(inputs, attrs) of a decoding op at the gpu preset's sizes, `rows` tokens (its spec's model_inputs)."""
    sample = registry.op(name).model_inputs(rng, GPU, rows)
    return sample.inputs, sample.attrs


def _rel_err(x, y):
    return float(np.linalg.norm(np.asarray(x, np.float64) - y) / max(np.linalg.norm(y), 1e-30))


def _outputs(name, inputs, attrs, backend):
    inputs = tuple(x.astype(np.float32) if x.dtype.kind == "f" else x for x in inputs)
    return run_backend(registry.op(name), backend, inputs, attrs)[0]


def _run(name, inputs, attrs, backend, weights="fp32"):
    """The op's first output; `weights` "bf16": the matrix rounded to bf16, as the decoder reads it."""
    if weights == "bf16":
        return run_with_bf16_weights(name, inputs, attrs, backend)
    return _outputs(name, inputs, attrs, backend)[0]


# the decoding ops with inputs at model sizes, in float32; those reading bf16 weights, with them too
CASES = [(name, "fp32") for name in DECODE_OPS if registry.op(name).model_inputs is not None] + \
        [(name, "bf16") for name in WEIGHT_OPS]


@pytest.mark.parametrize("name, weights", CASES)
@pytest.mark.parametrize("rows", [1, 12])
def test_cuda_matches_cpu_at_model_size(name, weights, rows):
    """float32 weights: the FMA kernels; bf16: the tensor-core kernels, against the CPU on the same
    bf16 values."""
    inputs, attrs = _inputs(name, np.random.default_rng(0), rows)
    error = _rel_err(_run(name, inputs, attrs, "cuda", weights), _run(name, inputs, attrs, "cpu", weights))
    assert np.isfinite(error) and error < REL_TOL, error


@pytest.mark.parametrize("name, weights", CASES)
def test_cuda_rows_do_not_depend_on_the_batch(name, weights):
    """A row's output is bit for bit the same computed alone or as row 4 of 9 (decode_attention:
    the last row of 3, fed with 3 tokens or alone with its first)."""
    inputs, attrs = _inputs(name, np.random.default_rng(1), 9)
    together = _run(name, inputs, attrs, "cuda", weights)
    if name == "decode_attention":
        qkv, k_cache, v_cache, pos = inputs
        alone = _run(name, (qkv[2:, :1], k_cache[2:], v_cache[2:], pos[2:]), attrs, "cuda")
        assert np.array_equal(together[2, 0], alone[0, 0])
    else:
        alone = _run(name, tuple(x[4:5] if x.shape[0] == 9 else x for x in inputs), attrs, "cuda", weights)
        assert np.array_equal(together[4], alone[0])


def _quantized_inputs(name, rng, rows, fmt):
    """(inputs, attrs) at model size in float32 values, the op's matrix quantized as the decoder
    quantizes it (quantized.DEFAULT_GROUP)."""
    inputs, attrs = _inputs(name, rng, rows)
    i = MATRIX_OPS[name]
    inputs = tuple(x.astype(np.float32).astype(np.float64) for x in inputs)
    return inputs[:i] + quantized.quantize(inputs[i], fmt, quantized.DEFAULT_GROUP[fmt]) + inputs[i + 1:], attrs


@pytest.mark.parametrize("fmt", quantized.FORMATS)
@pytest.mark.parametrize("name", list(MATRIX_OPS))
def test_quantized_cuda_matches_the_reference_at_model_size(name, fmt):
    """int8 and int4 matrices: the dp4a kernels give the float64 reference (x rounded to 8 bits by
    blocks of 32; a value the float32 norm rounds the other way now and then moves an output by a
    step), and a row alone is bit for bit row 4 of 9."""
    inputs, attrs = _quantized_inputs(name, np.random.default_rng(3), 9, fmt)
    together = run_backend(registry.op(name), "cuda", inputs, attrs, float32_inputs=(3, 4))[0][0]
    error = _rel_err(together, registry.op(name).reference.forward(*inputs, **attrs)[0])
    assert np.isfinite(error) and error < 1e-4, error
    alone = run_backend(registry.op(name), "cuda", tuple(x[4:5] if x.shape[0] == 9 else x for x in inputs), attrs,
                        float32_inputs=(3, 4))[0][0]
    assert np.array_equal(together[4], alone[0])


@pytest.mark.parametrize("fmt", quantized.FORMATS)
def test_cuda_quantized_generation(fmt):
    """A `gpu` model decoding with int8 or int4 matrices: the captured step equals eager launches,
    speculative greedy equals plain greedy, a batch equals its rows alone."""
    from nanoeuler_core import Model

    model = Model(GPU, backend="cuda")
    plain = decode(model, PROMPTS, 40, speculative=False, weights=fmt)
    assert plain == decode(model, PROMPTS, 40, speculative=False, capture=False, weights=fmt)
    assert plain == decode(model, PROMPTS, 40, speculative=True, weights=fmt)
    assert plain == [decode(model, [p], 40, speculative=False, weights=fmt)[0] for p in PROMPTS]


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.0, 0, 1.0), (0.8, 0, 1.0), (1.0, 40, 0.9)])
def test_sample_matches_cpu_at_model_size(temperature, top_k, top_p):
    rng = np.random.default_rng(2)
    B = 8
    logits = 3 * rng.standard_normal((B, K, K, V))
    drafts = np.stack([[warped(r, temperature or 1.0, top_k, top_p) for r in 3 * rng.standard_normal((K - 1, V))]
                       for _ in range(B)])
    tokens = rng.integers(0, V, (B, K))
    tokens[:, 1] = np.argmax(logits[:, 0, 0], axis=-1) if temperature == 0 else np.argmax(drafts[:, 0], axis=-1)
    settings = (np.full(B, float(temperature)), np.full(B, top_k), np.full(B, float(top_p)))   # every row's
    inputs = (logits, tokens, drafts, rng.integers(0, 2**62, B), rng.integers(-1, 100, B), rng.integers(0, 400, B),
              *settings, np.full((B, (V + 31) // 32), -1, np.int32))   # every token allowed
    attrs = {"max_pos": 512}
    gpu, cpu = _outputs("sample", inputs, attrs, "cuda"), _outputs("sample", inputs, attrs, "cpu")
    for g, c in zip(gpu, cpu):
        np.testing.assert_allclose(g, c, rtol=1e-4, atol=1e-6)


def test_cuda_generation(cycle_model):  # noqa: F811
    """On the GPU (bf16 weights, the default): the captured step equals eager launches, speculative
    greedy equals plain greedy, a batch equals its rows alone (greedy and sampled); with float32
    weights, greedy tokens equal the CPU's."""
    model = on_backend(cycle_model, "cuda")
    stats = DecodeStats()
    plain = decode(model, PROMPTS, 50, speculative=False)
    assert plain == decode(model, PROMPTS, 50, speculative=False, capture=False)
    assert plain == decode(model, PROMPTS, 50, speculative=True, stats=stats)
    assert 0 < stats.accepted < stats.proposed
    assert decode(model, PROMPTS, 50, speculative=False, weights="fp32") == decode(cycle_model, PROMPTS, 50, False)
    sampling = Sampling(1.0, top_k=5, top_p=0.9)
    for speculative in (False, True):
        batch = decode(model, PROMPTS, 30, speculative, sampling, seeds=[7, 8, 9, 10])
        assert batch == [decode(model, [p], 30, speculative, sampling, seeds=[7 + i])[0] for i, p in enumerate(PROMPTS)]
        assert batch == decode(model, PROMPTS, 30, speculative, sampling, seeds=[7, 8, 9, 10], capture=False)


def test_captured_prefill_equals_its_eager_run():
    """A decoder that captures replays its chunk forwards; one that does not runs them eagerly, over
    the same shapes. Both must leave a prompt's cache the same bit for bit, or a prompt's greedy
    generation could depend on capturing."""
    from nanoeuler_core import Model, ModelConfig
    from nanoeuler_core.inference.decoder import Decoder

    model = Model(ModelConfig.preset("gpu"), backend="cuda")
    ids = np.random.default_rng(0).integers(0, V, 300).tolist()
    be = model.backend
    runs = []
    for capture in (True, False):
        decoder = Decoder(model, 1, False, capture=capture, prefix_cache_tokens=0)
        decoder.prefill.fill(0, ids, 0)
        runs.append([be.to_host(a[0, :len(ids)]) for a in (*decoder.cache.kv[0], *decoder.cache.kv[-1])])
    for captured, eager in zip(*runs):
        np.testing.assert_array_equal(captured, eager)


def test_batch_too_large_for_the_gpu_is_one_clear_error():
    from nanoeuler_core import Model, ModelConfig
    from nanoeuler_core.inference.decoder import decoder_for

    model = Model(ModelConfig.preset("gpu"), backend="cuda")
    with pytest.raises(ValueError, match="rows needs .* GiB .* memory free on the device"):
        decoder_for(model, 200_000, False, Sampling())   # a 1.7 TB KV cache
    assert decoder_for(model, 1, False, Sampling()).generate([[1, 2, 3]], 4, [0])   # still usable after
