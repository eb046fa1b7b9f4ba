"""ScaledTensor parameters under FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 keeps each rank's piece of a parameter and all-gathers the pieces before a
module's forward and backward. A ScaledTensor's value is ``data * scale``: the pieces'
data are gathered, and the scale, one per tensor, travels beside them. FSDP2 calls
:func:`pre_all_gather` and :func:`post_all_gather` through the ScaledTensor methods of
the same names (its tensor-subclass extension points); this module also gives its
gradient copy-in (``fsdp::chunk_cat``) a rule.

The scale of a sharded ScaledTensor is the whole tensor's, the same on every rank:
FSDP2 cuts the pieces with views (which keep the scale) and rules derive a result's
scale from the operands' scales, never from the data, so optimizer steps on the pieces
keep the ranks' scales equal (the reduced gradients FSDP2 hands the optimizer are plain
tensors, scale 1). A rescale computed from a piece's own data
(``dynamic_rescale_`` on ``to_local()``) would break this: it is not supported.

Loading a checkpoint can break it too: ``copy_`` into a piece takes the source's scale
where it fills the whole piece and the larger of the two where it fills a part, so a
checkpoint saved on other ranks (DCP loads it piece by piece) leaves the ranks on
different scales, and each rank's gathered weight wrong. :func:`agree_scales` gives
every piece the largest scale of its ranks' non-empty pieces; ``scalify`` calls it after
every ``load_state_dict`` of the module it made (``set_model_state_dict`` calls that). So
can a cast of the sharded model (``model.half()``): a piece whose data would overflow the
new dtype moves a power of two into its scale, the others do not; call
:func:`agree_scales` after it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp  # noqa: F401  (defines the fsdp:: ops named below)
from torch import nn

from ..random import is_dtensor
from .casts import rebalance_
from .tensor import ScaledTensor, if_present, parts, rule, set_scale, value

__all__ = ["agree_scales", "post_all_gather", "pre_all_gather"]


def agree_scales(module: nn.Module) -> int:
    """Give every piece of each of ``module``'s sharded ScaledTensor parameters (a DTensor
    whose local tensor is one, with one scale) the largest scale of its ranks' non-empty
    pieces, rebalancing its data (exact for power-of-two scales, but for 16-bit
    subnormals); returns how many pieces of this rank changed. A collective over each
    mesh: call it on every rank, after loading a checkpoint saved on other ranks
    (``scalify``'s modules do so after each ``load_state_dict``)."""
    with torch.no_grad():  # (a hook of load_state_dict, which may run with gradients on)
        return _agree_scales(module)


def _agree_scales(module: nn.Module) -> int:
    meshes: dict[int, tuple[Any, list[ScaledTensor]]] = {}
    for p in module.parameters():  # (one order on every rank: the module's)
        local = p.to_local() if is_dtensor(p) else None  # (shares p's piece: rebalance_ writes it)
        # (Not a per-channel scale, refused by the all-gather; nor a model still on the meta
        # device, whose scales have no value, alike on every rank.)
        if isinstance(local, ScaledTensor) and getattr(parts(local)[1], "ndim", 0) == 0 and not local.is_meta:
            meshes.setdefault(id(p.device_mesh), (p.device_mesh, []))[1].append(local)
    changed = 0
    for mesh, pieces in meshes.values():
        held = [float(parts(t)[1]) for t in pieces]
        # An empty piece (FSDP2's past the end of a short tensor) holds nothing that its scale
        # says anything of, and a checkpoint's load leaves it the model's: it votes 0 and takes
        # the others' (its scale of 1 had won over the loaded 2^-20, and float16 data lost bits).
        votes = [h if t.numel() else 0.0 for t, h in zip(pieces, held, strict=True)]
        largest = torch.tensor(votes, dtype=torch.float64, device=mesh.device_type)
        for dim in range(mesh.ndim):  # the largest over each dimension in turn: over the mesh
            dist.all_reduce(largest, dist.ReduceOp.MAX, group=mesh.get_group(dim))
        for t, mine, s in zip(pieces, held, largest.tolist(), strict=True):
            if s != mine and s > 0:  # (0: no rank holds any of the tensor, each keeps its scale)
                rebalance_(t, s)
                changed += 1
    return changed


def pre_all_gather(t: ScaledTensor, mesh, outer_size: torch.Size, outer_stride, module, mp_policy):
    """The all-gather inputs of this rank's piece ``t``: its data (in the mixed-precision
    ``param_dtype`` if one is set), and as metadata its scale."""
    d, s = parts(t)
    if isinstance(s, torch.Tensor) and s.dim():
        raise NotImplementedError("FSDP2 of a ScaledTensor with a per-channel scale: its scale would "
                                  "have to be sharded with the data; rebalance it to one scale first")
    dtype = getattr(mp_policy, "param_dtype", None)
    if dtype is not None and dtype != d.dtype:
        d = d.to(dtype)
    # FSDP2 pads dim 0 to ceil(n / ranks) on every rank and gathers the padded pieces
    # (it shards other dims only evenly): a short piece goes out padded with zeros.
    rows = -(-outer_size[0] // mesh.size()) if len(outer_size) else 0
    if d.dim() and tuple(d.shape[1:]) == tuple(outer_size[1:]) and d.shape[0] != rows:
        padded = d.new_zeros((rows, *d.shape[1:]))
        padded[: d.shape[0]].copy_(d)
        d = padded
    return (d,), s


def post_all_gather(t: ScaledTensor, outputs: tuple[torch.Tensor, ...], scale: Any, param_dtype,
                    *, out: torch.Tensor | None = None):  # fmt: skip
    """The unsharded parameter: the gathered data with the scale. FSDP2 passes ``out``
    from the second all-gather on: the parameter it made the first time, whose data
    already views the buffer it gathered into again; only its scale is set (and its
    views')."""
    (data,) = outputs
    if out is not None:
        local = out._local_tensor if hasattr(out, "_local_tensor") else out
        if parts(local)[0].untyped_storage().data_ptr() != data.untyped_storage().data_ptr():
            raise RuntimeError("FSDP2 gathered a ScaledTensor's data into a buffer its unsharded "
                               "parameter does not view")  # fmt: skip
        set_scale(local, scale)
        return None
    # Nothing to free beyond the gathered buffer, which FSDP2 frees itself.
    return ScaledTensor._make(data, scale), ()


@rule(*if_present(torch.ops.fsdp, "chunk_cat"))
def _chunk_cat(func, tensors, dim, num_chunks, *, out):
    """FSDP2's gradient copy-in before the reduce-scatter: the values, rounded to the
    buffer's dtype (exact for a power-of-two scale in range), into that plain buffer."""
    return func([value(x, out.dtype) for x in tensors], dim, num_chunks, out=parts(out)[0])
