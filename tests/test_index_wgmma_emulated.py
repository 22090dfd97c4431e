"""The tensor-core (``wgmma``) scorer's tile code on the emulated grid.

``scorer="wgmma"`` with ``emulate_gpu`` runs the Hopper scorer's own phases
on the host: the tiles it stages in shared memory, the descriptors it
builds, the accumulator registers it reads, with the instruction itself
computed by ``kernels/wgmma_model.mojo`` (written from the PTX ISA, checked
against its tables in tests/mojo/test_wgmma_model.mojo). Each case is
checked against the float64 oracle within the tensor-core error bound
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

from index_cases import DSV32, GLM, GLM_CAUSAL, WHOLE, Case, build, index_key
from mla_kpool.index_runner import IndexKey
from test_index_top_k import CASES, run

#: Heads not a multiple of 8, depth not a multiple of 32: padded tiles.
ODD = replace(WHOLE, name="odd-pad", heads=5, depth=40, width=40, kpool=1)
#: More heads than one product takes (two chunks: 64 and 16).
WIDE = replace(DSV32, name="wide-80", heads=80, depth=64, width=64, top_k=64)
SHAPES = (GLM, GLM_CAUSAL, DSV32, WHOLE, ODD, WIDE)

#: Cases too large to emulate per thread (hundreds of millions of modelled
#: products); the GPU tests run them.
_SLOW = {"small-262k-pools", "glm-causal-prefill-4096"}

EXTRA = [
    Case("odd-pad-short-rows", ODD, cached=(3, 70, 0), new=(2, 1, 4)),
    Case("wide-heads-two-chunks", WIDE, cached=(130, 1), new=(2, 3)),
]
WGMMA_CASES = [c for c in CASES if c.name not in _SLOW] + EXTRA


def COMPILED_TOGETHER(device: str) -> list[IndexKey]:  # noqa: N802
    """Every shape's wgmma model, compiled as one graph per host device."""
    if device != "gpu-emulated":
        return []
    return [index_key(shape, device, scorer="wgmma") for shape in SHAPES]


@pytest.fixture(scope="module")
def runner(runners):
    """Where the op runs: its GPU path over the emulated grid."""
    return runners("gpu-emulated")


@pytest.mark.parametrize("case", WGMMA_CASES, ids=lambda c: c.name)
def test_wgmma_scorer_matches_the_oracle(runner, case):
    call = build(case)
    got = run(runner, call, scorer="wgmma")
    assert got.shape == (len(call.q), case.shape.top_k)
    report = call.check(got, scorer="wgmma")
    assert report.rows == len(call.q)


def test_wgmma_ties_go_to_the_lowest_ids(runner):
    # From id 100 on every key is the same: identical bytes and scales
    # score identically in any arithmetic, so the ids past 100 that make
    # the cut are exactly the lowest ones, in ascending order.
    call = build(Case("ties", DSV32, cached=(6500,), new=(2,), tie_from=100))
    got = run(runner, call, scorer="wgmma")
    call.check(got, scorer="wgmma")
    for row in got:
        tied = row[row >= 100]
        assert len(tied) > 0
        np.testing.assert_array_equal(tied, np.arange(100, 100 + len(tied)))


def test_wgmma_same_output_on_every_run(runner):
    call = build(WGMMA_CASES[0])
    first = run(runner, call, scorer="wgmma")
    for _ in range(2):
        np.testing.assert_array_equal(run(runner, call, scorer="wgmma"), first)
