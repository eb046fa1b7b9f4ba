"""Step time of a ScaledTensor model against the same model on plain tensors.

    python benchmarks/bench_scaled.py [--repeat 15] [--threads 2] [--no-compile]

One training step (forward, backward, AdamW step) of an MLP 256-1024-1024-256 with GELU
and an MSE loss, batch 256, float32 data: the plain model, and the same model after
``scalify`` (power-of-two scales) fed ``as_scaled`` inputs. Eager, and compiled: the
model through ``torch.compile``, the optimizer eager in both (torch.compile of an
optimizer step over tensor subclasses does not trace). The two are timed alternately,
step after step, so that load on a shared machine hits both alike; medians are
reported, with the ratios scaled / plain. Targets: eager <= 2x, compiled <= 1.15x.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from fewbit.scaled import as_scaled, scalify


def build() -> tuple[nn.Module, nn.Module, tuple, tuple]:
    """The plain model, its scalified copy, and their (input, target) pairs."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(),
                          nn.Linear(1024, 256))
    scaled = scalify(copy.deepcopy(plain))
    x, t = torch.randn(256, 256), torch.randn(256, 256)
    one = torch.tensor(1.0)
    return plain, scaled, (x, t), (as_scaled(x, one), as_scaled(t, one))


def steps(model: nn.Module, compiled: bool) -> tuple[Callable, Callable]:
    """(training step, forward + backward only) for model."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    forward = torch.compile(model) if compiled else model

    def forward_backward(x, t):
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(forward(x), t).backward()

    def step(x, t):
        forward_backward(x, t)
        opt.step()

    return step, forward_backward


def alternate(fns: dict[str, tuple[Callable, tuple]], repeat: int) -> dict[str, float]:
    """Median seconds per call of each fn, timed in turn, after two warm-up calls."""
    for fn, args in fns.values():
        fn(*args)
        fn(*args)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for name, (fn, args) in fns.items():
            t0 = time.perf_counter()
            fn(*args)
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    plain, scaled, plain_io, scaled_io = build()
    modes = [False] if args.no_compile else [False, True]
    print(f"MLP 256-1024-1024-256, batch 256, float32, AdamW; {args.threads} threads; "
          f"median of {args.repeat}")
    print(f"{'':26}{'plain ms':>10}{'scaled ms':>11}{'ratio':>8}")
    for compiled in modes:
        p_step, p_fb = steps(plain, compiled)
        s_step, s_fb = steps(scaled, compiled)
        t = alternate({"p_step": (p_step, plain_io), "s_step": (s_step, scaled_io),
                       "p_fb": (p_fb, plain_io), "s_fb": (s_fb, scaled_io)}, args.repeat)
        label = "compiled" if compiled else "eager"
        for what, p, s in (("step", "p_step", "s_step"), ("forward+backward", "p_fb", "s_fb")):
            print(f"{label + ' ' + what:26}{t[p] * 1e3:>10.1f}{t[s] * 1e3:>11.1f}{t[s] / t[p]:>8.2f}")


if __name__ == "__main__":
    main()
