"""CUDA against CPU, bit for bit, for every mode, eager and with fewbit's kernels (the
Triton kernel, or torch.compile's where it does not apply); skipped without a GPU.

The CPU kernels are checked against gfloat elsewhere; here the GPU must reproduce them
exactly. The inputs cover every bfloat16 and float16 pattern (as float32: subnormals of
the target, both sides of every binade boundary, Inf and NaN) plus random float32 bits,
which include float32 subnormals (the case that needs the GPU to keep denormals).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fewbit
from conftest import assert_bitwise_equal
from fewbit.random import key_of
from fewbit.rounding import RoundMode, dtype_format

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FORMATS = ("binary8p4", "binary8p3", "p3109_k8p4sf", "ocp_e4m3", "ocp_e5m2", "ocp_e2m1", "ocp_e8m0",
           "binary8p1", "bfloat16", "binary16")


def inputs() -> torch.Tensor:
    every16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    rng = np.random.default_rng(3109)
    raw = rng.integers(0, 1 << 32, size=1 << 18, dtype=np.uint64).astype(np.uint32).view(np.int32)
    tiny = rng.integers(0, 1 << 23, size=1 << 12, dtype=np.int64).astype(np.int32)  # fp32 subnormals
    return torch.cat([
        every16.view(torch.bfloat16).float(),
        every16.view(torch.float16).float(),
        torch.from_numpy(raw).view(torch.float32),
        torch.from_numpy(tiny).view(torch.float32),
    ])


@pytest.fixture(scope="module")
def x() -> torch.Tensor:
    return inputs()


#: Each (format, mode, sat) compiles its own GPU kernel, so fewer formats: the Triton
#: kernel's kinds (P > 1, P = 1, no NaN, a bfloat16 target with float32 subnormal results)
#: and one beyond it (E8M0: torch.compile's kernel).
COMPILED = ("binary8p4", "binary8p1", "ocp_e2m1", "bfloat16", "ocp_e8m0")


@pytest.mark.parametrize(
    "name, compiled", [(n, False) for n in FORMATS] + [(n, True) for n in COMPILED]
)
def test_gpu_equals_cpu(x, name, compiled):
    fmt = fewbit.format(name)
    for mode in RoundMode:
        # A format with neither Inf nor NaN refuses out-of-range values unless saturating.
        for sat in (False, True) if fmt.has_nans or fmt.has_infs else (True,):
            xs = x
            if not fmt.has_nans:
                xs = xs[~torch.isnan(xs)]
            if not fmt.has_infs and not sat:
                xs = xs[~torch.isinf(xs)]
            kw = {}
            if mode.is_stochastic:
                kw["seed"] = 11
                if mode.takes_bits:
                    kw["bits"] = 3
                if mode is RoundMode.SR_FRACTION:
                    kw["fraction"] = 0.5
            with fewbit.configure(compile=False):
                cpu = fewbit.round(xs, fmt, mode, sat=sat, **kw)
            with fewbit.configure(compile=compiled):
                gpu = fewbit.round(xs.cuda(), fmt, mode, sat=sat, **kw)
            assert gpu.device.type == "cuda"
            assert_bitwise_equal(gpu.cpu(), cpu, xs, f"{name} {mode} sat={sat} compiled={compiled}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode, kw", [("rne", {}), ("src", {"bits": 3, "seed": 5}), ("sr", {"seed": 6}),
                                      ("sr_fraction", {"seed": 7, "fraction": 0.5})])  # fmt: skip
def test_16_bit_inputs_gpu_equals_cpu(dtype, mode, kw):
    """Every bfloat16 and float16 pattern, read and written in its own width."""
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    x = torch.cat([every.view(torch.bfloat16).to(dtype), every.view(torch.float16).to(dtype)])
    for name in ("binary8p4", "ocp_e5m2"):
        cpu = fewbit.round(x, name, mode, sat=True, **kw)
        gpu = fewbit.round(x.cuda(), name, mode, sat=True, **kw)
        assert_bitwise_equal(gpu.cpu(), cpu, x, f"{name} {mode} {dtype}")


def test_given_bits_and_out_gpu_equals_cpu(x):
    bits = torch.randint(0, 8, x.shape, generator=torch.Generator().manual_seed(4), dtype=torch.int32)
    cpu = fewbit.round(x, "ocp_e4m3", "src", bits=3, sat=True, random_bits=bits)
    out = torch.empty_like(x, device="cuda")
    fewbit.round(x.cuda(), "ocp_e4m3", "src", bits=3, sat=True, random_bits=bits.cuda(), out=out)
    assert_bitwise_equal(out.cpu(), cpu, x, "given bits")


def test_triton_kernel_takes_the_calls():
    """The GPU runs fewbit's Triton kernel (Triton comes with CUDA builds of torch), not a fallback."""
    from fewbit.rounding import gpu

    assert gpu.usable(torch.empty(1, device="cuda"), fewbit.format("binary8p4"))


def test_a_kernel_launched_again_takes_new_sizes_and_addresses(x):
    """gpu.py launches a kernel it has compiled again without Triton's binding of its
    arguments: each call must still give the CPU's bits whatever its size, its
    addresses, and whether they are aligned (the kernel's ALIGNED)."""
    from fewbit.rounding import gpu

    gpu._COMPILED.clear()
    xc = x.cuda()
    # An int seed's key reaches the kernel as the launch's words; a key tensor on the GPU, in memory.
    seeds = [{}, {"bits": 3, "seed": 5}, {"bits": 3, "seed": key_of(5, "cuda")}]
    for start, stop in [(0, 4096), (0, 1 << 16), (16, 16 + 8192), (1, 4097), (3, 1 << 16), (0, 4096), (5, 6)]:
        for mode, kw in zip(["rne", "src", "src"], seeds, strict=True):
            cpu = fewbit.round(x[start:stop], "binary8p4", mode, sat=True, **kw)
            assert_bitwise_equal(fewbit.round(xc[start:stop], "binary8p4", mode, sat=True, **kw).cpu(), cpu,
                                 x[start:stop], f"{mode} [{start}:{stop}]")  # fmt: skip
        codes = fewbit.encode(fewbit.round(x[start:stop], "ocp_e4m3", sat=True), "ocp_e4m3")
        on_gpu = fewbit.encode(fewbit.round(xc[start:stop], "ocp_e4m3", sat=True), "ocp_e4m3")
        assert torch.equal(on_gpu.cpu(), codes), f"encode [{start}:{stop}]"
    # Aligned and not, for each of the five kernels: the later calls were launched again.
    assert len(gpu._COMPILED) == 2 * 5


@pytest.mark.parametrize("name", ["binary8p4", "ocp_e4m3", "ocp_e2m1", "binary8p1"])
def test_encode_gpu_equals_cpu(name):
    fmt = fewbit.format(name)
    codes = torch.arange(1 << fmt.k, dtype=torch.int32).to(fewbit.codec.code_dtype(fmt))
    values = fewbit.decode(codes, fmt)
    packed = fmt.k <= 4
    expected = fewbit.encode(values, fmt, packed=packed)
    assert torch.equal(fewbit.encode(values.cuda(), fmt, packed=packed).cpu(), expected)
    assert torch.equal(fewbit.encode(values.cuda(), fmt, packed=packed, check=False).cpu(), expected)
    with pytest.raises(ValueError, match="is not a value of"):
        fewbit.encode(torch.cat([values, torch.tensor([float(fmt.max) * 1.5])]).cuda(), fmt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["binary8p4", "ocp_e4m3", "ocp_e2m1", "binary16"])
def test_decode_gpu_equals_cpu(name, dtype):
    """fewbit.decode on a GPU (decode_kernel) gives the CPU's values, bit for bit, of every
    code and of codes over many programs, packed where K <= 4; a code beyond the format
    in a dtype that holds one raises as on the CPU."""
    fmt = fewbit.format(name)
    if not dtype_format(dtype).contains(fmt):
        pytest.skip(f"{dtype} cannot hold {name}")
    gen = torch.Generator().manual_seed(6)
    codes = torch.cat([torch.arange(1 << fmt.k), torch.randint(0, 1 << fmt.k, (1 << 20,), generator=gen)])
    codes = codes.to(fewbit.codec.code_dtype(fmt))
    for packed in (False, True) if fmt.k <= 4 else (False,):
        stored = fewbit.codec.pack_pairs(codes) if packed else codes
        want = fewbit.decode(stored, fmt, dtype, packed=packed)
        assert_bitwise_equal(fewbit.decode(stored.cuda(), fmt, dtype, packed=packed).cpu(), want, want, name)
    if fmt.k < 8:
        beyond = torch.cat([codes, torch.tensor([1 << fmt.k], dtype=torch.uint8)])
        with pytest.raises(ValueError, match="codes of"):
            fewbit.decode(beyond.cuda(), fmt, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["binary8p4", "ocp_e4m3", "ocp_e2m1", "binary4p2"])
def test_quantize_gpu_equals_cpu(name, dtype):
    """fewbit.quantize on a GPU (the rounding kernel, then encode's, unchecked) gives the
    CPU's one-pass codes, packed where K <= 4, and the same error for a NaN where the
    format has none."""
    gen = torch.Generator().manual_seed(8)
    x = (torch.randn(8, 4096 + 30, generator=gen) * 4).to(dtype)
    packed = fewbit.format(name).k <= 4
    for mode, kw in (("rne", {}), ("src", {"bits": 3, "seed": 5}), ("sr", {"seed": 6})):
        kw = {"sat": True, "packed": packed, **kw}
        expected = fewbit.quantize(x, name, mode, **kw)
        assert torch.equal(fewbit.quantize(x.cuda(), name, mode, **kw).cpu(), expected)
    if not fewbit.format(name).has_nans:
        with pytest.raises(ValueError, match="no NaN to hold a NaN input"):
            fewbit.quantize(torch.tensor([1.0, float("nan")], device="cuda"), name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp4", "nvfp4", "hbfp8"])
@pytest.mark.parametrize("mode, kw", [("rne", {}), ("src", {"bits": 3, "seed": 9})])
@pytest.mark.parametrize("axis", [-1, 0])
def test_block_formats_gpu_equals_cpu(name, mode, kw, dtype, axis):
    """Codes, scales and values of block formats: the GPU's (round_kernel's blocks along the
    last axis; torch.compile's kernels across rows) and the CPU's (the native kernel; from
    bfloat16 its 16-bit block path where it applies), bit for bit, with blocks holding NaN,
    Inf, zeros and subnormals among random values."""
    from fewbit import block

    gen = torch.Generator().manual_seed(6)
    x = torch.randn(64, 256, generator=gen) * torch.logspace(-30, 30, 256)
    x[0, :8] = torch.tensor([float("nan"), 1.0, float("inf"), -2.0, 0.0, -0.0, 1e-40, -3e-39])
    x[1, :32] = 0.0
    x[1, 32:64] = -0.0
    x[2, 32:40] = torch.tensor([1e30, 1e-40, -1e-40, 1e-30, -3e-38, 5e-39, -1e-45, 2e-44])  # x / S underflows
    x = x.to(dtype)
    kw = {**kw, "axis": axis}
    cpu = block.quantize(x, name, mode, **kw)
    gpu = block.quantize(x.cuda(), name, mode, **kw)
    assert torch.equal(gpu.codes.cpu(), cpu.codes) and torch.equal(gpu.scales.cpu(), cpu.scales), name
    assert_bitwise_equal(block.round(x.cuda(), name, mode, **kw).cpu(), block.round(x, name, mode, **kw), x,
                         f"{name} {mode} axis={axis}")  # fmt: skip


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_compiled_block_kernels_on_the_gpu_divide_as_the_cpu(name):
    """Blocks across rows of a tensor large enough for torch.compile's kernels (below the
    threshold, eager torch runs): Inductor's float32 division on a GPU is Triton's, not
    correctly rounded, and NVFP4's x / S took it (divided in float64 now)."""
    from fewbit import block

    x = torch.randn(1024, 256, generator=torch.Generator().manual_seed(8)) * torch.logspace(-8, 8, 256)
    for mode, kw in (("rne", {}), ("src", {"bits": 3, "seed": 4})):
        cpu = block.quantize(x, name, mode, axis=0, **kw)
        gpu = block.quantize(x.cuda(), name, mode, axis=0, **kw)
        assert torch.equal(gpu.codes.cpu(), cpu.codes) and torch.equal(gpu.scales.cpu(), cpu.scales), mode


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_amax_gpu_equals_cpu(dtype):
    """NVFP4's tensor amax in one read on the GPU (gpu.finite_amax) as the native kernel
    finds it on the CPU, past NaN and Inf, over many programs."""
    from fewbit.rounding import gpu, native

    x = torch.randn(1 << 24, generator=torch.Generator().manual_seed(3)) * 1e3
    x[[7, 1 << 20]] = torch.tensor([float("nan"), -float("inf")])
    x = x.to(dtype)
    assert gpu.finite_amax(x.cuda()).item() == native.finite_amax(x)


def test_block_calls_along_the_last_axis_take_the_triton_kernel(monkeypatch):
    """block.quantize and block.round along the last axis launch round_kernel's blocks
    (gpu.block_into, which compiled and ran), not torch.compile's kernels."""
    from fewbit import block
    from fewbit.rounding import gpu

    ran = []
    real = gpu.block_into
    monkeypatch.setattr(gpu, "block_into", lambda *args, **kw: ran.append(real(*args, **kw)) or ran[-1])
    x = torch.randn(16, 512, device="cuda")
    for name in ("mxfp8_e4m3", "nvfp4"):
        block.quantize(x, name, "src", bits=3, seed=1)
        block.round(x, name)
    assert ran == [True] * 4


@pytest.mark.parametrize("name", ["binary8p4", "mxfp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("placement", ["Shard(0)", "Shard(1)"])
def test_shard_rounding_gpu_equals_cpu(placement, name):
    """A sharded piece's write-back rounding (sharding.round_range: the kernel draws the
    bits of the piece's elements in the full tensor, from one range of it for Shard(0),
    a run a row for Shard(1); a block format's from a block inside a row of lanes; NVFP4
    with a per-tensor scale not the piece's own), on the GPU as on the CPU."""
    from fewbit.block import check_args
    from fewbit.random import Key
    from fewbit.sharding import ShardLayout, round_range

    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(8))
    if placement == "Shard(0)":
        piece = ShardLayout((1000, 64), (300, 64), (401, 0))
    else:
        piece = ShardLayout((300, 1024), (300, 64), (0, 352))
    spec = check_args(x.dtype, name, "src", name == "nvfp4", 3, None)  # (e2m1: no NaN for an overflow)
    ts = torch.tensor(x.abs().max().item() * 1.7 / (6 * 448)) if name == "nvfp4" else None
    cpu = round_range(x, spec, Key(3, 4), piece, tensor_scale=ts)
    gpu = round_range(x.cuda(), spec, Key(3, 4), piece, tensor_scale=None if ts is None else ts.cuda())
    assert cpu is not None and gpu is not None
    assert_bitwise_equal(gpu.cpu(), cpu, x, f"{placement} piece")


@pytest.mark.parametrize("update_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("width", [256, 250])
def test_write_back_gpu_equals_cpu(update_dtype, width, monkeypatch):
    """LowPrecisionWeights' write-back on the GPU, in one launch of the Triton kernel for
    every weight (gpu.round_foreach_), gives the CPU's weights, step after step; with a
    weight whose size is not a multiple of 16 (width 250: 7 x 250) the list takes the
    compiled path, with the same bits. The inner step is SGD at a learning rate of 2^-6 on
    given gradients, which both devices compute exactly alike (a model's gradients would
    not be: cuBLAS sums in another order)."""
    from fewbit.optim import LowPrecisionWeights
    from fewbit.rounding import gpu

    launches = []
    one_launch = gpu.round_foreach_
    monkeypatch.setattr(gpu, "round_foreach_", lambda *a: launches.append(one_launch(*a)) or launches[-1])
    gen = torch.Generator().manual_seed(4)
    shapes = [(width, 96), (7, width), (64, 64)]
    start = [torch.randn(shape, generator=gen) * 0.1 for shape in shapes]
    grads = [[torch.randn(shape, generator=gen) for shape in shapes] for _ in range(3)]
    weights = {}
    for device in ("cpu", "cuda"):
        params = [torch.nn.Parameter(w.to(device, copy=True)) for w in start]  # start stays as it is
        inner = torch.optim.SGD(params, lr=2.0**-6)
        opt = LowPrecisionWeights(inner, "binary8p4", "src", bits=3, seed=5, update_dtype=update_dtype)
        for step in grads:
            for p, g in zip(params, step, strict=True):
                p.grad = g.to(device)
            opt.step()
        weights[device] = [p.detach().cpu() for p in params]
    assert launches == [width % 16 == 0] * 4, launches  # the first rounding, then 3 steps
    for gpu_w, cpu_w in zip(weights["cuda"], weights["cpu"], strict=True):
        assert_bitwise_equal(gpu_w.reshape(-1), cpu_w.reshape(-1), cpu_w.reshape(-1), "write-back")


def test_write_back_table_stays_on_the_gpu_and_follows_the_weights():
    """The write-back's launch table is sent once while the weights stay where they are (one
    table for the first rounding and two steps: the key goes with the launch), and a
    weight given other memory between steps (p.data replaced) gets a table of its new
    address: the CPU's weights, step after step."""
    from fewbit.optim import LowPrecisionWeights
    from fewbit.rounding import gpu

    gen = torch.Generator().manual_seed(6)
    shapes = [(256, 96), (64, 64)]
    start = [torch.randn(shape, generator=gen) * 0.1 for shape in shapes]
    grads = [[torch.randn(shape, generator=gen) for shape in shapes] for _ in range(3)]
    weights, tables = {}, []
    for device in ("cpu", "cuda"):
        gpu._TABLES.clear()
        params = [torch.nn.Parameter(w.to(device, copy=True)) for w in start]
        opt = LowPrecisionWeights(torch.optim.SGD(params, lr=2.0**-6), "binary8p4", "src", bits=3, seed=5,
                                  update_dtype=torch.bfloat16)  # fmt: skip
        for i, step in enumerate(grads):
            if i == 2:
                params[0].data = params[0].data.clone()  # other memory, the same values
            for p, g in zip(params, step, strict=True):
                p.grad = g.to(device)
            opt.step()
            tables.append(len(gpu._TABLES))
        weights[device] = [p.detach().cpu() for p in params]
    assert tables == [0, 0, 0, 1, 1, 2], tables  # the CPU keeps none
    for gpu_w, cpu_w in zip(weights["cuda"], weights["cpu"], strict=True):
        assert_bitwise_equal(gpu_w.reshape(-1), cpu_w.reshape(-1), cpu_w.reshape(-1), "write-back")


def test_write_back_to_codes_gpu_equals_cpu():
    """LowPrecisionWeights(store_codes=True) on the GPU (a fewbit.quantize a weight, the
    Triton kernel writing codes) keeps the CPU's codes, and restores the CPU's weights."""
    from fewbit.optim import LowPrecisionWeights

    gen = torch.Generator().manual_seed(5)
    start = [torch.randn(shape, generator=gen) * 0.1 for shape in [(256, 96), (7, 250)]]
    grads = [torch.randn(w.shape, generator=gen) for w in start]
    kept = {}
    for device in ("cpu", "cuda"):
        params = [torch.nn.Parameter(w.to(device, copy=True)) for w in start]  # start stays as it is
        opt = LowPrecisionWeights(torch.optim.SGD(params, lr=2.0**-6), "binary8p4", "src", bits=3, seed=5,
                                  update_dtype=torch.bfloat16, store_codes=True)  # fmt: skip
        for p, g in zip(params, grads, strict=True):
            p.grad = g.to(device)
        opt.step()
        codes = [c.cpu() for c in opt._codes]
        opt.materialize()
        kept[device] = codes, [p.detach().cpu() for p in params]
    for a, b in zip(*(codes + weights for codes, weights in kept.values()), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fast", [False, True])
def test_resume_on_the_gpu_gives_the_same_run(tmp_path, fast):
    """#19: on a GPU a run stopped at iteration 7, saved and resumed in a fresh Run equals
    the uninterrupted run, losses and weights, dropout included (the CUDA generator's
    state travels in the checkpoint); fast: with the paper preset's speed options
    (bfloat16 autocast, the model compiled, fused AdamW)."""
    from dataclasses import replace

    from fewbit.experiments.data import CharDataset
    from fewbit.experiments.train import PRESETS, SPEED_OPTIONS, Run
    from test_train import generated_text

    data = CharDataset.from_text(generated_text())
    cfg = replace(PRESETS["tiny"], device="cuda", mode="src", update_dtype="bf16", dropout=0.1, iters=14,
                  eval_interval=7, **dict.fromkeys(SPEED_OPTIONS, fast))  # fmt: skip
    whole = Run(cfg, data)
    whole.run()
    first = Run(cfg, data)
    first.run(until=7)
    torch.save(first.state_dict(), tmp_path / "ckpt.pt")
    torch.manual_seed(123)  # disturb both generators: the checkpoint must restore them
    resumed = Run(cfg, data)
    resumed.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    resumed.run()
    assert resumed.history.val == whole.history.val
    np.testing.assert_array_equal(resumed.history.train, whole.history.train)  # NaN before the first step
    for (name, pw), pr in zip(whole.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(pw, pr), name


def test_bench_gives_device_time_ratios():
    """On a GPU every ratio row of ``fewbit bench`` also has its ratio in device time
    (bench.device_ratio: CUDA events around calls queued back to back), and its result
    checked against the CPU's (bench.matches_cpu)."""
    from fewbit import bench

    rows = bench.run(log2_size=16, device="cuda", repeat=2, quick=True, with_gfloat=False)
    ratios = [r for r in rows if "x_copy" in r]
    assert len(ratios) >= 12 and all(0 < r["device_x_copy"] < float("inf") for r in ratios)
    assert all(r["matches_cpu"] for r in ratios)  # every timed call's result is the CPU's, bit for bit
    assert {"encode to uint8", "encode to uint8, unchecked", "quantize src"} <= {r["mode"] for r in ratios}
    assert "device" in bench.format_table(rows).splitlines()[0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_write_back_refuses_weights_on_two_gpus():
    """The write-back rounds its weights together, with keys on one device: weights on
    cuda:0 and cuda:1 are refused at selection (the device's type alone let them by)."""
    from fewbit.optim import LowPrecisionWeights

    a, b = (torch.nn.Parameter(torch.randn(4, 4, device=f"cuda:{i}")) for i in range(2))
    with pytest.raises(ValueError, match="mix dtypes or devices"):
        LowPrecisionWeights(torch.optim.SGD([a, b], lr=0.1), "binary8p4", "src", bits=3)


def test_a_host_key_tensor_rounds_a_gpu_tensor_as_the_cpu():
    """A key or seed tensor in host memory is not copied to the GPU (a copy waits for the
    device): the kernel takes its words with the launch, round and fake_quantize alike."""
    from fewbit.nn import Quant, fake_quantize

    x = torch.randn(4096, generator=torch.Generator().manual_seed(2))
    for seed in (torch.tensor(11), key_of(11)):
        want = fewbit.round(x, "binary8p4", "src", bits=3, seed=seed)
        assert torch.equal(fewbit.round(x.cuda(), "binary8p4", "src", bits=3, seed=seed).cpu(), want)
        q = Quant("binary8p4", "src", bits=3)
        assert torch.equal(fake_quantize(x.cuda(), q, None, seed).cpu(), fake_quantize(x, q, None, seed))


def test_calls_that_read_nothing_back_wait_for_nothing():
    """Once compiled, these calls neither read back nor copy from host memory (torch's
    sync debug mode raises on either): an int seed and a host key tensor into the Triton
    kernel, the eager torch ops where it declines (float64), NVFP4 with rule up."""
    x = torch.randn(4096, device="cuda")
    calls = [
        lambda: fewbit.round(x, "binary8p4", "src", bits=3, seed=5),
        lambda: fewbit.round(x, "binary8p4", "src", bits=3, seed=key_of(5)),
        lambda: fewbit.round(x.double(), "binary8p4", "src", bits=3, seed=5),
        lambda: fewbit.block.round(x.view(64, 64), "nvfp4", "rne", rule="up"),
    ]
    for call in calls:
        call()  # compiled on first use
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for call in calls:
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
