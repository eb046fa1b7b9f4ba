"""The ScaledTensor example: a regression whose gradients underflow in float16.

A student MLP learns a teacher MLP whose outputs are SMALL = 2^-10; the student ends in
a fixed output multiplier SMALL (as muP does), so the loss is SMALL^2 times an O(1)
loss and every gradient carries a factor SMALL^2 = 2^-20 (times 2 / batch). SGD with
learning rate lr0 / SMALL^2 then follows the path of the O(1) problem with lr0.

Four runs from the same initial weights and batches:
  fp32         plain float32, the baseline;
  fp16         plain float16: the gradients fall below float16's 2^-24 and round to 0,
               so nothing is learnt;
  scaled fp16  ScaledTensor with float16 data: the SMALL factors live in the scales,
               the data stays near 1, and the run follows fp32;
  scaled e4m3  the same, with weights and hidden activations rounded to OCP E4M3 after
               a dynamic rescale (weights written back with stochastic rounding), and
               the activations' gradients rescaled dynamically.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from .casts import cast, cast_, dynamic_rescale_, dynamic_rescale_max, dynamic_rescale_max_grad
from .modules import scalify
from .tensor import ScaledTensor, as_scaled

SMALL = 2.0**-10
E4M3 = "ocp_e4m3"
RUNS = ("fp32", "fp16", "scaled fp16", "scaled e4m3")
#: Largest |data| after a dynamic rescale before an E4M3 cast: well inside E4M3's 448,
#: and small enough that a float16 matmul of two such tensors cannot overflow.
E4M3_TARGET = 8.0


class Student(nn.Module):
    """MLP whose output is multiplied by SMALL; ``act`` is applied to hidden activations."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(dim, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, 1)])
        self.act: Callable[[torch.Tensor], torch.Tensor] = lambda h: h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = self.act(torch.relu(layer(x)))
        return self.layers[-1](x) * SMALL


def make_problem(seed: int = 0, dim: int = 32, hidden: int = 64
                 ) -> tuple[Callable[[], Student], Callable[[torch.Generator, int], tuple]]:
    """(new_model, batch): new_model() gives the same initial student every call;
    batch(gen, n) gives float32 inputs x and targets SMALL * teacher(x)."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(dim, hidden, generator=g) / math.sqrt(dim)
    w2 = torch.randn(hidden, 1, generator=g) / math.sqrt(hidden / 2)

    def new_model() -> Student:
        torch.manual_seed(seed + 1)
        return Student(dim, hidden)

    def batch(gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, dim, generator=gen)
        return x, torch.relu(x @ w1) @ w2 * SMALL

    return new_model, batch


def _setup(run: str, model: Student) -> tuple[Student, Callable, Callable[[int], None]]:
    # The model as the run stores it, how it sees a batch, and what follows each step.
    def nothing(step: int) -> None:
        pass

    if run == "fp32":
        return model, lambda x, y: (x, y), nothing
    if run == "fp16":
        return model.half(), lambda x, y: (x.half(), y.half()), nothing
    scalify(model, dtype=torch.float16)

    def scaled(x, y):
        return as_scaled(x.half()), as_scaled((y / SMALL).half(), SMALL)

    if run == "scaled fp16":
        return model, scaled, nothing
    # Activations: rescaled and rounded to E4M3 going forward; their gradients rescaled
    # to max 1 going back, so that sums over the batch stay inside float16.
    model.act = lambda h: cast(dynamic_rescale_max(dynamic_rescale_max_grad(h), target=E4M3_TARGET), E4M3)

    def write_back(step: int) -> None:
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                dynamic_rescale_(p, "max", target=E4M3_TARGET, pow2=True)
                cast_(p, E4M3, "sr", seed=(step + 1) * 1000 + i)

    write_back(-1)
    return model, scaled, write_back


def _loss(model: Student, prepare: Callable, x: torch.Tensor, y: torch.Tensor) -> float:
    # MSE of the stored model on (x, y) in float64, relative to SMALL^2.
    with torch.no_grad():
        out = model(prepare(x, y)[0])
        out = out.dequantize(torch.float64) if isinstance(out, ScaledTensor) else out.double()
    return float(((out - y.double()) ** 2).mean()) / SMALL**2


def train(steps: int = 400, lr: float = 0.02, batch_size: int = 256, seed: int = 0, every: int = 5,
          progress: Callable[[int], None] | None = None) -> dict[str, list[tuple[int, float]]]:
    """Train the four runs; returns each run's (step, eval MSE / SMALL^2) before
    training, every ``every`` steps and at the end. ``progress(1)`` after each step."""
    new_model, batch = make_problem(seed)
    x_eval, y_eval = batch(torch.Generator().manual_seed(seed + 2), 1024)
    curves = {}
    for run in RUNS:
        model, prepare, after = _setup(run, new_model())
        opt = torch.optim.SGD(model.parameters(), lr=lr / SMALL**2, momentum=0.9)
        gen = torch.Generator().manual_seed(seed + 3)
        curve = [(0, _loss(model, prepare, x_eval, y_eval))]
        for step in range(steps):
            x, y = prepare(*batch(gen, batch_size))
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            after(step)
            if (step + 1) % every == 0 or step + 1 == steps:
                curve.append((step + 1, _loss(model, prepare, x_eval, y_eval)))
            if progress:
                progress(1)
        curves[run] = curve
    return curves


def write(curves: dict[str, list[tuple[int, float]]], out: Path) -> tuple[Path, Path]:
    """The curves as scaled_demo.csv and scaled_demo.png in folder out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = out / "scaled_demo.csv", out / "scaled_demo.png"
    with csv_path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *curves])
        for row in zip(*curves.values(), strict=True):
            w.writerow([row[0][0], *(f"{v:.6g}" for _, v in row)])
    fig, ax = plt.subplots(figsize=(7, 4.2))
    style = {"fp32": dict(color="0.6", linewidth=4), "fp16": dict(linestyle="--")}
    for run, curve in curves.items():
        ax.plot(*zip(*curve, strict=True), label=run, **style.get(run, {}))
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("eval MSE / SMALL$^2$")
    ax.set_title(f"Teacher-student regression, outputs of size 2$^{{{int(math.log2(SMALL))}}}$")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return csv_path, png_path


def main(steps: int, out: str) -> int:
    """``fewbit scaled-demo``: train with a progress bar, write the CSV and PNG, print
    the final losses."""
    from tqdm import tqdm

    if steps < 1:
        raise ValueError(f"--steps must be at least 1, got {steps}")
    with tqdm(total=steps * len(RUNS), desc="scaled-demo", unit="step") as bar:
        curves = train(steps, progress=bar.update)
    csv_path, png_path = write(curves, Path(out))
    for run, curve in curves.items():
        print(f"{run:12} eval MSE / SMALL^2: {curve[0][1]:.4g} at start, {curve[-1][1]:.4g} after "
              f"{curve[-1][0]} steps")
    print(f"wrote {csv_path} and {png_path}")
    return 0
