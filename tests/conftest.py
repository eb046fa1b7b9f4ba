"""Shared test helpers: thread settings, the fewbit -> gfloat mapping, bit-exact checks.

gfloat is imported lazily, inside the helpers that need it, so test files that do not
compare against gfloat run without it.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

import fewbit
from fewbit.formats import FloatFormat

# The suite runs under pytest-xdist with one worker per core. Torch's intra-op thread
# pool on top of that oversubscribes the cores, and on a loaded machine every
# elementwise op then pays for spinning threads (measured: 65,536-element ops 10-100x
# slower with 2 threads than with 1). One thread per worker.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items) -> None:
    """The tests marked slow first, each file's in its order: pytest-xdist hands tests out
    in this order, so the two workers start on the long ones and the short ones even out
    the end, where a long one left for last kept one worker busy while the other idled."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# Integer dtype of the same width, to compare and print bit patterns.
INT_VIEW = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}

# Bits of each torch float dtype, for hex printing.
WIDTH = {torch.float16: 16, torch.bfloat16: 16, torch.float32: 32, torch.float64: 64}

#: fewbit mode name -> gfloat RoundMode attribute name (the modes gfloat implements).
GFLOAT_MODE_NAMES = {
    "rne": "TiesToEven",
    "rna": "TiesToAway",
    "rtz": "TowardZero",
    "rup": "TowardPositive",
    "rdn": "TowardNegative",
    "srff": "StochasticFastest",
    "srf": "StochasticFast",
    "src": "Stochastic",
    "src_odd": "StochasticOdd",
}
DETERMINISTIC_MODES = ("rne", "rna", "rtz", "rup", "rdn")
FEW_BIT_SR_MODES = ("srff", "srf", "src", "src_odd")


def gfloat_mode(mode: str):
    import gfloat

    return getattr(gfloat.RoundMode, GFLOAT_MODE_NAMES[mode])


_GFLOAT_FIXED = {
    "binary16": "format_info_binary16",
    "bfloat16": "format_info_bfloat16",
    "binary32": "format_info_binary32",
    "binary64": "format_info_binary64",
    "ocp_e5m2": "format_info_ocp_e5m2",
    "ocp_e4m3": "format_info_ocp_e4m3",
    "ocp_e3m2": "format_info_ocp_e3m2",
    "ocp_e2m3": "format_info_ocp_e2m3",
    "ocp_e2m1": "format_info_ocp_e2m1",
    "ocp_e8m0": "format_info_ocp_e8m0",
    "ocp_int8": "format_info_ocp_int8",
}


def gfloat_format(fmt: FloatFormat | str):
    """The gfloat FormatInfo of a fewbit format (named OCP/IEEE ones, or any P3109)."""
    import gfloat.formats as gf
    from gfloat import Domain, Signedness

    fmt = fewbit.format(fmt)
    if fmt.name in _GFLOAT_FIXED:
        return getattr(gf, _GFLOAT_FIXED[fmt.name])
    return gf.format_info_p3109(
        fmt.k,
        fmt.p,
        Signedness.Signed if fmt.signed else Signedness.Unsigned,
        Domain.Extended if fmt.extended else Domain.Finite,
    )


def has_finite_max(fmt: FloatFormat) -> bool:
    """False for wide P3109 formats whose range goes beyond float64."""
    try:
        _ = (fmt.max, fmt.smallest_subnormal)
    except ValueError:
        return False
    return True


def blocks_eager_and_compiled(eager: list, compiled: list, x: torch.Tensor,
                              backward: bool = False) -> tuple[list, list, int]:  # fmt: skip
    """Chains of blocks run on x, ``eager`` as they are and each of ``compiled`` compiled
    apart (fullgraph, aot_eager), as users of FSDP2 compile a model: each chain's output
    (and with ``backward``, x's gradient from the sum of the output's squares), and the
    graphs Dynamo made (from a fresh cache: an earlier test's graph, whose guards now pass
    on equal formats however made, would count none)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    for b in compiled:
        b.compile(fullgraph=True, backend="aot_eager")
    results = []
    for chain in (eager, compiled):
        v = x.clone().requires_grad_(backward)
        out = v
        for b in chain:
            out = b(out)
        if backward:
            out.square().sum().backward()
        results.append([out] + ([v.grad] if backward else []))
    return results[0], results[1], counters["stats"]["unique_graphs"]


def stable_seed(*parts) -> int:
    """A seed fixed by the case's description (never Python's salted hash)."""
    return zlib.crc32("|".join(str(p) for p in parts).encode())


def int_bits(t: torch.Tensor) -> np.ndarray:
    """Bit patterns of a float tensor, as a numpy integer array."""
    return t.contiguous().view(INT_VIEW[t.dtype]).numpy()


def hexbits(t: torch.Tensor) -> list[str]:
    """Each element's bit pattern as a fixed-width hex string."""
    w = WIDTH[t.dtype]
    mask = (1 << w) - 1
    return [f"0x{int(b) & mask:0{w // 4}x}" for b in int_bits(t).reshape(-1)]


def bitwise_mismatches(got: torch.Tensor, expected: torch.Tensor) -> np.ndarray:
    """Indices where got and expected differ: NaN matches any NaN, else exact bits
    (signed zero included)."""
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    both_nan = (torch.isnan(got) & torch.isnan(expected)).numpy()
    differ = int_bits(got) != int_bits(expected)
    return np.flatnonzero(differ & ~both_nan)


def describe_mismatches(
    x: torch.Tensor,
    got: torch.Tensor,
    expected: torch.Tensor,
    bad: np.ndarray,
    random_bits: torch.Tensor | None = None,
    limit: int = 6,
) -> str:
    """A few failing elements: input, fewbit's and the oracle's bits (and values); ``bad``
    holds positions in row-major order."""
    lines = []
    x, got, expected = x.reshape(-1), got.reshape(-1), expected.reshape(-1)
    random_bits = None if random_bits is None else random_bits.reshape(-1)
    pick = torch.as_tensor(bad[:limit], dtype=torch.int64)
    xs, gs, es = x[pick], got[pick], expected[pick]
    for i, (xh, gh, eh) in enumerate(zip(hexbits(xs), hexbits(gs), hexbits(es), strict=True)):
        rb = "" if random_bits is None else f" random_bits={int(random_bits[pick[i]])}"
        lines.append(
            f"    x={xh} ({float(xs[i])!r}){rb}: fewbit {gh} ({float(gs[i])!r}),"
            f" expected {eh} ({float(es[i])!r})"
        )
    more = f" (showing {min(limit, len(bad))})" if len(bad) > limit else ""
    return f"{len(bad)} mismatching elements{more}:\n" + "\n".join(lines)


def assert_bitwise_equal(
    got: torch.Tensor,
    expected: torch.Tensor,
    x: torch.Tensor,
    context: str,
    random_bits: torch.Tensor | None = None,
) -> None:
    """Fail, naming the case and a few failing inputs, unless got == expected bitwise."""
    bad = bitwise_mismatches(got, expected)
    if len(bad):
        raise AssertionError(
            f"{context}: " + describe_mismatches(x, got, expected, bad, random_bits)
        )


def peak_allocated(call) -> int:
    """The most bytes of torch's CPU allocator that ``call`` held at once beyond what was
    held before it (its result included while it was alive), from the profiler's memory
    events in time order: what an op allocates, for the tests of its memory."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())  # fmt: skip
    held = peak = 0
    for event in events:
        held += event.nbytes()
        peak = max(peak, held)
    return peak
