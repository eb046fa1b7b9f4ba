"""fewbit.round against gfloat 0.5.2, the independent oracle, bit for bit.

What is covered:

- every bfloat16 and every float16 bit pattern, for every registered format the dtype
  holds (binary32/binary64 and formats wider than float64 aside), every mode gfloat
  has, sat both ways, and N in {1, 3, 8, D} for the few-bit SR modes
  (D = P_dtype - P_fmt);
- float32, with N in {1, 2, 3, 4, 8, D}: 2^19 values per format for a core set (at
  least 2^18 random bit patterns, every target value and midpoint with their float32
  neighbours, both sides of every binade boundary, the subnormal range and below it,
  the overflow region, fractions that are exact N-bit ties, and the special values),
  2^14 built the same way for every other format float32 holds;
- float64: 2^17 random bit patterns plus the same constructed values, core set.

Where fewbit deliberately differs from gfloat, those inputs are left out of the
bitwise comparison and fewbit is checked against its own exact reference
(``round_reference``) on a sample of them instead:

1. unsigned formats: negative non-zero inputs (gfloat mishandles them);
2. OCP E8M0: ``|x| < 2^-127`` (E8M0 has no zero; gfloat returns non-E8M0 values);
3. formats without NaN or Inf: a NaN input raises ValueError in fewbit, and with
   sat=False an overflow makes both raise for the whole call. Both must raise on the
   whole input; values within range are compared; up to 16 values per sign just past
   the largest magnitude are checked one call each (raise in both, or the same
   value), the rest of the overflow range by sign (both raise, or the same values).

Random bits come from a torch.Generator seeded by the case; a quarter of them are
aimed next to the value where the SR decision turns, so that the tie rules that
tell SRFF, SRF, SRC and SRC_ODD apart are exercised for every N, not only small ones.

gfloat gets float64 arrays, in which it computes exactly for inputs of up to 24
significand bits. For float64 inputs its SRF/SRFF sum ``delta + n 2^-N`` can round up
to 1.0 when the input lies below the target's smallest subnormal (e.g. float64
``nextafter(ss/2, 0)`` into binary8p4, SRFF, N=1, n=1 gives ss instead of 0), so float64
inputs reach gfloat as long double, whose 64-bit significand holds that sum exactly
for N <= 8.
"""

from __future__ import annotations

import functools
import math

import gfloat
import numpy as np
import pytest
import torch

import fewbit
from conftest import (
    DETERMINISTIC_MODES,
    FEW_BIT_SR_MODES,
    bitwise_mismatches,
    describe_mismatches,
    gfloat_format,
    gfloat_mode,
    has_finite_max,
    hexbits,
    stable_seed,
)
from fewbit.formats import FloatFormat, names
from fewbit.rounding import dtype_format, round_reference

GFLOAT_MODES = DETERMINISTIC_MODES + FEW_BIT_SR_MODES
BASE_NS = (1, 2, 3, 4, 8)
#: For every 16-bit input: N below, at (D is added) and above D; N = 2 and 4 are the
#: float32 and float64 sets'.
EXHAUSTIVE_NS = (1, 3, 8)

#: Formats tested with 2^19 float32 inputs (and the float64 sample): the values built for
#: a format (300k for an 8-bit one, 700k for bfloat16's) topped up with random bit patterns.
#: (2^20 took 190 CPU-seconds of CI's -n 2 run, its random patterns most of it.)
CORE = (
    "binary8p4", "p3109_k8p4sf", "p3109_k8p4ue", "binary8p3", "ocp_e4m3", "ocp_e5m2",
    "ocp_e2m1", "ocp_e3m2", "ocp_e2m3", "ocp_e8m0", "ocp_int8", "bfloat16", "binary16",
    "binary8p1", "p3109_k6p3sf", "binary3p2",
)

#: Excluded inputs checked against round_reference per case (it is slow).
REF_SAMPLE = 16
#: Overflow-window inputs of a format without NaN/Inf checked one call each, per sign.
WINDOW_SAMPLE = 16

# long double holds gfloat's SRF/SRFF sums exactly for float64 inputs and N <= 8
# when its significand has at least 62 bits (x86 extended, or IEEE quad).
LONG_DOUBLE_EXACT = np.finfo(np.longdouble).nmant >= 62


def held_formats(dtype: torch.dtype) -> list[str]:
    """Registered formats a dtype holds, binary32/64 and beyond-float64 ones aside."""
    src = dtype_format(dtype)
    out = []
    for name in names():
        if name in ("binary32", "binary64"):
            continue
        fmt = fewbit.format(name)
        if has_finite_max(fmt) and src.contains(fmt):
            out.append(name)
    return out


def sr_bits(dtype: torch.dtype, fmt, base=BASE_NS) -> tuple[int, ...]:
    """N values for the few-bit SR modes: the base set plus D = P_dtype - P_fmt."""
    d = dtype_format(dtype).p - fmt.p
    return tuple(base) + ((d,) if 1 <= d <= 32 and d not in base else ())


def mode_cases(dtype, fmt, modes=GFLOAT_MODES, base=BASE_NS):
    """(mode, N) pairs: N is None for the deterministic modes."""
    for mode in modes:
        if mode in DETERMINISTIC_MODES:
            yield mode, None
        else:
            for n in sr_bits(dtype, fmt, base):
                yield mode, n


@pytest.fixture(autouse=True)
def _eager():
    """Run fewbit eager: this file calls ~25,000 distinct (format, mode, sat, N)
    specs, and a compiled kernel per spec would cost far more than the checks. The
    compiled path is checked against eager elsewhere."""
    with fewbit.configure(compile=False):
        yield


# ---------------------------------------------------------------------------------
# Inputs


def exhaustive16(dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern of a 16-bit dtype."""
    codes = np.arange(1 << 16, dtype=np.uint16).view(np.int16)
    return torch.from_numpy(codes.copy()).view(dtype)


_NP = {torch.float32: np.float32, torch.float64: np.float64}
_UINT = {torch.float32: np.uint32, torch.float64: np.uint64}
_SPECIAL_BITS = {
    torch.float32: [
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # +-0, +-Inf
        0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF, 0xFFFFFFFF, 0x7FFFFFFF,  # NaNs
        0x7F7FFFFF, 0xFF7FFFFF, 0x00800000, 0x80800000,  # +-max, +-smallest normal
        0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF,  # subnormal extremes
    ],
    torch.float64: [
        0x0000000000000000, 0x8000000000000000, 0x7FF0000000000000, 0xFFF0000000000000,
        0x7FF8000000000000, 0xFFF8000000000000, 0x7FF0000000000001, 0x7FF7FFFFFFFFFFFF,
        0xFFFFFFFFFFFFFFFF, 0x7FFFFFFFFFFFFFFF,
        0x7FEFFFFFFFFFFFFF, 0xFFEFFFFFFFFFFFFF, 0x0010000000000000, 0x8010000000000000,
        0x0000000000000001, 0x8000000000000001, 0x000FFFFFFFFFFFFF, 0x800FFFFFFFFFFFFF,
    ],
}


def _ulp_exponent(fmt, mag: np.ndarray) -> np.ndarray:
    """log2 of the target's value spacing at magnitude ``mag`` (its binade, clamped to
    the subnormals' when the target has them); ``emin - t`` for 0, Inf and NaN."""
    usable = np.isfinite(mag) & (mag > 0)
    e = np.frexp(np.where(usable, mag, 1.0))[1].astype(np.int64) - 1  # floor(log2)
    e = np.where(usable, e, fmt.emin)
    if fmt.has_subnormals:
        e = np.maximum(e, fmt.emin)
    return e - fmt.t


def _ulp_at(fmt, mag: np.ndarray) -> np.ndarray:
    return np.ldexp(1.0, _ulp_exponent(fmt, mag))


def _cap(a: np.ndarray, cap: int, rng) -> np.ndarray:
    """At most ``cap`` elements: the ones nearest zero and largest kept, the rest
    sampled."""
    if len(a) <= cap:
        return a
    order = np.argsort(np.abs(a), kind="stable")
    ends = cap // 8
    keep = np.concatenate([order[:ends], order[-ends:]])
    rest = rng.choice(order[ends:-ends], size=cap - 2 * ends, replace=False)
    return a[np.sort(np.concatenate([keep, rest]))]


def _random_mantissa_values(rng, exps: np.ndarray) -> np.ndarray:
    """float64 values m * 2^e, m uniform in [1, 2) with 52 random bits, random sign."""
    m = 1.0 + rng.integers(0, 1 << 52, size=len(exps)) * 2.0**-52
    sign = np.where(rng.integers(0, 2, size=len(exps)) == 1, -1.0, 1.0)
    return sign * np.ldexp(m, exps)


def constructed_inputs(fmt, dtype: torch.dtype, total: int, caps: dict) -> torch.Tensor:
    """Values chosen for ``fmt`` in a float32/float64 tensor, topped up with random bit
    patterns to ``total`` elements (at least ``caps['random']`` of them)."""
    npdt = _NP[dtype]
    fi = np.finfo(npdt)
    rng = np.random.default_rng(stable_seed("inputs", fmt.name, dtype))
    parts: list[np.ndarray] = []

    def exact(a) -> np.ndarray:
        """float64 values that the dtype holds exactly, as the dtype."""
        a = np.asarray(a, dtype=np.float64)
        with np.errstate(over="ignore"):
            c = a.astype(npdt)
        keep = (c.astype(np.float64) == a) | np.isnan(a)
        return c[keep]

    def with_neighbours(a: np.ndarray) -> np.ndarray:
        a = a[np.isfinite(a)]
        return np.concatenate([a, np.nextafter(a, npdt(np.inf)), np.nextafter(a, npdt(-np.inf))])

    # Special values of the dtype.
    parts.append(np.array(_SPECIAL_BITS[dtype], dtype=_UINT[dtype]).view(npdt))

    # Both sides of every binade boundary of the target (and a little beyond).
    lo = max(fmt.min_ulp_exponent - 3, fi.minexp - fi.nmant)
    hi = min(fmt.emax + 3, fi.maxexp - 1)
    b = np.ldexp(1.0, np.arange(lo, hi + 1))
    parts.append(with_neighbours(exact(np.concatenate([b, -b]))))

    # Every target value and every midpoint, and their neighbours in the dtype.
    table = fmt.values()
    vals = np.unique(table[np.isfinite(table)])
    if not fmt.signed:
        vals = np.unique(np.concatenate([vals, -vals]))  # negatives: excluded, checked
    top = fmt.max
    top_ulp = float(_ulp_at(fmt, np.array([top]))[0])
    neg_top = fmt.max_negative_magnitude if fmt.signed else top
    neg_ulp = float(_ulp_at(fmt, np.array([neg_top]))[0])
    # Past the largest magnitude: half an ulp (RNE's overflow threshold), one ulp
    # (the first value beyond), one and a half; both signs.
    beyond = np.array(
        [top + top_ulp * f for f in (0.25, 0.5, 0.75, 1.0, 1.5, 2.0)]
        + [-(neg_top + neg_ulp * f) for f in (0.25, 0.5, 0.75, 1.0, 1.5, 2.0)]
        + [2 * top, -2 * neg_top]
    )
    mids = (vals[:-1] + vals[1:]) / 2
    parts.append(with_neighbours(exact(beyond)))
    parts.append(with_neighbours(exact(_cap(vals, caps["values"], rng))))
    parts.append(with_neighbours(exact(_cap(mids, caps["values"], rng))))

    # Fractions that are exact m-bit values (ties when rounded to N = m - 1 bits):
    # v + j ulp / 2^m for a target value v and odd j.
    n = caps["short"]
    pos = vals[vals >= 0]
    v = pos[rng.integers(0, len(pos), size=n)]
    m = rng.integers(1, 13, size=n)
    j = 2 * rng.integers(0, 1 << 11, size=n) % (1 << m) + 1
    frac = v + j * np.ldexp(_ulp_at(fmt, v), -m)
    sign = np.where(rng.integers(0, 2, size=n) == 1, -1.0, 1.0)
    parts.append(exact(sign * frac))
    # Long fractions (ties at N up to the dtype's precision) where the target's
    # subnormals or zero leave the input the most bits: (k 2^m + j) ulp_min / 2^m.
    n = caps["short"] // 2
    k = rng.integers(0, 1 << fmt.t, size=n) if fmt.has_subnormals else np.zeros(n, np.int64)
    m = rng.integers(1, fi.nmant + 2, size=n)
    j = (rng.integers(0, 1 << 62, size=n) >> (62 - m)) | 1  # odd, m bits
    keep = k < 2.0 ** (53 - m)  # k 2^m + j exact in float64
    num = k[keep] * np.ldexp(1.0, m[keep]) + j[keep]
    long_frac = np.ldexp(num, fmt.min_ulp_exponent - m[keep])
    sign = np.where(rng.integers(0, 2, size=len(num)) == 1, -1.0, 1.0)
    parts.append(exact(sign * long_frac))

    # The subnormal range of the target, below its smallest subnormal, and the top.
    n = caps["subnormal"]
    sub = fmt.smallest_normal * rng.integers(0, 1 << 52, size=n) * 2.0**-52
    parts.append(np.where(rng.integers(0, 2, size=n) == 1, -sub, sub).astype(npdt))
    parts.append(
        _random_mantissa_values(
            rng, rng.integers(fi.minexp - fi.nmant, fmt.min_ulp_exponent, size=caps["below"])
        ).astype(npdt)
    )
    parts.append(
        _random_mantissa_values(
            rng, rng.integers(fmt.emax - 1, min(fmt.emax + 3, fi.maxexp), size=caps["top"])
        ).astype(npdt)
    )
    # Anywhere in the target's range, with full random significands.
    parts.append(
        _random_mantissa_values(
            rng,
            rng.integers(
                fmt.min_ulp_exponent - 2, min(fmt.emax + 3, fi.maxexp), size=caps["range"]
            ),
        ).astype(npdt)
    )

    built = np.concatenate([p.astype(npdt) for p in parts])
    n_random = max(caps["random"], total - len(built))
    width = np.dtype(npdt).itemsize
    patterns = np.frombuffer(rng.bytes(width * n_random), dtype=_UINT[dtype]).view(npdt)
    return torch.from_numpy(np.concatenate([built, patterns]))


CAPS_CORE32 = dict(values=1 << 17, short=1 << 16, subnormal=1 << 15, below=1 << 13,
                   top=1 << 15, range=1 << 17, random=1 << 18)
CAPS_SAMPLE32 = dict(values=1 << 10, short=1 << 10, subnormal=1 << 9, below=1 << 8,
                     top=1 << 9, range=1 << 10, random=1 << 12)
CAPS_CORE64 = dict(values=1 << 12, short=1 << 12, subnormal=1 << 11, below=1 << 10,
                   top=1 << 11, range=1 << 13, random=1 << 17)


# ---------------------------------------------------------------------------------
# A format-and-input plan: which inputs are compared how


def _sample_by_magnitude(idx: np.ndarray, mag: np.ndarray, k: int) -> np.ndarray:
    """Up to k indices spread evenly over idx sorted by magnitude (ends included)."""
    if len(idx) <= k:
        return idx
    order = idx[np.argsort(mag[idx], kind="stable")]
    return np.unique(order[np.linspace(0, len(order) - 1, k).round().astype(np.int64)])


class Plan:
    """Inputs for one format, split by how each is checked."""

    def __init__(self, x: torch.Tensor, fmt, tag: str):
        self.x, self.fmt, self.tag, self.dtype = x, fmt, tag, x.dtype
        self.gfi = gfloat_format(fmt)
        xv = x.double().numpy()
        self.v = xv
        # gfloat's SRF/SRFF sums need more than float64 for float64 inputs (see top).
        self.v_wide = xv
        if x.dtype == torch.float64 and LONG_DOUBLE_EXACT:
            with np.errstate(invalid="ignore"):  # NaN payloads
                self.v_wide = xv.astype(np.longdouble)
        neg, nan, mag = np.signbit(xv), np.isnan(xv), np.abs(xv)
        self.mag = mag
        # The exact fraction d in [0, 1) each input leaves below the target's ulp
        # (float64 holds it exactly), to aim random bits at the SR decision.
        finite = np.isfinite(mag)
        scaled = np.ldexp(np.where(finite, mag, 0.0), -_ulp_exponent(fmt, mag))
        self.frac = torch.from_numpy(np.where(finite, scaled - np.floor(scaled), 0.0))
        self._floors: dict[int, torch.Tensor] = {}

        excluded = np.zeros(len(xv), dtype=bool)
        if not fmt.signed:  # difference 1
            excluded |= neg & ~nan & (xv != 0)
        if fmt.name == "ocp_e8m0":  # difference 2
            excluded |= ~nan & (mag < 2.0**-127)
            self.e8m0_small = np.flatnonzero(~neg & (mag < 2.0**-127))
        ref = np.flatnonzero(excluded)
        self.ref_idx = np.unique(np.concatenate([
            ref[(mag[ref] == 0) | np.isinf(mag[ref])],  # +-0 and +-Inf always
            _sample_by_magnitude(ref[neg[ref]], mag, REF_SAMPLE // 2),
            _sample_by_magnitude(ref[~neg[ref]], mag, REF_SAMPLE // 2),
        ]))

        self.finite_only = not fmt.has_nans  # difference 3
        if self.finite_only:
            excluded |= nan
            self.nan_idx = np.flatnonzero(nan)[:2]
            limit = np.where(neg, fmt.max_negative_magnitude, fmt.max)
            inrange = ~nan & (mag <= limit)
            over = ~nan & ~inrange
            ulp = _ulp_at(fmt, limit)
            window = over & np.isfinite(xv) & (mag < limit + ulp)
            self.inrange = np.flatnonzero(inrange)
            self.window = np.concatenate([
                _sample_by_magnitude(np.flatnonzero(window & ~neg), mag, WINDOW_SAMPLE),
                _sample_by_magnitude(np.flatnonzero(window & neg), mag, WINDOW_SAMPLE),
            ])
            far = over & ~window
            self.groups = [
                g for g in (
                    np.flatnonzero(far & np.isfinite(xv) & ~neg),
                    np.flatnonzero(far & np.isfinite(xv) & neg),
                    np.flatnonzero(far & np.isinf(xv) & ~neg),
                    np.flatnonzero(far & np.isinf(xv) & neg),
                ) if len(g)
            ]
        self.cmp = np.flatnonzero(~excluded) if excluded.any() else None
        self.compared = len(xv) if self.cmp is None else len(self.cmp)

    def frac_floor(self, n: int) -> torch.Tensor:
        """``floor(d 2^N)`` per element (exact: d has at most 53 bits)."""
        if n not in self._floors:
            self._floors[n] = torch.floor(self.frac * float(1 << n)).to(torch.int64)
        return self._floors[n]


def case_random_bits(plan: Plan, n: int, mode: str) -> torch.Tensor:
    """N-bit random integers (int64) from a generator seeded by the case (both of its
    sat cases take them: drawing them took a fifth of a case's time).

    About a quarter of the elements get a value next to where the SR decision turns:
    with ``d_lo = floor(d 2^N)``, ``n = 2^N - 1 - d_lo`` rounds away exactly when
    ``d`` rounded to N bits is ``d_lo + 1``, which is where SRFF, SRF, SRC and SRC_ODD
    differ (one below or above that, every mode agrees). Uniform bits alone would
    almost never hit it for large N.
    """
    gen = torch.Generator().manual_seed(stable_seed(plan.tag, plan.fmt.name, mode, n))
    # One draw: the low N bits are the uniform bits, the next two pick the aimed
    # quarter, the two above give the offset from the turning value (-1 .. 2).
    raw = torch.randint(0, 1 << (n + 4), plan.x.shape, generator=gen, dtype=torch.int64)
    bits = raw & ((1 << n) - 1)
    aimed = ((raw >> n) & 3) == 0
    offset = (raw >> (n + 2)) - 1
    turn = ((1 << n) - 1 + offset - plan.frac_floor(n)).clamp(0, (1 << n) - 1)
    return torch.where(aimed, turn, bits)


class Case:
    """One (mode, N, sat) run over a plan; collects failure messages."""

    def __init__(self, plan: Plan, mode: str, n: int | None, sat: bool, failures: list,
                 rb: torch.Tensor | None):
        self.plan, self.mode, self.n, self.sat, self.failures = plan, mode, n, sat, failures
        fmt = plan.fmt
        self.ctx = f"{plan.tag} -> {fmt.name}, mode={mode}, sat={sat}, N={n}"
        self.rb = rb
        self.rb_np = None if self.rb is None else self.rb.numpy()
        self.kw = {"sat": sat} if n is None else {"sat": sat, "bits": n, "random_bits": self.rb}
        self.gmode = gfloat_mode(mode)

    def _sub(self, idx):
        x = self.plan.x if idx is None else self.plan.x[torch.from_numpy(idx)]
        rb = None if (self.rb is None or idx is None) else self.rb[torch.from_numpy(idx)]
        return x, (self.rb if idx is None else rb)

    def fewbit(self, idx=None) -> torch.Tensor:
        x, rb = self._sub(idx)
        kw = dict(self.kw, random_bits=rb) if self.n is not None else self.kw
        return fewbit.round(x, self.plan.fmt, self.mode, **kw)

    def gfloat(self, idx=None) -> torch.Tensor:
        v = self.plan.v_wide if self.mode in ("srf", "srff") else self.plan.v
        v = v if idx is None else v[idx]
        with np.errstate(over="ignore"):  # gfloat's ldexp overflows to Inf, as meant
            if self.n is None:
                g = gfloat.round_ndarray(self.plan.gfi, v, self.gmode, self.sat)
            else:
                bits = self.rb_np if idx is None else self.rb_np[idx]
                g = gfloat.round_ndarray(self.plan.gfi, v, self.gmode, self.sat, bits, self.n)
        return torch.from_numpy(np.asarray(g, dtype=np.float64)).to(self.plan.dtype)

    def reference(self, idx) -> torch.Tensor:
        x, rb = self._sub(idx)
        kw = dict(self.kw, random_bits=rb) if self.n is not None else self.kw
        return round_reference(x, self.plan.fmt, self.mode, **kw)

    def compare(self, got, expected, idx, what="gfloat"):
        bad = bitwise_mismatches(got, expected)
        if len(bad):
            x, rb = self._sub(idx)
            self.failures.append(
                f"{self.ctx} (vs {what}): " + describe_mismatches(x, got, expected, bad, rb)
            )

    def _call(self, fn, idx):
        try:
            return fn(idx), None
        except ValueError as e:
            return None, e

    def pair(self, idx, must_succeed=False):
        """fewbit and gfloat on the same inputs: both raise ValueError, or neither and
        the results agree bitwise."""
        f, fe = self._call(self.fewbit, idx)
        g, ge = self._call(self.gfloat, idx)
        if fe is None and ge is None:
            self.compare(f, g, idx)
        elif (fe is None) != (ge is None) or must_succeed:
            x, _ = self._sub(idx)
            shown = ", ".join(hexbits(x[:6]))
            self.failures.append(
                f"{self.ctx}: on {len(x)} inputs ({shown}{', ...' if len(x) > 6 else ''})"
                f" fewbit {'raised ' + repr(str(fe)) if fe else 'returned'},"
                f" gfloat {'raised ' + repr(str(ge)) if ge else 'returned'}"
            )

    def run(self):
        plan = self.plan
        if plan.finite_only:
            self._run_finite_only()
        else:
            f = self.fewbit()
            g = self.gfloat(plan.cmp)
            got = f if plan.cmp is None else f[torch.from_numpy(plan.cmp)]
            self.compare(got, g, plan.cmp)
            if len(plan.ref_idx):
                idx = torch.from_numpy(plan.ref_idx)
                self.compare(f[idx], self.reference(plan.ref_idx), plan.ref_idx, "round_reference")
            if plan.fmt.name == "ocp_e8m0" and len(plan.e8m0_small):
                idx = torch.from_numpy(plan.e8m0_small)
                want = torch.full((len(idx),), 2.0**-127, dtype=plan.dtype)
                self.compare(f[idx], want, plan.e8m0_small, "2^-127 for 0 <= x < 2^-127")

    def _run_finite_only(self):
        plan = self.plan
        if self.sat:
            self.pair(plan.cmp, must_succeed=True)
        else:
            self.pair(plan.cmp)  # both raise when anything overflows
            self.pair(plan.inrange, must_succeed=True)
            for i in plan.window:
                self.pair(np.array([i]))
            for g in plan.groups:
                self.pair(g)
        if len(plan.nan_idx):
            _, fe = self._call(self.fewbit, plan.nan_idx)
            if fe is None:
                self.failures.append(f"{self.ctx}: NaN input did not raise ValueError")


def run_plan(plan: Plan, cases) -> int:
    """Run every (mode, N) case with sat both ways; fail listing every failing case."""
    failures: list[str] = []
    count = 0
    for mode, n in cases:
        rb = None if n is None else case_random_bits(plan, n, mode)
        for sat in (False, True):
            Case(plan, mode, n, sat, failures, rb).run()
            count += 1
    if failures:
        pytest.fail(f"{len(failures)} failing checks:\n" + "\n".join(failures[:40]), pytrace=False)
    return count


# ---------------------------------------------------------------------------------
# Tests. Longest first, so pytest-xdist spreads them evenly.


@functools.lru_cache(maxsize=2)
def _plan_core(name: str, dtype: torch.dtype) -> Plan:
    fmt = fewbit.format(name)
    if dtype == torch.float32:
        x = constructed_inputs(fmt, dtype, 1 << 19, CAPS_CORE32)
    else:
        x = constructed_inputs(fmt, dtype, 1 << 17, CAPS_CORE64)
    return Plan(x, fmt, str(dtype)[6:])


@pytest.mark.slow
@pytest.mark.parametrize("mode", GFLOAT_MODES)
@pytest.mark.parametrize("name", CORE)
def test_float64_core(name, mode):
    if mode in ("srf", "srff") and not LONG_DOUBLE_EXACT:
        pytest.skip("long double too narrow for gfloat's SRF/SRFF sums on float64 inputs")
    plan = _plan_core(name, torch.float64)
    run_plan(plan, mode_cases(torch.float64, plan.fmt, (mode,), BASE_NS))


@pytest.mark.slow
@pytest.mark.parametrize("mode", GFLOAT_MODES)
@pytest.mark.parametrize("name", CORE)
def test_float32_core(name, mode):
    plan = _plan_core(name, torch.float32)
    assert len(plan.x) >= 1 << 19
    run_plan(plan, mode_cases(torch.float32, plan.fmt, (mode,)))


_EXHAUSTIVE = [
    pytest.param(dtype, name, id=f"{str(dtype)[6:]}-{name}")
    for dtype in (torch.bfloat16, torch.float16)
    for name in held_formats(dtype)
]


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "name"), _EXHAUSTIVE)
def test_exhaustive_16bit(dtype, name):
    fmt = fewbit.format(name)
    plan = Plan(exhaustive16(dtype), fmt, str(dtype)[6:])
    run_plan(plan, mode_cases(dtype, fmt, base=EXHAUSTIVE_NS))


_SAMPLE32 = [n for n in held_formats(torch.float32) if n not in CORE]


@pytest.mark.parametrize("name", _SAMPLE32)
def test_float32_sample(name):
    fmt = fewbit.format(name)
    plan = Plan(constructed_inputs(fmt, torch.float32, 1 << 14, CAPS_SAMPLE32), fmt, "float32")
    run_plan(plan, mode_cases(torch.float32, fmt))


# ---------------------------------------------------------------------------------
# The oracle itself: the mapping must name the same value set.


@pytest.mark.parametrize("name", [n for n in names() if has_finite_max(fewbit.format(n))])
def test_gfloat_mapping_same_values(name):
    fmt = fewbit.format(name)
    fi = gfloat_format(fmt)
    assert (fi.k, fi.precision) == (fmt.k, fmt.p)
    assert fi.max == fmt.max and fi.min == fmt.min
    if fmt.has_subnormals:  # gfloat leaves it undefined otherwise (E8M0)
        assert fi.smallest_subnormal == fmt.smallest_subnormal
    assert fi.smallest_normal == fmt.smallest_normal
    assert (fi.num_nans > 0, fi.domain == gfloat.Domain.Extended) == (fmt.has_nans, fmt.has_infs)
    assert fi.has_nz == fmt.has_nz and fi.is_signed == fmt.signed
    if fmt.k <= 16:
        from gfloat import decode_ndarray

        ours = fmt.values()
        theirs = decode_ndarray(fi, np.arange(1 << fmt.k))
        for a in (ours, theirs):
            assert np.isnan(a).sum() == fmt.num_nans
        # The same values code by code (the code layout is the same in both).
        np.testing.assert_array_equal(ours, theirs)
        num = ~np.isnan(ours)
        assert np.array_equal(np.signbit(ours[num]), np.signbit(theirs[num]))  # signed zeros


def test_core_formats_are_testable():
    held = set(held_formats(torch.float32))
    assert set(CORE) <= held
    assert math.isfinite(fewbit.format("ocp_e8m0").max)


def _gfloat_of_hand_made(fmt: FloatFormat):
    """gfloat's FormatInfo of a signed, extended hand-made format (fields as fewbit's)."""
    return gfloat.FormatInfo(name=fmt.name, k=fmt.k, precision=fmt.p, bias=fmt.bias, is_signed=True,
                             domain=gfloat.Domain.Extended, has_nz=fmt.has_nz,
                             num_high_nans=fmt.num_high_nans, has_subnormals=True, is_twos_complement=False)


@pytest.mark.parametrize("fmt, dtype", [
    (FloatFormat("k10p2_bias140", 10, 2, 140), torch.float32),  # normals below float32's (emin -139)
    (FloatFormat("k12p2_bias1040", 12, 2, 1040), torch.float64),  # below float64's (emin -1039)
    (FloatFormat("k4p3_subnormals", 4, 3, -2, num_high_nans=3), torch.float32),  # emax 2 < emin 3
])  # fmt: skip
def test_hand_made_formats_beyond_the_input_dtypes_binades(fmt, dtype):
    """Formats whose binades the input dtype's do not cover: every value, each midpoint
    and each value one input ulp either side, in every deterministic mode, eager and
    native, against gfloat. (Values whose binade lay below the input's normals came back
    orders of magnitude off; a format of subnormals alone skipped its rounding.)"""
    values = fmt.values()
    finite = np.unique(values[np.isfinite(values)])
    mids = (finite[:-1] + finite[1:]) / 2
    x = torch.from_numpy(np.concatenate([finite, mids])).to(dtype)
    x = torch.cat([x, torch.nextafter(x, torch.tensor(math.inf, dtype=dtype)),
                   torch.nextafter(x, torch.tensor(-math.inf, dtype=dtype))])  # fmt: skip
    fi = _gfloat_of_hand_made(fmt)
    for mode in DETERMINISTIC_MODES:
        want = torch.from_numpy(gfloat.round_ndarray(fi, x.double().numpy(), gfloat_mode(mode))).to(dtype)
        for config in ({}, {"compile": False}):
            with fewbit.configure(**config):
                got = fewbit.round(x, fmt, mode)
            bad = bitwise_mismatches(got, want)
            assert not bad.size, (mode, config, describe_mismatches(x, got, want, bad))
