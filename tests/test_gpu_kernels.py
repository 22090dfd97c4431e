"""Runs tests/mojo/test_gpu_kernels.mojo: GPU code generation, launch shapes.

The Mojo test compiles each writer's GPU kernel to PTX for sm_90a and
sm_100a and to AMDGCN for gfx942 (no GPU needed), checks the launch shape
helpers the kernels index by, and unit-tests the emulated grid (every
thread once, and the launch shapes a GPU refuses refused).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MOJO_TEST = ROOT / "tests" / "mojo" / "test_gpu_kernels.mojo"


def _mojo() -> str | None:
    beside = Path(sys.executable).parent / "mojo"
    return str(beside) if beside.exists() else shutil.which("mojo")


@pytest.mark.skipif(_mojo() is None, reason="the mojo command is not found")
def test_gpu_kernels_compile_and_launch_shapes():
    proc = subprocess.run(
        [_mojo(), "run", "-I", str(ROOT), str(MOJO_TEST)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "MODULAR_DEBUG": "stack-trace-on-error"},
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    summary = re.search(r"(\d+) tests run: (\d+) passed", output)
    assert summary, output
    assert summary[1] == summary[2] and int(summary[1]) >= 7, output
