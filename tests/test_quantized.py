"""Weight-only quantized matrices (nanoeuler_core/quantized.py): the formats, a model quantized,
saved and loaded, and decoding that reads them."""

import numpy as np
import pytest

from cli_helpers import run_cli
from cycle_model import cycle_trained
from nanoeuler_core import quantized
from nanoeuler_core.engine.config import ModelConfig
from nanoeuler_core.engine.model import Model
from nanoeuler_core.engine.optim import AdamW
from nanoeuler_core.inference.decoder import Decoder, DecodeStats, Sampling
from nanoeuler_core.inference.decoder.weights import DecodeWeights
from nanoeuler_core.training.step import TrainStep

FORMATS = [("int8", 0, True), ("int8", 32, True), ("int4", 32, True), ("int4", 64, False)]
CFG = ModelConfig(vocab_size=16, dim=64, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=128, ctx_len=24, n_mtp=3)
PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 11], list(range(16)) + [3] * 8]


@pytest.mark.parametrize("fmt,group,zero_point", FORMATS)
def test_quantized_weights_are_within_half_a_step(fmt, group, zero_point):
    """Each weight comes back within half its group's scale (a step of the grid; without a zero
    point, a whole step at the end opposite the largest weight, which 0..15 reaches one short), and
    the packed arrays have the format's shapes and types."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((7, 128)) * np.exp(rng.standard_normal((7, 1)))   # rows of different scales
    q, scale, zero = quantized.quantize(w, fmt, group, zero_point)
    assert quantized.weight_format(q, scale, zero) == (fmt, group or 128, 128)
    step = np.repeat(np.abs(scale.astype(np.float64)), (group or 128), axis=1)
    bound = (0.5 if zero_point else 1.0) * step * (1 + 1e-6) + 1e-7
    assert np.all(np.abs(quantized.dequantize(q, scale, zero) - w) <= bound)
    assert q.dtype == (np.int8 if fmt == "int8" else np.uint8) and q.shape == (7, 128 if fmt == "int8" else 64)


def test_4_bit_blocks_are_packed_as_gguf_packs_them():
    """Byte j of a block of 32 holds weight j in its low nibble and weight j + 16 in its high one."""
    nibbles = np.arange(64, dtype=np.uint8).reshape(1, 64) % 16
    packed = quantized.pack4(nibbles)
    assert packed.shape == (1, 32)
    assert packed[0, 3] == nibbles[0, 3] | nibbles[0, 19] << 4 and packed[0, 16 + 5] == nibbles[0, 37] | nibbles[0, 53] << 4
    assert np.array_equal(quantized.unpack4(packed), nibbles)


def test_symmetric_4_bits_keep_the_largest_weight_exact():
    """Without a zero point (GGUF's Q4_0) the weight of largest magnitude maps to -8 * scale exactly."""
    w = np.linspace(-1.0, 3.0, 32).reshape(1, 32)
    q, scale, zero = quantized.quantize(w, "int4", 32, zero_point=False)
    assert zero[0, 0] == -8 * scale[0, 0] and quantized.dequantize(q, scale, zero)[0, -1] == pytest.approx(3.0)


@pytest.mark.parametrize("fmt,K,group,message", [("int4", 48, 32, "int4: a group of 32 weights does not divide rows of 48"),
                                                 ("int4", 64, 16, "int4: groups are whole blocks of 32 weights"),
                                                 ("int8", 64, 24, "int8: a group of 24 weights does not divide"),
                                                 ("int3", 64, 0, "unknown weight format 'int3'")])
def test_formats_that_do_not_fit_are_refused(fmt, K, group, message):
    with pytest.raises(ValueError, match=message):
        quantized.quantize(np.ones((2, K)), fmt, group)


def test_arrays_that_are_no_quantized_matrix_are_refused():
    q, scale, zero = quantized.quantize(np.ones((2, 64)), "int4", 32)
    for arrays in ((q, scale, zero[:, :1]), (q.view(np.int8), scale, zero), (q, scale[:, :0], zero[:, :0])):
        with pytest.raises(ValueError, match="not a quantized matrix"):
            quantized.weight_format(*arrays)


@pytest.fixture(scope="module")
def cycle_model():
    return cycle_trained(CFG)


def quantized_twin(model, backend, fmt, group=0, zero_point=True):
    twin = Model(model.cfg, backend=backend)
    twin.load_params(model.params)
    twin.quantize(fmt, group, zero_point)
    return twin


def decode(model, speculative, weights, n=30):
    decoder = Decoder(model, len(PROMPTS), speculative, Sampling(0.0), weights=weights)
    return decoder.generate(PROMPTS, n, list(range(len(PROMPTS))))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("fmt,group,zero_point", FORMATS)
def test_quantized_decoding_gives_the_dequantized_models_greedy_tokens(cycle_model, backend, fmt, group, zero_point):
    """Decoding from the quantized matrices picks the tokens that decoding the float weights they
    stand for picks, plain and speculative."""
    model = quantized_twin(cycle_model, backend, fmt, group, zero_point)
    floats = decode(model, False, "fp32")
    assert decode(model, False, None) == floats == decode(model, True, fmt)
    assert not np.array_equal(model.params["layers.0.wq"], cycle_model.params["layers.0.wq"])   # they were quantized


def test_decoding_weights_are_the_models_own_or_quantized_at_load(cycle_model):
    """A model loaded quantized decodes with its own matrices by default; a float model asked for
    int4 gets its blocks in int4 groups of 32 and its heads in int8, a scale per output channel."""
    model = quantized_twin(cycle_model, "cpu", "int4", 64, False)
    w = DecodeWeights(model, "int4", model.cfg.n_mtp)
    q, scale, zero = w.layers[0].wqkv
    own = [model.quantized[f"layers.0.{n}"] for n in ("wq", "wk", "wv")]
    assert np.array_equal(q, np.concatenate([p[0] for p in own])) and quantized.weight_format(q, scale, zero)[1] == 64
    assert Decoder(model, 1, False).weights == "int4"
    floats = DecodeWeights(cycle_model, "int4", cycle_model.cfg.n_mtp)
    assert quantized.weight_format(*floats.layers[1].w_down)[:2] == ("int4", 32)
    assert quantized.weight_format(*floats.heads)[:2] == ("int8", CFG.dim)
    assert floats.heads_of(2)[0].shape == (2 * CFG.vocab_size, CFG.dim)
    assert floats.nbytes() < DecodeWeights(cycle_model, "fp32", cycle_model.cfg.n_mtp).nbytes() / 3


def test_a_quantized_run_saves_its_matrices_and_loads_them(cycle_model, tmp_path):
    model = quantized_twin(cycle_model, "cpu", "int4")
    model.save(tmp_path / "q")
    loaded = Model.load(tmp_path / "q")
    assert loaded.quantized.keys() == model.quantized.keys()
    assert all(np.array_equal(a, b) for name in model.quantized for a, b in zip(loaded.quantized[name], model.quantized[name]))
    assert all(np.array_equal(loaded.params[n], w) for n, w in model.params.items())
    cycle_model.save(tmp_path / "float")
    assert (tmp_path / "q" / "model.safetensors").stat().st_size < 0.5 * (tmp_path / "float" / "model.safetensors").stat().st_size


def test_a_run_with_float32_scales_loads_them_as_float16(cycle_model, tmp_path):
    """A run whose scales and offsets are float32 (older files) loads: each the nearest float16,
    exactly where it holds a float16's value."""
    from nanoeuler_core.engine.checkpoint import load_tensors, save_tensors

    model = quantized_twin(cycle_model, "cpu", "int4")
    model.save(tmp_path / "q")
    tensors, _ = load_tensors(tmp_path / "q" / "model.safetensors")
    assert tensors["layers.0.wq.scale"].dtype == np.float16
    tensors = {n: t.astype(np.float32) if t.dtype == np.float16 else t for n, t in tensors.items()}
    tensors["layers.0.wq.scale"][0, 0] = np.float32(0.1) + np.float32(2.0 ** -20)   # between two float16s
    save_tensors(tmp_path / "q" / "model.safetensors", tensors)
    loaded = Model.load(tmp_path / "q")
    q, scale, zero = loaded.quantized["layers.0.wq"]
    assert scale.dtype == zero.dtype == np.float16 and scale[0, 0] == np.float16(0.1)
    assert np.array_equal(scale[1:], model.quantized["layers.0.wq"][1][1:])
    assert all(np.array_equal(a, b) for name in ("layers.1.w_down", "heads.0")
               for a, b in zip(loaded.quantized[name], model.quantized[name]))


def test_scales_float16_cannot_hold_are_refused():
    with pytest.raises(ValueError, match="too large for float16 scales"):
        quantized.quantize(np.full((2, 32), 1e7), "int8")


def test_a_quantized_model_that_learns_saves_float_weights(cycle_model, tmp_path):
    """Training changes the master weights: the quantized matrices no longer stand for them, and
    saving writes the float weights rather than lose what was learnt."""
    model = quantized_twin(cycle_model, "cpu", "int8")
    step = TrainStep(model, AdamW(model))
    step(np.array([PROMPTS[3][:-1]]), np.array([PROMPTS[3][1:]]), 1e-2)
    model.save(tmp_path / "run")
    loaded = Model.load(tmp_path / "run")
    assert not loaded.quantized and all(np.array_equal(loaded.params[n], w) for n, w in model.params.items())


def test_quantize_command(cycle_model, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    cycle_model.save(run)
    code, out, err = run_cli(monkeypatch, capsys, "quantize", run, tmp_path / "q4", "--bits", "4", "--group", "64",
                             "--no-zero-point")
    assert code == 0 and "matrices quantized" in err
    model = Model.load(tmp_path / "q4")
    assert {quantized.weight_format(*w)[:2] for n, w in model.quantized.items() if n.startswith("layers.")} == {("int4", 64)}
    for args, message in ((["--bits", "3"], "--bits must be 8 or 4"), (["--bits", "4", "--group", "16"], "int4: groups are whole blocks"),
                          (["--bits", "8"], "exists")):
        out_dir = tmp_path / ("q4" if message == "exists" else "bad")
        code, out, err = run_cli(monkeypatch, capsys, "quantize", run, out_dir, *args)
        assert code != 0 and message in err and "Traceback" not in err


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_decoding_on_cuda_gives_the_cpus_tokens(fmt):
    """The decode step on the CUDA backend (captured; the function itself on the simulator) reads the
    same quantized matrices as the CPU and picks the same tokens; heads of every width included."""
    cfg = ModelConfig(vocab_size=11, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=32, ctx_len=6, n_mtp=2)
    model = Model(cfg, backend="cuda", seed=2)
    model.quantize(fmt)
    cpu = Model(cfg, backend="cpu")
    cpu.load_params(model.params)
    cpu.quantized = model.quantized
    stats = DecodeStats()
    decoder = Decoder(model, 1, True, Sampling(0.0), weights=fmt)
    tokens = decoder.generate([[1, 2]], 2, [0], stats=stats)
    assert stats.weights == fmt and stats.steps == 1
    assert tokens == Decoder(cpu, 1, True, Sampling(0.0), weights=fmt).generate([[1, 2]], 2, [0])
