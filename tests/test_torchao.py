"""fewbit's block formats beside torchao's MX and NVFP4 code, where torchao is installed (it
is not a test dependency: CI skips this file). The README's "Beside torchao" says what
agrees and where the two part; these tests hold both sides of that to the installed
torchao (written against 0.18.0, its eager CPU code)."""

import pytest
import torch

import fewbit.block as block
from fewbit.block.formats import BlockFormat

mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
config = pytest.importorskip("torchao.prototype.mx_formats.config")
constants = pytest.importorskip("torchao.prototype.mx_formats.constants")
nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")

RULES = {"floor": "FLOOR", "ceil": "CEIL", "rceil": "RCEIL", "even": "EVEN"}
ELEMENTS = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2,
            "mxfp6_e3m2": constants.DTYPE_FP6_E3M2, "mxfp6_e2m3": constants.DTYPE_FP6_E2M3,
            "mxfp4": torch.float4_e2m1fn_x2}  # fmt: skip
#: torchao's NVFP4 default: block scales alone, no per-tensor scale.
ONE_LEVEL = BlockFormat("nvfp4_one_level", "ocp_e2m1", 16, "ocp_e4m3", rule="nearest")


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return (t if t.dtype == torch.uint8 else t.view(torch.uint8)).reshape(-1)


def torchao_mx(x: torch.Tensor, name: str, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's E8M0 scale bytes and element bytes of x in blocks of 32 along its last axis."""
    scale, data = mx.to_mx(x, ELEMENTS[name], 32, getattr(config.ScaleCalculationMode, RULES[rule]))
    return as_bytes(scale), as_bytes(data)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ELEMENTS)
def test_mx_scales_and_codes_are_torchaos_bytes_under_every_rule(name, dtype):
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(5))
    for k in (-100, -3, 0, 3, 100):  # (2^k x is exact: only the exponents move)
        xk = (x * 2.0**k).to(dtype)
        for rule in RULES:
            t = block.quantize(xk, name, "rne", rule=rule)
            scales, codes = torchao_mx(xk, name, rule)
            assert torch.equal(as_bytes(t.scales), scales), (rule, k)
            assert torch.equal(as_bytes(t.codes), codes), (rule, k)


def test_nvfp4_codes_scales_and_tensor_scale_are_torchaos_with_or_without_a_tensor_scale():
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(5))
    t = block.quantize(x, "nvfp4", "rne")
    tensor_scale = nv.per_tensor_amax_to_scale(x.abs().max())
    assert torch.equal(t.tensor_scale, tensor_scale.reshape(t.tensor_scale.shape))
    for fmt, given in (("nvfp4", tensor_scale), (ONE_LEVEL, None)):
        t = block.quantize(x, fmt, "rne")
        scales, codes = nv.nvfp4_quantize(x, 16, given)
        assert torch.equal(as_bytes(t.scales), as_bytes(scales)), fmt
        assert torch.equal(as_bytes(t.codes), as_bytes(codes)), fmt


def test_where_the_two_part_as_the_readme_says():
    """A block under an E8M0 scale of 2^-127: torchao stores that scale and divided by
    2^-126, so its values read back halved. An NVFP4 block whose scale is an E4M3
    subnormal: torchao clamps it to 2^-6 (code 0x08)."""
    x = torch.zeros(1, 32)
    x[0, :2] = torch.tensor([2.0**-125, 2.0**-127])
    scale, data = mx.to_mx(x, torch.float4_e2m1fn_x2, 32, config.ScaleCalculationMode.FLOOR)
    theirs = mx.to_dtype(data, scale, torch.float4_e2m1fn_x2, 32, torch.float32)
    ours = block.quantize(x, "mxfp4").dequantize(torch.float32)
    assert as_bytes(scale).tolist() == as_bytes(block.quantize(x, "mxfp4").scales).tolist() == [0]
    assert torch.equal(ours, x) and torch.equal(theirs, x / 2)
    y = torch.zeros(1, 16)
    y[0, :2] = torch.tensor([0.03, 0.01])
    assert as_bytes(block.quantize(y, ONE_LEVEL).scales).tolist() == [0x03]
    assert as_bytes(nv.nvfp4_quantize(y, 16, None)[0]).tolist() == [0x08]
