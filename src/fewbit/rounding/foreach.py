"""Rounding a list of tensors in place, each with a key of its own: an optimizer's
write-back (``fewbit.optim.LowPrecisionWeights``), where per-call overhead, not
arithmetic, is the cost of many mid-sized tensors. Every path gives the bits
``fewbit.round_`` of each tensor would."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from ..config import configure, current
from ..random import Key, fold_in
from . import gpu
from .checks import RoundSpec
from .ops import round_into

__all__ = ["round_foreach_", "write_back_threshold"]

#: Where the native kernel does not apply, the write-back rounds every weight of 8192
#: elements or more with the compiled kernel: it runs every step, so its compilations per
#: run (the first length's graph, then one for every length) are soon repaid.
COMPILE_FROM = 1 << 13


def write_back_threshold() -> contextlib.AbstractContextManager:
    """The settings of a write-back's calls of a tensor each: :data:`COMPILE_FROM` as the
    compile threshold, unless a lower one is set."""
    return configure(compile_threshold=min(current().compile_threshold, COMPILE_FROM))


def round_foreach_(
    tensors: list[torch.Tensor], spec: RoundSpec, key: Key | None, step: int, indices: Sequence[int],
    via: torch.dtype,
) -> None:  # fmt: skip
    """Round each tensor in place as ``round_`` of ``t.to(via)`` would, tensor j with the key
    ``fold_in(key, step, indices[j])`` (None: a deterministic mode). On a GPU one launch of the
    Triton kernel for the whole list where it applies (``gpu.round_foreach_``); else
    ``round_``'s own kernels, a call per tensor: on a CPU the native kernel (a few
    microseconds each), else the compiled one, with at most four graphs (lengths under a
    row of LANES, of one row, the first longer one, then one for all: a list compiled
    whole took a graph per list of shapes, and a run whose weights with gradients varied
    reached Dynamo's recompile limit). The caller has checked the spec against ``via``,
    and ``spec.fmt`` has a NaN for anything without a value (nothing to raise)."""
    if not tensors:
        return
    # Asked of the first tensor itself, not of a new tensor of dtype via (made every step):
    # round_foreach_ checks every tensor's dtype and via's, and reads their own memory.
    if gpu.applies(spec, tensors[0]) and gpu.round_foreach_(tensors, spec, key, step, indices, via):
        return
    step_key = None if key is None else fold_in(key, step)
    with write_back_threshold():
        for t, i in zip(tensors, indices, strict=True):
            x = t.to(via)  # torch's round to nearest even, as the GPU kernel's conversion is
            # Rounded in place: x is t itself (via is its dtype) or a new tensor of the call's
            # own; round_into takes a temporary only where its kernel cannot write x directly.
            round_into(x, spec, None if step_key is None else fold_in(step_key, i), None, x)
            if x is not t:
                t.copy_(x)
