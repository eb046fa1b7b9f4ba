"""ScaledTensor: a tensor stored as ``data * scale``, and the table of its aten rules.

Seed 003 (Scalify) in PyTorch: ``data`` keeps the storage dtype, ``scale`` is a float32
tensor (a scalar, or broadcastable to ``data`` for per-channel scales), and each aten
op has a rule that says how the output's scale follows from the inputs' scales, so
the scale propagates through forward, backward and the optimizer while the maths of
the model is unchanged. The rules themselves live in ``ops`` and ``nn_ops``.

A scale known while tracing is kept as a Python float instead of a tensor (seed 003's
special values: 1 for a plain tensor, 0 for the zero array, and constants such as a
scalar factor): rules then skip work (a product with 1, a sum with 0), and torch.compile
sees a constant.
"""

from __future__ import annotations

import copy
import hashlib
import math
import threading
import warnings
import weakref
from collections.abc import Callable
from functools import cache, partial
from pathlib import Path
from typing import Any

import torch

try:  # torch's private helper (tests/test_scaled.py fails first where it moves)
    from torch.utils._python_dispatch import return_and_correct_aliasing
except ImportError as err:  # fewbit's other modules do not import this one
    raise ImportError(f"fewbit.scaled needs torch.utils._python_dispatch.return_and_correct_aliasing, "
                      f"which torch {torch.__version__} lacks; the rest of fewbit works without it") from err

from ..config import current
from ..operators import has_tangent, transformed

aten = torch.ops.aten

#: A scale: a float32 tensor, or a Python float known while tracing.
Scale = torch.Tensor | float

#: Smallest normal float32: the floor of a divisor scale, so that a ratio to a zero
#: common scale is 0 instead of NaN (a zero scale is the zero array, whatever its data).
TINY = torch.finfo(torch.float32).tiny

#: 16-bit data dtypes: rules compute on them in float32 and round once.
REDUCED = (torch.float16, torch.bfloat16)


def check_dtype(dtype: torch.dtype, what: str = "data") -> None:
    """Raise TypeError for a data dtype that ScaledTensor refuses (``what`` names the
    tensor): 8-bit (and packed 4-bit) floats, on which torch has almost no arithmetic (no
    add, mul, matmul), so that rules would fail deep inside an op instead of here; and
    integer, bool and complex data, which rules would compute on in integers."""
    if not dtype.is_floating_point:
        raise TypeError(f"{what} must have a floating dtype, not {dtype}")
    if dtype.itemsize == 1:
        raise TypeError(f"ScaledTensor data of dtype {dtype} is not supported: torch computes almost "
                        "nothing on it. Keep an 8-bit format's values in float16, bfloat16 or float32 "
                        "data (cast(t, 'ocp_e4m3')) and store their codes with fewbit.codec.encode")


class NoRuleError(NotImplementedError):
    """An op without a rule met a ScaledTensor while fewbit's setting ``scaled_fallback``
    is ``"error"`` (``with fewbit.configure(scaled_fallback="error"): ...``), or a
    torch.distributed collective without a rule did, whatever the setting."""


def _rules_digest() -> str:
    """A digest of this package's source, the rules. AOTAutograd caches on disk what a
    graph of ScaledTensors compiled to, keyed by the graph (``t.half()``) and by its inputs'
    ``_stable_hash_for_caching``, not by the rules that ran inside it: a graph cached by a
    fewbit with other rules would load those rules, old bugs and all. The digest is part
    of each ScaledTensor's hash."""
    source = b"".join(path.read_bytes() for path in sorted(Path(__file__).parent.glob("*.py")))
    return hashlib.sha256(source).hexdigest()[:16]


RULES_DIGEST = _rules_digest()


def traced_settings() -> tuple[bool, str]:
    """The settings that rules read (``unit_scaling``, ``scaled_fallback``), which
    torch.compile bakes into a graph as it traces them: part of each ScaledTensor's
    flatten context, on which Dynamo guards, so that a change of them compiles again (and
    of AOTAutograd's cache key)."""
    config = current()
    return config.unit_scaling, config.scaled_fallback


def guard_settings(t: torch.Tensor | None = None) -> None:
    """Under torch.compile, have Dynamo guard on :func:`traced_settings` where traced code
    makes a ScaledTensor of plain tensors (the flatten context guards them on ScaledTensor
    inputs alone): a graph traced under other settings would run its rules silently.
    Dynamo guards on a value once it is used (a comparison), not on one merely read.

    Also refuses a call under torch.func's transforms (grad, vmap, jvp, ...), named: there
    torch failed inside (an autograd.Function without ``setup_context``; a functorch wrapper
    hides the ScaledTensor from its methods), where torch.autograd takes every cast; and
    ``t`` (the tensor the call makes a ScaledTensor of) with a forward-mode tangent
    (``torch.autograd.forward_ad``): the casts' Functions have no forward-mode formula
    (torch's NotImplementedError), and ``as_scaled`` dropped the tangent without a word."""
    if not torch.compiler.is_compiling():
        if transformed():
            raise RuntimeError("fewbit.scaled does not run under torch.func's transforms (grad, vmap, jvp, "
                               "jacrev, ...): take gradients with torch.autograd (loss.backward(), "
                               "torch.autograd.grad)")
        if t is not None and has_tangent(t):
            raise RuntimeError("fewbit.scaled does not carry forward-mode AD's tangents "
                               "(torch.autograd.forward_ad), and this tensor has one: take gradients in "
                               "reverse mode (loss.backward(), torch.autograd.grad)")
    if torch.compiler.is_compiling():
        unit, fallback = traced_settings()
        _ = (unit is True, fallback == "error")


#: Whether this torch has the private functions that rebuild a wrapper subclass
#: (ScaledTensor.__reduce_ex__).
_REBUILD = all(hasattr(module, name) for module, name in (
    (torch._utils, "_rebuild_wrapper_subclass"), (torch._utils, "_get_obj_state"),
    (torch._tensor, "_rebuild_from_type_v2"), (torch.Tensor, "_clear_non_serializable_cached_data")))


class _Parts:
    """A ScaledTensor's data and scale (``scale`` None where it is ``static``), and the
    record of the views that share them (``views``), in an object of their own: that
    record points to these weakly, never to a tensor, because torch.utils.swap_tensors
    (Module._apply: ``model.to()``, ``.half()``) refuses a tensor that a weak reference
    points to."""

    __slots__ = ("data", "scale", "static", "views", "__weakref__")

    def __init__(self, data: torch.Tensor, scale: torch.Tensor | None = None, static: float | None = None):
        self.data, self.scale, self.static, self.views = data, scale, static, None

    def __deepcopy__(self, memo: dict) -> _Parts:
        # The copies of views copied together (one memo: a deepcopy of a model, of a dict)
        # share their scale as the originals do.
        new = _Parts(copy.deepcopy(self.data, memo), copy.deepcopy(self.scale, memo), self.static)
        if self.views is not None:
            views = memo.get(id(self.views))
            if views is None:
                views = memo[id(self.views)] = _Views(new, base=copy.deepcopy(self.views.base, memo))
            views.members.add(new)
            new.views = views
        return new


class ScaledTensor(torch.Tensor):
    """A tensor whose value is ``data * scale``.

    ``ScaledTensor(data, scale)`` checks its arguments as :func:`as_scaled` does (in
    compiled code use as_scaled, which has Dynamo guard on the settings rules read). The
    tensor reports data's shape, dtype and device; ``unscaled`` is the data,
    ``scale`` the scale (always a tensor here), :meth:`dequantize` the value.
    """

    _parts: _Parts

    __torch_function__ = torch._C._disabled_torch_function_impl

    # The parts by the names the rules (and __tensor_flatten__) read and write.
    @property
    def _data(self) -> torch.Tensor:
        return self._parts.data

    @_data.setter
    def _data(self, data: torch.Tensor) -> None:
        self._parts.data = data

    @property
    def _scale(self) -> torch.Tensor | None:
        return self._parts.scale

    @_scale.setter
    def _scale(self, scale: torch.Tensor | None) -> None:
        self._parts.scale = scale

    @property
    def _static(self) -> float | None:
        return self._parts.static

    @_static.setter
    def _static(self, static: float | None) -> None:
        self._parts.static = static

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor | float | None = None) -> ScaledTensor:
        data, s = _checked(data, scale)
        return cls._make(data, s)

    @classmethod
    def _make(cls, data: torch.Tensor, scale: Scale) -> ScaledTensor:
        """Wrap without checks of the scale (rules call this). A tensor scale must be
        float32 on data's device with a shape broadcastable to data's. Data of a refused
        dtype (``check_dtype``) raises TypeError, whichever op made it."""
        check_dtype(data.dtype)
        t = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, device=data.device, layout=data.layout, requires_grad=False,
        )
        t._parts = _Parts(data)
        _hold(t._parts, scale)
        return t

    # unscaled and scale are also the names __tensor_flatten__ gives the parts: Dynamo
    # reads an attribute of a tensor made inside the graph only where it is one of those
    # (any other it takes for a constant, and a tensor is none: "Unexpected type in
    # sourceless builder"), and AOTAutograd writes a gradient's parts back by them.
    @property
    def unscaled(self) -> torch.Tensor:
        """The stored data (value = unscaled * scale)."""
        return self._parts.data

    @unscaled.setter
    def unscaled(self, data: torch.Tensor) -> None:
        self._data = _same_form(self._data, data, "unscaled")

    @property
    def scale(self) -> torch.Tensor:
        """The scale as a float32 tensor (built on the spot when it is static).

        Under torch.compile, a static scale of a tensor made inside the graph is refused
        by name (Dynamo cannot take a tensor built outside the graph): read
        ``static_scale``, a number and a constant of the graph, or give the scale as a
        tensor."""
        if self._parts.scale is not None:
            return self._parts.scale
        if _dynamo_reads(self._data):
            _graph_break(self, "fewbit.scaled: .scale of a static (number) scale inside a compiled function",
                         "The scale is a Python number, a constant of the graph, and .scale would build "
                         "a tensor of it outside the graph, which Dynamo cannot take.",
                         "Read t.static_scale (the number) instead, or give the scale as a tensor "
                         "(as_scaled(x, torch.tensor(s)); scalify's parameters have one).")
        return torch.full((), self._static, dtype=torch.float32, device=self._data.device)

    @scale.setter
    def scale(self, scale: torch.Tensor) -> None:
        if self._scale is None:
            raise TypeError("a static scale is set by rebalance_, not by assigning .scale")
        self._scale = _same_form(self._scale, scale, "scale")

    @property
    def static_scale(self) -> float | None:
        """The scale when it is known without reading a tensor, else None."""
        return self._static

    # torch's own ``.data`` setter swaps a wrapper's metadata only, and the value lives
    # in _parts: ``p.data = x`` (nn.utils.vector_to_parameters, EMA and model surgery)
    # would leave the value as it was, under x's shape.
    @property
    def data(self) -> ScaledTensor:
        """A detached alias, as for any tensor (it shares this tensor's scale)."""
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        # new's value, without a copy, as for a plain tensor: a ScaledTensor's data and
        # scale are shared as a view's are; a plain tensor is the data at scale 1, as
        # ScaledTensor(new) holds it (which refuses a dtype before anything changes).
        if not isinstance(new, torch.Tensor):
            raise TypeError(f"data must be a tensor, not {type(new).__name__}")
        alias = new.detach() if isinstance(new, ScaledTensor) else ScaledTensor(new.detach())
        torch._C.TensorBase.data.__set__(self, alias)
        self._parts = alias._parts

    def __setitem__(self, index: Any, v: Any) -> None:
        # torch's indexing makes a number a tensor of the data's dtype before any rule sees
        # it: x[:, 1] = 1e-9 wrote 0 (float16's 1e-9) into data at scale 2^-30, x[i] = 1e6
        # inf at 2^20. The number goes in as a 0-d ScaledTensor instead, data sign(c) at
        # scale |c| as a fill by a number (0, non-finite and float32's outliers as torch's).
        # Not at the static scale 1, where data are values and a write is torch's, bit for bit,
        # as by a plain tensor (x[0] = 1000. rescaled every element to scale 1000).
        number = isinstance(v, (int, float)) and not isinstance(v, bool) and self._static != 1.0
        if number and _ROUNDS_TO_ZERO < abs(v) < _ROUNDS_TO_INF:
            sign = torch.tensor(math.copysign(1.0, v), dtype=self.dtype, device=self.device)
            v = ScaledTensor._make(sign, abs(float(v)))
        super().__setitem__(index, v)

    def share_memory_(self) -> ScaledTensor:
        """Refused with TypeError (``model.share_memory()`` too): an in-place op may give
        this tensor a new scale, which other processes would not see, so they would read
        the shared data at a scale it no longer has. (torch's own would crash the process:
        the wrapper has no storage.)"""
        raise TypeError("a ScaledTensor cannot be put in shared memory: an in-place op may change its "
                        "scale, which other processes would not see; share plain tensors instead "
                        "(t.dequantize())")

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The value ``data * scale`` as a new plain tensor of ``dtype`` (default data's),
        computed in float32 or wider and rounded once.

        Differentiable: the gradient that comes back to this tensor has the value of the
        gradient of the plain result, as a ScaledTensor (as the gradients of the rules'
        ops are) of the data's dtype, with the power-of-two scale that
        ``dynamic_rescale_max(g, pow2=True)`` picks: its largest |data| is about 1, so
        float16 or bfloat16 data holds a gradient that would underflow or overflow there
        at scale 1.
        """
        return _Dequantize.apply(self, dtype or self._data.dtype)

    def __repr__(self) -> str:
        s = self._static if self._scale is None else self._scale
        return f"ScaledTensor(unscaled={self._data!r}, scale={s!r})"

    # torch's own refuse a subclass; these give the value's, as a plain tensor's do
    # (logging f"{loss:.4f}", np.asarray). An empty format spec keeps the repr. Eager under
    # torch.compile: a graph break, as for a plain tensor, where Dynamo put a call of the
    # value's __format__ into the graph and failed on its fake tensor.
    @torch.compiler.disable
    def __format__(self, spec: str) -> str:
        return self.detach().dequantize().__format__(spec) if spec else repr(self)

    def tolist(self) -> Any:
        """The value as (nested) Python numbers, as for a plain tensor."""
        return self.detach().dequantize().tolist()

    def numpy(self, *, force: bool = False) -> Any:
        """The value as a NumPy array (a copy), as for a plain tensor (which refuses a
        tensor that requires grad: so does this)."""
        return self.dequantize().numpy(force=force)

    # FSDP2's extension points (fewbit.scaled.fsdp): the pieces' data are gathered, the
    # scale comes along as metadata. Imported on call: only FSDP2 calls them.
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """FSDP2 hook: what to all-gather of this piece (``fewbit.scaled.fsdp``)."""
        from .fsdp import pre_all_gather

        return pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """FSDP2 hook: the unsharded parameter from the gathered data (``fewbit.scaled.fsdp``)."""
        from .fsdp import post_all_gather

        return post_all_gather(self, outputs, metadata, param_dtype, out=out)

    # torch pickles and deep-copies a wrapper subclass (a tensor without storage of its
    # own) from its metadata and Python state where data_ptr() == 0, which a view at a
    # storage offset (t[1:]) is not. There, the same as torch does at offset 0, through
    # torch's private rebuild functions (where this torch has them: _REBUILD; else
    # torch's own way, which fails for such a view as before; tests/test_scaled.py fails first).
    def _wrapper_args(self) -> tuple:
        return (type(self), self.dtype, tuple(self.size()), self.stride(), self.storage_offset(),
                self.layout, self.device, self.requires_grad)

    def __reduce_ex__(self, proto):
        if self.storage_offset() == 0 or not _REBUILD:
            return super().__reduce_ex__(proto)
        self._clear_non_serializable_cached_data()
        state = torch._utils._get_obj_state(self)
        return (torch._tensor._rebuild_from_type_v2,
                (torch._utils._rebuild_wrapper_subclass, type(self), self._wrapper_args(), state))

    def __deepcopy__(self, memo: dict) -> ScaledTensor:
        if self.storage_offset() == 0 or not _REBUILD:
            return super().__deepcopy__(memo)
        if id(self) not in memo:
            new = torch._utils._rebuild_wrapper_subclass(*self._wrapper_args())
            new.__dict__ = copy.deepcopy(self.__dict__, memo)
            if self.grad is not None:
                new.grad = copy.deepcopy(self.grad, memo)
            memo[id(self)] = new
        return memo[id(self)]

    def __getstate__(self) -> dict:
        # Pickled (torch.save) as the data and scale themselves, as they were before _Parts.
        state = {k: v for k, v in self.__dict__.items() if k != "_parts"}
        return {**state, "_data": self._data, "_scale": self._scale, "_static": self._static}

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        self._parts = _Parts(state.pop("_data"), state.pop("_scale"), state.pop("_static"))
        self.__dict__.update(state)

    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        inner = ["unscaled"] if self._scale is None else ["unscaled", "scale"]
        return inner, (self._static, *traced_settings())

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx: tuple, outer_size, outer_stride) -> ScaledTensor:
        static = ctx[0]
        t = ScaledTensor._make(inner["unscaled"], inner["scale"] if static is None else static)
        _UNFLATTENED.add(t._parts)
        return t

    def __coerce_tangent_metadata__(self) -> ScaledTensor:
        # torch.compile traces the gradient of an output in this form. A static scale
        # becomes a tensor: the gradient that arrives mostly has a tensor scale
        # (dequantize's backward), and coercing it to a traced static scale would move
        # the scale ratio into 16-bit data, flushing or overflowing it; a static one
        # turns into a float32 tensor (exactly where float32 holds it; value() multiplies
        # in float32 anyway).
        return self if self._static is None else ScaledTensor._make(self._data, self.scale)

    def __coerce_same_metadata_as_tangent__(self, expected_metadata: tuple, expected_type=None):
        # torch.compile guessed a gradient's static scale from the output's; give the
        # gradient that form, with the same value.
        if expected_type not in (None, type(self)):
            return None
        static = expected_metadata[0]
        if static == self._static:
            return self
        if static is None:
            return ScaledTensor._make(self._data, self.scale)
        return ScaledTensor._make(times(self._data, sdiv(parts(self)[1], static)), static)

    def _stable_hash_for_caching(self) -> str:
        # AOTAutograd's cache key (its extension point for subclasses): what the compiled
        # code depends on, the rules included, not the values.
        def meta(t: torch.Tensor | None) -> str:
            return "-" if t is None else f"{t.dtype}{tuple(t.shape)}{t.stride()}{t.device}"

        return (f"ScaledTensor[{RULES_DIGEST}]({meta(self._data)},{meta(self._scale)},{self._static!r},"
                f"{traced_settings()})")

    # Never a frame of Dynamo's own. Code that torch.compile runs eager (after a graph
    # break: FSDP2's hooks, which torch runs under compiler.disable, leave torch.nn's
    # forwards to run eager, frames Dynamo skips) calls this from C, and Dynamo would
    # compile it as a frame of user code: it broke the graph in the rules and resumed
    # in _make with the half-built wrapper, which has no _parts yet ("'ScaledTensor'
    # object has no attribute '_parts'"). Traced code never steps into it: AOTAutograd
    # runs it on fake tensors, outside Dynamo's frame hook, where this costs nothing.
    @classmethod
    @torch.compiler.disable(recursive=True)
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _check_devices(func, args, kwargs)
        rule = _lookup(func)
        if rule is None:
            return _fallback(func, args, kwargs)
        out = rule(func, *args, **kwargs)
        operands = _operands(func)
        if type(out) is ScaledTensor and operands is not None:
            # A rule computes with scales and numbers at the data's scale, which may
            # be wider tensors: the result takes the dtype torch gives the same op.
            want = promoted_dtype(operands(args))
            if want is not None and want != out.dtype:
                return aten._to_copy.default(out, dtype=want)
        return out


class _Dequantize(torch.autograd.Function):
    # ScaledTensor.dequantize as autograd sees it (the gradient's form: its docstring).
    @staticmethod
    def forward(ctx, t: ScaledTensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.dtype = t.dtype
        v = value(t, dtype)
        # Autograd writes the output's history on the tensor object itself: a scale-1
        # value in the data's dtype is the stored data, which must not take it.
        return v.clone() if v is t._data else v

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[ScaledTensor, None]:
        from .casts import dynamic_rescale_max  # casts builds on this module

        return dynamic_rescale_max(g, pow2=True).to(ctx.dtype), None


# A checkpoint of ScaledTensors loads with torch.load's default (weights_only=True), as one
# of plain tensors does: the type rebuilds from its data, scale and numbers alone.
torch.serialization.add_safe_globals([ScaledTensor])


# --- checks ------------------------------------------------------------------------

def _checked(data: torch.Tensor, scale: torch.Tensor | float | None) -> tuple[torch.Tensor, Scale]:
    if isinstance(data, ScaledTensor):
        raise TypeError("data is already a ScaledTensor; use rebalance to change its scale")
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"data must be a torch.Tensor, not {type(data).__name__}")
    check_dtype(data.dtype)
    return data, 1.0 if scale is None else check_scale(scale, data)


def constant(v: Any) -> Any:
    """A number that torch.compile made symbolic (the second value it saw) as a plain one
    again, guarded on: a graph per value, as fewbit's ops take numbers. Anything else is
    returned as it is."""
    if isinstance(v, torch.SymInt):
        return int(v)
    return float(v) if isinstance(v, torch.SymFloat) else v


def check_scale(scale: torch.Tensor | float, data: torch.Tensor, positive: bool = False) -> Scale:
    """scale as rules hold it (a float, or a float32 tensor), after checking that it is
    a number or float tensor on data's device, broadcastable to data, finite and >= 0
    (> 0 with ``positive``, and for a tensor: the zero array's scale is the number 0) as
    a float32 number: one that float32 rounds to inf, or to 0 from a nonzero value, is
    refused too. Raises TypeError or ValueError naming the problem."""
    scale = constant(scale)  # (a number is a constant of the graph, as the README has it)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, torch.Tensor)):
        raise TypeError(f"scale must be a float or a float tensor, not {type(scale).__name__}")
    if not isinstance(scale, torch.Tensor):
        # A static scale is float32 too (``ScaledTensor.scale``), though held as a float:
        # refused where float32's cast would make it inf, or 0 from a nonzero value, by
        # comparisons alone (_ROUNDS_TO_ZERO). Traced, a number that Dynamo made symbolic
        # (the second value it saw) is compared and guarded on, where a tensor of it, or a
        # message holding it, broke a fullgraph=True graph.
        scale = float(scale)
        if not ((scale == 0 and not positive) or _ROUNDS_TO_ZERO < scale < _ROUNDS_TO_INF):
            raise ValueError(f"scale must be finite and {'> 0' if positive else '>= 0'} in float32 "
                             f"(2^-149 to 2^128), got {scale}")
        return scale
    if not scale.is_floating_point():
        raise TypeError(f"scale must have a floating dtype, not {scale.dtype}")
    if scale.device != data.device:
        raise ValueError(f"scale is on device {scale.device} but data on device {data.device}")
    try:
        shape = torch.broadcast_shapes(scale.shape, data.shape)
    except RuntimeError:
        shape = None
    if shape != data.shape:
        raise ValueError(f"scale of shape {tuple(scale.shape)} does not broadcast to data's "
                         f"shape {tuple(data.shape)}")
    if torch.compiler.is_compiling():
        # Traced, its values are not known (a check would break the graph): they are
        # checked where the same code runs eager.
        return scale.detach().to(torch.float32, copy=True)
    return _check_float32(scale.detach(), " everywhere (the zero array's scale is the number 0)")


#: float32's rounding to nearest even takes a number at or below this to 0 (the tie with
#: its smallest subnormal, 2^-149, goes to 0) and one at or above the other to inf (the
#: tie between its largest, 2^128 - 2^104, and 2^128).
_ROUNDS_TO_ZERO, _ROUNDS_TO_INF = 2.0**-150, 2.0**128 - 2.0**103


def _check_float32(scale: torch.Tensor, where: str) -> torch.Tensor:
    # scale as float32, or ValueError: not finite, not > 0, or rounded to inf or to 0 by
    # the cast. A copy: the caller may change theirs later, to a scale this refuses.
    s = scale.to(torch.float32, copy=True)
    if not bool((torch.isfinite(s) & (s > 0)).all()):
        raise ValueError(f"scale must be finite and > 0 in float32 (2^-149 to 2^128){where}")
    return s


def _canonical(scale: torch.Tensor, ndim: int) -> torch.Tensor:
    # One element: a 0-dim scale, which broadcasts through any view. Per channel: as many
    # dims as data, so that view rules can apply data's op to the expanded scale.
    if scale.dim() == 0:
        return scale
    if scale.numel() == 1:
        return scale.reshape(())
    if scale.dim() < ndim:
        return scale.reshape((1,) * (ndim - scale.dim()) + tuple(scale.shape))
    return scale


def _check_devices(func, args: tuple, kwargs: dict) -> None:
    # Runs before every op, so a flat loop over the arguments (and lists among them).
    found = None
    for x in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(x, torch.Tensor):
            found = _same_device(func, x, found)
        elif isinstance(x, (list, tuple)):
            for y in x:
                if isinstance(y, torch.Tensor):
                    found = _same_device(func, y, found)


def _same_device(func, x: torch.Tensor, found: torch.device | None) -> torch.device | None:
    # CPU 0-dim tensors mix with any device in torch; so do they here.
    if not isinstance(x, ScaledTensor) and x.dim() == 0 and x.is_cpu:
        return found
    device = x.device
    if found is not None and device != found:
        raise ValueError(f"{func}: ScaledTensor mixed with tensors on other devices "
                         f"({', '.join(sorted(map(str, {found, device})))})")
    return device


def as_scaled(data: torch.Tensor, scale: torch.Tensor | float | None = None) -> ScaledTensor:
    """``ScaledTensor`` with value ``data * scale`` (scale None means 1).

    A float scale is static (known while tracing: torch.compile compiles a graph for
    each value, so give a scale that changes between calls as a tensor); a tensor scale
    is cast to float32 and may be per-channel (broadcastable to data). Raises TypeError for non-float or
    8-bit float data (``check_dtype``) or a non-float scale, ValueError for a scale that
    does not broadcast to data, lies on another device, or is negative or not finite.
    The result carries no gradient to data: data that requires grad (outside
    ``torch.no_grad``) is refused rather than cut from autograd without a word.
    """
    if isinstance(data, torch.Tensor) and data.requires_grad and torch.is_grad_enabled():
        raise ValueError("as_scaled(data, scale) would cut data from autograd (its gradient would never "
                         "come back); for a differentiable ScaledTensor of a tensor's value use "
                         "fewbit.scaled.rebalance(x, scale), or pass data.detach()")
    guard_settings(data if isinstance(data, torch.Tensor) else None)
    return ScaledTensor(data, scale)


# --- views share their base's scale ------------------------------------------------

class _Views:
    """The ScaledTensors that view one tensor's data: the tensor and the views rules made
    of it (and of them). They share its scale: a write that sets the scale of one (the
    zero array's first value, ``zero_``, ``rebalance_``, a broadcast) sets it on all, so
    none reads the data at a scale it no longer has."""

    __slots__ = ("base", "members")

    def __init__(self, first: _Parts, base: torch.Tensor):
        self.base = base  # the data they view (the zero array zeroes it: ``assign``)
        self.members = weakref.WeakSet([first])  # each one's _Parts


def share_scale(base: ScaledTensor, view: ScaledTensor) -> None:
    """Record that view's data view base's: they share one scale from now on."""
    views = base._parts.views
    if views is None:
        views = base._parts.views = _Views(base._parts, base._data)
    views.members.add(view._parts)
    view._parts.views = views


def _aliases(t: ScaledTensor) -> list[_Parts]:
    # The parts of t and of every live view of its data.
    views = t._parts.views
    return [t._parts] if views is None else [t._parts, *(m for m in list(views.members) if m is not t._parts)]


def _one_geometry(t: ScaledTensor) -> bool:
    # Whether every view of t's data has t's shape and strides (a per-channel scale then
    # fits them all).
    key = (t.shape, t._data.stride(), t._data.storage_offset())
    return all((m.data.shape, m.data.stride(), m.data.storage_offset()) == key for m in _aliases(t))


def has_per_channel_views(t: ScaledTensor) -> bool:
    """Whether t's scale, or that of a view of its data, is per channel. A view of one
    channel (``x[2]`` of a per-row x) holds one element of its base's scale, a scale of
    one element: a scale set through it would replace every channel's."""
    return any(m.scale is not None and m.scale.dim() > 0 for m in _aliases(t))


def check_settable(t: ScaledTensor, s: Scale) -> None:
    """ValueError for a per-channel s where a view of t's data has another shape or
    strides: s has no form there (checked before an in-place op writes anything). Traced
    by Dynamo, a graph break where s would be a new scale for a graph input: the graph
    would write the input back without it (the op then runs eager)."""
    if isinstance(s, torch.Tensor) and s.dim() and not _one_geometry(t):
        raise ValueError("a per-channel scale for a ScaledTensor with views of other shapes: give it "
                         "one scale, or drop the views first")
    if torch.compiler.is_compiling() and _rescales_an_input(t, s):
        _graph_break(t)


_RESCALED_INPUT = (
    "fewbit.scaled: an in-place op would give a graph input a new scale",
    "A graph writes a mutated input back as its data alone, at the scale it had: the new scale would be "
    "lost and the data read at the old one. fewbit.scaled runs the op eager (a ScaledTensor's copy_ at "
    "another scale into an input, or an op into it after zero_).",
    "Run the op outside the compiled function, or return the new tensor from it.")


def _graph_break(t: ScaledTensor, why: str = _RESCALED_INPUT[0], explanation: str = _RESCALED_INPUT[1],
                 hint: str = _RESCALED_INPUT[2]) -> None:
    """Dynamo's graph break, naming why (then the op runs eager; ``fullgraph=True`` refuses
    it). ``unimplemented`` is private, in its keyword form of torch 2.13: where a torch
    moves or changes it, an error that names why, never the silent wrong values
    (tests/test_scaled.py's compiled rescale tests fail there, for the next engineer)."""
    try:
        from torch._dynamo.exc import unimplemented

        unimplemented(gb_type=why, context=f"a ScaledTensor of shape {tuple(t.shape)}",
                      explanation=explanation, hints=[hint])
    except (ImportError, TypeError):  # (moved, or another signature: the error below)
        pass
    raise RuntimeError(f"{why}. {explanation} {hint}")


def _rescales_an_input(t: ScaledTensor, s: Scale) -> bool:
    # Traced, whether s would be a new scale for a graph input (t, or another view of its
    # data): a graph writes a mutated input back as its data alone, at the scale it had, so
    # the new scale was lost (wrong values, silently). Dynamo's propagation of fake values
    # answers it (then the op runs eager); AOTAutograd's trace does not: there an input
    # sharing its scale tensor with another (after an eager x.copy_(y)) has a scale of its
    # own, and the same op would look like a new scale. zero_'s scale 0 counts too: its
    # zeros read right at the old scale, but the next value stored met that scale in
    # 16-bit data (inf where eager gives the zero array the value's scale).
    from torch._subclasses.functional_tensor import FunctionalTensor

    if isinstance(t._data, FunctionalTensor):
        return False
    now = parts(t)[1]
    same = s is now or (not isinstance(s, torch.Tensor) and not isinstance(now, torch.Tensor) and s == now)
    return not same and any(m in _UNFLATTENED for m in _aliases(t))


#: torch's query of the active fake mode (private). None where this torch lacks it: .scale
#: of a static scale made inside a compiled function then fails in Dynamo's words
#: (tests/test_scaled.py fails first).
_FAKE_KEY = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "FAKE", None)
_ACTIVE_MODE = getattr(torch._C, "_get_dispatch_mode", None)


def _dynamo_reads(d: torch.Tensor) -> bool:
    # Whether Dynamo itself reads an attribute of a ScaledTensor that its graph made: the
    # tensor is fake and no fake mode runs (rules, which run under one, read it freely).
    if not torch.compiler.is_compiling() or _FAKE_KEY is None or _ACTIVE_MODE is None:
        return False
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(d, FakeTensor) and _ACTIVE_MODE(_FAKE_KEY) is None


def _same_form(old: torch.Tensor, new: torch.Tensor, name: str) -> torch.Tensor:
    # A part assigned by its flatten name (AOTAutograd gives a gradient's parts another memory
    # format so): the same shape, dtype and device, else refused before anything changes.
    if not isinstance(new, torch.Tensor) or isinstance(new, ScaledTensor):
        raise TypeError(f"{name} must be a plain tensor, not {type(new).__name__}")
    if (new.shape, new.dtype, new.device) != (old.shape, old.dtype, old.device):
        raise ValueError(f"{name} can only be replaced by a tensor of its shape, dtype and device "
                         f"({tuple(old.shape)}, {old.dtype}, {old.device}); got ({tuple(new.shape)}, "
                         f"{new.dtype}, {new.device}): use rebalance or as_scaled for another")
    return new


#: The parts of ScaledTensors that torch.compile rebuilt from their flattened parts: its
#: graph inputs among them (read only while tracing, by :func:`check_settable`).
_UNFLATTENED: weakref.WeakSet = weakref.WeakSet()


def set_scale(t: ScaledTensor, s: Scale) -> None:
    """Give t, and every view of its data, the scale s (their data is not changed);
    :func:`check_settable` first."""
    check_settable(t, s)
    for m in _aliases(t):
        _hold(m, s)


def _hold(p: _Parts, s: Scale) -> None:
    # The scale s: a tensor in the form p's data broadcasts with, a number as static.
    if isinstance(s, torch.Tensor):
        p.scale, p.static = _canonical(s, p.data.dim()), None
    else:
        p.scale, p.static = None, float(s)


# --- the op table ------------------------------------------------------------------

#: aten op (overload or packet) -> rule. A rule takes (func, *args, **kwargs) as the
#: op does and returns what the op returns, with ScaledTensors where values are scaled.
RULES: dict[Any, Callable] = {}

#: Rules found by ``_lookup``, per overload (None: no rule).
_CACHE: dict[Any, Callable | None] = {}
_UNSEEN = object()


class _Looking(threading.local):
    """The overloads this thread is looking up (``funcs``), which their siblings, asking
    back, find without a rule. Per thread: a None put in ``_CACHE`` while looking was
    found by another thread's first call of the op, which then had no rule (a
    NoRuleError with scaled_fallback="error", else the op on plain tensors)."""

    def __init__(self) -> None:
        self.funcs: set = set()


_LOOKING = _Looking()


def rule(*ops: Any) -> Callable[[Callable], Callable]:
    """Register the decorated function as the rule of each op (overload or packet).

    An op that already has a rule raises ValueError, and none of ``ops`` is registered:
    a second rule would silently replace the first, in whichever order modules import.
    """

    def register(fn: Callable) -> Callable:
        taken = [op for op in ops if op in RULES]
        if taken:
            raise ValueError("fewbit.scaled: " + "; ".join(
                f"{op} already has a rule ({RULES[op].__qualname__})" for op in taken))
        RULES.update(dict.fromkeys(ops, fn))
        return fn

    return register


def if_present(namespace: Any, name: str) -> tuple:
    """``namespace.<name>`` (``torch.ops.aten``, ``torch.ops.fsdp``) where this torch has
    the op, for :func:`rule`, else nothing: for private ops that a torch fewbit takes may
    lack (softmax's masked variant, the fused rms_norm, FSDP2's gradient copy-in). Without
    one, torch runs ops that have rules instead."""
    return (getattr(namespace, name),) if hasattr(namespace, name) else ()


def _overloads(op: Any) -> list:
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    return [op]


def _is_aliasing(op: torch._ops.OpOverload) -> bool:
    # Views: outputs that alias an input without writing it. (In-place and out= rules
    # return the written tensor itself, which needs no correcting.)
    return any(r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns)


@cache
def _operands(func: torch._ops.OpOverload) -> Callable[[tuple], tuple] | None:
    # Where a functional op's result has its operands' promoted dtype: a call's operands
    # (an in-place or out= op keeps the written tensor's dtype; None: not promoted).
    if func._schema.is_mutable:
        return None
    if func.overloadpacket in (aten.cat, aten.stack):
        return lambda args: tuple(args[0])
    if torch.Tag.pointwise in func.tags or func.overloadpacket is aten.rsub:  # (rsub has no tag)
        return lambda args: args
    return None


def promoted_dtype(operands: tuple) -> torch.dtype | None:
    """The dtype torch's type promotion gives a pointwise op on ``operands`` (tensors and
    numbers; anything else takes no part): tensors with dimensions first, then 0-d ones,
    then numbers, a later group counting only where its kind (bool, integer, floating)
    is higher. None where a complex operand takes part (not promoted here)."""
    groups: list[torch.dtype | None] = [None, None, None]
    for a in operands:
        if isinstance(a, torch.Tensor):
            group, dtype = (0 if a.dim() else 1), a.dtype
        elif isinstance(a, (bool, int, float)):  # (bool first: it is an int)
            group = 2
            dtype = torch.bool if isinstance(a, bool) else torch.int64 if isinstance(a, int) \
                else torch.get_default_dtype()  # fmt: skip
        elif isinstance(a, complex):
            return None
        else:
            continue
        if dtype.is_complex:
            return None
        groups[group] = dtype if groups[group] is None else torch.promote_types(groups[group], dtype)
    dims, zero_dims, numbers = groups
    return _combine(dims, _combine(zero_dims, numbers))


def _combine(higher: torch.dtype | None, lower: torch.dtype | None) -> torch.dtype | None:
    # The dtype of a group of operands and a group below it (c10's combine_categories,
    # complex aside): the lower counts only where it is floating and the higher is not,
    # or the higher is bool.
    if higher is None or lower is None:
        return lower if higher is None else higher
    if not higher.is_floating_point and (higher == torch.bool or lower.is_floating_point):
        return torch.promote_types(higher, lower)
    return higher


def _lookup(func: torch._ops.OpOverload) -> Callable | None:
    """The rule of func: its own, its packet's, or one derived from the rule of the
    functional op, for ``out=``, in-place and ``_foreach_`` ops."""
    found = _CACHE.get(func, _UNSEEN)  # one lookup: this runs before every op
    if found is not _UNSEEN:
        return found
    looking = _LOOKING.funcs
    if func in looking:  # a sibling asking back finds nothing
        return None
    looking.add(func)
    try:
        found = _find(func)
    finally:
        looking.discard(func)
    _CACHE[func] = found
    return found


def _find(func: torch._ops.OpOverload) -> Callable | None:
    """:func:`_lookup`'s answer, found."""
    found = RULES.get(func)
    name = func.overloadpacket.__name__
    if found is None and "out" not in func._overloadname:
        found = RULES.get(func.overloadpacket)
    elif found is None and [a.name for a in func._schema.arguments if a.is_out] == ["out"]:
        if any(_lookup(o) for o in _overloads(func.overloadpacket) if o is not func):
            found = partial(_out_variant, func.overloadpacket)
    if found is None and name.startswith("_foreach_"):
        op = name[len("_foreach_"):]
        # An in-place op that aten lacks (maximum_, Adam's amsgrad): the functional one,
        # stored back.
        store = op.endswith("_") and not hasattr(aten, op)
        base = getattr(aten, op[:-1] if store else op, None)
        if base is not None and any(_lookup(o) for o in _overloads(base)):
            found = partial(_foreach, base, name.endswith("_"), store)
    elif found is None and name.endswith("_") and not name.startswith("_"):
        functional = _functional(func)
        if functional is not None and _lookup(functional) is not None:
            found = _view_in_place if torch.Tag.inplace_view in func.tags else inplace
    if found is not None and _is_aliasing(func):
        found = partial(_aliasing, found)
    return found


def _aliasing(rule: Callable, func, *args, **kwargs):
    # View ops: the output views the input's data, so it shares its scale (``_Views``);
    # autograd and torch.compile need the wrapper's aliasing to match the op's schema.
    out = rule(func, *args, **kwargs)
    for view in out if isinstance(out, (list, tuple)) else (out,):
        if isinstance(view, ScaledTensor) and isinstance(args[0], ScaledTensor):
            share_scale(args[0], view)
    return return_and_correct_aliasing(func, args, kwargs, out)


@cache
def _functional(func: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    # aten.op_.overload -> the aten.op overload with the same arguments: the same name
    # where that matches, as it mostly does (pow_.Scalar is pow(Tensor, Scalar), which is
    # pow.Tensor_Scalar; pow.Scalar is pow(Scalar, Tensor)).
    packet = getattr(aten, func.overloadpacket.__name__[:-1], None)
    if packet is None:
        return None

    def signature(op: torch._ops.OpOverload) -> list:
        return [(a.name, a.type, a.kwarg_only) for a in op._schema.arguments]

    ops = sorted(_overloads(packet), key=lambda o: o._overloadname != func._overloadname)
    return next((o for o in ops if signature(o) == signature(func)), None)


def inplace(func, dest, *args, **kwargs):
    """The rule of an in-place op without its own: x.op_(...) is x.op(...) stored back
    into x (see ``assign``), which takes the result's scale where x is a whole tensor
    (:func:`holds_every_value`: FSDP2's padded piece too, as its ranks' other pieces), as
    ``x = x.op(...)`` would: x's own scale would put a result of another size out of
    16-bit data's range (``sigmoid_`` of float16 data at scale 2^-20: values near 1 are
    data near 2^20, inf).

    A parameter at the zero array (``nn.init.zeros_`` after ``scalify``; a tensor that
    requires grad) takes :func:`first_scale` instead of the result's: its first update's
    scale (the learning rate's, at a warmup's 1e-6) had 16-bit data overflow at the next,
    larger ones. Optimizer state and gradients (which do not require grad) take the
    result's, with which their next values come."""
    whole = isinstance(dest, ScaledTensor) and holds_every_value(dest._data)
    out = _functional(func)(dest, *args, **kwargs)
    if whole and dest._static == 0.0 and dest.requires_grad and isinstance(out, ScaledTensor) \
            and out._static != 0.0:  # (the zero array still: AdamW's decay, mul_, keeps it one)
        s = first_scale(out, dest.dtype)
        out = wrap(at_scale(out, s), s)
    return assign(dest, out, adopt=whole)


def first_scale(x: ScaledTensor, dtype: torch.dtype) -> torch.Tensor:
    """The power of two nearest 1 at which data of ``dtype`` hold x's largest finite
    |value| as a normal number: 1, as the plain dtype holds it, where that does (so the
    parameter has the plain dtype's room to grow and shrink); else the one that brings it
    to (1/2, 1] (a larger value), or to the bottom of the normal range (a smaller one:
    float16's 2^-14, leaving it 2^30 to grow). 1 for an all-zero x. A float32 tensor: its
    value is not read."""
    from .casts import _statistic, round_pow2  # (casts builds on this module)

    top = _statistic(scalar_scale(x), "max")
    high = round_pow2(top, "up")
    low = high / (2 * torch.finfo(dtype).tiny)  # (inf where float32 cannot hold it: then 1)
    return torch.where(top > 0, torch.ones_like(top).clamp(min=high, max=low), 1.0)


def _view_in_place(func, x, *args, **kwargs):
    # squeeze_, t_, ... (torch.Tag.inplace_view): x becomes its view by the functional op.
    # Its data and scale are new objects (as_scaled's caller may hold the data, other
    # ScaledTensors the scale), and the wrapper takes the view's shape and strides.
    new = _functional(func)(x, *args, **kwargs)
    x._data, x._scale, x._static = new._data, new._scale, new._static
    return return_and_correct_aliasing(func, (x, *args), kwargs, x)


def _out_variant(packet, func, *args, out, **kwargs):
    # op(..., out=t) is op(...) stored into t. A plain t of another shape is resized to the
    # result's first, as torch resizes an out= tensor (warning where t held elements; the
    # copy into it failed on the shapes: torch.add(a, b, out=torch.empty(0))); a
    # ScaledTensor's is refused, before anything is written. A list out= (unsafe_split's)
    # takes each piece, all checked before any is written (it failed: "'list' object has
    # no attribute 'dtype'").
    result = packet(*args, **kwargs)
    if not isinstance(out, (list, tuple)):
        _check_out(func, out, result)
        return _store_out(out, result)
    if not isinstance(result, (list, tuple)) or len(result) != len(out):
        raise RuntimeError(f"{func}: out= holds {len(out)} tensors, the result "
                           f"{len(result) if isinstance(result, (list, tuple)) else 1}")
    for o, r in zip(out, result, strict=True):
        _check_out(func, o, r)
    for o, r in zip(out, result, strict=True):
        _store_out(o, r)
    return None


def _check_out(func, out: torch.Tensor, result: Any) -> None:
    # What _out_variant refuses before writing: a ScaledTensor out= of another shape, a
    # plain one of a dtype the result cannot be cast to.
    if isinstance(result, torch.Tensor) and out.shape != result.shape:
        if isinstance(out, ScaledTensor):
            raise RuntimeError(f"{func}: out= is a ScaledTensor of shape {tuple(out.shape)}, the result's is "
                               f"{tuple(result.shape)}: a ScaledTensor is not resized; pass one of the "
                               "result's shape")
        check_castable(result.dtype, out)


def _store_out(out: torch.Tensor, result: Any) -> torch.Tensor:
    if isinstance(result, torch.Tensor) and out.shape != result.shape:
        if out.numel():
            warnings.warn(f"An output with one or more elements was resized since it had shape "
                          f"{list(out.shape)}, which does not match the required output shape "
                          f"{list(result.shape)} (as torch warns)", stacklevel=4)
        out.resize_(result.shape)
    return assign(out, result)


def _foreach(base, inplace: bool, store: bool, func, *args, **kwargs):
    # _foreach_op(lists...) is op on each index; a non-list argument goes to every call.
    # Arguments keyword-only in op (alpha, value) come positionally in _foreach_op. With
    # store, base is functional and each result is stored into the first list's tensor.
    schema = getattr(base, base.overloads()[0])._schema.arguments[:len(args)]

    def call(i: int):
        def pick(a):
            return a[i] if isinstance(a, (list, tuple)) else a

        pos = [pick(a) for a, arg in zip(args, schema, strict=True) if not arg.kwarg_only]
        kw = {arg.name: pick(a) for a, arg in zip(args, schema, strict=True) if arg.kwarg_only}
        kw.update({k: pick(v) for k, v in kwargs.items()})
        out = base(*pos, **kw)
        return assign(pos[0], out) if store else out

    outs = [call(i) for i in range(len(args[0]))]
    return None if inplace else outs


_warned: set[str] = set()
#: Namespaces of torch.distributed's collectives: c10d's in-place ones, the functional ones.
_COLLECTIVES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})


def _fallback(func, args: tuple, kwargs: dict):
    """func on the dequantized values; float outputs get scale 1. An argument that func
    writes in place (its schema's ``Tensor(a!)``, ``Tensor(a!)[]``: fused optimizers,
    ``sinh_``, ``out=``) gets the new value back, as in-place rules store theirs
    (``assign``), and an in-place op returns that argument itself."""
    name = str(func)
    if func.namespace in _COLLECTIVES:
        # A collective writes its tensors without its schema saying so: run on values, it
        # would leave each rank's ScaledTensors as they were. A functional one (DTensor's
        # full_tensor) returns a buffer still being written: its values are not there yet.
        raise NoRuleError(f"fewbit.scaled: no rule for {name}, a collective on a ScaledTensor (broadcast "
                          "and scatter have rules): run it on t.dequantize(), or rebalance every rank's "
                          "tensor to one scale and run it on t.unscaled")
    if current().scaled_fallback == "error":
        raise NoRuleError(f"fewbit.scaled: no rule for {name}")
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"fewbit.scaled: no rule for {name}; it runs on dequantized values, its outputs "
                      "take scale 1 and the arguments it writes keep theirs", stacklevel=3)
    written = _written(func, args, kwargs)
    plain: dict[int, torch.Tensor] = {}  # id of a ScaledTensor -> its value, one per tensor

    def dequantized(x: Any) -> Any:
        if not isinstance(x, ScaledTensor):
            return x
        if id(x) not in plain:
            v = value(x, x.dtype)
            # Scale 1 gives the data itself: a written argument gets a copy, so that
            # func writes nothing into a ScaledTensor before the checks below.
            plain[id(x)] = v.clone() if v is x._data and id(x) in written else v
        return plain[id(x)]

    out = func(*_tree_map(dequantized, args), **_tree_map(dequantized, kwargs))
    for dest in written.values():
        if plain[id(dest)].shape != dest.shape:
            raise NoRuleError(f"fewbit.scaled: no rule for {name}, which resizes a ScaledTensor "
                              "argument in place")
    for dest in written.values():
        new = plain[id(dest)]
        # An argument func left unchanged (fused Adam's gradients) keeps its data: a
        # round trip through its value could move it by an ulp.
        if not torch.equal(new, value(dest, dest.dtype)):
            assign(dest, new)
    originals = {id(plain[i]): dest for i, dest in written.items()}

    def result(t: Any) -> Any:
        if id(t) in originals:
            return originals[id(t)]
        return wrap(t, 1.0) if _is_float(t) else t

    return _tree_map(result, out)


def _written(func, args: tuple, kwargs: dict) -> dict[int, ScaledTensor]:
    # The ScaledTensors among the arguments that func's schema marks as written, by id.
    found = {}
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        x = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in x if isinstance(x, (list, tuple)) else (x,):
            if isinstance(t, ScaledTensor):
                found[id(t)] = t
    return found


def _is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _tree_map(fn: Callable, x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return type(x)(_tree_map(fn, y) for y in x)
    if isinstance(x, dict):
        return {k: _tree_map(fn, v) for k, v in x.items()}
    return fn(x)


# --- helpers shared by the rules -----------------------------------------------------

def wrap(data: torch.Tensor, scale: Scale) -> ScaledTensor:
    """A ScaledTensor from a rule's output data and scale."""
    return ScaledTensor._make(data, scale)


def parts(x: Any) -> tuple[Any, Scale]:
    """(data, scale) of an operand: a plain tensor has scale 1, and a Python number c
    is the constant sign(c) with scale |c| (seed 003's scalar as a scaled array)."""
    if isinstance(x, ScaledTensor):
        # By the flatten names (unscaled, scale), and _static, a number or None: Dynamo
        # traces this in casts (pow2_scale), where a tensor made in the graph has no other.
        return x.unscaled, (x.scale if x._static is None else x._static)
    if isinstance(x, torch.Tensor):
        return x, 1.0
    c = float(x)
    return (1.0 if c > 0 else -1.0 if c < 0 else 0.0), abs(c)


def is_static(s: Scale, c: float | None = None) -> bool:
    """Whether scale s is known while tracing (and equal to c when c is given)."""
    return not isinstance(s, torch.Tensor) and (c is None or s == c)


def smul(a: Scale, b: Scale) -> Scale:
    """Product of two scales, skipping the work for 0 and 1."""
    if is_static(a, 1.0) or is_static(b, 0.0):
        return b
    if is_static(b, 1.0) or is_static(a, 0.0):
        return a
    return a * b


def sdiv(a: Scale, b: Scale) -> Scale:
    """a / b for a ratio of scales: 0 when a is 0, even for b = 0."""
    if is_static(b, 1.0) or is_static(a, 0.0):
        return a
    if is_static(b):
        return a / b if b else 0.0
    return a / b.clamp_min(TINY)


def smax(a: Scale, b: Scale) -> Scale:
    """The larger of two (non-negative) scales."""
    if is_static(a) and is_static(b):
        return max(a, b)
    if is_static(a, 0.0):
        return b
    if is_static(b, 0.0):
        return a
    if is_static(a):
        return b.clamp_min(a)
    if is_static(b):
        return a.clamp_min(b)
    return torch.maximum(a, b)


def spow(s: Scale, p: float) -> Scale:
    """s ** p for a scale."""
    if is_static(s):
        return s**p if s or p > 0 else float("inf")
    return s.pow(p)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which rules compute on values: float32 for 16-bit data, else data's."""
    return torch.promote_types(dtype, torch.float32)


def times(d: Any, r: Scale, dtype: torch.dtype | None = None) -> Any:
    """d * r, rounded once to ``dtype``: the dtype of the op d is an operand of, where it
    is wider than d's (a float16 operand of a float32 sum), else d's (16-bit data would
    first round r to 16 bits); floating for integer or bool d (an int tensor at a
    fractional scale); bool d as 0 and 1 in ``dtype`` even at r = 1 (torch negates no
    bool, and a sum subtracts it)."""
    if is_static(r, 1.0):
        bool_data = isinstance(d, torch.Tensor) and d.dtype == torch.bool and dtype is not None
        return d.to(dtype) if bool_data else d
    if not isinstance(d, torch.Tensor):
        return d * r
    target = d.dtype if dtype is None else torch.promote_types(d.dtype, dtype)
    if d.dtype in REDUCED or target != d.dtype or (isinstance(r, torch.Tensor) and r.dim()):
        out = _widened_times(d, compute_dtype(target), r)
        return out.to(target) if target.is_floating_point else out
    return d * r


def _widened_times(d: torch.Tensor, dtype: torch.dtype, r: Scale) -> torch.Tensor:
    """``d.to(dtype) * r`` as a new tensor: the product in the widened copy's own memory
    where ``to`` made one (16-bit data: no second float32 tensor of d's size), where it has
    the product's dtype and shape and no gradient is recorded; else out of place (d itself,
    already of dtype, is the caller's)."""
    wide = d.to(dtype)
    owned = wide is not d and not (wide.requires_grad and torch.is_grad_enabled())
    if owned and (not isinstance(r, torch.Tensor) or (
            torch.result_type(wide, r) == wide.dtype and not r.requires_grad and _broadcasts_into(r, wide))):
        return wide.mul_(r)
    return wide * r


def _broadcasts_into(r: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``r`` broadcasts to ``t``'s shape (``t * r`` has t's shape): dimension by
    dimension from the last, in Python (torch.broadcast_shapes costs 10 us a call)."""
    if r.dim() > t.dim():
        return False
    return all(a == 1 or a == b for a, b in zip(r.shape, t.shape[t.dim() - r.dim():], strict=True))


def coefficient(s: Scale) -> Scale:
    """Scale s as a Python number where reading it is free, else s unchanged.

    Free: a plain scalar tensor in host memory, whose read syncs no device (torch's
    eager Adam reads its CPU step count so, every step). In-place rules then pass a
    rebalancing ratio as the scalar argument of one fused op (``d.addcmul_(d1, d2,
    value=ratio)``) instead of writing a rebalanced copy of an operand first, a pass
    and an allocation more. Scales on an accelerator, per-channel scales, and the fake
    tensors that torch.compile traces rules with (a subclass of torch.Tensor) stay
    tensors; make_fx and jit.trace record ops on ScaledTensors, not inside rules.
    """
    if type(s) is torch.Tensor and s.is_cpu and s.dim() == 0:
        return s.item()
    return s


def value(x: Any, dtype: torch.dtype | None = None) -> Any:
    """The value of x (ScaledTensor, tensor or number) as a plain tensor.

    Computed in the compute dtype; rounded to ``dtype`` when given, else left there.
    """
    if not isinstance(x, ScaledTensor):
        return x if dtype is None or not isinstance(x, torch.Tensor) else x.to(dtype)
    d, s = parts(x)
    if is_static(s, 0.0):
        v = torch.zeros_like(d, dtype=compute_dtype(d.dtype))
    else:
        wide = compute_dtype(d.dtype)
        v = d.to(wide) if is_static(s, 1.0) else _widened_times(d, wide, s)
    return v if dtype is None else v.to(dtype)


def at_scale(x: Any, s: Scale, dtype: torch.dtype | None = None) -> Any:
    """x's data rebalanced to scale s (x's value = result * s), rounded to ``dtype``, the
    op's, where that is wider than the data's (:func:`times`)."""
    if isinstance(x, torch.Tensor):
        d, sx = parts(x)
        if is_static(sx, 0.0):  # the zero array: 0 whatever its data holds (d * 0 is NaN for inf)
            return torch.zeros_like(d)
        return times(d, sdiv(sx, s), dtype)
    c = float(x)
    return c * sdiv(1.0, s) if math.isfinite(c) else c


def scalar_scale(x: Any, dtype: torch.dtype | None = None) -> Any:
    """x with a single scale: a per-channel ScaledTensor is rebalanced to its largest
    scale (for rules whose op mixes elements across channels), rounded to ``dtype``
    where that is wider (:func:`times`); others unchanged."""
    if not isinstance(x, ScaledTensor) or x._scale is None or x._scale.dim() == 0:
        return x
    top = x._scale.amax()
    return wrap(times(x._data, sdiv(x._scale, top), dtype), top)


def is_partial_view(d: torch.Tensor) -> bool:
    """Whether d covers only part of its storage (views made inside rules have no _base)."""
    return d.storage_offset() != 0 or d.untyped_storage().nbytes() != d.numel() * d.element_size()


def data_readable(d: torch.Tensor) -> bool:
    """Whether a rule may branch on d's values: not while tracing, nor on the meta device
    (where fake tensors' storage is too)."""
    return d.untyped_storage().device.type != "meta" and not torch.compiler.is_compiling()


def holds_every_value(d: torch.Tensor) -> bool:
    """Whether d's tensor is all there is of its values: d covers its storage, or the rest
    of the storage holds only zeros, which a new scale leaves as they are. FSDP2 keeps a
    short piece of an uneven Shard(0) in a buffer padded with zeros: that rank's piece
    must take a new scale (``copy_``, ``zero_``) as the unpadded ranks' pieces do, or the
    ranks would gather their data under different scales. Read only for a partial view,
    and only where there are data: traced, or on the meta device (fake tensors' storage
    is there too), it keeps the rest's scale (a graph cannot branch on data)."""
    partial = is_partial_view(d)
    if not partial or not data_readable(d):
        return not partial
    storage = d.new_empty(0).set_(d.untyped_storage())
    return bool(storage.count_nonzero() == d.count_nonzero())


def check_castable(dtype: torch.dtype, dest: torch.Tensor) -> None:
    """RuntimeError where a result of ``dtype`` cannot be stored into plain dest, as torch
    refuses a float result for an int or bool tensor."""
    if not torch.can_cast(dtype, dest.dtype):
        raise RuntimeError(f"result type {dtype} can't be cast to the desired output type {dest.dtype}")


def assign(dest: torch.Tensor, out: Any, adopt: bool = False) -> torch.Tensor:
    """Store the result of an in-place op into dest, and return dest.

    dest keeps its scale, except a zero scale (or ``adopt``: a whole tensor's copy_): the
    zero array takes the result's scale, as optimizer state created by ``zeros_like``
    does, and so do all views of its data (``set_scale``; one scale where they differ in
    shape from dest and the result's is per channel). Written through a view, the rest
    of the zero array becomes zeros first: its data may be anything (``empty_like``),
    which the new scale would show.
    """
    if not isinstance(dest, ScaledTensor):
        check_castable(out.dtype, dest)
        # The value in the compute dtype, rounded once, to dest's: in the data's dtype first,
        # a float32 out= lost what float16 cannot hold (2^-29 of data at scale 2^-30 read 0).
        dest.copy_(value(out))
        return dest
    if dest._static != 0.0 and not adopt:
        # (at_scale: a zero array written in is zeros, whatever its data holds: inf * 0 was NaN)
        dest._data.copy_(at_scale(out, parts(dest)[1]))
        return dest
    d, s = parts(out)
    if isinstance(s, torch.Tensor) and s.dim() and not _one_geometry(dest):
        d, s = parts(scalar_scale(out))
    set_scale(dest, s)  # (first: its checks come before anything is written; data are apart)
    views = dest._parts.views
    if views is not None and views.base is not dest._data and not is_static(s, 0.0):
        views.base.zero_()
    dest._data.copy_(d)
    return dest
