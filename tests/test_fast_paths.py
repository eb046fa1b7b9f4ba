"""The eager shortcut (rounding.magic) against the general kernel (fast.round_fast), bit
for bit, NaN payloads and signed zeros included.

Inputs, as float32: every bfloat16 and every float16 bit pattern, random float32 bit
patterns (subnormals, +-0, +-Inf and NaNs among them), and per format its values and
midpoints with their float32 neighbours, both sides of every binade boundary, its
subnormal range, and the values around its largest magnitude. Modes RNE, SRC with
several N, and SR; sat on and off.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fewbit
from conftest import assert_bitwise_equal, hexbits, stable_seed
from fewbit.formats import FloatFormat
from fewbit.random import random_bits
from fewbit.rounding import natural_sr_bits
from fewbit.rounding.checks import check_round_args, dtype_format
from fewbit.rounding.fast import round_fast
from fewbit.rounding.magic import magic_applies, round_magic

#: Formats the shortcut takes, and ones it leaves to the general kernel.
TAKEN = [
    "binary8p2", "binary8p3", "binary8p4", "binary8p5", "binary8p6", "binary8p7",
    "p3109_k8p4sf", "p3109_k6p3sf", "binary3p2", "ocp_e4m3", "ocp_e5m2", "ocp_e2m1",
    "ocp_e3m2", "ocp_e2m3", "binary16",
]
LEFT = ["binary8p1", "ocp_e8m0", "ocp_int8", "bfloat16", "p3109_k8p4ue", "p3109_k8p4uf"]

SR_BITS = (1, 2, 3, 4, 8)


def _bits16(dtype: torch.dtype) -> torch.Tensor:
    codes = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    return codes.view(dtype).float()


def _neighbours(v: np.ndarray) -> np.ndarray:
    v = v[np.isfinite(v)].astype(np.float32)
    return np.concatenate([v, np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(-np.inf))])


def _inputs(fmt) -> torch.Tensor:
    """Every 16-bit pattern, random float32 patterns and values chosen for ``fmt``."""
    rng = np.random.default_rng(stable_seed("fast_paths", fmt.name))
    random32 = np.frombuffer(rng.bytes(4 << 16), dtype=np.float32)
    vals = fmt.values()
    vals = np.unique(vals[np.isfinite(vals)])
    mids = (vals[:-1] + vals[1:]) / 2
    binades = np.ldexp(1.0, np.arange(max(fmt.min_ulp_exponent - 3, -149), min(fmt.emax + 4, 128)))
    top = np.array([fmt.max * (1 + f * fmt.eps) for f in (-1, -0.5, -0.25, 0, 0.25, 0.5, 0.75, 1, 2)])
    sub = fmt.smallest_normal * rng.random(1 << 12)
    chosen = np.concatenate([vals, mids, binades, top, sub])
    chosen = _neighbours(np.concatenate([chosen, -chosen]))
    return torch.cat([_bits16(torch.bfloat16), _bits16(torch.float16),
                      torch.from_numpy(random32.copy()), torch.from_numpy(chosen)])


def _cases(fmt):
    yield "rne", None
    for n in sorted({*SR_BITS, 21 - fmt.t}):  # t + N = 21: the most the shortcut takes
        yield "src", n
    yield "sr", natural_sr_bits(dtype_format(torch.float32), fmt)


def test_formats_taken_and_left():
    x = torch.zeros(1)
    for name in TAKEN:
        assert magic_applies(check_round_args(x, name, "rne", False, None, None), torch.float32), name
    for name in LEFT:
        assert not magic_applies(check_round_args(x, name, "rne", False, None, None), torch.float32), name
    spec = check_round_args(x, "binary8p4", "src", False, 3, None)
    assert not magic_applies(spec, torch.float64)
    for mode, bits in [("srff", 3), ("srf", 3), ("src_odd", 3), ("rtz", None), ("sr_near_zero", 3)]:
        assert not magic_applies(check_round_args(x, "binary8p4", mode, False, bits, None), torch.float32)
    # SR from float32 to binary8p4 takes N = D = 20 bits: more than C's binade holds.
    assert not magic_applies(check_round_args(x, "binary8p4", "sr", False, None, None), torch.float32)


@pytest.mark.parametrize("name", TAKEN)
def test_shortcut_equals_general_kernel(name):
    fmt = fewbit.format(name)
    x = _inputs(fmt)
    gen = torch.Generator().manual_seed(stable_seed("fast_paths_bits", name))
    for mode, n in _cases(fmt):
        rand = None if n is None else torch.randint(0, 1 << n, x.shape, generator=gen, dtype=torch.int32)
        for sat in (False, True):
            spec = check_round_args(x, fmt, mode, sat, n, None)
            if not magic_applies(spec, x.dtype):
                assert mode == "sr" and fmt.t + n > 21, (name, mode, n)
                continue
            got = round_magic(x, spec, rand, out=torch.empty_like(x))
            want = round_fast(x, spec, rand)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), \
                _first_difference(x, got, want, f"{name} {mode} N={n} sat={sat}")


def test_shortcut_leaves_grids_that_reach_float32_subnormals_under_flush_denormal():
    """The float adder computes in float32, which torch.set_flush_denormal(True) (FTZ and
    DAZ) flushes below 2^-126: a format made by hand whose subnormals are float32 ones, or
    whose grid 2^(min_ulp - N) is fine enough to round float32 subnormals away from 0,
    came out 0 there (eager; the native kernel clears FTZ). Such formats go to the
    general kernel, which builds subnormals in integers."""
    formats = [FloatFormat("fast_paths_hm_k10p4", 10, 4, 126), FloatFormat("fast_paths_hm_k12p8", 12, 8, 125),
               FloatFormat("fast_paths_hm_k9p3", 9, 3, 120)]  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(-(1 << 31), (1 << 31) - 1, (1 << 12,), generator=gen, dtype=torch.int64)
    codes = (codes & 0x807FFFFF) | (torch.randint(0, 9, codes.shape, generator=gen) << 23)  # below 2^-118
    x = codes.to(torch.int32).view(torch.float32)
    rand = torch.randint(0, 8, x.shape, generator=gen, dtype=torch.int32)
    for fmt in formats:
        for mode, n, bits in [("rne", None, None), ("src", 3, rand)]:
            spec = check_round_args(x, fmt, mode, False, n, None)
            want = round_fast(x, spec, bits)
            torch.set_flush_denormal(True)
            try:
                with fewbit.configure(compile=False):
                    got = fewbit.round(x, fmt, mode, bits=n, random_bits=bits)
            finally:
                torch.set_flush_denormal(False)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), \
                _first_difference(x, got, want, f"{fmt.name} {mode}")
    # The shortcut still takes a format made by hand whose grid stays above them.
    assert magic_applies(check_round_args(x, formats[2], "src", False, 3, None), torch.float32)


def _first_difference(x, got, want, context: str) -> str:
    i = int(torch.nonzero(got.view(torch.int32) != want.view(torch.int32))[0])
    hexes = [hexbits(t[i : i + 1])[0] for t in (x, got, want)]
    return f"{context}: x={x[i].item()!r} ({hexes[0]}): {hexes[1]} != {hexes[2]}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@fewbit.configure(compile=False, eager_chunk=5000)
def test_16_bit_inputs_through_round(dtype):
    # The whole call: chunks (small here, so several), the dtype round trip, bits
    # given or drawn from a seed, errors.
    x = _bits16(dtype).to(dtype)
    given = torch.randint(0, 8, x.shape, generator=torch.Generator().manual_seed(3), dtype=torch.int64)
    for mode, kw, bits in [("rne", {}, None), ("src", {"random_bits": given}, given),
                           ("src", {"seed": 7}, random_bits(x.shape, 3, 7))]:
        n = None if bits is None else 3
        for fmt in ("binary8p4", "ocp_e4m3"):
            got = fewbit.round(x, fmt, mode, sat=True, bits=n, **kw)
            want = round_fast(x.float(), check_round_args(x, fmt, mode, True, n, None), bits).to(dtype)
            assert_bitwise_equal(got, want, x, f"{dtype} {fmt} {mode} {list(kw)}")
    with pytest.raises(ValueError, match="use sat=True"):
        fewbit.round(x[x.isfinite()], "ocp_e2m1")
    with pytest.raises(ValueError, match="no NaN"):
        fewbit.round(torch.tensor([1.0, math.nan], dtype=dtype), "ocp_e2m1")
