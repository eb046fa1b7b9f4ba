"""The fewbit command line."""

import re
from fractions import Fraction

import pytest

import fewbit
from fewbit.cli import main


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
    code, out, _ = run(capsys, "formats", "--all")
    assert sum(1 for line in out.splitlines()[1:] if line.strip()) == len(fewbit.formats.names())


def test_round_prints_neighbours_results_and_sr_probabilities(capsys):
    code, out, _ = run(capsys, "round", "0.3", "--format", "binary8p4")
    assert code == 0
    assert "neighbours: 0.28125 and 0.3125" in out
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


def test_bench_json_rows(capsys):
    """`fewbit bench --quick --json`: every row the issue asks for, each with its ratios."""
    import json

    code, out, _ = run(capsys, "bench", "--quick", "--log2-size", "12", "--repeat", "1", "--json")
    assert code == 0
    rows = json.loads(out[out.index("[") :])
    per_call = [r for r in rows if "us_per_call" in r]
    assert {r["mode"] for r in per_call} == {"copy_", "rne", "src"}
    assert all(r["us_per_call"] > 0 for r in per_call)
    rows = [r for r in rows if "us_per_call" not in r]
    f32 = {(r["mode"], r["bits"]): r for r in rows if r["input"] == "torch.float32"}
    assert set(f32) == {("rne", None), ("src", 3), ("sr", None), ("encode to uint8", None)}
    assert {r["input"] for r in rows} == {"torch.float32", "torch.bfloat16"}
    for r in rows:
        assert r["melem_per_s"] > 0 and r["x_copy"] > 0 and r["x_clone"] > 0
    # Beside fewbit: eager, a torch.randint-fed SR, and gfloat on the key rows.
    assert {"eager_x_copy", "x_gfloat"} <= set(f32[("rne", None)])
    assert {"eager_x_copy", "x_gfloat", "randint_fed_x_copy"} <= set(f32[("src", 3)])
