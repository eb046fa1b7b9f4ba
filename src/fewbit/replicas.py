"""Stochastic rounding under data-parallel replication (seed 000's two RNG streams).

Forward and backward roundings should differ per replica, so that their noise averages
out over the data-parallel batch: ``SeedPolicy.DIFFERING`` folds the replica's rank into
the key. The weight update must round identically everywhere, or replicas drift apart
silently: ``SeedPolicy.IDENTICAL`` leaves the rank out. fewbit's keys are stateless, so
IDENTICAL rounding stays identical as long as its *inputs* are (seed 000's invariant);
:func:`check_in_sync`, the guard of ``LowPrecisionWeights(guard=True)`` and
:func:`drift_report` check that on real ranks.

Sharded tensors (DTensors: FSDP2, HSDP) are compared where they must be equal: between
the ranks that hold the same piece (the replicas of HSDP's replicate mesh dimension).
Under pure sharding no two ranks do; the checks say so instead of passing.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from .formats import FloatFormat, format
from .random import Key, as_key, fold_in
from .sharding import is_dtensor, local_tensor, piece_key

__all__ = [
    "DEFAULT_POLICY", "ReplicaContext", "ReplicaDriftError", "SeedPolicy", "SyncResult",
    "check_in_sync", "drift_report", "rank_order_mean_hook", "replica_key", "world",
]  # fmt: skip

#: Folded in before the rank, so a DIFFERING key never equals any IDENTICAL one.
_RANK_STREAM = 0x7E91_1CA5


class SeedPolicy(enum.StrEnum):
    """Whether a rounding's key holds the replica's rank (seed 000's two RNG streams)."""

    DIFFERING = "differing"  #: rounding differs per replica (forward, backward, accumulation)
    IDENTICAL = "identical"  #: rounding the same on every replica (the weight update)


#: Seed 000's assignment of a policy to each kind of rounding.
DEFAULT_POLICY = {
    "forward": SeedPolicy.DIFFERING,
    "backward": SeedPolicy.DIFFERING,
    "accumulation": SeedPolicy.DIFFERING,
    "update": SeedPolicy.IDENTICAL,
}


def world(group: torch.distributed.ProcessGroup | None = None) -> tuple[int, int]:
    """(rank, world size) in ``group`` under torch.distributed, else (0, 1)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def replica_key(key: Key | int | torch.Tensor, policy: SeedPolicy | str,
                rank: int | None = None) -> Key | torch.Tensor:
    """``key`` for IDENTICAL; ``key`` with the rank folded in for DIFFERING (rank None:
    this process's rank under torch.distributed, 0 without it). A key tensor gives a
    key tensor (see ``fewbit.random.fold_in``)."""
    if SeedPolicy(policy) is SeedPolicy.IDENTICAL:
        return key if isinstance(key, torch.Tensor) else as_key(key)
    return fold_in(key, _RANK_STREAM, world()[0] if rank is None else rank)


@dataclass(frozen=True)
class ReplicaContext:
    """What an SR call needs to pick its key under replication: seed, step, rank, world size.

    ``ctx.key(policy, *stream)`` is ``fold_in(seed, step, *stream)``, with the rank folded
    in for DIFFERING; pass it as ``seed=`` to ``fewbit.round``.
    """

    seed: int | Key = 0
    step: int = 0
    rank: int = 0
    world_size: int = 1

    @classmethod
    def from_distributed(cls, seed: int | Key = 0, step: int = 0,
                         group: torch.distributed.ProcessGroup | None = None) -> ReplicaContext:
        """The context of this process: its rank and world size in ``group`` under
        torch.distributed (0 and 1 without it). A group that does not hold this rank, or
        is no process group, is refused: torch gives the ranks outside a group the rank
        -1, which DIFFERING's keys then failed to fold in, naming neither the group nor why."""
        check_group(group)
        rank, size = world(group)
        return cls(seed, step, rank, size)

    def key(self, policy: SeedPolicy | str, *stream: int) -> Key:
        """``fold_in(seed, step, *stream)``, the rank folded in for DIFFERING."""
        return replica_key(fold_in(self.seed, self.step, *stream), policy, self.rank)


class ReplicaDriftError(RuntimeError):
    """Replicas hold different values where they must agree."""


def check_group(group, what: str = "group") -> None:
    """Refuse a process group the comparisons could not use, before any collective: one
    that does not hold this rank (torch's ``new_group`` gives the ranks outside it an int,
    ``get_rank`` -1 for a group of others), which would compare the rank with no one, or
    anything not a ProcessGroup (a DeviceMesh)."""
    if group is None:
        return
    import torch.distributed as dist

    if (isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER) or (
            isinstance(group, dist.ProcessGroup) and world(group)[0] < 0):  # fmt: skip
        raise ValueError(f"{what} does not hold this rank: give each rank the group of the ranks that hold "
                         "copies of its tensors")  # fmt: skip
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{what} must be a torch.distributed.ProcessGroup (a DeviceMesh's: "
                        f"mesh.get_group()), not {type(group).__name__}")  # fmt: skip


def _named_tensors(obj) -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.nn.Module):
        return [(n, t) for n, t in obj.state_dict(keep_vars=True).items()]
    if isinstance(obj, torch.Tensor):
        return [("tensor", obj)]
    items = list(obj.items()) if isinstance(obj, dict) else list(obj)
    return [item if isinstance(item, tuple) else (f"tensor {i}", item) for i, item in enumerate(items)]


def _digest(t: torch.Tensor) -> int:
    """A 63-bit hash of the raw bits (so -0 differs from 0 and NaN payloads count), the
    dtype and the shape; of this rank's piece of a DTensor."""
    t = local_tensor(t)
    h = hashlib.blake2b(_raw(t), digest_size=8)
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    return int.from_bytes(h.digest(), "little") >> 1


def _raw(t: torch.Tensor) -> bytes:
    # A wrapper subclass (a ScaledTensor: data and scale) by the tensors it holds, which
    # torch's __tensor_flatten__ protocol names, and its other attributes.
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, context = t.__tensor_flatten__()
        return b"".join(_raw(getattr(t, n)) for n in names) + repr(context).encode()
    # Of a copy: a numpy array made from a weight's own storage would leave it unresizable
    # for good (store_codes frees a weight's storage between steps).
    return t.detach().reshape(-1).view(torch.uint8).to("cpu", copy=True).numpy().tobytes()


@dataclass
class SyncResult:
    """Falsy when some tensor differs across ranks (``first`` names the first one), or
    when nothing could be compared. ``unchecked`` names the tensors that no two ranks
    hold alike (pieces of a pure shard): nothing says whether those agree."""

    names: list[str]
    differing: list[str]
    world_size: int
    unchecked: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return not self.differing and not (self.unchecked and len(self.unchecked) == len(self.names))

    @property
    def first(self) -> str | None:
        """The first tensor that differs, None when none does."""
        return self.differing[0] if self.differing else None

    def __str__(self) -> str:
        if self.differing:
            n, first = len(self.differing), self.first
            return f"OUT OF SYNC: {n} of {len(self.names)} tensors differ, first {first}"
        if not self:
            return (f"NOTHING COMPARED: all {len(self.names)} tensors are sharded and no two of the "
                    f"{self.world_size} ranks hold the same piece")  # fmt: skip
        compared = len(self.names) - len(self.unchecked)
        skipped = f" ({len(self.unchecked)} sharded tensors not compared: no replicas)"
        skipped = skipped if self.unchecked else ""
        return f"in sync: {compared} tensors on {self.world_size} ranks{skipped}"


def check_in_sync(tensors: torch.nn.Module | Iterable | torch.Tensor,
                  group: torch.distributed.ProcessGroup | None = None) -> SyncResult:
    """Compare a digest of every tensor's bits across the ranks of ``group`` (a collective:
    every rank must call it). A module contributes its state_dict (parameters, buffers).
    A DTensor is compared between the ranks that hold the same piece of it. A tensor None
    (a gradient not computed) must be None on every rank."""
    check_group(group)
    named = _named_tensors(tensors)
    names = [n for n, _ in named]
    rank, size = world(group)
    # Which ranks must agree: equal keys (an empty piece, None, gets a key of its own).
    keys, misplaced = _piece_keys(named)
    keys = [-1 - rank if k is None else k for k in keys]
    if size > 1:
        _check_same_names([f"{n} (None)" if t is None else n for n, t in named], group, size, misplaced)
    elif misplaced is not None:
        raise misplaced
    # One all_gather of integers: each tensor's digest, then its key.
    mine = torch.tensor([0 if t is None else _digest(t) for _, t in named] + keys, dtype=torch.int64)
    everyone = [mine]
    if size > 1:
        everyone = [torch.empty_like(mine) for _ in range(size)]
        torch.distributed.all_gather(everyone, mine, group=group)
    table = torch.stack(everyone).tolist()
    differing, unchecked = [], []
    for i, name in enumerate(names):
        holders: dict[int, list[int]] = {}  # piece key -> the digests of the ranks holding it
        for row in table:
            holders.setdefault(row[len(names) + i], []).append(row[i])
        if any(len(set(digests)) > 1 for digests in holders.values()):
            differing.append(name)
        elif size > 1 and all(len(digests) < 2 for digests in holders.values()):
            unchecked.append(name)
    return SyncResult(names, differing, size, unchecked)


def _piece_keys(named: list[tuple[str, torch.Tensor]]) -> tuple[list[int | None], Exception | None]:
    """Each tensor's :func:`~fewbit.sharding.piece_key` (0 for None), and this rank's error
    where a DTensor's piece is not where its placements say (``layout``'s RuntimeError):
    only its rank sees it, so it is raised after the ranks have agreed (:func:`_check_same_names`)."""
    keys: list[int | None] = []
    for name, t in named:
        try:
            keys.append(piece_key(t))
        except RuntimeError as err:
            return keys, RuntimeError(f"{name}: {err}")
    return keys, None


def _check_same_names(names: list[str], group, size: int, misplaced: Exception | None = None) -> None:
    """Raise ReplicaDriftError on every rank unless every rank holds the same names in the
    same order (each with what else must agree for the gathers that follow: "w (None)").
    The gathers need as many, as large, on every rank: first an all_gather of three integers
    (the names' hash and count, and whether this rank holds a piece not where placed:
    ``misplaced``, raised on its rank, a ValueError on the others, where before they waited
    for it in the gathers), then, only where they differ, the names."""
    mine = torch.tensor([_digest(torch.tensor(list("|".join(names).encode()))), len(names),
                         misplaced is not None])  # fmt: skip
    everyone = [torch.empty_like(mine) for _ in range(size)]
    torch.distributed.all_gather(everyone, mine, group=group)
    if misplaced is not None:
        raise misplaced
    if any(e[2] for e in everyone):
        raise ValueError("another rank holds a DTensor piece not where its placements say (see its error): "
                         "nothing was compared")  # fmt: skip
    if all(torch.equal(e, mine) for e in everyone):
        return
    lists: list = [None] * size
    torch.distributed.all_gather_object(lists, names, group=group)
    differences = []
    for r, other in enumerate(lists[1:], 1):
        lacks = ", ".join(n for n in lists[0] if n not in other)
        extra = ", ".join(n for n in other if n not in lists[0])
        said = [f"lacks {lacks}"] * bool(lacks) + [f"also holds {extra}"] * bool(extra)
        if said:
            differences.append(f"rank {r} {' and '.join(said)}")
    if not differences:
        raise ReplicaDriftError("ranks hold the same tensors in different orders")
    raise ReplicaDriftError(f"ranks hold different sets of tensors: beside rank 0, {'; '.join(differences)} "
                            "(where ranks hold other weights by design, as pipeline stages do, compare "
                            "each set's holders alone: a process group of them)")  # fmt: skip


#: The signed integer dtype of each float dtype's width whose sign-magnitude bits _ordered
#: makes monotone (not the unsigned float8_e8m0fnu, nor the fnuz ones, whose NaN is -0's bits).
_SAME_WIDTH = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
               torch.float16: torch.int16, torch.float8_e4m3fn: torch.int8, torch.float8_e5m2: torch.int8}


def _ordered(t: torch.Tensor, table: torch.Tensor | None) -> torch.Tensor:
    """Each value's position in value order, so that adjacent values differ by 1: in the
    tensor's own dtype (its bits, sign-magnitude made monotone), or in ``table``, the
    sorted values of a format between -inf and inf (NaN comes after inf, as in a dtype)."""
    if table is not None:
        return torch.searchsorted(table.to(t.device), t.detach().double().contiguous())
    ints = _SAME_WIDTH.get(t.dtype)
    if ints is None:  # (the same dtype on every rank: all raise, before any gather)
        raise ValueError(f"drift_report: {t.dtype} has no ulps fewbit counts by its bits; give fmt, the "
                         "format its values belong to")  # fmt: skip
    i = t.detach().contiguous().view(ints).to(torch.int64)
    sign_bit = 1 << (8 * t.element_size() - 1)
    return torch.where(i < 0, -(i + sign_bit), i)


def drift_report(
    tensors: torch.nn.Module | Iterable | torch.Tensor, group: torch.distributed.ProcessGroup | None = None,
    fmt: FloatFormat | str | None = None,
) -> dict[str, int]:
    """For each floating tensor, the largest distance in ulps between any rank's value and
    rank 0's (0 everywhere when in sync): ulps of the tensor's dtype, or of ``fmt`` (a
    format of up to 16 bits the values belong to, e.g. the weights' format, where -inf
    and inf lie a step beyond -max and max, and NaN one beyond inf). A DTensor is measured
    between the ranks that hold the same piece (from the first of them), and left out where
    no two do. A collective: every rank must call it, with the same names, dtypes and
    shapes (else a ReplicaDriftError on every rank)."""
    check_group(group)
    table = None
    if fmt is not None:
        finite = {v for v in format(fmt).values() if math.isfinite(v)}
        table = torch.tensor([-math.inf, *sorted(finite), math.inf], dtype=torch.float64)
    _, size = world(group)
    named = _named_tensors(tensors)
    keys, misplaced = _piece_keys(named)  # (before any gather: see _check_same_names)
    if size > 1:  # the gathers below need as many tensors, as large, on every rank
        _check_same_names([f"{n} ({'None' if t is None else f'{t.dtype}, shape {tuple(t.shape)}'})"
                           for n, t in named], group, size, misplaced)  # fmt: skip
    elif misplaced is not None:
        raise misplaced
    report = {}
    for (name, t), key in zip(named, keys, strict=True):
        if t is None or not t.is_floating_point():
            continue
        if is_dtensor(t):
            distance = _piece_drift(t, key, table, group, size)
            if distance is not None:
                report[name] = distance
            continue
        here = _ordered(t, table)
        gathered = [here]
        if size > 1:
            gathered = [torch.empty_like(here) for _ in range(size)]
            torch.distributed.all_gather(gathered, here, group=group)
        report[name] = max(_distance(g, gathered[0]) for g in gathered)
    return report


def _distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest ``|a - b|`` of positions from :func:`_ordered` (0 for no elements),
    without int64's wrap-around: float64's positions of opposite signs lie up to 2^64
    apart, which saturates at 2^63 - 1."""
    if not a.numel():
        return 0
    top = torch.iinfo(torch.int64).max
    same_sign = (a >= 0) == (b >= 0)  # (positions lie in [-top, top]: abs is exact)
    apart = torch.where(a.abs() > top - b.abs(), top, a.abs() + b.abs())
    return int(torch.where(same_sign, (a - b).abs(), apart).max())


def _piece_drift(t: torch.Tensor, key: int | None, table: torch.Tensor | None, group,
                 size: int) -> int | None:  # fmt: skip
    """:func:`drift_report` of one DTensor whose piece has ``key`` (``piece_key``): pieces
    differ in shape, so they travel as objects; None when no two ranks hold the same piece."""
    here = (key, _ordered(local_tensor(t), table).cpu())
    gathered = [here]
    if size > 1:
        gathered = [None] * size
        torch.distributed.all_gather_object(gathered, here, group=group)
    first: dict[int, torch.Tensor] = {}
    worst = None
    for key, values in gathered:
        if key is None:
            continue
        if key in first:
            worst = max(worst or 0, _distance(values, first[key]))
        else:
            first[key] = values
    return worst


def assert_identical_inputs(named: list[tuple[str, torch.Tensor]], group=None) -> None:
    """Seed 000's invariant before an IDENTICAL rounding: its inputs agree on every rank."""
    result = check_in_sync(named, group)
    if not result:
        raise ReplicaDriftError(
            f"{result.first} differs across ranks before the identical-seed weight update "
            f"(all differing: {', '.join(result.differing)}); was its gradient all-reduced? (Ranks whose "
            "weights differ by design, as pipeline stages' do, are compared within a guard_group.)"
        )


def rank_order_mean_hook(process_group, bucket):  # no annotation: DDP checks it, and ours are strings
    """A DDP communication hook (``ddp.register_comm_hook(None, rank_order_mean_hook)``):
    the mean of the ranks' gradients, each element summed in rank order. Its state is the
    process group (None: the world), so a DDP on a sub-group registers it with that group.

    With more than two ranks a sum's rounding depends on its order, and a ring
    all-reduce orders each element by where it falls in the bucket. DDP lays its buckets
    out again after its first iteration, and a run resumed from a checkpoint starts on a
    first iteration, so with the default hook a resumed run can differ from the
    uninterrupted one in the last bit. Gathering the buckets and adding them in rank order
    makes every element's sum independent of the layout, for the price of an all-gather.
    """
    import torch.distributed as dist  # only for runs that use torch.distributed

    group = process_group if process_group is not None else dist.group.WORLD
    size = dist.get_world_size(group)
    grads = bucket.buffer()
    parts = [torch.empty_like(grads) for _ in range(size)]
    gathered = dist.all_gather(parts, grads, group=group, async_op=True).get_future()

    # 16-bit gradients add in float32: their sum overflowed float16 (two ranks' 40960 read
    # inf) where the mean, and torch's own hook, which divides first, hold it.
    wide = torch.promote_types(grads.dtype, torch.float32)

    def mean(_) -> torch.Tensor:
        total = parts[0].to(wide, copy=True)
        for part in parts[1:]:
            total += part
        return total.div_(size).to(grads.dtype)

    return gathered.then(mean)
