"""fewbit: low-precision floating point for PyTorch, every format and rounding mode."""

from . import block, config, nn, optim
from . import sharded_ops as _sharded_ops  # noqa: F401 (registers its rules for DTensors)
from .codec import decode, encode, quantize
from .config import configure
from .formats import FloatFormat
from .rounding import RoundMode, round, round_

__all__ = [
    "FloatFormat", "RoundMode", "block", "config", "configure", "decode", "encode", "format", "nn", "optim",
    "quantize", "round", "round_",
]
__version__ = "0.1.0"


def format(name: str | FloatFormat) -> FloatFormat:
    """Look an element format up by name (or pass a FloatFormat through): the registry of
    ``fewbit.formats.format``, also inside a compiled function (``block.looked_up``)."""
    return block.looked_up(name, "element")
