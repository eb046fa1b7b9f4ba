"""Block quantisation in plain torch ops: one reduction for each block's amax, one
elementwise pass that scales, rounds and (for ``round``) scales back.

The same Python runs eager and under ``torch.compile`` (``ops`` compiles it once per
spec), so both give the same bits; native.cpp's block path computes it too, on a CPU for
blocks along the last axis with E8M0 or E4M3 scales (tests/test_native.py). Layout:
``x`` with the block axis moved last, padded with zeros to whole blocks and viewed as
``(rows, blocks, B)``; random bits are drawn for x's own flat indices and laid out the
same way, so element ``i`` of x takes the bits ``fewbit.round`` would give it.

Scaled values ``x / S``: exact for power-of-two scales, one correctly rounded division for
NVFP4's. Where the quotient falls below the working float's normal range it is replaced by
``±2^emin`` of that float: every value in ``(0, 2^-125)`` rounds alike in every mode to an
element format whose smallest subnormal is at least ``2^-92`` (SR reads at most 32 bits
of the fraction), and the working float is float64 for element formats finer than that.

Subnormals are kept whatever ``torch.set_flush_denormal`` says (FTZ and DAZ on the thread:
a float op then reads a float32 subnormal as 0 and makes 0 for one). Data near 2^-126
has scales that are float32 subnormals (E8M0's 2^-127, NVFP4's ``scale * tensor scale``)
and values ``q * S`` that are, so no float32 op may meet them there: 2^e is built from
its bits; a whole tensor's largest magnitude is found from its bits (:func:`magnitude_max`);
and where the thread or a thread torch splits the work among flushes (``flushed``,
:func:`flushes`) a block's is too, and the
scales, NVFP4's tensor scale, ``x / S`` and ``q * S`` are formed in float64 from float32s
:func:`widened` from their bits (float32's subnormals are float64's normals; the product
of two float32 significands is exact there, a quotient's double rounding innocuous) and
:func:`narrowed` back to float32 to nearest in integers. With it off, the float32 ops and
conversions give those bits, cheaper (a float32<->float64 conversion costs torch's CPU
ops some 10 ns an element; Inductor vectorises a float amax, not one of bits).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..formats import FloatFormat, format
from ..rounding.checks import RoundSpec, make_spec
from ..rounding.compiled import round_body
from ..rounding.fast import INT_LAYOUT, bits_of, narrowed
from ..rounding.modes import RoundMode
from .formats import BlockFormat

__all__ = ["BlockSpec", "block_layout", "block_scales", "flushes", "magnitude_max", "quantize_blocks",
           "times_scale", "widened"]

#: An element format whose smallest subnormal is below 2^-92 is rounded in float64 (see above).
_FLOAT32_FLOOR = -92
_FLOAT32_SMALLEST = format("binary32").smallest_subnormal


@dataclass(frozen=True)
class BlockSpec:
    """Validated arguments of one block call: the format, the rule in force and the
    element rounding (``spec``: a ``RoundSpec`` for x's dtype)."""

    bfmt: BlockFormat
    rule: str
    spec: RoundSpec
    scale_spec: RoundSpec | None  # amax / M to a scale with a significand (E4M3, float32)

    @property
    def work_dtype(self) -> torch.dtype:
        return work_dtype(self.bfmt, self.spec.source.k == 64)

    @property
    def may_refuse(self) -> bool:
        """Whether an element may have no value, found only once rounded: overflow without
        sat in an element format without Inf or NaN (a NaN is held in the scale)."""
        return not (self.spec.sat or self.spec.fmt.has_nans)


def work_dtype(bfmt: BlockFormat, wide: bool) -> torch.dtype:
    """The dtype a block's values ``q * S`` are formed in: float64 for float64 data
    (``wide``) or an element format finer than float32 holds, else float32."""
    fine = bfmt.element.min_ulp_exponent < _FLOAT32_FLOOR
    return torch.float64 if fine or wide else torch.float32


def make_block_spec(dtype: torch.dtype, bfmt: BlockFormat, rule: str, mode: RoundMode, sat: bool,
                    bits: int | None, fraction: float | None) -> BlockSpec:
    scale_spec = None
    if not bfmt.power_of_two:
        # To nearest, or up for rule "up"; saturating: an Inf block takes the largest scale.
        scale_mode = RoundMode.RNE if rule == "nearest" else RoundMode.RUP
        scale_spec = make_spec(torch.float64, bfmt.scale, scale_mode, True, None, None)
    element = make_spec(dtype, bfmt.element, mode, sat, bits, fraction, held=False)
    return BlockSpec(bfmt, rule, element, scale_spec)


def block_layout(t: torch.Tensor, axis: int, block_size: int) -> torch.Tensor:
    """``t`` with ``axis`` moved last, zero-padded to whole blocks, as ``(rows, blocks, B)``."""
    moved = t.movedim(axis, -1)
    length = moved.shape[-1]
    pad = -length % block_size  # no branch on it: a compiled kernel serves padded and whole rows
    moved = torch.nn.functional.pad(moved, (0, pad))
    return moved.reshape(-1, (length + pad) // block_size, block_size)


def from_block_layout(blocks: torch.Tensor, shape: torch.Size, axis: int) -> torch.Tensor:
    """The inverse of :func:`block_layout` for a tensor of ``shape``."""
    # (Not list.pop(axis): Dynamo may make axis a symbol, which it cannot pop at.)
    if not -len(shape) <= axis < len(shape):  # (a BlockTensor made by hand)
        raise IndexError(f"block axis {axis} is out of range for a tensor of {len(shape)} dimensions")
    axis %= len(shape)
    moved_shape = [n for d, n in enumerate(shape) if d != axis]
    length = shape[axis]
    padded = blocks.shape[-2] * blocks.shape[-1]  # (not -1: ambiguous for a tensor with no rows)
    flat = blocks.reshape(*moved_shape, padded)[..., :length]
    return flat.movedim(-1, axis)


_SMALLEST64, _TINY64, _ONE, _HALF = 2.0**-1074, 2.0**-1022, 1.0, 0.5  # (names: no constant folding)


#: torch's CPU ops split a tensor of this many elements or more among their threads
#: (ATen's GRAIN_SIZE); below it an op runs on the calling thread.
_GRAIN = 32768
#: One element in this many of the probe is float32's smallest subnormal: a kept subnormal
#: costs its op a microcode assist, and a thread's share of the probe holds 64 of them.
_PROBE_STEP = 512


def flushes(work: torch.Tensor | None = None, compiled: bool = False) -> bool:
    """Whether float ops on ``work``'s elements may flush subnormals
    (``torch.set_flush_denormal(True)``: DAZ reads them as 0, FTZ makes 0 for them): on
    this thread, whose Python float ops run as eager torch's do, or, where torch splits
    the work among its threads (a CPU tensor of ``_GRAIN`` elements or more, or any size
    in a ``compiled`` kernel, which Inductor splits as it likes), on one of those.
    torch.set_flush_denormal sets the calling thread's flags alone, and each OpenMP
    thread keeps those its pool started with: set before a thread's first parallel op
    and cleared after, its workers flushed where the thread did not (block values near
    2^-126 came out 0 there), so they are probed (:func:`_workers_flush`). ``work``
    None: the thread's own ops (0-d tensors). True while Dynamo traces (a user's
    compiled ``dequantize``): the graph runs on threads it cannot know, and the exact
    way is exact with flushing off too. (The block kernels, compiled once for both,
    take it as an argument.)"""
    if torch.compiler.is_compiling() or _SMALLEST64 * _ONE == 0.0 or _TINY64 * _HALF == 0.0:
        return True
    if work is None or work.device.type != "cpu" or (work.numel() < _GRAIN and not compiled):
        return False
    threads = torch.get_num_threads()
    return threads > 1 and _workers_flush(threads)


def _workers_flush(threads: int) -> bool:
    """Whether one of the calling thread's ``threads`` intra-op threads flushes: a torch
    op on ``threads`` grains gives each of them one, every grain holding subnormals.
    (Probed each call, not cached: a pool grown later starts its new threads with the
    flags the thread has then.)"""
    product = _probe(threads).mul(_ONE)
    return bool(product[::_PROBE_STEP].eq(0).any())


@functools.lru_cache(maxsize=8)
def _probe(threads: int) -> torch.Tensor:
    """The probe's input: float32 zeros with every ``_PROBE_STEP``-th the smallest
    subnormal, made from its bits (a conversion would flush it on a thread that does)."""
    bits = torch.zeros(threads * _GRAIN, dtype=torch.int32)
    bits[::_PROBE_STEP] = 1
    return bits.view(torch.float32)


def widened(t: torch.Tensor, flushed: bool = True) -> torch.Tensor:
    """``t`` (float32, or 16-bit: exact in float32) as float64, exactly where the thread
    flushes (``flushed``, :func:`flushes`), whose DAZ has the conversion read a float32
    subnormal as 0: a subnormal's bits count float32's smallest subnormals, 2^-149."""
    if t.dtype == torch.float64:
        return t
    if not flushed:
        return t.double()
    t = t.float()  # (16 bits to float32: exact, a bfloat16 subnormal's bits shifted)
    bits = t.view(torch.int32)
    counted = (bits & 0x7FFFFF).to(torch.float64) * _FLOAT32_SMALLEST  # (float64 normals)
    counted = torch.where(bits < 0, -counted, counted)
    return torch.where((bits & 0x7F800000) == 0, counted, t.double())


def times_scale(q: torch.Tensor, factor: torch.Tensor, dtype: torch.dtype, flushed: bool = True,
                owned: bool = False) -> torch.Tensor:  # fmt: skip
    """Block values ``q * S`` (both float32, or both float64) in ``dtype``: in float64 for
    float64, else rounded once to float32 (as a float32 product is, and float64's converted)
    and converted to dtype. ``flushed`` (:func:`flushes`): formed in float64 (exact for
    float32 ``q`` and ``S``) and :func:`narrowed`, as the product of a float32 subnormal S,
    or one that is a float32 subnormal, is 0 under FTZ and DAZ; else by a float op, in q's
    own memory where ``q`` is the caller's temporary (``owned``: no second tensor of its size)."""
    if not flushed:
        return (q.mul_(factor) if owned else q * factor).to(dtype)
    return narrowed(widened(q) * widened(factor), dtype)


def next_float32_up(t: torch.Tensor) -> torch.Tensor:
    """The float32 after each finite ``t >= 0``, from its bits (nextafter's compares read a
    subnormal as 0 under DAZ)."""
    return (t.view(torch.int32) + 1).view(torch.float32)


def magnitude_max(t: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``t.abs().amax(dim, keepdim=True)`` (every dimension for None: 0-d), compared as
    the magnitudes' bits, which order as their values (a NaN's above Inf's, so a NaN
    wins, as amax's does): DAZ has a float compare read float32 subnormals as 0, which
    made amax of a block of them 0."""
    itype = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
             torch.float16: torch.int16}[t.dtype]  # fmt: skip
    magnitudes = t.view(itype) & ~(-1 << (8 * t.element_size() - 1))  # the sign bit cleared
    top = magnitudes.amax() if dim is None else magnitudes.amax(dim=dim, keepdim=True)
    return top.view(t.dtype)


def _pow2(e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``2^e`` for integer ``e`` in ``[-127, 127]``, built from its bits (exact; E8M0's
    2^-127, a float32 subnormal, is 0 through a float conversion under FTZ)."""
    if dtype == torch.float64:
        return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)
    _, M, bias = INT_LAYOUT[torch.float32]
    e = e.to(torch.int32)
    # 2^-127, the one subnormal, is 2^22 times float32's smallest (a constant, not a shift
    # by a tensor).
    return torch.where(e >= 1 - bias, (e + bias) << M, 1 << (M - 1)).view(torch.float32)


def _exponent_of(amax: torch.Tensor, rule: str, element: FloatFormat, flushed: bool) -> torch.Tensor:
    """The power-of-two scale's exponent ``e`` for each block, by ``rule``, clipped to
    E8M0's ``[-127, 127]`` (an all-zero block takes -127, as gfloat does)."""
    a = widened(amax, flushed)
    bits = a.view(torch.int64)
    floor_log2 = ((bits >> 52) & 0x7FF) - 1023  # exact for every float32 amax; Inf gives 1024
    m = ((bits & ((1 << 52) - 1)) | (1023 << 52)).view(torch.float64)  # amax / 2^floor_log2, in [1, 2)
    e = floor_log2 - element.emax
    if rule == "ceil":
        e = e + (m > 1).to(e.dtype)
    elif rule == "rceil":
        e = e + (m * 2.0**element.emax > element.max).to(e.dtype)
    elif rule == "even":
        e = e + (m >= 2.0 - 2.0**-element.top_p).to(e.dtype)  # (intM: P less its sign bit)
    return torch.where(a == 0, -127, e).clamp(-127, 127)


def block_scales(
    amax: torch.Tensor, spec: BlockSpec, tensor_scale: torch.Tensor | None, flushed: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, S)`` per block: ``scale`` holds values of the scale format (in the
    working dtype), ``S`` the factor elements are multiplied by (``scale`` times the
    per-tensor scale where the format has one). A block holding a NaN gets NaN.
    ``flushed``: the thread flushes subnormals (:func:`flushes`)."""
    bfmt, work = spec.bfmt, spec.work_dtype
    if bfmt.power_of_two:
        scale = _pow2(_exponent_of(amax, spec.rule, bfmt.element, flushed), work)
    else:
        target = widened(amax, flushed) / bfmt.element.max
        if tensor_scale is not None:
            target = target / widened(tensor_scale, flushed)
        scale = round_body(target, spec.scale_spec, None).to(work)
    scale = torch.where(torch.isnan(amax), torch.nan, scale)
    if tensor_scale is None:
        return scale, scale

    def times_tensor_scale(scale: torch.Tensor) -> torch.Tensor:
        # scale * ts to nearest in float32 (a subnormal there where ts is small), in work.
        product = times_scale(scale, tensor_scale, torch.float32, flushed)
        return widened(product, flushed) if work == torch.float64 else product

    factor = times_tensor_scale(scale)
    if spec.rule == "up":
        # S = scale * ts rounds to nearest in float32, maybe below amax / M: the next scale
        # then (E4M3's values lie at least 1/16 apart, so 1 + 2^-5 lies below the next).
        short = widened(factor, flushed) * bfmt.element.max < widened(amax, flushed)
        bumped = round_body(scale.to(torch.float64) * (1 + 2.0**-5), spec.scale_spec, None).to(work)
        scale = torch.where(short, bumped, scale)
        factor = times_tensor_scale(scale)
    return scale, factor


def finite_amax(x: torch.Tensor, found: float | torch.Tensor | None = None, flushed: bool = True
                ) -> torch.Tensor:  # fmt: skip
    """``x``'s largest finite magnitude, a 0-d float32 tensor on x's device (0 for a
    tensor without one); float64 data's rounded up to float32 (to nearest, it could land
    below the data, and rule "up" clip). ``found``: that magnitude where the caller has
    it (the native kernel finds it in one read, as a float; the GPU's as a 0-d float32
    tensor). ``flushed``: the thread flushes subnormals (:func:`flushes`)."""
    if isinstance(found, torch.Tensor):
        return found
    if found is not None:  # (from its bits: a float32 subnormal converted from found is 0 under FTZ)
        bits = torch.tensor(bits_of(found, torch.float32), dtype=torch.int32, device=x.device)
        return bits.view(torch.float32)
    if not x.numel():
        return torch.zeros((), device=x.device)
    amax = magnitude_max(torch.where(torch.isfinite(x), x, 0))
    if amax.dtype != torch.float64:
        return amax.float()  # (16 bits to float32: exact)
    rounded = narrowed(amax, flushed=flushed)
    return torch.where(widened(rounded, flushed) < amax, next_float32_up(rounded), rounded)


def divided(a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
    """``a / b`` correctly rounded in a's dtype on every device, compiled too: Inductor
    writes a float32 division on a GPU as Triton's, which is not correctly rounded
    (``div.full.f32``, up to 2 ulp off), where the CPU's is. Divided in float64 (Triton's
    is ``div.rn.f64``) and rounded back, it is: 53 >= 2 * 24 + 2 bits make the double
    rounding innocuous. (On a CPU the float32 division is kept: it is correctly rounded,
    and twice as fast.)"""
    if a.dtype != torch.float32 or a.device.type == "cpu":
        return a / b
    return (a.double() / (b.double() if isinstance(b, torch.Tensor) else b)).float()


def tensor_scale_of(x: torch.Tensor, bfmt: BlockFormat, amax: float | torch.Tensor | None = None,
                    rule: str | None = None) -> torch.Tensor | None:  # fmt: skip
    """NVFP4's per-tensor float32 scale: the finite amax over the largest value a block
    can hold (``M * scale max``), so the largest block scale lands on the scale format's
    maximum; 1 for a tensor without a finite nonzero value. ``amax``: as
    :func:`finite_amax`'s ``found`` (a sharded tensor's: the largest of every rank's).
    Under ``rule`` "up" (default: the format's), raised by float32 steps until that
    maximum's S, its product with the scale rounded to float32, is at least amax / M, so
    that no block clips (to nearest, both may round down).

    The scale is a float32, at its limits: float64 data beyond float32's range take
    float32's largest value as amax (their blocks saturate), and a tiny amax whose
    quotient underflows takes float32's smallest positive value (1 would flush them all)."""
    if not bfmt.tensor_scale:
        return None
    # In float64, where a float32 subnormal (amax, ts, S) is normal (see the module's
    # docstring); a float64 division is correctly rounded on every device (see divided).
    flushed = flushes()
    found = widened(finite_amax(x, amax, flushed), flushed).clamp(max=torch.finfo(torch.float32).max)
    ts = narrowed((found / (bfmt.element.max * bfmt.scale.max)).clamp(min=_FLOAT32_SMALLEST), flushed=flushed)
    if (rule or bfmt.rule) == "up":
        # ts and S, each rounded to nearest, are at least (1 - 2^-24) of their quotient and
        # product, and a float32 step raises ts by at least 2^-24 of it: three steps suffice.
        top_scale = torch.full_like(ts, bfmt.scale.max)
        for _ in range(3):
            top = times_scale(top_scale, ts, torch.float32, flushed)
            short = widened(top, flushed) * bfmt.element.max < found
            ts = torch.where(short, next_float32_up(ts), ts)
    return torch.where(found > 0, ts, 1.0)


def quantize_blocks(
    blocks: torch.Tensor, spec: BlockSpec, rand: torch.Tensor | None, tensor_scale: torch.Tensor | None,
    flushed: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantise ``blocks`` (``(rows, blocks, B)``): returns ``(q, scale, S)``, ``q`` the
    element values (working dtype, the layout of ``blocks``), ``scale`` and ``S`` per
    block (:func:`block_scales`). ``rand``: the random bits in the layout of ``blocks``.
    ``flushed``: a thread of the work flushes subnormals (:func:`flushes`); True by
    default, as for the helpers it calls: the exact way holds whatever the threads do,
    the float32 ops only where none flushes (a default of False gave 0 for data near
    2^-126 to a caller that flushed and passed none)."""
    work = blocks.to(spec.work_dtype)
    # Compared as bits where the thread flushes; else as floats, which Inductor vectorises
    # where it does not the bits' (compiled block kernels took 1.2-1.7 times as long).
    amax = magnitude_max(work, -1) if flushed else work.abs().amax(dim=-1, keepdim=True)
    scale, factor = block_scales(amax, spec, tensor_scale, flushed)
    if flushed:  # in float64, where float32 subnormals are normal (see the module's docstring)
        wide, wide_factor = widened(work), widened(factor)
        scaled = wide / wide_factor
    else:
        wide, wide_factor = work, factor
        scaled = divided(work, factor)
    tiny = torch.finfo(spec.work_dtype).tiny
    underflow = (scaled.abs() < tiny) & (wide != 0)
    scaled = torch.where(underflow, torch.copysign(torch.full_like(scaled, tiny), wide), scaled)
    # A scale that underflowed holds zeros, each with its element's sign (E2M1 has a -0).
    scaled = torch.where(wide_factor == 0, torch.copysign(torch.zeros_like(scaled), wide), scaled)
    # In a NaN block the scale carries the NaN; elements without a NaN code hold 0.
    fill = torch.nan if spec.spec.fmt.has_nans else 0.0
    scaled = torch.where(torch.isnan(factor), fill, scaled).to(spec.work_dtype)
    q = round_body(scaled.reshape(-1), spec.spec, None if rand is None else rand.reshape(-1))
    return q.view(work.shape), scale, factor
