"""Sharded training (FSDP2, HSDP) of the character GPT, bit for bit against one process.

Every step trains on a global batch of ``micro_batches`` micro-batches (4 by default).
One process (no torch.distributed) computes each micro-batch's gradient by itself and
adds them with ``fewbit.sharding.pairwise_sum``: ((g0 + g1) + (g2 + g3)) / 4. Under
FSDP2 on W ranks (W = 2 or 4), rank r's backward pass p takes micro-batch ``p W + r``;
``PairwiseReduceScatter`` (``reduce_exactly``, on each block FSDP2 shards and the rest)
adds the ranks' gradients in that same tree, and FSDP2 adds
the (at most two) passes, so every rank ends the backward with its shard of the very
same gradient (divisions by 4 are exact). AdamW is elementwise, and
``LowPrecisionWeights`` rounds each piece with the bits of its global indices: the full
weights equal the single process's after every step, whatever the placement.

Gradient clipping is left out: its global norm is another reduction whose order
depends on the sharding.
"""

from __future__ import annotations

import hashlib
import math
import time
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch

import fewbit

from ..nn import Quant
from ..optim import LowPrecisionWeights
from ..random import Key
from ..replicas import ReplicaDriftError, check_in_sync, drift_report
from ..rounding.checks import check_round_args
from ..rounding.compiled import stream_words
from ..scaled import ScaledTensor, scalify
from ..sharding import (
    global_bits,
    is_dtensor,
    layout,
    local_tensor,
    pairwise_sum,
    placement_offsets,
    reduce_exactly,
    torch_offsets,
)  # fmt: skip
from .gpt import GPT, GPTConfig
from .train import PRESETS, learning_rate

#: The tiny preset (1 layer, 2 heads, 32 wide, batches of 8): its model and schedule.
TINY = PRESETS["tiny"]
#: What LowPrecisionWeights holds w + u in (RNE) before rounding it to the weights' format.
UPDATE_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class ShardedRun:
    steps: int = 50  #: the learning-rate schedule's length
    until: int | None = None  #: stop after this many steps (default: steps)
    seed: int = 0
    fmt: str = "binary8p4"
    mode: str = "src"
    bits: int = 3
    placement: int = 0  #: Shard(placement) for every parameter of two or more dimensions
    hsdp: bool = False  #: a (2, W / 2) mesh: replicate x shard
    policy: str = "default"  #: or "differing-update": the update keyed with the rank (wrong)
    guard: bool = False
    store_codes: bool = False  #: keep the weights as uint8 codes between steps
    scale: bool = False  #: LowPrecisionWeights(scale=True): power-of-two scale per tensor
    #: "scalified": parameters as ScaledTensors (fewbit.scaled.scalify, float32 data) trained by
    #: SGD with momentum (as fewbit.experiments.scaled_demo), no LowPrecisionWeights
    params: str = "low-precision"
    micro_batches: int = 4
    hash_every: int = 1  #: record the hash of the full weights every this many steps
    data: str = "synthetic"  #: or the path of a prepared Shakespeare dataset
    vocab: int = 30  #: synthetic data: uneven shards of the embedding on 4 ranks
    block_size: int = 15
    save_at: int | None = None  #: save with torch.distributed.checkpoint after this many steps
    checkpoint_dir: str | None = None
    resume: bool = False  #: start from the checkpoint in checkpoint_dir

    def __post_init__(self) -> None:
        if self.policy not in ("default", "differing-update"):
            raise ValueError(f"policy must be 'default' or 'differing-update', not {self.policy!r}")
        if self.params not in ("low-precision", "scalified"):
            raise ValueError(f"params must be 'low-precision' or 'scalified', not {self.params!r}")
        if self.micro_batches < 1 or self.micro_batches & (self.micro_batches - 1):
            raise ValueError(f"micro_batches must be a power of two, got {self.micro_batches}")


def check_world(cfg: ShardedRun, world_size: int) -> None:
    """The world sizes the exactness argument covers: 2^k ranks, one or two passes."""
    m = cfg.micro_batches
    if world_size & (world_size - 1) or m % world_size or m // world_size > 2 or world_size > m:
        raise ValueError(f"sharded runs take a power of two ranks with micro_batches / ranks in (1, 2); "
                         f"got {world_size} rank{'s' * (world_size != 1)} for {m} micro-batches")  # fmt: skip


class Batches:
    """Micro-batch m of step t, the same in every process: Shakespeare windows, or
    synthetic sequences (arithmetic progressions modulo the vocabulary: learnable)."""

    def __init__(self, cfg: ShardedRun):
        self.cfg = cfg
        self.dataset = None
        if cfg.data != "synthetic":
            from .data import CharDataset

            self.dataset = CharDataset.load(Path(cfg.data))

    @property
    def vocab(self) -> int:
        return len(self.dataset.vocab) if self.dataset else self.cfg.vocab

    def __call__(self, step: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        size = TINY.batch_size // cfg.micro_batches
        g = torch.Generator().manual_seed(zlib.crc32(f"sharded|{cfg.seed}|{step}|{m}".encode()))
        if self.dataset is not None:
            return self.dataset.batch("train", size, cfg.block_size, g)
        start, stride = torch.randint(cfg.vocab, (2, size, 1), generator=g)
        seq = (start + stride * torch.arange(cfg.block_size + 1)) % cfg.vocab
        return seq[:, :-1], seq[:, 1:]


def build(cfg: ShardedRun, vocab: int, world_size: int | None):
    """Model, AdamW and LowPrecisionWeights (or for scalified parameters, SGD); sharded
    with FSDP2 on ``world_size`` ranks (None: one process, no torch.distributed)."""
    from torch.distributed.tensor import Shard

    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(vocab, cfg.block_size, TINY.n_layer, TINY.n_head, TINY.n_embd))
    if cfg.params == "scalified":  # before sharding: FSDP2 shards the ScaledTensors
        scalify(model)
    if world_size is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if cfg.hsdp:
            mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
        matrix_shard = Shard(cfg.placement)

        def placement(p: torch.Tensor) -> Shard:
            return matrix_shard if p.dim() >= 2 else Shard(0)

        for module in (*model.blocks, model):  # block by block, as large models are, then the rest
            fully_shard(module, mesh=mesh, shard_placement_fn=placement)
        reduce_exactly(model, cfg.micro_batches)  # sums, then one exact division
    if cfg.params == "scalified":
        return model, torch.optim.SGD(model.parameters(), lr=TINY.lr, momentum=0.9)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": TINY.weight_decay}, {"params": others, "weight_decay": 0.0}],
        lr=TINY.lr, betas=(0.9, 0.99), foreach=True,
    )  # fmt: skip
    named = [(n, p) for n, p in model.named_parameters() if p.dim() >= 2]
    weights = LowPrecisionWeights(
        opt, cfg.fmt, cfg.mode, bits=cfg.bits, seed=cfg.seed, params=named, update_dtype=UPDATE_DTYPE,
        policy="differing" if cfg.policy == "differing-update" else "identical", guard=cfg.guard,
        store_codes=cfg.store_codes, scale=cfg.scale,
    )  # fmt: skip
    return model, weights


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a collective for sharded ones), a ScaledTensor as its value."""
    return {n: _whole(p).detach() for n, p in model.named_parameters()}


def _whole(p: torch.Tensor) -> torch.Tensor:
    if not is_dtensor(p):
        return p.dequantize() if isinstance(p, ScaledTensor) else p
    from torch.distributed.tensor import DTensor

    piece = DTensor.from_local(_whole(p.to_local()), p.device_mesh, p.placements, run_check=False,
                               shape=p.shape, stride=p.stride())  # fmt: skip
    return piece.full_tensor()


def weights_hash(weights: dict[str, torch.Tensor]) -> str:
    """16 hex digits of a hash of the weights' names, shapes and raw bits."""
    h = hashlib.blake2b(digest_size=8)
    for name, w in weights.items():
        h.update(f"{name}{tuple(w.shape)}{w.dtype}".encode())
        h.update(w.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _set_lr(weights: LowPrecisionWeights | torch.optim.Optimizer, step: int, steps: int) -> None:
    for group in weights.param_groups:
        group["lr"] = learning_rate(replace(TINY, iters=steps), step)


def train_single(cfg: ShardedRun) -> dict:
    """The run in this process: each micro-batch's gradient, then their pairwise sum. On
    one thread, as each rank runs: CPU kernels split their sums by thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_single(cfg)
    finally:
        torch.set_num_threads(threads)


def _train_single(cfg: ShardedRun) -> dict:
    batches = Batches(cfg)
    model, weights = build(cfg, batches.vocab, None)
    params = list(model.parameters())
    hashes = []
    for step in range(cfg.until or cfg.steps):
        _set_lr(weights, step, cfg.steps)
        grads = []
        for m in range(cfg.micro_batches):
            weights.zero_grad()
            model(*batches(step, m))[1].backward()
            grads.append([p.grad for p in params])
        for p, parts in zip(params, zip(*grads, strict=True), strict=True):
            p.grad = pairwise_sum(list(parts)).div_(cfg.micro_batches)
        weights.step()
        if (step + 1) % cfg.hash_every == 0:
            hashes.append(weights_hash(full_weights(model)))
    return {"hashes": hashes, "weights": {n: w.numpy().copy() for n, w in full_weights(model).items()},
            "scales": scales(model)}  # fmt: skip


def _checkpoint(model, weights) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {"model": get_model_state_dict(model), "weights": weights.state_dict(model)}


def train_sharded(rank: int, world_size: int, cfg: ShardedRun) -> dict:
    """One rank of the FSDP2 run (``fewbit.experiments.replicas.launch`` starts them)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    began = time.perf_counter()
    check_world(cfg, world_size)
    batches = Batches(cfg)
    try:
        model, weights = build(cfg, batches.vocab, world_size)
    except ValueError as err:  # a set-up LowPrecisionWeights refuses (alike on every rank)
        return {"error": str(err)}
    start = 0
    if cfg.resume:
        state = _checkpoint(model, weights)  # the shapes to load into, on this many ranks
        dcp.load(state, checkpoint_id=cfg.checkpoint_dir)
        set_model_state_dict(model, state["model"])
        weights.load_state_dict(state["weights"], model)
        start = weights.steps
    hashes, log, codes = [], [], None
    for step in range(start, cfg.until or cfg.steps):
        _set_lr(weights, step, cfg.steps)
        weights.zero_grad()
        for p in range(cfg.micro_batches // world_size):
            model(*batches(step, p * world_size + rank))[1].backward()
        try:
            weights.step()
        except ReplicaDriftError as err:  # the guard: raised alike on every rank
            return {"error": str(err), "step": step + 1}
        if cfg.store_codes:  # the weights are codes until zero_grad(); read them back now
            # (a block format's: BlockTensors; None for a weight without a gradient, left as floats)
            codes = sum(math.prod(c.shape) for c in weights._codes if c is not None)
            weights.materialize()
        if cfg.save_at is not None and step + 1 == cfg.save_at:
            dcp.save(_checkpoint(model, weights), checkpoint_id=cfg.checkpoint_dir)
        if cfg.hsdp:  # only replicas have something to compare
            sync = check_in_sync(model)
            entry = {"step": step + 1, "in_sync": bool(sync), "first": sync.first, "status": str(sync)}
            if not sync:  # how far apart, in ulps of the weight format
                entry["max_ulps"] = max(drift_report(model, fmt=cfg.fmt).values())
            log.append(entry)
        if (step + 1) % cfg.hash_every == 0:
            hashes.append(weights_hash(full_weights(model)))
    sync = check_in_sync(model)
    full = {n: w.numpy().copy() for n, w in full_weights(model).items()}
    return {"hashes": hashes, "log": log, "sync": (bool(sync), str(sync)), "codes": codes,
            "weights": full if rank == 0 else {}, "scales": scales(model),
            "seconds": time.perf_counter() - began}  # fmt: skip


def scales(model: torch.nn.Module) -> dict[str, float | None]:
    """The scale of each parameter that this rank holds (a piece of) as a ScaledTensor:
    a number for one scale, None for a per-channel one."""
    found = {}
    for n, p in model.named_parameters():
        t = local_tensor(p)
        if isinstance(t, ScaledTensor):
            found[n] = float(t.scale) if t.scale.numel() == 1 else None
    return found


@dataclass(frozen=True)
class LayoutProbe:
    """Where the pieces of tensors of ``shapes`` lie, for each placement, as the data say
    and as fewbit computes; for tests (``run``)."""

    shapes: tuple[tuple[int, ...], ...] = ((5, 8), (8, 6), (3, 4, 6), (2, 1030))
    bits: int = 3
    seed: int = 11


def probe_layouts(rank: int, world_size: int, cfg: LayoutProbe) -> dict:
    """For every shape and placement: the global indices of this rank's piece read from
    the data (the full tensor holds its own indices), from ``layout``, torch's and the
    fallback's offsets, and the bits ``global_bits`` gives the piece."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    meshes = {"1d": init_device_mesh("cpu", (world_size,))}
    if world_size == 4:
        meshes["2x2"] = init_device_mesh("cpu", (2, 2))
    spec = check_round_args(torch.empty(0), "binary8p4", "src", True, cfg.bits, None)
    words = stream_words(spec, Key.from_seed(cfg.seed))
    cases = []
    for shape in cfg.shapes:
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
        for name, mesh in meshes.items():
            for placements in _placements(mesh.ndim, len(shape), Shard, Replicate):
                dt = distribute_tensor(full, mesh, placements)
                piece = layout(dt)
                cases.append({
                    "shape": shape, "mesh": name, "placements": str(placements),
                    "from_data": dt.to_local().reshape(-1).long().numpy(),
                    "from_layout": piece.flat_indices().numpy(),
                    "runs": piece.runs(),
                    "torch": torch_offsets(dt), "fallback": placement_offsets(dt),
                    "bits": global_bits(spec, words, piece, "cpu").reshape(-1).numpy(),
                })  # fmt: skip
    return {"cases": cases, "weights": {}}


@dataclass(frozen=True)
class TensorParallelProbe:
    """Fake quantisation of DTensor activations (tensor parallelism), for tests (``run``):
    ``FakeQuantize(q, q, seed)`` on a tensor drawn from ``data_seed``, for each layout of
    :data:`TP_CASES`, then the backward pass of a gradient drawn alike. Each rank
    returns the full output and input gradient (gathered) per case, or the error."""

    fmt: str = "binary8p4"
    mode: str = "src"
    bits: int = 3
    seed: int = 5
    data_seed: int = 1
    shape: tuple[int, int] = (6, 10)


#: name -> (mesh, format, shape or None for the probe's, x's placement, the gradient's):
#: "tp" is one mesh of every rank (their pieces make one tensor); "dp x tp" a (2, W / 2)
#: mesh whose rows are data-parallel replicas, each holding its own tensor on its "tp"
#: row. A Partial gradient is the ranks' equal shares of it.
TP_CASES = {
    "shard0": ("tp", None, None, "S0", "S0"),
    "shard1, gradient replicated": ("tp", None, None, "S1", "R"),
    "replicated, gradient partial": ("tp", None, None, "R", "P"),
    "replicated": ("tp", None, None, "R", "R"),
    "data-parallel replicas": ("dp x tp", None, None, "S1", "S1"),
    "mx blocks, shard0": ("tp", "mxfp8_e4m3", (4, 64), "S0", "S0"),
    "mx blocks cut at 32, shard1": ("tp", "mxfp8_e4m3", (4, 64), "S1", "S1"),
    "mx blocks straddling ranks": ("tp", "mxfp8_e4m3", (4, 32), "S1", "S1"),
    "nvfp4, shard1, gradient partial": ("tp", "nvfp4", (4, 64), "S1", "P"),
}


def tp_data(cfg: TensorParallelProbe, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The probe's input and gradient of ``shape`` (the same in every process)."""
    g = torch.Generator().manual_seed(cfg.data_seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def probe_tensor_parallel(rank: int, world_size: int, cfg: TensorParallelProbe) -> dict:
    """Each case of :data:`TP_CASES` on this rank (see :class:`TensorParallelProbe`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from ..nn import FakeQuantize

    meshes = {"tp": init_device_mesh("cpu", (world_size,)),
              "dp x tp": init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))["tp"]}
    placement = {"S0": Shard(0), "S1": Shard(1), "R": Replicate(), "P": Partial()}
    out = {}
    for name, (mesh_name, fmt, shape, x_at, grad_at) in TP_CASES.items():
        mesh = meshes[mesh_name]
        x_full, g_full = tp_data(cfg, shape or cfg.shape)
        q = Quant(fmt or cfg.fmt, cfg.mode, bits=cfg.bits)
        x = distribute_tensor(x_full, mesh, [placement[x_at]]).requires_grad_()
        if grad_at == "P":  # halves: exact, and their sum is the gradient
            grad = DTensor.from_local(g_full / mesh.size(), mesh, [Partial()], run_check=False)
        else:
            grad = distribute_tensor(g_full, mesh, [placement[grad_at]])
        try:
            y = FakeQuantize(q, q, seed=cfg.seed)(x)
        except ValueError as err:  # a layout fewbit refuses (alike on every rank)
            out[name] = {"error": str(err)}
            continue
        y.backward(grad)
        out[name] = {"y": y.detach().full_tensor().numpy(), "grad": x.grad.full_tensor().numpy(),
                     "placements": (str(y.placements), str(x.grad.placements))}  # fmt: skip
    return {"cases": out, "weights": {}}


@dataclass(frozen=True)
class OpsProbe:
    """fewbit's public ops on DTensors, for tests (``run``): each case of :data:`OPS_CASES`
    on a tensor drawn from ``data_seed``, on a mesh of every rank. Each rank returns the
    full result per case (gathered), or the error."""

    data_seed: int = 2


def _round_src(x, like):
    return fewbit.round(x, "binary8p4", "src", bits=3, seed=5)


def _sr_fraction(x, like):
    return fewbit.round(x, "binary8p4", "sr_fraction", bits=4, fraction=0.5, seed=5)


def _given_bits(x, like):
    bits = torch.randint(0, 8, x.shape, generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    return fewbit.round(x, "binary8p4", "src", bits=3, random_bits=like(bits))


def _round_out(x, like):
    return fewbit.round(x, "binary8p4", "src", bits=3, seed=5, out=like(torch.zeros(x.shape)))


def _round_out_of_another_dtype(x, like):
    out = like(torch.zeros(x.shape, dtype=torch.float64))
    return fewbit.round(x, "binary8p4", "src", bits=3, seed=5, out=out)


def _round_in_place(x, like):  # (x itself, each case's own: a clone of a Partial x is Replicate)
    fewbit.round_(x, "binary8p4", "src", bits=3, seed=5)
    return x


def _round_gradient(x, like):
    x.requires_grad_()
    fewbit.round(x, "binary8p4", "src", bits=3, seed=5).backward(like(torch.arange(x.numel()).view(x.shape)))
    return x.grad


def _compiled(x, like):
    return torch.compile(_round_src, fullgraph=True)(x, like)


def _packed_codes(x, like):
    return fewbit.quantize(x, "ocp_e2m1", "src", bits=3, seed=5, sat=True, packed=True)


def _decoded(x, like):
    codes = fewbit.encode(fewbit.round(x, "ocp_e2m1", sat=True), "ocp_e2m1", packed=True)
    return fewbit.decode(codes, "ocp_e2m1", packed=True)


def _block_src(x, like):
    return fewbit.block.round(x, "mxfp8_e4m3", "src", bits=3, seed=5)


def _block_out(x, like):
    return fewbit.block.round(x, "mxfp8_e4m3", "src", bits=3, seed=5, out=like(torch.zeros(x.shape)))


def _nvfp4(x, like):
    return fewbit.block.round(x, "nvfp4")


def _nvfp4_src(x, like):
    return fewbit.block.round(x, "nvfp4", "src", bits=3, seed=5)


def _nvfp4_out(x, like):
    return fewbit.block.round(x, "nvfp4", "src", bits=3, seed=5, out=like(torch.zeros(x.shape)))


def _block_codes(x, like):
    return fewbit.block.quantize(x, "mxfp8_e4m3").codes


def _refused_alike(op, full: torch.Tensor, like, out: torch.Tensor | None = None) -> torch.Tensor:
    """``op(x)`` of ``full`` laid out as x, which one element, in the last rank's piece,
    makes refuse: the error, saying whether this rank wrote its piece of ``out`` first."""
    try:
        return op(like(full))
    except ValueError as err:
        kept = out is None or bool((out.to_local() == 7.0).all())
        raise ValueError(f"refused, {'nothing written' if kept else 'out written'}: {err}") from err


def _no_result_out(x, like):
    full = x.full_tensor()
    full[0, -1] = 1e9  # beyond e2m1's range, without sat
    out = like(torch.full(full.shape, 7.0))
    return _refused_alike(lambda t: fewbit.round(t, "ocp_e2m1", "src", bits=3, seed=5, sat=False, out=out),
                          full, like, out)  # fmt: skip


def _block_no_result_out(x, like):
    full = fewbit.block.round(x.full_tensor(), "mxfp4")  # every block fits, but
    full[-1, 0] = 7.0  # this one's scale becomes 1: 7 is beyond e2m1's range, without sat
    out = like(torch.full(full.shape, 7.0))
    return _refused_alike(lambda t: fewbit.block.round(t, "mxfp4", sat=False, out=out), full, like, out)


def _no_code(x, like):
    full = fewbit.round(x.full_tensor(), "ocp_e2m1", sat=True)
    full[0, -1] = 0.3  # not a value of e2m1
    return _refused_alike(lambda t: fewbit.encode(t, "ocp_e2m1"), full, like)


def _write_back_refused(x, like):
    """LowPrecisionWeights over a weight laid out as x, in a format without NaN, after
    the last rank's piece turned NaN: the step's error, on every rank."""
    w = torch.nn.Parameter(x.detach().clone())
    weights = LowPrecisionWeights(torch.optim.SGD([w], lr=0.1), "ocp_e2m1", params=[w])
    full = x.full_tensor()
    full[0, -1] = math.nan
    with torch.no_grad():
        w.copy_(like(full))
    w.grad = like(torch.zeros(full.shape))
    try:
        weights.step()
    except ValueError as err:
        raise ValueError(f"write-back refused: {err}") from err
    return w


#: name -> (x's placement: S0, S1, R or P, its shape, the call of x and of ``like``, which
#: lays a full tensor out as x). A Partial x is the ranks' equal shares of the tensor.
OPS_CASES = {
    "round src, shard0": ("S0", (6, 10), _round_src),
    "round src, shard1": ("S1", (6, 10), _round_src),
    "round src, replicated": ("R", (6, 10), _round_src),
    "round src, partial": ("P", (6, 10), _round_src),
    "round sr_fraction, shard1": ("S1", (6, 10), _sr_fraction),
    "round with given bits, shard1": ("S1", (6, 10), _given_bits),
    "round out=, shard1": ("S1", (6, 10), _round_out),
    "round out= of another dtype, shard1": ("S1", (6, 10), _round_out_of_another_dtype),
    "round_ in place, shard0": ("S0", (7, 10), _round_in_place),
    "round_ in place, partial": ("P", (6, 10), _round_in_place),
    "round, gradient, shard1": ("S1", (6, 10), _round_gradient),
    "round, compiled, shard1": ("S1", (6, 10), _compiled),
    "quantize packed, shard0": ("S0", (6, 6), _packed_codes),
    "quantize packed, shard1": ("S1", (6, 6), _packed_codes),
    "encode and decode packed, shard1": ("S1", (6, 8), _decoded),
    "block.round src, shard0": ("S0", (4, 64), _block_src),
    "block.round src, shard1": ("S1", (4, 64), _block_src),
    "block.round out=, shard0": ("S0", (4, 64), _block_out),
    "nvfp4, replicated": ("R", (4, 64), _nvfp4),
    "nvfp4, shard0": ("S0", (4, 64), _nvfp4),
    "nvfp4 src, shard1": ("S1", (4, 64), _nvfp4_src),
    "nvfp4 src, partial": ("P", (4, 64), _nvfp4_src),
    "nvfp4 out=, shard1": ("S1", (4, 64), _nvfp4_out),
    "block.quantize, shard0": ("S0", (4, 64), _block_codes),
    "round out= refused on one rank, shard1": ("S1", (6, 10), _no_result_out),
    "block.round out= refused on one rank, shard0": ("S0", (4, 64), _block_no_result_out),
    "encode refused on one rank, shard1": ("S1", (6, 10), _no_code),
    "write-back refused on one rank, shard1": ("S1", (6, 10), _write_back_refused),
}


def ops_data(cfg: OpsProbe, shape: tuple[int, ...]) -> torch.Tensor:
    """The probe's input of ``shape`` (the same in every process)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(cfg.data_seed))


def probe_ops(rank: int, world_size: int, cfg: OpsProbe) -> dict:
    """Each case of :data:`OPS_CASES` on this rank (see :class:`OpsProbe`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    placement = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}
    out = {}
    for name, (x_at, shape, call) in OPS_CASES.items():
        full = ops_data(cfg, shape)
        if x_at == "P":
            x = DTensor.from_local(full / world_size, mesh, [Partial()], run_check=False)
        else:
            x = distribute_tensor(full, mesh, [placement[x_at]])
        try:
            result = call(x, lambda t, at=x_at: distribute_tensor(t, mesh, [placement[at]]))
        except (ValueError, NotImplementedError, RuntimeError) as err:  # alike on every rank
            out[name] = {"error": f"{type(err).__name__}: {err}"}
            continue
        out[name] = {"result": result.detach().full_tensor().numpy(), "placements": str(result.placements)}
    return {"cases": out, "weights": {}}


def _placements(mesh_dims: int, tensor_dims: int, shard, replicate) -> list[tuple]:
    one = [shard(d) for d in range(tensor_dims)] + [replicate()]
    if mesh_dims == 1:
        return [(p,) for p in one]
    return [(a, b) for a in one for b in one]


def run(rank: int, world_size: int, cfg) -> dict:
    """What ``launch`` runs on each rank: a training run or a layout probe."""
    if isinstance(cfg, LayoutProbe):
        return probe_layouts(rank, world_size, cfg)
    if isinstance(cfg, TensorParallelProbe):
        return probe_tensor_parallel(rank, world_size, cfg)
    if isinstance(cfg, OpsProbe):
        return probe_ops(rank, world_size, cfg)
    return train_sharded(rank, world_size, cfg)
