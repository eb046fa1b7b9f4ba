"""``fewbit.round``: round a tensor to a format in a rounding mode.

``modes`` is the table of modes; ``reference`` states the maths element by element;
``fast`` is the torch kernel (with ``magic`` as its shortcut for the most common cases),
compiled by ``compiled``; ``native`` (``native.cpp``) and ``gpu`` (``triton_kernels``)
are the one-pass CPU and GPU kernels that take the calls they can, with fast's bits;
``ops`` registers ``fewbit::round`` and ``fewbit::round_into`` with ``torch.library``.
The functions here turn the user's arguments into an op call.
"""

from __future__ import annotations

import torch

from ..formats import FloatFormat
from ..random import Key
from .checks import RoundSpec, dtype_format
from .modes import MODES, SELECT_BITS, ModeInfo, RoundMode, natural_sr_bits
from .ops import call_with_out, op_args, round_into_op, round_op
from .reference import round_reference

__all__ = [
    "MODES", "ModeInfo", "RoundMode", "RoundSpec", "SELECT_BITS", "dtype_format", "natural_sr_bits",
    "round", "round_", "round_reference",
]


def round(
    x: torch.Tensor,
    fmt: FloatFormat | str,
    mode: RoundMode | str = "rne",
    *,
    sat: bool = False,
    bits: int | None = None,
    random_bits: torch.Tensor | None = None,
    fraction: float | None = None,
    seed: int | Key | torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Round ``x`` to the values of ``fmt``; the result keeps x's dtype and shape.

    Args:
        x: float32, float64, bfloat16 or float16 tensor, dense (not sparse), on any device.
        fmt: a FloatFormat or a name such as ``"binary8p4"`` or ``"e4m3"``.
        mode: a RoundMode or its name, in any case (``"rne"``, ``"src"``, ...).
        sat: overflow goes to the largest finite value instead of Inf/NaN.
        bits: N, random bits per element, for the stochastic modes.
        random_bits: integers in ``[0, 2^N)`` of x's shape, any integer dtype (for
            ``sr_fraction``, ``[0, 2^(N+16))``: the 16 bits above the N rounding bits select).
        fraction: p, the share of elements ``sr_fraction`` rounds stochastically.
        seed: an int, a ``fewbit.random.Key``, or a tensor (a 0-d integer seed, or a key
            from ``fewbit.random.key_of``): fewbit draws the random bits itself, element i
            taking the bits ``fewbit.random.random_bits`` gives index i (``sr_fraction``
            selects with the stream of ``fold_in(key, SELECT_KEY)``). Under
            ``torch.compile`` a tensor seed (a step counter, say) never recompiles.
        out: a tensor of x's shape, dtype and device to hold the result (torch's
            convention: no autograd through it).

    Returns the rounded tensor (``out`` when given). Its gradient is straight-through:
    the identity (see ``fewbit.rounding.ops``).

    Raises:
        TypeError / ValueError, before anything is written, for a bad argument; and
        ValueError when a value has no result in a format without Inf and NaN
        (NaN input, or overflow without ``sat``).
    """
    args = op_args(x, fmt, mode, sat, bits, fraction, seed, random_bits)
    return call_with_out(round_op, round_into_op, args, x, out, "fewbit.round")


def round_(x: torch.Tensor, fmt: FloatFormat | str, mode: RoundMode | str = "rne", **kwargs) -> torch.Tensor:
    """In-place :func:`round` (same arguments): x holds the rounded values; returns x.
    On an error x is left untouched."""
    return round(x, fmt, mode, out=x, **kwargs)
