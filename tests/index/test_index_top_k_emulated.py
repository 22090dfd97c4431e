"""index_top_k's GPU path on the emulated grid, against the float64 oracle.

Every test of tests/index/test_index_top_k.py again (the same cases, shapes,
malformed metadata, NaN ranking, ties past 4,096 at the k-th score, more
than 262,144 candidate pools, guarded fuzz), with the op's GPU path: the
plan, score and select launches run on the host for every block, thread and
phase (``Runner("gpu-emulated")``), the select's phases under the
shared-memory checks of ``kernels/grid/block_phases.mojo``. Those shapes
take the tiled scorer (the row's query in shared memory); one more test
covers the untiled scorer that a query too large for it takes. A file of
its own so that the two devices' compiles go to different workers.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_index_top_k import *  # noqa: F403 (the tests, run again here)

from mla_kpool.index_runner import IndexKey
from support.index_cases import SHAPES, WHOLE, Case, build, index_key


@pytest.fixture(scope="module")
def runner(runners):
    """Where the op runs: its GPU path over the emulated grid."""
    return runners("gpu-emulated")


#: 128 heads are more than the tiled scorer's 64 head lanes, so this shape
#: takes the untiled scorer (everything from global memory).
WIDE = replace(WHOLE, name="wide-heads", heads=128, depth=16, width=16)


def COMPILED_TOGETHER(device: str) -> list[IndexKey]:  # noqa: N802
    """Every shape's model and the untiled one's, compiled as one graph.

    See the ``runners`` fixture in conftest.py.
    """
    return [index_key(shape, device) for shape in (*SHAPES, WIDE)]


def test_untiled_scorer_matches_the_oracle(runner):
    call = build(Case("wide-heads", WIDE, cached=(90, 3), new=(4, 2)))
    got = runner.index_top_k(
        call.q, call.qs, call.offsets, call.cache, 1, **call.run_kwargs()
    )
    assert call.check(got).rows == 6
    np.testing.assert_array_equal(got, call.expected())
