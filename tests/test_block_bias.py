"""fewbit.block.bias: the exact block bias against a brute-force enumeration through
fewbit.block.round, against figures derived by hand, and against sampling."""

import itertools
from fractions import Fraction

import pytest
import torch

import fewbit
from fewbit.bias import block_bias
from fewbit.block import BlockFormat
from fewbit.block.bias import scale_steps
from fewbit.cli import main
from fewbit.formats import format as element_format

E8M0 = element_format("ocp_e8m0")
MXFP4_B2 = BlockFormat("mxfp4_b2", element_format("ocp_e2m1"), 2, E8M0)
MXFP4_B4 = BlockFormat("mxfp4_b4", element_format("ocp_e2m1"), 4, E8M0)
RULES = ("floor", "ceil", "rceil", "even")


def brute_force(bfmt: BlockFormat | str, mode: str, bits: int | None, rule: str, h: Fraction):
    """Mean of |round(x)| - |x| per element and the clipped share, over every block whose
    magnitudes sit at the midpoints of the cells of width ``h`` of [1, 2) (signs
    alternating), and every random integer n (the same n for a block's elements: the
    mean over n of each element's error is its expectation either way).

    Equal to the integral over uniform magnitudes when every point where an element's
    expected error jumps or bends, and every amax where the scale changes, lies on a
    cell edge: then on each product cell the scale is fixed, the error of element i is
    affine in x_i, and its value at the cell's midpoint is its mean over the cell."""
    bfmt = fewbit.block.format(bfmt)
    size = bfmt.block_size
    mids = [1 + (k + Fraction(1, 2)) * h for k in range(int(1 / h))]
    blocks = torch.tensor(list(itertools.product(*[[float(m) for m in mids]] * size)), dtype=torch.float64)
    signs = torch.tensor([(-1.0) ** i for i in range(size)], dtype=torch.float64)
    ns = range(1 << bits) if bits else [None]
    x = (blocks * signs).repeat(len(ns), 1).float()
    rand = None
    if bits:
        rand = torch.arange(1 << bits).repeat_interleave(blocks.shape[0])[:, None].repeat(1, size)
    with fewbit.configure(compile=False):
        r = fewbit.block.round(x, bfmt, mode, bits=bits, random_bits=rand, rule=rule)
        scale = fewbit.block.quantize(x, bfmt, mode, bits=bits, random_bits=rand, rule=rule).block_scales(
            torch.float64)
    xd = x.double().abs()
    top = torch.where(x < 0, bfmt.element.max_negative_magnitude, bfmt.element.max)
    # Every term is a multiple of h / 2 below 2: the float64 sum is exact.
    err = Fraction((r.double().abs() - xd).sum().item()) / x.numel()
    clipped = Fraction(int((xd > top * scale).sum()), x.numel())
    return err, clipped


# e2m1 in [1, 2) scaled by 1/4 or 1/2: x * 4 in [4, 8) (ulp 2) or x * 2 in [2, 4) (ulp 1),
# so an ulp is 1/2 in x and few-bit SR's jumps (multiples of 2^-(N+1) ulp) are multiples
# of 2^-(N+2); the scale changes at 3/2 (rceil) and 7/4 (even), clipping starts at 3/2.
# int4 (k/4 up to 7/4) scaled by 1 or 2: an ulp is 1/4 or 1/2 in x, jumps at 2^-(N+3);
# rule even changes the scale at 2 - 2^-4. Deterministic modes jump at half an ulp.
CASES = [(MXFP4_B2, lambda n: Fraction(1, 1 << (n + 2))),
         ("bfp4_b2", lambda n: Fraction(1, 1 << max(n + 3, 4)))]


@pytest.mark.parametrize("bfmt, cell", CASES, ids=["mxfp4_b2", "bfp4_b2"])
@pytest.mark.parametrize("rule", RULES)
def test_exact_equals_brute_force_block_of_two(bfmt, cell, rule):
    few_bit = [(m, n) for m in ("srff", "srf", "src") for n in (1, 2, 3)]
    for mode, bits in [("rne", None), ("rtz", None), *few_bit]:
        exact = block_bias(bfmt, mode, bits, rule)
        assert exact.exact
        assert (exact.mean_error, exact.clipped) == brute_force(bfmt, mode, bits, rule, cell(bits or 1)), \
            (mode, bits)


@pytest.mark.parametrize("rule", RULES)
def test_exact_equals_brute_force_block_of_four(rule):
    for mode, bits in [("rne", None), ("srff", 1), ("src", 2)]:
        exact = block_bias(MXFP4_B4, mode, bits, rule)
        expected = brute_force(MXFP4_B4, mode, bits, rule, Fraction(1, 1 << ((bits or 1) + 2)))
        assert (exact.mean_error, exact.clipped) == expected, (mode, bits)


def test_scale_thresholds_of_e2m1_and_nvfp4():
    # mxfp4 (E = 2, M = 6, P = 2) on amax in [1, 2): floor keeps 2^-2; ceil takes 2^-1 above 1;
    # rceil once amax * 4 > 6; even once amax rounded to 2 bits reaches 2, i.e. from 1.75.
    half, quarter = Fraction(1, 2), Fraction(1, 4)
    assert scale_steps("mxfp4", "floor") == ((1, 2, quarter),)
    assert scale_steps("mxfp4", "ceil") == ((1, 2, half),)
    assert scale_steps("mxfp4", "rceil") == ((1, Fraction(3, 2), quarter), (Fraction(3, 2), 2, half))
    assert scale_steps("mxfp4", "even") == ((1, Fraction(7, 4), quarter), (Fraction(7, 4), 2, half))
    # nvfp4: amax / 6 in [1/6, 1/3) to E4M3 (ulp 1/64 below 1/4); 1/6 lies nearer 11/64
    # than 10/64, and the scale moves to 12/64 at 6 * 23/128 = 69/64 (nearest), or just
    # above 6 * 11/64 = 66/64 (up).
    nearest, up = scale_steps("nvfp4", "nearest"), scale_steps("nvfp4", "up")
    assert nearest[0] == (1, Fraction(69, 64), Fraction(11, 64))
    assert up[0] == (1, Fraction(33, 32), Fraction(11, 64))
    assert nearest[-1][2] == up[-1][2] == Fraction(11, 32)  # amax just below 2: 1/3 -> 11/32


def test_hand_derived_mxfp4_figures():
    # Floor: S = 1/4, x * 4 uniform on [4, 8); above 6 saturates: half the elements, mean
    # error 6 - 7 = -1 there (in x: -1/4), and cell [4, 6) is unbiased for RNE and SRC.
    for mode, bits in [("rne", None), ("src", 3), ("srf", 2), ("sr", None)]:
        b = block_bias("mxfp4", mode, bits, "floor")
        assert (b.mean_error, b.clipped) == (Fraction(-1, 8), Fraction(1, 2)), mode
    # SRFF loses 2^-(N+1) of an ulp (1/2 in x) on the unclipped half.
    for n in (1, 3, 5):
        expected = Fraction(-1, 8) - Fraction(1, 1 << (n + 3))
        assert block_bias("mxfp4", "srff", n, "floor").mean_error == expected
    # Ceil and rceil never clip; an ulp is 1/2 in x under either scale.
    for rule in ("ceil", "rceil"):
        for mode, bits in [("rne", None), ("src", 3), ("srf", 3), ("sr", None)]:
            assert block_bias("mxfp4", mode, bits, rule).mean_error == 0, (mode, rule)
            assert block_bias("mxfp4", mode, bits, rule).clipped == 0
        assert block_bias("mxfp4", "srff", 3, rule).mean_error == Fraction(-1, 32)
    # Even: S = 1/4 while amax < 7/4, where x in (3/2, 7/4) clips (x * 4 in (6, 7)):
    # P(x_1 in (3/2, 7/4), the other 31 below 7/4) = 1/4 (3/4)^31. RNE rounds (6, 7) to 6
    # anyway, so it stays unbiased; SRC loses what SR would have sent to 8.
    even = block_bias("mxfp4", "rne", None, "even")
    assert even.clipped == Fraction(1, 4) * Fraction(3, 4) ** 31 and even.mean_error == 0
    assert block_bias("mxfp4", "src", 3, "even").mean_error < 0
    # int4 (k/4 from -2 to 7/4), floor: S = 1; a quarter of the positive [1, 2) saturates
    # to 7/4 (mean error -1/8 there), no negative value does.
    b = block_bias("bfp4_b2", "rne", None, "floor")
    assert (b.mean_error, b.clipped) == (Fraction(-1, 64), Fraction(1, 8))


@pytest.mark.parametrize("bfmt, mode, bits, rule", [
    (MXFP4_B4, "srff", 2, "even"), ("bfp4_b2", "src", 1, "floor"), ("mxfp4", "sr", None, "floor"),
    ("nvfp4", "src", 2, "nearest"),
    ("nvfp4", "srff", 3, "up"), ("mxfp8_e4m3", "rne", None, "floor"),
])
def test_sampled_uniform_agrees_with_exact(bfmt, mode, bits, rule):
    exact = block_bias(bfmt, mode, bits, rule)
    sampled = block_bias(bfmt, mode, bits, rule, samples=4096, seed=3)
    assert not sampled.exact and sampled.stderr > 0
    assert abs(sampled.mean_error - float(exact.mean_error)) <= 4 * sampled.stderr, (sampled, exact)
    if exact.clipped in (0, 1):
        assert sampled.clipped == exact.clipped
    else:
        assert abs(sampled.clipped - float(exact.clipped)) <= 4 * sampled.clipped_stderr, (sampled, exact)


def test_gaussian_estimate_where_it_must_match_the_uniform_figure():
    # Unbiased element rounding and a rule that never clips: zero error whatever the
    # distribution, as the exact uniform figure says.
    # (Few-bit SR is unbiased only over whole periods of its per-d bias: for nvfp4 the
    # scale changes at amax that are not on them, so that check takes sr.)
    for bfmt, mode, bits, rule in [("mxfp4", "src", 3, "rceil"), ("mxfp4", "srf", 2, "ceil"),
                                   ("nvfp4", "sr", None, "up")]:
        exact = block_bias(bfmt, mode, bits, rule)
        gauss = block_bias(bfmt, mode, bits, rule, "gaussian", samples=2048, seed=1)
        assert exact.mean_error == 0 and exact.clipped == 0 == gauss.clipped
        assert not gauss.exact and abs(gauss.mean_error) <= 4 * gauss.stderr, (bfmt, rule, gauss)
    # Floor clips Gaussian blocks too; SRFF's loss shows in both.
    gauss = block_bias("mxfp4", "srff", 1, "floor", "gaussian", samples=2048, seed=2)
    assert gauss.clipped > 10 * gauss.clipped_stderr and gauss.mean_error < -10 * gauss.stderr


def test_bad_arguments():
    with pytest.raises(ValueError, match="sign of x"):
        block_bias("mxfp4", "rup")
    with pytest.raises(ValueError, match="parity"):
        block_bias("mxfp4", "rto")
    with pytest.raises(ValueError, match="needs bits"):
        block_bias("mxfp4", "src")
    with pytest.raises(ValueError, match="not for ocp_e8m0"):
        block_bias("mxfp4", "rne", rule="nearest")
    with pytest.raises(ValueError, match="closest: mxfp4"):
        block_bias("mxfp5", "rne")
    with pytest.raises(ValueError, match="distribution"):
        block_bias("mxfp4", "rne", distribution="laplace")
    with pytest.raises(ValueError, match="samples"):
        block_bias("mxfp4", "rne", distribution="gaussian", samples=1)


def test_cli_block_table(capsys):
    assert main(["bias", "--block", "mxfp4", "--bits", "2", "--table", "--samples", "256"]) == 0
    rows = {tuple(line.split()[:2]): line.split() for line in capsys.readouterr().out.splitlines()
            if line.split()[:1] in (["rne"], ["srff"], ["srf"], ["src"], ["sr"])}
    assert len(rows) == 5 * 4
    # Hand-derived above: floor halves the elements into saturation; srff N=2 under ceil
    # loses 2^-(N+2) = 1/16.
    assert rows[("rne", "floor")][2:5] == ["-1/8", "-0.125000", "1/2"]
    assert rows[("srff", "ceil")][2:5] == ["-1/16", "-0.062500", "0"]
    assert main(["bias", "--block", "mxfp4", "--mode", "src", "--rule", "ceil", "--samples", "256"]) == 0
    assert len([line for line in capsys.readouterr().out.splitlines() if line.startswith("src")]) == 1
    assert main(["bias", "--block", "mxfp5", "--table"]) == 2
    assert "closest: mxfp4" in capsys.readouterr().err
    assert main(["bias", "--block", "mxfp4", "--rule", "nearest"]) == 2
    assert main(["bias", "--block", "mxfp4", "--excess", "3"]) == 2
