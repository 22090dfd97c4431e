"""index_top_k's GPU path on the emulated grid, against the float64 oracle.

Every test of tests/test_index_top_k.py again (the same cases, shapes,
malformed metadata, NaN ranking, ties past 4,096 at the k-th score, more
than 262,144 candidate pools, guarded fuzz), with the op's GPU path: the
plan, score and select launches run on the host for every block, thread and
phase (``Runner("gpu-emulated")``), the select's phases under the
shared-memory checks of ``kernels/block_phases.mojo``. A file of its own so
that the two devices' compiles go to different workers.
"""

from __future__ import annotations

import pytest

from test_index_top_k import *  # noqa: F403 (the tests, run again here)


@pytest.fixture(scope="module")
def runner(runners):
    """Where the op runs: its GPU path over the emulated grid."""
    return runners("gpu-emulated")
