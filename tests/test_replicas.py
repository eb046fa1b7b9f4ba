"""Replicas: seed policies, the sync verifier, real multi-process gloo training runs, and
`fewbit replicas` stopped by signals."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fewbit.experiments.processes import Stopped, stopping_on_signals
from fewbit.experiments.replicas import ReplicaRun, _train, launch
from fewbit.random import Key, fold_in
from fewbit.replicas import (
    ReplicaContext,
    SeedPolicy,
    _digest,
    _distance,
    _ordered,
    check_in_sync,
    drift_report,
    rank_order_mean_hook,
    replica_key,
)
from test_sweep import ENV, session

KEY = Key.from_seed(1)


def test_policies_fold_in_the_rank_only_when_differing():
    assert replica_key(KEY, "identical", rank=3) == KEY
    differing = {replica_key(KEY, SeedPolicy.DIFFERING, rank=r) for r in range(4)}
    assert len(differing) == 4 and KEY not in differing
    ctx = ReplicaContext(seed=1, step=7, rank=2, world_size=4)
    assert ctx.key("identical", 5) == fold_in(KEY, 7, 5)
    assert ctx.key("differing", 5) == replica_key(fold_in(KEY, 7, 5), "differing", rank=2)
    assert ctx.key("differing", 5) != ReplicaContext(1, 7, 3, 4).key("differing", 5)
    with pytest.raises(ValueError):
        replica_key(KEY, "same")


def test_digest_compares_bits_not_values():
    zero, nz = torch.tensor([0.0]), torch.tensor([-0.0])
    assert zero == nz and _digest(zero) != _digest(nz)
    nan_a = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    nan_b = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert _digest(nan_a) != _digest(nan_b) and _digest(nan_a) == _digest(nan_a.clone())
    assert _digest(torch.zeros(2, 3)) != _digest(torch.zeros(3, 2))


def test_single_process_is_trivially_in_sync():
    model = torch.nn.Linear(3, 2)
    result = check_in_sync(model)
    assert result and result.first is None and result.names == ["weight", "bias"]
    assert drift_report(model) == {"weight": 0, "bias": 0}


def test_a_group_that_is_not_a_process_group_is_refused_by_name():
    """A DeviceMesh (a likely mistake) failed in torch's lookup of its name."""
    from torch.distributed.device_mesh import DeviceMesh

    for check in (check_in_sync, drift_report):
        said = r"group must be a torch.distributed.ProcessGroup \(a DeviceMesh's: .*\), not DeviceMesh"
        with pytest.raises(TypeError, match=said):
            check(torch.nn.Linear(3, 2), DeviceMesh.__new__(DeviceMesh))


# ---------------------------------------------------------------------------------
# Real torch.distributed processes (gloo on CPU). Process start-up dominates, so each
# world size starts its processes once and runs all of its scenarios on them.

#: 1 + 3/128 rounds up with probability 1/4 (SRC, N = 3): ranks disagree with p = 3/8.
DISAGREE, N_SR = 3 / 8, 4096
STEPS = 200

BROKEN = {
    "differing-update": ReplicaRun(steps=10, policy="differing-update"),
    "randint+extra draw": ReplicaRun(steps=10, update_rng="randint", extra_draw_rank=1),
    "randint": ReplicaRun(steps=10, update_rng="randint"),
    "fewbit+extra draw": ReplicaRun(steps=10, extra_draw_rank=1),
    "skip all-reduce": ReplicaRun(steps=3, skip_allreduce="2.weight"),
    "skip all-reduce, guarded": ReplicaRun(steps=3, skip_allreduce="2.weight", guard=True),
    "gradient dropped on one rank, guarded": ReplicaRun(steps=3, drop_grad="2.weight", guard=True),
}


#: The gradient rank r's bucket holds (r + 1) times, in the DDP hook's probe.
HOOK_GRAD = [1.0, -2.0, 0.5, 3.0]


@dataclass(frozen=True)
class HookProbe:
    """Call rank_order_mean_hook on a bucket of (rank + 1) * HOOK_GRAD, outside DDP."""


class _Bucket:  # what the hook reads of DDP's GradBucket
    def __init__(self, grads: torch.Tensor):
        self.grads = grads

    def buffer(self) -> torch.Tensor:
        return self.grads


def probe_or_train(rank: int, world_size: int, cfg) -> dict:
    """The DDP run of a ReplicaRun, or the hook's probe (the ranks import this file: see ``runs``)."""
    if not isinstance(cfg, HookProbe):
        return _train(rank, world_size, cfg)
    out = rank_order_mean_hook(None, _Bucket((rank + 1) * torch.tensor(HOOK_GRAD))).wait()
    return {"mean": out.tolist(), "context": ReplicaContext.from_distributed(5, 9)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict[str, list[dict]]]:
    """Scenario name -> per-rank results, for each world size."""
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    plans = {
        2: {"default": ReplicaRun(steps=STEPS), "start": ReplicaRun(steps=0), **BROKEN, "hook": HookProbe()},
        3: {
            "default": ReplicaRun(steps=STEPS),
            "whole": ReplicaRun(steps=30, save_at=15, checkpoint_dir=ckpt),
            "resumed": ReplicaRun(steps=30, checkpoint_dir=ckpt, resume=True),
            "hook": HookProbe(),
        },
        4: {"default": ReplicaRun(steps=STEPS), "hook": HookProbe()},
    }
    with pytest.MonkeyPatch.context() as patch:  # the ranks unpickle probe_or_train from this file
        patch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.getenv("PYTHONPATH", "")]))
        return {n: dict(zip(plan, launch(list(plan.values()), n, train=probe_or_train), strict=True))
                for n, plan in plans.items()}  # fmt: skip


def bits(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(-1).view(torch.uint8)


def assert_all_ranks_equal(results: list[dict]) -> None:
    for r in results[1:]:
        for name, w in r["weights"].items():
            assert torch.equal(bits(w), bits(results[0]["weights"][name])), name


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_default_policy_keeps_replicas_in_sync(runs, nproc):
    results = runs[nproc]["default"]
    assert len(results) == nproc
    assert all(e["in_sync"] for r in results for e in r["log"])
    assert len(results[0]["log"]) == STEPS
    assert_all_ranks_equal(results)
    # Different data per rank really did reach the weights: they moved from the start.
    start = runs[2]["start"][0]["weights"]
    assert not torch.equal(start["0.weight"], results[0]["weights"]["0.weight"])
    # Forward SR is independent across ranks: disagreement at the rate the probabilities give.
    se = math.sqrt(DISAGREE * (1 - DISAGREE) / N_SR)
    assert results[0]["disagreement"] == 0.0
    for r in results[1:]:
        assert abs(r["disagreement"] - DISAGREE) < 5 * se


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_replica_context_from_distributed_takes_each_ranks_place(runs, nproc):
    contexts = [r["context"] for r in runs[nproc]["hook"]]
    assert contexts == [ReplicaContext(5, 9, rank, nproc) for rank in range(nproc)]
    assert ReplicaContext.from_distributed(5, 9) == ReplicaContext(5, 9, 0, 1)  # no process group here


@pytest.mark.parametrize(("group", "error", "match"), [
    (torch.distributed.GroupMember.NON_GROUP_MEMBER, ValueError, "does not hold this rank"),
    ([0, 1], TypeError, "must be a torch.distributed.ProcessGroup"),
], ids=["not holding the rank", "ranks, not a group"])  # fmt: skip
def test_replica_context_from_distributed_refuses_a_group_without_this_rank(group, error, match):
    """A group without this rank made a context of rank -1 and world size -1, whose
    DIFFERING keys then failed with "fold_in value must be in [0, 2**64), got -1" (and
    IDENTICAL ones went on); it is refused as FakeQuantize's replica_group is."""
    with pytest.raises(error, match=match):
        ReplicaContext.from_distributed(5, 9, group=group)


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_rank_order_mean_hook_gives_every_rank_the_mean_of_the_gradients(runs, nproc):
    """Rank r's bucket holds (r + 1) g: the hook's result is the mean, (n + 1)/2 g, on every
    rank, exactly (these sums and halvings are exact). A hook returning the sum passed every
    test: the runs only compare ranks with each other, and AdamW hardly sees the scale."""
    want = [(nproc + 1) / 2 * v for v in HOOK_GRAD]
    assert [r["mean"] for r in runs[nproc]["hook"]] == [want] * nproc


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rank_order_mean_hook_adds_16_bit_gradients_without_overflow(monkeypatch, dtype):
    """Two ranks' float16 gradients of 40960 added in float16 before the division read inf,
    where their mean (and torch's own hook, which divides first) is 40960 (amp hunt): 16-bit
    gradients now add in float32. (all_gather stood in for: no ranks are spawned.)"""
    import torch.distributed as dist

    ranks = [torch.tensor([40960.0, 1.0, -3.0], dtype=dtype), torch.tensor([40960.0, 2.0, 5.0], dtype=dtype)]

    def all_gather(parts, grads, group=None, async_op=False):
        for part, theirs in zip(parts, ranks, strict=True):
            part.copy_(theirs)
        done = torch.futures.Future()
        done.set_result(parts)
        return type("Work", (), {"get_future": lambda self: done})()

    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(dist, "get_world_size", lambda group: 2)
    mean = rank_order_mean_hook(object(), _Bucket(ranks[0].clone())).wait()
    assert mean.dtype == dtype and mean.tolist() == [40960.0, 1.5, 1.0]


def test_update_keyed_with_the_rank_drifts_and_is_named(runs):
    log = runs[2]["differing-update"][0]["log"]
    assert not any(e["in_sync"] for e in log)
    assert log[0]["first"] == "0.weight"
    assert all(e["max_ulps"] >= 1 for e in log)


def test_extra_draw_on_one_rank_breaks_stateful_sr_but_not_fewbit_keys(runs):
    stateful = runs[2]["randint+extra draw"][0]["log"]
    assert not stateful[-1]["in_sync"] and stateful[-1]["first"] == "0.weight"
    assert all(e["in_sync"] for e in runs[2]["randint"][0]["log"])  # without the draw: in sync
    assert all(e["in_sync"] for e in runs[2]["fewbit+extra draw"][0]["log"])
    assert_all_ranks_equal(runs[2]["fewbit+extra draw"])


def test_gradient_left_out_of_the_all_reduce_is_named(runs):
    assert runs[2]["skip all-reduce"][0]["log"][0]["first"] == "2.weight"
    for r in runs[2]["skip all-reduce, guarded"]:
        assert "2.weight.grad differs across ranks" in r["error"]


def test_a_gradient_missing_on_one_rank_is_named_on_every_rank(runs):
    """The guard's check gathers as many digests from every rank: a rank holding fewer
    tensors (a gradient left None) is named alike on every rank, not a gloo abort."""
    for r in runs[2]["gradient dropped on one rank, guarded"]:
        assert "beside rank 0, rank 1 lacks 2.weight.grad" in r["error"], r


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_drift_of_float8_counts_its_ulps(dtype):
    """Its bits order its values as a wider float's do (it was a bare KeyError)."""
    values = torch.tensor([2.0, -2.0]).to(dtype)
    assert drift_report({"w": values}) == {"w": 0}
    assert _distance(_ordered(values, None), _ordered(torch.tensor([-2.0, 2.0]).to(dtype), None)) == 2**7
    one_up = values.view(torch.uint8).add(1).view(dtype)  # 2 and -2 a step further from 0
    assert _distance(_ordered(values, None), _ordered(one_up, None)) == 1


def test_drift_of_a_dtype_without_ulps_asks_for_fmt():
    with pytest.raises(ValueError, match="give fmt"):
        drift_report({"w": torch.ones(2, dtype=torch.float8_e8m0fnu)})


@pytest.mark.parametrize(("dtype", "apart"), [(torch.float64, 2**63 - 1), (torch.float32, 2**31),
                                               (torch.bfloat16, 2**15), (torch.float16, 2**15)])  # fmt: skip
def test_drift_of_opposite_signs_does_not_wrap(dtype, apart):
    """2 and -2 lie 2 * 2^(bits - 2) positions apart in their dtype: float64's 2^63 is
    beyond int64 and saturates (it wrapped to -2^63, whose abs is itself, and read 0)."""
    two = torch.tensor([2.0], dtype=dtype)
    assert _distance(_ordered(two, None), _ordered(-two, None)) == apart
    assert _distance(_ordered(two, None), _ordered(two.nextafter(torch.tensor(3.0, dtype=dtype)), None)) == 1


def test_resume_on_all_ranks_equals_the_uninterrupted_run(runs):
    whole, resumed = runs[3]["whole"], runs[3]["resumed"]
    assert [e["step"] for e in resumed[0]["log"]] == list(range(16, 31))
    assert all(e["in_sync"] for e in resumed[0]["log"])
    for a, b in zip(whole, resumed, strict=True):
        for name, w in a["weights"].items():
            assert torch.equal(bits(w), bits(b["weights"][name])), name


# ---------------------------------------------------------------------------------
# `fewbit replicas` stopped mid-run: a Ctrl-C signals the terminal's whole foreground
# process group, `kill` the command alone. Either way every rank ends, none prints a
# traceback, and the command says in one line what happened.


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _replicas_then(tmp_path, act) -> tuple[subprocess.Popen, list[int], str, str]:
    """Start `fewbit replicas` on 2 ranks, call ``act(proc, rank_pids)`` once a rank has
    started torch.distributed, and return the process, its ranks' pids, stdout, stderr."""
    # The ranks' temporary folder, with their rendezvous file, lands in tmp_path.
    env = {**ENV, "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "fewbit.cli", "replicas", "--nproc", "2", "--steps", "1000000"]
    # A session of its own: its pid is its process group's id, as a shell's job has.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("*/rendezvous")):  # a rank has started torch.distributed
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no rank started within 120 s"
            time.sleep(0.05)
        ranks = [pid for pid in session(proc.pid) if pid != proc.pid]
        assert len(ranks) == 2
        act(proc, ranks)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert not [pid for pid in ranks if alive(pid)]
    assert session(proc.pid) == {}
    return proc, ranks, out, err


@pytest.mark.parametrize("sig, to_group", [(signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["ctrl-c", "kill"])  # fmt: skip
def test_replicas_command_stopped_by_a_signal_ends_every_rank_quietly(tmp_path, sig, to_group):
    def stop(proc, ranks):
        if to_group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)

    proc, ranks, out, err = _replicas_then(tmp_path, stop)
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in out + err
    assert out == ""
    assert err.splitlines() == [
        f"fewbit: stopped by {sig.name}: the 2 replica processes have ended and nothing was saved "
        "(the command keeps no checkpoints); run the same command to start again"
    ]


def test_a_rank_that_dies_stops_the_others_and_is_named_in_one_line(tmp_path):
    """A rank killed (out of memory, say) left the others waiting for it in a collective
    until gloo's 30-minute timeout, or crashing with gloo's traceback, and the command
    printed its own traceback. Now the others are stopped and one line names the rank."""
    proc, ranks, out, err = _replicas_then(tmp_path, lambda proc, ranks: os.kill(ranks[1], signal.SIGKILL))
    assert proc.returncode == 1, err
    # (The other rank may have logged gloo's view of the lost peer before it was stopped.)
    assert "Traceback" not in err
    assert re.fullmatch(r"fewbit: error: replica rank [01] killed by SIGKILL \(out of memory\?\); the other "
                        r"ranks were stopped", err.splitlines()[-1]), err  # fmt: skip


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_work_in_the_parent_stops_on_a_signal_as_the_ranks_do(sig):
    """`fewbit replicas --fsdp` runs its one-process comparison in the parent, after the
    ranks: SIGTERM there killed it without a word, and SIGINT gave the generic
    interrupted line, where the README promises the replicas' stopped line."""
    before = signal.getsignal(sig)
    with pytest.raises(Stopped) as stop, stopping_on_signals():
        os.kill(os.getpid(), sig)
        time.sleep(5)  # (interrupted by the handler at once)
    assert stop.value.signum == sig
    assert signal.getsignal(sig) is before
