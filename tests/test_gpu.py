"""CUDA against CPU, bit for bit, for every mode, eager and compiled (skipped without a GPU).

The CPU kernels are checked against gfloat elsewhere; here the GPU must reproduce them
exactly. The inputs cover every bfloat16 and float16 pattern (as float32: subnormals of
the target, both sides of every binade boundary, Inf and NaN) plus random float32 bits,
which include float32 subnormals (the case that needs the GPU to keep denormals).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fewbit
from conftest import assert_bitwise_equal
from fewbit.rounding import RoundMode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FORMATS = ("binary8p4", "binary8p3", "p3109_k8p4sf", "ocp_e4m3", "ocp_e5m2", "ocp_e2m1", "ocp_e8m0",
           "binary8p1", "bfloat16", "binary16")


def inputs() -> torch.Tensor:
    every16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    rng = np.random.default_rng(3109)
    raw = rng.integers(0, 1 << 32, size=1 << 18, dtype=np.uint64).astype(np.uint32).view(np.int32)
    tiny = rng.integers(0, 1 << 23, size=1 << 12, dtype=np.int64).astype(np.int32)  # fp32 subnormals
    return torch.cat([
        every16.view(torch.bfloat16).float(),
        every16.view(torch.float16).float(),
        torch.from_numpy(raw).view(torch.float32),
        torch.from_numpy(tiny).view(torch.float32),
    ])


@pytest.fixture(scope="module")
def x() -> torch.Tensor:
    return inputs()


#: Each (format, mode, sat) compiles its own GPU kernel (seconds each), so fewer formats.
COMPILED = ("binary8p4", "ocp_e5m2")


@pytest.mark.parametrize(
    "name, compiled", [(n, False) for n in FORMATS] + [(n, True) for n in COMPILED]
)
def test_gpu_equals_cpu(x, name, compiled):
    fmt = fewbit.format(name)
    for mode in RoundMode:
        # A format with neither Inf nor NaN refuses out-of-range values unless saturating.
        for sat in (False, True) if fmt.has_nans or fmt.has_infs else (True,):
            xs = x
            if not fmt.has_nans:
                xs = xs[~torch.isnan(xs)]
            if not fmt.has_infs and not sat:
                xs = xs[~torch.isinf(xs)]
            kw = {}
            if mode.is_stochastic:
                kw["seed"] = 11
                if mode.takes_bits:
                    kw["bits"] = 3
                if mode is RoundMode.SR_FRACTION:
                    kw["fraction"] = 0.5
            with fewbit.configure(compile=False):
                cpu = fewbit.round(xs, fmt, mode, sat=sat, **kw)
            with fewbit.configure(compile=compiled):
                gpu = fewbit.round(xs.cuda(), fmt, mode, sat=sat, **kw)
            assert gpu.device.type == "cuda"
            assert_bitwise_equal(gpu.cpu(), cpu, xs, f"{name} {mode} sat={sat} compiled={compiled}")
