"""``fewbit.round``: round a tensor to a format in a rounding mode.

``reference`` states the maths element by element; ``fast`` is what runs (compiled,
or eager), with ``magic`` as the eager shortcut for its most common cases. All share
the argument checks in ``checks`` and the modes in ``modes``.
"""

from __future__ import annotations

import torch

from ..formats import FloatFormat
from ..memory import converted, empty_output
from ..random import Key, as_key
from .checks import RoundSpec, check_random_bits, check_round_args, dtype_format
from .compiled import compiled_round, key_words, range_bits, round_body, use_compiled
from .fast import working_dtype
from .modes import SELECT_BITS, RoundMode, natural_sr_bits
from .reference import round_reference

__all__ = [
    "RoundMode", "RoundSpec", "SELECT_BITS", "dtype_format", "natural_sr_bits",
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
    seed: int | Key | None = None,
) -> torch.Tensor:
    """Round ``x`` to the values of ``fmt``; the result keeps x's dtype and shape.

    Args:
        x: float32, float64, bfloat16 or float16 tensor, any device and layout.
        fmt: a FloatFormat or a name such as ``"binary8p4"`` or ``"e4m3"``.
        mode: a RoundMode or its lower-case name (``"rne"``, ``"src"``, ...).
        sat: overflow goes to the largest finite value instead of Inf/NaN.
        bits: N, random bits per element, for the stochastic modes.
        random_bits: integers in ``[0, 2^N)`` of x's shape (for ``sr_fraction``,
            ``[0, 2^(N+16))``: the 16 bits above the N rounding bits select).
        fraction: p, the share of elements ``sr_fraction`` rounds stochastically.
        seed: an int or a ``fewbit.random.Key``: fewbit draws the random bits itself,
            element i taking the bits ``fewbit.random.random_bits`` gives index i
            (``sr_fraction`` selects with the stream of ``fold_in(key, 0x5E1EC7)``).

    Raises:
        TypeError / ValueError, before anything is computed, for a bad argument; and
        ValueError when a value has no result in a format without Inf and NaN
        (NaN input, or overflow without ``sat``).
    """
    spec = check_round_args(x, fmt, mode, sat, bits, fraction)
    key = _check_seed(spec, seed, random_bits)
    if key is None:
        check_random_bits(x, spec, random_bits)
    work = converted(x, working_dtype(x.dtype))
    out = _round_any(work.reshape(-1), spec, key, _flat(random_bits))
    if not spec.fmt.has_nans:
        _raise_on_invalid(work, out, spec)
    return converted(out.reshape(x.shape), x.dtype)


def round_(
    x: torch.Tensor,
    fmt: FloatFormat | str,
    mode: RoundMode | str = "rne",
    **kwargs,
) -> torch.Tensor:
    """In-place :func:`round` (same arguments): x holds the rounded values; returns x.
    On an error x is left untouched."""
    x.copy_(round(x, fmt, mode, **kwargs))
    return x


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.reshape(-1)


def _check_seed(spec: RoundSpec, seed, random_bits) -> Key | None:
    if seed is None:
        return None
    if random_bits is not None:
        raise ValueError("give either seed (fewbit draws the bits) or random_bits, not both")
    if spec.bits is None:
        raise ValueError(f"mode {spec.mode.value!r} is deterministic and takes no seed")
    return as_key(seed)


def _round_any(flat: torch.Tensor, spec: RoundSpec, key: Key | None, rand) -> torch.Tensor:
    """The compiled kernel where it applies, else eager."""
    if use_compiled(flat):
        out = compiled_round(flat, spec, key, rand)
        if out is not None:
            return out
    return _in_blocks(flat, spec, key, rand)


#: Elements per block for eager CPU runs: eager torch makes one pass over the tensor
#: per op, so blocks keep the intermediates in cache rather than memory. 2^20 was
#: the fastest of 2^14 .. 2^24 for ``round_fast`` on a 2-core AMD EPYC (2^24 elements,
#: float32); the magic shortcut ran alike from 2^17 to 2^20 there.
CPU_BLOCK = 1 << 20


def _in_blocks(flat: torch.Tensor, spec: RoundSpec, key: Key | None, rand) -> torch.Tensor:
    keys = key_words(key, spec)
    n = flat.numel()
    block = CPU_BLOCK if flat.device.type == "cpu" else max(n, 1)
    out = empty_output(flat)
    for start in range(0, n, block):
        part = flat[start : start + block]
        if key is None:
            bits = None if rand is None else rand[start : start + block]
        else:
            bits = range_bits(spec, keys, start, part.numel(), part.device)
        round_body(part, spec, bits, out[start : start + block])
    return out


def _raise_on_invalid(work: torch.Tensor, out: torch.Tensor, spec: RoundSpec) -> None:
    # In a format without NaN, a NaN result marks an element with no valid value.
    if bool(torch.isnan(out).any()):
        fmt = spec.fmt.name
        if bool(torch.isnan(work).any()):
            raise ValueError(f"{fmt} has no NaN to hold a NaN input")
        raise ValueError(f"{fmt} has no Inf or NaN for a value beyond its range; use sat=True")
