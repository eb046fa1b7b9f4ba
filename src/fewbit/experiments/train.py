"""Train the character GPT with low-precision weights (the paper's Figure 3 experiment).

One run is a :class:`TrainConfig`: model size, optimisation (and, for speed on a GPU,
bfloat16 autocast, a compiled model and fused AdamW), how the weights are kept
(``mode``: ``"fp32"`` for plain training, ``"fp16"`` for the binary16 baseline, or a
rounding mode with ``weight_format`` and ``bits``) and, optionally, how the gradients are
rounded (``grad_format``, an element or block format, with ``grad_mode``: seed 002's
study of SR on gradients in block floating point). Batches are a pure function of
(seed, iteration), so every arm of a sweep sees the same data, and a resumed run the
same batches as an uninterrupted one. Each evaluation also logs the diagnostics of the
step before it (:mod:`.probe`): mean |w| per weight matrix, the fraction of weights the
step changed, the write-back's mean error in ulps.
"""

from __future__ import annotations

import functools
import math
import os
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.utils.deterministic
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..block import BlockFormat, check_args, element_or_block
from ..nn import Quant, quantize_outputs
from ..optim import LowPrecisionWeights
from ..random import as_key, fold_in
from ..rounding.checks import check_bits, check_round_args
from ..rounding.modes import FRACTION_MODES, MODES, RoundMode, modes_text, parse_mode
from .data import CharDataset
from .gpt import GPT, GPTConfig
from .probe import StepProbe, mean_abs

#: TrainConfig's speed options (``fewbit train --fast`` sets them all).
SPEED_OPTIONS = ("autocast", "compile_model", "fused_adamw")
#: Modes of the weights beside fewbit's rounding modes.
PLAIN_MODES = ("fp32", "fp16")
#: The ``fewbit train`` option that sets each field (messages name them).
OPTIONS = {
    "mode": "--mode", "weight_format": "--format", "bits": "--bits", "fraction": "--fraction",
    "update_dtype": "--update-dtype", "grad_format": "--grad-format", "grad_mode": "--grad-mode",
    "grad_bits": "--grad-bits", "grad_fraction": "--grad-fraction", "iters": "--iters",
    "eval_interval": "--eval-interval", "device": "--device",
}  # fmt: skip
UPDATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: Key streams of the gradient rounding: Linear outputs' gradients, weights' gradients.
_OUTPUT_GRADS, _WEIGHT_GRADS = 0, 1


def check_signed(fmt: str, name: str) -> None:
    """Refuse an unsigned format (``name`` says whose) for weights or gradients, which take
    both signs."""
    if not getattr(element_or_block(fmt), "signed", True):
        raise ValueError(f"{name} {fmt!r} is unsigned: every negative value would round to its smallest; "
                         "give a signed format")


@dataclass(frozen=True)
class TrainConfig:
    # model
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    dropout: float = 0.0
    # optimisation (AdamW, linear warm-up then cosine decay to min_lr, as nanoGPT)
    batch_size: int = 32
    iters: int = 1500
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # speed (other bits, same experiment): the forward pass in bfloat16 autocast, the model
    # through torch.compile, torch's fused AdamW
    autocast: bool = False
    compile_model: bool = False
    fused_adamw: bool = False
    # evaluation
    eval_interval: int = 100
    eval_iters: int = 10
    # weights
    mode: str = "src"
    weight_format: str = "binary8p4"
    bits: int | None = 3
    fraction: float | None = None
    update_dtype: str = "bf16"
    # gradients: None keeps them float32; else the gradient reaching every Linear's output
    # and the weights' gradients (2+ dimensions) are rounded to grad_format, in blocks
    # along the last dimension for a block format (fewbit.nn.Quant's arguments)
    grad_format: str | None = None
    grad_mode: str = "rne"
    grad_bits: int | None = 8
    grad_fraction: float | None = None
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("mode", "grad_mode"):  # one spelling each, as of a format (below)
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, getattr(self, name).lower())
        check_mode(self.mode)
        if self.update_dtype not in UPDATE_DTYPES:
            known = sorted(UPDATE_DTYPES)
            raise ValueError(f"update_dtype must be one of {known}, not {self.update_dtype!r}")
        if self.mode not in PLAIN_MODES and isinstance(element_or_block(self.weight_format), BlockFormat):
            raise ValueError(f"weight_format {self.weight_format!r} is a block format: these runs keep "
                             "element-format weights (block formats go to grad_format, or, for weights, "
                             "to LowPrecisionWeights and `fewbit replicas --fsdp --format`)")  # fmt: skip
        for name in ("weight_format", "grad_format"):  # (weights and gradients take both signs)
            fmt = getattr(self, name)
            if fmt is None or (name == "weight_format" and self.mode in PLAIN_MODES):
                continue
            check_signed(fmt, name)
            # One spelling per format ("e4m3" is "ocp_e4m3", "BINARY8P4" "binary8p4"): two
            # spellings trained one run twice in two folders, or were "another configuration".
            object.__setattr__(self, name, element_or_block(fmt).name)
        if self.mode not in PLAIN_MODES:
            # The write-back's own checks, here: a bad format, N or p is reported before
            # any worker starts, in fewbit.round's words.
            probe = torch.empty(0, dtype=UPDATE_DTYPES[self.update_dtype])
            bits = self.bits if parse_mode(self.mode).takes_bits else None
            check_round_args(probe, self.weight_format, self.mode, True, bits, self.fraction)
        takes_fraction = self.grad_format is not None and parse_mode(self.grad_mode).takes_fraction
        if takes_fraction and self.grad_fraction is None:  # (Quant would ask for fraction=p: the weights')
            raise TypeError(f"grad_mode {parse_mode(self.grad_mode).value!r} needs grad_fraction=p, "
                            "a number in [0, 1]")
        if (q := self.grad_quant) is not None:  # the same, for the gradients' rounding
            check_args(torch.float32, q.fmt, q.mode, q.sat, q.bits, q.fraction)
        for name in ("bits", "grad_bits"):  # (range-checked by LowPrecisionWeights and Quant in any mode)
            check_bits(getattr(self, name), name)
        as_key(self.seed)  # the run's key: a seed outside [0, 2**64) raises there
        try:
            device = torch.device(self.device)
            kind = device.type if device.type == "cuda" or device.index is None else None  # (no cpu:N)
        except RuntimeError:
            kind = None
        if kind not in ("cpu", "cuda"):  # the devices runs are written (and tested) for
            raise ValueError(f"device must be 'cpu' or 'cuda' ('cuda:N': one of several GPUs), "
                             f"not {self.device!r}")  # fmt: skip
        for name in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "iters", "eval_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")

    @property
    def grad_quant(self) -> Quant | None:
        """The gradients' rounding, or None (float32 gradients)."""
        if self.grad_format is None:
            return None
        bits = self.grad_bits if parse_mode(self.grad_mode).takes_bits else None
        return Quant(self.grad_format, self.grad_mode, bits=bits, fraction=self.grad_fraction)

    @property
    def label(self) -> str:
        """A short name for plots: the weight format and mode, then the gradients'."""
        weights = {"fp32": "binary32", "fp16": "binary16"}.get(self.mode)
        if weights is None:
            weights = rounding_label(self.weight_format, self.mode, self.bits, self.fraction,
                                     self.update_dtype)  # fmt: skip
        if self.grad_format is None:
            return weights
        grads = rounding_label(self.grad_format, self.grad_mode, self.grad_bits, self.grad_fraction)
        return f"{grads} grads" if self.mode == "fp32" else f"{weights}, {grads} grads"


def check_mode(mode: str) -> None:
    """Raise ValueError unless ``mode`` is one of the weights' modes, in lower case (a run's
    folder and config.json name it as given)."""
    modes = [*PLAIN_MODES, *RoundMode]
    if mode not in modes:
        raise ValueError(f"mode must be one of {', '.join(modes)}; got {mode!r}")


def unused_fields(mode: str, grad_format: str | None, grad_mode: str) -> dict[str, str]:
    """The rounding fields that a run with these weights' and gradients' modes does not
    read, each with why and what to do (``fewbit train`` refuses them when given)."""
    check_mode(mode)
    unused = {}
    if mode in PLAIN_MODES:
        kept = "keeps float32 weights" if mode == "fp32" else "rounds the weights to binary16 with RNE"
        unused |= dict.fromkeys(("weight_format", "bits", "fraction", "update_dtype"),
                                f"--mode {mode} {kept}; leave it out")  # fmt: skip
    else:
        unused |= _unused_by_mode("", mode)
    if grad_format is None:
        why = "the --grad-* options round the gradients of --grad-format; give it"
        unused |= dict.fromkeys(("grad_mode", "grad_bits", "grad_fraction"), why)
    else:
        unused |= _unused_by_mode("grad_", grad_mode)
    return unused


def _unused_by_mode(prefix: str, mode: str) -> dict[str, str]:
    """``{prefix}bits`` where rounding mode ``mode`` takes no N, ``{prefix}fraction``
    where it is not sr_fraction (prefix ``"grad_"``: the gradients' fields)."""
    m = parse_mode(mode)
    unused = {}
    if not m.takes_bits:
        how = "is deterministic" if MODES[m].bits == "none" else "takes its N from the formats"
        unused[f"{prefix}bits"] = f"{prefix}mode {mode!r} {how}; leave it out"
    if not m.takes_fraction:
        unused[f"{prefix}fraction"] = (f"only {prefix}{modes_text(FRACTION_MODES)} takes p, not {mode!r}; "
                                       "leave it out")
    return unused


def rounding_label(fmt: str, mode: str, bits: int | None, fraction: float | None = None,
                   update_dtype: str = "bf16") -> str:  # fmt: skip
    """``binary8p4 SRF N=3``: a rounding's name in tables and plots; updates in another
    dtype than the paper's bfloat16 are named (``... fp32 updates``)."""
    m = parse_mode(mode)
    extra = ""
    if m.takes_fraction:  # all p's digits where 6 do not give it: a run's folder is named by it
        short = f"{fraction:g}"
        extra = f" p={short if float(short) == fraction else repr(fraction)}"
    n = f" N={bits}" if m.takes_bits else ""
    updates = "" if update_dtype == "bf16" else f" {update_dtype} updates"
    return f"{fmt} {mode.upper()}{n}{extra}{updates}"


PRESETS: dict[str, TrainConfig] = {
    # Minutes on 2 CPU cores (see the README for what it shows).
    "cpu-small": TrainConfig(),
    # nanoGPT's shakespeare-char model, as the paper ran it: for a GPU.
    # bfloat16 autocast, compiled, fused AdamW: the update dtype and the write-back stay the paper's.
    "paper": TrainConfig(n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.2, batch_size=64,
                         iters=5000, lr=1e-3, min_lr=1e-4, warmup=100, eval_interval=250, eval_iters=200,
                         autocast=True, compile_model=True, fused_adamw=True, device="cuda"),  # fmt: skip
    # The paper's Figure 4 model shape (GPT-2 medium: 24 layers, 16 heads, 1024 wide, about
    # 300M parameters with this vocabulary) on the same text, for as many steps as a GPU
    # budget allows (the paper ran 30,000 on its own data): for a GPU.
    "gpt2-medium": TrainConfig(n_layer=24, n_head=16, n_embd=1024, block_size=256, batch_size=32,
                               iters=2000, lr=3e-4, min_lr=3e-5, warmup=100, eval_interval=100,
                               eval_iters=40, autocast=True, compile_model=True, fused_adamw=True,
                               device="cuda"),  # fmt: skip
    # Seconds: for tests and smoke checks.
    "tiny": TrainConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=8, iters=20,
                        warmup=2, eval_interval=10, eval_iters=2),  # fmt: skip
}


@dataclass
class History:
    """Losses at each evaluation: train is the mean minibatch loss since the last one;
    ``diagnostics``: at each evaluation, the rows of :mod:`.probe` for the step before
    it (each with its ``iter``)."""

    iters: list[int] = field(default_factory=list)
    train: list[float] = field(default_factory=list)
    val: list[float] = field(default_factory=list)
    diagnostics: list[dict] = field(default_factory=list)

    def add(self, it: int, train: float, val: float) -> None:
        self.iters.append(it)
        self.train.append(train)
        self.val.append(val)


def batch_generator(seed: int, it: int) -> torch.Generator:
    """The generator of iteration ``it``'s batch: the same for every arm of a seed."""
    return torch.Generator().manual_seed(zlib.crc32(f"batch|{seed}|{it}".encode()))


@contextmanager
def same_bits(device: torch.device) -> Iterator[None]:
    """On a GPU, the kernels whose bits do not depend on the order in which the device's
    threads happen to run: torch's deterministic algorithms, so that Inductor lowers the
    embedding's backward without atomic adds and picks its reduction kernels' blocks
    without timing them (warn only: an op without a deterministic kernel still runs), and
    attention by the math backend (cuDNN's and flash's backward add with atomics, which
    warn only still lets them do). torch.empty is left unfilled, as usual. An
    H200 gave a resumed run of the paper preset's speed options other weights than the
    uninterrupted run (a layer norm's bias, 2026-11-29). On a CPU nothing changes: its
    kernels give the same bits every run (and the README's CPU figures stay those runs')."""
    if device.type != "cuda":
        yield
        return
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    filled = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        torch.utils.deterministic.fill_uninitialized_memory = filled


def learning_rate(cfg: TrainConfig, it: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_lr`` (nanoGPT's)."""
    if it < cfg.warmup:
        return cfg.lr * (it + 1) / cfg.warmup
    progress = min(1.0, (it - cfg.warmup) / max(1, cfg.iters - cfg.warmup))
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


class Run:
    """Model, optimizer and low-precision wrapper of one training run, resumable."""

    def __init__(self, cfg: TrainConfig, data: CharDataset):
        self.cfg, self.data = cfg, data
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda":
            # cuBLAS's workspace as deterministic algorithms want it (torch reads this once,
            # at the process's first matrix product; else same_bits warns at every one).
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.manual_seed(cfg.seed)
        self.model = GPT(GPTConfig(len(data.vocab), cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd,
                                   cfg.dropout)).to(cfg.device)  # fmt: skip
        if cfg.compile_model:
            self.model.compile()  # in place: the state_dict keeps its keys
        self.matrices = [(n, p) for n, p in self.model.named_parameters() if p.dim() >= 2]
        others = [p for p in self.model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for _, p in self.matrices], "weight_decay": cfg.weight_decay},
             {"params": others, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(0.9, 0.99), fused=cfg.fused_adamw or None,
        )  # fmt: skip
        self.weights = self._wrap()
        written_to = {"fp32": None, "fp16": "binary16"}.get(cfg.mode, cfg.weight_format)
        self.probe = StepProbe(self.optimizer, self.matrices, written_to)
        self.grad_quant = cfg.grad_quant
        if self.grad_quant is not None:
            key = as_key(cfg.seed)
            # Backward of each Linear's output: its FakeQuantize child counts calls in the
            # model's state_dict, so a resumed run draws the same bits.
            quantize_outputs(self.model, None, self.grad_quant, seed=fold_in(key, _OUTPUT_GRADS))
            self._grad_key = fold_in(key, _WEIGHT_GRADS)
        self.it = 0
        self.history = History()
        self._since_eval: list[float] = []
        self._losses: list[torch.Tensor] = []  # on the device until an evaluation reads them

    def _wrap(self) -> LowPrecisionWeights | None:
        cfg = self.cfg
        if cfg.mode == "fp32":
            return None
        if cfg.mode == "fp16":
            return LowPrecisionWeights(self.optimizer, "binary16", "rne", bits=None, params=self.matrices)
        return LowPrecisionWeights(
            self.optimizer, cfg.weight_format, cfg.mode, bits=cfg.bits, seed=cfg.seed, params=self.matrices,
            fraction=cfg.fraction, update_dtype=UPDATE_DTYPES[cfg.update_dtype],
        )  # fmt: skip

    @property
    def stepper(self):
        return self.weights or self.optimizer

    def train_step(self) -> torch.Tensor:
        """One step; its minibatch loss (a tensor on the device: a step waits for nothing
        on the GPU, the losses are read at the next evaluation)."""
        cfg = self.cfg
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(cfg, self.it)
        x, y = self.data.batch("train", cfg.batch_size, cfg.block_size, batch_generator(cfg.seed, self.it))
        self.model.train()
        with same_bits(self.device):
            loss = self._loss(x, y)
            self.stepper.zero_grad(set_to_none=True)
            loss.backward()
            self._round_weight_grads()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            self.stepper.step()
        self.it += 1
        self._losses.append(loss.detach())
        return self._losses[-1]

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        pinned = self.device.type == "cuda"  # to the GPU from pinned memory, without waiting for it
        x, y = ((t.pin_memory() if pinned else t).to(self.device, non_blocking=pinned) for t in (x, y))
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.cfg.autocast):
            return self.model(x, y)[1]

    def _read_losses(self) -> None:
        if self._losses:
            self._since_eval += torch.stack(self._losses).tolist()
            self._losses.clear()

    @torch.no_grad()
    def _round_weight_grads(self) -> None:
        """Weights' gradients to the gradient format, as a block-FP backward pass would hand
        them to the (float32) optimizer: before clipping, which is the optimizer's. Iteration
        t rounds matrix i with ``fold_in(seed, _WEIGHT_GRADS, t, i)``."""
        if self.grad_quant is None:
            return
        matrices = [p for p in self.model.parameters() if p.dim() >= 2]
        for i, p in enumerate(matrices):
            if p.grad is not None:
                p.grad = self.grad_quant(p.grad, fold_in(self._grad_key, self.it, i))

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over fixed batches (the same for every run and time)."""
        cfg = self.cfg
        self.model.eval()
        losses = []
        for i in range(cfg.eval_iters):
            x, y = self.data.batch("val", cfg.batch_size, cfg.block_size, batch_generator(-1, i))
            with same_bits(self.device):  # (the compiled model's guards see one setting)
                losses.append(self._loss(x, y).item())
        return sum(losses) / len(losses)

    def _evaluates_at(self, it: int) -> bool:
        return it % self.cfg.eval_interval == 0 or it == self.cfg.iters

    def run(self, until: int | None = None, on_eval: Callable[[Run], None] | None = None) -> History:
        """Train to iteration ``until`` (default: cfg.iters), evaluating every eval_interval."""
        until = self.cfg.iters if until is None else until
        if self.it == 0 and not self.history.iters:
            self.history.add(0, float("nan"), self.evaluate())
            self.history.diagnostics += [{"iter": 0, **row} for row in mean_abs(self.matrices)]
            on_eval and on_eval(self)
        while self.it < until:
            if self._evaluates_at(self.it + 1):
                self.probe.arm()
            self.train_step()
            if self._evaluates_at(self.it):
                self._read_losses()
                train = sum(self._since_eval) / len(self._since_eval)
                self._since_eval.clear()
                self.history.add(self.it, train, self.evaluate())
                self.history.diagnostics += [{"iter": self.it, **row} for row in self.probe.read()]
                on_eval and on_eval(self)
        return self.history

    def state_dict(self) -> dict:
        self._read_losses()
        return {
            "config": asdict(self.cfg),
            "it": self.it,
            "model": self.model.state_dict(),
            "optimizer": self.stepper.state_dict(),
            "history": asdict(self.history),
            "since_eval": list(self._since_eval),
            "torch_rng": torch.get_rng_state(),  # dropout draws from it
            # (on a GPU, dropout draws from its generator). A CPU run reads none: reading them
            # started CUDA in each worker of a CPU sweep on a machine with GPUs, and failed where
            # they were busy.
            "cuda_rng": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else [],
        }

    def load_state_dict(self, state: dict) -> None:
        if state["config"] != asdict(self.cfg):
            raise ValueError("checkpoint was written by a run with another configuration")
        self.model.load_state_dict(state["model"])
        self.stepper.load_state_dict(state["optimizer"])
        self.it = state["it"]
        self.history = History(**state["history"])
        self._since_eval = list(state["since_eval"])
        torch.set_rng_state(state["torch_rng"])
        if self.device.type == "cuda":
            # The run's GPU's generator alone, by its index as the checkpoint listed them: all of
            # them raised IndexError on a machine with fewer GPUs than the one that saved it.
            index = torch.cuda.current_device() if self.device.index is None else self.device.index
            torch.cuda.set_rng_state(state["cuda_rng"][index], index)


def time_steps(cfg: TrainConfig, data: CharDataset, steps: int = 20, rounds: int = 5,
               warmup: int = 3) -> dict[str, float]:  # fmt: skip
    """Seconds per training step of ``cfg`` (``"with"``: its write-back) and of the same
    run with float32 weights and no ``LowPrecisionWeights`` (``"without"``), and seconds of
    the write-back alone (``"write_back"``: from the end of the inner optimizer's step to
    the end of the training step, the device synchronised at both ends, in steps of their
    own so that the syncs do not slow the others; ``"write_back_host"``: from the same
    start until ``LowPrecisionWeights.step`` returns, the write-back's host time without
    what the training step does after it). Each is the median of ``rounds`` timings of
    ``steps`` steps, taking turns so that all see the same machine; ``warmup`` steps first
    (compilation)."""
    if cfg.mode == "fp32":
        raise ValueError("time_steps times a run's write-back, and mode fp32 has none")
    runs = {"with": Run(cfg, data), "without": Run(replace(cfg, mode="fp32"), data)}
    device = torch.device(cfg.device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    inner_done: list[float] = []
    wrapper_returned = [0.0]

    def stamp(*_) -> None:
        if inner_done:  # armed: an empty list is not
            sync()
            inner_done[:] = [time.perf_counter()]

    def step_stamped(step, *args, **kwargs):
        loss = step(*args, **kwargs)
        wrapper_returned[0] = time.perf_counter()
        return loss

    runs["with"].optimizer.register_step_post_hook(stamp)
    weights = runs["with"].weights
    weights.step = functools.partial(step_stamped, weights.step)  # this run's alone: a timing harness
    for run in runs.values():
        for _ in range(warmup):
            run.train_step()
    seconds: dict[str, list[float]] = {"with": [], "without": [], "write_back": [], "write_back_host": []}
    for _ in range(rounds):
        for name, run in runs.items():
            sync()
            start = time.perf_counter()
            for _ in range(steps):
                run.train_step()
            sync()
            seconds[name].append((time.perf_counter() - start) / steps)
        total = host = 0.0
        for _ in range(steps):
            inner_done[:] = [0.0]
            runs["with"].train_step()
            sync()
            total += time.perf_counter() - inner_done[0]
            host += wrapper_returned[0] - inner_done[0]
        inner_done.clear()
        seconds["write_back"].append(total / steps)
        seconds["write_back_host"].append(host / steps)
    return {k: sorted(v)[len(v) // 2] for k, v in seconds.items()}


def config_from(preset: str, **overrides) -> TrainConfig:
    """A preset with some fields replaced (None values are ignored)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    return replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})
