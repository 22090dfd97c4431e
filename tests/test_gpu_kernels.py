"""Runs tests/mojo/test_gpu_kernels.mojo: GPU code generation, launch shapes.

The Mojo test compiles each writer's GPU kernel to PTX for sm_90a and
sm_100a and to AMDGCN for gfx942 (no GPU needed), checks the launch shape
helpers the kernels index by, and unit-tests the emulated grid (every
thread once, and the launch shapes a GPU refuses refused).
tests/mojo/test_block_phases.mojo checks the phased kernels' emulation (a
block sum over a barrier, a missing barrier, an unwritten word, a
write-after-read and an index past the shared words all refused) and
compiles a phased kernel for the three targets.
"""

from __future__ import annotations

import pytest

from kpool_cases import mojo_command, run_mojo_suite


@pytest.mark.skipif(
    mojo_command() is None, reason="the mojo command is not found"
)
def test_gpu_kernels_compile_and_launch_shapes():
    run_mojo_suite("tests/mojo/test_gpu_kernels.mojo", min_tests=7)


@pytest.mark.skipif(
    mojo_command() is None, reason="the mojo command is not found"
)
def test_phased_kernels_emulation_and_compile():
    run_mojo_suite("tests/mojo/test_block_phases.mojo", min_tests=7)
