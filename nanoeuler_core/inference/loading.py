"""A run directory's model and tokenizer, loaded together and checked to belong together."""

from __future__ import annotations

from pathlib import Path

from nanoeuler_core.engine import checkpoint
from nanoeuler_core.engine.checkpoint import CheckpointError
from nanoeuler_core.engine.config import ModelConfig
from nanoeuler_core.engine.model import Model
from nanoeuler_core.text.tokenizer import Tokenizer


def load_model(run_dir: Path, backend: str = "cpu", precision: str | None = None):
    """The model and tokenizer saved in a run directory, checked to belong together; the model
    runs in `precision` (the backend's default if None)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"run directory {run_dir} does not exist")
    checkpoint.recover(run_dir, checkpoint.CHECKPOINT_FILES)
    model = Model.load(run_dir, backend=backend, precision=precision)
    tok = Tokenizer.load(run_dir / "tokenizer.json")
    check_tokenizer(tok, model.cfg, run_dir)
    return model, tok


def check_tokenizer(tok, cfg: ModelConfig, run_dir: Path) -> None:
    if tok.vocab_size != cfg.vocab_size:
        raise CheckpointError(f"the model in {run_dir} has vocab_size {cfg.vocab_size} but the tokenizer has "
                              f"{tok.vocab_size} entries: use the tokenizer.json saved with that run")
