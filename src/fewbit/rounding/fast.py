"""Fast rounding on the input's bit pattern: integer shifts, masks and compares only.

The input is viewed as integers of its working float (float32 for 16-bit inputs,
whose values it holds exactly, else the input's own dtype). With ``M`` trailing
bits in the working float, an input magnitude is ``sig * 2^(e_x - M)`` where ``sig``
carries the implicit bit. For a target of precision ``P = t + 1``:

- ``e_t = max(e_x, emin)`` is the target binade, ``D = M - t + (e_t - e_x)`` the
  number of bits discarded (the paper's D, per element),
- ``r = sig >> D`` is ``floor(s)`` and ``rem = sig mod 2^D`` holds ``d = rem / 2^D``,
- the mode's predicate gives ``away``; ``r + away`` is the target significand.

Shifts are clamped where more would only shift in zeros, so no shift leaves the
word. There is no Python branch on data, and every step is an elementwise torch op,
so ``torch.compile`` can fuse the whole function into one kernel.
"""

from __future__ import annotations

import math
import struct

import torch

from .checks import RoundSpec
from .modes import MODES, RoundMode

__all__ = ["INT_LAYOUT", "bits_of", "decompose", "float32_item", "float32_value", "narrowed", "round_fast",
           "working_dtype"]

# (integer view, trailing significand bits M, exponent bias) of each working float.
INT_LAYOUT = {
    torch.float32: (torch.int32, 23, 127),
    torch.float64: (torch.int64, 52, 1023),
}


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """The float dtype the bit arithmetic runs in for an input dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def bits_of(value: float, dtype: torch.dtype) -> int:
    """Integer bit pattern of a Python float in the working float ``dtype`` (a value it
    holds: a format's constant)."""
    if dtype == torch.float64:
        return struct.unpack("<q", struct.pack("<d", value))[0]
    if 0 < abs(value) < 2.0**-126:
        # A float32 subnormal (E8M0's 2^-127): its bits count its smallest subnormals. The
        # C library's conversion to float gives 0 under torch.set_flush_denormal(True).
        return int(abs(value) * 2.0**149) | (_sign_mask(dtype) if value < 0 else 0)
    return struct.unpack("<i", struct.pack("<f", value))[0]


def narrowed(v: torch.Tensor, dtype: torch.dtype = torch.float32, flushed: bool = True) -> torch.Tensor:
    """float64 ``v`` to nearest (ties to even) in float32, then in ``dtype`` (float64: ``v``
    itself): as the conversion rounds, but, where the thread flushes (``flushed``), a
    float32 subnormal is made from its bits, the count of 2^-149 in it rounded in float64
    (exact), where FTZ would make the conversion's 0 (``torch.set_flush_denormal(True)``)."""
    if dtype == torch.float64:
        return v
    if not flushed:
        return v.float().to(dtype)
    magnitude = v.abs()
    count = torch.round(magnitude * 2.0**149).to(torch.int32)  # (ties to even; used below 2^23)
    subnormal = torch.where(torch.signbit(v), count | -(1 << 31), count).view(torch.float32)
    return torch.where(magnitude < 2.0**-126, subnormal, v.float()).to(dtype)


def float32_value(bits: int) -> float:
    """The Python float a float32 bit pattern (as an int) holds, the inverse of
    :func:`bits_of`. A subnormal is made from its bits: the C conversion of a float32 to a
    float reads it as 0 under torch.set_flush_denormal(True) (DAZ)."""
    if bits & 0x7F800000:  # normal, Inf or NaN
        return struct.unpack("<f", struct.pack("<i", bits))[0]
    return math.copysign(math.ldexp(bits & 0x7FFFFF, -149), -1.0 if bits < 0 else 1.0)


def float32_item(t: torch.Tensor) -> float:
    """The Python float a one-element float32 tensor holds, from its bits (``float(t)``
    reads a subnormal as 0 under torch.set_flush_denormal(True): :func:`float32_value`)."""
    return float32_value(int(t.view(torch.int32)))


def _fraction_to_bits(rem, D, bits: int, tie: str, max_shift: int):
    """``d * 2^N`` rounded to an integer by the tie rule, where ``d = rem / 2^D``.

    ``rem`` holds every nonzero bit of the fraction (it is ``sig`` itself when
    ``D`` exceeds the significand), so clamping the right shift at ``max_shift``
    (more than ``sig``'s width) keeps the result exact: everything shifts out and the
    remainder stays below one half.
    """
    shift = D - bits
    right = shift.clamp(0, max_shift)
    left = (-shift).clamp(0, bits)
    q = rem >> right
    if tie == "truncate":
        return torch.where(shift > 0, q, rem << left)
    low2 = (rem & ((1 << right) - 1)) << 1  # twice the bits shifted out
    half2 = 1 << right  # ... compared with twice one half
    if tie == "up":
        up = low2 >= half2
    else:
        q_odd = (q & 1) == 1
        tie_up = q_odd if tie == "even" else ~q_odd
        up = (low2 > half2) | ((low2 == half2) & tie_up)
    return torch.where(shift > 0, q + up.to(q.dtype), rem << left)


def _few_bit_away(rem, D, n, bits: int, tie: str, max_shift: int):
    """Few-bit SR: round away iff ``d_N + n >= 2^N``, written so no sum can overflow."""
    wide = bits >= 31  # 2^N then needs more than int32
    if wide:
        rem, D = rem.to(torch.int64), D.to(torch.int64)
    d_n = _fraction_to_bits(rem, D, bits, tie, max_shift)
    n = n.to(d_n.dtype)
    return n > ((1 << bits) - 1) - d_n


def _sign_mask(dtype: torch.dtype) -> int:
    """The sign bit of the integer view, as a (negative) Python int."""
    M = INT_LAYOUT[dtype][1]
    return -(1 << (M + (11 if dtype == torch.float64 else 8)))


def decompose(x: torch.Tensor, emin: int):
    """Split a float32/float64 tensor into ``(negative, is_inf, is_nan, e_x, sig)``.

    For finite x, ``|x| = sig * 2^(e_x - M)`` with ``sig < 2^(M+1)``; ``e_x`` is the
    binade exponent, except for input subnormals, where it is clamped to the input's
    smallest normal exponent. A target whose ``emin`` lies below that (OCP E8M0 from
    float32) needs the true exponent, so those subnormals are renormalised.
    """
    itype, M, bias_in = INT_LAYOUT[x.dtype]
    bits = x.view(itype)
    negative = bits < 0
    a = bits & ~_sign_mask(x.dtype)
    inf_bits = bits_of(float("inf"), x.dtype)
    is_inf = a == inf_bits
    is_nan = a > inf_bits
    e_field = a >> M
    mantissa = a & ((1 << M) - 1)
    sig = torch.where(e_field > 0, mantissa | (1 << M), mantissa)
    e_x = e_field.clamp(min=1) - bias_in
    if emin < 1 - bias_in:
        # A subnormal is its mantissa times the smallest subnormal, 2^(1 - bias_in - M); the
        # mantissa as a float (exact, and normal) has the exponent and significand of the
        # value renormalised. (Integer to float: a float multiply of x would read the
        # subnormal as 0 under torch.set_flush_denormal(True).)
        scaled = mantissa.to(x.dtype).view(itype)
        subnormal = (e_field == 0) & (a != 0)
        e_x = torch.where(subnormal, (scaled >> M) - 2 * bias_in + 1 - M, e_x)
        sig = torch.where(subnormal, (scaled & ((1 << M) - 1)) | (1 << M), sig)
    return negative, is_inf, is_nan, e_x, sig


def round_fast(x: torch.Tensor, spec: RoundSpec, random_bits: torch.Tensor | None) -> torch.Tensor:
    """Round ``x`` (float32 or float64) to ``spec.fmt``.

    Returns a tensor of x's dtype. For formats without NaN, NaN marks the elements
    that have no valid result (NaN input, or overflow without sat); the caller turns
    them into an error.
    """
    fmt, mode = spec.fmt, spec.mode
    itype, M, bias_in = INT_LAYOUT[x.dtype]
    t = fmt.t
    sign_mask = _sign_mask(x.dtype)
    negative, is_inf, is_nan, e_x, sig = decompose(x, fmt.emin)
    e_t = e_x.clamp(min=fmt.emin)
    D = (M - t) + (e_t - e_x)
    # Beyond M + 2 discarded bits the kept part is 0 and the fraction's value is below
    # one half: every deterministic decision is already fixed.
    max_shift = M + 2
    Dc = D.clamp(max=max_shift)
    r = sig >> Dc
    one = 1 << Dc  # one ulp of the target, in units of the input's last bit
    rem = sig & (one - 1)

    away = _away(mode, spec, r, rem, one, D, e_t, negative, random_bits, max_shift)
    r = r + away.to(itype)

    # Back to the working float: normal results by placing exponent and significand
    # (a carry into 2^P moves the exponent up by itself); subnormal ones as r * ulp.
    normal = ((e_t + (bias_in - 1)) << M) + (r << (M - t))
    is_normal = r >= (1 << t)
    if fmt.emin < 1 - bias_in:
        # The format's normals reach below x's: r counts ulps of e_t, 2^(e_t - t), where
        # e_t may lie above emin while the value is subnormal in x's dtype. There it is at
        # most 2^(1 - bias_in), x's smallest normal, whose bits are its value over x's
        # smallest subnormal, as a subnormal's are; elsewhere (e_t a normal binade of x's)
        # a value below 2^t ulps is 0.
        is_normal &= e_t >= 1 - bias_in
        tiny = r << (e_t - t + bias_in - 1 + M).clamp(0, M + 1)
    else:
        tiny = _times_power_of_two(r, fmt.min_ulp_exponent, t, x.dtype)  # (used where r < 2^t)
    mag = torch.where(is_normal, normal, tiny)

    # Range: saturate, stop directed modes at the limit, or go beyond (Inf/NaN).
    def const(value: float):
        # A 0-d tensor keeps torch.where in the integer view's dtype. (Filled on the device:
        # a tensor copied to a GPU waits for its queued work.)
        return torch.full((), bits_of(value, x.dtype), dtype=itype, device=x.device)

    if fmt.max_negative_magnitude == fmt.max:
        limit = const(fmt.max)
    else:
        limit = torch.where(negative, const(fmt.max_negative_magnitude), const(fmt.max))
    over = (mag > limit) | is_inf
    if spec.sat:
        to_limit = over
    else:
        to_limit = _directed_to_limit(mode, negative)
        if to_limit is not None:
            to_limit = over & ~is_inf & to_limit
    beyond_pos = const(float("inf") if fmt.extended else float("nan"))
    beyond_neg = const(float("inf") if fmt.extended and fmt.signed else float("nan"))
    beyond = beyond_pos if fmt.signed else torch.where(negative, beyond_neg, beyond_pos)
    mag = torch.where(over, beyond, mag)
    if to_limit is not None:
        mag = torch.where(to_limit, limit, mag)
    keep_sign = negative & (mag != 0) if not fmt.has_nz else negative
    if not fmt.has_zero:
        mag = torch.where(mag == 0, const(fmt.smallest_normal), mag)
    out = torch.where(keep_sign, mag | sign_mask, mag)
    out = torch.where(is_nan, const(float("nan")), out)
    return out.view(x.dtype)


def _times_power_of_two(r: torch.Tensor, q: int, t: int, dtype: torch.dtype) -> torch.Tensor:
    """The bits of ``r * 2^q`` in ``dtype`` (its integer view) where ``r < 2^t`` (elsewhere
    any), for products in dtype's range, in integer arithmetic where they are subnormal: a
    float multiply there gives 0 under ``torch.set_flush_denormal(True)`` (FTZ and DAZ; 2^q
    itself may be a subnormal). A subnormal's bits are its value over the smallest
    subnormal, 2^(1 - bias - M); a normal product's are float(r)'s (exact) with q added to
    the exponent (as the GPU kernel computes them)."""
    itype, M, bias = INT_LAYOUT[dtype]
    if q >= 1 - bias:  # 2^q and every nonzero product are normal
        return (r.to(dtype) * 2.0**q).view(itype)
    shifted = r << (q - (1 - bias - M))
    if q + t <= 1 - bias:
        # Every product is subnormal (bfloat16 and binary32 from float32, binary64 from
        # float64): the shift alone, which Inductor vectorises where it does not the choice
        # below (bfloat16's compiled SRC took 7 times as long).
        return shifted
    normal = r.to(dtype).view(itype) + (q << M)
    return torch.where(r < (1 << (1 - bias - q)), shifted, normal)


def _directed_to_limit(mode: RoundMode, negative):
    """Where a mode stops at the largest finite value (None: nowhere)."""
    return {"nowhere": None, "everywhere": torch.ones_like(negative), "negative": negative,
            "positive": ~negative}[MODES[mode].stops_at_max]  # fmt: skip


def _away(mode, spec: RoundSpec, r, rem, one, D, e_t, negative, random_bits, max_shift):
    """The predicate R per element, on the integer fraction ``d = rem / one``."""
    fmt = spec.fmt
    rem2 = rem << 1
    if fmt.p > 1:
        odd = (r & 1) == 1
    else:  # P = 1: the code's last bit is the exponent field's.
        odd = (r != 0) & (((e_t + fmt.bias) & 1) == 1)

    def nearest_even():
        return (rem2 > one) | ((rem2 == one) & odd)

    if mode is RoundMode.RNE:
        return nearest_even()
    if mode is RoundMode.RNA:
        return rem2 >= one
    if mode is RoundMode.RTZ:
        return torch.zeros_like(negative)
    if mode is RoundMode.RUP:
        return (rem != 0) & ~negative
    if mode is RoundMode.RDN:
        return (rem != 0) & negative
    if mode is RoundMode.RTO:
        return (rem != 0) & ~odd

    info = MODES[mode]
    n = random_bits
    if info.takes_fraction:  # the selection bits lie above the N rounding bits
        select = n >> spec.bits
        n = n & ((1 << spec.bits) - 1)
    stochastic = _few_bit_away(rem, D, n, spec.bits, info.tie, max_shift)
    if info.where == "near_zero":
        rne = nearest_even()
        return torch.where((r == 0) & ~rne, stochastic, rne)
    if info.where == "selected":
        return torch.where(select < spec.select_below, stochastic, nearest_even())
    return stochastic
