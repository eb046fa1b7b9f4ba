"""One fused kernel per (mode, format, dtype, device): rounding and random-bit
generation compiled together by ``torch.compile`` (C++/OpenMP on CPU, Triton on GPU).

The kernel is the same Python as the eager path (``magic.round_magic`` where it
applies, else ``fast.round_fast``, fed by ``fewbit.random``), so compiled and eager
results are bit-identical. With generated bits it works on rows of
``fewbit.random.LANES`` elements, the stream's own layout, so each row of elements
reads a row of random words as contiguous vectors; the last, partial row is padded
to a whole one. Compilation is dynamic in the shape, so each spec compiles once (the
write-back's kernel over a list of tensors excepted: it compiles once per list of
shapes, which a training run keeps); the key is a tensor argument, so a new seed does
not recompile either.
``fewbit.configure(compile=False)`` (or ``FEWBIT_EAGER=1``) never compiles.
"""

from __future__ import annotations

import contextlib
import functools
import types
import warnings
from collections.abc import Callable

import torch

from ..config import current
from ..random import LANES, Key, bits_from_index, bits_from_range, bits_rows, fold_in, host_key, key_tensor
from .checks import RoundSpec
from .fast import round_fast, working_dtype
from .magic import magic_applies, round_magic
from .modes import MODES, SELECT_BITS, SELECT_KEY

__all__ = ["any_length", "compiled_round", "index_bits", "range_bits", "round_body",
           "run_compiled", "stream_words", "use_compiled", "word_tensors"]

#: Dynamo guards on the dispatch keys each input shows, and those depend on the caller: an
#: op called through autograd runs below ADInplaceOrView, one called without it does not.
#: Calling every kernel below it shows the same keys from every caller, so a spec compiles
#: once. torch's own custom-op machinery uses this guard; without it (a later torch), a
#: spec may compile twice, with the same results (tests/test_operator.py counts).
below_autograd = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", contextlib.nullcontext)

#: Dynamo's (private) mark of a dim whose size varies, which keeps a kernel compiled with
#: ``dynamic=False`` to one graph for every length. Without it (a later torch), each length
#: compiles anew, up to Dynamo's recompile limit and eager after it, with the same bits
#: (tests/test_operator.py's graph count fails first).
_MARK_DYNAMIC = getattr(torch._dynamo, "maybe_mark_dynamic", None)

_CACHE: dict[tuple, object] = {}
_BROKEN: set[tuple] = set()  # cache keys whose compilation failed once


def stream_words(spec: RoundSpec, key: Key | torch.Tensor) -> list:
    """``[k0, k1]`` of the key's stream, then for ``sr_fraction`` ``[s0, s1]`` of its
    selection stream, ``fold_in(key, SELECT_KEY)``: Python ints from a Key, 0-d tensors
    from a key tensor. Kernels take these words ready made: a key derived inside a
    compiled loop may be recomputed for every element."""
    keys = [key]
    if MODES[spec.mode].takes_fraction:
        keys.append(fold_in(key, SELECT_KEY))
    elif type(key) is Key:  # (at every call with a seed)
        return [key.k0, key.k1]
    return [w for k in keys for w in ((k.k0, k.k1) if isinstance(k, Key) else k.unbind())]


def word_tensors(spec: RoundSpec, key: Key | torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """:func:`stream_words` of a key (a Key, or a key tensor on ``device`` or in host
    memory), as 0-d tensors on ``device`` (a new key is new data for a compiled kernel).
    Derived with Python ints where the key is in host memory, so reading it waits for
    nothing."""
    key = host_key(key)
    if isinstance(key, torch.Tensor):  # on a device
        return stream_words(spec, key)
    return key_tensor(stream_words(spec, key), device).unbind()


def _draw(spec: RoundSpec, words, draw) -> torch.Tensor | None:
    """The random bits a spec takes, ``draw(bits, k0, k1)`` giving each stream's values:
    N bits from the key, and for ``sr_fraction`` the selection bits above them
    (``words``: :func:`stream_words`)."""
    if spec.bits is None:
        return None
    rand = draw(spec.bits, words[0], words[1])
    if len(words) > 2:
        rand = rand.to(torch.int64) | (draw(SELECT_BITS, words[2], words[3]).to(torch.int64) << spec.bits)
    return rand


def range_bits(spec: RoundSpec, words, offset: int, n: int, device) -> torch.Tensor | None:
    """The bits of elements ``offset .. offset + n`` for the streams' ``words``
    (:func:`stream_words`)."""
    return _draw(spec, words, lambda bits, a, b: bits_from_range(offset, n, bits, a, b, device=device))


def index_bits(spec: RoundSpec, words, index: torch.Tensor) -> torch.Tensor | None:
    """The bits of the elements at int64 ``index`` for the streams' ``words`` (the values
    :func:`range_bits` gives them, one Threefry block per element)."""
    return _draw(spec, words, lambda bits, a, b: bits_from_index(index, bits, a, b))


def round_body(
    x: torch.Tensor, spec: RoundSpec, rand: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """What every path computes, on ``x`` in its working dtype (a 16-bit ``x`` widened to
    float32, exactly): the float-adder shortcut where it applies, else ``round_fast``.
    Into ``out`` (of x's dtype or the working one) when given; else a tensor of the
    working dtype. Compiled, the widening and the narrowing into ``out`` fuse into the
    kernel: a 16-bit tensor is read and written in its own width, in one pass."""
    work = x.to(working_dtype(x.dtype))
    into = out if out is not None and out.dtype == work.dtype else None
    if magic_applies(spec, work.dtype):
        result = round_magic(work, spec, rand, into)
    else:
        result = round_fast(work, spec, rand)
    return result if out is None or result is out else out.copy_(result)


def _rows_kernel(main, last, out, words, *, spec: RoundSpec) -> torch.Tensor:
    """Round ``main`` (rows ``0 ..`` of the stream) into ``out``, and return ``last``
    (the row after them) rounded, with the bits of ``words`` (:func:`stream_words`).
    One draw of bits serves both."""
    rows = main.shape[0]
    rand = _draw(spec, words, lambda bits, a, b: bits_rows(0, rows + 1, bits, a, b, device=main.device))
    split = (None, None) if rand is None else (rand[:rows], rand[rows:])
    out.copy_(round_body(main, spec, split[0]))
    return round_body(last, spec, split[1])


def round_rows_into(x: torch.Tensor, out: torch.Tensor, words, spec: RoundSpec, kernel=None) -> None:
    """``out[:] =`` flat ``x`` rounded with generated bits, in rows of ``LANES``: the
    whole rows, and the partial last one padded with zeros to a whole row (an empty
    one when ``x`` fills its rows). The split is made outside ``kernel``, which so
    sees only a symbolic number of rows: one graph for every length."""
    rows, tail = divmod(x.shape[0], LANES)
    cut = rows * LANES
    last = torch.nn.functional.pad(x[cut:], (0, LANES - tail)).view(1, LANES)
    main, out_main = x[:cut].view(rows, LANES), out[:cut].view(rows, LANES)
    if not torch.compiler.is_compiling():
        any_length(main, out_main)
    if kernel is None:
        kernel = functools.partial(_rows_kernel, spec=spec)
    last = kernel(main, last, out_main, words)
    out[cut:].copy_(last.view(-1)[:tail])


def any_length(*tensors: torch.Tensor | None) -> None:
    """Mark dim 0 of each tensor given (None: skipped) as of any length for the compiled
    kernels: one graph for every length."""
    if _MARK_DYNAMIC is not None:
        for t in tensors:
            if t is not None:
                _MARK_DYNAMIC(t, 0)


def use_compiled(numel: int) -> bool:
    """Whether a call on ``numel`` elements takes the compiled kernel (``fewbit.config``)."""
    config = current()
    return config.compile and numel >= max(config.compile_threshold, 1)  # nothing to launch for 0


def compiled_round(
    x: torch.Tensor, spec: RoundSpec, key: torch.Tensor | None, random_bits, out: torch.Tensor
) -> bool:
    """Round flat ``x`` into flat ``out`` with the compiled kernel, the bits given or
    drawn with key tensor ``key``; False (nothing written) when compilation is
    unavailable."""
    kernel = _given_kernel if key is None else _rows_kernel

    def run(fn) -> None:
        if key is None:  # (the bits too: a length fixed in one input fixed x's, a graph per length)
            any_length(x, random_bits, out)
            fn(x, random_bits, out)
        else:
            round_rows_into(x, out, word_tensors(spec, key, x.device), spec, kernel=fn)

    return run_compiled((spec, x.dtype, x.device.type, key is None), kernel, run, spec, x.device, spec=spec)


def run_compiled(cache_key: tuple, kernel: Callable, run: Callable[[Callable], object], spec: RoundSpec,
                 device: torch.device, /, **bound) -> bool:  # fmt: skip
    """``run(fn)`` below autograd, with ``fn`` ``kernel`` (keyword arguments ``bound``)
    compiled once per ``cache_key``; True where it ran. False where that compilation failed
    (no C++ compiler, no Triton, ...), now or before: that warns once, and the calls run
    eager from then on (``run`` must then have written nothing)."""
    if cache_key in _BROKEN:
        return False
    fn = _CACHE.get(cache_key)
    if fn is None:
        fn = _CACHE[cache_key] = torch.compile(_with_own_code(kernel, **bound), fullgraph=True, dynamic=False)
    try:
        with below_autograd():
            run(fn)
        return True
    except Exception:  # compilers fail in many ways: each gets the one retry below
        pass
    # The user's stance (fail_on_recompile after a warm-up, say) refuses the first
    # compilation of a spec as it refuses their own recompiles: no failure of fewbit's
    # kernel, which compiles under the default stance and needs no compiling after that.
    # Setting it costs 16 us, so only here; a real failure (no C++ compiler) is met twice,
    # once a spec (2 s more here).
    try:
        with torch.compiler.set_stance("default"), below_autograd():
            run(fn)
        return True
    except Exception as err:
        _BROKEN.add(cache_key)
        warnings.warn(f"fewbit: torch.compile failed for {spec.mode.value} to {spec.fmt.name} "
                      f"on {device.type} ({err!s:.300}); running it eager from now on",
                      RuntimeWarning, stacklevel=4)  # fmt: skip
        return False


def _with_own_code(fn, **bound):
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
