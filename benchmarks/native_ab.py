"""A/B of native.cpp builds on block calls: each build's kernel against ``copy_``, in one process.

    python benchmarks/native_ab.py 5fa61c8 HEAD                  # git revisions, or paths
    python benchmarks/native_ab.py 5fa61c8 HEAD --log2-size 16 --threads 1   # input in L2

Each build is compiled with the library's flags and called directly (``fewbit_block``,
no operator around it), so the figures are the kernel's. The builds take turns, each
call paired with a ``copy_`` of the input into a preallocated output just before it:
on a machine whose speed drifts, every build sees the same conditions. Printed per
build: the median (and quartiles) of copy time / call time, and the best ns per
element. Codes (quantize) and values (round) of RNE and SRC N=3.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from fewbit.block.ops import _spec, _tensor_scale
from fewbit.random import Key
from fewbit.rounding import native
from fewbit.rounding.compiled import stream_words

SOURCE = "src/fewbit/rounding/native.cpp"


def build(which: str, folder: Path, index: int) -> ctypes.CDLL:
    """Compile ``which`` (a path, else a git revision of native.cpp) and load it."""
    source = Path(which)
    if not source.exists():
        source = folder / f"native-{index}.cpp"
        source.write_text(subprocess.run(["git", "show", f"{which}:{SOURCE}"], capture_output=True, text=True,
                                         check=True).stdout)  # fmt: skip
    library = folder / f"native-{index}.so"
    subprocess.run(["c++", *native.FLAGS, "-o", str(library), str(source)], check=True)
    return native._open(library)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("builds", nargs="+", help="git revisions or paths of native.cpp")
    parser.add_argument("--format", default="mxfp8_e4m3")
    parser.add_argument("--log2-size", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        libraries = [build(b, Path(folder), i) for i, b in enumerate(args.builds)]
        n = 1 << args.log2_size
        x = torch.randn(n, generator=torch.Generator().manual_seed(0))
        copied, values = torch.empty_like(x), torch.empty_like(x)
        for mode, bits in (("rne", None), ("src", 3)):
            spec = _spec(torch.float32, args.format, mode, True, bits, None, None)
            size, packed = spec.bfmt.block_size, spec.bfmt.packed
            rule = native._RULES[spec.rule]
            tensor_scale = _tensor_scale(x, spec.bfmt)  # NVFP4's, found as block.quantize finds it
            tensor_scale = 1.0 if tensor_scale is None else float(tensor_scale)
            codes = torch.empty(n // 2 if packed else n, dtype=torch.uint8)
            scales = torch.empty(n // size, dtype=torch.uint8)
            params, kernel = native._kernel(spec.spec, False)
            keys = (ctypes.c_uint32 * 4)(*(stream_words(spec.spec, Key(1, 0)) if bits else ()))
            # Codes (and the scales' codes; native.py's output kinds 1 and 3), or values (0).
            outputs = (("codes", codes, 3 if packed else 1, scales.data_ptr()), ("values", values, 0, None))
            calls = {}
            for name, library in zip(args.builds, libraries, strict=True):
                for what, out, output, scale_codes in outputs:
                    calls[f"{name} {what}"] = functools.partial(
                        library.fewbit_block, x.data_ptr(), 0, out.data_ptr(), output, n, params, kernel,
                        keys, None, args.threads, size, rule, tensor_scale, scale_codes)  # fmt: skip
            ratios = {label: [] for label in calls}
            best = dict.fromkeys(calls, float("inf"))
            for _ in range(3):  # warm-up: fault in the outputs
                for call in calls.values():
                    call()
            for _ in range(args.pairs):
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
                print(f"{args.format} {mode:3} {label:24} x copy {statistics.median(r):.3f} "
                      f"[{q[0]:.2f}-{q[2]:.2f}]  best {best[label] / n * 1e9:.3f} ns/element")  # fmt: skip


if __name__ == "__main__":
    main()
