"""fewbit's CPU kernel (``native.cpp``): rounding, and rounding to codes, in one pass
over memory with the random bits drawn inside.

Inductor's C++ loops did not overlap Threefry with the memory traffic, and every
16-bit input took three passes; this kernel is plain C++ without torch headers, built
at first use with the system compiler (``c++``, about 15 s on one core) into
``fewbit.config``'s ``native_cache`` under a name that hashes the source, the flags,
the compiler and the CPU (with no compiler on PATH, a build of the same source, flags
and CPU loads), and loaded with ``ctypes`` (which releases the GIL).
Where it cannot be built or loaded, or does not apply (float64 inputs, formats beyond
float32's range, N > 30), the torch kernels run instead: ``fast.round_fast`` compiled or
eager, whose bits it reproduces (tests/test_native.py). On a GPU, gpu.py's Triton kernel
takes the same calls with the same arithmetic.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import struct
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import torch

from ..config import current, fork_safe_lock
from ..formats import FloatFormat
from ..operators import is_plain
from .checks import RoundSpec, make_spec
from .fast import float32_value
from .magic import magic_applies
from .modes import MODES, SELECT_BITS, RoundMode

__all__ = [
    "applies", "block_applies", "block_into", "decode_into", "decodes", "encode_into", "finite_amax", "fits",
    "quantize_into", "round_into", "rounded", "usable",
]  # fmt: skip

SOURCE = Path(__file__).with_name("native.cpp")
#: -fno-trapping-math lets the vectoriser compute both sides of a select (no float op here
#: may trap, and no result depends on it); -ffp-contract=off keeps every float op single.
#: -fopenmp: the library names libgomp.so.1, which the loader finds loaded already by torch.
FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-ffp-contract=off", "-fopenmp", "-std=c++17",
         "-shared", "-fPIC"]

#: Kernel ids of native.cpp's ``Mode`` enum. Deterministic modes each have a predicate
#: of their own; the stochastic ones are told apart by the mode table's tie rule and
#: where they apply (``sr`` is ``src`` with N = D).
_DETERMINISTIC = {RoundMode.RNE: 0, RoundMode.RNA: 1, RoundMode.RTZ: 2, RoundMode.RUP: 3,
                  RoundMode.RDN: 4, RoundMode.RTO: 5}  # fmt: skip
_STOCHASTIC = {("truncate", "everywhere"): 6, ("up", "everywhere"): 7, ("even", "everywhere"): 8,
               ("odd", "everywhere"): 9, ("even", "near_zero"): 10,
               ("even", "selected"): 11}  # fmt: skip
_ENCODE, _MAGIC_RNE, _MAGIC_SRC, _CLASSICAL_SR, _ENCODE_MAGIC = 12, 13, 14, 15, 16
_STOPS_AT_MAX = {"nowhere": 0, "everywhere": 1, "negative": 2, "positive": 3}
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_VALUES, _CODES_U8, _CODES_I16, _CODES_PACKED = range(4)
#: The native kernel's (and the GPU kernel's) largest N, below the library's
#: ``modes.MAX_BITS``: its few-bit SR sums d_N + n in int32.
NATIVE_MAX_BITS = 30
#: Elements per row of native.cpp: a block size that divides it keeps every block in a row.
LANES = 512
#: native.cpp's ``Rule`` enum (and gpu.py's): block.formats.SCALE_RULES, power-of-two (E8M0)
#: scales then E4M3 ones.
BLOCK_RULES = {"floor": 0, "ceil": 1, "rceil": 2, "even": 3, "nearest": 4, "up": 5}


def even_fraction(fmt: FloatFormat) -> int:
    """The scale rule "even"'s bound, as native.cpp's ``Fmt`` holds it: a block's largest
    magnitude m 2^E rounds up to 2^(E+1) at P bits (``top_p``: intM's less its sign bit)
    where m's 23 fraction bits reach it."""
    t = fmt.top_p - 1
    return 0x800000 - (1 << (22 - t)) if t < 23 else 0x800000


_lock = fork_safe_lock(__name__)  # (a fork during a build gives the child a lock of its own)
_library: ctypes.CDLL | None = None
#: The cache folders (setting ``native_cache``) where the kernel could not be built or
#: loaded: each is tried once a process, so a bad folder set for a while costs no other.
_failed: set[str] = set()


def _bits32(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


@functools.cache
def fits(fmt: FloatFormat) -> bool:
    """Whether the kernel's float32 arithmetic covers ``fmt``: its values are float32
    normals or subnormals, with float32's exponent decomposition, and its exponent field 0
    holds subnormals (codes are float32 bits scaled and shifted)."""
    return fmt.t <= 23 and fmt.emin >= -126 and fmt.emax <= 127 and fmt.k <= 32 and fmt.has_subnormals


def usable(x: torch.Tensor, fmt: FloatFormat) -> bool:
    """Whether the configuration lets the kernel take ``x``, it covers ``fmt`` and it is
    built (building it at first use)."""
    return takes(x, fmt) and _enabled(x)


def _enabled(t: torch.Tensor) -> bool:
    """Whether the configuration lets the kernel take a tensor on t's device, with memory
    it may read (operators.is_plain), and it is built (building it at first use)."""
    config = current()
    return t.is_cpu and is_plain(t) and config.compile and config.native and _load() is not None


def takes(x: torch.Tensor, fmt: FloatFormat) -> bool:
    """Whether the kernel's arithmetic (and gpu.py's, the same) covers x's dtype and ``fmt``."""
    return x.dtype in _DTYPES and fits(fmt)


@functools.lru_cache(maxsize=256)
def covers(spec: RoundSpec) -> bool:
    """Whether the kernels' arithmetic (this and gpu.py's) covers a spec's format and N
    (looked up: every call asks, before its launch on a GPU)."""
    return fits(spec.fmt) and (spec.bits is None or spec.bits <= NATIVE_MAX_BITS)


def takes_call(spec: RoundSpec, x: torch.Tensor, random_bits: torch.Tensor | None) -> bool:
    """Whether the kernels (this and gpu.py's) take a call: x's dtype, the spec
    (:func:`covers`) and the given bits' dtype."""
    return x.dtype in _DTYPES and covers(spec) and (random_bits is None or random_bits.dtype == torch.int32)


def applies(spec: RoundSpec, x: torch.Tensor, random_bits: torch.Tensor | None = None) -> bool:
    """Whether :func:`round_into` takes this call."""
    return takes_call(spec, x, random_bits) and _enabled(x)


#: Names of native.cpp's ``Param`` array, in its order (gpu.py takes them as constants).
PARAM_NAMES = ("T", "EMIN", "BIAS", "MIN_ULP_EXP", "MAX", "MAX_NEG", "BEYOND_POS", "BEYOND_NEG",
               "SMALLEST_NORMAL", "FLAGS", "LIMIT_RULE", "BITS", "SELECT_BELOW", "K", "CODE_OF_MAX",
               "CODE_OF_NAN", "EMAX")  # fmt: skip


@functools.lru_cache(maxsize=256)
def kernel_params(spec: RoundSpec) -> tuple[int, ...]:
    """The values of native.cpp's ``Param`` array for a spec (:data:`PARAM_NAMES`)."""
    fmt, mode = spec.fmt, spec.mode
    beyond_pos = _bits32(float("inf") if fmt.extended else float("nan"))
    beyond_neg = beyond_pos if fmt.signed else _bits32(float("nan"))
    flags = ((fmt.p == 1) | fmt.has_nz << 1 | fmt.has_zero << 2 | spec.sat << 3 | fmt.has_nans << 4
             | fmt.extended << 5 | fmt.signed << 6 | fmt.twos_complement << 7)  # fmt: skip
    return (
        fmt.t, fmt.emin, fmt.bias, fmt.min_ulp_exponent, _bits32(fmt.max),
        _bits32(fmt.max_negative_magnitude), beyond_pos, beyond_neg, _bits32(fmt.smallest_normal), flags,
        _STOPS_AT_MAX[MODES[mode].stops_at_max], spec.bits or 0, spec.select_below or 0, fmt.k,
        fmt.code_of_max, fmt.code_of_nan if fmt.has_nans else 0, fmt.emax,
    )  # fmt: skip


@functools.lru_cache(maxsize=256)
def _kernel(spec: RoundSpec, encode: bool) -> tuple[ctypes.Array, int]:
    """native.cpp's ``Param`` array and kernel id for a spec; ``encode``: the check of
    :func:`encode_into` (``spec`` then RNE without saturation, which must leave x as it is)."""
    values = kernel_params(spec)
    if encode:
        kernel = _ENCODE_MAGIC if magic_applies(spec, torch.float32) else _ENCODE
    else:
        kernel = mode_id(spec)
    return (ctypes.c_int32 * len(values))(*values), kernel


def classical_sr_applies(spec: RoundSpec) -> bool:
    """Whether native.cpp's ``classical_sr_one`` takes a call: SRC everywhere with N = 23 - t
    (``sr`` from float32: N = D in the target's normal range), into the formats the
    float-adder shortcut handles (magic.py), whatever t + N."""
    fmt, info = spec.fmt, MODES[spec.mode]
    return (info.tie == "even" and not info.composite and spec.bits == 23 - fmt.t and fmt.signed
            and fmt.p >= 2 and fmt.has_subnormals and not fmt.twos_complement)  # fmt: skip


def mode_id(spec: RoundSpec) -> int:
    """The kernel for a spec: magic.py's float-adder shortcut where it applies (every
    input is rounded from float32 here), else fast.round_fast's predicate for the mode."""
    if magic_applies(spec, torch.float32):
        return _MAGIC_RNE if spec.mode is RoundMode.RNE else _MAGIC_SRC
    if classical_sr_applies(spec):
        return _CLASSICAL_SR
    info = MODES[spec.mode]
    return _DETERMINISTIC[spec.mode] if not info.stochastic else _STOCHASTIC[(info.tie, info.where)]


def round_into(
    x: torch.Tensor, spec: RoundSpec, words: list[int] | None, random_bits: torch.Tensor | None,
    out: torch.Tensor, offset: int = 0, runs: int = 1, stride: int = 0,
) -> int:
    """Round ``x`` into ``out`` (contiguous, x's dtype and size; element i is the i-th in
    row-major order), the bits given (int32 ``random_bits`` of x's shape) or drawn with
    ``words`` (``compiled.stream_words``: Python ints) for stream elements ``offset ..``;
    or, ``runs`` > 1, for ``runs`` runs of equal length (x's rows of a Shard(1) piece),
    run r being stream elements ``offset + r * stride ..``. Only where :func:`applies`.
    Returns the first position whose result is not valid (a format without NaN: NaN
    input, or overflow without sat), else -1."""
    return _call(x, spec, False, words, random_bits, out, _VALUES, offset, runs=(runs, stride))


def rounded(
    x: torch.Tensor, spec: RoundSpec, words: list[int] | None, offset: int = 0, runs: int = 1, stride: int = 0
) -> torch.Tensor | None:
    """:func:`round_into` a new tensor of x's shape; None where an element has no valid
    result (the torch kernels then say which, with their error)."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    return out if round_into(x, spec, words, None, out, offset, runs, stride) == -1 else None


def encode_into(x: torch.Tensor, fmt: FloatFormat, out: torch.Tensor, packed: bool) -> int:
    """Codes of ``x`` (float32 or 16-bit, in memory order) in ``fmt`` into ``out`` (uint8 or int16, or
    packed pairs in uint8); only where :func:`usable`. Returns the first position that
    holds no value of fmt, else -1."""
    check = make_spec(torch.float32, fmt, RoundMode.RNE, False, None, None)
    return _call(x, check, True, None, None, out, _code_output(fmt, packed), 0)


def quantize_into(
    x: torch.Tensor, spec: RoundSpec, words: list[int] | None, random_bits: torch.Tensor | None,
    out: torch.Tensor, packed: bool, offset: int = 0, runs: int = 1, stride: int = 0,
) -> int:
    """:func:`round_into` ``x`` (at ``offset``, or in runs, as there; even, for ``packed``
    pairs), writing the results' codes into ``out`` as :func:`encode_into` does, in the
    same pass: the rounded values are never stored. Returns :func:`round_into`'s answer."""
    return _call(x, spec, False, words, random_bits, out, _code_output(spec.fmt, packed), offset,
                 runs=(runs, stride))  # fmt: skip


def _code_output(fmt: FloatFormat, packed: bool) -> int:
    return _CODES_PACKED if packed else _CODES_U8 if fmt.k <= 8 else _CODES_I16


def decodes(codes: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether :func:`decode_into` takes codes of this dtype (uint8, or int16 bit patterns)
    into values of ``dtype``, where the configuration lets the kernel run."""
    return dtype in _DTYPES and codes.dtype in (torch.uint8, torch.int16) and _enabled(codes)


def decode_into(codes: torch.Tensor, k: int, table: torch.Tensor, out: torch.Tensor, packed: bool) -> int:
    """Values of ``codes`` (uint8, int16 bit patterns, or ``packed`` pairs in uint8, in
    memory order) looked up in ``table``, the 2^k values of the format in out's dtype,
    into ``out``; only where :func:`decodes`. Returns the first position whose code is not
    below 2^k, else -1."""
    library = _load()
    assert library is not None, "the native kernel is called only where decodes() found it built"
    codes = codes.contiguous()
    kind = _CODES_PACKED if packed else _CODES_I16 if codes.dtype == torch.int16 else _CODES_U8
    return library.fewbit_decode(LOOKUP.pack(codes.data_ptr(), kind, out.numel(), table.data_ptr(), k,
                                             out.element_size(), out.data_ptr(), torch.get_num_threads()))


def block_applies(spec: RoundSpec, x: torch.Tensor, random_bits: torch.Tensor | None, block_size: int,
                  scale: FloatFormat) -> bool:  # fmt: skip
    """Whether :func:`block_into` takes a block call whose elements round by ``spec``, with
    scales of ``scale`` (E8M0, or E4M3)."""
    return blocks_fit(block_size, scale) and applies(spec, x, random_bits)


def blocks_fit(block_size: int, scale: FloatFormat) -> bool:
    """Whether the block kernels (this and gpu.py's) take blocks of ``block_size`` with
    scales of ``scale``: rows hold whole blocks, and the scales are E8M0 or E4M3."""
    return LANES % block_size == 0 and scale.name in ("ocp_e8m0", "ocp_e4m3")


def block_into(
    x: torch.Tensor, spec: RoundSpec, words: list[int] | None, random_bits: torch.Tensor | None,
    out: torch.Tensor, scales: torch.Tensor | None, *, block_size: int, rule: str, tensor_scale: float = 1.0,
    packed: bool = False, offset: int = 0, runs: int = 1, stride: int = 0,
) -> int:
    """Block-quantise ``x`` (in memory order: whole blocks of ``block_size`` consecutive elements, a
    scale S each by ``rule``: a power of two, or E4M3 times ``tensor_scale``), its elements
    rounded by ``spec`` with the bits of stream elements ``offset ..`` (a sharded piece's
    place; or, ``runs`` > 1, of runs as :func:`round_into`'s; each a multiple of the
    block size), or given: into ``out`` the values ``q S`` in x's dtype (``scales``
    None), or the element codes (uint8, ``packed`` pairs) and into ``scales`` the scale
    codes; only where :func:`block_applies`. Returns :func:`round_into`'s answer."""
    output = _VALUES if scales is None else _CODES_PACKED if packed else _CODES_U8
    block = (block_size, BLOCK_RULES[rule], tensor_scale, 0 if scales is None else scales.data_ptr())
    return _call(x, spec, False, words, random_bits, out, output, offset, block, (runs, stride))


def finite_amax(x: torch.Tensor) -> float:
    """The largest finite magnitude of ``x`` (0 if none), in one read; only where the
    configuration and dtype let the kernel take x (:func:`usable` with any format)."""
    library = _load()
    assert library is not None, "the native kernel is called only where usable() found it built"
    x = x.contiguous()
    bits = library.fewbit_finite_amax(x.data_ptr(), _DTYPES[x.dtype], x.numel(), torch.get_num_threads())
    return float32_value(bits)


#: native.cpp's ``Call``: x, dtype, out, output, n, offset, params, mode, the four key
#: words, given, threads, block_size, rule, tensor_scale and scales, then runs and their
#: stride (addresses as int64, 0 for none). The kernels read x and the given bits in
#: memory order (made contiguous here if they are not) and write out's memory, which the
#: callers make contiguous: no shape is needed, and no flattening view (1 us each) is made.
CALL = struct.Struct("<8q4I4qdq2q")
#: native.cpp's ``Lookup``: codes, their kind, n, table, k, the values' width, out, threads.
LOOKUP = struct.Struct("<8q")
_NO_BLOCKS = (0, 0, 1.0, 0)
_ONE_RANGE = (1, 0)
_NO_WORDS = (0, 0, 0, 0)


def _call(x, spec: RoundSpec, encode: bool, words, random_bits, out: torch.Tensor, output: int,
          offset: int, block: tuple = _NO_BLOCKS, runs: tuple[int, int] = _ONE_RANGE) -> int:  # fmt: skip
    library = _load()
    assert library is not None, "the native kernel is called only where usable() found it built"
    x = x.contiguous()  # the kernel reads flat memory
    given = None if random_bits is None else random_bits.contiguous()
    call, _params = packed(x, spec, encode, words, given, out, output, offset, block, runs)
    return library.fewbit_round(call)


def packed(x, spec: RoundSpec, encode: bool, words, given, out: torch.Tensor, output: int, offset: int,
           block: tuple = _NO_BLOCKS, runs: tuple[int, int] = _ONE_RANGE,
           ) -> tuple[bytes, ctypes.Array]:  # fmt: skip
    """fewbit_round's packed ``Call`` on contiguous x and given bits, and the array of
    parameters it points to (which must live until the call returns)."""
    params, kernel = _kernel(spec, encode)
    words = _NO_WORDS if words is None else (*words, 0, 0)[:4]
    call = CALL.pack(x.data_ptr(), _DTYPES[x.dtype], out.data_ptr(), output, x.numel(), offset,
                     ctypes.addressof(params), kernel, *words, 0 if given is None else given.data_ptr(),
                     torch.get_num_threads(), *block, *runs)  # fmt: skip
    return call, params


def _load() -> ctypes.CDLL | None:
    """The built kernel, building it at first use; None (with one warning) when that fails."""
    global _library
    if _library is not None:
        return _library
    folder = os.fspath(current().native_cache)
    if folder in _failed:
        return None
    with _lock:
        if _library is None and folder not in _failed:
            try:
                _library = _cached_or_built(folder)  # (the folder read once: a failure is its own)
            except (OSError, subprocess.CalledProcessError) as err:
                _failed.add(folder)
                what = "loaded" if isinstance(err, _LoadFailed) else "built"
                detail = getattr(err, "stderr", None) or err
                warnings.warn(f"fewbit: the native CPU kernel could not be {what} ({detail!s:.300}); "
                              "torch kernels run instead (same bits, slower)", RuntimeWarning, stacklevel=4)
    return _library


class _LoadFailed(OSError):
    """A library that did not load: dlopen refused it, it is cut short, or it lacks fewbit's functions."""


def _cached_or_built(folder: str) -> ctypes.CDLL:
    """The kernel from the cache, built into it unless it is there already. One there that
    does not load (cut short by a full disk or a killed copy, or not fewbit's) is built
    again once, in its place: left there, it would fail every process that shares the cache."""
    # Absolute: dlopen looks a name without a slash up on the library path, not here.
    cache = Path(folder).resolve()
    _remove_killed_builds(cache)
    try:
        compiler = _compiler()
    except OSError:
        # No compiler here (an image that runs what another one built): a build of this
        # source, these flags and this CPU, by whichever compiler, does the same.
        built = max(cache.glob(f"native-{_build_tag()}-*.so"), key=lambda p: p.stat().st_mtime, default=None)
        if built is None:
            raise
        _mark_used(built)
        return _open(built)
    target = cache / _file_name(compiler)
    if target.exists():
        _mark_used(target)
        with contextlib.suppress(_LoadFailed):
            return _open(target)
    return _build(compiler, target)


def _mark_used(build: Path) -> None:
    """Mark a build in the cache used now, which :func:`_prune` goes by (unless read-only)."""
    with contextlib.suppress(OSError):
        os.utime(build)


def _build(compiler: str, target: Path) -> ctypes.CDLL:
    """Compile the kernel into ``target``, in its cache, and load it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built and loaded in a folder of its own, then moved to its name in one step:
    # processes building at the same time (test workers) each load a whole file, and a
    # build that does not load stays out of the cache. Loaded there, since dlopen hands
    # back a library already loaded under the same name (the one this build replaces).
    # The compiler creates the file, so its mode is a new library's: whoever the umask
    # lets read it (other users of a shared cache) can load it. The folder is removed by
    # the process that made it alone: a TemporaryDirectory's clean-up at exit also ran in a
    # child forked from another thread during the build, and took the folder from under it.
    folder, builder = tempfile.mkdtemp(prefix=_BUILDING, dir=target.parent), os.getpid()
    try:
        partial = Path(folder, target.name)
        subprocess.run([compiler, *FLAGS, "-o", str(partial), str(SOURCE)], capture_output=True, text=True,
                       check=True)  # fmt: skip
        if not partial.exists() or partial.stat().st_size == 0:  # a broken compiler wrapper (ccache, say)
            raise OSError(f"{compiler} exited with success and wrote nothing")
        library = _open(partial)
        os.replace(partial, target)
    finally:
        if os.getpid() == builder:
            shutil.rmtree(folder, ignore_errors=True)
    _prune(target.parent)
    return library


#: Builds a cache keeps: every edit of the source, new flags, compiler or CPU make another,
#: and a few let versions of fewbit that share the cache each find their own.
KEEP_BUILDS = 4
#: The prefix of a build's own folder, and the age past which one is a killed build's:
#: a build takes under a minute.
_BUILDING = "native-building-"
_STALE_BUILD_SECONDS = 3600


def _remove_killed_builds(cache: Path) -> None:
    """Delete the folders of builds killed part way (an hour old), which nothing else would."""
    for folder in cache.glob(_BUILDING + "*"):
        with contextlib.suppress(FileNotFoundError):
            if time.time() - folder.stat().st_mtime > _STALE_BUILD_SECONDS:
                shutil.rmtree(folder, ignore_errors=True)


def _prune(cache: Path) -> None:
    """Delete all but the ``KEEP_BUILDS`` builds in ``cache`` used last (built, or found by
    :func:`_build`). A process that has one loaded keeps its mapping."""
    used = {}
    for path in cache.glob("native-*.so"):
        with contextlib.suppress(FileNotFoundError):  # another process pruning too
            used[path] = path.stat().st_mtime
    for old in sorted(used, key=used.get, reverse=True)[KEEP_BUILDS:]:
        old.unlink(missing_ok=True)


def _compiler() -> str:
    compiler = shutil.which("c++")
    if compiler is None:
        raise OSError("no C++ compiler (c++) on PATH")
    return compiler


def _build_tag() -> str:
    """A hash of what a build depends on but the compiler: the source, the flags, the CPU."""
    return _hash(SOURCE.read_text(), *FLAGS, _cpu())


def _file_name(compiler: str) -> str:
    """The build's name in the cache: :func:`_build_tag`, then a hash of the compiler's version."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    return f"native-{_build_tag()}-{_hash(version)}.so"


def _hash(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _cpu() -> str:
    """What ``-march=native`` depends on: a library built for one CPU may not run on another."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.processor()


def _open(path: Path) -> ctypes.CDLL:
    """The library at ``path`` loaded, its functions typed; :class:`_LoadFailed` where it does not load."""
    try:
        if not _whole(path):
            raise OSError(f"{path} is cut short")
        library = ctypes.CDLL(str(path))
        library.fewbit_round.restype = ctypes.c_int64
        library.fewbit_round.argtypes = [ctypes.c_char_p]  # a packed CALL
        library.fewbit_decode.restype = ctypes.c_int64
        library.fewbit_decode.argtypes = [ctypes.c_char_p]  # a packed LOOKUP
        library.fewbit_finite_amax.restype = ctypes.c_uint32  # (float32 bits: see there)
        library.fewbit_finite_amax.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    except (OSError, AttributeError) as err:  # unreadable, cut short, not a library, or not fewbit's
        raise _LoadFailed(str(err)) from err
    return library


def _whole(path: Path) -> bool:
    """Whether an ELF file at ``path`` is as long as its header says. dlopen maps a file cut
    short past its end, and the process dies of SIGBUS at the first touch there; the linker
    writes the section header table last, so any cut takes off its end. (A checksum beside
    the build would also need checking builds made before it, and a second file that
    cannot be replaced in the same step.) Other files are left to dlopen, which refuses
    what is not a library with an error."""
    with open(path, "rb") as f:
        header = f.read(64)
    if header[:4] != b"\x7fELF":
        return True
    if len(header) < 64:
        return False
    # e_shoff, then e_shentsize and e_shnum 10 bytes after it; 64- or 32-bit, either byte order.
    layout, at = ("Q10xHH", 0x28) if header[4] == 2 else ("I10xHH", 0x20)
    table, entry_size, entries = struct.unpack_from(("<" if header[5] == 1 else ">") + layout, header, at)
    return table + entry_size * entries <= path.stat().st_size


assert SELECT_BITS == 16, "native.cpp draws the selection stream's fields 16 bits wide"
