"""Reference rounding: the paper's equations, one element at a time, in exact arithmetic.

For a finite ``x != 0`` with magnitude ``|x|`` and a target of precision ``P``:

- ``e = max(floor(log2 |x|), emin)``  (the clamp gives subnormals),
- ``ulp = 2^(e - P + 1)``, ``s = |x| / ulp``,
- ``d = s - floor(s)``, the fraction rounded away,
- result magnitude ``(floor(s) + [R(d)]) * ulp``, where the predicate ``R`` says
  "round away from zero".

This module is the specification: slow, readable, and the source of the predicates
that ``fewbit.bias`` integrates. The fast implementation is tested against it.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import torch

from ..formats import FloatFormat
from .checks import RoundSpec, check_random_bits, check_round_args, no_result
from .fast import bits_of, float32_value
from .modes import MODES, RoundMode

__all__ = ["fraction_to_bits", "probability_away", "round_away", "round_reference"]


def fraction_to_bits(d: Fraction, bits: int, tie: str) -> int:
    """``d * 2^N`` rounded to an integer: truncated, or to nearest with ties ``up``,
    to ``even`` or to ``odd``. The result lies in ``[0, 2^N]``."""
    scaled = d * (1 << bits)
    low = math.floor(scaled)
    rest = scaled - low
    if tie == "truncate" or rest < Fraction(1, 2):
        return low
    if rest > Fraction(1, 2) or tie == "up":
        return low + 1
    low_is_odd = low % 2 == 1
    return low + (low_is_odd if tie == "even" else not low_is_odd)


def round_away(
    mode: RoundMode,
    d: Fraction,
    *,
    odd: bool = False,
    negative: bool = False,
    n: int | None = None,
    bits: int | None = None,
) -> bool:
    """The predicate ``R(d)``: round the magnitude away from zero?

    ``odd``: the truncated result's last code bit is 1. ``n``: the N-bit random
    integer of the stochastic modes, whose tie rule comes from the mode table; for the
    stagnation modes this is their SR part (where it applies is decided in
    :func:`_round_magnitude`).
    """
    if mode is RoundMode.RNE:
        return d > Fraction(1, 2) or (d == Fraction(1, 2) and odd)
    if mode is RoundMode.RNA:
        return d >= Fraction(1, 2)
    if mode is RoundMode.RTZ:
        return False
    if mode is RoundMode.RUP:
        return d > 0 and not negative
    if mode is RoundMode.RDN:
        return d > 0 and negative
    if mode is RoundMode.RTO:
        return d > 0 and not odd
    return fraction_to_bits(d, bits, MODES[mode].tie) + n >= (1 << bits)


def probability_away(mode: RoundMode, d: Fraction, bits: int) -> Fraction:
    """Exact probability that a few-bit SR mode rounds a fraction ``d`` away, over
    uniformly random N-bit ``n``: the count of ``n`` with ``d_N + n >= 2^N``, / 2^N."""
    return Fraction(fraction_to_bits(d, bits, MODES[mode].tie), 1 << bits)


def _floor_log2(a: Fraction) -> int:
    e = a.numerator.bit_length() - a.denominator.bit_length()
    return e if Fraction(2) ** e <= a else e - 1


def _round_magnitude(a: Fraction, spec: RoundSpec, negative: bool, n: int | None) -> Fraction:
    """Round a finite magnitude to the target's grid (ignoring its range)."""
    fmt, mode = spec.fmt, spec.mode
    e = max(_floor_log2(a), fmt.emin) if a else fmt.emin
    ulp = Fraction(2) ** (e - fmt.t)
    s = a / ulp
    floor_s = math.floor(s)
    d = s - floor_s
    if fmt.p > 1:
        odd = floor_s % 2 == 1
    else:  # P = 1: the code's last bit is the exponent field's.
        odd = floor_s != 0 and (e + fmt.bias) % 2 == 1

    def away(m: RoundMode, rand: int | None = None) -> bool:
        return round_away(m, d, odd=odd, negative=negative, n=rand, bits=spec.bits)

    info = MODES[mode]
    if info.takes_fraction:  # the selection bits lie above the N rounding bits
        select, n = n >> spec.bits, n & ((1 << spec.bits) - 1)
    if info.where == "near_zero":
        rne_gives_zero = floor_s == 0 and not away(RoundMode.RNE)
        up = away(mode, n) if rne_gives_zero else away(RoundMode.RNE)
    elif info.where == "selected":
        up = away(mode, n) if select < spec.select_below else away(RoundMode.RNE)
    else:
        up = away(mode, n)
    return (floor_s + up) * ulp


def _directed_to_limit(mode: RoundMode, negative: bool) -> bool:
    """Whether an overflow stops at the largest finite value (the mode table's
    ``stops_at_max``: directed modes never round up in magnitude past it)."""
    rule = MODES[mode].stops_at_max
    return rule == "everywhere" or rule == ("negative" if negative else "positive")


def _beyond_range(fmt: FloatFormat, negative: bool) -> float:
    """What an overflow becomes without saturation: Inf, else NaN, else an error."""
    if fmt.extended and (fmt.signed or not negative):
        return -math.inf if negative else math.inf
    if fmt.has_nans:
        return math.nan
    raise no_result(fmt, nan_input=False)


def _round_scalar(v: float, spec: RoundSpec, n: int | None) -> float:
    fmt = spec.fmt
    if math.isnan(v):
        if not fmt.has_nans:
            raise no_result(fmt, nan_input=True)
        return math.nan
    negative = math.copysign(1.0, v) < 0
    limit = Fraction(fmt.max_negative_magnitude if negative else fmt.max)
    if math.isinf(v):
        magnitude = None
    else:
        magnitude = _round_magnitude(_exact_fraction(abs(v)), spec, negative, n)
        if magnitude > limit and _directed_to_limit(spec.mode, negative):
            magnitude = limit
    if magnitude is None or magnitude > limit:
        if not spec.sat:
            return _beyond_range(fmt, negative)
        magnitude = limit
    if magnitude == 0:
        if not fmt.has_zero:
            return fmt.smallest_normal
        return -0.0 if negative and fmt.has_nz else 0.0
    if magnitude < _SMALLEST_NORMAL64:  # a float64 subnormal from its bits: the division gives 0 under FTZ
        value = struct.unpack("<d", struct.pack("<q", int(magnitude * 2**1074)))[0]
    else:
        value = float(magnitude)
    return math.copysign(value, -1.0 if negative else 1.0)


_SMALLEST_NORMAL64 = Fraction(1, 2**1022)


def _exact_fraction(a: float) -> Fraction:
    """A finite ``a >= 0`` as a Fraction; a float64 subnormal from its bits (Fraction(a)
    reads it through frexp, which gives 0 under DAZ)."""
    if a < 2.0**-1022:
        return Fraction(struct.unpack("<q", struct.pack("<d", a))[0], 2**1074)
    return Fraction(a)


def round_reference(
    x: torch.Tensor,
    fmt: FloatFormat | str,
    mode: RoundMode | str = "rne",
    *,
    sat: bool = False,
    bits: int | None = None,
    random_bits: torch.Tensor | None = None,
    fraction: float | None = None,
) -> torch.Tensor:
    """Same contract as :func:`fewbit.round`, computed element by element in exact
    rational arithmetic. Slow: for tests and documentation."""
    spec = check_round_args(x, fmt, mode, sat, bits, fraction)
    check_random_bits(x, spec, random_bits)
    values = _exact_values(x)
    rand = random_bits.cpu().flatten().tolist() if random_bits is not None else [None] * len(values)
    out = [_round_scalar(v, spec, n) for v, n in zip(values, rand, strict=True)]
    if x.dtype == torch.float64:
        result = torch.tensor(out, dtype=torch.float64)
    else:  # (through float32's bits, exactly: see _exact_values)
        result = torch.tensor([bits_of(v, torch.float32) for v in out], dtype=torch.int32).view(torch.float32)
    return result.reshape(x.shape).to(x.dtype).to(x.device)


def _exact_values(x: torch.Tensor) -> list[float]:
    """x's values as Python floats. A float32 subnormal (bfloat16's too) is read from its
    bits: a float conversion, to float64 or back, reads or makes it as 0 under
    torch.set_flush_denormal(True) (DAZ and FTZ)."""
    x = x.detach().cpu().flatten()
    if x.dtype == torch.float64:
        return x.tolist()
    return [float32_value(b) for b in x.float().view(torch.int32).tolist()]  # (16 bits to float32: exact)
