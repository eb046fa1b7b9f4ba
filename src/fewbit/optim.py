"""Low-precision weights: the paper's Algorithm 1 around any torch optimizer.

Every step the inner optimizer computes ``w + u`` in the parameters' dtype (or, with
``update_dtype``, that sum rounded to a 16-bit dtype, as the paper's bfloat16 updates);
fewbit then rounds it back to the weight format in place, stochastically by default.
Updates smaller than half an ulp survive SR on average, where round-to-nearest drops them.

Random bits are a pure function of (seed, step, parameter index), so a run restarted
from ``state_dict()`` draws exactly the bits an uninterrupted run would.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from .block import BlockFormat, BlockTensor, check_args, element_or_block, quantize, round_to
from .codec import decode, encode
from .config import configure, current
from .formats import FloatFormat
from .random import Key, as_key, fold_in, key_tensor
from .replicas import SeedPolicy, assert_identical_inputs, replica_key
from .rounding import RoundMode, dtype_format
from .rounding.compiled import round_foreach_, stream_words
from .rounding.modes import parse_mode

__all__ = ["LowPrecisionWeights"]

_UPDATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

#: The write-back rounds every weight of 8192 elements or more with the compiled kernel:
#: it runs every step, so the one compilation per run is soon repaid.
COMPILE_FROM = 1 << 13


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
        seed: an int or ``fewbit.random.Key``; step t rounds parameter i with
            ``fold_in(key, t, i)`` (t = 0 is the rounding of the initial weights).
        params: the parameters to keep in ``fmt`` (tensors, or (name, tensor) pairs as
            ``named_parameters()`` gives); default: the optimizer's parameters with two or
            more dimensions (matrices and embeddings, as the paper).
        fraction: p for mode ``"sr_fraction"``.
        sat: values beyond the format's range go to its largest value (default), not Inf.
        update_dtype: hold ``w + u`` in this dtype (RNE) before rounding to ``fmt``;
            ``torch.bfloat16`` is the paper's set-up. None: the parameters' own dtype.
        scale: scale each tensor by a power of two so that its largest magnitude lands in
            the top binade below half the format's maximum, round, and scale back (element
            formats: a block format scales each block itself).
        store_codes: between a step and the next :meth:`zero_grad` (or
            :meth:`materialize`), keep the selected weights only as codes of ``fmt``
            (uint8 for formats of up to 8 bits; a ``fewbit.block.BlockTensor`` per weight
            for a block format) and free their float storage.
        policy: under data parallelism the write-back is ``"identical"`` on every
            replica (seed 000); ``"differing"`` folds in the rank (wrong: for tests).
        guard: before each step, check across ranks that every selected weight and its
            gradient agree (the invariant identical rounding needs); raise
            ``fewbit.replicas.ReplicaDriftError`` naming the first that does not.
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
    ):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.fmt = element_or_block(fmt)
        block = isinstance(self.fmt, BlockFormat)
        self.mode = parse_mode(mode)
        if bits is not None and (isinstance(bits, bool) or not isinstance(bits, int)):
            raise TypeError(f"bits must be an int, not {type(bits).__name__}")
        if bits is not None and not 1 <= bits <= 32:
            raise ValueError(f"bits must be in 1..32, got {bits}")
        self.bits = bits if self.mode.takes_bits else None
        self.fraction = fraction
        self.sat = sat
        self.key = as_key(seed)
        if update_dtype is not None and update_dtype not in _UPDATE_DTYPES:
            raise TypeError(f"update_dtype must be one of {_UPDATE_DTYPES}, not {update_dtype}")
        self.update_dtype = update_dtype
        self.scale = scale
        self.store_codes = store_codes
        self.policy = SeedPolicy(policy)
        self.guard = guard
        self.names, self.params = self._select(params)
        # For a block format the element format is checked: a block's values are elements
        # times a power of two (float32's exponent range), or for NVFP4 a product that the
        # kernel rounds to the dtype anyway.
        element = self.fmt.element if block else self.fmt
        for name, p in zip(self.names, self.params, strict=True):
            for dtype in {p.dtype, update_dtype or p.dtype}:
                if not dtype_format(dtype).contains(element):
                    raise ValueError(f"{name} ({dtype}) cannot hold every value of {element.name}")
        # Every selected parameter shares one dtype: the write-back rounds them together.
        dtypes = {p.dtype for p in self.params} | {p.device.type for p in self.params}
        if len(dtypes) > 2:
            raise ValueError(f"selected parameters mix dtypes or devices ({sorted(map(str, dtypes))}): "
                             "wrap each group in its own LowPrecisionWeights")  # fmt: skip
        #: The dtype ``w + u`` is rounded from.
        self.via = update_dtype or self.params[0].dtype
        self.spec = check_args(self.via, self.fmt, self.mode, sat, self.bits, fraction)
        if block and scale:
            raise ValueError(f"scale=True is for element formats: {self.fmt.name} scales each block itself")
        if self.store_codes and not block and self.fmt.k > 8:
            raise ValueError(f"store_codes keeps uint8 codes; {self.fmt.name} has {self.fmt.k} bits")
        self._codes: list[torch.Tensor] | list[BlockTensor] | None = None
        self._scales: list[float] = [1.0] * len(self.params)
        self._stored = False  # weights held only as codes
        self.steps = 0
        self._write_back()  # Algorithm 1 starts from rounded initial weights

    def _select(self, params) -> tuple[list[str], list[torch.Tensor]]:
        owned = [p for group in self.optimizer.param_groups for p in group["params"]]
        if params is None:
            chosen = [(f"param {i}", p) for i, p in enumerate(owned) if p.dim() >= 2]
        else:
            chosen = [
                item if isinstance(item, tuple) else (f"param {i}", item) for i, item in enumerate(params)
            ]
            ids = {id(p) for p in owned}
            for name, p in chosen:
                if id(p) not in ids:
                    raise ValueError(f"{name} is not among the optimizer's parameters")
        if not chosen:
            raise ValueError("no parameters selected: pass params=")
        return [n for n, _ in chosen], [p for _, p in chosen]

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's zero_grad; restores weights kept as codes first."""
        self.materialize()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        """The inner step (``w + u``), then every selected weight rounded to ``fmt``."""
        self.materialize()
        if self.guard:
            assert_identical_inputs(
                [(f"{name}{part}", t) for name, p in zip(self.names, self.params, strict=True)
                 for part, t in (("", p), (".grad", p.grad)) if t is not None]
            )  # fmt: skip
        loss = self.optimizer.step(closure)
        self.steps += 1
        self._write_back()
        return loss

    # A user's torch.compile of step() compiles the inner optimizer's update; the write-back
    # stays fewbit's own call (its compiled kernel, as eager), not traced into their graph.
    @torch.compiler.disable
    @torch.no_grad()
    def _write_back(self) -> None:
        with configure(compile_threshold=min(current().compile_threshold, COMPILE_FROM)):
            self._round_all()

    def _round_all(self) -> None:
        keys = [
            replica_key(fold_in(self.key, self.steps, i), self.policy) if self.mode.is_stochastic else None
            for i in range(len(self.params))
        ]
        if self.scale:  # powers of two: exact both ways
            self._scales = [self._power_of_two_scale(p) for p in self.params]
            torch._foreach_mul_(self.params, self._scales)
        block = isinstance(self.fmt, BlockFormat)
        if not block and self.fmt.has_nans:
            words = [[0, 0] if k is None else stream_words(self.spec, k) for k in keys]
            round_foreach_(self.params, self.spec, key_tensor(words, self.params[0].device), self.via)
        else:  # fewbit.round raises where a value has no result: a NaN input, say
            extra = {"fraction": self.fraction} if self.mode is RoundMode.SR_FRACTION else {}
            blocks = []
            for p, key in zip(self.params, keys, strict=True):
                sr = {"bits": self.bits, "seed": key, **extra} if key is not None else {}
                if block and self.store_codes:  # the codes of this very rounding (NVFP4's
                    # per-tensor scale would move if the rounded values were quantised again)
                    blocks.append(quantize(p.to(self.via), self.fmt, self.mode, sat=self.sat, **sr))
                else:
                    p.copy_(round_to(p.to(self.via), self.fmt, self.mode, sat=self.sat, **sr))
        if self.store_codes:
            self._codes = blocks if block else [encode(p, self.fmt) for p in self.params]
            for p in self.params:
                p.untyped_storage().resize_(0)
            self._stored = True
        elif self.scale:
            torch._foreach_div_(self.params, self._scales)

    def _power_of_two_scale(self, w: torch.Tensor) -> float:
        amax = float(w.abs().max()) if w.numel() else 0.0
        if amax == 0.0 or not math.isfinite(amax):
            return 1.0
        return 2.0 ** math.floor(math.log2(self.fmt.max / 2 / amax))

    @torch.compiler.disable
    @torch.no_grad()
    def materialize(self) -> None:
        """Decode weights kept as codes back into the parameters (no-op otherwise)."""
        if not self._stored:
            return
        for p, codes, s in zip(self.params, self._codes, self._scales, strict=True):
            p.untyped_storage().resize_(p.numel() * p.element_size())
            if isinstance(codes, BlockTensor):  # as fewbit.block.round gives the values in via
                p.copy_(codes.dequantize(self.via))
            else:
                p.copy_(decode(codes, self.fmt, p.dtype) / s)
        self._stored = False

    def memory(self) -> dict[str, int]:
        """Bytes the selected weights take as floats and as codes of ``fmt`` (a block
        format's: element codes, block scales and any per-tensor scale, BlockTensor.nbytes)."""
        n = sum(p.numel() for p in self.params)
        float_bytes = sum(p.numel() * p.element_size() for p in self.params)
        if isinstance(self.fmt, BlockFormat):  # the shapes alone: quantised on the meta device
            shapes = [torch.empty(p.shape, dtype=self.via, device="meta") for p in self.params]
            code_bytes = sum(quantize(t, self.fmt).nbytes for t in shapes)
        else:
            code_bytes = n * (1 if self.fmt.k <= 8 else 2)
        return {"elements": n, "float_bytes": float_bytes, "code_bytes": code_bytes,
                "saved_bytes": float_bytes - code_bytes}  # fmt: skip

    def _config(self) -> dict:
        return {"fmt": self.fmt.name, "mode": self.mode.value, "bits": self.bits, "fraction": self.fraction,
                "sat": self.sat, "key": (self.key.k0, self.key.k1), "scale": self.scale,
                "update_dtype": str(self.update_dtype), "policy": self.policy.value}  # fmt: skip

    def state_dict(self) -> dict:
        """The inner optimizer's state, the step count and the rounding set-up."""
        return {"optimizer": self.optimizer.state_dict(), "steps": self.steps, "config": self._config()}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next step draws the bits an uninterrupted run would."""
        if state["config"] != self._config():
            raise ValueError(
                f"checkpoint was written with {state['config']}, this wrapper has {self._config()}"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = state["steps"]
