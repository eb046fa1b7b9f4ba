"""encode/decode: exact round trips, torch float8 interop, packing, bad input."""

import itertools
import math

import numpy as np
import pytest
import torch

import fewbit
from fewbit.formats import names
from fewbit.rounding import dtype_format

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _small_formats():
    for name in names():
        fmt = fewbit.format(name)
        if fmt.k <= 16 and dtype_format(torch.float64).contains(fmt):
            yield fmt


def test_every_code_of_every_format_round_trips():
    checked = 0
    for fmt in _small_formats():
        codes = torch.arange(2**fmt.k)
        for dtype in DTYPES:
            if not dtype_format(dtype).contains(fmt):
                continue
            values = fewbit.decode(codes.to(fewbit.codec.code_dtype(fmt)), fmt, dtype)
            nan = torch.isnan(values)
            assert int(nan.sum()) == fmt.num_nans, fmt.name
            again = fewbit.encode(values, fmt).to(torch.int32) & 0xFFFF
            assert torch.equal(again[~nan], codes[~nan].to(torch.int32)), (fmt.name, dtype)
            if fmt.has_nans:
                assert bool((again[nan] == fmt.code_of_nan).all())
            checked += 1
    assert checked > 900


#: A hand-made format of large values: emin = 24, so 2^(-126 - emin), the native and GPU
#: kernels' factor from a value to its code, is below float32's smallest (values 2^21 ..).
LARGE_VALUES = fewbit.FloatFormat("large_e4m3", 8, 4, -23, has_nz=True, num_high_nans=1)


def large_values() -> tuple[torch.Tensor, torch.Tensor]:
    """LARGE_VALUES's codes but its NaNs', and their values."""
    codes = torch.arange(256).to(torch.uint8)
    codes = codes[~torch.isnan(fewbit.decode(codes, LARGE_VALUES))]
    return codes, fewbit.decode(codes, LARGE_VALUES)


def test_decode_refuses_a_dtype_that_is_no_float_dtype_in_its_own_words():
    """It answered "fewbit rounds tensors of ...", a message about rounding."""
    codes = fewbit.encode(torch.tensor([1.0]), "e4m3")
    for bad in (torch.int32, "float32", torch.complex64):
        with pytest.raises(TypeError, match="decode gives values in a float dtype"):
            fewbit.decode(codes, "e4m3", dtype=bad)
    with pytest.raises(ValueError, match="cannot hold every value of binary16"):
        fewbit.decode(codes, "binary16", dtype=torch.bfloat16)  # a float dtype, too narrow


@pytest.mark.parametrize("native", [True, False])
def test_every_code_of_a_format_of_large_values_round_trips(native):
    """The native kernel's factor underflowed to 0: every code came back 0 (and -0), with
    no error, and so did fewbit.quantize's."""
    codes, values = large_values()
    assert float(values[1]) == 2.0**21  # the smallest subnormal: 2^(emin - t)
    with fewbit.configure(native=native):
        assert torch.equal(fewbit.encode(values, LARGE_VALUES), codes)
        assert torch.equal(fewbit.quantize(values, LARGE_VALUES, "rne"), codes)


@pytest.mark.parametrize("fmt, dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_ocp_codes_are_torch_float8_bit_patterns(fmt, dtype):
    x = torch.randn(100_000) * 50
    x = fewbit.round(x, fmt, sat=True)
    assert torch.equal(fewbit.encode(x, fmt), x.to(dtype).view(torch.uint8))
    codes = torch.arange(256, dtype=torch.uint8)
    ours = fewbit.decode(codes, fmt)
    theirs = codes.view(dtype).float()
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
    finite = ~torch.isnan(ours)
    assert torch.equal(ours[finite].view(torch.int32), theirs[finite].view(torch.int32))


def test_code_dtypes():
    assert fewbit.encode(torch.tensor([1.0]), "binary8p4").dtype == torch.uint8
    assert fewbit.encode(torch.tensor([1.0]), "binary12p5").dtype == torch.int16
    assert fewbit.encode(torch.tensor([-2.0]), "bf16").item() == torch.tensor(
        [-2.0], dtype=torch.bfloat16).view(torch.int16).item()


@pytest.mark.parametrize("fmt", ["e2m1", "binary4p2", "p3109_k3p2uf"])
def test_packed_codes_share_bytes(fmt):
    codes = torch.randint(0, 2 ** fewbit.format(fmt).k, (6, 10), dtype=torch.uint8)
    values = fewbit.decode(codes, fmt)
    keep = ~torch.isnan(values).any(-1)
    values, codes = values[keep], codes[keep]
    packed = fewbit.encode(values, fmt, packed=True)
    assert packed.shape == (values.shape[0], 5) and packed.dtype == torch.uint8
    assert torch.equal(packed & 0xF, codes[:, 0::2]) and torch.equal(packed >> 4, codes[:, 1::2])
    assert torch.equal(fewbit.decode(packed, fmt, packed=True), values)


def test_bad_input():
    with pytest.raises(ValueError, match="not a value of binary8p4; round it first"):
        fewbit.encode(torch.tensor([0.3]), "binary8p4")
    with pytest.raises(ValueError, match="not a value"):
        fewbit.encode(torch.tensor([1000.0]), "binary8p4")
    with pytest.raises(ValueError, match="not a value"):
        fewbit.encode(torch.tensor([math.nan]), "e2m1")
    with pytest.raises(ValueError, match="not a value"):
        fewbit.encode(torch.tensor([-1.0]), "p3109_k8p4ue")
    with pytest.raises(ValueError, match="K <= 4"):
        fewbit.encode(torch.tensor([1.0, 2.0]), "e4m3", packed=True)
    with pytest.raises(ValueError, match="last dimension"):
        fewbit.encode(torch.tensor([1.0, 2.0, 3.0]), "e2m1", packed=True)
    with pytest.raises(ValueError, match="K <= 16"):
        fewbit.encode(torch.tensor([1.0]), "fp32")
    with pytest.raises(TypeError):
        fewbit.encode(torch.tensor([1]), "e4m3")
    with pytest.raises(ValueError, match="cannot hold"):
        fewbit.encode(torch.tensor([1.0], dtype=torch.float16), "bf16")
    with pytest.raises(ValueError, match=r"lie in \[0, 16\)"):
        fewbit.decode(torch.tensor([16], dtype=torch.uint8), "e2m1")
    with pytest.raises(TypeError, match="integer dtype"):
        fewbit.decode(torch.tensor([1.0]), "e4m3")
    with pytest.raises(ValueError, match="cannot hold"):
        fewbit.decode(torch.tensor([1], dtype=torch.uint8), "binary8p1", dtype=torch.float16)


def test_packed_is_a_bool():
    """packed went through bool(): "no" packed, None did not, while check=1 was refused."""
    x = torch.tensor([1.0, 2.0])
    codes = fewbit.encode(x, "e2m1")
    for call in (lambda: fewbit.encode(x, "e2m1", packed="no"),
                 lambda: fewbit.encode(x, "e2m1", packed=None),
                 lambda: fewbit.decode(codes, "e2m1", packed=2),
                 lambda: fewbit.quantize(x, "e2m1", packed="no")):  # fmt: skip
        with pytest.raises(TypeError, match="packed must be a bool"):
            call()


def test_flags_take_numpy_bools_as_sat_does():
    """packed and check take numpy's bool as fewbit.round's sat does; anything else that is
    no bool is refused, naming the parameter."""
    x = torch.tensor([1.0, -2.0, 0.5, 3.0])
    plain = fewbit.encode(x, "e2m1", packed=False)
    assert torch.equal(fewbit.encode(x, "e2m1", packed=np.bool_(False)), plain)
    assert torch.equal(fewbit.encode(x, "e2m1", packed=np.bool_(True), check=np.bool_(True)),
                       fewbit.encode(x, "e2m1", packed=True))
    assert torch.equal(fewbit.decode(plain, "e2m1", packed=np.bool_(False)), fewbit.decode(plain, "e2m1"))
    for value in (1, "yes", np.int64(0)):
        with pytest.raises(TypeError, match="^packed must be a bool, not "):
            fewbit.encode(x, "e2m1", packed=value)
    with pytest.raises(TypeError, match="not numpy.int64: "):
        fewbit.encode(x, "e2m1", check=np.int64(1))


def test_empty_and_scalar():
    assert fewbit.encode(torch.empty(0), "e4m3").shape == (0,)
    code = fewbit.encode(torch.tensor(1.0), "e4m3")
    assert code.shape == () and fewbit.decode(code, "e4m3").item() == 1.0


def _element_codes(codes: torch.Tensor, packed: bool) -> torch.Tensor:
    """Each element's code, from codes as encode gives them."""
    codes = codes.to(torch.int32) & 0xFFFF
    return torch.stack([codes & 0xF, codes >> 4], -1).flatten(-2) if packed else codes


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("name", ["binary8p4", "e4m3", "e2m1", "p3109_k8p4ue", "binary16"])
def test_unchecked_encode_keeps_each_elements_code_to_itself(name, native):
    """check=False: the codes of values as with the check; an element that is no value
    (beyond the range, far beyond, a NaN without NaN, between two values, negative and
    unsigned) raises nothing, gets a code of K bits (which decode takes: the native
    kernel's were wider, 255 in e2m1) and leaves its neighbours' codes as they are: in a
    packed pair, on either side of the byte."""
    fmt = fewbit.format(name)
    packed = fmt.k <= 4
    values = fewbit.decode(torch.arange(2**fmt.k).to(fewbit.codec.code_dtype(fmt)), fmt)
    values = values[~torch.isnan(values)][: 2 ** fmt.k // 2 * 2]  # (an even count, for pairs)
    small = values[values > 0].min()  # a code of few bits, which a wider one beside it would spoil
    odd = torch.tensor([float(fmt.max) * 1.5, math.nan, 0.3 * float(fmt.max), -float(fmt.max), 1e30, -1e-30])
    x = torch.stack([odd, torch.full_like(odd, small), torch.full_like(odd, small), odd], -1).flatten()
    still = x == small
    with fewbit.configure(native=native):
        want = fewbit.encode(values, fmt, packed=packed)
        assert torch.equal(fewbit.encode(values, fmt, packed=packed, check=False), want)
        with pytest.raises(ValueError, match="not a value"):
            fewbit.encode(x, fmt, packed=packed)
        for dtype, pack in itertools.product((torch.float32, torch.bfloat16, torch.float16), {packed, False}):
            if not dtype_format(dtype).contains(fmt):
                continue
            codes = fewbit.encode(x.to(dtype), fmt, packed=pack, check=False)
            got = _element_codes(codes, pack)
            assert torch.equal(got[still], _element_codes(fewbit.encode(x[still], fmt), False)), dtype
            assert int(got.max()) < 2**fmt.k, (dtype, pack)
            assert fewbit.decode(codes, fmt, packed=pack).shape == x.shape, (dtype, pack)
    with pytest.raises(TypeError, match="check must be a bool"):
        fewbit.encode(values, fmt, check=1)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("name, one, negative_zero", [
    ("binary8p4", 0x40, 0x00), ("binary8p3", 0x40, 0x00), ("binary6p3", 0x10, 0x00), ("binary4p2", 0x4, 0x00),
    ("ocp_e4m3", 0x38, 0x80),
])  # fmt: skip
def test_negative_zero_is_code_0_in_a_format_without_one(name, one, negative_zero, native):
    """-0.0 equals 0, a value of every format. In P3109 (no -0: the sign bit on 0 is the NaN
    code 0x80) it is code 0, checked or not; OCP E4M3 keeps its -0, 0x80. 1.0 is the bias
    2^(K-P-1) in the exponent field: 64, 64, 16, 4 (and E4M3's 0x38). The round trips start
    from codes, so -0.0 never reached the torch encoder, which gave P3109's NaN code."""
    x = torch.tensor([-0.0, 1.0])
    with fewbit.configure(native=native):
        for check in (True, False):
            codes = fewbit.encode(x, name, check=check)
            assert codes.tolist() == [negative_zero, one], check
            back = fewbit.decode(codes, name)
            assert back.tolist() == [0.0, 1.0] and back[0].signbit() == (negative_zero != 0)


@pytest.mark.parametrize("name, code_dtype, packed", [
    ("binary8p4", torch.uint8, False), ("p3109_k6p3sf", torch.uint8, False), ("e2m1", torch.uint8, True),
    ("binary4p2", torch.uint8, True), ("binary16", torch.int16, False), ("binary12p5", torch.int16, False),
])  # fmt: skip
def test_native_decode_is_the_torch_lookup(name, code_dtype, packed):
    """The native kernel's decode (a table lookup in chunks of 2^16 values, on two threads)
    gives the torch path's values in each dtype, and reports the first code that is no
    code of the format, wherever it lies; codes filling their dtype need no check."""
    from fewbit.config import configure
    from fewbit.rounding import native

    fmt = fewbit.format(name)
    gen = torch.Generator().manual_seed(3)
    n = 5 * (1 << 16) + 6  # a chunk left over
    codes = torch.randint(0, 1 << fmt.k, (n // 2 if packed else n,), generator=gen, dtype=torch.int32)
    if packed:
        codes = codes | (torch.randint(0, 1 << fmt.k, codes.shape, generator=gen, dtype=torch.int32) << 4)
    codes = codes.to(code_dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for dtype in DTYPES:
            if not dtype_format(dtype).contains(fmt):
                continue
            got = fewbit.decode(codes, fmt, dtype, packed=packed)
            with configure(compile=False):
                expected = fewbit.decode(codes, fmt, dtype, packed=packed)
            width = {8: torch.int64, 4: torch.int32, 2: torch.int16}[got.element_size()]
            assert torch.equal(got.view(width), expected.view(width)), dtype
        if packed or fmt.k == codes.element_size() * 8:
            return  # every number the codes' dtype holds is a code
        table = fewbit.codec._table(fmt, torch.float32, codes.device)
        for place in (3 * (1 << 16) + 5, n - 1, 7):
            bad = codes.clone()
            bad[place] = 1 << fmt.k
            bad[place + 1 :: 1000] = (1 << fmt.k) + 1  # later ones too
            assert native.decode_into(bad, fmt.k, table, torch.empty(n), packed) == place
            for compile in (True, False):
                with configure(compile=compile), pytest.raises(ValueError, match="lie in"):
                    fewbit.decode(bad, fmt)
    finally:
        torch.set_num_threads(threads)


def test_decode_refuses_codes_that_wrap_in_32_bits():
    """Codes wider than 32 bits are checked as they are: 2^32 + 5 is no code of an 8-bit
    format (as int32 it would be code 5), and a uint64 of 2^63 or more neither."""
    want = fewbit.decode(torch.tensor([5], dtype=torch.uint8), "binary8p4")
    assert torch.equal(fewbit.decode(torch.tensor([5]), "binary8p4"), want)
    bad = [torch.tensor([2**32 + 5]), torch.tensor([-(2**32) + 5]), torch.tensor([2**40]),
           torch.tensor([5, 2**32 + 5], dtype=torch.uint64), torch.tensor([2**63 + 5], dtype=torch.uint64)]
    for codes in bad:
        with pytest.raises(ValueError, match=r"codes of binary8p4 lie in \[0, 256\)"):
            fewbit.decode(codes, "binary8p4")
    with pytest.raises(ValueError, match=r"codes of binary16 lie in \[0, 65536\)"):
        fewbit.decode(torch.tensor([2**32 + 5]), "binary16")


@pytest.mark.parametrize("native", [True, False])
def test_encode_and_decode_of_strided_tensors_give_contiguous_results_as_compiled(native):
    """encode and decode of a transposed tensor give contiguous results, as their fake
    kernels say: a compiled caller lays out what follows by those (before: a crash on the
    strides under torch.compile)."""
    from fewbit.config import configure

    gen = torch.Generator().manual_seed(5)
    x = fewbit.round(torch.randn(6, 8, generator=gen, dtype=torch.float64), "ocp_e2m1", sat=True).t()
    codes = torch.randint(0, 1 << 4, (6, 8), generator=gen).t()  # int64, as torch.randint gives
    calls = [
        (lambda t: fewbit.encode(t, "ocp_e2m1"), x),
        (lambda t: fewbit.encode(t, "ocp_e2m1", packed=True), x.float()),
        (lambda t: fewbit.decode(t, "ocp_e2m1"), codes),
        (lambda t: fewbit.decode(t, "ocp_e2m1"), codes.to(torch.uint8)),
    ]
    with configure(native=native, compile=native):
        for i, (f, t) in enumerate(calls):
            want = f(t.contiguous())
            got = f(t)
            assert torch.equal(got, want) and got.is_contiguous(), i
            compiled = torch.compile(lambda t, f=f: f(t) + 1, fullgraph=True)
            assert torch.equal(compiled(t), want + 1), i


def test_pack_pairs_refuses_an_odd_last_dimension():
    """fewbit.codec.pack_pairs of an odd last dimension broadcast its last code into every
    byte (codes 0, 1, 2 gave 16, 18) instead of refusing; an even one pairs as before."""
    from fewbit.codec import pack_pairs

    for odd in (torch.arange(3), torch.zeros(2, 5, dtype=torch.int32), torch.tensor(1)):
        with pytest.raises(ValueError, match="pairs codes along the last dimension"):
            pack_pairs(odd)
    assert pack_pairs(torch.tensor([1, 2, 3, 4])).tolist() == [0x21, 0x43]


def test_codes_of_refuses_what_it_cannot_read():
    """codes_of reads float32 or float64 (its layouts' table): float16 was a KeyError."""
    from fewbit.codec import codes_of

    with pytest.raises(TypeError, match="codes_of reads float32 or float64 values, not torch.float16"):
        codes_of(torch.ones(4, dtype=torch.float16), fewbit.format("binary8p4"))
    assert codes_of(torch.ones(2, dtype=torch.float64), fewbit.format("binary8p4")).tolist() == [0x40, 0x40]


@pytest.mark.parametrize("config", [{}, {"compile": False}])
def test_float32_subnormal_values_survive_flush_denormal(config):
    """torch.set_flush_denormal(True) (FTZ and DAZ) flushed the conversion of decode's value
    table, built once and kept: E8M0's code 0 (2^-127) and bfloat16's subnormal codes
    decoded to 0 for the rest of the process; and encode's check compared floats, which
    read subnormals as 0, so 2^-149 passed as E8M0's 2^-127 and as bfloat16's 0 (the native
    kernel refused it as "0.0 is not a value of bfloat16", its value read as a float)."""
    e8m0 = torch.tensor([0x400000, 0x800000, 0x3F800000], dtype=torch.int32).view(torch.float32)
    bf16 = torch.tensor([0x10000, 0x7F0000, -0x7FFF0000], dtype=torch.int32).view(torch.float32)
    not_a_value = torch.tensor([1], dtype=torch.int32).view(torch.float32)  # 2^-149
    fewbit.codec._table.cache_clear()  # (built under the setting below)
    torch.set_flush_denormal(True)
    try:
        with fewbit.configure(**config):
            decoded = [fewbit.decode(fewbit.encode(v, name), name) for v, name in
                       ((e8m0, "ocp_e8m0"), (bf16, "bfloat16"))]  # fmt: skip
            for name in ("ocp_e8m0", "bfloat16"):
                with pytest.raises(ValueError, match=r"^1\.401298464324817e-45 is not a value"):  # (not 0.0)
                    fewbit.encode(not_a_value, name)
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(decoded[0].view(torch.int32), e8m0.view(torch.int32))
    assert torch.equal(decoded[1].view(torch.int32), bf16.view(torch.int32))
    assert fewbit.decode(torch.zeros(1, dtype=torch.uint8), "ocp_e8m0").view(torch.int32).item() == 0x400000


# Codec and storage hunt (codec hunt): every code of the named formats against gfloat, and
# the dtypes values come back in.


def test_values_come_back_only_in_a_dtype_fewbit_rounds():
    """BlockTensor.dequantize and block_scales took torch's 8-bit floats and cast q * S into
    them, unchecked: mxfp4's 768 came back 448 and mxfp8_e4m3's 1e-4 as 0 in float8_e4m3fn;
    elements and decode refused them in rounding's words ("fewbit rounds tensors of")."""
    import fewbit.block as block

    big = block.quantize(torch.tensor([[1000.0] + [0.5] * 31]), "mxfp4")
    tiny = block.quantize(torch.full((1, 32), 1e-4), "mxfp8_e4m3")
    codes = torch.zeros(2, dtype=torch.uint8)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu):
        for stored in (big, tiny):
            for call in (stored.dequantize, stored.block_scales):
                with pytest.raises(TypeError, match=r"^values come in a float dtype \(torch.float16, "):
                    call(dtype)
            with pytest.raises(TypeError, match="^decode gives values in a float dtype"):
                stored.elements(dtype)
        with pytest.raises(TypeError, match="^decode gives values in a float dtype"):
            fewbit.decode(codes, "e4m3", dtype)
    assert float(big.dequantize()[0, 0]) == 768.0 and float(tiny.dequantize()[0, 0]) > 0


@pytest.mark.slow
@pytest.mark.parametrize("native", [True, False])
def test_every_code_of_every_named_format_is_gfloats_both_ways(native):
    """decode of every code equals gfloat's decode_ndarray bit for bit (-0 included) in every
    dtype that holds the format, and encode of those values (NaN, -NaN, -0, +-Inf among
    them) gives gfloat's encode_ndarray codes: the codes themselves, but gfloat's NaN code
    for every NaN and +0 for -0 where the format has no -0. (No disagreement found.)"""
    import gfloat

    from conftest import INT_VIEW, gfloat_format

    checked = 0
    with fewbit.configure(native=native):
        for fmt in _small_formats():
            info = gfloat_format(fmt)
            codes = np.arange(2**fmt.k)
            theirs = torch.from_numpy(gfloat.decode_ndarray(info, codes))
            for dtype in DTYPES:
                if not dtype_format(dtype).contains(fmt):
                    continue
                values = fewbit.decode(torch.from_numpy(codes).to(fewbit.codec.code_dtype(fmt)), fmt, dtype)
                nan = torch.isnan(values)
                want = theirs.to(dtype)
                assert torch.equal(nan, torch.isnan(want)), (fmt.name, dtype)
                bits = INT_VIEW[dtype]
                assert torch.equal(values[~nan].view(bits), want[~nan].view(bits)), (fmt.name, dtype)
                specials = [-math.nan] * fmt.has_nans + [-0.0] * fmt.has_zero + [math.inf] * fmt.has_infs
                specials += [-math.inf] * (fmt.has_infs and fmt.signed)
                x = torch.cat([values, torch.tensor(specials, dtype=dtype)])
                ours = fewbit.encode(x, fmt).to(torch.int64) & ((1 << fmt.k) - 1)
                theirs_codes = gfloat.encode_ndarray(info, x.double().numpy())
                assert ours.tolist() == theirs_codes.tolist(), (fmt.name, dtype)
                checked += 1
    assert checked > 1300


# Memory (memory hunt): what a call allocates beyond its result.


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_decode_looks_codes_up_without_an_int64_copy(dtype):
    from conftest import peak_allocated

    # The torch kernel (float64 values, or no native kernel) indexed its table with an int64
    # copy of the int32 codes: 12 bytes a code beside the values, where 4 are needed.
    codes = torch.randint(0, 256, (64, 256), dtype=torch.uint8)
    with fewbit.configure(native=False):
        want = fewbit.decode(codes, "binary8p4", dtype)
        values = codes.numel() * want.element_size()
        assert peak_allocated(lambda: fewbit.decode(codes, "binary8p4", dtype)) <= values + 4 * codes.numel()
    table = torch.tensor(fewbit.format("binary8p4").values(), dtype=dtype)  # (exact in float32)
    torch.testing.assert_close(want, table[codes.long()], rtol=0, atol=0, equal_nan=True)


# Memory, second pass (memory-2 hunt).


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_encode_torch_path_works_in_chunks(dtype):
    from conftest import peak_allocated

    # encode's torch kernel ran codes_of and its check over the whole tensor: several int64
    # tensors of x's size at once, 8.5x x's bytes from float32 (19x from bfloat16). In chunks
    # of eager_chunk elements it holds the codes and one chunk's intermediates (66 bytes an
    # element from float64: here 0.16 MB, where the whole tensor's were 1.0 MB).
    x = fewbit.round(torch.randn(1 << 14, dtype=torch.float64), "binary8p4").to(dtype)
    chunk = 1 << 11
    with fewbit.configure(native=False, eager_chunk=chunk):
        want = fewbit.encode(x, "binary8p4")
        peak = peak_allocated(lambda: fewbit.encode(x, "binary8p4"))
        assert peak <= x.numel() + 72 * chunk, peak / x.nbytes
        # The first element that is no value is named, in a later chunk than the first.
        bad = x.clone()
        bad[5 * chunk + 3], bad[7 * chunk] = 1.0625, 1.03125
        with pytest.raises(ValueError, match=r"^1\.0625 is not a value of binary8p4"):
            fewbit.encode(bad, "binary8p4")
        packed = fewbit.encode(fewbit.round(x, "e2m1", sat=True).reshape(64, -1), "e2m1", packed=True)
    table = torch.tensor(fewbit.format("binary8p4").values(), dtype=torch.float64)
    assert torch.equal(table[want.long()], x.double())
    unpacked = fewbit.encode(fewbit.round(x, "e2m1", sat=True).reshape(64, -1), "e2m1")
    assert torch.equal(packed, unpacked[:, 0::2] | (unpacked[:, 1::2] << 4))
