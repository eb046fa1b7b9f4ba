"""Block quantisation block by block, as the formats' descriptions state it: slow, for
tests and documentation. The kernel (``kernel``) must agree with it bit for bit.

For each block of ``B`` values along the axis (zero-padded at the end):

1. ``amax = max |x_i|``;
2. the scale: for E8M0, ``S = 2^e`` with ``e`` from the rule (``floor``: ``floor(log2
   amax) - E``; ``ceil``: ``ceil(log2 amax) - E``; ``rceil``: the smallest ``e`` with
   ``amax <= M 2^e``; ``even``: ``floor(log2 amax') - E`` with ``amax'`` = amax rounded
   to ``P`` bits, ties to even), ``e`` clipped to ``[-127, 127]``, -127 for an all-zero
   block; for E4M3/float32, ``amax / M`` (over the per-tensor scale, if any) rounded to
   the scale format (``nearest``: ties to even; ``up``), times the per-tensor scale in
   float32. The per-tensor scale (NVFP4) is the tensor's largest finite magnitude in
   float32 (rounded up from float64; at most float32's largest value) over ``M`` times
   the scale format's largest, at least float32's smallest positive value; 1 for a
   tensor without a finite nonzero value. Under ``up``, both are raised until nothing
   clips: the block's scale to the next one while ``M S < amax``, the per-tensor scale by
   float32 steps while the largest scale's ``S`` gives ``M S < amax`` for the tensor's
   largest magnitude. NaN anywhere in the block makes ``S`` NaN;
3. ``q_i`` = ``x_i / S`` rounded to the element format (``fewbit.rounding.round_reference``),
   the quotient one division in the working float (``kernel.work_dtype``: float64 for
   float64 data, else float32) where S is not a power of two; a nonzero quotient below
   that float's normal range counts as its smallest normal (which every mode rounds as
   the exact quotient);
4. the block's values are ``q_i * S``.

It computes in float64, where every float32 value (subnormals too) is normal, and rounds
to float32 with ``round_reference`` where the steps above do: float64 and Python floats
then give the same bits whatever ``torch.set_flush_denormal`` says (a float32 op, or a
float conversion, reads and makes float32 subnormals as 0 under its DAZ and FTZ).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch

from ..rounding.checks import make_spec, scalar_args
from ..rounding.fast import bits_of
from ..rounding.modes import MODES, RoundMode, parse_mode
from ..rounding.reference import _exact_values, round_reference
from .formats import BlockFormat, format
from .kernel import work_dtype

__all__ = ["block_round_reference", "scale_reference", "tensor_scale_reference"]


def _exponent(amax: float, rule: str, bfmt: BlockFormat) -> int:
    element = bfmt.element
    if amax == 0:
        return -127
    if math.isinf(amax):
        return 127
    floor_log2 = math.frexp(amax)[1] - 1
    if rule == "floor":
        e = floor_log2 - element.emax
    elif rule == "ceil":
        e = floor_log2 + (amax != 2.0**floor_log2) - element.emax
    elif rule == "rceil":
        e = floor_log2 - element.emax - 1
        while amax > element.max * 2.0**e:
            e += 1
    else:  # even
        ulp = Fraction(2) ** (floor_log2 - element.top_p + 1)  # (intM: P less its sign bit)
        rounded = round(Fraction(amax) / ulp) * ulp  # Fraction rounds half to even
        e = math.floor(math.log2(rounded)) - element.emax
    return min(max(e, -127), 127)


def scale_reference(amax: float, bfmt: BlockFormat, rule: str, tensor_scale: float | None) -> float:
    """A block's factor ``S`` (step 2 above)."""
    if math.isnan(amax):
        return math.nan
    if bfmt.power_of_two:
        return 2.0 ** _exponent(amax, rule, bfmt)
    target = amax / bfmt.element.max / (1.0 if tensor_scale is None else tensor_scale)
    mode = "rne" if rule == "nearest" else "rup"
    scale = _to_scale(target, bfmt, mode)
    if tensor_scale is None:
        return scale
    factor = _float32(scale * tensor_scale)
    if rule == "up" and bfmt.element.max * factor < amax and scale < bfmt.scale.max:
        scale = _to_scale(math.nextafter(scale, math.inf), bfmt, "rup")  # the next scale
        factor = _float32(scale * tensor_scale)
    return factor


def _to_scale(target: float, bfmt: BlockFormat, mode: str) -> float:
    return round_reference(torch.tensor([target], dtype=torch.float64), bfmt.scale, mode, sat=True).item()


def _float32(value: float, mode: str = "rne") -> float:
    """``value`` (a float64: a product of two float32s is exact) rounded to float32, as a
    float32 op or conversion rounds it (for a quotient formed in float64, the double
    rounding is innocuous: 53 >= 2 * 24 + 2 bits)."""
    return round_reference(torch.tensor([value], dtype=torch.float64), "binary32", mode).item()


def _next_float32(value: float) -> float:
    """The float32 after a float32 ``value > 0``."""
    return value + 2.0 ** (max(math.frexp(value)[1] - 1, -126) - 23)


def _as_float32(values: torch.Tensor) -> torch.Tensor:
    """float64 ``values`` to nearest in float32, through float32's bits."""
    rounded = round_reference(values.flatten(), "binary32", "rne").tolist()
    bits = torch.tensor([bits_of(v, torch.float32) for v in rounded], dtype=torch.int32)
    return bits.view(torch.float32).reshape(values.shape)


def tensor_scale_reference(amax: float, bfmt: BlockFormat, rule: str) -> float:
    """The per-tensor scale for a tensor whose largest finite magnitude is ``amax``
    (step 2 above)."""
    # float64 data: the float32 at or above (kernel.finite_amax)
    amax_t = _float32(min(amax, float(np.finfo(np.float32).max)), "rup")
    if not amax_t:
        return 1.0
    top = bfmt.element.max * bfmt.scale.max
    ts = max(_float32(amax_t / top), 2.0**-149)
    while rule == "up" and bfmt.element.max * _float32(ts * bfmt.scale.max) < amax_t:
        ts = _next_float32(ts)
    return ts


def block_round_reference(
    x: torch.Tensor, bfmt: BlockFormat | str, mode: str = "rne", *, axis: int | None = None,
    bits: int | None = None, random_bits: torch.Tensor | None = None, fraction: float | None = None,
    rule: str | None = None, sat: bool = True,
) -> torch.Tensor:
    """Same contract as ``fewbit.block.round``, computed block by block."""
    bfmt = format(bfmt)
    # The op's N (make_spec with held=False: a default N is min(D, 32) for the quotients
    # x / S, float32 for data of up to 32 bits), passed on explicitly: the float64 this
    # works in would give another.
    mode = parse_mode(mode)
    bits = make_spec(x.dtype, bfmt.element, mode, *scalar_args(sat, bits, fraction), held=False).bits
    if MODES[mode].bits == "natural":  # classical SR is src with that N
        mode = RoundMode.SRC
    axis = bfmt.axis if axis is None else axis
    rule = rule or bfmt.rule
    size = bfmt.block_size
    moved = x.detach().movedim(axis, -1)
    values = np.array(_exact_values(moved), dtype=np.float64).reshape(moved.shape)
    work = np.float64 if work_dtype(bfmt, x.dtype == torch.float64) == torch.float64 else np.float32
    rand = None if random_bits is None else random_bits.movedim(axis, -1).cpu().numpy()
    tensor_scale = None
    if bfmt.tensor_scale:
        finite = values[np.isfinite(values)]
        tensor_scale = tensor_scale_reference(float(np.abs(finite).max()) if finite.size else 0.0, bfmt, rule)
    out = np.empty_like(values)
    for row in np.ndindex(values.shape[:-1]):
        for start in range(0, values.shape[-1], size):
            block = values[row][start : start + size]
            scale = scale_reference(float(np.abs(block).max()), bfmt, rule, tensor_scale)
            if math.isnan(scale):
                out[row][start : start + size] = np.nan
                continue
            if bfmt.power_of_two:
                scaled = block / scale  # exact: a power of two
            elif scale:  # one division in the working float; a nonzero quotient below its
                # normal range rounds as the exact one does, so it counts as the smallest normal
                quotient = block / scale
                if work == np.float32:
                    quotient = round_reference(torch.from_numpy(quotient), "binary32", "rne").numpy()
                tiny = np.finfo(work).tiny
                flushed = (np.abs(quotient) < tiny) & (block != 0)
                scaled = np.where(flushed, np.copysign(tiny, block), quotient).astype(np.float64)
            else:  # a scale that underflowed holds zeros, signed as x (0 * -x is -0)
                scaled = 0 * block
            n = None if rand is None else torch.from_numpy(rand[row][start : start + size].copy())
            q = round_reference(torch.from_numpy(np.asarray(scaled, dtype=np.float64)), bfmt.element, mode,
                                sat=sat, bits=bits, random_bits=n, fraction=fraction)
            out[row][start : start + size] = q.numpy() * scale
    result = torch.from_numpy(out).movedim(-1, axis)
    return result if x.dtype == torch.float64 else _as_float32(result).to(x.dtype)
