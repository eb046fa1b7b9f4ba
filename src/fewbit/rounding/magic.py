"""Eager shortcut for RNE and SRC on float32: the float adder does the rounding.

Eager torch makes one memory pass per op, and ``fast.round_fast`` takes ~50 ops. For
the common cases this path takes 4 (RNE) or 7 (SRC) elementwise passes and one
reduction, and gives the same bits; ``fast.round_fast`` stays the definition, and
tests/test_fast_paths.py compares the two.

With ``e_t = max(e_x, emin)`` the target binade of ``x``, ``ulp = 2^(e_t - t)`` and N
the bits SRC rounds the fraction to (N = 0 for RNE), let ``g = ulp / 2^N`` and
``c = e_t + 23 - t - N``: float32's spacing in the binade ``[2^c, 2^(c+1))`` is exactly
``g``. When ``t + N <= 21``, ``|x| < 2^(e_t + 1) <= 2^(c - 1)``, and so:

- RNE: ``x + 1.5 * 2^c`` lies in that binade for either sign of ``x``, so the addition
  rounds ``x`` to a multiple of ``g = ulp`` ties to even, and subtracting ``1.5 * 2^c``
  gives that multiple exactly (an exact zero as +0).
- SRC: with ``C = 2^c`` carrying x's sign, ``|x + C|`` lies in that binade and ``x + C``
  rounds ``|x|`` to ``k g`` ties to even: ``k = r 2^N + d_N`` with ``d_N`` the fraction
  rounded to N bits ties to even, as SRC wants (k and ``d_N`` have the same parity).
  The bit pattern of ``x + C`` is C's plus ``k`` for either sign (sign-magnitude), so
  adding the random ``n`` to it and clearing its low N bits carries
  ``d_N + n >= 2^N`` into the kept part (``k + n < 2^23``: the exponent field is
  untouched). Subtracting C is exact, an exact zero coming out as +0.

The target's subnormal range needs nothing of its own: there ``e_t = emin``. Values
beyond the largest finite one, Inf and NaN are fixed afterwards, only in blocks that
hold one.
"""

from __future__ import annotations

import torch

from .checks import RoundSpec
from .modes import MODES, RoundMode

__all__ = ["magic_applies", "round_magic"]

_EXPONENT = 0x7F800000  # exponent field of a float32 bit pattern
_SIGN = -0x80000000  # sign bit of a float32 bit pattern, as an int32


def _fraction_bits(spec: RoundSpec) -> int:
    """N, the bits the fraction is rounded to before the random ones are added."""
    return 0 if spec.mode is RoundMode.RNE else spec.bits


def magic_applies(spec: RoundSpec, dtype: torch.dtype) -> bool:
    """Whether :func:`round_magic` takes this call (else ``fast.round_fast``)."""
    fmt = spec.fmt
    info = MODES[spec.mode]
    src_everywhere = info.tie == "even" and not info.composite  # src, and sr (src with N = D)
    if dtype != torch.float32 or not (spec.mode is RoundMode.RNE or src_everywhere):
        return False
    # Unsigned formats map negatives to NaN; P = 1 breaks ties on the exponent's
    # parity; without subnormals there is no zero; two's complement has its own -max;
    # a format of subnormals alone (emax < emin) has no binade to clamp e_t into.
    if not fmt.signed or fmt.p < 2 or not fmt.has_subnormals or fmt.twos_complement or fmt.emax < fmt.emin:
        return False
    lowest_c = fmt.emin + 23 - fmt.t - _fraction_bits(spec)
    highest_c = fmt.emax + 23 - fmt.t - _fraction_bits(spec)
    # The target's normals are float32 normals, and C is a normal float32 for every
    # binade from emin to emax. The adder meets no float32 subnormal that matters, which
    # torch.set_flush_denormal(True) would flush (FTZ) or read as 0 (DAZ): every result
    # is a multiple of the smallest subnormal 2^min_ulp, a normal, and every float32
    # subnormal lies below half the grid g = 2^(min_ulp - N), where it rounds to 0 with
    # d_N = 0, as 0 does. (Hand-made formats only: the registry's lie far above.)
    return (fmt.t + _fraction_bits(spec) <= 21 and fmt.emin >= -126
            and lowest_c >= -126 and highest_c <= 127 and fmt.min_ulp_exponent - _fraction_bits(spec) >= -125)


def round_magic(
    x: torch.Tensor, spec: RoundSpec, random_bits: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Round float32 ``x`` into ``out`` (a new tensor if None) as ``fast.round_fast``
    does; returns out.

    Only for calls that :func:`magic_applies` accepts. The in-place ops keep eager
    runs to a few memory passes; under ``torch.compile`` they fuse into one kernel.
    """
    fmt, n = spec.fmt, _fraction_bits(spec)
    if out is None:
        out = torch.empty_like(x)
    # 2^e_t, made in its exponent field. Every binade above emax overflows whatever
    # the rounding, so e_t is capped at emax to keep the magic number finite; the
    # results there still come out beyond the largest finite value.
    c = x.view(torch.int32) & _EXPONENT
    c.clamp_((fmt.emin + 127) << 23, (fmt.emax + 127) << 23)
    c = c.view(torch.float32)
    scale = 2.0 ** (23 - fmt.t - n)  # 2^c = scale * 2^e_t, exactly
    if random_bits is None:
        scale *= 1.5
        torch.add(x, c, alpha=scale, out=out)
    else:
        _take_sign(c, x)
        torch.add(x, c, alpha=scale, out=out)
        k = out.view(torch.int32)
        k.add_(random_bits)
        k.bitwise_and_(-(1 << n))
    out.sub_(c, alpha=scale)
    if fmt.has_nz:  # the subtraction gave +0 where the result is -0
        _take_sign(out, x)
    # Fused, the range fix costs little; eager it is two passes, which a CPU skips when
    # one reduction finds every value in range (on a GPU that read-back would wait).
    if torch.compiler.is_compiling() or x.device.type != "cpu" or not _within_range(x, fmt.max):
        _beyond_range(x, spec, out)
    return out


def _take_sign(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Set a's sign bit where x's is set, in place; returns a. This is ``copysign(a, x)``
    wherever a is not negative, or has x's sign already: the cases here."""
    if torch.compiler.is_compiling():  # Inductor's C++ kernel calls copysign out of line
        a.view(torch.int32).bitwise_or_(x.view(torch.int32) & _SIGN)
        return a
    return torch.copysign(a, x, out=a)  # one pass eager, where the bit ops take two


def _within_range(x: torch.Tensor, limit: float) -> bool:
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)
    return -limit <= float(lo) <= float(hi) <= limit  # false for NaN too


def _beyond_range(x: torch.Tensor, spec: RoundSpec, out: torch.Tensor) -> None:
    """Overflow, Inf and NaN, as ``fast.round_fast`` treats them: in place in ``out``."""
    fmt = spec.fmt
    beyond = fmt.max if spec.sat else float("inf") if fmt.extended else float("nan")
    # Inf inputs and capped binades come out beyond max too. NaN inputs have left
    # arbitrary bits, replaced by the one NaN.
    beyond = _take_sign(torch.full_like(x, beyond), x)
    torch.where(out.abs() > fmt.max, beyond, out, out=out)
    nan = torch.full((), float("nan"), dtype=torch.float32, device=x.device)  # (no copy to a GPU)
    torch.where(x != x, nan, out, out=out)  # NaN: isnan is a scalar loop in the C++ kernel
