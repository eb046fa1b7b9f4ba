"""Rounding a list of tensors in place, each with a key of its own: an optimizer's
write-back (``fewbit.optim.LowPrecisionWeights``), where per-call overhead, not
arithmetic, is the cost of many mid-sized tensors. Every path gives the bits
``fewbit.round_`` of each tensor would."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..random import Key, fold_in, key_tensor
from . import gpu, native
from .checks import RoundSpec
from .compiled import foreach_compiled_, stream_words

__all__ = ["round_foreach_"]


def round_foreach_(
    tensors: list[torch.Tensor], spec: RoundSpec, key: Key | None, indices: Sequence[int], via: torch.dtype
) -> None:
    """Round each tensor in place as ``round_`` of ``t.to(via)`` would, tensor j with the key
    ``fold_in(key, indices[j])`` (None: a deterministic mode). On a GPU one launch of the
    Triton kernel for the whole list where it applies (``gpu.round_foreach_``); on a CPU
    the native kernel, a call per tensor (a few microseconds each); else one compiled
    call for the whole list. The caller has checked the spec against ``via``, and
    ``spec.fmt`` has a NaN for anything without a value (nothing to raise)."""
    if not tensors:
        return
    probe = tensors[0].new_empty(0, dtype=via)  # what the kernels would be given
    if gpu.applies(spec, probe) and gpu.round_foreach_(tensors, spec, key, indices, via):
        return
    keys = [(0, 0) if key is None else stream_words(spec, fold_in(key, i)) for i in indices]
    if native.applies(spec, probe):
        # t.to(via) is torch's round to nearest even, as the other paths' conversion is.
        for t, words in zip(tensors, keys, strict=True):
            t.copy_(native.rounded(t.to(via), spec, words))
        return
    stacked = key_tensor([w for row in keys for w in row], probe.device).view(len(keys), -1)
    foreach_compiled_(tensors, spec, stacked, via)
