"""One fused kernel per (mode, format, dtype, device): rounding and random-bit
generation compiled together by ``torch.compile`` (C++/OpenMP on CPU, Triton on GPU).

The kernel is the same Python as the eager path (``fast.round_fast`` fed by
``fewbit.random.bits_from_range``): integer ops only, so compiled and eager results
are bit-identical. Compilation is dynamic in the shape, so each spec compiles once;
keys are passed as 0-d tensors, so a new seed does not recompile either.
Set ``FEWBIT_EAGER=1`` to never compile.
"""

from __future__ import annotations

import os
import warnings
from functools import partial

import torch

from ..random import Key, bits_from_range, fold_in
from .checks import RoundSpec
from .fast import round_fast
from .modes import SELECT_BITS, RoundMode

__all__ = [
    "MIN_COMPILE_NUMEL", "compiled_round", "generated_round", "select_key", "use_compiled",
]

#: Below this many elements a call runs eager: a kernel launch buys nothing there,
#: and small tensors should never wait for a first compilation.
MIN_COMPILE_NUMEL = 1 << 16

RECOMPILE_LIMIT = 4096
_CACHE: dict[tuple, object] = {}
_BROKEN: set[tuple] = set()  # cache keys whose compilation failed once


def select_key(key: Key) -> Key:
    # sr_fraction's selection bits come from their own stream, derived from the key.
    return fold_in(key, 0x5E1EC7)


def generated_round(
    x: torch.Tensor, k0, k1, s0, s1, offset: int, spec: RoundSpec
) -> torch.Tensor:
    """Round a flat tensor with random bits drawn for elements ``offset ..`` of the
    key ``(k0, k1)`` (``(s0, s1)``: the selection stream of ``sr_fraction``)."""
    n = x.numel()
    rand = None
    if spec.bits is not None:
        rand = bits_from_range(offset, n, spec.bits, k0, k1, device=x.device)
        if spec.mode is RoundMode.SR_FRACTION:
            select = bits_from_range(offset, n, SELECT_BITS, s0, s1, device=x.device)
            rand = rand.to(torch.int64) | (select.to(torch.int64) << spec.bits)
    return round_fast(x, spec, rand)


def use_compiled(x: torch.Tensor) -> bool:
    """Whether a call on ``x`` takes the compiled kernel."""
    return (
        os.environ.get("FEWBIT_EAGER", "") in ("", "0")
        and x.numel() >= MIN_COMPILE_NUMEL
    )


def compiled_round(x: torch.Tensor, spec: RoundSpec, key: Key | None, random_bits) -> torch.Tensor | None:
    """Run the compiled kernel on flat ``x``; None when compilation is unavailable."""
    cache_key = (spec, x.dtype, x.device.type, key is None)
    if cache_key in _BROKEN:
        return None
    fn = _CACHE.get(cache_key)
    if fn is None:
        fn = torch.compile(partial(_kernel, spec=spec), fullgraph=True, dynamic=False)
        _CACHE[cache_key] = fn
    # Every spec's kernel shares _kernel's code object. So only the length is marked
    # dynamic (automatic dynamism would turn the next spec's format ints into symbols),
    # and Dynamo's limit of 8 compilations per code object is lifted.
    torch._dynamo.maybe_mark_dynamic(x, 0)
    try:
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            if key is None:
                return fn(x, random_bits)
            sel = select_key(key)
            return fn(x, *key.tensors(x.device), *sel.tensors(x.device))
    except Exception as err:  # no C++ compiler, no Triton, ...: eager still works
        _BROKEN.add(cache_key)
        warnings.warn(f"fewbit: torch.compile failed for {spec.mode.value} to {spec.fmt.name} "
                      f"on {x.device.type} ({err!s:.300}); running it eager from now on",
                      RuntimeWarning, stacklevel=3)
        return None


def _kernel(x, *args, spec: RoundSpec):
    if len(args) == 1:  # explicit random bits (or None)
        return round_fast(x, spec, args[0])
    return generated_round(x, *args, offset=0, spec=spec)
