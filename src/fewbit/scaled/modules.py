"""scalify: a module's parameters as ScaledTensors."""

from __future__ import annotations

import torch
from torch import nn

from .casts import Stat, dynamic_scale
from .tensor import ScaledTensor, as_scaled, wrap


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
                data = p.detach().to(dtype or p.dtype, copy=True)
                if rescale is not None:
                    s = dynamic_scale(as_scaled(data), rescale, 1.0, pow2)
                    t = wrap(data / s if data.dtype not in (torch.float16, torch.bfloat16)
                             else (data.float() / s).to(data.dtype), s)
                else:
                    t = as_scaled(data)
                done[id(p)] = nn.Parameter(t, requires_grad=p.requires_grad)
            m._parameters[name] = done[id(p)]
    return module
