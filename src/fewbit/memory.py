"""Outputs for large CPU results: cached for reuse, on transparent huge pages on Linux.

A fresh CPU tensor of tens of MiB costs more in first-touch page faults than the
arithmetic that fills it. glibc maps each such block anew, in 4 KiB pages, and every
page faults on its first write. On the 2-core development VM, ``torch.clone`` of 64 MiB
takes 27 ms, and the same copy into an output on huge pages 7 ms. numpy asks for huge
pages for its large arrays; torch does only with ``THP_MEM_ALLOC_ENABLE=1``, which
changes every allocation of the process. fewbit asks for its own outputs only; set
``FEWBIT_HUGE_PAGES=0`` to leave them on torch's pages (where a fragmented machine
would stall on compaction to find huge pages).

Even on huge pages, fresh memory costs the kernel's zeroing of every page: RNE of
2^24 float32 takes 10 ms into fresh memory there, 5 ms into reused. So fewbit keeps
the large CPU outputs it hands out in a cache, as torch's CUDA allocator does on a GPU:
once every tensor on such an output is gone, the next output of the same size reuses
its memory, already mapped. The cache tracks at most ``FEWBIT_CPU_CACHE_MB`` (default
1024) MiB of outputs, so no more than that stays allocated after the tensors are freed;
beyond it, outputs are plain allocations. ``FEWBIT_CPU_CACHE_MB=0`` turns it off;
:func:`empty_cache` gives the free memory back.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
import threading
from pathlib import Path

import torch

__all__ = ["cached_bytes", "converted", "empty_cache", "empty_output"]

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


def _advise(data_ptr: int, nbytes: int) -> None:
    """Ask for huge pages on the whole ones inside the block, before anything touches
    them (the kernel backs them on first write). The advice only changes how the
    memory is backed: where it fails, nothing else changes."""
    madvise = _madvise()
    if madvise is not None and os.environ.get("FEWBIT_HUGE_PAGES", "") != "0":
        start = -(-data_ptr // HUGE_PAGE) * HUGE_PAGE
        end = (data_ptr + nbytes) // HUGE_PAGE * HUGE_PAGE
        madvise(start, end - start, mmap.MADV_HUGEPAGE)


#: Storages of the large CPU outputs handed out; one is free again when the cache
#: holds its only reference.
_cached: list[torch.UntypedStorage] = []
_lock = threading.Lock()


def _cache_bytes() -> int:
    value = os.environ.get("FEWBIT_CPU_CACHE_MB", "1024")
    try:
        mib = int(value)
    except ValueError:
        raise ValueError(f"FEWBIT_CPU_CACHE_MB must be a whole number of MiB, got {value!r}") from None
    if mib < 0:
        raise ValueError(f"FEWBIT_CPU_CACHE_MB must be >= 0, got {mib}")
    return mib << 20


def _is_free(storage: torch.UntypedStorage) -> bool:
    return torch._C._storage_Use_Count(storage._cdata) == 1


def _from_cache(like: torch.Tensor, dtype: torch.dtype, nbytes: int) -> torch.Tensor | None:
    """An output on a free cached storage of ``nbytes``, else on a new one if the cache
    has room, else None."""
    limit = _cache_bytes()
    if not hasattr(torch._C, "_storage_Use_Count"):  # no way to tell a free storage
        return None
    with _lock:
        # Memory a tensor moved to shared memory may be in another process's hands, and
        # a storage resized to nothing (as FSDP frees memory) holds none: the cache lets
        # go of both for good.
        _cached[:] = [s for s in _cached if not s.is_shared() and s.nbytes() > 0]
        storage = next((s for s in _cached if s.nbytes() == nbytes and _is_free(s)), None)
        if storage is None:
            held = cached_bytes()
            for s in [s for s in _cached if _is_free(s)]:  # oldest first
                if held + nbytes <= limit:
                    break
                _cached.remove(s)
                held -= s.nbytes()
            if held + nbytes > limit:
                return None
            storage = torch.UntypedStorage(nbytes)
            _advise(storage.data_ptr(), nbytes)
            _cached.append(storage)
        # Made under the lock: from here on the storage is not free.
        return torch.empty(0, dtype=dtype).set_(storage, 0, like.shape)


def cached_bytes() -> int:
    """Bytes of the outputs the cache tracks, in use or free."""
    return sum(s.nbytes() for s in _cached)


def empty_cache() -> None:
    """Free the cached outputs that no tensor uses any more."""
    with _lock:
        _cached[:] = [s for s in _cached if not _is_free(s)]


def empty_output(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.empty_like(like, dtype=dtype)``, contiguous. A CPU one of 4 MiB or more
    comes from the cache (see the module docstring), on huge pages where they can be had."""
    dtype = like.dtype if dtype is None else dtype
    nbytes = like.numel() * dtype.itemsize
    # Traced by torch.compile, the compiled code allocates: a plain empty_like.
    large = nbytes >= MIN_BYTES and like.device.type == "cpu" and not torch.compiler.is_compiling()
    out = _from_cache(like, dtype, nbytes) if large else None
    if out is None:
        out = torch.empty_like(like, dtype=dtype, memory_format=torch.contiguous_format)
        if large:
            _advise(out.data_ptr(), nbytes)
    return out


def converted(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` (t itself when it has that dtype), into an :func:`empty_output`."""
    return t if t.dtype == dtype else empty_output(t, dtype).copy_(t)
