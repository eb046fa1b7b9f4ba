"""Bias of block-scaled formats: the mean error of a block's elements per rounding mode,
N and scale rule, for a stated distribution of the values in a block, and the share of
elements that the rule lets saturate.

Element ``i`` of a block holds ``q_i = round(x_i / S)`` and stands for ``q_i S``, ``S`` the
block's scale, which the rule sets from the block's largest magnitude ``amax``. So a
block's error is the elements' rounding error (``fewbit.bias``'s per-fraction bias, over
the element format's grid) plus clipping: a scaled magnitude above the element format's
largest value ``M`` saturates to ``M`` in every mode.

Distributions (errors are of magnitudes, ``|q S| - |x|``, negative towards zero; signs
are fair coin flips apart from the magnitudes, and matter only for two's-complement
elements, ``intM``, whose negative side reaches one step further, to ``-2``, and for
unsigned ones, whose negative half saturates to 0: ``mx_p3109_k6p3ue`` clips 7/8 of a
uniform block):

``"uniform"``
    The block's ``B`` magnitudes independent and uniform in ``[1, 2)``: the block's
    largest binade. Error per element in absolute units, i.e. in units of ``2^k`` for
    magnitudes uniform in ``[2^k, 2^(k+1))``, the same figures while the scales stay in
    range (E8M0 scales are powers of two; NVFP4 is taken with its per-tensor scale 1, as
    for a tensor whose amax is ``M`` times E4M3's 448, or that times a power of two).
    **Exact** (:class:`fractions.Fraction`): the scale is a step function of ``amax``
    (:func:`scale_steps`), and on each step the error is a piecewise-linear integral over
    the element grid.
``"gaussian"``
    The block's values independent ``N(0, sigma^2)``, ``sigma = 2^u`` with ``u`` uniform in
    ``[0, 1)`` drawn per block (so a block's place within a binade, which power-of-two
    scales see, is spread evenly rather than fixed by ``sigma = 1``). Error per element
    in units of the block's ``sigma``. **Computed**, not sampled: for one sigma the figure
    is a finite sum of closed forms in erf, erfc and exp over the scale's steps and the
    jumps of the expected rounded value (:func:`_gaussian_at`), and the mean over ``u`` is
    Gauss-Legendre quadrature. float64 throughout, so a float, not a Fraction: within
    about ``1e-15`` (units of sigma) of the true figure, the float64 roundoff of sums that
    nearly cancel (checked against 40-digit arithmetic), where the quadrature has
    converged to ``1e-12`` of the figure; blocks with amax below ``2^-ceil(60/B)`` (fewer
    than ``2^-60`` of them) or above 32 are left out. Few-bit modes up to ``N =``
    :data:`MAX_GAUSSIAN_BITS` (the work grows as ``2^N``).

Either distribution can also be **sampled** (``samples=``): float32 blocks rounded by
``fewbit.block.quantize`` with generated bits, the estimate with its standard error over
blocks (blocks are independent, a block's elements are not).

Modes: those whose bias depends on the fraction ``d`` alone, the same for ``x`` and
``-x``: rne, rna, rtz, srff, srf, src, src_odd, and sr (ideal SR in the exact figures;
``N = min(D, 32)`` on float32 inputs when sampled).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import cache

import torch
from numpy.polynomial.legendre import leggauss

from ..bias import away_steps, bias_integral, check_mode
from ..formats import FloatFormat
from ..random import as_key, fold_in
from ..rounding.modes import RoundMode, parse_mode
from .formats import SCALE_RULES, BlockFormat, check_rule, check_storable
from .formats import format as block_format
from .kernel import block_scales, make_block_spec

__all__ = ["DISTRIBUTIONS", "BlockBias", "block_bias", "block_table", "element_integrals", "scale_steps"]

DISTRIBUTIONS = ("uniform", "gaussian")

#: Modes whose bias is not a function of d alone: the sign (rup, rdn) or the parity of
#: each grid point (rto) decides, which a per-d bias averages away.
_NOT_PER_D = {RoundMode.RUP: "the sign of x", RoundMode.RDN: "the sign of x",
              RoundMode.RTO: "the parity of each grid point"}

#: Elements per call when sampling: below fewbit's compile threshold, so that a table of
#: many (mode, rule) rows runs eager instead of compiling a kernel for each.
_CHUNK_ELEMENTS = 1 << 15


@dataclass(frozen=True)
class BlockBias:
    """The bias of one (format, mode, N, rule, distribution).

    Attributes:
        mean_error: mean of ``|q S| - |x|`` per element (units: see the module docstring).
        clipped: the share of elements whose scaled magnitude exceeds ``M`` (they saturate).
        exact: True when the figures are not sampled: Fractions for uniform blocks, float64
            for Gaussian blocks (computed, within float64 roundoff); False for sampled
            estimates.
        stderr, clipped_stderr: standard errors of the estimates (0 when exact).
        samples: blocks drawn (None when exact).
    """

    format: str
    mode: str
    bits: int | None
    rule: str
    distribution: str
    mean_error: Fraction | float
    clipped: Fraction | float
    exact: bool
    stderr: float = 0.0
    clipped_stderr: float = 0.0
    samples: int | None = None


def _checked(bfmt: BlockFormat | str, mode: RoundMode | str, bits: int | None, rule: str | None,
             distribution: str, samples: int | None) -> tuple[BlockFormat, RoundMode, int | None, str]:
    bfmt = block_format(bfmt)
    check_storable(bfmt)  # a scale of more bits has too many steps for the exact figures
    mode, bits = check_mode(mode, bits)
    if mode in _NOT_PER_D:
        raise ValueError(f"the block bias of {mode.value!r} depends on {_NOT_PER_D[mode]}, not on d alone")
    rule = check_rule(bfmt.rule if rule is None else rule, bfmt.scale)
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {', '.join(DISTRIBUTIONS)}, not {distribution!r}")
    if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int) or samples < 2):
        raise ValueError(f"samples must be an int >= 2 (blocks), got {samples!r}")
    if distribution == "gaussian" and samples is None and bits is not None and bits > MAX_GAUSSIAN_BITS:
        raise ValueError(f"the Gaussian figures are computed for N <= {MAX_GAUSSIAN_BITS}, not {bits}: "
                         "ask for a sampled estimate (samples=, the CLI's --samples)")
    return bfmt, mode, bits, rule


def rules_for(bfmt: BlockFormat | str) -> list[str]:
    """The scale rules that fit the format's scale (E8M0: floor, ceil, rceil, even)."""
    bfmt = block_format(bfmt)
    return [name for name, r in SCALE_RULES.items() if r.power_of_two == bfmt.power_of_two]


# --- Exact figures -----------------------------------------------------------------------


def _significand_bits(f: Fraction) -> int:
    """Bits of a positive dyadic number's odd significand."""
    n = f.numerator
    return (n // (n & -n)).bit_length()


def _simplest(a: float, b: float) -> Fraction:
    """Of two neighbouring floats, the one with the shorter significand."""
    return min(Fraction(a), Fraction(b), key=_significand_bits)


Step = tuple[Fraction, Fraction, Fraction]


#: Points each bracket of a scale jump is cut into per kernel call while searching for it.
_SPLIT = 32


@cache
def scale_steps(bfmt: BlockFormat | str, rule: str | None = None, lo: Fraction = Fraction(1),
                hi: Fraction = Fraction(2)) -> tuple[Step, ...]:
    """The block scale ``S`` as a step function of ``amax`` on ``[lo, hi)`` (default the
    binade ``[1, 2)``; ends that are floats): rows ``(from, to, S)``, read off
    ``fewbit.block``'s kernel (the rules are stated there once).

    Every rule's ``S`` is non-decreasing in ``amax``, so a bracket of float64 ``amax`` whose
    ends have the same ``S`` holds no jump; each bracket whose ends differ is cut in
    :data:`_SPLIT` (every bracket in one kernel call) until each jump lies between two
    neighbouring floats, and the threshold is the shorter of them: thresholds are short
    dyadic numbers (``2^j``, ``M 2^j``, ``(2 - 2^-P) 2^j``, ``M`` times an E4M3 value or
    midpoint). Which side the threshold itself falls on does not matter for a continuous
    distribution. NVFP4: per-tensor scale 1.
    """
    bfmt = block_format(bfmt)
    check_storable(bfmt)  # (a binary32 scale: 2^23 steps a binade, brackets without end)
    rule = check_rule(bfmt.rule if rule is None else rule, bfmt.scale)
    lo, hi = Fraction(lo), Fraction(hi)
    if not (0 < lo < hi and Fraction(float(lo)) == lo and Fraction(float(hi)) == hi):
        raise ValueError(f"need 0 < lo < hi, both floats, got lo = {lo}, hi = {hi}")
    spec = make_block_spec(torch.float64, bfmt, rule, RoundMode.RNE, True, None, None)

    def scale_at(amax: torch.Tensor) -> torch.Tensor:
        return block_scales(amax.reshape(-1, 1), spec, None)[1].view(amax.shape)

    def broken(where: str) -> RuntimeError:
        return RuntimeError(f"{bfmt.name}, rule {rule}: the scale is not a step function of amax with "
                            f"short thresholds ({where})")

    cuts = torch.arange(1, _SPLIT, dtype=torch.float64) / _SPLIT
    left = torch.tensor([float(lo)], dtype=torch.float64)
    right = torch.tensor([math.nextafter(float(hi), 0.0)], dtype=torch.float64)
    while True:
        # Interior points rounded to floats stay within the bracket and in order; once the
        # ends are neighbouring floats the bracket comes back unchanged.
        inner = torch.minimum(left[:, None] + (right - left)[:, None] * cuts, right[:, None])
        points = torch.cat([left[:, None], inner, right[:, None]], dim=1)
        scales = scale_at(points)
        if (scales[:, 1:] < scales[:, :-1]).any():
            raise broken("it decreases")
        jump = scales[:, 1:] != scales[:, :-1]
        new_left, new_right = points[:, :-1][jump], points[:, 1:][jump]
        if torch.equal(new_left, left) and torch.equal(new_right, right):
            break
        left, right = new_left, new_right
    steps = []
    start, s = lo, Fraction(scale_at(torch.tensor(float(lo), dtype=torch.float64)).item())
    for a, b in zip(left.tolist(), right.tolist(), strict=True):
        if math.nextafter(a, math.inf) != b:
            raise broken(f"stuck between {a} and {b}")
        threshold = _simplest(a, b)
        if _significand_bits(threshold) > 40:
            raise broken(f"near {threshold}")
        if threshold > start:  # not the single amax = lo that ceil still scales down
            steps.append((start, threshold, s))
        start, s = threshold, Fraction(scale_at(torch.tensor(b, dtype=torch.float64)).item())
    steps.append((start, hi, s))
    return tuple(steps)


def _largest(element: FloatFormat, negative: bool) -> Fraction:
    """The largest magnitude on one side: ``M``, or for two's complement one step more below 0."""
    return Fraction(element.max_negative_magnitude if negative else element.max)


@cache
def _cells(element: FloatFormat, negative: bool) -> tuple[tuple[Fraction, Fraction], ...]:
    """``(value, ulp)`` for each magnitude on one side below its largest: the cells
    ``[v, v + ulp)`` in which a magnitude has fraction ``d = (y - v) / ulp``."""
    top = _largest(element, negative)
    side = (-v if negative else v for v in element.values())
    values = sorted({Fraction(v) for v in side if 0 <= v <= top})
    return tuple((lo, hi - lo) for lo, hi in zip(values, values[1:], strict=False))


def element_integrals(element: FloatFormat, mode: RoundMode | str, bits: int | None,
                      a: Fraction, b: Fraction, negative: bool = False) -> tuple[Fraction, Fraction]:
    """``(∫ e(y) dy, ∫ [y > M] dy)`` over scaled magnitudes ``y`` in ``[a, b]`` (``0 <= a <= b``)
    of one sign, ``e(y)`` the expected error of rounding ``y`` to ``element``, saturating:
    ``ulp`` times ``fewbit.bias``'s per-fraction bias below ``M``, ``M - y`` above it (``M``:
    that side's largest magnitude)."""
    mode, bits = check_mode(mode, bits)
    a, b = Fraction(a), Fraction(b)
    err = Fraction(0)
    for lo, ulp in _cells(element, negative):
        c0, c1 = max(a, lo), min(b, lo + ulp)
        if c0 < c1:  # y = lo + d ulp, dy = ulp dd; an error of bias_at ulps is bias_at * ulp
            err += ulp * ulp * bias_integral(mode, bits, (c0 - lo) / ulp, (c1 - lo) / ulp)
    top = _largest(element, negative)
    c0 = max(a, top)
    if b <= c0:
        return err, Fraction(0)
    err -= ((b - top) ** 2 - (c0 - top) ** 2) / 2  # ∫ (M - y) dy
    return err, b - c0


def _uniform_exact(bfmt: BlockFormat, mode: RoundMode, bits: int | None,
                   rule: str) -> tuple[Fraction, Fraction]:
    """Magnitudes i.i.d. uniform on [1, 2), CDF F(t) = t - 1. The block's elements are
    exchangeable, so the mean per element is element 1's. With S = s_j for amax in
    [t_j, t_(j+1)) and h_j the error of one element under s_j,

        E[h(X_1); amax < t] = E[h(X_1); X_1 < t] F(t)^(B-1)     (the others below t too),

    so E[error] = sum_j H_j(t_(j+1)) F(t_(j+1))^(B-1) - H_j(t_j) F(t_j)^(B-1), with
    H_j(t) = ∫_1^t s_j e(x / s_j) dx = s_j^2 ∫_(1/s_j)^(t/s_j) e(y) dy; the clipped share
    likewise with the indicator [y > M] (one factor s_j). Signs: the mean of the two
    sides (the same unless the element is two's complement)."""
    element = bfmt.element
    sides = (False, True) if element.max_negative_magnitude != element.max else (False,)

    def integrals(a: Fraction, b: Fraction) -> tuple[Fraction, Fraction]:
        both = [element_integrals(element, mode, bits, a, b, negative) for negative in sides]
        return sum(e for e, _ in both) / len(sides), sum(c for _, c in both) / len(sides)

    err = clip = Fraction(0)
    for t0, t1, s in scale_steps(bfmt, rule):
        for t, sign in ((t1, 1), (t0, -1)):
            e, c = integrals(1 / s, t / s)
            weight = sign * (t - 1) ** (bfmt.block_size - 1)
            err += weight * s * s * e
            clip += weight * s * c
    return err, clip


# --- Computed Gaussian figures ------------------------------------------------------------

#: Gauss-Legendre nodes over ``u`` (``sigma = 2^u``): the figure at one sigma is a finite sum
#: of smooth functions of sigma, and twice as many nodes change no figure by 1e-12 of itself
#: (tests/test_block_bias.py).
GAUSS_NODES = 16

#: The largest N of a few-bit mode whose Gaussian figure is computed: the sum runs over
#: every jump of the expected rounded value, up to ``2^N`` per element cell and scale.
MAX_GAUSSIAN_BITS = 12

#: amax above 32 (16 sigma at least) has a probability below 1e-55 for any block size here.
_GAUSSIAN_TOP = Fraction(32)


def _gaussian_bottom(block_size: int) -> Fraction:
    """An amax below which fewer than ``2^-60`` of the blocks lie (``P(|x| < a) < a`` for
    ``sigma >= 1``): the figures leave them out."""
    return Fraction(1, 1 << -(-60 // block_size))


@cache
def _rounded_steps(element: FloatFormat, mode: RoundMode, bits: int | None,
                   negative: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The expected rounded magnitude ``R(y)`` of scaled magnitudes ``y`` on one side (over
    the random integer) as a step function: ``(y_j, delta_j)``, ``R(0) = 0`` and ``R`` jumps by
    ``delta_j`` at ``y_j``; the last jump lands on ``M``, where saturation holds it. Exact in
    float64: a cell's ``v + ulp d`` spans at most ``P + N + 2`` bits."""
    cells = _cells(element, negative)
    v = torch.tensor([float(lo) for lo, _ in cells], dtype=torch.float64)[:, None]
    ulp = torch.tensor([float(u) for _, u in cells], dtype=torch.float64)[:, None]
    d, p_away = torch.tensor([[float(d), float(p)] for d, p in away_steps(mode, bits)], dtype=torch.float64).T
    top = torch.tensor([float(_largest(element, negative))], dtype=torch.float64)
    y = torch.cat([(v + ulp * d).flatten(), top])
    rounded = torch.cat([(v + ulp * p_away).flatten(), top])
    delta = torch.diff(rounded, prepend=rounded.new_zeros(1))
    return y[delta != 0], delta[delta != 0]


def _gaussian_at(bfmt: BlockFormat, mode: RoundMode, bits: int | None, rule: str,
                 sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean error / sigma, clipped share)`` for blocks of i.i.d. ``N(0, sigma^2)`` values,
    at each sigma of a float64 tensor (in ``[1, 2)``).

    As for uniform blocks, element 1 stands for all, and with ``G(t) = erf(t / (sigma
    sqrt 2))^(B-1)`` the chance that the other ``B - 1`` magnitudes lie below ``t``,

        E[error] = sum_k J_k(b_k) G(b_k) - J_k(a_k) G(a_k),   J_k(t) = E[e_k(|x_1|); |x_1| < t],

    over the scale's steps ``[a_k, b_k) -> s_k`` (:func:`scale_steps`), ``e_k`` the error under
    ``s_k``. With ``T(x) = P(|x_1| > x) = erfc(x / (sigma sqrt 2))`` and ``H(x) = E[|x_1|; |x_1| >
    x] = sigma sqrt(2/pi) exp(-x^2 / (2 sigma^2))``, a step function of expected rounded
    magnitudes (:func:`_rounded_steps`, jumps ``delta_j`` at ``x_j``, scaled by ``s_k``) gives

        J_k(t) = sum_(x_j < t) delta_j (T(x_j) - T(t)) - (H(0) - H(t)),

    a sum of jumps times tail probabilities (upper tails through erfc, so nothing is lost
    where they are small). Ideal SR rounds without error below ``c = s_k M`` and to ``c``
    above it: ``J_k(t) = c (T(c) - T(t)) - (H(c) - H(t))`` for ``t > c``. The clipped share
    is the same sum with ``J_k(t) = T(c) - T(t)`` for ``t > c``. Two's complement elements:
    the mean of the two sides, as for uniform blocks."""
    element = bfmt.element
    sides = (False, True) if element.max_negative_magnitude != element.max else (False,)
    ideal = mode.is_stochastic and bits is None
    arg = 1 / (sigma[:, None] * math.sqrt(2))  # x * arg: the argument of erf and erfc

    def tails(x: torch.Tensor) -> torch.Tensor:
        return torch.special.erfc(x * arg)  # (sigma, x)

    def tail(t: float) -> torch.Tensor:
        return torch.special.erfc(t * arg[:, 0])

    def upper_mean(x: float) -> torch.Tensor:
        return sigma * math.sqrt(2 / math.pi) * torch.exp(-(x / sigma) ** 2 / 2)

    def others_below(t: float) -> torch.Tensor:
        return torch.special.erf(t * arg[:, 0]) ** (bfmt.block_size - 1)

    def ideal_error(t: float, c: float) -> torch.Tensor:
        c_t = min(c, t)
        return c * (tail(c_t) - tail(t)) - (upper_mean(c_t) - upper_mean(t))

    def step_errors(a: float, b: float, s: float, y: torch.Tensor,
                    delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(J(a), J(b))`` for a step function of rounded values under scale ``s``."""
        x = s * y
        n_a, n_b = torch.searchsorted(x, torch.tensor([a, b], dtype=torch.float64)).tolist()
        # Summed pairwise (torch.sum), as the jumps' total nearly cancels H(0) - H(t).
        weighted = tails(x[:n_b]) * (s * delta[:n_b])
        below_a = weighted[:, :n_a].sum(1)
        below_b = below_a + weighted[:, n_a:].sum(1)
        return tuple(jumps - s * delta[:n].sum().item() * tail(t) - (upper_mean(0.0) - upper_mean(t))
                     for t, n, jumps in ((a, n_a, below_a), (b, n_b, below_b)))

    err = torch.zeros_like(sigma)
    clip = torch.zeros_like(sigma)
    for negative in sides:
        top = float(_largest(element, negative))
        if not ideal:
            y, delta = _rounded_steps(element, mode, bits, negative)
        for step in scale_steps(bfmt, rule, _gaussian_bottom(bfmt.block_size), _GAUSSIAN_TOP):
            a, b, s = (float(v) for v in step)
            c = s * top
            if ideal:
                at_a, at_b = ideal_error(a, c), ideal_error(b, c)
            else:
                at_a, at_b = step_errors(a, b, s, y, delta)
            err += others_below(b) * at_b - others_below(a) * at_a
            clip += (others_below(b) * (tail(min(c, b)) - tail(b))
                     - others_below(a) * (tail(min(c, a)) - tail(a)))
    return err / (len(sides) * sigma), clip / len(sides)


def _gaussian(bfmt: BlockFormat, mode: RoundMode, bits: int | None, rule: str) -> tuple[float, float]:
    """The figures of :func:`_gaussian_at` averaged over ``sigma = 2^u``, ``u`` uniform in
    ``[0, 1)``, by Gauss-Legendre quadrature in ``u``."""
    u, w = (torch.from_numpy(t) for t in leggauss(GAUSS_NODES))
    err, clip = _gaussian_at(bfmt, mode, bits, rule, 2.0 ** ((u + 1) / 2))
    return (w @ err).item() / 2, (w @ clip).item() / 2


# --- Sampled figures ---------------------------------------------------------------------


def _draw(distribution: str, blocks: int, size: int,
          gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, unit)``: float32 blocks ``(blocks, size)`` and each block's unit of error."""
    if distribution == "uniform":
        sign = torch.randint(0, 2, (blocks, size), generator=gen, dtype=torch.float64) * 2 - 1
        x = (1 + torch.rand(blocks, size, generator=gen, dtype=torch.float64)) * sign
        unit = torch.ones(blocks, 1, dtype=torch.float64)
    else:
        unit = 2.0 ** torch.rand(blocks, 1, generator=gen, dtype=torch.float64)
        x = unit * torch.randn(blocks, size, generator=gen, dtype=torch.float64)
    return x.float(), unit


def _sampled(bfmt: BlockFormat, mode: RoundMode, bits: int | None, rule: str, distribution: str,
             samples: int, seed: int) -> tuple[float, float, float, float]:
    from . import quantize  # the package imports this module's users, not the reverse

    size, top, bottom = bfmt.block_size, bfmt.element.max, bfmt.element.max_negative_magnitude
    gen = torch.Generator().manual_seed(seed)
    key = as_key(seed)
    per_chunk = max(1, _CHUNK_ELEMENTS // size)
    err_blocks, clip_blocks = [], []
    for i, done in enumerate(range(0, samples, per_chunk)):
        x, unit = _draw(distribution, min(per_chunk, samples - done), size, gen)
        if bfmt.tensor_scale:
            # A first block holding M * (the scale format's max) makes the per-tensor scale 1.
            x = torch.cat([torch.full((1, size), top * bfmt.scale.max), x])
        seed_i = fold_in(key, i) if mode.is_stochastic else None
        bt = quantize(x, bfmt, mode, bits=bits, seed=seed_i, rule=rule)
        r = bt.dequantize(torch.float64).view(x.shape)
        scale = bt.block_scales(torch.float64).view(-1, 1)
        if bfmt.tensor_scale:
            x, r, scale = x[1:], r[1:], scale[1:]
        xd = x.double().abs()
        err_blocks.append(((r.abs() - xd) / unit).mean(1))
        clip_blocks.append((xd > torch.where(x < 0, bottom, top) * scale).double().mean(1))

    def mean_se(t: list[torch.Tensor]) -> tuple[float, float]:
        t = torch.cat(t)
        return t.mean().item(), (t.var() / t.numel()).sqrt().item()

    return (*mean_se(err_blocks), *mean_se(clip_blocks))


def block_bias(
    bfmt: BlockFormat | str,
    mode: RoundMode | str,
    bits: int | None = None,
    rule: str | None = None,
    distribution: str = "uniform",
    *,
    samples: int | None = None,
    seed: int = 0,
) -> BlockBias:
    """The mean error per element and the clipped share of block format ``bfmt`` (module
    docstring: distributions, units, modes, accuracy).

    Without ``samples`` the figures are exact (``exact=True``): Fractions for
    ``distribution="uniform"``, float64 for ``"gaussian"`` (few-bit modes up to ``N =``
    :data:`MAX_GAUSSIAN_BITS`). With ``samples``: sampled through ``fewbit.block.quantize``
    with ``samples`` blocks and generated bits from ``seed``, with standard errors
    (``exact=False``). ``rule``: the format's default unless given.
    """
    bfmt, mode, bits, rule = _checked(bfmt, mode, bits, rule, distribution, samples)
    head = (bfmt.name, mode.value, bits, rule, distribution)
    if samples is None:
        figures = _uniform_exact if distribution == "uniform" else _gaussian
        return BlockBias(*head, *figures(bfmt, mode, bits, rule), exact=True)
    mean, se, clip, clip_se = _sampled(bfmt, mode, bits, rule, distribution, samples, seed)
    return BlockBias(*head, mean, clip, exact=False, stderr=se, clipped_stderr=clip_se, samples=samples)


TABLE_MODES = ("rne", "srff", "srf", "src", "sr")


def block_table(
    bfmt: BlockFormat | str,
    bits: int,
    modes: tuple[str, ...] | None = None,
    rules: tuple[str, ...] | None = None,
    *,
    samples: int | None = None,
    seed: int = 0,
) -> list[tuple[BlockBias, BlockBias]]:
    """``(uniform, gaussian)`` for every mode (default: rne, srff, srf, src, sr) and every
    rule that fits the format's scale; ``bits`` is N for the modes that take it. Uniform
    figures exact; Gaussian ones computed, or sampled with ``samples`` blocks (and
    ``seed``) when given. Every argument is checked before anything is computed."""
    modes = TABLE_MODES if modes is None else modes
    rules = tuple(rules_for(bfmt)) if rules is None else rules
    rows = []
    for mode in modes:
        n = bits if parse_mode(mode).takes_bits else None
        for rule in rules:
            rows.append((mode, n, rule))
            _checked(bfmt, mode, n, rule, "gaussian", samples)
    return [(block_bias(bfmt, m, n, r), block_bias(bfmt, m, n, r, "gaussian", samples=samples, seed=seed))
            for m, n, r in rows]
