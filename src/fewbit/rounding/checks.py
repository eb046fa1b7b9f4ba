"""Argument checks shared by the reference and the fast implementation.

Everything here runs before any output is written, so a bad call never leaves a
half-rounded tensor behind.
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from ..config import as_flag
from ..formats import FloatFormat, format
from .modes import (
    FRACTION_MODES,
    MAX_BITS,
    MODES,
    SELECT_BITS,
    RoundMode,
    modes_text,
    natural_sr_bits,
    parse_mode,
)

__all__ = [
    "VALUE_DTYPES", "RoundSpec", "check_bits", "check_holds", "check_random_bits", "check_round_args",
    "dtype_format", "make_spec", "no_result", "scalar_args",
]

_DTYPE_FORMATS = {
    torch.float16: "binary16",
    torch.bfloat16: "bfloat16",
    torch.float32: "binary32",
    torch.float64: "binary64",
}
#: The dtypes fewbit rounds, and the only ones values of a format come back in.
VALUE_DTYPES = tuple(_DTYPE_FORMATS)


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

    def __hash__(self) -> int:
        # Specs key the kernels' caches, looked in a few times a call: hashed once.
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.fmt, self.source, self.mode, self.sat, self.bits, self.select_below))

    @property
    def may_refuse(self) -> bool:
        """Whether an element may have no result, found only once rounded: a format without
        NaN (a NaN input, or a value beyond its range without sat)."""
        return not self.fmt.has_nans

    @property
    def random_range(self) -> int:
        extra = SELECT_BITS if MODES[self.mode].takes_fraction else 0
        return 1 << (self.bits + extra)


def scalar_args(sat, bits, fraction) -> tuple[bool, int | None, float | None]:
    """``sat``, ``bits`` and ``fraction`` as Python scalars: numpy bools, integers and
    floats are accepted as their Python kinds; a bool is not a number here."""
    if type(sat) is bool and type(bits) in (int, type(None)) and type(fraction) in (float, type(None)):
        return sat, bits, fraction  # Python scalars already: every call passes here first
    for value, name, kind in ((sat, "sat", "bool"), (bits, "bits", "int"), (fraction, "fraction", "float")):
        refuse_traced_numpy(value, name, kind)
    sat = as_flag(sat, "sat")
    if bits is not None:
        if isinstance(bits, (bool, np.bool_)) or not isinstance(bits, numbers.Integral):
            raise TypeError(f"bits must be an int, not {type(bits).__name__}")
        bits = int(bits)
    if fraction is not None:
        if isinstance(fraction, (bool, np.bool_)) or not isinstance(fraction, numbers.Real):
            raise TypeError(f"fraction must be a number in [0, 1], not {type(fraction).__name__}")
        fraction = float(fraction)
    return sat, bits, fraction


def refuse_traced_numpy(value: object, name: str, kind: str) -> None:
    """Refuse, naming it, a numpy scalar that Dynamo traces: it traces numpy as tensors, so
    the scalar comes as an array with no value at trace time, where ``name`` picks the graph
    (the checks refused it as "not ndarray", and a numpy bool in Dynamo's words about a
    tensor's repr, until 2026-11-30). Eager calls take numpy scalars."""
    if isinstance(value, np.ndarray) and torch.compiler.is_compiling():
        raise TypeError(f"{name}: torch.compile traces a numpy scalar as an array, without its value; "
                        f"pass a Python {kind} ({kind}({name}) before the compiled call)")


def check_tensor(x, name: str = "x") -> torch.Tensor:
    """Raise TypeError unless ``x`` is a dense (strided) torch.Tensor with memory (the
    kernels read its elements there, which a sparse tensor or a ZeroTensor does not lay
    out); return it, a view with torch's negative bit as a tensor of its values."""
    if not isinstance(x, torch.Tensor):
        if isinstance(x, torch.fx.Proxy):
            raise symbolic_trace_refused("fewbit's functions")
        raise TypeError(f"{name} must be a torch.Tensor, not {type(x).__name__}")
    # (Eager only: traced, in a backward torch.compile's strict mode refuses the query.)
    if torch.compiler.is_compiling():
        return x
    if x.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, not {x.layout}: .to_dense() converts it")
    if x.is_neg():  # (.conj().imag: its memory holds -x, which the kernels would read)
        return x.resolve_neg()
    if lazy := lazily_valued(x, name):
        raise TypeError(f"{name} is {lazy}")
    return x


def symbolic_trace_refused(what: str) -> TypeError:
    """The error for ``what`` given a ``torch.fx.Proxy``: symbolic tracing runs Python on
    stand-ins that hold no values, where fewbit checks its arguments' values and types as
    Python runs (a Proxy failed as "x must be a torch.Tensor, not Proxy", or in torch's words
    on FakeQuantize's control flow). The tracers that record fewbit's ops work."""
    return TypeError(f"torch.fx.symbolic_trace cannot trace {what} (fewbit checks arguments as Python "
                     "runs, and a Proxy has no values): torch.export.export(model, args).module() or "
                     "torch.fx.experimental.proxy_tensor.make_fx gives an FX graph holding fewbit's ops, "
                     "or make the module calling it a leaf of your torch.fx.Tracer (is_leaf_module)")


def lazily_valued(t: torch.Tensor, name: str) -> str | None:
    """Why the kernels cannot read or write ``t``'s memory as its values (a view with
    torch's negative bit holds -t there; a ZeroTensor has none), or None."""
    if t.is_neg():
        return (f"a view with torch's negative bit (from .conj().imag), whose memory holds -{name}: "
                f"{name}.resolve_neg() gives its values")  # fmt: skip
    if _IS_ZEROTENSOR is not None and _IS_ZEROTENSOR(t):
        return f"a ZeroTensor, which has no memory: {name}.clone() gives its zeros"
    return None


#: torch's private query of a ZeroTensor (which is_neg's public sibling lacks); where a
#: torch has none, a ZeroTensor is not refused here (tests/test_operator.py fails first).
_IS_ZEROTENSOR = getattr(torch.Tensor, "_is_zerotensor", None)


def no_result(fmt: FloatFormat, nan_input: bool) -> ValueError:
    """The error for an element without a result in ``fmt`` (a format without NaN): a NaN
    input, or a value beyond the range without ``sat``."""
    if nan_input:
        return ValueError(f"{fmt.name} has no NaN to hold a NaN input")
    return ValueError(f"{fmt.name} has no Inf or NaN for a value beyond its range; use sat=True")


def check_round_args(
    x: torch.Tensor,
    fmt: FloatFormat | str,
    mode: RoundMode | str,
    sat: bool,
    bits: int | None,
    fraction: float | None,
) -> RoundSpec:
    """Validate everything but the random bits themselves; return the call's spec."""
    check_tensor(x)
    return make_spec(x.dtype, format(fmt), parse_mode(mode), *scalar_args(sat, bits, fraction))


def check_mode_args(mode: RoundMode, bits: int | None, fraction: float | None) -> int | None:
    """The checks of ``bits`` and ``fraction`` (scalars already normalised) that hold
    whatever the dtype; returns ``select_below`` (see :class:`RoundSpec`)."""
    info = MODES[mode]
    if info.takes_fraction:
        if fraction is None:
            raise TypeError(f"mode {mode.value!r} needs fraction=p, a number in [0, 1]")
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        select_below = round(fraction * (1 << SELECT_BITS))
    elif fraction is not None:
        raise ValueError(f"fraction is only for {modes_text(FRACTION_MODES)}, not {mode.value!r}")
    else:
        select_below = None
    if info.bits == "none" and bits is not None:
        raise ValueError(f"mode {mode.value!r} is deterministic and takes no bits")
    if bits is None and info.bits == "required":
        raise ValueError(f"mode {mode.value!r} needs bits=N, the random bits per element")
    check_bits(bits)
    return select_below


def check_bits(bits: int | None, name: str = "bits") -> None:
    """Raise ValueError unless ``bits`` (an int already, or None) is an N in 1..MAX_BITS."""
    if bits is not None and not 1 <= bits <= MAX_BITS:
        raise ValueError(f"{name} must be in 1..{MAX_BITS}, got {bits}")


def check_holds(dtype: torch.dtype, fmt: FloatFormat, what: str | None = None, suggest: bool = True) -> None:
    """Raise ValueError unless a ``dtype`` tensor holds every value of ``fmt``, saying what
    it lacks and, with ``suggest``, which dtype would do (where the caller can choose one;
    ``what``, where given, names the tensor first); a TypeError for a dtype fewbit does not
    round. A block format is checked by its element format: a block's values are elements
    times a power of two (float32's exponent range), or for NVFP4 a product that the kernel
    rounds to the dtype anyway."""
    fmt = getattr(fmt, "element", fmt)  # (a BlockFormat: fewbit.block builds on this module)
    if not _holds(dtype, fmt):
        why = _cannot_hold(dtype, dtype_format(dtype), fmt, suggest)
        raise ValueError(why if what is None else f"{what}: {why}")


@functools.lru_cache(maxsize=256)
def _holds(dtype: torch.dtype, fmt: FloatFormat) -> bool:
    # Asked on every call of encode and quantize: FloatFormat.contains takes some 20 us.
    return dtype_format(dtype).contains(fmt)


def _cannot_hold(dtype: torch.dtype, source: FloatFormat, fmt: FloatFormat, suggest: bool) -> str:
    """Why a ``dtype`` tensor cannot hold ``fmt`` (its precision, its exponent range, or
    both), and with ``suggest`` the narrowest dtype that can, where one does."""
    short = [f"{fmt.top_p} significand bits to {source.name}'s {source.p}"] if fmt.top_p > source.p else []
    if fmt.emax > source.emax or fmt.min_ulp_exponent < source.min_ulp_exponent:
        short.append("a wider exponent range" + ("" if short else f" than {source.name}'s"))
    holders = [d for d, name in _DTYPE_FORMATS.items() if format(name).contains(fmt)]
    fix = (f"a {min(holders, key=lambda d: d.itemsize)} tensor holds it" if holders
           else "no dtype fewbit rounds holds it (float64 is the widest)")
    why = f"a {dtype} tensor cannot hold every value of {fmt.name} ({', and '.join(short)})"
    return f"{why}: {fix}" if suggest else why


#: Bounded: a schedule of ``fraction`` (a float) makes a spec a step, and every call looks
#: its spec up (an unbounded cache grew by half a kilobyte a step).
@functools.lru_cache(maxsize=4096)
def make_spec(
    dtype: torch.dtype, fmt: FloatFormat, mode: RoundMode, sat: bool, bits: int | None,
    fraction: float | None, held: bool = True,
) -> RoundSpec:
    """The spec of a call on a ``dtype`` tensor (scalars already normalised). ``held``:
    the results are values of ``fmt`` in a ``dtype`` tensor, which must hold them all (a
    block's elements are not: its tensor holds them times their scale, or codes; they
    round quotients x / S of float32 or wider, whose D sets the default N)."""
    source = dtype_format(dtype)
    info = MODES[mode]
    if held:
        check_holds(dtype, fmt)
    select_below = check_mode_args(mode, bits, fraction)
    if info.bits == "none":
        return RoundSpec(fmt, source, mode, sat, None, None)
    # A block's elements round their quotients x / S, formed in float32 or wider (block.kernel):
    # classical SR draws the bits of those, not of 16-bit x's, whose N = D would round the
    # probability of every element whose result falls among the element format's subnormals.
    quotients = source if held else dtype_format(torch.promote_types(dtype, torch.float32))
    natural = natural_sr_bits(quotients, fmt)
    if bits is None:
        bits = natural
    if info.bits == "natural" and bits != natural:
        raise ValueError(
            f"mode {mode.value!r} uses N = min(D, {MAX_BITS}) = {natural} bits for {quotients.name} -> "
            f"{fmt.name}; use 'src' to choose N"
        )
    return RoundSpec(fmt, source, mode, sat, bits, select_below)


#: Integer dtypes without torch's min/max kernels (:func:`check_random_bits`).
_NO_MIN_MAX = (torch.uint16, torch.uint32, torch.uint64)


def check_random_bits(
    x: torch.Tensor, spec: RoundSpec, random_bits: torch.Tensor | None, values: bool = True
) -> torch.Tensor | None:
    """Check explicit random bits against the spec (presence, shape, device, integer
    dtype, and with ``values`` their range) and return them as the kernels take them:
    int32, or int64 where the values need it. Any integer dtype is accepted, unsigned
    ones included."""
    if spec.bits is None:
        if random_bits is not None:
            raise ValueError(f"mode {spec.mode.value!r} is deterministic and takes no random_bits")
        return None
    if random_bits is None:
        raise ValueError(
            f"mode {spec.mode.value!r} needs random bits: pass random_bits "
            f"(integers in [0, {spec.random_range})) or seed=, and fewbit draws them"
        )
    random_bits = check_tensor(random_bits, "random_bits")  # (a negative-bit view's memory holds -bits)
    if random_bits.dtype == torch.bool or random_bits.is_floating_point() or random_bits.is_complex():
        raise TypeError(f"random_bits must have an integer dtype, not {random_bits.dtype}")
    if random_bits.shape != x.shape:
        raise ValueError(f"random_bits has shape {tuple(random_bits.shape)}, x has {tuple(x.shape)}")
    if random_bits.device != x.device:
        raise ValueError(f"random_bits is on {random_bits.device}, x on {x.device}")
    # uint16, uint32 and uint64 lack min/max kernels: compare them as int64, where a uint64
    # beyond 2^63 wraps to a negative value and is refused like one. Other dtypes are compared
    # as they are (an int64 copy of uint8 bits took 8 bytes an element beside the kernels'
    # int32 copy); int32 bits, the common case, are passed on without a copy.
    wide = random_bits.to(torch.int64) if random_bits.dtype in _NO_MIN_MAX else random_bits
    if values and wide.numel():
        lo, hi = (int(v) for v in torch.aminmax(wide))
        if lo < 0 or hi >= spec.random_range:
            raise ValueError(
                f"random_bits must lie in [0, {spec.random_range}) for N={spec.bits}"
                f"{' plus the selection bits' if MODES[spec.mode].takes_fraction else ''};"
                f" found values in [{lo}, {hi}]"
            )
    return wide.to(torch.int32 if spec.random_range <= 1 << 31 else torch.int64)
