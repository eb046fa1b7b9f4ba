"""LowPrecisionWeights: Algorithm 1's write-back, its keys, options and errors."""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

import fewbit
import fewbit.block as block
from fewbit.optim import LowPrecisionWeights
from fewbit.random import as_key, fold_in
from fewbit.rounding import compiled
from fewbit.rounding.checks import check_round_args
from fewbit.rounding.foreach import round_foreach_

FMT = "binary8p4"


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def loss_of(m: torch.nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)
    return (m(x) - y).pow(2).mean()


def train(m, opt, steps: int, start: int = 0) -> None:
    for t in range(start, start + steps):
        opt.zero_grad()
        loss_of(m, t).backward()
        opt.step()


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize(
    ("fmt", "mode"),
    [(FMT, mode) for mode in ("src", "srff", "rne", "sr", "sr_fraction")]
    + [("mxfp4", "src"), ("nvfp4", "src"), ("nvfp4", "rne"), ("hbfp6", "src"), ("hbfp6", "sr_fraction")],
)
def test_write_back_is_the_documented_rounding(fmt, mode):
    """Step t rounds parameter i as fewbit.round(w + u in bf16, seed=fold_in(key, t, i));
    a block format as fewbit.block.round with the same key, in blocks along the last dimension."""
    extra = {"fraction": 0.5} if mode == "sr_fraction" else {}
    a, b = model(), model()
    lpw = LowPrecisionWeights(torch.optim.AdamW(a.parameters(), lr=0.01), fmt, mode, bits=3, seed=9,
                              update_dtype=torch.bfloat16, **extra)  # fmt: skip
    plain = torch.optim.AdamW(b.parameters(), lr=0.01)
    key = fewbit.random.Key.from_seed(9)
    stochastic = fewbit.RoundMode(mode).is_stochastic
    bits = 3 if mode not in ("sr", "rne") else None
    block = fmt != FMT
    rounding = fewbit.block.round if block else functools.partial(fewbit.round, sat=True)

    def write_back(step: int) -> None:
        with torch.no_grad():
            for i, p in enumerate(w for w in b.parameters() if w.dim() >= 2):
                seed = {"seed": fold_in(key, step, i), "bits": bits, **extra} if stochastic else {}
                p.copy_(rounding(p.to(torch.bfloat16), fmt, mode, **seed))

    write_back(0)
    for t in range(1, 6):
        train(a, lpw, 1, start=t)
        train(b, plain, 1, start=t)
        write_back(t)
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
            assert bits_equal(pa.detach(), pb.detach()), (mode, t)
    matrices = [p.detach() for p in a.parameters() if p.dim() >= 2]
    # Values of the format: a fixed point of its rounding. (Not HBFP's: a block's largest
    # magnitude may round to -2^(e+1), which rescales the block when it is rounded again;
    # nor NVFP4's, whose per-tensor scale moves with the tensor's largest magnitude.)
    if not fmt.startswith("hbfp") and fmt != "nvfp4":
        assert all(torch.equal(rounding(p, fmt), p) for p in matrices)
    assert lpw.names == ["param 0", "param 2"]  # vectors (biases) are left in float32


def test_an_added_param_group_is_kept_in_the_format():
    """add_param_group after two steps: the group's matrices are rounded at once with
    fold_in(key, 2, i), i their places after the weights selected before, its vectors are
    left alone, and the next step writes both back as any selected weight; a group the
    write-back cannot hold is refused before the inner optimizer takes it. The weights selected
    before are not rounded again: in HBFP, where rounding is no fixed point, that moved them."""
    a = model()
    lpw = LowPrecisionWeights(torch.optim.SGD(a.parameters(), lr=0.1), FMT, "src", seed=4)
    train(a, lpw, 2)
    extra = torch.nn.Linear(4, 8)
    w0, bias0 = extra.weight.detach().clone(), extra.bias.detach().clone()
    key = fewbit.random.Key.from_seed(4)
    lpw.add_param_group({"params": extra.parameters(), "lr": 0.05})
    assert bits_equal(extra.weight.detach(), fewbit.round(w0, FMT, "src", bits=3, seed=fold_in(key, 2, 2),
                                                          sat=True))  # fmt: skip
    assert torch.equal(extra.bias.detach(), bias0)
    assert lpw.names == ["param 0", "param 2", "param 4"] and lpw.param_groups[1]["lr"] == 0.05
    extra.weight.grad, extra.bias.grad = torch.ones(8, 4), torch.ones(8)
    w1 = extra.weight.detach() - 0.05
    lpw.step()
    assert bits_equal(extra.weight.detach(), fewbit.round(w1, FMT, "src", bits=3, seed=fold_in(key, 3, 2),
                                                          sat=True))  # fmt: skip
    assert torch.equal(extra.bias.detach(), bias0 - 0.05)
    for bad in (torch.nn.Parameter(torch.ones(4, 4, dtype=torch.float64)), lpw.params[0]):
        with pytest.raises(ValueError, match="mix dtypes|more than one parameter group"):
            lpw.add_param_group({"params": [bad]})
        assert len(lpw.param_groups) == 2 and len(lpw.params) == 3
    # A set's order changes between runs, and with it the added weights' bits (torch refuses
    # one too; the wrapper made it a list first).
    with pytest.raises(TypeError, match="ordered collection"):
        lpw.add_param_group({"params": set(torch.nn.Linear(4, 4).parameters())})
    assert len(lpw.param_groups) == 2 and len(lpw.params) == 3
    # HBFP4: int4 mantissas k/4 (k in -8..7) times 2^floor(log2 amax). The block [-1.9, 0.25, 0..]
    # takes 2^0, an ulp of 1/4: RNE gives [-2, 0.25]. Rounded again, amax 2 takes 2^1, an ulp
    # of 1/2, and 0.25 (a tie) would go to 0.
    first = torch.zeros(2, 64)
    first[0, :2] = torch.tensor([-1.9, 0.25])
    first = torch.nn.Parameter(first)
    hbfp = LowPrecisionWeights(torch.optim.SGD([first], lr=0.1), "hbfp4", "rne", params=[first])
    assert first[0, :2].tolist() == [-2.0, 0.25]
    hbfp.add_param_group({"params": [torch.nn.Parameter(torch.randn(2, 64))]})
    assert first[0, :2].tolist() == [-2.0, 0.25] and not first[1].any()


def test_sr_keeps_updates_below_half_an_ulp_and_rne_loses_them():
    """w = 1, u = -2^-7: an eighth of binary8p4's ulp (1/16) below 1. RNE keeps 1 for
    ever; SRC with N = D = 4 (bfloat16 updates) is exact SR, so unbiased."""
    n, lr = 1 << 12, 2.0**-7
    means = {}
    for mode in ("rne", "src"):
        w = torch.nn.Parameter(torch.ones(n, 1))
        lpw = LowPrecisionWeights(torch.optim.SGD([w], lr=lr), FMT, mode, bits=4, seed=1,
                                  update_dtype=torch.bfloat16)  # fmt: skip
        w.grad = torch.ones_like(w)
        lpw.step()
        means[mode] = w.detach().double()
    assert torch.all(means["rne"] == 1.0)
    # 1 - 2^-7 lies 7/8 of the way from 15/16 to 1: P(1) = 7/8, mean 1 - 2^-7 exactly.
    got = means["src"]
    se = got.std() / n**0.5
    assert abs(got.mean() - (1 - lr)) < 5 * se
    assert set(got.unique().tolist()) == {15 / 16, 1.0}


@pytest.mark.parametrize("mode", ["src", "sr_fraction"])
def test_compiled_write_back_equals_eager(mode):
    """Weights of 8192 elements or more go through the compiled kernel, a call each."""
    extra = {"fraction": 0.3} if mode == "sr_fraction" else {}
    results = []
    for compile in (False, True):
        with fewbit.configure(compile=compile):
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(128, 96), torch.nn.Linear(96, 8))  # 12288 + 768
            lpw = LowPrecisionWeights(torch.optim.AdamW(m.parameters(), lr=0.01), FMT, mode, seed=2,
                                      update_dtype=torch.bfloat16, **extra)  # fmt: skip
            start = m[0].weight.detach().clone()
            with warnings.catch_warnings():
                # A kernel that fails to compile falls back to eager with a RuntimeWarning
                # and the same bits: only the warning shows it.
                warnings.simplefilter("error", RuntimeWarning)
                for t in range(2):
                    lpw.zero_grad()
                    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(t))
                    m(x).square().mean().backward()
                    lpw.step()
            assert not torch.equal(start, m[0].weight)
            results.append([p.detach().clone() for p in m.parameters()])
    for a, b in zip(*results, strict=True):
        assert bits_equal(a, b)


@pytest.mark.parametrize("held", [False, True])
def test_write_back_compiles_weights_of_8192_elements_or_more(monkeypatch, held):
    """Where the native kernel does not apply, a weight of 8192 elements is rounded by the
    compiled kernel (below the compile threshold of 65536 that other calls keep), one of
    4096 eagerly: through round_foreach_, and through the calls of a weight each that
    store_codes makes."""
    from fewbit.rounding import ops

    sizes = []
    real = ops.compiled_round
    monkeypatch.setattr(ops, "compiled_round", lambda flat, *a: sizes.append(flat.numel()) or real(flat, *a))
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(128, 64, bias=False), torch.nn.Linear(64, 64, bias=False))
    with fewbit.configure(native=False):
        assert fewbit.config.current().compile_threshold == 65536
        lpw = LowPrecisionWeights(torch.optim.SGD(m.parameters(), lr=0.1), FMT, "src", seed=1,
                                  store_codes=held)  # fmt: skip
        sizes.clear()
        m(torch.randn(2, 128)).square().sum().backward()
        lpw.step()
    assert sizes == [8192]


def test_compiled_write_back_compiles_for_each_format():
    """Where the native kernel does not apply, the write-back's compiled kernel serves a
    second format too: compiled dynamic, Dynamo made the second spec's ints symbols and
    failed (the same bits, eager, with a RuntimeWarning)."""
    x = torch.rand(37, 19) + 0.5
    with fewbit.configure(native=False, compile_threshold=1):
        for fmt in ("binary8p4", "ocp_e5m2"):
            spec = check_round_args(x, fmt, "src", True, 3, None)
            t = x.clone()
            round_foreach_([t], spec, as_key(1), 2, [0], torch.float32)
            assert torch.equal(t, fewbit.round(x, fmt, "src", bits=3, seed=fold_in(as_key(1), 2, 0))), fmt


def test_write_back_of_no_tensors_does_nothing():
    spec = check_round_args(torch.ones(1), "binary8p4", "src", True, 3, None)
    round_foreach_([], spec, as_key(1), 0, [], torch.float32)  # was an IndexError


@pytest.mark.parametrize("via", [torch.float64, torch.bfloat16])
def test_compiled_write_back_compiles_for_the_first_list_of_weights_only(monkeypatch, via):
    """Where the native kernel does not apply, the write-back rounds each weight with
    round's compiled kernel: a list compiled whole took a graph per list of shapes, and
    a run whose weights with gradients vary reached Dynamo's recompile limit at the 9th,
    warned that compilation had failed and ran eager from then on. Now the graphs of the
    first list (lengths under a row of LANES, of one, longer) serve every later list. Each
    weight's bits are round's of it converted to the update dtype by torch, eager."""
    spec = check_round_args(torch.ones(1, dtype=via), "binary8p4", "src", True, 3, None)
    monkeypatch.setattr(compiled, "_CACHE", {})
    g = torch.Generator().manual_seed(2)
    with fewbit.configure(native=False, compile_threshold=1):
        for n in range(10):
            # under a row of LANES, one row, then longer ones: the first list has them all
            shapes = [(20 + n, 9), (32, 16 + n), (40 + n, 30), (90 + n, 40)]
            chosen = shapes if n == 0 else shapes[n % 4:] + shapes[: n % 3]
            weights = [torch.randn(shape, generator=g, dtype=torch.float64) for shape in chosen]
            got = [w.clone() for w in weights]
            round_foreach_(got, spec, as_key(1), 0, range(n, n + len(got)), via)
            for i, (w, r) in enumerate(zip(weights, got, strict=True)):
                with fewbit.configure(compile=False):
                    key = fold_in(as_key(1), 0, n + i)
                    want = fewbit.round(w.to(via), "binary8p4", "src", bits=3, seed=key)
                assert torch.equal(r, want.to(torch.float64)), (n, i)
            if n == 0:
                counters.clear()  # after the first list's compilation
    assert counters["stats"]["unique_graphs"] == 0
    assert len(compiled._CACHE) == 1 and not compiled._BROKEN


def test_resume_from_state_dict_is_bit_identical():
    a = model()
    lpw = LowPrecisionWeights(torch.optim.AdamW(a.parameters(), lr=0.01), FMT, "src", seed=3)
    train(a, lpw, 6)
    b = model()
    lpw_b = LowPrecisionWeights(torch.optim.AdamW(b.parameters(), lr=0.01), FMT, "src", seed=3)
    train(b, lpw_b, 3)
    saved = {"model": b.state_dict(), "opt": lpw_b.state_dict()}
    c = model(seed=1)  # different initial weights: everything must come from the checkpoint
    lpw_c = LowPrecisionWeights(torch.optim.AdamW(c.parameters(), lr=0.01), FMT, "src", seed=3)
    c.load_state_dict(saved["model"])
    lpw_c.load_state_dict(saved["opt"])
    train(c, lpw_c, 3, start=3)
    for pa, pc in zip(a.parameters(), c.parameters(), strict=True):
        assert bits_equal(pa.detach(), pc.detach())
    assert lpw_c.steps == 6
    # The inner optimizer's state, as code written for a torch optimizer reads it.
    state_a, state_c = lpw.state[next(a.parameters())], lpw_c.state[next(c.parameters())]
    assert state_c["step"] == 6 and torch.equal(state_c["exp_avg"], state_a["exp_avg"])


def test_different_seeds_round_differently():
    a, b = model(), model()
    for m, seed in ((a, 1), (b, 2)):
        train(m, LowPrecisionWeights(torch.optim.AdamW(m.parameters(), lr=0.01), FMT, "src", seed=seed), 2)
    assert not torch.equal(a[0].weight, b[0].weight)


@pytest.mark.parametrize(("mode", "update_dtype"),
                         [("src", None), ("src", "bfloat16"), ("srff", "bfloat16"), ("rne", "bfloat16")])
def test_store_codes_frees_floats_and_restores_the_same_weights(mode, update_dtype):
    """store_codes rounds straight to codes on a path of its own: with the paper's
    update_dtype=bfloat16 (w + u rounded to bfloat16 first) it must hold the very weights
    the floats path holds, bit for bit (a codes path that skipped the bfloat16 step passed)."""
    a, b = model(), model()
    via = update_dtype and getattr(torch, update_dtype)
    opts = {"seed": 4, "update_dtype": via, "bits": None if mode == "rne" else 3}
    lpw_a = LowPrecisionWeights(torch.optim.AdamW(a.parameters(), lr=0.01), FMT, mode, **opts)
    lpw_b = LowPrecisionWeights(torch.optim.AdamW(b.parameters(), lr=0.01), FMT, mode, **opts,
                                store_codes=True)  # fmt: skip
    for t in range(3):
        lpw_b.zero_grad()
        loss_of(b, t).backward()
        lpw_b.step()
        assert all(p.untyped_storage().nbytes() == 0 for p in lpw_b.params)
        assert all(c.dtype == torch.uint8 for c in lpw_b._codes)
        train(a, lpw_a, 1, start=t)
    lpw_b.materialize()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert bits_equal(pa.detach(), pb.detach())
    mem = lpw_b.memory()
    assert mem["elements"] == 16 * 32 + 32 * 4
    assert mem["float_bytes"] == 4 * mem["elements"] and mem["code_bytes"] == mem["elements"]


@pytest.mark.parametrize("store_codes", [False, True])
@pytest.mark.parametrize(("mode", "sat"), [("src", True), ("rne", True), ("rne", False)])
def test_an_update_past_the_max_saturates_or_goes_to_inf_as_sat_says(mode, sat, store_codes):
    """binary8p4's largest value is 224. SGD at lr 1 takes 200 to 300 and -200 to -300:
    under sat=True (the default) both saturate to +-224, and a weight of 500 (saturated to
    224 at selection) stays there; under sat=False they go to +-Inf. The same with
    store_codes, whose codes path builds its own rounding call (it dropped sat, giving Inf
    under the default, and sat=False saturated silently: neither was tested)."""
    assert fewbit.format(FMT).max == 224.0
    big = 500.0 if sat else 2.0  # sat=False refuses a weight beyond the range at selection
    w = torch.nn.Parameter(torch.tensor([[200.0, -200.0, 1.0, big]]))
    lpw = LowPrecisionWeights(torch.optim.SGD([w], lr=1.0), FMT, mode, bits=None if mode == "rne" else 3,
                              sat=sat, seed=1, store_codes=store_codes)  # fmt: skip
    w.grad = torch.tensor([[-100.0, 100.0, 0.0, 0.0]])
    lpw.step()
    lpw.materialize()
    want = [224.0, -224.0, 1.0, 224.0] if sat else [float("inf"), float("-inf"), 1.0, 2.0]
    assert w.detach().tolist() == [want]


@pytest.mark.parametrize("fmt", [FMT, "mxfp4"])
def test_store_codes_keeps_floats_until_the_first_step(fmt):
    """The rounding at construction keeps the weights as floats: a checkpoint loaded into
    the model after wrapping it, and a forward before the first zero_grad(), find them
    (before, their storage was freed there: the load crashed the process)."""
    a, b = model(), model()
    lpw_a = LowPrecisionWeights(torch.optim.AdamW(a.parameters(), lr=0.01), fmt, "src", seed=4)
    lpw_b = LowPrecisionWeights(torch.optim.AdamW(b.parameters(), lr=0.01), fmt, "src", seed=4,
                                store_codes=True)  # fmt: skip
    assert all(p.untyped_storage().nbytes() == 4 * p.numel() for p in lpw_b.params)
    b.load_state_dict(a.state_dict())  # the rounded weights, as a checkpoint would hold them
    loss_of(b, 0).backward()  # forward and backward, then the step
    lpw_b.step()
    train(a, lpw_a, 1)
    assert all(p.untyped_storage().nbytes() == 0 for p in lpw_b.params)  # codes from the step on
    lpw_b.materialize()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert bits_equal(pa.detach(), pb.detach())


@pytest.mark.parametrize("fmt", [FMT, "mxfp4"])
def test_reading_a_weight_held_as_codes_decodes_it_first(fmt):
    """Between a step and zero_grad() the weights' storage is freed; reading one (a
    forward, a checkpoint, a print, a copy, a load) first decodes them all, where it
    crashed the process before (SIGSEGV: a read of 0-byte storage). Metadata, gradients
    and the optimizer's state keyed by the weight are read without decoding."""
    import copy
    import io

    a, b = model(), model()
    lpw_a = LowPrecisionWeights(torch.optim.AdamW(a.parameters(), lr=0.01), fmt, "src", seed=4)
    lpw_b = LowPrecisionWeights(torch.optim.AdamW(b.parameters(), lr=0.01), fmt, "src", seed=4,
                                store_codes=True)  # fmt: skip
    x = torch.randn(3, 16)
    reads = {
        "forward": lambda: b(x),
        "state_dict": lambda: torch.save(b.state_dict(), io.BytesIO()),
        "repr": lambda: repr(b[0].weight),
        "deepcopy": lambda: copy.deepcopy(b),
        "load": lambda: b.load_state_dict(a.state_dict()),
    }
    for t, (name, read) in enumerate(reads.items()):
        train(a, lpw_a, 1, start=t)
        train(b, lpw_b, 1, start=t)
        w = b[0].weight
        assert w.shape == (32, 16) and w.grad is not None and lpw_b.state[w]["step"] == t + 1
        assert lpw_b._stored, "metadata decoded the weights"
        result = read()
        assert not lpw_b._stored, name
        assert all(type(p) is torch.nn.Parameter for p in b.parameters()), name
        if name == "forward":
            assert torch.equal(result, a(x))
        if name == "deepcopy":
            assert all(type(p) is torch.nn.Parameter for p in result.parameters())
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
            assert bits_equal(pa.detach(), pb.detach()), name
        del result  # (the forward's graph holds a view of a weight: the next step would keep it)


def test_compiled_code_reading_a_weight_held_as_codes_decodes_it_and_warns():
    """torch.compile's first look at a weight held as codes decodes it (a fullgraph
    forward gives the values eager would), and warns that it compiles again."""
    a, b = model(), model()
    lpw_a = LowPrecisionWeights(torch.optim.AdamW(a.parameters(), lr=0.01), FMT, "src", seed=4)
    lpw_b = LowPrecisionWeights(torch.optim.AdamW(b.parameters(), lr=0.01), FMT, "src", seed=4,
                                store_codes=True)  # fmt: skip
    forward = torch.compile(b, fullgraph=True, backend="eager")
    x = torch.randn(3, 16)
    train(a, lpw_a, 1)
    train(b, lpw_b, 1)
    with pytest.warns(UserWarning, match="compiles again: call materialize"):
        y = forward(x)
    assert not lpw_b._stored and torch.equal(y, a(x))


def test_store_codes_frees_weights_loaded_by_torch_load(tmp_path):
    """torch.load's storage cannot be resized: a model loaded with assign=True (a meta-device
    init) stayed floats at every step, with a warning that blamed a sharing tensor."""
    torch.save(model().state_dict(), tmp_path / "w.pt")
    with torch.device("meta"):
        m = model()
    m.load_state_dict(torch.load(tmp_path / "w.pt"), assign=True)
    assert not m[0].weight.untyped_storage().resizable()
    lpw = LowPrecisionWeights(torch.optim.SGD(m.parameters(), lr=0.1), FMT, store_codes=True)
    m(torch.randn(2, 16)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lpw.step()
    assert lpw._stored and not any(w.untyped_storage().nbytes() for w in lpw.params)


def test_store_codes_refuses_weights_it_cannot_free_alone_and_leaves_a_set_one_as_set():
    """The write-back frees a weight's whole storage: a flat buffer's other parameters, or a
    second weight on it, were freed too, and a read of them segfaulted. A weight given other
    storage in the window (set_) had the decoded values copied over the user's tensor."""
    flat = torch.zeros(40)
    w, b = torch.nn.Parameter(flat[:32].view(4, 8)), torch.nn.Parameter(flat[32:])
    with pytest.raises(ValueError, match="param 0's holds more than it"):
        LowPrecisionWeights(torch.optim.SGD([w, b], lr=0.1), FMT, store_codes=True)
    v = torch.nn.Parameter(torch.ones(4, 8))
    alias = torch.nn.Parameter(v.detach())
    with pytest.raises(ValueError, match="param 1's holds more than it"):
        LowPrecisionWeights(torch.optim.SGD([v, alias], lr=0.1), FMT, store_codes=True)
    del alias  # (else the step keeps v as floats: test_a_weight_another_tensor_shares_stays_floats)
    lpw = LowPrecisionWeights(torch.optim.SGD([v], lr=0.1), FMT, store_codes=True)
    v.grad = torch.zeros(4, 8)
    lpw.step()
    assert lpw._stored and not v.untyped_storage().nbytes()
    new = torch.full((4, 8), 7.0)
    with torch.no_grad():
        v.set_(new)
    lpw.zero_grad()
    assert torch.equal(new, torch.full((4, 8), 7.0)) and torch.equal(v.detach(), new)


def test_a_forward_of_an_fsdp2_model_holding_codes_decodes_first():
    """FSDP2's forward all-gathers from its shards' storage, which the step freed (a
    forward between the step and zero_grad() segfaulted); any module's forward in that
    window now decodes the weights first, and gives the values it gives after zero_grad()."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        m = model()
        for layer in (m[0], m[2], m):
            fully_shard(layer)
        lpw = LowPrecisionWeights(torch.optim.AdamW(m.parameters(), lr=0.01), FMT, "src", store_codes=True)
        x = torch.randn(3, 16)
        for t in range(2):
            train(m, lpw, 1, start=t)
            assert lpw._stored and all(not p._local_tensor.untyped_storage().nbytes() for p in lpw.params)
            with torch.no_grad():
                y = m(x)
            assert not lpw._stored
            lpw.zero_grad()
            with torch.no_grad():
                assert torch.equal(y, m(x))
    finally:
        dist.destroy_process_group()


def test_storage_holders_counts_the_tensors_on_a_storage():
    """store_codes asks torch's private storage use count whether a weight's storage is its
    own: this fails first if torch drops or changes it (store_codes would then free
    storage that another tensor still reads, as it did before it asked)."""
    from fewbit.optim import _storage_holders

    w = torch.nn.Parameter(torch.ones(4, 8))
    assert _storage_holders(w) == 1
    d = w.detach()
    row = d[1]
    assert _storage_holders(w) == 3 and _storage_holders(row) == 3
    del d, row
    assert _storage_holders(w) == 1
    assert _storage_holders(w.detach().clone()) == 1


def test_a_wrapper_saved_whole_frees_its_weights_again_after_loading():
    """torch.save of the model and its wrapper together: torch.load's storages cannot be
    resized, so store_codes kept every weight as floats from then on, warning at each step
    that another tensor shared it. They now get storage of their own at the step, and are
    freed, with the bits of the run that was not saved."""
    import io

    m = model()
    lpw = LowPrecisionWeights(torch.optim.AdamW(m.parameters(), lr=0.01), FMT, "src", seed=5,
                              store_codes=True)  # fmt: skip
    train(m, lpw, 1)
    saved = io.BytesIO()
    torch.save((m, lpw), saved)
    saved.seek(0)
    m2, lpw2 = torch.load(saved, weights_only=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(m2, lpw2, 2, start=1)
    assert [p.untyped_storage().nbytes() for p in lpw2.params] == [0, 0]
    train(m, lpw, 2, start=1)
    lpw.materialize(), lpw2.materialize()
    for a, b in zip(m.parameters(), m2.parameters(), strict=True):
        assert bits_equal(a.detach(), b.detach())


@pytest.mark.parametrize(("fmt", "scale"), [(FMT, False), (FMT, True), ("mxfp4", False)])
def test_a_weight_another_tensor_shares_stays_floats(fmt, scale):
    """A tensor taken from a weight before a step (.detach(), .data, a state_dict() entry,
    a graph kept for a second backward) shares its storage: store_codes freed it there, and
    a read of that tensor segfaulted. Such a weight now stays floats for the step, with a
    warning naming it; the values are the same, and the other weights are kept as codes."""
    a, b = model(), model()
    lpw_a = LowPrecisionWeights(torch.optim.AdamW(a.parameters(), lr=0.01), fmt, "src", seed=4, scale=scale)
    lpw_b = LowPrecisionWeights(torch.optim.AdamW(b.parameters(), lr=0.01), fmt, "src", seed=4, scale=scale,
                                store_codes=True)  # fmt: skip
    taken = b.state_dict()["2.weight"]
    train(a, lpw_a, 1)
    with pytest.warns(UserWarning, match=r"kept param 2 as floats this step: another tensor shares"):
        train(b, lpw_b, 1)
    assert b[0].weight.untyped_storage().nbytes() == 0 and taken.untyped_storage().nbytes() == 4 * 32 * 4
    assert bits_equal(taken, a[2].weight.detach())  # read in the window: the step's values
    lpw_b.materialize()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert bits_equal(pa.detach(), pb.detach())
    del taken
    train(a, lpw_a, 1, start=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(b, lpw_b, 1, start=1)
    assert all(p.untyped_storage().nbytes() == 0 for p in lpw_b.params)
    lpw_b.materialize()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert bits_equal(pa.detach(), pb.detach())


def test_a_weight_whose_storage_cannot_be_resized_stays_floats_and_the_guard_leaves_it_resizable():
    """A numpy array made from a weight leaves its storage unresizable for good: freeing
    it raised in step(). While the array is held the weight stays floats, with the
    warning; once it is gone the weight gets storage of its own at the next step, and is
    freed. The replica guard's hashes (guard=True, check_in_sync) read a copy, so they no
    longer do this."""
    from fewbit.replicas import _raw

    m = model()
    w = m[0].weight
    _raw(w)
    assert w.untyped_storage().resizable()
    lpw = LowPrecisionWeights(torch.optim.SGD(m.parameters(), lr=0.1), FMT, "src", seed=1, store_codes=True)
    array = w.detach().numpy()
    with pytest.warns(UserWarning, match=r"kept param 0 as floats this step: .* a numpy array of it"):
        train(m, lpw, 1)
    assert w.untyped_storage().nbytes() == 32 * 16 * 4 and m[2].weight.untyped_storage().nbytes() == 0
    lpw.materialize()
    assert torch.equal(fewbit.round(w.detach(), FMT), w.detach())
    assert torch.equal(torch.from_numpy(array), w.detach())  # the array reads the weight's values
    del array
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(m, lpw, 1, start=1)
    assert w.untyped_storage().nbytes() == 0


def test_scale_stays_within_the_weights_dtype_and_a_refused_write_back_unscales():
    """A float16 weight of largest magnitude 2^-9 into E4M3 took the scale 2^16, inf in
    float16: 0 became NaN and the rest inf / inf. Its values here are E4M3's times 2^-15,
    so the largest scale float16 holds keeps them exactly. And a write-back refused part
    way (a NaN, E2M1 has none) left the other weights multiplied by their scale."""
    w = torch.nn.Parameter(torch.tensor([[0.0, 2**-9, -(2**-10), 3 * 2**-12]], dtype=torch.float16))
    kept = w.detach().clone()
    LowPrecisionWeights(torch.optim.SGD([w], lr=0.1), "e4m3", "rne", scale=True)
    assert torch.equal(w.detach().view(torch.int16), kept.view(torch.int16))
    bad, good = torch.nn.Parameter(torch.ones(2, 4)), torch.nn.Parameter(torch.full((2, 4), 2**-7))
    lpw = LowPrecisionWeights(torch.optim.SGD([bad, good], lr=1.0), "e2m1", "rne", scale=True)
    bad.grad, good.grad = torch.full((2, 4), float("nan")), torch.zeros(2, 4)
    with pytest.raises(ValueError, match="NaN"):
        lpw.step()
    assert torch.equal(good.detach(), torch.full((2, 4), 2**-7))


@pytest.mark.parametrize("fmt", ["e2m1", "int4"])
def test_a_nan_weight_in_a_format_without_nan_is_refused_before_any_is_written(fmt):
    """The rounding at selection refused the NaN weight after the weights before it were
    rounded: construction failed with the model changed (add_param_group: with the group
    added to the inner optimizer)."""
    first = torch.nn.Parameter(torch.full((2, 4), 0.3))
    nan = torch.nn.Parameter(torch.ones(2, 4))
    with torch.no_grad():
        nan[1, 2] = float("nan")
    with pytest.raises(ValueError, match=f"param 1 holds a NaN, which .*{fmt} has no value for"):
        LowPrecisionWeights(torch.optim.SGD([first, nan], lr=0.1), fmt, "src", bits=3)
    assert bool((first == 0.3).all())
    lpw = LowPrecisionWeights(torch.optim.SGD([first], lr=0.1), fmt, "src", bits=3)
    with pytest.raises(ValueError, match="param 1 holds a NaN"):
        lpw.add_param_group({"params": [nan]})
    assert len(lpw.param_groups) == 1 and len(lpw.params) == 1


def test_a_weight_beyond_the_range_refused_at_selection_leaves_every_weight_as_it_was():
    """Under sat=False a weight beyond E2M1's range has no value: construction raised after
    the weights before it were rounded in place, and add_param_group left the group added."""
    first = torch.nn.Parameter(torch.full((2, 4), 0.3))
    big = torch.nn.Parameter(torch.full((2, 4), 0.3))
    with torch.no_grad():
        big[1, 2] = 1e6
    with pytest.raises(ValueError, match="beyond its range"):
        LowPrecisionWeights(torch.optim.SGD([first, big], lr=0.1), "e2m1", "rne", bits=None, sat=False)
    assert bool((first == 0.3).all()) and bool((big[0] == 0.3).all())
    lpw = LowPrecisionWeights(torch.optim.SGD([first], lr=0.1), "e2m1", "rne", bits=None, sat=False)
    with pytest.raises(ValueError, match="beyond its range"):
        lpw.add_param_group({"params": [big]})
    assert bool((big[0] == 0.3).all()) and big[1, 2] == 1e6
    assert len(lpw.param_groups) == 1 and len(lpw.params) == 1 and len(lpw.names) == 1
    with torch.no_grad():
        big[1, 2] = 0.3
    lpw.add_param_group({"params": [big]})
    assert len(lpw.params) == 2 and bool((big == 0.5).all())


def test_selection_is_named_by_the_optimizers_places_and_refuses_a_weight_twice():
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    assert LowPrecisionWeights(opt, FMT, params=[m[2].weight]).names == ["param 2"]
    with pytest.raises(ValueError, match="param 2 is selected twice"):
        LowPrecisionWeights(opt, FMT, params=[m[2].weight, m[2].weight])
    with pytest.raises(TypeError, match="scale must be a bool"):
        LowPrecisionWeights(opt, FMT, scale="yes")
    # fp32 "codes" take 4 bytes an element: nothing saved (it said 2 and 8 KB saved)
    assert LowPrecisionWeights(opt, "fp32", "rne", params=[m[0].weight]).memory()["saved_bytes"] == 0


@pytest.mark.parametrize("store_codes", [False, True])
def test_wrappers_of_a_models_parts_draw_one_wrappers_bits_from_their_first_index(store_codes):
    """Pipeline stages wrap their own optimizers. Each wrapper counted its weights from 0,
    so with one seed the stages' first weights drew the same bits (and none drew those of
    one wrapper of the whole model); first_index gives each weight its place in the whole."""

    def run(stages: bool, offset: bool = True) -> list[torch.Tensor]:
        m = model()
        parts = [[m[0].weight, m[0].bias], [m[2].weight, m[2].bias]] if stages else [list(m.parameters())]
        wrappers, first = [], 0
        for params in parts:
            opt = torch.optim.SGD(params, lr=0.1)
            wrappers.append(LowPrecisionWeights(opt, FMT, seed=9, store_codes=store_codes,
                                                first_index=first if offset else 0))  # fmt: skip
            first += len(wrappers[-1].params)
        for t in range(3):
            for w in wrappers:
                w.zero_grad()
            loss_of(m, t).backward()
            for w in wrappers:
                w.step()
        for w in wrappers:
            w.materialize()
        return [m[0].weight.detach().clone(), m[2].weight.detach().clone()]

    whole = run(stages=False)
    assert all(bits_equal(a, b) for a, b in zip(run(stages=True), whole, strict=True))
    assert not bits_equal(run(stages=True, offset=False)[1], whole[1])  # (and the first weight follows)


def test_first_index_is_part_of_a_checkpoints_setup_and_refuses_bad_values():
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    saved = LowPrecisionWeights(opt, FMT, first_index=2).state_dict()
    with pytest.raises(ValueError, match="first_index 2 \\(here 0\\)"):
        LowPrecisionWeights(opt, FMT).load_state_dict(saved)
    older = {**saved, "config": {k: v for k, v in saved["config"].items() if k != "first_index"}}
    LowPrecisionWeights(opt, FMT).load_state_dict(older)  # (written before first_index: from 0)
    with pytest.raises(ValueError, match="first_index 0 \\(here 2\\)"):
        LowPrecisionWeights(opt, FMT, first_index=2).load_state_dict(older)
    for bad, error in ((-1, ValueError), (2**32, ValueError), (True, TypeError), (1.0, TypeError)):
        with pytest.raises(error, match="first_index must be"):
            LowPrecisionWeights(opt, FMT, first_index=bad)


@pytest.mark.parametrize("store_codes", [False, True])
def test_a_weight_without_a_gradient_is_left_as_it_is(store_codes):
    """A frozen weight (or one this step did not reach) is not rounded again after a step,
    as the inner optimizer does not update it. In HBFP rounding is not a fixed point:
    [-1.9, 0.25] rounds to [-2.0, 0.25] (a 4-bit mantissa of -8 at step 1/4), whose largest
    magnitude, 2, takes the next exponent, where 0.25 rounds to 0."""
    frozen = torch.zeros(2, 64)
    frozen[0, :2] = torch.tensor([-1.9, 0.25])
    frozen = torch.nn.Parameter(frozen, requires_grad=False)
    trained = torch.nn.Parameter(torch.randn(4, 64, generator=torch.Generator().manual_seed(0)))
    lpw = LowPrecisionWeights(torch.optim.AdamW([frozen, trained], lr=0.5), "hbfp4", "rne",
                              params=[frozen, trained], store_codes=store_codes)  # fmt: skip
    assert frozen[0, :2].tolist() == [-2.0, 0.25]  # rounded once, at construction
    start = trained.detach().clone()
    for _ in range(3):
        lpw.zero_grad()
        trained.pow(2).sum().backward()
        lpw.step()
    lpw.materialize()
    assert frozen[0, :2].tolist() == [-2.0, 0.25] and not frozen[1].any()
    assert not torch.equal(trained, start)


@pytest.mark.parametrize("store_codes", [False, True])
def test_a_scaled_step_where_no_selected_weight_has_a_gradient_leaves_them(store_codes):
    """With scale=True such a step (frozen weights, only the biases trained) raised from
    torch's foreach ops, which refuse an empty list, after the inner step had run."""
    m = model()
    weights = [m[0].weight, m[2].weight]
    lpw = LowPrecisionWeights(torch.optim.SGD(m.parameters(), lr=0.1), FMT, "src", seed=0, scale=True,
                              params=weights, store_codes=store_codes)  # fmt: skip
    lpw.materialize()
    before = [w.detach().clone() for w in weights]
    m[0].bias.grad = torch.ones_like(m[0].bias)
    lpw.step()
    lpw.materialize()
    assert lpw.steps == 1 and all(torch.equal(w, b) for w, b in zip(weights, before, strict=True))


@pytest.mark.parametrize("store_codes", [False, True])
@pytest.mark.parametrize("fmt", ["e2m1", "binary8p4", "mxfp8_e4m3"])
def test_an_empty_weight_steps_beside_others(fmt, store_codes):
    """An empty weight's stochastic rounding was given no bits: 'mode src needs bits=N'
    from step() in one process, where the write-back is not the compiled kernel's."""
    empty = torch.nn.Parameter(torch.zeros(0, 32))
    full = torch.nn.Parameter(torch.randn(2, 32, generator=torch.Generator().manual_seed(0)))
    with fewbit.configure(compile=False):
        lpw = LowPrecisionWeights(torch.optim.SGD([empty, full], lr=0.1), fmt, "src", bits=3, seed=4,
                                  store_codes=store_codes)  # fmt: skip
        lpw.materialize()
        start = full.detach().clone()
        for p in (empty, full):
            p.grad = torch.ones_like(p)
        lpw.step()
        lpw.materialize()
    assert empty.shape == (0, 32) and not torch.equal(full, start)


def test_power_of_two_scale_keeps_small_weights():
    """Weights of order 1e-5 are below binary8p4's subnormals; scaled, they keep 4 bits. The
    scale puts the largest magnitude in the top binade below half the format's max: worked by
    hand for amax 1 (2^6, not 2^7, where the small elements would round otherwise)."""
    torch.manual_seed(0)
    w0 = torch.randn(64, 64) * 1e-5
    kept = {}
    for scale in (False, True):
        w = torch.nn.Parameter(w0.clone())
        LowPrecisionWeights(torch.optim.SGD([w], lr=0.0), FMT, "rne", scale=scale)
        kept[scale] = w.detach()
    assert (kept[False] == 0).float().mean() > 0.9
    rel = ((kept[True] - w0).abs() / w0.abs()).max()
    assert rel <= 2.0**-4  # half an ulp of a 4-bit significand
    # max 224, amax 1: the scale is 2^6 (64 <= 112 < 128). Times 64: 1 -> 64, 0.5 -> 32;
    # 2^-17 -> 2^-11, half the smallest subnormal 2^-10, a tie RNE takes to 0; 3 * 2^-18 ->
    # 1.5 * 2^-11, nearer 2^-10, back to 2^-16. (Under 2^7, 2^-17 would have been kept.)
    f = fewbit.format(FMT)
    assert f.max == 224.0 and f.smallest_subnormal == 2.0**-10
    w = torch.nn.Parameter(torch.tensor([[1.0, 2.0**-17, 3 * 2.0**-18, 0.5]]))
    LowPrecisionWeights(torch.optim.SGD([w], lr=0.0), FMT, "rne", scale=True)
    assert w.detach().tolist() == [[1.0, 0.0, 2.0**-16, 0.5]]


def test_a_checkpoint_before_the_first_step_leaves_the_run_as_it_was():
    """state_dict(model=) has torch fill AdamW's state by a step at learning rate 0 (its
    count then 1): left in the live optimizer, every later bias correction was a step off."""

    def run(checkpoint: bool) -> torch.Tensor:
        torch.manual_seed(0)
        m = torch.nn.Linear(16, 16)
        lpw = LowPrecisionWeights(torch.optim.AdamW(m.parameters(), lr=1e-2), FMT, "src", seed=3)
        if checkpoint:
            assert lpw.state_dict(model=m)["optimizer"]["state"]  # the checkpoint keeps torch's state
        for t in range(3):
            lpw.zero_grad()
            m(torch.randn(4, 16, generator=torch.Generator().manual_seed(t))).square().mean().backward()
            lpw.step()
        return m.weight.detach().clone()

    assert bits_equal(run(False), run(True))


def test_bad_input():
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        LowPrecisionWeights(object(), FMT)
    with pytest.raises(ValueError, match="P3109 formats need"):
        LowPrecisionWeights(opt, "binary8p55")
    with pytest.raises(ValueError, match="mode"):
        LowPrecisionWeights(opt, FMT, "stochastic")
    for bits in (0, 33):
        with pytest.raises(ValueError, match="bits must be in 1..32"):
            LowPrecisionWeights(opt, FMT, bits=bits)
    half = torch.nn.Linear(4, 4).to(torch.bfloat16)
    with pytest.raises(ValueError, match="cannot hold every value of binary16"):
        LowPrecisionWeights(torch.optim.SGD(half.parameters(), lr=0.1), "binary16", "rne")
    with pytest.raises(ValueError, match="cannot hold"):
        LowPrecisionWeights(opt, "binary16", "rne", update_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not among the optimizer's parameters"):
        LowPrecisionWeights(opt, FMT, params=[torch.nn.Parameter(torch.ones(2, 2))])
    with pytest.raises(ValueError, match="give guard=True with it"):
        LowPrecisionWeights(opt, FMT, guard_group=object())
    with pytest.raises(TypeError, match="guard_group must be a torch.distributed.ProcessGroup .*not object"):
        LowPrecisionWeights(opt, FMT, guard=True, guard_group=object())
    # A tensor, a dict or a set iterated gives rows, names or an order of its own each run.
    for params in (m[0].weight, dict(m.named_parameters()), {m[0].weight},
                   torch.nn.ParameterDict({"w": m[0].weight})):  # fmt: skip
        with pytest.raises(TypeError, match=f"params must be a list .*not a {type(params).__name__}"):
            LowPrecisionWeights(opt, FMT, params=params)
    with pytest.raises(TypeError, match=r"params\[0\] is a str"):
        LowPrecisionWeights(opt, FMT, params=list(dict(m.named_parameters())))
    with pytest.raises(TypeError, match="sr_fraction"):
        LowPrecisionWeights(opt, FMT, "sr_fraction")
    lpw = LowPrecisionWeights(torch.optim.SGD(m.parameters(), lr=0.1), FMT, "src", seed=1)
    other = LowPrecisionWeights(torch.optim.SGD(m.parameters(), lr=0.1), FMT, "src", seed=2)
    with pytest.raises(ValueError, match=r"checkpoint was written with key \[1, 0\] \(here \[2, 0\]\)"):
        other.load_state_dict(lpw.state_dict())
    # The selection decides the bits as the seed does: parameter i takes fold_in(key, t, i).
    m2 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    both = [m2[0].weight, m2[1].weight]
    written = LowPrecisionWeights(torch.optim.SGD(m2.parameters(), lr=0.1), FMT, params=both).state_dict()
    for params in (both[::-1], both[:1]):
        with pytest.raises(ValueError, match="checkpoint was written with params"):
            LowPrecisionWeights(torch.optim.SGD(m2.parameters(), lr=0.1), FMT, params=params).load_state_dict(
                written)  # fmt: skip
    LowPrecisionWeights(torch.optim.SGD(m2.parameters(), lr=0.1), FMT, params=both).load_state_dict(written)
    old = {**written, "config": {k: v for k, v in written["config"].items() if k != "params"}}
    LowPrecisionWeights(torch.optim.SGD(m2.parameters(), lr=0.1), FMT, params=both).load_state_dict(old)
    # A plain torch optimizer's state (KeyError 'config'), or one without steps (loaded, then
    # KeyError 'steps'), is refused before anything is loaded.
    fresh = LowPrecisionWeights(torch.optim.SGD(m2.parameters(), lr=0.1), FMT, params=both)
    for state in (torch.optim.SGD(m2.parameters(), lr=0.5).state_dict(),
                  {**{k: v for k, v in written.items() if k != "steps"}, "optimizer": {
                      **written["optimizer"], "param_groups": [{**written["optimizer"]["param_groups"][0],
                                                               "lr": 0.5}]}}):  # fmt: skip
        with pytest.raises(ValueError, match=r"not a LowPrecisionWeights.state_dict\(\)"):
            fresh.load_state_dict(state)
        assert fresh.param_groups[0]["lr"] == 0.1
    # A config that is no dict, or lacks the format, is refused as such (TypeError, KeyError: on its
    # rank alone, before the all-reduce that refuses it on every rank of a sharded weight's mesh).
    with pytest.raises(ValueError, match=r"not a LowPrecisionWeights.state_dict\(\)"):
        fresh.load_state_dict({**written, "config": None})
    with pytest.raises(ValueError, match="checkpoint was written with fmt None"):
        fresh.load_state_dict({**written, "config": {k: v for k, v in written["config"].items()
                                                     if k != "fmt"}})  # fmt: skip


def test_a_checkpoint_names_its_format_by_every_field_and_its_weights_dtypes(monkeypatch):
    """The set-up check compared a format by name: a checkpoint of a hand-made "my8" (P=4)
    resumed into another "my8" (P=3), and one of float32 weights into bfloat16 ones, each
    with other bits. A hand-made format under a registered name is refused at construction,
    as fewbit.round refuses it."""
    import dataclasses

    from fewbit.formats import FloatFormat
    from fewbit.rounding import ops

    ref = fewbit.format("binary8p4")
    mine, theirs = (FloatFormat("my8", k=8, p=p, bias=ref.bias) for p in (4, 3))
    written = LowPrecisionWeights(torch.optim.SGD(model().parameters(), lr=0.1), mine, "src").state_dict()
    monkeypatch.setattr(ops, "_UNREGISTERED", {})  # a new process, where "my8" is P=3
    other = LowPrecisionWeights(torch.optim.SGD(model().parameters(), lr=0.1), theirs, "src")
    with pytest.raises(ValueError, match=r"checkpoint was written with fmt .*p=4.* \(here .*p=3"):
        other.load_state_dict(written)
    other.load_state_dict({**written, "config": {**written["config"], "fmt": "my8"}})  # older: by name alone
    with pytest.raises(ValueError, match="two formats are named 'binary8p4'"):
        LowPrecisionWeights(torch.optim.SGD(model().parameters(), lr=0.1),
                            dataclasses.replace(ref, has_subnormals=False))  # fmt: skip
    written = LowPrecisionWeights(torch.optim.SGD(model().parameters(), lr=0.1), FMT).state_dict()
    half = LowPrecisionWeights(torch.optim.SGD(model().to(torch.bfloat16).parameters(), lr=0.1), FMT)
    with pytest.raises(ValueError, match=r"written with dtypes \['torch.float32'.*\(here \['torch.bfloat16'"):
        half.load_state_dict(written)
    old = {**written, "config": {k: v for k, v in written["config"].items() if k != "dtypes"}}
    LowPrecisionWeights(torch.optim.SGD(model().parameters(), lr=0.1), FMT).load_state_dict(old)


def test_a_closure_computes_with_grad_and_cast_or_scaled_weights_are_refused():
    """From the training-loop hunt. step() ran the inner optimizer under no_grad, so an
    optimizer that calls its closure itself (torch's set grad mode first) got no gradient.
    Weights cast after wrapping (model.half()) were rounded through the old dtype, a finite
    weight to inf with lr 0; now the step refuses them before writing. A scalify'd model's
    ScaledTensor weights failed deep inside the rounding; now construction names them."""
    from fewbit.scaled import scalify

    class CallsItsClosure(torch.optim.SGD):
        def step(self, closure=None):
            loss = closure()
            super().step()
            return loss

    m = model()
    lpw = LowPrecisionWeights(CallsItsClosure(m.parameters(), lr=0.1), FMT, "rne")

    def closure():
        lpw.zero_grad()
        loss = loss_of(m, 0)
        loss.backward()
        return loss

    want = loss_of(m, 0).detach()  # at the weights rounded at construction, as the closure sees them
    assert torch.equal(lpw.step(closure).detach(), want) and lpw.steps == 1
    m.half()
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(RuntimeError, match=r"were torch.float32 on cpu .* are torch.float16 on cpu now"):
        lpw.step()
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, m.parameters(), strict=True))
    m = model()  # one weight cast, the last selected
    lpw = LowPrecisionWeights(torch.optim.SGD(m.parameters(), lr=0.1), FMT, "rne")
    m[2].weight.data = m[2].weight.data.double()
    with pytest.raises(RuntimeError, match=r"are torch.float32 on cpu and torch.float64 on cpu now"):
        lpw.step()
    with pytest.raises(TypeError, match="param 0 is a ScaledTensor: .* fewbit.scaled.cast"):
        LowPrecisionWeights(torch.optim.SGD(scalify(model()).parameters(), lr=0.1), FMT)


def test_the_inner_optimizer_stepped_alone_says_the_weights_were_not_rounded():
    """GradScaler given opt.optimizer (as schedulers take it) steps the inner optimizer
    alone: the weights left the format without a word (the training-loop hunt). It now warns,
    copies of the wrapper too; the wrapper's own steps, GradScaler given the wrapper, and the
    step torch takes to fill a fresh state for a checkpoint do not."""
    import copy

    m = model()
    lpw = LowPrecisionWeights(torch.optim.AdamW(m.parameters(), lr=0.01), FMT, "src", seed=1)
    scaler = torch.amp.GradScaler("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lpw.state_dict(m)  # torch fills the state by an inner step at learning rate 0
        for t in range(2):
            lpw.zero_grad()
            scaler.scale(loss_of(m, t)).backward()
            scaler.unscale_(lpw)
            scaler.step(lpw)
            scaler.update()
    assert lpw.steps == 2
    for wrapper, net in ((lpw, m), copy.deepcopy((lpw, m))):
        wrapper.zero_grad()
        scaler.scale(loss_of(net, 2)).backward()
        with pytest.warns(RuntimeWarning, match="wraps stepped alone .* not rounded to binary8p4"):
            scaler.step(wrapper.optimizer)
        scaler.update()


@pytest.mark.parametrize(("fmt", "sat", "there"), [("p3109_k8p4ue", True, "0.0"),
                                                  ("p3109_k8p4ue", False, "nan"),
                                                  ("ocp_e8m0", True, "5.877471754111438e-39")])  # fmt: skip
def test_an_unsigned_format_warns_what_negative_weights_become(fmt, sat, there):
    """An unsigned format took every negative weight to its smallest value (or NaN, under
    sat=False) at construction and at each step, without a word: it warns when built."""
    m = model()
    with pytest.warns(UserWarning, match=f"{fmt} is unsigned: every write-back takes a negative weight such "
                                         f"as -1 to {there};"):  # fmt: skip
        LowPrecisionWeights(torch.optim.SGD(m.parameters(), lr=0.1), fmt, "rne", sat=sat)
    w = m[0].weight  # what it warned of (2^-127 is E8M0's smallest value)
    assert bool(w.isnan().any()) if not sat else bool((w > 0 if fmt == "ocp_e8m0" else w >= 0).all())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LowPrecisionWeights(torch.optim.SGD(model().parameters(), lr=0.1), FMT, "rne")


def test_an_unsigned_format_without_nan_under_sat_false_warns_and_builds():
    """The warning's own rounding of -1 raised where the format has no NaN and sat=False
    (-1 has no result there): a wrapper whose weights the format holds was refused with
    "u8_finite has no Inf or NaN for a value beyond its range", naming neither -1 nor the warning."""
    u8 = fewbit.formats.FloatFormat("u8_finite", 8, 4, 7, signed=False, extended=False)
    w = torch.nn.Parameter(torch.rand(4, 4))
    with pytest.warns(UserWarning, match="u8_finite is unsigned: every write-back raises for a negative"):
        LowPrecisionWeights(torch.optim.SGD([w], lr=0.1), u8, "rne", sat=False)
    assert bool((w >= 0).all())


def test_print_shows_the_setup_and_the_inner_optimizer_and_leaves_codes_held():
    """print(opt) gave "<fewbit.optim.LowPrecisionWeights object at 0x...>": neither the
    format and mode a run rounds to nor the inner optimizer's groups, which print(optimizer)
    shows for torch's own."""
    m = model()
    inner = torch.optim.AdamW(m.parameters(), lr=0.01)
    lpw = LowPrecisionWeights(inner, FMT, "src", bits=3, store_codes=True, update_dtype=torch.bfloat16)
    train(m, lpw, 1)
    text = repr(lpw)
    assert text.startswith(f"LowPrecisionWeights({FMT}, src, bits=3, update_dtype=torch.bfloat16, "
                           "store_codes=True, weights=2, steps=1) of AdamW (")  # fmt: skip
    assert text.endswith(repr(inner)) and "lr: 0.01" in text
    assert all(p.untyped_storage().nbytes() == 0 for p in lpw.params)  # still codes: no weight read
    rne = LowPrecisionWeights(torch.optim.SGD(model().parameters(), lr=0.1), "mxfp8_e4m3", "rne", sat=False)
    assert str(rne).startswith("LowPrecisionWeights(mxfp8_e4m3, rne, sat=False, weights=2, steps=0) of SGD (")
    apart = LowPrecisionWeights(torch.optim.SGD(model().parameters(), lr=0.1), FMT, policy="differing")
    assert str(apart).startswith(f"LowPrecisionWeights({FMT}, src, bits=3, policy=differing, weights=2, ")


def test_a_wrapper_rebuilt_around_the_same_optimizer_lets_the_old_one_go():
    """The inner optimizer's step hook held the wrapper: rebuilt around the same optimizer
    (a resume in the same process, a notebook), every old wrapper stayed alive and warned
    that the optimizer stepped alone at each step of the new one. A step of the inner
    optimizer alone is still caught, and the warning names the line that stepped it."""
    import gc
    import weakref

    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    old = weakref.ref(LowPrecisionWeights(opt, FMT, "src", seed=1))
    gc.collect()
    assert old() is None
    lpw = LowPrecisionWeights(opt, FMT, "src", seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in range(2):
            lpw.zero_grad()
            loss_of(m, t).backward()
            lpw.step()
    with pytest.warns(RuntimeWarning, match="wraps stepped alone") as caught:
        opt.step()
    assert len(caught) == 1 and caught[0].filename == __file__


def test_block_weights_without_the_block_axis_are_refused_and_numpy_scalars_are_python_ones(tmp_path):
    """A block format whose axis a selected weight lacks (a 0-d weight; axis 2 of a 2-d
    one) is refused before any weight changes, as fewbit.block.round refuses it (it was
    a ZeroDivisionError after others were rounded; axis 2 wrapped to 0). numpy scalars
    are taken as Python ones, so the checkpoint loads with torch.load's defaults."""
    m = model()
    before = [p.detach().clone() for p in m.parameters()]
    opt = torch.optim.SGD([*m.parameters(), torch.nn.Parameter(torch.tensor(1.5))], lr=0.1)
    cases = [({"params": opt.param_groups[0]["params"]}, "at least one dimension \\(param 4 is 0-d\\)"),
             ({"params": [m[0].weight]}, "axis 2 is out of range for a tensor of 2 dimensions")]
    for kw, message in cases:
        fmt = block.BlockFormat("mxfp4_axis2", fewbit.format("ocp_e2m1"), 32, fewbit.format("ocp_e8m0"),
                                axis=2) if "axis 2" in message else "mxfp4"  # fmt: skip
        with pytest.raises(ValueError, match=message):
            LowPrecisionWeights(opt, fmt, **kw)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))
    numpy_scalars = {"bits": np.int64(3), "fraction": np.float64(0.5), "sat": np.bool_(True)}
    lpw = LowPrecisionWeights(opt, FMT, "sr_fraction", **numpy_scalars)
    torch.save(lpw.state_dict(), tmp_path / "lpw.pt")
    config = torch.load(tmp_path / "lpw.pt")["config"]
    assert (type(config["bits"]), type(config["fraction"]), type(config["sat"])) == (int, float, bool)


def test_a_compiled_step_keeps_the_write_back_out_of_the_graph():
    """``torch.compile(lpw.step)`` compiles the inner update; the write-back runs as fewbit's
    own call (traced into the user's graph, it hung). Compiled AdamW rounds float32
    differently from eager AdamW, so the check is what fewbit guarantees: every step ends
    with each weight a value of the format, the step count advanced."""
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 64)
    lpw = LowPrecisionWeights(torch.optim.AdamW(m.parameters(), lr=0.01), FMT, "src", bits=3)
    step = torch.compile(lpw.step)
    g = torch.Generator().manual_seed(1)
    start = m.weight.detach().clone()
    for _ in range(3):
        lpw.zero_grad()
        m(torch.randn(4, 64, generator=g)).square().mean().backward()
        step()
        w = m.weight.detach()
        assert torch.equal(fewbit.round(w, FMT), w)
    assert lpw.steps == 3 and not torch.equal(start, m.weight)


def test_a_compiled_training_step_with_store_codes_compiles_once():
    """A compiled training step (the wrapper's zero_grad, forward, backward, step) with
    store_codes: materialize decides whether weights are held as codes as the step runs,
    without a guard on the flag (``self._stored or is_compiling()`` read the flag first,
    and the step compiled materialize again once weights were held)."""
    torch._dynamo.reset()  # (materialize's frames compiled by other tests hold other wrappers)
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 64)
    lpw = LowPrecisionWeights(torch.optim.SGD(m.parameters(), lr=0.01), FMT, "src", bits=3, store_codes=True)

    @torch.compile(backend="eager")
    def train_step(x):
        lpw.zero_grad()
        m(x).square().mean().backward()
        lpw.step()

    g = torch.Generator().manual_seed(1)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            train_step(torch.randn(4, 64, generator=g))
            assert lpw._stored
    assert lpw.steps == 3


def test_block_format_store_codes_keeps_block_tensors_and_reports_their_bytes():
    a, b = model(), model()
    opts = {"update_dtype": torch.bfloat16, "seed": 4}
    lpw_a = LowPrecisionWeights(torch.optim.AdamW(a.parameters(), lr=0.01), "nvfp4", "src", **opts)
    lpw_b = LowPrecisionWeights(torch.optim.AdamW(b.parameters(), lr=0.01), "nvfp4", "src", store_codes=True,
                                **opts)  # fmt: skip
    for t in range(3):
        lpw_b.zero_grad()
        loss_of(b, t).backward()
        lpw_b.step()
        assert all(p.untyped_storage().nbytes() == 0 for p in lpw_b.params)
        assert all(isinstance(c, fewbit.block.BlockTensor) for c in lpw_b._codes)
        code_bytes = sum(c.nbytes for c in lpw_b._codes)
        assert lpw_b.memory()["code_bytes"] == code_bytes  # while stored
        train(a, lpw_a, 1, start=t)
    lpw_b.materialize()
    assert lpw_b._codes is None  # decoded, the codes are let go
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert bits_equal(pa.detach(), pb.detach())
    mem = lpw_b.memory()
    # NVFP4: 16 elements a block, half a byte each, one E4M3 byte a block, 4 bytes a tensor.
    # (32, 16): 32 blocks; (4, 32): 8 blocks.
    assert mem["code_bytes"] == (32 * 9 + 4) + (8 * 9 + 4) == code_bytes
    assert mem["float_bytes"] == 4 * mem["elements"] == 4 * (16 * 32 + 32 * 4)
    with pytest.raises(ValueError, match="scales each block itself"):
        LowPrecisionWeights(torch.optim.AdamW(a.parameters()), "mxfp4", scale=True)
    with pytest.raises(ValueError, match="float16.*cannot hold every value of binary8p2"):
        LowPrecisionWeights(torch.optim.AdamW(a.parameters()), "mx_binary8p2", update_dtype=torch.float16)


# Memory (memory hunt): what a write-back allocates.


def test_write_back_rounds_the_weights_in_place():
    from conftest import peak_allocated

    # The write-back (round_foreach_) rounded each weight into a new tensor as large as it
    # and copied that back: a step held a copy of a weight beside the weights, and took
    # several times as long from 2^20 elements on.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128, bias=False) for _ in range(3)])
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = LowPrecisionWeights(torch.optim.SGD(model.parameters(), lr=0.1), "binary8p4", "src", bits=3, seed=0)
    opt.step()
    weight = 128 * 128 * 4
    assert peak_allocated(opt.step) < weight // 8
    key = fewbit.random.Key.from_seed(0)  # the third step's keys: fold_in(key, 3, i)
    want = [fewbit.round(p.detach() - 0.1 * p.grad, "binary8p4", "src", bits=3, sat=True,
                         seed=fold_in(key, 3, i)) for i, p in enumerate(model.parameters())]  # fmt: skip
    opt.step()
    assert all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), want, strict=True))


# Memory, second pass (memory-2 hunt).


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "nvfp4", "binary8p4"])
def test_write_back_through_round_range_rounds_the_weights_in_place(fmt):
    from conftest import peak_allocated

    # Block formats (and element formats under the differing policy) were rounded by
    # round_range into a new tensor as large as the weight and copied back: a step held
    # two weights' bytes. Where nothing can be refused the kernel now rounds the weight
    # into itself (NVFP4's per-tensor scales are found first, from every weight).
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128, bias=False) for _ in range(3)])
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = LowPrecisionWeights(torch.optim.SGD(model.parameters(), lr=0.1), fmt, "src", bits=3, seed=0,
                              policy="identical" if "fp" in fmt else "differing")  # fmt: skip
    opt.step()
    weight = 128 * 128 * 4
    assert peak_allocated(opt.step) < weight // 8
    # The third step's keys: fold_in(key, 3, i), and under the differing policy rank 0's.
    keys = [fold_in(fewbit.random.Key.from_seed(0), 3, i) for i in range(3)]
    if "fp" in fmt:
        want = [block.round(p.detach() - 0.1 * p.grad, fmt, "src", bits=3, sat=True, seed=k)
                for p, k in zip(model.parameters(), keys, strict=True)]  # fmt: skip
    else:
        keys = [fewbit.replicas.replica_key(k, "differing", rank=0) for k in keys]
        want = [fewbit.round(p.detach() - 0.1 * p.grad, fmt, "src", bits=3, sat=True, seed=k)
                for p, k in zip(model.parameters(), keys, strict=True)]  # fmt: skip
    opt.step()
    assert all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), want, strict=True))


def test_nvfp4_write_back_of_tiny_weights_keeps_its_bits_under_flush_denormal():
    """The write-back's native block kernel took NVFP4's tensor scale as float(ts), which
    reads a float32 subnormal as 0 under torch.set_flush_denormal(True): weights near 2^-120
    (normal, their tensor scale amax / 2688 subnormal) were written back as zeros. From its
    bits, as block.round's native call takes it, they keep the bits they get with it off."""
    signs = torch.randint(0, 2, (8, 32), generator=torch.Generator().manual_seed(4)) * 2 - 1
    start = signs * (1 + torch.rand(8, 32, generator=torch.Generator().manual_seed(5))) * 2.0**-121

    def written_back(flush: bool) -> torch.Tensor:
        w = torch.nn.Parameter(start.clone())  # normal floats: SGD's own add keeps them under DAZ
        opt = LowPrecisionWeights(torch.optim.SGD([w], lr=0.0), "nvfp4", "src", seed=3)
        w.grad = torch.zeros_like(w)
        torch.set_flush_denormal(flush)
        try:
            opt.step()
        finally:
            torch.set_flush_denormal(False)
        return w.detach().view(torch.int32)

    kept = written_back(False)
    assert bool(kept.count_nonzero())
    assert torch.equal(written_back(True), kept)
