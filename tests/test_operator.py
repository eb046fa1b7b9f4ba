"""fewbit's rounding as registered torch.library operators: the user's torch.compile,
torch.export and autograd; out= and round_; arguments as numpy and torch give them;
outputs that never share memory; the configuration object."""

from __future__ import annotations

import dataclasses
import os
import warnings

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

import fewbit
from conftest import blocks_eager_and_compiled
from fewbit.nn import FakeQuantize, Quant
from fewbit.optim import LowPrecisionWeights
from fewbit.random import key_of, random_bits
from fewbit.rounding import MODES, RoundMode, compiled

STEPS_BATCHES = [5, 7, 9, 6, 8]  # a new batch size, so a new shape, every step


class Net(torch.nn.Module):
    """fewbit.round with the step as seed, a FakeQuantize (forward and backward SR). The
    maths around them is what Inductor computes exactly as eager torch does (matrix
    products by the same library call, relu), so any difference would be fewbit's: a
    fused bias or tanh may round float32 differently when compiled."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(32, 4, bias=False)
        self.fq = FakeQuantize(Quant("e4m3", "src", bits=3), Quant("e5m2", "src", bits=2), seed=3)

    def forward(self, x, step):
        h = fewbit.round(self.a(x), "binary8p4", "src", bits=3, seed=step)
        return self.b(torch.relu(self.fq(h)))


def _train(compile_model: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    net = Net()
    lpw = LowPrecisionWeights(torch.optim.AdamW(net.parameters(), lr=0.01), "binary8p4", "src", bits=3)
    run = torch.compile(net, fullgraph=True) if compile_model else net
    g = torch.Generator().manual_seed(1)
    outputs = []
    for step, batch in enumerate(STEPS_BATCHES):
        x = torch.randn(batch, 16, generator=g)
        if compile_model and step == 0:
            torch._dynamo.mark_dynamic(x, 0)  # the user's choice: one graph for every batch size
        lpw.zero_grad()
        y = run(x, torch.tensor(step))
        y.square().mean().backward()
        lpw.step()
        outputs.append(y.detach())
    return outputs, [p.detach().clone() for p in net.parameters()]


def test_compiled_model_is_one_graph_compiles_each_spec_once_and_equals_eager(monkeypatch):
    with fewbit.configure(compile=False):
        want_out, want_w = _train(compile_model=False)
    monkeypatch.setattr(compiled, "_CACHE", {})  # every kernel compiles afresh here
    counters.clear()
    # Every fewbit kernel compiled by torch.compile (threshold 0; not the native one),
    # inside the user's compiled graph.
    with fewbit.configure(compile=True, compile_threshold=0, native=False):
        got_out, got_w = _train(compile_model=True)
    assert not compiled._BROKEN
    assert not counters["graph_break"]
    # round (binary8p4 src), FakeQuantize forward (e4m3) and backward (e5m2), the write-back
    assert len(compiled._CACHE) == 4
    # one graph for the model (5 steps: new seeds, steps and shapes), one per kernel, and one
    # more for the write-back, a call per weight: 512 and 128 elements fill 1 and 0 rows of
    # LANES, lengths Dynamo specialises (a larger weight's rows share a graph)
    assert counters["stats"]["unique_graphs"] == 1 + 4 + 1
    for a, b in zip(got_out + got_w, want_out + want_w, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_given_bits_compile_one_kernel_for_every_length(monkeypatch):
    """The compiled kernel that takes random_bits marks them of any length too: only x and
    out were, and the bits' length fixed x's, a graph per length until Dynamo's limit of 8,
    then a warning that compilation failed and eager from then on."""
    monkeypatch.setattr(compiled, "_CACHE", {})
    counters.clear()
    with fewbit.configure(compile=True, compile_threshold=0, native=False):
        for n in (300, 700, 1100):
            x = torch.randn(n)
            bits = random_bits(n, 3, n)
            got = fewbit.round(x, "binary8p4", "src", bits=3, random_bits=bits)
            with fewbit.configure(compile=False):
                assert torch.equal(got, fewbit.round(x, "binary8p4", "src", bits=3, random_bits=bits))
    assert not compiled._BROKEN
    assert counters["stats"]["unique_graphs"] == 1


# (An int seed's key is kept only in eager code: ops._seed_key.)
@pytest.mark.filterwarnings("error:Dynamo detected a call to a `functools.lru_cache`")
def test_int_seed_under_compile_recompiles_at_most_once():
    def f(x, s):
        return fewbit.round(x, "e4m3", "src", bits=3, seed=s)

    cf = torch.compile(f, fullgraph=True, dynamic=True)
    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(100)
    for s in range(4):
        assert torch.equal(cf(x, s), f(x, s))
    assert counters["stats"]["unique_graphs"] <= 2  # Dynamo specialises an int once


def test_an_int_seed_beyond_int64_under_compile():
    """Inductor's graph takes its int inputs as int64. A seed in [2**63, 2**64), which Dynamo
    would pass to the graph made for a symbolic seed (from the second seed on), is a
    constant of a graph of its own, and rounds as eagerly."""
    def f(x, s):
        return fewbit.round(x, "e4m3", "src", bits=3, seed=s)

    cf = torch.compile(f, fullgraph=True)
    x = torch.randn(100)
    for s in (0, 1, 2**63 + 1, 2**64 - 1, 2):
        assert torch.equal(cf(x, s), f(x, s)), s


CALLS_WITH_BITS = {
    "round": lambda x, n: fewbit.round(x, "binary8p4", "src", bits=n, seed=1),
    "quantize": lambda x, n: fewbit.quantize(x, "binary8p4", "src", bits=n, seed=1),
    "block.round": lambda x, n: fewbit.block.round(x, "mxfp8_e4m3", "src", bits=n, seed=1),
    "block.quantize": lambda x, n: fewbit.block.quantize(x, "mxfp8_e4m3", "src", bits=n, seed=1).codes,
}


@pytest.mark.parametrize("dynamic", [None, True])
@pytest.mark.parametrize("call", CALLS_WITH_BITS)
def test_bits_under_compile_is_static_a_graph_for_each_value(call, dynamic):
    """bits picks the kernel's constants: the int that Dynamo makes symbolic (from its second
    value, or its first with dynamic=True) is specialised, a graph for each value, and each
    rounds as eagerly."""
    from torch._dynamo.testing import CompileCounter

    f, counter = CALLS_WITH_BITS[call], CompileCounter()
    cf = torch.compile(f, fullgraph=True, dynamic=dynamic, backend=counter)
    x = torch.randn(4, 64)
    for n in (3, 2, 5, 2, 3):
        assert torch.equal(cf(x, n), f(x, n)), n
    assert counter.frame_count == 3


def test_formats_made_by_hand_under_compile_and_export():
    """A format made by hand goes to an op as its repr, which states the whole format: from
    the first call, under torch.compile and torch.export (strict or not, saved and loaded),
    it rounds, encodes and decodes as the registered format of the same fields does
    eagerly."""
    import io

    mine = dataclasses.replace(fewbit.format("binary8p4"), name="test_made_b8p4")
    block_mine = dataclasses.replace(fewbit.block.format("mxfp8_e4m3"), name="test_made_mx")

    def calls(fmt, bfmt):
        def f(x):
            codes = fewbit.encode(fewbit.round(x, fmt), fmt)
            return (fewbit.round(x, fmt, "src", bits=3, seed=2), fewbit.quantize(x, fmt), codes,
                    fewbit.decode(codes, fmt), fewbit.block.round(x, bfmt),
                    fewbit.block.quantize(x, bfmt, "src", bits=3, seed=2).codes)  # fmt: skip
        return f

    class Calls(torch.nn.Module):
        def forward(self, x):
            return calls(mine, block_mine)(x)

    x = torch.randn(4, 64)
    want = calls("binary8p4", "mxfp8_e4m3")(x)
    compiled = torch.compile(calls(mine, block_mine), fullgraph=True, backend="aot_eager")
    results = {"compiled": compiled(x)}
    for strict in (False, True):
        buffer = io.BytesIO()
        torch.export.save(torch.export.export(Calls(), (x,), strict=strict), buffer)
        buffer.seek(0)
        results[f"exported, strict={strict}"] = torch.export.load(buffer).module()(x)
    results["eager"] = calls(mine, block_mine)(x)
    for how, got in results.items():
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), (how, i)


def test_two_formats_of_one_name_are_refused_under_compile_too():
    """A name is one format: under torch.compile, as eagerly, a second format of a name
    taken is refused, whichever of the two came first (it never rounds as the other)."""
    from fewbit.block import BlockFormat
    from fewbit.formats import FloatFormat

    def compiled(fn):
        return torch.compile(fn, fullgraph=True, backend="aot_eager")

    x = torch.randn(4, 64)
    e8m0 = fewbit.format("ocp_e8m0")
    for what, first, second, call in [
        ("formats", FloatFormat("test_clash", 8, 4, 8), FloatFormat("test_clash", 8, 2, 32), fewbit.round),
        ("block formats", BlockFormat("test_clash", fewbit.format("e4m3"), 32, e8m0),
         BlockFormat("test_clash", fewbit.format("e5m2"), 32, e8m0), fewbit.block.round),
    ]:  # fmt: skip
        call(x, first)
        with pytest.raises(Exception, match=f"two {what} are named 'test_clash'"):
            compiled(lambda v: call(v, second))(x)
        renamed = [dataclasses.replace(f, name="test_clash_2") for f in (first, second)]
        compiled(lambda v: call(v, renamed[0]))(x)
        with pytest.raises(ValueError, match=f"two {what} are named 'test_clash_2'"):
            call(x, renamed[1])


@pytest.mark.filterwarnings("error:Dynamo detected a call to a `functools.lru_cache`")
def test_format_names_in_a_compiled_function():
    """A name looked up inside the compiled function (Quant("hbfp4") there, or
    fake_quantize(x, "binary8p3"), and fewbit.format and fewbit.block.format until a
    later hunt) made Dynamo build a new format in the graph, which failed with an
    internal error; only the fixed element names (e4m3) passed."""
    from torch._dynamo.testing import CompileCounter

    from fewbit.block import round_to
    from fewbit.nn import fake_quantize

    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    names = ["binary8p3", "int4", "p3109_k6p3se", "hbfp4", "mxfp8_e4m3", "nvfp4", "bfp6_b16", "mx_binary8p3"]
    block_names = names[3:]

    def looked_up(v, name):  # the public look-ups, then the op of the format's kind
        if name in block_names:
            return fewbit.block.round(v, fewbit.block.format(name))
        return fewbit.round(v, fewbit.format(name), sat=True)

    for name in names:
        for call in (lambda v: fake_quantize(v, name, Quant(name, "src", bits=3), seed=1),
                     lambda v: Quant(name, "src", bits=3)(v, fewbit.random.Key.from_seed(2)),
                     lambda v: round_to(v, name),
                     lambda v: looked_up(v, name)):
            counter = CompileCounter()
            assert torch.equal(torch.compile(call, fullgraph=True, backend=counter)(x), call(x)), name
            assert counter.frame_count == 1
    # A name refused is the ValueError it is eagerly (Dynamo's internal error, in the lookup);
    # with fullgraph=True, Dynamo's Unsupported, which quotes it.
    for bad, message in (("e9m9", "unknown format 'e9m9'"), ("bfp4_b3", "block size must be even")):
        with pytest.raises(ValueError, match=message):
            torch.compile(lambda v: fake_quantize(v, bad), backend="eager")(x)
        with pytest.raises(torch._dynamo.exc.Unsupported, match=message):
            torch.compile(lambda v: fake_quantize(v, bad), fullgraph=True, backend="eager")(x)


def test_export_of_a_module_with_fake_quantize():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), FakeQuantize(Quant("e4m3", "src", bits=3), seed=1))
    m.eval()
    x = torch.randn(3, 4)
    ep = torch.export.export(m, (x,))
    assert "fewbit.round" in ep.graph_module.code
    assert torch.equal(ep.module()(x), m(x))
    assert not torch.equal(ep.module()(x), torch.nn.Sequential(m[0])(x))  # it did round


def test_export_says_the_backward_quant_is_left_out():
    """torch.export inlines fake_quantize's autograd.Function: the exported program's
    gradient is straight through. That was silent; export (non-strict, torch's default)
    now warns."""
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), FakeQuantize(None, Quant("e5m2"), seed=1))
    x = torch.randn(3, 4)
    with pytest.warns(UserWarning, match="without the backward Quant"):
        ep = torch.export.export(m, (x,))
    w = dict(ep.module().named_parameters())["0.weight"]
    (ep.module()(x) * 1.03).sum().backward()  # 1.03 is no e5m2 value: rounded, it would move
    assert torch.equal(w.grad, torch.full((8, 3), 1.03) @ x)


def test_blocks_compiled_apart_share_one_graph_whatever_their_keys():
    """Each FakeQuantize's Key ints were constants to Dynamo: compiling each block of a
    model apart (as FSDP2 users do) made a graph per block, until Dynamo's recompile limit
    left the rest eager. The key is a tensor input when compiled; a key set anew too."""
    q = Quant("binary8p4", "src", bits=3)

    def blocks() -> list[torch.nn.Module]:
        torch.manual_seed(0)
        return [torch.nn.Sequential(torch.nn.Linear(8, 8), FakeQuantize(q, q, seed=i)) for i in range(10)]

    eager, compiled = blocks(), blocks()
    compiled[3][1].key = 99
    eager[3][1].key = 99
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    (eager_out,), (compiled_out,), graphs = blocks_eager_and_compiled(eager, compiled, x)
    assert torch.equal(eager_out, compiled_out)
    assert graphs == 1


@pytest.mark.parametrize("fmt", ["binary8p4", "mxfp4", "by_hand", "by_hand_block"])
def test_equal_formats_share_a_graph_and_different_ones_do_not(fmt):
    """Dynamo guarded a format object handed to the ops by its id: blocks cloned with
    copy.deepcopy (as torch.nn.TransformerEncoder clones its layers), each holding a copy of
    its Quant's format, made a graph per block when compiled apart, and fullgraph=True
    failed at the recompile limit (so did a format made by hand for each layer). Equal
    formats share a graph now; one that differs in a single field gets its own."""
    import copy

    from fewbit.block import BlockFormat
    from fewbit.formats import FloatFormat

    made = {"by_hand": FloatFormat("test_shared_b8p4", 8, 4, 8),
            "by_hand_block": BlockFormat("test_shared_mx", "e2m1", 16, "e8m0")}  # fmt: skip
    q = Quant(made.get(fmt, fmt), "src", bits=3)

    def blocks() -> list[torch.nn.Module]:
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(32, 32), FakeQuantize(q, q, seed=1))
        return [copy.deepcopy(block) for _ in range(9)]  # one more than Dynamo's recompile limit

    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    (eager_out,), (compiled_out,), graphs = blocks_eager_and_compiled(blocks(), blocks(), x)
    assert torch.equal(eager_out, compiled_out)
    assert graphs == 1
    if fmt == "by_hand":  # an int field apart: a graph each, each rounding as eagerly
        torch._dynamo.reset()
        counters.clear()
        f = torch.compile(lambda v, m: fewbit.round(v, m, sat=True), fullgraph=True, backend="eager")
        for bias in (8, 7, 6, 8, 7, 6):
            other = FloatFormat(f"test_shared_bias{bias}", 8, 4, bias)
            assert torch.equal(f(x, other), fewbit.round(x, other, sat=True)), bias
        assert counters["stats"]["unique_graphs"] == 3
        inside = torch.compile(lambda v: fewbit.round(v, FloatFormat("test_inside", 8, 4, 8), sat=True),
                               fullgraph=True, backend="eager")  # (Dynamo's internal error before)
        assert torch.equal(inside(x), fewbit.round(x, made["by_hand"], sat=True))


@pytest.mark.parametrize("forward", [None, Quant("e4m3")], ids=["straight", "rne"])
def test_compiled_fake_quantize_rounds_each_gradient_with_its_own_calls_key(forward):
    """Where the forward pass draws nothing, the backward Quant's key came from the call
    count read in the backward pass, after the graph had advanced it in place: compiled,
    call c's gradient rounded with call c+1's key. It rounds as eagerly now."""
    bq = Quant("binary8p4", "src", bits=3)
    eager, compiled = FakeQuantize(forward, bq, seed=7), FakeQuantize(forward, bq, seed=7)
    run = torch.compile(compiled, fullgraph=True, backend="aot_eager")
    g = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 0.1 + 1.03
    for _ in range(3):
        grads = []
        for module in (eager, run):
            x = torch.zeros(4096, requires_grad=True)
            module(x).backward(g)
            grads.append(x.grad)
        assert torch.equal(*grads)
    assert int(compiled.calls) == int(eager.calls) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", list(RoundMode))
def test_round_of_a_parameter_is_straight_through(mode, dtype):
    g = torch.Generator().manual_seed(2)
    w = torch.nn.Parameter((torch.randn(64, generator=g) * 3).to(dtype))
    kw = {}
    if MODES[mode].stochastic:
        kw["seed"] = 5
        if mode.takes_bits:
            kw["bits"] = 3
        if "select" in MODES[mode].streams:
            kw["fraction"] = 0.5
    y = fewbit.round(w, "binary8p4", mode, **kw)
    assert y.requires_grad
    assert torch.equal(y.detach(), fewbit.round(w.detach(), "binary8p4", mode, **kw))
    upstream = torch.randn(64, generator=g).to(dtype)
    y.backward(upstream)
    assert torch.equal(w.grad, upstream)  # the documented gradient: the identity


def test_out_and_round_():
    x = torch.randn(1000) * 100
    want = fewbit.round(x, "e4m3", "src", bits=3, seed=1)
    out = torch.full_like(x, 7.0)
    assert fewbit.round(x, "e4m3", "src", bits=3, seed=1, out=out) is out
    assert torch.equal(out, want)
    y = x.clone()
    assert fewbit.round_(y, "e4m3", "src", bits=3, seed=1) is y and torch.equal(y, want)
    # a strided out, and a bfloat16 one (the kernel runs in float32)
    wide = torch.zeros(1000, 2)
    fewbit.round(x, "e4m3", "src", bits=3, seed=1, out=wide[:, 1])
    assert torch.equal(wide[:, 1], want) and not wide[:, 0].any()
    xb, ob = x.bfloat16(), torch.empty(1000, dtype=torch.bfloat16)
    assert torch.equal(fewbit.round(xb, "e4m3", out=ob), fewbit.round(xb, "e4m3"))


def test_out_refuses_before_writing():
    x = torch.tensor([1.0, float("nan")])
    out = torch.full_like(x, 3.0)
    with pytest.raises(ValueError, match="no NaN"):
        fewbit.round(x, "e2m1", out=out)  # E2M1 has no NaN: nothing may be written
    assert torch.equal(out, torch.full_like(x, 3.0))
    y = x.clone()
    with pytest.raises(ValueError, match="no NaN"):
        fewbit.round_(y, "e2m1")
    assert torch.equal(y[:1], x[:1]) and y[1].isnan()
    with pytest.raises(ValueError, match="out must match"):
        fewbit.round(x, "e4m3", out=torch.empty(3))
    with pytest.raises(RuntimeError, match=r"fewbit.round\(\.\.\., out=\.\.\.\) does not support automatic"):
        fewbit.round(torch.ones(2, requires_grad=True), "e4m3", out=torch.empty(2))
    with pytest.raises(RuntimeError, match=r"fewbit.round_ \(in place\) does not .* call fewbit.round\(x\)"):
        fewbit.round_(torch.ones(2, requires_grad=True), "e4m3")


def test_writing_ops_tell_autograd_they_wrote():
    """A tensor autograd saved, then written by fewbit's writing ops: the backward refuses
    it, as after any in-place op of torch (the ops bump the version counter)."""
    from fewbit import block

    writes = [
        lambda t: fewbit.round(torch.randn(64), "e4m3", out=t),
        lambda t: fewbit.round_(t, "e4m3", "src", bits=3, seed=1),
        lambda t: block.round(torch.randn(64), "mxfp8_e4m3", out=t),
    ]
    for write in writes:
        w = torch.randn(64, requires_grad=True)
        t = torch.randn(64)
        loss = (w * t).sum()  # saves t for w's gradient
        write(t)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    # block.quantize(out=) writes the stored tensor scale too
    stored = block.quantize(torch.randn(2, 32), "nvfp4")
    w = torch.randn(2, requires_grad=True)
    loss = (w * stored.tensor_scale).sum()
    block.quantize(torch.randn(2, 32) * 3, "nvfp4", out=stored)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    # Ops without a gradient record none, even where torch ops inside read an input that
    # requires grad (NVFP4's tensor scale from x's amax, by torch ops without the native kernel).
    for native in (True, False):
        with fewbit.configure(native=native):
            q = block.quantize(torch.randn(2, 32, requires_grad=True), "nvfp4")
        assert q.tensor_scale.grad_fn is None and not q.tensor_scale.requires_grad


def test_empty_tensors():
    for threshold in (0, 1 << 16):
        with fewbit.configure(compile_threshold=threshold):
            for mode, kw in [("rne", {}), ("src", {"bits": 3, "seed": 1})]:
                x = torch.empty(0, 3)
                y = fewbit.round(x, "e4m3", mode, **kw)
                assert y.shape == (0, 3) and not compiled._BROKEN


def test_round_under_compile_in_place():
    def step(w):
        return fewbit.round_(w, "binary8p4", "src", bits=3, seed=torch.tensor(4))

    w = torch.randn(300)
    want = fewbit.round(w, "binary8p4", "src", bits=3, seed=4)
    torch.compile(step, fullgraph=True)(w)
    assert torch.equal(w, want)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8,
                                   torch.int16, torch.int32, torch.int64])
def test_random_bits_of_any_integer_dtype(dtype):
    x = torch.randn(4096) * 5
    n = random_bits(x.shape, 3, 9)
    want = fewbit.round(x, "e4m3", "src", bits=3, random_bits=n)
    assert torch.equal(fewbit.round(x, "e4m3", "src", bits=3, random_bits=n.to(dtype)), want)
    big = torch.full(x.shape, 8, dtype=dtype)
    with pytest.raises(ValueError, match=r"must lie in \[0, 8\)"):
        fewbit.round(x, "e4m3", "src", bits=3, random_bits=big)


def test_uint64_beyond_int64_is_out_of_range():
    x = torch.randn(4)
    huge = torch.full((4,), 2**63 + 5, dtype=torch.uint64)
    with pytest.raises(ValueError, match="must lie in"):
        fewbit.round(x, "e4m3", "src", bits=3, random_bits=huge)


def test_numpy_scalars_are_accepted():
    x = torch.randn(5000)
    want = fewbit.round(x, "e4m3", "sr_fraction", bits=3, fraction=0.25, seed=7, sat=True)
    got = fewbit.round(x, "e4m3", "sr_fraction", bits=np.int64(3), fraction=np.float32(0.25),
                       seed=np.uint32(7), sat=np.bool_(True))
    assert torch.equal(got, want)
    assert torch.equal(fewbit.round(x, "e4m3", "src", bits=np.int8(3), seed=np.int64(7)),
                       fewbit.round(x, "e4m3", "src", bits=3, seed=7))
    for bad, message in [({"bits": 3.0}, "bits must be an int"), ({"bits": True}, "bits must be an int"),
                         ({"sat": 1}, "sat must be a bool"), ({"fraction": "0.5"}, "fraction must be")]:
        with pytest.raises(TypeError, match=message):
            fewbit.round(x, "e4m3", "sr_fraction", **{"bits": 3, "fraction": 0.5, "seed": 1, **bad})


def test_seed_as_tensor_or_key_tensor():
    x = torch.randn(3000)
    want = fewbit.round(x, "e4m3", "src", bits=3, seed=2**40 + 3)
    assert torch.equal(fewbit.round(x, "e4m3", "src", bits=3, seed=torch.tensor(2**40 + 3)), want)
    assert torch.equal(fewbit.round(x, "e4m3", "src", bits=3, seed=key_of(2**40 + 3)), want)
    with pytest.raises(ValueError, match="shape"):
        fewbit.round(x, "e4m3", "src", bits=3, seed=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="on cpu or the CPU"):  # (fewbit.round would move it to x's device)
        torch.ops.fewbit.round(x, "ocp_e4m3", "src", False, 3, None, key_of(7, "meta"), None)


def test_an_int_seeds_key_stays_in_host_memory():
    """Whatever x's device, an int seed's key stays in host memory: a Key, whose words the
    kernels take as ints (a GPU kernel with its launch: tests/test_gpu.py), and a tensor in
    host memory for a call through the dispatcher. A key tensor stays where it is."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fewbit.rounding.ops import op_args

    x = torch.empty(8, device="meta")
    for seed in (7, fewbit.random.Key(1, 2)):
        assert op_args(x, "e4m3", "src", False, 3, None, seed, None)[6] == fewbit.random.as_key(seed)
    assert op_args(x, "e4m3", "src", False, 3, None, key_of(7, "meta"), None)[6].device.type == "meta"

    class Keys(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func).startswith("fewbit."):
                keys.append(args[6])
            return func(*args, **(kwargs or {}))

    keys = []
    with Keys():
        fewbit.round(torch.randn(8), "e4m3", "src", bits=3, seed=(5 << 32) + 7)
        fewbit.block.round(torch.randn(32), "mxfp4", "src", bits=3, seed=(5 << 32) + 7)
    assert [(k.device.type, k.tolist()) for k in keys] == [("cpu", [7, 5])] * 2


def test_an_int_seeds_kept_key_is_the_one_made():
    """An op call keeps the keys of the int seeds used last (ops._seed_key): each is the
    key Key.from_seed makes, for the largest seed too, and for more seeds than it keeps;
    what is no seed (a bool, an int out of range) is refused as before. (Under
    torch.compile nothing is kept: test_int_seed_under_compile_recompiles_at_most_once.)"""
    from fewbit.random import Key
    from fewbit.rounding.ops import op_key

    x = torch.empty(8)
    seeds = [0, 1, 7, (5 << 32) + 7, 2**64 - 1, *range(1000, 1600)]
    for _ in range(2):  # made, then (the last ones) kept
        for seed in seeds:
            key = op_key(seed, x)
            assert type(key) is Key and (key.k0, key.k1) == (seed & 0xFFFFFFFF, seed >> 32)
    assert op_key(np.int64(7), x).tolist() == [7, 0]  # a numpy int: a key tensor, as before
    with pytest.raises(TypeError):
        op_key(True, x)
    for wrong in (-1, 2**64):
        with pytest.raises(ValueError):
            op_key(wrong, x)


# --- outputs never alias memory the user holds ---------------------------------------

SIZES = [100, 1 << 21]  # small, and 8 MiB of float32 (what the old cache of outputs took)


def _fresh(n: int) -> torch.Tensor:
    return fewbit.round(torch.randn(n), "e4m3")


@pytest.mark.parametrize("n", SIZES)
def test_kept_storage_is_never_reused(n):
    a = _fresh(n)
    held, values = a.untyped_storage(), a.clone()
    del a
    outputs = [_fresh(n) for _ in range(3)]
    for out in outputs:
        assert out.untyped_storage().data_ptr() != held.data_ptr()
    assert torch.equal(torch.tensor([], dtype=torch.float32).set_(held), values)


@pytest.mark.parametrize("n", SIZES)
def test_numpy_views_dlpack_and_shared_memory_keep_their_memory(n):
    a, b, c, d = _fresh(n), _fresh(n), _fresh(n), _fresh(n)
    as_numpy = a.numpy()
    capsule_owner = torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(b))
    view = c[1:]
    d.share_memory_()
    kept = [as_numpy.copy(), capsule_owner.clone(), view.clone(), d.clone()]
    del a, b, c
    later = [_fresh(n) for _ in range(4)]
    live = [t.untyped_storage().data_ptr() for t in later]
    for t in (capsule_owner, view, d):
        assert t.untyped_storage().data_ptr() not in live
    assert as_numpy.ctypes.data not in live
    assert np.array_equal(as_numpy, kept[0])
    for t, k in zip((capsule_owner, view, d), kept[1:], strict=True):
        assert torch.equal(t, k)


@pytest.mark.parametrize("n", SIZES)
def test_every_output_resizes_like_a_fresh_tensor(n):
    a = _fresh(n)
    a.numpy()
    for out in (_fresh(n), fewbit.round(torch.randn(n), "e4m3", "src", bits=3, seed=1)):
        out.untyped_storage().resize_(0)  # as FSDP frees a parameter
        assert out.untyped_storage().nbytes() == 0
        out.untyped_storage().resize_(n * 4)
        out.resize_(2 * n)
        assert out.numel() == 2 * n


# --- configuration ---------------------------------------------------------------------

def test_configure_restores_and_refuses_unknown_names():
    before = fewbit.config.current()
    with fewbit.configure(compile=False, eager_chunk=7) as inside:
        assert fewbit.config.current() is inside and inside.eager_chunk == 7 and not inside.compile
        with fewbit.configure(eager_chunk=9):
            assert fewbit.config.current().eager_chunk == 9
        assert fewbit.config.current().eager_chunk == 7
    assert fewbit.config.current() == before
    with pytest.raises(ValueError, match="unknown setting"):
        with fewbit.configure(compiled=False):
            pass
    with pytest.raises(ValueError, match="eager_chunk"):
        with fewbit.configure(eager_chunk=0):
            pass
    assert fewbit.config.current() == before
    # numpy's bool as fewbit.round's sat takes it ("compile must be a bool, not bool" before)
    with fewbit.configure(compile=np.bool_(False)) as inside:
        assert inside.compile is False
    with pytest.raises(TypeError, match="compile must be a bool, not int"):
        with fewbit.configure(compile=0):
            pass
    # numpy's ints as fewbit.round's bits takes them, kept as ints (refused as "not an int" before)
    with fewbit.configure(compile_threshold=np.int64(5), eager_chunk=np.uint16(7)) as inside:
        assert (inside.compile_threshold, inside.eager_chunk) == (5, 7) and type(inside.eager_chunk) is int
    with pytest.raises(ValueError, match="eager_chunk must be an int >= 1"):
        with fewbit.configure(eager_chunk=np.bool_(True)):
            pass


def test_configure_blocks_of_two_threads_that_overlap_each_undo_only_their_own():
    """A enters, then B; A ends while B is open: B's change stays, A's goes, and after B
    nothing remains (restoring what each block found would bring A's back for good)."""
    import threading

    before = fewbit.config.current()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with fewbit.configure(eager_chunk=111):
            a_in.set()
            b_in.wait()
        a_out.set()

    def b():
        a_in.wait()
        with fewbit.configure(compile_threshold=222):
            b_in.set()
            a_out.wait()
            seen["after A"] = fewbit.config.current()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["after A"] == dataclasses.replace(before, compile_threshold=222)
    assert fewbit.config.current() == before


def test_configure_inside_a_compiled_function_is_refused_naming_why():
    """A configure block traced by torch.compile failed in Dynamo's words ("Failed to trace
    builtin operator `object`"); it names itself now, and without fullgraph the frame runs
    eagerly, the block in force (a ScaledTensor matmul's unit scaling shows it)."""
    from fewbit.scaled import as_scaled

    a, b = (as_scaled(torch.ones(8, 64), torch.tensor(1.0)), as_scaled(torch.ones(64, 8), torch.tensor(1.0)))

    def f(a, b):
        with fewbit.configure(unit_scaling=True):
            return a @ b

    before = fewbit.config.current()
    torch._dynamo.reset()
    with pytest.raises(Exception, match="fewbit.configure cannot change the settings inside a compiled"):
        torch.compile(f, fullgraph=True)(a, b)
    assert fewbit.config.current() == before
    torch._dynamo.reset()
    assert float(torch.compile(f)(a, b).scale) == 8.0 == float(f(a, b).scale)
    assert fewbit.config.current() == before


@pytest.mark.parametrize("cache", [None, 5, ""])
def test_configure_refuses_a_native_cache_that_is_not_a_path(cache):
    with pytest.raises(ValueError, match="native_cache must be a folder's path"):
        with fewbit.configure(native_cache=cache):
            pass


def test_an_empty_environment_variable_is_unset():
    assert fewbit.config.Config.from_env({"FEWBIT_COMPILE_THRESHOLD": "", "FEWBIT_CACHE": "",
                                          "FEWBIT_EAGER": ""}) == fewbit.config.Config()


def test_environment_is_read_once():
    Config = fewbit.config.Config
    assert not Config.from_env({"FEWBIT_EAGER": "1"}).compile
    assert Config.from_env({"FEWBIT_COMPILE_THRESHOLD": "10"}).compile_threshold == 10
    with pytest.raises(ValueError, match="FEWBIT_EAGER"):
        Config.from_env({"FEWBIT_EAGER": "yes"})


def test_no_environment_read_per_call(monkeypatch):
    class Untouchable(dict):
        def __getitem__(self, name, default=None):
            raise AssertionError(f"read {name} from the environment")

        get = __getitem__

    x = torch.randn(1 << 17)
    calls = [lambda: fewbit.round(x, "e4m3", "src", bits=3, seed=1),
             lambda: fewbit.decode(fewbit.encode(fewbit.round(x, "e4m3"), "e4m3"), "e4m3")]  # fmt: skip
    for call in calls:  # first uses: the native kernel's loading looks for the compiler on PATH
        call()
    monkeypatch.setattr(os, "environ", Untouchable())
    for call in calls:
        call()


def test_the_private_dispatch_guard_and_length_mark_are_still_there():
    # compiled.py calls kernels below ADInplaceOrView through a private torch guard, and marks
    # a length as dynamic through a private Dynamo call; when a torch release drops one, the
    # fallback compiles a spec up to twice, or once per length: this says so first.
    assert compiled.below_autograd is torch._C._AutoDispatchBelowADInplaceOrView
    assert compiled._MARK_DYNAMIC is torch._dynamo.maybe_mark_dynamic


def test_encode_and_decode_compile_and_take_tensors_that_require_grad():
    w = torch.nn.Parameter(torch.randn(64))
    y = fewbit.round(w, "e4m3")
    codes = fewbit.encode(y, "e4m3")  # integer codes: no gradient, and no error
    assert codes.dtype == torch.uint8 and not codes.requires_grad
    assert torch.equal(fewbit.encode(y, "e4m3", check=False), codes)
    assert torch.equal(fewbit.decode(codes, "e4m3"), y.detach())

    def roundtrip(x):
        return fewbit.decode(fewbit.encode(fewbit.round(x, "e4m3"), "e4m3"), "e4m3")

    x = torch.randn(100)
    assert torch.equal(torch.compile(roundtrip, fullgraph=True)(x), fewbit.round(x, "e4m3"))

    def unchecked(x):  # the check's argument too is one the op takes
        return fewbit.encode(fewbit.round(x, "e4m3"), "e4m3", check=False)

    want = fewbit.encode(fewbit.round(x, "e4m3"), "e4m3")
    assert torch.equal(torch.compile(unchecked, fullgraph=True)(x), want)


def _every_op_call() -> list:
    """A call of each fewbit operator through its public function (writing ones too)."""
    from fewbit import block

    x = torch.randn(4, 32)
    codes = fewbit.encode(fewbit.round(x, "e4m3"), "e4m3")
    stored = block.quantize(x, "nvfp4")
    return [
        lambda: fewbit.round(x, "e4m3", "src", bits=3, seed=1),
        lambda: fewbit.round(x, "e4m3", out=torch.empty_like(x)),
        lambda: fewbit.quantize(x, "e4m3"),
        lambda: fewbit.encode(fewbit.round(x, "e4m3"), "e4m3"),
        lambda: fewbit.decode(codes, "e4m3"),
        lambda: block.round(x, "mxfp8_e4m3"),
        lambda: block.round(x, "mxfp8_e4m3", out=torch.empty_like(x)),
        lambda: block.quantize(x, "mxfp4").codes,
        lambda: block.quantize(x, "nvfp4", out=stored).codes,
    ]


def test_eager_calls_skip_the_dispatcher_where_nothing_would_see_it(monkeypatch):
    """Plain eager calls run their kernels without the dispatcher (each op's dispatcher
    call is made to fail here), and give what the dispatcher gives (a dispatch mode that
    only passes each op on sends every call through it)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fewbit import codec, operators
    from fewbit.block import ops as block_ops
    from fewbit.rounding import ops as round_ops

    class Through(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert operators._PRIVATE is not None, "torch lost a query operators.unseen needs: calls go the slow way"
    calls = _every_op_call()
    with fewbit.configure(native=True):
        with Through():
            through_dispatcher = [call() for call in calls]
        every = [getattr(m, n) for m in (round_ops, block_ops, codec) for n in dir(m)]
        for op in {o for o in every if isinstance(o, operators.Operator)}:
            monkeypatch.setattr(op, "op", None)  # not callable: a dispatcher call would fail
        for call, want in zip(calls, through_dispatcher, strict=True):
            got = call()
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:DeprecationWarning")
def test_whatever_would_see_an_op_call_still_sees_it():
    """Under a dispatch mode, a torch function mode, the profiler, vmap, jit.trace, fake
    tensors, autograd and on a meta tensor, each op call goes through the dispatcher:
    what a user's tool sees of it is what it saw before calls could skip it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from fewbit.operators import unseen

    class Recorded(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    class Called(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    for mode in (Recorded, Called):
        for call in _every_op_call():
            seen = []
            with mode():
                call()
            assert any(name.startswith("fewbit.") for name in seen), (mode, seen)
    x = torch.randn(4, 8)
    with torch.profiler.profile() as profile:
        fewbit.round(x, "e4m3")
    assert any(e.name == "fewbit::round" for e in profile.events())
    vmapped = torch.vmap(lambda row: fewbit.round(row, "e4m3", "src", bits=3, seed=2))(x)
    assert torch.equal(vmapped, torch.stack([fewbit.round(r, "e4m3", "src", bits=3, seed=2) for r in x]))
    assert "fewbit::round" in str(torch.jit.trace(lambda t: fewbit.round(t, "e4m3"), x).graph)
    with FakeTensorMode():
        fake = torch.randn(4, 8)
        assert fewbit.round(fake, "e4m3").shape == (4, 8)
    assert fewbit.round(torch.randn(4, device="meta"), "e4m3").device.type == "meta"
    # The tensors' own conditions, and where they hold.
    w = torch.nn.Parameter(x.clone())
    assert unseen([x, None]) and unseen([w.detach(), x])
    assert not unseen([w])  # autograd records a call on it
    with torch.no_grad():
        assert unseen([w])
    assert not unseen([torch.empty(2, device="meta")]) and not unseen([x.to_sparse()])
    assert not unseen([x.as_subclass(type("Sub", (torch.Tensor,), {}))])
    assert not unseen([fake])  # a subclass without __torch_function__, outside its mode


def test_torch_func_transforms_take_the_straight_through_gradient():
    """torch.func.grad, vjp, jacrev and vmap of grad (per-sample gradients) through
    fewbit.round, block.round and fake_quantize give what autograd gives: the gradient
    straight through (rounded by the backward Quant, for fake_quantize). torch refuses
    the gradient that register_autograd makes under these transforms (pytorch/pytorch
    #170834); fewbit's Operator calls its op through an autograd.Function of its own
    there. The last check fails once torch takes it: that Function can then go."""
    from fewbit.nn import fake_quantize

    gen = torch.Generator().manual_seed(12)
    x, w = torch.randn(6, 32, generator=gen), torch.randn(6, 32, generator=gen) * 0.37
    calls = {
        "round": lambda t: fewbit.round(t, "binary8p4", "src", bits=3, seed=1),
        "block.round": lambda t: fewbit.block.round(t, "mxfp8_e4m3", "src", bits=3, seed=1),
        "fake_quantize": lambda t: fake_quantize(t, Quant("binary8p4"), Quant("binary8p4", "src", bits=3), 2),
    }

    def autograd(f, x, w):
        x = x.clone().requires_grad_()
        return torch.autograd.grad((f(x) * w).sum(), x)[0]

    for name, f in calls.items():
        expected = autograd(f, x, w)
        assert not torch.equal(expected, w) if name == "fake_quantize" else torch.equal(expected, w), name
        assert torch.equal(torch.func.grad(lambda t, f=f: (f(t) * w).sum())(x), expected), name
        out, vjp = torch.func.vjp(f, x)
        assert torch.equal(out, f(x)) and torch.equal(vjp(w)[0], expected), name
        per_sample = torch.func.vmap(torch.func.grad(lambda r, wr, f=f: (f(r) * wr).sum()))(x, w)
        assert torch.equal(per_sample, torch.stack([autograd(f, r, wr) for r, wr in zip(x, w, strict=True)]))
    assert torch.equal(torch.func.jacrev(calls["round"])(x[0, :5]), torch.eye(5))
    op = torch.ops.fewbit.round
    with pytest.raises(RuntimeError, match="setup_context"):  # torch's own, still refused
        torch.func.grad(lambda t: op(t, "binary8p4", "rne", False, None, None, None, None).sum())(x)


def test_functionalize_takes_the_functional_ops():
    """torch.func.functionalize of fewbit.round and block.round (alone, under vmap, and
    traced by make_fx into one op call) gives the eager result: under any functorch
    transform they went through their autograd.Function, which torch cannot functionalise
    ("NYI: Functionalize rule for custom_function_call"); that Function is for the
    transforms that differentiate."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fewbit.operators import _DIFFERENTIATE, _STACK

    assert _STACK is not None and _DIFFERENTIATE is not None  # torch's private names: this fails first
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(16))
    for name, f in (("round", lambda t: fewbit.round(t, "binary8p4", "src", bits=3, seed=1) * 2),
                    ("block_round", lambda t: fewbit.block.round(t, "mxfp8_e4m3", "src", bits=3, seed=1))):
        expected = f(x)
        assert torch.equal(torch.func.functionalize(f)(x), expected), name
        assert torch.equal(torch.func.functionalize(torch.vmap(f))(x), torch.vmap(f)(x)), name
        graph = make_fx(torch.func.functionalize(f))(x)
        assert torch.equal(graph(x), expected), name
        assert sum(str(n.target) == f"fewbit.{name}.default" for n in graph.graph.nodes) == 1, name


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch.func.jvp
@pytest.mark.parametrize("level_known", [True, False])
def test_forward_mode_passes_the_tangent_straight_through(monkeypatch, level_known):
    """Forward-mode AD through fewbit.round, block.round and fake_quantize (dual tensors of
    forward_ad, torch.func.jvp, jacfwd) gives the values a plain call gives and the
    tangent unchanged: the forward-mode side of the straight-through gradient. Also where
    torch would not say that a dual level is active (its private record gone): then each
    call asks x for a tangent."""
    import torch.autograd.forward_ad as fwAD

    from fewbit import operators
    from fewbit.nn import fake_quantize

    if not level_known:
        monkeypatch.setattr(operators, "_LEVEL_KNOWN", False)
        monkeypatch.setattr(operators, "_PRIVATE", None)
    gen = torch.Generator().manual_seed(13)
    x, t = torch.randn(6, 32, generator=gen), torch.randn(6, 32, generator=gen)
    calls = {
        "round": lambda v: fewbit.round(v, "binary8p4", "src", bits=3, seed=1),
        "block.round": lambda v: fewbit.block.round(v, "mxfp8_e4m3", "src", bits=3, seed=1),
        "fake_quantize": lambda v: fake_quantize(v, Quant("binary8p4"), Quant("binary8p4", "src", bits=3), 2),
    }
    for name, f in calls.items():
        expected = f(x)
        assert not torch.equal(expected, x), name
        with fwAD.dual_level():
            values, tangent = fwAD.unpack_dual(f(fwAD.make_dual(x, t)))
        assert torch.equal(values, expected) and tangent is not None and torch.equal(tangent, t), name
        values, tangent = torch.func.jvp(f, (x,), (t,))
        assert torch.equal(values, expected) and torch.equal(tangent, t), name
    assert torch.equal(torch.func.jacfwd(calls["round"])(x[0, :5]), torch.eye(5))
    # out= and in-place calls have no forward-mode formula: refused on a tensor with a
    # tangent, as torch's out= is (they ran, and jvp gave a zero tangent); taken on one
    # without, under a dual level too.
    writes = (lambda v: fewbit.round(v, "binary8p4", out=torch.empty_like(v)),
              lambda v: fewbit.round_(v * 1, "binary8p4"),
              lambda v: fewbit.block.round(v, "mxfp4", out=torch.empty_like(v)))  # fmt: skip
    for f in writes:
        with pytest.raises(RuntimeError, match="carries a forward-mode tangent"):
            torch.func.jvp(f, (x,), (t,))
        with fwAD.dual_level():
            with pytest.raises(RuntimeError, match="carries a forward-mode tangent"):
                f(fwAD.make_dual(x, t))
            assert torch.equal(f(x), f(x.clone()))
        assert torch.equal(torch.func.jvp(lambda v: v + f(x), (x,), (t,))[1], t)


@pytest.mark.parametrize("compile", [True, False])
def test_ops_without_a_gradient_take_a_tensor_with_a_tangent(compile):
    """quantize, encode and block.quantize (out= too) of a dual tensor give the codes of a
    plain call, without a tangent. Their kernels ran with forward AD on (no_grad leaves it
    on), and the eager rounding's torch ops refused the tangent of x ("Trying to use
    forward AD with add_out ..."): block.quantize of a small tensor, and every call with
    compile=False."""
    import torch.autograd.forward_ad as fwAD

    from fewbit.operators import _FORWARD_GRAD_OFF

    assert _FORWARD_GRAD_OFF is not None  # torch's private context: this fails first where it goes
    gen = torch.Generator().manual_seed(15)
    x = fewbit.round(torch.randn(4, 64, generator=gen) * 3, "ocp_e2m1", sat=True)
    calls = (lambda v: fewbit.quantize(v, "ocp_e2m1", "src", bits=3, seed=1, sat=True),
             lambda v: fewbit.encode(v, "ocp_e2m1", packed=True),
             lambda v: fewbit.block.quantize(v[:, :8], "mxfp8_e4m3").codes,
             lambda v: fewbit.block.quantize(v, "nvfp4", "src", bits=3, seed=1).scales,
             lambda v: fewbit.block.quantize(v, "mxfp4", out=fewbit.block.quantize(v * 0, "mxfp4")).codes)
    with fewbit.configure(compile=compile):
        for i, f in enumerate(calls):
            expected = f(x)
            with fwAD.dual_level():
                codes = f(fwAD.make_dual(x, torch.ones_like(x)))
                assert fwAD.unpack_dual(codes).tangent is None, i
            assert torch.equal(codes, expected), i


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch.func.jvp
def test_forward_mode_under_compile_is_refused_or_runs_eagerly():
    """Traced, the ops have no forward-mode formula: a compiled torch.func.jvp through them
    gave a zero tangent. fullgraph=True refuses it, naming why; without it Dynamo runs the
    frame eagerly, where the tangent passes straight through."""
    from fewbit.nn import fake_quantize

    gen = torch.Generator().manual_seed(14)
    x, t = torch.randn(4, 64, generator=gen), torch.randn(4, 64, generator=gen)
    for f in (lambda v: fewbit.round(v, "binary8p4") * 2, lambda v: fewbit.block.round(v, "mxfp4") * 2,
              lambda v: fake_quantize(v, Quant("binary8p4")) * 2):
        def jvp(a, b, f=f):
            return torch.func.jvp(f, (a,), (b,))[1]

        torch._dynamo.reset()
        with pytest.raises(Exception, match="fewbit: forward-mode AD"):
            torch.compile(jvp, fullgraph=True)(x, t)
        torch._dynamo.reset()
        assert torch.equal(torch.compile(jvp)(x, t), 2 * t)
    assert torch.equal(torch.compile(lambda v: fewbit.round(v, "binary8p4"), fullgraph=True)(x),
                       fewbit.round(x, "binary8p4"))


def test_vmap_rounds_each_sample_as_a_call_of_its_own():
    """torch.vmap of fewbit.round and fewbit.block.round gives each sample what a call on
    it alone gives, batched along any dimension, for the block axis of each sample, with
    bits given to all or per sample, a seed (each sample draws its own indices' bits),
    and NVFP4 (each sample's own tensor scale); and no warning that an op lacks a batching
    rule (fewbit registers its own: one call for the batch where it can)."""
    import warnings

    gen = torch.Generator().manual_seed(21)
    x = torch.randn(4, 6, 64, generator=gen) * 3
    given = torch.randint(0, 8, (6, 64), generator=gen, dtype=torch.int32)
    per_sample = torch.randint(0, 8, (4, 6, 64), generator=gen, dtype=torch.int32)
    cases = [
        (lambda s: fewbit.round(s, "binary8p4"), (0,)),
        (lambda s: fewbit.round(s, "binary8p4", "srf", bits=3, random_bits=given), (0,)),
        (lambda s, r: fewbit.round(s, "binary8p4", "srf", bits=3, random_bits=r), (0, 0)),
        (lambda s: fewbit.round(s, "binary8p4", "src", bits=3, seed=4), (0,)),
        (lambda s: fewbit.block.round(s, "mxfp8_e4m3"), (0,)),
        (lambda s: fewbit.block.round(s, "mxfp4", axis=0), (0,)),
        (lambda s: fewbit.block.round(s, "mxfp8_e4m3", "srf", bits=3, random_bits=given), (0,)),
        (lambda s: fewbit.block.round(s, "mxfp8_e4m3", "src", bits=3, seed=4), (0,)),
        (lambda s: fewbit.block.round(s, "nvfp4"), (0,)),
    ]
    for i, (f, dims) in enumerate(cases):
        args = (x, per_sample)[: len(dims)]
        alone = torch.stack([f(*(a[b] for a in args)) for b in range(4)])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            batched = torch.vmap(f, in_dims=dims)(*args)
            along_1 = torch.vmap(f, in_dims=(1,) + dims[1:])(x.transpose(0, 1), *args[1:])
        assert torch.equal(batched, alone) and torch.equal(along_1, alone), i
    # The codec's ops: codes, values and quantize, element by element (torch's per-sample
    # fallback, before, with its warning that the ops have no batching rule).
    values = fewbit.round(x, "ocp_e2m1", sat=True)
    codec_cases = [
        (lambda s: fewbit.encode(s, "ocp_e2m1"), values),
        (lambda s: fewbit.encode(s, "ocp_e2m1", packed=True), values),
        (lambda c: fewbit.decode(c, "ocp_e2m1", packed=True), fewbit.encode(values, "ocp_e2m1", packed=True)),
        (lambda s: fewbit.quantize(s, "binary8p4", "srf", bits=3, random_bits=given), x),
        (lambda s: fewbit.quantize(s, "binary8p4", "src", bits=3, seed=4), x),
    ]
    for i, (f, t) in enumerate(codec_cases):
        alone = torch.stack([f(t[b]) for b in range(4)])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert torch.equal(torch.vmap(f)(t), alone), i
            assert torch.equal(torch.vmap(f, in_dims=1)(t.transpose(0, 1)), alone), i
    for (f, t), op, calls in ((codec_cases[1], "encode", 1), (codec_cases[2], "decode", 1),
                              (codec_cases[3], "quantize", 1), (codec_cases[4], "quantize", 4)):  # fmt: skip
        with torch.profiler.profile() as profile:  # (torch's fallback warns in C++, not in Python)
            torch.vmap(f)(t)
        assert sum(e.name == f"fewbit::{op}" for e in profile.events()) == 1 + calls, op
    with pytest.raises(ValueError, match="0-d"):  # a sample of one element has no pairs
        torch.vmap(lambda c: fewbit.decode(c, "ocp_e2m1", packed=True))(torch.zeros(4, dtype=torch.uint8))
    for f, calls in ((cases[0][0], 1), (cases[3][0], 4)):  # the batch as one call, or a call each
        with torch.profiler.profile() as profile:
            torch.vmap(f)(x)
        assert sum(e.name == "fewbit::round" for e in profile.events()) == 1 + calls  # (1: vmap's own)
    # An empty batch (a last batch of per-sample gradients): an empty result shaped as a
    # sample's, where the call per sample had none to stack.
    for i, (f, dims) in enumerate(cases):
        args = (x[:0], per_sample[:0])[: len(dims)]
        assert torch.vmap(f, in_dims=dims)(*args).shape == (0, 6, 64), i


def test_vmap_of_block_quantize_gives_each_sample_its_own_codes():
    """torch.vmap of fewbit.block.quantize (then dequantize): each sample's codes, scale
    codes and NVFP4 tensor scale are a call on it alone's, along any batch dimension, with
    a seed or bits per sample; an empty batch gives an empty result (torch's fallback, the
    op having no batching rule, refused it, and warned at every call)."""
    gen = torch.Generator().manual_seed(22)
    x = torch.randn(3, 4, 64, generator=gen) * 3
    bits = torch.randint(0, 8, (3, 4, 64), generator=gen, dtype=torch.int32)
    cases = [
        (lambda s: fewbit.block.quantize(s, "nvfp4", "src", bits=3, seed=4), (0,)),
        (lambda s, r: fewbit.block.quantize(s, "mxfp8_e4m3", "srf", bits=3, random_bits=r, axis=0), (0, 0)),
    ]
    for i, (f, dims) in enumerate(cases):
        def parts(*a, f=f):
            q = f(*a)
            return (q.codes, q.scales) + (() if q.tensor_scale is None else (q.tensor_scale,))

        args = (x, bits)[: len(dims)]
        alone = [torch.stack(p) for p in zip(*(parts(*(a[b] for a in args)) for b in range(3)), strict=True)]
        for batched in (torch.vmap(parts, in_dims=dims)(*args),
                        torch.vmap(parts, in_dims=(1,) * len(dims))(*(a.transpose(0, 1) for a in args))):
            assert all(torch.equal(p, q) for p, q in zip(batched, alone, strict=True)), i
        values = torch.vmap(lambda *a, f=f: f(*a).dequantize(), in_dims=dims)(*args)
        assert torch.equal(values, torch.stack([f(*(a[b] for a in args)).dequantize() for b in range(3)])), i
        empty = torch.vmap(parts, in_dims=dims)(*(a[:0] for a in args))
        assert [p.shape[1:] for p in empty] == [p.shape[1:] for p in alone] and empty[0].shape[0] == 0, i


def test_vmap_refuses_a_block_axis_that_a_call_on_a_sample_refuses():
    """A block axis that is none of a sample's, and a 0-d sample, are refused under
    torch.vmap with the error a call on a sample gives (before: the axis named the
    batch's, and blocks ran across samples). A negative axis within a sample's counts
    from its end."""
    rows = torch.tensor([[1.0, 0.3], [0.01, 2.5], [100.0, 0.2]])
    with pytest.raises(ValueError, match="axis -2 is out of range for a tensor of 1 dimensions"):
        torch.vmap(lambda s: fewbit.block.round(s, "mxfp4", axis=-2))(rows)
    with pytest.raises(ValueError, match="at least one dimension"):
        torch.vmap(lambda s: fewbit.block.round(s, "mxfp4"))(rows[:, 0])
    x = torch.randn(3, 5, 2, generator=torch.Generator().manual_seed(4)) * 10
    for axis in (-2, -1, 0, 1):
        f = lambda s, axis=axis: fewbit.block.round(s, "mxfp4", axis=axis)  # noqa: E731
        assert torch.equal(torch.vmap(f)(x), torch.stack([f(s) for s in x])), axis


def test_vmap_refuses_random_bits_shaped_otherwise_than_a_sample():
    """Bits given alike for every sample have a sample's shape: others are refused under
    torch.vmap with the error a call on a sample gives (before: broadcast over the batch)."""
    one = torch.tensor([5], dtype=torch.int32)
    calls = [lambda s: fewbit.round(s, "binary8p4", "srf", bits=3, random_bits=one),
             lambda s: fewbit.quantize(s, "binary8p4", "srf", bits=3, random_bits=one),
             lambda s: fewbit.block.round(s, "mxfp8_e4m3", "srf", bits=3, random_bits=one)]  # fmt: skip
    samples = torch.randn(3, 32)
    for f in calls:
        with pytest.raises(ValueError, match=r"random_bits has shape \(1,\), x has \(32,\)"):
            f(samples[0])
        with pytest.raises(ValueError, match=r"random_bits has shape \(1,\), x has \(32,\)"):
            torch.vmap(f)(samples)


def test_tensors_whose_memory_is_not_their_values():
    """A view with torch's negative bit (memory holding -x) was read and written as its
    memory: round gave 3.0 for -3.0, out= stored -x. As an input it is read as its values
    now, as out= refused; a ZeroTensor (no memory) crashed the process in encode, quantize
    and decode, and is refused."""
    from fewbit.rounding.checks import _IS_ZEROTENSOR

    assert _IS_ZEROTENSOR is not None  # torch's private query: this fails first where it goes
    negative = torch.tensor([1.25 + 3j])[:1].conj().imag  # -3.0, stored as 3.0
    assert negative.is_neg() and float(negative) == -3.0
    calls = (lambda v: fewbit.round(v, "binary8p4"), lambda v: fewbit.encode(v, "binary16"),
             lambda v: fewbit.quantize(v, "e4m3"), lambda v: fewbit.block.round(v, "mxfp8_e4m3"))
    for call in calls:
        assert torch.equal(call(negative), call(torch.tensor([-3.0])))
        with pytest.raises(TypeError, match="ZeroTensor.*x.clone"):
            call(torch._efficientzerotensor(4))
    with pytest.raises(TypeError, match="codes is a ZeroTensor"):
        fewbit.decode(torch._efficientzerotensor(4, dtype=torch.uint8), "e4m3")
    memory = torch.tensor([1.25 + 3j, 2.5 + 1j])
    out = memory.conj().imag[:1]  # a view of memory with the negative bit
    with pytest.raises(TypeError, match="out is a view with torch's negative bit"):
        fewbit.round(torch.tensor([0.3]), "binary8p4", out=out)
    assert torch.equal(memory, torch.tensor([1.25 + 3j, 2.5 + 1j]))  # nothing written


def test_random_bits_whose_memory_is_not_their_values():
    """Given bits were range-checked on their values but read as memory by the kernels: a
    negative-bit view (memory holding -bits) rounded half the elements with other bits,
    and a ZeroTensor (no memory) too. The view is read as its values now; a ZeroTensor is
    refused."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 3
    bits = torch.randint(0, 256, (4096,), dtype=torch.int32, generator=torch.Generator().manual_seed(2))
    view = torch._neg_view(-bits)  # values `bits`, memory -bits
    assert view.is_neg() and torch.equal(view, bits)
    for call in (lambda b: fewbit.round(x, "e4m3", "src", bits=8, random_bits=b),
                 lambda b: fewbit.block.round(x.view(64, 64), "mxfp8_e4m3", "src", bits=8,
                                              random_bits=b.view(64, 64))):  # fmt: skip
        assert torch.equal(call(view), call(bits))
        with pytest.raises(TypeError, match="random_bits is a ZeroTensor"):
            call(torch._efficientzerotensor(4096, dtype=torch.int32))


def test_out_sharing_memory_with_an_input_gets_what_a_new_tensor_gets():
    """out= was written first where it shared memory with the random bits, or with x
    through another storage over the same buffer (two tensors from one numpy array): the
    kernel then read bits or values it had overwritten (1968 and 4045 of 4096 wrong)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4096, generator=gen) * 3
    for fmt, call in (("e4m3", fewbit.round), ("mxfp8_e4m3", fewbit.block.round)):
        mem = torch.empty(4097, dtype=torch.float32)
        bits_view = mem.view(torch.int32)[1:]
        bits_view.copy_(torch.randint(0, 8, (4096,), generator=gen, dtype=torch.int32))
        want = call(x, fmt, "src", bits=3, random_bits=bits_view.clone())
        got = call(x, fmt, "src", bits=3, random_bits=bits_view, out=mem[:4096])
        assert torch.equal(got, want), fmt
        buffer = torch.cat([x, x[:64]]).numpy()
        apart = torch.from_numpy(buffer[:4096]).view(64, 64), torch.from_numpy(buffer[64:]).view(64, 64)
        assert apart[0].untyped_storage().data_ptr() != apart[1].untyped_storage().data_ptr()
        want = call(apart[0].clone(), fmt)
        assert torch.equal(call(apart[0], fmt, out=apart[1]), want), fmt


def test_the_kernels_take_subclasses_with_memory_and_no_wrapper():
    """A tensor subclass whose memory is its data (a Parameter's subclass, as_subclass)
    takes the native kernel; a wrapper that may hold none (AsyncCollectiveTensor, a
    FakeTensor) goes to the torch ops (an in-flight piece's null pointer crashed it)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    from fewbit.rounding import native

    class Mine(torch.nn.Parameter):
        pass

    fmt = fewbit.format("binary8p4")
    x = torch.randn(64)
    sub = x.as_subclass(type("Sub", (torch.Tensor,), {}))
    for t in (x, torch.nn.Parameter(x.clone()), Mine(x.clone()), sub):
        assert native.usable(t, fmt) == (native._load() is not None), type(t)
    assert not native.usable(AsyncCollectiveTensor(x), fmt)


def test_a_key_tensor_in_host_memory_stays_there_for_x_elsewhere():
    """Eager, a host key or seed tensor is not copied to x's device (on a GPU that copy
    waits for the device's queued work): the kernels take a host key's words. (x on the
    meta device stands in for a GPU's.) Traced, it goes to x's device."""
    from fewbit.rounding.ops import op_key

    x = torch.empty(4, device="meta")
    for seed in (torch.tensor(5), key_of(5)):
        assert op_key(seed, x).device.type == "cpu"
        assert op_key(seed.to("meta"), x).device.type == "meta"


def test_a_kernel_whose_compilation_fails_warns_once_and_runs_eager_with_the_same_bits(monkeypatch):
    """No C++ compiler, no Triton, a torch.compile bug: each compiled kernel (round, the block
    ops, the write-back's list) falls back to its eager code, with the same bits, and says so
    once."""

    def broken(fn, **options):
        def fails(*args, **kwargs):
            raise RuntimeError("no compiler here")

        return fails

    def calls() -> list[torch.Tensor]:
        x = torch.randn(300, generator=torch.Generator().manual_seed(0)) * 3
        w = torch.nn.Parameter(x[:64].clone())
        lpw = LowPrecisionWeights(torch.optim.SGD([w], lr=0.1), "binary8p4", "src", bits=3, seed=4,
                                  params=[w])
        w.grad = x[64:128].clone()
        lpw.step()
        q = fewbit.block.quantize(x, "mxfp8_e4m3", "sr", seed=2)
        return [fewbit.round(x, "binary8p4", "src", bits=3, seed=1), fewbit.round(x, "e4m3"), q.codes,
                q.scales, fewbit.block.round(x, "mxfp4_e2m1", "sr", seed=3), w.detach().clone()]

    with fewbit.configure(compile=False):
        want = calls()
    monkeypatch.setattr(compiled, "_CACHE", {})
    monkeypatch.setattr(compiled, "_BROKEN", set())
    monkeypatch.setattr(compiled.torch, "compile", broken)
    with fewbit.configure(compile=True, compile_threshold=0, native=False):
        with pytest.warns(RuntimeWarning, match="no compiler here.*eager from now on") as first:
            got = calls()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = calls()
    # round src and rne, the block quantize and round, the write-back
    assert len(first) == len(compiled._BROKEN) == 5
    for a, b, c in zip(got, again, want, strict=True):
        assert torch.equal(a, c) and torch.equal(b, c)


# --- export hunt: torch.fx, torch.func under torch.compile ---


def test_symbolic_trace_is_refused_by_name_and_a_leaf_fake_quantize_traces():
    """torch.fx.symbolic_trace hands fewbit's functions a Proxy, which holds no values: each
    refuses it naming the tracers that record fewbit's ops ("x must be a torch.Tensor, not
    Proxy", and torch's "symbolically traced variables cannot be used as inputs to control
    flow" for FakeQuantize, until 2026-11-30); a FakeQuantize kept a leaf traces and runs."""

    class Calls(torch.nn.Module):
        def __init__(self, call):
            super().__init__()
            self.call = call

        def forward(self, x):
            return self.call(x)

    for call in (lambda x: fewbit.round(x, "e4m3", "sr", seed=3), lambda x: fewbit.block.round(x, "mxfp4"),
                 lambda x: fewbit.quantize(x, "e4m3"), lambda x: fewbit.encode(x, "e4m3"),
                 lambda x: fewbit.nn.fake_quantize(x, "e4m3", "e5m2")):  # fmt: skip
        with pytest.raises(TypeError, match="symbolic_trace cannot trace .*make_fx"):
            torch.fx.symbolic_trace(Calls(call))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), FakeQuantize("e4m3", "e5m2", seed=1))
    with pytest.raises(TypeError, match="cannot trace FakeQuantize.*is_leaf_module"):
        torch.fx.symbolic_trace(model)

    class Leaves(torch.fx.Tracer):
        def is_leaf_module(self, m, name):
            return isinstance(m, FakeQuantize) or super().is_leaf_module(m, name)

    traced = torch.fx.GraphModule(model, Leaves().trace(model))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    want = model(x)
    model[1].reset_parameters()
    assert torch.equal(traced(x), want) and int(model[1].calls) == 1


def test_compiled_func_grad_is_refused_by_name_or_runs_eagerly():
    """torch.compile of torch.func.grad through fewbit's functions: torch 2.13 refuses the
    traced op's gradient there, and failed without fullgraph too, in words about an
    autograd.Function's setup_context (until 2026-11-30). fullgraph=True now refuses it
    naming the ways that work; without it Dynamo runs the frame eagerly, with eager's
    gradient. An op without a gradient (quantize) and vmap compile as before."""
    from fewbit.nn import fake_quantize

    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(15))
    key = key_of(3)
    for f in (lambda v: fewbit.round(v, "e4m3", "sr", seed=key).pow(2).sum(),
              lambda v: fewbit.block.round(v, "mxfp4", "sr", seed=key).pow(2).sum(),
              lambda v: fake_quantize(v, "e4m3", Quant("e5m2", "sr"), key).pow(2).sum()):  # fmt: skip
        torch._dynamo.reset()
        with pytest.raises(Exception, match="fewbit: torch.compile of torch.func.grad"):
            torch.compile(torch.func.grad(f), fullgraph=True, backend="eager")(x)
    # (aot_eager: with backend="eager", Dynamo fails inside the eager frames' backward, torch 2.13)
    grad = torch.func.grad(lambda v: fewbit.round(v, "e4m3", "sr", seed=key).pow(2).sum())
    torch._dynamo.reset()
    assert torch.equal(torch.compile(grad, backend="aot_eager")(x), grad(x))
    f = lambda v: fewbit.quantize(v, "e4m3", "sr", seed=key).float().sum() + v.pow(2).sum()  # noqa: E731
    torch._dynamo.reset()
    assert torch.equal(torch.compile(torch.func.grad(f), fullgraph=True, backend="eager")(x), 2 * x)
    f = lambda v: fewbit.round(v, "e4m3", "sr", seed=key)  # noqa: E731
    assert torch.equal(torch.compile(torch.vmap(f), fullgraph=True, backend="eager")(x), torch.vmap(f)(x))


def test_numpy_scalars_that_pick_the_graph_are_refused_by_name_under_compile():
    """Dynamo traces a numpy scalar as an array without its value: bits, fraction, sat and a
    block axis, which pick the graph, are refused naming the argument and the fix (they
    were "bits must be an int, not ndarray", and for sat Dynamo's error on a tensor's
    repr, until 2026-11-30); without fullgraph the call runs eagerly, with eager's bits.
    A numpy seed is a seed tensor: one graph for every value."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(16))
    for name, value, call in (
        ("bits", np.int64(3), lambda v, b: fewbit.round(v, "e4m3", "src", bits=b, seed=1)),
        ("fraction", np.float32(0.5), lambda v, p: fewbit.round(v, "e4m3", "sr_fraction", fraction=p,
                                                                seed=1)),
        ("sat", np.bool_(True), lambda v, s: fewbit.round(v, "e4m3", sat=s)),
        ("axis", np.int64(1), lambda v, a: fewbit.block.round(v, "mxfp4", axis=a)),
    ):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=f"{name}: torch.compile traces a numpy scalar"):
            torch.compile(call, fullgraph=True, backend="eager")(x, value)
    assert torch.equal(torch.compile(call, backend="eager")(x, value), call(x, value))
    torch._dynamo.reset()
    counters.clear()
    seeded = torch.compile(lambda v, s: fewbit.round(v, "e4m3", "sr", seed=s), fullgraph=True,
                           backend="eager")
    for seed in (1, 2, 2**40):
        assert torch.equal(seeded(x, np.int64(seed)), fewbit.round(x, "e4m3", "sr", seed=seed))
    assert counters["stats"]["unique_graphs"] == 1
