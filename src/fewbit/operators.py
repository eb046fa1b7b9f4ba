"""fewbit's operators: defined with ``torch.library`` at the cost of one dispatcher call.

``torch.library.custom_op`` runs every call through layers of Python: an autograd kernel, a
guard against Dynamo, and for an op that writes an argument a version-counter kernel that
rebuilds the schema's argument list on every call. On the 2-core VM that cost 20 us per
call of a functional op and 50 us of one that writes, where the dispatcher alone costs 4 us
and the native kernel rounds 4096 elements in 2 us. :func:`operator` defines the same op
with torch.library's lower-level API (``define``, ``Library.impl``, ``register_fake``,
``register_autograd``), and keeps what those layers were for:

- one kernel for every device (``CompositeExplicitAutograd``, as custom_op registers), and a
  fake implementation for tracing;
- autograd: for a straight-through op, the identity with respect to its first argument
  (``register_autograd``'s backward, and a forward-mode tangent where fewbit's functions
  call it); for any other op, a fallthrough: its outputs carry no gradient, and its kernel
  runs under ``no_grad`` so that no torch op inside records a graph on an input that
  requires grad;
- the version counter of each written argument is bumped once the kernel has written it
  (``torch.autograd.graph.increment_version``), so that autograd still refuses a backward
  through a tensor saved before the write.

The kernel's own frame is not traced by Dynamo: a kernel runs from the dispatcher, never
from the user's compiled frame (tests/test_operator.py counts the graphs Dynamo makes).

fewbit's functions call an op through its :class:`Operator`. In eager code where nothing
of PyTorch's would see the dispatcher's call (:func:`unseen`: no tracing, mode, transform,
profiler, tensor subclass or autograd recording), that runs the kernel itself and bumps
the written arguments' versions, as the dispatcher would. That saves 5 us of host time
per call on the 2-core VM (the dispatcher's boxing of nine arguments, the autograd layer
and ``no_grad``), on a CPU or before a GPU launch alike: ``fewbit.round`` of 4096 elements
takes 9 us in all (``benchmarks/bench_per_call.py``).
"""

from __future__ import annotations

import contextlib
import inspect
import operator as _operator
from collections.abc import Callable, Sequence

import torch

from .random import _DISPATCH_MODES, Key, key_of

__all__ = ["Operator", "operator"]

#: The registrations of every fewbit operator (alive as long as the module).
LIBRARY = torch.library.Library("fewbit", "FRAGMENT")


class Operator:
    """A defined operator: called as ``torch.ops.fewbit.<name>`` (``op``), or as this
    object, which runs its kernel without the dispatcher where nothing of PyTorch's would
    see the call (:func:`unseen`); ``register_fake`` decorates its fake implementation."""

    def __init__(self, qualname: str, direct: Callable, tensors: tuple[int, ...],
                 backward: Callable | None = None) -> None:  # fmt: skip
        self.qualname = qualname
        self.op = getattr(torch.ops.fewbit, qualname.split("::")[1]).default
        self._direct = direct
        self._differentiable = None if backward is None else _differentiable(self.op, backward)
        # Its tensor arguments, picked in one call: itemgetter gives several as a tuple, but
        # one as itself, so that one is picked as a slice.
        picked = tensors if len(tensors) > 1 else [slice(tensors[0], tensors[0] + 1)]
        self._tensors = _operator.itemgetter(*picked)

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            if self._differentiable is not None:
                refuse_compiled_forward_ad()
                refuse_compiled_transform()
            return self.op(*args)
        if unseen(self._tensors(args)):
            return self._direct(*args)
        args = tuple(key_of(a) if isinstance(a, Key) else a for a in args)  # the schema's key tensor
        if self._differentiable is not None and (differentiating() or may_carry_tangent(args[0])):
            return self._differentiable.apply(*args)
        return self.op(*args)

    def register_fake(self, fake: Callable) -> Callable:
        """Register ``fake`` as the op's fake (shape-only) implementation, for tracing."""
        torch.library.register_fake(self.qualname, fake, lib=LIBRARY)
        return fake

    def register_vmap(self, whole: Callable[..., tuple | None]) -> Callable:
        """The op under ``torch.vmap``: one call on the whole batch where only x is batched
        and ``whole(*args)``, given x with its batch first, returns that call's arguments;
        else a call per sample, as torch's fallback makes them (without its warning that
        the op has no rule). A sample is a call of its own: a stochastic rounding draws
        each sample the bits of its own indices, from 0. An op with several outputs (a
        tuple) stacks each; ``whole`` always None calls it per sample."""
        op = self.op

        def rule(info, in_dims, *args):
            if in_dims[0] is not None and not any(d is not None for d in in_dims[1:]):
                call = whole(args[0].movedim(in_dims[0], 0), *args[1:])
                if call is not None:
                    return op(*call), 0
            if info.batch_size == 0:  # no sample to call: one of zeros checks the call and gives the shape
                zeros = [a if d is None else a.new_zeros(a.shape[:d] + a.shape[d + 1:])
                         for a, d in zip(args, in_dims, strict=True)]  # fmt: skip
                one = op(*zeros)
                if isinstance(one, tuple):
                    return tuple(t.new_empty((0, *t.shape)) for t in one), (0,) * len(one)
                return one.new_empty((0, *one.shape)), 0
            picked = [[a if d is None else a.select(d, i) for a, d in zip(args, in_dims, strict=True)]
                      for i in range(info.batch_size)]  # fmt: skip
            results = [op(*sample) for sample in picked]
            if isinstance(results[0], tuple):
                return tuple(torch.stack(each) for each in zip(*results, strict=True)), (0,) * len(results[0])
            return torch.stack(results), 0

        torch.library.register_vmap(self.qualname, rule, lib=LIBRARY)
        return whole


def operator(
    qualname: str, *, mutates_args: tuple[str, ...] = (), straight_through: bool = False
) -> Callable[[Callable], Operator]:
    """Define the operator ``qualname`` (``"fewbit::name"``) with the decorated function
    as its kernel, its schema inferred from the type hints; ``mutates_args`` names the
    arguments it writes. ``straight_through``: the op's derivative is the identity with
    respect to its first argument (none for the others); else its outputs carry no
    gradient."""

    def define(fn: Callable) -> Operator:
        torch.library.define(qualname, torch.library.infer_schema(fn, mutates_args=mutates_args), lib=LIBRARY)
        parameters = inspect.signature(fn).parameters
        written = tuple(list(parameters).index(name) for name in mutates_args)
        tensors = tuple(i for i, p in enumerate(parameters.values()) if "Tensor" in str(p.annotation))
        name = qualname.split("::")[1]
        LIBRARY.impl(name, _kernel(fn, written, grad_off=not straight_through), "CompositeExplicitAutograd")
        backward = None
        if straight_through:
            nones = (None,) * (len(parameters) - 1)

            def backward(ctx, grad: torch.Tensor) -> tuple:
                return (grad, *nones)

            torch.library.register_autograd(qualname, backward, lib=LIBRARY)
        else:
            LIBRARY.impl(name, torch.library.fallthrough_kernel, "Autograd")
        # Called directly, nothing requires grad (unseen): the kernel without no_grad.
        return Operator(qualname, _kernel(fn, written, grad_off=False), tensors, backward)

    return define


def _differentiable(op: torch._ops.OpOverload, backward: Callable) -> type[torch.autograd.Function]:
    """``op`` with ``backward`` as its gradient and the identity as its forward-mode
    derivative in its first argument, as an autograd.Function: torch.func's transforms
    (grad, vjp, jacrev, vmap of them) refuse the one that ``register_autograd`` makes,
    which has no ``setup_context`` (pytorch/pytorch#170834, open in torch 2.13;
    tests/test_operator.py fails once torch takes it), and forward mode (``jvp``,
    ``jacfwd``, ``forward_ad``) has no formula through the op: it drops the tangent."""

    class Differentiable(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(*args):
            return op(*args)  # (autograd is off in here: the op's own formula is not run)

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass  # the gradients of fewbit's ops need nothing of the forward

        @staticmethod
        def backward(ctx, grad):
            return backward(ctx, grad)

        @staticmethod
        def jvp(ctx, tangent, *_):
            return tangent  # (only x is floating point: key and random_bits carry no tangent)

    return Differentiable


def transformed() -> bool:
    """Whether a torch.func transform is active (False where this torch lacks the query)."""
    return _PRIVATE is not None and _PRIVATE[1]() is not None


#: torch's query of a tensor batched by vmap (private). None where this torch lacks it:
#: a stacked count is then refused in torch's words (a vmapped .item()).
_IS_BATCHED = getattr(torch._C._functorch, "is_batchedtensor", None)
#: torch's queries of a functorch wrapper (grad's over vmap's) and what it wraps (private).
#: None where this torch lacks them: a count vmapped under grad is then refused in torch's
#: words (tests/test_nn.py fails first).
_IS_WRAPPED = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
_UNWRAPPED = getattr(torch._C._functorch, "get_unwrapped", None)


def vmapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is batched by vmap at any level: under vmap of grad (ensembled
    training) the tensor vmap stacked is wrapped by grad's, which is no batched tensor.
    Traced, the first level alone: Dynamo cannot trace the wrapper queries."""
    if _IS_BATCHED is None:
        return False
    while not _IS_BATCHED(t):
        if (_IS_WRAPPED is None or _UNWRAPPED is None or torch.compiler.is_compiling()
                or not _IS_WRAPPED(t)):
            return False
        t = _UNWRAPPED(t)
    return True


#: torch's context that runs ops past functorch's transforms (private). None where this
#: torch lacks it: a training FakeQuantize is then refused under them (tests/test_nn.py
#: fails first).
_PAST_TRANSFORMS = getattr(torch._C, "_DisableFuncTorch", None)


def past_transforms() -> contextlib.AbstractContextManager:
    """A context in which ops run past the active torch.func transforms, on the tensors
    they wrap (none active: a context that does nothing)."""
    if _PAST_TRANSFORMS is not None and transformed():
        return _PAST_TRANSFORMS()
    return contextlib.nullcontext()


#: functorch's stack of active transforms, and those that differentiate (private; None
#: where this torch lacks them: every transform then counts as one that differentiates).
_STACK = getattr(torch._C._functorch, "get_interpreter_stack", None)
_TRANSFORMS = getattr(torch._C._functorch, "TransformType", None)
_DIFFERENTIATE = None if _TRANSFORMS is None else (_TRANSFORMS.Grad, _TRANSFORMS.Jvp)


def differentiating() -> bool:
    """Whether a torch.func transform that differentiates (grad, vjp, jacrev, jvp, jacfwd)
    is active, where a straight-through op is called through its autograd.Function. Not
    under vmap or functionalize alone: torch cannot functionalise an autograd.Function ("NYI:
    Functionalize rule for custom_function_call"), where the op itself is functional."""
    if not transformed():
        return False
    if _STACK is None or _DIFFERENTIATE is None:
        return True
    return any(level.key() in _DIFFERENTIATE for level in _STACK())


_FORWARD_AD = torch.autograd.forward_ad
#: Whether this torch keeps the active forward-AD level as ``forward_ad._current_level``
#: (private; -1 while none is), which :func:`may_carry_tangent` reads in 0.07 us where
#: the public ``unpack_dual`` takes 0.8.
_LEVEL_KNOWN = isinstance(getattr(_FORWARD_AD, "_current_level", None), int)


def may_carry_tangent(x: torch.Tensor) -> bool:
    """Whether ``x`` may carry a forward-AD tangent: a dual level is active, or where this
    torch does not say so, x has a tangent."""
    if _LEVEL_KNOWN:
        return _FORWARD_AD._current_level >= 0
    return _FORWARD_AD.unpack_dual(x).tangent is not None


#: torch's context that turns forward AD off (private; None where this torch lacks it: the
#: kernels of ops without a gradient then run with it on, and tests/test_operator.py fails).
_FORWARD_GRAD_OFF = getattr(_FORWARD_AD, "_set_fwd_grad_enabled", None)


def dual_level_active() -> bool:
    """Whether a forward-AD level is active (True where this torch does not say)."""
    return not _LEVEL_KNOWN or _FORWARD_AD._current_level >= 0


def has_tangent(t: torch.Tensor) -> bool:
    """Whether ``t`` carries a forward-AD tangent (asked only where one may be)."""
    return may_carry_tangent(t) and _FORWARD_AD.unpack_dual(t).tangent is not None


def refuse_compiled_forward_ad() -> None:
    """Under torch.compile, refuse a call inside forward-mode AD (``torch.func.jvp``,
    ``jacfwd``, a dual level), which the traced op would answer with a zero tangent. Read
    at trace time; Dynamo without fullgraph runs the frame eagerly instead, where the
    tangent passes."""
    if _LEVEL_KNOWN and _FORWARD_AD._current_level >= 0:
        raise RuntimeError("fewbit: forward-mode AD (torch.func.jvp, jacfwd, forward_ad) through fewbit's "
                           "ops under torch.compile would give a zero tangent (torch 2.13 traces the op "
                           "without its forward-mode formula); call it eagerly")


#: Whether a differentiating torch.func transform is active where Dynamo traces: run at
#: trace time (Dynamo cannot trace functorch's queries), its answer a constant of the graph.
_differentiating_traced = torch.compiler.assume_constant_result(differentiating)


def refuse_compiled_transform() -> None:
    """Under torch.compile, refuse a call inside a torch.func transform that differentiates
    (``torch.compile(torch.func.grad(f))``; vjp, jacrev): the traced op has only the
    gradient ``register_autograd`` gives it, which torch 2.13 refuses there, and the
    autograd.Function that eager calls take instead fails inside Dynamo. Torch said so in
    its words, about a setup_context that fewbit's function does not lack."""
    if _differentiating_traced():
        raise RuntimeError("fewbit: torch.compile of torch.func.grad (vjp, jacrev) through fewbit's ops is "
                           "not supported in torch 2.13 (pytorch/pytorch#170834): call the transform "
                           "eagerly, or compile the function and take its gradient with torch.autograd "
                           "(backward outside the compiled function)")


#: Tensors a call may run on directly: torch's own, whose __torch_function__ is torch's.
_PLAIN = (torch.Tensor, torch.nn.Parameter)
#: (Looked up once: unseen runs at every call.)
_STRIDED, _has_torch_function = torch.strided, torch.overrides.has_torch_function


def is_plain(t: torch.Tensor) -> bool:
    """Whether a kernel may read ``t``'s memory as its data: a tensor whose class leaves
    ``__torch_dispatch__`` as torch's (a Parameter, a subclass of torch's own). A wrapper
    subclass may hold no memory (an AsyncCollectiveTensor, a DTensor's piece still waiting
    for its collective, has a null data pointer; a FakeTensor has none)."""
    return type(t).__torch_dispatch__ is _TORCH_DISPATCH


_TORCH_DISPATCH = torch.Tensor.__torch_dispatch__


def _private_state() -> tuple[Callable[[], object], ...] | None:
    """torch's private queries of what would see an op call: the dispatch modes stacked
    (tracing, fake tensors, a user's mode), the functorch transforms active (vmap, grad),
    whether a profiler records, and whether torch.jit traces (``torch.jit.is_tracing``
    less its check for TorchScript, which never runs this); and forward AD's level
    (:data:`_LEVEL_KNOWN`). None where this torch lacks one: every call then goes through
    the dispatcher (tests/test_operator.py fails first)."""
    if _DISPATCH_MODES is None or not _LEVEL_KNOWN:
        return None
    try:
        return (_DISPATCH_MODES, torch._C._functorch.peek_interpreter_stack,
                torch._C._autograd._profiler_enabled, torch._C._is_tracing)  # fmt: skip
    except AttributeError:
        return None


_PRIVATE = _private_state()


def unseen(tensors: Sequence[torch.Tensor | Key | None]) -> bool:
    """Whether an eager call of an op on these tensor arguments (None for one not given, a
    host Key for a key tensor) needs nothing of torch's dispatcher: nothing traces it
    (torch.jit, a dispatch mode) or transforms it (functorch, a torch function mode), no
    profiler records it, autograd has nothing to record (no tensor requires grad, or grad
    is off; no forward-AD level is active), and the tensors are torch's own, strided, on
    a CPU or a CUDA device. Its kernel then runs as called (``Operator``), without the
    dispatcher's 5 us (2-core VM; a kernel rounds 4096 elements in 2)."""
    if _PRIVATE is None:
        return False
    dispatch_modes, transforms, profiling, tracing = _PRIVATE
    if dispatch_modes() or transforms() is not None or profiling() or tracing():
        return False
    if _FORWARD_AD._current_level >= 0:
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None or type(t) is Key:
            continue
        if type(t) not in _PLAIN or t.layout != _STRIDED or not (t.is_cpu or t.is_cuda) or (
                grad and t.requires_grad):  # fmt: skip
            return False
    return not _has_torch_function(tensors[:1])  # a torch function mode


def recording() -> bool:
    """Whether ops called now are recorded rather than only run on values: Dynamo traces,
    torch.jit traces, or a dispatch mode is active (make_fx, torch.export, fake tensors, a
    user's mode). True where this torch lacks the private queries (:func:`_private_state`):
    a value read then would be wrong, where an op recorded is only slower."""
    if torch.compiler.is_compiling() or _PRIVATE is None:
        return True
    return bool(_PRIVATE[0]()) or _PRIVATE[3]()


def _kernel(fn: Callable, written: tuple[int, ...], grad_off: bool) -> Callable:
    """``fn`` as the op's kernel: without autograd recording where ``grad_off``, and the
    arguments at ``written`` marked as written once it returns (``fn`` itself where
    neither: a call's frame the less)."""
    if not (written or grad_off):
        return fn
    # One written argument is picked as itself, which increment_version takes at half the
    # cost of a list; several as a tuple.
    pick = _operator.itemgetter(*written) if written else None

    def kernel(*args):
        if grad_off and _FORWARD_GRAD_OFF is not None and dual_level_active():
            # no_grad leaves forward AD on: the torch ops inside would carry x's tangent, and
            # those that write an out= (the eager rounding's) refuse one, in torch's words.
            with torch.no_grad(), _FORWARD_GRAD_OFF(False):
                result = fn(*args)
        elif grad_off and torch.is_grad_enabled():
            torch.set_grad_enabled(False)  # as torch.no_grad, at a third of its 4 us
            try:
                result = fn(*args)
            finally:
                torch.set_grad_enabled(True)
        else:
            result = fn(*args)
        if pick is not None:
            torch.autograd.graph.increment_version(pick(args))
        return result

    return kernel
