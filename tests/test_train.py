"""Pretraining: schedule, exact resume, checkpoints that survive Ctrl-C, kill -9 and a full disk,
and one-line errors for bad input."""

import errno
import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import pytest

from nanoeuler_core.engine import checkpoint
from nanoeuler_core.inference.loading import load_model
from nanoeuler_core.training import pretrain as train
from nanoeuler_core.corpus.tokens import default_corpus
from nanoeuler_core.engine.optim import lr_at
from nanoeuler_core.text.tokenizer import Tokenizer

CORPUS_CHARS = 60_000


@pytest.fixture(scope="module")
def corpus_and_tokenizer(tmp_path_factory):
    """A slice of the bundled corpus and a 512-entry tokenizer trained on it, shared by the tests."""
    folder = tmp_path_factory.mktemp("corpus")
    text = default_corpus().read_text(encoding="utf-8")[:CORPUS_CHARS]
    corpus = folder / "shakespeare.txt"
    corpus.write_text(text, encoding="utf-8")
    tok = Tokenizer.train(text, 512)
    tok.save(folder / "tokenizer.json")
    return corpus, folder / "tokenizer.json"


def config(corpus_and_tokenizer, **overrides):
    corpus, tokenizer = corpus_and_tokenizer
    settings = dict(corpus=str(corpus), tokenizer=str(tokenizer), steps=12, batch_size=2, eval_every=4,
                    eval_batches=2, ckpt_every=4)
    return train.TrainConfig(**{**settings, **overrides})


def losses(run_dir: Path) -> dict[int, float]:
    rows = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


def quiet(_msg):
    pass


def test_lr_schedule():
    assert lr_at(1, 1.0, 10, 100) == pytest.approx(0.1)
    assert lr_at(10, 1.0, 10, 100) == pytest.approx(1.0)
    assert lr_at(55, 1.0, 10, 100) == pytest.approx(0.55)
    assert lr_at(100, 1.0, 10, 100) == pytest.approx(0.1)
    assert lr_at(500, 1.0, 10, 100) == pytest.approx(0.1)


def test_wsd_schedule_holds_the_peak_then_decays_linearly():
    # 10 warm-up steps of 110: of the 100 after them, the last 20 decay
    wsd = functools.partial(lr_at, peak=1.0, warmup=10, total=110, schedule="wsd")
    assert [wsd(s) for s in (5, 10, 50, 90)] == pytest.approx([0.5, 1.0, 1.0, 1.0])
    assert [wsd(s) for s in (100, 110, 500)] == pytest.approx([0.55, 0.1, 0.1])


def test_target_loss_stops_at_the_first_evaluation_that_reaches_it(corpus_and_tokenizer, tmp_path):
    said = []
    run = train.start_run(tmp_path / "run", config(corpus_and_tokenizer, steps=12, eval_every=3, ckpt_every=100,
                                                   target_loss=50.0), quiet)
    row, interrupted = train.train(run, said.append)
    assert row["step"] == 3 and row["val_next_token_loss"] <= 50.0 and not interrupted
    assert any(line.startswith("reached held-out next-token loss") and "at step 3" in line for line in said), said
    assert train.resume_run(tmp_path / "run", {}, quiet).optimizer.step_count == 3   # checkpointed there
    unreachable = train.start_run(tmp_path / "far", config(corpus_and_tokenizer, steps=6, eval_every=3,
                                                           target_loss=1e-3), quiet)
    assert train.train(unreachable, quiet)[0]["step"] == 6


def test_time_budget_lays_the_schedule_over_it_and_ends_with_an_evaluation(corpus_and_tokenizer, tmp_path):
    said = []
    run = train.start_run(tmp_path / "run", config(corpus_and_tokenizer, steps=10**9, eval_every=10**6,
                                                   ckpt_every=10**6, time_budget=0.05), quiet)
    row, interrupted = train.train(run, said.append)
    rows = [orjson.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_bytes().splitlines()]
    assert not interrupted and row["time"] >= 3.0 and "val_loss" in row and rows[-1] == row
    assert any(line.startswith("time budget of 0.05 min spent at step") for line in said), said
    lrs = [r["lr"] for r in rows]
    peak = lrs.index(max(lrs))
    assert lrs[peak:] == sorted(lrs[peak:], reverse=True) and lrs[-1] < 0.2 * run.config.lr   # the decay ends with it
    resumed = train.resume_run(tmp_path / "run", {}, quiet)
    assert resumed.optimizer.step_count == row["step"]   # checkpointed there
    assert train.train(resumed, quiet) == ({}, False)    # and the budget stays spent


def test_a_run_follows_its_schedule_and_keeps_it_on_resume(corpus_and_tokenizer, tmp_path):
    run = train.start_run(tmp_path / "run", config(corpus_and_tokenizer, steps=4, schedule="wsd"), quiet)
    train.train(run, quiet)
    resumed = train.resume_run(tmp_path / "run", {"steps": 6}, quiet)
    assert resumed.config.schedule == "wsd"
    train.train(resumed, quiet)
    rows = [orjson.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_bytes().splitlines()]
    tc = resumed.config
    assert [r["lr"] for r in rows] == pytest.approx([lr_at(r["step"], tc.lr, tc.warmup, tc.decay_steps,
                                                           tc.final_lr_ratio, "wsd") for r in rows])


def test_training_lowers_the_loss_and_writes_the_run(corpus_and_tokenizer, tmp_path):
    run = train.start_run(tmp_path / "run", config(corpus_and_tokenizer, steps=40, eval_every=20), quiet)
    row, interrupted = train.train(run, quiet)
    assert not interrupted and row["step"] == 40
    for name in ("config.json", "tokenizer.json", "model.safetensors", "optimizer.safetensors", "metrics.jsonl"):
        assert (tmp_path / "run" / name).is_file()
    rows = [orjson.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_bytes().splitlines()]
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "time"} <= set(rows[0])
    assert [r["step"] for r in rows if "val_loss" in r] == [20, 40]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    assert rows[-1]["val_loss"] < run.unigram_loss + 0.5


def test_muon_trains_the_small_preset(corpus_and_tokenizer, tmp_path):
    """Muon for the blocks' matrices, AdamW for the rest: the loss falls as AdamW's does, and the
    checkpoint carries the momentum of every block matrix and the moments of everything else."""
    final = {}
    for optimizer in ("adamw", "muon"):
        run = train.start_run(tmp_path / optimizer, config(corpus_and_tokenizer, steps=40, eval_every=20,
                                                           optimizer=optimizer), quiet)
        row, _ = train.train(run, quiet)
        final[optimizer] = row["val_loss"]
        rows = [orjson.loads(line) for line in (tmp_path / optimizer / "metrics.jsonl").read_bytes().splitlines()]
        assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    assert final["muon"] < final["adamw"] + 0.1
    state, meta = checkpoint.load_tensors(tmp_path / "muon" / "optimizer.safetensors")
    assert meta["optimizer"] == "muon"
    assert {"momentum.layers.0.wq", "momentum.layers.3.w_down", "m.tok_emb", "v.heads.0", "m.norm"} <= set(state)
    assert not {"m.layers.0.wq", "momentum.tok_emb", "momentum.layers.0.attn_norm"} & set(state)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_continues_exactly(corpus_and_tokenizer, tmp_path, optimizer):
    straight = train.start_run(tmp_path / "straight", config(corpus_and_tokenizer, optimizer=optimizer), quiet)
    train.train(straight, quiet)
    half = train.start_run(tmp_path / "half", config(corpus_and_tokenizer, steps=6, decay_steps=12,
                                                     optimizer=optimizer), quiet)
    train.train(half, quiet)
    resumed = train.resume_run(tmp_path / "half", {"steps": 12}, quiet)
    assert resumed.optimizer.step_count == 6
    train.train(resumed, quiet)
    assert losses(tmp_path / "half") == losses(tmp_path / "straight")
    a, b = load_model(tmp_path / "half")[0].params, load_model(tmp_path / "straight")[0].params
    assert all(np.array_equal(a[n], b[n]) for n in a)


def test_crash_between_checkpoint_renames_rolls_forward(corpus_and_tokenizer, tmp_path, monkeypatch):
    run = train.start_run(tmp_path / "run", config(corpus_and_tokenizer, steps=8, ckpt_every=100), quiet)
    run.config.steps = 4
    train.train(run, quiet)  # checkpoint at step 4
    real_replace, calls = os.replace, []

    def crash_after_first_rename(src, dst):
        calls.append(dst)
        if str(dst).endswith("model.safetensors"):
            raise KeyboardInterrupt("simulated crash")
        real_replace(src, dst)

    run.config.steps = 8
    monkeypatch.setattr(checkpoint.os, "replace", crash_after_first_rename)
    with pytest.raises(KeyboardInterrupt):
        train.train(run, quiet)
    monkeypatch.undo()
    resumed = train.resume_run(tmp_path / "run", {}, quiet)
    assert resumed.optimizer.step_count == 8  # both files were complete: the new checkpoint rolled forward


def test_crash_while_writing_keeps_last_good_checkpoint(corpus_and_tokenizer, tmp_path, monkeypatch):
    run = train.start_run(tmp_path / "run", config(corpus_and_tokenizer, steps=4), quiet)
    train.train(run, quiet)
    good = load_model(tmp_path / "run")[0].params
    real_write = checkpoint.atomic_write

    def disk_full_on_model(path, data):
        if "model.safetensors" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(path, data)

    run.config.steps = 8
    monkeypatch.setattr(checkpoint, "atomic_write", disk_full_on_model)
    with pytest.raises(OSError, match="No space left"):
        train.train(run, quiet)
    monkeypatch.undo()
    resumed = train.resume_run(tmp_path / "run", {}, quiet)
    assert resumed.optimizer.step_count == 4
    assert all(np.array_equal(resumed.model.params[n], w) for n, w in good.items())
    assert not list((tmp_path / "run").glob("*.pending"))


# ------------------------------------------------------------------------------------------------
# the command line, as a user runs it

def cli(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanoeuler_core.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, **kwargs)


def pretrain_args(corpus_and_tokenizer, out, steps=8, *extra):
    corpus, tokenizer = corpus_and_tokenizer
    return ("pretrain", "--corpus", corpus, "--tokenizer", tokenizer, "--steps", steps, "--batch-size", 2,
            "--eval-every", 4, "--ckpt-every", 4, "--out", out, *extra)


def test_kill_during_checkpoint_write_resumes_from_last_good(corpus_and_tokenizer, tmp_path):
    """kill -9 the trainer in the middle of its second checkpoint, between writing the two files."""
    script = (
        "import os, signal, sys\n"
        "from nanoeuler_core.engine import checkpoint\n"
        "real, model_writes = checkpoint.atomic_write, []\n"
        "def write(path, data):\n"
        "    if str(path).endswith('model.safetensors.pending'):\n"
        "        model_writes.append(path)\n"
        "        if len(model_writes) == 2:\n"
        "            os.kill(os.getpid(), signal.SIGKILL)\n"
        "    real(path, data)\n"
        "checkpoint.atomic_write = write\n"
        "from nanoeuler_core.cli import main\n"
        "sys.argv = ['nanoeuler-run'] + sys.argv[1:]\n"
        "main()\n"
    )
    run_dir = tmp_path / "run"
    args = [str(a) for a in pretrain_args(corpus_and_tokenizer, run_dir, 8)]
    killed = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL
    assert (run_dir / "optimizer.safetensors.pending").exists()  # the write it was killed in
    resumed = cli("pretrain", "--resume", run_dir, "--steps", 8)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stderr and "at step 4" in resumed.stderr
    assert sorted(losses(run_dir)) == list(range(1, 9))


def test_ctrl_c_saves_and_exits_cleanly(corpus_and_tokenizer, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "nanoeuler_core.cli",
                             *map(str, pretrain_args(corpus_and_tokenizer, run_dir, 100000))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and metrics.read_bytes().count(b"\n") >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted: checkpoint at step" in err
    step = int(err.split("checkpoint at step ")[1].split()[0])
    resumed = train.resume_run(run_dir, {}, quiet)
    assert resumed.optimizer.step_count == step >= 2


def test_bad_input_is_one_clear_line(corpus_and_tokenizer, tmp_path):
    corpus, tokenizer = corpus_and_tokenizer
    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be.\n")
    cases = [
        (("pretrain", "--resume", tmp_path / "missing"), "does not exist"),
        (("pretrain", "--preset", "huge", "--out", tmp_path / "a"), "unknown preset 'huge'"),
        (("pretrain", "--schedule", "linear", "--out", tmp_path / "s"), "--schedule must be one of cosine, wsd"),
        (("pretrain", "--target-loss", "-1", "--out", tmp_path / "t"), "--target-loss must be a positive number"),
        (("pretrain", "--time-budget", "0", "--out", tmp_path / "u"), "--time-budget must be a positive number"),
        (("pretrain", "--corpus", short, "--tokenizer", tokenizer, "--out", tmp_path / "b"), "fewer than one context window"),
        (("pretrain", "--corpus", tmp_path / "nope.txt", "--out", tmp_path / "c"), "not found"),
        (("generate", tmp_path / "missing", "It was"), "does not exist"),
    ]
    for args, message in cases:
        result = cli(*args)
        assert result.returncode == 1, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (args, result.stderr)


def test_generate_checks_checkpoint_and_tokenizer(corpus_and_tokenizer, tmp_path):
    run_dir = tmp_path / "run"
    run = train.start_run(run_dir, config(corpus_and_tokenizer, steps=2), quiet)
    train.train(run, quiet)
    ok = cli("generate", run_dir, "It was", "--max-new-tokens", 5, "--seed", 1)
    assert ok.returncode == 0 and ok.stdout.startswith("It was"), ok.stderr
    Tokenizer.train(default_corpus().read_text(encoding="utf-8")[:20_000], 300).save(run_dir / "tokenizer.json")
    mismatch = cli("generate", run_dir, "It was")
    assert mismatch.returncode == 1 and "vocab_size 512" in mismatch.stderr and "300" in mismatch.stderr
    (run_dir / "model.safetensors").write_bytes(b"\x00" * 10)
    corrupt = cli("generate", run_dir, "It was")
    assert corrupt.returncode == 1 and "corrupt" in corrupt.stderr and "Traceback" not in corrupt.stderr


def test_resume_keeps_the_runs_backend_unless_told(corpus_and_tokenizer, tmp_path):
    """`pretrain --resume RUN` continues on the backend RUN trained on (a GPU run stays on the GPU);
    --backend moves it."""
    run_dir = tmp_path / "run"
    args = [str(a) for a in pretrain_args(corpus_and_tokenizer, run_dir, 2)]
    assert cli(*args, "--backend", "reference").returncode == 0
    resumed = cli("pretrain", "--resume", run_dir, "--steps", 3, "--sample-prompt", "x")
    assert resumed.returncode == 0, resumed.stderr
    assert "backend reference" in resumed.stderr + resumed.stdout
    moved = cli("pretrain", "--resume", run_dir, "--steps", 4, "--backend", "cpu", "--sample-prompt", "x")
    assert moved.returncode == 0 and "backend cpu" in moved.stderr + moved.stdout, moved.stderr


def test_recompute_trains_exactly_as_keeping_activations(corpus_and_tokenizer, tmp_path):
    """Activation recomputation changes memory, not the run: through the captured training step,
    validation and a resume, the same losses and weights as a run that keeps its activations; a
    resumed run keeps its choice unless told, and fine-tuning takes it from its TrainConfig."""
    from nanoeuler_core.training import sft

    plain = train.start_run(tmp_path / "plain", config(corpus_and_tokenizer, steps=6), quiet)
    train.train(plain, quiet)
    recomputed = train.start_run(tmp_path / "recomputed",
                                 config(corpus_and_tokenizer, steps=3, decay_steps=6, recompute=True), quiet)
    assert recomputed.model.recompute and not plain.model.recompute
    train.train(recomputed, quiet)
    resumed = train.resume_run(tmp_path / "recomputed", {"steps": 6}, quiet)
    assert resumed.model.recompute
    train.train(resumed, quiet)
    assert losses(tmp_path / "recomputed") == losses(tmp_path / "plain")
    a, b = load_model(tmp_path / "recomputed")[0].params, load_model(tmp_path / "plain")[0].params
    assert all(np.array_equal(a[n], b[n]) for n in a)
    assert not train.resume_run(tmp_path / "recomputed", {"recompute": False}, quiet).model.recompute
    tc = sft.fine_tune_config(tmp_path / "plain", steps=1, recompute=True)
    model, _, _ = sft.new_run_from(tmp_path / "plain", tmp_path / "sft", tc, {"stage": "sft"}, quiet)
    assert model.recompute


def test_recompute_flag_reaches_the_run(corpus_and_tokenizer, tmp_path):
    run_dir = tmp_path / "run"
    result = cli(*pretrain_args(corpus_and_tokenizer, run_dir, 2, "--recompute", "--sample-prompt", "x"))
    assert result.returncode == 0, result.stderr
    assert "activations recomputed" in result.stderr
    assert checkpoint.read_json(run_dir / "config.json")["training"]["recompute"] is True


def test_tied_embeddings_train_and_resume(corpus_and_tokenizer, tmp_path):
    """`--tie-embeddings`: a run whose head 0 reads tok_emb lowers its loss, saves no heads.0, and
    resumes as a tied model."""
    run_dir = tmp_path / "run"
    result = cli(*pretrain_args(corpus_and_tokenizer, run_dir, 40, "--tie-embeddings", "--eval-every", 20,
                                "--ckpt-every", 20, "--sample-prompt", "x"))
    assert result.returncode == 0, result.stderr
    saved = checkpoint.read_json(run_dir / "config.json")
    assert saved["tie_embeddings"] is True and saved["training"]["tie_embeddings"] is True
    tensors, _ = checkpoint.load_tensors(run_dir / "model.safetensors")
    assert "heads.0" not in tensors and "heads.3" in tensors
    rows = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    resumed = train.resume_run(run_dir, {"steps": 44}, quiet)
    assert resumed.model.cfg.tie_embeddings
    row, _ = train.train(resumed, quiet)
    assert row["step"] == 44 and np.isfinite(row["loss"])
