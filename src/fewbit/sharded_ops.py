"""fewbit's operators on DTensors (``torch.distributed.tensor``): each rank runs the op on
its own piece, every element with the random bits of its index in the full tensor, so
the full result is the one a single process gets for the full tensor with the same seed,
whatever the placements (Shard along any dimension, Replicate; a Partial input is summed
first, a collective, as a rounding of the addends is not one of the sum).

The rules are torch's own extension point for a subclass and an operator
(``torch.library.register_torch_dispatch``): a DTensor reaching ``fewbit.round``,
``quantize``, ``encode``, ``decode``, ``fewbit.block.round`` (or their ``torch.ops.fewbit``
operators) comes here instead of DTensor's sharding propagation, which has no strategy
for them and could not give an element its global index. Autograd runs above: the
gradient is the straight-through one, a DTensor laid out as the input's. A per-tensor
scale (NVFP4's) is the full tensor's, found by a collective (``sharding.tensor_scales``).

Limits, each refused with an error before anything is written:
- eager only. A piece's bits depend on the rank's place in the mesh, which a traced
  rule would bake into the graph as constants, and torch's compile caches take a graph
  on a DTensor as the same on every rank: a warm cache then gives one rank another's
  bits (seen on 4 gloo ranks, torch 2.13);
- ``random_bits`` must be a DTensor laid out as x; ``out`` too, and neither Partial;
- packed codes pair elements along the last dimension: a piece cut inside a pair is
  refused, as a block format's piece cut inside a block, and so is a full tensor whose
  codes a plain tensor's call refuses (K > 4, an odd last dimension);
- ``fewbit.block.quantize`` (its codes are laid out by block, not as x).

Where an element may have no result, found only once rounded (a NaN, or a value beyond
the range without ``sat``, in a format without NaN; a value ``encode`` has no code for),
only the ranks that hold it would see it. Such calls agree first (one all-reduce of a
flag): every rank raises, and none has written its piece of ``out``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from .block.ops import block_spec_of, with_tensor_scale
from .codec import decode_checks_codes, encode_checks
from .operators import LIBRARY
from .random import Key, host_key, replicated_piece
from .rounding.ops import check_out_matches, checked_spec, lookup_format
from .sharding import (
    ShardLayout,
    check_cuts,
    check_whole_blocks,
    is_dtensor,
    layout,
    map_piece,
    piece_randomness,
    quantize_range,
    refuse_alike,
    round_range,
    summed,
    tensor_scales,
)

__all__ = ["register"]


def _eager(name: str) -> None:
    if torch.compiler.is_compiling():
        raise NotImplementedError(f"{name} on a DTensor runs eagerly only: a piece's bits depend on "
                                  "its rank; torch's compile caches share graphs across ranks")  # fmt: skip


T = TypeVar("T")


def _may_refuse(spec, given) -> bool:
    """Whether one rank's piece may be refused where another's is not: an element without
    a result, or given random bits out of range (each rank checks those of its piece)."""
    return spec.may_refuse or given is not None


def _alike(x, may_refuse: bool, name: str, compute: Callable[..., T], *args, **kwargs) -> T:
    """``compute(*args, **kwargs)`` on this rank's piece of DTensor ``x``. Where one rank's
    piece ``may_refuse`` (:func:`_may_refuse`), the ranks agree first (one all-reduce of
    a flag): if any rank's piece was refused, every rank raises, none having written
    ``out`` (a rank that went on would wait at its next collective for those that raised).
    Any error counts, not a ValueError alone: a rank whose piece is not where the placements
    say raises a RuntimeError, and the others wait for it in the all-reduce otherwise."""
    if not may_refuse:
        return compute(*args, **kwargs)
    try:
        result, error = compute(*args, **kwargs), None
    except Exception as err:  # (not a KeyboardInterrupt: that ends the process)
        result, error = None, err
    refuse_alike(error, [x], f"{name}: another rank's piece of x was refused (see its error: an element "
                             "without a result, or a piece not where the placements say); nothing was "
                             "written")  # fmt: skip
    return result


def _laid_out_as(x, other, what: str, name: str) -> torch.Tensor | None:
    """``other``'s local piece, where it is a DTensor laid out as ``x`` (None where other
    is None); else a ValueError. x and other must not be Partial."""
    if other is None:
        return None
    if any(p.is_partial() for p in x.placements):
        raise ValueError(f"{name}: x is Partial ({x.placements}); with {what}, reduce it first "
                         "(x.redistribute to Replicate)")  # fmt: skip
    if not is_dtensor(other) or (other.device_mesh, other.placements, other.shape) != (
            x.device_mesh, x.placements, x.shape):  # fmt: skip
        placed = f"{other.placements} on {other.device_mesh}" if is_dtensor(other) else "a plain tensor"
        raise ValueError(f"{name}: {what} must be a DTensor laid out as x ({tuple(x.shape)}, {x.placements} "
                         f"on {x.device_mesh}), not {placed} of shape {tuple(other.shape)}")  # fmt: skip
    return other.to_local()


def _drawn(spec, key, given: torch.Tensor | None, where: ShardLayout, piece: torch.Tensor) -> tuple:
    """The (key, random_bits) arguments that give the piece's elements the bits they have
    in the full tensor: the given bits' piece, or those ``key`` draws for it."""
    if given is not None or key is None:
        return None, given
    drawn = piece_randomness(spec, host_key(key), where, piece.device)
    return (key, None) if "seed" in drawn else (None, drawn["random_bits"])  # (a whole tensor: the op draws)


def _on_piece(spec, key, given: torch.Tensor | None, where: ShardLayout, piece: torch.Tensor,
              op: Callable, *, packed: bool | None = None, axis: int | None = None,
              tensor_scale: torch.Tensor | None = None) -> torch.Tensor | None:  # fmt: skip
    """The op's result on the piece, each element with the bits it has in the full tensor:
    fewbit's kernel's, which draws them itself where the piece is runs of the full tensor
    (a Replicate piece is one: the kernel is called without a second pass through the
    dispatcher; ``sharding.round_range``, blocks along ``axis`` with the full tensor's
    ``tensor_scale``; or its codes, ``packed`` not None: ``sharding.quantize_range``),
    else ``op(key, random_bits)`` with the piece's bits drawn first (an op that writes its
    ``out`` returns None)."""
    words = host_key(key)
    if given is None and type(words) is Key:
        if packed is not None:
            fast = quantize_range(piece, spec, words, where, packed)
        else:
            fast = round_range(piece, spec, words, where, axis, tensor_scale)
        if fast is not None:
            return fast
    return op(*_drawn(spec, key, given, where, piece))


def _pairs_whole(x, packed: bool, name: str, length: int | None = None) -> tuple[int, ...] | None:
    """The full shape of x's codes packed in pairs along the last dimension (None where
    not packed); a ValueError where a piece's cut would split a pair. ``length``: that of
    the values, where x holds packed codes."""
    if not packed or not x.dim():
        return None
    check_cuts(x, -1, 2, "packed codes", "pairs", name, length)
    return (*x.shape[:-1], x.shape[-1] // 2 if length is None else length)


# Each rule takes (DTensor, the op's overload, types, args, kwargs) and the op's arguments
# in its schema's order (``kwargs`` is empty: no argument of fewbit's schemas is keyword-only).


def _round(cls, func, types, args, kwargs):
    x, fmt, rounding, sat, bits, fraction, key, random_bits = args
    _eager("fewbit.round")
    spec = checked_spec(x.to_local(), fmt, rounding, sat, bits, fraction, key, random_bits)
    given = _laid_out_as(x, random_bits, "random_bits", "fewbit.round")

    def rounded(piece: torch.Tensor, where: ShardLayout) -> torch.Tensor:
        return _on_piece(spec, key, given, where, piece,
                         lambda *drawn: func(piece, fmt, rounding, sat, bits, fraction, *drawn))  # fmt: skip

    return _alike(x, _may_refuse(spec, given), "fewbit.round", map_piece, x, rounded)


def _round_into(cls, func, types, args, kwargs):
    *call, out = args
    x, fmt, rounding, sat, bits, fraction, key, random_bits = call
    _eager("fewbit.round")
    spec = checked_spec(x.to_local(), fmt, rounding, sat, bits, fraction, key, random_bits)
    given = _laid_out_as(x, random_bits, "random_bits", "fewbit.round")
    into = _laid_out_as(x, out, "out" if out is not x else "an in-place rounding", "fewbit.round")
    piece = x.to_local()
    where = layout(x, piece)
    check_out_matches(piece, into)  # (the kernel's result is copied into it)

    refusable = _may_refuse(spec, given)

    def write(*drawn) -> torch.Tensor | None:
        if refusable:  # a result, copied once every rank has one
            return torch.ops.fewbit.round.default(piece, fmt, rounding, sat, bits, fraction, *drawn)
        func(piece, fmt, rounding, sat, bits, fraction, *drawn, into)
        return None

    done = _alike(x, refusable, "fewbit.round", _on_piece, spec, key, given, where, piece, write)
    if done is not None:  # the kernel's, or one to copy (else the op wrote into itself)
        into.copy_(done)


def _quantize(cls, func, types, args, kwargs):
    x, fmt, rounding, sat, bits, fraction, key, random_bits, packed = args
    _eager("fewbit.quantize")
    spec = checked_spec(x.to_local(), fmt, rounding, sat, bits, fraction, key, random_bits)
    # The full tensor's codes (packed: K <= 4, an even last dimension), which a piece's kernel
    # cannot check: it wrote a piece's pairs past the end of its codes, or 8-bit codes in 4 bits.
    encode_checks(x, spec.fmt, packed)
    shape = _pairs_whole(x, packed, "fewbit.quantize")
    given = _laid_out_as(x, random_bits, "random_bits", "fewbit.quantize")

    def codes(piece: torch.Tensor, where: ShardLayout) -> torch.Tensor:
        return _on_piece(spec, key, given, where, piece,
                         lambda *drawn: func(piece, fmt, rounding, sat, bits, fraction, *drawn, packed),
                         packed=packed)  # fmt: skip

    return _alike(x, _may_refuse(spec, given), "fewbit.quantize", map_piece, x, codes, shape)


def _encode(cls, func, types, args, kwargs):
    x, fmt, packed, check = args
    _eager("fewbit.encode")
    encode_checks(x, lookup_format(fmt), packed)  # (a bad name, and the full tensor's codes, as above)
    shape = _pairs_whole(x, packed, "fewbit.encode")
    return _alike(x, check, "fewbit.encode", map_piece, x,
                  lambda piece, where: func(piece, fmt, packed, check), shape)  # fmt: skip


def _decode(cls, func, types, args, kwargs):
    codes, fmt, dtype, packed = args
    _eager("fewbit.decode")
    checked = decode_checks_codes(codes.dtype, lookup_format(fmt), packed)
    shape = _pairs_whole(codes, packed, "fewbit.decode", 2 * codes.shape[-1] if codes.dim() else None)
    return _alike(codes, checked, "fewbit.decode", map_piece, codes,
                  lambda piece, where: func(piece, fmt, dtype, packed), shape)  # fmt: skip


def _block_checks(x, call: tuple, out: torch.Tensor | None = None):
    """The block op's checked spec (on x's piece), its block axis, the pieces of the given
    bits and of ``out``, and the full tensor's per-tensor scale (NVFP4's: a collective;
    None for formats without one), x's Partial placements reduced first; raises, before
    any collective, for a piece whose blocks straddle ranks or a bad argument."""
    bfmt, rounding, sat, bits, fraction, key, random_bits, axis, rule = call
    name = "fewbit.block.round"  # (the one block op with DTensor rules)
    _eager(name)
    piece = x.to_local()
    spec, axis = block_spec_of(piece, bfmt, rounding, sat, bits, fraction, key, random_bits, axis, rule)
    check_whole_blocks(x, spec.bfmt, axis, name)
    given = _laid_out_as(x, random_bits, "random_bits", name)
    into = _laid_out_as(x, out, "out", name)  # (refuses a Partial x)
    if into is not None:
        check_out_matches(piece, into)
    x = summed(x)
    (tensor_scale,) = tensor_scales([x], spec.bfmt, rule=spec.rule)
    return x, spec, axis, given, into, tensor_scale


# The block rules round a piece as the ops round a tensor (block.ops.with_tensor_scale),
# with the full tensor's per-tensor scale, not the piece's own.


def _block_round(cls, func, types, args, kwargs):
    key = args[6]
    x, spec, axis, given, _, ts = _block_checks(args[0], args[1:])

    def rounded(piece: torch.Tensor, where: ShardLayout) -> torch.Tensor:
        def op(*drawn) -> torch.Tensor:
            return with_tensor_scale(piece, spec, axis, ts, *drawn)[0].contiguous()

        return _on_piece(spec, key, given, where, piece, op, axis=axis, tensor_scale=ts)

    return _alike(x, _may_refuse(spec, given), "fewbit.block.round", map_piece, x, rounded)


def _block_round_into(cls, func, types, args, kwargs):
    *call, out = args
    key = call[6]
    x, spec, axis, given, into, ts = _block_checks(call[0], tuple(call[1:]), out)
    piece = x.to_local()
    where = layout(x, piece)

    refusable = _may_refuse(spec, given)

    def write(*drawn) -> torch.Tensor | None:
        # A call that may be refused keeps its result until every rank has one.
        result = with_tensor_scale(piece, spec, axis, ts, *drawn, into=None if refusable else (into,))
        return result[0] if refusable else None

    done = _alike(x, refusable, "fewbit.block.round", _on_piece, spec, key, given, where, piece, write,
                  axis=axis, tensor_scale=ts)  # fmt: skip
    if done is not None:  # the kernel's, or one to copy (else the op wrote into itself)
        into.copy_(done)


def _block_quantize(cls, func, types, args, kwargs):
    raise NotImplementedError("fewbit.block.quantize takes no DTensor: its codes are laid out by block, not "
                              "as x. Round with fewbit.block.round (which takes DTensors), or quantize "
                              "x.full_tensor()")  # fmt: skip


def _count_call(cls, func, types, args, kwargs):
    """FakeQuantize's count where ``distribute_module`` made its buffer a DTensor: each rank
    holds the whole count (Replicate) and advances it, as eager code does on the piece."""
    from torch.distributed.tensor import DTensor

    (calls,) = args
    before = func(replicated_piece(calls, "a FakeQuantize's call count"))
    return DTensor.from_local(before, calls.device_mesh, calls.placements, run_check=False)


#: The rule of each of fewbit's operators for DTensor arguments.
RULES: dict[str, Callable] = {
    "fewbit::round": _round, "fewbit::round_into": _round_into, "fewbit::quantize": _quantize,
    "fewbit::encode": _encode, "fewbit::decode": _decode, "fewbit::block_round": _block_round,
    "fewbit::block_round_into": _block_round_into, "fewbit::block_quantize": _block_quantize,
    "fewbit::block_quantize_into": _block_quantize, "fewbit::count_call": _count_call,
}  # fmt: skip


def register() -> None:
    """Register :data:`RULES` for DTensor, where this torch has torch.distributed."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.tensor import DTensor

    for op, rule in RULES.items():
        torch.library.register_torch_dispatch(op, DTensor, _entry(rule), lib=LIBRARY)


def _entry(rule: Callable) -> Callable:
    """``rule`` as DTensor's dispatch calls it: run eagerly (as :func:`_eager` says; after its
    graph break torch.compile went on to compile the rule's own frames, ten graphs a call),
    and refused where the data is a plain tensor and another argument a DTensor (an
    AttributeError of the rule's, before). (A DTensor seed is made a plain key before the
    op: ``fewbit.random.key_of``.)"""

    @torch.compiler.disable
    def run(cls, func, types, args, kwargs):
        if not is_dtensor(args[0]):
            names = [a.name for a in func._schema.arguments]
            placed = [n for n, a in zip(names, args, strict=True) if is_dtensor(a)]
            raise ValueError(f"{func.name()}: {names[0]} is a plain tensor and {', '.join(placed)} a "
                             f"DTensor: give {names[0]} as a DTensor laid out alike, or plain tensors "
                             "throughout")
        return rule(cls, func, types, args, kwargs)

    return run


register()
