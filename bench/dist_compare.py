"""Summaries for the data-parallel GPU scripts (bench/run_gpu_dist.sh, bench/run_gpu_dist_multi.sh).

    python3 bench/dist_compare.py runs RUN_A RUN_B ...   # run directories against the first one
    python3 bench/dist_compare.py steps FILE.jsonl       # bench/bench_dist.py results, one JSON a line

`runs`: for each run, the largest relative difference of its per-step loss from RUN_A's, the
relative difference of its final weights (|a - b| / |a| over the whole model), and its median
tokens/s in all and per rank (steps after the 5th, evaluation steps left out).
`steps`: per (variant, ranks, batch, grad-accum): median ms/step over the repeats, tokens/s in all
and per rank, memory by rank, and whether every repeat's losses equal the plain variant's.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import numpy as np

from nanoeuler_core.engine import checkpoint


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def compare_runs(dirs: list[Path]) -> None:
    base_rows = _rows(dirs[0])
    base_w, _ = checkpoint.load_tensors(dirs[0] / "model.safetensors")
    print(f"{'run':<28} {'steps':>6} {'max rel loss diff':>18} {'weights rel diff':>17} {'tokens/s':>10}")
    for d in dirs:
        rows = _rows(d)
        n = min(len(rows), len(base_rows))
        a = np.array([r["loss"] for r in base_rows[:n]])
        b = np.array([r["loss"] for r in rows[:n]])
        w, _ = checkpoint.load_tensors(d / "model.safetensors")
        diff = np.sqrt(sum(float(np.sum((w[k].astype(np.float64) - base_w[k]) ** 2)) for k in w)
                       / sum(float(np.sum(base_w[k].astype(np.float64) ** 2)) for k in w))
        speed = statistics.median(r["tokens_per_s"] for r in rows[5:] if "val_loss" not in r) if len(rows) > 6 else float("nan")
        print(f"{str(d)[-28:]:<28} {len(rows):>6} {float(np.max(np.abs(b - a) / np.abs(a))):>18.2e} {diff:>17.2e} "
              f"{speed:>10,.0f}")


def summarise_steps(path: Path) -> None:
    results = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["variant"], r["ranks"], r["batch_size"], r["grad_accum"], r["precision"]), []).append(r)
    plain = {(k[2], k[3], k[4]): g[0]["loss_and_norm"] for k, g in groups.items() if k[0] == "plain"}
    print(f"{'variant':<10} {'ranks':>5} {'batch':>5} {'accum':>5} {'ms/step':>9} {'tokens/s':>10} {'per rank':>10} "
          f"{'memory GB by rank':<22} losses = plain's")
    for (variant, ranks, batch, accum, precision), g in groups.items():
        ms = statistics.median(r["ms_per_step"] for r in g)
        tps = statistics.median(r["tokens_per_s"] for r in g)
        same = plain.get((batch, accum, precision))
        equal = "-" if same is None or ranks > 1 else str(all(r["loss_and_norm"] == same for r in g))
        print(f"{variant:<10} {ranks:>5} {batch:>5} {accum:>5} {ms:>9.2f} {tps:>10,.0f} {tps / ranks:>10,.0f} "
              f"{str(g[0]['memory_gb_by_rank']):<22} {equal}")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("runs", "steps"):
        raise SystemExit(__doc__)
    if sys.argv[1] == "runs":
        compare_runs([Path(p) for p in sys.argv[2:]])
    else:
        summarise_steps(Path(sys.argv[2]))
