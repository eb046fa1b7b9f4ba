"""fewbit.quantize: the codes of rounded values in one call. It must give
``encode(round(x, ...), fmt, packed)`` bit for bit, with the same errors, on the native
kernel (one pass) and on the torch path, and gfloat's ``encode_ndarray`` of its own
rounding; and compose with torch.compile, torch.export and autograd as the other ops."""

from __future__ import annotations

import gfloat
import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

import fewbit
from conftest import gfloat_format, gfloat_mode
from fewbit.config import configure
from fewbit.rounding import dtype_format
from test_native import FORMATS, MODE_ARGS, every_bfloat16


def outcome(fn):
    """fn's result, or the message of the ValueError it raised."""
    try:
        return fn()
    except ValueError as err:
        return str(err)


def check_same(x: torch.Tensor, name: str, mode: str, sat: bool, packed: bool, **kw) -> None:
    """quantize against encode(round(...)): the same codes, or the same error."""
    got = outcome(lambda: fewbit.quantize(x, name, mode, sat=sat, packed=packed, **kw))
    expected = outcome(lambda: fewbit.encode(fewbit.round(x, name, mode, sat=sat, **kw), name, packed=packed))
    context = f"{name} {mode} {x.dtype} sat={sat} packed={packed}"
    if isinstance(expected, str) or isinstance(got, str):
        assert got == expected, context
    else:
        assert got.dtype == expected.dtype and torch.equal(got, expected), context


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_bfloat16_pattern_in_every_mode_gives_encode_of_round(dtype):
    """The native kernel's one pass (rows of 16-bit lanes included), every mode and format
    family; formats without NaN refuse a NaN input as round does."""
    x = every_bfloat16(dtype)
    finite = torch.nan_to_num(x, nan=0.0)
    checked = 0
    for name in FORMATS:
        fmt = fewbit.format(name)
        if not dtype_format(dtype).contains(fmt) or fmt.k > 16:
            continue
        for mode, kw in MODE_ARGS.items():
            for sat in (False, True):
                for packed in (False, True) if fmt.k <= 4 else (False,):
                    check_same(x if fmt.has_nans else finite, name, mode, sat, packed, **kw)
                    checked += 1
        check_same(x, name, "src", False, False, bits=3, seed=1)  # NaN in, every format
    assert checked >= 150


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [8.0, 0.01])
def test_16_bit_rows_and_a_row_left_over(dtype, scale):
    """16-bit inputs in data scaled to the format (whole groups without a value below
    2^emin) and not (most of them below it), a NaN in one row, and a last row that is not
    whole (the general way)."""
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(5 * 512 + 77, generator=gen) * scale).to(dtype)
    x[700] = float("nan")
    for name in ("binary8p4", "ocp_e4m3", "ocp_e5m2"):
        for mode in ("rne", "src", "sr"):
            check_same(x, name, mode, False, False, **MODE_ARGS[mode])


@pytest.mark.parametrize("name", ["binary8p4", "ocp_e4m3", "ocp_e2m1", "binary16"])
def test_the_torch_path_gives_the_same_codes(name):
    """Without the native kernel (compile=False), and for float64 inputs, which it does not
    take: round, then encode, as the op's fallback."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3000, generator=gen) * 6
    fmt = fewbit.format(name)
    native = fewbit.quantize(x, name, "src", bits=3, seed=9, sat=True)
    with configure(compile=False):
        for mode in ("rne", "src", "sr_fraction", "rtz"):
            check_same(x, name, mode, True, fmt.k <= 4, **MODE_ARGS[mode])
        assert torch.equal(fewbit.quantize(x, name, "src", bits=3, seed=9, sat=True), native)
    assert torch.equal(fewbit.quantize(x.double(), name, "src", bits=3, seed=9, sat=True), native)


@pytest.mark.parametrize("name", ["binary8p4", "ocp_e4m3", "ocp_e5m2", "ocp_e2m1", "p3109_k6p3sf"])
@pytest.mark.parametrize("mode", ["rne", "rtz", "srff", "srf", "src"])
def test_codes_are_gfloats_encoding_of_its_rounding(name, mode):
    """Every finite bfloat16 pattern as float32 (random bits below each), N = 3 given bits
    for the stochastic modes, saturating: gfloat's encode_ndarray of its round_ndarray."""
    x = every_bfloat16(torch.float32)
    x = x[torch.isfinite(x)]
    fi = gfloat_format(name)
    kw, g = {}, {}
    if mode.startswith("sr"):
        rb = torch.randint(0, 8, x.shape, generator=torch.Generator().manual_seed(4), dtype=torch.int32)
        kw, g = {"bits": 3, "random_bits": rb}, {"srbits": rb.numpy(), "srnumbits": 3}
    got = fewbit.quantize(x, name, mode, sat=True, **kw)
    with np.errstate(over="ignore"):
        rounded = gfloat.round_ndarray(fi, x.double().numpy(), gfloat_mode(mode), True, **g)
    expected = torch.from_numpy(np.asarray(gfloat.encode_ndarray(fi, rounded), dtype=np.int64))
    mismatched = torch.nonzero(got.to(torch.int64) != expected).flatten()
    assert len(mismatched) == 0, f"{len(mismatched)} codes differ, first at x={float(x[mismatched[0]])!r}"


def test_seeds_bits_and_shapes_as_round_takes_them():
    """A key tensor, a 0-d seed tensor and given bits draw what round draws; any shape and
    layout; packing along the last dimension; empty and 0-d tensors."""
    x = torch.randn(6, 10).t()  # not contiguous
    key = fewbit.random.key_of(5)
    for seed in (5, key, torch.tensor(5)):
        check_same(x, "binary8p4", "src", False, False, bits=3, seed=seed)
    check_same(x, "e2m1", "srf", True, True, bits=2, random_bits=torch.randint(0, 4, x.shape))
    assert fewbit.quantize(x, "e2m1", sat=True, packed=True).shape == (10, 3)
    assert fewbit.quantize(torch.empty(0, 4), "e4m3").shape == (0, 4)
    two = torch.tensor(2.0)
    assert fewbit.quantize(two, "e4m3").item() == fewbit.encode(two, "e4m3").item()
    assert fewbit.quantize(torch.ones(3), "binary16").dtype == torch.int16


def test_bad_arguments_fail_before_any_work():
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match="needs K <= 4"):
        fewbit.quantize(x, "e4m3", packed=True)
    with pytest.raises(ValueError, match="last dimension"):
        fewbit.quantize(torch.randn(3), "e2m1", packed=True)
    with pytest.raises(ValueError, match="K <= 16"):
        fewbit.quantize(x, "binary32")
    with pytest.raises(ValueError, match="either seed"):
        fewbit.quantize(x, "e4m3", "src", bits=3, seed=1, random_bits=torch.zeros(4, 6, dtype=torch.int32))
    with pytest.raises(ValueError, match="needs random bits"):
        fewbit.quantize(x, "e4m3", "src", bits=3)
    with pytest.raises(TypeError, match="float16, torch.bfloat16"):
        fewbit.quantize(torch.arange(4), "e4m3")
    with pytest.raises(ValueError, match="cannot hold"):
        fewbit.quantize(x.half(), "binary8p1")
    with pytest.raises(ValueError, match="no NaN to hold a NaN input"):
        fewbit.quantize(torch.tensor([1.0, float("nan")]), "e2m1")
    with pytest.raises(ValueError, match="beyond its range; use sat=True"):
        fewbit.quantize(torch.tensor([1.0, 7.0]), "e2m1", "rup")


def test_compiles_exports_and_takes_tensors_that_require_grad():
    """One opaque op under torch.compile(fullgraph=True), no recompile for a new seed
    tensor; torch.export; codes carry no gradient, and an input that requires grad is no
    error."""
    x = torch.randn(64, 32, requires_grad=True)
    compiled = torch.compile(lambda x, s: fewbit.quantize(x, "e2m1", "src", bits=3, seed=s, sat=True,
                                                          packed=True), fullgraph=True)  # fmt: skip
    torch._dynamo.reset()
    counters.clear()
    for seed in range(3):
        got = compiled(x, torch.tensor(seed))
        assert torch.equal(got, fewbit.quantize(x, "e2m1", "src", bits=3, seed=seed, sat=True, packed=True))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert not got.requires_grad and got.dtype == torch.uint8

    class Store(torch.nn.Module):
        def forward(self, x):
            return fewbit.quantize(x, "binary8p4", "rne")

    exported = torch.export.export(Store(), (torch.randn(8, 8),))
    y = torch.randn(8, 8)
    assert torch.equal(exported.module()(y), fewbit.quantize(y, "binary8p4"))
