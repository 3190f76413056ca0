"""DPO: the registered dpo_loss op at known values (its gradcheck runs in test_ops.py with every
other op), pairs loading, the gradient of a DPO step against finite differences, and training raising preference
accuracy on a tiny model."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from nanoeuler_core import registry
from nanoeuler_core.training import dpo
from nanoeuler_core.engine.checkpoint import read_json
from nanoeuler_core.engine.config import ModelConfig
from nanoeuler_core.engine.model import Model
from nanoeuler_core.inference.loading import load_model
from finetune_helpers import TINY, cli, make_base_run, write_jsonl

WORDS = ("night", "sword", "crown", "blood", "heart", "grace", "honour", "tongue")
PAIRS = [{"instruction": f"Reverse the word: {w}", "chosen": w[::-1], "rejected": w} for w in WORDS]


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_dpo_loss_values_and_extreme_margins(backend):
    impl, be = registry.op("dpo_loss").impl(backend), registry.backend(backend)
    chosen = be.asarray(np.array([-10.0, -10.0, 0.0, -5000.0]))
    rejected = be.asarray(np.array([-10.0, -20.0, -5000.0, 0.0]))
    zeros = be.asarray(np.zeros(4))
    losses, saved = impl.forward(chosen, rejected, zeros, zeros, beta=1.0)
    d_chosen, d_rejected, _, _ = impl.backward(be.asarray(np.ones(4)), saved, chosen, rejected, zeros, zeros, beta=1.0)
    # no margin: log 2 and gradient 1/2; a large margin either way saturates without overflow
    np.testing.assert_allclose(be.to_host(losses), [np.log(2), np.log1p(np.exp(-10)), 0.0, 5000.0], rtol=1e-6)
    np.testing.assert_allclose(be.to_host(d_chosen), [-0.5, -1 / (1 + np.exp(10)), 0.0, -1.0], rtol=1e-5, atol=1e-12)
    np.testing.assert_allclose(be.to_host(d_rejected), -be.to_host(d_chosen))


def test_load_pairs(tmp_path):
    rows = [{"prompt": "Say hi.", "chosen": "hi", "rejected": "bye"},
            {"instruction": "Add.", "input": "2 3", "chosen": "5", "rejected": "6"}]
    pairs = dpo.load_pairs(write_jsonl(tmp_path / "pairs.jsonl", rows))
    assert pairs == [dpo.Pair("Say hi.", "", "hi", "bye"), dpo.Pair("Add.", "2 3", "5", "6")]
    for bad, message in [({"instruction": "a", "chosen": "b"}, "missing field 'rejected'"),
                         ({"instruction": "a", "chosen": "b", "rejected": "b"}, "the same response")]:
        with pytest.raises(ValueError, match=message):
            dpo.load_pairs(write_jsonl(tmp_path / "bad.jsonl", [bad]))


def test_dpo_gradient_matches_finite_differences(tok):  # noqa: F811
    """loss_and_backward's gradient (the op's backward through logprob_backward) against central
    differences of the mean DPO loss, on the float64 reference backend."""
    cfg = ModelConfig(vocab_size=tok.vocab_size, **TINY)
    model = Model(cfg, backend="reference", seed=2)
    pairs, _ = dpo.encode_pairs(tok, [dpo.Pair(p["instruction"], "", p["chosen"], p["rejected"]) for p in PAIRS[:3]],
                                cfg.ctx_len)
    inputs, targets = pairs.rows(range(3))
    reference = np.array([[-30.0, -25.0], [-20.0, -22.0], [-28.0, -28.5]])
    loss_op, beta = registry.op("dpo_loss").impl("reference"), 0.5

    def loss() -> float:
        scores = model.token_logprobs(inputs, targets).sum(axis=1).reshape(2, 3).T
        return float(loss_op.forward(scores[:, 0], scores[:, 1], reference[:, 0], reference[:, 1], beta=beta)[0].mean())

    value, _ = dpo.loss_and_backward(model, loss_op, inputs, targets, reference, beta)
    assert value == pytest.approx(loss(), rel=1e-12)
    rng = np.random.default_rng(0)
    for name in ("tok_emb", "layers.1.wq", "layers.0.w_down", "norm", "heads.0"):
        w, g = model.params[name].reshape(-1), model.grads[name].reshape(-1).copy()
        for e in rng.choice(w.size, 3, replace=False):
            keep = w[e]
            w[e] = keep + 1e-5
            up = loss()
            w[e] = keep - 1e-5
            down = loss()
            w[e] = keep
            assert g[e] == pytest.approx((up - down) / 2e-5, rel=1e-5, abs=1e-9), name
    assert not model.grads["heads.1"].any()  # the scores come from head 0 alone


def test_dpo_raises_preference_accuracy(tmp_path, tok):  # noqa: F811
    base = make_base_run(tmp_path / "base", tok, seed=5)
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    out = tmp_path / "dpo"
    result = CliRunner().invoke(cli(), ["dpo", "--base", str(base), "--data", str(data), "--out", str(out),
                                        "--steps", "12", "--batch-size", "4", "--lr", "3e-3", "--beta", "0.5",
                                        "--val-fraction", "0"])
    assert result.exit_code == 0, result.output
    model, loaded = load_model(out)
    base_model, _ = load_model(base)
    pairs, _ = dpo.encode_pairs(loaded, dpo.load_pairs(data), model.cfg.ctx_len)
    pairs.reference = dpo.sequence_logprobs(base_model, pairs, batch_size=4)
    before = dpo.preference_metrics(pairs.reference, pairs.reference, beta=0.5)
    after = dpo.evaluate(model, pairs, beta=0.5, batch_size=4)
    assert after["accuracy"] > before["accuracy"] and after["accuracy"] >= 0.75
    assert after["reward_margin"] > 0.1 and after["loss"] < np.log(2)
    training = read_json(out / "config.json")["training"]
    assert training["stage"] == "dpo" and training["beta"] == 0.5 and training["template"] == "alpaca"
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 12


def test_dpo_reports_held_out_pairs(tmp_path, tok):  # noqa: F811
    base = make_base_run(tmp_path / "base", tok)
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    result = CliRunner().invoke(cli(), ["dpo", "--base", str(base), "--data", str(data), "--out", str(tmp_path / "dpo"),
                                        "--steps", "2", "--batch-size", "2", "--val-fraction", "0.25"])
    assert result.exit_code == 0, result.output
    assert "6 training and 2 held-out pairs" in result.output
    assert "before DPO, held-out pairs: preference accuracy" in result.output
    assert "after DPO, held-out pairs: preference accuracy" in result.output and "reward margin" in result.output


def test_dpo_bad_input(tmp_path, tok):  # noqa: F811
    base = make_base_run(tmp_path / "base", tok)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"instruction": "a", "chosen": "b"}) + "\n")
    good = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    for args, message in [(["--base", str(base), "--data", str(bad)], "missing field 'rejected'"),
                          (["--base", str(tmp_path / "nowhere"), "--data", str(good)], "not found"),
                          (["--base", str(base), "--data", str(good), "--beta", "0"], "--beta must be positive")]:
        result = CliRunner().invoke(cli(), ["dpo", *args, "--out", str(tmp_path / "out")])
        assert result.exit_code != 0 and isinstance(result.exception, ValueError), result.output
        assert message in str(result.exception) and "\n" not in str(result.exception)
