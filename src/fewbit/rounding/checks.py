"""Argument checks shared by the reference and the fast implementation.

Everything here runs before any output is written, so a bad call never leaves a
half-rounded tensor behind.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import FloatFormat, format
from .modes import SELECT_BITS, RoundMode, natural_sr_bits, parse_mode

__all__ = ["RoundSpec", "check_round_args", "dtype_format"]

_DTYPE_FORMATS = {
    torch.float16: "binary16",
    torch.bfloat16: "bfloat16",
    torch.float32: "binary32",
    torch.float64: "binary64",
}


def dtype_format(dtype: torch.dtype) -> FloatFormat:
    """The FloatFormat of a torch floating dtype fewbit rounds."""
    if dtype not in _DTYPE_FORMATS:
        supported = ", ".join(str(d) for d in _DTYPE_FORMATS)
        raise TypeError(f"fewbit rounds tensors of {supported}; got {dtype}")
    return format(_DTYPE_FORMATS[dtype])


@dataclass(frozen=True)
class RoundSpec:
    """Validated arguments of one rounding call.

    ``bits`` is N, the random bits per element the mode consumes (None when
    deterministic); ``random_range`` is the exclusive bound on each random integer
    (2^N, or 2^(N + SELECT_BITS) for ``sr_fraction``). ``select_below``: ``sr_fraction``
    rounds an element stochastically iff its selection bits are below it,
    ``round(p * 2^SELECT_BITS)`` (an int, so a compiled kernel keeps it constant).
    """

    fmt: FloatFormat
    source: FloatFormat
    mode: RoundMode
    sat: bool
    bits: int | None
    select_below: int | None

    @property
    def random_range(self) -> int:
        extra = SELECT_BITS if self.mode is RoundMode.SR_FRACTION else 0
        return 1 << (self.bits + extra)


def check_round_args(
    x: torch.Tensor,
    fmt: FloatFormat | str,
    mode: RoundMode | str,
    sat: bool,
    bits: int | None,
    fraction: float | None,
) -> RoundSpec:
    """Validate everything but the random bits themselves; return the call's spec."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, not {type(x).__name__}")
    source = dtype_format(x.dtype)
    fmt = format(fmt)
    mode = parse_mode(mode)
    if not isinstance(sat, bool):
        raise TypeError(f"sat must be a bool, not {type(sat).__name__}")
    if not source.contains(fmt):
        raise ValueError(
            f"a {x.dtype} tensor cannot hold every value of {fmt.name}: round into a "
            f"wider dtype (float32 holds every format of up to 24 significand bits)"
        )
    if mode is RoundMode.SR_FRACTION:
        if fraction is None or isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise TypeError("mode 'sr_fraction' needs fraction=p, a number in [0, 1]")
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        select_below = round(fraction * (1 << SELECT_BITS))
    elif fraction is not None:
        raise ValueError(f"fraction is only for mode 'sr_fraction', not {mode.value!r}")
    else:
        select_below = None
    if not mode.is_stochastic:
        if bits is not None:
            raise ValueError(f"mode {mode.value!r} is deterministic and takes no bits")
        return RoundSpec(fmt, source, mode, sat, None, None)
    natural = natural_sr_bits(source, fmt)
    if bits is None:
        if mode.takes_bits and mode not in (RoundMode.SR_NEAR_ZERO, RoundMode.SR_FRACTION):
            raise ValueError(f"mode {mode.value!r} needs bits=N, the random bits per element")
        bits = natural
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"bits must be an int, not {type(bits).__name__}")
    if not 1 <= bits <= 32:
        raise ValueError(f"bits must be in 1..32, got {bits}")
    if mode is RoundMode.SR and bits != natural:
        raise ValueError(
            f"mode 'sr' uses N = min(D, 32) = {natural} bits for {source.name} -> "
            f"{fmt.name}; use 'src' to choose N"
        )
    return RoundSpec(fmt, source, mode, sat, bits, select_below)


def check_random_bits(x: torch.Tensor, spec: RoundSpec, random_bits: torch.Tensor | None) -> None:
    """Check explicit random bits against the spec: presence, shape, dtype and range."""
    if spec.bits is None:
        if random_bits is not None:
            raise ValueError(f"mode {spec.mode.value!r} is deterministic and takes no random_bits")
        return
    if random_bits is None:
        raise ValueError(
            f"mode {spec.mode.value!r} needs random bits: pass random_bits "
            f"(integers in [0, {spec.random_range})) or seed=, and fewbit draws them"
        )
    if not isinstance(random_bits, torch.Tensor):
        raise TypeError(f"random_bits must be a tensor, not {type(random_bits).__name__}")
    if random_bits.dtype == torch.bool or random_bits.is_floating_point() or random_bits.is_complex():
        raise TypeError(f"random_bits must have an integer dtype, not {random_bits.dtype}")
    if random_bits.shape != x.shape:
        raise ValueError(f"random_bits has shape {tuple(random_bits.shape)}, x has {tuple(x.shape)}")
    if random_bits.device != x.device:
        raise ValueError(f"random_bits is on {random_bits.device}, x on {x.device}")
    if random_bits.numel():
        lo, hi = int(random_bits.min()), int(random_bits.max())
        if lo < 0 or hi >= spec.random_range:
            raise ValueError(
                f"random_bits must lie in [0, {spec.random_range}) for N={spec.bits}"
                f"{' plus the selection bits' if spec.mode is RoundMode.SR_FRACTION else ''};"
                f" found values in [{lo}, {hi}]"
            )
