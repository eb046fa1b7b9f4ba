"""The host time LowPrecisionWeights adds after its inner optimizer's step, down the GPU
path, without a GPU: the write-back of ``fewbit train --preset paper`` (26 matrices in
binary8p4, SRC N = 3, seed 1, bfloat16 updates, AdamW over two groups as train.py's Run
builds it), timed from the end of AdamW's step (a step post-hook, as train.time_steps
stamps it) to the return of ``LowPrecisionWeights.step``. The CPU tensors take the path
CUDA tensors take, with bench_gpu_host.py's stand-ins: every kernel counted as compiled,
every launch doing nothing (nothing is rounded). What is left is fewbit's Python around
the one launch of round_foreach_; not in it: the launch itself, and the pin_memory() of
the launch's table (a CUDA tensor's alone; a call into the CUDA host allocator).

The model is the paper's 6 layers at a width of 16 (block_size 16): the same 26 matrices,
every size a multiple of 16 as the one-launch kernel asks, small enough that the inner
step (AdamW on the CPU here, one fused launch on a GPU) leaves the caches to the Python
timed: that Python does not depend on the sizes.

    python benchmarks/bench_step_host.py [--steps 2000] [--runs 7] [--profile]

Microseconds a step, one thread: the median and the 10th percentile of every step timed
(``runs`` loops of ``steps`` steps), and the best loop's mean; then ``_write_back`` alone,
called back to back (the best of ``runs`` loops), the steadiest on a shared machine; and
all the wrapper adds to a step, zero_grad and step with the inner optimizer's calls
stubbed, back to back. A step's write-back runs after the inner step has had the caches,
about 3x slower than back to back (130-200 us against 52 on a 2-core VM, 2026-11-29 at
1fa7ea7; 114-118 against 42-44 with the step key in the kernel and the trims after it; of
that, about 15 us is glibc's malloc tidying the small blocks the inner step freed, paid by
the first request over about 1 KB, which is the launch's table here). ``--profile``:
cProfile of the same window (from the post-hook to the step's return), ``--sort`` its
order.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import statistics
import time
import timeit

import torch

from bench_gpu_host import _stand_in  # (this folder: a script's own is on the path)
from fewbit.cli import int_in
from fewbit.experiments.gpt import GPT, GPTConfig
from fewbit.optim import LowPrecisionWeights
from fewbit.rounding import gpu

VOCAB = 65  # Shakespeare's characters


class WriteBackWindow:
    """The host time of each step of ``weights`` from the end of its inner optimizer's step
    (a step post-hook) to the return of ``LowPrecisionWeights.step``, in ``times``; a
    cProfile set as ``profile`` records that window alone."""

    def __init__(self, weights: LowPrecisionWeights) -> None:
        self.times: list[float] = []
        self.profile: cProfile.Profile | None = None
        self._start = 0.0
        weights.optimizer.register_step_post_hook(self._started)
        step = weights.step

        def stamped(*args, **kwargs):
            loss = step(*args, **kwargs)
            if self.profile is not None:
                self.profile.disable()
            self.times.append(time.perf_counter() - self._start)
            return loss

        weights.step = stamped  # this object's alone: a timing harness

    def _started(self, *_) -> None:
        if self.profile is not None:
            self.profile.enable()
        self._start = time.perf_counter()

    def print_profile(self, sort: str = "tottime", rows: int = 40) -> None:
        pstats.Stats(self.profile).sort_stats(sort).print_stats(rows)


def build() -> tuple[LowPrecisionWeights, WriteBackWindow]:
    """The paper preset's wrapper at a width of 16, every selected weight with a
    gradient, and its write-back's window."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(VOCAB, 16, 6, 2, 16, 0.2))
    matrices = [(n, p) for n, p in model.named_parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": [p for _, p in matrices], "weight_decay": 0.1},
                             {"params": others, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.99))
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    weights = LowPrecisionWeights(opt, "binary8p4", "src", bits=3, seed=1, params=matrices,
                                  update_dtype=torch.bfloat16)  # fmt: skip
    assert len(weights.params) == 26, len(weights.params)
    return weights, WriteBackWindow(weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int_in(1), default=2000)
    parser.add_argument("--runs", type=int_in(1), default=7)
    parser.add_argument("--profile", action="store_true", help="then a cProfile of the same window")
    parser.add_argument("--sort", default="tottime", choices=sorted(pstats.Stats.sort_arg_dict_default),
                        help="the profile's order (pstats's keys)")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    gpu._COMPILED = _stand_in()[0]
    weights, window = build()
    for _ in range(50):
        weights.step()
    loops = []
    for _ in range(args.runs):
        window.times.clear()
        for _ in range(args.steps):
            weights.step()
        loops.append(list(window.times))
    steps = sorted(t for loop in loops for t in loop)
    print(f"after the inner step, us a step: median {steps[len(steps) // 2] * 1e6:.1f}, "
          f"10th percentile {steps[len(steps) // 10] * 1e6:.1f}, "
          f"best loop's mean {min(map(statistics.fmean, loops)) * 1e6:.1f}")  # fmt: skip
    # The same write-back called back to back, the caches its own: steadier, and what
    # bench_write_back.py's host column times on a GPU.
    write_back = functools.partial(weights._write_back, initial=False)
    alone = min(timeit.repeat(write_back, number=args.steps, repeat=args.runs))
    print(f"the write-back alone, back to back: {alone / args.steps * 1e6:.1f} us")
    if args.profile:
        window.profile = cProfile.Profile()
        for _ in range(args.steps):
            weights.step()
        window.print_profile(args.sort)
    # All that the wrapper adds to a step (its checks before the inner step, zero_grad's
    # and step's materialize, the write-back), the inner optimizer's own calls stubbed.
    weights.optimizer.step = lambda closure=None: None
    weights.optimizer.zero_grad = lambda set_to_none=True: None
    weights._stepping = True  # (as inside step: the stub is no step taken alone)

    def wrapped() -> None:
        weights.zero_grad()
        weights.step()

    whole = min(timeit.repeat(wrapped, number=args.steps, repeat=args.runs))
    print(f"the wrapper's zero_grad and step, the inner optimizer's stubbed, back to back: "
          f"{whole / args.steps * 1e6:.1f} us")


if __name__ == "__main__":
    main()
