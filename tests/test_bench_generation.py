"""`bench --generate` against Hugging Face transformers: a model with one head, as `import` makes
them, decoded by nanoeuler and by transformers' `generate` on the same weights and prompt."""

import importlib.util

import pytest

from cli_helpers import run_cli
from nanoeuler_core import Model, ModelConfig

pytest.importorskip("torch")
pytest.importorskip("transformers")

BENCH = ("bench", "--generate", "--prompt-tokens", 4, "--new-tokens", 8, "--prefill-tokens", 16, "--steps", 1)


@pytest.fixture
def one_head_run(tmp_path, tok):
    """A tiny run directory with one head (n_mtp 1), its head scaled up so that greedy choices are
    clear-cut (untrained logits are nearly equal, and argmax would hinge on rounding)."""
    cfg = ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=48,
                      ctx_len=64, n_mtp=1)
    model = Model(cfg, backend="cpu", seed=0)
    params = model.params
    params[cfg.head_names()[0]] = params[cfg.head_names()[0]] * 40.0
    model.load_params(params)
    model.save(tmp_path / "run")
    tok.save(tmp_path / "run" / "tokenizer.json")
    return tmp_path / "run"


def table(stdout: str) -> dict[str, list[str]]:
    """The rows of bench's table (the lines after its header up to the first that names no engine):
    engine name -> the figures after it."""
    lines = stdout.splitlines()
    rows = {}
    for line in lines[next(i for i, line in enumerate(lines) if line.startswith("engine ")) + 1:]:
        if not line.startswith(("nanoeuler ", "torch ", "transformers ")):
            break
        rows[line[:44].strip()] = line[44:].split()
    return rows


def test_bench_decodes_a_one_head_model_against_transformers(one_head_run, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, *BENCH, "--run", one_head_run)
    assert code == 0, err
    rows = table(out)
    assert list(rows) == ["nanoeuler plain", "torch eager, KV cache", "transformers generate, float32"], out
    tokens_per_s, _, memory_mb, vs_plain, same = rows["transformers generate, float32"]
    assert float(tokens_per_s) > 0 and float(memory_mb) > 0 and float(vs_plain) > 0
    assert same == "8/8"   # greedy on the same weights and prompt: the same tokens
    assert "prefill, 16-token prompt x 1: transformers generate " in out
    speeds = {name: float(row[0]) for name, row in rows.items() if not name.startswith("nanoeuler")}
    strongest = max(speeds, key=speeds.get)
    ratio = [line for line in out.splitlines() if line.startswith("ratio nanoeuler (best) / ")]
    assert len(ratio) == 1 and ratio[0].startswith(f"ratio nanoeuler (best) / {strongest}: "), out


def test_bench_without_transformers_says_so_in_one_line(one_head_run, monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else
                        find_spec(name, *a))
    code, out, err = run_cli(monkeypatch, capsys, *BENCH, "--run", one_head_run)
    assert code == 0, err
    assert list(table(out)) == ["nanoeuler plain", "torch eager, KV cache"]
    assert "transformers is not installed: no transformers peer (pip install 'nanoeuler[hf]')" in out.splitlines()
