"""``fewbit.block``: block-scaled formats (OCP MX, NVFP4, HBFP/BFP) with every rounding mode.

``formats`` says what a block format is (and the scale rules); ``kernel`` computes scales and
elements in plain torch ops; ``ops`` registers ``fewbit::block_round`` and
``fewbit::block_quantize``; ``reference`` states the maths block by block. Here: the user's
functions and :class:`BlockTensor`, the stored form.

Element ``i`` of ``x`` is rounded exactly as ``fewbit.round`` rounds ``x_i / S`` to the
element format, with the same mode, ``bits``, ``seed`` and ``random_bits`` (its own random
bits, those ``fewbit.round`` gives index ``i`` of x), where ``S`` is its block's scale;
``round`` returns that value times ``S``. A length along the block axis that is not a
multiple of the block size is padded with zeros in the last block (the OCP spec allows
it): padding never changes a block's scale, and the stored codes include it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from .. import rounding
from ..codec import check_value_dtype, decode, unpack_pairs
from ..formats import FloatFormat
from ..formats import format as element_format
from ..random import Key
from ..rounding import RoundMode
from ..rounding.checks import check_round_args
from ..rounding.ops import call_with_out, check_writable
from .formats import SCALE_RULES, BlockFormat, ScaleRule, names
from .formats import format as block_format
from .kernel import flushes, from_block_layout, times_scale, widened, work_dtype
from .ops import (
    block_args,
    block_quantize_into_op,
    block_quantize_op,
    block_round_into_op,
    block_round_op,
    block_spec_of,
    format_name,
    lookup,
)

__all__ = [
    "SCALE_RULES", "BlockFormat", "BlockTensor", "ScaleRule", "check_args", "element_or_block", "format",
    "names", "quantize", "round", "round_to",
]  # fmt: skip


@dataclass(frozen=True, eq=False)  # equal only to itself: == on its tensors has no one answer
class BlockTensor:
    """A tensor stored in a block format.

    Attributes:
        codes: uint8 element codes, ``(rows, blocks, B)`` (``B / 2`` bytes, two codes a
            byte, even element in the low nibble, for elements of at most 4 bits); rows run
            over x's other dimensions in order, blocks along ``axis``, padding included.
        scales: uint8 scale codes, ``(rows, blocks)`` (E8M0: ``e + 127``; E4M3: its code).
        tensor_scale: the per-tensor float32 scale (0-d), or None for formats without one.
        format: the block format. shape: x's shape. axis: the block axis (non-negative).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor | None
    format: BlockFormat
    shape: torch.Size
    axis: int

    @property
    def nbytes(self) -> int:
        """Bytes stored: codes, scales and the per-tensor scale. (Counted from numel:
        under torch.compile with a dynamic shape, a tensor's own ``nbytes`` is an error.)"""
        parts = (self.codes, self.scales) + (() if self.tensor_scale is None else (self.tensor_scale,))
        return sum(t.numel() * t.element_size() for t in parts)

    def block_scales(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Each block's factor ``S`` (``(rows, blocks)``): its scale, times the per-tensor scale."""
        check_value_dtype(dtype)
        scale = decode(self.scales, self.format.scale, torch.float32)
        flushed = flushes(scale)  # (see kernel.widened)
        ts = self.tensor_scale
        factor = scale if ts is None else times_scale(scale, ts, torch.float32, flushed)
        return widened(factor, flushed) if dtype == torch.float64 else factor.to(dtype)

    def elements(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The element values ``q`` (``(rows, blocks, B)``), before scaling."""
        codes = unpack_pairs(self.codes) if self.format.packed else self.codes
        return decode(codes, self.format.element, dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values, ``q * S``, in x's shape (a NaN scale makes its block NaN), formed
        as ``block.round`` forms them for data of ``dtype`` (in float64 for float64)."""
        check_value_dtype(dtype)
        work = work_dtype(self.format, dtype == torch.float64)
        elements = self.elements(work)
        # (the elements are decode's new tensor: owned, they take the product)
        factor = self.block_scales(work)[..., None]
        values = times_scale(elements, factor, dtype, flushes(elements), owned=True)
        return from_block_layout(values, self.shape, self.axis)


# A checkpoint of BlockTensors or formats loads with torch.load's default (weights_only=True):
# they rebuild from tensors, numbers and strings alone. (Registered here: the formats' own
# modules are pure data, without torch.)
torch.serialization.add_safe_globals([BlockTensor, BlockFormat, FloatFormat])


# A BlockTensor is a pytree node: a function exported by torch.export may return one,
# saved and loaded too (torch refused a type it did not know in an exported program's
# outputs; as an exported program's input it is still refused, torch taking no int
# there). Its tensors and the ints of its shape are the children (the shape
# is symbolic where the export's batch size is: a constant would give every batch the
# traced one's); the format, by the name its ops take, and the axis are the context.
# torch's registry of nodes is private (torch.utils._pytree): its public route,
# torch.export.register_dataclass, makes every field a child, the format too, which no
# program can output. Where a torch lacks it, BlockTensor is no node and export refuses
# it as before (tests/test_block.py's export test fails first).
_PYTREE = getattr(torch.utils, "_pytree", None)


def _flatten(q: BlockTensor) -> tuple[list, tuple[str, int]]:
    return [q.codes, q.scales, q.tensor_scale, *q.shape], (format_name(q.format), q.axis)


def _flatten_with_keys(q: BlockTensor) -> tuple[list, tuple[str, int]]:
    children, context = _flatten(q)
    keys = ["codes", "scales", "tensor_scale"] + [f"shape[{i}]" for i in range(len(q.shape))]
    return [(_PYTREE.GetAttrKey(k), c) for k, c in zip(keys, children, strict=True)], context


def _unflatten(children, context: tuple[str, int]) -> BlockTensor:
    name, axis = context
    codes, scales, ts, *shape = children
    return BlockTensor(codes, scales, ts, lookup(name), torch.Size(shape), axis)


if hasattr(_PYTREE, "register_pytree_node") and hasattr(_PYTREE, "GetAttrKey"):
    _PYTREE.register_pytree_node(
        BlockTensor, _flatten, _unflatten, serialized_type_name="fewbit.block.BlockTensor",
        flatten_with_keys_fn=_flatten_with_keys,
        to_dumpable_context=lambda context: json.dumps(list(context)),
        from_dumpable_context=lambda dumped: tuple(json.loads(dumped)),
    )


def quantize(
    x: torch.Tensor,
    bfmt: BlockFormat | str,
    mode: RoundMode | str = "rne",
    *,
    axis: int | None = None,
    bits: int | None = None,
    seed: int | Key | torch.Tensor | None = None,
    random_bits: torch.Tensor | None = None,
    fraction: float | None = None,
    rule: str | None = None,
    sat: bool = True,
    out: BlockTensor | None = None,
) -> BlockTensor:
    """Quantise ``x`` to block format ``bfmt``: codes, scale codes and the per-tensor scale.

    Args:
        x: a float tensor (float32, float64, bfloat16, float16) of at least one dimension.
        bfmt: a BlockFormat or a name (``"mxfp8_e4m3"``, ``"mxfp4"``, ``"nvfp4"``, ``"hbfp8"``,
            ``"bfp6_b32"``, ``"mx_binary8p4"``; ``fewbit.block.format``).
        mode, bits, seed, random_bits, fraction: as for ``fewbit.round``, applied to the elements.
        axis: the block axis (default: the format's, -1).
        rule: the scale rule (default: the format's; ``fewbit.block.SCALE_RULES``).
        sat: elements beyond the element format's largest value saturate (the OCP rule);
            False gives Inf/NaN where the element format has them, else a ValueError.
        out: a BlockTensor of the same format, shape and axis (an earlier ``quantize`` of a
            tensor like x) whose codes, scales and per-tensor scale take the result: no new
            memory, as a training loop that re-quantises its weights wants.

    Raises TypeError/ValueError, before anything is written, for a bad argument.
    """
    args = block_args(x, bfmt, mode, sat, bits, fraction, seed, random_bits, axis, rule)
    name, axis = args[1], args[8]
    if out is None:
        codes, scales, ts = block_quantize_op(*args)
        fmt = lookup(name)  # after the op, whose checks looked the name up (see lookup)
        axis = (fmt.axis if axis is None else axis) % x.dim()
        return BlockTensor(codes, scales, ts if fmt.tensor_scale else None, fmt, x.shape, axis)
    if not isinstance(out, BlockTensor):
        raise TypeError(f"fewbit.block.quantize: out must be a BlockTensor, not {type(out).__name__}")
    if out.shape != x.shape:
        raise ValueError(f"out holds a tensor of shape {tuple(out.shape)}, x has {tuple(x.shape)}")
    if (out.tensor_scale is not None) != out.format.tensor_scale:
        has, want = ("a", "a 0-d float32 tensor") if out.format.tensor_scale else ("no", "None")
        raise ValueError(f"out's format {out.format.name} has {has} per-tensor scale, so out.tensor_scale "
                         f"must be {want}")
    ts = out.tensor_scale if out.tensor_scale is not None else x.new_ones((), dtype=torch.float32)
    if torch.is_grad_enabled() and ts.requires_grad:
        raise RuntimeError("fewbit.block.quantize(..., out=...) does not support automatic differentiation, "
                           "and out.tensor_scale requires grad; call it without out=")
    check_writable("fewbit.block.quantize", out.codes, out.scales, ts)
    block_quantize_into_op(*args, out.format.name, out.axis, out.codes, out.scales, ts)
    return out


def round(
    x: torch.Tensor,
    bfmt: BlockFormat | str,
    mode: RoundMode | str = "rne",
    *,
    axis: int | None = None,
    bits: int | None = None,
    seed: int | Key | torch.Tensor | None = None,
    random_bits: torch.Tensor | None = None,
    fraction: float | None = None,
    rule: str | None = None,
    sat: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantise and dequantise in one pass: ``x``'s dtype and shape, holding values of the
    block format (``quantize(...).dequantize(x.dtype)``, without storing codes). What
    fake quantisation and training call. Arguments as :func:`quantize`; ``out``: a tensor
    of x's shape, dtype and device to hold the result (as ``fewbit.round``'s: no autograd
    through it). Gradient: straight-through (the identity), as ``fewbit.round``'s."""
    args = block_args(x, bfmt, mode, sat, bits, fraction, seed, random_bits, axis, rule)
    return call_with_out(block_round_op, block_round_into_op, args, x, out, "fewbit.block.round")


# Layers that take either kind of format (fewbit.nn, fewbit.optim) go through these three,
# so that an element format and a block format differ in one place.


def element_or_block(fmt: FloatFormat | BlockFormat | str) -> FloatFormat | BlockFormat:
    """``fmt`` itself, or the format its name names: an element format if ``fewbit.format``
    knows the name, else a block format (no name is both: ``"e4m3"``, ``"hbfp4"``)."""
    if isinstance(fmt, (FloatFormat, BlockFormat)):
        return fmt
    return looked_up(fmt, "any")


def format(name: str | BlockFormat) -> BlockFormat:
    """Look a block format up by name (or pass a BlockFormat through); see the table of
    ``fewbit.block.formats``. Also inside a compiled function (:func:`looked_up`)."""
    return looked_up(name, "block")


def looked_up(name, kind: str) -> FloatFormat | BlockFormat:
    """The format ``name`` names, as ``kind`` ("element", "block" or "any":
    :func:`element_or_block`) looks it up. Where Dynamo traces, it traced through the
    registries' caches and built a new format in the graph, one it cannot hand to the ops'
    name checks (an internal error: ``Quant("hbfp4")`` or ``fewbit.format("binary8p3")`` in
    a compiled function). There the name is looked up as Python runs, at trace time, and
    its format read back as an attribute, which Dynamo reads as it is then; a name refused
    is refused here, as eagerly (not inside the lookup: Dynamo's internal error)."""
    if not (isinstance(name, str) and torch.compiler.is_compiling()):
        return _LOOKUPS[kind](name)
    if refused := _look_up(name, kind):
        raise ValueError(refused)
    return getattr(_LOOKED_UP, f"{kind}:{name}")


class _LookedUp:
    """The formats :func:`looked_up` looked up while Dynamo traced, by kind and name."""


_LOOKED_UP = _LookedUp()


@torch.compiler.assume_constant_result
def _look_up(name: str, kind: str) -> str:
    """Keep the format ``name`` names in ``_LOOKED_UP``; why it is refused, or ''."""
    if f"{kind}:{name}" not in vars(_LOOKED_UP):
        try:
            setattr(_LOOKED_UP, f"{kind}:{name}", _LOOKUPS[kind](name))
        except ValueError as refused:
            return str(refused)
    return ""


def _named(fmt: str) -> FloatFormat | BlockFormat:
    try:
        return element_format(fmt)
    except ValueError as err:
        try:
            return block_format(fmt)
        except ValueError as refused:
            if not str(refused).startswith("unknown block format"):
                raise  # a block format's name, refused for its own reason (bfp4_b3: odd blocks)
            raise ValueError(f"{err}; nor is it a block format (fewbit.block.format: hbfp<m>, "
                             f"bfp<m>_b<size>, mx..., nvfp4)") from None  # fmt: skip


#: The registries :func:`looked_up` reads, by kind.
_LOOKUPS = {"element": element_format, "block": block_format, "any": _named}


def check_args(dtype: torch.dtype, fmt: FloatFormat | BlockFormat | str, mode: RoundMode | str, sat: bool,
               bits: int | None, fraction: float | None, axis: int | None = -1, ndim: int = 1):
    """Raise what :func:`round_to` would raise for these arguments on a ``dtype`` tensor
    of ``ndim`` dimensions, before there is one; return the call's spec."""
    fmt = element_or_block(fmt)
    probe = torch.empty((0,) * ndim, dtype=dtype)
    if isinstance(fmt, BlockFormat):
        return block_spec_of(*block_args(probe, fmt, mode, sat, bits, fraction, None, None, axis, None))[0]
    return check_round_args(probe, fmt, mode, sat, bits, fraction)


def round_to(
    x: torch.Tensor,
    fmt: FloatFormat | BlockFormat | str,
    mode: RoundMode | str = "rne",
    *,
    axis: int | None = None,
    sat: bool = True,
    bits: int | None = None,
    fraction: float | None = None,
    seed: int | Key | torch.Tensor | None = None,
    random_bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fewbit.round`` for an element format, :func:`round` for a block format (``axis``:
    its block axis; refused for an element format). Straight-through gradient either way."""
    fmt = element_or_block(fmt)
    sr = {"bits": bits, "fraction": fraction, "seed": seed, "random_bits": random_bits}
    if isinstance(fmt, BlockFormat):
        return round(x, fmt, mode, axis=axis, sat=sat, **sr)
    if axis is not None:
        raise ValueError(f"axis is the block axis of a block format; {fmt.name} is an element format")
    return rounding.round(x, fmt, mode, sat=sat, **sr)
