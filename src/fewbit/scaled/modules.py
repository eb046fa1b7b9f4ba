"""scalify: a module's parameters as ScaledTensors."""

from __future__ import annotations

import torch
from torch import nn

from .casts import Stat, dynamic_scale
from .tensor import ScaledTensor, as_scaled, check_dtype, compute_dtype, wrap


def scalify(module: nn.Module, dtype: torch.dtype | None = None, rescale: Stat | None = "l2",
            pow2: bool = True) -> nn.Module:
    """Turn every parameter of ``module`` into a ScaledTensor parameter, in place, and
    return the module.

    dtype: storage dtype of the data (default: the parameter's). rescale: the data is
    rebalanced so that this statistic ("max", "l1", "l2" for RMS) is 1, with a
    power-of-two scale when pow2, so the value is kept exactly; None keeps scale 1.
    Tied parameters stay tied. Parameters of integer, bool or complex dtype are left as
    they are (a scale would round integers away). Autograd then yields ScaledTensor
    gradients, and torch.optim optimizers update the parameters in place. A dtype or a
    parameter ScaledTensor refuses (8-bit floats) raises before any parameter changes.
    """
    chosen = [(m, name, p) for m in module.modules() for name, p in m._parameters.items()
              if p is not None and not isinstance(p, ScaledTensor) and p.is_floating_point()]  # fmt: skip
    if dtype is not None and not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating dtype, not {dtype}")
    for d in {dtype, *(p.dtype for _, _, p in chosen)} - {None}:
        check_dtype(d)
    done: dict[int, nn.Parameter] = {}
    for m, name, p in chosen:
        if id(p) not in done:
            # The scale from the parameter itself, divided out in the wider of its dtype
            # and the compute dtype, then rounded once: a narrower dtype would first
            # flush small parameters to zero and large ones to inf.
            store = dtype or p.dtype
            data = p.detach().to(torch.promote_types(compute_dtype(p.dtype), store), copy=True)
            if rescale is not None:
                s = dynamic_scale(as_scaled(data), rescale, 1.0, pow2)
                t = wrap((data / s).to(store), s)
            else:
                t = as_scaled(data.to(store))
            done[id(p)] = nn.Parameter(t, requires_grad=p.requires_grad)
        m._parameters[name] = done[id(p)]
    return module
