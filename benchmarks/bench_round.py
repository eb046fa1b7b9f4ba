"""Throughput of fewbit.round against torch.clone and gfloat, measured in one run.

    python benchmarks/bench_round.py [--log2-size 24] [--repeat 5] [--threads 2]

Reports million elements per second (Melem/s) and ratios for float32 -> binary8p4,
RNE and SRC with N = 3 random bits per element, the bits generated beforehand:
fewbit as called (the native CPU kernel) and eager (no compiler; both take the
magic-number shortcut, ``fewbit.rounding.magic``) against gfloat on numpy and on torch
arrays.
"""

from __future__ import annotations

import argparse

import gfloat
import torch
from gfloat.formats import format_info_p3109

import fewbit
from fewbit.bench import best_time
from fewbit.cli import int_in


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log2-size", type=int_in(0, 34), default=24)
    parser.add_argument("--repeat", type=int_in(1), default=5)
    parser.add_argument("--gfloat-repeat", type=int_in(1), default=1)
    parser.add_argument("--threads", type=int_in(1), default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    n = 1 << args.log2_size
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * 10
    bits = torch.randint(0, 8, (n,), generator=g, dtype=torch.int32)
    info = format_info_p3109(8, 4)

    rows = [("torch.clone", best_time(lambda: x.clone(), args.repeat))]
    rows += _fewbit_and_gfloat(x, bits, info, args)
    _report(rows, n)


def _fewbit_and_gfloat(x, bits, info, args):
    x_np, bits_np = x.numpy(), bits.numpy()
    rows = []
    for label, mode, kw, gmode in [
        ("RNE", "rne", {}, gfloat.RoundMode.TiesToEven),
        ("SRC N=3", "src", {"bits": 3, "random_bits": bits}, gfloat.RoundMode.Stochastic),
    ]:
        rows.append((f"fewbit {label}", best_time(
            lambda: fewbit.round(x, "binary8p4", mode, **kw), args.repeat)))
        with fewbit.configure(compile=False):
            rows.append((f"fewbit eager {label}", best_time(
                lambda: fewbit.round(x, "binary8p4", mode, **kw), args.repeat)))
        g_kw = {"srbits": bits_np, "srnumbits": 3} if kw else {}
        rows.append((f"gfloat numpy {label}", best_time(
            lambda: gfloat.round_ndarray(info, x_np, gmode, **g_kw), args.gfloat_repeat)))
        g_kw = {"srbits": bits, "srnumbits": 3} if kw else {}
        rows.append((f"gfloat torch {label}", best_time(
            lambda: gfloat.round_ndarray(info, x, gmode, **g_kw), args.gfloat_repeat)))
    return rows


def _report(rows, n):
    clone = rows[0][1]
    times = dict(rows)
    print(f"float32 -> binary8p4, {n} elements, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'':24} {'Melem/s':>10} {'x clone':>8} {'x gfloat np':>12} {'x gfloat torch':>15}")
    for name, t in rows:
        line = f"{name:24} {n / t / 1e6:>10.1f} {clone / t:>8.3f}"
        if name.startswith("fewbit"):
            label = name.removeprefix("fewbit ").removeprefix("eager ")
            line += f" {times[f'gfloat numpy {label}'] / t:>12.1f}"
            line += f" {times[f'gfloat torch {label}'] / t:>15.1f}"
        print(line)


if __name__ == "__main__":
    main()
