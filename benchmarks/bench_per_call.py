"""Host time of one call of each public op on 4096 float32 elements, where a call is almost
all host time (about 1 us of kernel): best of 7 runs of 20000 calls, one thread.

    python benchmarks/bench_per_call.py [LABEL]

To compare two revisions, run it from a worktree of each in turns, e.g.
``git worktree add /tmp/old REV && PYTHONPATH=/tmp/old/src python benchmarks/bench_per_call.py REV``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

import fewbit


def best_us(call: Callable[[], object], calls: int = 20000, runs: int = 7) -> float:
    """Microseconds per call: the best of ``runs`` loops of ``calls`` calls, after 500."""
    for _ in range(500):
        call()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else ""
    torch.set_num_threads(1)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    out = torch.empty_like(x)
    values = fewbit.round(x, "binary8p4")
    codes = fewbit.encode(values, "binary8p4")
    calls = {
        "copy_": lambda: out.copy_(x),
        "round RNE, out=": lambda: fewbit.round(x, "binary8p4", out=out),
        "round RNE": lambda: fewbit.round(x, "binary8p4"),
        "round SRC N=3 seed=1, out=": lambda: fewbit.round(x, "binary8p4", "src", bits=3, seed=1, out=out),
        "quantize RNE": lambda: fewbit.quantize(x, "binary8p4"),
        "encode": lambda: fewbit.encode(values, "binary8p4"),
        "decode": lambda: fewbit.decode(codes, "binary8p4"),
        "block.round mxfp8_e4m3, 8 rows of 512": lambda: fewbit.block.round(x.view(8, 512), "mxfp8_e4m3"),
    }
    for name, call in calls.items():
        print(f"{label:10} {name:38} {best_us(call):6.1f} us")


if __name__ == "__main__":
    main()
