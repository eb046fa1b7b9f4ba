"""fewbit.memory: outputs as torch.empty_like would give them, from a cache of large CPU
outputs, on huge pages on Linux."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import fewbit
from fewbit import memory
from fewbit.memory import HUGE_PAGE, cached_bytes, converted, empty_cache, empty_output

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_empty_output_is_empty_like_contiguous():
    x = torch.randn(64, 48).t()  # not contiguous
    for dtype in (None, torch.bfloat16):
        out = empty_output(x, dtype)
        assert out.shape == x.shape and out.is_contiguous() and out.device == x.device
        assert out.dtype == (dtype or x.dtype)
    big = torch.randn(3 << 20)  # 12 MiB: advised
    assert torch.equal(empty_output(big).copy_(big), big)


def test_converted_is_to():
    x = torch.randn(1 << 21) * 1e3  # 8 MiB float32
    assert converted(x, torch.float32) is x
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        got = converted(x, dtype)
        assert got.dtype == dtype and torch.equal(got, x.to(dtype))


def _huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages of the mappings that overlap t's data, from /proc/self/smaps (an
    advised range is a mapping of its own)."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.nbytes
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span[1], 16) < hi and lo < int(span[2], 16)
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def _fallbacks() -> int:
    return int(re.search(r"thp_fault_fallback (\d+)", Path("/proc/vmstat").read_text())[1])


@pytest.mark.skipif(not THP.exists() or "[madvise]" not in THP.read_text(),
                    reason="needs Linux with transparent huge pages on madvise")  # fmt: skip
def test_outputs_get_huge_pages_only_when_advised(monkeypatch):
    monkeypatch.delenv("FEWBIT_HUGE_PAGES", raising=False)
    monkeypatch.setattr(memory, "_cached", [])  # so that every output here is new memory
    monkeypatch.setenv("FEWBIT_EAGER", "1")  # the eager path allocates alike, without a compile
    before = _fallbacks()
    # Above glibc's largest mmap threshold (32 MiB), so each is a fresh mapping; a
    # smaller one may reuse heap memory that earlier tests already faulted in.
    n = 64 << 20  # bytes
    plain = torch.empty(n // 4).fill_(1.0)
    advised = empty_output(plain).fill_(1.0)
    rounded = fewbit.round(plain, "binary8p4")
    monkeypatch.setenv("FEWBIT_HUGE_PAGES", "0")
    refused = empty_output(plain).fill_(1.0)
    if _fallbacks() != before:
        pytest.skip("the kernel had no free huge page")
    # Whole aligned huge pages inside 64 MiB: at least 31.
    assert _huge_kib(advised) >= 31 * HUGE_PAGE // 1024
    assert _huge_kib(rounded) >= 31 * HUGE_PAGE // 1024
    assert _huge_kib(plain) == 0 and _huge_kib(refused) == 0


MIB = 1 << 20


@pytest.fixture
def cache(monkeypatch):
    """An empty cache of its own for the test, with the default limit."""
    monkeypatch.setattr(memory, "_cached", [])
    monkeypatch.delenv("FEWBIT_CPU_CACHE_MB", raising=False)
    return monkeypatch


def test_an_output_is_reused_once_no_tensor_holds_it(cache):
    like = torch.empty(3 * MIB)  # 12 MiB
    a = empty_output(like)
    first, view = a.data_ptr(), a[1:]
    del a
    b = empty_output(like)
    assert b.data_ptr() != first  # the view still uses a's memory
    del view
    c = empty_output(like, torch.int32)  # any dtype of the same size
    assert c.data_ptr() == first and c.dtype == torch.int32 and c.shape == like.shape
    assert b.data_ptr() != c.data_ptr()
    assert cached_bytes() == 2 * 12 * MIB


def test_rounding_into_reused_memory_gives_the_same_bits(cache):
    x = torch.randn(3 * MIB) * 100
    first = fewbit.round(x, "binary8p4", "src", bits=3, seed=5)
    kept = first.clone()
    address = first.data_ptr()
    del first
    again = fewbit.round(x, "binary8p4", "src", bits=3, seed=5)
    assert again.data_ptr() == address
    assert torch.equal(again.view(torch.int32), kept.view(torch.int32))


def test_memory_put_in_shared_memory_is_let_go(cache):
    like = torch.empty(3 * MIB)
    a = empty_output(like)
    a.share_memory_()  # another process may hold it now
    del a
    assert not empty_output(like).is_shared()
    assert cached_bytes() == 12 * MIB


def test_a_storage_resized_to_nothing_is_let_go(cache):
    like = torch.empty(3 * MIB)
    a = empty_output(like)
    a.untyped_storage().resize_(0)
    b = empty_output(like)
    assert b.untyped_storage().nbytes() == 12 * MIB
    assert len(memory._cached) == 1


def test_the_cache_tracks_at_most_its_limit(cache):
    cache.setenv("FEWBIT_CPU_CACHE_MB", "20")
    like = torch.empty(3 * MIB)  # 12 MiB
    outs = [empty_output(like) for _ in range(3)]
    assert cached_bytes() == 12 * MIB  # the others are plain allocations
    assert all(o.shape == like.shape for o in outs) and len({o.data_ptr() for o in outs}) == 3
    del outs
    small = empty_output(torch.empty(2 * MIB))  # 8 MiB fits beside the free 12 MiB
    assert cached_bytes() == 20 * MIB
    wide = torch.empty(4 * MIB)  # 16 MiB
    out = empty_output(wide)  # the free 12 MiB goes, and still no room: a plain one
    assert cached_bytes() == 8 * MIB
    del small, out
    out = empty_output(wide)  # the free 8 MiB goes too
    assert cached_bytes() == 16 * MIB
    del out
    empty_cache()
    assert cached_bytes() == 0
    cache.setenv("FEWBIT_CPU_CACHE_MB", "0")
    out = empty_output(like)
    assert cached_bytes() == 0 and out.shape == like.shape


def test_traced_code_allocates_plainly(cache):
    x = torch.randn(3 * MIB)
    traced = torch.compile(lambda t: empty_output(t).copy_(t) * 2, fullgraph=True)(x)
    assert torch.equal(traced, x * 2) and cached_bytes() == 0


def test_a_bad_cache_limit_is_an_error(cache):
    x = torch.randn(3 * MIB)
    for value in ("lots", "-1"):
        cache.setenv("FEWBIT_CPU_CACHE_MB", value)
        with pytest.raises(ValueError, match="FEWBIT_CPU_CACHE_MB"):
            fewbit.round(x, "binary8p4")
