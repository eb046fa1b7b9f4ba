"""scalify: a module's parameters as ScaledTensors."""

from __future__ import annotations

import torch
from torch import nn

from .casts import Stat, dynamic_scale
from .tensor import ScaledTensor, as_scaled, compute_dtype, wrap


def scalify(module: nn.Module, dtype: torch.dtype | None = None, rescale: Stat | None = "l2",
            pow2: bool = True) -> nn.Module:
    """Turn every parameter of ``module`` into a ScaledTensor parameter, in place, and
    return the module.

    dtype: storage dtype of the data (default: the parameter's). rescale: the data is
    rebalanced so that this statistic ("max", "l1", "l2" for RMS) is 1, with a
    power-of-two scale when pow2, so the value is kept exactly; None keeps scale 1.
    Tied parameters stay tied. Autograd then yields ScaledTensor gradients, and
    torch.optim optimizers update the parameters in place.
    """
    done: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is None or isinstance(p, ScaledTensor):
                continue
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
