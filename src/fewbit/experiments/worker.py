"""A sweep's worker: a process that trains the runs its parent sends, one after another.

``python -m fewbit.experiments.worker DATASET PARENT_PID``, started by
:mod:`fewbit.experiments.sweep`. Each line on stdin is one run,
``{"task": i, "dir": RUN_DIR, "config": {...}}``; the worker answers on stdout with one
JSON line when it starts the run (``{"task": i, "it": ...}``), one per evaluation, sent
once that evaluation's checkpoint is on disk (``{"task": i, "it": ..., "val": ...}``),
and ``{"task": i, "done": true}`` once ``result.json`` is. A run whose folder holds a
checkpoint continues from it, bit for bit.

The parent starts each worker as the leader of a process group of its own, so that a
Ctrl-C at the terminal reaches the parent alone, and the parent stops a worker by
signalling its group (compiler subprocesses included); should the parent die without
doing so (kill -9), the worker ends its group (:mod:`.processes`).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .data import CharDataset, write_atomically
from .processes import end_with_parent
from .train import Run, TrainConfig

CHECKPOINT = "checkpoint.pt"
RESULT = "result.json"


def send(**message) -> None:
    print(json.dumps(message), flush=True)


def train_run(task: dict, data: CharDataset) -> None:
    """Train one run to its end, from its checkpoint if it has one."""
    folder = Path(task["dir"])
    for stale in folder.glob(".*.tmp"):  # left by a worker killed while writing
        stale.unlink()
    start = time.perf_counter()
    run = Run(TrainConfig(**task["config"]), data)
    checkpoint = folder / CHECKPOINT
    earlier = 0.0  # seconds spent on this run by interrupted workers
    if checkpoint.exists():
        saved = torch.load(checkpoint)
        run.load_state_dict(saved["run"])
        earlier = saved["seconds"]

    def seconds() -> float:
        return earlier + time.perf_counter() - start

    def on_eval(r: Run) -> None:
        state = {"run": r.state_dict(), "seconds": seconds()}
        write_atomically(checkpoint, lambda f: torch.save(state, f))
        send(task=task["task"], it=r.it, val=r.history.val[-1])

    send(task=task["task"], it=run.it)
    run.run(on_eval=on_eval)
    result = {**asdict(run.history), "seconds": seconds()}
    write_atomically(folder / RESULT, lambda f: f.write(json.dumps(result).encode()))
    send(task=task["task"], done=True)


def main(argv: list[str]) -> None:
    data_file, parent = argv
    end_with_parent(int(parent))
    torch.set_num_threads(1)  # small models train faster side by side than sharing threads
    data = CharDataset.load(Path(data_file))
    for line in sys.stdin:  # until the parent closes stdin: no more runs
        train_run(json.loads(line), data)


if __name__ == "__main__":
    main(sys.argv[1:])
