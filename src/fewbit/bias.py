"""Bias of rounding modes: exact, from the paper's closed forms, and measured.

Bias is the mean rounding error in ulps of the target, for positive inputs spread
uniformly between two consecutive target values (fraction ``d`` uniform in [0, 1)),
and over the random integer ``n`` of the stochastic modes. Negative values mean
magnitudes drift toward zero. ``excess=None`` takes infinite-precision inputs;
``excess=D`` inputs with D bits below the target's last bit (``d = j / 2^D``).

``exact`` averages ``P(away | d) - d`` with ``P`` taken from the predicates of
``fewbit.rounding.reference`` (one definition for rounding and bias), in rational
arithmetic.

Block formats (a scale shared by a block of elements): ``block_bias`` and ``block_table``
give the mean error and the clipped share per mode, N and scale rule, exact for blocks
uniform within their largest binade and computed in float64 for Gaussian blocks
(``fewbit.block.bias``).
"""

from __future__ import annotations

import os
from fractions import Fraction
from functools import cache

import torch

from .formats import FloatFormat, format
from .random import Key, as_key, fold_in
from .rounding import RoundMode, modes
from .rounding import round as fewbit_round
from .rounding.checks import dtype_format
from .rounding.modes import MAX_BITS, MODES, natural_bits, parse_mode
from .rounding.reference import probability_away, round_away

__all__ = ["FIGURES", "away_steps", "bias_at", "bias_integral", "check_mode", "closed_form", "exact",
           "excess_bits", "figure", "measure", "outward_error"]

#: Block formats' bias lives in the block layer (``fewbit.block.bias``), which builds on
#: this module; it is answered here too, imported on first use (so not in ``__all__``).
_BLOCK_NAMES = ("BlockBias", "block_bias", "block_table")


def __getattr__(name: str):
    if name in _BLOCK_NAMES:
        from .block import bias as block

        return getattr(block, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_ENUMERATE_UP_TO = 1 << 12  # grid points per period summed one by one


#: The largest D taken: float64 to a 1-bit significand discards 52 bits, and exact values
#: of D far beyond that are still shown (2^-15001); the arithmetic on 2^-D grows with D
#: (D = 2^16: 0.1 s for a row; 10^6 took half a minute, 10^20 overflowed).
MAX_EXCESS = 1 << 16


def _check_excess(excess: int | None) -> None:
    if excess is not None and (isinstance(excess, bool) or not isinstance(excess, int)
                               or not 0 <= excess <= MAX_EXCESS):  # fmt: skip
        raise ValueError(f"excess must be an int in 0..{MAX_EXCESS} or None, got {excess!r}")


def _check_samples(samples: int) -> None:
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 2:
        raise ValueError(f"samples must be an int >= 2, got {samples!r}")


def _check(mode: RoundMode | str, bits: int | None, excess: int | None) -> tuple[RoundMode, int | None]:
    mode = parse_mode(mode)
    info = MODES[mode]
    if info.composite:
        raise ValueError(f"the bias of {mode.value!r} depends on where x lies, not only on d: "
                         "use fewbit.bias.measure")
    _check_excess(excess)
    if info.bits == "natural":
        if bits is not None:
            raise ValueError(f"mode {mode.value!r} takes its N from the excess bits: N = min(D, {MAX_BITS})")
        if excess is not None:
            return mode, natural_bits(excess)
    elif info.stochastic:
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
            raise ValueError(f"mode {mode.value!r} needs bits=N in 1..{MAX_BITS}, got {bits!r}")
    elif bits is not None:
        raise ValueError(f"mode {mode.value!r} is deterministic and takes no bits")
    return mode, bits


def check_mode(mode: RoundMode | str, bits: int | None) -> tuple[RoundMode, int | None]:
    """The mode and N that :func:`bias_at` takes for infinite-precision inputs (``sr``:
    N = None, ideal SR); raises for a composite mode or an N the mode does not take."""
    return _check(mode, bits, None)


def bias_at(mode: RoundMode | str, bits: int | None, d: Fraction) -> Fraction:
    """Expected rounding error, in ulps, of a positive input with fraction ``d``:
    ``P(away) - d``, averaged over the parity of the kept part (RNE, RTO)."""
    mode, bits = _check(mode, bits, None)
    d = Fraction(d)
    if not 0 <= d < 1:
        raise ValueError(f"d must lie in [0, 1), got {d}")
    return _bias_at(mode, bits, d)


def _bias_at(mode: RoundMode, bits: int | None, d: Fraction) -> Fraction:
    if bits is None and mode.is_stochastic:
        return Fraction(0)  # ideal SR (N = D of infinite precision): P(away) = d
    if not mode.is_stochastic:
        p = sum(Fraction(int(round_away(mode, d, odd=odd))) for odd in (False, True)) / 2
    else:
        p = probability_away(mode, d, bits)
    return p - d


def _period(mode: RoundMode, bits: int | None) -> tuple[Fraction, list[Fraction]]:
    """A period of ``bias_at`` in d and the points where it may jump within it.

    Few-bit SR: adding ``2^(1-N)`` to d adds 2 to ``d * 2^N`` (parity kept), so
    ``P(away)`` grows by exactly ``2^(1-N)`` and the bias repeats; it can only jump at
    multiples of ``2^-(N+1)``. Deterministic modes: one period, jumps at 0 and 1/2.
    """
    if not mode.is_stochastic:
        return Fraction(1), [Fraction(0), Fraction(1, 2)]
    period = Fraction(2, 1 << bits)
    step = Fraction(1, 1 << (bits + 1))
    return period, [k * step for k in range(4)]


def exact(mode: RoundMode | str, bits: int | None = None, excess: int | None = None) -> Fraction:
    """Exact mean bias in ulps (see the module docstring)."""
    mode, bits = _check(mode, bits, excess)
    if mode.is_stochastic and bits is None:
        return Fraction(0)
    period, jumps = _period(mode, bits)
    bounds = jumps + [period]
    if excess is None:
        return _from_period_start(mode, bits, period) / period
    h = Fraction(1, 1 << excess)
    if period <= h:  # every grid point sits at the start of a period
        return _bias_at(mode, bits, Fraction(0))
    points = period / h
    if points <= _ENUMERATE_UP_TO:
        return sum((_bias_at(mode, bits, j * h) for j in range(int(points))), Fraction(0)) / points
    # Many grid points: each jump point on its own, then each open piece as a group
    # (constant P, and an arithmetic series of d).
    total = Fraction(0)
    for a, b in zip(bounds, bounds[1:], strict=False):
        total += _bias_at(mode, bits, a)
        inside = (b - a) / h - 1  # grid points strictly between a and b (both on the grid)
        p_inside = _bias_at(mode, bits, (a + b) / 2) + (a + b) / 2
        total += inside * p_inside - inside * (a + b) / 2
    return total / points


@cache
def _pieces(mode: RoundMode, bits: int | None) -> tuple[tuple[Fraction, Fraction, Fraction], ...]:
    """One period of P(away | d): rows ``(from, to, P)``; on each open piece between
    jumps P(away) is constant, its value at the piece's midpoint."""
    period, jumps = _period(mode, bits)
    return tuple((a, b, _bias_at(mode, bits, (a + b) / 2) + (a + b) / 2)
                 for a, b in zip(jumps, [*jumps[1:], period], strict=True))


def _from_period_start(mode: RoundMode, bits: int | None, r: Fraction) -> Fraction:
    """``∫ bias_at(d) dd`` over ``[0, r]``, ``0 <= r <= period``: P(away) minus d on each piece."""
    total = Fraction(0)
    for a, b, p_away in _pieces(mode, bits):
        if a >= r:
            break
        hi = min(b, r)
        total += p_away * (hi - a) - (hi * hi - a * a) / 2
    return total


def away_steps(mode: RoundMode | str, bits: int | None) -> tuple[tuple[Fraction, Fraction], ...]:
    """P(away | d) on ``[0, 1)`` as a step function: rows ``(d, P)``, P(away) = P from d to
    the next row's d (the last row's to 1), no two neighbours equal. What the bias of a
    distribution with a density that is not flat over an ulp is made of (Gaussian blocks,
    ``fewbit.block.bias``). Few-bit SR has up to ``2^(N+1)`` rows; ideal SR (``P = d``) is no
    step function and raises."""
    mode, bits = _check(mode, bits, None)
    if mode.is_stochastic and bits is None:
        raise ValueError("ideal SR has P(away | d) = d, not a step function")
    return _away_steps(mode, bits)


@cache
def _away_steps(mode: RoundMode, bits: int | None) -> tuple[tuple[Fraction, Fraction], ...]:
    period, _ = _period(mode, bits)
    rows: list[tuple[Fraction, Fraction]] = []
    for k in range(int(1 / period)):  # each period adds the period to P(away) (see _period)
        for a, _, p_away in _pieces(mode, bits):
            if not rows or rows[-1][1] != p_away + k * period:
                rows.append((a + k * period, p_away + k * period))
    return tuple(rows)


def bias_integral(mode: RoundMode | str, bits: int | None, d0: Fraction, d1: Fraction) -> Fraction:
    """``∫ bias_at(mode, bits, d) dd`` over ``[d0, d1]`` (``0 <= d0 <= d1 <= 1``), exact:
    the mean error, in ulps, of inputs uniform on that part of an ulp, times its width.
    What the bias of a distribution that is not uniform over whole ulps is made of
    (block formats: ``fewbit.block.bias``)."""
    mode, bits = _check(mode, bits, None)
    d0, d1 = Fraction(d0), Fraction(d1)
    if not 0 <= d0 <= d1 <= 1:
        raise ValueError(f"need 0 <= d0 <= d1 <= 1, got d0 = {d0}, d1 = {d1}")
    if mode.is_stochastic and bits is None:
        return Fraction(0)  # ideal SR

    def from_zero(d: Fraction) -> Fraction:
        # The bias repeats with the period, so whole periods each add the same integral.
        period, _ = _period(mode, bits)
        whole = d // period
        rest = d - whole * period
        return whole * _from_period_start(mode, bits, period) + _from_period_start(mode, bits, rest)

    return from_zero(d1) - from_zero(d0)


def closed_form(mode: RoundMode | str, bits: int, excess: int | None = None) -> Fraction:
    """The paper's formulas (section III): SRFF ``-2^-(N+1)`` for infinite precision
    and ``(2^-D - 2^-N)/2`` with D excess bits; SRF ``0`` and ``2^-(D+1)``; SRC ``0``.

    Where they equal :func:`exact`: SRFF for ``N <= D``; SRF for ``N < D`` (its
    appendix derivation needs D > N; at ``N = D`` SRF is exact SR and unbiased,
    although the main text says ``N <= D``); SRC wherever given. The paper states them
    for ``N <= D`` (with ``N > D`` every few-bit mode is exact SR): ValueError beyond."""
    mode = parse_mode(mode)
    if mode not in (RoundMode.SRFF, RoundMode.SRF, RoundMode.SRC):
        raise ValueError(f"the paper gives closed forms for srff, srf and src, not {mode.value!r}")
    if isinstance(bits, bool) or not isinstance(bits, int) or bits < 1:
        raise ValueError(f"bits must be an int >= 1, got {bits!r}")
    _check_excess(excess)
    if excess is not None and bits > excess:
        raise ValueError(f"the paper's closed forms are for N <= D, not N = {bits} > D = {excess}")
    two = Fraction(2)
    if excess is None:
        return -(two ** -(bits + 1)) if mode is RoundMode.SRFF else Fraction(0)
    if mode is RoundMode.SRFF:
        return (two ** -excess - two ** -bits) / 2
    if mode is RoundMode.SRF:
        return two ** -(excess + 1)
    return Fraction(0)


def excess_bits(target: FloatFormat | str, source: FloatFormat | str) -> int:
    """D for inputs of ``source`` rounded to ``target`` in the normal range (for intM,
    whose values are all subnormal, the top binade): P_s - P_t, an intM's P less its
    sign bit (``FloatFormat.top_p``), for formats or their names; ValueError where D would
    be negative (``fewbit.rounding.modes.excess_bits``, keyword-only, gives it)."""
    target, source = format(target), format(source)
    excess = modes.excess_bits(source=source, target=target)
    if excess < 0:
        raise ValueError(f"{source.name} has fewer significand bits than {target.name}")
    return excess


def measure(
    x: torch.Tensor,
    fmt: FloatFormat | str,
    mode: RoundMode | str,
    bits: int | None,
    samples: int,
    seed: int | Key = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empirical bias per input, through ``fewbit.round`` with generated bits.

    Rounds ``x`` ``samples`` times (keys ``fold_in(seed, s)``); returns the mean error
    in ulps of each input and its standard error (float64 tensors of x's shape); a
    deterministic mode (``rne``, ...) takes no seed, and its errors, the same every sample,
    have standard error 0.
    """
    _check_samples(samples)
    # fewbit.round refuses a seed for a deterministic mode: measure's default seed is not the caller's.
    stochastic = MODES[parse_mode(mode)].stochastic
    key = as_key(seed)
    ulp = _ulp_at(x, fmt)
    # The variance from the errors less the first sample's: an error that never changes (a
    # deterministic mode, or P(away) 0 or 1) has variance 0, where E[err^2] - E[err]^2 left
    # float64 roundoff (a standard error of 4e-9 for RNE over three samples).
    first = None
    total = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    dev_total, dev_sq = torch.zeros_like(total), torch.zeros_like(total)
    for s in range(samples):
        r = fewbit_round(x, fmt, mode, bits=bits, seed=fold_in(key, s) if stochastic else None)
        err = (r.double().abs() - x.double().abs()) / ulp
        first = err if first is None else first
        dev = err - first
        total += err
        dev_total += dev
        dev_sq += dev * dev
    shift = dev_total / samples
    var = (dev_sq / samples - shift * shift).clamp(min=0) * samples / (samples - 1)
    return total / samples, (var / samples).sqrt()


def outward_error(x: torch.Tensor, rounded: torch.Tensor, fmt: FloatFormat | str) -> torch.Tensor:
    """``|rounded| - |x|`` in ulps of ``fmt`` at ``x`` (float64, x's shape): the error of
    a rounding of ``x`` to ``fmt``, positive where it moved the magnitude away from zero,
    the sign of the bias. Where ``x`` is a value of ``fmt`` (or lies beyond its largest)
    the ulp is taken as 1, so a rounding that keeps such a value has error 0."""
    return (rounded.double().abs() - x.double().abs()) / _ulp_at(x, fmt)


def _ulp_at(x: torch.Tensor, fmt: FloatFormat | str) -> torch.Tensor:
    """The gap between the values of ``fmt`` around each ``x`` (float64); 1 where ``x`` is
    a value or lies beyond the largest or the most negative (no gap: errors there are 0)."""
    # x itself, not |x|: a two's complement intM reaches one step further below zero than
    # above (int8's -2 and -127/64 are a gap of 1/64 that |x| = 1.99 beyond the largest
    # value, 127/64, hid), as `fewbit round` finds the neighbours. An unsigned format has
    # no gap below zero: there |x|'s, as before.
    y = x if format(fmt).signed else x.abs()
    ulp = fewbit_round(y, fmt, "rup", sat=True).double() - fewbit_round(y, fmt, "rdn", sat=True).double()
    return torch.where(ulp > 0, ulp, torch.ones_like(ulp))


#: The paper's two bias figures, set up so that its printed biases follow from the
#: theory. Figure 2's caption says 2 random bits, but its numbers (-0.046875 for SRFF,
#: +0.015625 for SRF) are the exact biases for N = 3 and D = 5; with N = 2 SRFF would
#: be -7/64. BFloat16 (P = 8) into a P = 3 target gives D = 5.
FIGURES = {
    1: {"source": torch.float64, "target": "binary8p4", "bits": 2, "modes": ("srff", "srf"),
        "samples": 5000, "title": "X at cell midpoints (as infinite precision)"},
    2: {"source": torch.bfloat16, "target": "binary8p3", "bits": 3, "modes": ("srff", "srf", "src"),
        "samples": 100_000, "title": "bfloat16 inputs (D = 5)"},
}


def figure(number: int, out_dir: str, seed: int = 0, samples: int | None = None) -> list[dict]:
    """Draw the paper's Figure 1 or 2 as ``figure<number>.png`` in ``out_dir``: the mean
    rounded value against X on [1, 2), one panel per mode, with the measured and the
    exact bias. Returns, per mode, the measured bias, its standard error and the exact
    value (in ulps of the target)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if number not in FIGURES:
        raise ValueError(f"figure must be 1 or 2, not {number!r}")
    cfg = FIGURES[number]
    samples = cfg["samples"] if samples is None else samples
    _check_samples(samples)
    if cfg["source"] == torch.bfloat16:  # every bfloat16 value in [1, 2)
        x = (1 + torch.arange(128, dtype=torch.float64) / 128).to(torch.bfloat16)
    else:
        # Midpoints of 512 equal cells of [1, 2): 64 per ulp of binary8p4, so the mean
        # over these X is exactly the mean over uniform d (the bias is linear between
        # jumps at multiples of 2^-(N+1), which fall on cell edges), no X on a jump.
        x = 1 + (torch.arange(512, dtype=torch.float64) + 0.5) / 512
    excess = excess_bits(cfg["target"], dtype_format(cfg["source"]))
    # Round many copies at once: each call covers `reps` samples of every X.
    reps = max(1, min(samples, 200_000 // x.numel()))
    calls = max(2, -(-samples // reps))
    results = []
    fig, axes = plt.subplots(1, len(cfg["modes"]), figsize=(4.2 * len(cfg["modes"]), 4), sharey=True)
    for ax, mode in zip(axes, cfg["modes"], strict=True):
        mean_err, se = measure(x.repeat(reps), cfg["target"], mode, cfg["bits"], calls,
                               fold_in(as_key(seed), number))
        per_x = mean_err.view(reps, -1).mean(0)
        measured = per_x.mean().item()
        stderr = se.pow(2).sum().sqrt().item() / se.numel()
        exact_value = float(exact(mode, cfg["bits"], excess if number == 2 else None))
        results.append({"mode": mode, "measured": measured, "stderr": stderr, "exact": exact_value})
        ulp = (fewbit_round(x, cfg["target"], "rup") - fewbit_round(x, cfg["target"], "rtz")).double()
        xs = x.double()
        ax.plot(xs, xs, color="grey", lw=1, label="Y = X")
        ax.plot(xs, xs + per_x * ulp, ".", ms=3, label="mean rounded value")
        ax.set_title(f"{mode.upper()}: bias {measured:+.4f} (exact {exact_value:+.4f}) ulp", fontsize=9)
        ax.set_xlabel("X")
    axes[0].set_ylabel("mean of rounded X")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Figure {number}: {cfg['title']} -> {cfg['target']}, N = {cfg['bits']} random bits, "
                 f"{calls * reps} samples per X", fontsize=10)
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    fig.savefig(os.path.join(out_dir, f"figure{number}.png"), dpi=110)
    plt.close(fig)
    return results
