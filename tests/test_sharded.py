"""Sharded training (FSDP2, HSDP) on real gloo processes: the full weights equal one
process's bit for bit on 2 and 4 ranks, for Shard(0) and Shard(1), across a checkpoint
saved on 4 ranks and resumed on 2; the pieces' global indices and bits; the sync checks."""

from __future__ import annotations

import functools
import itertools
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch

import fewbit
from fewbit.experiments.replicas import launch
from fewbit.experiments.sharded import (
    OPS_CASES,
    TP_CASES,
    Batches,
    LayoutProbe,
    OpsProbe,
    ShardedRun,
    TensorParallelProbe,
    build,
    ops_data,
    run,
    tp_data,
    train_single,
)  # fmt: skip
from fewbit.formats import format
from fewbit.nn import FakeQuantize, Quant, fake_quantize, quantize_outputs
from fewbit.optim import LowPrecisionWeights
from fewbit.random import Key, fold_in, random_bits
from fewbit.replicas import check_in_sync, drift_report, replica_key
from fewbit.sharding import Runs, ShardLayout, global_amax, layout, tensor_scales

STEPS, SAVE_AT, EVERY = 50, 25, 5
HSDP_STEPS = 20
MX = ShardedRun(steps=STEPS, until=10, hash_every=EVERY, fmt="mxfp8_e4m3")
NVFP4 = replace(MX, fmt="nvfp4")
SCALIFIED = ShardedRun(steps=STEPS, until=20, hash_every=EVERY, params="scalified")


@pytest.fixture(scope="module")
def single() -> dict:
    """The run in this process, without torch.distributed. Eager: the write-back's first
    compilation would cost more than the run (compiled and eager agree bit for bit,
    tests/test_optim.py); the ranks' pieces are below the compile threshold anyway."""
    with fewbit.configure(compile=False):
        return train_single(ShardedRun(steps=STEPS, hash_every=EVERY))


@pytest.fixture(scope="module")
def scalified_single() -> dict:
    """The scalified run in this process."""
    return train_single(SCALIFIED)


@dataclass(frozen=True)
class EdgeProbe:
    """This file's own cases on a launch's ranks (:func:`edge_cases`)."""


def probe_or_run(rank: int, world_size: int, cfg) -> dict:
    """``run``, and the :class:`EdgeProbe` (the ranks import this file: see ``runs``)."""
    return edge_cases(rank, world_size) if isinstance(cfg, EdgeProbe) else run(rank, world_size, cfg)


def _outcome(call):
    try:
        return call()
    except Exception as err:
        return f"{type(err).__name__}: {err}"


def edge_cases(rank: int, world_size: int) -> dict:
    """Each case's result on this rank, or its error: errors every rank must raise alike
    (a rank that did not would hang the others or abort gloo), the strided shards fewbit
    refuses and those it keeps, ranks outside a mesh."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    full = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))

    def rounded(x):
        return fewbit.round(x, "binary8p4", "sr", seed=2)

    def nvfp4(x):
        return fewbit.block.round(x, "nvfp4", "sr", seed=2)

    if world_size == 4:
        fsdp_tp = [_StridedShard(0, split_factor=2), Shard(0)]
        tp = distribute_tensor(full, init_device_mesh("cpu", (2, 2)), fsdp_tp)
        half = distribute_tensor(full, DeviceMesh("cpu", [0, 1]), [Shard(0)])  # ranks 2 and 3 outside
        cases = {
            "fsdp2 with tp": lambda: [torch.equal(rounded(tp).full_tensor(), rounded(full)),
                                      torch.equal(nvfp4(tp).full_tensor(), nvfp4(full)),
                                      global_amax(tp) == global_amax(full)],  # fmt: skip
            "outside the mesh": lambda: [global_amax(half), tuple(nvfp4(half).to_local().shape),
                                         tuple(fewbit.round(half, "e2m1", "sr", seed=1).to_local().shape)],
            "guard, tp with dp replicas": functools.partial(guard_on_tp_replicas, rank),
            "tp and fsdp2, an empty piece of another shape": functools.partial(tp_fsdp_empty_pieces, True),
            "guard, pipeline stages": functools.partial(guard_on_pipeline_stages, rank),
            "activations, pipeline stages": functools.partial(activations_on_pipeline_stages, rank),
            "activations, tp with dp replicas": activations_on_tp_replicas,
        }  # fmt: skip
    else:
        mesh = init_device_mesh("cpu", (2,))
        top, inf = format("binary8p4").max, math.inf
        ends = torch.tensor([-top, top, inf] if rank == 0 else [-inf, inf, math.nan])
        ends = dict(zip("abc", ends.split(1), strict=True))
        # 7 rows lie 4 and 3 on 2 ranks: rank 1's 4 are not where the placements say
        misplaced = DTensor.from_local(full[:4], mesh, [Shard(0)], run_check=False, shape=(7, 32),
                                       stride=(32, 1))  # fmt: skip
        partial = DTensor.from_local(torch.ones(2), mesh, [Partial()])
        others = {"a": torch.ones(2), **({"b": torch.ones(2)} if rank else {})}
        cases = {
            # (made in its case: torch before 2.13 refuses the view)
            "strided view": lambda: rounded(distribute_tensor(full.view(8, 4, 8), mesh, [Shard(1)])
                                            .view(32, 8)),
            "strided": lambda: rounded(distribute_tensor(full, mesh, [_StridedShard(0, split_factor=2)])),
            "piece not where placed": lambda: fewbit.round(misplaced, "e2m1", "sr", seed=1),
            "sync, None on one rank": lambda: check_in_sync([("w.grad", None if rank else torch.ones(3))]),
            "drift, other shapes": lambda: drift_report({"w": torch.ones(3 + rank)}),
            "drift, other names": lambda: drift_report(others),
            "drift in a format, at its ends": lambda: drift_report(ends, fmt="binary8p4"),
            "amax of a partial": lambda: global_amax(partial),
            "scales of a partial": lambda: tensor_scales([partial], fewbit.block.format("nvfp4")),
            **{f"bits out of range on rank 1, {name}": functools.partial(given_bits_out_of_range, mesh, call)
               for name, call in BAD_BITS_CALLS.items()},
            **{f"empty piece, {name}": functools.partial(empty_piece_write_back, mesh, kw)
               for name, kw in EMPTY_PIECE_CASES.items()},
            "held as codes, read": functools.partial(held_reads, mesh),
            "guard, unlike weights": functools.partial(guard_on_unlike_weights, mesh, rank),
            # A transposed Shard(1) tensor, rounded: its pieces are contiguous, and so is the result.
            "transposed, viewed": lambda: rounded(distribute_tensor(full, mesh, [Shard(1)]).t()).view(-1)
                                          .full_tensor().tolist(),  # fmt: skip
        }
    return {"cases": {name: _outcome(call) for name, call in cases.items()}}


#: Calls given random bits, written into ``out`` (:func:`given_bits_out_of_range`).
def _src3(op, fmt, x, bits, out):
    return op(x, fmt, "src", bits=3, random_bits=bits, out=out)


BAD_BITS_CALLS = {name: functools.partial(_src3, op, fmt) for name, op, fmt in (
    ("round", fewbit.round, "binary8p4"), ("nvfp4", fewbit.block.round, "nvfp4"),
    ("mxfp8", fewbit.block.round, "mxfp8_e4m3"))}  # fmt: skip


def given_bits_out_of_range(mesh, call) -> list:
    """``call`` with random bits out of range in rank 1's piece alone: its error, or its
    result, and whether ``out`` was written."""
    from torch.distributed.tensor import Shard, distribute_tensor

    x = distribute_tensor(torch.randn(8, 32, generator=torch.Generator().manual_seed(0)), mesh, [Shard(0)])
    bits = torch.randint(0, 8, (8, 32), generator=torch.Generator().manual_seed(1))
    bits[7, 0] = 1000
    out = distribute_tensor(torch.zeros(8, 32), mesh, [Shard(0)])
    outcome = _outcome(lambda: call(x, distribute_tensor(bits, mesh, [Shard(0)]), out))
    return [outcome if isinstance(outcome, str) else "a result", bool(out.to_local().any())]


#: LowPrecisionWeights set-ups whose write-back the native kernel does not take (it rounds
#: float32 alone, and only when fewbit compiles): an empty piece went the other way.
EMPTY_PIECE_CASES = {
    "float64 updates": dict(fmt="binary8p4", update_dtype=torch.float64),
    "eager": dict(fmt="binary8p4", configure=dict(native=False)),
    "eager, codes": dict(fmt="binary8p4", configure=dict(native=False), store_codes=True),
    "eager, mxfp8": dict(fmt="mxfp8_e4m3", configure=dict(native=False)),
}


def empty_piece_write_back(mesh, kw: dict, world: bool = True) -> list:
    """A (1, 32) weight (on 2 ranks, rank 1's piece is empty) after the rounding at
    construction and a step of LowPrecisionWeights, as a list (``world=False``: one
    process's, for the test to compare)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    kw = dict(kw)
    fmt, settings = kw.pop("fmt"), kw.pop("configure", {})
    w = torch.randn(1, 32, generator=torch.Generator().manual_seed(3))
    w = torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]) if world else w)
    with fewbit.configure(**settings):
        opt = LowPrecisionWeights(torch.optim.SGD([w], lr=0.01), fmt, "src", bits=3, seed=4, **kw)
        w.grad = torch.ones_like(w)
        opt.step()
        opt.zero_grad()
    return (w.full_tensor() if world else w).tolist()


def guard_on_tp_replicas(rank: int) -> list[str]:
    """Tensor parallelism on each row of a 2 x 2 (dp, tp) mesh, guard=True: a step with rank
    3's gradients off by 0.001, then a step with the gradients alike. Each weight's mesh is
    its row, and its copies lie on the other row."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 8), torch.nn.ReLU(), torch.nn.Linear(8, 32))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = LowPrecisionWeights(torch.optim.SGD(model.parameters(), lr=0.1), "binary8p4", "src", bits=3,
                              guard=True)  # fmt: skip
    steps = []
    for off in (0.001 * (rank == 3), 0.0):
        for p in model.parameters():
            p.grad = p.detach() * 0.5 + off
        steps.append(_outcome(lambda: opt.step() or "stepped"))
    return steps


def guard_on_pipeline_stages(rank: int) -> list:
    """Two pipeline stages of two data-parallel ranks each (ranks 0 and 1 hold the first
    Linear, 2 and 3 the second), guard=True compared across the world (the weights named,
    then by their place), then within each stage's group: a step with rank 3's gradient
    off by 0.001 and a step with them alike; and whether a deep copy shares the group."""
    import copy

    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # (every rank makes every group)
    torch.manual_seed(0)
    stage = torch.nn.Sequential(torch.nn.Linear(32, 8), torch.nn.Linear(8, 32))[rank // 2]
    stage.weight.grad = stage.weight.detach() * 0.5
    named = [(f"{rank // 2}.weight", stage.weight)]

    def wrapped(**kw):
        return LowPrecisionWeights(torch.optim.SGD(stage.parameters(), lr=0.1), "binary8p4", "src", bits=3,
                                   guard=True, **kw)  # fmt: skip

    outcomes = [_outcome(lambda: wrapped(params=named) and "built"),
                _outcome(lambda: wrapped().step() or "stepped"),
                _outcome(lambda: wrapped(guard_group=groups[1 - rank // 2]) and "built"),
                _outcome(lambda: check_in_sync(stage, groups[1 - rank // 2])),
                _outcome(lambda: drift_report(stage, groups[1 - rank // 2]))]  # fmt: skip
    opt = wrapped(params=named, guard_group=groups[rank // 2])
    for off in (0.001 * (rank == 3), 0.0):
        stage.weight.grad = stage.weight.detach() * 0.5 + off
        outcomes.append(_outcome(lambda: opt.step() or "stepped"))
    return [*outcomes, copy.deepcopy(opt).guard_group is opt.guard_group]


#: The activations' rounding of :func:`activations_on_pipeline_stages`, seeded as the whole model.
STAGE_QUANT, STAGE_SEED = Quant("binary8p4", "src", bits=3), 3


def pipeline_stage(stage: int) -> tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]:
    """Stage ``stage``'s Linear, its input and its output's gradient: alike on every rank."""
    torch.manual_seed(stage)
    return torch.nn.Linear(32, 32), torch.randn(16, 32), torch.randn(16, 32)


def activations_on_pipeline_stages(rank: int) -> dict:
    """Two pipeline stages of two data-parallel replicas each (as guard_on_pipeline_stages),
    each stage a Linear whose output quantize_outputs rounds (``first_index`` its place in
    the model): the output and input gradient with the stage's group as ``replica_group``,
    then without it; and the refusal of the other stage's group and of a DeviceMesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # (every rank makes every group)
    mesh = DeviceMesh("cpu", [0, 1, 2, 3])

    def stage_run(**kw) -> list[torch.Tensor]:
        linear, x, grad = pipeline_stage(rank // 2)
        quantize_outputs(linear, STAGE_QUANT, STAGE_QUANT, seed=STAGE_SEED, first_index=rank // 2, **kw)
        x.requires_grad_()
        y = linear(x)
        y.backward(grad)
        return [y.detach(), x.grad]

    return {"grouped": stage_run(replica_group=groups[rank // 2]), "global": stage_run(),
            "other stage's group": _outcome(lambda: stage_run(replica_group=groups[1 - rank // 2])),
            "mesh": _outcome(lambda: stage_run(replica_group=mesh))}  # fmt: skip


def activations_on_tp_replicas() -> list[torch.Tensor]:
    """A Shard(1) DTensor on each row of a 2 x 2 (dp, tp) mesh through FakeQuantize, with
    the dp group as replica_group and without: the full outputs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    _, x, _ = pipeline_stage(0)
    piece = distribute_tensor(x, mesh["tp"], [Shard(1)])
    grouped = FakeQuantize(STAGE_QUANT, seed=STAGE_SEED, replica_group=mesh.get_group("dp"))
    return [grouped(piece).full_tensor(), FakeQuantize(STAGE_QUANT, seed=STAGE_SEED)(piece).full_tensor()]


def guard_on_unlike_weights(mesh, rank: int) -> str:
    """guard=True where rank 0's weight is a piece and rank 1's a plain tensor: each rank
    decided from its own weights whether to ask the others (a collective)."""
    from torch.distributed.tensor import DTensor, Shard

    full = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    w = DTensor.from_local(full[:4], mesh, [Shard(0)], run_check=False, shape=(8, 32), stride=(32, 1))
    w = torch.nn.Parameter(w if rank == 0 else full)
    return _outcome(lambda: LowPrecisionWeights(torch.optim.SGD([w], lr=0.1), "binary8p4", guard=True)
                    and "built")  # fmt: skip


def tp_fsdp_empty_pieces(world: bool) -> list:
    """A row-parallel Linear(1, 32) on each row of a 2 x 2 (dp, tp) mesh, FSDP2 over the dp
    columns, after three steps of LowPrecisionWeights: its weight's piece on this rank and
    where that lies (``world=False``: one process's whole weight). Ranks 1 and 3 hold
    pieces of shape (0, 0) where the placements say (16, 0); they refused them alone."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 1), torch.nn.Linear(1, 32))
    if world:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    opt = LowPrecisionWeights(torch.optim.SGD(model.parameters(), lr=1.0), "binary8p4", "src", bits=3)
    for step in range(3):
        for p in model.parameters():
            p.grad = p.detach() * 0.37 + 0.01 * (step + 1)
        opt.step()
    w = model[1].weight.detach()
    return [list(layout(w).offset), (w.to_local() if world else w).tolist()]


def held_reads(mesh) -> dict[str, bool]:
    """A DTensor weight held as codes (store_codes) read through DTensor's methods that no
    torch function sees: whether each read gave the decoded weight (its piece's storage
    is freed)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    reads = {"to_local": lambda w: w.to_local().clone(), "full_tensor": lambda w: w.full_tensor(),
             "redistribute": lambda w: w.redistribute(placements=[Replicate()]).to_local(),
             "repr": repr}  # fmt: skip
    outcome = {}
    for name, read in reads.items():
        w = torch.randn(8, 32, generator=torch.Generator().manual_seed(3))
        w = torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]))
        opt = LowPrecisionWeights(torch.optim.SGD([w], lr=0.01), "binary8p4", "src", bits=3, store_codes=True)
        w.grad = torch.ones_like(w)
        opt.step()
        got = read(w)
        opt.materialize()
        outcome[name] = got == read(w) if name == "repr" else torch.equal(got, read(w))
    return outcome


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict[str, list[dict]]]:
    """Scenario -> per-rank results, for 4 ranks, then 2 (which resume the 4 ranks'
    checkpoint). Each world size starts its processes once."""
    ckpt = str(tmp_path_factory.mktemp("dcp"))
    plans = {
        4: {
            "layouts": LayoutProbe(),
            "tensor parallel": TensorParallelProbe(),
            "ops": OpsProbe(),
            "edges": EdgeProbe(),
            "scalified": SCALIFIED,
            "shard0": ShardedRun(steps=STEPS, hash_every=EVERY, save_at=SAVE_AT, checkpoint_dir=ckpt),
            "guard without replicas": ShardedRun(steps=1, guard=True),
            "hsdp": ShardedRun(steps=STEPS, until=HSDP_STEPS, hash_every=EVERY, hsdp=True, guard=True),
            "hsdp differing": ShardedRun(steps=2, hsdp=True, policy="differing-update"),
            "nvfp4 hsdp": replace(NVFP4, hsdp=True),
            "hsdp differing, guarded": ShardedRun(steps=2, hsdp=True, policy="differing-update", guard=True),
        },
        2: {
            "layouts": LayoutProbe(),
            "tensor parallel": TensorParallelProbe(),
            "ops": OpsProbe(),
            "edges": EdgeProbe(),
            "mx shard0": MX,
            "mx shard1": ShardedRun(steps=STEPS, until=1, fmt="mxfp8_e4m3", placement=1),
            "nvfp4 shard0": NVFP4,
            "nvfp4 shard1, codes": replace(NVFP4, placement=1, store_codes=True),
            "scalified": replace(SCALIFIED, placement=1),
            "shard1": ShardedRun(steps=STEPS, hash_every=EVERY, placement=1),
            "hsdp": ShardedRun(steps=STEPS, until=HSDP_STEPS, hash_every=EVERY, hsdp=True, guard=True),
            "resumed": ShardedRun(steps=STEPS, hash_every=EVERY, checkpoint_dir=ckpt, resume=True),
            "codes": ShardedRun(steps=STEPS, until=10, hash_every=EVERY, store_codes=True),
            "scaled": ShardedRun(steps=STEPS, until=10, hash_every=EVERY, scale=True, placement=1),
        },
    }
    with pytest.MonkeyPatch.context() as patch:  # the ranks unpickle probe_or_run from this file
        patch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.getenv("PYTHONPATH", "")]))
        return {n: dict(zip(plan, launch(list(plan.values()), n, train=probe_or_run), strict=True))
                for n, plan in plans.items()}  # fmt: skip


def assert_bits_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        x, y = np.ascontiguousarray(np.asarray(a[name])), np.ascontiguousarray(np.asarray(b[name]))
        assert x.shape == y.shape and np.array_equal(x.view(np.uint8), y.view(np.uint8)), name


@pytest.mark.parametrize("nproc, scenario", [(4, "shard0"), (2, "shard1")])
def test_sharded_weights_equal_one_process_bit_for_bit(single, runs, nproc, scenario):
    results = runs[nproc][scenario]
    assert len(single["hashes"]) == STEPS // EVERY
    for r in results:  # every rank gathers the same full weights
        assert r["hashes"] == single["hashes"]
    assert_bits_equal(results[0]["weights"], single["weights"])
    # Training did move the weights (in binary8p4: the hashes change from check to check).
    assert len(set(single["hashes"])) == len(single["hashes"])
    # Pure sharding: nothing to compare, and the check says so instead of passing.
    in_sync, status = results[0]["sync"]
    assert not in_sync and status.startswith("NOTHING COMPARED")


def test_checkpoint_saved_on_4_ranks_resumes_on_2_bit_for_bit(single, runs):
    resumed = runs[2]["resumed"]
    assert resumed[0]["hashes"] == single["hashes"][SAVE_AT // EVERY :]
    assert_bits_equal(resumed[0]["weights"], single["weights"])


@pytest.mark.parametrize("world", [4, 2])
def test_hsdp_replicas_stay_in_sync_and_equal_one_process(single, runs, world):
    """On 2 ranks the mesh is (2, 1), shard groups of one rank, where FSDP2 divided the
    gradient twice and the replicas, in sync, all differed from one process."""
    results = runs[world]["hsdp"]
    for r in results:
        assert [e["step"] for e in r["log"]] == list(range(1, HSDP_STEPS + 1))
        assert all(e["in_sync"] for e in r["log"]), r["log"]
        assert r["hashes"] == single["hashes"][: HSDP_STEPS // EVERY]
    assert r["log"][-1]["status"].startswith(f"in sync: 17 tensors on {world} ranks")


def test_hsdp_update_keyed_with_the_rank_is_caught_naming_the_tensor(runs):
    log = runs[4]["hsdp differing"][0]["log"]
    assert not any(e["in_sync"] for e in log)
    assert log[0]["first"] == "tok.weight" and all(e["max_ulps"] >= 1 for e in log)
    for r in runs[4]["hsdp differing, guarded"]:
        assert r["step"] == 1
        assert r["error"].startswith("tok.weight differs across ranks before the identical-seed")


def test_guard_without_replicas_is_refused(runs):
    for r in runs[4]["guard without replicas"]:
        assert "guard=True has nothing to compare" in r["error"]


@pytest.mark.parametrize("nproc", [2, 4])
def test_pieces_take_the_indices_and_bits_of_the_full_tensor(runs, nproc):
    cfg = LayoutProbe()
    ranks = [r["cases"] for r in runs[nproc]["layouts"]]
    key = Key.from_seed(cfg.seed)
    for per_rank in zip(*ranks, strict=True):
        case = per_rank[0]
        numel = int(np.prod(case["shape"]))
        everything = random_bits(numel, cfg.bits, key).numpy()
        covered = np.zeros(numel, dtype=np.int64)
        for c in per_rank:
            what = f"{c['shape']} on {c['mesh']} as {c['placements']}"
            # The data hold their own global indices: fewbit's layout must read the same.
            assert np.array_equal(c["from_layout"], c["from_data"]), what
            assert c["torch"] is not None, f"{what}: torch's private offsets moved; the fallback placed it"
            if len(c["from_data"]):  # an empty piece has no place to agree on
                assert c["torch"] == c["fallback"], what
            assert np.array_equal(c["bits"], everything[c["from_data"]]), what
            if c["runs"] is not None:
                assert np.array_equal(c["from_data"], expand(c["runs"])), what
            np.add.at(covered, c["from_data"], 1)
        # Every element is held: once per replica.
        assert len(set(covered.tolist())) == 1 and covered[0] >= 1, case["shape"]
    counts = {None if c["runs"] is None else min(c["runs"].count, 2) for r in ranks for c in r}
    assert counts == ({1, 2, None} if nproc == 4 else {1, 2})  # one range, runs (Shard(1)), neither (2x2)
    if nproc == 4:  # 3 rows on 4 ranks: and empty ones
        assert any(len(c["from_data"]) == 0 for r in ranks for c in r)


def expand(runs: Runs) -> np.ndarray:
    """The global indices of ``runs``, in order."""
    return (runs.start + runs.stride * np.arange(runs.count)[:, None] + np.arange(runs.length)).reshape(-1)


def maximal_runs(index: np.ndarray) -> tuple[list[int], list[int]]:
    """The starts and lengths of the longest runs of consecutive integers in ``index``."""
    cuts = np.flatnonzero(np.diff(index) != 1) + 1
    pieces = np.split(index, cuts)
    return [int(p[0]) for p in pieces], [len(p) for p in pieces]


@pytest.mark.parametrize("shape", [(3, 4, 2), (4, 1, 5), (2, 3, 1, 3)])
def test_runs_are_the_pieces_longest_runs_where_they_are_alike(shape):
    """Every block of a small tensor (each dimension any offset and size): ShardLayout.runs
    gives its indices as its longest runs of consecutive indices where those are equally
    long and spaced, and says there are none where they are not."""
    dims = [[(o, n) for o in range(g) for n in range(1, g - o + 1)] for g in shape]
    seen = set()
    for block in itertools.product(*dims):
        offset, local = zip(*block, strict=True)
        piece = ShardLayout(shape, local, offset)
        index = piece.flat_indices().numpy()
        starts, lengths = maximal_runs(index)
        alike = len(set(lengths)) == 1 and len(set(np.diff(starts).tolist())) <= 1
        runs = piece.runs()
        seen.add(None if runs is None else min(runs.count, 2))
        if not alike:
            assert runs is None, (offset, local)
            continue
        assert runs is not None and np.array_equal(expand(runs), index), (offset, local, runs)
        assert (runs.count, runs.length) == (len(starts), lengths[0]), (offset, local, runs)
        assert piece.flat_start() == (runs.start if runs.count == 1 else None)
    assert seen == ({1, 2, None} if shape != (4, 1, 5) else {1, 2})
    assert ShardLayout(shape, (0,) + shape[1:], (0,) * len(shape)).runs() == Runs(0, 1, 0, 0)


@pytest.mark.parametrize("name", ["binary8p4", "mxfp8_e4m3", "mxfp4", "nvfp4"])
def test_round_range_of_a_piece_is_the_full_tensors_rounding_there(name):
    """sharding.round_range (the write-back's and the DTensor ops' kernel path) of a piece
    of a 12 x 384 matrix, as Shard(0) cuts it (from inside a row of lanes) and as Shard(1)
    does (a run a row), equals the full matrix rounded once, there; for a block format
    only where the pieces hold whole blocks (cut at 8 of 16 or 32: None, the caller
    draws), NVFP4 with the full tensor's per-tensor scale (the piece's own would differ:
    its largest magnitude is the full tensor's / 3.3), and not for blocks along another
    dimension than the last."""
    from fewbit.block import check_args
    from fewbit.sharding import round_range, tensor_scales

    full = torch.randn(12, 384, generator=torch.Generator().manual_seed(3)) * 3
    full[0, 0] = 3.3 * full.abs().max()  # in none of the pieces (by a power of two, no scale would move)
    key = Key(5, 6)
    spec = check_args(torch.float32, name, "src", True, 3, None)
    (ts,) = tensor_scales([full], spec.bfmt) if name == "nvfp4" else (None,)
    expected = fewbit.block.round_to(full, name, "src", bits=3, seed=key)
    for rows, cols in [(slice(5, 12), slice(0, 384)), (slice(0, 12), slice(128, 320)),
                       (slice(2, 9), slice(64, 128))]:  # fmt: skip
        local = (rows.stop - rows.start, cols.stop - cols.start)
        piece = ShardLayout((12, 384), local, (rows.start, cols.start))
        got = round_range(full[rows, cols], spec, key, piece, tensor_scale=ts)
        assert got is not None and torch.equal(got, expected[rows, cols]), (rows, cols)
        if name == "nvfp4":  # the piece alone, at its own scale, rounds otherwise
            alone = fewbit.block.round(full[rows, cols], name)
            assert not torch.equal(alone, fewbit.block.round(full, name)[rows, cols])
            with pytest.raises(ValueError, match="rounds with its full tensor's tensor_scale"):
                round_range(full[rows, cols], spec, key, piece)
    straddling = ShardLayout((12, 384), (12, 184), (0, 8))
    cut = round_range(full[:, 8:192], spec, key, straddling, tensor_scale=ts)
    assert (cut is None) == (name != "binary8p4")
    if name != "binary8p4":  # a format whose blocks lie along dim 0: not the kernel's, unless told
        columns = replace(fewbit.block.format(name), name=f"{name} along dim 0", block_size=4, axis=0)
        spec = check_args(torch.float32, columns, "src", True, 3, None)
        rows = ShardLayout((12, 384), (8, 384), (4, 0))
        assert round_range(full[4:], spec, key, rows, tensor_scale=ts) is None
        assert round_range(full[4:], spec, key, rows, axis=-1, tensor_scale=ts) is not None


@pytest.mark.parametrize("name, packed", [("binary8p4", False), ("binary4p2", True), ("ocp_e2m1", True)])
def test_quantize_range_of_a_piece_is_the_full_tensors_codes_there(name, packed):
    """sharding.quantize_range (fewbit.quantize on a DTensor's piece, in one pass of the
    kernel) of Shard(0) and Shard(1) pieces of a 12 x 384 matrix gives the codes that
    fewbit.quantize gives the full matrix there; packed pairs only where every run starts
    and ends on a pair (None: the caller draws, and its own checks refuse the call)."""
    from fewbit.rounding.checks import make_spec
    from fewbit.sharding import quantize_range

    full = torch.randn(12, 384, generator=torch.Generator().manual_seed(4)) * 3
    key = Key(5, 6)
    spec = make_spec(torch.float32, fewbit.format(name), fewbit.RoundMode.SRC, True, 3, None)
    expected = fewbit.quantize(full, name, "src", bits=3, seed=key, sat=True, packed=packed)
    for rows, cols in [(slice(5, 12), slice(0, 384)), (slice(0, 12), slice(128, 320)),
                       (slice(2, 9), slice(64, 130))]:  # fmt: skip
        local = (rows.stop - rows.start, cols.stop - cols.start)
        piece = ShardLayout((12, 384), local, (rows.start, cols.start))
        got = quantize_range(full[rows, cols], spec, key, piece, packed)
        half = slice(cols.start // 2, cols.stop // 2) if packed else cols
        assert got is not None and torch.equal(got, expected[rows, half]), (rows, cols)
    odd = ShardLayout((12, 384), (12, 191), (0, 1))
    assert (quantize_range(full[:, 1:192], spec, key, odd, packed) is None) == packed


def one_process_fake_quantize(cfg: TensorParallelProbe, case: str, replica: int) -> tuple:
    """Output and input gradient of the case's full tensor in this process (no
    torch.distributed): FakeQuantize as is for replica 0, else with that replica's key."""
    _, fmt, shape, _, _ = TP_CASES[case]
    x, grad = tp_data(cfg, shape or cfg.shape)
    x.requires_grad_()
    q = Quant(fmt or cfg.fmt, cfg.mode, bits=cfg.bits)
    if replica == 0:
        y = FakeQuantize(q, q, seed=cfg.seed)(x)
    else:  # seed 000's DIFFERING: call 0's key with the replica's rank folded in
        y = fake_quantize(x, q, q, replica_key(fold_in(Key.from_seed(cfg.seed), 0), "differing", replica))
    y.backward(grad)
    return y.detach().numpy(), x.grad.numpy()


#: Cases refused on W ranks: cuts inside blocks of 32 (32 columns on 2 or 4 ranks, 64 on 4).
REFUSED = {2: {"mx blocks straddling ranks"},
           4: {"mx blocks straddling ranks", "mx blocks cut at 32, shard1"}}


@pytest.mark.parametrize("nproc", [2, 4])
def test_fake_quantize_of_dtensors_equals_one_process_forward_and_backward(runs, nproc):
    """Tensor parallelism: each rank rounds its piece with the bits of the full tensor, so
    the gathered output and gradient are one process's for every layout; ranks of one
    mesh share a key, data-parallel replicas (the rows of a dp x tp mesh) do not."""
    cfg = TensorParallelProbe()
    results = [r["cases"] for r in runs[nproc]["tensor parallel"]]
    for case, (mesh, *_, grad_at) in TP_CASES.items():
        for rank, per_rank in enumerate(results):
            got = per_rank[case]
            if case in REFUSED[nproc]:
                assert "would straddle ranks, cut at [" in got["error"], case
                continue
            replica = rank - rank % (nproc // 2) if mesh == "dp x tp" else 0  # the first rank of its row
            y, grad = one_process_fake_quantize(cfg, case, replica)
            assert_bits_equal({"y": got["y"], "grad": got["grad"]}, {"y": y, "grad": grad})
            if grad_at == "P":  # a Partial gradient is summed before it is rounded
                assert got["placements"][1] == "(Replicate(),)"
    # Replicas differ from each other (and so, the test above, from one process's replica 0).
    replicas = [r["data-parallel replicas"]["y"] for r in (results[0], results[-1])]
    assert not np.array_equal(*replicas)


#: OPS_CASES refused on every world size, and on W ranks only, with what the error says.
OPS_REFUSED = {
    "round, compiled, shard1": "fewbit.round on a DTensor runs eagerly only",
    "round out= of another dtype, shard1": "out must match x: x is torch.float32",
    "block.quantize, shard0": "fewbit.block.quantize takes no DTensor",
    "round_ in place, partial": "x is Partial ((Partial(sum),)); with an in-place rounding, reduce it first",
    # An element without a result in the last rank's piece: every rank refuses, none writes.
    "round out= refused on one rank, shard1": "refused, nothing written",
    "block.round out= refused on one rank, shard0": "refused, nothing written",
    "encode refused on one rank, shard1": "refused, nothing written",
    "write-back refused on one rank, shard1": "write-back refused: ",
}
OPS_REFUSED_ON = {
    2: {"quantize packed, shard1": "pairs of 2 along dim 1 (of 6) would straddle ranks, cut at [3]"},
    4: {"block.round src, shard1": "blocks of 32 along dim 1 (of 64) would straddle ranks, cut at [16, 48]"},
}


@pytest.mark.parametrize("nproc", [2, 4])
def test_ops_on_dtensors_equal_one_process_on_the_full_tensor(runs, nproc):
    """fewbit.round, quantize, encode, decode and fewbit.block.round on DTensors: each rank
    rounds its piece with the bits of the full tensor, so the gathered result is one
    process's on the full tensor, for Shard(0), Shard(1), Replicate and Partial inputs, with
    a seed or given bits, out=, packed codes and the gradient; NVFP4 with the full
    tensor's per-tensor scale (its pieces alone would round otherwise); what fewbit cannot
    place (or compile) is refused alike on every rank, naming why."""
    cfg = OpsProbe()
    full = ops_data(cfg, (4, 64))
    for dim in (0, 1):
        alone = torch.cat([fewbit.block.round(c, "nvfp4") for c in full.chunk(nproc, dim)], dim)
        assert not torch.equal(alone, fewbit.block.round(full, "nvfp4"))
    refused = {**OPS_REFUSED, **OPS_REFUSED_ON[nproc]}
    for rank in runs[nproc]["ops"]:
        for name, (_, shape, call) in OPS_CASES.items():
            got = rank["cases"][name]
            if name in refused:
                assert refused[name] in got["error"], (name, got)
                continue
            assert "error" not in got, (name, got)
            expected = call(ops_data(cfg, shape), lambda t: t).detach().numpy()
            assert_bits_equal({name: got["result"]}, {name: expected})
    placements = {name: c.get("placements") for name, c in runs[nproc]["ops"][0]["cases"].items()}
    assert placements["round src, partial"] == "(Replicate(),)"  # summed before it is rounded
    assert placements["round src, shard1"] == placements["round, gradient, shard1"] == "(Shard(dim=1),)"


def test_block_formats_on_fsdp_weights_whole_blocks_equal_one_process_straddling_refused(runs):
    """mxfp8 weights under FSDP2: Shard(0) pieces hold whole blocks (of 32 along the last
    dimension) and train bit-identically to one process; Shard(1) cuts the 32-wide rows
    at 16, a block across two ranks, and every rank refuses it naming the weight."""
    with fewbit.configure(compile=False):
        single = train_single(MX)
    for r in runs[2]["mx shard0"]:
        assert r["hashes"] == single["hashes"]
    weights = runs[2]["mx shard0"][0]["weights"]
    assert_bits_equal(weights, single["weights"])
    w = weights["tok.weight"]  # the written-back weights are mx values: rounding keeps them
    assert torch.equal(fewbit.block.round(w, "mxfp8_e4m3"), w)
    for r in runs[2]["mx shard1"]:
        assert r["error"].startswith("tok.weight: mxfp8_e4m3 on a sharded tensor: blocks of 32 along dim 1 "
                                     "(of 32) would straddle ranks")  # fmt: skip


def test_nvfp4_weights_under_fsdp2_take_their_full_tensors_scale_and_equal_one_process(runs):
    """NVFP4 weights under FSDP2: each piece rounds with the per-tensor scale of its full
    weight (the largest magnitude over the ranks' pieces: a collective a step), so
    Shard(0), Shard(1) with codes kept (32-wide rows cut at 16 hold whole blocks of 16),
    and HSDP on 4 ranks (2 replicas of 2 shards: the all-reduce along the shards alone)
    train bit-identically to one process."""
    with fewbit.configure(compile=False):
        single = train_single(NVFP4)
    assert len(set(single["hashes"])) == len(single["hashes"])  # the weights moved
    for n, scenario in ((2, "nvfp4 shard0"), (2, "nvfp4 shard1, codes"), (4, "nvfp4 hsdp")):
        for r in runs[n][scenario]:
            assert r["hashes"] == single["hashes"], scenario
    assert_bits_equal(runs[2]["nvfp4 shard0"][0]["weights"], single["weights"])


def test_store_codes_keeps_codes_of_the_local_piece_only(single, runs):
    results = runs[2]["codes"]
    full = sum(w.size for n, w in single["weights"].items() if w.ndim >= 2)
    counts = [r["codes"] for r in results]
    assert sum(counts) == full and all(0 < c < full for c in counts)
    for r in results:  # decoded, the weights are those of the run without codes
        assert r["hashes"] == single["hashes"][:2]


def test_scale_takes_the_largest_magnitude_of_the_full_tensor(runs):
    """scale=True: each piece is scaled by the power of two of the whole tensor's amax."""
    with fewbit.configure(compile=False):
        single = train_single(ShardedRun(steps=STEPS, until=10, hash_every=EVERY, scale=True))
    plain = runs[2]["codes"][0]["hashes"]  # the same 10 steps without scale
    assert single["hashes"] != plain  # the scale changed the rounding
    for r in runs[2]["scaled"]:
        assert r["hashes"] == single["hashes"]


@pytest.mark.parametrize("nproc, placement", [(4, "Shard(0), uneven"), (2, "Shard(1)")])
def test_scalified_model_under_fsdp2_equals_one_process_bit_for_bit(scalified_single, runs, nproc, placement):
    """ScaledTensor parameters under FSDP2 (its all-gather extension points): the ranks
    hold ScaledTensor pieces with the whole tensor's scale, and the full weights after
    every check equal those of the same scalified model trained in one process (its
    gradients ScaledTensors, summed pairwise) bit for bit. 30 embedding rows on 4 ranks
    leave the last piece short: the padded all-gather."""
    single = scalified_single
    assert len(set(single["hashes"])) == len(single["hashes"])  # the weights moved
    # scalify's power-of-two scales (RMS 1): not all 1, so a scale dropped on the way shows
    assert single["scales"] and any(s != 1.0 for s in single["scales"].values())
    for r in runs[nproc]["scalified"]:
        assert r["scales"] == single["scales"]  # every piece a ScaledTensor, at the full tensor's scale
        assert r["hashes"] == single["hashes"]
    assert_bits_equal(runs[nproc]["scalified"][0]["weights"], single["weights"])


def test_strided_shards_whose_pieces_are_no_block_are_refused_on_every_rank(runs):
    """A _StridedShard (a view of a sharded DTensor) gives a rank rows apart: their bits
    were drawn as if they were one block from the first."""
    for r in runs[2]["edges"]:
        for case in ("strided view", "strided"):
            assert r["cases"][case].startswith("ValueError: a DTensor of shape"), r["cases"][case]
            assert "redistribute it to Shard or Replicate" in r["cases"][case]


def test_fsdp2_with_tp_strided_shards_equal_one_process(runs):
    """Its even pieces are blocks, kept; its strided mesh dimension shards too (the full
    tensor's amax, NVFP4's scale), though torch's is_shard says not."""
    for r in runs[4]["edges"]:
        assert r["cases"]["fsdp2 with tp"] == [True, True, True]


def test_a_piece_not_where_placed_is_refused_on_every_rank(runs):
    """Only rank 1's piece is misplaced: rank 0 must not wait for it in the agreement."""
    first, second = (r["cases"]["piece not where placed"] for r in runs[2]["edges"])
    assert first.startswith("ValueError: fewbit.round: another rank's piece of x was refused"), first
    assert second.startswith("RuntimeError: a DTensor of shape (7, 32)"), second


@pytest.mark.parametrize("name", list(BAD_BITS_CALLS))
def test_given_bits_out_of_range_on_one_rank_are_refused_on_every_rank(runs, name):
    """The bits' range is checked on each piece: rank 0 went on, out written, while rank 1
    raised (and rank 0 then waited alone at its next collective)."""
    first, second = (r["cases"][f"bits out of range on rank 1, {name}"] for r in runs[2]["edges"])
    assert first[0].startswith("ValueError: fewbit.") and "another rank's piece of x was refused" in first[0]
    assert second[0].startswith("ValueError: random_bits must lie in [0, 8)"), second
    assert (first[1], second[1]) == (False, False)


def test_a_held_dtensor_weight_read_through_its_methods_is_decoded_first(runs):
    """store_codes under FSDP2 or tensor parallelism: ``to_local()``, ``redistribute()`` or
    a print of a weight held as codes read its piece, storage freed, and crashed the
    process (SIGSEGV); fewbit's own check_in_sync and drift_report read pieces so."""
    every_read = dict.fromkeys(("to_local", "full_tensor", "redistribute", "repr"), True)
    for r in runs[2]["edges"]:
        assert r["cases"]["held as codes, read"] == every_read


@pytest.mark.parametrize("name", list(EMPTY_PIECE_CASES))
def test_a_weight_with_an_empty_piece_writes_back_as_one_process(runs, name):
    """A (1, 32) weight on 2 ranks, where the native kernel does not round the write-back:
    rank 1's empty piece was given a stochastic rounding without its bits, and raised while
    rank 0 went on alone (a hang, or gloo's abort)."""
    kw = EMPTY_PIECE_CASES[name]
    with fewbit.configure(compile=False):
        single = empty_piece_write_back(None, kw, world=False)
    assert single != torch.randn(1, 32, generator=torch.Generator().manual_seed(3)).tolist()  # rounded
    for r in runs[2]["edges"]:
        assert r["cases"][f"empty piece, {name}"] == single


def test_ops_on_a_transposed_dtensor_give_contiguous_results(runs):
    """A rounding's pieces are contiguous (a plain tensor's result is, whatever its input's
    strides); the DTensor said it had the input's strides, and refused .view(-1)."""
    full = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    expected = fewbit.round(full.t(), "binary8p4", "sr", seed=2).view(-1).tolist()
    for r in runs[2]["edges"]:
        assert r["cases"]["transposed, viewed"] == expected


def test_guard_compares_tensor_parallel_weights_between_data_parallel_replicas(runs):
    """TP on each row of a (dp, tp) mesh: the guard was refused ("nothing to compare"), as the
    weights' own mesh holds no copies, while check_in_sync compared them across the rows."""
    for r in runs[4]["edges"]:
        outcome = r["cases"]["guard, tp with dp replicas"]
        assert isinstance(outcome, list), outcome  # (the refusal: a string)
        caught, stepped = outcome
        assert caught.startswith("ReplicaDriftError") and "differs across ranks" in caught, caught
        assert stepped == "stepped"


def test_the_guard_compares_each_pipeline_stage_within_its_guard_group(runs):
    """Pipeline stages hold other weights: compared across the world, the guard refused them
    named (at construction, on every rank alike) and took them for drifted copies by their
    places; with each stage's group it compares the stage's copies alone, so rank 3's drift
    stops the second stage and not the first. The other stage's group is refused (it would
    compare this rank with no one), by the guard and by check_in_sync and drift_report."""
    outcomes = [r["cases"]["guard, pipeline stages"] for r in runs[4]["edges"]]
    assert all(isinstance(o, list) for o in outcomes), outcomes  # (an error outside the cases: a string)
    for rank, (named, placed, elsewhere, synced, drifted, first, second, shared) in enumerate(outcomes):
        assert named.startswith("ReplicaDriftError: ranks hold different sets of tensors"), named
        assert "pipeline stages" in named, named
        assert placed.startswith("ReplicaDriftError: param 0 differs across ranks"), placed
        assert "guard_group" in placed, placed
        assert elsewhere.startswith("ValueError: guard_group does not hold this rank"), elsewhere
        for outcome in (synced, drifted):  # ("in sync: 1 tensors on -1 ranks", truthy; a drift of 0)
            assert outcome.startswith("ValueError: group does not hold this rank"), outcome
        if rank < 2:
            assert first == "stepped"
        else:
            assert first.startswith("ReplicaDriftError: 1.weight.grad differs across ranks"), first
        assert second == "stepped" and shared is True


def test_pipeline_stages_with_replicas_draw_as_replicas_of_one_model_given_their_group(runs):
    """2 stages x 2 replicas: with replica_group the stage's data-parallel group, replica r
    of each stage draws the bits of replica r of a 2-rank run without pipelining (the key
    made here by hand), forward and backward, whichever ranks hold the stage. Without it,
    the global rank was folded in: rank 2, stage 1's replica 0, drew other bits. A group
    not holding the rank, or a DeviceMesh, is refused."""
    outcomes = [r["cases"]["activations, pipeline stages"] for r in runs[4]["edges"]]
    assert all(isinstance(o, dict) for o in outcomes), outcomes  # (an error outside the cases: a string)
    for rank, got in enumerate(outcomes):
        stage, replica = divmod(rank, 2)
        linear, x, grad = pipeline_stage(stage)
        x.requires_grad_()
        key = replica_key(fold_in(Key.from_seed(STAGE_SEED), stage, 0), "differing", replica)
        y = fake_quantize(linear(x), STAGE_QUANT, STAGE_QUANT, key)
        y.backward(grad)
        out, input_grad = got["grouped"]
        assert_bits_equal({"y": out, "grad": input_grad}, {"y": y.detach(), "grad": x.grad})
        assert got["other stage's group"].startswith("ValueError: replica_group does not hold this rank")
        assert got["mesh"].startswith("TypeError: replica_group must be a torch.distributed.ProcessGroup")
    for stage in (0, 1):  # the replicas of a stage draw apart, forward and backward
        first, second = (outcomes[2 * stage + r]["grouped"] for r in (0, 1))
        assert not any(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    grouped, global_rank = outcomes[2]["grouped"], outcomes[2]["global"]
    assert not any(torch.equal(a, b) for a, b in zip(grouped, global_rank, strict=True))


def test_tensor_parallel_replicas_given_their_group_fold_in_their_rank_in_it(runs):
    """Rows of a (dp, tp) mesh: given the dp group, every rank holding a piece of the
    tensor folds in its replica's rank in that group (the row), so the full output is
    fake_quantize's of the full tensor with that rank folded in (the key made here by
    hand); without it, the row's lowest global rank (0 and 2): row 1 drew other bits."""
    outcomes = [r["cases"]["activations, tp with dp replicas"] for r in runs[4]["edges"]]
    assert all(isinstance(o, list) for o in outcomes), outcomes
    _, x, _ = pipeline_stage(0)
    for rank, (grouped, ungrouped) in enumerate(outcomes):
        row = rank // 2
        for folded, got in ((row, grouped), (2 * row, ungrouped)):
            key = replica_key(fold_in(Key.from_seed(STAGE_SEED), 0), "differing", folded)
            assert_bits_equal({"y": got}, {"y": fake_quantize(x, STAGE_QUANT, None, key)})
    assert not torch.equal(outcomes[0][0], outcomes[2][0])  # the rows draw apart
    assert not torch.equal(outcomes[2][0], outcomes[2][1])  # row 1: the group's rank, not rank 2


def test_an_empty_piece_of_another_empty_shape_is_taken_on_every_rank(runs):
    _, whole = tp_fsdp_empty_pieces(False)
    outcomes = [r["cases"]["tp and fsdp2, an empty piece of another shape"] for r in runs[4]["edges"]]
    assert all(isinstance(o, list) for o in outcomes), outcomes  # (a refusal: a string)
    assert [len(piece) for _, piece in outcomes] == [16, 0, 16, 0]
    for (row, col), piece in outcomes:
        columns = len(piece[0]) if piece else 0
        assert piece == [v[col:col + columns] for v in whole[row:row + len(piece)]]


def test_guard_on_weights_unlike_across_ranks_is_refused_on_every_rank(runs):
    outcomes = [r["cases"]["guard, unlike weights"] for r in runs[2]["edges"]]
    assert all(o.startswith("ValueError: guard=True has nothing to compare") for o in outcomes), outcomes


def test_ranks_outside_the_mesh_get_empty_pieces(runs):
    amax = float(torch.randn(8, 32, generator=torch.Generator().manual_seed(0)).abs().max())
    got = [r["cases"]["outside the mesh"] for r in runs[4]["edges"]]
    assert got == [[amax, (4, 32), (4, 32)]] * 2 + [[0.0, (0,), (0,)]] * 2


def test_sync_checks_refuse_other_tensors_alike_on_every_rank(runs):
    """A None on one rank, other shapes or names: the gathers would not pair (a hang, a gloo
    abort, or a bogus report)."""
    f32 = "torch.float32, shape"
    said = {"sync, None on one rank": "rank 1 lacks w.grad and also holds w.grad (None)",
            "drift, other shapes": f"lacks w ({f32} (3,)) and also holds w ({f32} (4,))",
            "drift, other names": f"beside rank 0, rank 1 also holds b ({f32} (2,))"}  # fmt: skip
    for r in runs[2]["edges"]:
        for case, error in said.items():
            got = r["cases"][case]
            assert got.startswith("ReplicaDriftError: ") and error in got, got


def test_drift_in_a_format_puts_inf_beyond_max_and_nan_beyond_inf(runs):
    """-max against -inf, max against inf, inf against NaN: each one step."""
    for r in runs[2]["edges"]:
        assert r["cases"]["drift in a format, at its ends"] == {"a": 1, "b": 1, "c": 1}


@pytest.mark.parametrize(("values", "amax"), [([1.0, math.inf], math.inf), ([-math.inf, 2.0], math.inf),
                                              ([1.0, math.nan], math.inf), ([], 0.0)])  # fmt: skip
def test_global_amax_of_a_tensor_keeps_inf(values, amax):
    assert global_amax(torch.tensor(values)) == amax


def test_global_amax_of_float64_keeps_its_range():
    assert global_amax(torch.tensor([-1e300, 2.0], dtype=torch.float64)) == 1e300


def test_global_amax_and_tensor_scales_refuse_a_partial_alike(runs):
    """Its pieces are addends: their largest is not the sum's (and nothing was reduced)."""
    for r in runs[2]["edges"]:
        for case in ("amax of a partial", "scales of a partial"):
            assert r["cases"][case].startswith("ValueError: ") and "holds addends" in r["cases"][case], r


def one_rank(script: str, tmp_path: Path) -> list[str]:
    """The lines ``script`` printed, run as one gloo rank in a process of its own (a crash
    must not take pytest with it), its rendezvous file in ``tmp_path``."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "store")], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    return done.stdout.strip().splitlines()


_IN_FLIGHT = """
import sys, torch, torch.distributed as dist, fewbit
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Shard, init_device_mesh
from fewbit.nn import Quant, fake_quantize
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
calls = {
    "round": lambda v: fewbit.round(v, "binary8p4", "src", bits=3, seed=1),
    "quantize": lambda v: fewbit.quantize(v, "e4m3"),
    "block.round": lambda v: fewbit.block.round(v, "mxfp8_e4m3", "src", bits=3, seed=1),
    "fake_quantize": lambda v: fake_quantize(v, Quant("binary8p4", "src", bits=3), None, 1),
}
with torch.no_grad():
    for name, call in calls.items():
        piece = DTensor.from_local(AsyncCollectiveTensor(x.clone()), mesh, [Shard(0)], run_check=False)
        assert type(piece.to_local()) is AsyncCollectiveTensor
        got = call(piece)
        assert torch.equal(got.to_local(), call(x)), name
print("ok")
dist.destroy_process_group()
"""


def test_a_piece_whose_collective_is_in_flight(tmp_path):
    """A row-parallel layer's output is a DTensor whose piece is an AsyncCollectiveTensor,
    a wrapper with a null data pointer: fake_quantize, round, quantize and block.round
    handed it to the kernel, and every rank died (SIGSEGV). One rank of gloo, in a process
    of its own (a crash must not take pytest with it)."""
    assert one_rank(_IN_FLIGHT, tmp_path) == ["ok"]


_REINITIALISED = """
import sys, torch, torch.distributed as dist, fewbit
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
rank, stores = int(sys.argv[1]), sys.argv[2:]
full = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
want = fewbit.round(full, "binary8p4", "src", bits=3, seed=5)
for k, store in enumerate(stores):  # the second time, this process has the other rank
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank if k == 0 else 1 - rank,
                            world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    got = fewbit.round(distribute_tensor(full, mesh, [Shard(0)]), "binary8p4", "src", bits=3, seed=5)
    assert torch.equal(got.full_tensor(), want), k
    dist.destroy_process_group()
print("ok", flush=True)
# Without the interpreter's teardown, in which torch 2.13's gloo thread aborted 1 run in 10
# (it frees a finished all-gather's tensors and takes the GIL, gone by then), fewbit or not.
import os; os._exit(0)
"""


def test_a_process_group_set_up_again_at_another_rank_draws_that_ranks_bits(tmp_path):
    """A DeviceMesh compares equal across ranks, so a layout found before the process group
    was set up again, with this process at the other rank, gave the old rank's piece its
    bits (an in-process restart). Two gloo ranks, each a process of its own."""
    import subprocess
    import sys

    stores = [str(tmp_path / f"store{k}") for k in range(2)]
    ranks = [subprocess.Popen([sys.executable, "-c", _REINITIALISED, str(r), *stores], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]  # fmt: skip
    done = [(p.communicate(timeout=300), p.returncode) for p in ranks]
    for (out, err), code in done:
        assert code == 0 and out.strip() == "ok", (code, err[-2000:])


_DTENSOR_CALLS = """
import sys, torch, torch.distributed as dist, fewbit
from torch._dynamo.utils import counters
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
from fewbit.random import key_of
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
full = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
x = distribute_tensor(full, mesh, [Shard(0)])
src = lambda v, seed=5, **kw: fewbit.round(v, "binary8p4", "src", bits=3, seed=seed, **kw)
want = src(full)
# Compiled without fullgraph: one graph break, and the rule runs eagerly (it compiled the
# rule's own frames: 11 graphs and 8 breaks a call).
f = torch.compile(lambda v: src(v * 1) + 0)
for _ in range(2):
    got = f(x)
assert torch.equal(got.full_tensor(), want)
print("graphs", counters["stats"]["unique_graphs"], "breaks", len(counters["graph_break"]))
# A step counter that distribute_module made a DTensor (DTensor's >> made seed 5 the key (5, 5)).
for seed in (distribute_tensor(torch.tensor(5), mesh, [Replicate()]),
             distribute_tensor(key_of(5), mesh, [Replicate()])):
    assert torch.equal(src(x, seed).full_tensor(), want) and torch.equal(src(full, seed), want)
for call in (lambda: src(full, out=torch.empty_like(x)),
             lambda: src(x, seed=distribute_tensor(key_of(5), mesh, [Shard(0)]))):
    try:
        call()
    except ValueError as e:
        print(e)
dist.destroy_process_group()
"""


def test_dtensor_calls_compiled_and_with_a_dtensor_seed_or_a_plain_x(tmp_path):
    """fewbit's DTensor rules run eagerly under torch.compile (Dynamo compiled their frames);
    a DTensor seed gives the int seed's bits (a 0-d one gave other bits); a plain x with a
    DTensor out= is refused by name (an AttributeError from inside the rule)."""
    lines = one_rank(_DTENSOR_CALLS, tmp_path)
    graphs, breaks = map(int, lines[0].split()[1::2])
    assert breaks == 1 and graphs <= 3, lines[0]
    assert lines[1] == ("fewbit::round_into: x is a plain tensor and out a DTensor: give x as a DTensor laid "
                        "out alike, or plain tensors throughout")  # fmt: skip
    assert lines[2] == "a seed tensor that is a DTensor must be Replicate, not (Shard(dim=0),)"


_FAKE_QUANTIZE_COMPILED = """
import sys, torch, torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
import torch.utils.checkpoint as cp
from torch.distributed.tensor import distribute_module
from fewbit.nn import FakeQuantize, Quant, checkpoint_context, fake_quantize
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
full = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
x = distribute_tensor(full, init_device_mesh("cpu", (1,)), [Shard(1)])
q = Quant("binary8p4", "src", bits=3)
module = lambda: FakeQuantize(q, q, seed=5)
function = lambda: lambda v: fake_quantize(v, q, q, seed=5)
for name, make in (("module", module), ("function", function)):
    for inside in (False, True):  # x itself, or a DTensor made in the compiled region
        torch._dynamo.reset()
        counters.clear()
        fq, eager = make(), make()
        compiled = torch.compile(lambda v: fq(v * 2 if inside else v))
        for _ in range(10):
            got, want = x.detach().requires_grad_(), x.detach().requires_grad_()
            y = compiled(got)
            y.square().sum().backward()
            z = eager(want * 2 if inside else want)
            z.square().sum().backward()
            assert torch.equal(y.full_tensor(), z.full_tensor()), (name, inside)
            assert torch.equal(got.grad.full_tensor(), want.grad.full_tensor()), (name, inside)
        print(name, inside, counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    try:
        torch.compile(make(), fullgraph=True)(x)
        print("fullgraph", name, "ran")
    except Exception as e:  # Dynamo's Unsupported, holding fewbit's reason
        print("fullgraph", name, "fewbit's fake quantisation of a DTensor runs eagerly only" in str(e))
# distribute_module makes the count a Replicate DTensor; checkpointed or compiled, the
# count is fewbit::count_call's, which had no DTensor rule.
fq, plain = module(), module()
distribute_module(fq, x.device_mesh)
compiled = torch.compile(fq)
for step in range(3):
    got, want = full.detach().requires_grad_(), full.detach().requires_grad_()
    if step == 0:
        y = cp.checkpoint(fq, got, use_reentrant=False, context_fn=checkpoint_context)
    else:
        y = compiled(got)
    y.square().sum().backward()
    z = plain(want)
    z.square().sum().backward()
    assert torch.equal(y, z) and torch.equal(got.grad, want.grad), step
print("count", fq.calls.placements, int(fq.calls.to_local()))
dist.destroy_process_group()
"""


def test_fake_quantize_on_dtensors_compiled_breaks_once_and_gives_eagers_bits(tmp_path):
    """torch.compile (not fullgraph) of FakeQuantize or fake_quantize on a DTensor: Dynamo
    failed outright on one made inside the compiled region (the mesh's rank tensor, read
    for the key), and on an input recompiled a frame inside the autograd Function at
    every call until its limit. Now one graph break, the call eager, with eager's bits
    forward and backward, and no graph a call. A FakeQuantize whose count distribute_module
    made a DTensor failed wherever its count is an op (checkpoint_context, compiled).
    fullgraph=True refuses both, with fewbit's reason."""
    *compiled, count = one_rank(_FAKE_QUANTIZE_COMPILED, tmp_path)
    refused = [line for line in compiled if line.startswith("fullgraph")]
    assert refused == ["fullgraph module True", "fullgraph function True"]  # (Dynamo's message said None)
    for line in set(compiled) - set(refused):
        assert int(line.split()[-1]) <= 2, line  # the code around the call: before and after it
    assert count == "count (Replicate(),) 3"


def test_reduce_exactly_refuses_a_model_nothing_shards():
    """reduce_exactly sets FSDP2's reduction on each sharded module (the experiment's runs
    above, sharded block by block, fail where it sets the root's alone); a model that
    fully_shard has not touched has none to set, which would leave the guarantee silently."""
    from fewbit.sharding import reduce_exactly

    with pytest.raises(ValueError, match="no module of the model is sharded"):
        reduce_exactly(torch.nn.Linear(2, 2), 4)


_ONE_RANK_SHARD_GROUPS = """
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from fewbit.sharding import reduce_exactly
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
for names in (("shard",), ("replicate", "shard")):  # FSDP2 on one rank; HSDP: one replica of one shard
    net = torch.nn.Linear(4, 4, bias=False)
    fully_shard(net, mesh=init_device_mesh("cpu", (1,) * len(names), mesh_dim_names=names))
    reduce_exactly(net, 4)
    net(torch.ones(1, 4)).sum().backward()  # each weight's gradient: 1
    print(*net.weight.grad.full_tensor().unique().tolist())
    del net
dist.destroy_process_group()
"""


def test_reduce_exactly_divides_once_where_a_shard_group_has_one_rank(tmp_path):
    """FSDP2 divided the sum twice where the shard group has one rank (torch 2.13's copy for
    one rank divides, and so does the division after it): reduce_exactly(model, 4) on one
    rank gave 1/16 for 1/4, silently, and so did HSDP on an (R, 1) mesh."""
    assert one_rank(_ONE_RANK_SHARD_GROUPS, tmp_path) == ["0.25", "0.25"]


def scaled_checkpoint(rank: int, world_size: int, cfg: dict) -> dict:
    """The scalified tiny GPT under FSDP2 on these ranks: every piece rebalanced to scale
    1/4 and saved with DCP (``cfg["save"]``), or that checkpoint loaded into a fresh model,
    whose LayerNorm weights are at scale 1. Returns the pieces' scales and what each
    rank's all-gather makes of every parameter (its values)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import FSDPModule

    from fewbit.scaled import rebalance_

    run = ShardedRun(params="scalified")
    model, _ = build(run, Batches(run).vocab, world_size)
    if cfg["save"]:
        for p in model.parameters():
            rebalance_(p.to_local(), 0.25)
        dcp.save(get_model_state_dict(model), checkpoint_id=cfg["dir"])
    else:
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=cfg["dir"])
        set_model_state_dict(model, state)
    scales = {n: float(p.to_local().scale) for n, p in model.named_parameters()}
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.unshard()
    gathered = {n: p.dequantize().detach().numpy().copy() for n, p in model.named_parameters()}
    return {"scales": scales, "gathered": gathered}


def test_scalified_checkpoint_loads_on_other_ranks_at_one_scale_and_gathers_its_values(tmp_path):
    """Saved on 2 ranks, loaded on 3: DCP fills a piece with one copy_ of a saved piece's
    part (which takes its scale, 1/4) or with two (which keep the larger, 1), so the ranks
    held a LayerNorm weight at scales (1/4, 1, 1/4) and every all-gather read the others'
    data at its own scale, silently (4 for 1). scalify's modules agree on the largest
    scale after load_state_dict: every rank's gathered values are the saved ones."""
    with pytest.MonkeyPatch.context() as patch:  # the ranks import this file (see runs)
        patch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.getenv("PYTHONPATH", "")]))
        (saved,) = launch([{"save": True, "dir": str(tmp_path)}], 2, train=scaled_checkpoint)
        (loaded,) = launch([{"save": False, "dir": str(tmp_path)}], 3, train=scaled_checkpoint)
    for name, values in saved[0]["gathered"].items():
        assert len({r["scales"][name] for r in loaded}) == 1, (name, [r["scales"][name] for r in loaded])
        for r in loaded:
            assert np.array_equal(r["gathered"][name], values), name
    assert loaded[0]["scales"]["blocks.0.ln1.weight"] == 1.0


_SCALIFY_SHARDED = """
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from fewbit.scaled import ScaledTensor, scalify
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
for first in (False, True):  # sharded plain, or scalified and then sharded (a second scalify)
    model = torch.nn.Linear(4, 6)
    if first:
        scalify(model)
    fully_shard(model, mesh=mesh)
    try:
        scalify(model)
        print("taken")
    except TypeError as e:
        print(type(model.weight.to_local()) is (ScaledTensor if first else torch.Tensor), e)
dist.destroy_process_group()
"""


def test_scalify_refuses_a_sharded_model_before_changing_it(tmp_path):
    """scalify after fully_shard wrapped each DTensor parameter whole in a ScaledTensor, and
    FSDP2's forward failed in torch ("'ScaledTensor' object has no attribute '_local_tensor'");
    on a model scalified and then sharded, a rescale taken from each rank's piece would give
    the ranks different scales. A clear TypeError, with the parameter as it was."""
    said = one_rank(_SCALIFY_SHARDED, tmp_path)
    assert len(said) == 2, said
    for line in said:
        assert line.startswith("True parameter 'weight' is a DTensor") and "before fully_shard" in line, line


def scaled_cast(rank: int, world_size: int, cfg: dict) -> dict:
    """A scalified Linear (rescale=None) whose first rows hold 1e6, sharded and cast with
    ``half()``: the scale of this rank's piece before and after ``agree_scales``, and whether
    the weight it then gathers is one process's cast."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fewbit.scaled import fsdp, scalify

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 6)
    with torch.no_grad():
        model.weight[:3] *= 1e6
    scalify(model, rescale=None)
    want = model.weight.detach().half().dequantize(torch.float32).numpy()  # as one process casts it
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    model.half()
    cast = float(model.weight.to_local().scale)
    changed = fsdp.agree_scales(model)
    agreed = float(model.weight.to_local().scale)
    model.unshard()
    got = model.weight.dequantize(torch.float32).detach().numpy()
    return {"scales": (cast, agreed), "changed": changed, "equal": bool(np.array_equal(got, want))}


def test_a_cast_of_a_sharded_scalified_model_then_agree_scales_gathers_its_values():
    """half() moves 2^19 into the scale of the piece whose data exceed float16 (rank 0's),
    not the other's: the ranks' all-gathers read each other's data 2^19 off (the README
    says to call agree_scales after such a cast); after it, both gather what one process's
    half() of the whole weight holds."""
    with pytest.MonkeyPatch.context() as patch:  # the ranks import this file (see runs)
        patch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.getenv("PYTHONPATH", "")]))
        (ranks,) = launch([{}], 2, train=scaled_cast)
    assert [r["scales"] for r in ranks] == [(2.0**19, 2.0**19), (1.0, 2.0**19)]
    assert [r["changed"] for r in ranks] == [0, 1]
    assert all(r["equal"] for r in ranks)


_UNPACKABLE = """
import sys, torch, torch.distributed as dist, fewbit
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
for fmt, shape in (("ocp_e2m1", (66, 5)), ("ocp_e2m1", (2, 3)), ("binary8p4", (4, 6))):
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    for placement in (Replicate(), Shard(0)):
        x = distribute_tensor(full, mesh, [placement])
        for call in (lambda v: fewbit.quantize(v, fmt, "src", bits=3, seed=1, sat=True, packed=True),
                     lambda v: fewbit.encode(fewbit.round(v, fmt, sat=True), fmt, packed=True)):
            said = []
            for v in (full, x):
                try:
                    call(v)
                    said.append("none")
                except ValueError as e:
                    said.append(str(e))
            print(said[0] == said[1] != "none", fmt, shape, placement, said[1])
dist.destroy_process_group()
"""


def test_packed_codes_of_a_dtensor_are_refused_as_the_full_tensors(tmp_path):
    """Packed codes need K <= 4 and an even last dimension of the full tensor. The DTensor
    rules checked only the cuts between pieces: a piece of an odd last dimension went to the
    kernel, which wrote its pairs past the end of the codes (heap corruption, SIGABRT), and
    binary8p4's 8-bit codes were packed in 4 bits without a word. One gloo rank, in a
    process of its own."""
    lines = one_rank(_UNPACKABLE, tmp_path)
    assert len(lines) == 12 and all(line.startswith("True ") for line in lines), lines


def empty_piece_agreement(rank: int, world_size: int, cfg: dict) -> dict:
    """A float16 scalified Linear(8, 1) of weights up to 2^-20 (at scale 2^-20, data up to 1)
    under FSDP2 on 2 ranks, rank 1's piece empty and at scale 1 (a checkpoint's load leaves
    such a piece the fresh model's scale), then agree_scales: each rank's scale and what its
    all-gather makes of the weight (in float32)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fewbit.scaled import rebalance_, scalify
    from fewbit.scaled.fsdp import agree_scales

    model = torch.nn.Linear(8, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.linspace(-1, 1, 8).mul(2.0**-20))
    scalify(model, dtype=torch.float16, rescale="max")
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    if not model.weight.to_local().numel():
        rebalance_(model.weight.to_local(), 1.0)
    agree_scales(model)
    scale = float(model.weight.to_local().scale)
    model.unshard()
    return {"scale": scale, "gathered": model.weight.dequantize(torch.float32).detach().numpy().copy()}


def test_agree_scales_takes_no_scale_from_an_empty_piece():
    """A rank whose piece is empty (a 1-row weight on 2 ranks) loads nothing and keeps the
    fresh model's scale, here 1: the largest, it was agreed on, and the other piece's
    float16 data of values near 2^-20 went to subnormals (a few bits left), silently. An
    empty piece now takes the others' scale."""
    want = torch.linspace(-1, 1, 8).half().float().mul(2.0**-20).numpy()[None]  # (data, scale)
    with pytest.MonkeyPatch.context() as patch:  # the ranks import this file (see runs)
        patch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.getenv("PYTHONPATH", "")]))
        (ranks,) = launch([{}], 2, train=empty_piece_agreement)
    assert [r["scale"] for r in ranks] == [2.0**-20] * 2
    for r in ranks:
        assert np.array_equal(r["gathered"], want)


_META_LOAD = """
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from fewbit.scaled import scalify
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
with torch.device("meta"):
    model = scalify(torch.nn.Linear(4, 4))
fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
print(model.load_state_dict({}, strict=False).missing_keys)
dist.destroy_process_group()
"""


def test_a_sharded_scalified_model_on_the_meta_device_loads_without_reading_its_scales(tmp_path):
    """scalify's hook after load_state_dict read every piece's scale: on the meta device (a
    model not yet materialised, loaded with strict=False) that was 'Tensor.item() cannot be
    called on meta tensors'. Meta pieces take no part, alike on every rank."""
    assert one_rank(_META_LOAD, tmp_path) == ["['weight', 'bias']"]


# Errors that only some ranks see (the rank-errors hunt): every rank must raise alike, and
# none may be left in a collective that the others never reach (a hang, or the others' next
# collective taken for it). One launch of 2 ranks for all the cases; after each, every rank
# adds its rank + 1 in an all-reduce of the world, which reads 3 only if the ranks' collectives
# paired up.


def _misplaced_on_rank_1(rank: int):
    """A (7, 32) DTensor on 2 ranks, Shard(0): rank 0's piece (4 rows) is where the placements
    say, rank 1's (4 rows, not 3) is not."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    full = torch.randn(7, 32, generator=torch.Generator().manual_seed(0))
    piece = full[:4] if rank == 0 else full[3:].repeat(2, 1)[:4]
    mesh = init_device_mesh("cpu", (2,))
    return DTensor.from_local(piece, mesh, [Shard(0)], run_check=False, shape=(7, 32), stride=(32, 1))


def _sharded_weight() -> torch.nn.Parameter:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    return torch.nn.Parameter(distribute_tensor(full, init_device_mesh("cpu", (2,)), [Shard(0)]))


def _stepped(**kw) -> str:
    """A sharded weight wrapped with ``kw`` (this rank's), and a step."""
    w = _sharded_weight()
    opt = LowPrecisionWeights(torch.optim.SGD([w], lr=0.1), **{"fmt": "binary8p4", "mode": "src", **kw})
    w.grad = torch.ones_like(w)
    opt.step()
    return "stepped"


def _nvfp4_weights(native: bool) -> list:
    """A sharded weight in NVFP4 after a step, the native kernels on or off: the full weight."""
    w = _sharded_weight()
    with fewbit.configure(native=native):
        opt = LowPrecisionWeights(torch.optim.SGD([w], lr=0.1), "nvfp4", "src", seed=5)
        w.grad = torch.ones_like(w)
        opt.step()
    return w.full_tensor().tolist()


def _loaded_on_rank_1(rank: int, spoiled) -> list:
    """A wrapper of a sharded weight loading its own state_dict after a step, rank 1's
    ``spoiled(state)``: the outcome and the step count after it."""
    w = _sharded_weight()
    opt = LowPrecisionWeights(torch.optim.SGD([w], lr=0.1), "binary8p4", "src")
    state = opt.state_dict()
    w.grad = torch.ones_like(w)
    opt.step()
    if rank == 1:
        state = spoiled(state)
    return [_outcome(lambda: opt.load_state_dict(state) or "loaded"), opt.steps]


def _added_misplaced(rank: int) -> str:
    """A group whose weight's piece is misplaced on rank 1, added to a wrapper of a sharded
    weight."""
    w = _sharded_weight()
    opt = LowPrecisionWeights(torch.optim.SGD([w], lr=0.1), "binary8p4", "src")
    opt.add_param_group({"params": [torch.nn.Parameter(_misplaced_on_rank_1(rank))]})
    return "added"


def rank_errors(rank: int, world_size: int, cfg: dict) -> dict:
    """Each case's outcome on this rank (its result or its error) and the all-reduce after it."""
    import torch.distributed as dist

    cases = {
        "sync, misplaced": lambda: str(check_in_sync([("w", _misplaced_on_rank_1(rank))])),
        "drift, misplaced": lambda: drift_report({"w": _misplaced_on_rank_1(rank)}),
        **{f"weights, misplaced, {fmt}": functools.partial(
            lambda fmt: LowPrecisionWeights(torch.optim.SGD([torch.nn.Parameter(_misplaced_on_rank_1(rank))],
                                                            lr=0.1), fmt) and "built", fmt)
           for fmt in ("binary8p4", "e2m1")},
        "weights, added group misplaced": functools.partial(_added_misplaced, rank),
        "weights, scale=True on rank 0": lambda: _stepped(scale=rank == 0),
        "weights, nvfp4 and mxfp8": lambda: _stepped(fmt=("nvfp4", "mxfp8_e4m3")[rank]),
        "weights, seeds differ": lambda: _stepped(seed=rank),
        "weights, alike": lambda: _stepped(seed=5, scale=True),
        # (written with bits=2; its torch optimizer's state_dict, no LowPrecisionWeights')
        "weights, loaded unlike on rank 1": functools.partial(
            _loaded_on_rank_1, rank, lambda state: {**state, "config": {**state["config"], "bits": 2}}),
        "weights, loaded no state_dict on rank 1": functools.partial(
            _loaded_on_rank_1, rank, lambda state: state["optimizer"]),
        "weights, configure alike": lambda: _nvfp4_weights(True),
        "weights, configure unlike": lambda: _nvfp4_weights(rank == 0),
    }  # fmt: skip
    out = {}
    for name, call in cases.items():
        outcome = _outcome(call)
        paired = torch.tensor([rank + 1.0])
        dist.all_reduce(paired)
        out[name] = [outcome, float(paired)]
    return out


@pytest.fixture(scope="module")
def rank_error_runs() -> list[dict]:
    with pytest.MonkeyPatch.context() as patch:  # the ranks import this file (see runs)
        patch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.getenv("PYTHONPATH", "")]))
        (ranks,) = launch([{}], 2, timeout=120, train=rank_errors)  # (a hang fails, it does not wait)
    return ranks


def _alike(runs: list[dict], case: str) -> tuple[str, str]:
    """The two ranks' outcomes of ``case``, once the all-reduce after it paired up."""
    assert [r[case][1] for r in runs] == [3.0, 3.0], [r[case] for r in runs]
    return runs[0][case][0], runs[1][case][0]


@pytest.mark.parametrize("case", ["sync, misplaced", "drift, misplaced"])
def test_sync_checks_refuse_a_misplaced_piece_on_every_rank(rank_error_runs, case):
    """The misplaced rank raised before the gathers, and the other waited in them (gloo's
    timeout, or the next collective taken for theirs)."""
    first, second = _alike(rank_error_runs, case)
    assert first.startswith("ValueError: another rank holds a DTensor piece not where its placements"), first
    assert second.startswith("RuntimeError: w: a DTensor of shape (7, 32)"), second


@pytest.mark.parametrize("case", ["weights, misplaced, binary8p4", "weights, misplaced, e2m1",
                                  "weights, added group misplaced"])  # fmt: skip
def test_weights_refuse_a_misplaced_piece_on_every_rank(rank_error_runs, case):
    """LowPrecisionWeights placed each piece (``layout``) on its own rank: the misplaced one
    raised alone, and rank 0 went on (with e2m1, into an all-reduce that took rank 1's next)."""
    first, second = _alike(rank_error_runs, case)
    assert first.startswith("ValueError: another rank's piece of a selected weight"), first
    assert "not where its placements say" in first, first
    assert second.startswith("RuntimeError: ") and "a DTensor of shape (7, 32)" in second, second


@pytest.mark.parametrize("case", ["weights, scale=True on rank 0", "weights, nvfp4 and mxfp8",
                                  "weights, seeds differ"])  # fmt: skip
def test_weights_set_up_unlike_on_the_ranks_of_a_mesh_are_refused_on_every_rank(rank_error_runs, case):
    """Each rank rounded its piece as its own set-up said: another seed gave full weights of
    no one set-up, silently; scale=True's and NVFP4's all-reduces on rank 0 alone took the
    next all-reduce of rank 1 (it read a largest magnitude into its sum)."""
    for outcome in _alike(rank_error_runs, case):
        assert outcome.startswith("ValueError: LowPrecisionWeights: ranks holding pieces of the same weights "
                                  "were given different set-ups"), outcome  # fmt: skip


def test_weights_set_up_alike_step(rank_error_runs):
    assert _alike(rank_error_runs, "weights, alike") == ("stepped", "stepped")


def test_weights_under_configure_settings_unlike_on_the_ranks_equal_alike(rank_error_runs):
    """configure() chooses kernels, which give the same bits and run the same collectives:
    not part of the set-up the ranks agree on."""
    alike = _alike(rank_error_runs, "weights, configure alike")
    assert isinstance(alike[0], list) and alike[0] == alike[1]
    assert _alike(rank_error_runs, "weights, configure unlike") == alike


def test_a_checkpoint_unlike_on_one_rank_is_refused_on_every_rank(rank_error_runs):
    """Rank 1 refused its checkpoint alone and kept its step count; rank 0 resumed at the
    checkpoint's (another step's keys) and went on to its next collective."""
    first, second = _alike(rank_error_runs, "weights, loaded unlike on rank 1")
    assert first[0].startswith("ValueError: another rank's checkpoint was written with another set-up"), first
    assert second[0].startswith("ValueError: checkpoint was written with bits 2 (here 3)"), second
    assert first[1] == second[1] == 1  # (nothing loaded: the count of the step after the state_dict)


def test_no_checkpoint_on_one_rank_is_refused_on_every_rank(rank_error_runs):
    """Rank 1 refused a state that is no LowPrecisionWeights.state_dict() before the all-reduce
    that pairs the refusal, where rank 0 waited for it (and took the next collective for it)."""
    first, second = _alike(rank_error_runs, "weights, loaded no state_dict on rank 1")
    assert first[0].startswith("ValueError: another rank's checkpoint was written with another set-up"), first
    assert second[0].startswith("ValueError: not a LowPrecisionWeights.state_dict()"), second
    assert first[1] == second[1] == 1
