"""Formats: registry, name parsing, properties and value tables."""

import math

import gfloat
import numpy as np
import pytest
import torch

import fewbit
from conftest import gfloat_format, has_finite_max
from fewbit.formats import FloatFormat, integer, names, p3109

# Published maxima and minima (OCP OFP8 and MX specs, IEEE 754, P3109 interim report).
SPEC_RANGES = {
    "binary16": (65504.0, 2.0**-14, 2.0**-24),
    "bfloat16": ((2 - 2.0**-7) * 2.0**127, 2.0**-126, 2.0**-133),
    "binary32": ((2 - 2.0**-23) * 2.0**127, 2.0**-126, 2.0**-149),
    "ocp_e4m3": (448.0, 2.0**-6, 2.0**-9),
    "ocp_e5m2": (57344.0, 2.0**-14, 2.0**-16),
    "ocp_e3m2": (28.0, 2.0**-2, 2.0**-4),
    "ocp_e2m3": (7.5, 1.0, 2.0**-3),
    "ocp_e2m1": (6.0, 1.0, 0.5),
    "binary8p4": (224.0, 2.0**-7, 2.0**-10),
    "binary8p3": (49152.0, 2.0**-15, 2.0**-17),
}


@pytest.mark.parametrize("name", sorted(SPEC_RANGES))
def test_published_ranges(name):
    fmt = fewbit.format(name)
    assert (fmt.max, fmt.smallest_normal, fmt.smallest_subnormal) == SPEC_RANGES[name]


def test_e8m0_and_int8():
    e8m0 = fewbit.format("e8m0")
    assert (e8m0.max, e8m0.min, e8m0.has_zero, e8m0.num_nans) == (2.0**127, 2.0**-127, False, 1)
    int8 = fewbit.format("int8")
    assert (int8.max, int8.min, int8.num_nans, int8.has_infs) == (127 / 64, -2.0, 0, False)


@pytest.mark.parametrize(
    "spelling, canonical",
    [
        ("binary8p4", "binary8p4"), ("p3109_k8p4se", "binary8p4"),
        ("p3109_k8p4sf", "p3109_k8p4sf"), ("p3109_k6p3uf", "p3109_k6p3uf"),
        ("e4m3", "ocp_e4m3"), ("ocp_e4m3", "ocp_e4m3"), ("E5M2", "ocp_e5m2"),
        ("e3m2", "ocp_e3m2"), ("e2m3", "ocp_e2m3"), ("e2m1", "ocp_e2m1"), ("e8m0", "ocp_e8m0"),
        ("int8", "ocp_int8"), ("bf16", "bfloat16"), ("bfloat16", "bfloat16"),
        ("fp16", "binary16"), ("binary16", "binary16"), ("fp32", "binary32"),
        ("binary32", "binary32"),
    ],
)
def test_names_parse(spelling, canonical):
    assert fewbit.format(spelling).name == canonical


def test_every_name_round_trips_and_is_unique():
    all_names = names()
    assert len(all_names) == len(set(all_names))
    assert len([n for n in all_names if n.startswith(("binary", "p3109")) and "p" in n[6:]]) >= 504
    for name in all_names:
        assert fewbit.format(name).name == name


def test_unknown_names_suggest_close_ones():
    with pytest.raises(ValueError, match="closest: .*binary8p4"):
        fewbit.format("binary8p5x")
    with pytest.raises(ValueError, match="e4m3"):
        fewbit.format("e4m4")
    with pytest.raises(TypeError):
        fewbit.format(8)
    # Refused before the cache, which said "unhashable type: 'list'" (a block format's element too).
    for look_up in (fewbit.format, fewbit.formats.format):
        with pytest.raises(TypeError, match="a format is a name or a FloatFormat, not list"):
            look_up(["e4m3"])
    with pytest.raises(TypeError, match="a format is a name or a FloatFormat, not list"):
        fewbit.block.BlockFormat("b", ["e2m1"], 32, "e8m0")
    # Digits are ASCII: Python's int() reads other scripts' digits, and \d matched them.
    with pytest.raises(ValueError, match="closest: .*binary8p4"):
        fewbit.format("binary\u0668p4")
    with pytest.raises(ValueError, match="closest: hbfp8"):
        fewbit.block.format("hbfp\u0668")


@pytest.mark.parametrize("k, p", [(2, 1), (17, 4), (8, 8), (8, 0)])
def test_impossible_p3109_parameters(k, p):
    with pytest.raises(ValueError, match="P3109"):
        p3109(k, p)
    with pytest.raises(ValueError):
        fewbit.format(f"binary{k}p{p}")
    with pytest.raises(ValueError, match="unsigned ones 1 <= P <= K" if p == k else "P3109"):
        p3109(k, p + (p == k), signed=False)


def test_unsigned_p3109_formats_reach_p_equal_k():
    """Without a sign bit, K = P gives one exponent bit (gfloat's format_info_p3109 makes
    them): p3109_k8p8ue holds 0, 2^-7 .. 1.9765625, Inf and a NaN."""
    fmt = fewbit.format("p3109_k8p8ue")
    assert (fmt.k, fmt.p, fmt.signed, fmt.max, fmt.smallest_subnormal) == (8, 8, False, 1.9765625, 2.0**-7)
    assert {"p3109_k3p3uf", "p3109_k16p16ue"} <= set(names()) and "p3109_k8p8se" not in names()


def test_wide_formats_say_they_exceed_float64():
    with pytest.raises(ValueError, match="float64"):
        _ = fewbit.format("binary16p1").max


def test_value_tables_and_properties_match_gfloat():
    checked = 0
    for name in names():
        fmt = fewbit.format(name)
        if fmt.k > 16 or not has_finite_max(fmt):
            continue
        info = gfloat_format(fmt)
        ours = fmt.values()
        theirs = gfloat.decode_ndarray(info, np.arange(2**fmt.k))
        assert np.array_equal(np.isnan(ours), np.isnan(theirs)), name
        finite = ~np.isnan(ours)
        assert np.array_equal(ours[finite], theirs[finite]), name
        assert np.array_equal(np.signbit(ours[finite]), np.signbit(theirs[finite])), name
        assert (fmt.max, fmt.min, fmt.num_nans) == (info.max, info.min, info.num_nans)
        above = ours[np.isfinite(ours) & (ours > 1.0)]  # eps from the values (gfloat's intM eps is half)
        if above.size and 1.0 in ours:
            assert fmt.eps == float(above.min() - 1.0), name
        assert (fmt.has_infs, fmt.has_nz, fmt.is_signed) == (
            info.num_infs > 0, info.has_nz, info.is_signed)
        # The table's extremes agree with the properties.
        assert np.nanmax(ours[np.isfinite(ours)]) == fmt.max
        checked += 1
    assert checked > 400


def test_contains():
    fp32, bf16, fp16 = (fewbit.format(n) for n in ("fp32", "bf16", "fp16"))
    assert fp32.contains(fewbit.format("e8m0")) and fp32.contains(bf16)
    assert not fp16.contains(bf16) and not bf16.contains(fp16)
    assert fp16.contains(fewbit.format("e5m2")) and bf16.contains(fewbit.format("e4m3"))
    assert bf16.contains(fewbit.format("binary8p1"))  # 2^62 fits bf16's range
    assert not fp16.contains(fewbit.format("binary8p1"))


def _value_set(fmt: FloatFormat) -> tuple[frozenset, bool]:
    """fmt's non-NaN values as float64 bit patterns (-0 apart from +0), and whether it has a NaN."""
    v = fmt.values()
    nan = np.isnan(v)
    return frozenset(v[~nan].view(np.int64).tolist()), bool(nan.any())


def test_contains_agrees_with_the_value_tables():
    # contains is True exactly when other's values (-0, Inf and NaN included) are self's: for
    # every pair among the registered formats of up to 8 bits, intM, a few made by hand
    # (many NaNs, few values) and 16-bit ones; float32 and float64 hold what numpy's casts keep.
    few = [
        FloatFormat("many_nans", 6, 2, 3, extended=False, has_nz=True, num_high_nans=5),
        FloatFormat("nans_no_nz", 7, 5, 4, extended=False, num_high_nans=2),
        FloatFormat("few_values", 5, 3, 1, num_high_nans=13),
        FloatFormat("few_unsigned", 5, 3, 2, signed=False, num_high_nans=29),
    ]
    fmts = [fewbit.format(n) for n in names() if fewbit.format(n).k <= 8]
    fmts += [integer(m) for m in (2, 3, 4, 5, 7, 9, 12, 16)] + few
    fmts += [fewbit.format(n) for n in ("binary16", "bfloat16", "binary12p5", "p3109_k10p3uf")]
    tables = {f: _value_set(f) for f in fmts}
    wrong = [
        (a.name, b.name) for a in fmts for b in fmts
        if a.contains(b) != (tables[b][0] <= tables[a][0] and (tables[a][1] or not tables[b][1]))
    ]
    assert not wrong, wrong[:10]
    for name, dtype in (("binary32", np.float32), ("binary64", np.float64)):
        for b in fmts:
            v = b.values()[~np.isnan(b.values())]
            kept = np.array_equal(v.astype(dtype).astype(np.float64).view(np.int64), v.view(np.int64))
            assert fewbit.format(name).contains(b) == kept, (name, b.name)
    assert fewbit.format("fp64").contains(fewbit.format("fp32"))
    assert not fewbit.format("fp32").contains(fewbit.format("fp64"))


def test_a_dtype_that_holds_every_value_of_an_int_format_rounds_and_decodes_to_it():
    # int9 (k * 2^-7) fits bfloat16 and int12 (k * 2^-10) float16: the sign is not a significand bit.
    int9 = torch.tensor(integer(9).values(), dtype=torch.bfloat16)
    assert torch.equal(fewbit.round(int9, "int9"), int9)
    ties = torch.tensor([2.0**-8, 3 * 2.0**-8, -(2.0**-8) * 511], dtype=torch.bfloat16)
    expected = torch.tensor([0.0, 2.0**-6, -2.0], dtype=torch.bfloat16)  # ties to even, -2 = -256 * 2^-7
    assert torch.equal(fewbit.round(ties, "int9"), expected)
    codes = torch.arange(4096, dtype=torch.int32).to(torch.int16)
    decoded = fewbit.codec.decode(codes, "int12", torch.float16)
    assert torch.equal(decoded.double(), torch.tensor(integer(12).values()))


def test_formats_refuse_impossible_fields_when_made():
    good = {"name": "mine", "k": 8, "p": 4, "bias": 7}
    with pytest.raises(TypeError, match="k must be of type int, not float"):
        FloatFormat(**{**good, "k": 8.0})
    with pytest.raises(TypeError, match="bias must be of type int"):
        FloatFormat(**{**good, "bias": 7.5})
    with pytest.raises(TypeError, match="p must be of type int, not bool"):
        FloatFormat(**{**good, "p": True})
    with pytest.raises(TypeError, match="signed must be of type bool"):
        FloatFormat(**good, signed=1)
    with pytest.raises(ValueError, match=r"num_high_nans must be in 0\.\.125"):
        FloatFormat(**good, num_high_nans=200)
    with pytest.raises(ValueError, match="num_high_nans must be in"):
        FloatFormat(**good, num_high_nans=-1)
    with pytest.raises(ValueError, match="unsigned format has no negative zero"):
        FloatFormat(**good, signed=False, has_nz=True)
    with pytest.raises(ValueError, match="two's-complement"):
        FloatFormat("uint4", 4, 4, 0, signed=False, extended=False, twos_complement=True)
    with pytest.raises(ValueError, match="no code for a finite value"):
        FloatFormat("k2", 2, 1, 0)
    # The most NaNs leave one finite non-zero magnitude: the smallest subnormal, 2^(1 - 7 - 3).
    assert FloatFormat(**good, num_high_nans=125).max == 2.0**-9


def test_smallest_subnormal_without_nonzero_subnormals():
    fmt = fewbit.format("binary8p1")
    assert fmt.smallest_subnormal == fmt.smallest_normal == math.ldexp(1, 1 - fmt.bias)


def test_formats_module_needs_no_torch(tmp_path):
    """fewbit.formats is the torch-free bottom layer, its error path included (an unknown name
    once imported fewbit.block, and torch with it, to say the name was a block format's)."""
    import subprocess
    import sys
    from pathlib import Path

    package = Path(fewbit.__file__).parent
    script = f"""
import sys, types
fewbit = types.ModuleType("fewbit")
fewbit.__path__ = [{str(package)!r}]  # the package without its __init__, which imports torch
sys.modules["fewbit"] = fewbit
import fewbit.formats as formats
assert formats.format("e4m3").name == "ocp_e4m3"
for name in ("mxfp4", "e4m3x"):
    try:
        formats.format(name)
    except ValueError as e:
        assert "block format" not in str(e), e
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("module", ["fewbit.random", "fewbit.rounding", "fewbit.codec", "fewbit.bias"])
def test_a_module_imports_before_the_package_orders_its_imports(module):
    """Each layer imports only those below it, so it imports first, alone (without the
    package's __init__, whose order hid a cycle: fewbit.random took N's limit from
    fewbit.rounding.modes, whose package imports fewbit.random)."""
    import subprocess
    import sys
    from pathlib import Path

    package = Path(fewbit.__file__).parent
    script = f"""
import importlib, sys, types
fewbit = types.ModuleType("fewbit")
fewbit.__path__ = [{str(package)!r}]
sys.modules["fewbit"] = fewbit
importlib.import_module({module!r})
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-1500:]
