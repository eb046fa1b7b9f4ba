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
from ..random import Key, key_of
from ..rounding.checks import check_random_bits, scalar_args
from ..rounding.compiled import (
    _own,
    _warn_eager,
    below_autograd,
    range_bits,
    stream_words,
    use_compiled,
    word_tensors,
)
from ..rounding.modes import parse_mode
from .formats import BlockFormat, check_rule
from .formats import format as block_format
from .kernel import (
    BlockSpec,
    block_layout,
    from_block_layout,
    make_block_spec,
    quantize_blocks,
    tensor_scale_of,
)

__all__ = ["block_args", "block_spec_of", "format_name", "lookup"]

_UNREGISTERED: dict[str, BlockFormat] = {}
_CACHE: dict[tuple, object] = {}
_BROKEN: set[tuple] = set()


def format_name(bfmt: BlockFormat | str) -> str:
    """The name an op takes for ``bfmt`` (one made by hand is kept here by its name)."""
    if isinstance(bfmt, str):
        return bfmt
    if not isinstance(bfmt, BlockFormat):
        raise TypeError(f"a block format is a name or a BlockFormat, not {type(bfmt).__name__}")
    if torch.compiler.is_compiling():
        return bfmt.name
    try:
        known = block_format(bfmt.name)
    except ValueError:
        known = _UNREGISTERED.setdefault(bfmt.name, bfmt)
    if known != bfmt:
        raise ValueError(f"two block formats are named {bfmt.name!r}: rename the one made by hand")
    return bfmt.name


def lookup(name: str) -> BlockFormat:
    return _UNREGISTERED.get(name) or block_format(name)


def block_args(x, bfmt, mode, sat, bits, fraction, seed, random_bits, axis, rule) -> tuple:
    """The ops' arguments from a user's call."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, not {type(x).__name__}")
    mode = parse_mode(mode).value
    sat, bits, fraction = scalar_args(sat, bits, fraction)
    name = format_name(bfmt)
    fmt = lookup(name)
    if axis is None:
        axis = fmt.axis
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"axis must be an int, not {type(axis).__name__}")
    rule = fmt.rule if rule is None else rule
    key = None if seed is None else key_of(seed, x.device)
    return x, name, mode, sat, bits, fraction, key, random_bits, axis, rule


@functools.cache
def _spec(dtype, name, rounding, sat, bits, fraction, rule) -> BlockSpec:
    bfmt = lookup(name)
    rule = check_rule(rule, bfmt.scale)
    return make_block_spec(dtype, bfmt, rule, parse_mode(rounding), sat, bits, fraction)


def block_spec_of(x, name, rounding, sat, bits, fraction, key, random_bits, axis, rule) -> BlockSpec:
    """The checked spec of an op call; raises before anything is written."""
    if not x.is_floating_point():
        raise TypeError(f"x must be a float tensor, not {x.dtype}")
    if not -x.dim() <= axis < max(x.dim(), 1):
        raise ValueError(f"axis {axis} is out of range for a tensor of {x.dim()} dimensions")
    if x.dim() == 0:
        raise ValueError("block formats need a tensor of at least one dimension")
    spec = _spec(x.dtype, name, rounding, sat, bits, fraction, rule)
    if key is not None:
        if random_bits is not None:
            raise ValueError("give either seed (fewbit draws the bits) or random_bits, not both")
        if spec.spec.bits is None:
            raise ValueError(f"mode {rounding!r} is deterministic and takes no seed")
        if key.dtype != torch.int64 or key.shape != (2,) or key.device != x.device:
            raise ValueError(f"a key is an int64 tensor of shape (2,) on {x.device} (fewbit.random.key_of)")
    return spec


def _kernel(x, words, rand, tensor_scale, *, spec: BlockSpec, axis: int, fused: bool):
    """Round (``fused``: back to x's dtype and shape) or quantise (codes, scale codes),
    and say whether an element had no value (overflow without sat in a format without
    Inf or NaN: NaN blocks hold zeros there, so a NaN element is such an overflow)."""
    if words is not None:
        rand = range_bits(spec.spec, words, 0, x.numel(), x.device).view(x.shape)
    size = spec.bfmt.block_size
    blocks = block_layout(x, axis, size)
    rand = None if rand is None else block_layout(rand, axis, size)
    q, scale, factor = quantize_blocks(blocks, spec, rand, tensor_scale)
    invalid = torch.isnan(q).any() if not (spec.spec.sat or spec.spec.fmt.has_nans) else None
    if fused:
        return from_block_layout((q * factor).to(x.dtype), x.shape, axis), invalid
    codes = codes_of(q, spec.bfmt.element)
    if spec.bfmt.packed:
        codes = pack_pairs(codes)
    return codes.to(torch.uint8), codes_of(scale.squeeze(-1), spec.bfmt.scale).to(torch.uint8), invalid


def _run(x, spec: BlockSpec, key, random_bits, axis: int, fused: bool):
    rand = check_random_bits(x, spec.spec, random_bits) if key is None else None
    ts = tensor_scale_of(x, spec.bfmt)
    words = None
    if use_compiled(x.numel()):
        cache_key = (spec, axis, fused, x.dtype, x.device.type, key is None)
        if cache_key not in _BROKEN:
            fn = _CACHE.get(cache_key)
            if fn is None:
                fn = _CACHE[cache_key] = torch.compile(_own(_kernel, spec=spec, axis=axis, fused=fused),
                                                       fullgraph=True, dynamic=False)
            try:
                # One kernel for every shape of a rank with this length along the block axis.
                # That length stays static: a symbolic one (pad, then blocks of B) made
                # Inductor's CPU kernel 7x slower (2^20 float32, torch 2.13), and a model
                # has few widths.
                for t in (x, rand):
                    for dim in range(0 if t is None else t.dim()):
                        if dim != axis % t.dim():
                            torch._dynamo.maybe_mark_dynamic(t, dim)
                with below_autograd():
                    words = None if key is None else word_tensors(spec.spec, key)
                    return fn(x, words, rand, ts)
            except Exception as err:  # no C++ compiler, no Triton, ...: eager still works
                _BROKEN.add(cache_key)
                _warn_eager(spec.spec, x.device, err)
    if key is not None:
        words = stream_words(spec.spec, Key(*key.tolist()) if key.device.type == "cpu" else key)
    return _kernel(x, words, rand, ts, spec=spec, axis=axis, fused=fused)


def _checked_run(x, spec: BlockSpec, key, random_bits, axis: int, fused: bool) -> tuple:
    *result, invalid = _run(x, spec, key, random_bits, axis, fused)
    if invalid is not None and bool(invalid):
        raise ValueError(f"{spec.spec.fmt.name} has no Inf or NaN for a value beyond its range; use sat=True")
    return tuple(result)


def _empty_codes(x: torch.Tensor, spec: BlockSpec, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty tensors shaped as :func:`_kernel`'s codes for ``x``."""
    size = spec.bfmt.block_size
    length = x.shape[axis]
    blocks = -(-length // size)
    rows = x.numel() // length if length else 0
    width = size // 2 if spec.bfmt.packed else size
    codes = x.new_empty((rows, blocks, width), dtype=torch.uint8)
    return codes, x.new_empty((rows, blocks), dtype=torch.uint8)


@torch.library.custom_op("fewbit::block_round", mutates_args=())
def block_round_op(
    x: torch.Tensor, bfmt: str, rounding: str, sat: bool, bits: int | None, fraction: float | None,
    key: torch.Tensor | None, random_bits: torch.Tensor | None, axis: int, rule: str,
) -> torch.Tensor:
    """``fewbit.block.round`` as an operator (see there)."""
    spec = block_spec_of(x, bfmt, rounding, sat, bits, fraction, key, random_bits, axis, rule)
    if x.numel() == 0:
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    (out,) = _checked_run(x, spec, key, random_bits, axis, fused=True)
    return out.contiguous()


@block_round_op.register_fake
def _(x, bfmt, rounding, sat, bits, fraction, key, random_bits, axis, rule):
    spec = block_spec_of(x, bfmt, rounding, sat, bits, fraction, key, random_bits, axis, rule)
    if key is None:
        check_random_bits(x, spec.spec, random_bits, values=False)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _straight_through(ctx, grad: torch.Tensor):
    return (grad,) + (None,) * 9


torch.library.register_autograd("fewbit::block_round", _straight_through)


@torch.library.custom_op("fewbit::block_quantize", mutates_args=())
def block_quantize_op(
    x: torch.Tensor, bfmt: str, rounding: str, sat: bool, bits: int | None, fraction: float | None,
    key: torch.Tensor | None, random_bits: torch.Tensor | None, axis: int, rule: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fewbit.block.quantize`` as an operator: element codes ``(rows, blocks, B)``
    (``B / 2`` bytes when packed), scale codes ``(rows, blocks)`` and the per-tensor
    scale (float32, 1 for formats without one)."""
    spec = block_spec_of(x, bfmt, rounding, sat, bits, fraction, key, random_bits, axis, rule)
    ts = tensor_scale_of(x, spec.bfmt)
    ts = torch.ones((), device=x.device) if ts is None else ts
    if x.numel() == 0:
        return (*_empty_codes(x, spec, axis), ts)
    codes, scales = _checked_run(x, spec, key, random_bits, axis, fused=False)
    return codes, scales, ts.clone()


@block_quantize_op.register_fake
def _(x, bfmt, rounding, sat, bits, fraction, key, random_bits, axis, rule):
    spec = block_spec_of(x, bfmt, rounding, sat, bits, fraction, key, random_bits, axis, rule)
    if key is None:
        check_random_bits(x, spec.spec, random_bits, values=False)
    return (*_empty_codes(x, spec, axis), x.new_empty((), dtype=torch.float32))
