"""A small data-parallel training run on real torch.distributed processes (gloo).

Every rank trains the same MLP under DistributedDataParallel on its own data, with SR
fake quantisation of activations and gradients (fewbit.nn, DIFFERING) and SR weights
(LowPrecisionWeights, IDENTICAL), and checks after every step that all ranks hold the
same bits. Options break it on purpose, as users do by accident: the update keyed with
the rank, an extra random draw on one rank feeding a stateful (torch.randint) SR, one
gradient left out of the all-reduce.

Each rank is a process of its own (``python -m fewbit.experiments.replicas``, started by
:func:`launch` through :mod:`.processes`): a Ctrl-C or SIGTERM stops them all, quietly.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .. import round as fewbit_round
from ..nn import Quant, quantize_outputs
from ..optim import LowPrecisionWeights
from ..replicas import ReplicaDriftError, check_in_sync, drift_report, rank_order_mean_hook
from .processes import Child, Children, Stopped, end_with_parent, how_it_ended

#: Policies the command offers: seed 000's default, and the update keyed with the rank.
POLICIES = ("default", "differing-update")


@dataclass(frozen=True)
class ReplicaRun:
    steps: int = 50
    policy: str = "default"
    seed: int = 0
    fmt: str = "binary8p4"
    width: int = 32
    lr: float = 0.01
    update_rng: str = "fewbit"  #: "fewbit" keys, or "randint": SR bits from torch's global generator
    extra_draw_rank: int | None = None  #: this rank draws one extra number every step
    skip_allreduce: str | None = None  #: this parameter's gradient is not all-reduced
    drop_grad: str | None = None  #: the last rank drops this parameter's gradient before each step
    guard: bool = False
    save_at: int | None = None  #: write a checkpoint after this many steps
    checkpoint_dir: str | None = None
    resume: bool = False  #: start from the checkpoint in checkpoint_dir

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, not {self.policy!r}")
        if self.update_rng not in ("fewbit", "randint"):
            raise ValueError(f"update_rng must be 'fewbit' or 'randint', not {self.update_rng!r}")


def build_model(cfg: ReplicaRun) -> torch.nn.Module:
    torch.manual_seed(cfg.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, cfg.width), torch.nn.Tanh(), torch.nn.Linear(cfg.width, 4)
    )
    quantize_outputs(model, Quant(cfg.fmt, "src", bits=3), Quant("ocp_e5m2", "src", bits=3), seed=cfg.seed)
    return model


def batch(cfg: ReplicaRun, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's own data: a linear teacher plus noise."""
    # mod 2^64, the generator's seeds: every --seed up to 2^64 - 1 (small ones as before)
    g = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step * 1009 + rank) % 2**64)
    x = torch.randn(32, 16, generator=g)
    teacher = torch.linspace(-1, 1, 64).reshape(16, 4)
    return x, x @ teacher + 0.1 * torch.randn(32, 4, generator=g)


def forward_sr_disagreement(cfg: ReplicaRun, world_size: int) -> float:
    """Share of elements where this rank's forward SR of a fixed input differs from rank 0's.

    1 + 3/128 lies 3/16 of an ulp above 1 in binary8p4; SRC with N = 3 rounds it up with
    probability 1/4, so two independent ranks disagree with probability 2 (1/4)(3/4) = 3/8.
    """
    q = build_model(cfg)[0].output_quant
    mine = q(torch.full((4096,), 1 + 3 / 128))
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    return float((mine != everyone[0]).float().mean())


def _worker(rank: int, world_size: int, init_file: str, cfgs: list, train) -> list[dict]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    out = []
    try:
        for cfg in cfgs:
            try:
                out.append(train(rank, world_size, cfg))
            except ReplicaDriftError as err:  # raised on every rank alike: go on to the next
                out.append({"error": str(err)})
    except Exception:  # reported to the parent, which raises it: never a silent failure
        out.append({"crash": traceback.format_exc()})
    finally:
        dist.destroy_process_group()
    return out


def _train(rank: int, world_size: int, cfg: ReplicaRun) -> dict:
    disagreement = forward_sr_disagreement(cfg, world_size)
    model = build_model(cfg)
    if cfg.skip_allreduce:
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, [cfg.skip_allreduce]
        )
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, rank_order_mean_hook)  # a resumed run stays bit-identical
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    named = [(n, p) for n, p in model.named_parameters() if p.dim() >= 2]
    policy = "differing" if cfg.policy == "differing-update" else "identical"
    weights = LowPrecisionWeights(opt, cfg.fmt, "src", bits=3, seed=cfg.seed, params=named,
                                  policy=policy, guard=cfg.guard)  # fmt: skip
    ckpt = Path(cfg.checkpoint_dir or ".") / f"rank{rank}.pt"
    start = 0
    torch.manual_seed(cfg.seed)  # the global generator: identical on every rank at the start
    if cfg.resume:
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        weights.load_state_dict(state["weights"])
        torch.set_rng_state(state["rng"])
        start = state["step"]
    log = []
    for step in range(start, cfg.steps):
        x, y = batch(cfg, step, rank)
        if rank == cfg.extra_draw_rank and float(y.abs().max()) > 0:
            torch.rand(1)  # e.g. a data-dependent augmentation on this rank only
        weights.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        if cfg.drop_grad and rank == world_size - 1:
            model.get_parameter(cfg.drop_grad).grad = None
        if cfg.update_rng == "randint":
            _randint_sr_step(opt, named, cfg.fmt)
        else:
            weights.step()
        if cfg.save_at is not None and step + 1 == cfg.save_at:
            state = {"model": model.state_dict(), "weights": weights.state_dict(),
                     "rng": torch.get_rng_state(), "step": step + 1}  # fmt: skip
            torch.save(state, ckpt)
        sync = check_in_sync(model)
        entry = {"step": step + 1, "in_sync": bool(sync), "first": sync.first, "max_ulps": 0}
        if not sync:  # how far apart, in ulps of the weight format
            entry["max_ulps"] = max(drift_report(dict(named), fmt=cfg.fmt).values())
        log.append(entry)
    return {"log": log, "disagreement": disagreement,
            # numpy arrays, as launch() expects of every train function
            "weights": {n: p.detach().numpy().copy() for n, p in model.state_dict().items()}}  # fmt: skip


@torch.no_grad()
def _randint_sr_step(opt: torch.optim.Optimizer, named, fmt: str) -> None:
    """The update rounded with SR bits from torch's global (stateful) generator."""
    opt.step()
    for _, p in named:
        bits = torch.randint(0, 8, p.shape, dtype=torch.int32)
        p.copy_(fewbit_round(p, fmt, "src", bits=3, random_bits=bits, sat=True))


class ReplicaFailure(RuntimeError):
    """A rank ended without its results; the others were stopped."""


def _results(r: int, code: int, raw: bytes) -> list[dict]:
    # Raised inside launch()'s block, so that leaving it stops the other ranks.
    if code != 0:
        raise ReplicaFailure(f"replica rank {r} {how_it_ended(code)}; the other ranks were stopped")
    per_cfg = pickle.loads(raw)
    if "crash" in per_cfg[-1]:
        raise ReplicaFailure(f"replica rank {r} crashed; the other ranks were stopped:\n"
                             f"{per_cfg[-1]['crash']}")
    return per_cfg


#: The file, in the ranks' temporary folder, that brings them their configurations.
JOB = "job.pkl"


def launch(cfgs, nproc: int, timeout: float | None = 600, train=None) -> list[list[dict]]:
    """Run each configuration in turn on the same ``nproc`` gloo processes (one start-up
    for all); ``result[i][rank]`` is configuration i's result on that rank, within
    ``timeout`` seconds in all (None: no limit).
    ``train(rank, world_size, cfg)`` (a function the ranks import by name: defined at the
    top level of a module, not of the script ``__main__``; default: the DDP run of a
    :class:`ReplicaRun`) returns a dict, whose ``weights`` are numpy arrays.

    SIGINT or SIGTERM stops every rank and raises :class:`~.processes.Stopped`; a rank
    that ends without its results (killed, or crashed: the others would wait for it in
    their next collective) stops the others and raises :class:`ReplicaFailure`."""
    cfgs = list(cfgs) if isinstance(cfgs, list | tuple) else [cfgs]
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    # Leaving the block stops every rank still running, before their folder goes.
    with tempfile.TemporaryDirectory() as tmp, Children() as children:
        (Path(tmp) / JOB).write_bytes(pickle.dumps((cfgs, train or _train)))
        ranks = [children.add(Child(__name__, tmp, str(r), str(nproc), stdin=subprocess.DEVNULL))
                 for r in range(nproc)]  # fmt: skip
        results = {rank: b"" for rank in ranks}
        out: dict[int, list[dict]] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(out) < nproc and not children.stopped:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise RuntimeError(f"replica processes gave no result within {timeout} s")
            for rank, fd, chunk in children.read(timeout=left):
                if fd == rank.proc.stdout.fileno():
                    results[rank] += chunk
                else:  # its warnings and errors
                    for line in rank.lines(fd, chunk):
                        print(line, file=sys.stderr)
            for r, rank in enumerate(ranks):
                if r not in out and not children.reading(rank):  # it has ended
                    out[r] = _results(r, children.close(rank), results[rank])
        if children.stopped:
            raise Stopped(children.stopped)
    for per_rank in out.values():
        for res in per_rank:
            res["weights"] = {n: torch.from_numpy(a) for n, a in res.get("weights", {}).items()}
    return [[out[r][i] for r in range(nproc)] for i in range(len(cfgs))]


def main(argv: list[str]) -> None:
    """One rank: ``python -m fewbit.experiments.replicas FOLDER RANK WORLD_SIZE PARENT_PID``.
    Its configurations and train function come pickled in FOLDER/job.pkl; its results
    leave pickled on stdout."""
    folder, rank, world_size, parent = argv
    end_with_parent(int(parent))
    results = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stdout carries the results alone: anything else printed goes to stderr
    cfgs, train = pickle.loads((Path(folder) / JOB).read_bytes())
    out = _worker(int(rank), int(world_size), os.path.join(folder, "rendezvous"), cfgs, train)
    with results:
        pickle.dump(out, results)
    # The results are out: end without the interpreter's teardown, in which torch 2.13's gloo
    # thread can abort the process (freeing a finished collective's tensors, it takes a GIL
    # that is gone: "terminate called without an active exception"), and the parent would
    # take the rank for crashed.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
