"""Run-directory files (docs/files.md), written atomically: a crash never leaves a
half-written file where a good one was.

    config.json            model config (section 1 names at the top level) + "training" config
    model.safetensors      float32 weights under the section 2 names
    optimizer.safetensors  AdamW moments m.<name> / v.<name>; step and seed in the metadata
    tokenizer.json         Hugging Face tokenizers format
    metrics.jsonl          one JSON object per line
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np
import orjson

FORMAT = "nanoeuler-run/1"


class CheckpointError(ValueError):
    """A run directory or checkpoint file is missing, corrupt or does not fit the model."""


@contextmanager
def atomic_writer(path: Path) -> Iterator[BinaryIO]:
    """A binary file that replaces `path` only once fully written and fsynced: a crash leaves the
    old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write(path: Path, data: bytes) -> None:
    with atomic_writer(path) as fh:
        fh.write(data)


def _fsync_dir(path: Path) -> None:
    """Make renames inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj) -> None:
    atomic_write(path, orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY) + b"\n")


def read_json(path: Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} not found: is {path.parent} a nanoeuler run directory?")
    try:
        obj = orjson.loads(path.read_bytes())
    except (orjson.JSONDecodeError, OSError) as exc:
        raise CheckpointError(f"{path} is not readable JSON ({exc}); the run directory is corrupt") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return obj


def tensors_bytes(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors file of float32 tensors (integer and float16 tensors, quantized matrices' parts,
    keep their type), as bytes."""
    from safetensors.numpy import save

    data = {name: np.ascontiguousarray(t, dtype=np.float32 if t.dtype.kind == "f" and t.dtype != np.float16 else t.dtype)
            for name, t in tensors.items()}
    return save(data, metadata={"format": "np", **(metadata or {})})


def save_tensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    atomic_write(path, tensors_bytes(tensors, metadata))


def load_tensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Tensors and metadata of a safetensors file; CheckpointError if it is missing or corrupt."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} not found: is {path.parent} a nanoeuler run directory?")
    try:
        with safe_open(str(path), framework="np") as fh:
            return {name: fh.get_tensor(name) for name in fh.keys()}, dict(fh.metadata() or {})
    except Exception as exc:  # safetensors raises its own error types for truncated or foreign files
        raise CheckpointError(f"{path} is not a valid safetensors file ({type(exc).__name__}: {exc}); "
                              f"the checkpoint is corrupt") from None


# ------------------------------------------------------------------------------------------------
# multi-file checkpoints: model.safetensors and optimizer.safetensors must change together

PENDING = ".pending"
CHECKPOINT_FILES = ["optimizer.safetensors", "model.safetensors"]  # commit order: see recover


def commit_files(run_dir: Path, files: list[tuple[str, bytes]]) -> None:
    """Replace several files of `run_dir` as one checkpoint.

    Each file is first written completely as `<name>.pending` (atomic_write: fsynced, renamed),
    in order; only then are the pending files renamed over the old ones, in the same order. A
    crash at any point leaves either the old set or the new set recoverable by `recover`.
    """
    run_dir = Path(run_dir)
    for name, data in files:
        atomic_write(run_dir / (name + PENDING), data)
    for name, _ in files:
        os.replace(run_dir / (name + PENDING), run_dir / name)
    _fsync_dir(run_dir)


def recover(run_dir: Path, names: list[str]) -> None:
    """Finish or undo a `commit_files(run_dir, ...)` of `names` that a crash interrupted.

    The last file's pending copy exists only once every pending copy was complete: then the new
    checkpoint rolls forward. Otherwise the pending copies are an unfinished write and are dropped.
    """
    run_dir = Path(run_dir)
    pending = [run_dir / (name + PENDING) for name in names]
    complete = pending[-1].exists()
    for name, path in zip(names, pending):
        if path.exists():
            if complete:
                os.replace(path, run_dir / name)
            else:
                path.unlink()
    _fsync_dir(run_dir)
