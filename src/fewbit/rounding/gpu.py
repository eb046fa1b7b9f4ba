"""fewbit's GPU kernel (Triton, ``triton_kernels.py``): rounding in one pass over memory,
the random words generated once per ``floor(32/N)`` elements inside it.

It takes the calls native.cpp takes on a CPU (formats within float32's range, N <=
native.NATIVE_MAX_BITS = 30, float32 and 16-bit inputs) and computes their bits
(tests/test_gpu_kernel.py runs it in Triton's interpreter against the native kernel;
tests/test_gpu.py on a GPU). A key tensor on the device is read by the kernel; a key in
host memory (an int seed's) travels as the launch's arguments. Either way a call neither
waits for the GPU nor copies a key to it, so it can be captured in a CUDA graph (which
keeps a host key's value at the capture). A kernel compiled once is launched again by
:func:`_launch` itself, without Triton's binding of its arguments (and without its
launcher's Python where gpu.py knows the launcher). Where Triton is missing the torch
kernels run instead, compiled or eager, with the same bits.
"""

from __future__ import annotations

import array
import functools
import hashlib
import itertools
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType

import torch

from ..config import current
from ..formats import FloatFormat
from ..operators import is_plain
from ..random import LANES, Key
from .checks import RoundSpec, make_spec
from .compiled import stream_words
from .magic import magic_applies
from .modes import MODES, RoundMode
from .native import (
    BLOCK_RULES,
    PARAM_NAMES,
    blocks_fit,
    even_fraction,
    kernel_params,
    mode_id,
    takes,
    takes_call,
)

__all__ = [
    "applies", "block_applies", "block_into", "decode_into", "decodes", "encode_into", "finite_amax",
    "quantize_into", "round_foreach_", "round_into", "rounded", "usable",
]  # fmt: skip

#: Rows per program where no words are drawn: 4096 elements.
_PLAIN_ROWS = 8
#: Codes (or pairs) per block of encode_kernel, and blocks per program from
#: _ENCODE_MANY codes on: 8192 codes a program, as round_kernel's 4096 to 10240
#: elements. Fewer codes keep a block a program, so that a weight's codes (a few
#: hundred thousand) still spread over every SM.
_ENCODE_BLOCK = 1024
_ENCODE_BLOCKS = 8
_ENCODE_MANY = 1 << 23
#: Compiler options. A float multiply here is exact (magic.py's constant: a power of two
#: times 1 or 1.5), so fusing it with the add that follows changes no result and saves an
#: instruction; said, rather than left to Triton's default, which changes in Triton 3.10.
#: Two warps a program give each thread 8 lanes of a row: the row's bounds, addresses and
#: loop count are shared by 8 elements instead of 4 (sm_90 SASS of an aligned call: float32
#: RNE 17 instructions an element instead of 20, bfloat16 SRC N=3 26 instead of 31), and 32
#: programs of 2 warps still fill an H100 SM.
_OPTIONS = {"enable_fp_fusion": True, "num_warps": 2}


@functools.cache
def kernels() -> ModuleType | None:
    """``triton_kernels``, or None (with one warning) where Triton cannot be imported."""
    try:
        from . import triton_kernels
    except ImportError as err:
        warnings.warn(f"fewbit: Triton is not available ({err}); GPU calls run the torch kernels "
                      "(same bits, slower)", RuntimeWarning, stacklevel=3)  # fmt: skip
        return None
    return triton_kernels


def usable(x: torch.Tensor, fmt: FloatFormat) -> bool:
    """Whether the kernel takes ``x`` (on a CUDA device) and ``fmt``, where ``fewbit.config``'s
    ``native`` and ``compile`` let it: what native.cpp would take on a CPU."""
    return _enabled(x) and takes(x, fmt)


def _enabled(t: torch.Tensor) -> bool:
    """Whether t is on a CUDA device with memory a kernel may read (operators.is_plain),
    fewbit.config lets the kernels run, and Triton is here."""
    config = current()
    return t.is_cuda and is_plain(t) and config.compile and config.native and kernels() is not None


def applies(spec: RoundSpec, x: torch.Tensor, random_bits: torch.Tensor | None = None) -> bool:
    """Whether :func:`round_into` takes this call."""
    return _enabled(x) and takes_call(spec, x, random_bits)


def _format_constants(spec: RoundSpec) -> dict:
    """The compile-time constants of round_bits that describe the format: native.cpp's
    parameters, decoded."""
    p = dict(zip(PARAM_NAMES, kernel_params(spec), strict=True))
    names = ("T", "EMIN", "BIAS", "MIN_ULP_EXP", "MAX", "MAX_NEG", "BEYOND_POS", "BEYOND_NEG",
             "SMALLEST_NORMAL")  # fmt: skip
    flags = p["FLAGS"]
    return {**{name: p[name] for name in names}, "SUBNORMAL_BELOW": 1 << max(-126 - p["MIN_ULP_EXP"], 0),
            "P_IS_1": bool(flags & 1), "HAS_NZ": bool(flags & 2), "HAS_ZERO": bool(flags & 4)}  # fmt: skip


def _magic_scale(spec: RoundSpec) -> float:
    """magic.py's constant C over 2^e_t: 1.5 2^(23 - t) for RNE, 2^(23 - t - N) for SRC."""
    return 2.0 ** (23 - spec.fmt.t - (spec.bits or 0)) * (1.5 if spec.bits is None else 1.0)


def aligned(n: int, offset: int, *tensors: torch.Tensor | None) -> bool:
    """The kernels' ``ALIGNED``: whether every tensor's address, ``n`` and ``offset`` are
    multiples of 16, so that a row may be loaded and stored 16 bytes at a time."""
    if n % 16 or offset % 16:
        return False
    for t in tensors:  # (a loop: a generator costs a call its own frame)
        if t is not None and t.data_ptr() % 16:
            return False
    return True


def _code_constants(spec: RoundSpec) -> dict:
    """The compile-time constants of _code_of: the format's codes."""
    fmt, p = spec.fmt, dict(zip(PARAM_NAMES, kernel_params(spec), strict=True))
    return {"K": fmt.k, "CODE_OF_MAX": p["CODE_OF_MAX"], "CODE_OF_NAN": p["CODE_OF_NAN"],
            "HAS_NANS": fmt.has_nans, "EXTENDED": fmt.extended, "SIGNED": fmt.signed,
            "TWOS_COMPLEMENT": fmt.twos_complement}  # fmt: skip


#: round_kernel's outputs (``CODES``): values in x's dtype, a code an element, two a byte.
_VALUES, _CODES, _PACKED = range(3)


@functools.lru_cache(maxsize=256)
def round_constants(spec: RoundSpec, drawn: bool, given: bool, aligned: bool = True,
                    via: torch.dtype | None = None, host_key: bool = False,
                    codes: int = _VALUES, block: tuple[int, str] | None = None, runs: bool = False,
                    ) -> dict:  # fmt: skip
    """round_kernel's compile-time constants for a spec, its bits drawn in the kernel or
    given (or neither); ``via``: those of round_foreach_'s launch (``FOREACH``);
    ``host_key``: the key's words passed with the launch; ``codes``: what it writes;
    ``block``: the block size and scale rule of a block format's call (``BLOCK``);
    ``runs``: x is runs of the stream (``RUNS``)."""
    p = dict(zip(PARAM_NAMES, kernel_params(spec), strict=True))
    size, rule = block or (0, "floor")
    per_word = 32 // spec.bits if spec.bits else 1
    rows = 2 * per_word if drawn else _PLAIN_ROWS
    return {**_format_constants(spec), "MODE": mode_id(spec), "SAT": spec.sat, "LIMIT_RULE": p["LIMIT_RULE"],
            "BITS": p["BITS"], "SELECT_BELOW": p["SELECT_BELOW"],
            "MAGIC_SCALE": _magic_scale(spec), "BEYOND": p["MAX"] if spec.sat else p["BEYOND_POS"],
            "ROWS": rows, "DRAWN": drawn, "GIVEN": given, "PER_WORD": per_word, "FOREACH": via is not None,
            "VIA": None if via is None else getattr(kernels().tl, _TRITON_DTYPES[via]),
            "TENSORS": 1 if via is None else _FOREACH_TENSORS, "ALIGNED": aligned,
            "HOST_KEY": host_key and drawn, "CODES": codes, **_code_constants(spec),
            "BLOCK": size, "RULE": BLOCK_RULES[rule], "EMAX": spec.fmt.emax,
            "RCEIL_FRACTION": p["MAX"] & 0x7FFFFF, "EVEN_FRACTION": even_fraction(spec.fmt),
            "ELEMENT_MAX": spec.fmt.max, "RUNS": runs}  # fmt: skip


@functools.lru_cache(maxsize=64)
def encode_constants(fmt: FloatFormat, blocks: int = 1, packed: bool = False, aligned: bool = True,
                     check: bool = True) -> dict:  # fmt: skip
    """encode_kernel's compile-time constants: the format's, as RNE without saturation
    (the check that x is a value) sees them, and its codes'; ``blocks`` of
    ``_ENCODE_BLOCK`` codes a program."""
    nearest = make_spec(torch.float32, fmt, RoundMode.RNE, False, None, None)  # the check's rounding
    return {**_format_constants(nearest), **_code_constants(nearest),
            "MAGIC": magic_applies(nearest, torch.float32), "MAGIC_SCALE": _magic_scale(nearest),
            "BLOCK": _ENCODE_BLOCK, "BLOCKS": blocks, "PACKED": packed, "ALIGNED": aligned,
            "CHECK": check}  # fmt: skip


def round_into(
    x: torch.Tensor,
    spec: RoundSpec,
    key: torch.Tensor | Key | None,
    random_bits: torch.Tensor | None,
    out: torch.Tensor,
    offset: int = 0,
    runs: int = 1,
    stride: int = 0,
) -> bool:
    """Round ``x`` into ``out`` (contiguous, x's dtype and size; element i is the i-th in
    row-major order), the bits given (int32 ``random_bits`` of x's shape) or drawn with
    ``key`` for stream elements ``offset ..``: a key tensor (int64 ``(k0, k1)`` on x's
    device, read by the kernel) or a :class:`Key` (its words passed with the launch);
    or, ``runs`` > 1, for ``runs`` runs of equal length (x's rows of a Shard(1) piece),
    run r being stream elements ``offset + r * stride ..``. Only where :func:`applies`
    (or, for tests, on CPU tensors under ``TRITON_INTERPRET=1``). In a format without
    NaN, NaN marks an element without a valid result, as in the torch kernels. False
    (nothing written) where Triton could not compile the kernel: the torch kernels then
    take the call."""
    return _round(x, spec, key, random_bits, out, offset, _VALUES, runs=(runs, stride))


def quantize_into(
    x: torch.Tensor, spec: RoundSpec, key: torch.Tensor | Key | None, random_bits: torch.Tensor | None,
    out: torch.Tensor, packed: bool, offset: int = 0, runs: int = 1, stride: int = 0,
) -> bool:
    """:func:`round_into` flat ``x`` (from stream element ``offset``, or in runs, as there;
    even, for ``packed`` pairs), writing the results' codes into ``out`` (uint8 or int16,
    or ``packed`` pairs in uint8, as :func:`encode_into`) in the same kernel; only for
    formats with NaN, where every element has a result. False as round_into's."""
    assert spec.fmt.has_nans, "a format without NaN would need a check of its results"
    return _round(x, spec, key, random_bits, out, offset, _PACKED if packed else _CODES, runs=(runs, stride))


def block_into(
    x: torch.Tensor, spec: RoundSpec, key: torch.Tensor | Key | None, random_bits: torch.Tensor | None,
    out: torch.Tensor, scales: torch.Tensor | None, *, block_size: int, rule: str,
    tensor_scale: torch.Tensor | None, packed: bool = False, offset: int = 0, runs: int = 1, stride: int = 0,
) -> bool:  # fmt: skip
    """Block-quantise ``x`` in memory order, as native.block_into does on a CPU: blocks of
    ``block_size`` consecutive elements (dividing LANES and x's size), a scale S each by
    ``rule`` (a power of two, or E4M3 times ``tensor_scale``, a float32 on x's device),
    elements rounded by ``spec`` with the bits of stream elements ``offset ..`` (or, for
    values, ``runs`` > 1, of runs as :func:`round_into`'s; each a multiple of the block
    size; drawn with ``key``, or given). Into ``out`` the values ``q S`` in x's dtype
    (``scales`` None), or the element codes (uint8, ``packed`` pairs) and into ``scales``
    the scale codes; only where :func:`block_applies`. False as round_into's."""
    assert runs == 1 or scales is None, "runs of values only"
    codes = _VALUES if scales is None else _PACKED if packed else _CODES
    block = (block_size, rule), scales, tensor_scale
    return _round(x, spec, key, random_bits, out, offset, codes, block, (runs, stride))


def block_applies(spec: RoundSpec, x: torch.Tensor, random_bits: torch.Tensor | None, block_size: int,
                  scale: FloatFormat) -> bool:  # fmt: skip
    """Whether :func:`block_into` takes a block call whose elements round by ``spec`` (from
    float32: block.kernel's working float) with scales of ``scale``: where the native
    kernel would on a CPU, and every element has a result (sat, or a format with NaN)."""
    return blocks_fit(block_size, scale) and applies(spec, x, random_bits) and (spec.sat or spec.fmt.has_nans)


def _round(x, spec: RoundSpec, key, random_bits, out: torch.Tensor, offset: int, codes: int,
           block: tuple | None = None, runs: tuple[int, int] = (1, 0)) -> bool:  # fmt: skip
    x = x.contiguous()
    if x.numel() == 0:
        return True
    count, stride = runs
    n = x.numel() // count  # a run's elements
    drawn = key is not None and MODES[spec.mode].stochastic
    given = None if random_bits is None else random_bits.contiguous()
    # k0, k1 (and the selection stream's s0, s1): as the launch's arguments, or on the
    # device, where nothing waits for them.
    host = drawn and isinstance(key, Key)
    words, host_words = None, (0, 0, 0, 0)
    if host:
        host_words = (*stream_words(spec, key), 0, 0)[:4]
    elif drawn:
        select = MODES[spec.mode].takes_fraction
        words = torch.stack(stream_words(spec, key)) if select else key.contiguous()
    # A block call's (size, rule), scale codes and tensor scale: what else it takes.
    shape, scales, tensor_scale = block or (None, None, None)
    fits = aligned(n, offset, x, out, given) and stride % 16 == 0
    variant = (spec, drawn, given is not None, fits, None, host, codes, shape, count > 1)
    rows = round_constants(*variant)["ROWS"]
    # Programs start at a multiple of `rows` rows, the first at the one holding element offset.
    first_row = offset // LANES // rows * rows
    end_row = -(-(offset + n) // LANES)
    programs = -(-(end_row - first_row) // rows)
    if count > 1:  # as many for each run as the run that starts latest in its programs' rows needs
        programs = count * -(-(LANES * rows - 1 + n) // (LANES * rows))
    ints = (n, offset, first_row, programs // count, stride, *host_words)
    tensors = (x, out, given, words, scales, tensor_scale)
    return _launch("round_kernel", programs, tensors, ints, round_constants, variant)


#: Tensors a launch of round_foreach_ takes: each program reads the start of every one.
_FOREACH_TENSORS = 64
#: The dtypes round_foreach_ takes, for tensors and for via, in Triton's names.
_TRITON_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@functools.lru_cache(maxsize=16)
def _table_rest(sizes: tuple[int, ...], indices: tuple[int, ...], elements: int) -> tuple[bytes, int]:
    """The columns of a launch's table after the addresses (sizes, key indices, first
    programs), as int64 bytes, and its programs, for tensors of ``sizes`` at ``elements`` a
    program: the same every step of a write-back, so made once (bytes: nothing can change
    what the cache holds). Padded to _FOREACH_TENSORS entries that start after the last
    program: every launch has the same arguments, so one compilation serves every chunk
    and model."""
    starts = list(itertools.accumulate((-(-size // elements) for size in sizes), initial=0))
    missing = _FOREACH_TENSORS - len(sizes)
    columns = (list(sizes), list(indices), starts[:-1])
    fills = (0, 0, starts[-1])
    return array.array("q", [v for column, fill in zip(columns, fills, strict=True)
                             for v in column + [fill] * missing]).tobytes(), starts[-1]  # fmt: skip


#: Launch tables of round_foreach_ kept on their devices: a write-back's weights stay where
#: they are step after step, so their table is made and sent once, not through pinned
#: memory every step. Keyed by all that a table holds (the addresses, read again at every
#: call, and the rest) and by the device and stream that read it, so a table is read only
#: for tensors that lie at its addresses now, after the copy that wrote it; never written
#: again, never handed out. Emptied when full (a dropped table's memory goes back to its
#: stream's pool, after what that stream has queued).
_TABLES: dict[tuple, torch.Tensor] = {}
_TABLES_KEPT = 8


def _launch_table(addresses: list[int], rest: bytes, device: torch.device) -> torch.Tensor:
    """The int64 table of one launch of round_foreach_ (the addresses, padded to
    _FOREACH_TENSORS, then ``rest``) on ``device``; on a CUDA device kept (:data:`_TABLES`),
    except while the stream is captured in a CUDA graph, which keeps what it reads: a
    table sent then is the graph's own. (Whether it is captured is asked of the current
    device's stream: on another device the table is sent afresh, as under capture.)"""
    cuda = device.type == "cuda"
    key = None
    if cuda and device.index == _current_device()() and not torch.cuda.is_current_stream_capturing():
        key = (device.index, _stream_of()(device.index), tuple(addresses), rest)
        kept = _TABLES.get(key)
        if kept is not None:
            return kept
    table = array.array("q", addresses)
    table.extend([0] * (_FOREACH_TENSORS - len(addresses)))
    table.frombytes(rest)
    table = torch.frombuffer(table, dtype=torch.int64)
    if not cuda:
        return table
    table = table.pin_memory().to(device, non_blocking=True)  # without waiting for queued work
    if key is not None:
        if len(_TABLES) >= _TABLES_KEPT:
            _TABLES.clear()
        _TABLES[key] = table
    return table


def round_foreach_(
    tensors: Sequence[torch.Tensor], spec: RoundSpec, key: Key | None, step: int, indices: Sequence[int],
    via: torch.dtype,
) -> bool:  # fmt: skip
    """Round each tensor in place as ``round_`` of ``t.to(via)`` would, tensor j with the key
    ``fold_in(key, step, indices[j])`` (derived in the kernel): a launch for every
    ``_FOREACH_TENSORS`` tensors; only where :func:`applies` to a tensor of dtype via on
    their device (or, for tests, on CPU tensors under ``TRITON_INTERPRET=1``). False
    (nothing written) where the kernel does not take the list: it takes tensors of one
    dtype and device, contiguous, each size and address a multiple of 16, and a step
    below 2**63. ``spec.fmt`` has a NaN: every element has a result."""
    first = tensors[0]
    dtype, device = first.dtype, first.get_device()
    if dtype not in _TRITON_DTYPES or via not in _TRITON_DTYPES:
        return False
    addresses, sizes = [], []
    for t in tensors:  # one pass, each read once: a model's weights are many
        address, size = t.data_ptr(), t.numel()
        if size % 16 or address % 16 or t.dtype != dtype or t.get_device() != device or not t.is_contiguous():
            return False
        addresses.append(address)
        sizes.append(size)
    drawn = key is not None and MODES[spec.mode].stochastic
    variant = (spec, drawn, False, True, via)
    elements = LANES * round_constants(*variant)["ROWS"]  # a program's
    if drawn and not 0 <= step < 1 << 63:  # the kernel's int64 offset holds it (fold_in takes 64 bits)
        return False
    words, step = ((key.k0, key.k1), step) if drawn else ((0, 0), 0)  # they go with each launch
    launched = False
    for lo in range(0, len(tensors), _FOREACH_TENSORS):
        hi = lo + _FOREACH_TENSORS
        chunk = tensors[lo:hi]
        rest, programs = _table_rest(tuple(sizes[lo:hi]), tuple(indices[lo:hi]), elements)
        if programs == 0:
            continue
        # The table of where the tensors are now (their addresses read at every call).
        table = _launch_table(addresses[lo:hi], rest, first.device)
        arguments = (table, first, None, None, None, None), (_FOREACH_TENSORS, step, 0, 0, 0, *words, 0, 0)
        if not _launch("round_kernel", programs, *arguments, round_constants, variant):
            if launched:  # (the same kernel as the launch before: not seen to happen)
                raise RuntimeError("fewbit: a write-back launch failed after others had written")
            return False
        launched = True
        # Written through their addresses, out of autograd's sight: marked as written, as an
        # in-place op would (a backward through a value saved before then refuses to run).
        torch.autograd.graph.increment_version(list(chunk))
    return True


def rounded(
    x: torch.Tensor, spec: RoundSpec, key: torch.Tensor | Key, offset: int = 0, runs: int = 1, stride: int = 0
) -> torch.Tensor | None:
    """:func:`round_into` a new tensor of x's shape, the bits drawn with ``key`` (a key
    tensor or a Key) for stream elements ``offset ..`` (or runs of them); None where an
    element has no valid result (the torch kernels then say which, with their error;
    finding out waits for the kernel)."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if not round_into(x, spec, key, None, out, offset, runs, stride):
        return None
    return None if not spec.fmt.has_nans and bool(torch.isnan(out).any()) else out


def encode_into(x: torch.Tensor, fmt: FloatFormat, out: torch.Tensor, packed: bool,
                check: bool = True) -> int | None:  # fmt: skip
    """Codes of flat ``x`` (float32 or 16-bit) in ``fmt`` into ``out`` (uint8 or int16, or
    packed pairs in uint8); only where :func:`usable`. Returns the first position that
    holds no value of fmt, else -1 (reading it waits for the kernel, as any check of data
    that raises must); without ``check``, -1 unchecked, and nothing waits. None where
    Triton could not compile the kernel."""
    x = x.contiguous()
    n = x.numel()
    bad = torch.full((1,), n, dtype=torch.int64, device=x.device) if check else None
    if n > 0:
        codes = n // 2 if packed else n
        blocks = _ENCODE_BLOCKS if codes >= _ENCODE_MANY else 1
        programs = -(-codes // (_ENCODE_BLOCK * blocks))
        variant = (fmt, blocks, packed, aligned(n, 0, x, out), check)
        if not _launch("encode_kernel", programs, (x, out, bad), (n,), encode_constants, variant):
            return None
    if not check:
        return -1
    first = int(bad.item())
    return first if first < n else -1


#: Codes a program of decode_kernel looks up.
_DECODE_BLOCK = 1024
#: The ints whose bits decode_kernel moves, by the values' width in bytes.
_BITS = {4: torch.int32, 2: torch.int16}


def decodes(codes: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether :func:`decode_into` takes codes of this dtype (uint8, or int16 bit patterns,
    on a CUDA device) into values of ``dtype``, where the configuration lets the kernel run."""
    return _enabled(codes) and dtype in _TRITON_DTYPES and codes.dtype in (torch.uint8, torch.int16)


def decode_constants(k: int, packed: bool, check: bool, aligned: bool) -> dict:
    """decode_kernel's compile-time constants."""
    return {"BLOCK": _DECODE_BLOCK, "K": k, "PACKED": packed, "CHECK": check, "ALIGNED": aligned}


def decode_into(codes: torch.Tensor, k: int, table: torch.Tensor, out: torch.Tensor, packed: bool,
                check: bool) -> int | None:  # fmt: skip
    """Values of ``codes`` (uint8, int16 bit patterns, or ``packed`` pairs in uint8, in
    memory order) looked up in ``table``, the 2^k values of the format in out's dtype on
    its device, into contiguous ``out``, in one kernel; only where :func:`decodes`. With
    ``check`` (codes of a dtype that holds numbers that are no code), returns the first
    position whose code is not below 2^k, else -1 (reading it waits for the kernel);
    without, -1, and nothing waits. None where Triton could not compile the kernel."""
    codes = codes.contiguous()
    n = out.numel()
    bad = torch.full((1,), n, dtype=torch.int64, device=codes.device) if check else None
    if n > 0:
        bits = _BITS[out.element_size()]
        tensors = (codes, table.view(bits), out.view(bits), bad)
        variant = (k, packed, check, aligned(n, 0, codes, out))
        if not _launch("decode_kernel", -(-n // _DECODE_BLOCK), tensors, (n,), decode_constants, variant):
            return None
    if not check:
        return -1
    first = int(bad.item())
    return first if first < n else -1


#: Elements a block of finite_amax_kernel, and blocks a program from _ENCODE_MANY elements on.
_AMAX_BLOCK = 1024


def amax_constants(blocks: int, aligned: bool) -> dict:
    """finite_amax_kernel's compile-time constants."""
    return {"BLOCK": _AMAX_BLOCK, "BLOCKS": blocks, "ALIGNED": aligned}


def finite_amax(x: torch.Tensor) -> torch.Tensor | None:
    """The largest finite magnitude of ``x`` (float32 or 16-bit; 0 if none) as a 0-d float32
    tensor on x's device, in one read of x and without waiting for it: NVFP4's per-tensor
    scale, as native.finite_amax finds it on a CPU; only where :func:`usable` (with any
    format). None where Triton could not compile the kernel."""
    x = x.contiguous()
    n = x.numel()
    found = torch.zeros((), dtype=torch.int32, device=x.device)  # float32 bits: 0 is +0
    if n > 0:
        blocks = _ENCODE_BLOCKS if n >= _ENCODE_MANY else 1
        programs = -(-n // (_AMAX_BLOCK * blocks))
        if not _launch("finite_amax_kernel", programs, (x, found), (n,), amax_constants,
                       (blocks, aligned(n, 0, x))):  # fmt: skip
            return None
    return found.view(torch.float32)


def compile_for(name: str, arg_types: dict[str, str], constants: dict, arch: int):
    """Kernel ``name`` as Triton compiles it for CUDA compute capability ``arch``, without a
    GPU (Triton's compiler and ptxas): for tests and ``benchmarks/sass_count.py``.
    ``arg_types``: each runtime argument's Triton type (``"*fp32"``, ``"i64"``); the
    others are None. Nothing is said of the arguments' values, as at a launch: what the
    compiler knows of alignment is the kernel's ``ALIGNED``."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(kernels(), name)
    values = {a: None for a in kernel.arg_names if a not in arg_types} | constants
    signature = {a: arg_types.get(a, "constexpr") for a in kernel.arg_names}
    source = ASTSource(kernel, signature, {(kernel.arg_names.index(a),): v for a, v in values.items()})
    return triton_compile(source, target=GPUTarget("cuda", arch, 32), options=_OPTIONS)


#: Launches (kernel, variant, argument kinds, device) that Triton failed to compile once.
_BROKEN: set[tuple] = set()
#: Triton's compiled kernels by the same key, each with its launch (:func:`_launcher`) and
#: its constants in the kernel's order: launched again without Triton's binding and
#: specialising of some thirty arguments (``JITFunction.run``, about 25 us of a call on an
#: H200's host). The kernels tell Triton not to specialise on their runtime arguments'
#: values (ALIGNED says what it would find), so the key names what Triton compiled. Its
#: entries are few (one a spec) and Triton keeps each kernel anyway.
_COMPILED: dict[tuple, tuple] = {}


def _launch(name: str, programs: int, tensors: tuple, ints: tuple, constants_of: Callable[..., dict],
            variant: tuple) -> bool:  # fmt: skip
    """Launch kernel ``name`` on ``programs`` programs with the runtime arguments ``tensors``
    (tensors or None, the kernel's first arguments) and ``ints`` (the rest), and the
    constants ``constants_of(*variant)``; False, with one warning per kernel, where Triton
    cannot compile it (it has not run on every GPU and Triton version): compilation comes
    before the launch, so nothing is written."""
    device = tensors[0].get_device()  # the CUDA device's index (-1: the CPU, for tests)
    if device >= 0 and device != _current_device()():  # Triton launches on the current device
        with torch.cuda.device(device):
            return _launch(name, programs, tensors, ints, constants_of, variant)
    # A tensor compiles as its dtype, None as a constant, an int as an int64 (each kernel's
    # annotation): the rest of what Triton compiles for is the variant's constants.
    kinds = tuple([None if t is None else t.dtype for t in tensors])  # (a list: no generator's frame)
    key = (name, variant, kinds, device)
    if _BROKEN and key in _BROKEN:  # (the key only once one broke)
        return False
    known = _COMPILED.get(key)
    if known is not None:
        compiled, launch, tail = known
        every = (*tensors, *ints, *tail)
        try:
            if not _launch_again(launch, programs, device, every):
                compiled[(programs, 1, 1)](*every)  # Triton's runner, which reads all three
            return True
        except Exception as err:  # raised before the launch (the arguments are read first)
            _relaunch_failed(err)
    args = (*tensors, *ints)
    kernel, constants = getattr(kernels(), name), constants_of(*variant)
    try:
        compiled = kernel[(programs,)](*args, **constants, **_OPTIONS)
    except Exception as err:  # a compiler or ptxas error, Triton's or the driver's
        _BROKEN.add(key)
        warnings.warn(f"fewbit: the Triton kernel did not compile ({err!s:.300}); the torch kernels "
                      "take these calls (same bits, slower)", RuntimeWarning, stacklevel=4)  # fmt: skip
        return False
    if device >= 0 and _RELAUNCH and isinstance(compiled, _compiled_kernel()):
        names = kernel.arg_names  # the runtime arguments first, then the constants
        _COMPILED[key] = compiled, _launcher(compiled), tuple(constants[name] for name in names[len(args) :])
    return True


#: torch.cuda.current_device's source, whitespace aside, whose last line :func:`_current_device`
#: calls itself.
CURRENT_DEVICE = "_lazy_init() return torch._C._cuda_getDevice()"


@functools.cache
def _current_device() -> Callable[[], int]:
    """The current CUDA device's index, asked as torch.cuda.current_device asks it, less its
    Python: torch's C function, which initialises CUDA itself (torch's Module.cpp), where
    torch.cuda.current_device is :data:`CURRENT_DEVICE` (tests/test_gpu_kernel.py fails
    where a torch's is not), else torch.cuda.current_device."""
    mirrored = _holds(torch.cuda.current_device, CURRENT_DEVICE)
    query = getattr(torch._C, "_cuda_getDevice", None) if mirrored else None
    return query or torch.cuda.current_device


def _holds(function: Callable, code: str) -> bool:
    """Whether ``function``'s source holds ``code``, whitespace aside: a call of torch's or
    Triton's that gpu.py makes itself, less their Python; False where there is no source
    to read (then theirs runs)."""
    return code in _source(function)


def _source(function: Callable) -> str:
    """``function``'s source with its whitespace folded to single spaces; empty where there
    is none to read."""
    import inspect

    try:
        return " ".join(inspect.getsource(function).split())
    except (OSError, TypeError):
        return ""


#: Whether _launch launches compiled kernels again itself: until a Triton it was not tried
#: with refuses (_relaunch_failed), then Triton launches every call.
_RELAUNCH = True

#: The launch in Triton's runner (``CompiledKernel.__getitem__``), whitespace aside, that
#: :func:`_launch_again` makes itself.
RUNNER_CALL = ("self.run(grid[0], grid[1], grid[2], stream, self.function, self.packed_metadata, "
               "launch_metadata, knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *args)")


@functools.cache
def runner_mirrored() -> bool:
    """Whether this Triton's runner launches as :data:`RUNNER_CALL` says, so that
    :func:`_launch_again` may launch as it does (tests/test_gpu_kernel.py fails where a
    Triton's does not)."""
    from triton.compiler import CompiledKernel

    return _holds(CompiledKernel.__getitem__, RUNNER_CALL)


@functools.cache
def _runtime():
    """Triton's runtime settings, which hold its launch hooks; None where its runner is not
    :data:`RUNNER_CALL`."""
    if not runner_mirrored():
        return None
    from triton import knobs

    return knobs.runtime


@functools.cache
def _stream_of() -> Callable[[int], int]:
    """The active driver's current stream of a device, as Triton's runner asks for it."""
    from triton.runtime import driver

    return driver.active.get_current_stream


def _launch_again(launch: Callable[[int, int, tuple], None], programs: int, device: int, args: tuple) -> bool:
    """Launch a kernel Triton compiled on ``programs`` programs as Triton's runner would,
    less its Python: ``launch`` (:func:`_launcher`'s) on the device's current stream, without
    launch metadata or hooks where no launch hook is registered (a profiler's). False where
    the runner must launch: its call is not :data:`RUNNER_CALL`, or a hook is registered."""
    runtime = _runtime()
    if runtime is None or not (_silent(runtime.launch_enter_hook) and _silent(runtime.launch_exit_hook)):
        return False
    launch(programs, _stream_of()(device), args)
    return True


#: Triton's launchers (``CudaLauncher.__call__``: the first 16 hex digits of the sha256 of its
#: source, whitespace folded) whose C launch :func:`_launcher` calls itself, by where that
#: launch takes the kernel's arguments: after the launch metadata and hooks, each its own
#: ("spread": Triton 3.5 and 3.6), or as one tuple after their annotations ("tuple": 3.7 to 3.9).
LAUNCHERS = {"b5e4d84a36af22ef": "spread", "e857bd76bbc535c5": "tuple", "16d77af07087b0df": "tuple",
             "6ac1fdd62dbc8cde": "tuple"}  # fmt: skip


@functools.cache
def launcher_layout(launcher: type) -> str | None:
    """How ``launcher``'s C launch takes a kernel's arguments (:data:`LAUNCHERS`); None where
    its ``__call__`` is none of those (tests/test_gpu_kernel.py fails where a Triton's is not)."""
    source = _source(launcher.__call__)
    return LAUNCHERS.get(hashlib.sha256(source.encode()).hexdigest()[:16]) if source else None


def _launcher(compiled) -> Callable[[int, int, tuple], None]:
    """``compiled``'s launch on (programs, stream, arguments) with no launch metadata or hooks:
    its launcher's C launch itself where the launcher is one of :data:`LAUNCHERS` and has
    nothing to do before it (no scratch memory, no GSan), which saves the launcher's Python
    (1.2 us of Triton 3.9's on the 2-core VM); else the launcher."""
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    layout = launcher_layout(type(run))
    busy = layout and (run.global_scratch_size or run.profile_scratch_size or getattr(run, "gsan_enabled", 0))
    if layout is None or busy:
        return through_launcher(compiled)
    c_launch, cooperative, pdl = run.launch, run.launch_cooperative_grid, run.launch_pdl
    if layout == "spread":

        def launch(programs: int, stream: int, args: tuple) -> None:
            c_launch(programs, 1, 1, stream, function, cooperative, pdl, None, None,  # (no scratch memory)
                     metadata, None, None, None, *args)  # fmt: skip

    else:
        annotations, signature = run.arg_annotations, run.kernel_signature

        def launch(programs: int, stream: int, args: tuple) -> None:
            c_launch(programs, 1, 1, stream, function, cooperative, pdl, metadata, None, None, None,
                     None, None, annotations, signature, args)  # fmt: skip

    return launch


def through_launcher(compiled) -> Callable[[int, int, tuple], None]:
    """``compiled``'s launch as :func:`_launcher` makes it, through its launcher's own call
    (``CudaLauncher.__call__``, Python and all)."""
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata

    def launch(programs: int, stream: int, args: tuple) -> None:
        run(programs, 1, 1, stream, function, metadata, None, None, None, *args)

    return launch


def _silent(hook) -> bool:
    """Whether a launch hook does nothing: None, or a chain of none (as Triton 3.6 and 3.9
    hold them)."""
    return hook is None or getattr(hook, "calls", None) == []


def _relaunch_failed(err: Exception) -> None:
    global _RELAUNCH
    _RELAUNCH = False
    _COMPILED.clear()
    warnings.warn(f"fewbit: launching a compiled Triton kernel again failed ({err!s:.300}); Triton "
                  "launches each call from now on (same bits, more host time)", RuntimeWarning, stacklevel=4)


@functools.cache
def _compiled_kernel() -> type:
    """Triton's CompiledKernel, which ``JITFunction.run`` returns and whose ``kernel[grid](*args)``
    launches with every argument, constants included, in the kernel's order (Triton 3.x)."""
    from triton.compiler import CompiledKernel

    return CompiledKernel
