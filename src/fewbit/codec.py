"""Real storage: values of a format as integer codes, and back.

``encode`` turns a tensor holding values of a format (as ``fewbit.round`` returns
them) into codes: uint8 for K <= 8, int16 holding the 16-bit pattern for K <= 16.
With ``packed=True`` two codes of K <= 4 bits share a byte, the even element in the
low nibble. ``decode`` looks codes up in the format's value table. OCP E4M3/E5M2
codes are the bit patterns of ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` (but a
NaN's: 0xFF, where torch's cast writes 0x7F).

``quantize`` rounds and encodes in one call: ``encode(round(x, fmt, mode, ...), fmt)``,
bit for bit, where the native CPU kernel (and on a GPU the Triton kernel) writes each
result's code in the pass that rounds it, without storing the rounded values.

All three are ``torch.library`` operators (``fewbit::encode``, ``fewbit::decode``,
``fewbit::quantize``) with fake implementations, so compiled and exported code treats
each as one op. Codes carry no gradient: they are integers.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .config import as_flag, current
from .formats import FloatFormat, format
from .operators import operator
from .random import Key, host_key
from .rounding import RoundMode, gpu, native
from .rounding.checks import VALUE_DTYPES, check_holds, check_random_bits, check_tensor, no_result
from .rounding.compiled import stream_words
from .rounding.fast import INT_LAYOUT, decompose, float32_value, narrowed, working_dtype
from .rounding.ops import (
    batch_bits,
    checked_spec,
    fake_checks,
    format_name,
    lookup_format,
    op_args,
)
from .rounding.ops import round_into as round_values_into

__all__ = ["check_value_dtype", "code_dtype", "codes_of", "decode", "encode", "pack_pairs", "quantize"]


def code_dtype(fmt: FloatFormat | str) -> torch.dtype:
    """The dtype codes of ``fmt`` are stored in."""
    fmt = format(fmt)
    if fmt.k > 16:
        raise ValueError(f"{fmt.name} has K={fmt.k}: codes are for K <= 16 (view the tensor instead)")
    return torch.uint8 if fmt.k <= 8 else torch.int16


def encode(x: torch.Tensor, fmt: FloatFormat | str, packed: bool = False, check: bool = True) -> torch.Tensor:
    """Codes of ``x``'s values in ``fmt``. Every element must be a value of fmt
    (round first); otherwise ValueError names the first that is not.

    ``check=False`` skips that check, for values known to be in fmt (``fewbit.round``'s
    results): an element that is not gets an unspecified code, never an error. On a GPU
    the check reads a flag back, which waits for the kernel; without it the call queues
    its kernel and returns, as a plain op does (and may be captured in a CUDA graph)."""
    x = check_tensor(x)
    packed = as_flag(packed, "packed")
    check = as_flag(check, "check")
    return _encode(x, format_name(fmt), packed, check)


def decode(
    codes: torch.Tensor,
    fmt: FloatFormat | str,
    dtype: torch.dtype = torch.float32,
    packed: bool = False,
) -> torch.Tensor:
    """Values of ``codes`` in ``fmt`` as a tensor of ``dtype`` (NaN codes give NaN)."""
    codes = check_tensor(codes, "codes")
    packed = as_flag(packed, "packed")
    return _decode(codes, format_name(fmt), dtype, packed)


def quantize(
    x: torch.Tensor,
    fmt: FloatFormat | str,
    mode: RoundMode | str = "rne",
    *,
    sat: bool = False,
    bits: int | None = None,
    random_bits: torch.Tensor | None = None,
    fraction: float | None = None,
    seed: int | Key | torch.Tensor | None = None,
    packed: bool = False,
) -> torch.Tensor:
    """Codes of ``x`` rounded to ``fmt``: ``encode(round(x, fmt, mode, ...), fmt, packed)``,
    bit for bit, in one call (the arguments are :func:`fewbit.round`'s, then ``packed``).

    On a CPU the native kernel rounds each element and writes its code in one pass, and
    the rounded values are never stored: a quarter of ``round``'s output bytes from
    float32, and no second pass to encode them. On a GPU the Triton kernel does the same
    into a format with NaN (into one without: round, which checks its results, then
    encode unchecked). Elsewhere (no native kernel, float64 inputs) it rounds and then
    encodes.

    Raises what :func:`fewbit.round` raises (a value with no result in a format without
    NaN), and :func:`encode`'s errors for the codes (K > 16; ``packed`` needs K <= 4 and
    an even last dimension)."""
    args = op_args(x, fmt, mode, sat, bits, fraction, seed, random_bits)
    packed = as_flag(packed, "packed")
    return _quantize(*args, packed)


def encode_checks(x: torch.Tensor, fmt: FloatFormat, packed: bool) -> tuple[torch.Size, torch.dtype]:
    """Check an encode (or quantize) call; return the shape and dtype of its codes. (Of the
    full tensor for a DTensor: its rules check it, as its pieces' kernels see a piece.)"""
    check_holds(x.dtype, fmt)  # also rejects non-float dtypes
    dtype = code_dtype(fmt)
    if not packed:
        return x.shape, dtype
    _check_packable(fmt, x.shape)
    return (*x.shape[:-1], x.shape[-1] // 2), dtype


def codes_of(work: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """int32 codes of ``work`` (float32 or float64) read as values of ``fmt``, unchecked:
    right for values of fmt, meaningless for others (:func:`encode` checks). Plain torch
    ops, so a compiled caller (block quantisation) fuses them."""
    if work.dtype not in (torch.float32, torch.float64):  # (a KeyError of the layouts' table, before)
        raise TypeError(f"codes_of reads float32 or float64 values, not {work.dtype} (encode takes any)")
    M = INT_LAYOUT[work.dtype][1]
    negative, is_inf, is_nan, e_x, sig = decompose(work, fmt.emin)
    exp_field_of_emin = 1 if fmt.has_subnormals else 0
    normal = ((e_x - fmt.emin + exp_field_of_emin) << fmt.t) + (sig >> (M - fmt.t)) - (1 << fmt.t)
    subnormal = sig >> (fmt.min_ulp_exponent + M - e_x).clamp(0, M + 1)  # |x| / ulp
    is_normal = (e_x >= fmt.emin) & (sig >= 1 << M)  # zero and subnormals: r * ulp
    mag = torch.where(is_normal, normal, subnormal)
    if fmt.extended:
        mag = torch.where(is_inf, fmt.code_of_max + 1, mag)
    if fmt.has_nans:
        mag = torch.where(is_nan, fmt.code_of_nan, mag)
    if fmt.twos_complement:
        code = torch.where(negative, -mag, mag) & ((1 << fmt.k) - 1)
    elif fmt.signed:
        keep_sign = negative & ~is_nan if fmt.has_nz else negative & (mag != 0) & ~is_nan
        code = torch.where(keep_sign, mag | (1 << (fmt.k - 1)), mag)
    else:
        code = mag
    return code.to(torch.int32)


def pack_pairs(code: torch.Tensor) -> torch.Tensor:
    """Two codes of at most 4 bits a byte along the last dimension, the even one low. An
    odd last dimension is a ValueError (its last code broadcast into every byte)."""
    if code.dim() == 0 or code.shape[-1] % 2:
        raise ValueError(f"pack_pairs pairs codes along the last dimension; it has shape {tuple(code.shape)}")
    return code[..., 0::2] | (code[..., 1::2] << 4)


@operator("fewbit::encode")
def _encode(x: torch.Tensor, fmt: str, packed: bool, check: bool) -> torch.Tensor:
    return _codes(x, lookup_format(fmt), packed, check)


def _codes(x: torch.Tensor, fmt: FloatFormat, packed: bool, check: bool) -> torch.Tensor:
    """encode's kernel."""
    shape, dtype = encode_checks(x, fmt, packed)
    out = _empty(x, shape, dtype)
    if native.usable(x, fmt):  # (its check is fused, and costs nothing to keep)
        bad = native.encode_into(x, fmt, out, packed)
    elif gpu.usable(x, fmt):  # None: the kernel did not compile, and the torch path takes the call
        bad = gpu.encode_into(x, fmt, out, packed, check)
    else:
        bad = None
    if bad is not None:
        if check and bad >= 0:
            _not_a_value(x.reshape(-1)[bad], fmt)
        return out
    # In chunks on a CPU, as eager rounding (``eager_chunk``): codes_of makes several int64
    # tensors of its input's size, which over the whole tensor came to 8.5x x's bytes (19x
    # from bfloat16). An even chunk keeps pairs whole, the last dimension being even. An
    # error after some chunks leaves them written only into out, this call's own tensor.
    n = x.numel()
    chunk = current().eager_chunk if x.device.type == "cpu" else max(n, 1)
    if n <= chunk:  # one chunk, as x's shape (a tenth of a small call's time went on views)
        code = _checked_codes(x, fmt, check)
        return out.copy_(pack_pairs(code) if packed else code)
    flat, flat_out = x.reshape(-1), out.view(-1)
    chunk += chunk % 2
    for start in range(0, n, chunk):
        code = _checked_codes(flat[start : start + chunk], fmt, check)
        if packed:
            code = pack_pairs(code)
        written = start // 2 if packed else start
        flat_out[written : written + code.numel()].copy_(code)
    return out


def _checked_codes(part: torch.Tensor, fmt: FloatFormat, check: bool) -> torch.Tensor:
    """int32 codes of ``part`` of encode's input (x, or a chunk of it); with ``check`` a ValueError names its
    first element that is no value of fmt."""
    work = part.to(working_dtype(part.dtype))
    code = codes_of(work, fmt)
    if not check:  # an element that is no value has a code of any width: kept to K bits, off its neighbour's
        return code & ((1 << fmt.k) - 1)
    # Exactness check: a code is right only if it decodes to the value given.
    in_range = (code >= 0) & (code < 1 << fmt.k)
    back = _lookup(code.clamp(0, (1 << fmt.k) - 1), fmt, work.dtype)
    # Compared as bits, a zero of either sign matching the other: a float compare under
    # torch.set_flush_denormal(True) reads subnormals as 0 (2^-149 passed as E8M0's 2^-127).
    itype = INT_LAYOUT[work.dtype][0]
    ours, theirs = work.view(itype), back.view(itype)
    equal = (ours == theirs) | (((ours | theirs) << 1) == 0)
    same = in_range & (equal | (torch.isnan(back) & torch.isnan(work)))
    if not bool(same.all()):
        _not_a_value(work[~same][0], fmt)
    return code


def _empty(like: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A new contiguous tensor of ``shape`` and ``dtype`` on like's device: by
    ``empty_like`` where the shape is like's, at half the host time of ``torch.empty``."""
    if shape == like.shape:
        return torch.empty_like(like, dtype=dtype, memory_format=torch.contiguous_format)
    return torch.empty(shape, dtype=dtype, device=like.device)


def _not_a_value(element: torch.Tensor, fmt: FloatFormat):
    """Refuse a 0-d tensor's value, named exactly: a float32 subnormal's from its bits (its
    conversion to a Python float reads it as 0 under torch.set_flush_denormal(True))."""
    if element.dtype == torch.float64:
        value = element.item()
    else:  # (16 bits to float32: exact)
        value = float32_value(element.float().view(torch.int32).item())
    raise ValueError(f"{value!r} is not a value of {fmt.name}; round it first (fewbit.round)")


@_encode.register_vmap
def _(x, fmt, packed, check):
    """One call for the batch: each element's code is its own, and pairs lie along each
    sample's last dimension (a sample of one element, 0-d, has none to pack: a call each,
    which refuses it)."""
    return None if packed and x.dim() < 2 else (x, fmt, packed, check)


@_encode.register_fake
def _(x, fmt, packed, check):
    fmt = lookup_format(fmt)
    shape, dtype = encode_checks(x, fmt, packed)
    return x.new_empty(shape, dtype=dtype)


@operator("fewbit::quantize")
def _quantize(
    x: torch.Tensor, fmt: str, rounding: str, sat: bool, bits: int | None, fraction: float | None,
    key: torch.Tensor | None, random_bits: torch.Tensor | None, packed: bool,
) -> torch.Tensor:
    spec = checked_spec(x, fmt, rounding, sat, bits, fraction, key, random_bits)
    shape, dtype = encode_checks(x, spec.fmt, packed)
    rand = check_random_bits(x, spec, random_bits) if key is None else None
    ints = host_key(key)
    on_cpu = native.applies(spec, x, rand)
    # On a GPU in one kernel where every element has a result (a format with NaN); a format
    # without would need its results checked, as round checks them.
    if on_cpu or (spec.fmt.has_nans and gpu.applies(spec, x, rand)):
        out = _empty(x, shape, dtype)
        if on_cpu:  # rounds and encodes in one pass
            words = None if ints is None else stream_words(spec, ints)
            if native.quantize_into(x, spec, words, rand, out, packed) >= 0:
                raise no_result(spec.fmt, nan_input=bool(torch.isnan(x).any()))  # as fewbit.round
            return out
        if gpu.quantize_into(x, spec, ints, rand, out, packed):
            return out
    values = torch.empty_like(x, memory_format=torch.contiguous_format)
    round_values_into(x, spec, key, random_bits, values)  # raises where a value has no result
    return _codes(values, spec.fmt, packed, check=False)  # values of the format: nothing to check


@_quantize.register_vmap
def _(x, fmt, rounding, sat, bits, fraction, key, random_bits, packed):
    """As round's and encode's: one call for a batch rounded deterministically or with
    bits given the same for every sample (``batch_bits``)."""
    given = batch_bits(x, key, random_bits)
    if given is None or (packed and x.dim() < 2):
        return None
    return x, fmt, rounding, sat, bits, fraction, key, *given, packed


@_quantize.register_fake
def _(x, fmt, rounding, sat, bits, fraction, key, random_bits, packed):
    fake_checks(x, fmt, rounding, sat, bits, fraction, key, random_bits)
    fmt = lookup_format(fmt)
    shape, dtype = encode_checks(x, fmt, packed)
    return x.new_empty(shape, dtype=dtype)


def check_value_dtype(dtype: object, what: str = "values come") -> None:
    """Raise TypeError unless ``dtype`` is a float dtype fewbit rounds (``VALUE_DTYPES``), the
    only kind values of a format come in (``what`` begins the message). Not torch's 8-bit
    floats: a cast into one would round the values again, unchecked (BlockTensor.dequantize
    gave 448 for mxfp4's 768, and 0 for mxfp8_e4m3's 1e-4, in float8_e4m3fn)."""
    if not isinstance(dtype, torch.dtype) or dtype not in VALUE_DTYPES:
        supported = ", ".join(str(d) for d in VALUE_DTYPES)
        raise TypeError(f"{what} in a float dtype ({supported}), not {dtype!r}")


def _decode_checks(codes: torch.Tensor, fmt: FloatFormat, dtype: torch.dtype, packed: bool) -> torch.Size:
    """Check a decode call; return the shape of its values."""
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise TypeError(f"codes must have an integer dtype, not {codes.dtype}")
    check_value_dtype(dtype, "decode gives values")
    check_holds(dtype, fmt)
    code_dtype(fmt)
    if not packed:
        return codes.shape
    _check_packable(fmt, None)
    if codes.dtype != torch.uint8:
        raise TypeError(f"packed codes are uint8, not {codes.dtype}")
    if codes.dim() == 0:
        raise ValueError("packed codes lie along a last dimension; got a 0-d tensor")
    return (*codes.shape[:-1], codes.shape[-1] * 2)


@operator("fewbit::decode")
def _decode(codes: torch.Tensor, fmt: str, dtype: torch.dtype, packed: bool) -> torch.Tensor:
    fmt = lookup_format(fmt)
    shape = _decode_checks(codes, fmt, dtype, packed)
    if native.decodes(codes, dtype):  # a table lookup in one pass
        out = _empty(codes, shape, dtype)
        table = _table(fmt, dtype, codes.device)
        if native.decode_into(codes, fmt.k, table, out, packed) >= 0:
            raise _no_code(fmt)
        return out
    check = decode_checks_codes(codes.dtype, fmt, packed)
    if gpu.decodes(codes, dtype):  # the same lookup in one kernel (None: it did not compile)
        out = _empty(codes, shape, dtype)
        bad = gpu.decode_into(codes, fmt.k, _table(fmt, dtype, codes.device), out, packed, check)
        if bad is not None:
            if bad >= 0:
                raise _no_code(fmt)
            return out
    # Contiguous, as the fake kernel's result. Codes wider than 32 bits are checked before
    # they narrow (int32 of an int64 2^32 + 5 is code 5); uint64, which has no min/max, as
    # int64, where one of 2^63 or more is negative and refused like one.
    wide = codes.element_size() > 4
    code = codes.to(torch.int64 if wide else torch.int32).contiguous()  # (to() may alias strided int64)
    if codes.dtype == torch.int16:
        code = code & 0xFFFF  # int16 holds the 16-bit pattern
    if packed:
        code = unpack_pairs(code)
    if code.numel() and check and (int(code.min()) < 0 or int(code.max()) >= 1 << fmt.k):
        raise _no_code(fmt)
    return _lookup(code, fmt, dtype)


def decode_checks_codes(dtype: torch.dtype, fmt: FloatFormat, packed: bool) -> bool:
    """Whether decode checks codes of ``dtype`` for range: only where the dtype holds a
    number that is no code (the check waits for a GPU, and uint8 codes of 8 bits, or 16
    of 16, or packed 4 of 4, are all codes)."""
    return (4 if packed else {torch.uint8: 8, torch.int16: 16}.get(dtype)) != fmt.k


def _no_code(fmt: FloatFormat) -> ValueError:
    return ValueError(f"codes of {fmt.name} lie in [0, {1 << fmt.k})")


@_decode.register_vmap
def _(codes, fmt, dtype, packed):
    """One call for the batch, as encode's."""
    return None if packed and codes.dim() < 2 else (codes, fmt, dtype, packed)


@_decode.register_fake
def _(codes, fmt, dtype, packed):
    return codes.new_empty(_decode_checks(codes, lookup_format(fmt), dtype, packed), dtype=dtype)


def unpack_pairs(code: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_pairs`."""
    return torch.stack([code & 0xF, code >> 4], dim=-1).flatten(-2)


def _check_packable(fmt: FloatFormat, shape) -> None:
    if fmt.k > 4:
        raise ValueError(f"packing puts two codes in a byte: needs K <= 4, {fmt.name} has K={fmt.k}")
    if shape is not None and (len(shape) == 0 or shape[-1] % 2):
        raise ValueError(f"packing pairs elements along the last dimension; it has size {tuple(shape)[-1:]}")


def _lookup(code: torch.Tensor, fmt: FloatFormat, dtype: torch.dtype) -> torch.Tensor:
    # index_select takes int32 codes as they are: indexing by them took an int64 copy, 8
    # bytes a code beside the values (and ten times the time).
    return _table(fmt, dtype, code.device).index_select(0, code.reshape(-1)).view(code.shape)


@lru_cache(maxsize=64)
def _table(fmt: FloatFormat, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Through float32 to nearest, its subnormals (E8M0's 2^-127, bfloat16's) made from
    # their bits: the conversion gives 0 under torch.set_flush_denormal(True), and the table
    # is kept for the process. (float32 to 16 bits converts exactly.)
    return narrowed(torch.tensor(fmt.values(), dtype=torch.float64), dtype).to(device)
