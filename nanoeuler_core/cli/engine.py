"""Engine commands: `ops` lists the registry, `gradcheck` validates every op and the whole model."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from nanoeuler_core import registry
from nanoeuler_core.cli.train import RECOMPUTE_HELP
from nanoeuler_core.engine import gradcheck
from nanoeuler_core.engine.optim import OPTIMIZERS
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
    op_names: list[str] = typer.Option([], "--op", metavar="NAME", help="check only this op (repeatable); the "
                                                                       "model's checks then run only with --model"),
    model: Optional[bool] = typer.Option(None, "--model/--no-model", help="check the whole model's gradients too "
                                                                          "(default: yes, unless --op is given)"),
    simulate: bool = typer.Option(False, "--simulate", help="run the kernels of a backend whose device is missing "
                                                            "on its simulator (CUDA: Numba's CUDA simulator, slow)"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="print every comparison, not one line per op"),
    seed: int = typer.Option(0, help="seed for the sample inputs"),
) -> None:
    """Check every op (finite differences, every backend pair, the calls it must refuse) and the whole
    model's gradients; in a reduced precision, the backends running it against the float32 ones and
    the reference. Says which backends it checked, and which it skipped and why."""
    if simulate:
        _restart_on_simulators()
    if backend is not None:
        registry.backend(backend)  # unknown names fail here with the list of backends
    registry.precision(precision)  # unknown names fail here with the list of precisions
    ops = _selected_ops(op_names)
    only = [backend] if backend else None
    check_model = model if model is not None else not op_names
    checked_ops = {name: op for name, op in ops.items() if precision in gradcheck.op_precisions(op, only)}
    model_backends = [b for b in (only or registry.backends()) if not registry.backend(b).ground_truth
                      and registry.backend(b).available()
                      and registry.precision(precision) in registry.backend(b).precisions
                      and gradcheck.runs_model(b)]
    status = _backend_status(ops, only, precision)
    if precision != "fp32" and not checked_ops and not (check_model and model_backends):
        raise ValueError(f"nothing to check in {precision}: no backend usable here runs it ("
                         + "; ".join(f"{name}: {why.removeprefix('skipped, ')}" for name, (checked, why, _)
                                     in status.items() if not checked) + ")")
    typer.echo("== backends")
    for name, (_, why, _) in status.items():
        typer.echo(f"{name}: {why}")
    failures = 0
    typer.echo(f"== ops in {precision}: " + ("reference backward vs finite differences; every backend pair, "
                                             "forward and backward; the calls each op must refuse"
                                             if precision == "fp32" else
                                             "its backends against the float32 ones and the reference"))
    for name, op in ops.items():
        if name not in checked_ops:
            typer.echo(f"--   {name:<14} not checked: no backend usable here runs it in {precision}")
            continue
        checks = gradcheck.check_op(op, only, seed=seed, precision=precision)
        refusals = gradcheck.refusal_checks(op, only, seed=seed) if precision == "fp32" else []
        failures += _echo_op_checks(name, checks, verbose, refusals)
    for tied in (False, True) if check_model else ():
        cfg, which = gradcheck.tiny_config(tie_embeddings=tied), "model, tied embeddings" if tied else "model"
        typer.echo(f"== {which} (float64 reference): analytic gradient vs central finite differences")
        failures += _echo_checks(gradcheck.check_model_finite_differences(seed, cfg))
        for name in model_backends:
            bound = gradcheck.MODEL_BACKEND_BOUND if precision == "fp32" else gradcheck.MODEL_PRECISION_BOUND[precision]
            typer.echo(f"== {which}: {name} backend in {precision} vs reference, loss and every gradient tensor "
                       f"(bound {bound:.0e} of each tensor's scale)")
            failures += _echo_checks(gradcheck.check_model_backend(name, seed, cfg=cfg, bound=bound,
                                                                   precision=precision))
    if not check_model:
        typer.echo("== model: not checked (--op checks the ops named; add --model for the model's gradients too)")
    if failures:
        _verdict("gradcheck", failures)
    others = {}   # the other precisions the checked ops run in here -> those ops
    for name, op in checked_ops.items():
        for p in gradcheck.op_precisions(op, only):
            if p != precision:
                others.setdefault(p, []).append(name)
    for p, names in others.items():
        typer.echo(f"also in {p}: {', '.join(names)} (--precision {p} checks {'them' if len(names) > 1 else 'it'})")
    typer.echo(_passed(list(checked_ops), precision, status, model_backends if check_model else None))


def _passed(op_names: list[str], precision: str, status: dict, model_backends: list[str] | None) -> str:
    """The verdict of a gradcheck that passed, claiming no more than it checked: the ops, the
    backends, the model (None: not checked), and the backends left out with why."""
    what = f"{len(op_names)} op{'s' if len(op_names) != 1 else ''}"
    if len(op_names) <= 3:
        what += f" ({', '.join(op_names) or 'none'})"
    checked_on = [name for name, (checked, _, _) in status.items() if checked]
    line = f"gradcheck passed: {what} in {precision} on {', '.join(checked_on)}"
    if model_backends is not None:
        line += "; the model's gradients: float64 vs finite differences" + \
            (f", {', '.join(model_backends)} vs the reference" if model_backends else "")
    left_out = [f"{name} ({short})" for name, (checked, _, short) in status.items() if not checked]
    return line + (f"; not checked: {', '.join(left_out)}" if left_out else "")


def _selected_ops(names: list[str]) -> dict:
    """The registered ops called `names` (all of them, sorted, if none is named); a ValueError
    naming the registered ops for a name that is none of them."""
    ops = registry.ops()
    unknown = [name for name in names if name not in ops]
    if unknown:
        raise ValueError(f"no op named {', '.join(repr(n) for n in unknown)} (registered: {', '.join(sorted(ops))})")
    return {name: ops[name] for name in (dict.fromkeys(names) or sorted(ops))}


def _backend_status(ops: dict, only: list[str] | None, precision: str) -> dict[str, tuple[bool, str, str]]:
    """backend name -> (whether the checks of `ops` in `precision` run on it, what to say of it,
    the same in a few words for a backend they skip)."""
    status = {}
    for name, be in sorted(registry.backends().items(), key=lambda item: not item[1].ground_truth):
        lacking = [op for op in ops if name not in ops[op].backend_names()]
        lacks = f"lacks op{'s' if len(lacking) > 1 else ''} {', '.join(lacking)}"
        if be.ground_truth:
            status[name] = (True, "the float64 ground truth the others are checked against", "")
        elif only and name not in only:
            status[name] = (False, f"not asked (--backend {only[0]})", "not asked")
        elif not be.available():
            simulate = f"; --simulate runs its kernels on {be.simulator}, slowly" if be.simulator else ""
            status[name] = (False, f"skipped, not usable here ({be.install_hint or 'unavailable'}){simulate}",
                            "not usable here" + ("; --simulate" if be.simulator else ""))
        elif len(lacking) == len(ops):
            status[name] = (False, f"skipped, {lacks}", lacks)
        else:
            where = f" on {be.simulator}" if be.simulated() else ""
            runs = "" if registry.precision(precision) in be.precisions else \
                f" in fp32, the baseline (it does not run {precision} here)"
            status[name] = (True, f"checked{where}{runs}" + (f"; {lacks}" if lacking else ""), "")
    return status


def _restart_on_simulators() -> None:
    """Run this command again with the simulator of every backend that is unusable here turned on:
    a simulator is chosen by environment variables its library reads when it is first imported,
    which has happened by now."""
    env = {}
    for be in registry.backends().values():
        if be.simulator_env and not be.simulated() and not be.available():
            env.update(be.simulator_env)
    if not env:
        return
    if "--simulate" not in sys.argv:   # called from Python, not from the command line: nothing to restart
        raise ValueError("--simulate needs " + " ".join(f"{k}={v}" for k, v in env.items())
                         + " set before Python starts")
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "nanoeuler_core.cli", *sys.argv[1:]], {**os.environ, **env})


def _echo_op_checks(name: str, checks, verbose: bool, refusals=()) -> int:
    """One line per op (every comparison with --verbose), the failures spelled out; returns how many failed."""
    bad = [c for c in [*checks, *refusals] if not c.ok]
    if verbose:
        for c in [*checks, *refusals]:
            typer.echo("  " + c.line())
    else:
        backend_diffs = [c.max_abs for c in checks if c.b != "finite diff"]
        pairs = sorted({f"{c.a}/{c.b}" for c in checks})
        refused = f"; refuses {len({c.sample for c in refusals})} error inputs on " \
                  f"{', '.join(dict.fromkeys(c.backend for c in refusals))}" if refusals else ""
        largest = f"largest backend difference {max(backend_diffs):.1e}" if backend_diffs else "no backend pair"
        typer.echo(f"{'ok  ' if not bad else 'FAIL'} {name:<14} {len(checks):>3} checks ({', '.join(pairs)}); "
                   f"{largest}{refused}")
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
        failures += _echo_checks([check_graph_replay(backend, small, precision=p, optimizer=o) for o in OPTIMIZERS])
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
    decode_weights: Optional[str] = typer.Option(None, help="with --generate: the weights nanoeuler's decoding reads, "
                                                            "bf16, fp32, int8 or int4 (default: --precision's; a "
                                                            "quantized run's own)"),
    profile: bool = typer.Option(False, help="also time each op in an eager step"),
    recompute: bool = typer.Option(False, help="nanoeuler with " + RECOMPUTE_HELP),
    peers: bool = typer.Option(True, help="compare with PyTorch (and, decoding a --run, transformers) where installed"),
    startup: bool = typer.Option(False, help="also time a cold (empty kernel cache) and a warm start"),
    generate: bool = typer.Option(False, help="time decoding instead of training: plain, speculative and the default "
                                              "policy, against PyTorch with a KV cache (and torch.compile on a GPU; for a --run, "
                                              "transformers' generate)"),
    run: Optional[Path] = typer.Option(None, help="with --generate: the run directory whose weights to decode "
                                                  "with (default: random weights of --preset)"),
    prompt_tokens: int = typer.Option(16, help="with --generate: prompt length in tokens"),
    prompt_from: str = typer.Option("held-out", help="with --generate: where in the run's corpus (else the bundled "
                                                     "one) the prompt comes from: held-out (its validation split) or "
                                                     "training (its start)"),
    new_tokens: int = typer.Option(256, help="with --generate: new tokens per row (capped to fit the context)"),
    prefill_tokens: int = typer.Option(512, help="with --generate: the prompt whose prefill is timed (capped to fit "
                                                 "the context)"),
    temperature: float = typer.Option(0.0, help="with --generate: 0 = greedy (the peers run only then)"),
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
        weights = decode_weights or precision
        check_weights(backend, weights)
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
                       temperature, peers, weights, prefill_tokens, prompt_from, echo=typer.echo)
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
