"""fewbit.bias: exact bias against brute force, the paper's closed forms, and measurement."""

import math
import re
from fractions import Fraction

import pytest
import torch

import fewbit
from fewbit import bias
from fewbit.cli import main
from fewbit.rounding import RoundMode
from fewbit.rounding.reference import round_away

FEW_BIT = ["srff", "srf", "src", "src_odd"]


def brute_force(mode: str, bits: int | None, excess: int) -> Fraction:
    """Mean of (away - d) over every d = j / 2^D, every n, and both parities."""
    m = RoundMode(mode)
    total, count = Fraction(0), 0
    for j in range(1 << excess):
        d = Fraction(j, 1 << excess)
        for n in range(1 << bits) if bits else [None]:
            for odd in (False, True):
                total += int(round_away(m, d, odd=odd, n=n, bits=bits)) - d
                count += 1
    return total / count


@pytest.mark.parametrize("mode", FEW_BIT)
def test_exact_equals_brute_force(mode):
    for bits in range(1, 5):
        for excess in range(0, 8):
            assert bias.exact(mode, bits, excess) == brute_force(mode, bits, excess), (bits, excess)


@pytest.mark.parametrize("mode", ["rne", "rna", "rtz", "rup", "rdn", "rto"])
def test_exact_deterministic_equals_brute_force(mode):
    for excess in range(0, 9):
        assert bias.exact(mode, None, excess) == brute_force(mode, None, excess)
    # Infinite precision: rtz loses half an ulp, rup gains it, the rest are unbiased.
    assert bias.exact(mode) == {"rtz": Fraction(-1, 2), "rdn": Fraction(-1, 2),
                                "rup": Fraction(1, 2)}.get(mode, 0)


def test_closed_forms_match_where_the_paper_says_they_are_tight():
    for bits in range(1, 9):
        for mode in ("srff", "srf", "src"):
            assert bias.exact(mode, bits) == bias.closed_form(mode, bits)
        for excess in range(1, 41):
            tight = {"srff": bits <= excess, "srf": bits < excess, "src": bits <= excess}
            for mode, is_tight in tight.items():
                if is_tight:
                    assert bias.exact(mode, bits, excess) == bias.closed_form(mode, bits, excess)


def test_where_the_closed_forms_are_not_tight():
    # SRF with N = D is exact SR: unbiased, not 2^-(D+1).
    for n in range(1, 9):
        assert bias.exact("srf", n, n) == 0 != bias.closed_form("srf", n, n)
    # With fewer excess bits than random bits every fraction is exact on N bits: the paper
    # states its forms for N <= D only, and closed_form refuses to give one beyond.
    for mode in ("srff", "srf"):
        assert bias.exact(mode, 8, 3) == 0
        with pytest.raises(ValueError, match="closed forms are for N <= D, not N = 8 > D = 3"):
            bias.closed_form(mode, 8, 3)
    with pytest.raises(ValueError, match="bits must be an int >= 1, got 0"):
        bias.closed_form("srff", 0)


def test_paper_headline_numbers():
    assert bias.exact("srff", 2) == Fraction(-1, 8)  # Figure 1: about -0.124
    assert bias.exact("srf", 2) == 0
    assert bias.exact("sr") == 0 and bias.exact("sr", excess=20) == 0
    assert bias.excess_bits("binary8p4", "bf16") == 4


def test_excess_bits_of_a_twos_complement_format_leave_out_its_sign():
    """OCP INT8 holds k / 64: 7 significant bits in [1, 2), its top binade, though its P is 8
    (the sign bit counts): float16's 11 leave D = 4 there (it said 3, so SRF unbiased), and
    INT8's 7 leave E4M3's 4 D = 3 (it said 4)."""
    assert bias.excess_bits("ocp_int8", "binary16") == 4
    assert bias.excess_bits("e4m3", "ocp_int8") == 3


def test_outward_error_of_a_twos_complement_format_below_its_largest_magnitude():
    """INT8 holds -2 and -127/64 (a gap of 1/64) below zero, but nothing beyond 127/64
    above it: the ulp at -1.99 was taken at |x| = 1.99, beyond the largest value, as 1, so
    an error of 0.36 ulp read as 0.0056 (`fewbit round` took x itself, and said 0.36)."""
    x = torch.tensor([-1.99, -1.995, -2.0, -1.0625], dtype=torch.float64)
    rounded = fewbit.round(x, "int8", "rne")  # -127/64, -2, -2, -68/64
    expected = torch.tensor([-0.36, 0.32, 0.0, 0.0], dtype=torch.float64)
    assert torch.allclose(bias.outward_error(x, rounded, "int8"), expected, rtol=0, atol=1e-12)


def test_measure_takes_a_deterministic_mode():
    """measure passed its own seed (default 0) to fewbit.round, which refuses one for a
    deterministic mode: measure(x, fmt, "rne", None, 2) raised "takes no seed"."""
    x = torch.tensor([1.0625, -1.03125, 1.5, 1.1875], dtype=torch.float64)
    mean, se = bias.measure(x, "binary8p4", "rne", None, samples=2)
    assert torch.equal(mean, torch.tensor([-0.5, -0.25, 0.0, 0.5], dtype=torch.float64))
    assert torch.equal(se, torch.zeros(4, dtype=torch.float64))


def test_measure_gives_an_error_that_never_changes_standard_error_zero():
    """E[err^2] - E[err]^2 over equal errors left float64 roundoff: RNE over three samples
    had standard errors up to 4e-9, and so had SRFF where P(away) is 0."""
    x = 1 + torch.arange(1000, dtype=torch.float64) / 1000
    for mode, bits in (("rne", None), ("srff", 2)):
        mean, se = bias.measure(x, "binary8p4", mode, bits, samples=3)
        if mode == "rne":
            assert torch.equal(se, torch.zeros_like(se))
        else:  # d < 1/4: SRFF with N = 2 never rounds away
            never = (x - 1) * 8 % 1 < 0.25
            assert never.sum() > 200 and (se[never] == 0).all()


def test_bias_at_one_fraction():
    assert bias.bias_at("srff", 2, Fraction(3, 8)) == Fraction(1, 4) - Fraction(3, 8)
    assert bias.bias_at("src", 2, Fraction(3, 8)) == Fraction(2, 4) - Fraction(3, 8)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        bias.bias_at("src", 2, Fraction(1))


@pytest.mark.parametrize("mode, bits", [("srff", 2), ("srf", 2), ("src", 2), ("sr", None)])
def test_measured_bias_through_the_kernel_matches_exact(mode, bits):
    # Every bfloat16 value in [1, 2) rounded to binary8p4: D = 4 excess bits, d spread
    # uniformly over its 16 values, 8 inputs each.
    x = torch.arange(128, dtype=torch.float64).mul(2.0**-7).add(1.0).to(torch.bfloat16)
    mean, se = bias.measure(x, "binary8p4", mode, bits, samples=3000, seed=5)
    expected = float(bias.exact(mode, bits, 4))
    overall, overall_se = mean.mean().item(), math.sqrt((se**2).sum().item()) / x.numel()
    assert overall_se > 0
    assert abs(overall - expected) <= 3 * overall_se, (overall, expected, overall_se)


def test_bad_input():
    with pytest.raises(ValueError, match="depends on where x lies"):
        bias.exact("sr_near_zero", 3)
    with pytest.raises(ValueError, match="needs bits"):
        bias.exact("srff")
    with pytest.raises(ValueError, match="takes no bits"):
        bias.exact("rne", 3)
    with pytest.raises(ValueError, match="excess"):
        bias.exact("srff", 3, -1)
    with pytest.raises(ValueError, match="unknown rounding mode"):
        bias.exact("nearest")
    with pytest.raises(ValueError, match="samples"):
        bias.measure(torch.ones(3), "e4m3", "src", 3, samples=1)
    # closed_form took a float D (a float answer) and True as D = 1; figure took samples 0
    # as its default and -5 as 2, where exact and measure refuse them.
    for excess in (4.5, 7.0, True, -1):
        with pytest.raises(ValueError, match=f"excess must be an int in 0..65536 or None, got {excess!r}"):
            bias.closed_form("srff", 3, excess)
    # D far beyond any two formats': 10^20 overflowed inside, 10^6 took half a minute.
    assert bias.exact("srf", 3, 65536) == Fraction(1, 2**65537)  # SRF's 2^-(D+1) ulp
    for excess in (65537, 10**6, 10**20):
        with pytest.raises(ValueError, match=f"excess must be an int in 0..65536 or None, got {excess}"):
            bias.exact("srf", 3, excess)
    for samples in (0, -5, 1, 2.5):
        with pytest.raises(ValueError, match=f"samples must be an int >= 2, got {samples!r}"):
            bias.figure(1, "unused", samples=samples)


def test_cli(capsys):
    assert main(["bias", "--mode", "srff", "--bits", "3", "--excess", "4"]) == 0
    out = capsys.readouterr().out
    assert "-1/32" in out and "-0.03125000" in out
    assert main(["bias", "--table"]) == 0
    rows = capsys.readouterr().out.splitlines()
    srff2 = next(r for r in rows if r.startswith("srff N=2 "))
    assert srff2.split()[-1] == "-0.125000" and srff2.split()[2] == "0.000000"
    assert main(["bias", "--format", "binary8p4", "--from", "bf16", "--bits", "3"]) == 0
    out = capsys.readouterr().out
    assert "D = 4" in out and "srf N=3 D=4" in out and "1/32" in out


@pytest.mark.parametrize("mode, bits, excess, shown", [
    ("srff", 3, 15000, "-2^-4 + 2^-15001"),  # a fraction of 9,000 digits: str() refused it
    ("srf", 3, 70, "2^-71"),
    ("rtz", None, 40, "-2^-1 + 2^-41"),
    ("srff", 32, None, "-2^-33"),
    ("srff", 3, 4, "-1/32"),  # a short fraction: as it is
])  # fmt: skip
def test_cli_prints_long_exact_values_as_powers_of_two(capsys, mode, bits, excess, shown):
    argv = ["--mode", mode] + (["--bits", str(bits)] if bits else [])
    argv += ["--excess", str(excess)] if excess else []
    assert main(["bias", *argv]) == 0
    row = capsys.readouterr().out.splitlines()[-1]
    assert f" exact {shown:>24} = " in row
    if "^" in shown:  # the sum is the value, exactly
        terms = re.findall(r"([+-]?) ?2\^(-?\d+)", shown)
        assert sum((-1 if sign == "-" else 1) * Fraction(2) ** int(e) for sign, e in terms) == bias.exact(
            mode, bits, excess)


def test_figures_reproduce_the_paper_numbers(tmp_path):
    results = bias.figure(2, str(tmp_path), samples=20_000)
    assert (tmp_path / "figure2.png").stat().st_size > 10_000
    assert [r["mode"] for r in results] == ["srff", "srf", "src"]
    for r, paper in zip(results, (-0.046875, 0.015625, 0.0), strict=True):
        assert r["exact"] == paper
        assert abs(r["measured"] - r["exact"]) <= 3 * r["stderr"], r


# Seed 002's theorems, checked through the kernel: SR equals floor(x + U(0, ulp)) in
# distribution, and is unbiased.

CHI2_DF1_P1E6 = 23.93  # chi-square critical value, 1 degree of freedom, p = 1e-6


def test_sr_is_distributed_as_floor_of_x_plus_uniform_ulp():
    fmt = "binary8p4"
    xs = torch.tensor([1.0 + 3 / 64, 1.3, 2.718281828, 0.0123, 100.7, 5.5 + 1 / 1024])
    draws = 40_000
    x = xs.repeat(draws, 1)
    lo = fewbit.round(xs, fmt, "rtz").double()
    ulp = (fewbit.round(xs, fmt, "rup").double() - lo)
    sr = fewbit.round(x, fmt, "sr", seed=11).double()
    u = torch.rand(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(12))
    dither = lo + ulp * torch.floor((x.double() - lo) / ulp + u)
    for j in range(xs.numel()):
        a = (sr[:, j] > lo[j]).sum().item()  # rounded up
        b = (dither[:, j] > lo[j]).sum().item()
        assert set(sr[:, j].unique().tolist()) <= {lo[j].item(), (lo[j] + ulp[j]).item()}
        table = [[a, draws - a], [b, draws - b]]
        total = 2 * draws
        chi2 = 0.0
        for row in table:
            for col in range(2):
                expected = sum(r[col] for r in table) * sum(row) / total
                chi2 += (row[col] - expected) ** 2 / expected if expected else 0.0
        assert chi2 < CHI2_DF1_P1E6, (xs[j].item(), a, b)
        # Unbiased: the mean of sr is x within 5 standard errors.
        p = (xs[j].double() - lo[j]) / ulp[j]
        se = ulp[j] * math.sqrt(p * (1 - p) / draws)
        assert abs(sr[:, j].mean() - xs[j].double()) <= 5 * se + 1e-15


@pytest.mark.parametrize("mode, bits", [("srff", 2), ("srf", 1), ("src", 3), ("src_odd", 2), ("rne", None)])
def test_bias_integral_equals_a_midpoint_sum(mode, bits):
    assert bias.bias_integral(mode, bits, 0, 1) == bias.exact(mode, bits)
    # bias_at is affine between multiples of 2^-(N+1) (deterministic modes: of 1/2), so on
    # cells of width h = 2^-(N+3) its value at a cell's midpoint times h is its integral.
    h = Fraction(1, 1 << ((bits or 1) + 3))
    for j0, j1 in [(3, 3), (3, 11), (1, int(1 / h) - 5)]:
        cells = sum(bias.bias_at(mode, bits, (j + Fraction(1, 2)) * h) * h for j in range(j0, j1))
        assert bias.bias_integral(mode, bits, j0 * h, j1 * h) == cells, (j0, j1)
    with pytest.raises(ValueError, match="d0 <= d1"):
        bias.bias_integral(mode, bits, Fraction(1, 2), Fraction(1, 4))


@pytest.mark.parametrize("mode, bits", [("srff", 3), ("srf", 1), ("src", 2), ("src_odd", 3), ("rne", None),
                                        ("rtz", None)])
def test_away_steps_are_bias_at_plus_d(mode, bits):
    steps = bias.away_steps(mode, bits)
    starts = [d for d, _ in steps]
    assert starts[0] == 0 and starts == sorted(set(starts))
    assert all(p0 != p1 for (_, p0), (_, p1) in zip(steps, steps[1:], strict=False))
    # On cells of width 2^-(N+3), finer than every jump, P(away) = bias_at + d is the step's.
    h = Fraction(1, 1 << ((bits or 1) + 3))
    for j in range(int(1 / h)):
        for d in (j * h, (j + Fraction(1, 2)) * h):
            p_away = next(p for start, p in reversed(steps) if start <= d)
            assert bias.bias_at(mode, bits, d) + d == p_away or d in starts, (d, p_away)
    if mode == "srff":  # P(away) = floor(d 2^N) / 2^N
        assert steps == tuple((Fraction(k, 1 << bits), Fraction(k, 1 << bits)) for k in range(1 << bits))
    with pytest.raises(ValueError, match="not a step function"):
        bias.away_steps("sr", None)
