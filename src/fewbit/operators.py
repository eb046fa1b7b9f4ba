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
- autograd: the given backward (``register_autograd``), or for an op without one, a
  fallthrough: its outputs carry no gradient, and its kernel runs under ``no_grad`` so that
  no torch op inside records a graph on an input that requires grad;
- the version counter of each written argument is bumped once the kernel has written it
  (``torch.autograd.graph.increment_version``), so that autograd still refuses a backward
  through a tensor saved before the write.

The kernel's own frame is not traced by Dynamo: a kernel runs from the dispatcher, never
from the user's compiled frame (tests/test_operator.py counts the graphs Dynamo makes).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

__all__ = ["Operator", "operator"]

#: The registrations of every fewbit operator (alive as long as the module).
LIBRARY = torch.library.Library("fewbit", "FRAGMENT")


class Operator:
    """A defined operator, whose ``register_fake`` decorates its fake implementation (it is
    called as ``torch.ops.fewbit.<name>``)."""

    def __init__(self, qualname: str) -> None:
        self.qualname = qualname

    def register_fake(self, fake: Callable) -> Callable:
        torch.library.register_fake(self.qualname, fake, lib=LIBRARY)
        return fake


def operator(
    qualname: str, *, mutates_args: tuple[str, ...] = (), backward: Callable | None = None
) -> Callable[[Callable], Operator]:
    """Define the operator ``qualname`` (``"fewbit::name"``) with the decorated function
    as its kernel, its schema inferred from the type hints; ``mutates_args`` names the
    arguments it writes, ``backward`` is the gradient (``register_autograd``'s), or None
    for an op whose outputs carry none."""

    def define(fn: Callable) -> Operator:
        torch.library.define(qualname, torch.library.infer_schema(fn, mutates_args=mutates_args), lib=LIBRARY)
        names = list(inspect.signature(fn).parameters)
        written = tuple(names.index(name) for name in mutates_args)
        name = qualname.split("::")[1]
        LIBRARY.impl(name, _kernel(fn, written, grad_off=backward is None), "CompositeExplicitAutograd")
        if backward is None:
            LIBRARY.impl(name, torch.library.fallthrough_kernel, "Autograd")
        else:
            torch.library.register_autograd(qualname, backward, lib=LIBRARY)
        return Operator(qualname)

    return define


def _kernel(fn: Callable, written: tuple[int, ...], grad_off: bool) -> Callable:
    """``fn`` as the op's kernel: without autograd recording where ``grad_off``, and the
    arguments at ``written`` marked as written once it returns."""

    def kernel(*args):
        if grad_off and torch.is_grad_enabled():
            torch.set_grad_enabled(False)  # as torch.no_grad, at a third of its 4 us
            try:
                result = fn(*args)
            finally:
                torch.set_grad_enabled(True)
        else:
            result = fn(*args)
        if written:
            torch.autograd.graph.increment_version([args[i] for i in written])
        return result

    return kernel
