"""Low-precision weights: the paper's Algorithm 1 around any torch optimizer.

Every step the inner optimizer computes ``w + u`` in the parameters' dtype (or, with
``update_dtype``, that sum rounded to a 16-bit dtype, as the paper's bfloat16 updates);
fewbit then rounds it back to the weight format in place, stochastically by default.
Updates smaller than half an ulp survive SR on average, where round-to-nearest drops them.

Random bits are a pure function of (seed, step, parameter index, element index), so a
run restarted from ``state_dict()`` draws exactly the bits an uninterrupted run would.
Sharded parameters (DTensors: FSDP2, HSDP) are rounded where they lie, each rank its own
piece, with the bits of the elements' indices in the full tensor (``fewbit.sharding``):
the full weights do not depend on the number of ranks or the placement.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from . import codec
from .block import BlockFormat, BlockTensor, check_args, element_or_block, quantize, round_to
from .block.formats import check_storable
from .block.ops import check_block_axis, with_tensor_scale
from .block.ops import format_name as block_format_name
from .config import as_flag
from .formats import FloatFormat
from .operators import is_plain
from .random import Key, as_key, check_index, fold_in
from .replicas import SeedPolicy, assert_identical_inputs, check_group, check_in_sync, replica_key, world
from .rounding import RoundMode, dtype_format
from .rounding.checks import check_bits, check_holds, scalar_args
from .rounding.foreach import round_foreach_, write_back_threshold
from .rounding.modes import parse_mode
from .rounding.ops import format_name
from .sharding import (
    ShardLayout,
    check_whole_blocks,
    differs_across_holders,
    global_amax,
    is_dtensor,
    layout,
    local_tensor,
    piece_randomness,
    quantize_range,
    refuse_alike,
    round_range,
    tensor_scales,
)  # fmt: skip

__all__ = ["LowPrecisionWeights"]

_UPDATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

#: What a weight held as codes answers without its values: its metadata, its gradient,
#: its hash (the optimizer's state is keyed by it) and its (empty) storage.
_METADATA = frozenset({
    *(getattr(torch.Tensor, name).__get__ for name in (
        "shape", "dtype", "device", "layout", "ndim", "grad", "requires_grad", "is_leaf")),
    torch.Tensor.grad.__set__, torch.Tensor.__hash__, torch.Tensor.size, torch.Tensor.dim,
    torch.Tensor.numel, torch.Tensor.element_size, torch.Tensor.is_floating_point,
    torch.Tensor.untyped_storage,
})  # fmt: skip


class _HeldAsCodes:
    """A selected weight between a step and :meth:`LowPrecisionWeights.materialize` under
    ``store_codes``: its storage is freed. Any use that reads its values first decodes
    every weight of its wrapper back (before, such a read crashed the process)."""

    __slots__ = ()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:  # the tensor's own class's (Parameter's: func as is)
            return super().__torch_function__(func, types, args, kwargs)
        for t in _tensors((args, kwargs)):
            holder = getattr(t, "_fewbit_codes_of", None)  # (None: traced, decoded already)
            if holder is None:
                continue
            if torch.compiler.is_compiling():  # torch.compile's first look at the weight
                warnings.warn("torch.compile read a weight that LowPrecisionWeights(store_codes=True) "
                              "held as codes, and decoded it; each such read after a step compiles "
                              "again: call materialize() or zero_grad() first", stacklevel=2)  # fmt: skip
            holder.materialize()
        return func(*args, **kwargs)  # as called, now on plain tensors

    def __deepcopy__(self, memo):  # (Parameter's would copy the held class)
        self._fewbit_codes_of.materialize()
        return self.__deepcopy__(memo)


#: DTensor's methods that read its piece in Python, where no torch function sees it: on a
#: held weight, the piece whose storage is freed (a read of it crashed the process; a
#: print too). (A plain weight's repr decodes first anyway, through its torch function.)
_PIECE_READERS = ("to_local", "redistribute", "full_tensor", "__repr__")


def _decoding_first(name: str) -> Callable:
    def method(self, *args, **kwargs):
        self._fewbit_codes_of.materialize()  # (the plain class again: its own method)
        return getattr(self, name)(*args, **kwargs)

    method.__name__ = name
    return method


@functools.cache
def _held_class(plain: type) -> type:
    """``plain`` (Parameter, DTensor, ...) with :class:`_HeldAsCodes` in front."""
    own = {"__slots__": (), "plain": plain}
    own.update({name: _decoding_first(name) for name in _PIECE_READERS if hasattr(plain, name)})
    return type(f"{plain.__name__}HeldAsCodes", (_HeldAsCodes, plain), own)


#: torch's count of a storage's owners (private: a version gate, ``_storage_holders``).
_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _storage_holders(t: torch.Tensor) -> int | None:
    """How many own ``t``'s storage (``t`` itself and every view or ``.detach()`` of it
    still alive), or None where this torch cannot tell (then store_codes frees regardless,
    as it did before it asked). tests/test_optim.py fails first if torch changes it."""
    if _STORAGE_USE_COUNT is None:
        return None
    storage = t.untyped_storage()
    return _STORAGE_USE_COUNT(storage._cdata) - 1  # (less the handle ``storage`` itself)


def _tensors(tree):
    """The tensors in nested tuples, lists and dicts (a torch function's arguments)."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, tuple | list):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


class LowPrecisionWeights:
    """Wrap ``optimizer`` so that the selected parameters always hold values of ``fmt``.

    Args:
        optimizer: any ``torch.optim.Optimizer``; it owns the update rule and its state.
        fmt: the weight format (a FloatFormat or a name such as ``"binary8p4"``), or a
            block format (a BlockFormat or a name such as ``"mxfp8_e4m3"``, ``"nvfp4"``):
            each weight then holds values of it in blocks along its last dimension (a
            Linear's input features, the dimension its forward product sums over, as MX
            lays out weights), rounded with ``fewbit.block.round`` and the same keys.
        mode: the rounding of the write-back; ``"src"`` (few-bit SR, unbiased) by default.
        bits: N, random bits per element, for the modes that take it.
        seed: an int or ``fewbit.random.Key``; step t rounds the i-th selected weight
            (from ``first_index``) with ``fold_in(key, t, i)`` (t = 0 is the rounding of
            the initial weights).
        params: the parameters to keep in ``fmt`` (tensors, or (name, tensor) pairs as
            ``named_parameters()`` gives); default: the optimizer's parameters with two or
            more dimensions (matrices and embeddings, as the paper).
        fraction: p for mode ``"sr_fraction"``.
        sat: values beyond the format's range go to its largest value (default), not Inf.
        update_dtype: hold ``w + u`` in this dtype (RNE) before rounding to ``fmt``;
            ``torch.bfloat16`` is the paper's set-up. None: the parameters' own dtype.
        scale: scale each tensor by a power of two so that its largest magnitude lands in
            the top binade below half the format's maximum (at most the largest power of
            two its dtype holds), round, and scale back (element formats: a block format
            scales each block itself).
        store_codes: between a step and the next :meth:`zero_grad` (or
            :meth:`materialize`), keep the selected weights only as codes of ``fmt``
            (uint8 for formats of up to 8 bits; a ``fewbit.block.BlockTensor`` per weight
            for a block format) and free their float storage. In that window a read of
            a weight (a forward, a checkpoint, a print, a load) first decodes them all,
            as :meth:`materialize` does; its metadata, gradient and optimizer state
            are read without. Compiled code that reads them compiles again each time
            (it warns). FSDP2's forward reads its shards' storage without asking the
            weights: while DTensor weights are held, any module's forward decodes first
            (a global forward pre-hook, removed by :meth:`materialize`). A weight whose
            storage another tensor shares at a step (its ``.data``, ``.detach()`` or
            ``state_dict()`` entry taken before and still held, a graph kept for a
            second backward) stays floats for that step, with a warning: freeing it
            would crash a read of that tensor (for a DTensor's piece: more tensors than
            shared it when it was selected, FSDP2's own, so a state dict taken before the
            wrapper was built and held past a step is freed under its holder: build the
            wrapper first, or drop it). A weight whose storage holds
            more than it (a flat buffer) is refused; one whose storage cannot be resized
            (``torch.load``'s) and that nothing else holds is given a copy of its own.
            The rounding at construction keeps them as floats.
        policy: under data parallelism the write-back is ``"identical"`` on every
            replica (seed 000); ``"differing"`` folds in the rank (wrong: for tests).
        guard: before each step, check across ranks that every selected weight and its
            gradient agree (the invariant identical rounding needs); raise
            ``fewbit.replicas.ReplicaDriftError`` naming the first that does not. Sharded
            weights are compared between the ranks that hold the same piece (HSDP's
            replicas); under pure sharding no two do, and guard=True is refused (the ranks
            are asked: a collective at construction).
        guard_group: the ranks the guard compares, a ``torch.distributed`` process group
            (None: the whole world). Under pipeline parallelism each stage holds other
            weights: give the stage's data-parallel group.
        first_index: the place of the first selected weight in the keys (default 0).
            Every wrapper counts its weights from it, so two wrappers with one seed round
            their weights alike from 0: a pipeline stage gives the number of weights the
            earlier stages select, and its weights then draw the bits they would in one
            wrapper of the whole model.

    Parameters may be DTensors (FSDP2's ``fully_shard``, HSDP, any Shard/Replicate
    placement, uneven shards): each rank rounds its own piece with the bits of the
    elements' indices in the full tensor, so the full weights are those one process
    would hold; ``store_codes`` keeps codes of the local piece only, and ``scale`` takes
    the largest magnitude of the full tensor. A block format needs whole blocks on every
    rank (the cuts along the block axis on multiples of the block size, as Shard(0) of
    blocks along the last dimension gives; other layouts are refused at construction, on
    every rank alike); NVFP4's per-tensor scale is the full tensor's (a collective a step
    finds every weight's largest magnitude).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        fmt: FloatFormat | str,
        mode: RoundMode | str = "src",
        bits: int | None = 3,
        seed: int | Key = 0,
        params: Iterable | None = None,
        *,
        fraction: float | None = None,
        sat: bool = True,
        update_dtype: torch.dtype | None = None,
        scale: bool = False,
        store_codes: bool = False,
        policy: SeedPolicy | str = SeedPolicy.IDENTICAL,
        guard: bool = False,
        guard_group: torch.distributed.ProcessGroup | None = None,
        first_index: int = 0,
    ):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
        scale, store_codes, guard = (as_flag(scale, "scale"), as_flag(store_codes, "store_codes"),
                                     as_flag(guard, "guard"))
        self.optimizer = optimizer
        self.fmt = element_or_block(fmt)
        block = isinstance(self.fmt, BlockFormat)
        self._format_name()  # one made by hand under another format's name: refused, as ops refuse it
        self.mode = parse_mode(mode)
        sat, bits, fraction = scalar_args(sat, bits, fraction)  # Python scalars: a checkpoint loads plainly
        check_bits(bits)
        self.bits = bits if self.mode.takes_bits else None
        self.fraction = fraction
        self.sat = sat
        self.key = as_key(seed)
        self.first_index = check_index(first_index, "first_index")
        if update_dtype is not None and update_dtype not in _UPDATE_DTYPES:
            raise TypeError(f"update_dtype must be one of {_UPDATE_DTYPES}, not {update_dtype}")
        self.update_dtype = update_dtype
        self.scale = scale
        self.store_codes = store_codes
        self.policy = SeedPolicy(policy)
        if guard_group is not None and not guard:
            raise ValueError("guard_group is the ranks guard=True compares: give guard=True with it")
        check_group(guard_group, "guard_group")
        self.guard = guard
        self.guard_group = guard_group
        self.names, self.params = self._select(params)
        if not self.params:
            raise ValueError("no parameters selected: pass params=")
        self._check(self.names, self.params)
        # The ranks say whether any two hold the same piece, as the guard will ask them: a copy
        # may lie outside a weight's own mesh (TP on each row of a (dp, tp) mesh), and every
        # rank must take the same way past this collective. (First: it is over the world or
        # guard_group, which every rank knows, where a rank whose weights are unlike the
        # others' knows no mesh of theirs for the collectives below.)
        named = list(zip(self.names, self.params, strict=True))
        unchecked = guard and world(guard_group)[1] > 1 and check_in_sync(named, guard_group).unchecked
        if unchecked and len(unchecked) == len(named):
            raise ValueError("guard=True has nothing to compare: every selected weight is sharded and "
                             "no two ranks hold the same piece (FSDP without replication); use HSDP "
                             "or drop guard")  # fmt: skip
        #: Where each rank's piece of each parameter lies in the full tensor.
        self._layouts = self._place(self.names, self.params)
        self._agree(self.params)  # (before the write-back's collectives)
        #: The dtype ``w + u`` is rounded from.
        self.via = update_dtype or self.params[0].dtype
        #: The selected weights' dtype and device (one of each: ``_check``).
        self._selected_as = (self.params[0].dtype, self.params[0].device)
        self.spec = check_args(self.via, self.fmt, self.mode, sat, self.bits, fraction)
        if block and scale:
            raise ValueError(f"scale=True is for element formats: {self.fmt.name} scales each block itself")
        if not block and not self.fmt.signed:  # (a choice of the user's, but rarely one meant for weights)
            try:
                value = round_to(torch.tensor(-1.0), self.fmt, sat=self.sat).item()
                there = f"takes a negative weight such as -1 to {value}"
            except ValueError:  # (no NaN, under sat=False: -1 has no result; weights >= 0 do)
                there = "raises for a negative weight (no result in it under sat=False)"
            warnings.warn(f"{self.fmt.name} is unsigned: every write-back {there}; weights that change "
                          "sign take a signed format", stacklevel=2)  # fmt: skip
        if self.store_codes and block:
            check_storable(self.fmt)
        if self.store_codes and not block and self.fmt.k > 8:
            raise ValueError(f"store_codes keeps uint8 codes; {self.fmt.name} has {self.fmt.k} bits")
        self._codes: list[torch.Tensor] | list[BlockTensor] | None = None
        self._nbytes: list[int] = []  # storage sizes of the weights kept as codes
        self._scales: list[float] = [1.0] * len(self.params)
        self._holders = [self._usual_holders(p) for p in self.params]
        self._stored = False  # weights held only as codes
        self._before_forward: RemovableHandle | None = None  # its global hook, while held
        self.steps = 0
        # Algorithm 1 starts from rounded initial weights; kept as floats, since a model is
        # often loaded from a checkpoint or run forward before the first step.
        self._write_back(initial=True)
        #: Whether the inner optimizer steps from here (``step``; torch's state-filling step
        #: in ``state_dict``): one that does not skipped the rounding (``_stepped_alone``).
        self._stepping = False
        self._watch_inner_steps()  # (last: a refused wrapper leaves none)

    def __repr__(self) -> str:
        # The set-up and the inner optimizer's own repr (its groups), as print(optimizer)
        # shows for torch's; no weight is read, so weights held as codes stay so.
        shown = {"bits": self.bits, "fraction": self.fraction, "sat": None if self.sat else False,
                 "update_dtype": self.update_dtype, "scale": self.scale or None,
                 "store_codes": self.store_codes or None,
                 "policy": None if self.policy is SeedPolicy.IDENTICAL else self.policy.value,
                 "guard": self.guard or None, "first_index": self.first_index or None}  # fmt: skip
        options = "".join(f", {k}={v}" for k, v in shown.items() if v is not None)
        return (f"LowPrecisionWeights({self.fmt.name}, {self.mode.value}{options}, "
                f"weights={len(self.params)}, steps={self.steps}) of {self.optimizer!r}")

    def __deepcopy__(self, memo: dict) -> LowPrecisionWeights:
        # A process group is a handle on the ranks' communicators (and cannot be copied):
        # a copy of the wrapper shares it.
        memo[id(self.guard_group)] = self.guard_group
        copied = memo[id(self)] = type(self).__new__(type(self))
        copied.__setstate__(copy.deepcopy(self.__dict__, memo))
        return copied

    def __setstate__(self, state: dict) -> None:
        # (copy.deepcopy, pickle: torch's Optimizer drops its hooks on the way)
        self.__dict__.update(state)
        self._watch_inner_steps()

    def _watch_inner_steps(self) -> None:
        """Hook the inner optimizer's steps (``_stepped_alone``) through a weak reference:
        the optimizer outlives a wrapper rebuilt around it, and a hook holding the old
        wrapper kept it alive and warned at every step of the new one."""
        wrapper = weakref.ref(self)

        def stepped(optimizer, args, kwargs) -> None:
            if (alive := wrapper()) is not None:
                alive._stepped_alone()

        weakref.finalize(self, self.optimizer.register_step_post_hook(stepped).remove)

    @contextlib.contextmanager
    def _inner_step(self):
        """Mark the inner optimizer's steps in this block as this wrapper's own."""
        self._stepping = True
        try:
            yield
        finally:
            self._stepping = False

    def _stepped_alone(self) -> None:
        # GradScaler given opt.optimizer steps it alone: the weights leave the format silently.
        if not self._stepping:
            warnings.warn(f"the optimizer LowPrecisionWeights wraps stepped alone (GradScaler's "
                          f"scaler.step(opt.optimizer), say): the weights were not rounded to "
                          f"{self.fmt.name}; step the wrapper", RuntimeWarning, stacklevel=4)  # fmt: skip

    def _owned(self) -> list[torch.Tensor]:
        """The optimizer's parameters, in its order."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _select(self, params, owned: list[torch.Tensor] | None = None,
                start: int = 0) -> tuple[list[str], list[torch.Tensor]]:  # fmt: skip
        """``params`` named, checked to be among ``owned`` (the optimizer's parameters,
        the first of them number ``start``); None: those of two or more dimensions."""
        owned = self._owned() if owned is None else owned
        place = {id(p): start + i for i, p in enumerate(owned)}  # its place among the optimizer's
        if params is None:
            chosen = [(f"param {place[id(p)]}", p) for p in owned if p.dim() >= 2]
        else:
            # Iterated, a tensor gives rows, a dict names, a set an order of its own each run
            # (and the order gives each weight its key).
            if isinstance(params, (torch.Tensor, Mapping, torch.nn.ParameterDict, set, frozenset)):
                raise TypeError(f"params must be a list of tensors or of (name, tensor) pairs, not a "
                                f"{type(params).__name__} (named_parameters() gives pairs)")  # fmt: skip
            chosen = []
            for i, item in enumerate(params):
                name, p = item if isinstance(item, tuple) else (None, item)
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"params[{i}] is a {type(p).__name__}: give tensors or (name, tensor) "
                                    "pairs")  # fmt: skip
                if id(p) not in place:
                    raise ValueError(f"{name or f'params[{i}]'} is not among the optimizer's parameters")
                chosen.append((name or f"param {place[id(p)]}", p))
        seen = set()
        for name, p in chosen:  # rounded twice a step, with two keys, it would be neither
            if id(p) in seen:
                raise ValueError(f"{name} is selected twice: select each weight once")
            seen.add(id(p))
        return [n for n, _ in chosen], [p for _, p in chosen]

    def _check(self, names: list[str], params: list[torch.Tensor]) -> None:
        """Refuse parameters the write-back cannot hold: a piece without whole blocks, a
        dtype without every value of the format, or a mix of dtypes or devices (among
        them and the parameters already selected). Alike on every rank; :meth:`_place`
        refuses what only one rank sees."""
        for name, p in zip(names, params, strict=True):
            if not is_plain(local_tensor(p)):  # (a ScaledTensor's ops refused the rounding's, deep inside)
                raise TypeError(f"LowPrecisionWeights rounds plain weights (or DTensors of them); {name} "
                                f"is a {type(local_tensor(p)).__name__}: a scalify'd model's weights round "
                                "by fewbit.scaled.cast")  # fmt: skip
            if isinstance(self.fmt, BlockFormat):
                check_block_axis(p, self.fmt.axis, name)
            # A block's scale needs all its elements: a piece must hold whole blocks.
            check_whole_blocks(p, self.fmt, name=name)
            for dtype in {p.dtype, self.update_dtype or p.dtype}:
                check_holds(dtype, self.fmt, name if dtype == p.dtype else f"{name}'s update (update_dtype)")
        # Every selected parameter shares one dtype: the write-back rounds them together.
        every = [*self.params, *params]
        dtypes = {p.dtype for p in every} | {p.device for p in every}  # (cuda:0 and cuda:1 differ)
        if len(dtypes) > 2:
            raise ValueError(f"selected parameters mix dtypes or devices ({sorted(map(str, dtypes))}): "
                             "wrap each group in its own LowPrecisionWeights")  # fmt: skip
        if self.store_codes:
            self._check_own_storage([*zip(self.names, self.params, strict=True),
                                     *zip(names, params, strict=True)])  # fmt: skip

    def _place(self, names: list[str], params: list[torch.Tensor]) -> list[ShardLayout]:
        """Where each rank's piece of each of ``params`` lies in the full tensor. A piece not
        where its placements say is seen by its rank alone (``layout`` raises there), and so
        is a NaN that fmt has no value for (a block format holds it in the scale): both are
        refused here, before any weight is rounded, on every rank of the mesh (one
        all-reduce, once). Before, a misplaced piece's rank raised alone, and the others
        waited for it in the write-back's collectives or took its next one for theirs."""
        layouts, error = [], None
        for name, p in zip(names, params, strict=True):
            try:
                layouts.append(layout(p))
            except RuntimeError as err:
                error = RuntimeError(f"{name}: {err}")
                break
        if error is None and not isinstance(self.fmt, BlockFormat) and not self.fmt.has_nans:
            nan = next((name for name, p in zip(names, params, strict=True)
                        if bool(local_tensor(p).isnan().any())), None)  # fmt: skip
            error = None if nan is None else ValueError(f"{nan} holds a NaN, which {self.fmt.name} has no "
                                                        "value for")  # fmt: skip
        refuse_alike(error, params, f"another rank's piece of a selected weight holds a NaN that "
                                    f"{self.fmt.name} has no value for, or is not where its placements say "
                                    "(see its error)")  # fmt: skip
        return layouts

    def _agree(self, params: list[torch.Tensor]) -> None:
        """Refuse, on every rank, a set-up that differs between the ranks holding pieces of
        the sharded weights among ``params`` (one all-reduce per mesh dimension, once).
        Each rank rounds its piece as its own set-up says, so the full weights were no one
        set-up's (another seed, silently), and the collectives of the write-back that some
        set-ups take (NVFP4's or scale=True's largest magnitude, the flag of a format
        without NaN) and others not paired with the next collective of the others: a
        user's all-reduce summed a largest magnitude in. Plain weights (DDP, pipeline
        stages, whose weights differ by design) are not compared: ``guard=True`` is."""
        mine = _plain(self._config())
        digest = int.from_bytes(hashlib.blake2b(repr(mine).encode(), digest_size=8).digest(), "little") >> 2
        if differs_across_holders(digest, params):
            said = ", ".join(f"{k}={v!r}" for k, v in mine.items() if k not in ("params", "dtypes"))
            raise ValueError(f"LowPrecisionWeights: ranks holding pieces of the same weights were given "
                             f"different set-ups or selections; every rank must wrap its pieces alike. This "
                             f"rank's: {said}, {len(mine['params'])} weights")  # fmt: skip

    @staticmethod
    def _check_own_storage(named: list[tuple[str, torch.Tensor]]) -> None:
        """store_codes frees each weight's whole storage: refuse one whose storage holds more
        than it (a flat buffer of several parameters, another weight). A DTensor's piece is
        exempt: FSDP2 pads each shard in a storage of its own."""
        first = {}  # data pointer -> the name of the first weight seen on it
        for name, p in {id(p): (name, p) for name, p in named}.values():
            if is_dtensor(p) or not p.numel():
                continue
            storage = p.untyped_storage()
            shared = first.setdefault(storage.data_ptr(), name) != name
            if shared or storage.nbytes() > p.numel() * p.element_size():
                raise ValueError(f"store_codes frees each selected weight's storage, and {name}'s holds more "
                                 "than it (a flat buffer, or another weight): give it storage of its own, "
                                 "or pass store_codes=False")  # fmt: skip

    @staticmethod
    def _own_storage(params: list[torch.Tensor]) -> None:
        """store_codes frees a weight's storage by resizing it: a weight whose storage cannot
        be resized (``torch.load``'s, mmap'd, a wrapper's loaded with it) and that nothing
        else holds is given a copy of its own, which can (else it would stay floats)."""
        for p in params:
            if not is_dtensor(p) and p.numel() and not p.untyped_storage().resizable() and (
                    _storage_holders(p) == 1):
                p.data = p.detach().clone()

    def add_param_group(self, group: dict, params: Iterable | None = None) -> None:
        """The inner optimizer's ``add_param_group``, with the group's ``params`` (as
        ``__init__`` takes them; default: those of two or more dimensions) kept in ``fmt``
        from now on: checked before the group is added, rounded at once (key
        ``fold_in(seed, t, i)`` at step count t, i their places after the weights
        selected before, from ``first_index``), then written back every step as the others."""
        self.materialize()
        added = group["params"]
        if isinstance(added, set):  # torch refuses one too, but after list() below it could not
            raise TypeError("a group's params must be an ordered collection: a set's order changes "
                            "between runs, and the order decides each weight's bits; use a list")
        group["params"] = added = [added] if isinstance(added, torch.Tensor) else list(added)
        names, chosen = self._select(params, owned=added, start=len(self._owned()))
        self._check(names, chosen)
        layouts = self._place(names, chosen)
        self.optimizer.add_param_group(group)
        first = len(self.params)
        self.names += names
        self.params += chosen
        self._layouts += layouts
        self._scales += [1.0] * len(chosen)
        self._holders += [self._usual_holders(p) for p in chosen]
        try:
            self._agree(chosen)
            self._write_back(initial=True, only=range(first, len(self.params)))
        except BaseException:  # (a weight beyond the range under sat=False: the weights are as they were)
            self.optimizer.param_groups.pop()
            for added_to in (self.names, self.params, self._layouts, self._scales, self._holders):
                del added_to[first:]
            raise

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        """The inner optimizer's per-parameter state (AdamW's moments, say)."""
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's zero_grad; restores weights kept as codes first."""
        self.materialize()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """The inner step (``w + u``), then every selected weight rounded to ``fmt``. (Not
        under no_grad: a closure computes a loss, and torch's optimizers set grad mode
        themselves; the rounding has its own no_grad.)"""
        self._check_unchanged()
        self.materialize()
        if self.guard:
            assert_identical_inputs(
                [(f"{name}{part}", t) for name, p in zip(self.names, self.params, strict=True)
                 for part, t in (("", p), (".grad", p.grad)) if t is not None], self.guard_group
            )  # fmt: skip
        with self._inner_step():
            loss = self.optimizer.step(closure)
        self.steps += 1
        if kept := self._write_back(initial=False):
            warnings.warn(f"store_codes kept {', '.join(kept)} as floats this step: another tensor shares "
                          "its storage (its .data, .detach() or a state_dict() entry taken before the step, "
                          "a graph kept for another backward, a numpy array of it), and freeing it would "
                          "crash a read of that tensor; drop that tensor or clone it",
                          stacklevel=3)  # fmt: skip
        return loss

    def _check_unchanged(self) -> None:
        """Refuse a step on weights cast or moved since they were selected (``model.half()``
        after wrapping): the rounding would go through the dtype chosen for the old ones
        (inf where float16 cannot hold a format's value), and nothing would say so."""
        dtype, device = self._selected_as
        for p in self.params:  # (a loop that stops at the first: a set of every pair took 5 us a step)
            if p.dtype is not dtype or p.device != device:
                break
        else:
            return
        now = {(p.dtype, p.device) for p in self.params}
        was, are = (" and ".join(sorted(f"{d} on {where}" for d, where in kinds))
                    for kinds in ({self._selected_as}, now))  # fmt: skip
        raise RuntimeError(f"the selected weights were {was} when LowPrecisionWeights was built, and are "
                           f"{are} now: build it after the model's .to()/.half()")  # fmt: skip

    # A user's torch.compile of step() compiles the inner optimizer's update; the write-back
    # stays fewbit's own call (its compiled kernel, as eager), not traced into their graph.
    @torch.compiler.disable
    @torch.no_grad()
    def _write_back(self, initial: bool, only: range | None = None) -> list[str]:
        """Round the weights; the names of those store_codes kept as floats (``_round_all``)."""
        # After a step, a parameter without a gradient is left as it is, as the inner
        # optimizer leaves it: rounding it again would move it where rounding is not a
        # fixed point on the format's values (HBFP's, NVFP4's), and costs a pass (frozen
        # weights). At construction every one is rounded (added ones: ``only`` those),
        # and kept as floats.
        live = [i for i, p in enumerate(self.params) if initial or p.grad is not None]
        live = live if only is None else [i for i in live if i in only]
        store = self.store_codes and not initial
        if not self.spec.may_refuse:
            return self._round_all(live, store)
        # A value may have no result in fmt (a NaN, or under sat=False one beyond a format
        # without Inf or NaN): where one rank's piece of a sharded weight holds it, every
        # rank raises. At selection (where NaNs were refused before) the weights are then
        # put back as they were; after a step the write-back stops part way (README).
        saved = [local_tensor(self.params[i]).clone() for i in live] if initial and not self.sat else []
        try:
            try:
                kept, error = self._round_all(live, store), None
            except ValueError as err:
                kept, error = [], err
            then = ("every selected weight is as it was" if saved else
                    "that rank's write-back stopped part way; restore from a checkpoint")
            refuse_alike(error, self.params, f"another rank's piece of a weight holds a value without a "
                                             f"result in {self.fmt.name} (see its error): {then}")
        except ValueError:
            if saved:
                torch._foreach_copy_([local_tensor(self.params[i]) for i in live], saved)
            raise
        return kept

    @staticmethod
    def _usual_holders(p: torch.Tensor) -> int | None:
        """The owners of p's storage (of its piece's) when nobody else holds it: p alone,
        or a DTensor's piece and what its parallelism keeps (FSDP2 its padded shard), as
        found when p is selected."""
        return _storage_holders(local_tensor(p)) if is_dtensor(p) else 1

    def _round_all(self, live: list[int], store: bool) -> list[str]:
        """Round the weights of ``live`` (keep them as codes where ``store``, but for those
        whose storage another tensor shares: freeing it would crash a read of that tensor;
        their names are returned)."""
        if not live:  # no selected weight has a gradient this step (torch's foreach ops refuse [])
            return []
        if store:
            self._own_storage([self.params[i] for i in live])
        pieces = [local_tensor(p) for p in self.params]  # a DTensor's piece shares its storage
        # (A storage a numpy array was made from cannot be resized: it is held too.)
        shared = [i for i in live if not pieces[i].untyped_storage().resizable() or (
            (n := _storage_holders(pieces[i])) is not None and n > self._holders[i])] if store else []
        stored = [i for i in live if i not in shared] if store else []
        kept = [self.names[i] for i in shared]
        if not self.scale:
            self._round_pieces(live, stored, pieces)
            return kept
        # Powers of two: exact both ways. Codes keep the scaled values (materialize divides).
        self._scales = [1.0] * len(pieces)
        for i in live:
            self._scales[i] = self._power_of_two_scale(self.params[i])
        scaled, scales = [pieces[i] for i in live], [self._scales[i] for i in live]
        torch._foreach_mul_(scaled, scales)
        try:
            self._round_pieces(live, stored, pieces)
        except BaseException:  # a write-back that stops leaves no weight scaled
            torch._foreach_div_(scaled, scales)
            raise
        if floats := [i for i in live if i not in stored]:
            torch._foreach_div_([pieces[i] for i in floats], [self._scales[i] for i in floats])
        return kept

    def _round_pieces(self, live: list[int], stored: list[int], pieces: list[torch.Tensor]) -> None:
        """Round the weights of ``live``; keep those of ``stored`` as codes and free them."""
        place = range(self.first_index, self.first_index + len(self.params))  # weight i's in the keys
        # Weight i draws with fold_in(key, t, i) at step t. Whole tensors in formats with a
        # NaN, under the identical policy (no rank to fold in), go through round_foreach_,
        # which derives each key in its kernel (kept as codes: one fewbit.quantize each,
        # which rounds and encodes in one pass); a piece of a sharded tensor takes the bits
        # of its global indices; fewbit.round raises where a value has no result in a
        # format without NaN (a NaN input, say).
        block = isinstance(self.fmt, BlockFormat)
        batched = []
        if not block and self.fmt.has_nans and self.policy is SeedPolicy.IDENTICAL:
            batched = [i for i in live if self._layouts[i].whole]
        in_batch, in_codes = set(batched), set(stored)
        coded, others = [i for i in batched if i in in_codes], [i for i in live if i not in in_batch]
        # fold_in(key, t, i) is fold_in(fold_in(key, t), i): the step's key, derived once, where
        # a weight needs it here (6 us in Python ints: not for round_foreach_ alone).
        stochastic = self.mode.is_stochastic
        step_key = fold_in(self.key, self.steps) if stochastic and (coded or others) else None
        if floats := [i for i in batched if i not in in_codes]:  # (a GPU's one launch asks no threshold)
            key, places = self.key if stochastic else None, [place[i] for i in floats]
            round_foreach_([pieces[i] for i in floats], self.spec, key, self.steps, places, self.via)
        if not (coded or others):  # (then nothing is stored: a stored weight is coded or another)
            return
        # The weights rounded (and encoded) a call each compile from COMPILE_FROM elements on,
        # as round_foreach_'s do; where it takes every weight, the 3 us of setting that
        # threshold are not paid.
        codes = {}
        with write_back_threshold():
            for i in coded:  # straight to codes, a pass each
                kw = {"sat": self.sat, "bits": self.bits, "fraction": self.fraction}
                if step_key is not None:
                    kw["seed"] = fold_in(step_key, place[i])
                codes[i] = codec.quantize(pieces[i].to(self.via), self.fmt, self.mode, **kw)
            if block:  # the full tensors'
                scales = tensor_scales([self.params[i] for i in live], self.fmt, self.via, self.spec.rule)
                tensor_scale = dict(zip(live, scales, strict=True))
            for i in others:
                t, at = pieces[i], self._layouts[i]
                key = None if step_key is None else replica_key(fold_in(step_key, place[i]), self.policy)
                x = t.to(self.via)
                store = i in in_codes
                if store and not block:  # the codes in the pass that rounds: t is freed below
                    codes_now = quantize_range(x, self.spec, key, at, packed=False)
                    if codes_now is not None:
                        codes[i] = codes_now
                        continue
                ts = tensor_scale[i] if block else None
                # In place into x: t itself, or t.to(via), this call's own (a new tensor of the
                # weight's size beside it doubled the step's peak). Not into codes kept.
                done = None if block and store else round_range(x, self.spec, key, at, tensor_scale=ts,
                                                                in_place=True)  # fmt: skip
                if done is not None:  # runs of the full tensor: its bits drawn inside the kernel
                    if done is not t:
                        t.copy_(done)
                    continue
                random = piece_randomness(self.spec, key, at, t.device)
                if not block:
                    sr = {"bits": self.bits, "fraction": self.fraction, **random} if random else {}
                    t.copy_(round_to(x, self.fmt, self.mode, sat=self.sat, **sr))
                    continue
                axis = self.fmt.axis % x.dim()
                drawn = {"key": random.get("seed"), "random_bits": random.get("random_bits")}
                result = with_tensor_scale(x, self.spec, axis, ts, **drawn, fused=not store)
                if store:  # the codes of this very rounding (NVFP4's per-tensor
                    # scale would move if the rounded values were quantised again)
                    codes[i] = BlockTensor(*result, ts, self.fmt, x.shape, axis)
                else:
                    t.copy_(result[0])
            if stored:
                # The rest: values of fmt, rounded just now (unchecked: a GPU step waits for nothing).
                for i in stored:
                    if i not in codes:
                        codes[i] = codec.encode(pieces[i], self.fmt, check=False)
                self._codes = [codes.get(i) for i in range(len(pieces))]  # (None: left as it is, in floats)
                # The size of the whole storage: a piece may be a view into a larger one (FSDP2
                # pads its shards), which must come back at its size.
                self._nbytes = [t.untyped_storage().nbytes() for t in pieces]
                for i in stored:
                    pieces[i].untyped_storage().resize_(0)
                    p = self.params[i]  # until materialize(): a read decodes first
                    p._fewbit_codes_of = self  # (held by the weight: its codes live as long)
                    p.__class__ = _held_class(type(p))
                self._stored = True
                if any(is_dtensor(self.params[i]) for i in stored):
                    # FSDP2's forward all-gathers from its shards' storage without asking the
                    # weights: any module's forward decodes first (a global hook, for the window).
                    self._before_forward = register_module_forward_pre_hook(lambda *_: self.materialize())

    def _power_of_two_scale(self, w: torch.Tensor) -> float:
        amax = global_amax(w)
        if amax == 0.0 or not math.isfinite(amax):
            return 1.0
        # At most the largest power of two w's dtype holds: w is scaled in place (a float16
        # weight of largest magnitude 2^-9 into E4M3 would take 2^16, inf in float16).
        exponent = min(math.floor(math.log2(self.fmt.max / 2 / amax)), dtype_format(w.dtype).emax)
        return 2.0**exponent

    def materialize(self) -> None:
        """Decode weights kept as codes back into the parameters (no-op otherwise)."""
        # Asked here first: every step and zero_grad calls this, most with nothing kept, and
        # the decorators below cost 3 us. Traced (a user's compiled step), decided as it runs:
        # is_compiling first, so that Dynamo never reads the flag (a guard on it compiled the
        # step again once weights were kept as codes).
        if torch.compiler.is_compiling() or self._stored:
            self._decode()

    @torch.compiler.disable
    @torch.no_grad()
    def _decode(self) -> None:
        if not self._stored:
            return
        if self._before_forward is not None:
            self._before_forward.remove()
            self._before_forward = None
        for p, codes, s, nbytes in zip(self.params, self._codes, self._scales, self._nbytes, strict=True):
            if codes is None:  # left as it was at the step: never freed
                continue
            p.__class__ = type(p).plain
            del p._fewbit_codes_of
            t = local_tensor(p)
            if t.untyped_storage().nbytes():  # given other storage meanwhile (set_): the user's
                continue
            t.untyped_storage().resize_(nbytes)
            if isinstance(codes, BlockTensor):  # as fewbit.block.round gives the values in via
                t.copy_(codes.dequantize(self.via))
            else:
                values = codec.decode(codes, self.fmt, t.dtype)
                t.copy_(values if s == 1.0 else values / s)  # (a power of two: exact)
        self._codes = None  # (kept, they took a quarter of float32 weights' bytes more at the peak)
        self._stored = False

    def memory(self) -> dict[str, int]:
        """Bytes this rank's pieces of the selected weights take as floats and as codes of
        ``fmt`` (a block format's: element codes, block scales and any per-tensor scale,
        BlockTensor.nbytes)."""
        n = sum(at.numel for at in self._layouts)
        float_bytes = sum(at.numel * p.element_size()
                          for at, p in zip(self._layouts, self.params, strict=True))  # fmt: skip
        if isinstance(self.fmt, BlockFormat):  # the pieces' shapes alone: quantised on the meta device
            shapes = [torch.empty(at.local_shape, dtype=self.via, device="meta") for at in self._layouts]
            code_bytes = sum(quantize(t, self.fmt).nbytes for t in shapes)
        else:
            code_bytes = n * (1 << (math.ceil(self.fmt.k / 8) - 1).bit_length())  # 1, 2, 4 or 8 a code
        return {"elements": n, "float_bytes": float_bytes, "code_bytes": code_bytes,
                "saved_bytes": float_bytes - code_bytes}  # fmt: skip

    def _format_name(self) -> str:
        """The format as ops name it: a registered format's name, else its repr, every field
        (a checkpoint of one made by hand resumes only into the same one)."""
        return (block_format_name if isinstance(self.fmt, BlockFormat) else format_name)(self.fmt)

    def _config(self) -> dict:
        # The selection too: step t rounds parameter i with fold_in(key, t, i), so which
        # parameters, in which order, decides the bits as the seed does (each by its
        # place among the optimizer's parameters, and its full shape).
        owned = {id(p): i for i, p in enumerate(self._owned())}
        selected = [(owned[id(p)], *p.shape) for p in self.params]
        return {"fmt": self._format_name(), "mode": self.mode.value, "bits": self.bits,
                "fraction": self.fraction, "sat": self.sat, "key": (self.key.k0, self.key.k1),
                "scale": self.scale, "update_dtype": str(self.update_dtype), "policy": self.policy.value,
                "params": selected, "dtypes": [str(p.dtype) for p in self.params],
                "first_index": self.first_index}  # fmt: skip

    def state_dict(self, model: torch.nn.Module | None = None) -> dict:
        """The inner optimizer's state, the step count and the rounding set-up.

        With ``model`` (sharded training), the inner state is torch's
        ``get_optimizer_state_dict(model, optimizer)``: keyed by parameter names, sharded
        state as DTensors, so ``torch.distributed.checkpoint`` saves it and loads it on
        another number of ranks. Before the first step torch fills the state for it by an
        inner step at learning rate 0 (AdamW's count becomes 1, so a run resumed from it
        counts from 1, as torch's own resumes do); the live optimizer is left as it was, so
        taking the checkpoint does not change the run.
        """
        if model is None:
            inner = self.optimizer.state_dict()
        else:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            self.materialize()  # torch may take an inner step, which reads the weights
            fresh = not self.optimizer.state
            with self._inner_step():  # (torch fills a fresh state by a step at learning rate 0)
                inner = get_optimizer_state_dict(model, self.optimizer)
            if fresh:  # the checkpoint keeps the state torch made; the optimizer drops it
                self.optimizer.state.clear()
        return {"optimizer": inner, "steps": self.steps, "config": self._config()}

    def load_state_dict(self, state: dict, model: torch.nn.Module | None = None) -> None:
        """Resume: the next step draws the bits an uninterrupted run would. Pass the
        ``model`` that :meth:`state_dict` was given."""
        error = self._unlike(state)
        # A checkpoint read by each rank from its own file can be unlike on one rank, or no
        # checkpoint there (another file): every rank of a sharded weight's mesh refuses it (one
        # all-reduce a load), where that rank alone raised and the others resumed, at another
        # step count, into the next collective (or waited in this all-reduce).
        refuse_alike(error, self.params, "another rank's checkpoint was written with another set-up (see its "
                                         "error): nothing was loaded")  # fmt: skip
        steps = int(state["steps"])
        if model is None:
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            with self._inner_step():
                set_optimizer_state_dict(model, self.optimizer, state["optimizer"])
        self.steps = steps

    def _unlike(self, state: object) -> ValueError | None:
        """Why ``state`` is not a checkpoint this wrapper continues (not a state_dict, or
        written with another set-up), or None: this rank's alone, which
        :meth:`load_state_dict` raises on every rank."""
        if (not isinstance(state, dict) or not {"optimizer", "steps", "config"} <= state.keys()
                or not isinstance(state["config"], dict)):  # fmt: skip
            return ValueError("not a LowPrecisionWeights.state_dict() (it has 'optimizer', 'steps' and "
                              "'config'): a torch optimizer's state goes to opt.optimizer.load_state_dict")
        mine = _plain(self._config())
        # What older checkpoints lack goes unchecked, and so does a format made by hand that
        # they named by its name alone; but their keys all counted the weights from 0.
        lacked = {"params": mine["params"], "dtypes": mine["dtypes"], "first_index": 0}
        saved = _plain({**lacked, **state["config"]})
        if saved.get("fmt") == self.fmt.name:  # (one without "fmt" differs: KeyError on its rank alone)
            saved["fmt"] = mine["fmt"]
        differ = [f"{k} {saved.get(k)!r} (here {mine.get(k)!r})"
                  for k in {**saved, **mine} if saved.get(k) != mine.get(k)]  # fmt: skip
        said = f"checkpoint was written with {'; '.join(differ)}: its bits would not continue"
        return ValueError(said) if differ else None


def _plain(config: dict) -> dict:
    """A configuration with tuples as lists: a checkpoint format may store either."""
    return {k: _plain_value(v) for k, v in config.items()}


def _plain_value(value):
    return [_plain_value(v) for v in value] if isinstance(value, tuple | list) else value
