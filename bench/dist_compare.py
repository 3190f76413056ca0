"""Summaries for the data-parallel GPU scripts (bench/run_gpu_dist.sh, bench/run_gpu_dist_multi.sh).

    python3 bench/dist_compare.py runs RUN_A RUN_B ...   # run directories against the first one
    python3 bench/dist_compare.py steps FILE.jsonl       # bench/bench_dist.py results, one JSON a line

`runs`: for each run, the largest relative difference of its per-step loss from RUN_A's, the
relative difference of its final weights (|a - b| / |a| over the whole model), and its median
tokens/s in all and per rank (steps after the 5th, evaluation steps left out).
`steps`: per (engine, variant, overlap, ranks, batch, grad-accum, sums in): median ms/step over
the repeats, the exposed communication (ms from the end of the backward to the end of the last sum,
rank 0's), tokens/s in all and per GPU, the scaling efficiency (per-GPU tokens/s over the same
engine's on one GPU), the ratio to PyTorch DDP's per-GPU tokens/s on as many GPUs with the same
grad-accum and sums (bench/torch_ddp.py), memory by rank, and whether every 1-rank repeat's losses
equal the plain variant's.
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
    """One row per (engine, variant, overlap, ranks, batch, accum, precision): medians over the
    repeats; per-rank tokens/s against the same engine's 1-GPU figure (scaling efficiency) and
    against PyTorch DDP's on as many GPUs; whether 1-rank losses equal the plain step's."""
    results = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        key = (r.get("engine", "nanoeuler"), r["variant"], r.get("overlap", False), r["ranks"], r["batch_size"],
               r["grad_accum"], r["precision"], r.get("grad_reduce") or "-")
        groups.setdefault(key, []).append(r)
    per_rank = {k: statistics.median(r["tokens_per_s_per_rank"] for r in g) for k, g in groups.items()}
    one_gpu = {k[0]: v for k, v in per_rank.items() if k[3] == 1 and k[1] in ("plain", "ddp")}
    ddp = {(k[3], k[5], k[7]): v for k, v in per_rank.items() if k[0].startswith("torch-ddp")}
    plain = {(k[4], k[5], k[6]): g[0].get("loss_and_norm") for k, g in groups.items() if k[1] == "plain"}
    devices = sorted({r.get("device", "?") for r in results})
    print(f"devices: {', '.join(devices)}")
    print(f"{'engine':<18} {'variant':<10} {'overlap':>7} {'GPUs':>4} {'batch':>5} {'accum':>5} {'sums':>4} "
          f"{'ms/step':>8} {'exposed':>7} {'tokens/s':>10} "
          f"{'per GPU':>9} {'scaling':>8} {'vs DDP':>7} {'memory GB by rank':<28} losses = plain's")
    for key, g in groups.items():
        engine, variant, overlap, ranks, batch, accum, precision, sums = key
        ms = statistics.median(r["ms_per_step"] for r in g)
        exposed = [r["exposed_comm_ms"] for r in g if r.get("exposed_comm_ms") is not None]
        exposed = f"{statistics.median(exposed):>7.2f}" if exposed else f"{'-':>7}"
        tps = statistics.median(r["tokens_per_s"] for r in g)
        scaling = per_rank[key] / one_gpu[engine] if engine in one_gpu else float("nan")
        peer = ddp.get((ranks, accum, sums if ranks > 1 else "-"))
        vs_ddp = per_rank[key] / peer if peer and not engine.startswith("torch") else float("nan")
        same = plain.get((batch, accum, precision))
        equal = "-" if same is None or ranks > 1 or "loss_and_norm" not in g[0] else str(
            all(r["loss_and_norm"] == same for r in g))
        print(f"{engine:<18} {variant:<10} {str(overlap):>7} {ranks:>4} {batch:>5} {accum:>5} {sums:>4} {ms:>8.2f} "
              f"{exposed} {tps:>10,.0f} "
              f"{per_rank[key]:>9,.0f} {scaling:>8.1%} {vs_ddp:>7.2f} {str(g[0]['memory_gb_by_rank']):<28} {equal}")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("runs", "steps"):
        raise SystemExit(__doc__)
    if sys.argv[1] == "runs":
        compare_runs([Path(p) for p in sys.argv[2:]])
    else:
        summarise_steps(Path(sys.argv[2]))
