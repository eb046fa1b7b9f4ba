"""Scale-aware casts and rescaling (seed 003's cast and rebalance_scale).

``cast`` rounds the data to a fewbit format and keeps the scale; ``rebalance`` moves a
factor between data and scale without changing the value; the dynamic rescalings pick
the new scale from a statistic of the tensor (max, mean absolute value, RMS), on the
forward value or, for the ``_grad`` variants, on the gradient flowing back. Scales can
be held to powers of two, whose exponents E8M0 stores in a byte.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from ..codec import decode, encode
from ..formats import FloatFormat
from ..rounding import RoundMode
from ..rounding import round as fewbit_round
from ..rounding.ops import op_key
from .tensor import (
    Scale,
    ScaledTensor,
    as_scaled,
    at_scale,
    check_dtype,
    check_scale,
    check_settable,
    compute_dtype,
    constant,
    guard_settings,
    holds_every_value,
    is_static,
    parts,
    set_scale,
    wrap,
)

Stat = Literal["max", "l1", "l2"]
Pow2 = Literal["down", "up", "nearest"]

_E8M0 = "ocp_e8m0"
_POW2_MODES = {"down": "rtz", "up": "rup", "nearest": "rne"}


def _check_floating(t: torch.Tensor, name: str) -> None:
    # A plain t's dtype, as as_scaled checks data's: an integer one rebalanced at scale 1
    # made a ScaledTensor of int64 data, whose value a later op computed in integers
    # (rebalance(torch.arange(6), 1.0) / 4 gave 0, 0, 0, 0, 1, 1); float8 failed in torch's
    # isfinite deep inside. (A ScaledTensor's data was checked when it was made.)
    if isinstance(t, torch.Tensor) and not isinstance(t, ScaledTensor):
        check_dtype(t.dtype, f"{name}: t")


def _check_statistic(stat: object, target: object) -> None:
    # Before the statistic is taken, or (the _grad variants) before the backward pass.
    if stat not in ("max", "l1", "l2"):
        raise ValueError(f"statistic must be 'max', 'l1' or 'l2', not {stat!r}")
    if not target > 0:
        raise ValueError(f"target must be positive, got {target}")


# --- cast ----------------------------------------------------------------------------
#
# cast and rebalance build a new ScaledTensor, which Dynamo cannot trace: their autograd
# Functions go into the graph whole (allow_in_graph), and AOTAutograd traces them below,
# as it traces the rules, so that they compile with torch.compile(fullgraph=True).

def _making(name: str, t: torch.Tensor) -> None:
    """Before ``name``'s autograd.Function makes a ScaledTensor of t: Dynamo's guards on the
    settings (:func:`guard_settings`), and under torch.export a refusal naming why. torch
    2.13's export does not track the ScaledTensor such a Function returns: it failed on the
    first use ("... is not tracked with proxy", a RecursionError before 2026-11-30), strict
    or not, even returned as it came."""
    if torch.compiler.is_exporting():
        raise RuntimeError(f"fewbit.scaled.{name} does not run under torch.export (torch 2.13 does not "
                           "trace the ScaledTensor it makes): call it before the exported code and pass "
                           "its result in")
    guard_settings(t)


@torch.compiler.allow_in_graph
class _Cast(torch.autograd.Function):
    # Rounding with a straight-through gradient, the usual estimator for quantisation.
    @staticmethod
    def forward(ctx, t, fmt, mode, kwargs):
        d, s = parts(t)
        # bits or fraction made symbolic by torch.compile: constants again, as fewbit.round
        # takes them (a graph per value).
        return wrap(fewbit_round(d, fmt, mode, **{k: constant(v) for k, v in kwargs.items()}), s)

    @staticmethod
    def backward(ctx, g):
        return g, None, None, None


#: The arguments of fewbit.round that cast and cast_ pass through (out= is not one: the
#: result's data is a new tensor, or t's own).
_ROUND_ARGUMENTS = frozenset({"sat", "bits", "seed", "random_bits", "fraction"})


def _check_arguments(name: str, kwargs: dict) -> None:
    if unknown := sorted(set(kwargs) - _ROUND_ARGUMENTS):
        raise TypeError(f"{name}() takes fewbit.round's {', '.join(sorted(_ROUND_ARGUMENTS))}, not "
                        f"{', '.join(unknown)}")


def cast(t: torch.Tensor, fmt: FloatFormat | str, mode: RoundMode | str = "rne",
         **kwargs: Any) -> ScaledTensor:
    """t with its data rounded to the values of ``fmt`` by ``fewbit.round`` (any mode,
    stochastic ones included: ``bits=``, ``seed=``, ``random_bits=``, ``sat=`` pass
    through); the scale and the data dtype are kept. Gradients pass straight through.
    Rebalance first (e.g. ``dynamic_rescale_max``) to centre the data in fmt's range.
    """
    _check_arguments("cast", kwargs)
    if kwargs.get("seed") is not None:
        # The op's own key: traced, a key tensor (into the graph's Function an int or a Key
        # went as a constant, a graph per seed, and a Key rebuilt from Dynamo's proxies
        # failed its checks).
        kwargs = {**kwargs, "seed": op_key(kwargs["seed"], t)}
    _making("cast", t)
    return _Cast.apply(t, fmt, mode, kwargs)


def cast_(t: ScaledTensor, fmt: FloatFormat | str, mode: RoundMode | str = "rne",
          **kwargs: Any) -> ScaledTensor:
    """In-place :func:`cast` of a ScaledTensor (a parameter's write-back); returns t."""
    if not isinstance(t, ScaledTensor):
        raise TypeError(f"cast_ needs a ScaledTensor, not {type(t).__name__}")
    _check_arguments("cast_", kwargs)
    with torch.no_grad():
        t._data.copy_(fewbit_round(t._data, fmt, mode, **kwargs))
    torch.autograd.graph.increment_version(t)
    return t


# --- rebalance -----------------------------------------------------------------------

@torch.compiler.allow_in_graph
class _Rebalance(torch.autograd.Function):
    # Same value, new scale: the identity for autograd.
    @staticmethod
    def forward(ctx, t, s):
        return wrap(at_scale(t, s), s)

    @staticmethod
    def backward(ctx, g):
        return g, None


def rebalance(t: torch.Tensor, s: torch.Tensor | float) -> ScaledTensor:
    """t with scale ``s`` and the same value: data * old_scale / s, rounded once to the
    data dtype (seed 003's rebalance_scale gives the factor; here s is the new scale).

    s: a positive float, or a float tensor broadcastable to t (on t's device).
    """
    _check_floating(t, "rebalance")
    s = check_scale(s, parts(t)[0], positive=True)
    _making("rebalance", t)
    return _Rebalance.apply(t, s)


def rebalance_(t: ScaledTensor, s: torch.Tensor | float) -> ScaledTensor:
    """In-place :func:`rebalance` of a ScaledTensor that is not a view (a parameter; or
    a view whose rest is zeros, as FSDP2's short piece of a padded buffer). Eager only:
    under torch.compile one graph break, then eager (fullgraph=True refuses it, naming why)."""
    if torch.compiler.is_compiling():
        return _eager_rebalance_(t, s)
    if not isinstance(t, ScaledTensor):
        raise TypeError(f"rebalance_ needs a ScaledTensor, not {type(t).__name__}")
    if not holds_every_value(t._data):
        raise ValueError("rebalance_ of a view would leave its base with the old scale")
    s = check_scale(s, t._data, positive=True)
    check_settable(t, s)
    with torch.no_grad():
        t._data.copy_(at_scale(t, s))
    set_scale(t, s)
    torch.autograd.graph.increment_version(t)
    return t


#: Traced, rebalance_'s check of a view's storage (storage_offset, the rest's zeros) broke
#: the graph in Dynamo's words ("torch.* op returned non-Tensor"), and its scale checks
#: again (a tensor's values read): one break, named, then eager.
_eager_rebalance_ = torch.compiler.disable(
    rebalance_, reason="fewbit.scaled.rebalance_ and dynamic_rescale_ run eagerly only: they check the "
    "storage of a view and the new scale's values, which a graph cannot (rebalance out of place compiles)")


# --- power-of-two scales ---------------------------------------------------------------

def round_pow2(s: Scale, rounding: Pow2 = "down") -> Scale:
    """Scale s rounded to a power of two (down, up or to the nearest), through E8M0:
    2^-127 .. 2^127; 0 stays 0. A number gives a number, except under torch.compile,
    where reading the rounded tensor would break the graph: there it stays a tensor."""
    if rounding not in _POW2_MODES:
        raise ValueError(f"rounding must be one of {sorted(_POW2_MODES)}, not {rounding!r}")
    if not isinstance(s, torch.Tensor) and not s >= 0:  # (a tensor's values are not read)
        raise ValueError(f"a scale is a number >= 0, not {s}")
    t = s if isinstance(s, torch.Tensor) else torch.tensor(float(s))
    r = fewbit_round(t.to(torch.float32), _E8M0, _POW2_MODES[rounding], sat=True)
    r = torch.where(t == 0, 0.0, r)
    return r if isinstance(s, torch.Tensor) or torch.compiler.is_compiling() else r.item()


def pow2_scale(t: torch.Tensor, rounding: Pow2 = "down") -> ScaledTensor:
    """t with its scale rounded to a power of two and the same value (data * 2^k is
    exact, so products and quotients of such scales are too); the zero array stays one."""
    _check_floating(t, "pow2_scale")
    _making("pow2_scale", t)
    return _Rebalance.apply(t, round_pow2(parts(t)[1], rounding))


def scale_to_e8m0(t: ScaledTensor) -> torch.Tensor:
    """The E8M0 codes (uint8, biased exponents) of t's power-of-two scale.
    ValueError if the scale is not a non-zero power of two in 2^-127 .. 2^127."""
    s = parts(t)[1]
    return encode(s if isinstance(s, torch.Tensor) else torch.tensor(s), _E8M0)


def from_e8m0(data: torch.Tensor, codes: torch.Tensor) -> ScaledTensor:
    """ScaledTensor of data with the power-of-two scale stored as E8M0 codes."""
    return as_scaled(data, decode(codes.to(data.device), _E8M0, torch.float32))


# --- dynamic rescaling -------------------------------------------------------------------

def _statistic(t: torch.Tensor, stat: Stat) -> torch.Tensor:
    # Of the finite values only: an inf or NaN would make the scale inf or NaN, and every
    # value with it (the non-finite ones stay what they are at any scale).
    d, s = parts(t)
    finite = d.isfinite()
    a = torch.where(finite, d.to(compute_dtype(d.dtype)).abs(), 0)
    if a.numel() == 0:
        v = a.new_zeros(())  # no data: 0, which keeps the scale (dynamic_scale)
    elif stat == "max":
        v = a.amax()
    else:
        n = finite.sum().clamp_min(1)
        if stat == "l1":
            v = a.sum() / n
        else:
            # RMS relative to the largest: squares of the values themselves leave float32
            # beyond about 1e±19, where the statistic would read 0 or inf.
            top = a.amax()
            v = top * ((a / torch.where(top > 0, top, 1)).square().sum() / n).sqrt()
    return (v if is_static(s, 1.0) else v * s).to(torch.float32)


def dynamic_scale(t: torch.Tensor, stat: Stat = "max", target: float = 1.0,
                  pow2: bool = False) -> torch.Tensor:
    """The scale that brings ``stat`` of t's data to ``target`` (max |x|, mean |x| or
    RMS) of its finite values, as a float32 tensor; with pow2 a power of two (rounded up
    for max, so the data stays within target; to the nearest otherwise). Where that is 0
    (an all-zero t) or beyond float32, t keeps its scale; the zero array (scale 0, which
    a tensor scale cannot be) gets 1.
    """
    _check_floating(t, "dynamic_scale")
    _check_statistic(stat, target)
    # (Of parts, not of a ScaledTensor made from a plain t: Dynamo cannot trace making one.)
    new = _statistic(t, stat) / target
    usable = (new > 0) & new.isfinite()  # before round_pow2, which saturates inf to 2^127
    if pow2:
        new = round_pow2(new, "up" if stat == "max" else "nearest")
    old = parts(t)[1]
    return torch.where(usable, new, 1.0 if is_static(old, 0.0) else old)


def dynamic_rescale(t: torch.Tensor, stat: Stat = "max", target: float = 1.0,
                    pow2: bool = False) -> ScaledTensor:
    """t rebalanced to :func:`dynamic_scale` (same value; autograd sees the identity)."""
    _making("dynamic_rescale", t)
    return _Rebalance.apply(t, dynamic_scale(t, stat, target, pow2))


def dynamic_rescale_(t: ScaledTensor, stat: Stat = "max", target: float = 1.0,
                     pow2: bool = False) -> ScaledTensor:
    """In-place :func:`dynamic_rescale` of a parameter; returns t."""
    return rebalance_(t, dynamic_scale(t, stat, target, pow2))


def dynamic_rescale_max(t: torch.Tensor, target: float = 1.0, pow2: bool = False) -> ScaledTensor:
    """t rebalanced so that max |data| = target."""
    return dynamic_rescale(t, "max", target, pow2)


def dynamic_rescale_l1(t: torch.Tensor, target: float = 1.0, pow2: bool = False) -> ScaledTensor:
    """t rebalanced so that mean |data| = target."""
    return dynamic_rescale(t, "l1", target, pow2)


def dynamic_rescale_l2(t: torch.Tensor, target: float = 1.0, pow2: bool = False) -> ScaledTensor:
    """t rebalanced so that the RMS of its data = target."""
    return dynamic_rescale(t, "l2", target, pow2)


class _RescaleGrad(torch.autograd.Function):
    # The identity forward; in backward the gradient is rebalanced by its statistic.
    @staticmethod
    def forward(ctx, t, stat, target, pow2):
        ctx.args = (stat, target, pow2)
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return dynamic_rescale(g, *ctx.args), None, None, None


def dynamic_rescale_grad(t: torch.Tensor, stat: Stat = "max", target: float = 1.0,
                         pow2: bool = False) -> torch.Tensor:
    """t itself, but the gradient flowing back through it is rebalanced (same value) so
    that ``stat`` of its data is ``target``: where the gradient's data is about to leave
    the range of a 16- or 8-bit format, its scale takes the size instead. A bad ``stat``
    or ``target`` is refused here, not in the backward pass."""
    _check_statistic(stat, target)
    guard_settings(t)
    return _RescaleGrad.apply(t, stat, target, pow2)


def dynamic_rescale_max_grad(t: torch.Tensor, target: float = 1.0, pow2: bool = False) -> torch.Tensor:
    """Identity forward; the gradient is rebalanced so that max |data| = target."""
    return dynamic_rescale_grad(t, "max", target, pow2)


def dynamic_rescale_l1_grad(t: torch.Tensor, target: float = 1.0, pow2: bool = False) -> torch.Tensor:
    """Identity forward; the gradient is rebalanced so that mean |data| = target."""
    return dynamic_rescale_grad(t, "l1", target, pow2)


def dynamic_rescale_l2_grad(t: torch.Tensor, target: float = 1.0, pow2: bool = False) -> torch.Tensor:
    """Identity forward; the gradient is rebalanced so that its RMS = target."""
    return dynamic_rescale_grad(t, "l2", target, pow2)
