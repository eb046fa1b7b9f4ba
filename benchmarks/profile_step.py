"""Where a training step's time goes, with and without the write-back: torch.profiler over
a few steps of a preset (``paper``: the GPU run of #19), the run with
``LowPrecisionWeights`` and the same run in float32, taking turns.

``fewbit train --time-steps`` says how much longer a step with the write-back takes; this
says what in it takes that long: per run, the ops and kernels by their own host time and
by their own device time, and the steps' wall time against the device's busy time (the
kernels' time summed), which says whether a step waits on the host or on the device.

    python benchmarks/profile_step.py [--preset paper] [--device cuda] [--steps 10] [--rows 25]
        [--data-dir DIR] [--data-tarball FILE] [--trace DIR]

``--trace DIR`` also writes each run's Chrome trace there (open in chrome://tracing or
Perfetto). Then, without torch.profiler (whose Python tracer inflates every call), the
write-back's own window in the same steps (bench_step_host.WriteBackWindow: from the end of
AdamW's step to the return of LowPrecisionWeights.step): its host time a step, and a
cProfile of that window alone, by each function's own time.
"""

from __future__ import annotations

import argparse
import cProfile
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench_step_host import WriteBackWindow  # (this folder: a script's own is on the path)
from fewbit.cli import device_option, int_in
from fewbit.experiments.data import load_shakespeare
from fewbit.experiments.train import PRESETS, Run, config_from


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="paper", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", type=device_option)
    ap.add_argument("--steps", type=int_in(1), default=10)
    ap.add_argument("--warmup", type=int_in(0), default=5, help="steps before profiling (compilation)")
    ap.add_argument("--rows", type=int_in(1), default=25)
    ap.add_argument("--data-dir", type=Path)
    ap.add_argument("--data-tarball", type=Path)
    ap.add_argument("--trace", type=Path)
    args = ap.parse_args()
    cfg = config_from(args.preset, device=args.device)
    data = load_shakespeare(args.data_dir, args.data_tarball)
    cuda = cfg.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    runs = {"write_back": Run(cfg, data), "fp32": Run(replace(cfg, mode="fp32"), data)}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(cfg.device)  # cuda:1, say: the device the steps run on

    for run in runs.values():
        for _ in range(args.warmup):
            run.train_step()
    sync()
    for name, run in runs.items():
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(args.steps):
                run.train_step()
            sync()
            wall = (time.perf_counter() - start) / args.steps
        events = prof.key_averages()
        label = cfg.label if name == "write_back" else "float32 weights"
        print(f"\n=== {label} on {cfg.device}, torch {torch.__version__}: {args.steps} steps profiled, "
              f"{wall * 1e3:.3f} ms a step (profiler on)")  # fmt: skip
        if cuda:
            kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
            busy = sum(e.self_device_time_total for e in kernels)
            print(f"device busy {busy / args.steps / 1e3:.3f} ms a step (kernels and copies summed)")
            print(events.table(sort_by="self_device_time_total", row_limit=args.rows))
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
        if args.trace:
            args.trace.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(args.trace / f"{name}.json"))
    window = WriteBackWindow(runs["write_back"].weights)
    for _ in range(args.steps * 5):
        runs["write_back"].train_step()
    times = sorted(window.times)
    median, tenth = statistics.median(times) * 1e6, times[len(times) // 10] * 1e6
    print(f"\n=== the write-back's window, {len(times)} steps without the profiler: host time a step "
          f"median {median:.1f} us, 10th percentile {tenth:.1f} us")
    window.profile = cProfile.Profile()
    for _ in range(args.steps * 5):
        runs["write_back"].train_step()
    sync()
    window.print_profile(rows=args.rows + 5)


if __name__ == "__main__":
    main()
