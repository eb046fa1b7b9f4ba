"""fewbit's own host time down the GPU path, without a GPU: CPU tensors of 4096 float32
elements take the path a CUDA tensor takes (gpu.usable; the native kernel, which quantize
and block calls would ask first, out of the way), every kernel counted as compiled, and
every C launch does nothing. What is left is the Python that runs before each launch on
a GPU (Triton's C launch and the CUDA driver's call are not in it). The last row is the
first through the Python of Triton's launcher, which gpu.py passes by where it knows it:

    python benchmarks/bench_gpu_host.py [--calls 20000] [--profile "round RNE, out="]

Best of 5 loops after 500 calls, one thread. The stand-ins are for this measurement only: nothing here
launches a kernel, and the results in out are not rounded.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import types

import torch
import triton
from triton.runtime import driver

import fewbit
from bench_per_call import best_us  # (this folder: a script's own is on the path)
from fewbit.cli import int_in
from fewbit.rounding import gpu, native


class _Compiled:
    """A compiled kernel whose launcher is this Triton's CudaLauncher, its C launch doing
    nothing: the launcher's Python runs where gpu._launcher calls it."""

    function = packed_metadata = None

    def __init__(self) -> None:
        from triton.backends.nvidia.driver import CudaLauncher

        self.run = object.__new__(CudaLauncher)
        no_scratch = {"global_scratch_size": 0, "global_scratch_align": 1, "profile_scratch_size": 0,
                      "profile_scratch_align": 1, "gsan_enabled": False}  # fmt: skip
        vars(self.run).update(num_ctas=1, launch=lambda *args: None, launch_cooperative_grid=False,
                              launch_pdl=False, arg_annotations=(), kernel_signature=b"", **no_scratch)

    def __getitem__(self, grid):
        return lambda *args: None


class _EveryKernel(dict):
    """gpu._COMPILED as if every kernel had been compiled, launched with ``launch``."""

    def __init__(self, compiled: _Compiled, launch) -> None:
        super().__init__()
        self.known = compiled, launch, ()

    def get(self, key, default=None):
        return self.known


def _stand_in() -> tuple[_EveryKernel, _EveryKernel]:
    """The stand-ins; gpu._COMPILED as gpu.py launches, and through the launcher's own call."""
    enabled = gpu._enabled
    gpu._enabled = lambda t: enabled(t) or t.is_cpu  # a CPU tensor as if on a CUDA device
    native._enabled = lambda t: False  # nor the native kernel, which quantize and blocks ask first
    gpu._stream_of = lambda: (lambda device: 0)
    try:
        assert driver.active is not None
    except RuntimeError:  # no GPU here: Triton 3.8 on asks for the active driver at each launch
        driver.set_active(types.SimpleNamespace())
    compiled = _Compiled()
    passed_by, through = gpu._launcher(compiled), gpu.through_launcher(compiled)
    return _EveryKernel(compiled, passed_by), _EveryKernel(compiled, through)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int_in(1), default=20000)
    parser.add_argument("--profile", help="a row's name: its cProfile, by time in each function")
    args = parser.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    out = torch.empty_like(x)
    calls = {
        "round RNE, out=": lambda: fewbit.round(x, "binary8p4", out=out),
        "round RNE": lambda: fewbit.round(x, "binary8p4"),
        "round SRC N=3 seed=1, out=": lambda: fewbit.round(x, "binary8p4", "src", bits=3, seed=1, out=out),
        "quantize RNE": lambda: fewbit.quantize(x, "binary8p4"),
        "block.round mxfp8_e4m3, 8 rows of 512": lambda: fewbit.block.round(x.view(8, 512), "mxfp8_e4m3"),
    }
    if args.profile is not None and args.profile not in calls:  # (else a KeyError once every row is timed)
        parser.error(f"--profile: a row's name, one of {', '.join(map(repr, calls))}; got {args.profile!r}")
    mirrored, tritons = _stand_in()  # (after the checks: it patches fewbit for this process)
    gpu._COMPILED = mirrored
    for name, call in calls.items():
        print(f"{name:30} {best_us(call, lambda: None, args.calls, runs=5):6.2f} us")
    # The same call with Triton's launcher's Python, which gpu._launcher passes by.
    gpu._COMPILED = tritons
    slower = best_us(calls["round RNE, out="], lambda: None, args.calls, runs=5)
    gpu._COMPILED = mirrored
    print(f"{'round RNE, out=, Triton ' + triton.__version__ + ' launcher':30} {slower:6.2f} us")
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(lambda: [calls[args.profile]() for _ in range(args.calls)])
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
