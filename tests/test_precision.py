"""Precision as a dimension of the engine (docs/model.md): bf16 mixed precision on the CUDA
backend (the simulator here, a GPU where there is one) keeps float32 master weights and
checkpoints, trains, stays within its bound of float32, and is refused, in one line, where it
cannot run."""

import subprocess
import sys

import numpy as np
import pytest

from nanoeuler_core import Model, ModelConfig
from nanoeuler_core.engine.gradcheck import MODEL_PRECISION_BOUND, check_model_backend, tiny_batch, tiny_config
from nanoeuler_core.engine.optim import AdamW
from nanoeuler_core.training.step import TrainStep
from nanoeuler_core.training.pretrain import TrainConfig


def cli(*args):
    return subprocess.run([sys.executable, "-m", "nanoeuler_core.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


def one_block(tie_embeddings=False):
    """The gradient checker's tiny model with one block: the simulator runs it in seconds."""
    return ModelConfig(**{**tiny_config(tie_embeddings).to_dict(), "n_layers": 1})


@pytest.mark.parametrize("tied", [False, True])
def test_bf16_model_gradients_within_bound_of_float32(tied):
    checks = check_model_backend("cuda", against="cpu", cfg=one_block(tied), bound=MODEL_PRECISION_BOUND["bf16"],
                                 precision="bf16")
    assert all(c.ok for c in checks), "\n".join(c.line() for c in checks if not c.ok)


def test_bf16_updates_float32_master_weights_and_saves_float32(tmp_path):
    cfg = one_block()
    model = Model(cfg, backend="cuda", seed=1, precision="bf16")
    assert model.compute_flat.dtype == np.uint16 and model.flat.dtype == np.float32
    before = model.params
    step = TrainStep(model, AdamW(model))
    loss, norm = step(*tiny_batch(cfg, np.random.default_rng(0), B=2, T=cfg.ctx_len), 1e-2)
    assert np.isfinite(loss) and norm > 0
    master = model.params
    assert all(not np.array_equal(master[n], before[n]) for n in master)   # the update reached every tensor
    assert all(v.dtype == np.float32 for v in master.values())
    # the bf16 copy the ops read is the master weights rounded
    copy = model.backend.to_host(model.compute_flat)
    flat = model.backend.to_host(model.flat)
    assert np.all(np.abs(copy - flat) <= np.abs(flat) * 2.0 ** -8)
    model.save(tmp_path / "run")
    on_cpu = Model.load(tmp_path / "run", backend="cpu")
    assert on_cpu.precision == "fp32"
    assert all(np.array_equal(on_cpu.params[n], master[n]) for n in master)


@pytest.mark.parametrize("args", [("pretrain", "--precision", "bf16"), ("bench", "--precision", "bf16"),
                                  ("pretrain", "--precision", "fp16")])
def test_reduced_precision_on_the_cpu_is_one_line(args, tmp_path):
    result = cli(*args, "--out", tmp_path / "run") if args[0] == "pretrain" else cli(*args)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "precision" in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


def test_runs_written_before_named_precisions_keep_theirs():
    assert TrainConfig.from_dict({"backend": "cuda", "tf32": True}).precision == "tf32"
    assert TrainConfig.from_dict({"backend": "cuda", "tf32": False}).precision == "fp32"
    assert TrainConfig.from_dict({"backend": "cpu", "tf32": True}).precision == "fp32"
