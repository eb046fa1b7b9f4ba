"""Rounding modes: the one table every layer reads.

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

:data:`MODES` gives each mode's :class:`ModeInfo`: whether it is stochastic, its tie
rule, where it rounds stochastically (everywhere, or only where seed 002's stagnation
fixes apply), the random streams it reads and how its ``N`` is chosen. The reference
(``reference``), the kernel (``fast``), the argument checks, ``fewbit.bias`` and the
command line read it. Adding a mode is an entry here, its predicate in
``reference.round_away`` and ``fast._away``, and, for a deterministic mode or a new
(tie, where) pair, its kernel id in ``native`` (``_DETERMINISTIC`` / ``_STOCHASTIC``),
its case in ``native.cpp`` and its tie code in ``triton_kernels``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

from ..formats import FloatFormat
from ..random import MAX_BITS  # (N is at most a word's bits)

__all__ = [
    "FRACTION_MODES", "MAX_BITS", "MODES", "ModeInfo", "RoundMode", "SELECT_BITS", "excess_bits",
    "mode_name", "modes_text", "natural_bits", "natural_sr_bits", "parse_mode",
]


class RoundMode(enum.StrEnum):
    """Rounding modes; each also accepted as its lower-case string."""

    RNE = "rne"
    RNA = "rna"
    RTZ = "rtz"
    RUP = "rup"
    RDN = "rdn"
    RTO = "rto"
    SR = "sr"
    SRFF = "srff"
    SRF = "srf"
    SRC = "src"
    SRC_ODD = "src_odd"
    SR_NEAR_ZERO = "sr_near_zero"
    SR_FRACTION = "sr_fraction"

    @property
    def is_stochastic(self) -> bool:
        """Whether the mode reads random bits."""
        return MODES[self].stochastic

    @property
    def takes_bits(self) -> bool:
        """Whether ``bits`` may be chosen (``sr`` derives it from the formats)."""
        return MODES[self].bits in ("required", "optional")

    @property
    def takes_fraction(self) -> bool:
        """Whether the call needs ``fraction=p`` (the mode reads the selection stream)."""
        return MODES[self].takes_fraction


#: ``sr_fraction`` takes ``SELECT_BITS`` extra random bits per element above the N
#: rounding bits: the element is rounded stochastically iff those bits, read as an
#: integer, are below ``round(p * 2^SELECT_BITS)``.
SELECT_BITS = 16


@dataclass(frozen=True)
class ModeInfo:
    """One row of the mode table.

    Attributes:
        summary: when the mode rounds away, in words.
        stochastic: reads random bits.
        tie: how the fraction ``d`` is rounded to N bits before ``n`` is added
            (``"truncate"``, ``"up"``, ``"even"``, ``"odd"``); None for deterministic modes.
        where: where the stochastic rounding applies: ``"everywhere"``, ``"near_zero"``
            (where RNE would give 0; RNE elsewhere) or ``"selected"`` (on elements whose
            selection bits fall below ``round(p 2^SELECT_BITS)``; RNE elsewhere).
        streams: the random streams read per element: ``"bits"`` (N rounding bits) and
            ``"select"`` (SELECT_BITS selection bits, from the key ``fold_in(key, SELECT_KEY)``).
        bits: how N is given: ``"none"`` (deterministic), ``"required"``, ``"optional"``
            (default: the natural ``N = min(D, 32)``), ``"natural"`` (always that N).
        stops_at_max: where a value beyond the largest finite one stops at it (with its
            sign) when the call does not saturate, instead of going beyond (Inf or NaN):
            ``"nowhere"``, ``"everywhere"``, or only for ``"negative"`` or ``"positive"`` x
            (the directed modes never round away from the direction they are told).
    """

    summary: str
    stochastic: bool = False
    tie: Literal["truncate", "up", "even", "odd"] | None = None
    where: Literal["everywhere", "near_zero", "selected"] = "everywhere"
    streams: tuple[str, ...] = ()
    bits: Literal["none", "required", "optional", "natural"] = "none"
    stops_at_max: Literal["nowhere", "everywhere", "negative", "positive"] = "nowhere"

    @property
    def composite(self) -> bool:
        """SR in some places and RNE in others: its bias depends on where x lies."""
        return self.where != "everywhere"

    @property
    def takes_fraction(self) -> bool:
        """Reads the selection stream: the call needs ``fraction=p``."""
        return "select" in self.streams


def _few_bit(summary: str, tie: str, **kw) -> ModeInfo:
    kw.setdefault("bits", "required")
    return ModeInfo(summary, stochastic=True, tie=tie, streams=kw.pop("streams", ("bits",)), **kw)


#: The table of modes.
MODES: dict[RoundMode, ModeInfo] = {
    RoundMode.RNE: ModeInfo("d > 1/2, or d = 1/2 and floor(s) odd"),
    RoundMode.RNA: ModeInfo("d >= 1/2"),
    RoundMode.RTZ: ModeInfo("never", stops_at_max="everywhere"),
    RoundMode.RUP: ModeInfo("d > 0 and x positive", stops_at_max="negative"),
    RoundMode.RDN: ModeInfo("d > 0 and x negative", stops_at_max="positive"),
    RoundMode.RTO: ModeInfo("d > 0 and floor(s) even (round to odd)", stops_at_max="everywhere"),
    RoundMode.SR: _few_bit("classical SR, probability d: src with N = min(D, 32)", "even", bits="natural"),
    RoundMode.SRFF: _few_bit("floor(d 2^N) + n >= 2^N", "truncate"),
    RoundMode.SRF: _few_bit("(d 2^N rounded ties up) + n >= 2^N", "up"),
    RoundMode.SRC: _few_bit("RNE(d 2^N) + n >= 2^N", "even"),
    RoundMode.SRC_ODD: _few_bit("RNO(d 2^N) + n >= 2^N", "odd"),
    RoundMode.SR_NEAR_ZERO: _few_bit("src where RNE would give 0, RNE elsewhere", "even",
                                     where="near_zero", bits="optional"),
    RoundMode.SR_FRACTION: _few_bit("src on a random fraction p of elements, RNE on the rest", "even",
                                    where="selected", bits="optional", streams=("bits", "select")),
}
assert set(MODES) == set(RoundMode), "every mode needs a row"

#: The modes that take ``fraction=p``.
FRACTION_MODES = tuple(m for m, info in MODES.items() if info.takes_fraction)


def modes_text(modes: tuple[RoundMode, ...]) -> str:
    """``mode 'sr_fraction'`` or ``modes 'a', 'b'``: modes named in a message."""
    return f"mode{'s' if len(modes) > 1 else ''} {', '.join(repr(m.value) for m in modes)}"


#: The value folded into a key to give ``sr_fraction``'s selection stream.
SELECT_KEY = 0x5E1EC7


def excess_bits(*, source: FloatFormat, target: FloatFormat) -> int:
    """D = P_source - P_target: the significand bits of a ``source`` value that ``target``
    discards in its normal range (for intM, whose values are all subnormal, the top binade),
    an intM's P less its sign bit (``FloatFormat.top_p``). Negative where ``target`` has
    more (``fewbit.bias.excess_bits`` refuses that; classical SR takes N = 1 there)."""
    return source.top_p - target.top_p


def natural_bits(excess: int) -> int:
    """Classical SR's N for D = ``excess`` discarded bits: D kept within 1..MAX_BITS."""
    return min(max(excess, 1), MAX_BITS)


def natural_sr_bits(source: FloatFormat, target: FloatFormat) -> int:
    """N for classical SR from ``source`` to ``target``: :func:`natural_bits` of
    :func:`excess_bits`.

    For normal results N = D makes SRC exact; results in the target's subnormal range
    discard more bits, and their fraction is rounded to N bits first.
    """
    return natural_bits(excess_bits(source=source, target=target))


def mode_name(mode: RoundMode | str) -> str:
    """The checked, lower-case name of a mode given as a RoundMode or a string: what the
    ops take (``parse_mode`` without making the enum member, on every call)."""
    if isinstance(mode, RoundMode):
        return mode.value
    if isinstance(mode, str):
        name = mode.lower()
        if name in _NAMES:
            return name
        known = ", ".join(m.value for m in RoundMode)
        raise ValueError(f"unknown rounding mode {mode!r}; known: {known}")
    raise TypeError(f"mode must be a RoundMode or a string, not {type(mode).__name__}")


_NAMES = frozenset(m.value for m in RoundMode)


def parse_mode(mode: RoundMode | str) -> RoundMode:
    """The RoundMode of ``mode`` (a RoundMode, or its name in any case)."""
    return mode if isinstance(mode, RoundMode) else RoundMode(mode_name(mode))
