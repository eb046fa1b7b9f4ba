"""fewbit.round: fast vs reference, the modes gfloat lacks, statistics, bad input."""

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fewbit
from conftest import assert_bitwise_equal
from fewbit.rounding import RoundMode, natural_sr_bits, round_reference
from fewbit.rounding.checks import dtype_format
from fewbit.rounding.reference import fraction_to_bits

FORMATS = ["binary8p4", "binary8p3", "p3109_k8p4ue", "p3109_k6p3sf", "binary8p1", "ocp_e4m3",
           "ocp_e5m2", "ocp_e2m1", "ocp_e8m0", "ocp_int8", "bfloat16", "binary3p2"]
SR_MODES = ["srff", "srf", "src", "src_odd"]


def sample(fmt, dtype, n_random=150, seed=0):
    """Random values around the target's range, its grid points, midpoints and specials."""
    g = torch.Generator().manual_seed(seed)
    fmt = fewbit.format(fmt)
    grid = torch.tensor(fmt.values(), dtype=torch.float64) if fmt.k <= 8 else torch.tensor([])
    grid = grid[torch.isfinite(grid)]
    grid = grid.sort().values[:: max(1, grid.numel() // 64)]
    mids = (grid[1:] + grid[:-1]) / 2 if grid.numel() > 1 else grid
    lo, hi = math.log2(fmt.smallest_subnormal) - 3, math.log2(fmt.max) + 2
    mags = torch.exp2(torch.rand(n_random, generator=g, dtype=torch.float64) * (hi - lo) + lo)
    signs = torch.where(torch.rand(n_random, generator=g) < 0.5, -1.0, 1.0).double()
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, fmt.max, -fmt.max,
                            fmt.max * 1.01, fmt.smallest_subnormal / 2])
    x = torch.cat([mags * signs, grid, mids, special]).to(dtype)
    return x[torch.isfinite(x) | torch.isnan(x) | torch.isinf(x)]


def usable(x, fmt):
    """Drop inputs whose result would be an error (checked separately)."""
    fmt = fewbit.format(fmt)
    if not fmt.has_nans:
        x = x[~torch.isnan(x)]
    return x


def explicit_bits(x, spec_bits, mode, seed=1):
    g = torch.Generator().manual_seed(seed)
    width = spec_bits + (16 if mode == "sr_fraction" else 0)
    return torch.randint(0, 2**width, x.shape, generator=g, dtype=torch.int64)


def mode_cases(dtype, fmt):
    natural = natural_sr_bits(dtype_format(dtype), fewbit.format(fmt))
    for mode in ["rne", "rna", "rtz", "rup", "rdn", "rto"]:
        yield mode, None, {}
    for mode in SR_MODES:
        for n in (1, 3, 32):
            yield mode, n, {}
    yield "sr", natural, {}
    yield "sr_near_zero", 3, {}
    yield "sr_fraction", 3, {"fraction": 0.3}


@pytest.mark.parametrize(
    "fmt, dtype",
    [(f, d) for f in FORMATS for d in (torch.float32, torch.bfloat16)]
    + [(f, torch.float64) for f in ("binary8p4", "ocp_e5m2", "ocp_int8", "bfloat16")],
)
def test_fast_equals_reference(fmt, dtype):
    if not dtype_format(dtype).contains(fewbit.format(fmt)):
        pytest.skip(f"{dtype} cannot hold {fmt}")
    x = usable(sample(fmt, dtype), fmt)
    for mode, bits, extra in mode_cases(dtype, fmt):
        rb = explicit_bits(x, bits, mode) if bits else None
        for sat in (False, True):
            if not fewbit.format(fmt).has_nans and not sat:
                x_ok = x[x.abs() <= fewbit.format(fmt).max]
                rb_ok = rb[x.abs() <= fewbit.format(fmt).max] if rb is not None else None
            else:
                x_ok, rb_ok = x, rb
            args = dict(sat=sat, bits=bits if mode != "sr" else None, random_bits=rb_ok, **extra)
            got = fewbit.round(x_ok, fmt, mode, **args)
            want = round_reference(x_ok, fmt, mode, **args)
            assert_bitwise_equal(got, want, x_ok, f"{fmt} {mode} N={bits} sat={sat} {dtype}")


@settings(max_examples=300, deadline=None)
@given(
    bits=st.integers(0, 2**32 - 1),
    fmt=st.sampled_from(FORMATS),
    mode=st.sampled_from([m.value for m in RoundMode]),
    n=st.integers(1, 32),
    r=st.integers(0, 2**48 - 1),
    sat=st.booleans(),
)
def test_fast_equals_reference_on_any_float32(bits, fmt, mode, n, r, sat):
    x = torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32)
    f = fewbit.format(fmt)
    if mode == "sr":
        n = natural_sr_bits(f.__class__("binary32", 32, 24, 127), f)  # float32 source
    extra = {"fraction": 0.5} if mode == "sr_fraction" else {}
    width = n + (16 if mode == "sr_fraction" else 0)
    kwargs = dict(sat=sat, **extra)
    if RoundMode(mode).is_stochastic:
        kwargs["random_bits"] = torch.tensor([r % 2**width])
        if mode != "sr":
            kwargs["bits"] = n
    try:
        want = round_reference(x, fmt, mode, **kwargs)
    except ValueError:
        with pytest.raises(ValueError):
            fewbit.round(x, fmt, mode, **kwargs)
        return
    assert_bitwise_equal(fewbit.round(x, fmt, mode, **kwargs), want, x, f"{fmt} {mode}")


# Round to odd, sr and the stagnation modes, which gfloat lacks, by their definitions.

def _all_finite(dtype=torch.bfloat16):
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    return x[torch.isfinite(x)]


def test_round_to_odd_is_truncation_with_a_sticky_last_bit():
    fmt = fewbit.format("binary8p4")
    x = _all_finite()
    x = x[x.abs() <= fmt.max]
    rto = fewbit.round(x, fmt, "rto")
    rtz = fewbit.round(x, fmt, "rtz")
    codes = fewbit.encode(rto, fmt).to(torch.int32)
    exact = rtz == x
    assert torch.equal(rto[exact], x[exact])
    # Inexact: the result's last code bit is 1, and it is RTZ or the next value away.
    assert bool(((codes[~exact] & 1) == 1).all())
    rup_away = torch.where(x < 0, fewbit.round(x, fmt, "rdn"), fewbit.round(x, fmt, "rup"))
    assert bool(((rto[~exact] == rtz[~exact]) | (rto[~exact] == rup_away[~exact])).all())


def test_sr_rounds_away_with_probability_equal_to_the_discarded_fraction():
    # bfloat16 -> binary8p4 discards D = 4 bits: over all 16 random values, sr rounds
    # away exactly (d * 16) times for every input in the normal range.
    fmt = fewbit.format("binary8p4")
    x = _all_finite()
    x = x[(x.abs() >= fmt.smallest_normal) & (x.abs() <= fmt.max / 2)]
    assert natural_sr_bits(dtype_format(torch.bfloat16), fmt) == 4
    down = fewbit.round(x, fmt, "rtz")
    ulp = fewbit.round(x.abs(), fmt, "rup") - fewbit.round(x.abs(), fmt, "rtz")
    d = ((x.abs().double() - down.abs().double()) / ulp.double().clamp(min=1e-300))
    away_count = torch.zeros(x.shape, dtype=torch.float64)
    for n in range(16):
        r = fewbit.round(x, fmt, "sr", random_bits=torch.full(x.shape, n))
        away_count += (r.abs() > down.abs()).double()
    expected = torch.where(ulp > 0, d * 16, torch.zeros_like(d))
    assert torch.equal(away_count, expected)


def test_round_to_odd_stops_at_the_largest_value():
    """Beyond the largest finite value round-to-odd gives it, sign kept, with sat=False
    too (round-to-odd never rounds away, so a finite value never overflows to inf)."""
    for name in ("binary8p4", "ocp_e5m2", "ocp_e4m3", "binary8p3"):
        fmt = fewbit.format(name)
        x = torch.tensor([fmt.max * 1.03, -fmt.max * 1.03, 1e30, -1e30])
        want = [fmt.max, -fmt.max, fmt.max, -fmt.max]
        assert fewbit.round(x, fmt, "rto").tolist() == want, name


@pytest.mark.parametrize("dtype, n", [(torch.bfloat16, 4), (torch.float32, 20)])
def test_sr_is_src_with_the_natural_n_subnormals_included(dtype, n):
    """sr is src with N = min(D, 32) (D = 8 - 4 and 24 - 4 into binary8p4) for every bit
    value, results below the smallest normal included, where more than D bits are
    discarded and src's tie rule decides the last of them (truncating them instead passed
    every sampled test: it differs once in 2^N draws)."""
    fmt = fewbit.format("binary8p4")
    if dtype == torch.bfloat16:
        x = _all_finite()
        draws = range(1 << n)
    else:  # float32 below binary8p4's smallest normal, with bits either side of each boundary
        step = fmt.smallest_subnormal * 2.0**-n
        x = torch.cat([torch.arange(1, 5000) * step * 0.75, torch.randn(5000) * fmt.smallest_normal])
        draws = [0, 1, (1 << n - 1) - 1, 1 << n - 1, (1 << n) - 2, (1 << n) - 1]
    for bits in draws:
        rb = torch.full(x.shape, bits)
        assert_bitwise_equal(fewbit.round(x, fmt, "sr", random_bits=rb),
                             fewbit.round(x, fmt, "src", bits=n, random_bits=rb), x, f"bits {bits}")


@pytest.mark.parametrize("dtype, n", [(torch.bfloat16, 4), (torch.float32, 20)])
@pytest.mark.parametrize("mode, kw", [("sr_near_zero", {}), ("sr_fraction", {"fraction": 0.5})])
def test_optional_modes_default_to_the_natural_n(dtype, n, mode, kw):
    """Without bits=, the modes whose N is optional take N = min(D, 32)."""
    x = (torch.randn(20_000, generator=torch.Generator().manual_seed(0)) * 0.01).to(dtype)
    assert_bitwise_equal(fewbit.round(x, "binary8p4", mode, seed=3, **kw),
                         fewbit.round(x, "binary8p4", mode, bits=n, seed=3, **kw), x, mode)


def test_sr_into_a_twos_complement_format_keeps_every_discarded_bit():
    """OCP INT8's values in [1, 2) are k / 64: 7 significant bits, as its P = 8 counts the
    sign. From float32 (24) sr keeps D = 17 bits, so 1 + 2^-23, 2^-17 of an ulp above 1,
    rounds up for exactly one n of 2^17 (with N = P_x - P = 16 it never did)."""
    int8 = fewbit.format("ocp_int8")
    assert natural_sr_bits(dtype_format(torch.float32), int8) == 17
    n = torch.arange(1 << 17)
    x = torch.full(n.shape, 1 + 2.0**-23)
    assert int((fewbit.round(x, int8, "sr", random_bits=n) == 1 + 2.0**-6).sum()) == 1


def test_sr_near_zero_is_rne_except_where_rne_gives_zero():
    fmt = "binary8p4"
    x = _all_finite(torch.float32 if False else torch.bfloat16).float()
    rb = explicit_bits(x, 5, "sr_near_zero")
    got = fewbit.round(x, fmt, "sr_near_zero", bits=5, random_bits=rb)
    rne = fewbit.round(x, fmt, "rne")
    src = fewbit.round(x, fmt, "src", bits=5, random_bits=rb)
    zero = rne == 0
    assert 1000 < int(zero.sum()) < x.numel()
    assert torch.equal(got[~zero], rne[~zero])
    assert_bitwise_equal(got[zero], src[zero], x[zero], "sr_near_zero")
    assert bool((got[zero] != 0).any())  # SR does lift some tiny values off zero


@pytest.mark.parametrize("p", [0.0, 0.2, 0.5, 1.0])
def test_sr_fraction_selects_by_the_bits_above_n(p):
    fmt = "binary8p4"
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(3))
    rb = explicit_bits(x, 3, "sr_fraction")
    got = fewbit.round(x, fmt, "sr_fraction", bits=3, random_bits=rb, fraction=p)
    chosen = (rb >> 3) < round(p * 2**16)
    src = fewbit.round(x, fmt, "src", bits=3, random_bits=rb & 7)
    rne = fewbit.round(x, fmt, "rne")
    assert torch.equal(got[chosen], src[chosen]) and torch.equal(got[~chosen], rne[~chosen])
    assert abs(chosen.double().mean().item() - p) < 5 * math.sqrt(p * (1 - p) / x.numel()) + 1e-9


# Statistics: the mean of many roundings equals the exact expectation.

@pytest.mark.parametrize("mode", ["srff", "srf", "src", "src_odd"])
@pytest.mark.parametrize("bits", [2, 3, 8])
def test_mean_of_stochastic_rounding_matches_exact_expectation(mode, bits):
    fmt = fewbit.format("binary8p4")
    g = torch.Generator().manual_seed(bits)
    values = torch.tensor([0.3, -1.1, 2.7183, 100.0, 0.0013, -0.021])
    reps = 20_000
    x = values.repeat(reps, 1)
    rb = torch.randint(0, 2**bits, x.shape, generator=g)
    mean = fewbit.round(x, fmt, mode, bits=bits, random_bits=rb).double().mean(0)
    for j, v in enumerate(values.tolist()):
        lo = fewbit.round(torch.tensor([abs(v)]), fmt, "rtz").item()
        hi = fewbit.round(torch.tensor([abs(v)]), fmt, "rup").item()
        d = Fraction(abs(v) - lo) / Fraction(hi - lo)
        tie = {"srff": "truncate", "srf": "up", "src": "even", "src_odd": "odd"}[mode]
        prob = fraction_to_bits(d, bits, tie) / 2**bits
        expected = math.copysign(lo + prob * (hi - lo), v)
        se = (hi - lo) * math.sqrt(prob * (1 - prob) / reps)
        assert abs(mean[j].item() - expected) <= 5 * se + 1e-12, (v, mean[j].item(), expected)


def test_sr_is_unbiased_for_float32_inputs():
    fmt = "binary8p4"
    x = torch.tensor([0.3, 1.7, -5.55, 0.01234]).repeat(40_000, 1)
    n = natural_sr_bits(dtype_format(torch.float32), fewbit.format(fmt))
    rb = torch.randint(0, 2**n, x.shape, generator=torch.Generator().manual_seed(9))
    r = fewbit.round(x, fmt, "sr", random_bits=rb).double()
    ulp = (fewbit.round(x[0].abs(), fmt, "rup") - fewbit.round(x[0].abs(), fmt, "rtz")).double()
    se = ulp / 2 / math.sqrt(x.shape[0])
    assert bool(((r.mean(0) - x[0].double()).abs() <= 5 * se).all())


# Shapes, layouts, dtypes.

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_dtype_and_shape_are_kept(dtype):
    x = torch.randn(3, 4, 5).to(dtype)
    out = fewbit.round(x, "e5m2")
    assert out.dtype == dtype and out.shape == x.shape


def test_empty_scalar_and_non_contiguous():
    assert fewbit.round(torch.empty(0, 3), "e4m3").shape == (0, 3)
    s = fewbit.round(torch.tensor(0.3), "binary8p4")
    assert s.shape == () and s.item() == 0.3125
    x = torch.randn(64, 32)
    xt = x.t()
    assert not xt.is_contiguous()
    rb = torch.randint(0, 8, (64, 32)).t()
    assert torch.equal(fewbit.round(xt, "e4m3", "src", bits=3, random_bits=rb),
                       fewbit.round(xt.contiguous(), "e4m3", "src", bits=3,
                                    random_bits=rb.contiguous()))


def test_input_is_not_modified():
    x = torch.randn(100)
    before = x.clone()
    fewbit.round(x, "e2m1", sat=True)
    assert torch.equal(x, before)


# Bad input: clear errors, raised before anything is computed.

def test_bad_input_errors():
    x = torch.randn(8)
    with pytest.raises(ValueError, match="unknown format"):
        fewbit.round(x, "e9m9")
    with pytest.raises(ValueError, match="unknown rounding mode"):
        fewbit.round(x, "e4m3", "nearest")
    for bits in (0, 33):
        with pytest.raises(ValueError, match="bits must be in 1..32"):
            fewbit.round(x, "e4m3", "src", bits=bits, random_bits=torch.zeros(8, dtype=torch.int64))
    with pytest.raises(TypeError, match="bits must be an int"):
        fewbit.round(x, "e4m3", "src", bits=2.0, random_bits=torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="needs random bits"):
        fewbit.round(x, "e4m3", "src", bits=3)
    with pytest.raises(ValueError, match="needs bits=N"):
        fewbit.round(x, "e4m3", "src", random_bits=torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="takes no random_bits"):
        fewbit.round(x, "e4m3", "rne", random_bits=torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="takes no bits"):
        fewbit.round(x, "e4m3", "rne", bits=3)
    with pytest.raises(ValueError, match="shape"):
        fewbit.round(x, "e4m3", "src", bits=3, random_bits=torch.zeros(4, dtype=torch.int64))
    with pytest.raises(TypeError, match="integer dtype"):
        fewbit.round(x, "e4m3", "src", bits=3, random_bits=torch.zeros(8))
    with pytest.raises(TypeError, match="integer dtype"):
        fewbit.round(x, "e4m3", "src", bits=3, random_bits=torch.zeros(8, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        fewbit.round(x, "e4m3", "src", bits=3, random_bits=torch.full((8,), 8))
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        fewbit.round(x, "e4m3", "src", bits=3, random_bits=torch.full((8,), -1))
    with pytest.raises(ValueError, match="'sr' uses N"):
        fewbit.round(x, "e4m3", "sr", bits=3, random_bits=torch.zeros(8, dtype=torch.int64))
    with pytest.raises(TypeError, match="fraction"):
        fewbit.round(x, "e4m3", "sr_fraction", bits=3, random_bits=torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="fraction must be in"):
        fewbit.round(x, "e4m3", "sr_fraction", bits=3, fraction=1.5,
                      random_bits=torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="only for mode 'sr_fraction'"):
        fewbit.round(x, "e4m3", "rne", fraction=0.5)
    for bad in (torch.arange(8), torch.ones(8, dtype=torch.bool), torch.ones(8, dtype=torch.complex64)):
        with pytest.raises(TypeError, match="fewbit rounds tensors of"):
            fewbit.round(bad, "e4m3")
    with pytest.raises(TypeError, match="torch.Tensor"):
        fewbit.round([1.0, 2.0], "e4m3")
    with pytest.raises(ValueError, match="cannot hold every value of bfloat16"):
        fewbit.round(x.half(), "bf16")
    with pytest.raises(ValueError, match="cannot hold"):
        fewbit.round(x.bfloat16(), "fp16")
    with pytest.raises(TypeError, match="sat must be a bool"):
        fewbit.round(x, "e4m3", sat=1)


@pytest.mark.parametrize("call", [
    lambda t: fewbit.round(t, "binary8p4"), lambda t: fewbit.quantize(t, "binary8p4"),
    lambda t: fewbit.encode(t, "binary8p4"), lambda t: fewbit.decode(t, "binary8p4"),
    lambda t: fewbit.block.round(t, "mxfp4"), lambda t: fewbit.block.quantize(t, "mxfp4"),
], ids=["round", "quantize", "encode", "decode", "block.round", "block.quantize"])  # fmt: skip
@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")  # (torch's, making the input)
def test_sparse_tensors_are_refused_with_the_reason(call, layout):
    # (torch's own error from inside the op, before: "memory format option is only
    # supported by strided tensors")
    dense = torch.zeros(4, 32)
    sparse = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    with pytest.raises(TypeError, match=r"must be a dense \(strided\) tensor, not torch.sparse_"):
        call(sparse)


def test_an_inference_tensor_is_refused_as_out_before_it_is_written():
    """Outside inference mode torch refuses to write an inference tensor; the refusal
    came after the kernel had written it (round_), or not at all (out=)."""
    with torch.inference_mode():
        x = torch.linspace(-3, 3, 64)
    before = x.clone()
    for call in (lambda: fewbit.round_(x, "binary8p4"), lambda: fewbit.round(before, "binary8p4", out=x),
                 lambda: fewbit.block.round(before, "mxfp4", out=x)):  # fmt: skip
        with pytest.raises(RuntimeError, match="out is an inference tensor"):
            call()
        assert torch.equal(x, before)
    with torch.inference_mode():  # inside, as torch's own ops
        assert torch.equal(fewbit.round_(x, "binary8p4"), fewbit.round(before, "binary8p4"))


@pytest.mark.parametrize("fmt", ["e2m1", "e3m2", "e2m3", "int8"])
def test_formats_without_inf_or_nan_refuse_what_they_cannot_hold(fmt):
    f = fewbit.format(fmt)
    with pytest.raises(ValueError, match="no NaN"):
        fewbit.round(torch.tensor([1.0, math.nan]), fmt, sat=True)
    for v in (math.inf, -math.inf, f.max * 4):
        with pytest.raises(ValueError, match="use sat=True"):
            fewbit.round(torch.tensor([1.0, v]), fmt)
        assert abs(fewbit.round(torch.tensor([v]), fmt, sat=True).item()) in (f.max, -f.min)
    # Directed rounding toward zero stops at the largest value even without sat.
    assert fewbit.round(torch.tensor([f.max * 4]), fmt, "rtz").item() == f.max


def test_overflow_and_specials_follow_the_format():
    x = torch.tensor([1e9, -1e9, math.inf, -math.inf, math.nan, -0.0])
    e5m2 = fewbit.round(x, "e5m2")
    assert e5m2[:4].tolist() == [math.inf, -math.inf, math.inf, -math.inf]
    assert math.isnan(e5m2[4]) and math.copysign(1, e5m2[5]) == -1
    e4m3 = fewbit.round(x, "e4m3")  # no Inf: overflow goes to NaN
    assert bool(torch.isnan(e4m3[:5]).all())
    assert fewbit.round(x, "e4m3", sat=True)[:4].tolist() == [448, -448, 448, -448]
    p4 = fewbit.round(x, "binary8p4")  # no negative zero in P3109
    assert math.copysign(1, p4[5]) == 1
    unsigned = fewbit.round(torch.tensor([-3.0, -1e-9, -0.0]), "p3109_k8p4ue")
    assert math.isnan(unsigned[0]) and unsigned[1:].tolist() == [0.0, 0.0]
    # E8M0 has no zero; 3 is a tie between 2 (code 128, even) and 4 (code 129).
    e8m0 = fewbit.round(torch.tensor([0.0, 1e-45, 3.0, 3.5]), "e8m0")
    assert e8m0.tolist() == [2.0**-127, 2.0**-127, 2.0, 4.0]


def test_a_schedule_of_fractions_keeps_a_bounded_number_of_specs():
    """Every call looks its spec up in a cache keyed by its arguments: with sr_fraction's p
    changing every step, the element and block caches kept a spec a step, without bound,
    and fake_quantize's check of its backward Quant a Quant a step."""
    from fewbit.block import ops as block_ops
    from fewbit.rounding import ops
    from fewbit.rounding.checks import make_spec

    x = torch.randn(4, 32)
    for i in range(1100):
        p = 0.1 + 0.8 * i / 1100
        fewbit.round(x, "binary8p3", "sr_fraction", bits=4, fraction=p, seed=1)
        fewbit.block.round(x, "mxfp8_e4m3", "sr_fraction", bits=4, fraction=p, seed=1)
        q = fewbit.nn.Quant("binary8p3", "sr_fraction", bits=4, fraction=p)
        fewbit.nn.fake_quantize(x.requires_grad_(), None, q, seed=1)
    for cache in (make_spec, ops._named_spec, block_ops._spec, fewbit.nn._check_gradient):
        assert cache.cache_info().maxsize is not None  # (an unbounded cache has none)


def _subnormals_of(dtype: torch.dtype) -> torch.Tensor:
    """Subnormals of ``dtype`` with both signs, the smallest normal and neighbours around
    twice it, made from their bit patterns (a conversion of values would flush them)."""
    view = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}[dtype]
    m = {torch.float32: 23, torch.float64: 52, torch.bfloat16: 7}[dtype]
    codes = [1, 2, 3, 5, (1 << m) // 3, (1 << m) - 1, 1 << m, (1 << m) + 1, (2 << m) - 1, (2 << m) + 1]
    x = torch.tensor(codes, dtype=torch.int64).to(view).view(dtype)
    return torch.cat([x, -x])


@pytest.mark.parametrize("dtype, fmt", [
    (torch.float32, "bfloat16"), (torch.float32, "binary32"), (torch.float32, "ocp_e8m0"),
    (torch.bfloat16, "bfloat16"), (torch.bfloat16, "ocp_e8m0"), (torch.float64, "binary64"),
])  # fmt: skip
def test_torch_kernels_keep_subnormals_under_flush_denormal(dtype, fmt):
    """torch.set_flush_denormal(True) (FTZ and DAZ on the calling thread) made the torch
    kernels' float arithmetic flush: float32 subnormals into bfloat16 came out 0, and into
    E8M0 (no zero) they came out 0, E8M0's 2^-127 being a float32 subnormal that the
    conversion of the constant flushed, and a subnormal input's renormalisation read 0.
    They compute subnormals in integers, as the native and GPU kernels do. (Eager here: the
    compiled kernel is the same Python, and compiles seconds a spec.) round_reference read
    and wrote them through float conversions, which flushed them too."""
    x = _subnormals_of(dtype)
    rb = torch.randint(0, 8, x.shape, generator=torch.Generator().manual_seed(0))
    cases = [("rne", {}), ("rup", {}), ("rtz", {}), ("src", {"bits": 3, "random_bits": rb})]
    want = [round_reference(x, fmt, mode, **kw) for mode, kw in cases]
    torch.set_flush_denormal(True)
    try:
        with fewbit.configure(compile=False):
            got = [fewbit.round(x, fmt, mode, **kw) for mode, kw in cases]
        again = [round_reference(x, fmt, mode, **kw) for mode, kw in cases]
    finally:
        torch.set_flush_denormal(False)
    for (mode, _), g, a, w in zip(cases, got, again, want, strict=True):
        assert_bitwise_equal(g, w, x, f"{dtype} to {fmt} {mode}")
        assert_bitwise_equal(a, w, x, f"round_reference, {dtype} to {fmt} {mode}")


# Memory (memory hunt): what a call allocates beyond its result.


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16])
def test_narrow_random_bits_are_not_widened_to_int64(dtype):
    from conftest import peak_allocated

    # Bits in a dtype narrower than int32 were copied to int64 for their range check, then
    # to the kernels' int32: 12 bytes an element beside the result (3 times a float32 x).
    x = torch.randn(1 << 14)
    bits = torch.randint(0, 8, x.shape).to(dtype)
    want = fewbit.round(x, "binary8p4", "src", bits=3, random_bits=bits.to(torch.int32))
    call = lambda: fewbit.round(x, "binary8p4", "src", bits=3, random_bits=bits)  # noqa: E731
    assert peak_allocated(call) <= 2 * x.nbytes  # the result, and the bits as int32
    assert torch.equal(call(), want)
    with pytest.raises(ValueError, match=r"found values in \[0, 8\]"):
        fewbit.round(x[:2], "binary8p4", "src", bits=3, random_bits=torch.tensor([0, 8], dtype=dtype))
