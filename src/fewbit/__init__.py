"""fewbit: low-precision floating point for PyTorch, every format and rounding mode."""

from . import block, config, nn, optim
from . import sharded_ops as _sharded_ops  # noqa: F401 (registers its rules for DTensors)
from .codec import decode, encode, quantize
from .config import configure
from .formats import FloatFormat, format
from .rounding import RoundMode, round, round_

__all__ = [
    "FloatFormat", "RoundMode", "block", "config", "configure", "decode", "encode", "format", "nn", "optim",
    "quantize", "round", "round_",
]
__version__ = "0.1.0"
