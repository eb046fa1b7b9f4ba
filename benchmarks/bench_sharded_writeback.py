"""What LowPrecisionWeights' write-back costs sharded (FSDP2) against one process.

The char GPT of a training preset (cpu-small by default: 2 layers, 128 wide), its
matrices held in binary8p4 (or ``--fmt``; SRC, N = 3, bfloat16 updates, as ``fewbit
train``). One process rounds whole tensors, each in a native call of its own (through
round_foreach_, for a format with NaN that is not a block format); under FSDP2 on W gloo
processes each rank rounds its piece of every matrix with the bits of the piece's global
indices, drawn in the kernel (``fewbit.sharding.round_range``): from one range of the
full tensor for Shard(0), a run a row for Shard(1). Only ``_write_back`` is timed, after
warm-up (first-call compilation), each repeat on freshly perturbed weights with a new
step's key. The ranks take turns (a barrier between), so that each is timed alone on one
torch thread, as one process is: what a rank costs where it has its own cores, not what
two processes sharing this machine's cores cost. NVFP4's write-back holds a collective
(the full tensors' largest magnitudes), so its ranks run together, a barrier before each
write-back (on this 2-core VM, a core each). Prints per configuration the median time
per write-back on the slowest rank, the elements each rank rounds, the time per element,
and the ratio to one process.

    python benchmarks/bench_sharded_writeback.py [--preset cpu-small] [--nproc 2] [--repeat 30]
                                                 [--fmt binary8p4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fewbit.cli import int_in
from fewbit.experiments.gpt import GPT, GPTConfig
from fewbit.experiments.replicas import launch
from fewbit.experiments.train import PRESETS
from fewbit.optim import LowPrecisionWeights
from fewbit.sharding import local_tensor
from ranks import importable  # (this folder: a script's own is on the path)

VOCAB = 65  # Shakespeare's characters


@dataclass(frozen=True)
class Case:
    preset: str
    placement: int | None  # Shard(placement) of the matrices; None: no FSDP
    repeat: int
    fmt: str = "binary8p4"
    warmup: int = 3


def time_write_back(rank: int, world_size: int, case: Case) -> dict:
    """Median seconds of ``_write_back`` on this rank (``launch`` runs it on each)."""
    torch.set_num_threads(1)
    p = PRESETS[case.preset]
    torch.manual_seed(0)
    model = GPT(GPTConfig(VOCAB, p.block_size, p.n_layer, p.n_head, p.n_embd))
    if case.placement is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard

        shard = Shard(case.placement)
        fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)),
                    shard_placement_fn=lambda t: shard if t.dim() >= 2 else Shard(0))  # fmt: skip
    named = [(n, t) for n, t in model.named_parameters() if t.dim() >= 2]
    opt = torch.optim.AdamW(model.parameters(), lr=p.lr)
    weights = LowPrecisionWeights(opt, case.fmt, "src", bits=3, params=named, update_dtype=torch.bfloat16)
    pieces = [local_tensor(t) for _, t in named]
    for _, t in named:
        t.grad = torch.zeros_like(t)  # a step's write-back rounds only the weights with a gradient
    g = torch.Generator().manual_seed(rank)
    noise = [torch.randn(t.shape, generator=g) * 1e-3 for t in pieces]
    times = []
    together = getattr(weights.fmt, "tensor_scale", False)  # (a collective inside: no turns)
    for turn in [None] if together else range(world_size):  # one rank at a time: the cores are not shared
        dist.barrier()
        if turn not in (None, rank):
            continue
        for i in range(case.warmup + case.repeat):
            with torch.no_grad():  # an update's worth of change: every element has rounding to do
                torch._foreach_add_(pieces, noise)
            weights.steps += 1
            if together:
                dist.barrier()
            start = time.perf_counter()
            weights._write_back(initial=False)
            if i >= case.warmup:
                times.append(time.perf_counter() - start)
    dist.barrier()
    return {"seconds": statistics.median(times), "elements": sum(t.numel() for t in pieces), "weights": {}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu-small", choices=sorted(PRESETS))
    ap.add_argument("--nproc", type=int_in(1), default=2)
    ap.add_argument("--repeat", type=int_in(1), default=30)
    ap.add_argument("--fmt", default="binary8p4", help="the weights' format (a block format too: mxfp8_e4m3)")
    args = ap.parse_args()
    me = importable(__file__)  # (the ranks import time_write_back and Case by this module's name)
    rows = [("1 process, whole tensors", launch([me.Case(args.preset, None, args.repeat, args.fmt)], 1,
                                                train=me.time_write_back)[0])]  # fmt: skip
    sharded = [me.Case(args.preset, d, args.repeat, args.fmt) for d in (0, 1)]
    for d, per_rank in zip((0, 1), launch(sharded, args.nproc, train=me.time_write_back), strict=True):
        rows.append((f"FSDP2 on {args.nproc} ranks, Shard({d})", per_rank))
    base = max(r["seconds"] for r in rows[0][1])
    print(f"write-back of the {args.preset} GPT's matrices, {args.fmt} SRC N=3 (median of {args.repeat})")
    print(f"{'configuration':32} {'ms':>8} {'elements/rank':>14} {'ns/element':>11} {'vs 1 process':>13}")
    for name, per_rank in rows:
        slowest = max(r["seconds"] for r in per_rank)
        elements = max(r["elements"] for r in per_rank)
        print(f"{name:32} {slowest * 1e3:8.3f} {elements:14,d} {slowest / elements * 1e9:11.2f} "
              f"{slowest / base:12.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
