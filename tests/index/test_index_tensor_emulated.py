"""The tensor scorers' tile code on the emulated grid: Hopper's and MI300's.

``scorer="wgmma"`` (or ``"mfma"``) with ``emulate_gpu`` runs that scorer's
own phases on the host: the tiles and fragments it loads, the descriptors
it builds, the accumulator registers it reads, with the instruction itself
computed by a host model written from the ISA's tables
(``kernels/index/gpu/emulated/wgmma.mojo`` from the PTX ISA,
``kernels/index/gpu/emulated/mfma.mojo`` from AMD's CDNA3 tables; checked
against them in tests/mojo). Each case is checked against the float64
oracle within that scorer's error bound
(``mla_kpool.reference.index_tolerance``), and ties must still go to the
lowest ids. The corpus is the index cases whose emulation stays small
(every shape but the 262,144-pool and 4,096-row ones), plus rows shorter
than a tile, a head count that is not a multiple of 8 and a depth that is
not a multiple of 32 (zero-padded tiles), and more heads than one product
takes.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from mla_kpool.index_runner import IndexKey
from support.index_cases import (
    CASES,
    DSV32,
    GLM,
    GLM_CAUSAL,
    WHOLE,
    Case,
    build,
    index_key,
    nan_keys,
    run,
)

#: Heads not a multiple of 8, depth not a multiple of 32: padded tiles.
ODD = replace(WHOLE, name="odd-pad", heads=5, depth=40, width=40, kpool=1)
#: More heads than one product takes (two chunks: 64 and 16).
WIDE = replace(DSV32, name="wide-80", heads=80, depth=64, width=64, top_k=64)
SHAPES = (GLM, GLM_CAUSAL, DSV32, WHOLE, ODD, WIDE)
#: The tensor scorers; each runs every case.
SCORERS = ("wgmma", "mfma")

#: Cases too large to emulate per thread (hundreds of millions of modelled
#: products); the GPU tests run them.
_SLOW = {"small-262k-pools", "glm-causal-prefill-4096"}

EXTRA = [
    Case("odd-pad-short-rows", ODD, cached=(3, 70, 0), new=(2, 1, 4)),
    Case("wide-heads-two-chunks", WIDE, cached=(130, 1), new=(2, 3)),
]
CASES_SMALL = [c for c in CASES if c.name not in _SLOW] + EXTRA


def COMPILED_TOGETHER(device: str) -> list[IndexKey]:  # noqa: N802
    """Every shape's model per tensor scorer, compiled as one graph."""
    if device != "gpu-emulated":
        return []
    return [
        index_key(shape, device, scorer=scorer)
        for scorer in SCORERS
        for shape in SHAPES
    ]


@pytest.fixture(scope="module")
def runner(runners):
    """Where the op runs: its GPU path over the emulated grid."""
    return runners("gpu-emulated")


@pytest.mark.parametrize("scorer", SCORERS)
@pytest.mark.parametrize("case", CASES_SMALL, ids=lambda c: c.name)
def test_tensor_scorer_matches_the_oracle(runner, case, scorer):
    call = build(case)
    got = run(runner, call, scorer=scorer)
    assert got.shape == (len(call.q), case.shape.top_k)
    report = call.check(got, scorer=scorer)
    assert report.rows == len(call.q)


@pytest.mark.parametrize("scorer", SCORERS)
def test_ties_go_to_the_lowest_ids(runner, scorer):
    # From id 100 on every key is the same: identical bytes and scales
    # score identically in any arithmetic, so the ids past 100 that make
    # the cut are exactly the lowest ones, in ascending order.
    call = build(Case("ties", DSV32, cached=(6500,), new=(2,), tie_from=100))
    got = run(runner, call, scorer=scorer)
    call.check(got, scorer=scorer)
    for row in got:
        tied = row[row >= 100]
        assert len(tied) > 0
        np.testing.assert_array_equal(tied, np.arange(100, 100 + len(tied)))


@pytest.mark.parametrize("scorer", SCORERS)
def test_same_output_on_every_run(runner, scorer):
    call = build(CASES_SMALL[0])
    first = run(runner, call, scorer=scorer)
    for _ in range(2):
        np.testing.assert_array_equal(run(runner, call, scorer=scorer), first)


def _nan_query(call) -> None:
    """Tweak: a NaN byte in one head of row 1's query (request 0)."""
    call.q[1, 2, 7] = 0xFF


@pytest.mark.parametrize("scorer", SCORERS)
def test_nan_bytes_make_nan_scores(runner, scorer):
    # e4m3fn's NaN bytes (0x7F, 0xFF) are numbers to MI300's e4m3fnuz
    # instruction: both scorers must still score them NaN, as the oracle
    # does. Row 1's query has one: its whole row scores NaN, so its ids are
    # in ascending order (all tied); row 0's NaN keys rank last.
    call = build(
        Case(
            "nan-both",
            WHOLE,
            cached=(25, 7),
            new=(2, 1),
            tweaks=(nan_keys(1), _nan_query),
        )
    )
    got = run(runner, call, scorer=scorer)
    call.check(got, scorer=scorer)
    row = got[1][got[1] >= 0]
    np.testing.assert_array_equal(row, np.arange(len(row)))
