"""``fewbit.scaled``: tensors stored as data * scale, with the scale propagated through
every op (seed 003, Scalify, in PyTorch).

>>> x = as_scaled(torch.randn(4, 8, dtype=torch.float16), 2.0**-20)
>>> model = scalify(torch.nn.Linear(8, 2), dtype=torch.float16)
>>> y = model(x)                   # a ScaledTensor: fp16 data, scale 2^-20 * weight's
"""

from . import nn_ops, ops  # noqa: F401  (fill the rule table)
from .casts import (
    cast,
    cast_,
    dynamic_rescale,
    dynamic_rescale_,
    dynamic_rescale_grad,
    dynamic_rescale_l1,
    dynamic_rescale_l1_grad,
    dynamic_rescale_l2,
    dynamic_rescale_l2_grad,
    dynamic_rescale_max,
    dynamic_rescale_max_grad,
    dynamic_scale,
    from_e8m0,
    pow2_scale,
    rebalance,
    rebalance_,
    round_pow2,
    scale_to_e8m0,
)
from .modules import scalify
from .tensor import RULES, NoRuleError, ScaledTensor, as_scaled

__all__ = [
    "RULES", "NoRuleError", "ScaledTensor", "as_scaled", "cast", "cast_", "dynamic_rescale",
    "dynamic_rescale_", "dynamic_rescale_grad", "dynamic_rescale_l1", "dynamic_rescale_l1_grad",
    "dynamic_rescale_l2", "dynamic_rescale_l2_grad", "dynamic_rescale_max", "dynamic_rescale_max_grad",
    "dynamic_scale", "from_e8m0", "pow2_scale", "rebalance", "rebalance_", "round_pow2", "scalify",
    "scale_to_e8m0",
]
