"""The ScaledTensor example: the character GPT on Shakespeare, with gradients that
underflow in float16.

The model and data are this package's (``GPT``, ``load_shakespeare``), at a size that
trains in a minute or two per run on one CPU thread. The loss that is differentiated is
SMALL * cross-entropy, SMALL = 2^-16 (a fixed loss multiplier below 1, the opposite of
float16 loss scaling): every gradient carries the factor SMALL, and the gradient of the
logits, SMALL * (softmax - onehot) / (batch * block), lies below half of float16's
smallest subnormal 2^-24 once batch * block >= 512, and rounds to 0 (SMALL is no smaller
so that float16 can hold SGD's step size lr0 / SMALL). SGD with momentum and learning
rate lr0 / SMALL then follows the path of plain cross-entropy with lr0, in exact
arithmetic.

Four runs from the same initial weights and batches:
  fp32         plain float32, the baseline;
  fp16         plain float16: every gradient is 0, so nothing is learnt;
  scaled fp16  ScaledTensor with float16 data: SMALL lives in the gradients' scales,
               the data stays near 1, and the run follows fp32. Matmuls use unit
               scaling (``fewbit.configure(unit_scaling=True)``), so that the
               gradients' data does not grow by sqrt(K) at each matmul going back:
               without it, the float16 data of the LayerNorm weight gradients (sums
               over the tokens) overflowed in trials;
  scaled e4m3  the same, with the weight matrices (embedding and output included) and
               the inputs of every Linear rounded to OCP E4M3 after a dynamic rescale
               (weights written back with stochastic rounding after each step), and the
               gradients of those inputs rescaled dynamically; vectors (biases, LayerNorm)
               stay float16.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..config import configure
from ..scaled import (
    ScaledTensor,
    cast,
    cast_,
    dynamic_rescale_,
    dynamic_rescale_max,
    dynamic_rescale_max_grad,
    scalify,
)
from .data import CharDataset, write_atomically
from .gpt import GPT, GPTConfig
from .sweep import pyplot, write_csv
from .train import batch_generator

SMALL = 2.0**-16
E4M3 = "ocp_e4m3"
RUNS = ("fp32", "fp16", "scaled fp16", "scaled e4m3")
#: Largest |data| after a dynamic rescale before an E4M3 cast: well inside E4M3's 448,
#: and small enough that a float16 matmul of two such tensors cannot overflow.
E4M3_TARGET = 8.0
#: The demo's model: two layers, 64 wide, 32 characters of context.
MODEL = dict(block_size=32, n_layer=2, n_head=4, n_embd=64)
BATCH_SIZE = 16
EVAL_BATCHES = 8


def _e4m3_input(module: nn.Module, args: tuple) -> tuple:
    # Forward pre-hook of a Linear: its input rescaled and rounded to E4M3, the gradient
    # flowing back through it rescaled to max 1 so that sums stay inside float16.
    x = dynamic_rescale_max(dynamic_rescale_max_grad(args[0]), target=E4M3_TARGET)
    return (cast(x, E4M3), *args[1:])


def _setup(run: str, model: GPT) -> tuple[GPT, Callable[[int], None]]:
    # The model as the run stores it, and what follows each step.
    def nothing(step: int) -> None:
        pass

    if run == "fp32":
        return model, nothing
    if run == "fp16":
        return model.half(), nothing
    scalify(model, dtype=torch.float16)
    if run == "scaled fp16":
        return model, nothing
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_pre_hook(_e4m3_input)
    matrices = [p for p in model.parameters() if p.dim() >= 2]

    def write_back(step: int) -> None:
        with torch.no_grad():
            for i, p in enumerate(matrices):
                dynamic_rescale_(p, "max", target=E4M3_TARGET, pow2=True)
                cast_(p, E4M3, "sr", seed=(step + 1) * 1000 + i)

    write_back(-1)
    return model, write_back


def _value(t: torch.Tensor) -> float:
    return float(t.dequantize(torch.float64) if isinstance(t, ScaledTensor) else t.double())


def _eval_loss(model: GPT, data: CharDataset, batch_size: int, batches: int) -> float:
    # Mean validation cross-entropy (nats per character) over fixed batches.
    model.eval()
    with torch.no_grad():
        losses = []
        for i in range(batches):
            x, y = data.batch("val", batch_size, model.cfg.block_size, batch_generator(-1, i))
            losses.append(_value(model(x, y)[1]))
    model.train()
    return sum(losses) / len(losses)


def train(steps: int = 1000, data: CharDataset | None = None, lr: float = 0.3, batch_size: int = BATCH_SIZE,
          seed: int = 0, every: int = 50, model: dict | None = None, eval_batches: int = EVAL_BATCHES,
          progress: Callable[[int], None] | None = None) -> dict[str, list[tuple[int, float]]]:
    """Train the four runs on ``data`` (default: Shakespeare, downloaded on first use);
    returns each run's (step, validation cross-entropy over ``eval_batches`` fixed
    batches) before training, every ``every`` steps and at the end. ``model``
    overrides :data:`MODEL`; ``progress(1)`` after each step."""
    if data is None:
        from .data import load_shakespeare

        data = load_shakespeare()
    cfg = GPTConfig(len(data.vocab), **(model or MODEL))
    curves = {}
    for run in RUNS:
        torch.manual_seed(seed)
        net, after = _setup(run, GPT(cfg))
        opt = torch.optim.SGD(net.parameters(), lr=lr / SMALL, momentum=0.9)
        with configure(unit_scaling=run.startswith("scaled")):
            curve = [(0, _eval_loss(net, data, batch_size, eval_batches))]
            for step in range(steps):
                x, y = data.batch("train", batch_size, cfg.block_size, batch_generator(seed, step))
                for group in opt.param_groups:  # a short linear warm-up
                    group["lr"] = lr / SMALL * min(1.0, (step + 1) / 20)
                opt.zero_grad(set_to_none=True)
                (net(x, y)[1] * SMALL).backward()
                opt.step()
                after(step)
                if (step + 1) % every == 0 or step + 1 == steps:
                    curve.append((step + 1, _eval_loss(net, data, batch_size, eval_batches)))
                if progress:
                    progress(1)
        curves[run] = curve
    return curves


#: The files :func:`write` writes.
OUTPUTS = ("scaled_demo.csv", "scaled_demo.png")


def write(curves: dict[str, list[tuple[int, float]]], out: Path) -> list[Path]:
    """The curves as scaled_demo.csv and, with matplotlib, scaled_demo.png in folder out;
    the files written."""
    out.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = (out / name for name in OUTPUTS)
    write_csv(csv_path, ["step", *curves],
              [[row[0][0], *(f"{v:.6g}" for _, v in row)] for row in zip(*curves.values(), strict=True)])
    if (plt := pyplot(png_path)) is None:
        return [csv_path]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    style = {"fp32": dict(color="0.6", linewidth=4), "fp16": dict(linestyle="--")}
    for run, curve in curves.items():
        ax.plot(*zip(*curve, strict=True), label=run, **style.get(run, {}))
    ax.set_xlabel("step")
    ax.set_ylabel("validation cross-entropy (nats/char)")
    ax.set_title(f"Char GPT on Shakespeare, loss multiplied by 2$^{{{int(math.log2(SMALL))}}}$")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    write_atomically(png_path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)
    return [csv_path, png_path]


def main(steps: int, out: str, data: CharDataset) -> int:
    """``fewbit scaled-demo`` on ``data``: train with a progress bar, write the CSV (and,
    with matplotlib, the PNG), print the final losses."""
    from tqdm import tqdm

    with tqdm(total=steps * len(RUNS), desc="scaled-demo", unit="step") as bar:
        curves = train(steps, data, progress=bar.update)
    written = write(curves, Path(out))
    for run, curve in curves.items():
        print(f"{run:12} validation cross-entropy: {curve[0][1]:.4g} at start, {curve[-1][1]:.4g} after "
              f"{curve[-1][0]} steps")
    print("wrote " + ", ".join(map(str, written)))
    return 0
