"""The Triton GPU kernel (rounding/triton_kernels.py) run by Triton's interpreter on the
CPU, against the eager torch kernels: the same bits for every mode, format family, input
dtype and random stream (drawn, given, at any offset), and the same codes and errors for
encode. The interpreter runs the kernel's code as numpy, so this checks its arithmetic
and its reading of the stream layout on any machine with Triton; tests/test_gpu.py
checks the compiled kernel on a GPU.

Triton reads ``TRITON_INTERPRET`` as it is imported, so these run in a process of their
own that sets it first: tests/test_gpu_kernel.py starts it (the file name keeps pytest
from collecting them in the main run).
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

import fewbit
from conftest import assert_bitwise_equal
from fewbit.block import ops as block_ops
from fewbit.config import configure, current
from fewbit.random import Key, fold_in, key_of, random_bits
from fewbit.rounding import gpu, native
from fewbit.rounding.checks import dtype_format, make_spec
from fewbit.rounding.compiled import stream_words
from fewbit.rounding.modes import RoundMode
from test_block import blocks_whose_s_rounds_short
from test_codec import LARGE_VALUES, _element_codes, large_values
from test_native import BLOCK_PIECES, FORMATS, MODE_ARGS, RUNS, every_bfloat16, runs_index, runs_of_a_matrix

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before Triton is imported (tests/test_gpu_kernel.py)",
                allow_module_level=True)  # fmt: skip

# numpy warns where the float adder's sums meet a signalling NaN among the inputs (whose
# result the kernel replaces by NaN, as it does on the GPU), and where its constant
# overflows for an x beyond the format's range (Inf - Inf then marks it beyond).
# NVFP4's blocks whose scale is 0 divide by it (the kernel then writes zeros).
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")]  # fmt: skip


def kernel(x, fmt, mode, *, sat=False, bits=None, fraction=None, seed=None, random_bits=None, offset=0,
           host=False):  # fmt: skip
    """The kernel's result for what ``fewbit.round`` takes (seed: drawn bits, from a key
    tensor, or with ``host`` from a Key, whose words the launch takes), on CPU tensors:
    gpu.applies() looks for a CUDA tensor, gpu.round_into does not."""
    spec = make_spec(x.dtype, fewbit.format(fmt), RoundMode(mode), sat, bits, fraction)
    out = torch.empty_like(x)
    key = None if seed is None else Key.from_seed(seed) if host else key_of(seed)
    ran = gpu.round_into(x, spec, key, random_bits, out, offset)
    assert ran, "the Triton kernel did not run (its warning says why)"
    return out


def eager(x, fmt, mode, **kw):
    with configure(compile=False):
        return fewbit.round(x, fmt, mode, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODE_ARGS))
def test_every_format_same_bits_as_torch(mode):
    """Every 32nd bfloat16 pattern (every exponent and sign, Inf, NaN) with random low bits."""
    x = every_bfloat16(torch.float32)[::32]
    assert torch.isinf(x).sum() == 2 and torch.isnan(x).any()
    for name in FORMATS:
        for sat in (False, True):
            kw = {"sat": sat, **MODE_ARGS[mode]}
            got = kernel(x, name, mode, **kw)
            try:
                expected = eager(x, name, mode, **kw)
            except ValueError:  # no NaN to hold a NaN, or no value beyond the range: NaN marks them
                assert torch.isnan(got).any(), f"{mode} {name} sat={sat}"
                xs = x[~torch.isnan(x)]
                kw["sat"] = True
                got, expected = kernel(xs, name, mode, **kw), eager(xs, name, mode, **kw)
            assert_bitwise_equal(got, expected, x, f"{mode} {name} sat={sat}")


@pytest.mark.parametrize("mode", ["rne", "src", "sr", "srff"])
def test_a_nan_of_any_payload_stays_nan(mode):
    """A NaN whose sum with the float adder's constant, plus N random bits, would carry
    into the sign bit (all ones: a GPU's NaN sum is such) still rounds to NaN: the kernel
    looks at x, not at the sum."""
    nans = torch.tensor([0x7FFFFFFF, -1, 0x7F800001, 0x7FC00000, 0x7FFFFFF9], dtype=torch.int32)
    x = torch.cat([nans.view(torch.float32), torch.randn(600, generator=torch.Generator().manual_seed(5))])
    x = x.repeat(8)  # each NaN meets other random bits
    kw = {"sat": True, **MODE_ARGS[mode]}
    got = kernel(x, "binary8p4", mode, **kw)
    assert torch.isnan(got).sum() == 5 * 8
    assert_bitwise_equal(got, eager(x, "binary8p4", mode, **kw), x, mode)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["rne", "src", "sr", "rup"])
def test_16_bit_inputs_same_bits_as_torch(mode, dtype):
    """Read and written in their own width: every bfloat16 pattern."""
    x = every_bfloat16(dtype)
    held = dtype_format(dtype)
    names = [n for n in ("binary8p4", "ocp_e5m2", "binary8p1") if held.contains(fewbit.format(n))]
    assert len(names) >= 2
    for name in names:
        kw = {"sat": True, **MODE_ARGS[mode]}
        assert_bitwise_equal(kernel(x, name, mode, **kw), eager(x, name, mode, **kw), x, f"{name} {mode}")


@pytest.mark.parametrize("mode, bits", [("src", 3), ("srff", 30), ("sr_fraction", 8)])
def test_given_bits_same_as_torch(mode, bits):
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1)) * 4
    fraction = 0.3 if mode == "sr_fraction" else None
    spec = make_spec(x.dtype, fewbit.format("ocp_e4m3"), RoundMode(mode), True, bits, fraction)
    rb = torch.randint(0, spec.random_range, x.shape, generator=torch.Generator().manual_seed(2),
                       dtype=torch.int32)  # fmt: skip
    kw = {"sat": True, "bits": bits, "fraction": fraction, "random_bits": rb}
    assert_bitwise_equal(kernel(x, "ocp_e4m3", mode, **kw), eager(x, "ocp_e4m3", mode, **kw), x, mode)


@pytest.mark.parametrize("bits", [1, 3, 7, 11, 16, 20])
def test_any_offset_draws_the_streams_bits(bits):
    """Elements offset .. offset + n get the stream's bits of their indices, whatever row
    of blocks the first one falls in, far out too (block counters past 2^32, the stream's end). N from 1 to
    20: the rows' fields fill both words (1, 16), leave bits unused (3, 7, 11), or take a
    word each (20)."""
    x = torch.randn(3 * 512 * 2 * (32 // bits) + 77, generator=torch.Generator().manual_seed(3))
    key = Key.from_seed(11)
    # Far out: block 2^32 onwards, and the last elements of the stream (ending at 2^63).
    for offset in (0, 333, 512 * 2 * (32 // bits) * (1 << 23) + 5, 2**63 - x.numel()):
        given = random_bits(x.shape, bits, key, offset=offset)
        expected = eager(x, "binary8p4", "src", bits=bits, random_bits=given)
        got = kernel(x, "binary8p4", "src", bits=bits, seed=11, offset=offset)
        assert_bitwise_equal(got, expected, x, f"offset {offset}")
    # As sharding.round_range calls it for a piece of a tensor: a new tensor of x's shape, or
    # None where an element has no value in a format without NaN.
    spec = make_spec(x.dtype, fewbit.format("ocp_e2m1"), RoundMode.SRC, False, bits, None)
    piece = x[: x.numel() // 7 * 7].view(-1, 7)
    got = gpu.rounded(piece, spec, key_of(11), offset=5)
    assert got.shape == piece.shape
    expected = native.rounded(piece, spec, stream_words(spec, key), offset=5)
    assert_bitwise_equal(got, expected, piece, "rounded")
    assert gpu.rounded(piece * 1e9, spec, key_of(11), offset=5) is None  # beyond e2m1 without sat


@pytest.mark.parametrize("mode, dtype", [("src", torch.float32), ("sr_fraction", torch.float32),
                                         ("srf", torch.bfloat16), ("sr", torch.bfloat16)])  # fmt: skip
def test_runs_draw_the_bits_of_their_place_in_the_stream(mode, dtype):
    """A piece of a matrix cut along its columns (sharding.round_range's Shard(1)), each
    row a run of the stream, rounds as the whole matrix does there: a program per part of
    a run, the key in a tensor or the launch's words. (Not the case of many short runs,
    for the native kernel's threads: 300 programs take the interpreter 10 s.)"""
    kw, fmt = MODE_ARGS[mode], fewbit.format("binary8p4")
    spec = make_spec(dtype, fmt, RoundMode(mode), True, kw.get("bits"), kw.get("fraction"))
    cases = [case for case in RUNS if case[0] < 100]
    for case, host in zip(cases, itertools.cycle((False, True)), strict=False):
        x, piece, (offset, runs, stride) = runs_of_a_matrix(dtype, *case)
        expected = eager(x, "binary8p4", mode, sat=True, **kw)[case[2] :, case[3] : case[3] + case[4]]
        key = Key.from_seed(kw["seed"]) if host else key_of(kw["seed"])
        out = torch.empty_like(piece, memory_format=torch.contiguous_format)
        assert gpu.round_into(piece, spec, key, None, out, offset, runs, stride)
        assert_bitwise_equal(out, expected, piece, f"{case} host key {host}")


@pytest.mark.parametrize("name, packed", [("binary8p4", False), ("binary4p2", True)])
def test_codes_of_runs_are_the_native_kernels(name, packed):
    """fewbit.quantize of a Shard(1) piece in one pass (sharding.quantize_range): the
    kernel's codes of runs equal the native kernel's (tests/test_native.py holds those
    to the whole matrix), a code an element or two a byte, each run's bytes from its own."""
    spec = make_spec(torch.float32, fewbit.format(name), RoundMode.SRC, True, 3, None)
    key = Key.from_seed(9)
    for case in RUNS:
        x, piece, (offset, runs, stride) = runs_of_a_matrix(torch.float32, *case)
        if case[0] >= 100 or packed and (offset | stride | piece.shape[1]) & 1:
            continue
        outs = []
        for run, k in ((gpu.quantize_into, key), (native.quantize_into, stream_words(spec, key))):
            out = torch.empty(piece.numel() // 2 if packed else piece.numel(), dtype=torch.uint8)
            assert run(piece.contiguous(), spec, k, None, out, packed, offset, runs, stride) in (True, -1)
            outs.append(out)
        assert torch.equal(*outs), case


@pytest.mark.parametrize("mode", ["src", "srff", "sr", "sr_fraction"])
def test_a_key_in_host_memory_draws_the_same_bits(mode):
    """A key the host holds (an int seed's) travels as the launch's words k0, k1 (and the
    selection stream's s0, s1), not in a tensor: the same bits as a key tensor's, at any
    offset, with words small, of 1, and with the top bit set. (x reaches into a second row
    of Threefry blocks; the interpreter takes seconds a call for sr_fraction's two streams,
    whose words travel as the others': it takes the top bit's seed only.)"""
    x = torch.randn(512 * 2 * 10 + 77, generator=torch.Generator().manual_seed(4)) * 4
    kw = {"sat": True, **{k: v for k, v in MODE_ARGS[mode].items() if k != "seed"}}
    seeds = (5, (1 << 32) + 1, (1 << 63) + (1 << 31))
    for seed in seeds[-1:] if mode == "sr_fraction" else seeds:
        got = kernel(x, "binary8p4", mode, host=True, seed=seed, **kw)
        assert_bitwise_equal(got, eager(x, "binary8p4", mode, seed=seed, **kw), x, f"{mode} seed {seed}")
        got = kernel(x, "binary8p4", mode, offset=333, host=True, seed=seed, **kw)
        expected = kernel(x, "binary8p4", mode, offset=333, seed=seed, **kw)
        assert_bitwise_equal(got, expected, x, f"{mode} seed {seed} offset 333")


def encoded(x, fmt, packed=False):
    """The kernel's codes, or the message of the error fewbit.encode raises with them."""
    fmt = fewbit.format(fmt)
    codes = torch.empty(x.shape[:-1] + (x.shape[-1] // 2 if packed else x.shape[-1],),
                        dtype=fewbit.codec.code_dtype(fmt))  # fmt: skip
    bad = gpu.encode_into(x.reshape(-1), fmt, codes.view(-1), packed)
    return codes if bad < 0 else f"{x.reshape(-1)[bad].item()!r} is not a value of {fmt.name}"


def encode_as_torch(x, fmt, packed):
    """The torch path's codes, or the first part of its error message."""
    with configure(compile=False):
        try:
            return fewbit.encode(x, fmt, packed=packed)
        except ValueError as err:
            return str(err).split(";")[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_same_codes_and_errors_as_torch(dtype):
    """Every value of each format (both zeros, Inf and NaN where it has them) gives the
    torch path's code; with a value beyond the range, off the grid, or a NaN, the same
    codes or the same error, naming the first such element."""
    refused = 0
    for name in FORMATS:
        fmt = fewbit.format(name)
        if not dtype_format(dtype).contains(fmt):
            continue
        codes = torch.arange(1 << fmt.k, dtype=torch.int32).to(fewbit.codec.code_dtype(fmt))
        values = fewbit.decode(codes, fmt).to(dtype)
        packed = fmt.k <= 4
        expected = encode_as_torch(values, fmt, packed)
        assert not isinstance(expected, str), expected
        assert torch.equal(encoded(values, fmt, packed), expected), name
        for odd in (float(fmt.max) * 1.5, float("nan"), float(values[values > 0].min()) * 1.5):
            x = torch.cat([values, torch.tensor([odd, 0.0], dtype=dtype)])
            expected, got = encode_as_torch(x, fmt, packed), encoded(x, fmt, packed)
            if isinstance(expected, str):
                assert got == expected, name
                refused += 1
            else:
                assert torch.equal(got, expected), name
            for pack in {packed, False}:  # unchecked, each element's code is still K bits
                codes = torch.empty(x.numel() // 2 if pack else x.numel(), dtype=fewbit.codec.code_dtype(fmt))
                gpu.encode_into(x, fmt, codes, pack, check=False)
                assert int(_element_codes(codes, pack).max()) < 2**fmt.k, (name, pack)
    assert refused >= 20


def test_encode_of_a_format_of_large_values():
    """2^(-126 - emin), the factor from a value to its code, is below float32's smallest
    for emin > 23: it became 0, and every code 0."""
    codes, values = large_values()
    assert torch.equal(encoded(values, LARGE_VALUES), codes)
    spec = make_spec(torch.float32, LARGE_VALUES, RoundMode.RNE, False, None, None)
    out = torch.empty_like(codes)
    assert gpu.quantize_into(values, spec, None, None, out, False)  # fewbit.quantize's path
    assert torch.equal(out, codes)


@pytest.mark.parametrize("name", ["binary8p4", "ocp_e2m1"])
def test_encode_across_blocks_and_programs(name, monkeypatch):
    """A long tensor, in programs of several blocks (as from _ENCODE_MANY codes on): every
    code where it belongs, and the first element that is no value reported wherever the
    bad ones lie (a program's later block, a later program, two in one program)."""
    monkeypatch.setattr(gpu, "_ENCODE_MANY", 0)
    fmt = fewbit.format(name)
    packed = fmt.k <= 4
    per_program = gpu._ENCODE_BLOCK * gpu._ENCODE_BLOCKS * (2 if packed else 1)
    codes = torch.randint(0, 1 << fmt.k, (3 * per_program + 100,), generator=torch.Generator().manual_seed(7))
    values = fewbit.decode(codes.to(fewbit.codec.code_dtype(fmt)), fmt)
    values = torch.where(torch.isnan(values), 0.0, values)  # NaN is a value here or not, elsewhere
    assert torch.equal(encoded(values, fmt, packed), encode_as_torch(values, fmt, packed))
    odd = float(fmt.max) * 1.5
    for places in ([per_program + 5 * gpu._ENCODE_BLOCK + 3], [2 * per_program + 1, per_program + 7],
                   [3 * per_program + 99], [per_program - 1, 2 * per_program]):  # fmt: skip
        x = values.clone()
        x[places] = odd
        out = torch.empty(x.numel() // 2 if packed else x.numel(), dtype=fewbit.codec.code_dtype(fmt))
        assert gpu.encode_into(x, fmt, out, packed) == min(places), places


@pytest.mark.parametrize("name", ["ocp_e4m3", "ocp_e2m1", "binary16"])
def test_unchecked_encode_same_codes(name):
    """Without its check (CHECK False: nothing read back) the kernel writes the codes of
    values as the checked call does, and an element that is no value leaves the codes
    beside it as they are, in a packed pair too."""
    fmt = fewbit.format(name)
    packed = fmt.k <= 4
    values = fewbit.decode(torch.arange(2**fmt.k).to(fewbit.codec.code_dtype(fmt)), fmt)
    values = values[~torch.isnan(values)][: 2 ** fmt.k // 2 * 2]
    small = values[values > 0].min()
    odd = torch.tensor([float(fmt.max) * 1.5, float("nan"), 1e30, -1e-30])
    beside = torch.stack([odd, torch.full_like(odd, small), torch.full_like(odd, small), odd], -1).flatten()
    for x in (values, beside):
        out = torch.full((x.numel() // 2 if packed else x.numel(),), 0x55, dtype=fewbit.codec.code_dtype(fmt))
        assert gpu.encode_into(x, fmt, out, packed, check=False) == -1
        keep = ~torch.isnan(x) & (x.abs() <= float(fmt.max)) & (x.abs() >= float(small))
        want = fewbit.encode(torch.where(keep, x, small), fmt, packed=packed)
        assert torch.equal(_element_codes(out, packed)[keep], _element_codes(want, packed)[keep]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rounded_codes_are_the_native_kernels(dtype):
    """quantize's launch (CODES: the results' codes, packed where K <= 4): the CPU's codes
    of every 16th bfloat16 pattern (Inf and NaN among them), for the formats with NaN
    (binary4p2's packed), in the float-adder (its codes in one go where beyond has a code
    of its own: _magic_code), classical-SR and general paths, with and without sat, with
    drawn (key tensor and host words) and given bits, in a length that ends inside a row."""
    x = every_bfloat16(dtype)[::16][:4094]
    checked = 0
    for name in [*FORMATS, "binary4p2"]:
        fmt = fewbit.format(name)
        if not fmt.has_nans or fmt.k > 16 or not dtype_format(dtype).contains(fmt):
            continue
        packed = fmt.k <= 4
        for mode, sat in itertools.product(("rne", "src", "sr", "srff", "rtz"), (False, True)):
            kw = MODE_ARGS[mode]
            spec = make_spec(dtype, fmt, RoundMode(mode), sat, kw.get("bits"), None)
            # Drawn bits: the key in a tensor without sat, the launch's words with it.
            keys = [None] if spec.bits is None else [Key.from_seed(kw["seed"]) if sat else key_of(kw["seed"])]
            for key in keys:
                out = torch.full((x.numel() // 2 if packed else x.numel(),), 0x55,
                                 dtype=fewbit.codec.code_dtype(fmt))  # fmt: skip
                assert gpu.quantize_into(x, spec, key, None, out, packed)
                expected = fewbit.quantize(x, fmt, mode, sat=sat, packed=packed, **kw)
                assert torch.equal(out, expected), f"{name} {mode} sat={sat} {type(key).__name__}"
                checked += 1
    rb = torch.randint(0, 8, x.shape, generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    spec = make_spec(dtype, fewbit.format("ocp_e4m3"), RoundMode.SRC, True, 3, None)
    out = torch.empty(x.numel(), dtype=torch.uint8)
    assert gpu.quantize_into(x, spec, None, rb, out, False)
    assert torch.equal(out, fewbit.quantize(x, "ocp_e4m3", "src", sat=True, bits=3, random_bits=rb))
    assert checked >= 12


def foreach_inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    """An optimizer's weights, as many programs' worth as one: every bfloat16 pattern with
    random low bits, and ties of bfloat16 (low half 0x8000), in tensors whose sizes are
    multiples of 16 (one a few programs long, one empty, one shorter than a row)."""
    x = every_bfloat16(torch.float32)
    ties = (x.view(torch.int32) & -(1 << 16) | (1 << 15)).view(torch.float32)[1::4]
    x = torch.cat((x[::2], ties[torch.isfinite(ties)]))[: 48_000].to(dtype)
    return [x[:40_000].view(-1, 80).clone(), x[:0].clone(), x[40_000:40_048].clone(), x[40_048:].clone()]


@pytest.mark.parametrize("dtype, via, mode", [
    *[(torch.float32, torch.bfloat16, mode) for mode in ("rne", "src", "srf", "sr", "sr_fraction")],
    (torch.float32, torch.float16, "rne"), (torch.float32, torch.float16, "src"),
    (torch.float32, torch.float32, "src"), (torch.bfloat16, torch.bfloat16, "src"),
    (torch.bfloat16, torch.float32, "src"),
])  # fmt: skip
def test_foreach_same_bits_as_each_round(dtype, via, mode):
    """The write-back's one launch for a list: tensor j as fewbit.round of ``t.to(via)``
    with the key fold_in(key, step, indices[j]), which the kernel derives; in place. (A
    step above 2**32: both of its words count.)"""
    kw = {k: v for k, v in MODE_ARGS[mode].items() if k != "seed"}
    spec = make_spec(via, fewbit.format("binary8p4"), RoundMode(mode), True, kw.get("bits"),
                     kw.get("fraction"))  # fmt: skip
    key, step, indices = Key.from_seed(9), 5 << 32 | 17, [3, 0, 7, 12]
    tensors = foreach_inputs(dtype)
    seeds = [fold_in(key, step, i) if spec.bits is not None else None for i in indices]
    expected = [eager(t.to(via), "binary8p4", mode, sat=True, seed=s, **kw).to(dtype)
                for t, s in zip(tensors, seeds, strict=True)]  # fmt: skip
    inputs, versions = [t.clone() for t in tensors], [t._version for t in tensors]
    assert gpu.round_foreach_(tensors, spec, key if spec.bits is not None else None, step, indices, via)
    assert all(t._version > v for t, v in zip(tensors, versions, strict=True))  # marked as written
    for j, (got, want, x) in enumerate(zip(tensors, expected, inputs, strict=True)):
        assert_bitwise_equal(got.view(-1), want.view(-1), x.view(-1), f"tensor {j}")


def test_foreach_of_more_tensors_than_a_launch_takes():
    """Lists longer than a launch's table go in launches of their own, each tensor still
    with its own key and stream."""
    spec = make_spec(torch.float32, fewbit.format("binary8p4"), RoundMode.SRC, True, 3, None)
    gen = torch.Generator().manual_seed(5)
    count = 2 * gpu._FOREACH_TENSORS + 3
    tensors = [torch.randn(16 * (1 + i % 5), generator=gen) * 4 for i in range(count)]
    key, indices = Key.from_seed(2), [count - i for i in range(count)]
    expected = [eager(t, "binary8p4", "src", sat=True, bits=3, seed=fold_in(key, 4, i))
                for t, i in zip(tensors, indices, strict=True)]  # fmt: skip
    assert gpu.round_foreach_(tensors, spec, key, 4, indices, torch.float32)
    for j, (got, want) in enumerate(zip(tensors, expected, strict=True)):
        assert_bitwise_equal(got, want, got, f"tensor {j}")


def test_foreach_takes_steps_below_2_63_and_leaves_the_rest():
    """The step travels as the launch's int64 offset: up to 2**63 - 1 the kernel folds it
    in (both words), and a step from 2**63 (fold_in takes 64 bits) is left to the other
    paths: False, nothing written. (Triton's interpreter holds a step in [2**31, 2**32) as
    uint32 data under an int64 type, whose ``>> 32`` numpy returned whole: other bits.)"""
    spec = make_spec(torch.float32, fewbit.format("binary8p4"), RoundMode.SRC, True, 3, None)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3)) * 3
    key = Key.from_seed(4)
    for step in ((1 << 63) - 1, (1 << 40) + 3, (1 << 31) + 1, (1 << 32) - 1, 5):
        got, want = x.clone(), eager(x, "binary8p4", "src", sat=True, bits=3, seed=fold_in(key, step, 2))
        assert gpu.round_foreach_([got], spec, key, step, [2], torch.float32)
        assert_bitwise_equal(got, want, x, f"step {step}")
    for step in (1 << 63, (1 << 64) - 1):
        got = x.clone()
        assert not gpu.round_foreach_([got], spec, key, step, [2], torch.float32)
        assert torch.equal(got, x)


def test_foreach_leaves_what_it_does_not_take():
    """A size or an address off a multiple of 16 (the kernel's vector loads), a strided
    tensor, or mixed dtypes: False, nothing written (the caller's other paths take it)."""
    spec = make_spec(torch.float32, fewbit.format("binary8p4"), RoundMode.SRC, True, 3, None)
    whole = torch.randn(4096) * 3
    for bad in ([whole[:4096 - 8]], [whole[1:4081]], [whole.view(64, 64).t()],
                [whole[:2048], whole[2048:].bfloat16()]):  # fmt: skip
        before = [t.clone() for t in bad]
        assert not gpu.round_foreach_(bad, spec, Key.from_seed(1), 0, range(len(bad)), torch.float32)
        assert all(torch.equal(t, b) for t, b in zip(bad, before, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_same_values_as_the_native_lookup(dtype):
    """decode_kernel: every code of each format the dtype holds (uint8, int16 patterns,
    packed pairs where K <= 4) gives the native lookup's value bits, NaNs included, over
    several programs; unchecked, the same."""
    gen = torch.Generator().manual_seed(3)
    for name in ("binary8p4", "ocp_e4m3", "ocp_e5m2", "ocp_e2m1", "p3109_k8p3ue", "binary16", "bfloat16"):
        fmt = fewbit.format(name)
        if not dtype_format(dtype).contains(fmt):
            continue
        every = torch.arange(1 << fmt.k, dtype=torch.int32)
        codes = torch.cat([every, torch.randint(0, 1 << fmt.k, (3 * gpu._DECODE_BLOCK + 48,), generator=gen)])
        codes = codes.to(fewbit.codec.code_dtype(fmt))
        for packed in (False, True) if fmt.k <= 4 else (False,):
            stored = fewbit.codec.pack_pairs(codes) if packed else codes
            want = fewbit.decode(stored, fmt, dtype, packed=packed)  # the native lookup
            table = fewbit.codec._table(fmt, dtype, codes.device)
            for check in (True, False):
                out = torch.empty_like(want)
                assert gpu.decode_into(stored, fmt.k, table, out, packed, check) == -1
                assert_bitwise_equal(out, want, want, f"{name} packed={packed} check={check}")


def test_decode_reports_the_first_code_beyond_the_format():
    """uint8 codes of a 4-bit format, and int16 patterns of an 8-bit one (2^K, or 0xFFFF as
    the int16 -1): a code at or above 2^K anywhere (a program's start, a later program,
    two programs, two in one program) is reported at the first place, as the native
    lookup reports it."""
    block = gpu._DECODE_BLOCK
    for name, dtype, beyond in (("ocp_e2m1", torch.uint8, 16), ("binary8p4", torch.int16, 256),
                                ("binary8p4", torch.int16, -1)):  # fmt: skip
        fmt = fewbit.format(name)
        codes = torch.randint(0, 1 << fmt.k, (3 * block + 5,), generator=torch.Generator().manual_seed(4))
        table = fewbit.codec._table(fmt, torch.float32, codes.device)
        for places in ([0], [block + 7], [2 * block + 1, block + 9], [block + 700, block + 9], [3 * block]):
            bad = codes.clone()
            bad[places] = beyond
            bad = bad.to(dtype)
            assert native.decode_into(bad, fmt.k, table, torch.empty(bad.numel()), False) == min(places)
            assert gpu.decode_into(bad, fmt.k, table, torch.empty(bad.numel()), False, True) == min(places)


def block_kernel(x, name, mode, *, codes, rule=None, sat=True, bits=None, fraction=None, seed=None,
                 random_bits=None, host=True):  # fmt: skip
    """gpu.block_into on CPU tensors, as fewbit.block takes a call along the last axis: the
    values, or the element codes and scale codes (shaped as BlockTensor's)."""
    spec = block_ops._spec(x.dtype, name, mode, sat, bits, fraction, rule)
    bfmt = spec.bfmt
    key = None if seed is None else Key.from_seed(seed) if host else key_of(seed)
    kw = {"block_size": bfmt.block_size, "rule": spec.rule, "tensor_scale": block_ops._tensor_scale(x, spec)}
    if codes:
        out, scales = block_ops._empty_codes(x, spec, x.dim() - 1)
        assert gpu.block_into(x, spec.spec, key, random_bits, out, scales, packed=bfmt.packed, **kw)
        return out, scales
    out = torch.empty_like(x)
    assert gpu.block_into(x, spec.spec, key, random_bits, out, None, **kw)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp4", "nvfp4"])
def test_blocks_from_any_block_of_the_stream_take_their_places_bits(name, dtype):
    """A piece of whole blocks from any block of the stream, or runs of them (values only:
    sharding.round_range's), gives the native kernel's values, codes and scales for it
    (tests/test_native.py holds those to the call on the whole tensor): lanes before the
    piece's first in its first row are zero blocks, not stored."""
    from fewbit.block import check_args

    x = (torch.randn(5 * 512 + 128, generator=torch.Generator().manual_seed(9)) * 3).to(dtype)
    bfmt = fewbit.block.format(name)
    ts = torch.tensor(0.75)
    for mode, bits in [("rne", None), ("src", 3)]:
        spec = check_args(dtype, bfmt, mode, True, bits, None)
        key = None if bits is None else Key(7, 8)
        words = None if key is None else stream_words(spec.spec, key)
        call = {"block_size": bfmt.block_size, "rule": spec.rule, "packed": bfmt.packed}
        for piece in BLOCK_PIECES:
            at = dict(zip(("offset", "runs", "stride"), piece[:2] + piece[3:], strict=True))
            t = x[runs_index(*piece)]
            for codes in (False, True) if piece[1] == 1 else (False,):
                outs = []
                for run in (gpu.block_into, native.block_into):
                    out = torch.empty(t.numel() // 2 if codes and bfmt.packed else t.numel(),
                                      dtype=torch.uint8 if codes else dtype)  # fmt: skip
                    scales = torch.empty(t.numel() // bfmt.block_size, dtype=torch.uint8) if codes else None
                    gpu_call = run is gpu.block_into
                    done = run(t, spec.spec, key if gpu_call else words, None, out, scales,
                               tensor_scale=ts if gpu_call else float(ts), **at, **call)  # fmt: skip
                    assert done is True if gpu_call else done == -1
                    outs.append((out, scales))
                (got, got_scales), (expected, expected_scales) = outs
                where = f"{mode} codes={codes} piece {piece}"
                assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), where
                assert got_scales is None or torch.equal(got_scales, expected_scales), where


def block_inputs(dtype, rows=8):
    """Rows of 256 random values across 60 binades, with blocks that hold NaN, Inf, zeros of
    both signs and float32 subnormals, a block of +0 and one of -0, one of subnormals, and one whose
    small values fall below float32's normal range once scaled."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(rows, 256, generator=gen) * torch.logspace(-30, 30, 256)
    x[0, :8] = torch.tensor([float("nan"), 1.0, float("inf"), -2.0, 0.0, -0.0, 1e-40, -3e-39])
    x[1, :32] = 0.0
    x[1, 32:64] = -0.0
    x[2, 16:24] = torch.tensor([-1e-45, 3e-44, 0.0, -0.0, 1e-42, -2e-41, 5e-39, 1e-38])
    x[3, 32:40] = torch.tensor([1e30, 1e-40, -1e-40, 1e-30, -3e-38, 5e-39, -1e-45, 2e-44])  # x / S underflows
    x[3, 64:96] = torch.logspace(-45, -38.5, 32) * (-1) ** torch.arange(32)  # a block of subnormals
    return x.to(dtype)


def assert_block_same_as_torch(x, name, mode, context="", **kw):
    """Codes, scale codes and values of the kernel against the eager torch kernels'."""
    with configure(compile=False):
        stored, values = fewbit.block.quantize(x, name, mode, **kw), fewbit.block.round(x, name, mode, **kw)
    codes, scales = block_kernel(x, name, mode, codes=True, **kw)
    context = f"{name} {mode} {x.dtype} {kw} {context}"
    assert torch.equal(scales, stored.scales), context
    assert torch.equal(codes, stored.codes), context
    assert_bitwise_equal(block_kernel(x, name, mode, codes=False, **kw).view(-1), values.view(-1), x.view(-1),
                         context)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode, kw", [("rne", {}), ("src", {"bits": 3, "seed": 9}), ("sr", {"seed": 4}),
                                      ("rup", {}), ("srff", {"bits": 2, "seed": 1})])  # fmt: skip
def test_block_formats_same_bits_as_torch(dtype, mode, kw):
    """round_kernel's blocks (BLOCK): MX formats with float and integer elements, NVFP4 (an
    E4M3 scale times the tensor's) and HBFP, in each input dtype."""
    x = block_inputs(dtype)
    for name in ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "mxint8", "nvfp4", "hbfp6"):
        assert_block_same_as_torch(x, name, mode, **kw)


@pytest.mark.parametrize("name, rules", [("mxfp8_e4m3", ["floor", "ceil", "rceil", "even"]),
                                         ("mxfp4", ["ceil", "rceil", "even"]), ("mxint8", ["even"]),
                                         ("nvfp4", ["nearest", "up"])])
def test_block_scale_rules_same_as_torch(name, rules):
    """Every scale rule, on blocks whose largest magnitudes fall on both sides of each
    rule's bound (a block's largest value m 2^E with m's fraction spread over [1, 2))."""
    gen = torch.Generator().manual_seed(2)
    x = torch.rand(32, 512, generator=gen) - 0.5
    near_one = torch.where(torch.rand(32, 16, generator=gen) < 0.5, 1, 1e-3)  # (m just above 1, for ceil)
    top = 1 + torch.rand(32, 16, generator=gen) * near_one
    x.view(32, 16, 32)[:, :, 0] = -top * 2.0 ** torch.randint(-20, 20, (32, 16), generator=gen)
    for rule in rules:
        assert_block_same_as_torch(x, name, "rne", rule=rule)
        assert_block_same_as_torch(x.bfloat16(), name, "src", rule=rule, bits=4, seed=3)


def test_rule_up_takes_the_next_block_scale_where_s_rounds_short():
    """Blocks where S = scale * ts rounds below amax / M (tests/test_block.py builds them):
    the kernel takes the next E4M3 scale there, as the torch kernels do."""
    bfmt, x = blocks_whose_s_rounds_short()
    for mode in ("rne", "rup"):
        assert_block_same_as_torch(x, block_ops.format_name(bfmt), mode)


def test_block_bits_from_every_source():
    """Given bits, a key tensor read by the kernel and a key the launch takes draw what the
    torch kernels draw, the selection stream of sr_fraction too; blocks of 8 and of 512 (a
    whole row); without sat, into formats with NaN (e4m3) and with Inf (e5m2)."""
    x = block_inputs(torch.float32, rows=4)
    given = torch.randint(0, 1 << 5, x.shape, dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    assert_block_same_as_torch(x, "mxfp8_e4m3", "src", bits=5, random_bits=given)
    assert_block_same_as_torch(x, "mxfp8_e4m3", "sr_fraction", bits=4, fraction=0.5, seed=3)  # two streams
    with configure(compile=False):
        want = fewbit.block.quantize(x, "mxfp4", "src", bits=3, seed=7)
    for host in (True, False):  # a Key's words with the launch, or a key tensor the kernel reads
        codes, _ = block_kernel(x, "mxfp4", "src", codes=True, bits=3, seed=7, host=host)
        assert torch.equal(codes, want.codes), f"host={host}"
    for name in ("bfp4_b8", "bfp8_b512"):
        assert_block_same_as_torch(x.view(2, 512), name, "src", bits=3, seed=5)
    for name in ("mxfp8_e4m3", "mxfp8_e5m2"):
        assert_block_same_as_torch(x * 1e3, name, "src", bits=3, seed=5, sat=False)


def test_block_calls_reach_the_kernel(monkeypatch):
    """fewbit.block's ops send a call along the last axis (its length a multiple of B) to
    round_kernel where gpu.block_applies, with or without out=, and the rest to the torch
    kernels: a CPU tensor here stands for a GPU's, the native kernel out of the way."""
    launched = []

    def block_into(*args, **kw):
        launched.append(kw["block_size"])
        return real(*args, **kw)

    real = gpu.block_into
    monkeypatch.setattr(gpu, "block_into", block_into)
    monkeypatch.setattr(gpu, "_enabled", lambda t: current().compile and current().native)
    monkeypatch.setattr(native, "block_applies", lambda *args: False)
    x = block_inputs(torch.bfloat16, rows=4)
    for name in ("mxfp4", "nvfp4"):
        with configure(compile=False):
            want = fewbit.block.quantize(x, name, "src", bits=3, seed=2)
            want_values = fewbit.block.round(x, name)
        assert launched == []
        stored = fewbit.block.quantize(x, name, "src", bits=3, seed=2)
        assert torch.equal(stored.codes, want.codes) and torch.equal(stored.scales, want.scales)
        assert (stored.tensor_scale is None) == (want.tensor_scale is None)
        assert want.tensor_scale is None or torch.equal(stored.tensor_scale, want.tensor_scale)
        stored.codes.zero_()
        fewbit.block.quantize(x, name, "src", bits=3, seed=2, out=stored)
        assert torch.equal(stored.codes, want.codes)
        out = torch.empty_like(x)
        assert fewbit.block.round(x, name, out=out) is out
        assert_bitwise_equal(out, want_values, x, name)
        size = fewbit.block.format(name).block_size
        assert launched == [size] * 3
        launched.clear()
        fewbit.block.round(x, name, axis=0)  # blocks across rows: the torch kernels
        assert launched == []
    with pytest.raises(ValueError, match="no Inf or NaN"):  # e2m1 beyond 6 without sat: the torch kernels
        fewbit.block.round(x, "mxfp4", sat=False)
    assert launched == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_amax_is_torchs(dtype, monkeypatch):
    """finite_amax_kernel: x's largest finite magnitude as torch finds it (NVFP4's tensor
    scale), wherever it lies (a negative value, a program's later block, the last element
    of a partial block), past NaN, Inf and -Inf; 0 where nothing is finite or x is empty;
    in programs of one block and of several."""
    gen = torch.Generator().manual_seed(9)
    for many in (1 << 62, 0):  # _ENCODE_MANY: a block a program, then BLOCKS a program
        monkeypatch.setattr(gpu, "_ENCODE_MANY", many)
        n = 3 * gpu._AMAX_BLOCK * gpu._ENCODE_BLOCKS + 37
        x = torch.randn(n, generator=gen) * torch.logspace(-40, 0, n)
        x[[3, 5000, n - 1]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
        for place in (gpu._AMAX_BLOCK * gpu._ENCODE_BLOCKS + 5 * gpu._AMAX_BLOCK + 3, n - 2):
            y = x.clone()
            y[place] = -3e4
            y = y.to(dtype)
            want = torch.where(torch.isfinite(y), y, 0).abs().amax().float()
            got = gpu.finite_amax(y)
            assert got.dtype == torch.float32 and got.shape == () and got.item() == want.item()
            assert want.item() == -y[place].float().item()  # (the planted value is the largest)
        inf = float("inf")
        for none in (torch.full((20,), float("nan")), torch.tensor([inf, -inf]), torch.empty(0)):
            assert gpu.finite_amax(none.to(dtype)).item() == 0.0
        subnormal = torch.tensor([1e-45, -3e-44, 0.0]).to(dtype)
        assert gpu.finite_amax(subnormal).item() == subnormal.abs().max().float().item()


def test_e4m3_scales_without_a_tensor_scale_run_in_the_kernel():
    """A block format with E4M3 scales and no per-tensor scale (NVFP4's scales, alone): the
    kernel took the tensor scale's pointer, None, failed to launch and left every such
    call to the torch ops, with a warning that it did not compile."""
    from fewbit.block.formats import BlockFormat

    fmt = BlockFormat("e2m1_e4m3_16", "ocp_e2m1", 16, "ocp_e4m3", rule="nearest", tensor_scale=False)
    x = block_inputs(torch.float32)
    for mode, kw in (("rne", {}), ("src", {"bits": 3, "seed": 5})):
        got = block_kernel(x, repr(fmt), mode, codes=False, **kw)  # (the ops name a format by its repr)
        assert_bitwise_equal(got, fewbit.block.round(x, fmt, mode, **kw), x, mode)
