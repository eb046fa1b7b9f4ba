"""``fewbit::block_round`` and ``fewbit::block_quantize``: block quantisation as
``torch.library`` operators, the second kind after ``fewbit::round``.

Arguments are those of ``fewbit::round`` (format by name, mode as ``rounding``, the key as
an int64 tensor) plus the block axis and the scale rule, so a user's ``torch.compile``,
``torch.export`` and autograd see one opaque op and a new seed is new data. Behind it runs
``kernel`` compiled once per spec (``fewbit.config`` decides, as for ``fewbit.round``), or
eager. Gradient of ``block_round``: straight-through, as ``fewbit::round``'s (see there).
"""

from __future__ import annotations

import functools

import torch

from ..codec import codes_of, pack_pairs
from ..formats import FloatFormat, from_repr
from ..operators import operator
from ..random import Key, host_key, is_int
from ..rounding import gpu, native
from ..rounding.checks import check_random_bits, no_result, refuse_traced_numpy
from ..rounding.compiled import (
    any_length,
    range_bits,
    run_compiled,
    stream_words,
    use_compiled,
    word_tensors,
)
from ..rounding.fast import float32_item
from ..rounding.modes import parse_mode
from ..rounding.ops import (
    batch_bits,
    by_fields,
    check_key,
    check_out_matches,
    name_for_op,
    op_args,
    spans_overlap,
    storages_overlap,
)
from ..rounding.ops import format_name as element_name
from .formats import BlockFormat, check_rule, check_storable
from .formats import format as block_format
from .kernel import (
    BlockSpec,
    block_layout,
    finite_amax,
    flushes,
    from_block_layout,
    make_block_spec,
    quantize_blocks,
    tensor_scale_of,
    times_scale,
)

__all__ = ["block_args", "block_spec_of", "check_axis", "format_name", "largest_finite", "lookup",
           "with_tensor_scale"]

_UNREGISTERED: dict[str, BlockFormat] = {}
#: By name, the last block format whose element's name was checked (each object once).
_ELEMENT_CHECKED: dict[str, BlockFormat] = {}
_KNOWN: dict[str, BlockFormat] = {}


@torch.compiler.assume_constant_result  # (as rounding.ops.format_name)
def _format_name(bfmt: BlockFormat | str) -> str:
    """The name an op takes for ``bfmt`` (``name_for_op``: one made by hand, its repr).
    Its element format keeps its name as ``fewbit.round``'s formats do: one made by hand
    under another format's name is refused (the scale is checked when the format is made)."""
    if isinstance(bfmt, BlockFormat) and _ELEMENT_CHECKED.get(bfmt.name) is not bfmt:
        element_name(bfmt.element)
        _ELEMENT_CHECKED[bfmt.name] = bfmt
    return name_for_op(bfmt, BlockFormat, block_format, _UNREGISTERED, "block format")


#: The name an op takes for a block format (or a name); by its fields under torch.compile (``by_fields``).
format_name = by_fields(_format_name, BlockFormat)


def lookup(name: str) -> BlockFormat:
    """The block format an op's name stands for (a registered one, or one made by hand by
    its repr). Kept in a plain dict: a traced caller (``quantize`` under torch.compile, once
    the op's checks have looked the name up) reads it there instead of tracing the
    registry's cache."""
    fmt = _KNOWN.get(name)
    if fmt is None:
        made = "(" in name
        fmt = _KNOWN[name] = from_repr(name, (BlockFormat, FloatFormat)) if made else block_format(name)
    return fmt


def block_args(x, bfmt, mode, sat, bits, fraction, seed, random_bits, axis, rule) -> tuple:
    """The ops' arguments from a user's call: ``fewbit::round``'s (``rounding.ops.op_args``,
    with the block format's name), the axis and the rule."""
    args = op_args(x, bfmt, mode, sat, bits, fraction, seed, random_bits, name_of=format_name)
    return *args, check_axis(axis), rule


def check_axis(axis: object) -> int | None:
    """``axis`` as an int (numpy's too, as the keys take them), or None; a bool or anything
    else is a TypeError."""
    if axis is None:
        return None
    if not is_int(axis):
        refuse_traced_numpy(axis, "axis", "int")
        raise TypeError(f"axis must be an int, not {type(axis).__name__}")
    return int(axis)


@functools.lru_cache(maxsize=1024)  # (bounded as rounding.checks.make_spec)
def _spec(dtype, name, rounding, sat, bits, fraction, rule) -> BlockSpec:
    bfmt = lookup(name)
    rule = check_rule(bfmt.rule if rule is None else rule, bfmt.scale)
    return make_block_spec(dtype, bfmt, rule, parse_mode(rounding), sat, bits, fraction)


def block_spec_of(
    x, name, rounding, sat, bits, fraction, key, random_bits, axis, rule
) -> tuple[BlockSpec, int]:
    """The checked spec of an op call and its axis (None: the format's, as a None rule
    is); raises before anything is written. Defaults are read here, inside the op, so a
    traced caller never reads the registry."""
    if not x.is_floating_point():
        raise TypeError(f"x must be a float tensor, not {x.dtype}")
    spec = _spec(x.dtype, name, rounding, sat, bits, fraction, rule)
    axis = spec.bfmt.axis if axis is None else axis
    check_block_axis(x, axis)
    check_key(spec.spec, x, key, random_bits)
    return spec, axis


def check_block_axis(x: torch.Tensor, axis: int, name: str = "x") -> None:
    """Raise ValueError unless ``x`` has a dimension ``axis`` to lay blocks along."""
    if x.dim() == 0:
        raise ValueError(f"block formats need a tensor of at least one dimension ({name} is 0-d)")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis {axis} is out of range for a tensor of {x.dim()} dimensions ({name})")


def _fake_checks(
    x, bfmt, rounding, sat, bits, fraction, key, random_bits, axis, rule
) -> tuple[BlockSpec, int]:
    """What can be checked while tracing: everything but the values of random_bits."""
    spec, axis = block_spec_of(x, bfmt, rounding, sat, bits, fraction, key, random_bits, axis, rule)
    if key is None:
        check_random_bits(x, spec.spec, random_bits, values=False)
    return spec, axis


def _kernel(blocks, words, rand, tensor_scale, *, spec: BlockSpec, fused: bool, flushed: bool):
    """On ``blocks`` (``(n, B)``, contiguous): the rounded values in x's dtype (``fused``)
    or the codes and scale codes; and whether an element had no value (overflow without
    sat in a format without Inf or NaN: NaN blocks hold zeros there, so a NaN element is
    such an overflow). ``words``: draw the bits of elements ``0 .. n B`` here. ``flushed``:
    the calling thread or its intra-op threads flush subnormals (``kernel.flushes``)."""
    if words is not None:
        rand = range_bits(spec.spec, words, 0, blocks.numel(), blocks.device).view(blocks.shape)
    q, scale, factor = quantize_blocks(blocks, spec, rand, tensor_scale, flushed)
    invalid = torch.isnan(q).any() if spec.may_refuse else None
    if fused:
        return times_scale(q, factor, blocks.dtype, flushed), invalid
    codes = codes_of(q, spec.bfmt.element)
    if spec.bfmt.packed:
        codes = pack_pairs(codes)
    return codes.to(torch.uint8), codes_of(scale.squeeze(-1), spec.bfmt.scale).to(torch.uint8), invalid


def _outputs(x: torch.Tensor, spec: BlockSpec, fused: bool, into: tuple | None) -> tuple:
    """What the kernels on blocks in x's memory order write: the values and None
    (``fused``), or the element codes and the scale codes; ``into``'s tensors where given
    (contiguous, shaped as the results), else new ones."""
    if fused:
        (out,) = into or (torch.empty_like(x, memory_format=torch.contiguous_format),)
        return out, None
    return into or _empty_codes(x, spec, x.dim() - 1)


def _native(x: torch.Tensor, spec: BlockSpec, key: Key | None, rand: torch.Tensor | None, fused: bool,
            ts: torch.Tensor | None, into: tuple | None) -> tuple:  # fmt: skip
    """:func:`_run`'s answer from the native CPU kernel, for blocks in x's memory order,
    written into ``into`` where given."""
    out, scales = _outputs(x, spec, fused, into)
    words = None if key is None else stream_words(spec.spec, key)
    tensor_scale = 1.0 if ts is None else float32_item(ts)
    bad = native.block_into(x, spec.spec, words, rand, out, scales, block_size=spec.bfmt.block_size,
                            rule=spec.rule, tensor_scale=tensor_scale, packed=spec.bfmt.packed)  # fmt: skip
    return (out, bad >= 0) if fused else (out, scales, bad >= 0)


def _triton(x: torch.Tensor, spec: BlockSpec, key, rand: torch.Tensor | None, fused: bool,
            ts: torch.Tensor | None, into: tuple | None) -> tuple | None:  # fmt: skip
    """:func:`_run`'s answer from the GPU kernel, for blocks in x's memory order, written
    into ``into`` where given; None where Triton could not compile it (nothing written).
    Every element has a result (gpu.block_applies), so nothing waits for the kernel."""
    out, scales = _outputs(x, spec, fused, into)
    if not gpu.block_into(x, spec.spec, key, rand, out, scales, block_size=spec.bfmt.block_size,
                          rule=spec.rule, tensor_scale=ts, packed=spec.bfmt.packed):  # fmt: skip
        return None
    return (out, None) if fused else (out, scales, None)


def _run(x, spec: BlockSpec, key, random_bits, axis: int, fused: bool, ts: torch.Tensor | None,
         into: tuple | None = None):
    """The kernel on x's blocks, laid out here (a view when the axis is last and its length
    a multiple of B): the kernel then sees a plain ``(n, B)`` tensor, which Inductor
    vectorises. Where the layout moves elements, their bits are drawn here, by x's own
    flat indices, and laid out with them. Blocks in x's memory order go to the native
    kernel on a CPU (:func:`_native`) and to the Triton kernel on a GPU (:func:`_triton`)
    instead, which write ``into`` where given (the torch kernels ignore it)."""
    size = spec.bfmt.block_size
    rand = check_random_bits(x, spec.spec, random_bits) if key is None else None
    in_order = axis % x.dim() == x.dim() - 1 and x.shape[-1] % size == 0
    cpu_key = host_key(key)
    if in_order and spec.work_dtype == torch.float32:
        if native.block_applies(spec.spec, x, rand, size, spec.bfmt.scale):
            return _native(x, spec, cpu_key, rand, fused, ts, into)
        if gpu.block_applies(spec.spec, x, rand, size, spec.bfmt.scale):
            result = _triton(x, spec, cpu_key, rand, fused, ts, into)
            if result is not None:
                return result
    words = None
    if key is not None:
        if not in_order:
            words_now = stream_words(spec.spec, cpu_key)
            rand = range_bits(spec.spec, words_now, 0, x.numel(), x.device).view(x.shape)
        else:
            words = cpu_key
    blocks = block_layout(x, axis, size)
    shape3 = blocks.shape
    blocks = blocks.reshape(-1, size)
    rand = None if rand is None else block_layout(rand, axis, size).reshape(-1, size)
    result = None
    compiled = use_compiled(x.numel())
    flushed = flushes(blocks, compiled)
    if compiled:

        def run(fn) -> None:
            nonlocal result
            any_length(blocks, rand)  # one kernel for every number of blocks
            result = fn(blocks, None if words is None else word_tensors(spec.spec, key, x.device), rand, ts)

        # (result stays None where the compiled kernel failed: eager below)
        run_compiled((spec, fused, x.dtype, x.device.type, words is None, flushed), _kernel, run, spec.spec,
                     x.device, spec=spec, fused=fused, flushed=flushed)  # fmt: skip
    if result is None:
        result = _kernel(blocks, None if words is None else stream_words(spec.spec, words), rand, ts,
                         spec=spec, fused=fused, flushed=flushed)
    if fused:
        out, invalid = result
        return from_block_layout(out.view(shape3), x.shape, axis), invalid
    codes, scales, invalid = result
    return codes.view(*shape3[:2], -1), scales.view(shape3[:2]), invalid


def _checked_run(x, spec: BlockSpec, key, random_bits, axis: int, fused: bool, ts, into: tuple | None = None
                 ) -> tuple:  # fmt: skip
    """The results, or ValueError where an element has no value. ``into``: tensors to hold
    them (round's ``out``; quantize's codes and scales). The kernel writes them directly
    only where nothing can be refused after it starts (sat, or elements with NaN), they
    are contiguous and apart from x; else they are copied once the call is valid."""
    direct = into is not None and not spec.may_refuse and all(
        t.is_contiguous() and not storages_overlap(t, x, random_bits) for t in into)  # fmt: skip
    *result, invalid = _run(x, spec, key, random_bits, axis, fused, ts, into if direct else None)
    if invalid is not None and bool(invalid):
        raise no_result(spec.spec.fmt, nan_input=False)
    if into is None:
        return tuple(result)
    for t, r in zip(into, result, strict=True):
        if r is not t:
            t.copy_(r.view(t.shape))
    return into


def largest_finite(x: torch.Tensor, bfmt: BlockFormat) -> torch.Tensor:
    """``kernel.finite_amax`` of x (0-d float32 on x's device), found in one read of x by
    the native kernel or the GPU's where they take x (torch's where/abs/amax make two
    temporaries of x's size)."""
    found = None
    if x.numel():
        if native.usable(x, bfmt.element):
            found = native.finite_amax(x)
        elif gpu.usable(x, bfmt.element):
            found = gpu.finite_amax(x)  # (None where Triton could not compile it)
    return finite_amax(x, found)


def _tensor_scale(x: torch.Tensor, spec: BlockSpec) -> torch.Tensor | None:
    """x's own per-tensor scale (:func:`tensor_scale_of`), for formats that have one."""
    bfmt = spec.bfmt
    return tensor_scale_of(x, bfmt, largest_finite(x, bfmt), spec.rule) if bfmt.tensor_scale else None


def with_tensor_scale(x: torch.Tensor, spec: BlockSpec, axis: int, tensor_scale: torch.Tensor | None,
                      key: Key | None = None, random_bits: torch.Tensor | None = None, *, fused: bool = True,
                      into: tuple | None = None) -> tuple:  # fmt: skip
    """The block ops' results for x: the rounded values (``fused``) or the element codes
    and scale codes, with ``tensor_scale`` as the per-tensor scale. The ops give x's own;
    a piece of a sharded tensor takes its full tensor's (``fewbit.sharding.tensor_scales``),
    so that it rounds as it does in the full tensor (the DTensor rules and the write-back
    call this below autograd, eagerly). ``into``: tensors to hold the results, as the ops'
    ``out``. Raises ValueError where an element has no value; the caller has checked the
    rest."""
    if not fused:
        check_storable(spec.bfmt)
    if x.numel():
        return _checked_run(x, spec, key, random_bits, axis, fused, tensor_scale, into)
    if fused:
        return into or (torch.empty_like(x, memory_format=torch.contiguous_format),)
    return into or _empty_codes(x, spec, axis)


def _code_shapes(x: torch.Tensor, spec: BlockSpec, axis: int) -> tuple[tuple, tuple]:
    """Shapes of :func:`_kernel`'s codes and scale codes for ``x`` (for a format that has them)."""
    check_storable(spec.bfmt)
    size = spec.bfmt.block_size
    length = x.shape[axis]
    blocks = -(-length // size)
    rows = x.numel() // length if length else 0
    return (rows, blocks, size // 2 if spec.bfmt.packed else size), (rows, blocks)


def _empty_codes(x: torch.Tensor, spec: BlockSpec, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty tensors shaped as :func:`_kernel`'s codes for ``x``."""
    return tuple(x.new_empty(shape, dtype=torch.uint8) for shape in _code_shapes(x, spec, axis))


@operator("fewbit::block_round", straight_through=True)
def block_round_op(
    x: torch.Tensor, bfmt: str, rounding: str, sat: bool, bits: int | None, fraction: float | None,
    key: torch.Tensor | None, random_bits: torch.Tensor | None, axis: int | None, rule: str | None,
) -> torch.Tensor:
    """``fewbit.block.round`` as an operator (see there)."""
    spec, axis = block_spec_of(x, bfmt, rounding, sat, bits, fraction, key, random_bits, axis, rule)
    (out,) = with_tensor_scale(x, spec, axis, _tensor_scale(x, spec), key, random_bits)
    return out.contiguous()


@block_round_op.register_vmap
def _(x, bfmt, rounding, sat, bits, fraction, key, random_bits, axis, rule):
    """One call for a batch rounded deterministically, or with bits given the same for
    every sample (``batch_bits``), its block axis counted past the batch's. A call each
    where NVFP4 takes each sample's own tensor scale, and where the axis is none of a
    sample's (or a sample is 0-d): that call refuses it, which one call would take for
    another axis of the batch."""
    fmt = lookup(bfmt)
    given = batch_bits(x, key, random_bits)
    axis = fmt.axis if axis is None else axis
    dims = x.dim() - 1  # a sample's
    if given is None or fmt.tensor_scale or not -dims <= axis < dims:
        return None
    return x, bfmt, rounding, sat, bits, fraction, key, *given, axis % dims + 1, rule


@block_round_op.register_fake
def _(x, bfmt, rounding, sat, bits, fraction, key, random_bits, axis, rule):
    _fake_checks(x, bfmt, rounding, sat, bits, fraction, key, random_bits, axis, rule)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@operator("fewbit::block_round_into", mutates_args=("out",))
def block_round_into_op(
    x: torch.Tensor, bfmt: str, rounding: str, sat: bool, bits: int | None, fraction: float | None,
    key: torch.Tensor | None, random_bits: torch.Tensor | None, axis: int | None, rule: str | None,
    out: torch.Tensor,
) -> None:
    """``fewbit.block.round(..., out=out)`` as an operator."""
    spec, axis = block_spec_of(x, bfmt, rounding, sat, bits, fraction, key, random_bits, axis, rule)
    check_out_matches(x, out)
    with_tensor_scale(x, spec, axis, _tensor_scale(x, spec), key, random_bits, into=(out,))


@block_round_into_op.register_fake
def _(x, bfmt, rounding, sat, bits, fraction, key, random_bits, axis, rule, out):
    _fake_checks(x, bfmt, rounding, sat, bits, fraction, key, random_bits, axis, rule)
    check_out_matches(x, out)


@operator("fewbit::block_quantize")
def block_quantize_op(
    x: torch.Tensor, bfmt: str, rounding: str, sat: bool, bits: int | None, fraction: float | None,
    key: torch.Tensor | None, random_bits: torch.Tensor | None, axis: int | None, rule: str | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fewbit.block.quantize`` as an operator: element codes ``(rows, blocks, B)``
    (``B / 2`` bytes when packed), scale codes ``(rows, blocks)`` and the per-tensor
    scale (float32, 1 for formats without one)."""
    spec, axis = block_spec_of(x, bfmt, rounding, sat, bits, fraction, key, random_bits, axis, rule)
    ts = _tensor_scale(x, spec)
    codes, scales = with_tensor_scale(x, spec, axis, ts, key, random_bits, fused=False)
    return codes, scales, torch.ones((), device=x.device) if ts is None else ts


@block_quantize_op.register_vmap
def _(x, bfmt, rounding, sat, bits, fraction, key, random_bits, axis, rule):
    """A call per sample, each giving its own codes, scale codes and tensor scale (torch's
    fallback did so, with its warning that the op has no rule, and refused an empty batch)."""
    return None


@block_quantize_op.register_fake
def _(x, bfmt, rounding, sat, bits, fraction, key, random_bits, axis, rule):
    spec, axis = _fake_checks(x, bfmt, rounding, sat, bits, fraction, key, random_bits, axis, rule)
    return (*_empty_codes(x, spec, axis), x.new_empty((), dtype=torch.float32))


def _check_codes(x: torch.Tensor, spec: BlockSpec, axis: int, stored_format: str, stored_axis: int,
                 codes: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor) -> None:  # fmt: skip
    """Raise ValueError unless the BlockTensor's format and axis are the call's and its
    buffers are shaped as quantize's results for ``x``."""
    axis = axis % x.dim()
    if stored_format != spec.bfmt.name or stored_axis != axis:  # a name is one format
        raise ValueError(f"out holds {stored_format} along axis {stored_axis}; this call makes "
                         f"{spec.bfmt.name} along axis {axis}")
    shapes = _code_shapes(x, spec, axis)
    for what, shape, got in zip(("codes", "scales"), shapes, (codes, scales), strict=True):
        if got.shape != shape or got.dtype != torch.uint8 or got.device != x.device:
            raise ValueError(f"out's {what} must be uint8 {shape} on {x.device} for this x, not {got.dtype} "
                             f"{tuple(got.shape)} on {got.device}")
    if tensor_scale.shape != () or tensor_scale.dtype != torch.float32 or tensor_scale.device != x.device:
        raise ValueError(f"out's tensor scale must be a 0-d float32 tensor on {x.device}")


@operator("fewbit::block_quantize_into", mutates_args=("codes", "scales", "tensor_scale"))
def block_quantize_into_op(
    x: torch.Tensor, bfmt: str, rounding: str, sat: bool, bits: int | None, fraction: float | None,
    key: torch.Tensor | None, random_bits: torch.Tensor | None, axis: int | None, rule: str | None,
    stored_format: str, stored_axis: int, codes: torch.Tensor, scales: torch.Tensor,
    tensor_scale: torch.Tensor,
) -> None:
    """``fewbit.block.quantize(..., out=stored)`` as an operator: :func:`block_quantize_op`'s
    results written into ``codes``, ``scales`` and ``tensor_scale`` (1 for formats without
    one) of a BlockTensor of ``stored_format`` along ``stored_axis``."""
    spec, axis = block_spec_of(x, bfmt, rounding, sat, bits, fraction, key, random_bits, axis, rule)
    _check_codes(x, spec, axis, stored_format, stored_axis, codes, scales, tensor_scale)
    # Here, where the tensors are real: traced (fake tensors, functionalisation, make_fx)
    # their addresses are not theirs, or not there.
    pairs = ((codes, scales), (codes, tensor_scale), (scales, tensor_scale))
    if any(spans_overlap(a, b) for a, b in pairs):
        raise ValueError("fewbit.block.quantize: out's codes, scales and tensor_scale share memory; "
                         "give each its own")
    ts = _tensor_scale(x, spec)
    with_tensor_scale(x, spec, axis, ts, key, random_bits, fused=False, into=(codes, scales))
    if ts is None:
        tensor_scale.fill_(1.0)
    else:
        tensor_scale.copy_(ts)


@block_quantize_into_op.register_fake
def _(x, bfmt, rounding, sat, bits, fraction, key, random_bits, axis, rule, stored_format, stored_axis, codes,
      scales, tensor_scale):  # fmt: skip
    spec, axis = _fake_checks(x, bfmt, rounding, sat, bits, fraction, key, random_bits, axis, rule)
    _check_codes(x, spec, axis, stored_format, stored_axis, codes, scales, tensor_scale)
