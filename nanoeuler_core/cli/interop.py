"""Interoperability commands: `export` (Hugging Face), `import` (Hugging Face or GGUF), `quantize`."""

from __future__ import annotations

import shutil
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


def quantize_command(
    run_dir: Path = typer.Argument(..., help="a run directory"),
    out: Path = typer.Argument(..., help="run directory to create, holding the quantized model"),
    bits: int = typer.Option(..., help="8 (int8) or 4 (int4): the bits of the blocks' weights; heads keep 8"),
    group: int = typer.Option(0, help="weights per scale (default: int8 one per output channel, int4 32); "
                                      "int4 groups are multiples of 32"),
    zero_point: bool = typer.Option(True, "--zero-point/--no-zero-point",
                                    help="int4: a zero point per group (as GGUF's Q4_1), or none (as Q4_0)"),
) -> None:
    """Write RUN_DIR with its matrices quantized to 8 or 4 bits, for decoding (generate, chat, serve,
    bench --generate read them); the other tensors stay float32."""
    from nanoeuler_core.engine import checkpoint
    from nanoeuler_core.engine.model import Model

    if bits not in (8, 4):
        raise ValueError(f"--bits must be 8 or 4, got {bits}")
    if out.exists():
        raise ValueError(f"{out} exists: quantize writes a new run directory")
    checkpoint.recover(run_dir, checkpoint.CHECKPOINT_FILES)
    model = Model.load(run_dir)
    before = (run_dir / "model.safetensors").stat().st_size
    model.quantize(f"int{bits}", group, zero_point)
    out.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, out / name)
    model.save(out)
    after = (out / "model.safetensors").stat().st_size
    _log(f"{len(model.quantized)} matrices quantized: {before / 2**20:,.1f} MB -> {after / 2**20:,.1f} MB")
    typer.echo(f"decode it: nanoeuler-run generate {out} \"Once upon a time\"")


def register(app: typer.Typer) -> None:
    app.command("export")(export_command)
    app.command("import")(import_command)
    app.command("quantize")(quantize_command)
