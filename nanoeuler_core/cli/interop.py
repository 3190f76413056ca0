"""Interoperability commands: `export` (Hugging Face), `import` (Hugging Face or GGUF)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from nanoeuler_core.interop import gguf, hf


def _log(msg: str) -> None:
    typer.echo(msg, err=True)


def export_command(
    run_dir: Path = typer.Argument(..., help="a run directory (from pretrain, sft, dpo or import)"),
    out: Path = typer.Argument(..., help="directory to write the Hugging Face model to"),
) -> None:
    """Write RUN_DIR as a Hugging Face Llama directory that transformers loads (extra MTP heads kept beside it)."""
    hf.export_run(run_dir, out, _log)
    typer.echo(f"load it with transformers: AutoModelForCausalLM.from_pretrained({str(out)!r}); "
               f"AutoTokenizer.from_pretrained({str(out)!r})")


def import_command(
    source: Path = typer.Argument(..., help="a local Llama-architecture checkpoint directory (config.json, "
                                            "*.safetensors, tokenizer.json), or a llama.cpp .gguf file of one "
                                            "(F32, F16, BF16, Q8_0, Q4_0, Q4_1 tensors, dequantized to float32)"),
    out: Path = typer.Argument(..., help="run directory to create"),
    n_mtp: Optional[int] = typer.Option(None, help="output heads (default: the checkpoint's; 1 for a plain Llama); "
                                                   "missing heads start as copies of the first"),
    ctx_len: Optional[int] = typer.Option(None, help="context length (default: max_position_embeddings, or "
                                                     "llama.context_length of a .gguf file)"),
) -> None:
    """Turn a Hugging Face Llama checkpoint or a Llama .gguf file into a run directory for generate, chat, sft,
    dpo and pretrain --resume."""
    read = gguf.import_gguf if source.suffix == ".gguf" else hf.import_checkpoint
    read(source, out, n_mtp=n_mtp, ctx_len=ctx_len, log=_log)
    typer.echo(f"sample it: nanoeuler-run generate {out} \"Once upon a time\"; fine-tune it: "
               f"nanoeuler-run sft --base {out}")


def register(app: typer.Typer) -> None:
    app.command("export")(export_command)
    app.command("import")(import_command)
