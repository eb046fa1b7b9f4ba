"""The Triton GPU kernel without a GPU: compiled by Triton's own compiler for NVIDIA
targets (what the GPU would run, short of running it), and run under Triton's
interpreter on the CPU (tests/interpreted_gpu_kernel.py, in a process of its own with
``TRITON_INTERPRET=1``, which Triton reads as it is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

import numpy as np  # noqa: E402

import fewbit  # noqa: E402
from fewbit.rounding import gpu  # noqa: E402
from fewbit.rounding.checks import make_spec  # noqa: E402
from fewbit.rounding.modes import RoundMode  # noqa: E402

#: Triton's names of x's dtypes.
_TRITON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def compiled(kernel, args: dict, constants: dict, arch: int):
    """``kernel`` compiled for CUDA compute capability ``arch`` (no GPU needed): ``args``
    maps each runtime argument to its Triton type; pointers and integers are taken as
    multiples of 16, as Triton specialises them at a launch on aligned tensors."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {**args, **dict.fromkeys(constants, "constexpr")}
    aligned = {(names.index(a),): [["tt.divisibility", 16]] for a in args}
    source = ASTSource(kernel, signature, {(names.index(k),): v for k, v in constants.items()}, aligned)
    return triton_compile(source, target=GPUTarget("cuda", arch, 32), options=gpu._OPTIONS)


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype, fmt, mode, bits, sat, given", [
    (torch.float32, "binary8p4", "rne", None, False, False),  # the float adder
    (torch.float32, "binary8p4", "src", 3, False, False),
    (torch.float32, "binary8p4", "sr", None, False, False),  # classical SR
    (torch.bfloat16, "binary8p4", "src", 3, True, False),
    (torch.float16, "ocp_e5m2", "rtz", None, False, False),  # round_one from here on
    (torch.float32, "ocp_e2m1", "src_odd", 5, True, True),
    (torch.float32, "binary8p1", "sr_fraction", 4, False, False),
    (torch.float32, "bfloat16", "srff", 2, False, False),
])  # fmt: skip
def test_round_kernel_compiles_for_the_gpu(arch, dtype, fmt, mode, bits, sat, given):
    """Each path of round_kernel compiles for an A100's and an H100's architecture, and its
    PTX flushes no float32 subnormal (no .ftz), as the float-adder paths need."""
    fraction = 0.5 if mode == "sr_fraction" else None
    spec = make_spec(dtype, fewbit.format(fmt), RoundMode(mode), sat, bits, fraction)
    drawn = spec.bits is not None and not given
    constants = {**gpu.round_constants(spec, drawn, given), **({} if given else {"given_ptr": None}),
                 **({} if drawn else {"key_ptr": None})}  # fmt: skip
    args = {"x_ptr": f"*{_TRITON_DTYPES[dtype]}", "out_ptr": f"*{_TRITON_DTYPES[dtype]}", "n": "i32",
            "offset": "i32", "first_row": "i32", **({"given_ptr": "*i32"} if given else {}),
            **({"key_ptr": "*i64"} if drawn else {})}  # fmt: skip
    ptx = compiled(gpu.kernels().round_kernel, args, constants, arch).asm["ptx"]
    assert "ld.global" in ptx and "st.global" in ptx
    assert ".ftz" not in ptx


@pytest.mark.parametrize("via, mode, bits", [(torch.bfloat16, "src", 3), (torch.float16, "src", 3),
                                             (torch.float32, "src", 3), (torch.bfloat16, "sr_fraction", 4),
                                             (torch.bfloat16, "rne", None)])  # fmt: skip
def test_foreach_kernel_compiles_with_vector_loads(via, mode, bits):
    """The write-back's launch for a list (FOREACH: addresses read from a table) compiles
    for an H100, with 16-byte loads and stores: the table's sizes and addresses are
    multiples of 16, which the kernel says to the compiler."""
    fraction = 0.5 if mode == "sr_fraction" else None
    spec = make_spec(via, fewbit.format("binary8p4"), RoundMode(mode), True, bits, fraction)
    constants = {**gpu.round_constants(spec, bits is not None, False), "given_ptr": None, "key_ptr": None,
                 "FOREACH": True, "VIA": getattr(triton.language, gpu._TRITON_DTYPES[via]),
                 "TENSORS": gpu._FOREACH_TENSORS}  # fmt: skip
    args = {"x_ptr": "*i64", "out_ptr": "*fp32", "n": "i32", "offset": "i32", "first_row": "i32"}
    ptx = compiled(gpu.kernels().round_kernel, args, constants, 90).asm["ptx"]
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx and ".ftz" not in ptx


@pytest.mark.parametrize("fmt, packed", [("ocp_e4m3", False), ("ocp_e2m1", True), ("binary16", False)])
def test_encode_kernel_compiles_for_the_gpu(fmt, packed):
    fmt = fewbit.format(fmt)
    out = {8: "*u8", 16: "*i16"}[8 if fmt.k <= 8 else 16]
    constants = {**gpu.encode_constants(fmt), "BLOCK": gpu._ENCODE_BLOCK, "BLOCKS": gpu._ENCODE_BLOCKS,
                 "PACKED": packed}  # fmt: skip
    args = {"x_ptr": "*fp32", "out_ptr": out, "bad_ptr": "*i64", "n": "i32"}
    ptx = compiled(gpu.kernels().encode_kernel, args, constants, 90).asm["ptx"]
    assert "atom.global" in ptx and ".ftz" not in ptx


def test_a_kernel_triton_cannot_compile_leaves_the_call_to_torch(monkeypatch):
    """Where Triton fails to compile a kernel (a GPU or Triton version it was not tried
    on), the call writes nothing and says it did not run, with one warning per kernel."""

    class Failing:
        launches = 0

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                Failing.launches += 1
                raise RuntimeError("ptxas fatal: no such instruction")

            return launch

    failing = types.SimpleNamespace(round_kernel=Failing(), encode_kernel=Failing())
    monkeypatch.setattr(gpu, "kernels", lambda: failing)
    monkeypatch.setattr(gpu, "_BROKEN", set())
    x = torch.randn(1000)
    spec = make_spec(x.dtype, fewbit.format("binary8p4"), RoundMode.RNE, False, None, None)
    out = torch.full_like(x, 7.0)
    with pytest.warns(RuntimeWarning, match="ptxas fatal"):
        assert gpu.round_into(x, spec, None, None, out) is False
        codes = torch.empty(1000, dtype=torch.uint8)
        assert gpu.encode_into(x, fewbit.format("binary8p4"), codes, False) is None
    assert gpu.round_into(x, spec, None, None, out) is False  # no second try, no second warning
    assert Failing.launches == 2 and torch.equal(out, torch.full_like(x, 7.0))


def test_gpu_kernel_under_the_interpreter():
    # Triton 3.6's interpreter (the GPU image's) turns a loop bound into an int by int() of
    # a one-element array, which numpy 2.4 refuses; with numpy 2.3, or Triton 3.7 on, the
    # same tests pass. There tests/test_gpu.py checks the compiled kernel instead.
    triton_version = tuple(int(v) for v in triton.__version__.split(".")[:2])
    numpy_version = tuple(int(v) for v in np.__version__.split(".")[:2])
    if triton_version < (3, 7) and numpy_version >= (2, 4):
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot loop over tensor bounds with "
                    f"numpy {np.__version__}")  # fmt: skip
    tests = Path(__file__).with_name("interpreted_gpu_kernel.py")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " skipped" not in result.stdout, result.stdout[-2000:]
