"""Engine commands: `ops` lists the registry, `gradcheck` validates every op and the whole model."""

from __future__ import annotations

from typing import Optional

import typer

from nanoeuler_core import registry
from nanoeuler_core.engine import gradcheck


def ops() -> None:
    """List every registered op with its backends (those usable here marked *) and its package."""
    backends = registry.backends()
    rows = []
    for name, op in sorted(registry.ops().items()):
        names = [b + ("*" if b in backends and backends[b].available() else "") for b in op.backend_names()]
        rows.append((name, " ".join(names), op.source, op.summary))
    width = [max(len(r[i]) for r in rows + [("op", "backends", "package", "")]) for i in range(3)]
    typer.echo(f"{'op':<{width[0]}}  {'backends':<{width[1]}}  {'package':<{width[2]}}  summary")
    for row in rows:
        typer.echo(f"{row[0]:<{width[0]}}  {row[1]:<{width[1]}}  {row[2]:<{width[2]}}  {row[3]}")
    typer.echo("* usable on this machine")


def gradcheck_cmd(
    backend: Optional[str] = typer.Option(None, help="check only this backend against the reference (default: all usable)"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="print every comparison, not one line per op"),
    seed: int = typer.Option(0, help="seed for the sample inputs"),
) -> None:
    """Check every op (finite differences and every backend pair) and the whole model's gradients."""
    if backend is not None:
        registry.backend(backend)  # unknown names fail here with the list of backends
    only = [backend] if backend else None
    failures = 0
    typer.echo("== ops: reference backward vs finite differences; every backend pair, forward and backward")
    for name, op in sorted(registry.ops().items()):
        checks = gradcheck.check_op(op, only, seed=seed)
        bad = [c for c in checks if not c.ok]
        failures += len(bad)
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

    typer.echo("== model (float64 reference): analytic gradient vs central finite differences")
    failures += _echo_checks(gradcheck.check_model_finite_differences(seed))
    model_backends = [b for b in (only or registry.backends()) if b != "reference" and registry.backend(b).available()]
    for name in model_backends:
        typer.echo(f"== model: {name} backend vs reference, loss and every gradient tensor")
        failures += _echo_checks(gradcheck.check_model_backend(name, seed))
    _verdict("gradcheck", failures)


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
    seed: int = typer.Option(0, help="seed for the inputs"),
) -> None:
    """Every kernel of BACKEND against the CPU, the `small` model's gradients, and the captured step."""
    from nanoeuler_core.engine.config import ModelConfig

    be = registry.backend(backend)
    if backend == "cpu" or not be.available():
        raise ValueError(f"selftest compares a backend with the CPU: '{backend}' is not usable here")
    failures = 0
    typer.echo(f"== ops: {backend} vs cpu (and the reference), forward and backward")
    for name, op in sorted(registry.ops().items()):
        if backend not in op.backends:
            typer.echo(f"skip {name:<14} (no {backend} implementation)")
            continue
        checks = [c for c in gradcheck.check_op(op, ["cpu", backend], seed=seed) if c.b != "finite diff"]
        bad = [c for c in checks if not c.ok]
        failures += len(bad)
        typer.echo(f"{'ok  ' if not bad else 'FAIL'} {name:<14} {len(checks):>3} checks, largest difference "
                   f"{max(c.max_abs for c in checks):.1e}")
        for c in bad:
            typer.echo("  " + c.line())
    small = ModelConfig.preset("small")
    for precision, bound in (("highest", 1e-5), ("high", 5e-3)):
        be.matmul_precision = precision
        label = "TF32 on" if precision == "high" else "TF32 off"
        typer.echo(f"== model `small`: {backend} gradients vs cpu, {label} (bound {bound:.0e} of each tensor's scale)")
        failures += _echo_checks(gradcheck.check_model_backend(backend, seed, against="cpu", cfg=small, batch_size=4,
                                                               bound=bound))
    be.matmul_precision = "highest"
    typer.echo("== training step: captured and replayed vs launched eagerly")
    failures += _echo_checks([gradcheck.check_graph_replay(backend, small)])
    _verdict("selftest", failures)


def bench(
    preset: str = typer.Option("small", help="model preset"),
    backend: str = typer.Option("cpu", help="cpu or cuda"),
    batch_size: int = typer.Option(8, help="sequences per step"),
    steps: int = typer.Option(20, help="timed steps"),
    warmup: int = typer.Option(3, help="untimed steps first (compilation, graph capture)"),
    tf32: bool = typer.Option(True, help="CUDA: TF32 tensor-core matrix products, in both engines"),
    profile: bool = typer.Option(False, help="also time each op in an eager step"),
    peers: bool = typer.Option(True, help="compare with PyTorch where it is installed"),
    startup: bool = typer.Option(False, help="also time a cold (empty kernel cache) and a warm start"),
) -> None:
    """Training tokens/s, model FLOPs utilisation and peak memory, against PyTorch on the same machine."""
    import tempfile

    from nanoeuler_core.bench import training as benchmark

    if registry.backend(backend).name == "reference" or steps < 1 or batch_size < 1:
        raise ValueError("bench needs --backend cpu or cuda, and positive --steps and --batch-size")
    if startup:
        with tempfile.TemporaryDirectory() as cache:
            cold, warm = benchmark.start_time(cache), benchmark.start_time(cache)
        typer.echo(f"start of a small forward+backward on the CPU: cold {cold:.1f} s (compiling kernels), "
                   f"warm {warm:.1f} s (cached kernels)")
    benchmark.run(preset, backend, batch_size, steps, warmup, tf32, profile, peers, echo=typer.echo)


def register(app: typer.Typer) -> None:
    app.command("ops")(ops)
    app.command("gradcheck")(gradcheck_cmd)
    app.command("selftest")(selftest)
    app.command("bench")(bench)
