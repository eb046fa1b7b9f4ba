"""What one write-back of LowPrecisionWeights costs, alone, on a CPU or a GPU.

The char GPT of a training preset (``paper`` by default: 6 layers, 384 wide, 10.7M
weights in 26 matrices), its matrices held in binary8p4 (SRC, N = 3, bfloat16 updates,
as ``fewbit train``). Times ``_write_back`` after warm-up (first-call compilation),
``repeat`` times back to back, each with a new step's key, for:

- fewbit's path: on a GPU one launch of the Triton kernel for every matrix
  (``fewbit.rounding.foreach``), on a CPU the native kernel, a call per matrix;
- the same rounding by fewbit's torch.compile'd kernel, a call per matrix
  (``configure(native=False)``; until 2026-11-29 one compiled call over all matrices,
  the path a GPU took before the Triton launch);
- with ``store_codes=True``: the write-back to codes (``fewbit.quantize`` a matrix) and
  the decode back to floats before the next step (``materialize``), what keeping codes
  adds to a step;
- ``copy_`` of the weights' bytes into a preallocated buffer, the yardstick.

Per row: host time per write-back (until the call returns; on a GPU nothing waits for
the device), wall time per write-back (the device synchronised after the last: on a
GPU the device's time where it is the slower), and ``x copy_``: copy_'s wall time over
the row's, as ``fewbit bench``'s ``x copy`` (above 1: faster than copy_). The outputs in
docs/gpu_runs up to 2026-11-28 give the inverse there, the row's time over copy_'s.

The write-backs timed round weights already on binary8p4's grid: the first warm-up call
rounded them there (from an update's worth off it), and nothing moves them between calls.

    python benchmarks/bench_write_back.py [--preset paper] [--device cuda] [--repeat 50]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from fewbit.cli import device_option, int_in
from fewbit.config import configure
from fewbit.experiments.gpt import GPT, GPTConfig
from fewbit.experiments.train import PRESETS
from fewbit.optim import LowPrecisionWeights

VOCAB = 65  # Shakespeare's characters


def timed(fn: Callable[[], None], device: torch.device, repeat: int, warmup: int = 3) -> tuple[float, float]:
    """Seconds per call of ``fn``: until the calls return, and until the device is done."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    host = time.perf_counter() - start
    sync()
    return host / repeat, (time.perf_counter() - start) / repeat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="paper", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", type=device_option)
    ap.add_argument("--repeat", type=int_in(1), default=50)
    args = ap.parse_args()
    device = torch.device(args.device)
    p = PRESETS[args.preset]
    torch.manual_seed(0)
    model = GPT(GPTConfig(VOCAB, p.block_size, p.n_layer, p.n_head, p.n_embd)).to(device)
    named = [(n, t) for n, t in model.named_parameters() if t.dim() >= 2]
    opt = torch.optim.AdamW(model.parameters(), lr=p.lr)
    weights = LowPrecisionWeights(opt, "binary8p4", "src", bits=3, params=named, update_dtype=torch.bfloat16)
    with torch.no_grad():  # an update's worth off the grid: the first write-back (a warm-up call) rounds all
        for _, t in named:
            t.add_(torch.randn_like(t) * 1e-3)
            t.grad = torch.zeros_like(t)  # a step's write-back rounds only the weights with a gradient

    def write_back() -> None:
        weights.steps += 1
        weights._write_back(initial=False)

    n = sum(t.numel() for _, t in named)
    source = torch.randn(n, device=device)
    target = torch.empty_like(source)
    rows = [("copy_ of the weights' bytes", timed(lambda: target.copy_(source), device, args.repeat))]
    rows.append(("fewbit", timed(write_back, device, args.repeat)))
    with configure(native=False):
        rows.append(("torch.compile'd, a call each", timed(write_back, device, args.repeat)))
    # Last: keeping codes frees the weights' floats between steps (materialize decodes them).
    kept = LowPrecisionWeights(torch.optim.AdamW(model.parameters(), lr=p.lr), "binary8p4", "src", bits=3,
                               params=named, update_dtype=torch.bfloat16, store_codes=True)  # fmt: skip

    def to_codes_and_back() -> None:
        kept.materialize()
        kept.steps += 1
        kept._write_back(initial=False)

    rows.append(("store_codes: codes, decode back", timed(to_codes_and_back, device, args.repeat)))
    kept.materialize()
    print(f"write-back of the {args.preset} GPT's {len(named)} matrices ({n:,} weights), binary8p4 SRC N=3 "
          f"from bfloat16, on {device} (torch {torch.__version__}), {args.repeat} back to back")  # fmt: skip
    print(f"{'path':30} {'host us':>9} {'wall us':>9} {'x copy_':>8}")
    copy_wall = rows[0][1][1]
    for name, (host, wall) in rows:
        print(f"{name:30} {host * 1e6:9.1f} {wall * 1e6:9.1f} {copy_wall / wall:8.3f}")


if __name__ == "__main__":
    main()
