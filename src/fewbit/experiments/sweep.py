"""Sweeps of training runs: the paper's Figure 3 and seed 002's stagnation study.

Each (arm, seed) is one run in a worker process (one thread each: small models train
faster side by side than sharing threads). Results: ``losses.csv`` (every run's
evaluations), ``summary.csv`` (final and best validation loss per arm, mean and spread
over seeds) and a PNG of validation loss with the spread over seeds shaded.
"""

from __future__ import annotations

import csv
import multiprocessing as mp
import queue
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .data import CharDataset
from .train import TrainConfig, train

#: Each sweep's arms as overrides of the base configuration.
SWEEPS: dict[str, list[dict]] = {
    "figure3": [
        {"mode": "fp16"},
        {"mode": "rne"},
        {"mode": "srff"},
        {"mode": "srf"},
        {"mode": "src"},
    ],
    "stagnation": [
        {"mode": "fp16"},
        {"mode": "rne"},
        {"mode": "sr_fraction", "fraction": 0.2},
        {"mode": "sr_fraction", "fraction": 0.5},
        {"mode": "sr_fraction", "fraction": 1.0},
        {"mode": "sr_near_zero"},
    ],
}


@dataclass
class RunResult:
    cfg: TrainConfig
    iters: list[int]
    train: list[float]
    val: list[float]
    seconds: float


def _worker(cfg: TrainConfig, data: CharDataset, index: int, progress) -> RunResult:
    torch.set_num_threads(1)

    def report(run) -> None:
        progress.put((index, run.it, run.history.train[-1], run.history.val[-1]))

    run = train(cfg, data, on_eval=report)
    h = run.history
    return RunResult(cfg, h.iters, h.train, h.val, run.seconds)


def arm_configs(sweep: str | None, base: TrainConfig, seeds: Sequence[int]) -> list[TrainConfig]:
    """Every (arm, seed) of a named sweep; ``None``: the base configuration alone."""
    if sweep is not None and sweep not in SWEEPS:
        raise ValueError(f"unknown sweep {sweep!r}; choose from {sorted(SWEEPS)}")
    arms = SWEEPS[sweep] if sweep else [{}]
    return [replace(base, **arm, seed=s) for arm in arms for s in seeds]


def run_many(
    configs: list[TrainConfig], data: CharDataset, workers: int = 2, progress_bar: bool = True
) -> list[RunResult]:
    """Every configuration, ``workers`` at a time, with one progress bar over all iterations."""
    from tqdm import tqdm

    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager, ctx.Pool(workers) as pool:
        progress = manager.Queue()
        pending = [pool.apply_async(_worker, (c, data, i, progress)) for i, c in enumerate(configs)]
        done_iters = [0] * len(configs)
        latest: dict[str, str] = {}
        bar = tqdm(total=sum(c.iters for c in configs), unit="it", disable=not progress_bar, smoothing=0.05)
        while not all(p.ready() for p in pending):
            try:
                i, it, tr, va = progress.get(timeout=0.5)
            except queue.Empty:
                continue
            bar.update(it - done_iters[i])
            done_iters[i] = it
            latest[f"{configs[i].label} s{configs[i].seed}"] = f"{va:.3f}"
            bar.set_postfix_str(" ".join(f"{k}: {v}" for k, v in list(latest.items())[-2:]))
        bar.update(bar.total - bar.n)
        bar.close()
        return [p.get() for p in pending]


def write_losses(results: list[RunResult], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arm", "seed", "iter", "train_loss", "val_loss"])
        for r in results:
            for row in zip(r.iters, r.train, r.val, strict=True):
                w.writerow([r.cfg.label, r.cfg.seed, *row])


def by_arm(results: list[RunResult]) -> dict[str, list[RunResult]]:
    """Each arm's runs (one per seed), in sweep order."""
    arms: dict[str, list[RunResult]] = {}
    for r in results:
        arms.setdefault(r.cfg.label, []).append(r)
    return arms


def summarise(results: list[RunResult]) -> list[dict]:
    """Per arm: final and best validation loss, mean with min and max over seeds."""
    rows = []
    for label, runs in by_arm(results).items():
        final = [r.val[-1] for r in runs]
        best = [min(r.val) for r in runs]
        rows.append({
            "arm": label, "seeds": len(runs),
            "final_val": sum(final) / len(final), "final_min": min(final), "final_max": max(final),
            "best_val": sum(best) / len(best), "minutes": sum(r.seconds for r in runs) / 60,
        })  # fmt: skip
    return rows


def write_summary(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def format_summary(rows: list[dict]) -> str:
    lines = [f"{'arm':<28} {'final val loss':>22} {'best val':>9}"]
    for r in rows:
        spread = f"{r['final_val']:.3f} [{r['final_min']:.3f}, {r['final_max']:.3f}]"
        lines.append(f"{r['arm']:<28} {spread:>22} {r['best_val']:>9.3f}")
    return "\n".join(lines)


def plot(results: list[RunResult], path: Path, title: str) -> None:
    """Validation loss per arm: mean over seeds, the min-max band shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, runs in by_arm(results).items():
        its = torch.tensor(runs[0].iters)
        vals = torch.tensor([r.val for r in runs])
        (line,) = ax.plot(its, vals.mean(0), label=f"{label} ({len(runs)} seeds)")
        ax.fill_between(its, vals.min(0).values, vals.max(0).values, color=line.get_color(), alpha=0.25)
    ax.set_xlabel("iteration")
    ax.set_ylabel("validation loss (nats/char)")
    ax.set_title(title)
    lo = min(min(r.val) for r in results)
    ax.set_ylim(lo - 0.05, lo + 1.2)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_sweep(
    sweep: str | None,
    base: TrainConfig,
    data: CharDataset,
    seeds: Sequence[int],
    out_dir: Path,
    workers: int = 2,
    progress_bar: bool = True,
) -> list[dict]:
    """Run a named sweep (or, with None, ``base`` for each seed); write losses.csv,
    summary.csv and <sweep>.png (or losses.png) into out_dir."""
    configs = arm_configs(sweep, base, seeds)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = run_many(configs, data, workers, progress_bar)
    write_losses(results, out_dir / "losses.csv")
    rows = summarise(results)
    write_summary(rows, out_dir / "summary.csv")
    name = sweep or "losses"
    plot(results, out_dir / f"{name}.png", f"{sweep or base.label}: char GPT on Shakespeare")
    return rows
