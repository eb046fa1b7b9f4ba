"""Instructions an element in the main loops of fewbit's GPU kernels, read from the SASS
that Triton compiles for an H100 (sm_90) without a GPU: a proxy for the rows that a GPU
finds bound by arithmetic (bfloat16 SRC, encode), not a timing.

A loop is a backward branch; the main one is the longest that stores. round_kernel's
loop does a row of ``LANES`` elements, 8 a thread; encode_kernel's a block of 1024 codes
(or packed bytes), 16 a thread; ``codes`` rows are round_kernel writing codes
(fewbit.quantize). round_kernel draws its Threefry words before the loop,
once a program of ``ROWS`` rows: its rows also say an element's share of the whole
kernel (the loop run ROWS times, the rest once), which for ``sr`` (a word an element,
2 rows a program) is most of it.

    python benchmarks/sass_count.py
"""

from __future__ import annotations

import re

import torch

import fewbit
from fewbit.block.ops import _spec as _block_spec
from fewbit.random import LANES
from fewbit.rounding import gpu
from fewbit.rounding.checks import make_spec
from fewbit.rounding.modes import RoundMode

#: (x's dtype, mode, N) of round_kernel into binary8p4, and (x's dtype, format) of encode.
ROUND_ROWS = [(torch.float32, "rne", None), (torch.float32, "src", 3), (torch.float32, "sr", None),
              (torch.bfloat16, "rne", None), (torch.bfloat16, "src", 3)]  # fmt: skip
ENCODE_ROWS = [(torch.float32, "ocp_e4m3"), (torch.bfloat16, "ocp_e4m3"), (torch.float32, "ocp_e2m1")]
#: round_kernel writing codes of binary8p4 (fewbit.quantize), as ROUND_ROWS.
QUANTIZE_ROWS = [(torch.float32, "rne", None), (torch.float32, "src", 3), (torch.bfloat16, "src", 3)]
#: round_kernel on block formats (``BLOCK``): (x's dtype, format, mode, N, codes or values).
BLOCK_ROWS = [
    (torch.float32, "mxfp8_e4m3", "rne", None, False), (torch.bfloat16, "mxfp8_e4m3", "src", 3, False),
    (torch.bfloat16, "mxfp8_e4m3", "rne", None, True), (torch.bfloat16, "mxfp4", "src", 3, True),
    (torch.bfloat16, "nvfp4", "rne", None, True),
]  # fmt: skip
_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16"}
_INTEGERS = dict.fromkeys(["n", "offset", "first_row", "per_run", "stride", "k0", "k1", "s0", "s1"], "i64")
#: Threads a program: the kernels' num_warps.
_THREADS = 32 * gpu._OPTIONS["num_warps"]


def instructions(sass: str) -> tuple[int, int]:
    """Instructions in the longest loop of ``sass`` (Triton's ``get_sass`` text) that
    stores, and in the whole kernel."""
    lines = sass.splitlines()
    labels = {line.strip()[:-1]: i for i, line in enumerate(lines) if re.fullmatch(r"\s*\w+:", line)}
    best = 0
    for i, line in enumerate(lines):
        target = re.search(r"\bBRA (\w+);", line)
        if target and labels.get(target[1], i) < i:
            body = lines[labels[target[1]] + 1 : i + 1]
            if any("STG" in b for b in body):
                best = max(best, sum(1 for b in body if "\t" in b))  # (instructions: control, tab, text)
    return best, sum(1 for line in lines if "\t" in line)


def sass_of(name: str, args: dict, constants: dict) -> str:
    from triton.tools.disasm import get_sass

    return get_sass(gpu.compile_for(name, args, constants, 90).asm["cubin"])


def main() -> None:
    print("sm_90 SASS, instructions an element (a code): in the main loop, and with its share of the kernel")
    per_row = LANES // _THREADS
    rows_of = [("round", row, gpu._VALUES) for row in ROUND_ROWS] + [("codes", row, gpu._CODES)
                                                                     for row in QUANTIZE_ROWS]  # fmt: skip
    for what, (dtype, mode, bits), codes in rows_of:
        spec = make_spec(dtype, fewbit.format("binary8p4"), RoundMode(mode), True, bits, None)
        drawn = spec.bits is not None
        constants = gpu.round_constants(spec, drawn, False, codes=codes)
        args = {"x_ptr": _TYPES[dtype], "out_ptr": "*u8" if codes else _TYPES[dtype], **_INTEGERS}
        if drawn:
            args["key_ptr"] = "*i64"
        loop, whole = instructions(sass_of("round_kernel", args, constants))
        rows = constants["ROWS"]
        share = (loop * rows + whole - loop) / (rows * per_row)
        print(f"{what:6} {str(dtype).removeprefix('torch.'):9} -> binary8p4 {mode:4} {bits or '':>2}  "
              f"{loop / per_row:5.1f} {share:6.1f}")
    for dtype, name, mode, bits, codes in BLOCK_ROWS:
        bspec = _block_spec(dtype, name, mode, True, bits, None, None)
        drawn = bits is not None
        output = (gpu._PACKED if bspec.bfmt.packed else gpu._CODES) if codes else gpu._VALUES
        constants = gpu.round_constants(bspec.spec, drawn, False, codes=output,
                                        block=(bspec.bfmt.block_size, bspec.rule))  # fmt: skip
        args = {"x_ptr": _TYPES[dtype], "out_ptr": "*u8" if codes else _TYPES[dtype], **_INTEGERS,
                **({"key_ptr": "*i64"} if drawn else {}), **({"scales_ptr": "*u8"} if codes else {}),
                **({"ts_ptr": "*fp32"} if bspec.bfmt.tensor_scale else {})}  # fmt: skip
        loop, whole = instructions(sass_of("round_kernel", args, constants))
        rows = constants["ROWS"]
        share = (loop * rows + whole - loop) / (rows * per_row)
        label = f"{name} {'codes' if codes else 'values'}"
        print(f"block  {str(dtype).removeprefix('torch.'):9} -> {label:18} {mode:4} {bits or '':>2}  "
              f"{loop / per_row:5.1f} {share:6.1f}")
    for dtype, name in ENCODE_ROWS:
        fmt = fewbit.format(name)
        packed = fmt.k <= 4
        args = {"x_ptr": _TYPES[dtype], "out_ptr": "*u8", "bad_ptr": "*i64", "n": "i64"}
        constants = gpu.encode_constants(fmt, gpu._ENCODE_BLOCKS, packed)
        loop, _ = instructions(sass_of("encode_kernel", args, constants))  # (its rest: the rare second pass)
        per_block = gpu._ENCODE_BLOCK // _THREADS * (2 if packed else 1)
        print(f"encode {str(dtype).removeprefix('torch.'):9} -> {name + (' (packed)' if packed else ''):16} "
              f"{loop / per_block:5.1f}")


if __name__ == "__main__":
    main()
