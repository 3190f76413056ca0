"""HellaSwag scoring (lm-evaluation-harness's preprocessing and log-likelihoods, checked against
transformers on an exported model), its download, its use during pretraining, and the curves plot."""

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest

from cli_helpers import run_cli
from nanoeuler_core.corpus import downloads as datasets
from nanoeuler_core.engine.config import ModelConfig
from nanoeuler_core.engine.model import Model
from nanoeuler_core.eval import curves, hellaswag
from nanoeuler_core.text.tokenizer import Tokenizer

FIXTURE = Path(__file__).parent / "fixtures" / "hellaswag_val_sample.jsonl"
CORPUS = (Path(__file__).parents[1] / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(CORPUS[:300_000], 512)


@pytest.fixture(scope="module")
def run_dir(tok, tmp_path_factory):
    """A run of the small shape with a 64-token context: several fixture items are cut to their tail."""
    path = tmp_path_factory.mktemp("run")
    Model(ModelConfig.preset("small", ctx_len=64), seed=5).save(path, training={"preset": "small", "batch_size": 8})
    tok.save(path / "tokenizer.json")
    return path


# ------------------------------------------------------------------------------------------------
# the task


def test_items_are_preprocessed_as_the_harness_does():
    items = hellaswag.load_items(FIXTURE)
    assert len(items) == 8 and [item.label for item in items] == [0, 1, 0, 2, 1, 3, 0, 2]
    assert items[0].context == "Washing dishes: A woman stands at a kitchen sink filled with soapy water. She"
    assert items[5].context.endswith("by the front door. The dog")  # ctx_b.capitalize() lowers the rest
    assert items[2].context == ("Home and Garden: How to water a vegetable garden. Water early in the morning. "
                                "Morning watering lets the soil absorb moisture before the heat of the day.")
    # A leading "[title]" has no space before it: only the tag goes, and its space stays (as in the harness);
    # "  " -> " " is one pass, so three spaces become two.
    assert items[2].endings[0] == " Water at the base of the plants. Wet leaves can encourage disease, so aim for the soil."
    assert items[2].endings[2] == " Pour salt on the seedlings.  This makes them grow faster."
    assert hellaswag.preprocess("a [x]  b [title] c") == "a  b. c"
    assert len(hellaswag.load_items(FIXTURE, limit=3)) == 3


def test_scoring_rows_keep_the_tail_and_score_only_the_ending(tok):
    items = hellaswag.load_items(FIXTURE)
    rows = hellaswag.scoring_rows(tok, items, ctx_len=32)
    assert len(rows) == 4 * len(items)
    for item, (sequence, n_scored) in zip([i for i in items for _ in range(4)], rows):
        assert len(sequence) <= 33
    sequence, n_scored = rows[0]
    whole = tok.encode(items[0].context + " " + items[0].endings[0])
    assert sequence == whole[-33:] and n_scored == len(whole) - len(tok.encode(items[0].context))


def test_batched_scores_equal_one_at_a_time(run_dir, tok):
    from nanoeuler_core.inference.loading import load_model

    model, _ = load_model(run_dir)
    items = hellaswag.load_items(FIXTURE)
    _, batched = hellaswag.evaluate(model, tok, items, batch_size=7)
    _, single = hellaswag.evaluate(model, tok, items, batch_size=1)
    assert np.allclose(batched, single, rtol=1e-5, atol=1e-4)


def harness_logprobs_in_transformers(export_dir: Path, items) -> np.ndarray:
    """lm-evaluation-harness's loglikelihood for each (context, " " + ending), run by transformers."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(export_dir)
    max_length = model.config.max_position_embeddings
    scores = np.zeros((len(items), 4))
    for i, item in enumerate(items):
        for j, ending in enumerate(item.endings):
            context_enc = tokenizer(item.context, add_special_tokens=False)["input_ids"]
            whole = tokenizer(item.context + " " + ending, add_special_tokens=False)["input_ids"]
            continuation_enc = whole[len(context_enc):]
            inp = (context_enc + continuation_enc)[-(max_length + 1):][:-1]
            with torch.no_grad():
                logits = torch.log_softmax(model(torch.tensor([inp])).logits[0], dim=-1)
            n = len(continuation_enc)
            picked = logits[len(inp) - n:].gather(1, torch.tensor(continuation_enc).unsqueeze(1))
            scores[i, j] = float(picked.sum())
    return scores


def test_same_scores_as_transformers_on_the_exported_model(run_dir, tok, tmp_path):
    pytest.importorskip("transformers")
    from nanoeuler_core.inference.loading import load_model
    from nanoeuler_core.interop import hf

    hf.export_run(run_dir, tmp_path / "hf", log=lambda msg: None)
    items = hellaswag.load_items(FIXTURE)
    model, _ = load_model(run_dir)
    ours_result, ours = hellaswag.evaluate(model, tok, items)
    theirs = harness_logprobs_in_transformers(tmp_path / "hf", items)
    assert np.allclose(ours, theirs, rtol=1e-4, atol=0)
    assert ours_result == hellaswag.metrics(items, theirs)


# ------------------------------------------------------------------------------------------------
# commands


def test_eval_command_prints_json_and_writes_the_items(run_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "result.json"
    code, stdout, stderr = run_cli(monkeypatch, capsys, "eval", run_dir, "--task", "hellaswag", "--data", FIXTURE,
                                   "--limit", 5, "--out", out, "--batch-size", 4)
    assert code == 0, stderr
    result = json.loads(stdout)
    assert result["task"] == "hellaswag" and result["n"] == 5 and 0 <= result["acc_norm"] <= 1
    assert "endings scored" in stderr and "acc_norm" in stderr
    detail = json.loads(out.read_text())
    assert len(detail["items"]) == 5 and len(detail["items"][0]["logprobs"]) == 4


def test_text_loss_is_the_mean_next_token_loss_over_windows(run_dir, tok, tmp_path, monkeypatch, capsys):
    """`eval --task loss`: windows of --window targets, each token predicted from those before it in
    its window; the mean of their cross-entropies, whatever the batch."""
    text = CORPUS[300_000:302_000]
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    code, stdout, stderr = run_cli(monkeypatch, capsys, "eval", run_dir, "--task", "loss", "--data",
                                   tmp_path / "text.txt", "--window", 50, "--batch-size", 3)
    assert code == 0, stderr
    result = json.loads(stdout)
    ids = tok.encode(text)
    model = Model.load(run_dir)
    total = 0.0
    for start in range(0, len(ids) - 1, 50):
        piece = np.array([ids[start:start + 51]])
        total -= model.token_logprobs(piece[:, :-1], piece[:, 1:]).sum()
    assert result["tokens"] == len(ids) - 1 and result["loss"] == pytest.approx(total / (len(ids) - 1), rel=1e-5)
    assert result["perplexity"] == pytest.approx(np.exp(result["loss"])) and "nats" in stderr


@pytest.mark.parametrize("args, message", [
    (("--task", "loss"), "eval --task loss needs --data"),
    (("--task", "mmlu"), "unknown task 'mmlu'"),
    (("--data", "{bad}"), "not a HellaSwag item"),
    (("--data", "{missing}"), "not found"),
    ((), "download it with `nanoeuler-run data hellaswag`"),
    (("--data", FIXTURE, "--limit", 0), "--limit must be at least 1"),
])
def test_eval_errors_are_one_line(run_dir, tmp_path, monkeypatch, capsys, args, message):
    (tmp_path / "bad.jsonl").write_text('{"ctx_a": "x"}\n')
    monkeypatch.chdir(tmp_path)  # no corpora/hellaswag here
    args = [str(a).format(bad=tmp_path / "bad.jsonl", missing=tmp_path / "missing.jsonl") for a in args]
    code, _, stderr = run_cli(monkeypatch, capsys, "eval", run_dir, *args)
    assert code == 1 and stderr.count("\n") == 1 and message in stderr, stderr


def test_hellaswag_download_is_checked_and_recorded(tmp_path):
    from test_data import FixtureServer

    body = FIXTURE.read_bytes()
    server = FixtureServer({"/hellaswag_val.jsonl": body})
    try:
        url = f"{server.url}/hellaswag_val.jsonl"
        path = datasets.hellaswag(tmp_path / "hs" / "val.jsonl", url=url, sha256=hashlib.sha256(body).hexdigest())
        assert path.read_bytes() == body and "val.jsonl" in datasets.read_manifest(tmp_path / "hs")
        with pytest.raises(datasets.ChecksumError, match="does not match the pinned"):
            datasets.hellaswag(tmp_path / "other.jsonl", url=url)  # the real file's digest
    finally:
        server.close()


def cli_process(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanoeuler_core.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=600)


def test_pretrain_scores_hellaswag_and_ends_with_the_plot_command(tok, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS[:60_000])
    tok.save(tmp_path / "tokenizer.json")
    done = cli_process("pretrain", "--corpus", corpus, "--tokenizer", tmp_path / "tokenizer.json", "--steps", 4,
                       "--batch-size", 2, "--eval-every", 4, "--out", tmp_path / "run", "--eval-hellaswag-every", 2,
                       "--hellaswag-file", FIXTURE, "--hellaswag-limit", 6, "--sample-prompt", "A")
    assert done.returncode == 0, done.stderr
    rows = [orjson.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_bytes().splitlines()]
    assert [r["step"] for r in rows if "hellaswag_acc_norm" in r] == [2, 4]
    assert "val nan" not in done.stderr and "step 1/4 | loss" in done.stderr
    assert f"nanoeuler-run plot {tmp_path / 'run'}" in done.stderr
    resumed = cli_process("pretrain", "--resume", tmp_path / "run", "--steps", 5, "--hellaswag-limit", 3)
    rows = [orjson.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_bytes().splitlines()]
    assert resumed.returncode == 0 and "hellaswag_acc" in rows[-1] and rows[-1]["step"] == 5, resumed.stderr


# ------------------------------------------------------------------------------------------------
# curves


def write_run(path: Path, steps: int, batch_size: int, ctx_len: int, hellaswag_every: int = 0) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"ctx_len": ctx_len, "training": {"batch_size": batch_size}}))
    rows = []
    for step in range(1, steps + 1):
        row = {"step": step, "loss": 5.0 * math.exp(-step / 40) + 2 + 0.1 * math.sin(step), "lr": 1e-3 * min(1, step / 10),
               "time": 0.25 * step * batch_size}
        if step % 20 == 0:
            row["val_loss"] = 5.0 * math.exp(-step / 40) + 2.1
        if hellaswag_every and step % hellaswag_every == 0:
            row["hellaswag_acc_norm"] = 0.25 + step / 4000
        rows.append(orjson.dumps(row))
    (path / "metrics.jsonl").write_bytes(b"\n".join(rows) + b"\n{\"step\": 10")  # a line cut by a crash
    return path


def test_tokens_seen_and_legend_names(tmp_path):
    run = curves.read_run(write_run(tmp_path / "a" / "run", 100, 8, 128))
    assert len(run.rows) == 100 and run.tokens[0] == 8 * 128 and run.tokens[-1] == 100 * 8 * 128
    assert run.series("val_loss")[0].tolist() == [s * 1024 for s in (20, 40, 60, 80, 100)]
    run.x = "seconds"
    assert run.series("val_loss")[0].tolist() == [0.25 * s * 8 for s in (20, 40, 60, 80, 100)]
    assert curves.run_names([Path("x/a/run"), Path("x/b/run"), Path("c")]) == ["a/run", "b/run", "c"]
    assert np.allclose(curves.moving_average(np.array([1.0, 3, 5, 7]), 2), [1, 2, 4, 6])


def test_plot_overlays_runs(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    first = write_run(tmp_path / "small", 200, 8, 128, hellaswag_every=50)
    second = write_run(tmp_path / "bigger-batch", 100, 16, 128)
    code, stdout, stderr = run_cli(monkeypatch, capsys, "plot", first, second, "--out", tmp_path / "curves.png")
    assert code in (0, None), stderr
    image = (tmp_path / "curves.png").read_bytes()
    assert image.startswith(b"\x89PNG") and len(image) > 20_000 and "curves of 2 run(s)" in stdout
    code, _, stderr = run_cli(monkeypatch, capsys, "plot", first, second, "--x", "seconds", "--out", tmp_path / "s.png")
    assert code in (0, None), stderr
    assert (tmp_path / "s.png").read_bytes() != image


def test_plot_errors_are_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "config.json").write_text("{}")
    write_run(tmp_path / "done", 10, 8, 128)
    for args, message in (((tmp_path / "fresh",), "has no metrics to plot"), ((tmp_path / "missing",), "does not exist"),
                          ((tmp_path / "done", "--x", "steps"), "--x must be one of tokens, seconds")):
        code, _, stderr = run_cli(monkeypatch, capsys, "plot", *args, "--out", tmp_path / "c.png")
        assert code == 1 and stderr.count("\n") == 1 and message in stderr, stderr


@pytest.mark.gpu
def test_eval_on_the_gpu_gives_the_cpu_scores(run_dir, tmp_path):
    import numba
    from numba import cuda

    if numba.config.ENABLE_CUDASIM or not cuda.is_available():
        pytest.skip("needs a real CUDA GPU")
    scores = {}
    for backend in ("cpu", "cuda"):
        done = cli_process("eval", run_dir, "--data", FIXTURE, "--backend", backend, "--out", tmp_path / f"{backend}.json")
        assert done.returncode == 0, done.stderr
        items = json.loads((tmp_path / f"{backend}.json").read_text())["items"]
        scores[backend] = np.array([item["logprobs"] for item in items])
    assert np.allclose(scores["cuda"], scores["cpu"], rtol=2e-3)  # TF32 matrix products on the GPU
