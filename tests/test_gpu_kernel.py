"""The Triton GPU kernel under Triton's interpreter, on the CPU: tests/interpreted_gpu_kernel.py
in a process of its own with ``TRITON_INTERPRET=1`` (Triton reads it as it is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_gpu_kernel_under_the_interpreter():
    tests = Path(__file__).with_name("interpreted_gpu_kernel.py")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " skipped" not in result.stdout, result.stdout[-2000:]
