"""Runs tests/mojo/test_gpu_kernels.mojo: GPU code generation, launch shapes.

The Mojo test compiles each writer's GPU kernel to PTX for sm_90a and
sm_100a and to AMDGCN for gfx942 (no GPU needed), checks the launch shape
helpers the kernels index by, and unit-tests the emulated grid (every
thread once, and the launch shapes a GPU refuses refused).
tests/mojo/test_block_phases.mojo checks the phased kernels' emulation (a
block sum over a barrier, a missing barrier, an unwritten word, a
write-after-read and an index past the shared words all refused) and
compiles a phased kernel for the three targets;
tests/mojo/test_index_select.mojo runs the indexer's GPU top-k select
through that emulation against a plain sort of every candidate's rank key,
and must fail with a planted off-by-one in its radix bucket or with either
of two of its barriers left out.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from kpool_cases import (
    ROOT,
    mojo_hardware_test,
    needs_mojo,
    run_mojo_file,
    run_mojo_suite,
)


@needs_mojo
def test_gpu_kernels_compile_and_launch_shapes():
    run_mojo_suite("tests/mojo/test_gpu_kernels.mojo")


@needs_mojo
def test_phased_kernels_emulation_and_compile():
    run_mojo_suite("tests/mojo/test_block_phases.mojo")


@needs_mojo
def test_index_select_on_the_phased_emulation():
    run_mojo_suite("tests/mojo/test_index_select.mojo")


def _planted_fault_fails(
    mutant: tuple, kernel: str, test_file: str, tmp_path: Path
) -> None:
    """Plants ``mutant`` (id, source text, its faulty replacement, what the
    failing run must say) in a copy of ``kernels/<kernel>`` and requires
    ``test_file``, run on that copy, to fail saying so."""
    _, good, bad, match = mutant
    shutil.copytree(ROOT / "kernels", tmp_path / "kernels")
    (tmp_path / "tests").mkdir()
    shutil.copytree(ROOT / "tests/mojo", tmp_path / "tests/mojo")
    path = tmp_path / "kernels" / kernel
    source = path.read_text()
    assert source.count(good) == 1, "the planted line moved; update it"
    path.write_text(source.replace(good, bad))
    status, output = run_mojo_file(test_file, tmp_path)
    assert status != 0, output
    assert re.search(match, output), output


#: Planted select faults: (id, exact source text, its faulty replacement,
#: what the failing run must say).
SELECT_MUTANTS = [
    (
        # The digit fixed is the bucket below the one that holds the k-th key.
        "radix_bucket_off_by_one",
        "(UInt32(b) << UInt32(shift))",
        "(UInt32(b - 1) << UInt32(shift))",
        r"slot \d+: got",
    ),
    (
        # The first threads prefix their group's counts in the phase that
        # writes them: right in the emulation's thread order, so only the
        # shared-word stamps see it.
        "prefix_without_barrier",
        "        _count_run(thread, s, scores, bound, m, take_all)\n",
        "        _count_run(thread, s, scores, bound, m, take_all)\n"
        "        if thread < _WARPS:\n"
        "            _prefix_group(thread, s)\n",
        "missing barrier",
    ),
    (
        # The bucket totals are added up in the phase that writes the
        # partial sums they add: again right in the emulation's order.
        "totals_without_barrier",
        "            _sum_columns(thread, s)\n",
        "            _sum_columns(thread, s)\n"
        "            if thread < _COUNTED:\n"
        "                _sum_partials(thread, s)\n",
        "missing barrier",
    ),
]


@needs_mojo
@pytest.mark.parametrize(
    "mutant", SELECT_MUTANTS, ids=[m[0] for m in SELECT_MUTANTS]
)
def test_index_select_planted_faults_fail(mutant, tmp_path: Path):
    _planted_fault_fails(
        mutant,
        "index_select.mojo",
        "tests/mojo/test_index_select.mojo",
        tmp_path,
    )


@needs_mojo
def test_wgmma_model_against_the_isa_tables():
    run_mojo_suite(
        "tests/mojo/test_wgmma_model.mojo",
        may_skip=("test_hardware_equals_the_model_on_sm_90",),
    )


@needs_mojo
def test_wgmma_hardware_equals_the_model():
    mojo_hardware_test(
        "tests/mojo/test_wgmma_model.mojo",
        "test_hardware_equals_the_model_on_sm_90",
        "an sm_90 GPU (Hopper)",
    )


@needs_mojo
def test_wgmma_scorer_on_the_phased_emulation():
    run_mojo_suite("tests/mojo/test_index_wgmma.mojo")


#: Planted faults in the tensor-core scorer: (id, exact source text, its
#: faulty replacement, what the failing run must say).
WGMMA_MUTANTS = [
    (
        # A thread adds its second register row's heads to the first row.
        "register_row_swapped",
        "lane // 4 + 8 * r",
        "lane // 4 + 8 * (1 - r)",
        r"row \d+ id \d+",
    ),
    (
        # The descriptor's leading byte offset (between core matrices
        # along K) two core matrices instead of one.
        "leading_offset_doubled",
        "comptime leading = CORE_BYTES\n",
        "comptime leading = 2 * CORE_BYTES\n",
        # Wrong bytes, or bytes past the staged tile.
        r"row \d+ id \d+|before any thread wrote it",
    ),
    (
        # The product issued in the phase that stages its tiles: no
        # barrier between the stores and the instruction's reads.
        "product_without_barrier",
        "        fence_async_view_proxy()\n",
        "        fence_async_view_proxy()\n"
        "    if chunk == 0:\n"
        "        multiply_chunk[0](s, thread, op, t)\n",
        "before any thread wrote it|missing barrier",
    ),
]


@needs_mojo
@pytest.mark.parametrize(
    "mutant", WGMMA_MUTANTS, ids=[m[0] for m in WGMMA_MUTANTS]
)
def test_wgmma_scorer_planted_faults_fail(mutant, tmp_path: Path):
    _planted_fault_fails(
        mutant, "index_wgmma.mojo", "tests/mojo/test_index_wgmma.mojo", tmp_path
    )


@needs_mojo
def test_mfma_model_against_the_isa_tables():
    run_mojo_suite(
        "tests/mojo/test_mfma_model.mojo",
        may_skip=("test_hardware_equals_the_model_on_mi300",),
    )


@needs_mojo
def test_mfma_hardware_equals_the_model():
    mojo_hardware_test(
        "tests/mojo/test_mfma_model.mojo",
        "test_hardware_equals_the_model_on_mi300",
        "an MI300 GPU (gfx942)",
    )


@needs_mojo
def test_mfma_scorer_on_the_phased_emulation():
    run_mojo_suite("tests/mojo/test_index_mfma.mojo")


#: Planted faults in the MI300 scorer, as WGMMA_MUTANTS.
MFMA_MUTANTS = [
    # The e4m3fnuz halving not undone: every dot half its value.
    (
        "fnuz_scale_halved",
        "var v = acc[r] * 4",
        "var v = acc[r] * 2",
        r"row \d+ id \d+",
    ),
    (
        # e4m3fn's -0 (0x80) fed as is: e4m3fnuz's NaN.
        "negative_zero_kept",
        "    return x & (((x & 0x7F7F7F7F) + 0x7F7F7F7F) | 0x7F7F7F7F)\n",
        "    return x\n",
        r"row \d+ id \d+",
    ),
    (
        # A register's head taken from the wrong row of D.
        "accumulator_head_swapped",
        "MFMA_ACC * (lane // MFMA_N) + r\n",
        "MFMA_ACC * r + lane // MFMA_N\n",
        r"row \d+ id \d+",
    ),
    (
        # Each lane's partial sum filed under its neighbour's candidate.
        "candidate_lane_shifted",
        "    var j = j0 + MFMA_N * wave + lane % MFMA_N\n",
        "    var j = j0 + MFMA_N * wave + (lane + 1) % MFMA_N\n",
        r"row \d+ id \d+",
    ),
    (
        # The final sum in the products' phase: no barrier between them.
        "sum_without_barrier",
        "multiply_tile(s, thread, op, t, b, j0, bound)\n        return\n",
        "multiply_tile(s, thread, op, t, b, j0, bound)\n",
        "missing barrier",
    ),
]


@needs_mojo
@pytest.mark.parametrize(
    "mutant", MFMA_MUTANTS, ids=[m[0] for m in MFMA_MUTANTS]
)
def test_mfma_scorer_planted_faults_fail(mutant, tmp_path: Path):
    _planted_fault_fails(
        mutant, "index_mfma.mojo", "tests/mojo/test_index_mfma.mojo", tmp_path
    )
