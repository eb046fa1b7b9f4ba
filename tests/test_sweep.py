"""Sweeps that survive interruption: real `fewbit train` processes, stopped by real signals.

Each test starts ``python -m fewbit.cli train --sweep figure3`` (tiny preset, one seed: five
arms) in a session of its own, signals it while a run is mid-way, checks that no process
of that session is left, and compares what the sweep writes (CSVs and PNG) with an
uninterrupted sweep's files, byte for byte. Two sweeps on one folder: the second is
refused while the first runs, and a killed sweep leaves no lock behind. Rounding runs
eager (FEWBIT_EAGER=1): these tests are about processes and files, and five first
compilations would take minutes.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fewbit
from fewbit.cli import main
from fewbit.experiments.data import prepare_shakespeare
from fewbit.experiments.sweep import LOCK, hold
from fewbit.experiments.train import TrainConfig
from test_train import fake_tarball

pytestmark = pytest.mark.slow  # about ten `fewbit train` processes, each importing torch

ITERS = 20
SWEEP = ["train", "--preset", "tiny", "--sweep", "figure3", "--seeds", "0", "--iters", str(ITERS),
         "--eval-interval", "5", "--quiet"]  # fmt: skip
ENV = {
    **os.environ,
    "FEWBIT_EAGER": "1",
    # The processes import this fewbit, wherever the tests found it.
    "PYTHONPATH": os.pathsep.join([str(Path(fewbit.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
}
OUTPUTS = ("losses.csv", "summary.csv", "diagnostics.csv", "figure3.png", "figure3_diagnostics.png")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    prepare_shakespeare(root, fake_tarball(root / "s.tar.gz"))
    return root


def start(data_dir: Path, out: Path, *extra: str) -> subprocess.Popen:
    """The sweep, in a session of its own: its id is the process's pid."""
    cmd = [sys.executable, "-m", "fewbit.cli", *SWEEP, "--data-dir", str(data_dir), "--out", str(out), *extra]
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    """Exit status and stderr, once the command has ended."""
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory) -> Path:
    """An uninterrupted sweep's folder (run from this process: one torch import less)."""
    out = tmp_path_factory.mktemp("reference")
    with pytest.MonkeyPatch.context() as env:
        for name in ("FEWBIT_EAGER", "PYTHONPATH"):
            env.setenv(name, ENV[name])
        assert main([*SWEEP, "--data-dir", str(data_dir), "--out", str(out)]) == 0
    return out


def session(sid: int) -> dict[int, str]:
    """The live processes of session ``sid``: pid -> command line."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # ended meanwhile
            continue
        state, _, _, sid_of = text[text.rindex(")") + 2 :].split()[:4]
        if int(sid_of) == sid and state != "Z":
            found[int(stat.parent.name)] = cmdline
    return found


def iteration(checkpoint: Path) -> int:
    return torch.load(checkpoint)["run"]["it"]


def mid_run(proc: subprocess.Popen, out: Path, since: float) -> Path:
    """Wait for a checkpoint written after ``since`` by a run part of the way through;
    return that run's folder."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the sweep ended first: {finish(proc)}"
        for checkpoint in out.glob("*/checkpoint.pt"):
            try:
                if checkpoint.stat().st_mtime > since and 0 < iteration(checkpoint) < ITERS:
                    return checkpoint.parent
            except FileNotFoundError:  # replaced meanwhile
                continue
        time.sleep(0.02)
    raise AssertionError("no checkpoint mid-run within 240 s")


def interrupt(data_dir: Path, out: Path, sig: signal.Signals) -> str:
    """Start or continue the sweep, send ``sig`` mid-run; check it stopped, leaving
    nothing running; its stderr."""
    since = time.time()
    proc = start(data_dir, out)
    mid_run(proc, out, since)
    proc.send_signal(sig)
    code, err = finish(proc)
    assert code == 128 + sig, err
    assert session(proc.pid) == {}
    assert f"stopped by {sig.name}" in err and "run the same command to continue" in err
    assert "Traceback" not in err
    # What the next call continues from: a run part of the way through.
    saved = [f / "checkpoint.pt" for f in out.iterdir() if not (f / "result.json").exists()]
    assert any(0 < iteration(c) < ITERS for c in saved if c.exists()), err
    return err


def assert_same_outputs(out: Path, reference: Path) -> None:
    for name in OUTPUTS:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name


def test_stopped_three_ways_then_continued_equals_uninterrupted(data_dir, reference, tmp_path):
    interrupt(data_dir, tmp_path, signal.SIGTERM)
    err = interrupt(data_dir, tmp_path, signal.SIGINT)
    assert "fewbit: continuing in" in err  # the second call went on from the first's checkpoints
    # Killed outright, the command cannot stop its workers: they notice, and end.
    since = time.time()
    proc = start(data_dir, tmp_path)
    mid_run(proc, tmp_path, since)
    proc.kill()
    proc.communicate()
    deadline = time.monotonic() + 10
    while session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session(proc.pid) == {}
    code, err = finish(start(data_dir, tmp_path))
    assert code == 0, err
    assert_same_outputs(tmp_path, reference)


def test_killed_worker_is_reported_and_the_rest_finish(data_dir, reference, tmp_path):
    since = time.time()
    proc = start(data_dir, tmp_path, "--workers", "1")
    mid_run(proc, tmp_path, since)
    (worker,) = [pid for pid, cmd in session(proc.pid).items() if "fewbit.experiments.worker" in cmd]
    os.kill(worker, signal.SIGKILL)
    code, err = finish(proc)
    assert code == 1, err
    assert session(proc.pid) == {}
    # The run the worker had then: the one found mid-run, or (on a loaded machine) the next.
    killed = re.search(r"the worker training '(.+?)' seed 0 killed by SIGKILL", err)
    assert killed, err
    labels = {TrainConfig(**json.loads(c.read_text())).label for c in tmp_path.glob("*/config.json")}
    label = killed.group(1)
    assert label in labels, (label, labels)
    assert f"1 of 5 runs did not finish: {label!r} seed 0" in err
    # The other four runs' rows, as the uninterrupted sweep wrote them.
    rows = (reference / "losses.csv").read_text().splitlines(keepends=True)
    assert (tmp_path / "losses.csv").read_text() == "".join(r for r in rows if not r.startswith(label + ","))
    # The killed run continues from its checkpoint.
    code, err = finish(start(data_dir, tmp_path))
    assert code == 0, err
    assert_same_outputs(tmp_path, reference)


def test_training_warns_of_nothing(data_dir, tmp_path):
    """`python -W error::UserWarning -m fewbit.cli train --preset tiny`, compiled as a user
    runs it: no warning, from the command or its worker."""
    env = {k: v for k, v in ENV.items() if k != "FEWBIT_EAGER"}
    cmd = [sys.executable, "-W", "error::UserWarning", "-m", "fewbit.cli", "train", "--preset", "tiny",
           "--data-dir", str(data_dir), "--out", str(tmp_path), "--quiet"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "Warning" not in done.stderr, done.stderr


# ---------------------------------------------------------------------------------
# One sweep at a time on a folder.


def holder(out: Path) -> int | None:
    """The pid in ``out``'s lock file: the sweep that holds it, or held it last."""
    try:
        text = (out / LOCK).read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text else None


def await_lock(proc: subprocess.Popen, out: Path) -> None:
    """Wait until the sweep ``proc`` holds ``out``."""
    deadline = time.monotonic() + 120
    while holder(out) != proc.pid:
        assert proc.poll() is None, f"the sweep ended first: {finish(proc)}"
        assert time.monotonic() < deadline, "the sweep took no lock within 120 s"
        time.sleep(0.02)


def in_use(out: Path, pid: int) -> str:
    """The refused command's stderr."""
    return (f"fewbit: error: {out} is in use by another sweep (pid {pid}): wait for it to end or stop it, or "
            "pass another --out\n")  # fmt: skip


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_held_folder_is_refused_before_anything_is_written(data_dir, tmp_path, capsys):
    run = tmp_path / "binary16-s0"  # what --restart would discard, were the command to go on
    run.mkdir()
    (run / "checkpoint.pt").write_bytes(b"an earlier run")
    # A second open file of the lock is refused as another process's would be.
    with hold(tmp_path):
        before = files(tmp_path)
        code = main([*SWEEP, "--data-dir", str(data_dir), "--out", str(tmp_path), "--restart"])
        assert files(tmp_path) == before
    assert code == 2
    assert capsys.readouterr().err == in_use(tmp_path, os.getpid())


def test_a_second_sweep_on_the_folder_fails_at_once_and_the_first_goes_on(data_dir, reference, tmp_path):
    first = start(data_dir, tmp_path)
    await_lock(first, tmp_path)
    # Refused, not queued: waiting for the lock, it would run once the first ends, and succeed.
    assert finish(start(data_dir, tmp_path)) == (2, in_use(tmp_path, first.pid))
    code, err = finish(first)
    assert code == 0, err
    assert_same_outputs(tmp_path, reference)


def test_a_killed_sweep_leaves_no_lock_behind(data_dir, tmp_path):
    first = start(data_dir, tmp_path)
    await_lock(first, tmp_path)
    first.kill()
    finish(first)
    assert holder(tmp_path) == first.pid  # the file stays, naming a process that is gone
    # The next sweep's first step, without its training: the lock is free at once (its
    # workers, should it have started any, end on their own).
    with hold(tmp_path):
        assert holder(tmp_path) == os.getpid()


def test_a_run_that_finished_as_the_stop_came_is_counted_and_written(data_dir, tmp_path, monkeypatch, capsys):
    """A run may write its result as a stop comes, before its worker's message is read:
    the stop line said '0 of 5 runs finished' and the outputs left it out until the next
    call. The finished runs are the results on disk."""
    from fewbit.experiments import sweep

    def stopped_as_one_finished(configs, folders, *args, **kwargs):
        result = {"iters": [0, 10, 20], "train": [4.2, 3.1, 2.7], "val": [4.2, 3.2, 2.8], "seconds": 1.0}
        (folders[0] / "result.json").write_text(json.dumps(result))
        return sweep.SweepOutcome(total=len(configs), stopped=signal.SIGINT)

    monkeypatch.setattr(sweep, "run_many", stopped_as_one_finished)
    code = main([*SWEEP, "--data-dir", str(data_dir), "--out", str(tmp_path)])
    assert code == 128 + signal.SIGINT
    assert "1 of 5 runs finished" in capsys.readouterr().err
    assert "2.8" in (tmp_path / "losses.csv").read_text()


def test_a_stop_as_the_last_run_ends_stops_nothing(data_dir, tmp_path, monkeypatch, capsys):
    """Ctrl-C while the last run's tables and plots were drawn (the bar at 100%) said "stopped
    by SIGINT: 5 of 5 runs finished, ...; run the same command to continue", status 130,
    with every run finished and written."""
    from fewbit.experiments import sweep

    def stopped_as_the_last_finished(configs, folders, *args, **kwargs):
        result = {"iters": [0, 10, 20], "train": [4.2, 3.1, 2.7], "val": [4.2, 3.2, 2.8], "seconds": 1.0}
        for folder in folders:
            (folder / "result.json").write_text(json.dumps(result))
        return sweep.SweepOutcome(total=len(configs), stopped=signal.SIGINT)

    monkeypatch.setattr(sweep, "run_many", stopped_as_the_last_finished)
    assert main([*SWEEP, "--data-dir", str(data_dir), "--out", str(tmp_path)]) == 0
    assert "stopped" not in capsys.readouterr().err
    assert len((tmp_path / "losses.csv").read_text().splitlines()) == 1 + 5 * 3


def test_a_stop_as_the_last_run_ends_after_a_failure_reports_the_failure(data_dir, tmp_path, monkeypatch,
                                                                        capsys):  # fmt: skip
    """With one run failed and the others finished, a stop as the last ended stopped nothing
    either; it said "stopped by SIGINT: 4 of 5 runs finished, 0 more saved", status 130, and
    not which run had failed."""
    from fewbit.experiments import sweep

    def one_failed_and_stopped_as_the_last_finished(configs, folders, *args, **kwargs):
        result = {"iters": [0, 10, 20], "train": [4.2, 3.1, 2.7], "val": [4.2, 3.2, 2.8], "seconds": 1.0}
        for folder in folders[1:]:
            (folder / "result.json").write_text(json.dumps(result))
        return sweep.SweepOutcome(total=len(configs), failed=[(configs[0], "killed by SIGKILL")],
                                  stopped=signal.SIGINT)  # fmt: skip

    monkeypatch.setattr(sweep, "run_many", one_failed_and_stopped_as_the_last_finished)
    assert main([*SWEEP, "--data-dir", str(data_dir), "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "stopped" not in err and "1 of 5 runs did not finish" in err


@pytest.mark.parametrize("restart", [False, True])
def test_the_way_on_after_a_stop_or_a_failure_keeps_what_was_saved(data_dir, tmp_path, monkeypatch, capsys,
                                                                   restart):  # fmt: skip
    """"Run the same command to continue" after a command with --restart discarded the
    checkpoints it had just saved: the way on is the command without it."""
    from fewbit.experiments import sweep

    ends = [(dict(stopped=signal.SIGTERM), "to continue, with --restart to start over"),
            (dict(failed=[(TrainConfig(), "killed by SIGKILL")]), "to continue them from")]  # fmt: skip
    restarting = ["--restart"] if restart else []
    for outcome, says in ends:
        ended = sweep.SweepOutcome(5, **outcome)  # (5 runs: SWEEP's)
        monkeypatch.setattr(sweep, "run_many", lambda *a, **k: ended)
        main([*SWEEP, "--data-dir", str(data_dir), "--out", str(tmp_path), *restarting])
        way = "the same command without --restart" if restart else "the same command"
        assert f"; run {way} {says}" in capsys.readouterr().err


def train_seed(data_dir: Path, out: Path, seed: int) -> None:
    """SWEEP at ``seed`` into ``out``, from this process (as ``reference``)."""
    args = [*SWEEP, "--data-dir", str(data_dir), "--out", str(out)]
    args[args.index("--seeds") + 1] = str(seed)
    with pytest.MonkeyPatch.context() as env:
        for name in ("FEWBIT_EAGER", "PYTHONPATH"):
            env.setenv(name, ENV[name])
        assert main(args) == 0


@pytest.fixture(scope="module")
def seed_1(data_dir, tmp_path_factory) -> Path:
    """SWEEP at seed 1, apart from the reference's seed 0."""
    out = tmp_path_factory.mktemp("seed_1")
    train_seed(data_dir, out, 1)
    return out


def test_seeds_run_apart_collect_into_what_a_sweep_of_both_writes(data_dir, reference, seed_1, tmp_path,
                                                                  capsys):  # fmt: skip
    """`fewbit collect` of two folders, seed 0's and seed 1's tables, against the sweep of
    seeds 0 and 1 in one folder that holds both folders' runs (it trains none of them and
    writes its tables from their result.json): the same bytes, PNGs included."""
    together = tmp_path / "together"
    for run in [*reference.glob("*-s0"), *seed_1.glob("*-s1")]:
        shutil.copytree(run, together / run.name, ignore=shutil.ignore_patterns("checkpoint.pt"))
    args = [*SWEEP, "--data-dir", str(data_dir), "--out", str(together)]
    args[args.index("--seeds") + 1 : args.index("--seeds") + 2] = ["0", "1"]
    assert main(args) == 0
    assert "10 of 10 runs finished" in capsys.readouterr().err  # (none trained)
    collected = tmp_path / "collected"
    assert main(["collect", str(reference), str(seed_1), "--sweep", "figure3", "--out", str(collected)]) == 0
    out = capsys.readouterr().out
    assert_same_outputs(collected, together)
    assert (collected / "times.csv").read_bytes() == (together / "times.csv").read_bytes()
    # Each arm's mean and spread over the two seeds, as the summary prints them.
    summary = {r["arm"]: r for r in csv.DictReader((together / "summary.csv").open())}
    src = summary["binary8p4 SRC N=3"]
    assert src["seeds"] == "2" and float(src["final_min"]) < float(src["final_max"])
    assert f"{float(src['final_val']):.3f} [{float(src['final_min']):.3f}, " in out


def test_collect_refuses_before_writing(reference, seed_1, tmp_path):
    from fewbit.experiments.sweep import collect, read_outputs, write_losses

    out = tmp_path / "out"
    # Another configuration's run of an arm: evaluated at other iterations.
    other = tmp_path / "other"
    shutil.copytree(seed_1, other, ignore=shutil.ignore_patterns("*-s1"))
    runs = read_outputs(other)
    runs[0].iters = [i * 2 for i in runs[0].iters]
    write_losses(runs, other / "losses.csv")
    damaged = tmp_path / "damaged"
    shutil.copytree(seed_1, damaged, ignore=shutil.ignore_patterns("*-s1"))
    text = (damaged / "losses.csv").read_text().splitlines()
    text[3] = text[3].replace(",", ",x", 1)
    (damaged / "losses.csv").write_text("\n".join(text) + "\n")
    refused = {
        "is in both": ([reference, reference], out),
        "one of the folders collected from": ([reference], reference),
        "holds runs (binary16-s0, ": ([seed_1], reference),
        "evaluated at other iterations": ([reference, other], out),
        "losses.csv, line 4: not a sweep's row": ([damaged], out),
        "a sweep's folder holds losses.csv": ([tmp_path], out),
    }
    before = {p: p.stat().st_mtime_ns for p in reference.iterdir()}
    for message, (sources, to) in refused.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            collect(sources, to, "figure3")
    assert not out.exists()
    assert {p: p.stat().st_mtime_ns for p in reference.iterdir()} == before


def test_collect_refuses_diagnostics_of_other_iterations_before_writing(tmp_path):
    """A diagnostics.csv that lacks a row of the whole model (damaged) passed every check, and
    the diagnostics plot failed on it ("zip() argument 2 is shorter than argument 1") after
    the tables and the loss plot were written."""
    from fewbit.experiments.sweep import RunResult, collect, write_diagnostics, write_losses, write_times

    def run(seed: int, evaluations: list[int]) -> RunResult:
        rows = [{"iter": i, "param": "all", "numel": 64, "mean_abs": 0.5, "changed": 0.1, "outward_ulp": 0.01}
                for i in evaluations]  # fmt: skip
        return RunResult("binary8p4 SRC N=3", seed, [0, 10, 20], [5.0, 4.0, 3.0], [5.5, 4.5, 3.5], 1.0, rows)

    folders = [tmp_path / "s0", tmp_path / "s1"]
    for folder, result in zip(folders, [run(0, [0, 10, 20]), run(1, [0, 20])], strict=True):
        folder.mkdir()
        write_losses([result], folder / "losses.csv")
        write_diagnostics([result], folder / "diagnostics.csv")
        write_times([result], folder / "times.csv")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"'binary8p4 SRC N=3' seed 1 hold mean_abs at other iterations than "
                                         r"seed 0's: a damaged diagnostics.csv"):  # fmt: skip
        collect(folders, out, "figure3")
    assert not out.exists()


def test_collect_keeps_the_sweeps_order_of_arms_whatever_comes_first(reference, seed_1, tmp_path):
    """A folder of a sweep cut short (only its SRC arm finished) given first put SRC at the
    top of summary.csv and the plots: the arms now come in the order the sweeps wrote them."""
    from fewbit.experiments.sweep import collect, read_outputs, write_diagnostics, write_losses, write_times

    cut = tmp_path / "cut"
    cut.mkdir()
    src = [run for run in read_outputs(seed_1) if run.label == "binary8p4 SRC N=3"]
    for write, name in ((write_losses, "losses.csv"), (write_times, "times.csv"),
                        (write_diagnostics, "diagnostics.csv")):  # fmt: skip
        write(src, cut / name)
    collected, _ = collect([cut, reference], tmp_path / "out", "figure3")
    arms = list(dict.fromkeys(run.label for run in collected))
    assert arms == [run.label for run in read_outputs(reference)]  # binary16 first, SRC last
    assert [(run.label, run.seed) for run in collected[-2:]] == [(src[0].label, 0), (src[0].label, 1)]


def _tables(folder: Path, runs) -> Path:
    """``runs`` (RunResults) written into ``folder`` as a sweep writes its tables."""
    from fewbit.experiments.sweep import write_diagnostics, write_losses, write_times

    folder.mkdir()
    write_losses(runs, folder / "losses.csv")
    write_times(runs, folder / "times.csv")
    write_diagnostics(runs, folder / "diagnostics.csv")
    return folder


def _run(seed: int = 0):
    from fewbit.experiments.sweep import RunResult

    return RunResult("binary8p4 SRC N=3", seed, [0, 10, 20], [math.nan, 4.0, 3.0], [5.5, 4.5, 3.5], 1.0)


@pytest.mark.parametrize("content", [b"", b"\xff\xfe\x00garbage\n", b'arm,"' + b"x" * 200_000],
                         ids=["empty", "not-utf-8", "unclosed-quote"])
def test_collect_names_an_empty_or_undecodable_table(tmp_path, content):
    """An empty losses.csv was refused with "I/O operation on closed file" (the header read
    after the file was closed), one that is not UTF-8 with the codec's words alone, naming
    no file, and one whose unclosed quote made a field past csv's limit with csv.Error's
    traceback."""
    from fewbit.experiments.sweep import collect

    folder = _tables(tmp_path / "s0", [_run()])
    (folder / "losses.csv").write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(f"{folder / 'losses.csv'} is not a sweep's table")):
        collect([folder], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_collect_refuses_a_run_without_its_time_or_with_an_evaluation_out_of_order(tmp_path):
    """A times.csv that lacked a run of losses.csv was taken, and times.csv written again with
    "nan" seconds for it; a losses.csv with a run's evaluation again at the end (a row
    appended twice) was taken as a run evaluated at 0, 10, 20, 20; a times.csv with a run's
    time twice was taken with the last, and written back with it alone. All are damaged
    tables."""
    from fewbit.experiments.sweep import collect

    untimed = _tables(tmp_path / "untimed", [_run(0), _run(1)])
    (untimed / "times.csv").write_text("".join((untimed / "times.csv").read_text().splitlines(True)[:2]))
    again = _tables(tmp_path / "again", [_run(0)])
    with (again / "losses.csv").open("a") as f:
        f.write("binary8p4 SRC N=3,0,20,3.0,3.5\r\n")
    twice = _tables(tmp_path / "twice", [_run(0)])
    with (twice / "times.csv").open("a") as f:
        f.write("binary8p4 SRC N=3,0,7.0\r\n")
    refused = {"untimed/times.csv lacks 'binary8p4 SRC N=3' seed 1 of losses.csv": untimed,
               "again/losses.csv, line 5: not a sweep's row (iteration 20 after 20": again,
               "twice/times.csv, line 3: not a sweep's row (a second time for the same": twice}  # fmt: skip
    for message, folder in refused.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            collect([folder], tmp_path / "out")
    assert not (tmp_path / "out").exists()
