"""Floating-point formats as pure data: what a format is and which values it holds.

Notation, used throughout fewbit:

- ``K``: the number of bits of a code.
- ``P``: precision, the significand bits including the implicit leading one.
- ``t = P - 1``: trailing significand bits stored in the code.
- ``bias``: exponent bias; ``emin`` is the exponent of the smallest normal value.
- ``ulp``: the distance between consecutive values at a given exponent.

A code is laid out as ``[sign][exponent field][t trailing bits]``. Special values sit
at the top of each sign's code range: ``num_high_nans`` NaNs at the highest codes, then
one infinity when the domain is extended. Formats without negative zero use the code
``100...0`` as a NaN (IEEE P3109). This module needs no torch.
"""

from __future__ import annotations

import ast
import difflib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import cache

import numpy as np

__all__ = ["FloatFormat", "format", "from_repr", "integer", "names", "p3109"]

_FIELD_TYPES = {"str": str, "int": int, "bool": bool}


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format of ``k`` bits and precision ``p``.

    ``signed``: encodes negative values. ``extended``: the domain has +-Inf (otherwise
    finite). ``has_nz``: has negative zero; when False and signed, the code ``1 << (k-1)``
    is a NaN. ``num_high_nans``: NaN codes at the top of each sign's range.
    ``has_subnormals``: exponent field 0 holds subnormals (otherwise it holds normals).
    ``twos_complement``: the significand of negative values is stored in two's
    complement (OCP MX INT8 only).
    """

    name: str
    k: int
    p: int
    bias: int
    signed: bool = True
    extended: bool = True
    has_nz: bool = False
    num_high_nans: int = 0
    has_subnormals: bool = True
    twos_complement: bool = False

    def __hash__(self) -> int:
        # By name alone (equal formats share it): formats key the caches every rounding call
        # looks in, and the generated hash of all ten fields cost a third of a microsecond.
        return hash(self.name)

    def __post_init__(self) -> None:
        # (annotations are strings: "str", "int", "bool")
        check_field_types(self, [(field.name, _FIELD_TYPES[field.type]) for field in fields(self)])
        if not (2 <= self.k <= 64):
            raise ValueError(f"{self.name}: K must be in 2..64, got {self.k}")
        if not (1 <= self.p <= self.k):
            raise ValueError(f"{self.name}: P must be in 1..K={self.k}, got {self.p}")
        if self.exp_bits < 0:
            raise ValueError(f"{self.name}: K={self.k} leaves no room for P={self.p} and a sign")
        if self.has_nz and not self.signed:
            raise ValueError(f"{self.name}: an unsigned format has no negative zero; set has_nz=False")
        if self.twos_complement and not (
            self.signed and self.p == self.k and self.has_subnormals
            and not (self.extended or self.has_nz or self.num_high_nans)
        ):
            raise ValueError(f"{self.name}: a two's-complement format is signed fixed point (intM): "
                             "P = K, has_subnormals, and no Inf, NaN or -0 (extended, has_nz, num_high_nans)")
        # Code 1 (the least non-zero magnitude where code 0 is zero) must stay finite.
        most = (1 << (self.k - self.sign_bits)) - 2 - self.extended
        if most < 0:
            raise ValueError(f"{self.name}: K={self.k} signed and extended leaves no code for a finite "
                             "value but zero; use extended=False or a larger K")
        if not 0 <= self.num_high_nans <= most:
            raise ValueError(f"{self.name}: num_high_nans must be in 0..{most} (K={self.k}), so that a "
                             f"finite value other than zero remains, got {self.num_high_nans}")

    # Layout

    @property
    def t(self) -> int:
        """Trailing significand bits stored in a code (``P - 1``)."""
        return self.p - 1

    @property
    def top_p(self) -> int:
        """Significant bits of a value in the top binade: P, but ``P - 1`` for two's
        complement (intM), whose P counts the sign bit, as gfloat's does."""
        return self.p - 1 if self.twos_complement else self.p

    @property
    def sign_bits(self) -> int:
        """Width of the sign field: 1, or 0 for an unsigned format."""
        return 1 if self.signed else 0

    @property
    def exp_bits(self) -> int:
        """Width of the exponent field."""
        return self.k - self.t - self.sign_bits

    @property
    def is_signed(self) -> bool:
        """Whether the format has negative values (gfloat's name for ``signed``)."""
        return self.signed

    # Special values

    @property
    def has_infs(self) -> bool:
        """Whether +-Inf have codes: the extended formats (gfloat's name for ``extended``)."""
        return self.extended

    @property
    def has_zero(self) -> bool:
        """Whether 0 has a code."""
        # Without subnormals exponent field 0 is a normal value, so zero has no code.
        return self.has_subnormals

    @property
    def num_nans(self) -> int:
        """How many codes decode to NaN."""
        if not self.signed:
            return self.num_high_nans
        if self.twos_complement:
            return 0
        return 2 * self.num_high_nans + (0 if self.has_nz else 1)

    @property
    def has_nans(self) -> bool:
        """Whether some code decodes to NaN."""
        return self.num_nans > 0

    # Exponent range

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value."""
        return (1 if self.has_subnormals else 0) - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite value, ``floor(log2(max))``."""
        code = self.code_of_max
        exp_field, frac = code >> self.t, code & ((1 << self.t) - 1)
        if exp_field == 0 and self.has_subnormals:
            return self.emin - self.t + frac.bit_length() - 1
        return exp_field - self.bias

    @property
    def min_ulp_exponent(self) -> int:
        """``log2`` of the smallest spacing of values: the ulp of the subnormal range."""
        return self.emin - self.t

    # Codes

    @property
    def code_of_max(self) -> int:
        """Code of the largest finite value."""
        top = (1 << (self.k - self.sign_bits)) - 1
        return top - self.num_high_nans - (1 if self.extended else 0)

    @property
    def code_of_nan(self) -> int:
        """The code fewbit writes for NaN: all ones where the top codes are NaNs, else
        P3109's, the code -0 would have; ValueError for a format without NaN."""
        if self.num_high_nans:
            return (1 << self.k) - 1
        if self.signed and not self.has_nz and not self.twos_complement:
            return 1 << (self.k - 1)
        raise ValueError(f"{self.name} has no NaN")

    def decode_magnitude(self, code: int) -> float:
        """Value of a code's magnitude bits (sign bit cleared), as an exact float."""
        return self._ldexp(*self._magnitude(code))

    def _magnitude(self, code: int) -> tuple[int, int]:
        """A code's magnitude bits as ``(m, e)``, the value ``m * 2^e``, in integers (exact
        at any exponent)."""
        exp_field, frac = code >> self.t, code & ((1 << self.t) - 1)
        if exp_field == 0 and self.has_subnormals:
            return frac, self.min_ulp_exponent
        return (1 << self.t) + frac, exp_field - self.bias - self.t

    def _ldexp(self, m: int, e: int) -> float:
        # Wide P3109 formats (K - P >= 11) reach beyond float64; say so instead of
        # returning inf or 0.
        if m and not (-1074 <= e + m.bit_length() - 1 <= 1023):
            raise ValueError(f"{self.name}: values beyond float64's range (2^{e} scale)")
        return math.ldexp(m, e)

    # Range, finfo-like

    @property
    def max(self) -> float:
        """Largest finite value."""
        return self.decode_magnitude(self.code_of_max)

    @property
    def max_negative_magnitude(self) -> float:
        """Magnitude of the most negative finite value (0.0 for unsigned formats)."""
        if not self.signed:
            return 0.0
        if self.twos_complement:
            # Code 100...0 is -2^t in two's complement: one step beyond -max.
            return self._ldexp(1, self.emin)
        return self.max

    @property
    def min(self) -> float:
        """Most negative finite value (the smallest value for unsigned formats)."""
        if self.signed:
            return -self.max_negative_magnitude
        return 0.0 if self.has_zero else self.smallest_normal

    @property
    def smallest_normal(self) -> float:
        """Smallest positive normal value, ``2^emin``."""
        return self._ldexp(1, self.emin)

    @property
    def smallest_subnormal(self) -> float:
        """Smallest positive value; equals smallest_normal when no subnormal is non-zero."""
        if self.has_subnormals and self.p > 1:
            return self._ldexp(1, self.min_ulp_exponent)
        return self.smallest_normal

    @property
    def eps(self) -> float:
        """Distance from 1.0 to the next larger value: 2^(1 - P), for intM 2^(2 - M)
        (gfloat's eps of intM is half that)."""
        return math.ldexp(1.0, 1 - self.top_p)

    def contains(self, other: FloatFormat) -> bool:
        """True when every value of ``other`` is a value of self: its finite values, zero,
        +-Inf and NaN (one value, whatever its codes). -0 counts as a value of its own: a
        format with -0 is contained only in one with -0 (one without it would turn -0 into +0)."""
        # (Only a signed format with zero has -0: has_nz on one without subnormals is -2^emin.)
        specials = (
            (self.has_zero or not other.has_zero)
            and (self.has_nz and self.has_zero or not (other.has_nz and other.has_zero))
            and (self.has_infs or not other.has_infs)
            and (self.has_nans or not other.has_nans)
        )
        return specials and all(self._holds(negative, *value) for negative, value in other._extremes())

    def _extremes(self):
        """Finite non-zero values ``-+m * 2^e`` of self, as ``(negative, (m, e))``, that a
        format holding them holds every finite value of self with: for each sign the smallest
        and the largest magnitude, one with the lowest last bit (code 1; code 0 for P = 1) and
        one with the most significant bits (one of the top two codes has an odd fraction)."""
        top = self.code_of_max
        for negative in (False, True)[: 1 + self.sign_bits]:
            # Code 0 is zero, or 2^emin without subnormals, whose negative is the NaN without -0.
            low = 1 if self.has_subnormals or (negative and not self.has_nz) else 0
            for code in {low, 1, top - 1, top}:
                if low <= code <= top:
                    yield negative, self._magnitude(code)
        if self.twos_complement:
            yield True, (1, self.emin)  # -2^emin, the code 100...0

    def _holds(self, negative: bool, m: int, e: int) -> bool:
        """Whether the finite value ``-+m * 2^e`` (``m > 0``) is one of self's."""
        if negative and not self.signed:
            return False
        shift = (m & -m).bit_length() - 1
        m, e = m >> shift, e + shift  # m odd: its bits are the value's significant bits
        if negative and (m, e) == (1, self.emin):
            if self.twos_complement:
                return True  # the code 100...0
            if not (self.has_subnormals or self.has_nz):
                return False  # the negative of code 0 (2^emin) is the NaN
        top_m, top_e = self._magnitude(self.code_of_max)
        return (
            m.bit_length() <= self.p
            and e >= self.min_ulp_exponent
            and (self.has_subnormals or e + m.bit_length() - 1 >= self.emin)
            and _order(m, e) <= _order(top_m, top_e)
        )

    # Value table

    def values(self) -> np.ndarray:
        """Float64 value of every code ``0 .. 2^K - 1`` (K <= 16), NaN codes as NaN."""
        if self.k > 16:
            raise ValueError(f"{self.name}: value tables are for K <= 16, not K={self.k}")
        return _value_table(self).copy()

    def __str__(self) -> str:
        return self.name


def check_field_types(obj, kinds: list[tuple[str, type]]) -> None:
    """TypeError naming the first field of a format ``obj`` (its ``name`` first among
    them) whose value is not of its type; a bool is no int."""
    for name, kind in kinds:
        value = getattr(obj, name)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise TypeError(f"{type(obj).__name__} {obj.name!r}: {name} must be of type {kind.__name__}, "
                            f"not {type(value).__name__} ({value!r})")


def _order(m: int, e: int) -> tuple[int, int]:
    """A key that orders values ``m * 2^e`` (``0 < m < 2^64``) without shifting by ``e``."""
    return e + m.bit_length(), m << (64 - m.bit_length())


@cache
def _value_table(fmt: FloatFormat) -> np.ndarray:
    _ = fmt.max, fmt.smallest_subnormal  # raise for formats beyond float64's range
    half = 1 << (fmt.k - fmt.sign_bits)
    codes = np.arange(half)
    exp_field, frac = codes >> fmt.t, codes & ((1 << fmt.t) - 1)
    subnormal = (exp_field == 0) & fmt.has_subnormals
    mags = np.where(
        subnormal,
        np.ldexp(frac.astype(np.float64), fmt.emin - fmt.t),
        np.ldexp(((1 << fmt.t) + frac).astype(np.float64), exp_field - fmt.bias - fmt.t),
    )
    top = half - 1
    if fmt.num_high_nans:
        mags[top - fmt.num_high_nans + 1 :] = np.nan
    if fmt.extended:
        mags[fmt.code_of_max + 1] = np.inf
    if not fmt.signed:
        return mags
    if fmt.twos_complement:
        # Negative code c holds -(2^(K-1) - (c - 2^(K-1))) ulps.
        neg = -np.arange(half, 0, -1, dtype=np.float64) * math.ldexp(1.0, fmt.emin - fmt.t)
    else:
        neg = -mags
        if not fmt.has_nz:
            neg[0] = np.nan
    return np.concatenate([mags, neg])


# Registry

def _p3109_max_p(k: int, signed: bool) -> int:
    # At least one exponent bit: K = (sign bit) + (exponent bits) + (P - 1).
    return k - signed


def p3109(k: int, p: int, signed: bool = True, extended: bool = True) -> FloatFormat:
    """IEEE P3109 ``binaryKpP`` format: no negative zero (its code is the NaN); unsigned
    formats keep their top code as NaN. Without a sign bit P may reach K (one exponent
    bit)."""
    if not (3 <= k <= 16):
        raise ValueError(f"P3109 formats need 3 <= K <= 16, got K={k}")
    if not (1 <= p <= _p3109_max_p(k, signed)):
        bound = "1 <= P < K" if signed else "unsigned ones 1 <= P <= K"
        raise ValueError(f"P3109 formats need {bound}, got K={k}, P={p}")
    bias = (1 << (k - p - 1)) if signed else (1 << (k - p))
    variant = ("s" if signed else "u") + ("e" if extended else "f")
    name = f"binary{k}p{p}" if variant == "se" else f"p3109_k{k}p{p}{variant}"
    return FloatFormat(
        name, k, p, bias, signed=signed, extended=extended, has_nz=False,
        num_high_nans=0 if signed else 1,
    )


def _ieee(name: str, k: int, p: int) -> FloatFormat:
    e = k - p
    return FloatFormat(
        name, k, p, (1 << (e - 1)) - 1, extended=True, has_nz=True,
        num_high_nans=(1 << (p - 1)) - 1,
    )


def _ocp(name: str, e: int, m: int, *, nans: int, extended: bool = False) -> FloatFormat:
    return FloatFormat(
        name, 1 + e + m, m + 1, (1 << (e - 1)) - 1, extended=extended, has_nz=True,
        num_high_nans=nans,
    )


_FIXED: dict[str, FloatFormat] = {
    f.name: f
    for f in [
        _ieee("binary16", 16, 11),
        _ieee("bfloat16", 16, 8),
        _ieee("binary32", 32, 24),
        _ieee("binary64", 64, 53),
        _ocp("ocp_e5m2", 5, 2, nans=3, extended=True),
        _ocp("ocp_e4m3", 4, 3, nans=1),
        _ocp("ocp_e3m2", 3, 2, nans=0),
        _ocp("ocp_e2m3", 2, 3, nans=0),
        _ocp("ocp_e2m1", 2, 1, nans=0),
        FloatFormat("ocp_e8m0", 8, 1, 127, signed=False, extended=False, has_nz=False,
                    num_high_nans=1, has_subnormals=False),
        # OCP MX INT8: a fixed-point two's-complement value k * 2^-6, k in [-128, 127].
        FloatFormat("ocp_int8", 8, 8, 0, extended=False, has_nz=False,
                    twos_complement=True),
    ]
}

_ALIASES = {
    "fp16": "binary16", "float16": "binary16", "half": "binary16",
    "bf16": "bfloat16",
    "fp32": "binary32", "float32": "binary32",
    "fp64": "binary64", "float64": "binary64",
    "int8": "ocp_int8",
    **{n[len("ocp_"):]: n for n in _FIXED if n.startswith("ocp_")},
}

# ASCII digits only (\d would take other scripts' digits, which int() reads too).
_P3109 = re.compile(r"(?:binary(\d+)p(\d+)|p3109_k(\d+)p(\d+)([su])([ef]))", re.ASCII)
_INT = re.compile(r"int(\d+)", re.ASCII)


def integer(m: int) -> FloatFormat:
    """``intM``: M-bit two's-complement fixed point ``k * 2^(2 - M)``, ``k`` in
    ``[-2^(M-1), 2^(M-1))`` (values in ``[-2, 2)``), laid out as OCP MX INT8 (``int8`` is
    ``ocp_int8``): the element of HBFP/BFP blocks, whose shared exponent sets the scale."""
    if not (2 <= m <= 16):
        raise ValueError(f"intM formats need 2 <= M <= 16, got M={m}")
    if m == 8:
        return _FIXED["ocp_int8"]
    return FloatFormat(f"int{m}", m, m, 0, extended=False, has_nz=False, twos_complement=True)


@cache
def names() -> tuple[str, ...]:
    """Canonical names of every registered format."""
    p3109_names = [
        p3109(k, p, s, e).name
        for k in range(3, 17) for p in range(1, k + 1)
        for s in (True, False) if p <= _p3109_max_p(k, s) for e in (True, False)
    ]
    return tuple(_FIXED) + tuple(p3109_names)


def _all_spellings() -> list[str]:
    return list(names()) + list(_ALIASES)


def format(name: str | FloatFormat) -> FloatFormat:
    """Look a format up by name (or pass a FloatFormat through).

    Accepts ``binary8p4`` (P3109 signed extended), ``p3109_k8p4sf`` (s/u signed or
    unsigned, e/f extended or finite), OCP names with or without ``ocp_``, ``bf16``,
    ``fp16``, ``fp32`` and their long forms, and ``intM`` (:func:`integer`; these parse
    by pattern and are not in :func:`names`).
    """
    if isinstance(name, FloatFormat):
        return name
    if not isinstance(name, str):  # (before the cache, which would hash a list first)
        raise TypeError(f"a format is a name or a FloatFormat, not {type(name).__name__}")
    return _named(name)


@cache
def _named(name: str) -> FloatFormat:
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key in _FIXED:
        return _FIXED[key]
    m = _P3109.fullmatch(key)
    if m:
        if m.group(1):
            return p3109(int(m.group(1)), int(m.group(2)))
        k, p, s, e = int(m.group(3)), int(m.group(4)), m.group(5), m.group(6)
        return p3109(k, p, signed=s == "s", extended=e == "e")
    m = _INT.fullmatch(key)
    if m:
        return integer(int(m.group(1)))
    close = difflib.get_close_matches(key, _all_spellings(), n=5, cutoff=0.5)
    hint = f"; closest: {', '.join(close)}" if close else ""
    raise ValueError(f"unknown format {name!r}{hint} (fewbit.formats.names() lists all){_hints(name)}")


#: Hints for a name no format here has, added by the layers above (fewbit.block adds "a block
#: format's name"): this module stays torch-free and imports none of them.
NAME_HINTS: list[Callable[[str], str]] = []


def _hints(name: str) -> str:
    return "".join(hint(name) for hint in NAME_HINTS)


@cache
def from_repr(text: str, kinds: tuple[type, ...] = (FloatFormat,)):
    """The format whose ``repr`` is ``text``: a dataclass of ``kinds`` called with keywords
    that are literals or such formats (nothing else is evaluated). An op takes a format
    made by hand by its repr, and reads it back here: its name alone states the format."""
    by_name = {kind.__name__: kind for kind in kinds}

    def build(node: ast.expr):
        if not isinstance(node, ast.Call):
            return ast.literal_eval(node)
        kind = by_name.get(node.func.id if isinstance(node.func, ast.Name) else None)
        if kind is None or node.args:
            raise ValueError(f"not a format's repr: {text!r}")
        return kind(**{kw.arg: build(kw.value) for kw in node.keywords})

    try:
        return build(ast.parse(text, mode="eval").body)
    except (SyntaxError, TypeError) as err:
        raise ValueError(f"not a format's repr: {text!r}") from err
