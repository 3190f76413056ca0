"""Engine commands: `ops` lists the registry, `gradcheck` validates every op and the whole model."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from nanoeuler_core import registry
from nanoeuler_core.cli.train import RECOMPUTE_HELP
from nanoeuler_core.engine import gradcheck
from nanoeuler_core.training.step import check_graph_replay


def ops() -> None:
    """List every registered op: the backends that have its kernels (those usable here marked *),
    the backends that lack them, and the package that registered it."""
    backends = registry.backends()
    rows = []
    for name, op in sorted(registry.ops().items()):
        has = op.backend_names()
        names = [b + ("*" if backends[b].available() else "") for b in has]
        lacks = [b for b in backends if b not in has]
        rows.append((name, " ".join(names), " ".join(lacks) or "-", op.source, op.summary))
    header = ("op", "backends", "lacking on", "package", "summary")
    width = [max(len(r[i]) for r in rows + [header]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        typer.echo("  ".join(f"{cell:<{w}}" for cell, w in zip(row, width)) + "  " + row[-1])
    typer.echo("* usable on this machine; an op is usable on a backend only where that backend has its kernels")


def gradcheck_cmd(
    backend: Optional[str] = typer.Option(None, help="check only this backend against the reference (default: all usable)"),
    precision: str = typer.Option("fp32", help="fp32, tf32 or bf16: the ops (and the model) that run in this precision"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="print every comparison, not one line per op"),
    seed: int = typer.Option(0, help="seed for the sample inputs"),
) -> None:
    """Check every op (finite differences and every backend pair) and the whole model's gradients;
    in a reduced precision, the backends running it against the float32 ones and the reference."""
    if backend is not None:
        registry.backend(backend)  # unknown names fail here with the list of backends
    registry.precision(precision)  # unknown names fail here with the list of precisions
    only = [backend] if backend else None
    failures = 0
    typer.echo(f"== ops in {precision}: " + ("reference backward vs finite differences; every backend pair, "
                                             "forward and backward" if precision == "fp32" else
                                             "its backends against the float32 ones and the reference"))
    for name, op in sorted(registry.ops().items()):
        if precision not in gradcheck.op_precisions(op, only):
            continue
        checks = gradcheck.check_op(op, only, seed=seed, precision=precision)
        failures += _echo_op_checks(name, checks, verbose)
    typer.echo("== model (float64 reference): analytic gradient vs central finite differences")
    failures += _echo_checks(gradcheck.check_model_finite_differences(seed))
    model_backends = [b for b in (only or registry.backends()) if not registry.backend(b).ground_truth
                      and registry.backend(b).available()
                      and registry.precision(precision) in registry.backend(b).precisions
                      and gradcheck.runs_model(b)]
    for name in model_backends:
        bound = gradcheck.MODEL_BACKEND_BOUND if precision == "fp32" else gradcheck.MODEL_PRECISION_BOUND[precision]
        typer.echo(f"== model: {name} backend in {precision} vs reference, loss and every gradient tensor "
                   f"(bound {bound:.0e} of each tensor's scale)")
        failures += _echo_checks(gradcheck.check_model_backend(name, seed, bound=bound, precision=precision))
    _verdict("gradcheck", failures)


def _echo_op_checks(name: str, checks, verbose: bool) -> int:
    """One line per op (every comparison with --verbose), the failures spelled out; returns how many failed."""
    bad = [c for c in checks if not c.ok]
    if verbose:
        for c in checks:
            typer.echo("  " + c.line())
    else:
        backend_diffs = [c.max_abs for c in checks if c.b != "finite diff"]
        pairs = sorted({f"{c.a}/{c.b}" for c in checks})
        typer.echo(f"{'ok  ' if not bad else 'FAIL'} {name:<14} {len(checks):>3} checks ({', '.join(pairs)}); "
                   f"largest backend difference {max(backend_diffs, default=0.0):.1e}")
        for c in bad:
            typer.echo("  " + c.line())
    return len(bad)


def _echo_checks(checks) -> int:
    """Print one line per check; return how many failed."""
    for c in checks:
        typer.echo(c.line())
    return sum(not c.ok for c in checks)


def _verdict(command: str, failures: int) -> None:
    if failures:
        typer.echo(f"{command} FAILED: {failures} check(s) out of bounds", err=True)
        raise typer.Exit(1)
    typer.echo(f"{command} passed")


def selftest(
    backend: str = typer.Option("cuda", help="the backend to test against its CPU twin"),
    precision: Optional[str] = typer.Option(None, help="fp32, tf32 or bf16 (default: every precision the backend runs)"),
    seed: int = typer.Option(0, help="seed for the inputs"),
) -> None:
    """Every kernel of BACKEND against the CPU, the `small` model's gradients, and the captured step,
    in each precision."""
    from nanoeuler_core.engine.config import ModelConfig

    be = registry.backend(backend)
    if backend == "cpu" or not be.available():
        raise ValueError(f"selftest compares a backend with the CPU: '{backend}' is not usable here")
    precisions = [be.check_precision(precision).name] if precision else [p.name for p in be.precisions]
    small = ModelConfig.preset("small")
    failures = 0
    for p in precisions:
        typer.echo(f"== ops in {p}: {backend} vs cpu (and the reference), forward and backward")
        for name, op in sorted(registry.ops().items()):
            if backend not in op.backend_names() or p not in op.precisions_on(backend):
                continue
            checks = [c for c in gradcheck.check_op(op, ["cpu", backend], seed=seed, precision=p) if c.b != "finite diff"]
            failures += _echo_op_checks(name, checks, verbose=False)
        bound = gradcheck.MODEL_PRECISION_BOUND[p]
        typer.echo(f"== model `small` in {p}: {backend} loss and gradients vs cpu (bound {bound:.0e} of each tensor's scale)")
        failures += _echo_checks(gradcheck.check_model_backend(backend, seed, against="cpu", cfg=small, batch_size=4,
                                                               bound=bound, precision=p))
        typer.echo(f"== training step in {p}: captured and replayed vs launched eagerly")
        failures += _echo_checks([check_graph_replay(backend, small, precision=p)])
    _verdict("selftest", failures)


def bench(
    preset: str = typer.Option("small", help="model preset: small, cpu-medium, gpu, gpu-medium or gpu-large"),
    backend: str = typer.Option("cpu", help="cpu or cuda"),
    batch_size: Optional[int] = typer.Option(None, help="sequences per step (default 8; with --generate: rows "
                                                        "decoded together, default 1)"),
    steps: Optional[int] = typer.Option(None, help="timed steps (default 20; with --generate: timed generations, "
                                                   "default 3)"),
    warmup: int = typer.Option(3, help="untimed steps first (compilation, graph capture)"),
    precision: Optional[str] = typer.Option(None, help="fp32, tf32 or bf16, in both engines (default: bf16 on a CUDA "
                                                       "GPU with tensor cores, fp32 on the CPU); with --generate: "
                                                       "bf16 or fp32, the weights nanoeuler's decoding reads"),
    profile: bool = typer.Option(False, help="also time each op in an eager step"),
    recompute: bool = typer.Option(False, help="nanoeuler with " + RECOMPUTE_HELP),
    peers: bool = typer.Option(True, help="compare with PyTorch where it is installed"),
    startup: bool = typer.Option(False, help="also time a cold (empty kernel cache) and a warm start"),
    generate: bool = typer.Option(False, help="time decoding instead of training: plain, speculative and the default "
                                              "policy, against PyTorch with a KV cache (and torch.compile on a GPU)"),
    run: Optional[Path] = typer.Option(None, help="with --generate: the run directory whose weights to decode "
                                                  "with (default: random weights of --preset)"),
    prompt_tokens: int = typer.Option(16, help="with --generate: prompt length in tokens"),
    prompt_from: str = typer.Option("held-out", help="with --generate: where in the run's corpus (else the bundled "
                                                     "one) the prompt comes from: held-out (its validation split) or "
                                                     "training (its start)"),
    new_tokens: int = typer.Option(256, help="with --generate: new tokens per row (capped to fit the context)"),
    prefill_tokens: int = typer.Option(512, help="with --generate: the prompt whose prefill is timed (capped to fit "
                                                 "the context)"),
    temperature: float = typer.Option(0.0, help="with --generate: 0 = greedy (the PyTorch peers run only then)"),
) -> None:
    """Training (or, with --generate, decoding) tokens/s and peak memory, against PyTorch on the same machine."""
    import tempfile

    be = registry.backend(backend)
    batch_size = batch_size if batch_size is not None else 1 if generate else 8
    steps = steps if steps is not None else 3 if generate else 20
    if be.ground_truth or steps < 1 or batch_size < 1:
        raise ValueError("bench needs --backend cpu or cuda, and positive --steps and --batch-size")
    if generate:
        from nanoeuler_core.bench import generation

        from nanoeuler_core.inference.decoder import check_weights

        if precision not in (None, "fp32", "bf16"):
            raise ValueError("decoding reads bf16 or fp32 weights: pass --precision bf16 or fp32 with --generate")
        check_weights(backend, precision)
        if prompt_tokens < 1 or new_tokens < 1 or prefill_tokens < 1 or temperature < 0:
            raise ValueError("bench --generate needs positive --prompt-tokens, --new-tokens and --prefill-tokens, "
                             "and --temperature >= 0")
        if prompt_from not in generation.PROMPT_SOURCES:
            raise ValueError(f"--prompt-from must be one of {', '.join(generation.PROMPT_SOURCES)}, got {prompt_from!r}")
        if run is not None and not (run / "config.json").is_file():
            raise ValueError(f"{run} is not a nanoeuler run directory (no config.json)")
        corpus = generation.run_corpus(run)
        if not corpus.is_file():
            raise ValueError(f"{run} was trained on {corpus}, which is missing: the prompts come from it")
        generation.run(preset, backend, str(run) if run else None, batch_size, prompt_tokens, new_tokens, steps,
                       temperature, peers, precision, prefill_tokens, prompt_from, echo=typer.echo)
        return
    from nanoeuler_core.bench import training as benchmark

    precision = be.check_precision(precision or be.default_precision).name
    if startup:
        with tempfile.TemporaryDirectory() as cache:
            cold, warm = benchmark.start_time(cache), benchmark.start_time(cache)
        typer.echo(f"start of a small forward+backward on the CPU: cold {cold:.1f} s (compiling kernels), "
                   f"warm {warm:.1f} s (cached kernels)")
    benchmark.run(preset, backend, batch_size, steps, warmup, precision, profile, peers, echo=typer.echo,
                  recompute=recompute)


def register(app: typer.Typer) -> None:
    app.command("ops")(ops)
    app.command("gradcheck")(gradcheck_cmd)
    app.command("selftest")(selftest)
    app.command("bench")(bench)
