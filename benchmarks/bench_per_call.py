"""Host time of one call of each public op on 4096 float32 elements, where a call is almost
all host time (about 1 us of kernel): best of 7 runs of 20000 calls, one thread. On a GPU
(``--device cuda``) the calls of a run are queued back to back and waited for at its end,
so that a call's time is its host time wherever the device keeps up; the host column
says how long the loop took before that wait (a wall time above it: the device was the
slower).

    python benchmarks/bench_per_call.py [--label LABEL] [--device cuda]

To compare two revisions, run it from a worktree of each in turns, e.g.
``git worktree add /tmp/old REV && PYTHONPATH=/tmp/old/src python benchmarks/bench_per_call.py --label REV``.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

import fewbit
from fewbit.cli import device_option, int_in


def host_and_wall_us(call: Callable[[], object], sync: Callable[[], None], calls: int = 20000,
                     runs: int = 7) -> tuple[float, float]:  # fmt: skip
    """Microseconds per call, the best of ``runs`` loops of ``calls`` calls after 500: until
    the loop's last call returned (the host's time), and until ``sync`` then returned
    (the wall time: the device's, where it is the slower)."""
    for _ in range(500):
        call()
    sync()
    host = wall = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        queued = time.perf_counter()
        sync()
        host, wall = min(host, queued - start), min(wall, time.perf_counter() - start)
    return host / calls * 1e6, wall / calls * 1e6


def best_us(call: Callable[[], object], sync: Callable[[], None], calls: int = 20000, runs: int = 7) -> float:
    """Microseconds per call (:func:`host_and_wall_us`'s wall time)."""
    return host_and_wall_us(call, sync, calls, runs)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="", help="printed before each row (a revision, say)")
    parser.add_argument("--device", default="cpu", type=device_option)
    parser.add_argument("--calls", type=int_in(1), default=20000,
                        help="calls a timed loop (fewer on a lease)")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    if torch.device(args.device).type != "cuda":
        run(args, lambda: None)
        return
    # cuda:1, say: the waits are that device's, and it is the current one while the calls run
    with torch.cuda.device(args.device):
        run(args, functools.partial(torch.cuda.synchronize, args.device))


def run(args: argparse.Namespace, sync: Callable[[], None]) -> None:
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)).to(args.device)
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
    print(f"{args.label:10} {'call':38} {'wall':>9} {'host':>9}")
    for name, call in calls.items():
        host, wall = host_and_wall_us(call, sync, args.calls)
        print(f"{args.label:10} {name:38} {wall:6.1f} us {host:6.1f} us")


if __name__ == "__main__":
    main()
