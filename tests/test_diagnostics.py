"""Diagnostics of the write-back (fewbit.bias.outward_error, experiments.probe), the SRF
study (`fewbit train --sweep srf`, `fewbit ratchet`) and the training speed options."""

from __future__ import annotations

import csv
import re
import sys
from dataclasses import replace

import pytest
import torch

from fewbit.bias import outward_error
from fewbit.cli import main
from fewbit.experiments import ratchet
from fewbit.experiments.probe import StepProbe
from fewbit.experiments.sweep import RunResult, arm_configs, format_diagnostics
from fewbit.experiments.train import Run
from fewbit.optim import LowPrecisionWeights
from test_train import TINY, text_data, tiny_sweep  # noqa: F401 (text_data: a fixture)


def test_outward_error_in_ulps_of_the_format():
    # Binary8P4 has 3 fraction bits: spacing 1/8 on [1, 2), 1/4 on [2, 4).
    x = torch.tensor([1.0625, -1.0625, -1.03125, 2.125, 1.5, 0.0])
    rounded = torch.tensor([1.125, -1.0, -1.0, 2.25, 1.5, 0.0])
    expected = torch.tensor([0.5, -0.5, -0.25, 0.5, 0.0, 0.0], dtype=torch.float64)
    assert torch.equal(outward_error(x, rounded, "binary8p4"), expected)


def probed_step():
    """One write-back to Binary8P4 rounding up (toward +inf), the probe armed; SGD with
    lr 1 and gradient ``w - target`` puts ``w + u`` at the target exactly."""
    w = torch.nn.Parameter(torch.tensor([[1.0, 1.0, -1.0, 2.0]]))
    v = torch.nn.Parameter(torch.tensor([[0.5, 0.5]]))
    opt = torch.optim.SGD([w, v], lr=1.0)
    weights = LowPrecisionWeights(opt, "binary8p4", "rup", bits=None)
    probe = StepProbe(opt, [("w", w), ("v", v)], "binary8p4")
    w.grad = w.detach() - torch.tensor([[1.0625, 1.0, -1.03125, 2.125]])
    v.grad = torch.zeros_like(v)
    probe.arm()
    weights.step()
    return w, probe


def test_probe_measures_one_write_back():
    w, probe = probed_step()
    assert torch.equal(w.detach(), torch.tensor([[1.125, 1.0, -1.0, 2.25]]))
    rows = {r["param"]: r for r in probe.read()}
    # w: errors +1/2, 0, -1/4, +1/2 ulp; two of four values changed.
    assert rows["w"] == {"param": "w", "numel": 4, "mean_abs": 1.34375, "changed": 0.5, "outward_ulp": 0.1875}
    assert rows["v"] == {"param": "v", "numel": 2, "mean_abs": 0.5, "changed": 0.0, "outward_ulp": 0.0}
    assert rows["all"] == {"param": "all", "numel": 6, "mean_abs": 6.375 / 6, "changed": 2 / 6,
                           "outward_ulp": 0.125}  # fmt: skip
    with pytest.raises(RuntimeError, match="after arm"):
        probe.read()  # read disarms it: the next step is not measured


def test_unarmed_probe_keeps_nothing():
    w = torch.nn.Parameter(torch.ones(2, 2))
    opt = torch.optim.SGD([w], lr=0.1)
    probe = StepProbe(opt, [("w", w)], None)
    w.grad = torch.ones_like(w)
    opt.step()
    with pytest.raises(RuntimeError, match="after arm"):
        probe.read()


def test_training_logs_diagnostics_at_each_evaluation(text_data):  # noqa: F811
    run = Run(replace(TINY, mode="srf", iters=8, eval_interval=4), text_data)
    history = run.run()
    names = [n for n, _ in run.matrices] + ["all"]
    logged = [(d["iter"], d["param"]) for d in history.diagnostics]
    assert logged == [(i, n) for i in (0, 4, 8) for n in names]
    last = {d["param"]: d for d in history.diagnostics if d["iter"] == 8}
    total = sum(p.detach().abs().double().sum().item() for _, p in run.matrices)
    assert last["all"]["mean_abs"] == pytest.approx(total / last["all"]["numel"], rel=1e-12)
    assert 0.0 < last["all"]["changed"] < 1.0  # the 8-bit write-back leaves some weights as they were
    assert last["all"]["outward_ulp"] is not None
    assert history.diagnostics[0]["changed"] is None  # no step before iteration 0
    plain = Run(replace(TINY, mode="fp32", iters=4, eval_interval=4), text_data).run()
    everything = [d for d in plain.diagnostics if d["iter"] == 4 and d["param"] == "all"]
    assert everything[0]["outward_ulp"] is None and everything[0]["changed"] > 0.99


def test_speed_options_train_and_resume_bit_for_bit(text_data):  # noqa: F811
    """bfloat16 autocast and fused AdamW (torch.compile of the model: the GPU preset's
    third option, checked by test_compiled_model_keeps_its_state_dict)."""
    cfg = replace(TINY, mode="src", iters=30, eval_interval=15, autocast=True, fused_adamw=True)
    whole = Run(cfg, text_data)
    assert whole.optimizer.defaults["fused"] is True
    whole.run()
    assert whole.history.val[-1] < whole.history.val[0] - 0.3
    first = Run(cfg, text_data)
    first.run(until=15)
    resumed = Run(cfg, text_data)
    resumed.load_state_dict(first.state_dict())
    resumed.run()
    assert resumed.history.val == whole.history.val
    assert resumed.history.diagnostics == whole.history.diagnostics
    plain = Run(replace(cfg, autocast=False, fused_adamw=False), text_data).run()
    assert plain.val != whole.history.val  # bfloat16 matrix products: other bits


@pytest.mark.slow
def test_compiled_model_keeps_its_state_dict(text_data):  # noqa: F811
    cfg = replace(TINY, mode="src", iters=4, eval_interval=2)
    eager, compiled = Run(cfg, text_data), Run(replace(cfg, compile_model=True), text_data)
    assert list(compiled.model.state_dict()) == list(eager.model.state_dict())
    eager.run()
    compiled.run()
    assert compiled.history.val == pytest.approx(eager.history.val, abs=1e-3)


def test_srf_sweep_arms_and_outputs(tmp_path, capsys, monkeypatch):
    assert [c.label for c in arm_configs("srf", TINY, [0])] == [
        "binary8p4 SRC N=3", "binary8p4 SRF N=3", "binary8p4 SRF N=3 fp32 updates", "binary8p4 SRF N=4",
        "binary8p4 SRC N=4",
    ]  # fmt: skip
    monkeypatch.setenv("FEWBIT_EAGER", "1")  # five first compilations would test nothing here
    args, out = tiny_sweep(tmp_path, "srf", 4)
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert re.search(r"binary8p4 SRF N=3 fp32 updates +[0-9.]+ +[0-9.]+ +[+-][0-9.]+ +[+-][0-9.]+\n", printed)
    rows = list(csv.DictReader(open(out / "diagnostics.csv")))
    whole = [r for r in rows if r["param"] == "all"]
    assert [(r["arm"], r["iter"]) for r in whole[:3]] == [("binary8p4 SRC N=3", i) for i in ("0", "2", "4")]
    assert whole[0]["changed"] == "" and float(whole[1]["changed"]) > 0
    assert (out / "srf_diagnostics.png").stat().st_size > 10_000


def test_diagnostics_table_takes_means_over_seeds_of_the_last_evaluation():
    """Per arm: the means over seeds of the last evaluation's mean |w| and changed share, of
    the last outward error, and of each run's average error. Three seeds, figures by hand
    (the sweep test reads the printed row by a regex only, so mean |w| from the first
    evaluation passed): |w| (0.25 + 0.5 + 0.75) / 3 = 0.5; changed (0.5 + 0.25 + 0.75) / 3 =
    0.5; last error (0.25 - 0.25 + 0.75) / 3 = 0.25; averages of (0.5, last error) 0.375."""

    def row(it, w, changed, error):
        return {"iter": it, "param": "all", "numel": 10, "mean_abs": w, "changed": changed,
                "outward_ulp": error}  # fmt: skip

    last = [(0.25, 0.5, 0.25), (0.5, 0.25, -0.25), (0.75, 0.75, 0.75)]  # each seed's |w|, changed, error
    runs = [RunResult(TINY.label, s, [0, 10], [5.0, 4.0], [6.0, 3.0], 1.0,
                      [row(0, 1.0, None, None), row(10, 9.0, 0.9, 0.5), row(20, *end)])
            for s, end in enumerate(last)]  # fmt: skip
    header, line = format_diagnostics(runs).splitlines()
    assert header.split()[-6:] == ["|w|", "changed", "error", "ulp", "mean", "error"]
    assert [float(v) for v in line.split()[-4:]] == [0.5, 0.5, 0.25, 0.375]


def test_time_steps_prints_both_steps_and_the_write_back(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FEWBIT_EAGER", "1")
    args, _ = tiny_sweep(tmp_path, "srf", 4)
    # --time-steps refuses the options of a sweep it would ignore: the data's alone.
    data = args[args.index("--data-dir") : args.index("--out")]
    args = ["train", "--preset", "tiny", "--time-steps", "2", *data]
    assert main(args) == 0
    printed = capsys.readouterr().out
    times = re.findall(r"  (?:step with|the write-back).*? ([0-9.]+) ms", printed)
    with_, without, alone = map(float, times)
    share = float(re.search(r"\(([0-9.]+)% of the step with it\)", printed).group(1))
    assert with_ > 0 and without > 0 and 0 < alone < with_
    # Printed to 0.001 ms and 0.1%: the share from the printed times may be off by this much.
    slack = 100 * 0.0005 * (1 / with_ + alone / with_**2) + 0.05
    assert share == pytest.approx(100 * alone / with_, abs=slack * 1.01)
    host = float(re.search(r"    its host time +([0-9.]+) ms", printed).group(1))
    assert 0 < host <= alone  # (the wrapper's step returns before the training step does)


def test_ratchet_srf_drifts_outward_and_its_cures_do_not():
    """The noisy quadratic, short: SRF with N = 3 < D = 4 inflates the weights, SRFF
    shrinks them; SRC, float32 updates and N = 4 = D stay within 1% of the targets'
    magnitude (5% for SRF N = 4: its subnormals keep more than 4 excess bits)."""
    growth, error, distance = {}, {}, {}
    for arm in ratchet.ARMS:
        cfg = ratchet.RatchetConfig(**arm, iters=600, shape=(32, 64), eval_interval=150)
        h = ratchet.run(cfg)
        growth[cfg.label], distance[cfg.label] = h.growth[-1], h.distance[-1]
        error[cfg.label] = h.error_ulp[-1]
    assert growth["binary8p4 SRF N=3"] > 1.15 and error["binary8p4 SRF N=3"] > 0.005
    assert growth["binary8p4 SRFF N=3"] < 0.85 and error["binary8p4 SRFF N=3"] < -0.005
    for label in ("binary32", "binary8p4 SRC N=3", "binary8p4 SRF N=3 fp32 updates", "binary8p4 SRC N=4"):
        assert abs(growth[label] - 1) < 0.01, label
    assert 1.0 < growth["binary8p4 SRF N=4"] < 1.05
    assert distance["binary8p4 SRF N=3"] > 1.5 * distance["binary8p4 SRC N=3"]
    assert error["binary32"] is None


def test_ratchet_cli_writes_its_table_and_plot(tmp_path, capsys):
    assert main(["ratchet", "--iters", "300", "--seeds", "0", "1", "--out", str(tmp_path), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"binary8p4 SRF N=3 +[0-9.]+ \[[0-9.]+, [0-9.]+\]", printed)
    summary = list(csv.DictReader(open(tmp_path / "ratchet_summary.csv")))
    assert [r["arm"] for r in summary] == [ratchet.RatchetConfig(**a).label for a in ratchet.ARMS]
    assert all(r["seeds"] == "2" for r in summary)
    rows = list(csv.DictReader(open(tmp_path / "ratchet.csv")))
    assert len(rows) == 8 * 2 * (300 // 250 + 1)  # every arm and seed at steps 250 and 300
    assert (tmp_path / "ratchet.png").stat().st_size > 10_000


def test_without_matplotlib_an_earlier_plot_is_removed_not_left_beside_new_csvs(tmp_path, monkeypatch,
                                                                                capsys):
    """... and each plot not drawn is named once, with what to install (it was skipped in
    silence, while the README and --help promise it)."""
    from fewbit.experiments import sweep

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    monkeypatch.setattr(sweep, "_UNDRAWN", set())
    stale = [tmp_path / name for name in ("ratchet.png", "srf.png", "srf_diagnostics.png")]
    for path in stale:
        path.write_bytes(b"an earlier run's plot")
    history = ratchet.run(ratchet.RatchetConfig(iters=1, shape=(2, 2), eval_interval=1))
    written = ratchet.write_outputs({"binary8p4 SRF N=3": [history]}, tmp_path)
    assert [p.name for p in written] == ["ratchet.csv", "ratchet_summary.csv"]
    # The sweeps' plots (fewbit train), as their write_outputs draws them.
    assert sweep.plot([], stale[1], "srf") is False and sweep.plot_diagnostics([], stale[2], "srf") is False
    assert sweep.plot([], stale[1], "srf") is False  # (a sweep draws again as runs finish)
    assert not any(path.exists() for path in stale)
    said = capsys.readouterr().err.splitlines()
    assert said == [f"fewbit: {p.name} not drawn: matplotlib is not installed (pip install 'fewbit[plot]')"
                    for p in stale]


def test_gpu_presets_say_so_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert main(["train", "--preset", "gpt2-medium", "--sweep", "figure4", "--out", "unused"]) == 2
    assert capsys.readouterr().err == ("fewbit: error: --preset gpt2-medium trains on a GPU (cuda) and "
                                       "there is no CUDA device here; --device cpu runs it on the "
                                       "CPU\n")  # fmt: skip
    # Asked for by --device, not by the preset (which said "--preset tiny trains on a GPU").
    assert main(["train", "--preset", "tiny", "--device", "cuda:1", "--out", "unused"]) == 2
    assert capsys.readouterr().err == ("fewbit: error: --device cuda:1 asks for a GPU and there is no CUDA "
                                       "device here; --device cpu runs it on the CPU\n")  # fmt: skip
