"""Rules of the general aten ops (layout, arithmetic, reductions, comparisons, factories)
and of torch.distributed's broadcast and scatter.

Each rule states its output scale in its docstring (``s`` is the input's scale, ``sa``
and ``sb`` those of two operands, ``c`` a Python number). A plain tensor operand has
scale 1; a Python number c is seed 003's constant of scale |c|. Sums use the common
scale max(sa, sb), so the larger operand keeps its data exactly and nothing overflows
that did not already; a static zero scale is the zero array and drops out of sums and
maxima. In-place and ``_foreach_`` ops need no rule of their own (see ``tensor``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from functools import reduce
from typing import Any

import torch

from ..formats import format
from .casts import round_pow2
from .tensor import (
    REDUCED,
    NoRuleError,
    Scale,
    ScaledTensor,
    assign,
    at_scale,
    aten,
    check_dtype,
    coefficient,
    compute_dtype,
    data_readable,
    has_per_channel_views,
    holds_every_value,
    inplace,
    is_partial_view,
    is_static,
    parts,
    promoted_dtype,
    rule,
    scalar_scale,
    sdiv,
    set_scale,
    share_scale,
    smax,
    smul,
    spow,
    times,
    value,
    wrap,
)

# --- layout: the data moves, the scale follows ---------------------------------------

_VIEWS = (aten.view, aten._unsafe_view, aten.reshape)
#: The range of a static scale (:func:`_float32_scale`), read once: a rule checks each.
_FLOAT32_SMALLEST, _FLOAT32_MAX = format("binary32").smallest_subnormal, format("binary32").max


def _compact(s: torch.Tensor) -> torch.Tensor:
    # A scale expanded to data's shape back to its broadcastable form: one element along
    # every dimension it does not vary in.
    for dim in range(s.dim()):
        if s.stride(dim) == 0 and s.size(dim) > 1:
            s = s.narrow(dim, 0, 1)
    return s


@rule(aten.view, aten._unsafe_view, aten.reshape, aten.expand, aten.permute, aten.t, aten.transpose,
      aten.unsqueeze, aten.squeeze, aten.select, aten.slice, aten.alias, aten.detach, aten.split,
      aten.split_with_sizes, aten.unbind, aten.narrow, aten.index, aten._unsafe_index, aten.index_select,
      aten.gather, aten.embedding, aten.repeat, aten.flip, aten.roll, aten.diagonal, aten.unfold,
      aten.movedim, aten.masked_select, aten.take, aten.rot90, aten.narrow_copy, aten.diagonal_copy,
      aten.pixel_shuffle, aten.pixel_unshuffle, aten.channel_shuffle, aten.native_channel_shuffle,
      aten.reflection_pad1d, aten.reflection_pad2d, aten.reflection_pad3d, aten.replication_pad1d,
      aten.replication_pad2d, aten.replication_pad3d, aten.upsample_nearest1d, aten.upsample_nearest2d,
      aten.upsample_nearest3d, aten._upsample_nearest_exact1d, aten._upsample_nearest_exact2d,
      aten._upsample_nearest_exact3d)
def _layout(func, x, *args, **kwargs):
    """Views, indexing, gather, embedding, repeat, and the ops that move or copy elements
    (masked_select, take, rot90, reflection and replication padding, nearest upsampling,
    pixel shuffles): scale s (a per-channel scale goes through the same op, expanded to
    data's shape). The latter had no rule: on the values at scale 1 in the data's dtype,
    float16 data at scale 2^-30 were zeros there, and at 2^20 inf."""
    d, s = parts(x)
    out = func(d, *args, **kwargs)
    if is_static(s) or s.dim() == 0:
        return [wrap(o, s) for o in out] if isinstance(out, (list, tuple)) else wrap(out, s)
    big = s.expand(d.shape)
    so = big.reshape(*args, **kwargs) if func.overloadpacket in _VIEWS else func(big, *args, **kwargs)
    if isinstance(out, (list, tuple)):
        return [wrap(o, _compact(t)) for o, t in zip(out, so, strict=True)]
    return wrap(out, _compact(so))


@rule(aten.unsafe_split, aten.unsafe_split_with_sizes, aten.unsafe_chunk)
def _unsafe_split(func, x, *args, **kwargs):
    """unsafe_split, unsafe_split_with_sizes, unsafe_chunk (GRU's gates): split's pieces,
    whose aliasing of x the schema does not state (autograd does not track them as views).
    They view x's data all the same, so they share its scale as split's pieces do. They had
    no rule: GRU warned and ran on dequantized values."""
    out = _layout(func, x, *args, **kwargs)
    if isinstance(x, ScaledTensor):
        for piece in out:
            share_scale(x, piece)
    return out


@rule(aten.view.dtype)
def _view_dtype(func, x, dtype):
    """view(dtype) of another dtype: refused (TypeError); the data's bits read as another
    dtype have no value at the scale (view ``t.unscaled`` instead)."""
    if dtype != x.dtype:
        raise TypeError(f"view({dtype}) of a ScaledTensor of {x.dtype}: its data's bits have no value "
                        "at its scale; view t.unscaled instead")
    d, s = parts(x)
    return wrap(func(d, dtype), s)


@rule(aten.as_strided)
def _as_strided(func, x, size, stride, storage_offset=None):
    """as_strided: scale s; a per-channel one laid out over the data's storage as the data
    are, so that the same as_strided picks each element's (an element beyond x's takes the
    largest). It was x rebalanced to one scale, a copy: writes through it were lost, as they
    were through a view of a per-channel input that a compiled function returned, which
    AOTAutograd makes with as_strided."""
    d, s = parts(x)
    offset = d.storage_offset() if storage_offset is None else storage_offset
    if not _per_channel(s):
        return wrap(func(d, size, stride, offset), s)
    n = d.untyped_storage().nbytes() // d.element_size()
    laid = s.amax().expand(n).clone()
    # Written by index: d may hold an element more than once (an expanded view), where copy_
    # into the same as_strided of laid refuses (torch's "more than one element ... refers to
    # a single memory location"). Such elements are one, so their scales are too.
    at = torch.arange(n, device=d.device).as_strided(d.shape, d.stride(), d.storage_offset())
    laid.index_put_((at,), s.expand(d.shape))
    return wrap(func(d, size, stride, offset), _compact(laid.as_strided(size, stride, offset)))


@rule(aten.clone, aten.neg, aten.abs, aten.relu, aten.tril, aten.triu, aten.leaky_relu)
def _keep(func, x, *args, **kwargs):
    """Same-shape ops that commute with a positive factor: scale s."""
    d, s = parts(x)
    return wrap(func(d, *args, **kwargs), s)


@rule(aten._to_copy)
def _to_copy(func, x, **kwargs):
    """Cast or move: scale s (moved with the data); a non-float dtype gives a plain tensor.
    A cast to a narrower dtype that would overflow (float32 data beyond float16's range)
    rebalances first: a power of two moves from the data to the scale (exactly), so that
    max |data| is in (1/2, 1] as with ``dynamic_rescale_max(pow2=True)``."""
    dtype = kwargs.get("dtype")
    if dtype is not None and not dtype.is_floating_point:
        return func(value(x), **kwargs)
    if dtype is not None:
        check_dtype(dtype)  # before the cast
    d, s = parts(x)
    out = func(d, **kwargs)
    f = _overflow_factor(d, out, s)
    if not is_static(f, 1.0):
        out, s = func(times(d, sdiv(1.0, f)), **kwargs), smul(s, f)
    if isinstance(s, torch.Tensor) and s.device != out.device:
        s = s.to(out.device)
    return wrap(out, s)


def _overflow_factor(d: torch.Tensor, out: torch.Tensor, s: Scale) -> Scale:
    # 1 where out, d cast, holds d's finite values; else the power of two 2^k >= max |d|.
    # A number where it can be read: eager on the host, or a static scale (which stays
    # static; an accelerator syncs). Traced, a tensor (1 where the data fit).
    info = torch.finfo(out.dtype)
    if info.max >= torch.finfo(d.dtype).max or d.numel() == 0:
        return 1.0
    # A cast overflows from max + half an ulp of the top binade (it rounds to nearest).
    # Compared with that, not tested on a cast (isinf), which Inductor leaves out: the
    # same bits eager and compiled.
    edge = info.max + info.eps * 2.0 ** math.floor(math.log2(info.max)) / 2
    top = torch.where(d.isfinite(), d.abs(), 0).amax().to(compute_dtype(d.dtype))
    f = torch.where(top >= edge, round_pow2(top.float(), "up"), 1.0)
    return f.item() if type(f) is torch.Tensor and (f.is_cpu or is_static(s)) else f


@rule(aten.copy)
def _copy(func, dest, src, non_blocking=False):
    """Functional copy (for copy_): src's values in dest's shape and dtype, scale of src
    (cast by the cast's rule first: where its data would overflow dest's dtype, a power
    of two moves into the scale); into a non-float dest, src's values (a plain tensor)."""
    if not dest.dtype.is_floating_point:
        return func(dest, value(src), non_blocking)
    if isinstance(src, ScaledTensor) and src.dtype != dest.dtype:
        src = aten._to_copy.default(src, dtype=dest.dtype)
    d, s = parts(src)
    return wrap(func(parts(dest)[0], d, non_blocking), s)


@rule(aten.copy_)
def _copy_(func, dest, src, non_blocking=False):
    """copy_: a whole ScaledTensor takes a ScaledTensor source's scale with its values (as
    the zero array takes a result's), so that weights at a larger scale load
    (``load_state_dict``) without overflowing 16-bit data at the model's scale; so does a
    part of a tensor whose rest is zeros (:func:`holds_every_value`). Another part takes the
    larger of the two scales, for the whole tensor and its views (the rest's data divided
    by a power of two where the scales are powers of two: they never overflow, and lose
    bits only to subnormals), so that a part never overflows either: DCP loads a checkpoint
    saved on other ranks so, piece by piece at the saved tensor's scale, and float16 data at
    a smaller scale had overflowed. Whole or part differs between a sharded tensor's ranks
    when they load a checkpoint saved on others, so their scales may differ after it:
    ``fsdp.agree_scales`` (which scalify's modules run after ``load_state_dict``). A plain
    source, whole or part, counts as scale 1 (a plain tensor's) and dest takes the larger
    of the two: a plain checkpoint loaded into a float16 model at a small scale overflowed
    where plain float16 holds its values (a scale of 1 or more is kept, as other in-place
    ops keep theirs; traced, dest's is kept)."""
    out = _copy(aten.copy.default, dest, src, non_blocking)
    if not isinstance(dest, ScaledTensor):
        return assign(dest, out)
    whole = holds_every_value(parts(dest)[0])
    if isinstance(src, ScaledTensor) and whole:
        return assign(dest, out, adopt=True)
    if not isinstance(src, ScaledTensor):
        # Eager only: traced, a new scale of an input (a static one, or a tensor's) was lost
        # where the graph wrote the input back (its data at the old scale).
        t = parts(dest)[1]
        if not data_readable(parts(dest)[0]):
            return assign(dest, out)
        if isinstance(t, torch.Tensor) and t.dim() == 0:
            out = wrap(parts(out)[0], torch.ones_like(t))  # scale 1 as a tensor: scalify's leaves train one
    if not _takes_the_larger_scale(dest, out, whole):
        return assign(dest, out)
    if whole:  # (a plain source: out's scale is 1)
        return assign(dest, out, adopt=True)
    d, s = parts(out)
    base = dest._parts.views.base  # the data every view of dest shares
    base.copy_(times(base, sdiv(parts(dest)[1], s)))
    dest._data.copy_(d)
    set_scale(dest, s)
    return dest


def _takes_the_larger_scale(dest: ScaledTensor, out: ScaledTensor, whole: bool = False) -> bool:
    """Whether out's scale, larger than dest's, becomes the whole tensor's in a part's
    copy_ (or a ``whole`` one's of a plain source). Not where a scale is per channel (out's,
    or that of dest or of a view of its data: ``x[2] = row`` of a per-row x gave the row's
    scale to every row, their data divided by that row's ratio), out's is zero (the zero
    array: zeros, at any scale), a part's dest has no record of the views sharing its data
    (torch.load's, which may share them with another), or a tensor scale
    cannot be read (traced: a graph cannot branch on it): dest keeps its scale there, as in
    other in-place ops. Nor where dest is the zero array: ``assign`` gives it out's scale
    and its rest zeros, where dividing the rest's data by the ratio (0) made the inf or NaN
    that empty memory holds NaN."""
    s, t = parts(out)[1], parts(dest)[1]
    if s is t or is_static(t, 0.0) or (dest._parts.views is None and not whole):
        return False
    if _per_channel(s) or has_per_channel_views(dest):
        return False
    if not (is_static(s) and is_static(t) or data_readable(dest._data)):
        return False
    return float(s) > float(t)  # (a tensor scale: read once, for the whole copy)


# --- factories ---------------------------------------------------------------------

def _factory(func, x, args, kwargs, fill_scale: float):
    out = func(parts(x)[0], *args, **kwargs)
    return wrap(out, fill_scale) if out.is_floating_point() else out


@rule(aten.zeros_like, aten.zero, aten.empty_like, aten.new_empty, aten.new_empty_strided)
def _zeros(func, x, *args, **kwargs):
    """Zeros, empty: scale 0, the zero array (optimizer state starts here and takes the
    scale of the first value written into it, as ``empty_like(x).copy_(x)`` takes x's)."""
    return _factory(func, x, args, kwargs, 0.0)


@rule(aten.new_zeros)
def _new_zeros(func, x, *args, **kwargs):
    """A zero buffer of another shape: zeros at x's scale (one scale: a per-channel one's
    largest), to be filled with x's pieces, as FSDP2 builds a shard: ``x.new_zeros(n)``,
    then a copy into a view of it, which keeps x's data as it is (the zero array would
    first zero itself to take the scale)."""
    s = parts(x)[1]
    return _factory(func, x, args, kwargs, s.amax() if isinstance(s, torch.Tensor) and s.dim() else s)


@rule(aten.ones_like, aten.new_ones, aten.rand_like, aten.randn_like)
def _ones(func, x, *args, **kwargs):
    """Ones, random: scale 1 (the seed of backward is ``ones_like(loss)``)."""
    return _factory(func, x, args, kwargs, 1.0)


@rule(aten.full_like, aten.new_full, aten.fill.Scalar)
def _full(func, x, *args, **kwargs):
    """Filled with c: data sign(c), scale |c| (c not finite: data c, scale 1)."""
    args = list(args)
    i = 0 if func.overloadpacket is aten.full_like or func is aten.fill.Scalar else 1
    c = float(args[i])
    dtype = kwargs.get("dtype")
    if not math.isfinite(c) or (dtype is not None and not dtype.is_floating_point):
        return _factory(func, x, tuple(args), kwargs, 1.0)  # (an integer fill is a plain tensor)
    args[i] = math.copysign(1.0, c) if c else 0.0
    return _factory(func, x, tuple(args), kwargs, abs(c))


@rule(aten.fill.Tensor)
def _fill_tensor(func, x, c):
    """Filled with a one-element tensor c (``x[:, 1] = t``, ``x.fill_(t)``): the number it
    holds, data c / |c| at scale |c| (1 for 0 or a non-finite c), as fill by a number; a
    0-d ScaledTensor gives its data and scale; at x's static scale 1, torch's fill. It had
    no rule: on the values at scale 1 in the data's dtype, ``x[:, 1] = torch.tensor(1e-9)``
    of float16 data at scale 2^-30 left the column as it was (both 0 in float16)."""
    d, sx = parts(x)
    if isinstance(c, ScaledTensor) or is_static(sx, 1.0):
        s = scale_of(c)
    else:
        s = number_size(c, d.device, zero=1.0)
    return wrap(func(d, at_scale(c, s)), s)


@rule(aten.zero_)
def _zero_(func, dest):
    """Zeroing in place: the zero array (scale 0, as ``zero``), so that the next value
    stored (a gradient accumulated after ``zero_grad(set_to_none=False)``) brings its own
    scale instead of meeting the old one in 16-bit data. A view of part of a tensor
    keeps the scale, which the rest of the tensor still has, unless the rest is zeros
    (:func:`holds_every_value`)."""
    d = parts(dest)[0]
    func(d)
    if holds_every_value(d):
        set_scale(dest, 0.0)
    return dest


@rule(aten.bernoulli_, aten.uniform_, aten.normal_, aten.exponential_)
def _random_(func, dest, *args, **kwargs):
    """Random fills in place (dropout's mask): the random values, stored at dest's
    scale; the generator is drawn as for a plain tensor of dest's shape."""
    fresh = func(torch.empty_like(parts(dest)[0]), *args, **kwargs)
    return assign(dest, wrap(fresh, 1.0))


# --- sums: a common scale ------------------------------------------------------------

def scale_of(x: Any) -> Scale:
    """Scale of an operand of a sum: a finite number c counts |c|, a non-finite one 0
    (it is the same at any scale)."""
    if isinstance(x, torch.Tensor):
        return parts(x)[1]
    c = float(x)
    return abs(c) if math.isfinite(c) else 0.0


def is_number(x: Any) -> bool:
    """Whether x is a plain one-element real tensor (float, integer or bool): where it
    meets a ScaledTensor, the number it holds (:func:`number_size`)."""
    return isinstance(x, torch.Tensor) and not isinstance(x, ScaledTensor) and x.numel() == 1 \
        and not x.is_complex()  # fmt: skip


def number_size(c: torch.Tensor, device: torch.device | None = None, zero: float = 0.0) -> torch.Tensor:
    """|c| of a one-element tensor c (:func:`is_number`) as a float32 0-d tensor on
    ``device`` (the data's: a CPU 0-d tensor meets data on any device), ``zero`` where
    |c| is 0 or c not finite (as :func:`scale_of` counts a number, with ``zero`` 0). Not
    read: that would wait for a device, and break a graph or compile one per value."""
    c = c.detach().to(device=device, dtype=torch.float32).reshape(())
    return torch.where(c.isfinite() & (c != 0), c.abs(), zero)


def common_scale(*xs: Any, coefs: tuple[float, ...] | None = None) -> Scale:
    """max of the operands' scales (seed 003's add rule), each times |coef| where given.

    A plain one-element tensor counts as the number it holds (:func:`number_size`), not as
    a plain tensor of scale 1, which flushed float16 data at scale 2^-30 to zeros in
    ``x + torch.tensor(0.)``, ``torch.where(m, x, torch.tensor(0.))``, ``x[i] = 0``
    (index_put of a 0-d 0); but not where every tensor operand has the static scale 1:
    plain tensors, which meet as in torch, bit for bit. Where such tensors alone bring a
    tensor scale (the others' are static: the zero array's 0, a number's), a 0 there is
    1: the zero array plus a plain 0 is zeros, not at a tensor scale 0, whose in-place
    writes would be lost."""
    numbers = [is_number(x) for x in xs]
    if not any(numbers) or _unit_scales(*xs):  # (the usual case: no more work than this)
        numbers = [False] * len(xs)
    device = next((x.device for x in xs if isinstance(x, ScaledTensor)), None)
    scales = [number_size(x, device) if n else scale_of(x) for x, n in zip(xs, numbers, strict=True)]
    s = reduce(smax, scales if coefs is None else
               (smul(sx, abs(c)) for sx, c in zip(scales, coefs, strict=True)))
    if any(numbers) and isinstance(s, torch.Tensor) and all(
            is_static(sx) for sx, n in zip(scales, numbers, strict=True) if not n):
        return torch.where(s > 0, s, 1.0)
    return s


def _unit_scales(*xs: Any) -> bool:
    """Whether every tensor operand has the static scale 1: then it is a plain tensor
    (seed 003), and numbers and coefficients act on its data as torch's op does."""
    return all(is_static(parts(x)[1], 1.0) for x in xs if isinstance(x, torch.Tensor))


def _on_data(func, *args, **kwargs) -> ScaledTensor:
    # func on the data of scale-1 operands: the output has scale 1.
    return wrap(func(*(parts(a)[0] if isinstance(a, torch.Tensor) else a for a in args), **kwargs), 1.0)


def _term(x: Any, coef: float) -> tuple[Any, Scale, float] | None:
    # (data, scale, sign) of coef * x, or None when it is zero. A non-finite number is
    # kept as data with scale 0: inf is inf at any scale.
    if isinstance(x, torch.Tensor):
        d, s = parts(x)
        s = smul(s, abs(coef))
        return None if coef == 0 or is_static(s, 0.0) else (d, s, math.copysign(1.0, coef))
    k = float(x) * coef
    if not math.isfinite(k):
        return (k, 0.0, 1.0)
    return None if k == 0 else (1.0, abs(k), math.copysign(1.0, k))


def _like(datas: list, sign: float, d: Any) -> torch.Tensor:
    # d as a new tensor with the shape and dtype of the sum of datas.
    tensors = [t for t in datas if isinstance(t, torch.Tensor)]
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    dtype = reduce(torch.promote_types, (t.dtype for t in tensors))
    if not isinstance(d, torch.Tensor):
        return torch.full(shape, sign * d, dtype=dtype, device=tensors[0].device)
    out = d.expand(shape).to(dtype, copy=True)
    return out.neg_() if sign < 0 else out


def lincomb(terms: list[tuple[Any, float]]) -> tuple[torch.Tensor, Scale]:
    """(data, scale) of sum(coef * x) over (x, coef) pairs, coef a Python number.

    Scale: the max of |coef| * scale(x) over the terms (seed 003's add). A zero-scale
    term is the zero array and drops out: one term left is returned as it is.
    """
    datas = [parts(x)[0] if isinstance(x, torch.Tensor) else x for x, _ in terms]
    dtype = promoted_dtype(tuple(x for x, _ in terms))  # each term rounds to the sum's
    live = [t for t in (_term(x, c) for x, c in terms) if t is not None]
    if not live:
        return _like(datas, 1.0, 0.0), 0.0
    # The scale from the terms' scales; where a one-element plain tensor is among them, from
    # the operands' sizes (common_scale's, which count it the number it holds, not 1).
    s = (common_scale(*(x for x, c in terms), coefs=tuple(c for _, c in terms))
         if any(is_number(x) for x, _ in terms) else reduce(smax, (ts for _, ts, _ in live)))
    if len(live) == 1:
        d, ts, sign = live[0]
        return _like(datas, sign, d if is_static(ts, 0.0) else times(d, sdiv(ts, s), dtype)), s
    (d0, s0, g0), (d1, s1, g1) = live[0], live[1]
    if len(live) == 2 and g0 > 0 and isinstance(d0, torch.Tensor) and is_static(s0, 1.0) \
            and is_static(s, 1.0) and is_static(s1):
        # Scale-1 operands: one fused op, rounded once, as on plain tensors.
        return torch.add(d0, d1, alpha=g1 * s1), s
    out = None
    for d, ts, sign in live:
        term = d if is_static(ts, 0.0) else times(d, sdiv(ts, s), dtype)
        if out is None:
            out = -term if sign < 0 else term
        else:
            out = out - term if sign < 0 else out + term
    if not isinstance(out, torch.Tensor) or out.shape != torch.broadcast_shapes(
            *(t.shape for t in datas if isinstance(t, torch.Tensor))):
        out = _like(datas, 1.0, out)
    return out, s


@rule(aten.add, aten.sub)
def _add(func, a, b, alpha=1):
    """a + alpha b, a - alpha b: scale max(sa, |alpha| sb); a zero-scale operand returns
    the other."""
    if _unit_scales(a, b):
        return _on_data(func, a, b, alpha=alpha)
    sign = 1.0 if func.overloadpacket is aten.add else -1.0
    return wrap(*lincomb([(a, 1.0), (b, sign * alpha)]))


@rule(aten.rsub)
def _rsub(func, a, b, alpha=1):
    """b - alpha a: as sub."""
    if _unit_scales(a, b):
        return _on_data(func, a, b, alpha=alpha)
    return wrap(*lincomb([(b, 1.0), (a, -alpha)]))


@rule(aten.lerp.Scalar)
def _lerp(func, a, b, weight):
    """a + w (b - a) = (1 - w) a + w b: scale max(|1-w| sa, |w| sb)."""
    if _unit_scales(a, b):
        return _on_data(func, a, b, weight)
    w = float(weight)
    return wrap(*lincomb([(a, 1.0 - w), (b, w)]))


@rule(aten.lerp.Tensor)
def _lerp_tensor(func, a, b, weight):
    """a + w (b - a) with a tensor w: composed of sub, mul and add."""
    if _unit_scales(a, b, weight):
        return _on_data(func, a, b, weight)
    return torch.add(a, torch.mul(weight, torch.sub(b, a)))


@rule(aten.addcmul, aten.addcdiv)
def _addc(func, a, t1, t2, value=1):
    """a + v t1 * t2 (t1 / t2): scale max(sa, |v| s1 s2) (s1 / s2)."""
    if _unit_scales(a, t1, t2):
        return _on_data(func, a, t1, t2, value=value)
    d1, s1 = parts(t1)
    d2, s2 = parts(t2)
    if func.overloadpacket is aten.addcmul:  # (the product in the op's compute dtype: rounded once, below)
        cdt = compute_dtype(promoted_dtype((a, t1, t2)) or d1.dtype)
        prod = wrap(d1.to(cdt) * d2.to(cdt), smul(s1, s2))
    else:
        prod = _divide(t1, t2)
    return wrap(*lincomb([(a, 1.0), (prod, value)]))


# --- in place: the destination keeps its scale ----------------------------------------
#
# These are the optimizer's updates, so they avoid passes that plain torch does not make:
# scales are read as numbers where that is free (``coefficient``), and a rebalancing ratio
# then goes into the scalar argument of the op itself instead of into a rescaled copy of
# an operand. 16-bit data keeps the copy: its ops round the scalar argument to 16 bits.

def _keeps_scale(dest: Any) -> bool:
    # A zero-scale ScaledTensor takes the result's scale instead (see ``assign``).
    return isinstance(dest, ScaledTensor) and dest._static != 0.0


def _operand(x: Any) -> tuple[Any, Scale]:
    # (data, scale) of an in-place op's operand, the scale a number where that is free.
    d, s = parts(x)
    return d, coefficient(s)


def read_parts(x: Any) -> tuple[Any, Scale]:
    """(data, scale) of x for an op that reads its data, the zero array's as the zeros it
    stands for (its data hold anything: the indices a sort or max pool picks in empty memory)."""
    d, s = parts(x)
    return (torch.zeros_like(d), s) if is_static(s, 0.0) else (d, s)


def _source(x: Any) -> tuple[Any, Scale]:
    # As _operand, for an operand only read: the zero array's data as the zeros it stands
    # for (it holds anything, empty_like's memory: rebalanced by 0, inf gave NaN).
    d, s = _operand(x)
    return (torch.zeros_like(d), s) if is_static(s, 0.0) else (d, s)


def _fusable(d: torch.Tensor, ratio: Scale) -> bool:
    # Whether ratio can be the scalar argument of an in-place op on data d.
    return is_static(ratio) and d.dtype not in REDUCED


@rule(aten.add_.Tensor, aten.add_.Scalar, aten.sub_.Tensor, aten.sub_.Scalar)
def _add_(func, dest, other, alpha=1):
    """In-place add, sub: dest keeps its scale sd; alpha * other is rebalanced to it
    (alpha goes into the ratio, so a large learning rate meets a tiny gradient in the
    scale, not in 16-bit data)."""
    if not _keeps_scale(dest):
        return inplace(func, dest, other, alpha=alpha)
    d, sd = _operand(dest)
    sign = math.copysign(1.0, alpha) * (1 if func.overloadpacket is aten.add_ else -1)
    if isinstance(other, torch.Tensor) and d.dtype not in REDUCED:
        # One pass: d + sign * ratio * other's data.
        do, so = _source(other)
        r = sdiv(smul(so, abs(alpha)), sd)
        if is_static(r):
            d.add_(do, alpha=sign * r)
            return dest
        if r.dim() == 0:
            d.addcmul_(do, r, value=sign)
            return dest
    d.add_(at_scale(other, sdiv(sd, abs(alpha)), promoted_dtype((dest, other))) if alpha else 0.0, alpha=sign)
    return dest


@rule(aten.mul_.Tensor, aten.mul_.Scalar, aten.div_.Tensor, aten.div_.Scalar)
def _mul_(func, dest, other):
    """In-place mul, div: dest keeps its scale sd; the data is multiplied (divided) by
    other's value (in the compute dtype, rounded once). But a whole dest times a 0-d
    ScaledTensor (clip_grad_norm_'s coefficient) takes its magnitude into the scale, its
    sign into the data: exact, where 16-bit data would become subnormal or 0. (A factor
    of 0, Inf or NaN goes into the data: a scale is finite and positive.) Eager only:
    traced, a graph writes an input back as its data at the scale it had, so the new scale
    was lost there (``torch.compile`` of clip_grad_norm_ left the gradients unclipped)."""
    if not _keeps_scale(dest):
        return inplace(func, dest, other)
    d, sd = parts(dest)
    factor = value(other) if isinstance(other, ScaledTensor) else other
    if func.overloadpacket is aten.div_:
        d.div_(factor)
    elif (isinstance(other, ScaledTensor) and other.dim() == 0 and not is_partial_view(d)
          and not (isinstance(sd, torch.Tensor) and sd.dim()) and data_readable(d)):  # fmt: skip
        magnitude = torch.where(torch.isfinite(factor) & (factor != 0), factor.abs(), 1.0)
        d.mul_(factor / magnitude)
        set_scale(dest, smul(sd, magnitude))
    else:
        d.mul_(factor)
    return dest


@rule(aten.lerp_.Scalar)
def _lerp_(func, dest, end, weight):
    """In-place lerp: dest keeps its scale sd; end is rebalanced to it. The zero array
    becomes w end at end's scale: a running average (Adam's) starts at its input's scale,
    and later steps need no rebalancing, one exact lerp, while that scale holds."""
    if isinstance(dest, ScaledTensor) and dest._static == 0.0:
        de, se = parts(end)
        return assign(dest, wrap(times(de, float(weight)), se))
    if not _keeps_scale(dest):
        return inplace(func, dest, end, weight)
    d, sd = _operand(dest)
    de, se = _source(end)
    r = sdiv(se, sd)
    if is_static(r, 1.0):
        d.lerp_(de, weight)
    elif _fusable(d, r):
        # (1 - w) d + w r de: two passes over d, no rebalanced copy of end.
        w = float(weight)
        d.mul_(1.0 - w).add_(de, alpha=w * r)
    else:
        d.lerp_(times(de, r, promoted_dtype((dest, end))), weight)
    return dest


@rule(aten.addcmul_, aten.addcdiv_)
def _addc_(func, dest, t1, t2, value=1):
    """In-place addcmul, addcdiv: dest keeps its scale sd; the ratio |v| s1 s2 / sd
    (|v| s1 / (s2 sd)) is the op's value, or multiplies t1's data."""
    if not _keeps_scale(dest):
        return inplace(func, dest, t1, t2, value=value)
    d, sd = _operand(dest)
    (d1, s1), (d2, s2) = _source(t1), _source(t2)
    if func.overloadpacket is aten.addcmul_:
        op, r = d.addcmul_, sdiv(smul(smul(s1, s2), abs(value)), sd)
    else:
        op, r = d.addcdiv_, sdiv(smul(s1, abs(value)), smul(s2, sd))
    sign = math.copysign(1.0, value)
    if _fusable(d, r):
        op(d1, d2, value=sign * r)
    else:
        op(times(d1, r, promoted_dtype((dest, t1, t2))), d2, value=sign)
    return dest


# --- products ------------------------------------------------------------------------

@rule(aten.mul)
def _mul(func, a, b):
    """a * b: scale sa sb; a number c only changes the scale (to |c| s). A zero factor
    (0, or the zero array) gives 0 times the other's data at its scale: NaN where that
    is Inf or NaN, as in torch (the zero array, scale 0, would be 0 whatever it holds);
    but the zero array times a nonzero number or a one-element plain tensor stays the
    zero array (``_zero_array_by``)."""
    for x, c in ((a, b), (b, a)):
        if not isinstance(c, torch.Tensor):
            c = float(c)
            if not math.isfinite(c):
                return _on_values(func, a, b)
            d, s = parts(x)
            if c == 0:  # (d * c: -0 where the signs differ, NaN for Inf and NaN)
                return wrap(d * c, s)
            return _signed_at(func, (a, b), d, c, smul(s, abs(c)))
        if (z := _zero_array_by(x, c)) is not None:
            return z
        if (y := _by_number(func, x, c)) is not None:
            return y
    da, sa = parts(a)
    db, sb = parts(b)
    if is_static(sa, 0.0) != is_static(sb, 0.0):
        if is_static(sa, 0.0):
            return wrap(torch.zeros_like(da) * db, sb)
        return wrap(da * torch.zeros_like(db), sa)
    return wrap(da * db, smul(sa, sb))


def _divide(a: Any, b: Any) -> torch.Tensor:
    da, sa = parts(a)
    db, sb = parts(b)
    if is_static(sb, 0.0):
        return wrap(value(a) / value(b), 1.0)
    if is_static(sa, 0.0):  # the zero array: 0 / b, NaN where b is 0 or NaN, as in torch
        return wrap(torch.zeros_like(da) / db, sdiv(1.0, sb))
    return wrap(da / db, sa if is_static(sb, 1.0) else sa / sb)


def _signed_at(func, args: tuple, d: torch.Tensor, c: float, scale: Scale) -> torch.Tensor:
    """x times or over a nonzero number c: x's data d with c's sign at ``scale``, or func
    on the values where that scale would leave float32's range (the value may fit). The
    zero array stays one (Adam's fresh state, ``mul_(beta2)``); it has no sign (+0
    where torch's zeros times a negative c give -0)."""
    if is_static(scale, 0.0):
        return wrap(torch.zeros_like(d), 0.0)
    if not _float32_scale(scale):
        return _on_values(func, *args)
    return wrap(-d if c < 0 else d.clone(), scale)


@rule(aten.div.Tensor, aten.div.Scalar)
def _div(func, a, b):
    """a / b: scale sa / sb; a number c only changes the scale (to s / |c|)."""
    if not isinstance(b, torch.Tensor):
        c = float(b)
        if c == 0 or not math.isfinite(c):
            return _on_values(func, a, b)
        d, s = parts(a)
        return _signed_at(func, (a, b), d, c, sdiv(s, abs(c)))
    if not isinstance(a, torch.Tensor):
        return torch.mul(torch.reciprocal(b), a)
    if (z := _zero_array_by(a, b)) is not None:
        return z
    if (y := _by_number(func, a, b)) is not None:
        return y
    if is_number(a) and isinstance(b, ScaledTensor) and not _unit_scales(a, b) \
            and not is_static(parts(b)[1], 0.0):  # fmt: skip
        # c / x of a one-element plain c as of a number (1 / x, then _by_number): on the data,
        # c / d put c's size in 16-bit data (torch.tensor(1e6) / x was inf at any scale).
        return torch.mul(torch.reciprocal(b), a)
    return _divide(a, b)


def _by_number(func, x: Any, c: Any) -> torch.Tensor | None:
    """x times or over c, a plain one-element tensor (:func:`is_number`), as by a number
    (``_signed_at``): |c| goes into the scale, its sign into the data, so that 16-bit data
    neither overflow nor flush (``x * torch.tensor(1e6)`` of float16 data was inf). c is
    not read: where |c| is 0 or not finite, or the scale would leave float32's range, c
    stays in the data. None where x is no ScaledTensor, or has the static scale
    1 (a plain tensor's product, bit for bit) or 0 (``_zero_array_by``), or c is no such
    tensor."""
    if not (isinstance(x, ScaledTensor) and is_number(c)):
        return None
    d, s = parts(x)
    if is_static(s) and s in (0.0, 1.0):
        return None
    size = number_size(c, d.device, zero=1.0)
    new = smul(s, size) if func.overloadpacket is aten.mul else sdiv(s, size)
    fits = ((new >= _FLOAT32_SMALLEST) & (new <= _FLOAT32_MAX)).all()
    size = torch.where(fits, size, 1.0)
    return wrap(func(d, c / size), torch.where(fits, new, s))


def _zero_array_by(z: Any, c: Any) -> torch.Tensor | None:
    """The zero array z times or over c, a one-element plain tensor that leaves z's shape
    (Adam's betas as tensors), as the zero array; None for other operands. c's value is
    not read (on a device that would wait for it), so a NaN, Inf or 0 there gives the zero
    array where torch's zeros give NaN."""
    if not (isinstance(z, ScaledTensor) and z._static == 0.0 and isinstance(c, torch.Tensor)
            and not isinstance(c, ScaledTensor) and c.numel() == 1 and c.dim() <= z.dim()):  # fmt: skip
        return None
    return wrap(torch.zeros_like(z._data, dtype=torch.result_type(z._data, c)), 0.0)


@rule(aten.reciprocal)
def _reciprocal(func, x):
    """1 / x: scale 1 / s."""
    d, s = parts(x)
    if is_static(s, 0.0) or not _float32_scale(scale := 1.0 / s):
        return _on_values(func, x)
    return wrap(torch.reciprocal(d), scale)


@rule(aten.sqrt, aten.rsqrt)
def _sqrt(func, x):
    """sqrt: scale sqrt(s); rsqrt: scale 1 / sqrt(s)."""
    d, s = parts(x)
    if is_static(s, 0.0):
        return _on_values(func, x)
    return wrap(func(d), spow(s, 0.5 if func.overloadpacket is aten.sqrt else -0.5))


@rule(aten.pow.Tensor_Scalar)
def _pow(func, x, p):
    """x ** p for a number p: scale s ** p."""
    d, s = parts(x)
    if is_static(s, 0.0) or isinstance(p, complex) or not _float32_scale(scale := spow(s, float(p))):
        return _on_values(func, x, p)
    return wrap(func(d, p), scale)


def _float32_scale(s: Scale) -> bool:
    """Whether a scale a rule made is one a ScaledTensor holds: a static one between
    float32's smallest positive value and its largest; a tensor one is taken as such
    (reading it would wait for the device)."""
    return not is_static(s) or _FLOAT32_SMALLEST <= s <= _FLOAT32_MAX


# --- computed on the value -----------------------------------------------------------

def _on_values(func, *args, **kwargs):
    """func on the values (computed in float32 or wider), rounded once to the dtype torch
    gives the op (its ``dtype=``, else the operands' promoted); scale 1. Used where the
    result is bounded or has no useful scale."""
    out = func(*(value(a) for a in args), **kwargs)
    return wrap(out.to(kwargs.get("dtype") or promoted_dtype(args)), 1.0)


def on_values_sized(func, *args, **kwargs):
    """func on the values, as :func:`_on_values`, for an op whose output's size follows
    neither an input's scale nor 1 (round, frac, logsumexp, softplus, smooth_l1_loss and
    its gradient): the output takes the power-of-two scale that brings its largest finite
    magnitude to (1/2, 1] (as ``dynamic_rescale_max(pow2=True)``; 1 where there is none),
    exact, so that 16-bit data neither overflow (logsumexp of float16 data at scale 2^20
    was inf) nor flush (frac at 2^-30 was 0). Where every tensor argument has the static
    scale 1 (plain tensors): func on the data, as in torch."""
    if _unit_scales(*args, *kwargs.values()):
        return _on_data(func, *args, **kwargs)
    dtype = kwargs.get("dtype") or promoted_dtype(args)
    cdt = compute_dtype(dtype or torch.float32)

    def computed(a: Any) -> Any:  # (every float tensor in one dtype, as a kernel takes them)
        return value(a, cdt) if isinstance(a, torch.Tensor) and a.is_floating_point() else a

    out = func(*map(computed, args), **{k: computed(v) for k, v in kwargs.items()})
    return fitted(out, dtype or out.dtype)


def fitted(out: torch.Tensor, dtype: torch.dtype) -> ScaledTensor:
    """A value computed on values (``out``) in ``dtype`` at the power-of-two scale that
    brings its largest finite magnitude to (1/2, 1] (1 where there is none), exactly
    (:func:`on_values_sized`)."""
    if not out.numel():
        return wrap(out.to(dtype), 1.0)
    top = torch.where(out.isfinite(), out.abs(), 0).amax().to(torch.float32)
    f = torch.where(top > 0, round_pow2(top, "up"), 1.0)
    return wrap((out / f).to(dtype), f)


@rule(aten.frac, aten.round, aten.floor, aten.ceil, aten.trunc, aten.fmod, aten.remainder,
      aten.logsumexp, aten.logcumsumexp, aten.logaddexp, aten.logaddexp2, aten.xlogy, aten.renorm, aten.dist,
      aten.norm, aten.histc, aten.scatter_reduce, aten.pow.Tensor_Tensor, aten.cumprod)
def _sized(func, *args, **kwargs):
    """frac, round, floor, ceil, trunc, fmod, remainder, logsumexp, logcumsumexp,
    logaddexp(2), xlogy, renorm, dist, norm (pairwise_distance's), histc, scatter_reduce
    (sum, prod, mean, amax, amin), pow by a tensor, cumprod (nan_to_num: below): computed on
    the values, at a power-of-two scale that fits the output (:func:`on_values_sized`).
    They had no rule (logsumexp, pow by a tensor, cumprod: scale 1): on the values at scale
    1 in the data's dtype, float16 data at scale 2^-30 were zeros there (``x **
    torch.tensor(2.)``), and at 2^20 inf."""
    return on_values_sized(func, *args, **kwargs)


@rule(aten.nan_to_num)
def _nan_to_num(func, x, nan=None, posinf=None, neginf=None):
    """nan_to_num as :func:`_sized`, Inf (and -Inf) by default the largest finite value of
    x's dtype, as torch's default for a tensor of that dtype: on the values in float32 the
    default was float32's largest, which the output's scale took to 2 in float16 data, so
    ``torch.nan_to_num(x)`` gave Inf back."""
    top = torch.finfo(x.dtype).max
    posinf, neginf = top if posinf is None else posinf, -top if neginf is None else neginf
    return on_values_sized(func, x, nan, posinf, neginf)


@rule(aten.tanh, aten.sigmoid, aten.exp, aten.expm1, aten.log1p, aten.erf, aten.sin, aten.cos, aten.atan,
      aten.sgn, aten.sign, aten.pow.Scalar)
def _bounded(func, *args, **kwargs):
    """tanh, sigmoid, exp, sign, ...: computed on the value; scale 1 (bounded outputs,
    or outputs whose size does not follow the input's scale)."""
    return _on_values(func, *args, **kwargs)


@rule(aten.log)
def _log(func, x):
    """log(d s) = log(d) + log(s), computed on the data so a tiny value does not
    underflow first; scale 1."""
    d, s = parts(x)
    if is_static(s, 1.0) or is_static(s, 0.0):
        return _on_values(func, x)
    cdt = compute_dtype(d.dtype)
    out = torch.log(d.to(cdt)) + (math.log(s) if is_static(s) else torch.log(s.to(cdt)))
    return wrap(out.to(d.dtype), 1.0)


# --- maxima and clamps ---------------------------------------------------------------

@rule(aten.maximum, aten.minimum, aten.max.other, aten.min.other, aten.clamp_min.Tensor,
      aten.clamp_max.Tensor)
def _maximum(func, a, b):
    """Elementwise max/min: scale max(sa, sb); a zero-scale operand needs no common
    scale (max(a, 0) keeps sa)."""
    upper = func.overloadpacket in (aten.maximum, aten.max, aten.clamp_min)
    op = torch.maximum if upper else torch.minimum
    for x, y in ((a, b), (b, a)):
        if is_static(scale_of(y), 0.0) and isinstance(y, ScaledTensor):
            d, s = parts(x)
            bound = d.clamp_min(0) if upper else d.clamp_max(0)
            return wrap(_like([d, parts(y)[0]], 1.0, bound), s)
    s, dtype = common_scale(a, b), promoted_dtype((a, b))
    return wrap(op(at_scale(a, s, dtype), at_scale(b, s, dtype)), s)


@rule(aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default)
def _clamp(func, x, lo=None, hi=None):
    """clamp by numbers: scale s, the bounds divided by s. A bound beyond the data dtype's
    range there is ±inf: a lower one below the range (an upper one above) bounds no
    finite data, and ±inf data, whose bound that format cannot hold, stays ±inf. A lower
    bound above the range (an upper below) clamps all finite data: computed on the
    values, then cast to the data's dtype by the cast's rule."""
    d, s = parts(x)
    if is_static(s, 0.0):
        return _on_values(func, x, lo, hi) if hi is not None else _on_values(func, x, lo)
    if func.overloadpacket is aten.clamp_max:
        lo, hi = None, lo

    def bound(c: Any) -> Any:
        b = at_scale(c, s)
        if is_static(b) and abs(b) > torch.finfo(d.dtype).max:
            return math.copysign(math.inf, b)
        return b

    bounds = [None if c is None else bound(c) for c in (lo, hi)]
    if is_static(bounds[0], math.inf) or is_static(bounds[1], -math.inf):
        return aten._to_copy.default(wrap(torch.clamp(value(x), lo, hi), 1.0), dtype=d.dtype)
    return wrap(torch.clamp(d, *bounds), s)


@rule(aten.clamp.Tensor)
def _clamp_tensor(func, x, lo=None, hi=None):
    """clamp by tensors: composed of maximum and minimum."""
    if lo is not None:
        x = torch.maximum(x, lo)
    return x if hi is None else torch.minimum(x, hi)


@rule(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _where(func, cond, a, b):
    """where(cond, a, b): scale max(sa, sb)."""
    if _unit_scales(a, b):
        return _on_data(func, cond, a, b)
    s, dtype = common_scale(a, b), promoted_dtype((a, b))
    return wrap(torch.where(cond, at_scale(a, s, dtype), at_scale(b, s, dtype)), s)


@rule(aten.masked_fill)
def _masked_fill(func, x, mask, fill):
    """masked_fill: scale max(s, |fill|) (a non-finite fill, e.g. -inf, keeps s). A fill in a
    plain one-element tensor is such a number (:func:`common_scale`), an integer or bool one too
    (torch takes ``torch.tensor(0)`` as the float 0 there)."""
    if _unit_scales(x, fill):
        return _on_data(func, x, mask, fill)
    s = common_scale(x, fill)
    d, c = at_scale(x, s), at_scale(fill, s)
    if isinstance(c, torch.Tensor) and c.dim():
        # A per-channel scale makes the fill's data per channel; masked_fill takes one value.
        return wrap(torch.where(mask, c.to(d.dtype), d), s)
    return wrap(torch.masked_fill(d, mask, c), s)


@rule(aten.index_fill)
def _index_fill(func, x, dim, index, fill):
    """index_fill: masked_fill along dim (scale max(s, |fill|), per channel). It had no
    rule: on the values at scale 1 in the data's dtype, float16 data at scale 2^-30 became
    zeros."""
    d = parts(x)[0]
    if d.dim() == 0:
        mask = torch.tensor(index.numel() > 0, device=d.device)
    else:
        mask = torch.zeros(d.shape[dim], dtype=torch.bool, device=d.device).index_fill(0, index, True)
        mask = mask.view([-1 if i == dim % d.dim() else 1 for i in range(d.dim())])
    return _masked_fill(aten.masked_fill, x, mask, fill)  # (the packet: fill may be a 0-d tensor)


@rule(aten.masked_scatter, aten.put)
def _masked_scatter(func, x, where, source, *args):
    """masked_scatter, put (by flat indices ``where``, with ``accumulate`` in args):
    source's elements meet x at scale max(s, s_source) (a per-channel one first rebalanced
    to its largest). They had no rule: on the values at scale 1 in the data's dtype,
    float16 data at scale 2^-30 became zeros."""
    x, source = scalar_scale(x), scalar_scale(source)
    s = common_scale(x, source)
    return wrap(func(at_scale(x, s), where, at_scale(source, s), *args), s)


@rule(aten.constant_pad_nd)
def _pad(func, x, pad, value=0):
    """Padding (F.pad, and so distribute_tensor's uneven shards): with zeros, scale s (a
    per-channel one's largest); with another number, computed on the value."""
    if value != 0:
        return _on_values(func, x, pad, value)
    d, s = parts(scalar_scale(x))
    return wrap(func(d, pad, 0.0), s)


@rule(aten.cat, aten.stack)
def _cat(func, tensors, dim=0):
    """cat, stack: scale max of the scales."""
    tensors = [scalar_scale(t) for t in tensors]
    s = common_scale(*tensors)
    dtype = promoted_dtype(tuple(tensors))
    return wrap(func([at_scale(t, s, dtype) for t in tensors], dim), s)


#: index_put and the form that traced code (nearest upsampling's backward) calls.
_INDEX_PUTS = (aten.index_put, aten._unsafe_index_put)


@rule(*_INDEX_PUTS, aten.scatter.src, aten.scatter.value, aten.scatter_add, aten.index_add, aten.index_copy)
def _merge(func, x, *args, **kwargs):
    """index_put, scatter, scatter_add, index_add, index_copy: the values written meet x at
    scale max(s, s_src) (a zero-scale x, as autograd's zeros, takes s_src), per channel for a
    per-channel x: each value written is rebalanced to the scale of the element it lands
    on, a channel raised to s_src only where a value lands. (x at its largest channel's
    scale, or each channel at max(s, s_src), flushed the small channels' data, those the op
    leaves as they are too, in 16 bits: ``x[i] = v``, ``index_add_``.)"""
    i = 1 if func.overloadpacket in _INDEX_PUTS else 2
    src = scalar_scale(args[i])
    s = common_scale(x, src)
    if _per_channel(s):
        s = _raised_where_written(func, parts(x)[1], s, x.shape, args)
        at = _landing_scale(func, s.expand(x.shape), args)
        if func.overloadpacket in (aten.scatter, aten.scatter_add) and isinstance(src, torch.Tensor):
            src = src[tuple(slice(0, n) for n in at.shape)]  # (scatter reads src where its index is)
        d, v = at_scale(x, s), at_scale(src, at)
    else:
        d, v = at_scale(x, s), at_scale(src, s)
    if func is aten.scatter.value and isinstance(v, torch.Tensor):
        # A number at a tensor scale is a tensor, which scatter.value does not take.
        func, v = aten.scatter.src, v.to(d.dtype).expand(args[1].shape)
    return wrap(func(d, *args[:i], v, *args[i + 1:], **kwargs), s)


def _landing_scale(func, s: torch.Tensor, args: tuple) -> torch.Tensor:
    """For ``_merge``: of s, x's scale expanded to x's shape, the elements that its op's
    values land on, in the values' shape."""
    if func.overloadpacket in _INDEX_PUTS:
        return aten.index.Tensor(s, args[0])
    if func.overloadpacket in (aten.index_add, aten.index_copy):
        return s.index_select(args[0], args[1])
    return s.gather(args[0], args[1])  # scatter, scatter_add: where the index says


def _raised_where_written(func, sx: torch.Tensor, s: torch.Tensor, shape: torch.Size, args: tuple
                          ) -> torch.Tensor:  # fmt: skip
    """For ``_merge``: s, max(x's per-channel scale sx, the values'), in the channels that
    its op's values land on; sx in the others, whose data it leaves as they are."""
    need = _landing_scale(func, s.expand(shape), args)
    full = sx.expand(shape)
    if func.overloadpacket in _INDEX_PUTS:
        full = aten.index_put.default(full, args[0], need)  # (indices may hold None: x[:, i])
    elif func.overloadpacket in (aten.index_add, aten.index_copy):
        full = full.index_copy(args[0], args[1], need)
    else:
        full = full.scatter(args[0], args[1], need)
    lead = len(shape) - s.dim()
    dims = [i for i in range(len(shape)) if i < lead or s.shape[i - lead] == 1]
    return full.amax(dims, keepdim=True).reshape(s.shape) if dims else full


# --- reductions ----------------------------------------------------------------------

@functools.cache
def _schema_arguments(func) -> tuple[tuple[str, ...], dict]:
    # The names of func's arguments after self, and the defaults of those that have one.
    schema = func._schema.arguments[1:]
    return tuple(a.name for a in schema), {a.name: a.default_value for a in schema if a.has_default_value()}


def _given(func, args: tuple, kwargs: dict) -> dict:
    # A call's arguments after self by name, with the schema's defaults for those left out
    # (kthvalue's and mode's dim=-1).
    names, defaults = _schema_arguments(func)
    return defaults | dict(zip(names, args, strict=False)) | kwargs


def _reduced_dims(given: dict, ndim: int) -> list[int]:
    # The dims a reduction reduces (its ``dim``; None or []: all), sorted and nonnegative.
    dim = given.get("dim")
    dims = range(ndim) if dim is None or dim == [] else [dim] if isinstance(dim, int) else dim
    return sorted({i % ndim for i in dims})


def _scale_varies(s: Scale, given: dict) -> bool:
    # Whether a per-channel scale s varies along a dim the reduction reduces.
    return any(s.shape[i] != 1 for i in _reduced_dims(given, s.dim()))


def _per_channel(s: Scale) -> bool:
    return isinstance(s, torch.Tensor) and s.dim() > 0


def reduced_parts(func, x: Any, given: dict, dtype: torch.dtype | None = None) -> tuple:
    """(data, output scale) of a reduction of x with a per-channel scale (``given``: the
    call's arguments, :func:`_given`): where it is constant along every dim the reduction
    reduces (its schema's ``dim``, with its default; none: all), x's data and that scale,
    squeezed as the data are (unless ``keepdim``; cumsum keeps every dim); else x at one
    scale (``scalar_scale``, rounded to ``dtype`` where wider), which would flush channels
    far below the largest in 16-bit data were it taken everywhere."""
    d, s = parts(x)
    if _scale_varies(s, given):
        return parts(scalar_scale(x, dtype))
    kept = given.get("keepdim") or func.overloadpacket in _SAME_RANK
    return d, (s if kept else s.squeeze(tuple(_reduced_dims(given, s.dim()))))


#: Ops along a dim that keep every dim (no keepdim to read).
_SAME_RANK = (aten.cumsum, aten.sort, aten.topk, aten.cummax, aten.cummin)

#: The op along one dim, with indices, of each reduction that picks elements (``_picked``).
_ALONG = {aten.max: aten.max.dim, aten.amax: aten.max.dim, aten.min: aten.min.dim, aten.amin: aten.min.dim,
          aten.median: aten.median.dim, aten.nanmedian: aten.nanmedian.dim}


def _picked(func, x: ScaledTensor, args: tuple, kwargs: dict, given: dict) -> Any:
    """func's result where x's per-channel scale varies along the dims it reduces: each
    output element is the element of x that func picks on the values, with that element's
    own data and scale (the output's scale is per element). Its value is then exactly the
    element's: the backward of max, amax, median and the inf norm finds the elements
    equal to the result, and a common scale would round it to equal none (the gradient
    would be NaN, a share of a count of 0)."""
    d, s = parts(x)
    s, v = s.expand(d.shape), value(x)
    along = _ALONG.get(func.overloadpacket)
    if func.overloadpacket is aten.linalg_vector_norm:
        d, v = d.abs().to(given["dtype"] or d.dtype), v.abs()
        along = aten.max.dim if given["ord"] > 0 else aten.min.dim
    if len(func._schema.returns) == 2:  # (max.dim, kthvalue, ...: func gives the indices)
        _, idx = func(v, *args, **kwargs)
        dim, keep = given["dim"], given.get("keepdim", True)  # (sort, topk, cummax: every dim kept)
        at = idx if keep else idx.unsqueeze(dim)
        out = [t.gather(dim, at) if keep else t.gather(dim, at).squeeze(dim) for t in (d, s)]
        return wrap(*out), idx
    dims = _reduced_dims(given, d.dim())
    kept = [i for i in range(d.dim()) if i not in dims]
    shape = [1 if i in dims else n for i, n in enumerate(d.shape) if given.get("keepdim") or i in kept]
    # (the reduced dims' size spelled out: -1 cannot be inferred where a kept dim is empty)
    flat_shape = (*(d.shape[i] for i in kept), math.prod(d.shape[i] for i in dims))

    def flat(t: torch.Tensor) -> torch.Tensor:  # the reduced dims as one, the last
        return t.permute(kept + dims).reshape(flat_shape)

    idx = along(flat(v), -1, True)[1]
    return wrap(flat(d).gather(-1, idx).reshape(shape), flat(s).gather(-1, idx).reshape(shape))


@rule(aten.sum, aten.mean, aten.nansum, aten.amax, aten.amin, aten.cumsum, aten.linalg_vector_norm)
def _reduce(func, x, *args, **kwargs):
    """Sums, means, maxima, norms (homogeneous of degree 1): scale s (per channel where
    the channels are not reduced; for maxima and the ±inf norms where they are, each
    picked element's own, :func:`_picked`)."""
    if func.overloadpacket is aten.linalg_vector_norm and (args[:1] or [kwargs.get("ord", 2)])[0] == 0:
        return _on_values(func, x, *args, **kwargs)
    dtype = kwargs.get("dtype")
    if dtype is not None and not dtype.is_floating_point:  # (sum(dtype=int): the values' sum, truncated)
        return func(value(x), *args, **kwargs)
    d, s = parts(x)
    if _per_channel(s):
        given = _given(func, args, kwargs)
        picks = func.overloadpacket in (aten.amax, aten.amin) or (
            func.overloadpacket is aten.linalg_vector_norm and math.isinf(given["ord"]))
        if picks and _scale_varies(s, given):
            return _picked(func, x, args, kwargs, given)
        d, s = reduced_parts(func, x, given, dtype)
    return wrap(func(d, *args, **kwargs), s)


@rule(aten._foreach_norm)
def _foreach_norm(func, tensors, ord=2, dtype=None):
    """_foreach_norm (clip_grad_norm_'s foreach path): linalg_vector_norm of each tensor,
    scale s."""
    return [aten.linalg_vector_norm.default(t, ord, dtype=dtype) for t in tensors]


@rule(aten.max.default, aten.min.default, aten.max.dim, aten.min.dim, aten.median.default, aten.median.dim,
      aten.nanmedian.default, aten.nanmedian.dim, aten.kthvalue.default, aten.mode.default, aten.sort.default,
      aten.sort.stable, aten.topk.default, aten.cummax.default, aten.cummin.default)
def _max(func, x, *args, **kwargs):
    """max, min, median, kthvalue, mode, sort, topk, cummax, cummin (and their indices),
    which pick elements and so commute with a positive scale: scale s (per channel where
    the channels are not reduced, or sorted; where they are, each picked element's own,
    :func:`_picked`). Sort and topk had no rule: on values at scale 1 in the data's dtype,
    float16 data at scale 2^-30 sorted to zeros."""
    d, s = read_parts(x)
    if _per_channel(s):
        given = _given(func, args, kwargs)
        if _scale_varies(s, given):
            return _picked(func, x, args, kwargs, given)
        d, s = reduced_parts(func, x, given)
    out = func(d, *args, **kwargs)
    return (wrap(out[0], s), out[1]) if isinstance(out, tuple) else wrap(out, s)


@rule(aten.prod)
def _prod(func, x, *args, **kwargs):
    """prod: scale s^n, n the number of elements multiplied. Computed on the values
    (scale 1, as pow) where a static s^n leaves float32's range (300 twos at scale 1/2
    are ones: their data's product overflows while s^n underflows). Data whose product
    leaves its dtype's range at a scale in range give inf, as the data's product does:
    telling would take a read of the data, which would wait for a device."""
    d, s = parts(scalar_scale(x))
    out = func(d, *args, **kwargs)
    scale = spow(s, float(d.numel() // max(out.numel(), 1)))
    if is_static(s, 0.0) or not _float32_scale(scale):
        return _on_values(func, x, *args, **kwargs)
    return wrap(out, scale)


@rule(aten.var, aten.std, aten.var_mean, aten.std_mean)
def _var(func, x, *args, **kwargs):
    """var: scale s^2; std: s; var_mean: (s^2, s); std_mean: (s, s)."""
    d, s = parts(scalar_scale(x))
    out = func(d, *args, **kwargs)
    first = spow(s, 2.0) if func.overloadpacket in (aten.var, aten.var_mean) else s
    return (wrap(out[0], first), wrap(out[1], s)) if isinstance(out, tuple) else wrap(out, first)


# --- plain outputs -------------------------------------------------------------------

@rule(aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge, aten.isnan, aten.isinf, aten.isfinite,
      aten.argmax, aten.argmin, aten.equal)
def _compare(func, *args, **kwargs):
    """Comparisons and predicates: a plain result, computed on the values (on the data
    when both operands share one scale; as torch computes it where every ScaledTensor has
    scale 1, so a number meets 16-bit data in the data's dtype)."""
    if not any(isinstance(a, ScaledTensor) and not is_static(parts(a)[1], 1.0) for a in args):
        return func(*(parts(a)[0] if isinstance(a, ScaledTensor) else a for a in args), **kwargs)
    if len(args) >= 2 and all(isinstance(a, ScaledTensor) for a in args[:2]):
        (da, sa), (db, sb) = parts(args[0]), parts(args[1])
        same = is_static(sa) and is_static(sb) and sa == sb
        if (sa is sb or same) and not is_static(sa, 0.0):  # (the zero array's data is no value)
            return func(da, db, *args[2:], **kwargs)
    if func.overloadpacket is aten.equal:
        return func(*(value(a, a.dtype) for a in args))
    return func(*(value(a) for a in args), **kwargs)


@rule(aten.nonzero, aten.any, aten.all, aten.count_nonzero)
def _nonzero(func, x, *args, **kwargs):
    """nonzero, any, all, count_nonzero: a plain result, computed on the data, which are zero
    where the value is (a scale is > 0; the zero array is zeros, whatever its data hold).
    They had no rule: on the values at scale 1 in the data's dtype, float16 data at scale
    2^-30 were all zeros there (``g.any()`` False, ``g.nonzero()`` empty)."""
    return func(read_parts(x)[0], *args, **kwargs)


@rule(aten._local_scalar_dense)
def _item(func, x):
    """item(): the value as a Python number."""
    return value(x).item()


@rule(aten.is_same_size)
def _same_size(func, a, b):
    """is_same_size: compares shapes."""
    return a.shape == b.shape


@rule(aten.is_pinned)
def _is_pinned(func, x, device=None):
    """is_pinned (DCP asks it of every tensor it saves or loads): whether the data are."""
    return func(parts(x)[0], device)


# --- collectives: every rank takes the root's data and scale -----------------------------
#
# A ScaledTensor travels as one buffer, its scale and the scale's form (static, tensor,
# per channel) as two float64 numbers and then its data's bytes, so that receivers
# hold the root's data and scale bit for bit and replicas stay equal. Every rank passes
# a ScaledTensor: a plain tensor elsewhere would take those bytes for its values (gloo
# stops on the size). Other collectives raise NoRuleError (``tensor._fallback``).

def _packed(t: torch.Tensor) -> torch.Tensor:
    d, s = parts(t)
    number, form = (s, 0.0) if is_static(s) else (s, 1.0) if s.dim() == 0 else (0.0, 2.0)
    head = torch.stack([torch.as_tensor(number, dtype=torch.float64, device=d.device),
                        torch.tensor(form, dtype=torch.float64, device=d.device)])
    return torch.cat([head.view(torch.uint8), d.contiguous().reshape(-1).view(torch.uint8)])


def _receive(t: torch.Tensor, buffer: torch.Tensor) -> None:
    # t takes the data and scale in buffer (``_packed``); a view of part of a tensor, or a
    # plain tensor, takes their value at its own scale.
    d = parts(t)[0]
    number, form = buffer[:16].view(torch.float64).tolist()
    if form == 2.0:
        raise NoRuleError("fewbit.scaled: a collective of a ScaledTensor with a per-channel scale: "
                          "rebalance it to one scale first")
    data = buffer[16:].view(d.dtype).view(d.shape)
    s = number if form == 0.0 else torch.tensor(number, dtype=torch.float32, device=d.device)
    if isinstance(t, ScaledTensor) and not is_partial_view(d):
        d.copy_(data)
        set_scale(t, s)
    else:
        assign(t, wrap(data, s))


def _exchange(tensors: list, run: Callable) -> Any:
    # run(buffers) starts the collective on the packed tensors and returns its work; the
    # tensors take what arrived once it is done.
    buffers = [_packed(t) for t in tensors]
    work = run(buffers)
    work.wait()
    for t, buffer in zip(tensors, buffers, strict=True):
        _receive(t, buffer)
    return work


if torch.distributed.is_available():
    @rule(torch.ops.c10d.broadcast_)
    def _broadcast(func, tensors, group, root, root_tensor, async_op=True, timeout=-1):
        """broadcast (``dist.broadcast``, DDP's first sync, ``distribute_tensor`` with
        Replicate): every rank takes the root's data and scale; done when it returns."""
        return tensors, _exchange(tensors, lambda b: func(b, group, root, root_tensor, async_op, timeout)[1])

    @rule(torch.ops.c10d.scatter_)
    def _scatter(func, outputs, inputs, group, root, async_op=True, timeout=-1):
        """scatter (``distribute_tensor`` with Shard): each rank takes the data and scale
        of its piece on the root; done when it returns."""
        pieces = [[_packed(t) for t in ts] for ts in inputs]
        return outputs, _exchange(outputs, lambda b: func(b, pieces, group, root, async_op, timeout)[1])
