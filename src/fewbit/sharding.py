"""Sharded tensors (DTensor: FSDP2, HSDP, tensor parallelism): where a rank's piece sits
in the full tensor, and the random bits of that piece.

fewbit's random bits are a pure function of (key, element index). Under sharding each
rank holds a piece of a tensor (``DTensor.to_local()``); it draws the bits of its
elements' *global* indices, so a rounding gives the same full tensor on any number of
ranks and for any placement. This module finds those indices from the DTensor's mesh,
placements and shape, and supplies the exact gradient reduction FSDP2 needs for the
rest of a training step to be independent of the sharding too
(:class:`PairwiseReduceScatter`).

Nothing here imports ``torch.distributed.tensor`` unless a DTensor exists: a tensor can
only be one if that module was imported.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .block import BlockFormat
from .block.kernel import BlockSpec, tensor_scale_of
from .block.ops import largest_finite
from .codec import code_dtype
from .operators import is_plain
from .random import Key, is_dtensor
from .rounding import gpu, native
from .rounding.checks import RoundSpec
from .rounding.compiled import index_bits, range_bits, stream_words
from .rounding.fast import float32_item

__all__ = [
    "PairwiseReduceScatter", "Runs", "ShardLayout", "check_cuts", "check_whole_blocks",
    "differs_across_holders", "global_amax", "global_bits", "is_dtensor", "layout", "local_tensor",
    "map_piece", "pairwise_sum", "piece_key",
    "piece_randomness", "placement_offsets", "quantize_range", "reduce_exactly", "refuse_alike",
    "replica_rank", "round_range", "sharded_by_mesh", "summed", "tensor_scales",
    "torch_offsets",
]  # fmt: skip


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The piece of ``t`` this rank holds (``to_local()``, which shares its storage: an
    in-place write changes the DTensor); ``t`` itself for a plain tensor."""
    return t.to_local() if is_dtensor(t) else t


class Runs(NamedTuple):
    """``count`` runs of ``length`` consecutive global indices, run r starting at
    ``start + r * stride``."""

    start: int
    count: int
    length: int
    stride: int

    @property
    def placed(self) -> dict[str, int]:
        """Where the kernels (``native``'s and ``gpu``'s ``*_into``) take the runs: their
        ``offset``, ``runs`` and ``stride`` arguments."""
        return {"offset": self.start, "runs": self.count, "stride": self.stride}


@dataclass(frozen=True)
class ShardLayout:
    """A rank's piece of a tensor: the block ``offset .. offset + local_shape`` of the full
    tensor of ``global_shape`` (row-major; element indices are those of the full tensor
    flattened)."""

    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    offset: tuple[int, ...]

    @functools.cached_property  # (asked of every weight at every write-back)
    def whole(self) -> bool:
        return self.local_shape == self.global_shape

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    def _strides(self) -> list[int]:
        strides, step = [], 1
        for size in reversed(self.global_shape):
            strides.append(step)
            step *= size
        return strides[::-1]

    def flat_bounds(self) -> tuple[int, int]:
        """The global indices of the piece's first and last element, plus one (the piece
        lies within them); ``(0, 0)`` when it is empty."""
        if self.numel == 0:
            return 0, 0
        strides = self._strides()
        first = sum(o * s for o, s in zip(self.offset, strides, strict=True))
        last = sum((o + n - 1) * s for o, n, s in zip(self.offset, self.local_shape, strides, strict=True))
        return first, last + 1

    def runs(self) -> Runs | None:
        """The piece as runs of consecutive global indices, equally long and spaced, where
        it is (one run for Shard(0) or a whole tensor, a run a row for Shard(1) of a
        matrix); None where it is not (a piece cut along two dimensions with more than
        one row across a third)."""
        return self._runs

    @functools.cached_property
    def _runs(self) -> Runs | None:  # (a layout is kept and asked again: see layout)
        if self.numel == 0:
            return Runs(0, 1, 0, 0)
        # The piece's dimensions as (size, stride in the full tensor), a size 1 dropped, and
        # a dimension merged into the one before it where the two are contiguous.
        dims: list[tuple[int, int]] = []
        for n, stride in zip(self.local_shape, self._strides(), strict=True):
            if n == 1:
                continue
            if dims and dims[-1][1] == n * stride:
                dims[-1] = (dims[-1][0] * n, stride)
            else:
                dims.append((n, stride))
        if not dims or dims[-1][1] != 1:  # runs of one element
            dims.append((1, 1))
        if len(dims) > 2:
            return None
        (count, stride), (length, _) = dims if len(dims) == 2 else ((1, 0), dims[0])
        return Runs(self.flat_bounds()[0], count, length, stride)

    def flat_start(self) -> int | None:
        """The global index of the first element when the piece is one contiguous range
        of the flattened full tensor (Shard(0), or a whole tensor), else None."""
        runs = self.runs()
        return runs.start if runs is not None and runs.count == 1 else None

    def flat_indices(self, device: torch.device | str | None = None) -> torch.Tensor:
        """int64 global index of every element of the piece, in its row-major order."""
        index = torch.zeros((), dtype=torch.int64, device=device)
        for d, (o, n, s) in enumerate(zip(self.offset, self.local_shape, self._strides(), strict=True)):
            shape = [1] * len(self.local_shape)
            shape[d] = n
            index = index + (torch.arange(o, o + n, dtype=torch.int64, device=device) * s).view(shape)
        return index.expand(self.local_shape).reshape(-1)


def placement_offsets(t) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Local shape and global offset of this rank's piece for Shard and Replicate (and
    Partial) placements, applied left to right over the mesh dimensions with
    ``torch.chunk``'s split (``ceil(size / n)`` per rank, the last ones short or empty),
    as DTensor documents for Shard."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    shape, offset = list(t.shape), [0] * t.dim()
    coordinate = t.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is outside the mesh: it holds nothing
        return tuple(0 for _ in shape), tuple(offset)
    for mesh_dim, placement in enumerate(t.placements):
        if isinstance(placement, Replicate | Partial):
            continue
        if type(placement) is not Shard:
            raise NotImplementedError(
                f"placement {placement} is not supported by this torch's fallback; "
                "fewbit places pieces for Shard, Replicate and Partial"
            )
        d, ranks, c = placement.dim, t.device_mesh.size(mesh_dim), coordinate[mesh_dim]
        chunk = -(-shape[d] // ranks)
        start = min(c * chunk, shape[d])
        offset[d] += start
        shape[d] = max(0, min(chunk, shape[d] - start))
    return tuple(shape), tuple(offset)


def torch_offsets(t) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """torch's own answer where this torch has it (a private function: it also places the
    strided shards that FSDP2 with tensor parallelism makes, by their first offset alone:
    :func:`_check_strided` first); None otherwise."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    except (ImportError, TypeError):  # moved, or called otherwise (tests/test_sharded.py says which)
        return None
    return tuple(shape), tuple(offset)


def _splits(placement, dim: int | None = None) -> bool:
    """Whether ``placement`` shards (dimension ``dim``, or any): a Shard, or a _StridedShard,
    which torch's ``is_shard`` does not count."""
    return placement.is_shard(dim) or (_is_strided(placement) and dim in (None, placement.dim))


def _is_strided(placement) -> bool:
    return type(placement).__name__ == "_StridedShard"  # (private to torch: not imported to be named)


def _check_strided(t) -> None:
    """Raise ValueError where a _StridedShard (``.view`` of a sharded DTensor, FSDP2 with
    tensor parallelism) gives some rank rows along its dimension that are not one run of
    the full tensor's: a piece is then no block of it, and fewbit has no global indices
    for it. Alike on every rank: it splits the dimension's indices as the placements split
    a tensor, for every rank's coordinates. FSDP2 with TP's evenly split pieces are runs."""
    placements, mesh = t.placements, t.device_mesh
    for d in sorted({p.dim for p in placements if _is_strided(p)}):
        along = [(i, p) for i, p in enumerate(placements) if _splits(p, d)]
        # torch's private split (its placements' own); without it, no strided shard is placed
        # (tests/test_sharded.py's FSDP2 with TP case then fails)
        splits = [getattr(p, "_split_tensor", None) for _, p in along]
        for coordinate in itertools.product(*(range(mesh.size(i)) for i, _ in along)):
            rows = torch.arange(t.shape[d])
            for (i, _), split, c in zip(along, splits, coordinate, strict=True):
                rows = rows[:0] if split is None else split(rows, mesh.size(i), with_padding=False)[0][c]
            if None in splits or (rows.diff() != 1).any():
                raise ValueError(f"a DTensor of shape {tuple(t.shape)} with placements {placements} holds "
                                 f"rows {rows.tolist()[:6]} of dim {d} on one rank, not a run of the full "
                                 "tensor's: fewbit cannot place its pieces; redistribute it to Shard or "
                                 "Replicate placements first")  # fmt: skip


#: layout's answers by (shape, mesh, this rank's place in it, placements), which are all
#: they depend on: torch's offsets took 15-27 us a call (2-core VM), a third of a DTensor
#: op's own time, and a model asks the same few again every step. (A DeviceMesh compares
#: equal across ranks: a process group set up again with this process at another rank
#: makes an equal mesh.) Emptied when it reaches _LAYOUTS_KEPT.
_LAYOUTS: dict[tuple, ShardLayout] = {}
_LAYOUTS_KEPT = 4096


def layout(t: torch.Tensor, piece: torch.Tensor | None = None) -> ShardLayout:
    """Where this rank's piece of ``t`` sits in the full tensor (the whole of a plain
    tensor). Raises before anything is written when the piece is not where the
    placements say: fewbit would draw the wrong bits. ``piece``: ``t.to_local()``, where
    the caller has it."""
    shape = tuple(t.shape)
    if not is_dtensor(t):
        return ShardLayout(shape, shape, (0,) * len(shape))
    mesh = t.device_mesh
    key = (shape, mesh, mesh.get_coordinate(), tuple(t.placements))
    where = _LAYOUTS.get(key)
    if where is None:
        if len(_LAYOUTS) >= _LAYOUTS_KEPT:
            _LAYOUTS.clear()
        _check_strided(t)
        where = _LAYOUTS[key] = ShardLayout(shape, *(torch_offsets(t) or placement_offsets(t)))
    actual = tuple((t.to_local() if piece is None else piece).shape)
    if where.local_shape != actual and len(actual) == len(shape) and math.prod(actual) == where.numel == 0:
        # An empty piece has no index to misplace, whatever its empty shape: FSDP2's chunk of
        # TP's empty (32, 0) piece is (0, 0) where the placements say (16, 0). Refused on its
        # ranks alone, the others waited in their next collective.
        return ShardLayout(shape, actual, where.offset)
    if where.local_shape != actual:
        raise RuntimeError(f"a DTensor of shape {shape} with placements {t.placements} holds a local "
                           f"tensor of shape {actual}, not {where.local_shape}: fewbit cannot tell its "
                           "global indices")  # fmt: skip
    return where


def global_bits(spec: RoundSpec, words, piece: ShardLayout, device) -> torch.Tensor:
    """The random integers a rounding with ``spec`` and the streams' ``words``
    (``fewbit.rounding.compiled.stream_words``) gives the elements of ``piece``, shaped
    as the piece: the bits those elements have in the full tensor."""
    n = piece.numel
    start = piece.flat_start()
    if start is not None:
        flat = range_bits(spec, words, start, n, device)
    else:
        first, end = piece.flat_bounds()
        index = piece.flat_indices(device)
        # A range costs one Threefry block per 2 * floor(32 / N) of its elements, an index
        # one per element: draw the span and pick from it when that is cheaper (Shard(1)
        # on a few ranks), else draw by index.
        if end - first <= 2 * (32 // spec.bits) * n:
            flat = range_bits(spec, words, first, end - first, device)[index - first]
        else:
            flat = index_bits(spec, words, index)
    return flat.view(piece.local_shape)


def round_range(
    x: torch.Tensor, spec: RoundSpec | BlockSpec, key: Key | None, piece: ShardLayout,
    axis: int | None = None, tensor_scale: torch.Tensor | None = None, in_place: bool = False,
) -> torch.Tensor | None:
    """``x`` (a piece, in the dtype the rounding starts from) rounded stochastically by
    fewbit's kernel (native on a CPU, Triton on a GPU) with the bits its elements have in
    the full tensor, drawn in the kernel, where the piece is runs of the flattened full
    tensor (:meth:`ShardLayout.runs`: Shard(0) one, Shard(1) a run a row); for a block
    format, where its blocks lie along the last dimension (``axis``; None: the format's)
    and the runs are whole blocks, with the full tensor's ``tensor_scale`` for a format
    that has one (:func:`tensor_scales`). None where that does not apply, or where an
    element has no value in the format (the caller's rounding then raises).

    ``in_place``: x is the caller's own, and the native kernel rounds it into itself (x
    returned) where it takes x and no element can be refused: it reads each element (a
    block's, each block) before it writes the results there. A refusal would leave x
    rounded part way, and the caller's rounding would then name the wrong value."""
    runs = piece.runs()
    if key is None or runs is None:
        return None
    own = in_place and not spec.may_refuse and x.is_contiguous()
    if isinstance(spec, BlockSpec):
        axis = spec.bfmt.axis if axis is None else axis
        return _blocks_in_range(x, spec, key, piece, runs, axis, tensor_scale, own)
    if native.applies(spec, x):
        if own:
            bad = native.round_into(x, spec, stream_words(spec, key), None, x, **runs.placed)
            return x if bad < 0 else None
        return native.rounded(x, spec, stream_words(spec, key), **runs.placed)
    if gpu.applies(spec, x):
        return gpu.rounded(x, spec, key, **runs.placed)
    return None


def quantize_range(x: torch.Tensor, spec: RoundSpec, key: Key | None, piece: ShardLayout,
                   packed: bool) -> torch.Tensor | None:  # fmt: skip
    """The codes (``fewbit.quantize``'s: uint8 or int16, or ``packed`` pairs along the last
    dimension) of ``x`` rounded as :func:`round_range` rounds it, in the same pass of the
    kernel, where the piece is runs of the full tensor (even, for pairs); None where that
    does not apply, or where an element has no value in the format."""
    runs = piece.runs()
    if key is None or runs is None or (packed and (runs.start | runs.length | runs.stride) & 1):
        return None
    shape = (*x.shape[:-1], x.shape[-1] // 2) if packed else x.shape
    out = x.new_empty(shape, dtype=torch.uint8 if packed else code_dtype(spec.fmt))
    if native.applies(spec, x):
        bad = native.quantize_into(x, spec, stream_words(spec, key), None, out, packed, **runs.placed)
        return out if bad < 0 else None
    if spec.fmt.has_nans and gpu.applies(spec, x):  # every element has a code there
        return out if gpu.quantize_into(x, spec, key, None, out, packed, **runs.placed) else None
    return None


def _blocks_in_range(x: torch.Tensor, spec: BlockSpec, key: Key, piece: ShardLayout, runs: Runs,
                     axis: int, tensor_scale: torch.Tensor | None,
                     own: bool) -> torch.Tensor | None:  # fmt: skip
    """:func:`round_range` for a block format: each run whole blocks, from a block's first
    element, blocks along the last dimension (``axis``) lying as in the full tensor (its
    length a multiple of the block size)."""
    size, bfmt, dims = spec.bfmt.block_size, spec.bfmt, len(piece.global_shape)
    if bfmt.tensor_scale and tensor_scale is None:  # the piece's own would not be the full tensor's
        raise ValueError(f"{bfmt.name}: a piece rounds with its full tensor's tensor_scale (tensor_scales)")
    if (axis % dims != dims - 1 or piece.global_shape[-1] % size or runs.start % size or runs.length % size
            or runs.stride % size or spec.work_dtype != torch.float32):  # fmt: skip
        return None
    call = {"block_size": size, "rule": spec.rule, **runs.placed}
    if native.block_applies(spec.spec, x, None, size, bfmt.scale):
        out = x if own else torch.empty_like(x, memory_format=torch.contiguous_format)  # (in_place)
        ts = 1.0 if tensor_scale is None else float32_item(tensor_scale)  # (float() flushes a subnormal)
        bad = native.block_into(x, spec.spec, stream_words(spec.spec, key), None, out, None, tensor_scale=ts,
                                **call)  # fmt: skip
        return out if bad < 0 else None
    if gpu.block_applies(spec.spec, x, None, size, bfmt.scale):  # every element has a result there
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        done = gpu.block_into(x, spec.spec, key, None, out, None, tensor_scale=tensor_scale, **call)
        return out if done else None
    return None


def piece_randomness(spec: RoundSpec | BlockSpec | None, key: Key | torch.Tensor | None,
                     piece: ShardLayout, device) -> dict:  # fmt: skip
    """The keyword arguments that make a rounding of a piece (``fewbit.round``,
    ``fewbit.block.round_to``, ``quantize``) draw the bits its elements have in the full
    tensor under ``key``: ``seed`` for a whole tensor, ``random_bits`` for a piece of one,
    none for a deterministic rounding (key None). ``spec``: the rounding's (its N and
    streams); not read for a whole tensor."""
    if key is None:
        return {}
    if piece.whole:
        return {"seed": key}
    spec = spec.spec if isinstance(spec, BlockSpec) else spec  # a block's elements take the bits
    return {"random_bits": global_bits(spec, stream_words(spec, key), piece, device)}


def _cuts(size: int, splits: list[int]) -> set[int]:
    """Where a dimension of ``size`` is cut when mesh dimensions of ``splits`` ranks shard
    it in turn (``torch.chunk``'s split of each piece, as :func:`placement_offsets`)."""
    pieces = [(0, size)]
    for n in splits:
        chunked = []
        for a, b in pieces:
            step = -(-(b - a) // n) or 1
            chunked += [(min(a + k * step, b), min(a + (k + 1) * step, b)) for k in range(n)]
        pieces = chunked
    return {a for a, _ in pieces} | {b for _, b in pieces}


def check_whole_blocks(t: torch.Tensor, fmt, axis: int | None = None, name: str = "tensor") -> None:
    """Raise ValueError unless each rank's piece of ``t`` holds whole blocks of block
    format ``fmt`` along its block ``axis`` (None: the format's), and so rounds alone to
    what the full tensor's rounding gives there. The answer is the same on every rank (it
    looks at every rank's cuts, not this rank's piece): all raise or none does.

    A piece's blocks are whole when every cut along the axis falls on a multiple of the
    block size (or at the end, whose last block is padded in the full tensor too). A
    per-tensor scale (NVFP4's) is the full tensor's: :func:`tensor_scales`.
    """
    if not isinstance(fmt, BlockFormat) or not is_dtensor(t):
        return
    check_cuts(t, fmt.axis if axis is None else axis, fmt.block_size, fmt.name, "blocks", name)


def check_cuts(t: torch.Tensor, dim: int, size: int, what: str, groups: str, name: str,
               length: int | None = None) -> None:  # fmt: skip
    """Raise ValueError unless every rank's piece of ``t`` (a DTensor) is cut along ``dim``
    only on multiples of ``size`` (or at its end): groups of ``size`` elements along it
    (blocks, packed pairs) then each lie on one rank. ``length``: that of a tensor laid out
    as t whose pieces are checked instead (packed codes' values). Alike on every rank, as
    :func:`check_whole_blocks`."""
    from torch.distributed.tensor import Shard

    d = dim % t.dim()
    along = [(i, p) for i, p in enumerate(t.placements) if _splits(p, d)]
    if any(type(p) is not Shard for _, p in along):
        raise ValueError(f"{name}: placements {t.placements} split the {groups}' axis {d} in a way fewbit "
                         "does not place them for")  # fmt: skip
    length = t.shape[d] if length is None else length
    ranks = [t.device_mesh.size(i) for i, _ in along]
    straddled = sorted(c for c in _cuts(length, ranks) if c % size and c != length)
    if straddled:
        raise ValueError(
            f"{name}: {what} on a sharded tensor: {groups} of {size} along dim {d} (of {length}) would "
            f"straddle ranks, cut at {straddled[:4]} by placements {t.placements}; shard another dimension "
            f"or give each rank a multiple of {size} elements along dim {d}"
        )


def replica_rank(t: torch.Tensor) -> int | None:
    """The rank that a DIFFERING key folds in for ``t`` (seed 000): None for a plain
    tensor (the process's own rank). For a DTensor, the lowest global rank of its mesh:
    every rank of the mesh holds a piece of this one tensor and must draw its bits, while
    data-parallel replicas hold other tensors on other meshes, with other lowest ranks."""
    if not is_dtensor(t):
        return None
    return int(t.device_mesh.mesh.min())


def map_piece(t: torch.Tensor, fn: Callable[[torch.Tensor, ShardLayout], torch.Tensor],
              shape: tuple[int, ...] | None = None) -> torch.Tensor:  # fmt: skip
    """``fn(piece, where)`` on this rank's piece of ``t`` and where it lies, as a tensor placed
    as ``t`` (contiguous); ``fn(t, whole)`` for a plain tensor. ``fn`` must keep the piece's shape
    and act elementwise by global index (a rounding with :func:`piece_randomness`); or,
    given the full result's ``shape``, change the length of the last dimension alone (codes
    packed in pairs, or unpacked) so that the pieces still lie where ``t``'s placements
    put them in it.

    Partial placements are reduced first (to Replicate, a collective): their pieces are
    addends, and a rounding of the addends is not a rounding of their sum.
    """
    if not is_dtensor(t):
        return fn(t, layout(t))
    from torch.distributed.tensor import DTensor

    t = summed(t)
    piece = t.to_local()
    if not is_plain(piece) and callable(getattr(piece, "wait", None)):
        # A piece whose collective is in flight (a row-parallel layer's output, an
        # AsyncCollectiveTensor) has no memory of its own: its result, for the kernels.
        piece = piece.wait()
    # The result is contiguous, as the ops' results on a plain tensor are whatever its strides
    # (their pieces already are: .contiguous() copies nothing), and the DTensor says so: t's
    # strides would refuse a view (.view(-1) of a transposed t) that the plain result takes.
    out = fn(piece, layout(t, piece)).contiguous()
    shape = shape or t.shape
    return DTensor.from_local(out, t.device_mesh, t.placements, run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())  # fmt: skip


def summed(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its Partial placements reduced (to Replicate, a collective): their pieces
    are addends, and a rounding of the addends is not a rounding of their sum."""
    if not is_dtensor(t) or not any(p.is_partial() for p in t.placements):
        return t
    from torch.distributed.tensor import Replicate

    return t.redistribute(placements=[Replicate() if p.is_partial() else p for p in t.placements])


def max_over_mesh(values: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """``values`` (elementwise) made the largest over the ranks that hold other pieces of
    ``tensors`` (DTensors on one mesh), in place: an all-reduce along each mesh dimension
    that shards any of them (along the others the pieces are copies: HSDP's replicas).
    Nothing on a rank outside the mesh, which holds no piece."""
    import torch.distributed as dist

    mesh = tensors[0].device_mesh
    if mesh.get_coordinate() is None:  # (it has no group along the mesh's dimensions)
        return
    for mesh_dim in range(mesh.ndim):
        if any(_splits(t.placements[mesh_dim]) for t in tensors):
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=mesh.get_group(mesh_dim))


def refuse_alike(error: Exception | None, tensors: list[torch.Tensor], others: str) -> None:
    """Raise on every rank if any rank that holds pieces of ``tensors`` met an error
    (``error``: this rank's, or None): one all-reduce of a flag per mesh that shards any
    of them, so that no rank goes on to wait at a collective that ranks which raised never
    reach. This rank raises its own error, or a ValueError saying ``others``. Without
    sharded DTensors among ``tensors``, only its own."""
    on_mesh = sharded_by_mesh(tensors)
    if on_mesh:
        first = tensors[next(iter(on_mesh.values()))[0]]  # (the collectives' device)
        refused = torch.tensor(float(error is not None), device=local_tensor(first).device)
        for at in on_mesh.values():
            max_over_mesh(refused, [tensors[i] for i in at])
        if error is None and refused:
            raise ValueError(others)
    if error is not None:
        raise error


def differs_across_holders(value: int, tensors: list[torch.Tensor]) -> bool:
    """Whether ``value`` (an int of at most 62 bits: a digest) differs between the ranks
    that hold pieces of the sharded DTensors among ``tensors``, on any of their meshes, along
    every mesh dimension (HSDP's replicas too): one all-reduce (MAX of value and -value) per
    mesh dimension. False without sharded DTensors; on a rank outside a mesh, nothing."""
    import torch.distributed as dist

    differs = False
    for at in sharded_by_mesh(tensors).values():
        mesh = tensors[at[0]].device_mesh
        if mesh.get_coordinate() is None:
            continue
        bounds = torch.tensor([value, -value], dtype=torch.int64, device=local_tensor(tensors[at[0]]).device)
        for mesh_dim in range(mesh.ndim):
            dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=mesh.get_group(mesh_dim))
        differs |= int(bounds[0]) != -int(bounds[1])  # (the largest and the smallest)
    return differs


def sharded_by_mesh(tensors: list[torch.Tensor]) -> dict:
    """The places in ``tensors`` of the DTensors sharded along some mesh dimension, by
    their mesh (in their order: alike on every rank, as the collectives over them must be)."""
    on_mesh: dict = {}
    for i, t in enumerate(tensors):
        if is_dtensor(t) and any(_splits(p) for p in t.placements):
            on_mesh.setdefault(t.device_mesh, []).append(i)
    return on_mesh


def global_amax(t: torch.Tensor) -> float:
    """The largest magnitude in the full tensor (inf where any element is NaN or
    infinite; 0 for an empty one). For a sharded DTensor, a collective over its mesh; 0 on
    a rank outside the mesh (its piece is empty)."""
    _check_not_partial([t], "global_amax")
    piece = local_tensor(t).detach()
    # float64 holds every float dtype's values (float32 made float64's large ones its max)
    amax = torch.zeros((), dtype=torch.float64, device=piece.device)
    if piece.numel():
        amax = piece.abs().amax().double().nan_to_num(nan=math.inf, posinf=math.inf)
    if is_dtensor(t):
        max_over_mesh(amax, [t])
    return float(amax)


def _check_not_partial(tensors: list[torch.Tensor], name: str) -> None:
    """Raise ValueError where a tensor is a Partial DTensor: its pieces are addends, and
    their largest magnitude is not the sum's. Alike on every rank (so are placements)."""
    for t in tensors:
        if is_dtensor(t) and any(p.is_partial() for p in t.placements):
            raise ValueError(f"{name}: a DTensor with placements {t.placements} holds addends, not pieces "
                             "of its values: reduce it first (fewbit.sharding.summed)")  # fmt: skip


def tensor_scales(tensors: list[torch.Tensor], bfmt: BlockFormat, dtype: torch.dtype | None = None,
                  rule: str | None = None) -> list[torch.Tensor | None]:  # fmt: skip
    """The per-tensor scale of block format ``bfmt`` (NVFP4's) for each full tensor, from
    the largest finite magnitude of every rank's piece, so that each piece rounds with
    the scale its full tensor takes: one all-reduce for all the DTensors of a mesh per
    mesh dimension that shards any of them (placements are alike on every rank, and so
    are the calls). None each for a format without one. No tensor may be Partial (reduce
    it first: :func:`summed`): its pieces are addends. ``dtype``: the one the tensors are
    rounded from, where it is not theirs (the write-back's update dtype): the scale is
    that of the tensors converted to it, as the block ops would find it (a piece at a
    time). ``rule``: the scale rule in force (default: the format's), which the scale
    depends on (:func:`fewbit.block.kernel.tensor_scale_of`)."""
    if not bfmt.tensor_scale:
        return [None] * len(tensors)
    _check_not_partial(tensors, "tensor_scales")
    pieces = [local_tensor(t).detach() for t in tensors]
    amax = [largest_finite(p if dtype is None else p.to(dtype), bfmt) for p in pieces]
    for at in sharded_by_mesh(tensors).values():
        found = torch.stack([amax[i] for i in at])
        max_over_mesh(found, [tensors[i] for i in at])
        for i, value in zip(at, found.unbind(), strict=True):
            amax[i] = value
    return [tensor_scale_of(p, bfmt, a, rule) for p, a in zip(pieces, amax, strict=True)]


def piece_key(t: torch.Tensor) -> int | None:
    """Equal on two ranks iff they must hold the same values of ``t``: 0 for a plain
    tensor (the same everywhere); for a DTensor, a hash of where its piece sits (and its
    coordinate along Partial mesh dimensions, whose pieces are addends, not copies);
    None for an empty piece (nothing to compare)."""
    if not is_dtensor(t):
        return 0
    piece = layout(t)
    if piece.numel == 0:
        return None
    from torch.distributed.tensor import Partial

    coordinate = t.device_mesh.get_coordinate() or []
    partial = tuple(c for c, p in zip(coordinate, t.placements, strict=True) if isinstance(p, Partial))
    return hash((piece.offset, piece.local_shape, partial)) & ((1 << 62) - 1)


def pairwise_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` summed as a binary tree over their order, split at the largest power of
    two below their number: ((a + b) + (c + d)) for four. A block of 2^k consecutive
    terms starting at a multiple of 2^k is a subtree, so partial sums over such blocks
    (a rank's share, an accumulation step) combine into exactly the same result."""
    if len(tensors) == 1:
        return tensors[0].clone()
    half = 1 << ((len(tensors) - 1).bit_length() - 1)
    return pairwise_sum(tensors[:half]).add_(pairwise_sum(tensors[half:]))


class PairwiseReduceScatter:
    """An FSDP2 reduce-scatter (``model.set_custom_reduce_scatter(PairwiseReduceScatter())``)
    whose sums do not depend on torch's collective algorithm: each rank receives every
    rank's part of its shard (one all-to-all) and adds them with :func:`pairwise_sum` in
    rank order.

    A float sum's rounding depends on its order, and a collective's order on its
    algorithm and the number of ranks. With this reduction, FSDP2 on 2^k ranks, where rank
    r's backward pass p handles micro-batch ``p * 2^k + r``, gives the gradient
    ``pairwise_sum(micro-batch gradients)`` bit for bit, as one process computing that
    sum does, when there are at most two passes (FSDP2 adds passes left to right).
    Handles SUM and AVG (divided after the sum); costs an all-to-all of the whole input
    instead of a reduce-scatter.
    """

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False):  # fmt: skip
        import torch.distributed as dist

        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"PairwiseReduceScatter sums (SUM, AVG), not {op}: "
                             "set_force_sum_reduction_for_comms(True) makes FSDP2 ask for SUM")  # fmt: skip
        size = dist.get_world_size(group)
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)
        total = pairwise_sum(list(received.view(size, -1).unbind()))
        if op == dist.ReduceOp.AVG:
            total.div_(size)
        output_tensor.copy_(total.view_as(output_tensor))
        return None


def reduce_exactly(model: torch.nn.Module, divide_by: float) -> None:
    """FSDP2's gradient reduction for ``model``, the same on any number of ranks: on every
    module ``fully_shard`` was applied to, :class:`PairwiseReduceScatter`, sums only, and
    one division of the sum by ``divide_by`` (the micro-batches a step adds; exact for a
    power of two). FSDP2's own setters reach only the module they are called on: a model
    sharded block by block and then as a whole, given them at the root alone, averaged its
    blocks' gradients by torch's collective, in another order on another number of ranks.

    The division is the module's all-reduce hook (``set_all_reduce_hook``; one set before
    is replaced), with FSDP2's own switched off: where a module's shard group has one rank
    (FSDP2 on one rank, HSDP on an (R, 1) mesh) torch 2.13 divides the sum twice. Under
    HSDP the sum across replicas is torch's all-reduce: one exact addition for two
    replicas, in the collective's order for more."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not sharded:
        raise ValueError("reduce_exactly: no module of the model is sharded (fully_shard it first)")
    setters = ("set_custom_reduce_scatter", "set_force_sum_reduction_for_comms", "set_gradient_divide_factor",
               "set_all_reduce_hook")  # fmt: skip
    if missing := [name for name in setters if not hasattr(FSDPModule, name)]:  # (before any is set)
        raise RuntimeError(f"reduce_exactly needs FSDP2's {', '.join(missing)}, which torch "
                           f"{torch.__version__} lacks")  # fmt: skip
    divide = functools.partial(_divide_in_place, by=float(divide_by))
    # The hooks first: FSDP2 refuses them, as it refuses a custom reduce-scatter, on a module
    # whose parameters lie on several meshes; a refusal then leaves nothing set.
    for i, m in enumerate(sharded):
        try:
            m.set_all_reduce_hook(divide)
        except ValueError as err:
            for earlier in sharded[:i]:
                earlier.set_all_reduce_hook(None)  # (FSDP2's default: no hook)
            raise ValueError(f"reduce_exactly cannot set this module's reduction: {err}") from err
    for m in sharded:
        m.set_custom_reduce_scatter(PairwiseReduceScatter())
        m.set_force_sum_reduction_for_comms(True)
        m.set_gradient_divide_factor(1.0)


def _divide_in_place(reduced: torch.Tensor, by: float) -> None:
    reduced.div_(by)
