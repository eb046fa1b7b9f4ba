"""``fewbit.round``: round a tensor to a format in a rounding mode.

``reference`` states the maths element by element; ``fast`` is what runs. Both share
the argument checks in ``checks`` and the modes in ``modes``.
"""

from __future__ import annotations

import torch

from ..formats import FloatFormat
from .checks import RoundSpec, check_random_bits, check_round_args, dtype_format
from .fast import round_fast, working_dtype
from .modes import SELECT_BITS, RoundMode, natural_sr_bits
from .reference import round_reference

__all__ = [
    "RoundMode", "RoundSpec", "SELECT_BITS", "dtype_format", "natural_sr_bits",
    "round", "round_reference",
]


def round(
    x: torch.Tensor,
    fmt: FloatFormat | str,
    mode: RoundMode | str = "rne",
    *,
    sat: bool = False,
    bits: int | None = None,
    random_bits: torch.Tensor | None = None,
    fraction: float | None = None,
) -> torch.Tensor:
    """Round ``x`` to the values of ``fmt``; the result keeps x's dtype and shape.

    Args:
        x: float32, float64, bfloat16 or float16 tensor, any device and layout.
        fmt: a FloatFormat or a name such as ``"binary8p4"`` or ``"e4m3"``.
        mode: a RoundMode or its lower-case name (``"rne"``, ``"src"``, ...).
        sat: overflow goes to the largest finite value instead of Inf/NaN.
        bits: N, random bits per element, for the stochastic modes.
        random_bits: integers in ``[0, 2^N)`` of x's shape (for ``sr_fraction``,
            ``[0, 2^(N+16))``: the 16 bits above the N rounding bits select).
        fraction: p, the share of elements ``sr_fraction`` rounds stochastically.

    Raises:
        TypeError / ValueError, before anything is computed, for a bad argument; and
        ValueError when a value has no result in a format without Inf and NaN
        (NaN input, or overflow without ``sat``).
    """
    spec = check_round_args(x, fmt, mode, sat, bits, fraction)
    check_random_bits(x, spec, random_bits)
    work = x.to(working_dtype(x.dtype))
    out = round_fast(work, spec, random_bits)
    if not spec.fmt.has_nans:
        _raise_on_invalid(work, out, spec)
    return out.to(x.dtype)


def _raise_on_invalid(work: torch.Tensor, out: torch.Tensor, spec: RoundSpec) -> None:
    # In a format without NaN, a NaN result marks an element with no valid value.
    if bool(torch.isnan(out).any()):
        fmt = spec.fmt.name
        if bool(torch.isnan(work).any()):
            raise ValueError(f"{fmt} has no NaN to hold a NaN input")
        raise ValueError(f"{fmt} has no Inf or NaN for a value beyond its range; use sat=True")
