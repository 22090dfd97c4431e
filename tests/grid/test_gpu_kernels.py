"""Runs tests/mojo/test_gpu_kernels.mojo: GPU code generation, launch shapes.

The Mojo test compiles each writer's GPU kernel to PTX for sm_90a and
sm_100a and to AMDGCN for gfx942 (no GPU needed), checks the launch shape
helpers the kernels index by, and unit-tests the emulated grid (every
thread once, and the launch shapes a GPU refuses refused).
tests/mojo/test_block_phases.mojo checks the kernel model's emulation
(phases and shared memory, atomics, per-thread state, collectives, shared
memory sized at launch, blocks meeting through global memory, each with
its planted faults refused) and compiles its kernels for the three
targets; tests/mojo/test_index_select.mojo runs the indexer's GPU top-k
select through that emulation against a plain sort of every candidate's
rank key, and must fail with a planted off-by-one in its radix bucket, a
histogram counted without atomics, a histogram cleared while counted, a
rank sort that ranks in reverse, or a thread that offers nothing to a
collective. tests/mojo/test_profile.mojo checks the emulated profile's
shared-memory counts (wavefronts, bank conflicts, atomics per address)
on kernels whose answers are known.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from mla_kpool.gpu_profile import PROFILE_DEFINE
from support.kpool_cases import (
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
def test_the_emulated_profile_counts_planted_patterns():
    run_mojo_suite("tests/mojo/test_profile.mojo", defines=(PROFILE_DEFINE,))


@needs_mojo
def test_index_select_on_the_phased_emulation():
    run_mojo_suite("tests/mojo/test_index_select.mojo")


def _planted_fault_fails(
    mutant: tuple,
    kernel: str,
    test_file: str,
    tmp_path: Path,
    defines: tuple[str, ...] = (),
) -> None:
    """Plants ``mutant`` (id, source text, its faulty replacement, what the
    failing run must say) in a copy of ``kernels/<kernel>`` and requires
    ``test_file``, run on that copy (built with ``defines``), to fail
    saying so."""
    _, good, bad, match = mutant
    shutil.copytree(ROOT / "kernels", tmp_path / "kernels")
    (tmp_path / "tests").mkdir()
    shutil.copytree(ROOT / "tests/mojo", tmp_path / "tests/mojo")
    path = tmp_path / "kernels" / kernel
    source = path.read_text()
    assert source.count(good) == 1, "the planted line moved; update it"
    path.write_text(source.replace(good, bad))
    status, output = run_mojo_file(test_file, tmp_path, defines)
    assert status != 0, output
    assert re.search(match, output), output


#: Planted select faults: (id, exact source text, its faulty replacement,
#: what the failing run must say).
SELECT_MUTANTS = [
    (
        # The digit fixed is the bucket below the one that holds the k-th
        # key: the collect then places pairs on each other's slots or past
        # them, which the shared-word stamps see before the output does.
        "radix_bucket_off_by_one",
        "var digit = UInt32(RADIX_BUCKETS - 1 - thread)",
        "var digit = UInt32(RADIX_BUCKETS - 2 - thread)",
        r"slot \d+: got|missing barrier|out of range|before any thread wrote",
    ),
    (
        # The histogram counted with a plain read-modify-write: right in the
        # emulation's one-thread-at-a-time order, so only the shared-word
        # stamps see two threads adding to one bucket.
        "count_without_atomics",
        "_ = hist.atomic_add(digit, 1)",
        "hist.store(digit, hist.load(digit) + 1)",
        "missing barrier",
    ),
    (
        # The histogram a pass counts into is cleared in that pass, while
        # other threads add to it.
        "clear_the_counted_histogram",
        "shared.histogram(p + 1).store(thread, 0)",
        "shared.histogram(p).store(thread, 0)",
        r"one of them atomic \(a race\)|missing barrier",
    ),
    (
        # A thread with nothing to collect offers nothing to the prefix sum:
        # on a GPU its lane would hold a stale value.
        "collect_without_an_offer",
        "    lane.offer(above << 32 | ties)",
        "    if above + ties > 0:\n        lane.offer(above << 32 | ties)",
        "offered no value to the collective",
    ),
    (
        # The collect's table entry loses its prefix sum: the phase still
        # offers its counts, to no collective.
        "collect_without_a_collective",
        'Phase("collect", BLOCK_EXCLUSIVE_SUM)',
        'Phase("collect")',
        r"phase 13 \(collect\) thread \d+ offered a value, but the phase"
        " table has no collective after phase collect",
    ),
    (
        # A body names a phase its table does not have: a compile error,
        # not a branch that never runs.
        "misspelt_phase_name",
        'elif table.named(phase, "collect"):',
        'elif table.named(phase, "colect"):',
        "no phase is called 'colect'",
    ),
    (
        # A split row's first block selects instead of its last to arrive:
        # the shuffled block order runs it before some of the others, so
        # it takes a histogram they have not added to yet (and re-zeroes
        # the counter before they arrive).
        "select_by_block_order",
        "last = 1 if Int(before) == whole.slices - 1 else 0",
        "last = 1 if slice == 0 else 0",
        r"slot \d+: got|left its counter or histogram set|out of range",
    ),
    (
        # The wide bucket recorded is the one above the m-th key's: fewer
        # keys pass the filter than the recorded count, so the pick reads
        # pairs nobody compacted, or misses keys.
        "wide_bucket_off_by_one",
        "decided.store(WIDE_BUCKET, UInt32(top - i))",
        "decided.store(WIDE_BUCKET, UInt32(top - i + 1))",
        r"slot \d+: got|before any thread wrote|out of range",
    ),
    (
        # The compaction leaves out the m-th key's bucket: fewer pairs than
        # the decided count reach shared memory, so the pick reads places
        # nobody wrote, or misses the keys of that bucket.
        "compaction_without_the_bucket",
        "UInt64(decided.load(WIDE_BUCKET)) << UInt64(32 - WIDE_BITS)",
        "UInt64(decided.load(WIDE_BUCKET) + 1) << UInt64(32 - WIDE_BITS)",
        r"slot \d+: got|missing barrier|out of range|before any thread wrote",
    ),
    (
        # The odd lane of a pair places its kept keys where its partner
        # places the partner's of the same sector: two writers of a word,
        # or keys out of id order.
        "compaction_odd_lane_ignores_its_partner",
        "            next += theirs * side\n",
        "",
        r"slot \d+: got|race|before any thread wrote",
    ),
    (
        # The last block leaves the row's histogram as the launch left it:
        # the next launch would count on top of it.
        "histogram_left_for_the_next_launch",
        "                s.global_store(whole.split, 1 + i, 0)\n",
        "",
        "left its counter or histogram set",
    ),
    (
        # The rank sort counts the pairs ranked after each pair, not
        # before: the right ids, in reverse order.
        "rank_in_reverse",
        "if ordered_rank_key(keys.load(j), pair_ids.load(j)) > mine:",
        "if ordered_rank_key(keys.load(j), pair_ids.load(j)) < mine:",
        r"slot \d+: got",
    ),
    (
        # The bitonic sort's compare-exchange keeps the wrong pair first in
        # every block: a sequence in no order.
        "bitonic_exchange_reversed",
        "if _after(ka, ia, kb, ib) == ((i & size) == 0):",
        "if _after(ka, ia, kb, ib) != ((i & size) == 0):",
        r"slot \d+: got",
    ),
]

#: The mutants planted in select.mojo (the split and the sort); the
#: others are a pick's, in pick.mojo.
_IN_SELECT = (
    "select_by_block_order",
    "wide_bucket_off_by_one",
    "compaction_without_the_bucket",
    "histogram_left_for_the_next_launch",
    "rank_in_reverse",
    "bitonic_exchange_reversed",
)
_IN_COMPACTION = ("compaction_odd_lane_ignores_its_partner",)


#: The one select kernel (k, split) a planted fault's run compiles and
#: checks (each select kernel is a compile of its own): the split one for
#: the split's faults, k 101 for the rank sort (at most 256 winners), the
#: unsplit k 512 for the others.
_SELECT_KERNEL = {
    "select_by_block_order": (512, True),
    "wide_bucket_off_by_one": (512, True),
    "compaction_without_the_bucket": (512, True),
    "compaction_odd_lane_ignores_its_partner": (512, True),
    "histogram_left_for_the_next_launch": (512, True),
    "rank_in_reverse": (101, False),
}


@needs_mojo
@pytest.mark.parametrize(
    "mutant", SELECT_MUTANTS, ids=[m[0] for m in SELECT_MUTANTS]
)
def test_index_select_planted_faults_fail(mutant, tmp_path: Path):
    kernel = "select" if mutant[0] in _IN_SELECT else "pick"
    if mutant[0] in _IN_COMPACTION:
        kernel = "compaction"
    k, split = _SELECT_KERNEL.get(mutant[0], (512, False))
    _planted_fault_fails(
        mutant,
        f"index/gpu/{kernel}.mojo",
        "tests/mojo/test_index_select.mojo",
        tmp_path,
        (f"MLA_KPOOL_SELECT_K={k}", f"MLA_KPOOL_SELECT_SPLIT={int(split)}"),
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
        "    stage_query[Shape, chunk](s, thread, op, row)\n"
        "    async_fence()\n",
        "    stage_query[Shape, chunk](s, thread, op, row)\n"
        "    async_fence()\n"
        "    _ = issue_product[Shape, chunk](s, thread, 0)\n",
        "before any thread wrote it|missing barrier",
    ),
    (
        # The next pair's keys staged into the buffer the tensor cores
        # are reading for this pair.
        "next_keys_into_the_busy_buffer",
        "if stage_pair[Shape](p + 1, thread, s, op, first_row, block_first)",
        "if stage_pair[Shape](p, thread, s, op, first_row, block_first)",
        # The model reads the tile when the product is issued: the stores
        # after it, in the same phase, are a race the shared-word stamps
        # see.
        "missing barrier",
    ),
    (
        # Every block of a row group starts at candidate 0: the group's
        # second span of tiles is never scored.
        "span_ignored",
        "    var first = (block % spans) * WGMMA_TILE * Shape.span\n",
        "    var first = 0\n",
        r"grouped row 0 id 2\d\d",
    ),
    (
        # A segment holds only the first of its request's rows in the
        # block: the others are never scored.
        "segment_of_its_first_row_only",
        "            members |= 1 << r\n",
        "            members = 1 << s\n",
        r"grouped row \d+ id \d+",
    ),
]


@needs_mojo
@pytest.mark.parametrize(
    "mutant", WGMMA_MUTANTS, ids=[m[0] for m in WGMMA_MUTANTS]
)
def test_wgmma_scorer_planted_faults_fail(mutant, tmp_path: Path):
    _planted_fault_fails(
        mutant,
        "index/gpu/wgmma.mojo",
        "tests/mojo/test_index_wgmma.mojo",
        tmp_path,
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
        mutant,
        "index/gpu/mfma.mojo",
        "tests/mojo/test_index_mfma.mojo",
        tmp_path,
    )
