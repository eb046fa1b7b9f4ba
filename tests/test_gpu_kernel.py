"""The Triton GPU kernel without a GPU: compiled by Triton's own compiler for NVIDIA
targets (what the GPU would run, short of running it), and run under Triton's
interpreter on the CPU (tests/interpreted_gpu_kernel.py, in a process of its own with
``TRITON_INTERPRET=1``, which Triton reads as it is imported)."""

from __future__ import annotations

import inspect
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
    PTX flushes no float32 subnormal (no .ftz), as the float-adder paths need. Drawn bits
    take the key from a tensor for the A100, from the launch's words for the H100."""
    fraction = 0.5 if mode == "sr_fraction" else None
    spec = make_spec(dtype, fewbit.format(fmt), RoundMode(mode), sat, bits, fraction)
    drawn = spec.bits is not None and not given
    host = drawn and arch == 90
    constants = gpu.round_constants(spec, drawn, given, True, None, host)
    args = {"x_ptr": f"*{_TRITON_DTYPES[dtype]}", "out_ptr": f"*{_TRITON_DTYPES[dtype]}", **_INTEGERS,
            **({"given_ptr": "*i32"} if given else {}), **({"key_ptr": "*i64"} if drawn and not host else {})}
    ptx = gpu.compile_for("round_kernel", args, constants, arch).asm["ptx"]
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx  # (aligned: 16 bytes a load)
    assert ".ftz" not in ptx


#: round_kernel's integer arguments, as the kernel annotates them.
_INTEGERS = dict.fromkeys(["n", "offset", "first_row", "per_run", "stride", "k0", "k1", "s0", "s1"], "i64")


@pytest.mark.parametrize("dtype, fmt, mode, bits", [
    (torch.float32, "binary8p4", "src", 1),  # 32 fields of 1 bit a word
    (torch.float32, "binary8p4", "src", 2),
    (torch.bfloat16, "binary8p4", "sr", None),  # N = D = 4
    (torch.float16, "ocp_e5m2", "sr_fraction", None),  # N = 8
    (torch.float32, "bfloat16", "sr", None),  # classical SR, N = 16
    (torch.float32, "binary8p4", "src", 3),  # 30 of a word's 32 bits used
])  # fmt: skip
def test_drawn_bits_survive_the_compiler(dtype, fmt, mode, bits):
    """Where N divides 32, a row's fields fill both words exactly. The words were once
    joined with an int32 ``1 << 32``, which is undefined for the compiler (Triton's
    interpreter gives 0, as numpy does): it dropped Threefry and the rounding, and every
    such call wrote one constant (NaN) on an H200. The compiled kernel must keep Threefry's
    20 rotations (funnel shifts), as it does for N = 3."""
    fraction = 0.3 if mode == "sr_fraction" else None
    spec = make_spec(dtype, fewbit.format(fmt), RoundMode(mode), True, bits, fraction)
    constants = gpu.round_constants(spec, True, False, True, None, True)
    assert 32 % constants["BITS"] == 0 or bits == 3
    args = {"x_ptr": f"*{_TRITON_DTYPES[dtype]}", "out_ptr": f"*{_TRITON_DTYPES[dtype]}", **_INTEGERS}
    ptx = gpu.compile_for("round_kernel", args, constants, 90).asm["ptx"]
    assert ptx.count("shf.") >= 20


@pytest.mark.parametrize("runs", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_alignment_is_what_the_host_says(dtype, runs):
    """A launch's loads and stores are 16 bytes wide where the host says the call is
    aligned (``ALIGNED``), and element by element where it says not: the kernel is not
    compiled for what Triton would find of its arguments, so that gpu.py can launch it
    again knowing only its constants and dtypes. So for runs (``RUNS``) too, each run's
    start placed in the kernel."""
    spec = make_spec(dtype, fewbit.format("binary8p4"), RoundMode.SRC, False, 3, None)
    args = {"x_ptr": f"*{_TRITON_DTYPES[dtype]}", "out_ptr": f"*{_TRITON_DTYPES[dtype]}", "key_ptr": "*i64",
            **_INTEGERS}  # fmt: skip
    variant = {aligned: (spec, True, False, aligned, None, False, 0, None, runs) for aligned in (True, False)}
    ptx = {aligned: gpu.compile_for("round_kernel", args, gpu.round_constants(*variant[aligned]), 90)
           for aligned in (True, False)}  # fmt: skip
    ptx = {aligned: compiled.asm["ptx"] for aligned, compiled in ptx.items()}
    assert "ld.global.v4.b32" in ptx[True] and "st.global.v4.b32" in ptx[True]
    assert ".v4" not in ptx[False] and ".v2" not in ptx[False]
    assert gpu.aligned(4096, 32, torch.empty(64)) and not gpu.aligned(4096, 8, torch.empty(64))
    assert not gpu.aligned(4100, 0, torch.empty(64)) and not gpu.aligned(4096, 0, torch.empty(64)[1:])


def _specialisation(kernel, args: tuple, constants: dict) -> list:
    """What Triton compiles ``kernel`` for at a launch with these arguments: its binder's
    specialisation for an H100, the key of its cache of compiled kernels."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    h100 = make_backend(GPUTarget("cuda", 90, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, h100)
    return binder(*args, **constants)[1]


def test_triton_compiles_for_the_constants_and_dtypes_alone():
    """gpu._launch keys a compiled kernel by its constants and its arguments' dtypes and
    launches it again on other sizes and addresses, the constants after the runtime
    arguments: what Triton compiles for must not depend on those sizes and addresses.
    This fails if Triton changes how it reads the kernels' annotations, or how it orders
    a launch's arguments."""
    buf, key = torch.empty(1 << 12), torch.zeros(2, dtype=torch.int64)
    spec = make_spec(torch.float32, fewbit.format("binary8p4"), RoundMode.SRC, False, 3, None)
    kernel, constants = gpu.kernels().round_kernel, gpu.round_constants(spec, True, False)
    zeros = (0,) * 8  # offset .. s1
    first = _specialisation(kernel, (buf, buf, None, key, None, None, 4096, *zeros), constants)
    for other in [(buf[1:], buf[3:], None, key[1:], None, None, 4095, 7, 1, 1, 16, 1, 16, 3, 5),  # int64s:
                  (buf, buf, None, key, None, None, 1 << 33, 1 << 32, 1, 3, 1 << 40, (1 << 32) - 1, 1 << 31,
                   1, 0)]:  # fmt: skip
        assert _specialisation(kernel, other, constants) == first
    halves = (buf.half(), buf.half(), None, key, None, None, 4096, *zeros)
    assert _specialisation(kernel, halves, constants) != first
    runtime = ["x_ptr", "out_ptr", "given_ptr", "key_ptr", "scales_ptr", "ts_ptr", "n", "offset", "first_row",
               "per_run", "stride", "k0", "k1", "s0", "s1"]  # fmt: skip
    assert kernel.arg_names[:15] == runtime and set(kernel.arg_names[15:]) == set(constants)
    codes, bad = torch.empty(1 << 12, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64)
    encode, constants = gpu.kernels().encode_kernel, gpu.encode_constants(fewbit.format("ocp_e4m3"))
    first = _specialisation(encode, (buf, codes, bad, 4096), constants)
    assert _specialisation(encode, (buf[1:], codes[5:], bad, 4095), constants) == first
    assert encode.arg_names[:4] == ["x_ptr", "out_ptr", "bad_ptr", "n"]
    assert set(encode.arg_names[4:]) == set(constants)


def test_the_current_device_is_asked_as_torch_asks_it():
    """gpu._launch asks torch's C function for the current CUDA device, where
    torch.cuda.current_device is that call after its lazy initialisation (which a CUDA
    tensor has done): this fails where a torch asks otherwise, and gpu then calls
    torch.cuda.current_device itself."""
    source = " ".join(inspect.getsource(torch.cuda.current_device).split())
    assert gpu.CURRENT_DEVICE in source
    query = getattr(torch._C, "_cuda_getDevice", None)
    assert gpu._current_device() is (query or torch.cuda.current_device)


def test_the_launch_again_is_tritons_runners():
    """gpu._launch_again launches a compiled kernel as Triton's runner
    (``CompiledKernel.__getitem__``) does, less its Python: this fails where a Triton's
    runner launches otherwise (then every launch goes through the runner, slower). Its grid
    has three dimensions, which the runner reads: 01ae8c5 gave it one, and every launch
    again raised on the H200."""
    import inspect

    from triton.compiler import CompiledKernel

    assert gpu.runner_mirrored()
    runner = " ".join(inspect.getsource(CompiledKernel.__getitem__).split())
    assert "grid[2]" in runner
    # A launch hook (a profiler's) sends launches through the runner, which calls it.
    from triton import knobs

    hook = knobs.runtime.launch_enter_hook
    assert gpu._silent(hook) and gpu._silent(None)
    assert not gpu._silent(print)  # a hook set as a plain function
    hook.add(print)  # added to the chain, as Triton 3.6 and 3.9 hold hooks
    try:
        assert not gpu._silent(hook)
        assert not gpu._launch_again(None, 1, 0, ())  # (never reaches the launch)
    finally:
        hook.remove(print)


class _Recorded:
    """A C launch that records what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, *args) -> None:
        self.calls.append(args)


def _stand_in_launcher(**sizes):
    """A CudaLauncher of this Triton as compiling a kernel with no scratch memory makes one,
    its C launch recorded (no GPU here to make a real one)."""
    from triton.backends.nvidia.driver import CudaLauncher

    launcher = object.__new__(CudaLauncher)
    attributes = {"num_ctas": 1, "launch": _Recorded(), "global_scratch_size": 0, "global_scratch_align": 1,
                  "profile_scratch_size": 0, "profile_scratch_align": 1, "launch_cooperative_grid": False,
                  "launch_pdl": True, "gsan_enabled": False, "arg_annotations": ("annotations",),
                  "kernel_signature": b"signature"}  # fmt: skip
    vars(launcher).update({**attributes, **sizes})
    return launcher


def test_the_launch_again_is_tritons_launchers(monkeypatch):
    """gpu._launcher calls the C launch of this Triton's launcher (``CudaLauncher``) itself
    with what the launcher's own call would give it: this fails where a Triton's launcher
    is not one of gpu.LAUNCHERS (then its Python runs at every launch, 1.2 us on the VM:
    read its source, and add it where it still only passes its arguments on), or where the
    arguments differ."""
    from triton.backends.nvidia.driver import CudaLauncher
    from triton.runtime import driver

    assert gpu.launcher_layout(CudaLauncher) in ("spread", "tuple")
    monkeypatch.setattr(driver, "_active", types.SimpleNamespace())  # Triton 3.8 on reads it; no GPU here
    launcher = _stand_in_launcher()
    compiled = types.SimpleNamespace(run=launcher, function=1234, packed_metadata=(2, 1, 0))
    args = (torch.empty(4), None, 4096, 7, 0)
    launcher(5, 1, 1, 99, 1234, (2, 1, 0), None, None, None, *args)  # the runner's call, Triton's Python
    gpu._launcher(compiled)(5, 99, args)
    assert len(launcher.launch.calls) == 2 and launcher.launch.calls[1] == launcher.launch.calls[0]
    # A launcher with something to do first, here scratch memory: its own call, which asks
    # for an allocator (none set) before its C launch.
    scratch = compiled.run = _stand_in_launcher(global_scratch_size=64)
    with pytest.raises(RuntimeError, match="allocator"):
        gpu._launcher(compiled)(5, 99, args)
    assert not scratch.launch.calls
    unknown = compiled.run = _Recorded()  # a launcher not known: its own call
    gpu._launcher(compiled)(5, 99, args)
    assert unknown.calls == [(5, 1, 1, 99, 1234, (2, 1, 0), None, None, None, *args)]


@pytest.mark.parametrize("via, mode, bits", [(torch.bfloat16, "src", 3), (torch.float16, "src", 3),
                                             (torch.float32, "src", 3), (torch.bfloat16, "sr_fraction", 4),
                                             (torch.bfloat16, "rne", None)])  # fmt: skip
def test_foreach_kernel_compiles_with_vector_loads(via, mode, bits):
    """The write-back's launch for a list (FOREACH: addresses read from a table) compiles
    for an H100, with 16-byte loads and stores: the table's sizes and addresses are
    multiples of 16, which the kernel says to the compiler."""
    fraction = 0.5 if mode == "sr_fraction" else None
    spec = make_spec(via, fewbit.format("binary8p4"), RoundMode(mode), True, bits, fraction)
    constants = gpu.round_constants(spec, bits is not None, False, True, via)
    args = {"x_ptr": "*i64", "out_ptr": "*fp32", **_INTEGERS}
    ptx = gpu.compile_for("round_kernel", args, constants, 90).asm["ptx"]
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx and ".ftz" not in ptx


@pytest.mark.parametrize("dtype, fmt, mode, bits, runs", [
    (torch.float32, "binary8p4", "src", 3, False), (torch.bfloat16, "ocp_e4m3", "rne", None, False),
    (torch.float16, "binary4p2", "src", 2, False), (torch.float32, "binary16", "sr_fraction", 4, False),
    (torch.float32, "binary4p2", "src", 3, True), (torch.bfloat16, "binary8p4", "src", 3, True),
])  # fmt: skip
def test_round_kernel_compiles_to_codes(dtype, fmt, mode, bits, runs):
    """quantize's launches (CODES: a code an element, or two a byte where K <= 4) compile
    for an H100 with 16-byte loads of x, and no float32 subnormal flushed; so do those of
    runs (a Shard(1) piece's codes)."""
    fmt = fewbit.format(fmt)
    spec = make_spec(dtype, fmt, RoundMode(mode), False, bits, 0.5 if mode == "sr_fraction" else None)
    codes = gpu._PACKED if fmt.k <= 4 else gpu._CODES
    constants = gpu.round_constants(spec, True, False, True, None, True, codes, None, runs)
    out = "*u8" if fmt.k <= 8 else "*i16"
    args = {"x_ptr": f"*{_TRITON_DTYPES[dtype]}", "out_ptr": out, **_INTEGERS}
    ptx = gpu.compile_for("round_kernel", args, constants, 90).asm["ptx"]
    assert "ld.global.v4.b32" in ptx and "st.global" in ptx and ".ftz" not in ptx


@pytest.mark.parametrize("dtype, name, mode, bits, codes, runs", [
    (torch.float32, "mxfp8_e4m3", "rne", None, False, False),
    (torch.bfloat16, "mxfp4", "src", 3, True, False),
    (torch.float16, "hbfp8", "sr", None, False, False),
    (torch.bfloat16, "nvfp4", "rne", None, True, False),
    (torch.float32, "nvfp4", "src", 3, False, False),
    (torch.bfloat16, "mxfp8_e4m3", "src", 3, False, True),
])  # fmt: skip
def test_block_kernel_compiles_for_the_gpu(dtype, name, mode, bits, codes, runs):
    """round_kernel's block formats (BLOCK) compile for an H100 with 16-byte loads of x, no
    float32 subnormal flushed, and NVFP4's x / S and target amax / M / ts correctly
    rounded (div.rn, where Triton's float32 division would be div.full); so do their
    values in runs (a Shard(1) piece's)."""
    from fewbit.block.ops import _spec

    bspec = _spec(dtype, name, mode, True, bits, None, None)
    output = (gpu._PACKED if bspec.bfmt.packed else gpu._CODES) if codes else gpu._VALUES
    drawn = bspec.spec.bits is not None
    constants = gpu.round_constants(bspec.spec, drawn, False, True, None, drawn, output,
                                    (bspec.bfmt.block_size, bspec.rule), runs)  # fmt: skip
    args = {"x_ptr": f"*{_TRITON_DTYPES[dtype]}", "out_ptr": "*u8" if codes else f"*{_TRITON_DTYPES[dtype]}",
            **_INTEGERS, **({"scales_ptr": "*u8"} if codes else {}),
            **({"ts_ptr": "*fp32"} if bspec.bfmt.tensor_scale else {})}  # fmt: skip
    ptx = gpu.compile_for("round_kernel", args, constants, 90).asm["ptx"]
    assert "ld.global.v4.b32" in ptx and ".ftz" not in ptx and "div.full" not in ptx
    assert ("div.rn.f32" in ptx and "div.rn.f64" in ptx) == bspec.bfmt.tensor_scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_amax_kernel_compiles_for_the_gpu(dtype):
    """NVFP4's tensor amax compiles to 16-byte loads where the call is aligned, and one
    atomic max a program."""
    for blocks in (1, gpu._ENCODE_BLOCKS):
        args = {"x_ptr": f"*{_TRITON_DTYPES[dtype]}", "amax_ptr": "*i32", "n": "i64"}
        ptx = gpu.compile_for("finite_amax_kernel", args, gpu.amax_constants(blocks, True), 90).asm["ptx"]
        assert "ld.global.v4.b32" in ptx and "atom.global" in ptx and ".max" in ptx


@pytest.mark.parametrize("fmt, packed", [("ocp_e4m3", False), ("ocp_e2m1", True), ("binary16", False)])
def test_encode_kernel_compiles_for_the_gpu(fmt, packed):
    """encode_kernel compiles with its check (an atomic to report the first element that is
    no value) and without (nothing of the kind: nothing to read back)."""
    fmt = fewbit.format(fmt)
    out = {8: "*u8", 16: "*i16"}[8 if fmt.k <= 8 else 16]
    for check in (True, False):
        constants = gpu.encode_constants(fmt, gpu._ENCODE_BLOCKS, packed, True, check)
        args = {"x_ptr": "*fp32", "out_ptr": out, "n": "i64", **({"bad_ptr": "*i64"} if check else {})}
        ptx = gpu.compile_for("encode_kernel", args, constants, 90).asm["ptx"]
        assert ("atom.global" in ptx) == check and "st.global" in ptx and ".ftz" not in ptx


@pytest.mark.parametrize("codes, values, packed", [("*u8", "*i32", False), ("*u8", "*i16", True),
                                                   ("*i16", "*i16", False)])  # fmt: skip
def test_decode_kernel_compiles_for_the_gpu(codes, values, packed):
    """decode_kernel compiles with its check (an atomic for the first code beyond the
    format) and without (none), and stores 16 bytes at a time where the call is aligned."""
    for check in (True, False):
        args = {"codes_ptr": codes, "table_ptr": values, "out_ptr": values, "n": "i64",
                **({"bad_ptr": "*i64"} if check else {})}  # fmt: skip
        constants = gpu.decode_constants(8, packed, check, True)
        ptx = gpu.compile_for("decode_kernel", args, constants, 90).asm["ptx"]
        assert ("atom.global" in ptx) == check and "st.global.v4" in ptx


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


#: The interpreted tests in three processes (each about a third of their time on a CI
#: machine), so that pytest-xdist's workers share them: the last part runs the rest.
_INTERPRETED_PARTS = [
    "test_every_format_same_bits_as_torch or test_block_scale_rules_same_as_torch",
    "test_rounded_codes_are_the_native_kernels or test_runs_draw_the_bits_of_their_place_in_the_stream"
    " or test_16_bit_inputs_same_bits_as_torch",
]


@pytest.mark.slow  # (about 70 s a part on the 2-core VM)
@pytest.mark.parametrize("part", range(len(_INTERPRETED_PARTS) + 1))
def test_gpu_kernel_under_the_interpreter(part):
    # Triton 3.6's interpreter (the GPU image's) turns a loop bound into an int by int() of
    # a one-element array, which numpy 2.4 refuses; with numpy 2.3, or Triton 3.7 on, the
    # same tests pass. There tests/test_gpu.py checks the compiled kernel instead.
    triton_version = tuple(int(v) for v in triton.__version__.split(".")[:2])
    numpy_version = tuple(int(v) for v in np.__version__.split(".")[:2])
    if triton_version < (3, 7) and numpy_version >= (2, 4):
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot loop over tensor bounds with "
                    f"numpy {np.__version__}")  # fmt: skip
    tests = Path(__file__).with_name("interpreted_gpu_kernel.py")
    rest = " and ".join(f"not ({names})" for names in _INTERPRETED_PARTS)
    chosen = _INTERPRETED_PARTS[part] if part < len(_INTERPRETED_PARTS) else rest
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests), "-k", chosen]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " skipped" not in result.stdout, result.stdout[-2000:]
