"""Engine commands: `ops` lists the registry, `gradcheck` validates every op and the whole model."""

from __future__ import annotations

from typing import Optional

import typer

from nanoeuler_core import gradcheck, registry


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
    for c in gradcheck.check_model_finite_differences(seed):
        failures += not c.ok
        typer.echo(c.line())
    model_backends = [b for b in (only or registry.backends()) if b != "reference" and registry.backend(b).available()]
    for name in model_backends:
        typer.echo(f"== model: {name} backend vs reference, loss and every gradient tensor")
        for c in gradcheck.check_model_backend(name, seed):
            failures += not c.ok
            typer.echo(c.line())
    if failures:
        typer.echo(f"gradcheck FAILED: {failures} check(s) out of bounds", err=True)
        raise typer.Exit(1)
    typer.echo("gradcheck passed")


def register(app: typer.Typer) -> None:
    app.command("ops")(ops)
    app.command("gradcheck")(gradcheck_cmd)
