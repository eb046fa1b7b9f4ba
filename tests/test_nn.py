"""fewbit.nn: straight-through fake quantisation of activations and gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fewbit
from conftest import blocks_eager_and_compiled
from fewbit.nn import FakeQuantize, Quant, fake_quantize, quantize_outputs
from fewbit.random import Key, fold_in, key_of
from fewbit.replicas import replica_key

E4M3 = Quant("ocp_e4m3")
E5M2_SR = Quant("ocp_e5m2", "src", bits=3)


def test_forward_and_backward_round_separately():
    """An RNE forward and an SRC backward: the gradient draws with fold_in(key, 1). A
    stochastic forward draws with fold_in(key, 0), a stream of its own: given the same
    values, the two directions round differently (drawing both from fold_in(key, 1) passed)."""
    torch.manual_seed(0)
    x = torch.randn(1000, requires_grad=True)
    g = torch.randn(1000)
    key = Key.from_seed(5)
    y = fake_quantize(x, E4M3, E5M2_SR, seed=key)
    assert torch.equal(y, fewbit.round(x.detach(), "ocp_e4m3", sat=True))
    y.backward(g)
    expected = fewbit.round(g, "ocp_e5m2", "src", bits=3, sat=True, seed=fold_in(key, 1))
    assert torch.equal(x.grad, expected)
    assert not torch.equal(x.grad, g)
    q = Quant("binary8p4", "src", bits=3)
    x = torch.linspace(1.0, 1.125, 4096, requires_grad=True)  # between neighbours 1 and 1.125
    y = fake_quantize(x, q, q, seed=key)
    v = x.detach()
    assert torch.equal(y, fewbit.round(v, "binary8p4", "src", bits=3, sat=True, seed=fold_in(key, 0)))
    y.backward(v)
    assert torch.equal(x.grad, fewbit.round(v, "binary8p4", "src", bits=3, sat=True, seed=fold_in(key, 1)))
    assert not torch.equal(y.detach(), x.grad)


def test_straight_through_when_a_direction_is_none():
    x = torch.linspace(-3, 3, 101, requires_grad=True)
    y = fake_quantize(x, E4M3, None)
    g = torch.linspace(0.001, 1, 101)
    y.backward(g)
    assert torch.equal(x.grad, g)
    x.grad = None
    fake_quantize(x, None, Quant("binary8p3")).backward(g)
    assert torch.equal(x.grad, fewbit.round(g, "binary8p3", sat=True))


def test_stochastic_needs_a_seed_and_quant_checks_its_arguments():
    with pytest.raises(ValueError, match="needs a seed"):
        fake_quantize(torch.ones(3), E5M2_SR)
    with pytest.raises(ValueError, match="deterministic and takes no bits"):
        Quant("ocp_e4m3", "rne", bits=3)
    with pytest.raises(ValueError):
        Quant("binary8p9")
    with pytest.raises(ValueError, match="mode"):
        Quant("ocp_e4m3", "nearest")
    # As fewbit.round refuses them, at construction (they were dropped, or refused at the
    # first forward pass).
    with pytest.raises(ValueError, match="fraction is only for mode 'sr_fraction', not 'rne'"):
        Quant("ocp_e4m3", "rne", fraction=0.5)
    with pytest.raises(ValueError, match="mode 'src' needs bits=N"):
        Quant("ocp_e4m3", "src")
    with pytest.raises(ValueError, match="bits must be in 1..32, got 0"):
        Quant("mxfp4", "src", bits=0)
    with pytest.raises(TypeError, match="needs fraction=p"):
        Quant("ocp_e4m3", "sr_fraction", bits=3)


def test_a_format_stands_for_its_quant_and_bad_arguments_are_refused_at_the_call():
    """A name where a Quant is due ran into 'str' object is not callable (in backward for
    the backward direction), and a stochastic backward Quant without a seed passed the
    forward pass: all are decided at the call now."""
    x = torch.tensor([1.03, 500.0, 0.3], requires_grad=True)
    # By hand: OCP E4M3 steps 1/8 on [1, 2), 1/32 on [1/4, 1/2), max 448 (saturated).
    e4m3 = torch.tensor([1.0, 448.0, 0.3125])
    assert torch.equal(fake_quantize(x, "ocp_e4m3"), e4m3)
    assert torch.equal(FakeQuantize(fewbit.format("ocp_e4m3"))(x), e4m3)
    # E5M2 steps 1/4 on [1, 2), 1/16 on [1/4, 1/2), 64 on [256, 512): 500 -> 512.
    fake_quantize(x, None, "ocp_e5m2").backward(x.detach())
    assert torch.equal(x.grad, torch.tensor([1.0, 512.0, 0.3125]))
    for bad in (3, b"ocp_e4m3"):
        with pytest.raises(TypeError, match="forward must be a fewbit.nn.Quant"):
            fake_quantize(x, bad)
        with pytest.raises(TypeError, match="backward must be a fewbit.nn.Quant"):
            FakeQuantize(None, bad)
    with pytest.raises(ValueError, match="mode 'src' needs a seed"):
        fake_quantize(x, E4M3, E5M2_SR)


def test_quant_refuses_a_bad_axis_at_construction():
    for bad in (True, 1.5, "x"):
        with pytest.raises(TypeError, match="axis must be an int"):
            Quant("hbfp4", axis=bad)
    assert type(Quant("hbfp4", axis=np.int64(0)).axis) is int  # as fewbit.block.round takes it


def test_a_refused_call_does_not_advance_the_count():
    q = FakeQuantize(Quant("e2m1"))
    with pytest.raises(ValueError, match="no NaN"):
        q(torch.tensor([float("nan")]))
    assert int(q.calls) == 0


def test_a_backward_quant_the_gradient_cannot_take_is_refused_at_the_call():
    """The gradient has x's dtype and dimensions: these were refused in backward, after
    the forward pass had run and the module had counted the call."""
    cases = [
        (torch.randn(4, 64), Quant("hbfp4", axis=2), "axis 2 is out of range for a tensor of 2 dimensions"),
        (torch.randn(()), Quant("hbfp4"), "need a tensor of at least one dimension"),
        (torch.randn(8, dtype=torch.bfloat16), Quant("binary16"), "bfloat16 tensor cannot hold"),
        (torch.randn(8), Quant("e4m3", "sr", bits=5), "mode 'sr' uses N"),
    ]
    for x, bad, message in cases:
        q = FakeQuantize(None, bad, seed=1)
        with pytest.raises(ValueError, match=f"backward Quant.*for the gradient of x: .*{message}"):
            q(x.requires_grad_())
        assert int(q.calls) == 0
        with torch.no_grad():  # no gradient comes: inference runs, as before the check
            assert torch.equal(q(x), x)


def test_module_on_the_meta_device_and_its_deferred_initialisation():
    """Read as an int, a meta count failed the call (a deterministic one too); after
    ``to_empty`` the count was whatever the memory held, and the bits with it."""
    q = Quant("binary8p4", "src", bits=3)
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 4), FakeQuantize(q, seed=7))
        assert model(torch.empty(2, 8)).shape == (2, 4)
        assert FakeQuantize("e4m3")(torch.empty(3)).is_meta
    model.to_empty(device="cpu")
    model[1].calls.fill_(12345)  # as the memory may hold
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    x = torch.full((4096,), 1.03)
    assert torch.equal(model[1](x), FakeQuantize(q, seed=7)(x))


def test_quant_saturates_unless_sat_is_false():
    """Quant saturates by default (E4M3's max 448, E5M2's 57344), in both directions;
    Quant(sat=False) takes a value beyond the max to Inf (a Quant that dropped its sat
    saturated silently, and no test asked for sat=False)."""
    x = torch.tensor([500.0, -1000.0, 1.0], requires_grad=True)
    y = fake_quantize(x, "ocp_e4m3", Quant("ocp_e5m2"))
    assert y.tolist() == [448.0, -448.0, 1.0]
    y.backward(torch.tensor([1e6, -1e6, 2.0]))
    assert x.grad.tolist() == [57344.0, -57344.0, 2.0]
    x.grad = None
    y = fake_quantize(x, Quant("ocp_e5m2", sat=False), Quant("ocp_e5m2", sat=False))
    assert y.tolist() == [512.0, -1024.0, 1.0]
    y.backward(torch.tensor([1e6, -1e6, 2.0]))
    assert x.grad.tolist() == [float("inf"), float("-inf"), 2.0]
    assert fake_quantize(torch.tensor([1e6]), Quant("ocp_e5m2", sat=False)).tolist() == [float("inf")]


@pytest.mark.filterwarnings("ignore:`torch.jit.trace")
@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_traced_module_draws_each_calls_bits():
    """make_fx and torch.jit.trace froze the count read at the trace: every replay drew
    the bits of that one call. The trace is a call (it counts); each replay is the next."""
    from torch.fx.experimental.proxy_tensor import make_fx

    q = Quant("binary8p4", "src", bits=3)
    x = torch.full((4096,), 1.03)
    for trace in (make_fx, lambda m: (lambda v: torch.jit.trace(m, v, check_trace=False))):
        traced_module, eager = FakeQuantize(q, seed=7), FakeQuantize(q, seed=7)
        replay = trace(traced_module)(x)
        eager(x)
        for _ in range(3):
            assert torch.equal(replay(x), eager(x))
        assert int(traced_module.calls) == 4


def test_module_draws_fresh_bits_per_call_and_resumes_from_state_dict():
    x = torch.full((4096,), 1.03)  # between binary8p4 neighbours 1 and 1.125
    q = FakeQuantize(Quant("binary8p4", "src", bits=3), seed=7)
    first, second = q(x), q(x)
    assert not torch.equal(first, second)
    assert int(q.calls) == 2
    restored = FakeQuantize(Quant("binary8p4", "src", bits=3), seed=7)
    restored.load_state_dict(q.state_dict())
    assert torch.equal(restored(x), q(x))
    q.eval()
    assert torch.equal(q(x), q(x))  # evaluation does not advance the stream
    # Call c's forward draws with fold_in(key, c, 0) (the replica's key is the key itself
    # under the identical policy): pinned, so that the bits do not change between versions.
    same = FakeQuantize(Quant("binary8p4", "src", bits=3), seed=7, policy="identical")
    same(x)
    want = fewbit.round(x, "binary8p4", "src", bits=3, sat=True, seed=fold_in(Key.from_seed(7), 1, 0))
    assert torch.equal(same(x), want)


def test_quantize_outputs_of_every_linear():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    plain = [p.detach().clone() for p in model.parameters()]
    changed = quantize_outputs(model, E4M3, Quant("ocp_e5m2"))
    assert changed == [model[0], model[2]]
    x = torch.randn(32, 8)
    h = model[0](x)
    assert torch.equal(h, fewbit.round(x @ plain[0].T + plain[1], "ocp_e4m3", sat=True))
    model(x).sum().backward()
    # The gradient reaching the first layer's weight went through e5m2 rounding.
    grad_h = fewbit.round(
        fewbit.round(torch.ones(32, 2), "ocp_e5m2", sat=True) @ model[2].weight.detach(), "ocp_e5m2", sat=True
    ) * (h > 0)
    assert torch.allclose(model[0].weight.grad, grad_h.T @ x, rtol=1e-6, atol=1e-6)
    assert "0.output_quant.calls" in model.state_dict()


def test_quantize_outputs_on_a_models_parts_keys_them_as_the_whole_from_first_index():
    """A pipeline stage's call numbered its modules from 0: every stage's first Linear took
    the key of the model's first, and rounded its outputs with the same bits."""

    def keys(parts: bool, offset: bool = True) -> list:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(4)))
        if not parts:
            return [m.output_quant.key for m in quantize_outputs(model, E4M3, seed=3)]
        changed = quantize_outputs(model[:2], E4M3, seed=3)
        changed += quantize_outputs(model[2:], E4M3, seed=3, first_index=2 if offset else 0)
        return [m.output_quant.key for m in changed]

    whole = keys(parts=False)
    assert len(set(whole)) == 4 and keys(parts=True) == whole
    assert keys(parts=True, offset=False)[2:] == whole[:2]
    with pytest.raises(ValueError, match="first_index must be in"):
        quantize_outputs(torch.nn.Linear(2, 2), E4M3, first_index=-1)


def test_quantize_outputs_leaves_out_what_never_runs_its_forward():
    """MultiheadAttention reads its out_proj's weight without calling it: hooked, it was
    reported as quantised and never rounded. It is left out, with a warning naming it."""
    model = torch.nn.ModuleDict({"attn": torch.nn.MultiheadAttention(8, 2), "head": torch.nn.Linear(8, 2)})
    with pytest.warns(UserWarning, match="leaves out the out_proj of MultiheadAttention 'attn'"):
        changed = quantize_outputs(model, E4M3)
    assert changed == [model["head"]] and not hasattr(model["attn"].out_proj, "output_quant")


def test_a_key_tensor_changed_before_backward_leaves_the_gradients_bits():
    """The gradient rounds with the key of the forward call, though the caller advance
    their key tensor in place before backward (it was read at backward time)."""
    q = Quant("ocp_e5m2", "src", bits=3)
    x, g = torch.randn(4, 64, requires_grad=True), torch.randn(4, 64)
    key = key_of(7)
    y = fake_quantize(x, None, q, seed=key)
    key.copy_(key_of(8))
    y.backward(g)
    assert torch.equal(x.grad, q(g, fold_in(key_of(7), 1)))
    assert not torch.equal(x.grad, q(g, fold_in(key_of(8), 1)))


def test_quantize_outputs_refuses_modules_that_return_tuples():
    """An nn.GRU taken by types= was hooked, and every forward failed in the hook with
    "x must be a torch.Tensor, not tuple"."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GRU(4, 4))
    with pytest.raises(TypeError, match="GRU return tuples"):
        quantize_outputs(model, E4M3, types=(torch.nn.Linear, torch.nn.GRU))
    assert not hasattr(model[0], "output_quant")  # refused before any module changed
    for module in (torch.nn.LSTMCell(4, 4), torch.nn.MaxPool1d(2, return_indices=True)):
        with pytest.raises(TypeError, match=f"{type(module).__name__} return tuples"):
            quantize_outputs(module, E4M3, types=(type(module),))
    assert quantize_outputs(torch.nn.MaxPool1d(2), E4M3, types=(torch.nn.MaxPool1d,))  # one tensor

    class Pair(torch.nn.Module):
        def forward(self, x):
            return x, x

    pair = Pair()
    quantize_outputs(pair, E4M3, types=(Pair,))
    with pytest.raises(TypeError, match="this Pair returned tuple"):
        pair(torch.ones(2))
    assert int(pair.output_quant.calls) == 0
    del pair.output_quant
    assert pair(torch.ones(2))[0].shape == (2,)


def test_quantize_outputs_takes_types_as_a_list_and_names_bad_types():
    """types=[nn.Linear, nn.Conv2d] reached isinstance, which refused the list with "isinstance()
    arg 2 must be a type, a tuple of types, or a union", naming neither types= nor the fix."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Conv1d(1, 1, 1), torch.nn.ReLU())
    changed = quantize_outputs(model, E4M3, types=[torch.nn.Linear, torch.nn.Conv1d])
    assert changed == [model[0], model[1]] and not hasattr(model[2], "output_quant")
    y = model(torch.randn(1, 4))  # the Conv1d's output, in E4M3 (ReLU keeps it there)
    assert torch.equal(y, fewbit.round(y, "ocp_e4m3", sat=True))
    assert quantize_outputs(torch.nn.Linear(4, 4), E4M3, types=torch.nn.Linear | torch.nn.Conv1d)
    for bad in ("Linear", [torch.nn.Linear, "Conv1d"], {torch.nn.Linear}):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        with pytest.raises(TypeError, match="types must be module classes"):
            quantize_outputs(model, E4M3, types=bad)
        assert not hasattr(model[0], "output_quant")  # refused before any module changed


def test_quantize_outputs_again_replaces_the_rounding_without_a_second_hook():
    """A second call hooked each module again: every output was rounded twice, and its
    stream advanced twice a call."""
    torch.manual_seed(0)
    once, twice = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    twice.load_state_dict(once.state_dict())
    quantize_outputs(once, Quant("binary8p4", "src", bits=3), seed=1)
    quantize_outputs(twice, Quant("ocp_e5m2"), seed=9)
    quantize_outputs(twice, Quant("binary8p4", "src", bits=3), seed=1)
    x = torch.randn(64, 4)
    assert torch.equal(once(x), twice(x)) and int(twice.output_quant.calls) == 1


# Block formats: the same Quant, with fewbit.block.round behind it and the same keys.
MX = Quant("mxfp8_e4m3")
HBFP_SR = Quant("hbfp4", "src", bits=8)


def test_block_format_forward_and_backward():
    torch.manual_seed(0)
    x = torch.randn(8, 100, requires_grad=True)  # 100: a padded last block
    g = torch.randn(8, 100) * torch.logspace(-4, 0, 100)  # small values beside large ones
    key = Key.from_seed(5)
    y = fake_quantize(x, MX, HBFP_SR, seed=key)
    assert torch.equal(y, fewbit.block.round(x.detach(), "mxfp8_e4m3"))
    assert not torch.equal(y, fewbit.round(x.detach(), "ocp_e4m3", sat=True))  # scaled per block
    y.backward(g)
    expected = fewbit.block.round(g, "hbfp4", "src", bits=8, seed=fold_in(key, 1))
    assert torch.equal(x.grad, expected)
    # Block values: each row's first 64 are 4-bit two's-complement mantissas times one power
    # of two, set by the block's largest magnitude (which may round to -8 steps).
    q = fewbit.block.quantize(g, "hbfp4", "src", bits=8, seed=fold_in(key, 1))
    assert torch.equal(q.dequantize(), x.grad)
    step = 2.0 ** (torch.floor(torch.log2(g[:, :64].abs().amax(1, keepdim=True))) - 2)
    mantissas = x.grad[:, :64] / step
    assert torch.equal(mantissas, mantissas.round()) and mantissas.abs().max() <= 8
    # Stochastic: another key rounds some gradients the other way.
    x.grad = None
    fake_quantize(x, MX, HBFP_SR, seed=Key.from_seed(6)).backward(g)
    assert not torch.equal(x.grad, expected)


def test_block_axis_and_straight_through():
    x = torch.randn(128, 3, requires_grad=True)
    y = fake_quantize(x, Quant("hbfp3", axis=0), None)
    assert torch.equal(y, fewbit.block.round(x.detach(), "hbfp3", axis=0))
    assert not torch.equal(y, fewbit.block.round(x.detach(), "hbfp3"))  # blocks down the columns
    g = torch.randn(128, 3)
    y.backward(g)
    assert torch.equal(x.grad, g)
    with pytest.raises(ValueError, match="block axis of a block format"):
        Quant("ocp_e4m3", axis=0)
    with pytest.raises(ValueError, match="nor is it a block format"):
        Quant("hbfp")


def test_quantize_outputs_rounds_gradients_to_a_block_format_with_the_modules_keys():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 70))
    quantize_outputs(model, None, HBFP_SR, seed=3)
    x = torch.randn(32, 8)
    c = torch.randn(32, 70) * torch.logspace(-5, 0, 70)
    (model(x) * c).sum().backward()
    # The last Linear (module 1 of 2) on its first call (0): its key, as FakeQuantize derives it.
    key = fold_in(replica_key(fold_in(Key.from_seed(3), 1, 0), "differing"), 1)
    grad_out = fewbit.block.round(c, "hbfp4", "src", bits=8, seed=key)
    assert not torch.equal(grad_out, c)
    assert torch.equal(model[2].bias.grad, grad_out.sum(0))


class _Checkpointed(torch.nn.Module):
    """Two checkpointed regions: one FakeQuantize called in both, one called twice in the
    second; ``how`` None runs them without checkpointing."""

    def __init__(self, how: dict | None):
        super().__init__()
        torch.manual_seed(0)
        q = Quant("binary8p4", "src", bits=3)
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.shared, self.twice = FakeQuantize(q, q, seed=1), FakeQuantize(q, q, seed=2)
        self.how = how

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        def run(f, v):
            return f(v) if self.how is None else checkpoint(f, v, **self.how)

        h = run(lambda v: torch.tanh(self.shared(self.a(v))), x)
        return run(lambda v: self.twice(torch.tanh(self.twice(self.shared(self.b(v))))), h)


def _checkpointed_steps(model: torch.nn.Module, run=None) -> list[list[torch.Tensor]]:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    grads = []
    for _ in range(3):
        model.zero_grad()
        (model if run is None else run)(x).square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return grads


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_checkpoint_context_recomputes_with_the_forward_calls_bits(compiled):
    """The recomputation of a checkpointed region was a second call of each FakeQuantize:
    it drew the next count's bits (gradients of activations the loss never saw) and
    advanced the count again. With checkpoint_context it draws the forward pass's bits."""
    from fewbit.nn import checkpoint_context

    seen = set()

    def mine(ctx, op, *args, **kwargs):  # a policy of the user's, for every other op
        seen.add(op)
        return torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    want = _checkpointed_steps(_Checkpointed(None))
    # (Compiled, one context: each compilation takes 10 s.)
    for context in (lambda: checkpoint_context(mine),) + (() if compiled else (checkpoint_context,)):
        model = _Checkpointed({"use_reentrant": False, "context_fn": context})
        run = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else None
        got = _checkpointed_steps(model, run)
        for a, b in zip(got, want, strict=True):
            assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
        assert (int(model.shared.calls), int(model.twice.calls)) == (6, 6)
    assert torch.ops.aten.mm.default in seen or torch.ops.aten.addmm.default in seen


@pytest.mark.parametrize("how", [{"use_reentrant": False}, {"use_reentrant": True}, "compiled"])
def test_a_recomputation_without_checkpoint_context_is_refused(how):
    model = _Checkpointed({"use_reentrant": False} if how == "compiled" else how)
    run = torch.compile(model, fullgraph=True, backend="aot_eager") if how == "compiled" else None
    with pytest.raises(RuntimeError, match="during a backward pass.*context_fn=fewbit.nn.checkpoint_context"):
        _checkpointed_steps(model, run)


def test_a_call_in_a_backward_hook_is_a_call_of_its_own():
    """Only a recomputation (grad on, as checkpointing runs it) is refused in backward: a
    FakeQuantize that a backward hook calls (grad off) rounds and counts."""
    q = FakeQuantize(Quant("binary8p4", "src", bits=3), seed=1)
    seen = []
    x = torch.full((4096,), 1.03, requires_grad=True)
    y = x * 1
    y.register_hook(lambda g: seen.append(q(g)))
    (y * 1.03).sum().backward()  # g = 1.03, between binary8p4 neighbours 1 and 1.125
    first_call = FakeQuantize(Quant("binary8p4", "src", bits=3), seed=1)(torch.full((4096,), 1.03))
    assert torch.equal(seen[0], first_call)
    assert int(q.calls) == 1


def test_torch_still_says_when_a_backward_pass_runs():
    """torch's private query that refuses a recomputation (torch.utils.checkpoint reads it too):
    this fails first if torch drops or changes it."""
    from fewbit.nn import _GRAPH_TASK_ID

    assert _GRAPH_TASK_ID is not None and _GRAPH_TASK_ID() == -1
    inside = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: inside.append(_GRAPH_TASK_ID()))
    y.sum().backward()
    assert inside and inside[0] != -1


def test_straight_through_apply_skips_only_torchs_argument_binding():
    """_StraightThrough.apply calls past torch's Function.apply to skip its binding of the
    arguments to forward's signature (20 us a call): this fails first where torch's apply
    does anything else, or ends elsewhere."""
    from fewbit import nn as fewbit_nn

    assert fewbit_nn._DIRECT_APPLY
    code = torch.autograd.Function.apply.__func__.__code__
    assert sorted(code.co_names) == [
        "RuntimeError", "_C", "_are_functorch_transforms_active", "_functorch", "_is_setup_context_defined",
        "apply", "custom_function_call", "forward", "setup_context", "super", "torch", "unwrap_dead_wrappers",
        "utils"]  # fmt: skip
    assert [c.co_name for c in code.co_consts if hasattr(c, "co_name")] == ["bind_default_args"]
    # Under a transform it is torch's apply: vmap of fake_quantize, each sample as its own call.
    x = torch.full((3, 4096), 1.03)
    q = Quant("binary8p4", "src", bits=3)
    batched = torch.vmap(lambda v: fake_quantize(v, q, None, 5))(x)
    assert torch.equal(batched[1], fake_quantize(x[1], q, None, 5))


def test_a_module_pickled_whole_before_the_key_buffer_loads():
    """The key became a property with a tensor of its words beside it; a FakeQuantize
    pickled whole before (torch.save(module)) held the key as an attribute, and loaded, it
    had no key at all. Its pickle here is that module's state, made by hand."""
    import pickle

    q = FakeQuantize(Quant("binary8p4", "src", bits=3), seed=7)
    x = torch.full((64,), 1.03)
    q(x)
    old = dict(q.__getstate__())
    old["key"] = old.pop("_key")
    del old["_key_words"]
    loaded = FakeQuantize.__new__(FakeQuantize)
    loaded.__setstate__(pickle.loads(pickle.dumps(old)))
    assert loaded.key == Key.from_seed(7) and int(loaded.calls) == 1 and loaded.replica_rank is None
    assert torch.equal(loaded(x), q(x))
    compiled = torch.compile(loaded, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), q(x))


@pytest.mark.parametrize(("policy", "group", "error", "match"), [
    ("identical", [0, 1], ValueError, "give it with 'differing'"),
    ("differing", torch.distributed.GroupMember.NON_GROUP_MEMBER, ValueError, "does not hold this rank"),
    ("differing", [0, 1], TypeError, "must be a torch.distributed.ProcessGroup"),
], ids=["identical", "not holding the rank", "ranks, not a group"])  # fmt: skip
def test_a_replica_group_that_would_go_unused_or_is_no_group_of_this_rank_is_refused(policy, group, error,
                                                                                       match):  # fmt: skip
    """replica_group is the group whose rank DIFFERING folds in: refused with IDENTICAL (it
    would be ignored) and, as guard_group is, where it is no process group or does not
    hold this rank (torch's new_group gives the ranks outside it an int); by quantize_outputs
    before any module changes."""
    with pytest.raises(error, match=f"replica_group.*{match}"):
        FakeQuantize(E5M2_SR, policy=policy, replica_group=group)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(error, match=f"replica_group.*{match}"):
        quantize_outputs(model, E5M2_SR, policy=policy, replica_group=group)
    assert not hasattr(model[0], "output_quant")


def test_a_replica_rank_draws_that_replicas_bits_copies_and_compiles_as_a_constant():
    """FakeQuantize keeps replica_group's rank as the int replica_rank (set here by hand: this
    process has no process group): call c draws with the rank folded in as DIFFERING folds
    in a replica's, forward and backward. It pickles and deep-copies (a group would not
    pickle), the state_dict holds the count alone, and blocks compiled apart share a graph."""
    import copy
    import pickle

    q = Quant("binary8p4", "src", bits=3)
    x, g = torch.full((4096,), 1.03), torch.full((4096,), 1.03)  # between neighbours 1 and 1.125

    def blocks() -> list[torch.nn.Module]:
        torch.manual_seed(0)
        chain = [torch.nn.Sequential(torch.nn.Linear(8, 8), FakeQuantize(q, q, seed=i)) for i in range(4)]
        for b in chain:
            b[1].replica_rank = 1
        return chain

    def first_call(fq: torch.nn.Module) -> list[torch.Tensor]:
        v = x.clone().requires_grad_()
        y = fq(v)
        y.backward(g)
        return [y.detach(), v.grad]

    def replica_1(count: int) -> list[torch.Tensor]:  # call count's bits on replica 1, keyed by hand
        key = replica_key(fold_in(Key.from_seed(0), count), "differing", 1)
        return first_call(lambda v: fake_quantize(v, q, q, key))

    fq = blocks()[0][1]
    got, unset = first_call(fq), first_call(FakeQuantize(q, q, seed=0))
    assert all(torch.equal(a, b) for a, b in zip(got, replica_1(0), strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(got, unset, strict=True))  # (rank 0's)
    for other in (pickle.loads(pickle.dumps(fq)), copy.deepcopy(fq)):  # (at call 1)
        assert other.replica_rank == 1 and torch.equal(first_call(other)[0], replica_1(1)[0])
    assert list(fq.state_dict()) == ["calls"]
    assert repr(fq).endswith("replica_rank=1)") and "replica_rank" not in repr(FakeQuantize(q))
    h = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    eager, compiled, graphs = blocks_eager_and_compiled(blocks(), blocks(), h, backward=True)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])  # output, gradient
    assert graphs == 1


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch.func.jvp
def test_a_training_module_counts_its_calls_under_torch_func_transforms():
    """torch.func.grad of a model with a FakeQuantize (functional_call), vmap of it
    (per-sample gradients), jacrev and jvp: each call counts once and draws the bits an
    eager call with that count draws. Counting wrote the buffer in place, which grad's
    transforms refuse for a tensor the function did not take ("would mutate a captured
    Tensor"), so none of them ran."""
    from fewbit import operators

    assert operators._PAST_TRANSFORMS is not None  # torch's private context: this fails first where it goes
    gen = torch.Generator().manual_seed(31)
    sr = Quant("binary8p4", "src", bits=3)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), FakeQuantize(sr, sr, seed=3))
    x = torch.randn(4, 16, generator=gen)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, rows):
        return (torch.func.functional_call(model, p, (rows,)) * 1.03).sum()

    def eager(rows, count):  # the gradients autograd gives for the call of that count
        model[1].calls.fill_(count)
        model.zero_grad()
        loss(dict(model.named_parameters()), rows).backward()
        return {k: v.grad for k, v in model.named_parameters()}

    model[1].calls.fill_(5)
    grads = torch.func.grad(loss)(params, x)
    assert int(model[1].calls) == 6
    assert all(torch.equal(grads[k], g) for k, g in eager(x, 5).items())
    model[1].calls.fill_(5)
    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x[:, None])
    assert int(model[1].calls) == 6  # one call, for the batch
    for i in range(4):
        assert all(torch.equal(per_sample[k][i], g) for k, g in eager(x[i : i + 1], 5).items()), i
    model[1].calls.fill_(5)
    assert torch.func.jacrev(model)(x[0]).shape == (16, 16) and int(model[1].calls) == 6
    values, _ = torch.func.jvp(model, (x,), (torch.ones_like(x),))
    assert int(model[1].calls) == 7
    model[1].calls.fill_(6)
    assert torch.equal(values, model(x))


def test_model_ensembling_is_refused_by_name():
    """vmap of functional_call over stacked FakeQuantize states (model ensembling) failed in
    torch's words (a vmapped .item(), "please file a bug report"); refused by name now, in
    training and eval alike. A vmap over the inputs alone still runs."""
    import copy

    from fewbit import operators

    assert operators._IS_BATCHED is not None  # torch's private query: this fails first where it goes
    sr = Quant("binary8p4", "src", bits=3)
    members = [torch.nn.Sequential(torch.nn.Linear(8, 8), FakeQuantize(sr, seed=i)) for i in range(3)]
    params, buffers = torch.func.stack_module_state(members)
    base = copy.deepcopy(members[0]).to("meta")
    x = torch.randn(4, 8)
    for training in (True, False):
        base.train(training)
        with pytest.raises(RuntimeError, match="does not take a count stacked under torch.vmap"):
            torch.vmap(lambda p, b: torch.func.functional_call(base, (p, b), (x,)))(params, buffers)
    assert torch.vmap(members[0])(x[:, None]).shape == (4, 1, 8)


def test_model_ensembling_under_grad_is_refused_by_name():
    """vmap of grad of functional_call over stacked FakeQuantize states (ensembled training)
    still failed in torch's words: grad wraps the stacked count, and the wrapper is no
    batched tensor. Each level is looked through."""
    import copy

    from fewbit import operators

    members = [torch.nn.Sequential(torch.nn.Linear(8, 8), FakeQuantize("bfloat16")) for _ in range(2)]
    params, buffers = torch.func.stack_module_state(members)
    base = copy.deepcopy(members[0]).to("meta")

    def loss(p, b, x):
        return torch.func.functional_call(base, (p, b), (x,)).sum()

    with pytest.raises(RuntimeError, match="does not take a count stacked under torch.vmap"):
        torch.vmap(torch.func.grad(loss), in_dims=(0, 0, None))(params, buffers, torch.randn(4, 8))
    assert operators._IS_WRAPPED is not None and operators._UNWRAPPED is not None  # torch's private queries


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (torch.jit.script is deprecated)
@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_torch_jit_script_is_refused_by_name():
    """torch.jit.script of a model with a FakeQuantize (its own, or quantize_outputs') failed
    on Key's source (an OSError naming no module); refused by name, naming the tracers that
    take it. torch.jit.trace still does."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), FakeQuantize("binary8p4"))
    hooked = torch.nn.Sequential(torch.nn.Linear(4, 4))
    quantize_outputs(hooked, "binary8p4")
    for m in (model, hooked):
        with pytest.raises(RuntimeError, match="torch.jit.script does not take FakeQuantize"):
            torch.jit.script(m)
    x = torch.randn(2, 4)
    assert torch.equal(torch.jit.trace(model, (x,))(x), model(x))


@pytest.mark.parametrize(("backward", "skipped"), [(Quant("ocp_e4m3", sat=False), True),
                                                    (Quant("mxfp8_e4m3", sat=False), True),
                                                    (Quant("mxfp8_e4m3"), False)])  # fmt: skip
def test_loss_scaling_skips_on_sat_false_gradients_even_without_overflow_in_block_formats(backward, skipped):
    """The README advised sat=False for every gradient Quant under GradScaler (amp hunt). An
    element format's overflow then reads Inf and the step is skipped, as meant; but a block
    format cannot overflow (each block scales itself), and under sat=False its scale rule's
    largest elements of ordinary data read Inf or NaN: GradScaler skipped every step. The
    README now says to keep sat=True for block formats."""
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 64)
    quantize_outputs(m, None, backward, seed=3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
    scaler.scale(m(torch.randn(8, 64)).square().mean()).backward()  # E4M3 overflows: 448
    scaler.step(opt)
    scaler.update()
    assert (scaler.get_scale() < 2.0**20) == skipped


def test_a_sat_false_block_gradient_without_inf_or_nan_is_refused_in_backward():
    """Under sat=False, a block format whose elements have neither Inf nor NaN refuses the
    ordinary gradient its scale rule rounds past the element's largest value (README)."""
    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True)
    y = fake_quantize(x, None, Quant("hbfp4", "src", bits=8, sat=False), seed=1)
    with pytest.raises(ValueError, match="int4 has no Inf or NaN for a value beyond its range; use sat=True"):
        y.backward(torch.randn(64, 64))
    x.grad = None
    fake_quantize(x, None, Quant("hbfp4", "src", bits=8), seed=1).backward(torch.randn(64, 64))
    assert bool(x.grad.isfinite().all())


def _autocast_model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    quantize_outputs(m, Quant("ocp_e4m3", "src", bits=3), E5M2_SR, seed=3)
    return m


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_autocast_outputs_and_gradients_are_those_of_the_model_cast_by_hand(dtype):
    """Under torch.autocast FakeQuantize rounds the tensor in autocast's dtype, forward and
    backward: the bits of the model cast by hand (README; undocumented before the amp hunt)."""
    x = torch.randn(5, 8)
    m, by_hand, unrounded = _autocast_model(), _autocast_model().to(dtype), _autocast_model()
    del unrounded[0].output_quant, unrounded[2].output_quant
    with torch.autocast("cpu", dtype=dtype):
        y, plain = m(x), unrounded(x)
    expected = by_hand(x.to(dtype))
    assert y.dtype == dtype and torch.equal(y, expected)
    for out in (y, plain, expected):
        out.float().square().sum().backward()
    grads, plain_grads, hand_grads = ([p.grad for p in net.parameters()] for net in (m, unrounded, by_hand))
    assert all(g.dtype == torch.float32 for g in grads)
    assert all(torch.equal(a, b.float()) for a, b in zip(grads, hand_grads, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))  # the backward rounds
    quantize_outputs(m, "binary16")
    with pytest.raises(ValueError, match="a torch.bfloat16 tensor cannot hold every value of binary16"), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        m(x)


@pytest.mark.slow
def test_under_autocast_compiled_rounds_as_eager():
    """torch.compile(fullgraph=True) under bfloat16 autocast: the outputs and the weights'
    gradients of eager, step after step (a bias's gradient is torch's own bfloat16 sum,
    which compiled code adds in another order, with fewbit or without)."""
    x = torch.randn(5, 8)
    m, c = _autocast_model(), _autocast_model()
    compiled = torch.compile(c, fullgraph=True)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, z = m(x), compiled(x)
        assert torch.equal(y, z)
        for out in (y, z):
            out.float().square().sum().backward()
        assert all(torch.equal(m[i].weight.grad, c[i].weight.grad) for i in (0, 2))
