"""Rules of the neural-network aten ops and of their backward ops.

Linear maps (matmuls, convolutions) compute on the data and multiply the scales, with
seed 003's optional static unit-scaling factor. Ops that are not scale-equivariant
(normalisations, softmax, GELU, attention's softmax) compute on the value in float32
or wider and give their output a stated scale. A backward op is linear in the incoming
gradient: it computes on the gradient's data, and its output carries the gradient's
scale (times the scale of any linear factor).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..config import current
from .casts import round_pow2
from .ops import fitted, lincomb, on_values_sized, read_parts, scale_of
from .tensor import (
    Scale,
    ScaledTensor,
    assign,
    at_scale,
    aten,
    coefficient,
    compute_dtype,
    if_present,
    is_static,
    parts,
    rule,
    scalar_scale,
    sdiv,
    smul,
    times,
    value,
    wrap,
)


def _unit(k: int) -> float:
    # Unit scaling: a power of two near sqrt(k), by which the data of a sum of k unit
    # terms is divided (exact) and the scale multiplied, so that the data stays near 1.
    if not current().unit_scaling or k <= 1:
        return 1.0
    return 2.0 ** round(0.5 * math.log2(k))


def _to(x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if x is None else x.to(dtype)


def _refuse_mixed(op: str, what: str, t: Any, x_dtype: torch.dtype, also_float32: bool = False) -> None:
    """Refuse an argument of another dtype than the input's, as torch's kernel does (the
    rules compute on float32 values, which would take it); ``also_float32``: float32 as
    well for 16-bit input (the mixed precision torch's CPU layer_norm takes)."""
    allowed = {x_dtype, torch.float32} if also_float32 and x_dtype in (torch.float16, torch.bfloat16) \
        else {x_dtype}  # fmt: skip
    if isinstance(t, torch.Tensor) and t.dtype not in allowed:
        raise RuntimeError(f"{op}: the {what} is {t.dtype} and the input {x_dtype}: torch refuses mixed "
                           "dtypes here; cast one of them")  # fmt: skip


# --- matmuls and convolutions ----------------------------------------------------------

def _factors(packet, a: Any, b: Any) -> tuple[Any, Any]:
    """a and b, each at one scale, but for mm and bmm one per-channel scale that is
    constant along the dim they contract (a weight's per output channel, say), which the
    product keeps per channel: at one scale, channels far below the largest would flush
    to zero in 16-bit data. (One only: two would make a scale of the output's size.)"""
    if packet in (aten.mm, aten.bmm):
        if _constant_along(a, -1):
            return a, scalar_scale(b)
        if _constant_along(b, -2):
            return scalar_scale(a), b
    return scalar_scale(a), scalar_scale(b)


def _constant_along(x: Any, dim: int) -> bool:
    # Whether x has a per-channel scale that is constant along dim.
    s = parts(x)[1]
    return isinstance(s, torch.Tensor) and s.dim() > 0 and s.shape[dim] == 1


@rule(aten.mm, aten.bmm, aten.mv, aten.dot)
def _mm(func, a, b):
    """mm, bmm, mv, dot (and matmul, linear, which decompose into them): scale sa sb
    (times the unit-scaling factor when fewbit's setting unit_scaling is on)."""
    (da, sa), (db, sb) = map(parts, _factors(func.overloadpacket, a, b))
    return _product(func(da, db), smul(sa, sb), da.shape[-1])


def _product(data: torch.Tensor, p: Scale, k: int) -> ScaledTensor:
    # A linear map's output data, summed over k terms of scale p, with the unit factor.
    f = _unit(k)
    return wrap(times(data, 1.0 / f), smul(p, f))


def _with_bias(fused: Callable, product: Callable, p: Scale, k: int, bias: Any, alpha: float = 1,
               beta: float = 1) -> ScaledTensor:
    """alpha * P + beta * bias for a product P of scale p summed over k terms, at seed
    003's add scale max(|alpha| p f, |beta| s_bias) (f: the unit-scaling factor), so that
    a bias larger than the product keeps its data in range.

    ``product()`` is the op on the data without the bias; ``fused(c, alpha, beta)`` the
    op with bias data c and the coefficients alpha and beta.
    """
    bias = scalar_scale(bias)
    sc = scale_of(bias)
    f = _unit(k)
    if is_static(p, 1.0) and is_static(sc, 1.0) and f == 1.0:
        # Plain tensors: the op itself, bit for bit (seed 003's scale 1).
        return wrap(fused(parts(bias)[0], alpha, beta), 1.0)
    q = smul(p, abs(alpha))  # the product term's scale, before the unit factor
    # Which term is larger needs the scales as numbers: read where that is free.
    nq, nc = coefficient(q), coefficient(sc)
    if is_static(nq) and is_static(nc) and nq > 0 and nq * f >= abs(beta) * nc:
        # The product's term is: one fused op on the data, with |alpha| in the scale
        # and the bias term, no larger than that term, in range at it: |beta| goes into
        # the bias's data (bias / q alone could overflow 16-bit data where |beta| < 1).
        # beta = 0 takes no bias, not even Inf or NaN, as in torch.
        if beta == 0:
            return _product(fused(at_scale(bias, q), math.copysign(1.0, alpha), 0), q, k)
        c = at_scale(bias, sdiv(q, abs(beta)))
        return _product(fused(c, math.copysign(1.0, alpha), math.copysign(1.0, beta)), q, k)
    return wrap(*lincomb([(_product(product(), p, k), alpha), (bias, beta)]))


#: The product of each op with a bias: addmm's is mm.
_WITHOUT_BIAS = {aten.addmm: aten.mm, aten.baddbmm: aten.bmm, aten.addmv: aten.mv}


@rule(*_WITHOUT_BIAS)
def _addmm(func, bias, a, b, *, beta=1, alpha=1):
    """addmm, baddbmm, addmv (linear with a bias): alpha (a @ b) at scale sa sb (times the
    unit factor) plus beta bias, so scale max(|alpha| sa sb, |beta| s_bias)."""
    mm = _WITHOUT_BIAS[func.overloadpacket]
    _refuse_mixed(func.overloadpacket.__name__, "bias", bias, a.dtype)
    (da, sa), (db, sb) = map(parts, _factors(mm, a, b))
    return _with_bias(lambda c, a_, b_: func(c, da, db, beta=b_, alpha=a_), lambda: mm(da, db),
                      smul(sa, sb), da.shape[-1], bias, alpha, beta)


@rule(aten.convolution)
def _convolution(func, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """convolution (conv1d/2d/3d): scale sx sw (times the unit factor, K = fan-in); with
    a bias, max(sx sw, s_bias)."""
    dx, sx = parts(scalar_scale(x))
    dw, sw = parts(scalar_scale(weight))
    fan_in = (dw.shape[0] // groups if transposed else dw.shape[1]) * math.prod(dw.shape[2:])

    def conv(c: torch.Tensor | None) -> torch.Tensor:
        return func(dx, dw, c, stride, padding, dilation, transposed, output_padding, groups)

    if bias is None:
        return _product(conv(None), smul(sx, sw), fan_in)
    # The bias as (C, 1, ..., 1), to broadcast over the output's spatial dims in a sum.
    db, sb = parts(scalar_scale(bias))
    channels = wrap(db.reshape(-1, *(1,) * (dw.dim() - 2)), sb)
    return _with_bias(lambda c, *_: conv(c.reshape(-1)), lambda: conv(None), smul(sx, sw), fan_in, channels)


@rule(aten.convolution_backward)
def _convolution_backward(func, g, x, weight, bias_sizes, *args):
    """Gradients of convolution: input sg sw, weight sg sx, bias sg."""
    dg, sg = parts(scalar_scale(g))
    dx, sx = parts(scalar_scale(x))
    dw, sw = parts(scalar_scale(weight))
    gi, gw, gb = func(dg, dx, dw, bias_sizes, *args)
    return (None if gi is None else wrap(gi, smul(sg, sw)),
            None if gw is None else wrap(gw, smul(sg, sx)),
            None if gb is None else wrap(gb, sg))


# --- attention -------------------------------------------------------------------------

def _attention_inputs(q, k, v, attn_mask):
    dv, sv = parts(scalar_scale(v))
    cdt = compute_dtype(dv.dtype)
    mask = attn_mask
    if mask is not None and mask.is_floating_point():
        mask = value(mask, cdt)
    return value(q, cdt), value(k, cdt), dv.to(cdt), sv, mask


@rule(aten._scaled_dot_product_flash_attention_for_cpu)
def _sdpa(func, q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """scaled_dot_product_attention (CPU kernel): softmax(q k^T) on the values of q and
    k; the output is that times v, so its scale is sv."""
    vq, vk, dv, sv, mask = _attention_inputs(q, k, v, attn_mask)
    out, lse = func(vq, vk, dv, dropout_p, is_causal, attn_mask=mask, scale=scale)
    return wrap(out.to(parts(v)[0].dtype), sv), lse


@rule(aten._scaled_dot_product_flash_attention_for_cpu_backward)
def _sdpa_backward(func, g, q, k, v, out, lse, dropout_p, is_causal, *, attn_mask=None, scale=None):
    """Gradients of attention: q sg sv sk, k sg sv sq, v sg (the kernel runs on the
    gradient's data and the output's data at v's scale, which are linear in those scales;
    q's gradient is linear in k, k's in q, whose values it takes)."""
    vq, vk, dv, sv, mask = _attention_inputs(q, k, v, attn_mask)
    dg, sg = parts(scalar_scale(g))
    cdt = dv.dtype
    gq, gk, gv = func(dg.to(cdt), vq, vk, dv, at_scale(out, sv).to(cdt), lse, dropout_p, is_causal,
                      attn_mask=mask, scale=scale)
    s = smul(sg, sv)

    def linear_in(grad: torch.Tensor, x: Any, other: Any) -> ScaledTensor:
        so = parts(scalar_scale(other))[1]
        return wrap(times(grad, sdiv(1.0, so)).to(parts(x)[0].dtype), smul(s, so))

    return linear_in(gq, q, k), linear_in(gk, k, q), wrap(gv.to(parts(v)[0].dtype), sg)


@rule(aten._fused_sdp_choice)
def _sdp_choice(func, q, k, v, *args, **kwargs):
    """Which attention kernel: chosen as for the data."""
    return func(*(parts(t)[0] for t in (q, k, v)), *args, **kwargs)


# --- normalisations --------------------------------------------------------------------

def _affine(weight, cdt):
    # The affine weight's data, in the compute dtype, and its scale.
    if weight is None:
        return None, 1.0
    dw, sw = parts(scalar_scale(weight))
    return _to(dw, cdt), sw


@rule(aten.native_layer_norm)
def _layer_norm(func, x, normalized_shape, weight, bias, eps):
    """layer_norm on the value: the output is unit-scaled, so its scale is 1, or sw with
    a scaled affine weight; a bias at another scale is added as add adds it (scale
    max(sw, s_bias): a zero weight leaves the bias, a small one does not push the bias's
    data out of range). mean and rstd stay in float32 (they are of the value)."""
    d = parts(x)[0]
    for what, t in (("weight", weight), ("bias", bias)):
        _refuse_mixed("layer_norm", what, t, d.dtype, also_float32=True)
    if isinstance(weight, torch.Tensor) and isinstance(bias, torch.Tensor) and weight.dtype != bias.dtype:
        raise RuntimeError(f"layer_norm: the weight is {weight.dtype} and the bias {bias.dtype}: torch "
                           "refuses mixed dtypes here; cast one of them")  # fmt: skip
    cdt = compute_dtype(d.dtype)
    w, sw = _affine(weight, cdt)
    bias = scalar_scale(bias)
    # At the weight's scale, the bias's data go into the one fused kernel as they are.
    fused = bias is None or (is_static(sw) and is_static(scale_of(bias), sw) and sw != 0)
    b = _to(parts(bias)[0], cdt) if fused and bias is not None else None
    out, mean, rstd = func(value(x, cdt), normalized_shape, w, b, eps)
    if fused:
        return wrap(out.to(d.dtype), sw), mean, rstd
    y, s = lincomb([(wrap(out, sw), 1.0), (bias, 1.0)])
    return wrap(y.to(d.dtype), s), mean, rstd


def _normalized_input_gradient(gi: torch.Tensor, x: Any, sg: Scale, sw: Scale,
                               rstd: torch.Tensor) -> ScaledTensor:
    """The input's gradient of a normalisation, computed in float32 on the data of the
    gradient and the weight: its size is theirs times rstd = 1/sigma(x), which the scale
    takes, sg sw times rstd's largest (rounded up to a power of two, an exact division),
    so that 16-bit data neither overflows (sigma small) nor underflows (sigma large)."""
    f = round_pow2(rstd.amax(), "up") if rstd.numel() else 1.0
    return wrap(times(gi, sdiv(1.0, f)).to(parts(x)[0].dtype), smul(smul(sg, sw), f))


@rule(aten.native_layer_norm_backward)
def _layer_norm_backward(func, g, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    """Gradients of layer_norm: input sg sw times rstd's largest (a power of two), weight
    sg, bias sg."""
    dg, sg = parts(scalar_scale(g))
    cdt = compute_dtype(dg.dtype)
    w, sw = _affine(weight, cdt)
    b = None if bias is None else _to(parts(bias)[0], cdt)  # (its values are not used: its shape is)
    gi, gw, gb = func(dg.to(cdt), value(x, cdt), normalized_shape, mean, rstd, w, b, output_mask)
    return (None if gi is None else _normalized_input_gradient(gi, x, sg, sw, rstd),
            None if gw is None else wrap(gw.to(parts(weight)[0].dtype), sg),
            None if gb is None else wrap(gb.to(parts(bias)[0].dtype), sg))


def _values(cdt: torch.dtype, *ts: Any) -> list:
    # The values of tensor arguments in the compute dtype (None, numbers, ints stay).
    return [value(t, cdt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in ts]


@rule(aten.native_batch_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training,
      aten.native_group_norm)
def _batch_norm(func, x, weight, bias, *args):
    """batch_norm (in the ops torch.compile decomposes it into too) and group_norm on the
    values (of the affine weight and bias too, and of batch_norm's running statistics, which
    take the kernel's update at their own dtype and scale): scale 1; mean and rstd stay in
    float32 (they are of the value). They had no rule: on the values at scale 1 in the
    data's dtype, where float16 data at scale 2^-20 are zeros, so the output was the bias
    (and the running variance went to 0); compiled, float16 data met float32 statistics."""
    d = parts(x)[0]
    cdt = compute_dtype(d.dtype)
    running = args[:2] if func._schema.arguments[3].name == "running_mean" else ()  # (batch_norm's)
    stats = _values(cdt, *running)
    out, mean, rstd = func(value(x, cdt), *_values(cdt, weight, bias), *stats, *args[len(running):])
    for dest, new in zip(running, stats, strict=True):
        if new is not dest:  # (a copy in the compute dtype, which the kernel updated)
            assign(dest, new)
    return wrap(out.to(d.dtype), 1.0), mean, rstd


@rule(aten.native_batch_norm_backward, aten.native_group_norm_backward)
def _batch_norm_backward(func, g, x, *args):
    """Gradients of batch_norm and group_norm: input sg times rstd's largest (a power of
    two), weight and bias sg."""
    dg, sg = parts(scalar_scale(g))
    cdt = compute_dtype(dg.dtype)
    values = _values(cdt, *args)
    gi, gw, gb = func(dg.to(cdt), value(x, cdt), *values)
    if func.overloadpacket is aten.native_batch_norm_backward:
        weight, running_var, save_invstd, train, eps = args[0], values[2], values[4], args[5], args[6]
        rstd = save_invstd if train else (running_var + eps).rsqrt()
    else:
        weight, rstd = args[2], values[1]
    dtype = dg.dtype if weight is None else parts(weight)[0].dtype
    return (None if gi is None else _normalized_input_gradient(gi, x, sg, 1.0, rstd),
            None if gw is None else wrap(gw.to(dtype), sg), None if gb is None else wrap(gb.to(dtype), sg))


@rule(*if_present(aten, "_fused_rms_norm"))
def _rms_norm(func, x, normalized_shape, weight, eps):
    """rms_norm (fused kernel) on the value: scale 1, or sw with a scaled weight.
    (On CPU rms_norm decomposes into pow, mean, add, rsqrt and mul, whose rules make
    the output's scale exactly 1.)"""
    d = parts(x)[0]
    cdt = compute_dtype(d.dtype)
    w, sw = _affine(weight, cdt)
    out, rstd = func(value(x, cdt), normalized_shape, w, eps)
    return wrap(out.to(d.dtype), sw), rstd


@rule(*if_present(aten, "_fused_rms_norm_backward"))
def _rms_norm_backward(func, g, x, normalized_shape, rstd, weight, output_mask):
    """Gradients of rms_norm: input sg sw times rstd's largest (a power of two), weight sg."""
    dg, sg = parts(scalar_scale(g))
    cdt = compute_dtype(dg.dtype)
    w, sw = _affine(weight, cdt)
    gi, gw = func(dg.to(cdt), value(x, cdt), normalized_shape, rstd, w, output_mask)
    return (None if gi is None else _normalized_input_gradient(gi, x, sg, sw, rstd),
            None if gw is None else wrap(gw.to(parts(weight)[0].dtype), sg))


# --- softmax and activations -------------------------------------------------------------

@rule(aten._softmax)
def _softmax(func, x, dim, half_to_float):
    """softmax on the value: scale 1 (probabilities)."""
    d = parts(x)[0]
    out = func(value(x, compute_dtype(d.dtype)), dim, False)
    return wrap(out.to(torch.float32 if half_to_float else d.dtype), 1.0)


@rule(aten._log_softmax)
def _log_softmax(func, x, dim, half_to_float):
    """log_softmax on the value: scale 1, cast to the data's dtype by the cast's rule, so
    log-probabilities beyond its range (float16 logits spread wider than 65504, at a
    large scale) move a power of two into the scale instead of becoming -inf. Off the
    CPU the scale is a tensor: the cast's largest magnitude is then not read on the host."""
    d = parts(x)[0]
    out = func(value(x, compute_dtype(d.dtype)), dim, False)
    out = wrap(out, 1.0 if out.is_cpu else torch.ones((), device=out.device))
    want = torch.float32 if half_to_float else d.dtype
    return out if want == out.dtype else aten._to_copy.default(out, dtype=want)


@rule(*if_present(aten, "_safe_softmax"))
def _safe_softmax(func, x, dim, dtype=None):
    """softmax that gives 0 on fully masked rows, on the value: scale 1."""
    d = parts(x)[0]
    out = func(value(x, compute_dtype(d.dtype)), dim)
    return wrap(out.to(dtype or d.dtype), 1.0)


@rule(aten._softmax_backward_data, aten._log_softmax_backward_data)
def _softmax_backward(func, g, output, dim, input_dtype):
    """Gradients of softmax, log_softmax (linear in g): scale sg."""
    dg, sg = parts(scalar_scale(g))
    cdt = compute_dtype(dg.dtype)
    return wrap(func(dg.to(cdt), value(output, cdt), dim, cdt).to(input_dtype), sg)


@rule(aten.gelu, aten.silu, aten.mish, aten.hardswish, aten.elu, aten.celu)
def _gelu(func, x, *args, **kwargs):
    """gelu (exact and tanh), silu, mish, hardswish, elu, celu on the value; they follow relu
    for large |x| (elu, celu: the identity for large x, -alpha for large -x) and a multiple of
    x near 0, so the output keeps the input's scale s. (elu's -alpha, no multiple of x, is
    data -alpha/s: 0 in float16 at s = 2^30.) (Not softplus: log 2 at 0, at the scale of a
    small x.)"""
    d, s = parts(x)
    out = func(value(x, compute_dtype(d.dtype)), *args, **kwargs)
    return wrap(times(out, sdiv(1.0, s)).to(d.dtype), s)


@rule(aten.softplus, aten.glu, aten.glu_backward)
def _softplus(func, *args, **kwargs):
    """softplus (log 2 at 0, x for large x: no input's scale), glu (a times sigmoid(b),
    halves of x) and glu's gradient: on the values, at a power-of-two scale that fits the
    output (``ops.on_values_sized``). They had no rule: on the values at scale 1 in the
    data's dtype, softplus of float16 data at scale 2^20 was inf, glu at 2^-30 zeros."""
    return on_values_sized(func, *args, **kwargs)


@rule(aten.log_sigmoid_forward)
def _log_sigmoid(func, x):
    """logsigmoid (0 for large x, x for large -x, -log 2 at 0: no input's scale) on the
    values, at a power-of-two scale that fits the output (``ops.fitted``), and the buffer
    its gradient reads, plain in the data's dtype; at the static scale 1, torch's. It had
    no rule: on the values at scale 1 in the data's dtype, float16 data at scale 2^20
    gave -inf (and multilabel_soft_margin_loss NaN)."""
    d, s = parts(x)
    if is_static(s, 1.0):
        out, buffer = func(d)
        return wrap(out, 1.0), buffer
    out, buffer = func(value(x, compute_dtype(d.dtype)))
    return fitted(out, d.dtype), buffer.to(d.dtype)


@rule(aten.hardtanh)
def _hardtanh(func, x, min_val=-1.0, max_val=1.0):
    """hardtanh (and relu6), a clamp by numbers: scale s (``ops._clamp``). It had no rule:
    on the values at scale 1 in the data's dtype, float16 data at scale 2^-30 were zeros."""
    return aten.clamp.default(x, min_val, max_val)


@rule(aten._prelu_kernel)
def _prelu(func, x, weight):
    """prelu on the values: x where x > 0, else weight times x, so the output keeps x's
    scale s (the weight, a slope, multiplies the negative part only)."""
    dtype = parts(x)[0].dtype
    _refuse_mixed("prelu", "weight", weight, dtype)
    return _gelu(func, x, value(weight, compute_dtype(dtype)))  # (x's scale kept, as gelu's)


@rule(aten._prelu_kernel_backward)
def _prelu_backward(func, g, x, weight):
    """Gradients of prelu: the input's, g or weight times g, scale sg; the weight's, g times
    the negative x, scale sg sx."""
    dg, sg = parts(scalar_scale(g))
    dx, sx = parts(scalar_scale(x))
    cdt = compute_dtype(dg.dtype)
    gx, gw = func(dg.to(cdt), dx.to(cdt), value(weight, cdt))
    return wrap(gx.to(dx.dtype), sg), wrap(gw.to(parts(weight)[0].dtype), smul(sg, sx))


@rule(aten.threshold_backward, aten.gelu_backward, aten.silu_backward, aten.tanh_backward,
      aten.sigmoid_backward, aten.leaky_relu_backward, aten.mish_backward, aten.hardswish_backward,
      aten.elu_backward, aten.softplus_backward, aten.hardtanh_backward, aten.log_sigmoid_backward)
def _activation_backward(func, g, *args, **kwargs):
    """Gradients of activations, g * f'(x) (f' from the value of x or of the output):
    scale sg."""
    dg, sg = parts(scalar_scale(g))
    cdt = compute_dtype(dg.dtype)
    args = tuple(value(a, cdt) if isinstance(a, torch.Tensor) else a for a in args)
    return wrap(func(dg.to(cdt), *args, **kwargs).to(dg.dtype), sg)


@rule(aten.select_backward, aten.slice_backward, aten.embedding_dense_backward, aten.native_dropout_backward,
      aten.max_pool2d_with_indices_backward, aten.max_pool3d_with_indices_backward, aten.avg_pool2d_backward,
      aten.avg_pool3d_backward, aten._adaptive_avg_pool2d_backward, aten._adaptive_avg_pool3d_backward,
      aten.adaptive_max_pool2d_backward, aten.adaptive_max_pool3d_backward, aten.upsample_nearest1d_backward,
      aten.upsample_nearest2d_backward, aten.upsample_nearest3d_backward,
      aten._upsample_nearest_exact1d_backward, aten._upsample_nearest_exact2d_backward,
      aten._upsample_nearest_exact3d_backward,
      aten.upsample_linear1d_backward, aten.upsample_bilinear2d_backward, aten.upsample_bicubic2d_backward,
      aten.upsample_trilinear3d_backward, aten.reflection_pad1d_backward, aten.reflection_pad2d_backward,
      aten.reflection_pad3d_backward, aten.replication_pad1d_backward, aten.replication_pad2d_backward,
      aten.replication_pad3d_backward, aten.col2im)
def _gather_backward(func, g, *args, **kwargs):
    """Gradients of views, embedding, dropout, pooling, upsampling and padding (g moved,
    masked or averaged; a ScaledTensor input, there for its shape, passes its data): scale
    sg. The latter had no rule: on the values at scale 1 in the data's dtype, float16
    gradients at scale 2^-30 were zeros there."""
    dg, sg = parts(scalar_scale(g))
    args = tuple(parts(a)[0] if isinstance(a, ScaledTensor) else a for a in args)
    return wrap(func(dg, *args, **kwargs), sg)


#: Ops that average, pick or sum elements over a tensor's last dims (pooling, interpolation):
#: how many. None: ops that mix every dim (im2col mixes channels with the kernel's places;
#: trace, unique).
_SPATIAL = {aten.avg_pool2d: 2, aten.avg_pool3d: 3, aten._adaptive_avg_pool2d: 2,
            aten._adaptive_avg_pool3d: 3, aten.max_pool2d_with_indices: 2, aten.max_pool3d_with_indices: 3,
            aten.adaptive_max_pool2d: 2, aten.adaptive_max_pool3d: 3, aten.upsample_linear1d: 1,
            aten.upsample_bilinear2d: 2, aten.upsample_bicubic2d: 2, aten.upsample_trilinear3d: 3,
            aten.im2col: None, aten.trace: None, aten._unique: None,
            aten._unique2: None, aten.unique_consecutive: None, aten.unique_dim: None}


@rule(*_SPATIAL)
def _pool(func, x, *args, **kwargs):
    """Pooling, linear and cubic interpolation, im2col, trace, unique (linear
    in x, or picking its elements, with their indices): scale s, per channel where it is
    constant over the dims they mix (a per-channel one there first rebalanced to its
    largest). They had no rule: on the values at scale 1 in the data's dtype, float16
    data at scale 2^-30 were zeros there, and at 2^20 inf."""
    s = parts(x)[1]
    mixed = _SPATIAL[func.overloadpacket]
    if isinstance(s, torch.Tensor) and s.dim() and (mixed is None or any(n != 1 for n in s.shape[-mixed:])):
        x = scalar_scale(x)
    d, s = read_parts(x)
    out = func(d, *args, **kwargs)
    return (wrap(out[0], s), *out[1:]) if isinstance(out, tuple) else wrap(out, s)


@rule(aten.diag_embed)
def _diag_embed(func, x, offset=0, dim1=-2, dim2=-1):
    """diag_embed: scale s; a per-channel one constant along the last dim (the one spread
    over the diagonal) stays per channel, one element along the two new dims (each output
    matrix holds one channel's elements, and zeros); another is first rebalanced to its
    largest. It was rebalanced always: float16 data at scale 2^-30 in a channel beside one
    at 2^20 became zeros."""
    d, s = read_parts(x)
    if not (isinstance(s, torch.Tensor) and s.dim()):
        return wrap(func(d, offset, dim1, dim2), s)
    if s.shape[-1] != 1:
        d, s = read_parts(scalar_scale(x))
        return wrap(func(d, offset, dim1, dim2), s)
    n = d.dim() + 1
    lo, hi = sorted((dim1 % n, dim2 % n))
    return wrap(func(d, offset, dim1, dim2), s.squeeze(-1).unsqueeze(lo).unsqueeze(hi))


@rule(aten.embedding_renorm_)
def _embedding_renorm_(func, weight, indices, max_norm, norm_type):
    """embedding_renorm_ (``F.embedding(..., max_norm=)``): the rows looked up whose norm
    exceeds max_norm shrink to it, on the values (max_norm is a value), stored back at the
    weight's scale (they only shrink). It had no rule: NoRuleError, or on the values at
    scale 1 in the data's dtype, where float16 data at scale 2^-20 lose their bits."""
    v = value(weight, compute_dtype(weight.dtype)).clone()
    func(v, indices, max_norm, norm_type)
    return assign(weight, wrap(v, 1.0))


@rule(aten._embedding_bag, aten._embedding_bag_forward_only, aten._embedding_bag_backward,
      aten._embedding_bag_dense_backward, aten._embedding_bag_per_sample_weights_backward, aten._trilinear)
def _multilinear(func, *args, **kwargs):
    """embedding_bag (sums, means or maxima of looked-up rows, times per_sample_weights in
    sum mode) and its gradients, and _trilinear (F.bilinear and its gradients), linear in
    each tensor of values among their arguments (weight, per-sample weights, gradient; the
    three factors): on their data, each at one scale (a per-channel one rebalanced to its
    largest), the first output at the product of their scales (the offsets, sizes and
    indices stay plain). They had no rule: on the values at scale 1 in float16, weights at
    scale 2^-30 gave zeros and at 2^20 NaN."""
    scale: Scale = 1.0

    def data(a: Any) -> Any:
        nonlocal scale
        if not isinstance(a, ScaledTensor):
            return a
        d, s = read_parts(scalar_scale(a))
        scale = smul(scale, s)
        return d

    out = func(*map(data, args), **{k: data(v) for k, v in kwargs.items()})
    return (wrap(out[0], scale), *out[1:]) if isinstance(out, tuple) else wrap(out, scale)


@rule(aten.native_dropout)
def _dropout(func, x, p, train):
    """dropout: scale s (the kept data is divided by 1 - p)."""
    d, s = parts(x)
    out, mask = func(d, p, train)
    return wrap(out, s), mask


# --- losses ------------------------------------------------------------------------------

@rule(aten.nll_loss_forward, aten.nll_loss2d_forward)
def _nll_loss(func, x, target, weight, reduction, ignore_index):
    """nll_loss (the end of cross_entropy, after log_softmax): scale s."""
    _refuse_mixed("nll_loss", "class weight", weight, x.dtype)
    d, s = parts(scalar_scale(x))
    out, total = func(d, target, value(weight, d.dtype), reduction, ignore_index)
    return wrap(out, s), total


@rule(aten.nll_loss_backward, aten.nll_loss2d_backward)
def _nll_loss_backward(func, g, x, target, weight, reduction, ignore_index, total_weight):
    """Gradient of nll_loss: scale sg."""
    dg, sg = parts(scalar_scale(g))
    d = parts(x)[0]
    return wrap(func(dg.to(d.dtype), d, target, value(weight, d.dtype), reduction, ignore_index,
                     total_weight), sg)


@rule(aten.smooth_l1_loss, aten.smooth_l1_loss_backward, aten.huber_loss, aten.huber_loss_backward,
      aten.binary_cross_entropy, aten.binary_cross_entropy_backward, aten.binary_cross_entropy_with_logits,
      aten.soft_margin_loss, aten.soft_margin_loss_backward)
def _sized_loss(func, *args, **kwargs):
    """smooth_l1_loss, huber_loss, binary_cross_entropy (with logits), soft_margin_loss and
    their gradients (quadratic near 0, linear beyond, or logarithmic: no input's scale):
    on the values, at a power-of-two scale that fits the output (``ops.on_values_sized``).
    They had no rule: on the values at scale 1 in the data's dtype, float16 data at scale
    2^-30 gave a loss of 0 and at 2^20 NaN."""
    return on_values_sized(func, *args, **kwargs)


@rule(aten.mse_loss)
def _mse_loss(func, x, target, reduction=1):
    """mse_loss: (x - t)^2 reduced, scale max(sx, st)^2 (composed of sub, mul, mean)."""
    diff = torch.sub(x, target)
    sq = torch.mul(diff, diff)
    return sq if reduction == 0 else sq.mean() if reduction == 1 else sq.sum()


@rule(aten.mse_loss_backward)
def _mse_loss_backward(func, g, x, target, reduction):
    """Gradient of mse_loss, 2 (x - t) g / n: scale 2 max(sx, st) sg / n."""
    diff = torch.sub(x, target)
    n = diff.numel() if reduction == 1 else 1
    return torch.mul(torch.mul(diff, g), 2.0 / n)

