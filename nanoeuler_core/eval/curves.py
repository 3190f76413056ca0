"""Training curves of one or more runs, overlaid: loss (training, thin; its moving average; and
validation, dashed with markers) and the learning rate against tokens seen, plus HellaSwag
acc_norm when a run measured it (`pretrain --eval-hellaswag-every`), against tokens seen or against
seconds of training (each row's `time`: runs of different speeds compared by the clock).

Tokens seen at a metrics row are its `tokens` field when it has one, else step x batch_size x
ctx_len from the run's config.json (for fine-tuning runs, the padded sequences' upper bound).
Drawn with matplotlib's Agg canvas: no display needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from nanoeuler_core.engine import checkpoint


@dataclass
class RunCurves:
    name: str
    tokens: np.ndarray      # tokens seen at each row
    rows: list[dict]        # metrics.jsonl
    x: str = "tokens"       # what `series` pairs the values with: "tokens" or "seconds"

    def series(self, field: str) -> tuple[np.ndarray, np.ndarray]:
        """(tokens or seconds, values) of the rows that have `field`."""
        at = self.tokens if self.x == "tokens" else [row.get("time", np.nan) for row in self.rows]
        picked = [(t, row[field]) for t, row in zip(at, self.rows) if row.get(field) is not None]
        if not picked:
            return np.empty(0), np.empty(0)
        tokens, values = zip(*picked)
        return np.asarray(tokens, dtype=np.float64), np.asarray(values, dtype=np.float64)


def read_run(run_dir: Path, name: str | None = None) -> RunCurves:
    """The metrics of a run directory, with tokens seen at each row."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist")
    config = checkpoint.read_json(run_dir / "config.json")
    path = run_dir / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_bytes().splitlines():
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue  # a line cut short by a crash
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
    if not rows:
        raise ValueError(f"{run_dir} has no metrics to plot (metrics.jsonl is missing or empty): train it first")
    tokens_per_step = config.get("training", {}).get("batch_size", 0) * config.get("ctx_len", 0)
    tokens = np.array([row.get("tokens", row["step"] * tokens_per_step) for row in rows], dtype=np.float64)
    return RunCurves(name or run_dir.name, tokens, rows)


def run_names(run_dirs: list[Path]) -> list[str]:
    """Legend names: each directory's name, with its parent where two names would clash."""
    names = [Path(d).name or str(d) for d in run_dirs]
    return [f"{Path(d).parent.name}/{n}" if names.count(n) > 1 else n for d, n in zip(run_dirs, names)]


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over up to `window` values (shorter at the start)."""
    sums = np.cumsum(np.insert(values, 0, 0.0))
    counts = np.minimum(np.arange(1, len(values) + 1), window)
    return (sums[1:] - sums[np.arange(1, len(values) + 1) - counts]) / counts


X_AXES = {"tokens": "tokens seen", "seconds": "seconds of training"}


def plot_runs(run_dirs: list[Path], out: Path, x: str = "tokens") -> Path:
    """Draw the curves of `run_dirs` into the image `out` (format from its extension) against `x`
    (X_AXES); returns it."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import EngFormatter, PercentFormatter
    except ImportError:
        raise ValueError("plotting needs matplotlib: pip install 'nanoeuler[plot]'") from None
    if not run_dirs:
        raise ValueError("name at least one run directory to plot")
    if x not in X_AXES:
        raise ValueError(f"--x must be one of {', '.join(X_AXES)}, got '{x}'")
    runs = [read_run(d, name) for d, name in zip(run_dirs, run_names(list(run_dirs)))]
    for run in runs:
        run.x = x
    with_hellaswag = any(run.series("hellaswag_acc_norm")[0].size for run in runs)
    panels = 3 if with_hellaswag else 2
    figure = Figure(figsize=(9, 3.2 * panels + 0.6), layout="constrained")
    axes = figure.subplots(panels, 1, sharex=True, height_ratios=[2, 1, 1][:panels])
    colors = [f"C{i % 10}" for i in range(len(runs))]

    loss_ax, lr_ax = axes[0], axes[1]
    for run, color in zip(runs, colors):
        tokens, loss = run.series("loss")
        if loss.size:   # (a benchmark's rows may hold evaluations only)
            loss_ax.plot(tokens, loss, color=color, alpha=0.25, linewidth=0.8)
            window = max(1, len(loss) // 50)
            loss_ax.plot(tokens, moving_average(loss, window), color=color, linewidth=1.6, label=f"{run.name} train")
        tokens, val = run.series("val_loss")
        if val.size:
            loss_ax.plot(tokens, val, color=color, linestyle="--", marker="o", markersize=3.5, linewidth=1.2,
                         label=f"{run.name} validation")
        lr_ax.plot(*run.series("lr"), color=color, linewidth=1.4, label=run.name)
    loss_ax.set_ylabel("loss (nats)")
    loss_ax.set_title("training (moving average over the faint raw steps) and validation loss")
    loss_ax.legend(fontsize="small", ncols=2 if len(runs) > 2 else 1)
    lr_ax.set_ylabel("learning rate")
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if with_hellaswag:
        hs_ax = axes[2]
        for run, color in zip(runs, colors):
            tokens, acc = run.series("hellaswag_acc_norm")
            if acc.size:
                hs_ax.plot(tokens, acc, color=color, marker="o", markersize=3.5, label=run.name)
        hs_ax.axhline(0.25, color="grey", linestyle=":", linewidth=1, label="random (25%)")
        hs_ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        hs_ax.set_ylabel("HellaSwag acc_norm")
        hs_ax.legend(fontsize="small")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[-1].xaxis.set_major_formatter(EngFormatter())
    axes[-1].set_xlabel(X_AXES[x])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120)
    return out
