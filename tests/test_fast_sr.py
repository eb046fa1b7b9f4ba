"""Stochastic rounding with generated bits: seeds, the fused compiled kernel, round_."""

import math
import warnings
from fractions import Fraction

import pytest
import torch

import fewbit
from fewbit.random import Key, fold_in, random_bits
from fewbit.rounding import compiled
from fewbit.rounding.reference import probability_away


@pytest.fixture
def eager():
    with fewbit.configure(compile=False):
        yield


@pytest.fixture
def compiling():
    """The torch.compile'd kernels (on a CPU the native kernel would take the calls)."""
    with fewbit.configure(compile=True, native=False):
        yield


def bits_of(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


@pytest.mark.parametrize("mode, bits", [("srff", 2), ("srf", 3), ("src", 3), ("src_odd", 8),
                                        ("src", 32), ("sr", None), ("sr_near_zero", 4)])
def test_seed_draws_the_bits_random_bits_gives(eager, mode, bits):
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(1)) * 3
    n = bits or 20  # sr from float32 to binary8p4: N = D = 20
    want = fewbit.round(x, "binary8p4", mode, bits=bits, random_bits=random_bits(x.shape, n, 42))
    got = fewbit.round(x, "binary8p4", mode, bits=bits, seed=42)
    assert torch.equal(bits_of(got), bits_of(want))
    assert torch.equal(bits_of(fewbit.round(x, "binary8p4", mode, bits=bits, seed=Key.from_seed(42))),
                       bits_of(want))


def test_sr_fraction_selects_from_its_own_stream(eager):
    x = torch.randn(100_000)
    key = Key.from_seed(5)
    select = random_bits(x.shape, 16, fold_in(key, 0x5E1EC7), dtype=torch.int64)
    rb = random_bits(x.shape, 3, key, dtype=torch.int64) | (select << 3)
    want = fewbit.round(x, "e4m3", "sr_fraction", bits=3, fraction=0.3, random_bits=rb)
    assert torch.equal(fewbit.round(x, "e4m3", "sr_fraction", bits=3, fraction=0.3, seed=key), want)


def test_same_seed_same_bits_new_seed_new_bits(eager):
    x = torch.randn(300_000)
    a = fewbit.round(x, "e5m2", "src", bits=2, seed=3)
    b = fewbit.round(x, "e5m2", "src", bits=2, seed=3)
    c = fewbit.round(x, "e5m2", "src", bits=2, seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # The two seeds round about 3/8 of inputs differently (half the inputs have a
    # nonzero chance each way), not all or none.
    assert 0.05 < (a != c).double().mean().item() < 0.6


@pytest.mark.parametrize(
    "dtype, fmt, mode, bits",
    [(torch.float32, "binary8p4", "src", 3), (torch.float32, "e4m3", "sr_fraction", 3),
     (torch.bfloat16, "e2m1", "srff", 2), (torch.float32, "binary8p4", "rne", None)],
)
def test_compiled_kernel_equals_eager(compiling, dtype, fmt, mode, bits):
    x = (torch.randn(fewbit.config.current().compile_threshold * 3 + 17) * 4).to(dtype)
    kw = {"bits": bits, "seed": 11} if bits else {}
    if mode == "sr_fraction":
        kw["fraction"] = 0.5
    sat = fmt == "e2m1"
    before = len(compiled._CACHE)
    fast = fewbit.round(x, fmt, mode, sat=sat, **kw)
    assert len(compiled._CACHE) == before + 1 and not compiled._BROKEN
    again = fewbit.round(x[:-5], fmt, mode, sat=sat, **kw)  # another length: no new compile
    assert len(compiled._CACHE) == before + 1
    with fewbit.configure(compile=False):
        slow = fewbit.round(x, fmt, mode, sat=sat, **kw)
    assert torch.equal(bits_of(fast), bits_of(slow))
    assert torch.equal(bits_of(again), bits_of(slow[:-5]))


def test_a_users_stance_against_recompiles_does_not_make_a_kernel_eager(compiling, monkeypatch):
    """A user who sets ``fail_on_recompile`` after warming up their model still gets
    fewbit's compiled kernel for a spec first met after that (it was marked failed, with a
    warning, and ran eager for the rest of the process)."""
    monkeypatch.setattr(compiled, "_CACHE", {})  # this spec's first compilation
    monkeypatch.setattr(compiled, "_BROKEN", set())
    x = torch.randn(fewbit.config.current().compile_threshold + 9, generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings(record=True) as seen:  # not "error": Inductor warns of its own
        warnings.simplefilter("always")
        torch.compiler.set_stance("fail_on_recompile")
        try:
            got = [fewbit.round(x[:n], "e5m2", "src", bits=3, seed=n) for n in (len(x), len(x) - 5)]
        finally:
            torch.compiler.set_stance("default")
    assert not [w for w in seen if "fewbit" in str(w.message)]
    assert len(compiled._CACHE) == 1 and not compiled._BROKEN
    with fewbit.configure(compile=False):
        for g, n in zip(got, (len(x), len(x) - 5), strict=True):
            assert torch.equal(g, fewbit.round(x[:n], "e5m2", "src", bits=3, seed=n))


def test_config_forces_eager(eager):
    before = len(compiled._CACHE)
    fewbit.round(torch.randn(fewbit.config.current().compile_threshold * 2), "e3m2", "src", bits=3, seed=1,
                 sat=True)
    assert len(compiled._CACHE) == before


@pytest.mark.parametrize("mode", ["srff", "srf", "src", "src_odd"])
@pytest.mark.parametrize("value", [0.3, 0.302734375, 0.303125])
def test_mean_over_seeds_matches_the_exact_expectation(eager, mode, value):
    # In binary8p4 these lie d = 0.6000004, 11/16 (a tie of d * 2^3, where the modes' tie
    # rules differ) and 0.7000003 of an ulp above 0.28125: with N = 2 instead of 3, srff
    # would give 1/2 at d = 0.7 (5/8 with 3 bits).
    x = torch.full((100_000,), value)
    lo, ulp = 0.28125, 0.03125
    d = Fraction(torch.tensor(value).item() - lo) / Fraction(ulp)
    mean = torch.stack([fewbit.round(x, "binary8p4", mode, bits=3, seed=s).double().mean()
                        for s in range(4)]).mean().item()
    p = float(probability_away(fewbit.RoundMode(mode), d, 3))
    se = ulp * math.sqrt(p * (1 - p) / (4 * x.numel()))
    assert abs(mean - (lo + p * ulp)) <= 5 * se


def test_round_in_place(eager):
    x = torch.randn(1000)
    want = fewbit.round(x, "binary8p4", "src", bits=3, seed=9)
    y = x.clone()
    assert fewbit.round_(y, "binary8p4", "src", bits=3, seed=9) is y
    assert torch.equal(y, want)
    z = torch.tensor([1.0, math.inf])
    with pytest.raises(ValueError):
        fewbit.round_(z, "e2m1")
    assert z.tolist() == [1.0, math.inf]  # untouched on error


def test_bad_seeds():
    x = torch.randn(8)
    with pytest.raises(ValueError, match="not both"):
        fewbit.round(x, "e4m3", "src", bits=3, seed=1, random_bits=torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="takes no seed"):
        fewbit.round(x, "e4m3", "rne", seed=1)
    for bad in (1.5, "seed", None.__class__, True):
        with pytest.raises(TypeError):
            fewbit.round(x, "e4m3", "src", bits=3, seed=bad)
    with pytest.raises(ValueError):
        fewbit.round(x, "e4m3", "src", bits=3, seed=-1)
    with pytest.raises(ValueError, match="bits must be in 1..32"):
        fewbit.round(x, "e4m3", "src", bits=40, seed=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cpu_and_gpu_give_the_same_bits():
    x = torch.randn(1 << 20) * 3
    for mode, bits in [("src", 3), ("srff", 2), ("sr", None), ("rne", None)]:
        kw = {"seed": 5} if mode != "rne" else {}
        cpu = fewbit.round(x, "binary8p4", mode, bits=bits, **kw)
        gpu = fewbit.round(x.cuda(), "binary8p4", mode, bits=bits, **kw).cpu()
        assert torch.equal(bits_of(cpu), bits_of(gpu)), mode
