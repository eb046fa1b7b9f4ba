"""fewbit's one configuration object: read once from the environment at import, changed
for a block of code with :func:`configure`.

=====================  =====================  =============================================
setting                environment (import)   meaning
=====================  =====================  =============================================
``compile``            ``FEWBIT_EAGER=1``     run fewbit's kernels compiled by torch.compile
                       sets it False          (C++/OpenMP on CPU, Triton on GPU); False: eager
                                              torch ops (same bits, slower, no compiler)
``compile_threshold``  ``FEWBIT_COMPILE_      tensors of at least this many elements take the
                       THRESHOLD``            compiled kernel; smaller ones run eager (the
                                              native kernel takes every size)
``native``             ``FEWBIT_NATIVE=0``    fewbit's own kernels where they apply: on a CPU
                       sets it False          C++ (``rounding/native.cpp``, built at first use),
                                              on a GPU Triton (``rounding/triton_kernels.py``);
                                              False: torch.compile'd kernels. Needs ``compile``
``native_cache``       ``FEWBIT_CACHE``       folder of the built native kernel (default
                                              ``$XDG_CACHE_HOME/fewbit`` or ``~/.cache/fewbit``;
                                              a leading ``~`` is expanded)
``eager_chunk``                               elements per chunk of an eager CPU run (chunks
                                              keep the intermediates in cache)
``scaled_fallback``                           ``"warn"`` (once per op) or ``"error"`` when an
                                              aten op without a ScaledTensor rule meets one
``unit_scaling``                              ScaledTensor matmuls divide by a power of two
                                              near sqrt(K) and fold it into the scale
=====================  =====================  =============================================

The settings are process-wide: a ``with configure(...)`` block changes them for every
thread until it ends, autograd's backward threads included (a per-thread setting would
not reach those); blocks of several threads may overlap, each taking out only its own
changes when it ends. Nothing in fewbit reads the environment after import: a process
forked inside a block keeps its settings, a spawned one starts from the environment.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

__all__ = ["Config", "as_flag", "configure", "current"]


def as_flag(value: object, name: str) -> bool:
    """``value`` as a bool flag: a bool or numpy's bool; anything else is a TypeError
    naming ``name`` (bool() would take "no" or 2 as True, None as False). Here, not in
    fewbit.rounding.checks: the config, which imports no torch, checks its flags so too."""
    if isinstance(value, bool | np.bool_):
        return bool(value)
    kind = type(value)
    kind = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    raise TypeError(f"{name} must be a bool, not {kind}: {value!r}")


@dataclass(frozen=True)
class Config:
    """fewbit's settings (see the module docstring for each)."""

    compile: bool = True
    #: 2^16: below it a kernel launch buys nothing, and a small tensor should never wait
    #: for a first compilation.
    compile_threshold: int = 1 << 16
    #: 2^20 was the fastest of 2^14 .. 2^24 for eager rounding on a 2-core AMD EPYC.
    eager_chunk: int = 1 << 20
    scaled_fallback: Literal["warn", "error"] = "warn"
    unit_scaling: bool = False
    native: bool = True
    native_cache: str | os.PathLike[str] = os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fewbit")

    def __post_init__(self) -> None:
        for name in ("compile", "unit_scaling", "native"):  # (numpy's bool too, as fewbit.round's sat)
            object.__setattr__(self, name, as_flag(getattr(self, name), name))
        for name in ("compile_threshold", "eager_chunk"):  # (numpy's ints too, as fewbit.round's bits)
            value = getattr(self, name)
            if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral) or \
                    value < (name == "eager_chunk"):  # fmt: skip
                raise ValueError(f"{name} must be an int >= {int(name == 'eager_chunk')}, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.scaled_fallback not in ("warn", "error"):
            raise ValueError(f"scaled_fallback must be 'warn' or 'error', got {self.scaled_fallback!r}")
        if not isinstance(self.native_cache, str | os.PathLike) or not os.fspath(self.native_cache):
            raise ValueError(f"native_cache must be a folder's path (a non-empty str or os.PathLike), "
                             f"got {self.native_cache!r}")
        if os.fspath(self.native_cache).startswith("~"):  # as a shell would (Docker's ENV does not)
            object.__setattr__(self, "native_cache", os.path.expanduser(self.native_cache))

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Config:
        """The defaults, with the environment variables of the module docstring applied."""
        env = os.environ if environ is None else environ
        changes: dict[str, Any] = {}
        for name, setting, default in (("FEWBIT_EAGER", "compile", "0"), ("FEWBIT_NATIVE", "native", "1")):
            value = env.get(name, "")
            if value not in ("", "0", "1"):
                raise ValueError(f"{name} must be 0 or 1, got {value!r}")
            changes[setting] = (value or default) == default
        if env.get("FEWBIT_CACHE"):
            changes["native_cache"] = env["FEWBIT_CACHE"]
        threshold = env.get("FEWBIT_COMPILE_THRESHOLD")
        if threshold:  # set and empty means unset, as for the others
            try:
                changes["compile_threshold"] = int(threshold)
            except ValueError:
                raise ValueError(f"FEWBIT_COMPILE_THRESHOLD must be an int, got {threshold!r}") from None
        return cls(**changes)


_current = Config.from_env()
#: The settings outside every open configure block, and the open blocks' changes (a key
#: each) in the order they were entered: the settings in force are rebuilt from them when
#: a block ends, since blocks of two threads may end in any order.
_base = _current
_open: dict[object, dict[str, Any]] = {}


def fork_safe_lock(module: str) -> threading.Lock:
    """A new lock for ``module``'s ``_lock``, made anew in a forked child: a fork while
    another thread holds it copies it held by a thread the child lacks, and the child's
    next use would wait forever (the native build's lock; configure's here)."""

    def renew() -> None:
        sys.modules[module]._lock = threading.Lock()  # type: ignore[attr-defined]

    if hasattr(os, "register_at_fork"):  # POSIX
        os.register_at_fork(after_in_child=renew)
    return threading.Lock()


_lock = fork_safe_lock(__name__)


def current() -> Config:
    """The settings in force."""
    return _current


#: The settings' names, which configure takes.
_NAMES = frozenset(f.name for f in dataclasses.fields(Config))


def _changed(config: Config, changes: dict[str, Any]) -> Config:
    """``config`` with ``changes``, checked. The same block entered again (a write-back's,
    every step) takes the frozen Config made the first time, without its checks: keyed by
    each value's type too, since 8192.0 == 8192 but only the int passes them. Not a change
    of native_cache: its leading ~ is the home folder of the call (HOME read then)."""
    if "native_cache" in changes:
        return dataclasses.replace(config, **changes)
    try:
        return _replaced(config, tuple((name, type(v), v) for name, v in changes.items()))
    except TypeError:  # a value that cannot be hashed, or a wrong one (raises again here)
        return dataclasses.replace(config, **changes)


@functools.lru_cache(maxsize=64)
def _replaced(config: Config, changes: tuple[tuple[str, type, Any], ...]) -> Config:
    return dataclasses.replace(config, **{name: v for name, _, v in changes})


def _refuse_traced() -> None:
    """Refuse a block that torch.compile traces, naming why: the settings are read as the
    kernels run, after the traced code has returned (Dynamo failed on the block's key,
    "Failed to trace builtin operator `object`"; without fullgraph it runs eagerly). torch
    as the process has it: this module imports none."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.compiler.is_compiling():
        raise RuntimeError("fewbit.configure cannot change the settings inside a compiled function (the "
                           "kernels read them as they run): enter it around the compiled call")


@contextmanager
def configure(**changes: Any) -> Iterator[Config]:
    """Change settings inside a ``with`` block: ``with fewbit.configure(compile=False): ...``.
    Unknown names and bad values raise before anything changes."""
    global _current, _base
    unknown = sorted(set(changes) - _NAMES)
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}; known: {sorted(_NAMES)}")
    _refuse_traced()
    key = object()
    with _lock:
        entered = _changed(_current, changes)
        if not _open:
            _base = _current
        _open[key] = changes
        _current = entered
    try:
        yield entered
    finally:
        with _lock:
            del _open[key]
            config = _base
            for still_open in _open.values():
                config = _changed(config, still_open)
            _current = config
