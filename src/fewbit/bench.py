"""``fewbit bench``: rounding throughput as ratios to a copy of the same bytes, in one run.

Every row times one configuration on the same input (2^24 elements by default):
fewbit.round as users call it (the compiled kernel, bits generated inside it), an
SR fed by ``torch.randint`` bits (what one writes without fewbit.random), and gfloat
on key rows (its best of 3 calls). Melem/s is the best of ``repeat`` runs after a
warm-up, which also absorbs the first call's compilation.

Ratios are medians over ``repeat`` pairs, each the baseline and then the configuration,
back to back: on a shared machine whose speed drifts by tens of percent, both sides of
a pair see the same conditions. ``x copy`` is the yardstick of a memory-bound op:
``fewbit.round(x, ..., out=y)`` against ``y.copy_(x)``, both into a preallocated
output. ``x clone`` compares a call that returns a new tensor with ``torch.clone``,
where both also pay for fresh memory. ``GB/s`` counts the bytes each call reads and
writes as whole tensors (round then encode: x, the rounded values twice and the codes;
NVFP4 reads x twice), not what a cache spares; the ``copy_`` row of each dtype gives the
device's copy speed measured in the same run (on a GPU, its achievable memory
bandwidth). On a GPU ``device`` gives ``x copy`` in device time (:func:`device_ratio`):
the pairs wait for the device after each call, so their ratio counts a call's host time,
which a training step hides. The last rows give the time of one call on 4096 elements,
where the per-call overhead is all there is.
Codes rows (encode, quantize) return new codes, a byte an element: ``x copy`` then
compares a call that allocates a quarter of float32's bytes with ``copy_``.

Each row goes to ``run``'s ``on_row`` as soon as it is measured (``fewbit bench`` prints
it then). On a GPU every timed row but ``copy_`` and the per-call rows has
``matches_cpu`` (:func:`matches_cpu`): whether the result of the row's own call is bit
for bit the CPU's for the same call on the same input, NaN payloads included, on the
first 2^16 elements (all of them for NVFP4, whose per-tensor scale depends on every
element). A fast kernel that writes wrong values would otherwise be timed as any other.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .codec import encode, quantize
from .config import configure
from .formats import format
from .rounding import dtype_format, natural_sr_bits
from .rounding import round as fewbit_round

if TYPE_CHECKING:
    from .block import BlockTensor

#: The gfloat releases whose API the comparison calls (the tests pin one of them).
GFLOAT_SERIES = "0.5"


def check_gfloat() -> None:
    """Raise ValueError, saying how to get it, where the comparison with gfloat (a test
    dependency, not one of the library's) cannot run here."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("gfloat") is None:
        why = "which is not installed"
    else:
        try:
            found = importlib.metadata.version("gfloat")
        except importlib.metadata.PackageNotFoundError:  # a copy on the path, not installed: trusted
            return
        if found.split(".")[:2] == GFLOAT_SERIES.split("."):
            return
        why = f"and {found} is installed"  # (0.4's format_info_p3109 takes one argument)
    raise ValueError(f"the bench compares with gfloat {GFLOAT_SERIES}, {why}: pip install "
                     f"'gfloat=={GFLOAT_SERIES}.*', or leave it out (--no-gfloat)")


TARGETS = ["binary8p4", "ocp_e4m3", "ocp_e5m2", "ocp_e2m1", "bfloat16"]
SR_MODES = ["srff", "srf", "src"]
BITS = [2, 3, 4, 8]
WARMUP = 3


def best_time(fn: Callable[[], object], repeat: int, sync: Callable[[], None] = lambda: None) -> float:
    """Best wall time of ``repeat`` calls after one warm-up call."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def paired(fn: Callable[[], object], baseline: Callable[[], object], repeat: int,
           sync: Callable[[], None] = lambda: None) -> tuple[float, float]:
    """``fn``'s best time, and the median of ``baseline`` time / ``fn`` time over
    ``repeat`` back-to-back pairs, after warm-up calls: the first calls of a process
    (beyond compiling) fault in memory that later calls reuse."""
    for _ in range(WARMUP):
        fn()
        baseline()
    sync()
    times, ratios = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        baseline()
        sync()
        middle = time.perf_counter()
        fn()
        sync()
        end = time.perf_counter()
        times.append(end - middle)
        ratios.append((middle - start) / (end - middle))
    return min(times), statistics.median(ratios)


#: Calls queued back to back for a device-time ratio on a GPU.
BACK_TO_BACK = 10


def device_ratio(fn: Callable[[], object], baseline: Callable[[], object], repeat: int) -> float:
    """On a GPU: the median over ``repeat`` rounds of ``baseline``'s device time over
    ``fn``'s, each timed by CUDA events around ``BACK_TO_BACK`` calls queued back to
    back on the current device's current stream (:func:`run` makes the device timed the
    current one). Where the device is the slower (large tensors), a call's host time hides
    behind the calls queued before it: what a training step, which queues without
    waiting, pays. ``paired`` waits after every call, so it counts the host's time too."""
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(2)]
    ratios = []
    for _ in range(repeat):
        for f, (start, end) in zip((baseline, fn), events, strict=True):
            start.record()
            for _ in range(BACK_TO_BACK):
                f()
            end.record()
        torch.cuda.synchronize()  # the current device: run's, where the calls run
        (b0, b1), (f0, f1) = events
        ratios.append(b0.elapsed_time(b1) / f0.elapsed_time(f1))
    return statistics.median(ratios)


def _gfloat_round(x: torch.Tensor, fmt: str, mode: str, bits: int | None):
    import gfloat  # a test dependency, imported only when asked for
    from gfloat.formats import format_info_ocp_e4m3, format_info_p3109

    info = format_info_p3109(8, 4) if fmt == "binary8p4" else format_info_ocp_e4m3
    modes = {"rne": gfloat.RoundMode.TiesToEven, "src": gfloat.RoundMode.Stochastic,
             "srf": gfloat.RoundMode.StochasticFast, "srff": gfloat.RoundMode.StochasticFastest}
    xn = x.float().numpy()
    if bits is None:
        return lambda: gfloat.round_ndarray(info, xn, modes[mode])
    rb = torch.randint(0, 2**bits, x.shape, dtype=torch.int32).numpy()
    return lambda: gfloat.round_ndarray(info, xn, modes[mode], srbits=rb, srnumbits=bits)


def run(
    log2_size: int = 24,
    device: str = "cpu",
    repeat: int = 9,
    quick: bool = False,
    with_gfloat: bool = True,
    progress: Callable[[str], None] | None = None,
    block: bool = False,
    on_row: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Measure every configuration; one dict per row (Melem/s and ratios), each also given
    to ``on_row`` as soon as it is measured (a run cut short has shown what it measured).
    ``block`` adds the block-format rows (:func:`block_rows`). On a GPU the whole run has
    ``device`` as the current device: the waits, and :func:`device_ratio`'s events (recorded
    on the current stream), are then those of ``device`` (cuda:1, say), where the calls run."""
    if with_gfloat and torch.device(device).type == "cpu":
        check_gfloat()  # (before a row is timed)
    rows = []

    def measure(sync: Callable[[], None]) -> list[dict]:
        for row in _run(log2_size, device, repeat, quick, with_gfloat, progress, block, sync):
            rows.append(row)
            if on_row:
                on_row(row)
        return rows

    if torch.device(device).type != "cuda":
        return measure(lambda: None)
    with torch.cuda.device(device):
        return measure(functools.partial(torch.cuda.synchronize, device))


def _run(log2_size: int, device: str, repeat: int, quick: bool, with_gfloat: bool,
         progress: Callable[[str], None] | None, block: bool, sync: Callable[[], None]) -> Iterator[dict]:
    n = 1 << log2_size
    on_cpu = torch.device(device).type == "cpu"  # "cpu:0" too
    on_gpu = torch.device(device).type == "cuda"
    gen = torch.Generator(device=device).manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = (torch.randn(n, generator=gen, device=device) * 8).to(dtype)
        out = torch.empty_like(x)

        def clone():
            return x.clone()

        def copy():
            return out.copy_(x)

        t = best_time(copy, repeat, sync)  # the device's copy speed: the GB/s column's yardstick
        yield {"input": str(dtype), "format": "memory", "mode": "copy_", "bits": None,
               "melem_per_s": n / t / 1e6, "gb_per_s": 2 * x.nbytes / t / 1e9}
        targets = TARGETS[:1] if quick else TARGETS
        for fmt in targets:
            if fmt == "bfloat16" and dtype != torch.float32:  # bfloat16 itself; float16 cannot hold it
                continue
            configs = [("rne", None)]
            for mode in (["src"] if quick else SR_MODES):
                configs += [(mode, b) for b in ([3] if quick else BITS)]
            configs.append(("sr", None))
            for mode, bits in configs:
                row = {"input": str(dtype), "format": fmt, "mode": mode, "bits": bits}
                if progress:
                    progress(label(row))
                kw = {"bits": bits, "sat": fmt == "ocp_e2m1", **({"seed": 1} if mode != "rne" else {})}

                def call(v, into=None):
                    return fewbit_round(v, fmt, mode, out=into, **kw)

                call_out = functools.partial(call, x, out)
                t, x_copy = paired(call_out, copy, repeat, sync)
                row |= {"melem_per_s": n / t / 1e6, "gb_per_s": 2 * x.nbytes / t / 1e9, "x_copy": x_copy,
                        "x_clone": paired(functools.partial(call, x), clone, repeat, sync)[1]}
                if on_gpu:
                    row["device_x_copy"] = device_ratio(call_out, copy, repeat)
                    row["matches_cpu"] = matches_cpu(call, x, out)  # before the calls below write out
                if mode != "rne":
                    width = bits or natural_sr_bits(dtype_format(dtype), format(fmt))

                    def randint_fed():
                        rb = torch.randint(0, 2**width, x.shape, dtype=torch.int32, device=device)
                        return fewbit_round(x, fmt, mode, random_bits=rb, out=out,
                                            **{k: v for k, v in kw.items() if k != "seed"})

                    row["randint_fed_x_copy"] = paired(randint_fed, copy, repeat, sync)[1]
                if dtype == torch.float32 and fmt == "binary8p4" and (mode == "rne" or bits == 3):
                    with configure(compile=False):
                        row["eager_x_copy"] = paired(call_out, copy, repeat, sync)[1]
                    if with_gfloat and on_cpu and mode in ("rne", "src", "srf", "srff"):
                        row["x_gfloat"] = best_time(_gfloat_round(x, fmt, mode, bits), 3) / t
                yield row
        rounded = fewbit_round(x, "binary8p4", sat=True)
        src = {"bits": 3, "seed": 1}

        def round_then_encode(v, into=None):
            return encode(fewbit_round(v, "binary8p4", "src", out=into, **src), "binary8p4", check=False)

        # Calls returning new codes, a byte an element, each of its source: encode of the
        # rounded values (on a GPU also without the check, which reads a flag back and so
        # waits for the kernel), and the codes of SRC N=3 roundings of x, by fewbit.quantize
        # in one call and by round then encode (the rounded values into out).
        codes_calls = [("encode to uint8", None, rounded, lambda v: encode(v, "binary8p4"), None)]
        if on_gpu:
            codes_calls.append(("encode to uint8, unchecked", None, rounded,
                                lambda v: encode(v, "binary8p4", check=False), None))  # fmt: skip
        codes_calls += [("quantize src", 3, x, lambda v: quantize(v, "binary8p4", "src", **src), None),
                        ("round+encode src", 3, x, round_then_encode, out)]  # fmt: skip
        for mode, bits, source, call, into in codes_calls:
            row = {"input": str(dtype), "format": "binary8p4", "mode": mode, "bits": bits}
            if progress:
                progress(label(row))
            fn = functools.partial(call, source) if into is None else functools.partial(call, source, into)
            # The bytes each call moves: x (or the rounded values) read and the codes written;
            # round then encode also writes the rounded values and reads them back.
            moved = (3 if mode == "round+encode src" else 1) * x.nbytes + n
            t, x_copy = paired(fn, copy, repeat, sync)
            row |= {"melem_per_s": n / t / 1e6, "gb_per_s": moved / t / 1e9, "x_copy": x_copy,
                    "x_clone": paired(fn, clone, repeat, sync)[1]}  # fmt: skip
            if on_gpu:
                row["device_x_copy"] = device_ratio(fn, copy, repeat)
                row["matches_cpu"] = matches_cpu(call, source, fn())
            yield row
    if block:
        yield from block_rows(log2_size, device, repeat, sync, progress)
    yield from _per_call(device, sync)


BLOCK_FORMATS = ["mxfp8_e4m3", "mxfp4", "nvfp4"]
#: The block rows' inputs are rows of 2^this elements.
BLOCK_LOG2_ROW = 12


def block_rows(log2_size: int, device: str, repeat: int, sync: Callable[[], None],
               progress: Callable[[str], None] | None = None) -> Iterator[dict]:
    """``fewbit.block.quantize`` (to codes) and ``fewbit.block.round`` (quantise-dequantise)
    on float32 and bfloat16 rows of 4096, blocks along them, RNE and SRC N=3: ``x copy``
    into preallocated outputs (``out=``) against ``copy_`` of the input, ``x clone``
    returning new tensors against ``clone``, as the element rows."""
    from . import block

    if log2_size < BLOCK_LOG2_ROW:  # not rounded up: the element rows and these share one size
        raise ValueError(f"block rows are rows of {1 << BLOCK_LOG2_ROW} elements: log2_size {log2_size} "
                         f"is below {BLOCK_LOG2_ROW}")  # fmt: skip
    n, length = 1 << log2_size, 1 << BLOCK_LOG2_ROW
    gen = torch.Generator(device=device).manual_seed(0)
    x32 = torch.randn(n // length, length, generator=gen, device=device)
    for x in (x32, x32.to(torch.bfloat16)):
        out = torch.empty_like(x)
        for name in BLOCK_FORMATS:
            stored = block.quantize(x, name)
            calls = (("quantize", block.quantize, stored), ("round", block.round, out))
            for (mode, bits), (what, fn, into) in itertools.product((("rne", None), ("src", 3)), calls):
                row = {"input": str(x.dtype), "format": f"{name} {what}", "mode": mode, "bits": bits}
                if progress:
                    progress(label(row))
                kw = {"bits": bits, **({"seed": 1} if bits else {})}

                def call(v, into=None, fn=fn, name=name, mode=mode, kw=kw):
                    return fn(v, name, mode, out=into, **kw)

                copy = functools.partial(out.copy_, x)
                t, x_copy = paired(functools.partial(call, x, into), copy, repeat, sync)
                # x read (twice for NVFP4: its per-tensor amax first), the result written (a
                # stored tensor's nbytes: its codes and scales)
                moved = (2 if name == "nvfp4" else 1) * x.nbytes + into.nbytes
                row |= {"melem_per_s": n / t / 1e6, "gb_per_s": moved / t / 1e9, "x_copy": x_copy,
                        "x_clone": paired(functools.partial(call, x), x.clone, repeat, sync)[1]}
                if torch.device(device).type == "cuda":
                    row["device_x_copy"] = device_ratio(functools.partial(call, x, into), copy, repeat)
                    # into holds the last call's result: the timed calls end with this row's own
                    row["matches_cpu"] = matches_cpu(call, x, into, whole=block.format(name).tensor_scale)
                yield row


#: Where Linux describes CPU 0's caches, one folder per cache.
CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def last_level_cache_bytes(caches: Path = CACHES) -> int | None:
    """The size of the CPU's last-level data cache, from Linux's sysfs; None where it
    cannot be read (another system, or a VM that hides it)."""
    found: tuple[int, int] | None = None
    for index in caches.glob("index*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level, size = int((index / "level").read_text()), (index / "size").read_text().strip()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
            size_bytes = int(size.rstrip("KMG")) * scale
        except (OSError, ValueError):
            continue
        if found is None or level > found[0]:
            found = (level, size_bytes)
    return None if found is None else found[1]


def cache_note(log2_size: int, cache_bytes: int | None) -> str | None:
    """A warning where a float32 input of 2^log2_size elements and its output fit in the
    last-level cache together: ``copy_`` timed after fewbit's non-temporal stores then
    runs from memory, and alone from the cache, so the ratios measure the cache's state."""
    moved = 8 << log2_size
    if cache_bytes is None or moved > cache_bytes:
        return None
    beyond = log2_size
    while 8 << beyond <= cache_bytes:
        beyond += 1
    return (f"fewbit bench: 2^{log2_size} float32 elements and their output ({moved / 1e6:.3g} MB) fit in "
            f"this CPU's last-level cache ({cache_bytes / 1e6:.3g} MB): the ratios to copy_ depend on what "
            f"the cache holds; --log2-size {beyond} goes beyond it")


def bytes_held(log2_size: int, with_gfloat: bool, quick: bool = False) -> int:
    """At least the most memory :func:`run` holds at once on 2^log2_size elements, with a
    fifth to spare: measured as ``fewbit bench``'s peak resident memory on a CPU at 2^22
    elements (2^21 with gfloat), less that at 2^10, per element: ``--quick`` 27.5 bytes,
    32 with ``--block``; the full run 37-40 (the hunt's three runs and this one), 38 with
    ``--block``; gfloat's rows (its numpy temporaries) 130-131, quick or full, with or
    without ``--block``."""
    per_element = 160 if with_gfloat else 40 if quick else 48
    return per_element << log2_size


def memory_bytes(device: torch.device) -> int:
    """The memory of ``device``: a GPU's own, else the machine's."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


#: Elements of the per-call rows: small enough that the call's overhead is all there is.
PER_CALL_NUMEL = 4096


def _per_call(device: str, sync: Callable[[], None]) -> Iterator[dict]:
    """Microseconds per call on ``PER_CALL_NUMEL`` float32 elements (best of 5 runs of
    200 calls), for ``copy_`` and for RNE and SRC N=3 into a preallocated output."""
    x = torch.randn(PER_CALL_NUMEL, device=device)
    out = torch.empty_like(x)
    calls = {"copy_": lambda: out.copy_(x),
             "rne": lambda: fewbit_round(x, "binary8p4", out=out),
             "src": lambda: fewbit_round(x, "binary8p4", "src", bits=3, seed=1, out=out)}  # fmt: skip
    for mode, fn in calls.items():
        for _ in range(20):
            fn()
        t = best_time(lambda: [fn() for _ in range(200)], 5, sync) / 200
        yield {"input": "torch.float32", "format": f"{PER_CALL_NUMEL} elements", "mode": mode,
               "bits": 3 if mode == "src" else None, "us_per_call": t * 1e6}


#: Elements of the input whose results a GPU row compares with the CPU's: a prefix, as
#: cheap at 2^27 elements as at 2^16, where each element's result depends on it alone.
CHECKED_NUMEL = 1 << 16


def _raw_bytes(result: torch.Tensor | BlockTensor, rows: int) -> list[torch.Tensor]:
    """The first ``rows`` of a result (a BlockTensor's codes and scales, and its tensor
    scale) as bytes on the CPU: a NaN compares by its payload."""
    parts = [result[:rows]] if isinstance(result, torch.Tensor) else [
        result.codes[:rows], result.scales[:rows], result.tensor_scale]  # fmt: skip
    return [p.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for p in parts if p is not None]


def matches_cpu(call: Callable[[torch.Tensor], torch.Tensor | BlockTensor], x: torch.Tensor,
                result: torch.Tensor | BlockTensor, whole: bool = False) -> bool:
    """Whether ``result``, a device's ``call(x)``, is bit for bit what ``call`` gives on the
    CPU: on the first ``CHECKED_NUMEL`` elements of x (whole rows of a 2-D x), or on all of
    x where ``whole`` (a per-tensor scale, NVFP4's, depends on every element)."""
    rows = len(x) if whole else max(1, CHECKED_NUMEL // max(1, x[0].numel()))
    got, expected = _raw_bytes(result, rows), _raw_bytes(call(x[:rows].cpu()), rows)
    return len(got) == len(expected) and all(map(torch.equal, got, expected))


def label(row: dict) -> str:
    """A row's name, as the table and the progress line give it."""
    name = f"{row['input'].removeprefix('torch.')} -> {row['format']} {row['mode']}"
    return name + (f" N={row['bits']}" if row["bits"] else "")


#: The table's label column: the longest label (a GPU's "bfloat16 -> binary8p4 encode to
#: uint8, unchecked") fits.
LABEL_WIDTH = 48
#: The mark of a GPU row whose result is not the CPU's.
DIFFERS = "DIFFERS FROM THE CPU"


def table_header() -> str:
    return (f"{'configuration':{LABEL_WIDTH}} {'Melem/s':>9} {'GB/s':>7} {'x copy':>7} {'x clone':>8} "
            f"{'eager':>7} {'randint-fed':>11} {'x gfloat':>9} {'device':>7}\n"
            "(ratios: copy_ or clone time / fewbit time, into a preallocated output or a new one;"
            " GB/s: bytes of the tensors read and written;\n"
            " device: x copy in device time, calls queued back to back)")


def table_line(row: dict) -> str:
    """A row of the table, marked where a GPU's result differs from the CPU's."""
    name = f"{label(row):{LABEL_WIDTH}}"
    if "us_per_call" in row:
        return f"{name} {row['us_per_call']:>9.1f} us per call"

    def col(key, width, fmt=".3f"):
        return f"{row[key]:>{width}{fmt}}" if key in row else " " * width

    line = (f"{name} {row['melem_per_s']:>9.1f} {row['gb_per_s']:>7.1f} {col('x_copy', 7)} "
            f"{col('x_clone', 8)} {col('eager_x_copy', 7)} {col('randint_fed_x_copy', 11)} "
            f"{col('x_gfloat', 9, '.0f')} {col('device_x_copy', 7)}")
    return line + (f" {DIFFERS}" if row.get("matches_cpu") is False else "")


def format_table(rows: list[dict]) -> str:
    return "\n".join([table_header(), *map(table_line, rows)])


def to_json(rows: list[dict]) -> str:
    return json.dumps(rows, indent=1)
