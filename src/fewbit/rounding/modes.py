"""Rounding modes and the arguments each one takes.

Every mode decides, for a magnitude ``|x| = (floor(s) + d) * ulp`` with fraction
``d`` in ``[0, 1)``, whether to round away from zero. The few-bit stochastic modes
share one shape: round ``d`` to ``N`` bits with a tie rule, giving an integer
``d_N`` in ``[0, 2^N]``, then round away iff ``d_N + n >= 2^N`` for the ``N``-bit
random integer ``n``. The tie rule is what distinguishes them:

=========  ==========================  =====================================
mode       ``d`` to ``N`` bits         paper's predicate
=========  ==========================  =====================================
SRFF       truncate                    ``d + n 2^-N >= 1``
SRF        nearest, ties up            ``d + (n + 1/2) 2^-N >= 1``
SRC        nearest, ties to even       ``RNE(d 2^N) + n >= 2^N``
SRC_ODD    nearest, ties to odd        ``RNO(d 2^N) + n >= 2^N``
=========  ==========================  =====================================
"""

from __future__ import annotations

import enum

from ..formats import FloatFormat

__all__ = ["RoundMode", "SELECT_BITS", "natural_sr_bits"]


class RoundMode(enum.StrEnum):
    """Rounding modes; each also accepted as its lower-case string."""

    RNE = "rne"  #: to nearest, ties to even
    RNA = "rna"  #: to nearest, ties away from zero
    RTZ = "rtz"  #: toward zero
    RUP = "rup"  #: toward +inf
    RDN = "rdn"  #: toward -inf
    RTO = "rto"  #: round to odd: truncate, then set the last bit if inexact
    SR = "sr"  #: classical SR: P(away) is the discarded fraction (SRC with N = D)
    SRFF = "srff"  #: few-bit SR, fraction truncated to N bits
    SRF = "srf"  #: few-bit SR, fraction to N bits ties up
    SRC = "src"  #: few-bit SR, fraction to N bits ties to even
    SRC_ODD = "src_odd"  #: few-bit SR, fraction to N bits ties to odd
    SR_NEAR_ZERO = "sr_near_zero"  #: SR where RNE would give zero, RNE elsewhere
    SR_FRACTION = "sr_fraction"  #: SR on a random fraction p of elements, RNE elsewhere

    @property
    def is_stochastic(self) -> bool:
        return self not in _DETERMINISTIC

    @property
    def takes_bits(self) -> bool:
        """Whether ``bits`` may be chosen (``sr`` derives it from the formats)."""
        return self.is_stochastic and self is not RoundMode.SR


_DETERMINISTIC = frozenset(
    {RoundMode.RNE, RoundMode.RNA, RoundMode.RTZ, RoundMode.RUP, RoundMode.RDN, RoundMode.RTO}
)

#: Tie rule used when the fraction is rounded to N bits, per few-bit SR mode.
FEW_BIT_TIE = {
    RoundMode.SRFF: "truncate",
    RoundMode.SRF: "up",
    RoundMode.SRC: "even",
    RoundMode.SRC_ODD: "odd",
}

#: ``sr_fraction`` takes ``SELECT_BITS`` extra random bits per element above the N
#: rounding bits: the element is rounded stochastically iff those bits, read as an
#: integer, are below ``round(p * 2^SELECT_BITS)``.
SELECT_BITS = 16


def natural_sr_bits(source: FloatFormat, target: FloatFormat) -> int:
    """N for classical SR: D = P_source - P_target discarded bits, kept within 1..32.

    For normal results N = D makes SRC exact; results in the target's subnormal range
    discard more bits, and their fraction is rounded to N bits first.
    """
    return min(max(source.p - target.p, 1), 32)


def parse_mode(mode: RoundMode | str) -> RoundMode:
    if isinstance(mode, RoundMode):
        return mode
    if isinstance(mode, str):
        try:
            return RoundMode(mode.lower())
        except ValueError:
            pass
        known = ", ".join(m.value for m in RoundMode)
        raise ValueError(f"unknown rounding mode {mode!r}; known: {known}")
    raise TypeError(f"mode must be a RoundMode or a string, not {type(mode).__name__}")
