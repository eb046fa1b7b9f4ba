"""fewbit.block.bias: the exact block bias against a brute-force enumeration through
fewbit.block.round, against figures derived by hand, and against sampling."""

import itertools
import math
from fractions import Fraction

import pytest
import torch

import fewbit
import fewbit.block.bias as block_bias_module
from fewbit.bias import bias_at, block_bias
from fewbit.block import BlockFormat
from fewbit.block.bias import MAX_GAUSSIAN_BITS, scale_steps
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
    # An unsigned element (p3109_k6p3ue: 128 and 160 in the top binade under floor's
    # S = 2^-7): positives above 160 saturate (3/4 of them, mean error -48/128 there), every
    # negative goes to 0 (error -|x|, mean -3/2); what the module docstring says of signs.
    b = block_bias("mx_p3109_k6p3ue", "src", 2, "floor")
    assert (b.mean_error, b.clipped) == (Fraction(-57, 64), Fraction(7, 8))


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


@pytest.mark.parametrize("samples, seed", [(2048, 3), (8192, 4)])
def test_sampled_stderr_is_the_standard_error_worked_by_hand(samples, seed):
    """The sampled stderr is the tolerance of the tests above, so it is pinned on its own.
    MXFP4 (floor, RNE) on magnitudes uniform on [1, 2): S = 1/4 for every block, so the
    elements are independent; y = 4x on [4, 8) rounds to 4 on [4, 5), to 6 on [5, 8) (the
    max, saturated above 7). In x, the error is uniform on (-1/4, 0] w.p. 1/4, on [0, 1/4)
    w.p. 1/4, on (-1/2, 0] w.p. 1/2: mean -1/8, E[e^2] = 5/96, variance 7/192; a block's mean of
    32 has variance 7/6144, and the mean of n blocks a standard error sqrt(7/6144 / n).
    (One sqrt(n) too few, or a factor 2, passed every test: they only loosened the tolerance.)"""
    se = math.sqrt(7 / 6144 / samples)
    b = block_bias("mxfp4", "rne", None, "floor", samples=samples, seed=seed)
    assert abs(b.mean_error + 0.125) < 5 * se, b
    assert 0.85 < b.stderr / se < 1.15, b  # the estimate's own spread is about sqrt(2 / (32 n))


# --- Gaussian blocks ----------------------------------------------------------------------


@pytest.mark.parametrize("bfmt, mode, bits, rule", [
    ("nvfp4", "src", 2, "nearest"), ("nvfp4", "rne", None, "up"), ("mxfp4", "srff", 1, "floor"),
    ("mxfp4", "rne", None, "even"), ("mxfp8_e4m3", "src", 3, "even"), ("mxfp8_e4m3", "rne", None, "floor"),
    ("hbfp8", "srff", 3, "floor"), ("hbfp4", "srf", 2, "floor"),
])
def test_computed_gaussian_agrees_with_sampled(bfmt, mode, bits, rule):
    computed = block_bias(bfmt, mode, bits, rule, "gaussian")
    sampled = block_bias(bfmt, mode, bits, rule, "gaussian", samples=4096, seed=5)
    assert computed.exact and computed.samples is None and computed.stderr == 0
    assert isinstance(computed.mean_error, float) and not sampled.exact
    assert abs(sampled.mean_error - computed.mean_error) <= 5 * sampled.stderr, (sampled, computed)
    if computed.clipped == 0:
        assert sampled.clipped == 0
    else:
        assert abs(sampled.clipped - computed.clipped) <= 5 * sampled.clipped_stderr, (sampled, computed)


def gaussian_brute_force(bfmt: BlockFormat, mode: str, bits: int | None, rule: str, per_binade: int = 512,
                         sigmas: int = 8) -> tuple[float, float]:
    """Mean error / sigma and clipped share of element 1 of blocks of two i.i.d. N(0, sigma^2)
    values, sigma = 2^u, by midpoint rules, rounding through fewbit.block.round with every
    random integer.

    Magnitudes on cells of equal width, ``per_binade`` to a binade, from 2^-12 to 32 (outside
    them lies less than 1e-7 of the figure), so that every point where the scale changes or
    the error jumps is a cell edge: on a cell the scale is then fixed and the expected error
    affine, and the midpoint rule errs by O(width^2). Element 1 takes the midpoint rule; the
    other element only sets the scale when it is the larger, so it takes each cell's exact
    probability. u: the midpoint rule, which for a periodic function (E8M0 scales make the
    figure one in u) converges faster than any power."""
    edges = torch.cat([2.0 ** j * (1 + torch.arange(per_binade, dtype=torch.float64) / per_binade)
                       for j in range(-12, 5)] + [torch.tensor([32.0], dtype=torch.float64)])
    mid = (edges[:-1] + edges[1:]) / 2
    n = mid.numel()
    ns = range(1 << bits) if bits else [None]

    def rounded(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Element 1's mean error over the random integer and whether it clips."""
        x = block.repeat(len(ns), 1)
        rand = torch.arange(len(ns)).repeat_interleave(block.shape[0])[:, None].repeat(1, 2) if bits else None
        with fewbit.configure(compile=False):
            r = fewbit.block.round(x, bfmt, mode, bits=bits, random_bits=rand, rule=rule)
            scale = fewbit.block.quantize(x, bfmt, mode, bits=bits, random_bits=rand,
                                          rule=rule).block_scales(torch.float64)
        err = (r[:, 0].double() - x[:, 0]).view(len(ns), -1).mean(0)
        return err, (x[:, 0] > bfmt.element.max * scale.view(-1))[: block.shape[0]].double()

    # The scale when a cell holds amax, and for each scale the largest midpoint it holds.
    zeros = torch.zeros_like(mid)
    with fewbit.configure(compile=False):
        cell_scale = fewbit.block.quantize(torch.stack([mid, zeros], 1), bfmt, rule=rule).block_scales(
            torch.float64).view(-1)
    scales, which = cell_scale.unique(return_inverse=True)
    rep = torch.stack([mid[which == k].max() for k in range(scales.numel())])
    self_err, self_clip = rounded(torch.stack([mid, zeros], 1))
    i, k = torch.meshgrid(torch.arange(n), torch.arange(scales.numel()), indexing="ij")
    needed = rep[k] >= mid[i]  # element 2 in a higher cell of scale k: amax is element 2
    pair_err = torch.zeros(n, scales.numel(), dtype=torch.float64)
    pair_clip = torch.zeros_like(pair_err)
    pair_err[needed], pair_clip[needed] = rounded(torch.stack([mid[i[needed]], rep[k[needed]]], 1))
    err = clip = 0.0
    for u in (torch.arange(sigmas, dtype=torch.float64) + 0.5) / sigmas:
        sigma = 2.0 ** u
        cdf = torch.special.erf(edges / (sigma * 2 ** 0.5))  # P(|x| < edge)
        cell = torch.diff(cdf)
        density = (2 / torch.pi) ** 0.5 / sigma * torch.exp(-(mid / sigma) ** 2 / 2) * torch.diff(edges)
        # P(element 2 lies in a higher cell of scale k), for each cell of element 1.
        higher = torch.zeros(scales.numel(), n, dtype=torch.float64)
        higher[which, torch.arange(n)] = cell
        higher = higher.flip(1).cumsum(1).flip(1) - higher
        lower = cdf[1:]  # element 2 below the top of element 1's cell
        err += (density * (self_err * lower + (pair_err * higher.T).sum(1))).sum().item() / sigma.item()
        clip += (density * (self_clip * lower + (pair_clip * higher.T).sum(1))).sum().item()
    return err / sigmas, clip / sigmas


@pytest.mark.parametrize("rule", ["floor", "even", "rceil"])
def test_computed_gaussian_equals_brute_force_block_of_two(rule):
    for mode, bits in [("rne", None), ("srff", 2), ("src", 3)]:
        computed = block_bias(MXFP4_B2, mode, bits, rule, "gaussian")
        err, clip = gaussian_brute_force(MXFP4_B2, mode, bits, rule)
        assert abs(computed.mean_error - err) < 1e-6 and abs(computed.clipped - clip) < 1e-6, \
            (mode, bits, computed, err, clip)


def test_gaussian_quadrature_has_converged(monkeypatch):
    cases = [("mxfp4", "rne", None, "floor"), ("mxfp4", "src", 3, "rceil"), ("nvfp4", "src", 2, "nearest"),
             ("hbfp8", "srff", 3, "floor"), ("mxfp8_e4m3", "src", 4, "even"), (E4M3_B1, "srff", 2, "floor")]
    figures = [block_bias(f, m, n, r, "gaussian") for f, m, n, r in cases]
    monkeypatch.setattr(block_bias_module, "GAUSS_NODES", 2 * block_bias_module.GAUSS_NODES)
    for (f, m, n, r), before in zip(cases, figures, strict=True):
        after = block_bias(f, m, n, r, "gaussian")
        assert after.mean_error == pytest.approx(before.mean_error, rel=1e-12, abs=0), (f, m, n, r)
        assert after.clipped == pytest.approx(before.clipped, rel=1e-12, abs=0), (f, m, n, r)


E4M3_B1 = BlockFormat("e4m3_b1", element_format("ocp_e4m3"), 1, E8M0)


@pytest.mark.parametrize("bfmt", [E4M3_B1, "bfp8_b1"], ids=["e4m3", "int8"])
def test_gaussian_blocks_of_one_by_hand(bfmt):
    # One element per block, floor rule: y = |x| / S lies in the element's top binade
    # [2^E, 2^(E+1)), and with sigma = 2^u, u uniform, log2(y) - E = frac(u + log2|z|) is
    # uniform whatever z = x / sigma: y is log-uniform and independent of |z|, and the error
    # over sigma is |z| e(y) / y. So the figure is E|z| E[e(y) / y] = sqrt(2/pi) / ln 2 times
    # the integral of e(y) / y^2 over the binade, e(y) the expected error of rounding y (M - y
    # above M), and the clipped share is P(y > M) = log2(2^(E+1) / M).
    bfmt = fewbit.block.format(bfmt)
    element = bfmt.element
    low = 2.0 ** math.floor(math.log2(element.max))

    def figure(mode: str, bits: int | None, negative: bool) -> tuple[float, float]:
        top = element.max_negative_magnitude if negative else element.max
        side = {-v if negative else v for v in element.values()}
        grid = sorted(Fraction(m) for m in side if low <= m <= top)
        total = 0.0
        split = 1 << ((bits or 0) + 2)  # pieces finer than every jump of the per-d bias
        for v, w in zip(grid, grid[1:], strict=False):
            if mode == "sr":
                break  # ideal SR: no error below M
            for j in range(split):
                p_away = bias_at(mode, bits, (j + Fraction(1, 2)) / split) + (j + Fraction(1, 2)) / split
                y0, y1 = float(v + (w - v) * j / split), float(v + (w - v) * (j + 1) / split)
                rounded = float(v + (w - v) * p_away)  # constant on the piece
                total += rounded * (1 / y0 - 1 / y1) - math.log(y1 / y0)  # ∫ (R - y) / y^2 dy
        total += top * (1 / top - 1 / (2 * low)) - math.log(2 * low / top)  # above M: R = M
        return math.sqrt(2 / math.pi) / math.log(2) * total, math.log2(2 * low / top)

    for mode, bits in [("sr", None), ("rne", None), ("srff", 2), ("src", 3), ("rtz", None)]:
        computed = block_bias(bfmt, mode, bits, "floor", "gaussian")
        sides = [figure(mode, bits, negative) for negative in (False, True)]
        err, clip = (sum(side[i] for side in sides) / 2 for i in range(2))
        assert computed.mean_error == pytest.approx(err, rel=1e-12), (mode, bits)
        assert computed.clipped == pytest.approx(clip, rel=1e-12, abs=1e-16), (mode, bits)


def test_gaussian_figures_where_theory_says():
    # Ideal SR under a rule that never clips: no error at all, exactly.
    for bfmt, rule in [("mxfp4", "ceil"), ("mxfp4", "rceil"), ("nvfp4", "up"), ("hbfp8", "rceil")]:
        b = block_bias(bfmt, "sr", None, rule, "gaussian")
        assert (b.mean_error, b.clipped) == (0.0, 0.0), (bfmt, rule)
    # Few-bit SRC is unbiased over whole periods of its per-d bias, not under a density that
    # falls across them: its bias toward zero is the next term, and shrinks 4x per bit.
    errors = [block_bias("mxfp4", "src", n, "rceil", "gaussian").mean_error for n in range(2, 9)]
    assert all(e < 0 for e in errors)
    assert all(3.9 < a / b < 4.01 for a, b in zip(errors, errors[1:], strict=False)), errors
    # Floor clips Gaussian blocks too, RNE's share the same as SRFF's.
    rne, srff = (block_bias("mxfp4", m, n, "floor", "gaussian") for m, n in [("rne", None), ("srff", 1)])
    assert rne.clipped == srff.clipped > 0.02 and srff.mean_error < rne.mean_error < 0


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
    with pytest.raises(ValueError, match=f"N <= {MAX_GAUSSIAN_BITS}"):
        block_bias("mxfp4", "srff", MAX_GAUSSIAN_BITS + 1, distribution="gaussian")
    assert not block_bias("mxfp4", "srff", MAX_GAUSSIAN_BITS + 1, distribution="gaussian", samples=16).exact
    # A binary32 scale changes 2^23 times a binade: the exact figures' search for its steps
    # ran until memory ran out; now refused up front, as the sampled figures always were.
    f32_scaled = BlockFormat("e2m1_f32", "e2m1", 4, "binary32", rule="nearest")
    for call in (lambda: block_bias(f32_scaled, "rne"), lambda: block_bias(f32_scaled, "rne", samples=16),
                 lambda: scale_steps(f32_scaled)):  # fmt: skip
        with pytest.raises(ValueError, match="e2m1_f32: its binary32 scales have no 8-bit code"):
            call()


def test_cli_block_table(capsys):
    assert main(["bias", "--block", "mxfp4", "--bits", "2", "--table", "--samples", "256"]) == 0
    rows = {tuple(line.split()[:2]): line.split() for line in capsys.readouterr().out.splitlines()
            if line.split()[:1] in (["rne"], ["srff"], ["srf"], ["src"], ["sr"])}
    assert len(rows) == 5 * 4
    # Hand-derived above: floor halves the elements into saturation; srff N=2 under ceil
    # loses 2^-(N+2) = 1/16.
    assert rows[("rne", "floor")][2:5] == ["-1/8", "-0.125000", "1/2"]
    assert rows[("srff", "ceil")][2:5] == ["-1/16", "-0.062500", "0"]
    assert len(rows[("rne", "floor")]) == 9  # sampled: each Gaussian figure with its +-
    assert main(["bias", "--block", "mxfp4", "--mode", "src", "--rule", "ceil", "--samples", "256"]) == 0
    out = capsys.readouterr().out
    assert len([line for line in out.splitlines() if line.startswith("src")]) == 1
    assert out.startswith("mxfp4_e2m1: ocp_e2m1 elements, blocks of 32, E8M0 scale; N = 3 (src)\n")
    assert main(["bias", "--block", "mxfp4", "--mode", "rne", "--rule", "ceil"]) == 0
    assert capsys.readouterr().out.startswith("mxfp4_e2m1: ocp_e2m1 elements, blocks of 32, E8M0 scale\n")
    # Without --samples the Gaussian figures are computed: no +- columns, six digits.
    assert main(["bias", "--block", "mxfp4", "--bits", "2", "--mode", "srff", "--rule", "floor"]) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.startswith("srff"))
    computed = block_bias("mxfp4", "srff", 2, "floor", "gaussian")
    assert "computed" in out and row[5:] == [f"{computed.mean_error:.6g}", f"{computed.clipped:.6g}"]
    assert main(["bias", "--block", "mxfp4", "--bits", str(MAX_GAUSSIAN_BITS + 1), "--table"]) == 2
    assert "--samples" in capsys.readouterr().err
    assert main(["bias", "--block", "mxfp5", "--table"]) == 2
    assert "closest: mxfp4" in capsys.readouterr().err
    assert main(["bias", "--block", "mxfp4", "--rule", "nearest"]) == 2
    assert main(["bias", "--block", "mxfp4", "--excess", "3"]) == 2
