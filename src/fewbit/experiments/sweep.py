"""Sweeps of training runs: the paper's Figure 3 and seed 002's stagnation study, on the
weights' write-back (``stagnation``) and, as the seed ran it, on gradients in block floating
point (``hbfp``); ``srf`` tests why SRF can fall behind SRC (docs/bias.md).

Each (arm, seed) is one run, trained by a worker process (:mod:`.worker`, one thread
each: small models train faster side by side than sharing threads) in a folder of its
own under the output directory, ``<arm>-s<seed>/``: ``config.json``, ``checkpoint.pt``
(model, optimizer, history and RNG states, rewritten at every evaluation) and, once the
run is over, ``result.json``. Results: ``losses.csv`` (every run's evaluations),
``summary.csv`` (final and best validation loss per arm, mean and spread over seeds), a
PNG of validation loss with the spread over seeds shaded, ``diagnostics.csv`` and
``<sweep>_diagnostics.png`` (at each evaluation, per weight matrix: mean |w|, the share
of weights the last step changed, the write-back's mean error in ulps), and
``times.csv`` (each run's wall-clock seconds in its workers, building the model and
compiling included). They are
rewritten as runs finish; all but ``times.csv`` depend on the finished runs alone, so an
interrupted and continued sweep writes the same bytes as an uninterrupted one.

Sweeps run apart (seeds on other machines) become one sweep's outputs with
:func:`collect` (``fewbit collect``), from their tables alone.

A sweep survives interruption: SIGINT (Ctrl-C) or SIGTERM stops every worker, and the
same call again continues each run from its last checkpoint. A worker that dies (killed,
out of memory) costs its run alone, which is reported; the others go on. One sweep at a
time holds an output directory (:func:`hold`): another is refused before it writes.
"""

from __future__ import annotations

import csv
import fcntl
import io
import json
import math
import os
import shutil
import sys
import zipfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from statistics import fmean as mean

import torch

from .data import CharDataset, write_atomically
from .processes import Child, Children, how_it_ended
from .train import OPTIONS, TrainConfig, unused_fields
from .worker import CHECKPOINT, RESULT

#: Each sweep's arms as overrides of the base configuration.
SWEEPS: dict[str, list[dict]] = {
    "figure3": [
        {"mode": "fp16"},
        {"mode": "rne"},
        {"mode": "srff"},
        {"mode": "srf"},
        {"mode": "src"},
    ],
    "stagnation": [
        {"mode": "fp16"},
        {"mode": "rne"},
        {"mode": "sr_fraction", "fraction": 0.2},
        {"mode": "sr_fraction", "fraction": 0.5},
        {"mode": "sr_fraction", "fraction": 1.0},
        {"mode": "sr_near_zero"},
    ],
    # Gradients in HBFP (weights float32): every arm rounds with grad_bits N (8 by default).
    "hbfp": [
        {"grad_format": None},
        {"grad_mode": "rne"},
        {"grad_mode": "sr_fraction", "grad_fraction": 0.2},
        {"grad_mode": "sr_fraction", "grad_fraction": 0.5},
        {"grad_mode": "sr_near_zero"},
        {"grad_mode": "src"},
    ],
    # Figure 4's arms (run with --preset gpt2-medium).
    "figure4": [
        {"mode": "fp16"},
        {"mode": "srff"},
        {"mode": "srf"},
        {"mode": "src"},
    ],
    # Why SRF may trail SRC: with bfloat16 updates (D = 4) and N = 3 SRF's bias is
    # 2^-(D+1) ulp outward; float32 updates (D large) and N = 4 = D remove it.
    "srf": [
        {"mode": "src"},
        {"mode": "srf"},
        {"mode": "srf", "update_dtype": "fp32"},
        {"mode": "srf", "bits": 4},
        {"mode": "src", "bits": 4},
    ],
}

#: A sweep's defaults below the command line's options (``fewbit train --sweep hbfp
#: --grad-format bfp3_b32`` runs the study at another width). hbfp4: the widest mantissa
#: at which RNE visibly stagnates on the cpu-small preset (the README's width search).
SWEEP_DEFAULTS: dict[str, dict] = {"hbfp": {"mode": "fp32", "grad_format": "hbfp4"}}


@dataclass
class RunResult:
    """A finished run's evaluations, known by its arm's label and its seed (all that the
    tables keep of its configuration)."""

    label: str
    seed: int
    iters: list[int]
    train: list[float]
    val: list[float]
    seconds: float
    diagnostics: list[dict] = field(default_factory=list)


def check_distinct(seeds: Sequence[int]) -> None:
    """Raise ValueError where a seed is given twice: its runs would count twice."""
    if len(set(seeds)) < len(seeds):
        raise ValueError(f"seeds must differ, got {list(seeds)}")


def arm_configs(sweep: str | None, base: TrainConfig, seeds: Sequence[int]) -> list[TrainConfig]:
    """Every (arm, seed) of a named sweep; ``None``: the base configuration alone. Two
    arms that ``base`` makes one run (``--sweep srf --bits 4``) are a ValueError: the
    run would count twice, and two workers would train its folder."""
    if sweep is not None and sweep not in SWEEPS:
        raise ValueError(f"unknown sweep {sweep!r}; choose from {sorted(SWEEPS)}")
    check_distinct(seeds)
    arms = SWEEPS[sweep] if sweep else [{}]
    first: dict[Path, dict] = {}  # each run folder's first arm
    for arm in arms:
        cfg = _arm_config(base, arm)
        if (earlier := first.setdefault(run_folder(Path(), cfg), arm)) is not arm:
            # The fields in which the two arms differ: base sets them alike.
            differ = [k for k in {**earlier, **arm} if earlier.get(k) != arm.get(k)]
            given = ", ".join(f"{OPTIONS[k]} {getattr(base, k)}" for k in differ)
            raise ValueError(f"with {given}, two arms of --sweep {sweep} ({_overrides(earlier)} and "
                             f"{_overrides(arm)}) are one run, {cfg.label!r}: leave out "
                             f"{' and '.join(OPTIONS[k] for k in differ)}")  # fmt: skip
    return [_arm_config(base, arm, seed=s) for arm in arms for s in seeds]


def _arm_config(base: TrainConfig, arm: dict, **more) -> TrainConfig:
    """``base`` with ``arm``'s fields, and those its run does not read (a baseline's
    grad_bits) at their defaults: ``--sweep hbfp --grad-bits 4`` wrote 4 into the float32
    baseline's config.json, and the same sweep without it refused that run as another."""
    cfg = replace(base, **arm, **more)
    unused = unused_fields(cfg.mode, cfg.grad_format, cfg.grad_mode)
    return replace(cfg, **{f.name: f.default for f in fields(TrainConfig)
                           if f.name in unused and f.name not in arm})


def _overrides(arm: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in arm.items())


def run_folder(out_dir: Path, cfg: TrainConfig) -> Path:
    """``binary8p4-src-n3-s0``: the arm's label and the seed."""
    name = cfg.label.lower().replace(" ", "-").replace("=", "")
    return out_dir / f"{name}-s{cfg.seed}"


def read_result(cfg: TrainConfig, folder: Path) -> RunResult | None:
    """The finished run in ``folder``, or None while it is unfinished."""
    path = folder / RESULT
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    return RunResult(cfg.label, cfg.seed, saved["iters"], saved["train"], saved["val"], saved["seconds"],
                     saved.get("diagnostics", []))  # fmt: skip


#: The file in an output directory that a sweep holds locked while it runs (:func:`hold`).
LOCK = ".lock"


def make_out_dir(out_dir: Path, files: Iterable[str] = ()) -> None:
    """Make ``out_dir`` (parents too) for a command's outputs, the ``files`` there, or
    raise a ValueError naming it: called before the command's work, so that a bad
    ``--out`` costs none."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"{out_dir} is a file, or inside one, not a folder: pass another --out") from None
    except OSError as err:
        raise ValueError(f"cannot make the folder {out_dir} ({err.strerror}): pass another --out") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ValueError(f"{out_dir} is not writable: pass another --out")
    for name in files:
        if (out_dir / name).is_dir():
            raise ValueError(f"{out_dir / name} is a folder where a file goes: move it or pass another --out")


@contextmanager
def hold(out_dir: Path, files: Iterable[str] = ()) -> Iterator[None]:
    """Hold ``out_dir`` for one sweep: an exclusive OS advisory lock (``flock``) on
    ``out_dir/.lock``, which names the holder's pid. The OS releases it when the holder
    ends, however it ends, so a crashed or killed sweep leaves no stale lock (the file
    stays; the next sweep takes it). A directory held by another process is a ValueError
    naming it and that pid, raised before anything is written."""
    make_out_dir(out_dir, [*files, LOCK])  # (a folder at LOCK was IsADirectoryError's traceback)
    fd = os.open(out_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)  # an existing file is left as it is
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.read(fd, 32).decode().strip()  # empty while the holder is writing it
            holder = f"pid {pid}" if pid else "a process that has just taken it"
            raise ValueError(f"{out_dir} is in use by another sweep ({holder}): wait for it to end or stop "
                             "it, or pass another --out") from None  # fmt: skip
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)  # the lock goes with the last descriptor of its open file


#: The file in a run's folder naming the text it trains on (CharDataset.digest).
DATA = "data.sha256"


#: The fields that make a config.json a run's, with TrainConfig's fields alone beside them: a
#: folder of the user's whose config.json is {} or holds a "seed" is no run to discard.
_RUN_FIELDS = {"mode", "weight_format", "seed", "iters", "n_layer", "n_embd", "lr"}


def _is_run(folder: Path) -> bool:
    """Whether ``folder`` holds a run of fewbit's: a config.json of TrainConfig's fields."""
    try:
        saved = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and _RUN_FIELDS <= saved.keys() <= asdict(TrainConfig()).keys()


def _check_result(saved: object) -> None:
    """Raise ValueError unless ``saved`` is a run's result.json: its iterations with as many
    train and validation losses, and its seconds."""
    lists = [saved.get(k) for k in ("iters", "train", "val")] if isinstance(saved, dict) else [None]
    if (any(not isinstance(v, list) for v in lists) or len({len(v) for v in lists}) != 1
            or not isinstance(saved.get("seconds"), int | float)):
        raise ValueError


def _check_saved(folder: Path) -> None:
    """Refuse a run whose checkpoint or result is damaged (cut short by a crash): loaded,
    it would fail in the worker at every try."""
    checkpoint, result = folder / CHECKPOINT, folder / RESULT
    try:
        if result.exists():
            _check_result(json.loads(result.read_text()))
        elif checkpoint.exists():
            with zipfile.ZipFile(checkpoint) as saved:  # torch.save's zip: every record's CRC
                if saved.testzip() is not None:
                    raise zipfile.BadZipFile
    except (ValueError, zipfile.BadZipFile, EOFError, OSError):  # (OSError: a folder in its place)
        damaged = result if result.exists() else checkpoint
        raise ValueError(f"{damaged} is damaged or not a run's (cut short?): delete it to train that run "
                         "again from its beginning, or pass --restart to discard every run here") from None


def claim_folders(configs: list[TrainConfig], out_dir: Path, restart: bool, data_digest: str) -> list[Path]:
    """Each run's folder, made or found. With ``restart`` every run out_dir holds is
    discarded first (a folder with a config.json of TrainConfig's, and this command's run
    folders), not only this command's: a later command would take up a run left from
    before as finished. A folder that holds a run of another configuration, or of other
    text (``data_digest``), a damaged checkpoint or result, or either without its
    config.json, is an error, named before anything starts."""
    folders = [run_folder(out_dir, c) for c in configs]
    for folder in folders:  # every check before anything is written or discarded
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"{folder} is a file where a run's folder goes: move it or pass another --out")
        # A link to a run kept elsewhere that has gone: its mkdir below was FileExistsError's
        # traceback, after the runs before it had been claimed (and --restart kept it).
        if folder.is_symlink() and not folder.exists() and not restart:
            raise ValueError(f"{folder} is a link to {os.readlink(folder)}, which is not there: remove the "
                             "link, or pass --restart to discard every run here")  # fmt: skip
    if restart and out_dir.is_dir():
        for old in out_dir.iterdir():  # (and this command's own folders, whatever they hold)
            if old in folders or old.is_dir() and _is_run(old):  # (a file at one of folders: refused above)
                if old.is_symlink():  # a run kept elsewhere: it leaves this folder, its files stay
                    old.unlink()
                else:
                    shutil.rmtree(old)
    for cfg, folder in zip(configs, folders, strict=True):
        written = folder / "config.json"
        if not written.exists() and any((folder / f).exists() for f in (CHECKPOINT, RESULT)):
            raise ValueError(f"{folder} holds a run's checkpoint or result without its config.json (a "
                             f"--restart cut short?): remove {folder}, or pass --restart to discard every "
                             "run here")  # fmt: skip
        if written.exists():
            try:
                before = json.loads(written.read_text())
                if not isinstance(before, dict):
                    raise ValueError
            except ValueError:
                raise ValueError(f"{written} is not a run's configuration (cut short?): remove {folder}, or "
                                 "pass --restart to discard every run here") from None  # fmt: skip
            now = asdict(cfg)
            changed = [f"{k} {before.get(k)!r} -> {now.get(k)!r}" for k in {**before, **now}
                       if before.get(k) != now.get(k)]  # (a field today's fewbit lacks too)
            if changed:
                raise ValueError(
                    f"{folder} holds a run with another configuration ({', '.join(changed)}): pass "
                    "--restart to discard it, or --out for another folder"
                )
        # (A run from before the text was recorded is taken as trained on this text.)
        if (folder / DATA).exists() and (folder / DATA).read_text().strip() != data_digest:
            raise ValueError(f"{folder} holds a run trained on other text (another --data-dir or "
                             "FEWBIT_DATA): pass --restart to discard it, or --out for another "
                             "folder")  # fmt: skip
        _check_saved(folder)
    for cfg, folder in zip(configs, folders, strict=True):
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / "config.json").exists():
            text = json.dumps(asdict(cfg), indent=1).encode()
            write_atomically(folder / "config.json", lambda f, text=text: f.write(text))
        if not (folder / DATA).exists():
            write_atomically(folder / DATA, lambda f: f.write(f"{data_digest}\n".encode()))
    return folders


class _Worker(Child):
    """A worker process (:mod:`.worker`) and the run it trains."""

    def __init__(self, data_file: Path):
        super().__init__("fewbit.experiments.worker", str(data_file))
        self.task: int | None = None

    def send(self, task: int, cfg: TrainConfig, folder: Path) -> None:
        self.task = task
        line = json.dumps({"task": task, "dir": str(folder), "config": asdict(cfg)})
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # it has died: its end of output reports the run
            pass


@dataclass
class SweepOutcome:
    """What a sweep call did: the finished runs in sweep order, the runs whose worker
    died (with how), and the signal that stopped it, if one did."""

    total: int
    results: list[RunResult] = field(default_factory=list)
    failed: list[tuple[TrainConfig, str]] = field(default_factory=list)
    stopped: int | None = None
    checkpointed: int = 0  #: unfinished runs with a checkpoint to continue from
    written: list[Path] = field(default_factory=list)


def run_many(
    configs: list[TrainConfig],
    folders: list[Path],
    data_file: Path,
    workers: int = 2,
    progress_bar: bool = True,
    on_finish: Callable[[list[RunResult]], object] = lambda results: None,
) -> SweepOutcome:
    """Train every unfinished run, ``workers`` at a time, with one progress bar over all
    iterations; ``on_finish`` is called with the finished runs (in sweep order) as each
    ends. SIGINT and SIGTERM stop every worker and return (``outcome.stopped``)."""
    from tqdm import tqdm

    outcome = SweepOutcome(len(configs))
    results = [read_result(c, f) for c, f in zip(configs, folders, strict=True)]
    finished = {i: r for i, r in enumerate(results) if r is not None}
    pending = deque(i for i in range(len(configs)) if i not in finished)
    done_iters = [finished[i].iters[-1] if i in finished else 0 for i in range(len(configs))]
    bar = tqdm(total=sum(c.iters for c in configs), initial=sum(done_iters), unit="it",
               disable=not progress_bar, smoothing=0.05)  # fmt: skip
    bar.set_postfix_str("starting (a mode's first run compiles its kernels)")
    latest: dict[str, str] = {}

    def handle(w: _Worker, message: dict) -> None:
        i = message["task"]
        if message.get("done"):
            w.task = None
            finished[i] = read_result(configs[i], folders[i])
            on_finish([finished[j] for j in sorted(finished)])
            return
        bar.update(message["it"] - done_iters[i])
        done_iters[i] = message["it"]
        if "val" in message:
            latest[f"{configs[i].label} s{configs[i].seed}"] = f"{message['val']:.3f}"
            bar.set_postfix_str(" ".join(f"{k}: {v}" for k, v in list(latest.items())[-2:]))

    def ended(w: _Worker) -> None:
        code = children.close(w)
        if w.task is not None:
            cfg = configs[w.task]
            how = how_it_ended(code)
            outcome.failed.append((cfg, how))
            bar.write(f"fewbit: the worker training {cfg.label!r} seed {cfg.seed} {how}; "
                      "the other runs go on", file=sys.stderr)  # fmt: skip

    # Leaving the block (a stop signal, an error, or the end) stops every worker still running.
    with bar, Children() as children:
        while (pending or children.live) and not children.stopped:
            while pending and len(children.live) < workers:
                children.add(_Worker(data_file))
            for w in children.live:
                if w.task is None and pending:
                    i = pending.popleft()
                    w.send(i, configs[i], folders[i])
                elif w.task is None and not w.proc.stdin.closed:
                    w.proc.stdin.close()  # no more runs: the worker exits
            for w, fd, chunk in children.read(timeout=1.0):
                if not chunk:
                    if not children.reading(w):
                        ended(w)
                    continue
                for line in w.lines(fd, chunk):
                    if fd == w.proc.stdout.fileno() and line.startswith("{"):
                        handle(w, json.loads(line))
                    else:  # the worker's warnings and errors, above the bar
                        bar.write(line, file=sys.stderr)
    outcome.stopped = children.stopped
    outcome.results = [finished[i] for i in sorted(finished)]
    return outcome


def write_csv(path: Path, header: list[str], rows: list[list]) -> None:
    """``rows`` under ``header``, replacing ``path`` atomically (None: an empty field)."""
    text = io.StringIO(newline="")
    w = csv.writer(text)
    w.writerow(header)
    w.writerows(rows)
    write_atomically(path, lambda f: f.write(text.getvalue().encode()))


_DIAGNOSTICS = ("numel", "mean_abs", "changed", "outward_ulp")
#: The columns of the tables of every run's records (summary.csv's are per arm).
_HEADERS = {"losses.csv": ["arm", "seed", "iter", "train_loss", "val_loss"],
            "diagnostics.csv": ["arm", "seed", "iter", "param", *_DIAGNOSTICS],
            "times.csv": ["arm", "seed", "seconds"]}  # fmt: skip


def write_losses(results: list[RunResult], path: Path) -> None:
    rows = [[r.label, r.seed, *evaluation] for r in results
            for evaluation in zip(r.iters, r.train, r.val, strict=True)]  # fmt: skip
    write_csv(path, _HEADERS["losses.csv"], rows)


def write_diagnostics(results: list[RunResult], path: Path) -> None:
    # A measure a row lacks (None: no step before iteration 0, no format for float32
    # weights) is an empty field.
    rows = [[r.label, r.seed, d["iter"], d["param"], *(d[k] for k in _DIAGNOSTICS)]
            for r in results for d in r.diagnostics]  # fmt: skip
    write_csv(path, _HEADERS["diagnostics.csv"], rows)


def _totals(run: RunResult, measure: str) -> tuple[list[int], list[float]]:
    """One measure of the whole model (the ``all`` rows) at each evaluation that has it."""
    rows = [d for d in run.diagnostics if d["param"] == "all" and d[measure] is not None]
    return [d["iter"] for d in rows], [d[measure] for d in rows]


def format_diagnostics(results: list[RunResult]) -> str:
    """Per arm, means over seeds: mean |w| at the end, the share of weights the last step
    changed, and the write-back's error in ulps (outward positive), at the end and
    averaged over every evaluation."""
    arms = by_arm(results)
    width = max(28, *map(len, arms))
    lines = [f"{'arm':<{width}} {'mean |w|':>9} {'changed':>8} {'error ulp':>10} {'mean error':>11}"]
    for label, runs in arms.items():
        if not all(_totals(r, "mean_abs")[1] for r in runs):
            continue  # runs from before the diagnostics
        w = mean([_totals(r, "mean_abs")[1][-1] for r in runs])
        changed = mean([_totals(r, "changed")[1][-1] for r in runs])
        errors = [_totals(r, "outward_ulp")[1] for r in runs]
        if all(errors):
            last, overall = mean([e[-1] for e in errors]), mean([mean(e) for e in errors])
            last, overall = f"{last:+10.5f}", f"{overall:+11.5f}"
        else:  # float32 weights: no write-back
            last, overall = f"{'-':>10}", f"{'-':>11}"
        lines.append(f"{label:<{width}} {w:9.6f} {changed:8.4f} {last} {overall}")
    return "\n".join(lines)


def write_times(results: list[RunResult], path: Path) -> None:
    rows = [[r.label, r.seed, f"{r.seconds:.1f}"] for r in results]
    write_csv(path, _HEADERS["times.csv"], rows)


def by_arm(results: list[RunResult]) -> dict[str, list[RunResult]]:
    """Each arm's runs (one per seed), in sweep order."""
    arms: dict[str, list[RunResult]] = {}
    for r in results:
        arms.setdefault(r.label, []).append(r)
    return arms


def _nan_last(values: list[float]) -> list[float]:
    """Sorted, a NaN (a diverged run) above every number: the worst loss."""
    return sorted(values, key=lambda v: (math.isnan(v), v))


def summarise(results: list[RunResult]) -> list[dict]:
    """Per arm: final and best validation loss, mean with min and max over seeds. A NaN
    loss counts as the worst, whatever the order of the seeds: a seed that diverged makes
    final_max (and the mean) NaN, final_min is the best seed's; a run's best loss is its
    lowest before it diverged."""
    rows = []
    for label, runs in by_arm(results).items():
        final = [r.val[-1] for r in runs]
        ordered = _nan_last(final)
        best = [_nan_last(r.val)[0] for r in runs]
        rows.append({
            "arm": label, "seeds": len(runs),
            "final_val": sum(final) / len(final), "final_min": ordered[0], "final_max": ordered[-1],
            "best_val": sum(best) / len(best),
        })  # fmt: skip
    return rows


def write_summary(rows: list[dict], path: Path) -> None:
    write_csv(path, list(rows[0]), [list(r.values()) for r in rows])


def format_summary(rows: list[dict]) -> str:
    width = max(28, *(len(r["arm"]) for r in rows))
    lines = [f"{'arm':<{width}} {'final val loss':>22} {'best val':>9}"]
    for r in rows:
        spread = f"{r['final_val']:.3f} [{r['final_min']:.3f}, {r['final_max']:.3f}]"
        lines.append(f"{r['arm']:<{width}} {spread:>22} {r['best_val']:>9.3f}")
    return "\n".join(lines)


_UNDRAWN: set[str] = set()  # the plots said to be skipped, each said once a process


def pyplot(path: Path):
    """matplotlib's pyplot drawing to files (the Agg backend), to draw ``path``; or None
    without matplotlib (an optional dependency), ``path`` removed: a plot of earlier runs
    must not sit beside the new data as if it drew them. The CSVs are written either way."""
    try:
        import matplotlib
    except ImportError:
        path.unlink(missing_ok=True)
        if path.name not in _UNDRAWN:
            _UNDRAWN.add(path.name)
            print(f"fewbit: {path.name} not drawn: matplotlib is not installed (pip install 'fewbit[plot]')",
                  file=sys.stderr, flush=True)  # fmt: skip
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(results: list[RunResult], path: Path, title: str) -> bool:
    """Validation loss per arm: mean over seeds, the min-max band shaded. False, and no
    file, without matplotlib (an optional dependency)."""
    if (plt := pyplot(path)) is None:
        return False

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, runs in by_arm(results).items():
        its = torch.tensor(runs[0].iters)
        vals = torch.tensor([r.val for r in runs])
        (line,) = ax.plot(its, vals.mean(0), label=f"{label} ({len(runs)} seed{'s' * (len(runs) > 1)})")
        ax.fill_between(its, vals.min(0).values, vals.max(0).values, color=line.get_color(), alpha=0.25)
    ax.set_xlabel("iteration")
    ax.set_ylabel("validation loss (nats/char)")
    ax.set_title(title)
    lo = min(min(r.val) for r in results)
    ax.set_ylim(lo - 0.05, lo + 1.2)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    write_atomically(path, lambda f: fig.savefig(f, format="png", dpi=120))
    plt.close(fig)
    return True


def plot_diagnostics(results: list[RunResult], path: Path, title: str) -> bool:
    """Mean |w|, the share of weights changed by the step before each evaluation and the
    write-back's error in ulps, per arm (mean over seeds), against iteration. False, and
    no file, without matplotlib."""
    if (plt := pyplot(path)) is None:
        return False

    measures = {"mean_abs": "mean |w|", "changed": "share changed by the step",
                "outward_ulp": "write-back error (ulps, outward +)"}  # fmt: skip
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.6))
    for label, runs in by_arm(results).items():
        for ax, measure in zip(axes, measures, strict=True):
            series = [_totals(r, measure) for r in runs]
            if all(values for _, values in series):
                per_seed = zip(*(values for _, values in series), strict=True)
                ax.plot(series[0][0], [mean(v) for v in per_seed], label=label)
    for ax, name in zip(axes, measures.values(), strict=True):
        ax.set_xlabel("iteration")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
    axes[2].axhline(0.0, color="black", lw=0.8)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.12, 1, 1))  # room for the legend below
    write_atomically(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)
    return True


def write_outputs(results: list[RunResult], out_dir: Path, name: str, title: str) -> list[Path]:
    """losses.csv, summary.csv, diagnostics.csv, times.csv, ``name``.png and
    ``name``_diagnostics.png of the finished runs; the files written. With no finished
    run, none: earlier ones are removed, as they describe runs that are gone."""
    written = [out_dir / f for f in _TABLES]
    if not results:
        for path in [*written, *_plots(out_dir, name)]:
            path.unlink(missing_ok=True)
        return []
    write_losses(results, written[0])
    write_summary(summarise(results), written[1])
    write_diagnostics(results, written[2])
    write_times(results, written[3])
    for draw, png in zip((plot, plot_diagnostics), _plots(out_dir, name), strict=True):
        if draw(results, png, title):
            written.append(png)
    return written


#: The CSVs every sweep writes.
_TABLES = ("losses.csv", "summary.csv", "diagnostics.csv", "times.csv")


def _plots(out_dir: Path, name: str) -> list[Path]:
    """The PNGs of the sweep ``name`` (``losses``: of one configuration's runs)."""
    return [out_dir / f"{name}.png", out_dir / f"{name}_diagnostics.png"]


#: The names a sweep's plots take (``losses``: those of one configuration's runs).
_PLOTTED = (*SWEEPS, "losses")


def _outputs(out_dir: Path) -> list[str]:
    """Every file a sweep may write in ``out_dir``: each is removed or written."""
    return [*_TABLES, *(png.name for other in _PLOTTED for png in _plots(out_dir, other))]


def _remove_other_plots(out_dir: Path, name: str) -> None:
    """The plots of sweeps other than ``name`` removed from ``out_dir``: they would show its runs."""
    for other in set(_PLOTTED) - {name}:
        for png in _plots(out_dir, other):
            png.unlink(missing_ok=True)


def _title(sweep: str | None, label: str) -> str:
    """A sweep's plots' title; without a sweep, of the runs of one configuration, ``label``."""
    return f"{sweep or label}: char GPT on Shakespeare"


def _table(path: Path) -> list[dict[str, str]]:
    """The rows of the table ``path`` that :func:`write_csv` wrote under its header
    (:data:`_HEADERS`); a missing file, another header or a row of other fields is a
    ValueError naming it."""
    try:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            # (read while the file is open: of an empty file, fieldnames reads it first, and
            # failed on the closed file with "I/O operation on closed file")
            header, rows = reader.fieldnames, list(reader)
    except OSError as err:
        raise ValueError(f"cannot read {path} ({err.strerror}): a sweep's folder holds "
                         f"{', '.join(_TABLES)}") from None  # fmt: skip
    # (UnicodeDecodeError, a ValueError, was reported without the file's name; csv.Error, a
    # field past csv's limit as an unclosed quote makes one, was a traceback)
    except (UnicodeDecodeError, csv.Error):
        header = rows = None
    if header != _HEADERS[path.name] or any(None in row or None in row.values() for row in rows):
        raise ValueError(f"{path} is not a sweep's table: its columns are not {_HEADERS[path.name]}")
    return rows


def _number(text: str) -> float | None:
    """A table's field: an empty one is None (a measure the row lacks)."""
    return None if text == "" else float(text)


def read_outputs(folder: Path) -> list[RunResult]:
    """The finished runs whose tables (losses.csv, times.csv, diagnostics.csv) a sweep
    wrote into ``folder``, each as that sweep had it: written again, the same bytes
    (times to a tenth of a second, as times.csv keeps them)."""
    runs: dict[tuple[str, int], RunResult] = {}
    timed: set[tuple[str, int]] = set()

    def evaluation(row: dict[str, str]) -> None:
        key = row["arm"], int(row["seed"])
        run = runs.setdefault(key, RunResult(*key, [], [], [], math.nan))
        if run.iters and int(row["iter"]) <= run.iters[-1]:  # (a run is evaluated at iterations that go up)
            raise ValueError(f"iteration {row['iter']} after {run.iters[-1]} of the same run")
        run.iters.append(int(row["iter"]))
        run.train.append(float(row["train_loss"]))
        run.val.append(float(row["val_loss"]))

    def timing(row: dict[str, str]) -> None:
        key = row["arm"], int(row["seed"])
        run = runs[key]
        if key in timed:  # (a row appended again: the last one won, and was written back alone)
            raise ValueError(f"a second time for the same run, after {run.seconds}")
        run.seconds = float(row["seconds"])
        timed.add(key)

    def diagnostic(row: dict[str, str]) -> None:
        measures = {k: _number(row[k]) for k in _DIAGNOSTICS[1:]}
        runs[row["arm"], int(row["seed"])].diagnostics.append(
            {"iter": int(row["iter"]), "param": row["param"], "numel": int(row["numel"]), **measures})

    for name, read in (("losses.csv", evaluation), ("times.csv", timing), ("diagnostics.csv", diagnostic)):
        path = folder / name
        for line, row in enumerate(_table(path), start=2):
            try:
                read(row)
            except KeyError:  # (the runs are losses.csv's)
                raise ValueError(f"{path}, line {line}: {row['arm']!r} seed {row['seed']} is not in "
                                 "losses.csv") from None  # fmt: skip
            except ValueError as err:
                raise ValueError(f"{path}, line {line}: not a sweep's row ({err})") from None
    if untimed := [key for key in runs if key not in timed]:  # (written again as "nan" seconds)
        label, seed = untimed[0]
        raise ValueError(f"{folder / 'times.csv'} lacks {label!r} seed {seed} of losses.csv: a damaged "
                         "times.csv")  # fmt: skip
    return list(runs.values())


def collect(
    sources: Sequence[Path], out_dir: Path, sweep: str | None = None
) -> tuple[list[RunResult], list[Path]]:
    """The runs whose tables the folders ``sources`` hold (sweeps run apart: seeds on other
    machines, or at other times), written into ``out_dir`` as one sweep's outputs, the
    same tables and plots as had the runs been trained there together; the runs (arm by
    arm in the sweep's order, each arm's in order of seed) and the files written. Each
    of these is a ValueError, raised before anything is written: a run (arm and seed) in
    two sources, an arm whose runs were evaluated at other iterations (runs of other
    configurations) or hold diagnostics at other iterations (a damaged table), an
    ``out_dir`` that is a source or holds runs (its tables would no longer be theirs)."""
    if sweep is not None and sweep not in SWEEPS:
        raise ValueError(f"unknown sweep {sweep!r}; choose from {sorted(SWEEPS)}")
    if not sources:
        raise ValueError("no folders to collect from")
    if any(out_dir.resolve() == source.resolve() for source in sources):
        raise ValueError(f"{out_dir} is one of the folders collected from, whose tables it would replace: "
                         "pass another --out")  # fmt: skip
    if out_dir.is_dir() and (held := [f.name for f in out_dir.iterdir() if f.is_dir() and _is_run(f)]):
        raise ValueError(f"{out_dir} holds runs ({', '.join(sorted(held)[:3])}, ...) whose tables these "
                         "would replace: pass another --out")  # fmt: skip
    found: dict[tuple[str, int], int] = {}  # each run's first source
    results, arms = [], []
    for i, source in enumerate(sources):
        runs = read_outputs(source)
        for run in runs:
            if (first := found.setdefault((run.label, run.seed), i)) != i:
                raise ValueError(f"{run.label!r} seed {run.seed} is in both {sources[first]} and {source}: "
                                 "it would count twice")  # fmt: skip
        results += runs
        # Each source's arms in its sweep's order, merged: a source that finished only some
        # arms (a lease cut short) puts none of them before the arms that come first.
        at = -1
        for label in dict.fromkeys(run.label for run in runs):
            if label in arms:
                at = arms.index(label)
            else:
                at += 1
                arms.insert(at, label)
    if not results:
        raise ValueError(f"no runs to collect: the tables of {', '.join(map(str, sources))} are empty")
    results.sort(key=lambda run: (arms.index(run.label), run.seed))
    for label, runs in by_arm(results).items():
        if other := [run.seed for run in runs if run.iters != runs[0].iters]:
            first = runs[0]
            raise ValueError(f"the runs of {label!r} were evaluated at other iterations (seed {first.seed}: "
                             f"{len(first.iters)} evaluations to {first.iters[-1]}; seed {other[0]}: "
                             "others): runs of other configurations")  # fmt: skip
        for measure in _DIAGNOSTICS[1:]:  # (their plot averages the seeds' rows at each iteration)
            when = [_totals(run, measure)[0] for run in runs]
            if all(when) and (odd := [r.seed for r, its in zip(runs, when, strict=True) if its != when[0]]):
                raise ValueError(f"the diagnostics of {label!r} seed {odd[0]} hold {measure} at other "
                                 f"iterations than seed {runs[0].seed}'s: a damaged "
                                 "diagnostics.csv")  # fmt: skip
    name = sweep or "losses"
    with hold(out_dir, _outputs(out_dir)):
        _remove_other_plots(out_dir, name)
        return results, write_outputs(results, out_dir, name, _title(sweep, arms[0]))


def run_sweep(
    sweep: str | None,
    configs: list[TrainConfig],
    data_file: Path,
    out_dir: Path,
    workers: int = 2,
    progress_bar: bool = True,
    restart: bool = False,
) -> SweepOutcome:
    """Run ``configs``, the runs of a named sweep (or, with None, of one configuration:
    :func:`arm_configs`), on the prepared dataset ``data_file``, continuing the runs
    ``out_dir`` holds (``restart``: from scratch); write the results into out_dir as runs
    finish and once more at the end."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    name, title = sweep or "losses", _title(sweep, configs[0].label)
    with hold(out_dir, _outputs(out_dir)):  # until the sweep ends: no other writes here meanwhile
        folders = claim_folders(configs, out_dir, restart, CharDataset.load(data_file).digest())
        finished = sum((f / RESULT).exists() for f in folders)
        if finished or _checkpointed(folders):
            print(f"fewbit: continuing in {out_dir}: {finished} of {len(configs)} runs finished, "
                  f"{_checkpointed(folders)} resume from their last evaluation (--restart starts over)",
                  file=sys.stderr)  # fmt: skip
        written: list[Path] = []

        def write(results: list[RunResult]) -> None:
            written[:] = write_outputs(results, out_dir, name, title)

        if not finished:  # outputs of runs discarded (--restart) or of another sweep: gone now
            write([])
        _remove_other_plots(out_dir, name)
        outcome = run_many(configs, folders, data_file, workers, progress_bar, on_finish=write)
        # A run may have written its result as a stop came, before its worker's message
        # was read: the finished runs are the results on disk.
        on_disk = [r for c, f in zip(configs, folders, strict=True) if (r := read_result(c, f)) is not None]
        if not written or len(on_disk) > len(outcome.results):  # (none ended in this call: written again)
            outcome.results = on_disk
            write(on_disk)
        outcome.written = written
        outcome.checkpointed = _checkpointed(folders)
        return outcome


def _checkpointed(folders: list[Path]) -> int:
    """How many unfinished runs have a checkpoint to continue from."""
    return sum((f / CHECKPOINT).exists() and not (f / RESULT).exists() for f in folders)
