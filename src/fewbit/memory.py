"""Output buffers for large CPU results, on transparent huge pages where Linux offers them.

A fresh CPU tensor of tens of MiB costs more in first-touch page faults than the
arithmetic that fills it. glibc maps each such block anew, in 4 KiB pages, and every
page faults on its first write. On the 2-core development VM, ``torch.clone`` of 64 MiB
takes 27 ms, and the same copy into an output on huge pages 7 ms. numpy asks for huge
pages for its large arrays; torch does only with ``THP_MEM_ALLOC_ENABLE=1``, which
changes every allocation of the process. fewbit asks for its own outputs only; set
``FEWBIT_HUGE_PAGES=0`` to leave them on torch's pages (where a fragmented machine
would stall on compaction to find huge pages).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
from pathlib import Path

import torch

__all__ = ["converted", "empty_output"]

#: A huge page on x86-64 and on arm64 with 4 KiB base pages.
HUGE_PAGE = 2 << 20
#: Smaller outputs may hold no whole aligned huge page; they keep torch's allocation as is.
MIN_BYTES = 2 * HUGE_PAGE


@functools.cache
def _madvise():
    """libc's ``madvise``, or None where huge pages cannot be asked for."""
    if sys.platform != "linux" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        setting = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    if "[never]" in setting:
        return None
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


def empty_output(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.empty_like(like, dtype=dtype)``, contiguous; a CPU one of 4 MiB or more
    with the whole huge pages inside it advised as such (before anything touches them,
    so the kernel backs them with huge pages on first write). The advice only changes
    how the memory is backed: where it fails, nothing else changes."""
    out = torch.empty_like(like, dtype=dtype, memory_format=torch.contiguous_format)
    madvise = _madvise()
    wanted = os.environ.get("FEWBIT_HUGE_PAGES", "") != "0"
    if madvise is not None and wanted and out.device.type == "cpu" and out.nbytes >= MIN_BYTES:
        start = -(-out.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (out.data_ptr() + out.nbytes) // HUGE_PAGE * HUGE_PAGE
        madvise(start, end - start, mmap.MADV_HUGEPAGE)
    return out


def converted(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` (t itself when it has that dtype), into an :func:`empty_output`."""
    return t if t.dtype == dtype else empty_output(t, dtype).copy_(t)
