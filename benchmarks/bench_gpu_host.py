"""fewbit's own host time down the GPU path, without a GPU: CPU tensors of 4096 float32
elements take the path a CUDA tensor takes (gpu.usable; the native kernel, which quantize
and block calls would ask first, out of the way), every kernel counted as compiled, and
every launch does nothing. What is left is the Python that runs before
each launch on a GPU (Triton's C launcher and the CUDA driver's call are not in it):

    python benchmarks/bench_gpu_host.py [--calls 20000] [--profile "round RNE, out="]

Best of 5 loops after 500 calls, one thread. The stand-ins are for this measurement only: nothing here
launches a kernel, and the results in out are not rounded.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch

import fewbit
from bench_per_call import best_us  # (this folder: a script's own is on the path)
from fewbit.rounding import gpu, native


class _Launched:
    """A compiled kernel that does nothing when launched, as either launch path asks."""

    function = packed_metadata = None

    def __getitem__(self, grid):
        return lambda *args: None

    def run(self, *args) -> None:
        return None


class _EveryKernel(dict):
    """gpu._COMPILED as if every kernel had been compiled."""

    def get(self, key, default=None):
        return _Launched(), ()


def _stand_in() -> None:
    enabled = gpu._enabled
    gpu._enabled = lambda t: enabled(t) or t.is_cpu  # a CPU tensor as if on a CUDA device
    native._enabled = lambda t: False  # nor the native kernel, which quantize and blocks ask first
    gpu._COMPILED = _EveryKernel()
    gpu._stream_of = lambda: (lambda device: 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--profile", help="a row's name: its cProfile, by time in each function")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _stand_in()
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    out = torch.empty_like(x)
    calls = {
        "round RNE, out=": lambda: fewbit.round(x, "binary8p4", out=out),
        "round RNE": lambda: fewbit.round(x, "binary8p4"),
        "round SRC N=3 seed=1, out=": lambda: fewbit.round(x, "binary8p4", "src", bits=3, seed=1, out=out),
        "quantize RNE": lambda: fewbit.quantize(x, "binary8p4"),
        "block.round mxfp8_e4m3, 8 rows of 512": lambda: fewbit.block.round(x.view(8, 512), "mxfp8_e4m3"),
    }
    for name, call in calls.items():
        print(f"{name:30} {best_us(call, lambda: None, args.calls, runs=5):6.2f} us")
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(lambda: [calls[args.profile]() for _ in range(args.calls)])
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
