"""What LowPrecisionWeights' rounding costs inside a training step.

Times training steps of the char GPT (cpu-small preset, generated text) with plain
AdamW and with LowPrecisionWeights (binary8p4, SRC N=3, bfloat16 updates), and the
write-back alone, in the same run. Prints each and the write-back's share of the step.

    python benchmarks/bench_train.py [--preset cpu-small] [--steps 30] [--device cpu] [--threads 1]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from fewbit.experiments.data import CharDataset
from fewbit.experiments.train import Run, config_from


def sample_text(n: int = 200_000) -> str:
    g = torch.Generator().manual_seed(0)
    letters = "abcdefghijklmnopqrstuvwxyz ,.\n"
    return "".join(letters[i] for i in torch.randint(len(letters), (n,), generator=g).tolist())


def seconds_per_step(run: Run, steps: int, sync) -> float:
    for _ in range(3):  # warm-up: allocator, first-call compilation
        run.train_step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        run.train_step()
    sync()
    return (time.perf_counter() - start) / steps


def seconds_per_write_back(run: Run, steps: int, sync) -> float:
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        run.weights._write_back()
    sync()
    return (time.perf_counter() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu-small")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    data = CharDataset.from_text(sample_text())
    base = config_from(args.preset, device=args.device)
    plain = Run(replace(base, mode="fp32"), data)
    lpw = Run(replace(base, mode="src", bits=3, update_dtype="bf16"), data)
    # Interleave the two, so drifts in machine speed hit both alike.
    t_plain, t_lpw = [], []
    for _ in range(3):
        t_plain.append(seconds_per_step(plain, args.steps, sync))
        t_lpw.append(seconds_per_step(lpw, args.steps, sync))
    t_wb = seconds_per_write_back(lpw, args.steps, sync)
    best_plain, best_lpw = min(t_plain), min(t_lpw)
    n = lpw.weights.memory()["elements"]
    print(f"preset {args.preset} on {args.device}, {torch.get_num_threads()} threads, {n} rounded weights")
    print(f"step, plain AdamW              {best_plain * 1e3:8.2f} ms")
    print(f"step, LowPrecisionWeights      {best_lpw * 1e3:8.2f} ms  ({best_lpw / best_plain:.3f}x plain)")
    print(f"write-back alone (SRC N=3)     {t_wb * 1e3:8.2f} ms  ({t_wb / best_lpw:.1%} of the step)")


if __name__ == "__main__":
    main()
