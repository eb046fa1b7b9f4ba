"""One fused kernel per (mode, format, dtype, device): rounding and random-bit
generation compiled together by ``torch.compile`` (C++/OpenMP on CPU, Triton on GPU).

The kernel is the same Python as the eager path (``magic.round_magic`` where it
applies, else ``fast.round_fast``, fed by ``fewbit.random``), so compiled and eager
results are bit-identical. With generated bits it works on rows of
``fewbit.random.LANES`` elements, the stream's own layout, so each row of elements
reads a row of random words as contiguous vectors; the last, partial row is padded
to a whole one. Compilation is dynamic in the shape, so each spec compiles once;
keys are passed as 0-d tensors, so a new seed does not recompile either.
Set ``FEWBIT_EAGER=1`` to never compile.
"""

from __future__ import annotations

import functools
import os
import types
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from ..memory import empty_output
from ..random import LANES, Key, bits_from_range, bits_rows, fold_in, key_tensor
from .checks import RoundSpec, dtype_format
from .fast import round_fast, working_dtype
from .magic import magic_applies, round_magic
from .modes import SELECT_BITS, RoundMode

__all__ = [
    "MIN_COMPILE_NUMEL", "compile_from", "compiled_round", "key_words", "range_bits", "round_body",
    "round_foreach_", "use_compiled",
]

#: Below this many elements a call runs eager: a kernel launch buys nothing there,
#: and small tensors should never wait for a first compilation.
MIN_COMPILE_NUMEL = 1 << 16
_min_numel: ContextVar[int] = ContextVar("min_compile_numel", default=MIN_COMPILE_NUMEL)


@contextmanager
def compile_from(numel: int) -> Iterator[None]:
    """Inside the block, compile calls on tensors of ``numel`` elements or more. For loops
    that round the same spec again and again (an optimizer's write-back), where the one
    compilation is soon repaid: a small tensor's ~50 eager ops cost more than one kernel."""
    token = _min_numel.set(numel)
    try:
        yield
    finally:
        _min_numel.reset(token)


_CACHE: dict[tuple, object] = {}
_BROKEN: set[tuple] = set()  # cache keys whose compilation failed once


def select_key(key: Key) -> Key:
    # sr_fraction's selection bits come from their own stream, derived from the key.
    return fold_in(key, 0x5E1EC7)


def key_words(key: Key | None, spec: RoundSpec) -> tuple[int, int, int, int]:
    """``(k0, k1, s0, s1)`` as the kernels take them: the key, and the selection key that
    only ``sr_fraction`` reads (the key again otherwise; zeros when nothing is drawn)."""
    if key is None:
        return (0, 0, 0, 0)
    sel = select_key(key) if spec.mode is RoundMode.SR_FRACTION else key
    return (key.k0, key.k1, sel.k0, sel.k1)


def _draw(spec: RoundSpec, keys, draw) -> torch.Tensor | None:
    """The random bits a spec takes, ``draw(bits, k0, k1)`` giving each stream's values:
    N bits from the key, and for ``sr_fraction`` the selection bits above them."""
    if spec.bits is None:
        return None
    k0, k1, s0, s1 = keys
    rand = draw(spec.bits, k0, k1)
    if spec.mode is RoundMode.SR_FRACTION:
        rand = rand.to(torch.int64) | (draw(SELECT_BITS, s0, s1).to(torch.int64) << spec.bits)
    return rand


def range_bits(spec: RoundSpec, keys, offset: int, n: int, device) -> torch.Tensor | None:
    """The bits of elements ``offset .. offset + n`` for the key in
    ``keys = (k0, k1, s0, s1)`` (``(s0, s1)``: the selection stream of ``sr_fraction``)."""
    return _draw(spec, keys, lambda bits, a, b: bits_from_range(offset, n, bits, a, b, device=device))


def round_body(
    x: torch.Tensor, spec: RoundSpec, rand: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """What every path computes: the float-adder shortcut where it applies, else
    ``round_fast``; into ``out`` when given."""
    if magic_applies(spec, x.dtype):
        return round_magic(x, spec, rand, out)
    result = round_fast(x, spec, rand)
    return result if out is None else out.copy_(result)


def _rows_kernel(main, last, out, keys, *, spec: RoundSpec) -> torch.Tensor:
    """Round ``main`` (rows ``0 ..`` of the stream) into ``out``, and return ``last``
    (the row after them) rounded. One draw of bits serves both."""
    rows = main.shape[0]
    rand = _draw(spec, keys, lambda bits, a, b: bits_rows(0, rows + 1, bits, a, b, device=main.device))
    split = (None, None) if rand is None else (rand[:rows], rand[rows:])
    out.copy_(round_body(main, spec, split[0]))
    return round_body(last, spec, split[1])


def round_rows_into(x: torch.Tensor, out: torch.Tensor, keys, spec: RoundSpec, kernel=None) -> None:
    """``out[:] =`` flat ``x`` rounded with generated bits, in rows of ``LANES``: the
    whole rows, and the partial last one padded with zeros to a whole row (an empty
    one when ``x`` fills its rows). The split is made outside ``kernel``, which so
    sees only a symbolic number of rows: one graph for every length."""
    rows, tail = divmod(x.shape[0], LANES)
    cut = rows * LANES
    last = torch.nn.functional.pad(x[cut:], (0, LANES - tail)).view(1, LANES)
    main, out_main = x[:cut].view(rows, LANES), out[:cut].view(rows, LANES)
    if not torch.compiler.is_compiling():
        torch._dynamo.maybe_mark_dynamic(main, 0)
        torch._dynamo.maybe_mark_dynamic(out_main, 0)
    if kernel is None:
        kernel = functools.partial(_rows_kernel, spec=spec)
    last = kernel(main, last, out_main, keys)
    out[cut:].copy_(last.view(-1)[:tail])


def use_compiled(x: torch.Tensor) -> bool:
    """Whether a call on ``x`` takes the compiled kernel."""
    return use_compiled_numel(x.numel())


def use_compiled_numel(numel: int) -> bool:
    return os.environ.get("FEWBIT_EAGER", "") in ("", "0") and numel >= _min_numel.get()


def compiled_round(x: torch.Tensor, spec: RoundSpec, key: Key | None, random_bits) -> torch.Tensor | None:
    """Run the compiled kernel on flat ``x``; None when compilation is unavailable."""
    cache_key = (spec, x.dtype, x.device.type, key is None)
    if cache_key in _BROKEN:
        return None
    fn = _CACHE.get(cache_key)
    if fn is None:
        kernel = _given_kernel if key is None else _rows_kernel
        fn = torch.compile(_own(kernel, spec=spec), fullgraph=True, dynamic=False)
        _CACHE[cache_key] = fn
    out = empty_output(x)
    try:
        if key is None:
            torch._dynamo.maybe_mark_dynamic(x, 0)  # one kernel for every length
            torch._dynamo.maybe_mark_dynamic(out, 0)
            fn(x, random_bits, out)
            return out
        words = key_tensor(key_words(key, spec), x.device)
        round_rows_into(x, out, words.unbind(), spec, kernel=fn)
        return out
    except Exception as err:  # no C++ compiler, no Triton, ...: eager still works
        _BROKEN.add(cache_key)
        _warn_eager(spec, x.device, err)
        return None


def _warn_eager(spec: RoundSpec, device: torch.device, err: Exception) -> None:
    warnings.warn(f"fewbit: torch.compile failed for {spec.mode.value} to {spec.fmt.name} "
                  f"on {device.type} ({err!s:.300}); running it eager from now on",
                  RuntimeWarning, stacklevel=4)  # fmt: skip


def _own(fn, **bound):
    """``fn`` with keyword arguments bound, as a function with a code object of its own.
    Dynamo keeps compilations, guards and its recompile limit per code object: one per
    spec keeps specs apart (a shared one would hit the limit of 8, and automatic
    dynamism would turn the next spec's format constants into symbols), with no
    per-call change of Dynamo's settings."""
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)
    own.__kwdefaults__ = bound
    return own


def _given_kernel(x, random_bits, out, *, spec: RoundSpec) -> None:
    round_body(x, spec, random_bits, out)


def _as_via(t: torch.Tensor, via: torch.dtype) -> torch.Tensor:
    """Flat ``t.to(via)``, held in via's working dtype. The conversion to a 16-bit ``via``
    is fewbit's own RNE: a compiled ``t.to(bfloat16).float()`` is a round trip that
    Inductor may drop (torch 2.11 on AVX-512 did, even with emulate_precision_casts),
    and then SR would start from the unrounded value. float64 goes through float32
    first, as torch's own conversion to a 16-bit dtype does."""
    x = t.reshape(-1).to(working_dtype(via))
    if via in (torch.bfloat16, torch.float16) and t.dtype != via:
        to_via = RoundSpec(dtype_format(via), dtype_format(x.dtype), RoundMode.RNE, False, None, None)
        x = round_body(x, to_via, None)
    return x


def _foreach_kernel(tensors: list[torch.Tensor], keys: torch.Tensor, *, spec: RoundSpec, via: torch.dtype):
    for i, t in enumerate(tensors):
        x = _as_via(t, via)  # the value in the dtype the caller rounds from
        out = torch.empty_like(x)
        round_rows_into(x, out, keys[i].unbind(), spec)
        t.copy_(out.reshape(t.shape))


def round_foreach_(
    tensors: list[torch.Tensor], spec: RoundSpec, keys: list[Key | None], via: torch.dtype
) -> None:
    """Round each tensor in place, tensor i with ``keys[i]``, as ``round_`` of ``t.to(via)``
    would: one compiled call for the whole list when compilation applies (an optimizer's
    write-back: per-call overhead, not arithmetic, dominates many mid-sized tensors),
    else the same code eager. The caller has checked the spec against ``via``, and
    ``spec.fmt`` has a NaN for anything without a value (nothing to raise)."""
    device = tensors[0].device
    table = key_tensor([key_words(k, spec) for k in keys], device)
    total = sum(t.numel() for t in tensors)
    cache_key = ("foreach", spec, via, tensors[0].dtype, device.type)
    if use_compiled_numel(total) and cache_key not in _BROKEN:
        fn = _CACHE.get(cache_key)
        if fn is None:
            fn = _CACHE[cache_key] = torch.compile(_own(_foreach_kernel, spec=spec, via=via), fullgraph=True)
        try:
            return fn(tensors, table)
        except Exception as err:
            _BROKEN.add(cache_key)
            _warn_eager(spec, device, err)
    _foreach_kernel(tensors, table, spec=spec, via=via)
