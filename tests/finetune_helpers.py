"""Shared by the fine-tuning tests (test_sft, test_dpo, test_chat): a tiny base run and the CLI."""

import json

import typer

from nanoeuler_core.cli import finetune
from nanoeuler_core.engine.config import ModelConfig
from nanoeuler_core.engine.model import Model

TINY = dict(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=48, ctx_len=96, n_mtp=2)


def make_base_run(path, tok, seed=0, **overrides):
    """A run directory as pretrain writes it (config.json, model.safetensors, tokenizer.json) of a tiny model."""
    model = Model(ModelConfig(vocab_size=tok.vocab_size, **{**TINY, **overrides}), backend="cpu", seed=seed)
    model.save(path, training={"preset": "small"})
    tok.save(path / "tokenizer.json")
    return path


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def cli():
    app = typer.Typer()
    finetune.register(app)
    return app
