"""A/B of native.cpp builds: each build's kernel against ``copy_``, in one process.

    python benchmarks/native_ab.py 5fa61c8 HEAD                  # git revisions, or paths
    python benchmarks/native_ab.py 5fa61c8 HEAD --log2-size 16 --threads 1   # input in L2
    python benchmarks/native_ab.py 5fa61c8 HEAD --elements       # fewbit bench --quick's rows
    python benchmarks/native_ab.py 5fa61c8 HEAD --elements --scale 0.01   # mostly below 2^emin
    python benchmarks/native_ab.py HEAD "HEAD -falign-loops=64"   # a build with flags of its own
    python benchmarks/native_ab.py HEAD HEAD --elements           # A/A: two builds, HEAD [1] and [2]

Each build is compiled with the library's flags and its ``fewbit_round`` called directly
(no operator around it), so the figures are the kernel's: builds of native.cpp that take
one packed ``Call`` (this one's ``native.CALL``), from the commit that introduced it. The builds
take turns, each call paired with a ``copy_`` of the input into a preallocated output
just before it: on a machine whose speed drifts, every build sees the same conditions.
Printed per build: the median (and quartiles) of copy time / call time, and the best ns
per element. Block calls (``--format``): codes (quantize) and values (round) of RNE and
SRC N=3, from float32 or (``--dtype bfloat16``) bfloat16. ``--elements``: float32,
bfloat16 and float16 rounded to binary8p4 in RNE, SRC N=3 and
``sr``, and encoded to uint8, as ``fewbit bench --quick``.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import fewbit
from fewbit.block import format as block_format
from fewbit.block.ops import _spec, _tensor_scale
from fewbit.cli import int_in
from fewbit.formats import format
from fewbit.random import Key
from fewbit.rounding import RoundMode, native
from fewbit.rounding.checks import make_spec
from fewbit.rounding.compiled import stream_words

SOURCE = "src/fewbit/rounding/native.cpp"


def build(which: str, folder: Path, index: int) -> ctypes.CDLL:
    """Compile ``which`` (a path, else a git revision of native.cpp, then any flags of its
    own after a space) and load it."""
    which, *flags = which.split()
    source = Path(which)
    if not source.exists():
        source = folder / f"native-{index}.cpp"
        source.write_text(subprocess.run(["git", "show", f"{which}:{SOURCE}"], capture_output=True, text=True,
                                         check=True).stdout)  # fmt: skip
    library = folder / f"native-{index}.so"
    subprocess.run(["c++", *native.FLAGS, *flags, "-o", str(library), str(source)], check=True)
    return native._open(library)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("builds", nargs="+", help="git revisions or paths of native.cpp")
    parser.add_argument("--format", default="mxfp8_e4m3", help="the block format of block calls")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="x's dtype in block calls")
    parser.add_argument("--elements", action="store_true", help="element calls instead of block calls")
    parser.add_argument("--scale", type=float, default=8.0,
                        help="element calls round randn times this (8: fewbit bench's data)")
    parser.add_argument("--log2-size", type=int_in(0, 34), default=24)
    parser.add_argument("--threads", type=int_in(1), default=2)
    parser.add_argument("--pairs", type=int_in(2), default=25,
                        help="timed calls of each build (quartiles need 2 or more)")
    args = parser.parse_args()
    try:  # before the builds (a minute): else the first block call's error, after them
        block_format(args.format)
    except ValueError as err:
        parser.error(f"--format: {err}")
    args.labels = labels(args.builds)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        libraries = [build(b, Path(folder), i) for i, b in enumerate(args.builds)]
        n = 1 << args.log2_size
        x = torch.randn(n, generator=torch.Generator().manual_seed(0))
        if args.elements:
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                xd = (x * args.scale).to(dtype)
                for label, calls in element_calls(xd, args.labels, libraries).items():
                    compare(f"{str(dtype).removeprefix('torch.')} {label}", calls, xd, args.pairs)
        else:
            xd = x.to(getattr(torch, args.dtype))
            for mode, bits in (("rne", None), ("src", 3)):
                compare(f"{args.format} {mode}", block_calls(xd, args, mode, bits, libraries), xd, args.pairs)


def labels(builds: list[str]) -> list[str]:
    """A name for each build: itself, numbered where one is given twice (``HEAD HEAD``, an
    A/A run that shows the noise), so that neither build's rows replace the other's."""
    return [f"{name} [{i + 1}]" if builds.count(name) > 1 else name for i, name in enumerate(builds)]


def element_calls(x: torch.Tensor, names: list[str], libraries: list) -> dict[str, dict]:
    """fewbit_round of each build on x, by row of ``fewbit bench --quick``: {row: {build: call}}."""
    n = x.numel()
    out = torch.empty_like(x)
    codes = torch.empty(n, dtype=torch.uint8)
    rounded = fewbit.round(x, "binary8p4", sat=True)  # encode takes values of the format
    rows = {}
    for mode, bits in (("rne", None), ("src", 3), ("sr", None), ("encode", None)):
        encode = mode == "encode"
        # encode's check is RNE from float32 (as native.encode_into)
        source = torch.float32 if encode else x.dtype
        spec = make_spec(source, format("binary8p4"), RoundMode("rne" if encode else mode), False, bits, None)
        words = stream_words(spec, Key(1, 0)) if spec.bits else None
        src, into, output = (rounded, codes, 1) if encode else (x, out, 0)
        rows[f"{mode} N={spec.bits}" if spec.bits else mode] = {
            name: call(library, src, into, spec, encode, words, output)
            for name, library in zip(names, libraries, strict=True)
        }
    return rows


def block_calls(x: torch.Tensor, args, mode: str, bits: int | None, libraries: list) -> dict:
    """Block calls of each build on x, codes and values: {label: call}."""
    n = x.numel()
    spec = _spec(x.dtype, args.format, mode, True, bits, None, None)
    size, packed = spec.bfmt.block_size, spec.bfmt.packed
    rule = native.BLOCK_RULES[spec.rule]
    tensor_scale = _tensor_scale(x, spec)  # NVFP4's, found as block.quantize finds it
    tensor_scale = 1.0 if tensor_scale is None else float(tensor_scale)
    codes = torch.empty(n // 2 if packed else n, dtype=torch.uint8)
    scales = torch.empty(n // size, dtype=torch.uint8)
    values = torch.empty_like(x)
    words = stream_words(spec.spec, Key(1, 0)) if bits else None
    # Codes (and the scales' codes; native.py's output kinds 1 and 3), or values (0).
    outputs = (("codes", codes, 3 if packed else 1, scales), ("values", values, 0, None))
    calls = {}
    for name, library in zip(args.labels, libraries, strict=True):
        for what, out, output, scale_codes in outputs:
            block = (size, rule, tensor_scale, 0 if scale_codes is None else scale_codes.data_ptr())
            label = f"{name} {what}"
            calls[label] = call(library, x, out, spec.spec, False, words, output, block, scale_codes)
    return calls


def call(library, x, out, spec, encode, words, output, block=native._NO_BLOCKS, scales=None):
    """A call of ``library``'s kernel, packed as native.py packs its own. It holds the tensors
    whose memory the kernel reads and writes (an address alone would let them be freed)."""
    arguments, params = native.packed(x, spec, encode, words, None, out, output, 0, block)
    return lambda: (library.fewbit_round(arguments), x, out, scales, params)


def compare(title: str, calls: dict, x: torch.Tensor, pairs: int) -> None:
    """Time the calls in turns, each after a copy_ of x, and print their ratios."""
    copied, n = torch.empty_like(x), x.numel()
    ratios = {label: [] for label in calls}
    best = dict.fromkeys(calls, float("inf"))
    # Warm-up: fault in the outputs, the yardstick's too (its first copy_ would pay for fresh
    # pages, and the first build's first ratio with them: 13x where the others gave 0.6x).
    for _ in range(3):
        copied.copy_(x)
        for call in calls.values():
            call()
    for _ in range(pairs):
        for label, call in calls.items():
            start = time.perf_counter()
            copied.copy_(x)
            middle = time.perf_counter()
            call()
            end = time.perf_counter()
            ratios[label].append((middle - start) / (end - middle))
            best[label] = min(best[label], end - middle)
    for label, r in ratios.items():
        q = statistics.quantiles(r, n=4)
        print(f"{title:22} {label:24} x copy {statistics.median(r):.3f} [{q[0]:.2f}-{q[2]:.2f}]  "
              f"best {best[label] / n * 1e9:.3f} ns/element")


if __name__ == "__main__":
    main()
