"""What ``fewbit.round`` (or ``--op``: ``quantize``, ``block.round``) costs on a DTensor
against the same op on the rank's piece as a plain tensor (which draws the bits of the
wrong indices: the floor), on W gloo processes. A float32 matrix (1024 x 1024 by
default) rounded to binary8p4 (block.round: mxfp8_e4m3) with SRC, N = 3, a new seed each
call, for Shard(0), Shard(1) and Replicate, and ``copy_`` of the piece's bytes into a
preallocated tensor as the yardstick. The ranks take turns (a
barrier between), each timed alone on one torch thread. Prints the median time per
call on the slowest rank and the ratio to the plain piece's rounding.

    python benchmarks/bench_dtensor_ops.py [--nproc 2] [--rows 1024] [--cols 1024] [--repeat 20]
                                           [--op round|quantize|block.round]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

import fewbit
from fewbit.cli import int_in
from fewbit.experiments.replicas import launch
from ranks import importable  # (this folder: a script's own is on the path)

PLACEMENTS = ("Shard(0)", "Shard(1)", "Replicate")


#: The ops timed (``--op``), each with a new seed a call.
OPS = {
    "round": lambda t, i: fewbit.round(t, "binary8p4", "src", bits=3, seed=i),
    "quantize": lambda t, i: fewbit.quantize(t, "binary8p4", "src", bits=3, seed=i),
    "block.round": lambda t, i: fewbit.block.round(t, "mxfp8_e4m3", "src", bits=3, seed=i),
}


@dataclass(frozen=True)
class Case:
    shape: tuple[int, int]
    repeat: int
    op: str = "round"
    warmup: int = 3


def _median(call: Callable[[int], object], case: Case) -> float:
    times = []
    for i in range(case.warmup + case.repeat):
        start = time.perf_counter()
        call(i)
        if i >= case.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_ops(rank: int, world_size: int, case: Case) -> dict:
    """Median seconds per call of each row on this rank (``launch`` runs it on each)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.randn(case.shape, generator=torch.Generator().manual_seed(0))
    placement = {"Shard(0)": Shard(0), "Shard(1)": Shard(1), "Replicate": Replicate()}
    tensors = {name: distribute_tensor(full, mesh, [p]) for name, p in placement.items()}
    seconds = {}
    for turn in range(world_size):  # one rank at a time: the ranks do not share the cores
        dist.barrier()
        if turn != rank:
            continue
        for name, x in tensors.items():
            piece = x.to_local()
            into = torch.empty_like(piece)
            seconds[f"{name}: copy_ of the piece"] = _median(lambda i, p=piece, o=into: o.copy_(p), case)
            op = OPS[case.op]
            seconds[f"{name}: the piece, plain"] = _median(lambda i, p=piece, op=op: op(p, i), case)
            seconds[f"{name}: the DTensor"] = _median(lambda i, t=x, op=op: op(t, i), case)
    dist.barrier()
    return {"seconds": seconds, "weights": {}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int_in(1), default=2)
    ap.add_argument("--rows", type=int_in(1), default=1024)
    ap.add_argument("--cols", type=int_in(1), default=1024)
    ap.add_argument("--repeat", type=int_in(1), default=20)
    ap.add_argument("--op", default="round", choices=sorted(OPS), help="block.round: to mxfp8_e4m3")
    args = ap.parse_args()
    me = importable(__file__)  # (the ranks import time_ops and Case by this module's name)
    case = me.Case((args.rows, args.cols), args.repeat, args.op)
    per_rank = launch([case], args.nproc, train=me.time_ops)[0]
    print(f"fewbit.{args.op} of a {args.rows} x {args.cols} float32 DTensor on {args.nproc} ranks, "
          f"SRC N=3 (median of {args.repeat}, slowest rank)")  # fmt: skip
    print(f"{'row':40} {'ms':>8} {'vs the piece, plain':>20}")
    for name in PLACEMENTS:
        plain = max(r["seconds"][f"{name}: the piece, plain"] for r in per_rank)
        for row in ("copy_ of the piece", "the piece, plain", "the DTensor"):
            slowest = max(r["seconds"][f"{name}: {row}"] for r in per_rank)
            print(f"{name + ': ' + row:40} {slowest * 1e3:8.3f} {slowest / plain:19.2f}x")


if __name__ == "__main__":
    main()
