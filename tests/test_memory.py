"""fewbit.memory: outputs as torch.empty_like would give them, on huge pages on Linux."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import fewbit
from fewbit.memory import HUGE_PAGE, converted, empty_output

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
