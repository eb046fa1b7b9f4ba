"""Straight-through fake quantisation of activations and gradients.

The forward pass rounds a tensor to one format and mode; the backward pass rounds the
incoming gradient to another (or passes it through unchanged, the straight-through
estimator). A format is an element format (``"e4m3"``, ``"binary8p4"``) or a block format
(``"mxfp8_e4m3"``, ``"nvfp4"``, ``"hbfp4"``; ``fewbit.block``), by name or object; where a
:class:`Quant` is taken, a format alone stands for ``Quant(fmt)`` (RNE, saturating). A
:class:`FakeQuantize` module counts its calls in a buffer, so each call draws fresh random
bits and a model restored from its ``state_dict`` draws the same bits as one that never
stopped; under activation checkpointing, :func:`checkpoint_context` makes the
recomputation draw the forward pass's bits.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from types import UnionType
from typing import get_args

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .block import BlockFormat, check_args, element_or_block, round_to
from .block.ops import check_axis
from .formats import FloatFormat
from .operators import (
    may_carry_tangent,
    operator,
    past_transforms,
    recording,
    refuse_compiled_forward_ad,
    transformed,
    vmapped,
)
from .random import Key, as_key, check_index, fold_in, is_dtensor, key_of
from .replicas import SeedPolicy, check_group, replica_key, world
from .rounding import RoundMode
from .rounding.checks import check_mode_args, scalar_args, symbolic_trace_refused
from .rounding.modes import parse_mode
from .rounding.ops import op_key
from .sharding import replica_rank

__all__ = ["FakeQuantize", "Quant", "checkpoint_context", "fake_quantize", "quantize_outputs"]

#: torch.fx.symbolic_trace's stand-in for a tensor (refused by name: it has no values).
_PROXY = torch.fx.Proxy

#: Streams of one call: forward and backward rounding draw from different keys.
_FORWARD, _BACKWARD = 0, 1


@dataclass(frozen=True)
class Quant:
    """One rounding: format, mode, N (stochastic modes), p (``sr_fraction``), saturation,
    and for a block format its block axis (None: the format's, the last).

    ``Quant("hbfp4", "src", bits=8)`` rounds to HBFP with 4-bit mantissas in blocks of 64
    along the last dimension, with the key the caller gives as ``seed=`` of
    ``fewbit.block.round``, as an element format's key goes to ``fewbit.round``.
    """

    fmt: FloatFormat | BlockFormat | str
    mode: RoundMode | str = "rne"
    bits: int | None = None
    fraction: float | None = None
    sat: bool = True
    axis: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "fmt", element_or_block(self.fmt))
        object.__setattr__(self, "mode", parse_mode(self.mode))
        # Refused here, as fewbit.round refuses them, not at the first forward pass (N for
        # classical SR, which depends on the dtype rounded from, is checked there).
        sat, bits, fraction = scalar_args(self.sat, self.bits, self.fraction)
        check_mode_args(self.mode, bits, fraction)
        for name, value in (("sat", sat), ("bits", bits), ("fraction", fraction)):
            object.__setattr__(self, name, value)
        if self.axis is not None:
            object.__setattr__(self, "axis", check_axis(self.axis))
            if not isinstance(self.fmt, BlockFormat):
                raise ValueError(f"axis is the block axis of a block format; {self.fmt.name} is an "
                                 "element format")  # fmt: skip

    def check_seed(self, key: Key | torch.Tensor | None) -> None:
        """Refuse a missing key for a stochastic mode."""
        if key is None and self.mode.is_stochastic:
            raise ValueError(f"mode {self.mode.value!r} needs a seed (an int, a Key or a key tensor)")

    def __call__(self, x: torch.Tensor, key: Key | torch.Tensor | None) -> torch.Tensor:
        """``x`` rounded; a DTensor by fewbit's ops' rules for DTensors, piece by piece, each
        element with the bits of its index in the full tensor (see :func:`fake_quantize`)."""
        self.check_seed(key)
        sr = {"bits": self.bits, "fraction": self.fraction, "seed": key} if self.mode.is_stochastic else {}
        return round_to(x, self.fmt, self.mode, axis=self.axis, sat=self.sat, **sr)


def _as_quant(q: Quant | FloatFormat | BlockFormat | str | None, what: str) -> Quant | None:
    """``q`` as a Quant (a format alone: ``Quant(fmt)``); None stays None."""
    if q is None or isinstance(q, Quant):
        return q
    if isinstance(q, (FloatFormat, BlockFormat, str)):
        return Quant(q)
    raise TypeError(f"{what} must be a fewbit.nn.Quant, a format or its name, or None; "
                    f"got {type(q).__name__}: {q!r}")  # fmt: skip


@lru_cache(maxsize=1024)  # (bounded: a schedule of sr_fraction's p makes a Quant a step)
def _check_gradient(q: Quant, dtype: torch.dtype, ndim: int) -> None:
    """Raise at the call what ``q`` would raise in the backward pass on x's gradient (x's
    dtype and dimensions: a block axis out of range, a dtype that cannot hold the format,
    N for SR), before the forward pass runs or a module counts the call."""
    try:
        check_args(dtype, q.fmt, q.mode, q.sat, q.bits, q.fraction, q.axis, ndim)
    except (TypeError, ValueError) as err:
        what = f"backward Quant({q.fmt.name!r}, {q.mode.value!r})"
        raise type(err)(f"{what}, for the gradient of x: {err}") from None


#: Whether this torch's autograd.Function ends in the C++ apply of torch._C._FunctionBase,
#: reached past Function.apply, and has the two functorch queries that Function.apply
#: makes before it (all private; where not, _StraightThrough.apply is Function.apply, and
#: tests/test_nn.py fails).
_UNWRAP = getattr(getattr(torch._functorch, "utils", None), "unwrap_dead_wrappers", None)
_DIRECT_APPLY = (issubclass(torch.autograd.Function, torch._C._FunctionBase) and _UNWRAP is not None
                 and hasattr(torch._C, "_are_functorch_transforms_active"))  # fmt: skip


class _StraightThrough(torch.autograd.Function):
    # forward and setup_context apart, and a vmap rule: torch.func's transforms take it.
    generate_vmap_rule = True

    @classmethod
    def apply(cls, *args):
        # Function.apply binds the arguments to forward's signature to fill in defaults
        # where setup_context is defined: inspect.signature, 20 us of fake_quantize's 37
        # on the 2-core VM. forward has no defaults and takes its arguments in order, so
        # outside functorch's transforms the C++ apply that Function.apply ends in is
        # called as it would call it.
        if _DIRECT_APPLY and not torch._C._are_functorch_transforms_active():
            return super(torch.autograd.Function, cls).apply(*_UNWRAP(args))
        return super().apply(*args)

    # type(q).__call__(q, ...) rather than q(...): Dynamo before torch 2.13 hashes a Quant it
    # is asked to call, and one made in the compiled code had no fields yet (an internal error).
    @staticmethod
    def forward(x, forward: Quant | None, backward: Quant | None, key: Key | torch.Tensor | None):
        if forward is None:
            return x.clone()
        return type(forward).__call__(forward, x, None if key is None else fold_in(key, _FORWARD))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, _, ctx.backward_quant, ctx.key = inputs

    @staticmethod
    def backward(ctx, grad):
        q, key = ctx.backward_quant, ctx.key
        if q is None:
            return grad, None, None, None
        out = type(q).__call__(q, grad.contiguous(), None if key is None else fold_in(key, _BACKWARD))
        return out, None, None, None


class _ForwardMode(_StraightThrough):
    """_StraightThrough with a forward-mode derivative: the tangent straight through,
    unrounded (the backward Quant rounds reverse mode's gradients). A class apart, taken
    only while a tangent may come: Dynamo refuses a Function that defines ``jvp``."""

    @staticmethod
    def jvp(ctx, tangent, *_):
        return tangent


def fake_quantize(
    x: torch.Tensor,
    forward: Quant | FloatFormat | BlockFormat | str | None = None,
    backward: Quant | FloatFormat | BlockFormat | str | None = None,
    seed: int | Key | torch.Tensor | None = None,
) -> torch.Tensor:
    """Round ``x`` with ``forward`` and its gradient with ``backward`` (None: unchanged; a
    format: ``Quant(fmt)``).

    Stochastic roundings need ``seed`` (an int, a Key, or a seed or key tensor as
    ``fewbit.round`` takes), refused here without one (not in the backward pass); the two
    directions draw from separate streams.

    DTensors (tensor parallelism): each rank rounds its own piece with the bits its
    elements have in the full tensor, forward and backward, so the full result is the one
    a single process gets for the full tensor with the same seed, whatever the placements
    (Shard along any dimension, Replicate: every rank holding a copy rounds it alike).
    A Partial tensor, forward or in the gradient, is a sum of the ranks' addends, and a
    rounding of the addends is not one of the sum: it is reduced first (an all-reduce,
    the one the model would run later anyway) and comes out Replicate. Otherwise the
    output and the gradient keep the placements they come with. A block format needs
    whole blocks on every rank (``fewbit.sharding.check_whole_blocks``); the seed must be
    the same on every rank of the mesh (:class:`FakeQuantize` sees to it).
    """
    if torch.compiler.is_compiling() and is_dtensor(x):
        return _eager_fake_quantize(x, forward, backward, seed)
    if isinstance(x, _PROXY):  # (its checks below ask x's values)
        raise symbolic_trace_refused("fake_quantize")
    forward, backward = _as_quant(forward, "forward"), _as_quant(backward, "backward")
    for q in (forward, backward):
        if q is not None:
            q.check_seed(seed)
    # Where a gradient can come (traced, the backward pass is traced too).
    gradient = x.requires_grad and torch.is_grad_enabled()
    if backward is not None and gradient and torch.compiler.is_exporting():
        warnings.warn("torch.export keeps fake_quantize's forward rounding only: an exported program's "
                      "gradient goes straight through, without the backward Quant", stacklevel=2)  # fmt: skip
    if backward is not None and gradient and not torch.compiler.is_compiling():
        _check_gradient(backward, x.dtype, x.dim())
    if seed is not None:
        # A key tensor is copied: the gradient rounds with the key of this call, though the
        # caller change theirs in place before backward (key_of passes (2,) int64 through).
        seed = op_key(seed, x).clone() if isinstance(seed, torch.Tensor) else as_key(seed)
    if torch.compiler.is_compiling():
        refuse_compiled_forward_ad()
    forward_mode = not torch.compiler.is_compiling() and may_carry_tangent(x)
    return (_ForwardMode if forward_mode else _StraightThrough).apply(x, forward, backward, seed)


#: On a DTensor under torch.compile: one graph break, then eager, with eager's bits. Traced,
#: Dynamo failed on the mesh's rank tensor (``replica_rank``) or recompiled a frame inside
#: the autograd Function at every call until its recompile limit.
_EAGER_ON_DTENSORS = ("fewbit's fake quantisation of a DTensor runs eagerly only: a piece's bits depend "
                      "on its rank, and torch's compile caches share graphs across ranks")
_eager_fake_quantize = torch.compiler.disable(fake_quantize, reason=_EAGER_ON_DTENSORS)


#: torch's private query of the backward pass this thread runs (-1: none), which
#: torch.utils.checkpoint reads too. None where this torch lacks it: a recomputation is
#: then not refused (tests/test_nn.py fails first).
_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)


def _refuse_in_backward() -> None:
    """Refuse a call counted during a backward pass: activation checkpointing recomputing
    a forward pass, where a second call would draw other bits than the first."""
    if _GRAPH_TASK_ID is not None and _GRAPH_TASK_ID() != -1:
        raise RuntimeError("FakeQuantize was called in training during a backward pass, as activation "
                           "checkpointing recomputes a forward pass: a second call would draw other bits "
                           "than the first. Pass context_fn=fewbit.nn.checkpoint_context to "
                           "torch.utils.checkpoint.checkpoint (use_reentrant=False); compiled, torch's "
                           "partitioner recomputes it too under activation_memory_budget=0")  # fmt: skip


@operator("fewbit::count_call", mutates_args=("calls",))
def _count_call(calls: torch.Tensor) -> torch.Tensor:
    """The count before this call, ``calls`` advanced by one. An op of its own because a
    graph must keep it: AOT autograd recomputes cheap ops on a graph input in the backward
    pass, and read after the graph advanced the count in place, the input gave the key of
    the next call (the backward Quant's key, where nothing in the forward pass needs it).
    Under activation checkpointing it must be saved, not recomputed: :func:`checkpoint_context`."""
    _refuse_in_backward()
    before = calls.clone()
    calls.add_(1)
    return before


@_count_call.register_fake
def _(calls: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(calls)


def checkpoint_context(policy: Callable | None = None) -> tuple:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False,
    context_fn=fewbit.nn.checkpoint_context)``, eagerly and under torch.compile: torch's
    selective checkpointing, which saves each :class:`FakeQuantize` call's count
    (``fewbit::count_call``) and recomputes the rest, so the recomputation draws the bits
    of the forward pass and counts nothing. ``policy``: a selective-checkpointing policy
    of the caller's for every other op (``functools.partial`` passes it); default,
    recompute. Without it, a FakeQuantize call in a recomputation is refused. As torch's
    selective checkpointing, it allows one backward pass through a region (not
    ``retain_graph=True`` and a second, nor a double backward)."""
    def save_counts(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op is _count_call.op:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE if policy is None else policy(ctx, op, *args, **kwargs)

    return create_selective_checkpoint_contexts(save_counts)


def _group_rank(policy: SeedPolicy, group: torch.distributed.ProcessGroup | None) -> int | None:
    """This process's rank in ``replica_group`` (None: none given), refused where it would
    go unused (IDENTICAL folds in no rank) or could not be this rank's replicas."""
    if group is None:
        return None
    if policy is SeedPolicy.IDENTICAL:
        raise ValueError("replica_group is the group whose rank policy='differing' folds in: give it with "
                         "'differing' (policy='identical' folds in no rank)")  # fmt: skip
    check_group(group, "replica_group")
    return world(group)[0]


class FakeQuantize(nn.Module):
    """:func:`fake_quantize` as a module with its own stream: call c uses ``fold_in(key, c)``,
    with the replica's rank folded in under the default DIFFERING policy (seed 000: forward
    and backward rounding differ per replica). For a DTensor the rank folded in is its
    mesh's (``fewbit.sharding.replica_rank``): ranks holding pieces of one tensor draw
    alike, data-parallel replicas (other meshes) differently.

    For a plain tensor the rank folded in is the global one, or, given ``replica_group``
    (a ``torch.distributed`` process group holding this rank), this process's rank in it:
    under pipeline parallelism with replicas of each stage, pass the stage's data-parallel
    group, and replica r of a stage draws the bits replica r of a run without pipelining
    draws, whichever ranks hold the stage. A DTensor then folds in that rank too, in
    place of its mesh's: the ranks holding its pieces must share their rank in their
    groups, as the rows of a (dp, tp) mesh do in ``mesh.get_group("dp")``. The rank is
    read once, here, and kept as the int ``replica_rank`` (None: the global rank, read at
    each call), so the module pickles and copies as before. ``replica_group`` is refused
    with policy IDENTICAL, which folds in no rank.
    """

    def __init__(
        self,
        forward: Quant | FloatFormat | BlockFormat | str | None = None,
        backward: Quant | FloatFormat | BlockFormat | str | None = None,
        seed: int | Key = 0,
        policy: SeedPolicy | str = SeedPolicy.DIFFERING,
        replica_group: torch.distributed.ProcessGroup | None = None,
    ):
        super().__init__()
        self.policy = SeedPolicy(policy)
        self.replica_rank = _group_rank(self.policy, replica_group)
        self.forward_quant = _as_quant(forward, "forward")
        self.backward_quant = _as_quant(backward, "backward")
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.key = seed

    @property
    def key(self) -> Key:
        """The module's key: call c draws with ``fold_in(key, c)``."""
        return self._key

    @key.setter
    def key(self, seed: int | Key) -> None:
        self._key = as_key(seed)
        # The key as data too, for where the ops are recorded: Dynamo takes a Key's ints
        # as constants, a graph for each module (every block of a model compiled apart,
        # as FSDP2 users do, recompiled until Dynamo's limit), and a module's plain tensor
        # as an input. Not a buffer: DDP would copy rank 0's over it, to_empty leave it
        # uninitialised, and the state_dict holds the count alone (the key is the seed's).
        self._key_words = key_of(self._key, "cpu")

    def __setstate__(self, state: dict) -> None:
        # A module pickled whole before the key was a property holds it as "key".
        key = state.pop("key", None)
        state.setdefault("replica_rank", None)  # (before replica_group: the global rank)
        super().__setstate__(state)
        if key is not None:
            self.key = key

    def reset_parameters(self) -> None:
        """Back to call 0 (as a module made afresh; torch's deferred initialisation calls it)."""
        self.calls.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and is_dtensor(x):  # as _eager_fake_quantize
            return _eager_forward(self, x)
        if isinstance(x, _PROXY):  # (the count's value picks the path below)
            raise symbolic_trace_refused("FakeQuantize")
        if transformed() and vmapped(self.calls):
            raise RuntimeError("FakeQuantize does not take a count stacked under torch.vmap (model "
                               "ensembling: torch.func.stack_module_state, then vmap of functional_call): "
                               "its key is no state, so every member would draw the base module's bits; "
                               "call each model")
        # Eager, Python ints derive the key at a fraction of the cost of tensor ops. Where
        # the ops are recorded (torch.compile, torch.export, make_fx, torch.jit.trace) or
        # the count has no value (meta, fake tensors), it stays a tensor: a new count is
        # new data, not a new graph, nor the same key replayed.
        recorded = recording() or self.calls.is_meta
        if not self.training:
            count = self.calls if recorded else int(self.calls)
        elif recorded:
            # Recorded, the call is counted before it rounds (the op returns the count it
            # found); a call refused on its data as the graph runs (NaN into a format
            # without NaN) has then counted, where an eager one has not.
            count = _count_call(self.calls)
        else:
            if torch.is_grad_enabled():  # as a recomputation is; a backward hook's call is not
                _refuse_in_backward()
            count = int(self.calls)
        # A DTensor's pieces are one tensor: its mesh folds in one rank for all of them, or
        # the rank in replica_group (an int: a constant when compiled), alike on its ranks.
        own = self._key_words.to(self.calls.device) if recorded else self.key
        rank = replica_rank(x) if self.replica_rank is None else self.replica_rank
        key = replica_key(fold_in(own, count), self.policy, rank)
        y = fake_quantize(x, self.forward_quant, self.backward_quant, key)
        # Counted once it succeeded: a refused call draws nothing, so a retry that
        # succeeds gets the bits a run that never failed would have drawn.
        if self.training and not recorded:
            _advance(self.calls)
        return y

    def __prepare_scriptable__(self) -> FakeQuantize:
        # torch.jit.script asks each module of a model this first: TorchScript cannot compile
        # the Python of a call's key (it failed on Key's source, an OSError naming no module).
        raise RuntimeError("torch.jit.script does not take FakeQuantize (TorchScript cannot compile fewbit's "
                           "Python): use torch.compile, torch.export or torch.jit.trace")

    def extra_repr(self) -> str:
        group = "" if self.replica_rank is None else f", replica_rank={self.replica_rank}"
        return f"forward={self.forward_quant}, backward={self.backward_quant}{group}"


_eager_forward = torch.compiler.disable(FakeQuantize.forward, reason=_EAGER_ON_DTENSORS)


def _advance(calls: torch.Tensor) -> None:
    """Count an eager call: ``calls`` advanced by one, in place (+= would set the attribute
    again, 3 us). Under torch.func's transforms past them: the count is the module's state,
    not a value of the function transformed, and grad, jvp and jacrev (vmap of grad too)
    refuse an in-place write to a tensor the function did not take as an input."""
    if not transformed():  # (the usual call: entering even a null context cost 1 us, a tenth of it)
        calls.add_(1)
        return
    with past_transforms():
        calls.add_(1)


def quantize_outputs(
    model: nn.Module,
    forward: Quant | FloatFormat | BlockFormat | str | None = None,
    backward: Quant | FloatFormat | BlockFormat | str | None = None,
    types: tuple[type[nn.Module], ...] | list[type[nn.Module]] = (nn.Linear,),
    seed: int | Key = 0,
    policy: SeedPolicy | str = SeedPolicy.DIFFERING,
    first_index: int = 0,
    replica_group: torch.distributed.ProcessGroup | None = None,
) -> list[nn.Module]:
    """Fake-quantise the output of every submodule of ``types`` (and, in backward, the
    gradient flowing into it). Each gets a :class:`FakeQuantize` child named
    ``output_quant`` (in the state_dict, so resumable) with key ``fold_in(seed, i)``, i
    counting the changed modules from ``first_index`` (a part of a model, such as a
    pipeline stage, gives the number of modules before it, so its keys are the whole
    model's); returns the modules changed. ``del module.output_quant`` and the hook stop
    it; calling this again replaces each module's ``output_quant`` (its one hook reads it).
    ``policy`` and ``replica_group`` are :class:`FakeQuantize`'s: under pipeline parallelism,
    ``policy="identical"`` without replicas of a stage, else the stage's data-parallel
    group as ``replica_group``.
    """
    # Checked before any module changes, and once for all of them.
    forward, backward = _as_quant(forward, "forward"), _as_quant(backward, "backward")
    types = _module_types(types)
    policy = SeedPolicy(policy)
    _group_rank(policy, replica_group)
    key = as_key(seed)
    first_index = check_index(first_index, "first_index")
    # MultiheadAttention reads its out_proj's weight without calling it: a hook there
    # would never run, so that Linear is left out, and said so.
    unused = {id(m.out_proj): name for name, m in model.named_modules()
              if isinstance(m, nn.MultiheadAttention) and isinstance(m.out_proj, types)}  # fmt: skip
    changed = [m for m in model.modules() if isinstance(m, types) and id(m) not in unused]
    tuples = sorted({type(m).__name__ for m in changed
                     if isinstance(m, _TUPLE_OUTPUTS) or getattr(m, "return_indices", False)})  # fmt: skip
    if tuples:
        raise TypeError(f"quantize_outputs rounds a module's output tensor; {', '.join(tuples)} return "
                        "tuples (round the tensors you choose with fake_quantize)")  # fmt: skip
    if unused:
        warnings.warn(f"quantize_outputs leaves out the out_proj of MultiheadAttention "
                      f"{', '.join(repr(n) for n in unused.values())}: it never runs its own forward, "
                      "so its output cannot be hooked", stacklevel=2)  # fmt: skip
    for i, m in enumerate(changed, start=first_index):
        m.output_quant = FakeQuantize(forward, backward, fold_in(key, i), policy, replica_group)
        if not getattr(m, "_output_quant_hooked", False):  # a second hook would round twice
            m.register_forward_hook(_quantize_output)
            m._output_quant_hooked = True
    return changed


def _module_types(types) -> tuple[type, ...]:
    """``types`` as a tuple of classes: one class, a union, or a list or tuple of them (a
    list went to isinstance, whose error named neither the argument nor the fix)."""
    if isinstance(types, type | UnionType):
        types = (types,)
    if isinstance(types, list | tuple):
        chosen = tuple(c for t in types for c in (get_args(t) if isinstance(t, UnionType) else (t,)))
        if all(isinstance(c, type) for c in chosen):
            return chosen
    raise TypeError(f"types must be module classes (nn.Linear, or a tuple or list of them), got {types!r}")


#: torch's modules that return a tuple (and pooling with return_indices): refused by
#: quantize_outputs before any changes.
_TUPLE_OUTPUTS = (nn.RNNBase, nn.LSTMCell, nn.MultiheadAttention)


def _quantize_output(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    quant = getattr(module, "output_quant", None)
    if quant is None:
        return output
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"quantize_outputs rounds a module's output tensor; this {type(module).__name__} "
                        f"returned {type(output).__name__} (del its output_quant to stop)")  # fmt: skip
    return quant(output)
