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
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch

from ..rounding.checks import make_spec, scalar_args
from ..rounding.modes import MODES, RoundMode, parse_mode
from ..rounding.reference import round_reference
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
    factor = float(np.float32(scale) * np.float32(tensor_scale))
    if rule == "up" and bfmt.element.max * factor < amax and scale < bfmt.scale.max:
        scale = _to_scale(math.nextafter(scale, math.inf), bfmt, "rup")  # the next scale
        factor = float(np.float32(scale) * np.float32(tensor_scale))
    return factor


def _to_scale(target: float, bfmt: BlockFormat, mode: str) -> float:
    return round_reference(torch.tensor([target], dtype=torch.float64), bfmt.scale, mode, sat=True).item()


def tensor_scale_reference(amax: float, bfmt: BlockFormat, rule: str) -> float:
    """The per-tensor scale for a tensor whose largest finite magnitude is ``amax``
    (step 2 above)."""
    bounded = min(amax, float(np.finfo(np.float32).max))
    amax_t = np.float32(bounded)
    if float(amax_t) < bounded:  # float64 data: the float32 above (kernel.finite_amax)
        amax_t = np.nextafter(amax_t, np.float32(np.inf))
    if not amax_t:
        return 1.0
    top = bfmt.element.max * bfmt.scale.max
    ts = max(np.float32(amax_t / np.float32(top)), np.float32(2.0**-149))
    while rule == "up" and bfmt.element.max * float(ts * np.float32(bfmt.scale.max)) < float(amax_t):
        ts = np.nextafter(ts, np.float32(np.inf))
    return float(ts)


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
    values = x.detach().double().movedim(axis, -1).cpu().numpy()
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
                quotient = block.astype(work) / work(scale)
                tiny = np.finfo(work).tiny
                flushed = (np.abs(quotient) < tiny) & (block != 0)
                scaled = np.where(flushed, np.copysign(tiny, block), quotient).astype(np.float64)
            else:  # a scale that underflowed holds zeros, signed as x (0 * -x is -0)
                scaled = 0 * block
            n = None if rand is None else torch.from_numpy(rand[row][start : start + size].copy())
            q = round_reference(torch.from_numpy(np.asarray(scaled, dtype=np.float64)), bfmt.element, mode,
                                sat=sat, bits=bits, random_bits=n, fraction=fraction)
            out[row][start : start + size] = q.numpy() * scale
    return torch.from_numpy(out).movedim(-1, axis).to(x.dtype)
