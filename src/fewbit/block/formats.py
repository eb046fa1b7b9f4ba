"""Block-scaled formats as pure data: elements of one format sharing a scale per block.

A block of ``B`` consecutive elements along one axis shares a scale ``S``; element ``i``
of the block holds a value ``q_i`` of the element format and stands for ``q_i * S``.

========================  ========  =====  ============  ==========  =====================
name                      element   B      scale         rule        per-tensor scale
========================  ========  =====  ============  ==========  =====================
``mxfp8_e4m3``            e4m3      32     E8M0          floor       no
``mxfp8_e5m2``            e5m2      32     E8M0          floor       no
``mxfp6_e3m2``            e3m2      32     E8M0          floor       no
``mxfp6_e2m3``            e2m3      32     E8M0          floor       no
``mxfp4`` (``_e2m1``)     e2m1      32     E8M0          floor       no
``mxint8``                int8      32     E8M0          floor       no
``mx_<element>``          any       32     E8M0          floor       no
``nvfp4``                 e2m1      16     E4M3          nearest     float32
``hbfp<m>``               int<m>    64     E8M0          floor       no
``bfp<m>_b<B>``           int<m>    B      E8M0          floor       no
========================  ========  =====  ============  ==========  =====================

A format has one name: the first row that describes it (``mx_e2m1`` is ``mxfp4_e2m1``,
``bfp8_b32`` is ``mxint8``, ``bfp6_b64`` is ``hbfp6``).

The MX rows follow the OCP Microscaling Formats (MX) v1.0 specification (block of 32, E8M0
scale ``2^e``, ``e = floor(log2(amax)) - emax_element``). NVFP4 follows NVIDIA's public
description (the NVIDIA technical blog "Introducing NVFP4 for Efficient and Accurate
Low-Precision Inference", 2025, and the NVFP4 pretraining report, arXiv:2509.25149): 16
E2M1 elements share an E4M3 scale, times one float32 scale per tensor chosen so that the
largest block scale lands on E4M3's maximum, 448.

HBFP/BFP elements are ``intM`` (``fewbit.formats.integer``): M-bit two's-complement
mantissas ``k * 2^(2 - M)``, sign included, sharing the block's exponent. ``hbfp<m>``
takes blocks of 64: a power of two, so it divides the widths models use (and MX's 32
tiles it), small enough that one outlier flushes at most 63 neighbours towards zero,
large enough that the 8-bit exponent costs 1/8 of a bit per element.

Scale rules (:data:`SCALE_RULES`) say how a block's largest magnitude ``amax`` sets its
scale; each row states what the rule clips and what it wastes.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from functools import cache

from ..formats import NAME_HINTS, FloatFormat, check_field_types
from ..formats import format as element_format

__all__ = ["BlockFormat", "SCALE_RULES", "ScaleRule", "format", "names"]


@dataclass(frozen=True)
class ScaleRule:
    """One row of the scale-rule table.

    Attributes:
        summary: how the scale follows from the block's largest magnitude ``amax``
            (``E``: the element format's largest exponent, ``M``: its largest value,
            ``P``: its precision).
        clips: which values the rule lets overflow the element format (they saturate to ``M``).
        wastes: how much of the element format's range the block's largest value leaves unused.
        power_of_two: for power-of-two scales (E8M0); otherwise for scales with a
            significand (E4M3, float32).
    """

    summary: str
    clips: str
    wastes: str
    power_of_two: bool = True


#: The table of scale rules.
SCALE_RULES: dict[str, ScaleRule] = {
    "floor": ScaleRule(
        "2^(floor(log2 amax) - E) (OCP MX)",
        "amax / S lies in [2^E, 2^(E+1)): the part above M saturates (e2m1: (6, 8), e4m3: (448, 512),"
        " up to 25% error on the block's largest value)",
        "nothing: the block's largest value sits in the element format's top binade",
    ),
    "ceil": ScaleRule(
        "2^(ceil(log2 amax) - E)",
        "nothing: amax / S <= 2^E <= M",
        "the top binade: amax / S lies in (2^(E-1), 2^E], so every value above 2^E goes unused",
    ),
    "rceil": ScaleRule(
        "the smallest 2^e with amax / 2^e <= M (round the scale up to fit)",
        "nothing",
        "less than one binade: amax / S lies in (M/2, M]",
    ),
    "even": ScaleRule(
        "2^(floor(log2 amax') - E), amax' = amax rounded to P bits (intM: P less its sign bit), "
        "ties to even (torchao's EVEN)",
        "only what rounding to nearest would clip anyway where M is the top P-bit value of its binade "
        "(e2m1, int<m>); e4m3: amax / S in (464, 496), which stays in the binade but rounds above M = 448",
        "at most the top half-ulp of a binade's values",
    ),
    "nearest": ScaleRule(
        "amax / M rounded to nearest (ties to even) in the scale format (NVFP4)",
        "amax / S may exceed M by half a scale ulp (E4M3: 1/16) and saturate",
        "at most half a scale ulp of range",
        power_of_two=False,
    ),
    "up": ScaleRule(
        "amax / M rounded up in the scale format",
        "nothing (with a per-tensor scale, both it and S are raised where float32's rounding "
        "to nearest would clip)",
        "less than one scale ulp of range (E4M3: 1/8)",
        power_of_two=False,
    ),
}

#: The scale formats a block may use, by the names :func:`fewbit.format` gives them.
SCALE_FORMATS = ("ocp_e8m0", "ocp_e4m3", "binary32")


@dataclass(frozen=True)
class BlockFormat:
    """``block_size`` elements of ``element`` along ``axis`` share a scale of ``scale``.

    Attributes:
        name: the registry name (or any name, for a format made by hand).
        element: the element format (any fewbit FloatFormat, or its name; ``intM`` for HBFP/BFP).
        block_size: B, elements per block.
        scale: ``ocp_e8m0`` (a power of two), ``ocp_e4m3`` (positive values) or ``binary32``
            (those FloatFormats, or their names).
        rule: the default scale rule (:data:`SCALE_RULES`).
        tensor_scale: a second, per-tensor float32 scale above the block scales (NVFP4):
            for ``ocp_e4m3`` scales only, whose range it moves to the tensor's.
        axis: the default block axis.
    """

    name: str
    element: FloatFormat
    block_size: int
    scale: FloatFormat
    rule: str = "floor"
    tensor_scale: bool = False
    axis: int = -1

    def __post_init__(self) -> None:
        for field in ("element", "scale"):  # a name stands for its format
            object.__setattr__(self, field, element_format(getattr(self, field)))
        check_field_types(self, [("name", str), ("block_size", int), ("rule", str), ("tensor_scale", bool),
                                 ("axis", int)])  # fmt: skip
        if self.block_size < 1:
            raise ValueError(f"{self.name}: block_size must be >= 1, got {self.block_size}")
        if self.scale.name not in SCALE_FORMATS or self.scale != element_format(self.scale.name):
            raise ValueError(f"{self.name}: the scale format must be one of {', '.join(SCALE_FORMATS)} "
                             f"(fewbit.format(name)), not {self.scale!r}")
        if self.tensor_scale and self.scale.name != "ocp_e4m3":
            # E8M0 and float32 scales span any data alone; the per-tensor scale, amax over
            # (M * the scale's max), serves E4M3's narrow range (for the others it underflows).
            raise ValueError(f"{self.name}: a per-tensor scale is for ocp_e4m3 block scales (NVFP4), "
                             f"not {self.scale.name}; set tensor_scale=False")
        if self.element.k > 8:
            raise ValueError(f"{self.name}: block elements have at most 8 bits, not {self.element.k} "
                             f"({self.element.name})")
        if self.packed and self.block_size % 2:
            raise ValueError(f"{self.name}: {self.element.k}-bit elements are stored two to a byte within "
                             f"a block, so the block size must be even, not {self.block_size}")
        check_rule(self.rule, self.scale)

    @property
    def power_of_two(self) -> bool:
        """Whether the block scale is a power of two (E8M0)."""
        return self.scale.p == 1

    @property
    def packed(self) -> bool:
        """Element codes of at most 4 bits are stored two to a byte (even element low)."""
        return self.element.k <= 4

    @property
    def bits_per_element(self) -> float:
        """Storage per element: its code (a byte for 5..8 bits, half for <= 4) plus its share
        of the block scale (the per-tensor scale aside)."""
        code = 4 if self.packed else 8
        return code + self.scale.k / self.block_size

    def __str__(self) -> str:
        return self.name


def check_storable(bfmt: BlockFormat) -> None:
    """Raise ValueError unless ``bfmt``'s scales have uint8 codes, as a BlockTensor keeps
    them (a binary32 scale has none: ``block.round`` takes such a format, ``quantize`` not)."""
    if bfmt.scale.k > 8:
        raise ValueError(f"{bfmt.name}: its {bfmt.scale.name} scales have no 8-bit code, and block codes "
                         "keep uint8 scale codes; fewbit.block.round rounds to it without codes")


def check_rule(rule: str, scale: FloatFormat) -> str:
    """``rule``, once it is known and fits the scale format."""
    if rule not in SCALE_RULES:
        close = difflib.get_close_matches(str(rule), SCALE_RULES, n=3, cutoff=0.4)
        hint = f"; closest: {', '.join(close)}" if close else ""
        raise ValueError(f"unknown scale rule {rule!r}{hint}; known: {', '.join(SCALE_RULES)}")
    kind = scale.p == 1
    if SCALE_RULES[rule].power_of_two != kind:
        fits = [name for name, r in SCALE_RULES.items() if r.power_of_two == kind]
        raise ValueError(f"scale rule {rule!r} is not for {scale.name} scales; use one of {', '.join(fits)}")
    return rule


_MX_ELEMENTS = {
    "mxfp8_e4m3": "ocp_e4m3", "mxfp8_e5m2": "ocp_e5m2", "mxfp6_e3m2": "ocp_e3m2",
    "mxfp6_e2m3": "ocp_e2m3", "mxfp4_e2m1": "ocp_e2m1", "mxint8": "ocp_int8",
}
_ALIASES = {"mxfp4": "mxfp4_e2m1"}
_HBFP_BLOCK = 64
_HBFP = re.compile(r"hbfp(\d+)", re.ASCII)  # (ASCII digits, as fewbit.formats' patterns)
_BFP = re.compile(r"bfp(\d+)_b(\d+)", re.ASCII)
_MX = re.compile(r"mx_(.+)")


_MX_NAMES = {element: name for name, element in _MX_ELEMENTS.items()}


def _e8m0_blocks(element: FloatFormat, block: int) -> BlockFormat:
    """Blocks of ``element`` under an E8M0 scale, named by their row of the module table
    whichever name reached them (``mx_e2m1`` is ``mxfp4_e2m1``, ``bfp8_b32`` is
    ``mxint8``, ``bfp6_b64`` is ``hbfp6``): one format, one name, so that an ``out=``
    made under one name takes a call under another."""
    integer = re.fullmatch(r"(?:ocp_)?int(\d+)", element.name, re.ASCII)
    if block == 32 and element.name in _MX_NAMES:
        name = _MX_NAMES[element.name]
    elif integer:
        m = integer.group(1)
        name = f"hbfp{m}" if block == _HBFP_BLOCK else f"bfp{m}_b{block}"
    else:
        name = f"mx_{element.name}"
    return BlockFormat(name, element, block, element_format("ocp_e8m0"))


def names() -> tuple[str, ...]:
    """The fixed names; ``hbfp<m>``, ``bfp<m>_b<B>`` and ``mx_<element>`` parse by pattern."""
    return (*_MX_ELEMENTS, *_ALIASES, "nvfp4")


def format(name: str | BlockFormat) -> BlockFormat:
    """Look a block format up by name (or pass a BlockFormat through); see the module table."""
    if isinstance(name, BlockFormat):
        return name
    if not isinstance(name, str):  # (before the cache, which would hash a list first)
        raise TypeError(f"a block format is a name or a BlockFormat, not {type(name).__name__}")
    return _named(name)


@cache
def _named(name: str) -> BlockFormat:
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key in _MX_ELEMENTS:
        return _e8m0_blocks(element_format(_MX_ELEMENTS[key]), 32)
    if key == "nvfp4":
        return BlockFormat("nvfp4", element_format("ocp_e2m1"), 16, element_format("ocp_e4m3"),
                           rule="nearest", tensor_scale=True)
    if m := _HBFP.fullmatch(key):
        return _e8m0_blocks(element_format(f"int{int(m.group(1))}"), _HBFP_BLOCK)
    if m := _BFP.fullmatch(key):
        return _e8m0_blocks(element_format(f"int{int(m.group(1))}"), int(m.group(2)))
    if m := _MX.fullmatch(key):
        return _e8m0_blocks(element_format(m.group(1)), 32)
    close = difflib.get_close_matches(key, [*names(), "hbfp8", "bfp8_b32", "mx_binary8p4"], n=4, cutoff=0.5)
    hint = f"; closest: {', '.join(close)}" if close else ""
    raise ValueError(f"unknown block format {name!r}{hint} (also: hbfp<m>, bfp<m>_b<size>, mx_<element>)")


def _element_name_hint(name: str) -> str:
    """Where a block format's name went where an element format goes (fewbit.round(x, "mxfp4")),
    a pointer to the block ops."""
    try:
        format(name)
    except (ValueError, TypeError):
        return ""
    return f"; {name!r} is a block format, which fewbit.block.round and fewbit.block.quantize take"


NAME_HINTS.append(_element_name_hint)
