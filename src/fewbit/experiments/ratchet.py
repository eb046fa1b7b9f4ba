"""SRF's outward ratchet on a problem small enough for a CPU: a noisy quadratic.

Each weight ``w`` is pulled toward its own target ``w*`` (drawn like a GPT's initial
weights, N(0, 0.02^2)) by the gradient ``g = (w - w*) + 0.02 xi`` (xi standard normal,
fresh every step: minibatch noise as large as the weights themselves). AdamW follows the
paper's schedule (warm-up, cosine decay from 1e-3 to 1e-4 over 5000 steps), and
``LowPrecisionWeights`` writes the weights back to Binary8P4 after every step, from
bfloat16 updates by default, exactly as ``fewbit train`` does for the char GPT.

Late in training Adam's steps are a fraction of an ulp of Binary8P4 with a random sign.
bfloat16 keeps D = 4 bits of them below the weight's last bit, and SRF with N = 3 < D
rounds ``d 2^N`` half up before comparing: an update of +1/16 ulp is applied with
probability 1/8 instead of 1/16, one of -1/16 ulp never (from below, its ``d`` is 15/16,
and 7.5 rounds up to 8). Magnitudes drift outward until the pull toward ``w*`` balances
the bias. SRC (ties to even), float32 updates (D large) and N = 4 = D have no such bias:
the run shows which of these the drift follows.

Measured per arm: ``|w| / |w*|`` (mean magnitudes), the rms distance to the targets in
units of 0.02, and the write-back's mean error in ulps (:mod:`.probe`), every
``eval_interval`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import fmean as mean

import torch

from ..optim import LowPrecisionWeights
from .data import write_atomically
from .probe import StepProbe
from .sweep import check_distinct, pyplot, write_csv, write_summary
from .train import PRESETS, UPDATE_DTYPES, learning_rate, rounding_label

#: The weights' (and the noise's) scale: GPT-2's initialisation.
SCALE = 0.02


@dataclass(frozen=True)
class RatchetConfig:
    """One arm and seed: the write-back (as ``fewbit train``'s), the problem's size and
    length, how often it is measured."""

    mode: str = "srf"  # "fp32": float32 weights, no write-back
    bits: int | None = 3
    update_dtype: str = "bf16"
    weight_format: str = "binary8p4"
    shape: tuple[int, int] = (64, 128)
    iters: int = 5000  # the paper preset's learning-rate schedule, over this many steps
    eval_interval: int = 250
    seed: int = 0

    @property
    def label(self) -> str:
        if self.mode == "fp32":
            return "binary32"
        return rounding_label(self.weight_format, self.mode, self.bits, update_dtype=self.update_dtype)


#: The arms: the reference, the two biased modes of the paper, and SRF's two cures.
ARMS: list[dict] = [
    {"mode": "fp32"},
    {"mode": "rne"},
    {"mode": "srff"},
    {"mode": "srf"},
    {"mode": "src"},
    {"mode": "srf", "update_dtype": "fp32"},
    {"mode": "srf", "bits": 4},
    {"mode": "src", "bits": 4},
]


@dataclass
class RatchetHistory:
    """One run's measurements, at steps ``iters``."""

    seed: int
    iters: list[int] = field(default_factory=list)
    growth: list[float] = field(default_factory=list)  #: mean |w| / mean |w*|
    distance: list[float] = field(default_factory=list)  #: rms(w - w*) / SCALE
    error_ulp: list[float | None] = field(default_factory=list)  #: the write-back's, outward +


#: Each arm's runs, one per seed, by label.
Results = dict[str, list[RatchetHistory]]


@torch.no_grad()
def run(cfg: RatchetConfig) -> RatchetHistory:
    """Train one arm; targets, start and noise depend on the seed alone (every arm of a
    seed sees the same), the write-back's bits on the seed too."""
    data = torch.Generator().manual_seed(cfg.seed)
    target = torch.randn(cfg.shape, generator=data) * SCALE
    w = torch.nn.Parameter(target + torch.randn(cfg.shape, generator=data) * SCALE)
    schedule = replace(PRESETS["paper"], iters=cfg.iters)
    optimizer = torch.optim.AdamW([w], lr=schedule.lr, betas=(0.9, 0.99), weight_decay=0.0)
    weights = None
    if cfg.mode != "fp32":
        weights = LowPrecisionWeights(optimizer, cfg.weight_format, cfg.mode, bits=cfg.bits, seed=cfg.seed,
                                      update_dtype=UPDATE_DTYPES[cfg.update_dtype])  # fmt: skip
    probe = StepProbe(optimizer, [("w", w)], None if weights is None else cfg.weight_format)
    history = RatchetHistory(cfg.seed)
    for it in range(1, cfg.iters + 1):
        optimizer.param_groups[0]["lr"] = learning_rate(schedule, it - 1)
        w.grad = (w - target) + torch.randn(cfg.shape, generator=data) * SCALE
        measured = it % cfg.eval_interval == 0 or it == cfg.iters
        if measured:
            probe.arm()
        (weights or optimizer).step()
        if measured:
            history.iters.append(it)
            history.growth.append((w.abs().mean() / target.abs().mean()).item())
            history.distance.append(((w - target).pow(2).mean().sqrt() / SCALE).item())
            history.error_ulp.append(probe.read()[-1]["outward_ulp"])
    return history


def run_all(seeds: list[int], iters: int = 5000, progress_bar: bool = True) -> Results:
    """Every arm for every seed: each arm's histories, in seed order."""
    from tqdm import tqdm

    check_distinct(seeds)  # a repeated seed would repeat its runs in the summary's spread
    configs = [RatchetConfig(**arm, iters=iters, seed=s) for arm in ARMS for s in seeds]
    results: Results = {}
    for cfg in tqdm(configs, unit="run", disable=not progress_bar):
        results.setdefault(cfg.label, []).append(run(cfg))
    return results


def summarise(results: Results) -> list[dict]:
    """Per arm, over seeds: the final |w| / |w*| and distance (mean, min, max) and the
    write-back's error in ulps averaged over every measured step."""
    rows = []
    for label, runs in results.items():
        growth = [h.growth[-1] for h in runs]
        distance = [h.distance[-1] for h in runs]
        errors = [e for h in runs for e in h.error_ulp if e is not None]
        rows.append({"arm": label, "seeds": len(runs),
                     "growth": mean(growth), "growth_min": min(growth), "growth_max": max(growth),
                     "distance": mean(distance), "distance_min": min(distance), "distance_max": max(distance),
                     "error_ulp": mean(errors) if errors else None})  # fmt: skip
    return rows


def format_summary(rows: list[dict]) -> str:
    width = max(len(r["arm"]) for r in rows)
    lines = [f"{'arm':<{width}} {'|w| / |w*|':>22} {'rms(w - w*) / 0.02':>22} {'error ulp':>10}"]
    for r in rows:
        growth = f"{r['growth']:.3f} [{r['growth_min']:.3f}, {r['growth_max']:.3f}]"
        distance = f"{r['distance']:.3f} [{r['distance_min']:.3f}, {r['distance_max']:.3f}]"
        error = "-" if r["error_ulp"] is None else f"{r['error_ulp']:+.5f}"
        lines.append(f"{r['arm']:<{width}} {growth:>22} {distance:>22} {error:>10}")
    return "\n".join(lines)


#: The files :func:`write_outputs` writes.
OUTPUTS = ("ratchet.csv", "ratchet_summary.csv", "ratchet.png")


def write_outputs(results: Results, out_dir: Path) -> list[Path]:
    """ratchet.csv (every measurement), ratchet_summary.csv and ratchet.png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / OUTPUTS[0], out_dir / OUTPUTS[1]]
    rows = [[label, h.seed, *values] for label, runs in results.items() for h in runs
            for values in zip(h.iters, h.growth, h.distance, h.error_ulp, strict=True)]  # fmt: skip
    write_csv(written[0], ["arm", "seed", "iter", "growth", "distance", "error_ulp"], rows)
    write_summary(summarise(results), written[1])
    if _plot(results, out_dir / OUTPUTS[2]):
        written.append(out_dir / OUTPUTS[2])
    return written


def _plot(results: Results, path: Path) -> bool:
    if (plt := pyplot(path)) is None:
        return False

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    for label, runs in results.items():
        its = torch.tensor(runs[0].iters)
        for ax, series in zip(axes, ("growth", "distance"), strict=True):
            values = torch.tensor([getattr(h, series) for h in runs])
            (line,) = ax.plot(its, values.mean(0), label=label)
            low, high = values.min(0).values, values.max(0).values
            ax.fill_between(its, low, high, color=line.get_color(), alpha=0.2)
    axes[0].set_ylabel("mean |w| / mean |w*|")
    axes[1].set_ylabel("rms(w - w*) / 0.02")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8)
    seeds = len(next(iter(results.values())))
    fig.suptitle(f"Noisy quadratic, AdamW, weights written back to Binary8P4 ({seeds} seeds, min-max shaded)",
                 fontsize=11)  # fmt: skip
    fig.tight_layout(rect=(0, 0.1, 1, 1))  # room for the legend below
    write_atomically(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)
    return True
