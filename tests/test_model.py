"""The model: presets, config validation, gradients (finite differences and backend parity),
files, the KV cache and sampling."""

import json
import tracemalloc

import numpy as np
import pytest

from nanoeuler_core import Model, ModelConfig, registry
from nanoeuler_core.engine.checkpoint import CheckpointError
from nanoeuler_core.engine.config import PRESETS
from nanoeuler_core.engine.gradcheck import check_model_backend, check_model_finite_differences, tiny_batch, tiny_config

MODEL_BACKENDS = [b for b, be in registry.backends().items() if b != "reference" and be.available()]


def test_preset_parameter_counts():
    assert ModelConfig.preset("small").n_params() == 1_053_824
    assert ModelConfig.preset("cpu-medium").n_params() == 13_572_480
    assert ModelConfig.preset("gpu").n_params() == 116_417_280
    assert ModelConfig.preset("gpu-medium").n_params() == 291_554_304
    assert ModelConfig.preset("gpu-large").n_params() == 633_826_560
    assert Model(ModelConfig.preset("small")).n_params == 1_053_824
    for name in PRESETS:   # ZeRO-1 shards the parameters evenly over 2, 4 or 8 ranks
        assert ModelConfig.preset(name).n_params() % 8 == 0, name


def _recompute_pair(cfg, backend, batch_size, precision="fp32"):
    """Loss and gradients of one batch with activations kept and recomputed, on the same weights."""
    inputs, targets = tiny_batch(cfg, np.random.default_rng(4), B=batch_size, T=cfg.ctx_len)
    return [Model(cfg, backend=backend, seed=4, precision=precision, recompute=recompute).loss_and_grad(inputs, targets)
            for recompute in (False, True)]


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_recompute_gives_the_same_gradients_bit_for_bit(backend):
    cfg = ModelConfig.preset("small") if backend == "cpu" else tiny_config()
    (loss, grads), (loss_recomputed, grads_recomputed) = _recompute_pair(cfg, backend, batch_size=4)
    assert loss_recomputed == loss
    for name, g in grads.items():
        assert np.array_equal(grads_recomputed[name], g), name


@pytest.mark.slow
@pytest.mark.skipif("cuda" not in MODEL_BACKENDS, reason="no CUDA backend (GPU or simulator) here")
def test_recompute_gives_the_same_gradients_bit_for_bit_on_cuda():
    """The same on the CUDA kernels (the simulator's twins without a GPU): a tiny model, one block,
    one head (tests the recomputed block's buffers; more blocks repeat it)."""
    cfg = ModelConfig(**{**tiny_config().to_dict(), "n_mtp": 1, "ctx_len": 4, "n_layers": 1})
    (loss, grads), (loss_recomputed, grads_recomputed) = _recompute_pair(cfg, "cuda", batch_size=1)
    assert loss_recomputed == loss
    for name, g in grads.items():
        assert np.array_equal(grads_recomputed[name], g), name


def _real_gpu() -> bool:
    import numba
    from numba import cuda

    return not numba.config.ENABLE_CUDASIM and cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _real_gpu(), reason="needs a real CUDA GPU")
def test_recompute_captured_steps_are_bit_for_bit_on_a_gpu():
    """At gpu-medium's width and context (two blocks), in bf16: captured training steps with and
    without recomputation give the same losses, gradient norms and weights, to the last bit."""
    from nanoeuler_core.engine.optim import AdamW
    from nanoeuler_core.training.step import TrainStep

    cfg = ModelConfig.preset("gpu-medium", n_layers=2)
    results = []
    for recompute in (False, True):
        model = Model(cfg, backend="cuda", seed=0, precision="bf16", recompute=recompute)
        step = TrainStep(model, AdamW(model))
        rng = np.random.default_rng(0)
        history = [step(*tiny_batch(cfg, rng, B=2, T=cfg.ctx_len), 1e-4) for _ in range(3)]
        results.append((history, model.backend.to_host(model.flat)))
    (plain, w_plain), (recomputed, w_recomputed) = results
    assert recomputed == plain
    assert np.array_equal(w_recomputed, w_plain)


def test_recompute_keeps_less_in_memory():
    """The forward keeps each block's input instead of its cache: the `small` model's peak host
    memory (every array NumPy allocates, traced) drops by more than a third."""
    cfg = ModelConfig.preset("small")
    inputs, targets = tiny_batch(cfg, np.random.default_rng(0), B=8, T=cfg.ctx_len)
    peaks = []
    for recompute in (False, True):
        model = Model(cfg, backend="cpu", recompute=recompute)
        model.loss_and_backward(inputs, targets)   # compiled, buffers settled
        tracemalloc.start()
        model.loss_and_backward(inputs, targets)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[1] < 0.65 * peaks[0], peaks


@pytest.mark.parametrize("fields, message", [
    (dict(dim=130, n_heads=4), "divisible by n_heads"),
    (dict(n_heads=4, n_kv_heads=3), "divisible by n_kv_heads"),
    (dict(dim=12, n_heads=4, n_kv_heads=2), "must be even"),
    (dict(n_layers=0), "positive integer"),
])
def test_invalid_config(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**fields)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'tiny'"):
        ModelConfig.preset("tiny")


def test_bad_inputs_raise_value_error():
    cfg = tiny_config()
    model = Model(cfg, backend="reference")
    with pytest.raises(ValueError, match="token ids must be in"):
        model.forward(np.array([[0, cfg.vocab_size]]))
    with pytest.raises(ValueError, match="ctx_len"):
        model.forward(np.zeros((1, cfg.ctx_len + 1), dtype=np.int64))
    with pytest.raises(ValueError, match="targets"):
        model.loss_and_grad(np.zeros((1, 3), dtype=np.int64), np.zeros((1, 4), dtype=np.int64))
    params = model.params
    params["norm"] = np.ones(cfg.dim + 1)
    with pytest.raises(ValueError, match="'norm' has shape"):
        model.load_params(params)
    del params["norm"]
    with pytest.raises(ValueError, match="missing"):
        model.load_params(params)


def test_named_views_share_one_buffer():
    model = Model(tiny_config(), backend="cpu")
    assert sum(p.size for p in model.params.values()) == model.n_params == model.flat.size
    model.params["layers.1.wq"][0, 0] = 123.0  # a view: writes reach the flat buffer
    assert 123.0 in model.flat
    # weight decay covers the matrices, laid out first
    decayed = [n for n, (off, s) in model.layout.items() if off < model.n_decay]
    assert all(len(model.layout[n][1]) == 2 for n in decayed)
    assert len(decayed) == sum(len(s) == 2 for s in model.cfg.param_shapes().values())


def test_init_statistics():
    cfg = ModelConfig.preset("small")
    p = Model(cfg, backend="cpu", seed=3).params
    assert abs(p["layers.0.wq"].std() - 0.02) < 1e-3
    assert abs(p["layers.0.wo"].std() - 0.02 / np.sqrt(2 * cfg.n_layers)) < 1e-3
    assert np.all(p["layers.2.ffn_norm"] == 1.0)
    assert np.array_equal(Model(cfg, seed=3).params["heads.1"], p["heads.1"])


@pytest.mark.parametrize("tied", [False, True])
def test_gradients_match_finite_differences(tied):
    cfg = tiny_config(tie_embeddings=tied)
    checks = check_model_finite_differences(seed=0, cfg=cfg)
    assert len(checks) == len(cfg.param_shapes())
    assert all(c.ok for c in checks), "\n".join(c.line() for c in checks)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("backend", MODEL_BACKENDS)
def test_backend_gradients_match_reference(backend, tied):
    checks = check_model_backend(backend, seed=1, cfg=tiny_config(tie_embeddings=tied))
    assert all(c.ok for c in checks), "\n".join(c.line() for c in checks)


def test_tied_embeddings_have_no_head_zero_of_their_own():
    untied, tied = ModelConfig.preset("small"), ModelConfig.preset("small", tie_embeddings=True)
    assert "heads.0" not in tied.param_shapes() and "heads.1" in tied.param_shapes()
    assert tied.n_params() == untied.n_params() - tied.vocab_size * tied.dim == 988_288   # docs/model.md
    assert tied.flops_per_token() == untied.flops_per_token()   # the same products: head 0 reads tok_emb
    model = Model(tied, backend="cpu")
    assert model.n_params == tied.n_params()
    emb, _ = model.layout["tok_emb"]
    assert model.n_hidden <= emb and emb + tied.vocab_size * tied.dim <= model.n_decay   # decayed, not Muon's
    assert np.shares_memory(model.heads, model.weights["tok_emb"]) and model.heads.shape[0] == tied.n_mtp * tied.vocab_size
    with pytest.raises(ValueError, match="tie_embeddings must be true or false"):
        ModelConfig(tie_embeddings=1)


def test_tied_gradient_of_tok_emb_sums_the_embedding_and_head_zero():
    """tok_emb's gradient is the untied model's tok_emb gradient plus its heads.0 gradient, on the same weights."""
    cfg = tiny_config()
    untied = Model(cfg, backend="reference", seed=6)
    untied.master["heads.0"][:] = untied.master["tok_emb"]
    tied = Model(ModelConfig(**{**cfg.to_dict(), "tie_embeddings": True}), backend="reference")
    tied.load_params({n: w for n, w in untied.params.items() if n != "heads.0"})
    inputs, targets = tiny_batch(cfg, np.random.default_rng(2))
    loss, grads = untied.loss_and_grad(inputs, targets)
    loss_tied, grads_tied = tied.loss_and_grad(inputs, targets)
    assert loss_tied == pytest.approx(loss, rel=1e-12)
    np.testing.assert_allclose(grads_tied["tok_emb"], grads["tok_emb"] + grads["heads.0"], atol=1e-14)
    assert np.array_equal(tied.forward(inputs), untied.forward(inputs))


def test_tied_backward_reports_tok_emb_final_once_and_last():
    model = Model(tiny_config(tie_embeddings=True), backend="cpu")
    reported = []
    model.forward_backward(model.prepare(*tiny_batch(model.cfg, np.random.default_rng(0))),
                           grads_ready=reported.extend)
    assert sorted(reported) == sorted(model.layout) and reported[-1] == "tok_emb"


def test_ignored_targets_give_no_gradient():
    cfg = tiny_config()
    model = Model(cfg, backend="reference")
    inputs, _ = tiny_batch(cfg, np.random.default_rng(0))
    loss, grads = model.loss_and_grad(inputs, np.full(inputs.shape, -1))
    assert loss == 0.0
    assert all(np.all(g == 0) for g in grads.values())


def test_forward_logits_are_head_zero():
    cfg = tiny_config()
    model = Model(cfg, backend="reference", seed=2)
    inputs, _ = tiny_batch(cfg, np.random.default_rng(1))
    logits = model.forward(inputs)
    assert logits.shape == (*inputs.shape, cfg.vocab_size)
    # the loss of head 0 alone, from those logits, is the first head's term
    targets = np.roll(inputs, -1, axis=1)
    lse = np.log(np.exp(logits).sum(-1))
    head0 = np.mean(lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0])
    single = Model(ModelConfig(**{**cfg.to_dict(), "n_mtp": 1}), backend="reference")
    single.load_params({n: w for n, w in model.params.items() if not n.startswith("heads.") or n == "heads.0"})
    assert single.loss(inputs, targets) == pytest.approx(head0, rel=1e-10)


@pytest.mark.parametrize("tied", [False, True])
def test_save_and_load_round_trip(tmp_path, tied):
    model = Model(tiny_config(tie_embeddings=tied), backend="cpu", seed=5)
    model.save(tmp_path / "run")
    again = Model.load(tmp_path / "run", backend="cpu")
    assert again.cfg == model.cfg
    for name, w in model.params.items():
        assert np.array_equal(again.params[name], w)


def test_a_config_without_tie_embeddings_loads_untied(tmp_path):
    Model(tiny_config(), backend="cpu").save(tmp_path / "run")
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    del config["tie_embeddings"]
    (tmp_path / "run" / "config.json").write_text(json.dumps(config))
    assert not Model.load(tmp_path / "run").cfg.tie_embeddings


def test_load_reports_bad_run_directories(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        Model.load(tmp_path / "nope")
    Model(tiny_config(), backend="cpu").save(tmp_path / "run")
    weights = tmp_path / "run" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        Model.load(tmp_path / "run")
    (tmp_path / "run" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not readable JSON"):
        Model.load(tmp_path / "run")


@pytest.mark.parametrize("tied", [False, True])
def test_matches_pytorch_where_installed(tied):
    torch = pytest.importorskip("torch")
    from nanoeuler_core.bench.torch_peer import TorchModel

    cfg = tiny_config(tie_embeddings=tied)
    model = Model(cfg, backend="reference", seed=7)
    model.load_params({n: w.astype(np.float32) for n, w in model.params.items()})  # the values torch will hold
    inputs, targets = tiny_batch(cfg, np.random.default_rng(3))
    loss, grads = model.loss_and_grad(inputs, targets)
    peer = TorchModel(cfg).load(model.params).double()
    peer_loss = peer.loss(torch.tensor(inputs), torch.tensor(targets))
    peer_loss.backward()
    assert loss == pytest.approx(peer_loss.item(), rel=1e-5)
    for name, g in grads.items():
        np.testing.assert_allclose(g, peer.w(name).grad.numpy(), atol=1e-5 * np.abs(g).max() + 1e-12)
