"""Step time of a ScaledTensor model against the same model on plain tensors.

    python benchmarks/bench_scaled.py [--repeat 30] [--threads 2] [--no-compile]

One training step (forward, backward, AdamW step) of an MLP 256-1024-1024-256 with GELU
and an MSE loss, batch 256, float32 data: the plain model, and the same model after
``scalify`` (power-of-two scales) fed ``as_scaled`` inputs with tensor scales, so that
gradients and optimizer state carry tensor scales as in training. AdamW runs with
torch's defaults (on the CPU, and for tensor subclasses on any device, the per-tensor
path; ``--foreach`` for the ``_foreach_`` one). Eager, and compiled: the model through
``torch.compile``, the optimizer eager in both (a compiled step would need the
optimizer state's scales before tracing). Plain and scaled steps alternate, and
forward + backward and the optimizer step are timed within each, so that load on a
shared machine hits both alike; medians are reported, with the ratios scaled / plain.
Targets: whole step eager <= 2x, compiled <= 1.15x.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from fewbit.cli import int_in
from fewbit.scaled import as_scaled, scalify

PHASES = ("forward+backward", "AdamW step", "whole step")


def build() -> tuple[nn.Module, nn.Module, tuple, tuple]:
    """The plain model, its scalified copy, and their (input, target) pairs."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(),
                          nn.Linear(1024, 256))
    scaled = scalify(copy.deepcopy(plain))
    x, t = torch.randn(256, 256), torch.randn(256, 256)
    one = torch.tensor(1.0)
    return plain, scaled, (x, t), (as_scaled(x, one), as_scaled(t, one))


def step_timer(model: nn.Module, compiled: bool, foreach: bool | None) -> Callable[..., tuple]:
    """A training step of model that returns the seconds of (forward + backward, AdamW)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=foreach)
    forward = torch.compile(model) if compiled else model

    def step(x, t) -> tuple[float, float]:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(forward(x), t).backward()
        t1 = time.perf_counter()
        opt.step()
        return t1 - t0, time.perf_counter() - t1

    return step


def alternate(steps: dict[str, tuple[Callable, tuple]], repeat: int) -> dict[str, tuple]:
    """Median seconds of each phase (PHASES) of each step, run in turn, after two
    warm-up steps."""
    for fn, args in steps.values():
        fn(*args)
        fn(*args)
    times: dict[str, list[tuple]] = {k: [] for k in steps}
    for _ in range(repeat):
        for name, (fn, args) in steps.items():
            fb, opt = fn(*args)
            times[name].append((fb, opt, fb + opt))
    return {k: tuple(statistics.median(p) for p in zip(*v, strict=True)) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int_in(1), default=30)
    parser.add_argument("--threads", type=int_in(1), default=torch.get_num_threads())
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--foreach", action="store_true", help="AdamW(foreach=True)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    plain, scaled, plain_io, scaled_io = build()
    modes = [False] if args.no_compile else [False, True]
    print(f"MLP 256-1024-1024-256, batch 256, float32, AdamW{'(foreach)' if args.foreach else ''}; "
          f"{args.threads} threads; median of {args.repeat}")
    print(f"{'':30}{'plain ms':>10}{'scaled ms':>11}{'ratio':>8}")
    foreach = True if args.foreach else None
    for compiled in modes:
        t = alternate({"plain": (step_timer(plain, compiled, foreach), plain_io),
                       "scaled": (step_timer(scaled, compiled, foreach), scaled_io)}, args.repeat)
        label = "compiled" if compiled else "eager"
        for i, what in enumerate(PHASES):
            p, s = t["plain"][i], t["scaled"][i]
            print(f"{label + ' ' + what:30}{p * 1e3:>10.1f}{s * 1e3:>11.1f}{s / p:>8.2f}")


if __name__ == "__main__":
    main()
