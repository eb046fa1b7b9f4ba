"""scalify: a module's parameters as ScaledTensors."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..random import is_dtensor
from .casts import Stat, dynamic_scale
from .tensor import ScaledTensor, as_scaled, check_dtype, compute_dtype, data_readable, is_static, parts, wrap


def scalify(module: nn.Module, dtype: torch.dtype | None = None, rescale: Stat | None = "l2",
            pow2: bool = True) -> nn.Module:
    """Turn every parameter of ``module`` into a ScaledTensor parameter, in place, and
    return the module.

    dtype: storage dtype of the data (default: the parameter's). rescale: the data is
    rebalanced so that this statistic ("max", "l1", "l2" for RMS) is 1, with a
    power-of-two scale when pow2, so the value is kept exactly; None keeps the scale (1
    for a plain parameter). An all-zero parameter (a zero-initialised bias), which has no
    statistic, takes the largest scale of its module's other parameters (a Linear's bias
    its weight's), the scale of the products it is added to; 1 where they are all zero
    (and on the meta device, where there are no values to read). A parameter that is
    already a ScaledTensor (a second scalify) takes the dtype and rescale too, from its
    value. Each parameter stays the object it was (a plain one is swapped for its
    ScaledTensor, as ``Module._apply`` swaps a cast), so an optimizer made before scalify
    keeps its parameters; an RNN's, which torch holds weak references to and refuses to
    swap, are replaced: make its optimizer after scalify. Tied parameters stay tied.
    Parameters of integer, bool or complex dtype are left as they are (a scale would
    round integers away). Autograd then yields ScaledTensor gradients, and torch.optim
    optimizers update the parameters in place. A dtype ScaledTensor refuses (8-bit
    floats; without dtype, a parameter's), a lazy module's parameter not yet
    initialised, or a sharded one (a DTensor: scalify before sharding), raises before any
    parameter changes.

    Once its parameters are sharded (FSDP2, tensor parallelism), the module's
    ``load_state_dict`` ends with ``fsdp.agree_scales``, a collective over their meshes:
    call it on every rank of them (on one rank alone it waits for the others for good).
    A submodule's own ``load_state_dict`` does not run it: call ``agree_scales`` after.
    """
    if not isinstance(module, nn.Module):  # (a tensor: as_scaled makes one a ScaledTensor)
        raise TypeError(f"scalify takes an nn.Module, not {type(module).__name__} (as_scaled takes a tensor)")
    chosen = [(m, name, p) for m in module.modules() for name, p in m._parameters.items()
              if p is not None and p.is_floating_point()]
    if dtype is not None and not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating dtype, not {dtype}")
    for _, name, p in chosen:
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise ValueError(f"parameter {name!r} of a lazy module is not initialised yet: run the model "
                             "once before scalify")
        # A DTensor's value would become the data of one ScaledTensor, which torch.distributed
        # then failed to find its pieces in ("no attribute '_local_tensor'"); and a rescale
        # from each rank's own piece would give the ranks different scales for one tensor.
        if is_dtensor(p):
            raise TypeError(f"parameter {name!r} is a DTensor (sharded): scalify the model before "
                            "fully_shard, which then shards its ScaledTensors")
    for d in {dtype} if dtype is not None else {p.dtype for _, _, p in chosen}:
        check_dtype(d)  # (an 8-bit parameter with a wider dtype given is taken)
    unique = {id(p): p for _, _, p in chosen}
    values = {i: _scalified(p.detach(), dtype or p.dtype, rescale, pow2) for i, p in unique.items()}
    if rescale is not None:
        _zeros_at_siblings_scale(chosen, values)
    params: dict[int, nn.Parameter] = {}
    for i, p in unique.items():
        if isinstance(p, ScaledTensor):
            p.data = values[i]  # in place: an optimizer that holds p keeps it
            params[i] = p
        else:
            params[i] = nn.Parameter(values[i], requires_grad=p.requires_grad)
            # The plain parameter becomes the ScaledTensor itself, as Module._apply swaps a
            # cast's: an optimizer made before scalify held the old float32 tensors and
            # updated them, silently, while the model ran on the new ones. torch refuses to
            # swap one that a weak reference points to (an RNN's flat weights): replaced.
            try:
                torch.utils.swap_tensors(p, params[i])
                params[i] = p
            except RuntimeError:
                pass
    for m, name, p in chosen:
        m._parameters[name] = params[id(p)]
    if module not in _AGREEING:
        module.register_load_state_dict_post_hook(_agree_after_load)
        _AGREEING.add(module)
    return module


# The modules scalify gave the hook, so that a second scalify does not add another.
_AGREEING: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _agree_after_load(module: nn.Module, incompatible_keys) -> None:
    """After ``load_state_dict``: the ranks' pieces of each sharded ScaledTensor parameter
    take one scale (``fsdp.agree_scales``: a checkpoint saved on other ranks loads piece
    by piece, and a rank's scale depends on how its piece was cut)."""
    if any(is_dtensor(p) for p in module.parameters()):
        from .fsdp import agree_scales

        agree_scales(module)


def _zeros_at_siblings_scale(chosen: list, values: dict[int, ScaledTensor]) -> None:
    # An all-zero parameter (a zero-initialised bias) has no statistic to take a scale from.
    # At scale 1 it set the scale of its module's sums (add's common scale is the larger):
    # products at a weight's scale 2^-10 fell into float16's subnormals there. It takes the
    # largest scale of its module's other parameters, whose products it is added to. Not the
    # zero array: the first optimizer update would give it that update's small scale for
    # good (the scaled demo's E4M3 run overflowed float16 biases within 20 SGD steps).
    ids: dict[int, list[int]] = {}
    for m, _, p in chosen:
        ids.setdefault(id(m), []).append(id(p))
    for members in ids.values():
        zero = [i for i in members if _all_zero(values[i])]
        scales = [parts(values[i])[1] for i in members if i not in zero]
        if zero and scales:
            s = torch.stack([torch.as_tensor(t, dtype=torch.float32) for t in scales]).amax()
            for i in zero:
                values[i] = wrap(parts(values[i])[0], s.clone())  # (zeros at any scale)


def _all_zero(t: ScaledTensor) -> bool:
    # (Not read on the meta device, where there are no values: a model built there keeps 1.)
    d, s = parts(t)
    return data_readable(d) and not bool(d.count_nonzero())


def _scalified(p: torch.Tensor, store: torch.dtype, rescale: Stat | None, pow2: bool) -> ScaledTensor:
    if rescale is None:
        t = p.to(store, copy=True)
        return t if isinstance(t, ScaledTensor) else as_scaled(t)
    # The scale from the value itself, divided out in a dtype that holds the value
    # exactly, then rounded once: a narrower dtype would first flush small parameters to
    # zero and large ones to inf. A plain parameter: the wider of its dtype and the
    # compute dtype; a ScaledTensor's data times a float32 scale: float64.
    if isinstance(p, ScaledTensor):
        d, s = parts(p)
        wide = torch.float64
        data = torch.zeros_like(d, dtype=wide) if is_static(s, 0.0) else d.to(wide) * (
            s.to(wide) if isinstance(s, torch.Tensor) else s)
    else:
        wide = compute_dtype(store if p.dtype.itemsize == 1 else torch.promote_types(p.dtype, store))
        data = p.to(wide, copy=True)
    s = dynamic_scale(as_scaled(data), rescale, 1.0, pow2)
    return wrap((data / s).to(store), s)
