"""What LowPrecisionWeights' rounding costs inside a training step.

Times training steps of the char GPT (cpu-small preset, generated text) with plain
AdamW and with LowPrecisionWeights (binary8p4, SRC N=3, bfloat16 updates), and the
write-back alone, in the same run (``fewbit.experiments.train.time_steps``, which
``fewbit train --time-steps`` runs on the Shakespeare text). Prints each and the
write-back's share of the step.

    python benchmarks/bench_train.py [--preset cpu-small] [--steps 30] [--device cpu] [--threads 1] [--fast]
"""

from __future__ import annotations

import argparse

import torch

from fewbit.cli import device_option, int_in
from fewbit.experiments.data import CharDataset
from fewbit.experiments.train import PRESETS, SPEED_OPTIONS, config_from, time_steps


def sample_text(n: int = 200_000) -> str:
    g = torch.Generator().manual_seed(0)
    letters = "abcdefghijklmnopqrstuvwxyz ,.\n"
    return "".join(letters[i] for i in torch.randint(len(letters), (n,), generator=g).tolist())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu-small", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int_in(1), default=30)
    p.add_argument("--device", default="cpu", type=device_option)
    p.add_argument("--threads", type=int_in(1), help="torch threads (default: torch's)")
    p.add_argument("--fast", action=argparse.BooleanOptionalAction,
                   help="bf16 autocast, compiled model, fused AdamW (default: the preset's)")  # fmt: skip
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    fast = {} if args.fast is None else dict.fromkeys(SPEED_OPTIONS, args.fast)
    cfg = config_from(args.preset, device=args.device, mode="src", bits=3, update_dtype="bf16", **fast)
    t = time_steps(cfg, CharDataset.from_text(sample_text()), steps=args.steps)
    plain, lpw, alone = t["without"], t["with"], t["write_back"]
    print(f"preset {args.preset} on {args.device}, {torch.get_num_threads()} threads, "
          f"median of 5 x {args.steps} steps")  # fmt: skip
    print(f"step, plain AdamW              {plain * 1e3:8.2f} ms")
    print(f"step, LowPrecisionWeights      {lpw * 1e3:8.2f} ms  ({lpw / plain:.3f}x plain)")
    print(f"write-back alone (SRC N=3)     {alone * 1e3:8.2f} ms  ({alone / lpw:.1%} of the step)")


if __name__ == "__main__":
    main()
