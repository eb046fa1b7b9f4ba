"""fewbit.block: against gfloat's block API, its own block-by-block reference, and fewbit.round."""

from __future__ import annotations

import concurrent.futures
import io
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

import fewbit
import fewbit.block as block
from conftest import DETERMINISTIC_MODES, gfloat_mode, stable_seed
from fewbit.block.reference import block_round_reference, tensor_scale_reference
from fewbit.formats import FloatFormat
from fewbit.optim import LowPrecisionWeights
from fewbit.random import key_of, random_bits
from fewbit.rounding import natural_sr_bits

MX = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_e2m1", "mxint8"]
STOCHASTIC = ["srff", "srf", "src", "src_odd", "sr", "sr_near_zero", "sr_fraction"]


def _gfloat_block(name: str):
    import gfloat.formats as gf

    return getattr(gf, f"format_info_{name}")


def _edge_blocks(bfmt: block.BlockFormat, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Blocks of 32 float32 values that exercise the scale rule and the element edges."""
    M, E = bfmt.element.max, bfmt.element.emax
    ulp_top = 2.0 ** (E - bfmt.element.p + 1)
    gauss = rng.standard_normal(32).astype(np.float32)
    blocks = {
        "zeros": np.zeros(32, np.float32),
        "gaussian": gauss,
        "gaussian_tiny": gauss * np.float32(1e-30),
        "outlier": np.concatenate([[3.0e4], rng.standard_normal(31)]).astype(np.float32),
        "subnormal_only": (rng.standard_normal(32) * 1e-40).astype(np.float32),
        # Scaled by 2^10: amax/S lands on M, on the next grid step above it, and just below 2^(E+1).
        "at_max": np.concatenate([[M * 1024], gauss[1:] * 8]).astype(np.float32),
        "above_max": np.concatenate([[(M + ulp_top / 2) * 1024], gauss[1:]]).astype(np.float32),
        "below_binade_top": np.concatenate([[np.nextafter(np.float32(2.0 ** (E + 11)), 0)], gauss[1:]])
        .astype(np.float32),
        "inf": np.concatenate([[np.inf, -np.inf], gauss[2:]]).astype(np.float32),
    }
    if bfmt.element.has_nans:  # gfloat refuses NaN for elements without one
        blocks["nan"] = np.concatenate([[np.nan], gauss[1:]]).astype(np.float32)
    return blocks


@pytest.mark.parametrize("name", MX)
def test_mx_formats_agree_with_gfloat_block_api(name):
    """Scale codes, element codes and values equal gfloat's quantize_block /
    encode_block (floor rule, OCP), for every deterministic mode, on edge and random blocks."""
    from gfloat import compute_scale_amax, decode_block, encode_block

    fi = _gfloat_block(name)
    bfmt = block.format(name)
    rng = np.random.default_rng(stable_seed("gfloat-block", name))
    cases = _edge_blocks(bfmt, rng)
    x = torch.from_numpy(np.stack(list(cases.values())))
    for mode in DETERMINISTIC_MODES:
        stored = block.quantize(x, bfmt, mode)
        elements = stored.codes[:, 0]
        if bfmt.packed:
            elements = torch.stack([elements & 0xF, elements >> 4], -1).flatten(-2)
        values = block.round(x, bfmt, mode)
        for row, (case, vals) in enumerate(cases.items()):
            scale = compute_scale_amax(fi.etype.emax, vals.astype(np.float64))
            codes = list(encode_block(fi, scale, vals.astype(np.float64) / scale, gfloat_mode(mode)))
            where = f"{name} {mode} {case}"
            assert int(stored.scales[row, 0]) == codes[0], where
            assert elements[row].tolist() == codes[1:], where
            with np.errstate(over="ignore"):  # Inf saturates to M * 2^127, beyond float32
                expected = np.fromiter(decode_block(fi, codes), float).astype(np.float32)
            np.testing.assert_array_equal(values[row].numpy(), expected, err_msg=where)


def test_int_elements_agree_with_gfloat():
    """intM (HBFP/BFP elements) round as gfloat rounds a two's-complement format of M bits."""
    import gfloat
    from gfloat import Domain, FormatInfo

    x = torch.linspace(-2.5, 2.5, 801, dtype=torch.float64)
    for m in (3, 4, 6, 12):
        fi = FormatInfo(name=f"int{m}", k=m, precision=m, bias=0, has_nz=False, domain=Domain.Finite,
                        num_high_nans=0, has_subnormals=True, is_signed=True, is_twos_complement=True)
        for mode in DETERMINISTIC_MODES:
            expected = gfloat.round_ndarray(fi, x.numpy(), gfloat_mode(mode), sat=True)
            got = fewbit.round(x, f"int{m}", mode, sat=True)
            np.testing.assert_array_equal(got.numpy(), expected, err_msg=f"int{m} {mode}")


def _formats_and_rules():
    for name in ["mxfp8_e4m3", "mxfp4", "mxint8", "hbfp4", "bfp6_b16", "mx_binary8p4"]:
        for rule in ("floor", "ceil", "rceil", "even"):
            yield name, rule
    yield "nvfp4", "nearest"
    yield "nvfp4", "up"


@pytest.mark.parametrize(("name", "rule"), list(_formats_and_rules()))
def test_kernel_agrees_with_reference(name, rule):
    """Every rule, deterministic and stochastic modes, padded blocks, a non-last axis, and
    blocks whose amax lies on a rule's threshold: M 2^3 (rceil's tie: amax / 2^3 = M fits)
    and (2 - 2^-P) 2^-2 (even's), with elements over 14 binades below it, where a scale
    twice too large shows in the subnormals (rceil taking the next scale at its tie passed)."""
    g = torch.Generator().manual_seed(stable_seed("block-ref", name, rule))
    x = torch.randn(3, 70, generator=g) * torch.logspace(-3, 3, 70)
    x[1, 5:40] = 0  # a block of zeros
    bfmt = block.format(name)
    spread = torch.logspace(-14, 0, 16, base=2.0).flip(0).repeat(5)[:70]  # every block starts at 1
    el = bfmt.element
    x = torch.cat([x, torch.stack([el.max * 2.0**3 * spread, (2 - 2.0**-el.top_p) * 2.0**-2 * spread])])
    for mode, bits in [("rne", None), ("rna", None), ("rtz", None), ("rup", None), ("src", 3), ("srff", 2)]:
        for axis in (-1, 0):
            rb = None if bits is None else torch.randint(0, 2**bits, x.shape, generator=g)
            got = block.round(x, bfmt, mode, axis=axis, bits=bits, random_bits=rb, rule=rule)
            want = block_round_reference(x, bfmt, mode, axis=axis, bits=bits, random_bits=rb, rule=rule)
            assert torch.equal(got, want), f"{name} {rule} {mode} axis={axis}"


def test_reference_takes_a_mode_in_any_case():
    """The reference parses the mode as block.round does: "SR" is classical SR (src with the
    quotients' natural N), not an error about N for the float64 it works in."""
    g = torch.Generator().manual_seed(stable_seed("block-ref-case"))
    x = torch.randn(2, 64, generator=g)
    n = natural_sr_bits(fewbit.format("binary32"), block.format("mxfp8_e4m3").element)
    rb = torch.randint(0, 2**n, x.shape, generator=g)
    want = block.round(x, "mxfp8_e4m3", "sr", random_bits=rb)
    for mode in ("sr", "SR", fewbit.RoundMode.SR):
        assert torch.equal(block_round_reference(x, "mxfp8_e4m3", mode, random_bits=rb), want), mode


@pytest.mark.parametrize("mode", STOCHASTIC)
@pytest.mark.parametrize("bits", [1, 2, 3, 8])
def test_sr_on_blocks_is_elementwise_round_of_x_over_scale(mode, bits):
    """With explicit bits, block.round is fewbit.round of x / S times S, element by element
    (float32 arithmetic: exact for power-of-two S, one rounding each way for NVFP4's)."""
    g = torch.Generator().manual_seed(stable_seed("block-sr", mode, bits))
    x = torch.randn(4, 96, generator=g) * 5
    for name in ("mxfp8_e4m3", "mxfp4", "nvfp4", "hbfp6"):
        bfmt = block.format(name)
        n = natural_sr_bits(fewbit.format("fp32"), bfmt.element) if mode == "sr" else bits
        kwargs = {} if mode == "sr" else {"bits": bits}
        if mode == "sr_fraction":
            kwargs["fraction"] = 0.5
        rb = torch.randint(0, 2 ** (n + (16 if mode == "sr_fraction" else 0)), x.shape, generator=g)
        got = block.round(x, bfmt, mode, random_bits=rb, **kwargs)
        S = block.quantize(x, bfmt).block_scales()  # the scale depends on amax only
        S = S.repeat_interleave(bfmt.block_size, -1)[:, : x.shape[1]]
        want = fewbit.round(x / S, bfmt.element, mode, random_bits=rb, sat=True, **kwargs) * S
        assert torch.equal(got, want), f"{name} {mode} N={bits}"


def test_seed_draws_the_bits_fewbit_round_gives_each_index():
    x = torch.randn(5, 70) * 3
    key = fewbit.random.Key.from_seed(11)
    for axis in (-1, 0):
        got = block.round(x, "mxfp4", "src", bits=3, seed=key, axis=axis)
        rb = random_bits(x.shape, 3, key)
        assert torch.equal(got, block.round(x, "mxfp4", "src", bits=3, random_bits=rb, axis=axis))
    same = block.round(x, "mxfp4", "src", bits=3, seed=key_of(key))
    assert torch.equal(same, block.round(x, "mxfp4", "src", bits=3, seed=key))
    assert not torch.equal(same, block.round(x, "mxfp4", "src", bits=3, seed=12))


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "hbfp4"])
def test_generated_bits_are_unbiased_per_element(name):
    """Per-element means of SRC (N = 3) over 4096 draws within 5 standard errors of the
    exact expectation: down + (up - down) * RNE(d 2^N) / 2^N, from the directed roundings."""
    bits, draws = 3, 4096
    g = torch.Generator().manual_seed(stable_seed("block-mean", name))
    row = torch.randn(1, 64, generator=g, dtype=torch.float64).float()
    x = row.expand(draws, 64).contiguous()  # every row: the same blocks, other bits
    down = block.round(row, name, "rtz").double()
    away = block.round(row, name, "rup").double()
    away = torch.where(row < 0, block.round(row, name, "rdn").double(), away)
    gap = away - down
    d = torch.where(gap == 0, 0, (row.double() - down) / torch.where(gap == 0, 1, gap))
    expected = down + gap * torch.round(d * 2**bits) / 2**bits  # torch.round: ties to even
    with fewbit.configure(compile=False):  # eager: no first compilation in a test
        samples = block.round(x, name, "src", bits=bits, seed=stable_seed(name)).double()
    mean = samples.mean(0)
    se = samples.std(0) / math.sqrt(draws)
    assert (gap != 0).sum() > 48  # most elements are not on the grid
    assert bool(((mean - expected[0]).abs() <= 5 * se + 1e-12).all())


def test_nvfp4_round_trips_every_representable_value():
    """Every E2M1 element under every positive finite E4M3 block scale, with a power-of-two
    per-tensor scale: quantize then dequantize gives the input back, with the codes expected."""
    e2m1 = torch.tensor(fewbit.format("e2m1").values(), dtype=torch.float32)  # 16 codes
    e4m3 = torch.tensor(fewbit.format("e4m3").values(), dtype=torch.float32)[:128]
    scales = e4m3[(e4m3 > 0) & torch.isfinite(e4m3)]
    q = e2m1.expand(len(scales), 16).clone()
    q[:, 0] = 6.0  # the block's largest element is 6: its scale is amax / 6
    ts = 2.0**-3  # the largest block scale, 448, sets the per-tensor scale 448 * 6 * ts / (6 * 448)
    x = q * scales[:, None] * ts
    stored = block.quantize(x, "nvfp4")
    assert stored.tensor_scale.item() == ts
    assert torch.equal(stored.scales[:, 0], fewbit.encode(scales, "e4m3"))
    assert torch.equal(stored.dequantize(), x)
    assert torch.equal(block.round(x, "nvfp4"), x)
    assert torch.equal(stored.elements()[:, 0], q)
    assert stored.nbytes == len(scales) * (8 + 1) + 4


def test_quantize_dequantize_equals_round_and_reports_bytes():
    x = torch.randn(6, 100)
    for name in ("mxfp8_e4m3", "mxfp6_e2m3", "mxfp4", "nvfp4", "hbfp5", "bfp3_b8"):
        bfmt = block.format(name)
        stored = block.quantize(x, bfmt, "src", bits=2, seed=3, axis=0)
        assert torch.equal(stored.dequantize(), block.round(x, bfmt, "src", bits=2, seed=3, axis=0))
        for dtype in (torch.float64, torch.bfloat16, torch.float16):  # (float64: NVFP4's q S in float64)
            wide = (x * 3).to(dtype)
            want = block.round(wide, bfmt, "src", bits=2, seed=3, axis=0)
            stored = block.quantize(wide, bfmt, "src", bits=2, seed=3, axis=0)
            assert torch.equal(stored.dequantize(dtype), want), (name, dtype)
        assert stored.shape == x.shape and stored.axis == 0
        blocks = -(-6 // bfmt.block_size) * 100
        per_block = bfmt.block_size // 2 if bfmt.packed else bfmt.block_size
        assert stored.nbytes == blocks * (per_block + 1) + (4 if bfmt.tensor_scale else 0)


def test_block_tensor_nbytes_under_compile_with_a_dynamic_shape():
    """BlockTensor.nbytes read a tensor's nbytes, which torch refuses for a symbolic shape:
    under torch.compile(fullgraph=True), a second batch size (made dynamic) failed with
    Dynamo's internal error. Counted from numel, it compiles and gives eager's count."""
    f = torch.compile(lambda x: block.quantize(x, "nvfp4").nbytes, fullgraph=True, backend="eager")
    for rows in (4, 8, 6):
        x = torch.randn(rows, 64)
        assert f(x) == block.quantize(x, "nvfp4").nbytes == rows * 4 * (8 + 1) + 4


def test_a_block_tensor_goes_through_torch_export_saved_and_loaded():
    """A BlockTensor is a pytree node: an exported function returns one (torch refused the
    unknown type in the program's outputs), saved and loaded, its shape following a
    dynamic batch size, a format made by hand by its repr; and torch.compile takes one
    as an input without a recompile per tensor."""
    mine = replace(block.format("mxfp6_e3m2"), name="test_pytree_mx")

    class Quantize(torch.nn.Module):
        def forward(self, x):
            return block.quantize(x, "nvfp4", "sr", seed=1), block.quantize(x.t(), mine, axis=0)

    def same(a, b):
        return (type(a) is block.BlockTensor and (a.format, a.shape, a.axis) == (b.format, b.shape, b.axis)
                and all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("codes", "scales"))
                and (a.tensor_scale is None) == (b.tensor_scale is None)
                and (a.tensor_scale is None or torch.equal(a.tensor_scale, b.tensor_scale)))

    x = torch.randn(4, 64)
    batch = torch.export.Dim("b", min=2, max=64)
    exported = torch.export.export(Quantize(), (x,), dynamic_shapes=({0: batch},))
    buffer = io.BytesIO()
    torch.export.save(exported, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer).module()
    for rows in (4, 9):
        x = torch.randn(rows, 64)
        assert all(same(a, b) for a, b in zip(loaded(x), Quantize()(x), strict=True))
    calls = []
    f = torch.compile(lambda q: q.dequantize(), fullgraph=True, backend=lambda gm, _: calls.append(gm) or gm)
    for seed in range(3):
        q = block.quantize(torch.randn(4, 64), "mxfp4", "sr", seed=seed)
        assert torch.equal(f(q), q.dequantize())
    assert len(calls) == 1


def test_scale_rules_clip_and_waste_as_the_table_says():
    """A block whose amax scales to 7 (e2m1: max 6, binade [4, 8)): floor clips it to 6,
    ceil/rceil/even never clip; ceil doubles the scale, rceil too (7 > 6), even rounds 7 to 8."""
    x = torch.tensor([[7.0, 1.0, 0.5, 0.0]])
    bfmt = block.BlockFormat("e2m1_b4", fewbit.format("e2m1"), 4, fewbit.format("ocp_e8m0"))
    assert block.round(x, bfmt, rule="floor")[0, 0] == 6.0
    for rule in ("ceil", "rceil", "even"):
        assert block.round(x, bfmt, rule=rule)[0, 0] == 8.0, rule  # 4 * scale 2
    y = torch.tensor([[5.0, 1.0, 0.5, 0.0]])  # amax 5: fits under floor and rceil, ceil wastes a binade
    assert block.round(y, bfmt, rule="rceil")[0, 0] == 4.0  # 5 rounds (RNE) to 4 in [4, 6]
    assert block.quantize(y, bfmt, rule="ceil").block_scales()[0, 0] == 2.0
    assert block.quantize(y, bfmt, rule="floor").block_scales()[0, 0] == 1.0


@pytest.mark.parametrize("native", [True, False])
def test_even_rounds_an_int_blocks_largest_at_its_magnitude_bits(native):
    """int4 holds 1, 1.25, 1.5, 1.75 in [1, 2): 3 bits, P less its sign. Rule even rounded
    amax at P = 4 bits, so 1.9 stayed in the binade (scale 1) and clipped to 1.75, where
    rounding to nearest at 3 bits gives 2 (scale 2, and 1.9 rounds to 2): as the table says,
    even clips only what RNE would clip anyway (nothing, for intM)."""
    bfmt = block.BlockFormat("int4_b4", fewbit.format("int4"), 4, fewbit.format("ocp_e8m0"), rule="even")
    with fewbit.configure(native=native):
        for amax, scale, top in ((1.9, 2.0, 2.0), (1.875, 2.0, 2.0), (1.86, 1.0, 1.75)):
            x = torch.tensor([[amax, 0.5, -0.25, 0.0]] * 128)  # (rows enough for the native kernel)
            assert block.quantize(x, bfmt).block_scales()[0, 0] == scale, amax
            assert block.round(x, bfmt)[0, 0] == top, amax
            assert torch.equal(block.round(x, bfmt), block_round_reference(x, bfmt)), amax


def test_nan_and_inf():
    """NaN makes its block's scale NaN (every scale format has one); Inf saturates."""
    x = torch.randn(2, 32)
    x[0, 3] = math.nan
    x[1, 4] = math.inf
    for name in ("mxfp8_e4m3", "mxfp4", "mxint8", "nvfp4"):
        out = block.round(x, name)
        size = block.format(name).block_size
        assert bool(out[0, :size].isnan().all()) and not bool(out[0, size:].isnan().any()), name
        assert not bool(out[1].isnan().any()), name
        assert out[1, 4] > 0 and bool(torch.isfinite(out[1, :4]).all())
        assert block.quantize(x, name).scales[0, 0] == fewbit.format(block.format(name).scale).code_of_nan


def test_padding_and_shapes():
    x = torch.randn(2, 3, 45)
    for axis in (0, 1, 2, -1):
        out = block.round(x, "mxfp4", axis=axis)
        assert out.shape == x.shape
        assert torch.equal(out, block.round(x.movedim(axis, -1).contiguous(), "mxfp4").movedim(-1, axis))
    padded = block.round(torch.nn.functional.pad(x, (0, 19)), "mxfp4")[..., :45]
    assert torch.equal(block.round(x, "mxfp4"), padded)  # zeros in the last block change nothing
    assert block.round(torch.empty(0, 32), "mxfp4").shape == (0, 32)


@pytest.mark.parametrize("shape, axis", [((0, 64), -1), ((2, 0, 32), -1), ((64, 0), 0), ((4, 0), -1)])
@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "hbfp4"])
def test_codes_of_a_tensor_without_elements_decode_to_its_shape(shape, axis, name):
    """A weight with a dimension of size 0 (kept as codes by LowPrecisionWeights'
    store_codes, say): its codes hold no rows, and decode back to its shape."""
    codes = block.quantize(torch.empty(shape), name, axis=axis)
    assert codes.dequantize(torch.bfloat16).shape == shape and codes.codes.numel() == 0


def test_dtypes():
    x = torch.randn(4, 64)
    want = block.round(x, "mxfp8_e4m3")
    assert torch.equal(block.round(x.double(), "mxfp8_e4m3"), want.double())
    wide = block.round(x.bfloat16().float(), "mxfp8_e4m3")
    assert torch.equal(block.round(x.bfloat16(), "mxfp8_e4m3"), wide.bfloat16())


@pytest.mark.parametrize(("dtype", "name", "size", "n", "ulp", "d"), [
    (torch.bfloat16, "mxfp4", 32, 22, 0.5, 2.0**-7),  # block max 4: S = 1, E2M1's subnormal ulp 1/2
    (torch.float16, "hbfp4", 64, 21, 0.25, 2.0**-10),  # block max 1: int4's ulp 1/4
])  # fmt: skip
def test_classical_sr_of_16bit_blocks_draws_the_quotients_bits(dtype, name, size, n, ulp, d):
    """N was bfloat16's (float16's) D: an element 2^-8 in a bfloat16 mxfp4 block whose
    largest is 4 (d = 1/128 of E2M1's subnormal ulp) never rounded up with 6 bits. N is
    float32's D now (24 - 2 for E2M1; 24 - 3 for int4, P less its sign): SRC rounds up
    from 2^N (1 - d) on, exactly."""
    x = torch.zeros(1, size, dtype=dtype)
    x[0, 0], x[0, 1] = 8 * ulp if name == "mxfp4" else 4 * ulp, d * ulp
    for bits, want in ((2**n - round(2**n * d) - 1, 0.0), (2**n - round(2**n * d), ulp)):
        y = block.round(x, name, "sr", random_bits=torch.full(x.shape, bits))
        assert y[0, 1].item() == want, bits


@pytest.mark.parametrize("name", ["mx_binary8p2", "mx_binary8p1"])
@pytest.mark.parametrize("axis", [-1, 0])
def test_16bit_data_takes_elements_of_a_wider_range_than_its_dtype(name, axis):
    """A block's tensor holds q S (or codes), never q: float16 data into binary8p2
    elements (exponents to 2^31) was refused as if it had to hold them. Its values are
    those of the same data in float32 (q S of a float16 x is a float16 value, below the
    dtype's largest), and so are its codes and scales; the natural SR takes D from the
    float32 its quotients x / S are formed in (24 - P bits), as for float32 data."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 256, generator=gen) * 2.0 ** torch.randint(-30, 10, (16, 1), generator=gen)
    x[0, :32] = torch.arange(32) * 2.0**-24  # float16's subnormals, in one block
    x = x.half()
    if axis == 0:
        x = x.t()
    p = block.format(name).element.p
    src = dict(bits=3, seed=1)
    for mode, kw, wide_mode, wide_kw in [("rne", {}, "rne", {}), ("src", src, "src", src),
                                         ("sr", dict(seed=2), "src", dict(bits=24 - p, seed=2))]:  # fmt: skip
        y = block.round(x, name, mode, axis=axis, **kw)
        want = block.round(x.float(), name, wide_mode, axis=axis, **wide_kw)
        assert want.abs().max() < 65504 and torch.equal(y.float(), want), mode
        codes, wide = (block.quantize(x, name, mode, axis=axis, **kw),
                       block.quantize(x.float(), name, wide_mode, axis=axis, **wide_kw))  # fmt: skip
        assert torch.equal(codes.codes, wide.codes) and torch.equal(codes.scales, wide.scales), mode


def test_bad_input_is_refused_before_anything_is_written():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="block size must be even"):
        block.format("bfp4_b7")
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        block.round(x, "mxfp4", axis=2)
    with pytest.raises(TypeError, match="float tensor"):
        block.round(torch.ones(4, 32, dtype=torch.int32), "mxfp4")
    with pytest.raises(ValueError, match="unknown scale rule 'flor'.*floor"):
        block.round(x, "mxfp4", rule="flor")
    with pytest.raises(ValueError, match="not for ocp_e8m0 scales"):
        block.quantize(x, "mxfp4", rule="nearest")
    with pytest.raises(ValueError, match="unknown block format 'mxfp5'; closest: mxfp4"):
        block.round(x, "mxfp5")
    with pytest.raises(ValueError, match="needs bits=N"):
        block.round(x, "mxfp4", "src")
    with pytest.raises(ValueError, match="random_bits must lie"):
        block.round(x, "mxfp4", "src", bits=2, random_bits=torch.full(x.shape, 4))
    with pytest.raises(ValueError, match="use sat=True"):
        block.round(torch.tensor([[7.0, 1.0]]), "mxfp4", sat=False)
    with pytest.raises(ValueError, match="at most 8 bits"):
        block.format("mx_bf16")
    with pytest.raises(TypeError, match="axis must be an int"):
        block.round(x, "mxfp4", axis=1.0)
    with pytest.raises(TypeError, match="axis must be an int, not bool"):
        block.round(x, "mxfp4", axis=True)
    # Messages that named the wrong thing (an unhashable list, 'closest: fp64', an attribute).
    with pytest.raises(TypeError, match="a block format is a name or a BlockFormat, not list"):
        block.format(["mxfp4"])
    with pytest.raises(ValueError, match="'mxfp4' is a block format, which fewbit.block.round"):
        fewbit.round(x, "mxfp4")
    with pytest.raises(ValueError, match="block size must be even, not 3"):
        block.round_to(x, "bfp4_b3")  # (an element format or a block format: the block's reason)
    stored = block.quantize(x, "mxfp4")
    with pytest.raises(TypeError, match="out must be a BlockTensor, not Tensor"):
        block.quantize(x, "mxfp4", out=torch.empty_like(x))
    with pytest.raises(TypeError, match="out must be a tensor, not BlockTensor"):
        block.round(x, "mxfp4", out=stored)
    assert torch.equal(stored.dequantize(), block.round(x, "mxfp4"))
    # A numpy int is an axis, as Quant and the keys take one (it was a TypeError).
    assert torch.equal(block.round(x, "mxfp4", axis=np.int64(-1)), block.round(x, "mxfp4", axis=-1))


def test_inside_torch_compile_export_and_autograd():
    """One opaque op: fullgraph, no recompile for a new seed, export, straight-through gradient."""
    torch._dynamo.reset()
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm

    lin = torch.nn.Linear(64, 64)
    f = torch.compile(lambda x, s: block.round(lin(x), "mxfp4", "src", bits=3, seed=s), backend=backend,
                      fullgraph=True)
    x = torch.randn(8, 64)
    for step in range(3):
        seed = torch.tensor(step)
        assert torch.equal(f(x, seed), block.round(lin(x), "mxfp4", "src", bits=3, seed=step))
    assert len(calls) == 1

    class M(torch.nn.Module):
        def forward(self, x):
            return block.round(x, "nvfp4")

    ep = torch.export.export(M(), (x,))
    assert torch.equal(ep.module()(x), block.round(x, "nvfp4"))

    w = torch.randn(4, 64, requires_grad=True)
    (block.round(w, "mxfp8_e4m3", "src", bits=3, seed=0) * 3).sum().backward()
    assert torch.equal(w.grad, torch.full_like(w, 3.0))


def test_compiled_kernel_gives_the_eager_bits():
    """The compiled kernel (C++ here) and eager agree: rounding with generated bits, and
    quantising to codes with given bits (one compilation each: they take a while)."""
    x = torch.randn(5, 70) * 4
    x[1, :16] = -0.0  # an NVFP4 block whose scale is 0: its -0 codes
    rb = torch.randint(0, 8, x.shape)
    with fewbit.configure(compile=False):
        eager = block.round(x, "mxfp4", "src", bits=3, seed=7)
        stored = block.quantize(x, "nvfp4", "srf", bits=3, random_bits=rb)
    with fewbit.configure(compile_threshold=0):
        assert torch.equal(block.round(x, "mxfp4", "src", bits=3, seed=7), eager)
        compiled = block.quantize(x, "nvfp4", "srf", bits=3, random_bits=rb)
    assert torch.equal(compiled.codes, stored.codes) and torch.equal(compiled.scales, stored.scales)
    assert bool((compiled.codes[1, 0] == 0x88).all())


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp4", "nvfp4", "hbfp4"])
def test_out_holds_the_same_result_in_the_callers_memory(name):
    """quantize(out=) and round(out=) write what the allocating calls return, into the
    given memory: blocks along the last axis, along another, padded, bfloat16, strided out."""
    g = torch.Generator().manual_seed(stable_seed("block-out", name))
    for shape, axis, dtype in [((8, 128), -1, torch.float32), ((8, 128), 0, torch.float32),
                               ((6, 70), -1, torch.float32), ((4, 64), -1, torch.bfloat16)]:
        x = (torch.randn(shape, generator=g) * 4).to(dtype)
        kw = {"axis": axis, "bits": 3, "seed": 11}
        want = block.quantize(x, name, "src", **kw)
        stored = block.quantize(torch.zeros(shape, dtype=dtype), name, axis=axis)
        assert block.quantize(x, name, "src", out=stored, **kw) is stored
        assert torch.equal(stored.codes, want.codes) and torch.equal(stored.scales, want.scales)
        assert torch.equal(stored.dequantize(), want.dequantize())
        out = torch.full_like(x, 7.0)
        assert block.round(x, name, "src", out=out, **kw) is out
        assert torch.equal(out, block.round(x, name, "src", **kw))
        wide = torch.zeros(*shape, 2, dtype=dtype)
        block.round(x, name, "src", out=wide[..., 1], **kw)
        assert torch.equal(wide[..., 1], out) and not wide[..., 0].any()
        y = x.clone()
        block.round(y, name, "src", out=y, **kw)  # in place
        assert torch.equal(y, out)


def test_out_is_refused_before_anything_is_written():
    x = torch.tensor([[7.0, 1.0] * 16])  # 7 is beyond e2m1's 6 at the block's scale
    out = torch.full_like(x, 3.0)
    with pytest.raises(ValueError, match="use sat=True"):
        block.round(x, "mxfp4", sat=False, out=out)
    assert bool((out == 3.0).all())
    stored = block.quantize(torch.ones_like(x), "mxfp4")
    before = stored.codes.clone(), stored.scales.clone()
    with pytest.raises(ValueError, match="use sat=True"):
        block.quantize(x, "mxfp4", sat=False, out=stored)
    assert torch.equal(stored.codes, before[0]) and torch.equal(stored.scales, before[1])
    with pytest.raises(ValueError, match="out holds mxfp4_e2m1 along axis 1; this call makes mxfp8_e4m3"):
        block.quantize(x, "mxfp8_e4m3", out=stored)
    with pytest.raises(ValueError, match="out holds"):
        block.quantize(x, "mxfp4", axis=0, out=stored)
    bad = block.BlockTensor(stored.codes[:, :, :8], stored.scales, None, stored.format, x.shape, 1)
    with pytest.raises(ValueError, match="out's codes must be uint8"):
        block.quantize(x, "mxfp4", out=bad)
    with pytest.raises(ValueError, match="out must match x"):
        block.round(x, "mxfp4", out=torch.empty(2, 32))
    with pytest.raises(RuntimeError, match="automatic differentiation"):
        block.round(x.requires_grad_(), "mxfp4", out=torch.empty_like(x))
    # A weight that requires grad: codes carry no gradient, and round(out=) runs under no_grad.
    w = torch.randn(2, 32, requires_grad=True)
    stored = block.quantize(torch.zeros(2, 32), "mxfp4")
    assert block.quantize(w, "mxfp4", out=stored) is stored
    assert torch.equal(stored.codes, block.quantize(w.detach(), "mxfp4").codes)
    with torch.no_grad():
        assert torch.equal(block.round(w, "mxfp4", out=torch.empty(2, 32)), block.round(w.detach(), "mxfp4"))


def test_stored_values_come_in_a_float_dtype():
    """dequantize(torch.int32) truncated the values without a word, and 'float32' (a name)
    failed as a device string; elements() refused such dtypes already."""
    stored = block.quantize(torch.tensor([[2.5, 0.3] * 16]), "mxfp4")
    for call in (stored.dequantize, stored.block_scales, stored.elements):
        for dtype in (torch.int32, torch.bool, "float32"):
            with pytest.raises(TypeError, match="float dtype"):
                call(dtype)


def test_quantize_refuses_an_out_it_could_not_fill_whole_before_writing_it():
    """Scales that share memory (expanded) were refused by torch after the codes were
    written, and codes and scales over one buffer (or scales whose rows overlap) took
    results that clobbered each other; an NVFP4 out without its per-tensor scale (or an
    MX one with one) took codes and scales for a scale that went nowhere; a tensor scale
    that requires grad was written in place, which torch refuses for a leaf."""
    x = torch.randn(4, 64) * 1000
    buffer = torch.zeros(300, dtype=torch.uint8)
    for name, change, error, match in (
        ("mxfp8_e4m3", {"scales": torch.zeros(1, 1, dtype=torch.uint8).expand(4, 2)}, RuntimeError, "share"),
        ("mxfp8_e4m3", {"scales": buffer[:16].as_strided((4, 2), (1, 1))}, RuntimeError, "share"),
        ("mxfp8_e4m3", {"codes": buffer[:256].view(4, 2, 32), "scales": buffer[250:258].view(4, 2)},
         ValueError, "codes, scales and tensor_scale share memory"),
        ("nvfp4", {"tensor_scale": None}, ValueError, "per-tensor scale, so out.tensor_scale must be a 0-d"),
        ("mxfp4", {"tensor_scale": torch.ones(())}, ValueError, "no per-tensor scale, so out.tensor_scale"),
        ("nvfp4", {"tensor_scale": torch.ones((), requires_grad=True)}, RuntimeError, "requires grad"),
    ):
        out = replace(block.quantize(torch.ones(4, 64), name), **change)
        before = [t.clone() for t in (out.codes, out.scales, out.tensor_scale) if t is not None]
        with pytest.raises(error, match=match):
            block.quantize(x, name, out=out)
        after = [t for t in (out.codes, out.scales, out.tensor_scale) if t is not None]
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), name
    # Codes and scales cut apart from one buffer do not meet: taken, as before.
    apart = replace(block.quantize(torch.ones(4, 64), "mxfp8_e4m3"), codes=buffer[:256].view(4, 2, 32),
                    scales=buffer[256:264].view(4, 2))  # fmt: skip
    want = block.quantize(x, "mxfp8_e4m3")
    block.quantize(x, "mxfp8_e4m3", out=apart)
    assert torch.equal(apart.codes, want.codes) and torch.equal(apart.scales, want.scales)


def test_quantize_into_an_out_of_fake_tensors_or_under_make_fx():
    """The check that out's buffers do not overlap read their addresses before the op: a
    fake tensor's are not its own (every pair overlapped, refused), and make_fx's proxies
    have none (torch's error). It runs in the op's kernel, on real tensors, now."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def into(x, codes, scales):
        block.quantize(x, "mxfp4", out=block.BlockTensor(codes, scales, None, fmt, x.shape, 1))
        return codes, scales

    x, fmt = torch.randn(4, 64), block.format("mxfp4")
    want = block.quantize(x, "mxfp4")
    with FakeTensorMode():
        fake = torch.randn(4, 64)
        block.quantize(fake, "mxfp4", out=block.quantize(fake, "mxfp4"))
    buffers = (torch.empty_like(want.codes), torch.empty_like(want.scales))
    for mode in ("fake", "symbolic"):
        codes, scales = make_fx(into, tracing_mode=mode)(x, *buffers)(x, *map(torch.empty_like, buffers))
        assert torch.equal(codes, want.codes) and torch.equal(scales, want.scales), mode


@pytest.mark.filterwarnings("error::UserWarning")  # Dynamo's warning on tracing a registry's cache
def test_quantize_and_out_under_torch_compile():
    """quantize, and the writing ops, under the user's torch.compile(fullgraph=True) with a
    tensor seed; a format named for the first time inside the compiled function."""
    x = torch.randn(4, 64)
    buf = torch.empty_like(x)
    stored = block.quantize(x, "mxfp8_e4m3")

    def step(x, seed):
        block.round(x, "mxfp4", "src", bits=3, seed=seed, out=buf)
        block.quantize(x, "mxfp8_e4m3", "src", bits=3, seed=seed, out=stored)
        return block.quantize(x, "bfp5_b16", "src", bits=3, seed=seed).dequantize()

    values = torch.compile(step, fullgraph=True)(x, torch.tensor(5))
    assert torch.equal(buf, block.round(x, "mxfp4", "src", bits=3, seed=5))
    assert torch.equal(stored.codes, block.quantize(x, "mxfp8_e4m3", "src", bits=3, seed=5).codes)
    assert torch.equal(values, block.round(x, "bfp5_b16", "src", bits=3, seed=5))


def test_dequantize_compiled_for_blocks_along_any_axis():
    """A compiled function dequantising BlockTensors of several block axes: Dynamo made the
    axis a symbol (dynamic=True, or the second axis it saw), and the dequantisation's
    list.pop at it failed with Dynamo's internal error."""
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    stored = [block.quantize(x, "mxfp4", axis=a) for a in (0, 1, 0)]
    for dynamic in (None, True):
        torch._dynamo.reset()
        dequantize = torch.compile(lambda t: t.dequantize(), fullgraph=True, dynamic=dynamic)
        for t in stored:
            assert torch.equal(dequantize(t), t.dequantize())
    both = torch.compile(lambda v, a: block.quantize(v, "mxfp4", axis=a).dequantize(), fullgraph=True)
    for a in (0, 1, -1):
        assert torch.equal(both(x, a), block.round(x, "mxfp4", axis=a))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_nvfp4_edges_of_the_tensor_scale(dtype):
    """NVFP4's per-tensor scale is a float32: float64 data beyond its range saturate (not
    NaN everywhere), and a tensor too small for amax / 2688 in float32 keeps its values
    (the smallest positive float32 as its tensor scale, not 1, which flushed them all)."""
    big = torch.tensor([1e39 if dtype == torch.float64 else 3e38] + [1.0] * 15, dtype=dtype)
    out = block.round(big, "nvfp4")
    top = min(big[0].item(), torch.finfo(torch.float32).max)
    assert bool(torch.isfinite(out).all()) and 0.99 * top <= out[0] <= 1.01 * top, out[:2]
    assert torch.equal(out, block_round_reference(big, "nvfp4"))
    tiny = torch.tensor([6e-43, 3e-43] + [0.0] * 14, dtype=dtype)
    t = block.quantize(tiny, "nvfp4")
    assert t.tensor_scale == 2.0**-149
    # 9 * 2^-146 is the block scale (E4M3 72 times 2^-149): 6e-43 is 5.95 of it, so 6, and
    # 3e-43 is 2.97 of it, so 3.
    assert torch.equal(block.round(tiny, "nvfp4")[:2], torch.tensor([54, 27], dtype=dtype) * 2.0**-146)
    assert torch.equal(t.dequantize(dtype), block.round(tiny, "nvfp4"))
    assert torch.equal(block.round(tiny, "nvfp4"), block_round_reference(tiny, "nvfp4"))


def _tiny_data() -> torch.Tensor:
    """float32 rows near and below 2^-126: blocks whose E8M0 scale is 2^-127 (a float32
    subnormal) and whose values q * S are float32 subnormals, subnormal elements
    (2^-149 multiples, from their bits) among them, and NVFP4 tensor scales below 2^-126."""
    g = torch.Generator().manual_seed(stable_seed("block-ftz"))
    codes = torch.randint(-(1 << 23), 1 << 23, (64,), generator=g, dtype=torch.int32)
    return torch.stack([torch.randn(64, generator=g) * 2.0**-122, torch.randn(64, generator=g) * 2.0**-135,
                        torch.randn(64, generator=g) * torch.logspace(-149, -110, 64, base=2.0),
                        (codes & ~0x7F800000).view(torch.float32)])  # fmt: skip


def _block_results(x: torch.Tensor, name: str, axis: int) -> list[torch.Tensor]:
    """block.round, quantize's codes, scales and tensor scale, and dequantize of x."""
    stored = block.quantize(x, name, axis=axis)
    ts = [] if stored.tensor_scale is None else [stored.tensor_scale.view(torch.int32)]
    return [block.round(x, name, axis=axis).view(torch.int32), stored.codes, stored.scales, *ts,
            stored.dequantize().view(torch.int32)]  # fmt: skip


@pytest.mark.parametrize("config", [{}, {"compile": False}, pytest.param(
    {"native": False, "compile_threshold": 0}, marks=pytest.mark.slow)])  # fmt: skip
def test_tiny_data_keeps_its_bits_under_flush_denormal(config):
    """torch.set_flush_denormal(True) (FTZ and DAZ on the thread) made float32 subnormals 0
    in the torch kernel's float ops: a block's amax, its scale 2^-127 and x / S, q * S, and
    NVFP4's tensor scale (on the native path too: amax / 2688, and the native kernel's
    amax, read back as a float); rounded, quantised or dequantised, such data came out 0
    (mxfp8_e4m3 of randn * 2^-122: all of it). The config's defaults run the native kernel
    along the last axis and the eager torch kernel along the first (4 rows: under one
    block); the reference computed in float32 and numpy, which flush too. All of them now
    give the bits they give with it off (which test_mx_formats_agree_with_gfloat_block_api
    holds to gfloat for tiny blocks, as here). Compiled, for two formats (seconds a spec)."""
    x = _tiny_data()
    names = [*MX, "nvfp4", "hbfp4", "mx_binary8p4"] if config.get("native", True) else ["mxfp8_e4m3", "nvfp4"]
    cases = [(name, axis) for name in names for axis in (-1, 0)]
    want = {case: _block_results(x, *case) for case in cases}
    refs = ["mxfp8_e4m3", "mxint8", "nvfp4"]
    rb = x.view(torch.int32) & 7
    want_ref = {name: block_round_reference(x, name, "src", bits=3, random_bits=rb) for name in refs}
    assert all(bool(w[0].count_nonzero()) for w in want.values())
    from gfloat import compute_scale_amax, encode_block

    for name in set(MX) & set(names):  # along rows, blocks of 32: gfloat's codes
        fi, stored = _gfloat_block(name), want[name, -1]
        for row, vals in enumerate(x.view(-1, 32).double().numpy()):
            scale = compute_scale_amax(fi.etype.emax, vals)
            codes = list(encode_block(fi, scale, vals / scale, gfloat_mode("rne")))
            elements = stored[1].view(-1, stored[1].shape[-1])[row]
            if block.format(name).packed:
                elements = torch.stack([elements & 0xF, elements >> 4], -1).flatten()
            assert [int(stored[2].flatten()[row]), *elements.tolist()] == codes, (name, row)
    torch.set_flush_denormal(True)
    try:
        with fewbit.configure(**config):
            got = {case: _block_results(x, *case) for case in cases}
        got_ref = {name: block_round_reference(x, name, "src", bits=3, random_bits=rb) for name in refs}
    finally:
        torch.set_flush_denormal(False)
    for case in cases:
        for i, (g, w) in enumerate(zip(got[case], want[case], strict=True)):
            assert torch.equal(g, w), (case, i)
    for name in refs:
        assert torch.equal(got_ref[name].view(torch.int32), want_ref[name].view(torch.int32)), name


@pytest.mark.parametrize("native", [True, False])
def test_nvfp4_rule_up_clips_nothing(native):
    """Under rule "up" the per-tensor scale ts = amax / 2688 and each block's S = scale * ts
    were rounded to nearest in float32: where both rounded down, the tensor's largest
    element lay above 6 S and saturated (below itself under rup, refused with sat=False);
    S alone rounding down did the same to other blocks: a sixth of N(0, 1) tensors."""
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 1.902856469154358, 0.5  # ts and 448 ts both round down
    gen = torch.Generator().manual_seed(0)
    xs = [x, *(torch.randn(8, 64, generator=gen) for _ in range(60))]
    with fewbit.configure(native=native):
        for t in xs:
            stored = block.quantize(t, "nvfp4", "rne", rule="up")
            factor = stored.block_scales().double().repeat_interleave(16, dim=-1)
            assert bool((t.abs().double() <= 6 * factor).all())
            up = block.round(t, "nvfp4", "rup", rule="up", sat=False)  # nothing overflows: no error
            assert torch.equal(up, block_round_reference(t, "nvfp4", "rup", rule="up"))
        # (rup is below x only where x / S, one float32 division, rounds down onto an element.)
        assert block.round(x, "nvfp4", "rup", rule="up")[0, 0] >= x[0, 0]
        # The per-tensor scale moves only by the float32 steps that rule "up" needs.
        ts = block.quantize(x, "nvfp4", rule="up").tensor_scale.item()
        nearest = np.float32(block.quantize(x, "nvfp4").tensor_scale.item())
        assert ts == np.nextafter(nearest, np.float32(np.inf))  # one float32 step


def test_nvfp4_rule_up_clips_no_float64_data():
    """float64 data's largest magnitude was rounded to nearest in float32 before the
    per-tensor scale was raised to cover it: where it rounded down (2.1543860756514377,
    and 32 of 400 N(0, 1) tensors), it saturated under "up" all the same."""
    x = torch.zeros(1, 16, dtype=torch.float64)
    x[0, 0], x[0, 1] = 2.1543860756514377, 0.5
    assert float(np.float32(x[0, 0].item())) < x[0, 0].item()  # float32 rounds it down
    gen = torch.Generator().manual_seed(1)
    for t in [x, *(torch.randn(4, 64, generator=gen, dtype=torch.float64) for _ in range(100))]:
        stored = block.quantize(t, "nvfp4", "rne", rule="up")
        factor = stored.block_scales().double().repeat_interleave(16, dim=-1)
        assert bool((t.abs() <= 6 * factor).all())
        up = block.round(t, "nvfp4", "rup", rule="up", sat=False)
        assert bool((up >= t).all())
        assert torch.equal(up, block_round_reference(t, "nvfp4", "rup", rule="up"))


def blocks_whose_s_rounds_short(element: str = "e2m3") -> tuple[block.BlockFormat, torch.Tensor]:
    """NVFP4's scaling (blocks of 16, E4M3 scales, a per-tensor scale ts) over ``element``,
    rule "up", and a row of blocks where S = s ts, s a block's E4M3 scale (amax / M / ts
    rounded up), rounds to nearest in float32 below amax / M: each block's largest
    magnitude lies in (M fl32(s ts), M s ts]. Block 0 holds the tensor's largest, which
    sets ts. (With E2M1, M = 6, no float32 lies there: only ts needs raising.)"""
    bfmt = block.BlockFormat(f"{element}_ts", fewbit.format(element), 16, fewbit.format("e4m3"), "up", True)
    top, big = bfmt.element.max, 5.55  # (a ts where 29 E4M3 scales need it)
    ts = np.float32(tensor_scale_reference(big, bfmt, "up"))
    rows = [[big] + [0.0] * 15]
    for s in fewbit.format("e4m3").values():
        exact = float(np.float64(s) * np.float64(ts))  # s ts, exact in float64
        if 0 < s < bfmt.scale.max and float(np.float32(exact)) < exact:
            a = np.float32(top * exact)
            a = a if float(a) <= top * exact else np.nextafter(a, np.float32(-np.inf))
            if top * float(np.float32(exact)) < float(a) <= big:
                rows.append([float(a), -float(a) / 3, float(a) / 7] + [0.0] * 13)
    return bfmt, torch.tensor(rows, dtype=torch.float32).reshape(1, -1)


@pytest.mark.parametrize("native", [True, False])
def test_rule_up_takes_the_next_block_scale_where_s_rounds_short(native):
    """S = scale * ts, rounded to nearest in float32, lay below amax / M for some blocks:
    their largest elements saturated. The next scale is taken there (E2M3's M = 7.5)."""
    bfmt, x = blocks_whose_s_rounds_short()
    assert x.numel() == 16 * 30  # blocks that need it
    with fewbit.configure(native=native):
        stored = block.quantize(x, bfmt, "rne")
        factor = stored.block_scales().double().repeat_interleave(16, dim=-1)
        assert bool((x.abs().double() <= bfmt.element.max * factor).all())
        assert torch.equal(block.round(x, bfmt, "rup", sat=False), block_round_reference(x, bfmt, "rup"))
        assert torch.equal(stored.dequantize(), block_round_reference(x, bfmt, "rne"))


def test_nvfp4_quotients_are_formed_in_the_working_dtype_and_never_flush():
    """The reference forms x / S as the kernel does: in float64 for float64 data, and a
    nonzero quotient below the working float's normal range rounds as the exact one
    (directed modes away from 0 give the smallest element, not 0)."""
    x = torch.zeros(16)
    x[0] = 1.0
    # S = 1/6 (rounded to float32): x / S is 5.99999998 in float64 (rtz: 4), 6 in float32.
    assert block.round(x, "nvfp4", "rtz")[0] == 1.0
    wide = block.round(x.double(), "nvfp4", "rtz")
    assert wide[0] < 0.7 and torch.equal(wide, block_round_reference(x.double(), "nvfp4", "rtz"))
    y = torch.zeros(32)
    y[0], y[16] = 1e30, 1e-30  # the second block's scale is E4M3's smallest times ~1e30/2688
    for mode in ("rup", "rne", "rdn"):
        got = block.round(y, "nvfp4", mode, rule="up")
        assert torch.equal(got, block_round_reference(y, "nvfp4", mode, rule="up")), mode
    assert block.round(y, "nvfp4", "rup", rule="up")[16] > 0


def test_a_block_whose_scale_is_0_keeps_its_zeros_signs():
    """An NVFP4 block whose E4M3 scale is 0 (a block of -0.0; tiny values beside 1e30)
    holds zeros signed as x: E2M1 has a -0 (code 0b1000), which MX blocks and fewbit.round
    keep. Native kernel, eager torch kernel and reference, codes and values (the compiled
    kernel: test_compiled_kernel_gives_the_eager_bits)."""
    x = torch.ones(2, 48)
    x[0, :16], x[0, 16] = -0.0, 1e30
    x[1, :16] = -1e-30
    x[1, 32:] = 1e-30 * (-1.0) ** torch.arange(16)
    zeros = torch.zeros(2, 48, dtype=torch.bool)
    zeros[:, :16] = zeros[1, 32:] = True
    for mode, kw in [("rne", {}), ("rup", {}), ("src", {"bits": 3, "seed": 2}), ("sr", {"seed": 2})]:
        for config in ({}, {"compile": False}):
            with fewbit.configure(**config):
                got, stored = block.round(x, "nvfp4", mode, **kw), block.quantize(x, "nvfp4", mode, **kw)
            where = f"{mode} {config}"
            assert bool((got[zeros] == 0).all()), where
            assert torch.equal(torch.signbit(got[zeros]), torch.signbit(x[zeros])), where
            assert stored.scales[0, 0] == 0 and stored.scales[1, 0] == 0, where
            assert bool((stored.codes[:, 0] == 0x88).all()), where  # two E2M1 -0s a byte
            assert torch.equal(torch.signbit(stored.dequantize()), torch.signbit(got)), where
        if "seed" not in kw:
            reference = block_round_reference(x, "nvfp4", mode, **kw)
            assert torch.equal(torch.signbit(reference), torch.signbit(got)), mode


def test_a_block_format_with_float32_scales_rounds_but_is_not_stored():
    """block.quantize keeps uint8 scale codes: a float32 scale has none, and quantize
    says so (block.round works)."""
    bf = block.BlockFormat("e2m1_f32", fewbit.format("e2m1"), 16, fewbit.format("binary32"), rule="nearest")
    x = torch.randn(4, 64)
    assert torch.equal(block.round(x, bf), block_round_reference(x, bf))
    with pytest.raises(ValueError, match="binary32 scales have no 8-bit code"):
        block.quantize(x, bf)
    with pytest.raises(Exception, match="binary32 scales have no 8-bit code"):  # Dynamo wraps it
        torch.compile(lambda t: block.quantize(t, bf).codes, fullgraph=True, backend="eager")(x)
    with pytest.raises(ValueError, match="binary32 scales have no 8-bit code"):
        LowPrecisionWeights(torch.optim.SGD([torch.nn.Parameter(x)], lr=0.1), bf, store_codes=True)


def test_a_format_has_one_name_whichever_alias_reaches_it():
    """Aliases name one format: ``out=`` of one takes a call of the other."""
    names = [("mx_e2m1", "mxfp4_e2m1"), ("mx_ocp_e4m3", "mxfp8_e4m3"), ("mx_int8", "mxint8"),
             ("hbfp08", "hbfp8"), ("bfp6_b064", "hbfp6"), ("bfp8_b32", "mxint8"), ("MXFP4", "mxfp4_e2m1")]
    for alias, name in names:
        assert block.format(alias) == block.format(name) and block.format(alias).name == name, alias
    x = torch.randn(4, 64)
    stored = block.quantize(x, "mxfp4")
    assert block.quantize(x * 2, "mx_e2m1", out=stored) is stored
    assert torch.equal(stored.dequantize(), block.round(x * 2, "mxfp4"))


def test_a_0d_tensor_is_refused_for_what_it_is():
    with pytest.raises(ValueError, match="at least one dimension"):
        block.round(torch.tensor(1.0), "mxfp4")


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4"])
def test_quantize_refuses_an_inference_blocktensor_as_out_before_writing_it(name):
    """Outside inference mode torch refuses to write an inference tensor: quantize refuses
    such an out first, as fewbit.round(out=) and block.round(out=) do, and writes none of
    its codes, scales or tensor scale (before: written, then refused, or not at all)."""
    x = torch.linspace(-3, 3, 4 * 64).view(4, 64)
    with torch.inference_mode():
        stored = block.quantize(torch.zeros(4, 64), name)
    before = [t.clone() for t in (stored.codes, stored.scales, stored.tensor_scale) if t is not None]
    with pytest.raises(RuntimeError, match="fewbit.block.quantize: out is an inference tensor"):
        block.quantize(x, name, out=stored)
    after = [t for t in (stored.codes, stored.scales, stored.tensor_scale) if t is not None]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    with torch.inference_mode():  # inside, as torch's own ops
        assert block.quantize(x, name, out=stored) is stored
        assert torch.equal(stored.dequantize(), block.round(x, name))


def test_a_per_tensor_scale_is_refused_unless_the_block_scale_is_e4m3():
    """An E8M0 (or float32) scale with tensor_scale=True was accepted, and the native kernel,
    the torch path and quantize().dequantize() gave three different answers."""
    e2m1, e8m0 = fewbit.format("e2m1"), fewbit.format("e8m0")
    with pytest.raises(ValueError, match="per-tensor scale is for ocp_e4m3 block scales.*not ocp_e8m0"):
        block.BlockFormat("mx_ts", e2m1, 32, e8m0, tensor_scale=True)
    with pytest.raises(ValueError, match="not binary32; set tensor_scale=False"):
        block.BlockFormat("f32_ts", e2m1, 16, fewbit.format("binary32"), rule="nearest", tensor_scale=True)
    nvfp4 = block.format("nvfp4")
    assert block.BlockFormat("nvfp4_again", e2m1, 16, fewbit.format("e4m3"), "nearest", True) == replace(
        nvfp4, name="nvfp4_again")


def test_a_block_formats_element_and_scale_keep_their_names():
    """A hand-made element format under a registered name (other fields) was rounded to by
    block.round and quantize; a scale named ocp_e8m0 with P = 2 passed a name-only check."""
    fake_e2m1 = FloatFormat("ocp_e2m1", 4, 3, 0, extended=False, has_nz=True)
    e8m0 = fewbit.format("e8m0")
    x = torch.randn(2, 64)
    bf = block.BlockFormat("blocks_of_fake_e2m1", fake_e2m1, 32, e8m0)
    for call in (block.round, block.quantize):
        with pytest.raises(ValueError, match="two formats are named 'ocp_e2m1'"):
            call(x, bf)
    # Refused before the block format's name was taken: one with the real e2m1 may have it.
    good = block.BlockFormat("blocks_of_fake_e2m1", fewbit.format("e2m1"), 32, e8m0)
    assert torch.equal(block.round(x, good), block.round(x, "mxfp4"))
    fake_e8m0 = FloatFormat("ocp_e8m0", 8, 2, 127, signed=False, extended=False, num_high_nans=1)
    with pytest.raises(ValueError, match="scale format must be one of"):
        block.BlockFormat("fake_scale", fewbit.format("e2m1"), 32, fake_e8m0, rule="nearest")


def test_block_formats_take_format_names_and_refuse_impossible_fields():
    e2m1, e8m0 = fewbit.format("e2m1"), fewbit.format("e8m0")
    named = block.BlockFormat("by_name", "e2m1", 32, "e8m0")
    assert (named.element, named.scale) == (e2m1, e8m0)
    with pytest.raises(ValueError, match="unknown format 'e2m2'"):
        block.BlockFormat("b", "e2m2", 32, e8m0)
    with pytest.raises(TypeError, match="a format is a name or a FloatFormat, not int"):
        block.BlockFormat("b", 4, 32, e8m0)
    with pytest.raises(TypeError, match="axis must be of type int, not str"):
        block.BlockFormat("b", e2m1, 32, e8m0, axis="a")
    with pytest.raises(TypeError, match="block_size must be of type int, not float"):
        block.BlockFormat("b", e2m1, 32.0, e8m0)
    with pytest.raises(TypeError, match="tensor_scale must be of type bool"):
        block.BlockFormat("b", e2m1, 32, e8m0, tensor_scale=0)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        block.BlockFormat("b", e2m1, 0, e8m0)


def test_blocktensors_compare_by_identity():
    """== on two BlockTensors compared their tensors and raised (a == b, a in [b])."""
    x = torch.randn(4, 64)
    a, b = block.quantize(x, "mxfp4"), block.quantize(x, "mxfp4")
    assert a == a and a != b and a in [b, a] and b not in [a] and len({a, b, a}) == 2


def test_blocktensors_and_formats_load_with_torch_loads_defaults():
    """torch.load (weights_only=True by default) refused BlockTensor, BlockFormat and FloatFormat."""
    x = torch.linspace(-5, 5, 2 * 32).view(2, 32)
    stored = block.quantize(x, "nvfp4")
    saved = {"t": stored, "bf": block.format("mxfp6_e3m2"), "f": fewbit.format("e4m3")}
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert (loaded["bf"], loaded["f"], loaded["t"].format) == (saved["bf"], saved["f"], stored.format)
    assert (loaded["t"].shape, loaded["t"].axis) == (stored.shape, stored.axis)
    for name in ("codes", "scales", "tensor_scale"):
        assert torch.equal(getattr(loaded["t"], name), getattr(stored, name)), name


# Memory (memory hunt): what a call allocates beyond its result.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_forms_the_product_in_the_decoded_elements(dtype):
    from conftest import peak_allocated

    # dequantize formed q * S in a second float32 tensor beside the decoded elements q: from
    # float32, twice the result's bytes; from bfloat16, five times.
    x = torch.randn(64, 256, dtype=dtype)
    q = block.quantize(x, "mxfp8_e4m3")
    work = 4 * x.numel()  # the float32 elements, which now take the product
    result = 0 if dtype == torch.float32 else x.nbytes  # (float32's is the elements themselves)
    assert peak_allocated(lambda: q.dequantize(dtype)) <= 1.25 * (work + result)  # (and the scales)
    assert torch.equal(q.dequantize(dtype), block.round(x, "mxfp8_e4m3"))


def _on_thread_whose_workers_flush(fn):
    """``fn()`` on a new thread that keeps subnormals while its intra-op threads flush
    them: torch.set_flush_denormal sets the calling thread's flags alone, and its OpenMP
    pool, started by its first parallel op, keeps those its threads began with. Returns
    the result, or skips where torch's workers do not take the flags so (one thread,
    another parallel backend)."""

    def body():
        torch.set_flush_denormal(True)
        try:
            torch.ones(1 << 17).mul_(2.0)  # the thread's pool starts here, flushing
        finally:
            torch.set_flush_denormal(False)
        smallest = torch.ones(1 << 17, dtype=torch.int32).view(torch.float32)  # 2^-149 each
        return bool(smallest.mul(1.0).eq(0).any()), fn()

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            workers_flush, result = pool.submit(body).result()
    finally:
        torch.set_num_threads(threads)
    if not workers_flush:
        pytest.skip("torch's intra-op threads here do not keep the flags they started with")
    return result


@pytest.mark.parametrize("config", [{"compile": False},
                                    pytest.param({"native": False}, marks=pytest.mark.slow)])  # fmt: skip
def test_tiny_data_keeps_its_bits_where_only_the_workers_flush(config):
    """The torch kernels probed FTZ and DAZ on the calling thread alone (kernel.flushes)
    and took the float32 ops where it kept subnormals, but torch splits a tensor of 2^15
    elements or more among its OpenMP threads, which may flush where the caller does not
    (a thread whose pool started under torch.set_flush_denormal(True), cleared since):
    data near 2^-126 came out 0 on those threads' share, eager, compiled, and in
    dequantize after the native kernel's quantize (4 x 8256 such values, every format,
    along either axis: values, codes and the tensor scale). They probe the workers too now."""
    x = _tiny_data().repeat(1, 129)  # just over 2^15 elements
    cases = [("mxint8", -1), ("nvfp4", 0)]
    with fewbit.configure(**config):
        want = {case: _block_results(x, *case) for case in cases}
        got = _on_thread_whose_workers_flush(lambda: {case: _block_results(x, *case) for case in cases})
    for case in cases:
        for i, (g, w) in enumerate(zip(got[case], want[case], strict=True)):
            assert torch.equal(g, w), (case, i)


def test_quantize_blocks_defaults_to_the_way_exact_under_flushing():
    """kernel.quantize_blocks took the float32 ops by default (flushed=False), where the
    helpers it calls default to the exact way: called without it by a thread that
    flushes, mxfp8_e4m3 blocks of _tiny_data's first rows came out 0. The default is the
    exact way now, which gives flushing off's bits either way."""
    from fewbit.block.kernel import block_layout, make_block_spec, quantize_blocks

    x = _tiny_data()
    bfmt = block.format("mxfp8_e4m3")
    spec = make_block_spec(x.dtype, bfmt, bfmt.rule, fewbit.RoundMode.RNE, True, None, None)
    blocks = block_layout(x, -1, bfmt.block_size)
    want = quantize_blocks(blocks, spec, None, None, flushed=False)
    torch.set_flush_denormal(True)
    try:
        got = quantize_blocks(blocks, spec, None, None)
    finally:
        torch.set_flush_denormal(False)
    assert want[0].count_nonzero()
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g.view(torch.int32), w.view(torch.int32)), i
