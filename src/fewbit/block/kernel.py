"""Block quantisation in plain torch ops: one reduction for each block's amax, one
elementwise pass that scales, rounds and (for ``round``) scales back.

The same Python runs eager and under ``torch.compile`` (``ops`` compiles it once per
spec), so both give the same bits; native.cpp's block path computes it too, on a CPU for
blocks along the last axis with E8M0 or E4M3 scales (tests/test_native.py). Layout:
``x`` with the block axis moved last, padded with zeros to whole blocks and viewed as
``(rows, blocks, B)``; random bits are drawn for x's own flat indices and laid out the
same way, so element ``i`` of x takes the bits ``fewbit.round`` would give it.

Scaled values ``x / S``: exact for power-of-two scales, one correctly rounded division for
NVFP4's. Where the quotient falls below the working float's normal range it is replaced by
``±2^emin`` of that float: every value in ``(0, 2^-125)`` rounds alike in every mode to an
element format whose smallest subnormal is at least ``2^-92`` (SR reads at most 32 bits
of the fraction), and the working float is float64 for element formats finer than that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import FloatFormat, format
from ..rounding.checks import RoundSpec, make_spec
from ..rounding.compiled import round_body
from ..rounding.modes import RoundMode
from .formats import BlockFormat

__all__ = ["BlockSpec", "block_layout", "block_scales", "quantize_blocks"]

#: An element format whose smallest subnormal is below 2^-92 is rounded in float64 (see above).
_FLOAT32_FLOOR = -92
_FLOAT32_SMALLEST = format("binary32").smallest_subnormal


@dataclass(frozen=True)
class BlockSpec:
    """Validated arguments of one block call: the format, the rule in force and the
    element rounding (``spec``: a ``RoundSpec`` for x's dtype)."""

    bfmt: BlockFormat
    rule: str
    spec: RoundSpec
    scale_spec: RoundSpec | None  # amax / M to a scale with a significand (E4M3, float32)

    @property
    def work_dtype(self) -> torch.dtype:
        return work_dtype(self.bfmt, self.spec.source.k == 64)

    @property
    def may_refuse(self) -> bool:
        """Whether an element may have no value, found only once rounded: overflow without
        sat in an element format without Inf or NaN (a NaN is held in the scale)."""
        return not (self.spec.sat or self.spec.fmt.has_nans)


def work_dtype(bfmt: BlockFormat, wide: bool) -> torch.dtype:
    """The dtype a block's values ``q * S`` are formed in: float64 for float64 data
    (``wide``) or an element format finer than float32 holds, else float32."""
    fine = bfmt.element.min_ulp_exponent < _FLOAT32_FLOOR
    return torch.float64 if fine or wide else torch.float32


def make_block_spec(dtype: torch.dtype, bfmt: BlockFormat, rule: str, mode: RoundMode, sat: bool,
                    bits: int | None, fraction: float | None) -> BlockSpec:
    scale_spec = None
    if not bfmt.power_of_two:
        # To nearest, or up for rule "up"; saturating: an Inf block takes the largest scale.
        scale_mode = RoundMode.RNE if rule == "nearest" else RoundMode.RUP
        scale_spec = make_spec(torch.float64, bfmt.scale, scale_mode, True, None, None)
    element = make_spec(dtype, bfmt.element, mode, sat, bits, fraction, held=False)
    return BlockSpec(bfmt, rule, element, scale_spec)


def block_layout(t: torch.Tensor, axis: int, block_size: int) -> torch.Tensor:
    """``t`` with ``axis`` moved last, zero-padded to whole blocks, as ``(rows, blocks, B)``."""
    moved = t.movedim(axis, -1)
    length = moved.shape[-1]
    pad = -length % block_size  # no branch on it: a compiled kernel serves padded and whole rows
    moved = torch.nn.functional.pad(moved, (0, pad))
    return moved.reshape(-1, (length + pad) // block_size, block_size)


def from_block_layout(blocks: torch.Tensor, shape: torch.Size, axis: int) -> torch.Tensor:
    """The inverse of :func:`block_layout` for a tensor of ``shape``."""
    # (Not list.pop(axis): Dynamo may make axis a symbol, which it cannot pop at.)
    if not -len(shape) <= axis < len(shape):  # (a BlockTensor made by hand)
        raise IndexError(f"block axis {axis} is out of range for a tensor of {len(shape)} dimensions")
    axis %= len(shape)
    moved_shape = [n for d, n in enumerate(shape) if d != axis]
    length = shape[axis]
    padded = blocks.shape[-2] * blocks.shape[-1]  # (not -1: ambiguous for a tensor with no rows)
    flat = blocks.reshape(*moved_shape, padded)[..., :length]
    return flat.movedim(-1, axis)


def _pow2(e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``2^e`` for integer ``e`` in ``[-1022, 1023]``, built from float64 bits (exact)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64).to(dtype)


def _exponent_of(amax: torch.Tensor, rule: str, element: FloatFormat) -> torch.Tensor:
    """The power-of-two scale's exponent ``e`` for each block, by ``rule``, clipped to
    E8M0's ``[-127, 127]`` (an all-zero block takes -127, as gfloat does)."""
    a = amax.to(torch.float64)
    bits = a.view(torch.int64)
    floor_log2 = ((bits >> 52) & 0x7FF) - 1023  # exact for every float32 amax; Inf gives 1024
    m = ((bits & ((1 << 52) - 1)) | (1023 << 52)).view(torch.float64)  # amax / 2^floor_log2, in [1, 2)
    e = floor_log2 - element.emax
    if rule == "ceil":
        e = e + (m > 1).to(e.dtype)
    elif rule == "rceil":
        e = e + (m * 2.0**element.emax > element.max).to(e.dtype)
    elif rule == "even":
        e = e + (m >= 2.0 - 2.0**-element.top_p).to(e.dtype)  # (intM: P less its sign bit)
    return torch.where(a == 0, -127, e).clamp(-127, 127)


def block_scales(
    amax: torch.Tensor, spec: BlockSpec, tensor_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, S)`` per block: ``scale`` holds values of the scale format (in the
    working dtype), ``S`` the factor elements are multiplied by (``scale`` times the
    per-tensor scale where the format has one). A block holding a NaN gets NaN."""
    bfmt, work = spec.bfmt, spec.work_dtype
    if bfmt.power_of_two:
        scale = _pow2(_exponent_of(amax, spec.rule, bfmt.element), work)
    else:
        target = amax.to(torch.float64) / bfmt.element.max
        if tensor_scale is not None:
            target = target / tensor_scale.to(torch.float64)
        scale = round_body(target, spec.scale_spec, None).to(work)
    scale = torch.where(torch.isnan(amax), torch.nan, scale)
    factor = scale if tensor_scale is None else (scale.float() * tensor_scale).to(work)
    if spec.rule == "up" and tensor_scale is not None:
        # S = scale * ts rounds to nearest in float32, maybe below amax / M: the next scale
        # then (E4M3's values lie at least 1/16 apart, so 1 + 2^-5 lies below the next).
        short = factor.to(torch.float64) * bfmt.element.max < amax.to(torch.float64)
        bumped = round_body(scale.to(torch.float64) * (1 + 2.0**-5), spec.scale_spec, None).to(work)
        scale = torch.where(short, bumped, scale)
        factor = (scale.float() * tensor_scale).to(work)
    return scale, factor


def finite_amax(x: torch.Tensor, found: float | torch.Tensor | None = None) -> torch.Tensor:
    """``x``'s largest finite magnitude, a 0-d float32 tensor on x's device (0 for a
    tensor without one); float64 data's rounded up to float32 (to nearest, it could land
    below the data, and rule "up" clip). ``found``: that magnitude where the caller has
    it (the native kernel finds it in one read, as a float; the GPU's as a 0-d float32
    tensor)."""
    if isinstance(found, torch.Tensor):
        return found
    if found is not None:
        return torch.tensor(found, dtype=torch.float32, device=x.device)
    if not x.numel():
        return torch.zeros((), device=x.device)
    amax = torch.where(torch.isfinite(x), x, 0).abs().amax()
    rounded = amax.to(torch.float32)
    if amax.dtype == torch.float64:
        above = torch.nextafter(rounded, torch.full_like(rounded, torch.inf))
        rounded = torch.where(rounded.double() < amax, above, rounded)
    return rounded


def divided(a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
    """``a / b`` correctly rounded in a's dtype on every device, compiled too: Inductor
    writes a float32 division on a GPU as Triton's, which is not correctly rounded
    (``div.full.f32``, up to 2 ulp off), where the CPU's is. Divided in float64 (Triton's
    is ``div.rn.f64``) and rounded back, it is: 53 >= 2 * 24 + 2 bits make the double
    rounding innocuous. (On a CPU the float32 division is kept: it is correctly rounded,
    and twice as fast.)"""
    if a.dtype != torch.float32 or a.device.type == "cpu":
        return a / b
    return (a.double() / (b.double() if isinstance(b, torch.Tensor) else b)).float()


def tensor_scale_of(x: torch.Tensor, bfmt: BlockFormat, amax: float | torch.Tensor | None = None,
                    rule: str | None = None) -> torch.Tensor | None:  # fmt: skip
    """NVFP4's per-tensor float32 scale: the finite amax over the largest value a block
    can hold (``M * scale max``), so the largest block scale lands on the scale format's
    maximum; 1 for a tensor without a finite nonzero value. ``amax``: as
    :func:`finite_amax`'s ``found`` (a sharded tensor's: the largest of every rank's).
    Under ``rule`` "up" (default: the format's), raised by float32 steps until that
    maximum's S, its product with the scale rounded to float32, is at least amax / M, so
    that no block clips (to nearest, both may round down).

    The scale is a float32, at its limits: float64 data beyond float32's range take
    float32's largest value as amax (their blocks saturate), and a tiny amax whose
    quotient underflows takes float32's smallest positive value (1 would flush them all)."""
    if not bfmt.tensor_scale:
        return None
    found = finite_amax(x, amax).clamp(max=torch.finfo(torch.float32).max)
    ts = divided(found, bfmt.element.max * bfmt.scale.max).clamp(min=_FLOAT32_SMALLEST)
    if (rule or bfmt.rule) == "up":
        # ts and S, each rounded to nearest, are at least (1 - 2^-24) of their quotient and
        # product, and a float32 step raises ts by at least 2^-24 of it: three steps suffice.
        inf = torch.full_like(ts, torch.inf)  # (made on the device: a tensor copied there waits for it)
        for _ in range(3):
            short = (ts * bfmt.scale.max).double() * bfmt.element.max < found.double()
            ts = torch.where(short, torch.nextafter(ts, inf), ts)
    return torch.where(found > 0, ts, 1.0)


def quantize_blocks(
    blocks: torch.Tensor, spec: BlockSpec, rand: torch.Tensor | None, tensor_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantise ``blocks`` (``(rows, blocks, B)``): returns ``(q, scale, S)``, ``q`` the
    element values (working dtype, the layout of ``blocks``), ``scale`` and ``S`` per
    block (:func:`block_scales`). ``rand``: the random bits in the layout of ``blocks``."""
    work = blocks.to(spec.work_dtype)
    amax = work.abs().amax(dim=-1, keepdim=True)
    scale, factor = block_scales(amax, spec, tensor_scale)
    scaled = divided(work, factor)
    tiny = torch.finfo(spec.work_dtype).tiny
    underflow = (scaled.abs() < tiny) & (work != 0)
    scaled = torch.where(underflow, torch.copysign(torch.full_like(work, tiny), work), scaled)
    # A scale that underflowed holds zeros, each with its element's sign (E2M1 has a -0).
    scaled = torch.where(factor == 0, torch.copysign(torch.zeros_like(work), work), scaled)
    # In a NaN block the scale carries the NaN; elements without a NaN code hold 0.
    fill = torch.nan if spec.spec.fmt.has_nans else 0.0
    scaled = torch.where(torch.isnan(factor), fill, scaled)
    q = round_body(scaled.reshape(-1), spec.spec, None if rand is None else rand.reshape(-1))
    return q.view(work.shape), scale, factor
