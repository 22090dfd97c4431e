"""The indexer's GPU select, run through the phased emulation.

Each case is a batch of score rows; every row's output must be the top
`min(k, bound)` ids by the contract's order (descending score with NaN as
`-inf`, ties by ascending id, then -1), computed here by sorting every
candidate's `rank_key` (no radix, no bitonic). Cases: random scores, a
bound below k, an empty row, more than 4,096 candidates tied at the k-th
score, a row of only ties, NaN and signed zeros and infinities, k of 1 and
of 3 (no power of two), bounds around the block's `SELECT_THREADS`, around
k 2048 and around the pairs the write ranks (below, at, one past, far
past), thousands of ties and of NaN at the k-th place spread over many
threads' runs, a row of more than 262,144 candidates, and rows split over
up to 24 blocks: keys one wide bucket apart, more keys in one bucket than
the row cache holds, signed zeros at the threshold, rows from 0 to 8,192
candidates in one launch, row caches from the least a split allows to past
`CACHE_WORDS`. The select kernel also compiles for sm_90a,
sm_100a and gfx942.

Built with `-D MLA_KPOOL_SELECT_K=k -D MLA_KPOOL_SELECT_SPLIT=0|1` (a
planted fault's run in tests/grid/test_gpu_kernels.py), only the checks of
that one select kernel run, and only it compiles: the others return at
once."""

from std.builtin.sort import sort
from std.math import min
from std.random import random_float64, random_ui64, seed
from std.sys import get_defined_int
from std.testing import TestSuite, assert_equal, assert_true

from kernels.grid.block_phases import Lane, Shared
from kernels.grid.gpu_kernel import GpuKernel, emulate_kernel, kernel_code
from kernels.index.rank import rank_key
from kernels.index.gpu.select import (
    CACHE_WORDS,
    RANK_SORT_PAIRS,
    SELECT_THREADS,
    SelectState,
    WindowRow,
    select_max_words,
    select_phase,
    select_phases,
    select_shared_words,
    split_words,
)
from kernels.grid.operands import KernelOperands
from kernels.grid.ragged import Field, Ptr


def _expected(scores: List[Float32], bound: Int, k: Int) -> List[Int32]:
    var keys = List[UInt64]()
    for j in range(bound):
        keys.append(rank_key(scores[j], j))
    sort(keys)
    var out = List[Int32](length=k, fill=-1)
    for i in range(min(k, bound)):
        out[i] = Int32(0xFFFFFFFF - Int(keys[bound - 1 - i] & 0xFFFFFFFF))
    return out^


@fieldwise_init
struct SelectOperands[origin: MutOrigin](KernelOperands):
    """A batch of rows: scores at a row stride, bounds, output ids, and the
    split select's words."""

    var scores: Field[DType.float32, Self.origin]
    var ids: Field[DType.int32, Self.origin]
    var bounds: Field[DType.int64, Self.origin]
    var split: Field[DType.uint32, Self.origin]
    var rows: Int
    var width: Int
    var slices: Int


comptime Select = SelectOperands[MutAnyOrigin]


struct SelectTest[k: Int, split: Bool](GpuKernel):
    """The select over a batch of rows, `slices` blocks each (`split`: more
    than one), as the op declares it (`launches.SelectKernel`) but on
    this file's operands."""

    comptime Operands = Select
    comptime State = SelectState
    comptime name = "index_select"
    comptime block_threads = SELECT_THREADS
    comptime shared_words = select_max_words(Self.k)
    comptime dynamic_shared = True
    comptime phase_table = select_phases(Self.k, Self.split)
    comptime grid_rows = "rows"
    comptime grid_columns = "slices"

    @staticmethod
    def rows(op: Select) -> Int:
        return op.rows

    @staticmethod
    def columns(op: Select) -> Int:
        return op.slices

    @staticmethod
    def launch_shared_words(op: Select) -> Int:
        return select_shared_words(Self.k, op.width)

    @staticmethod
    def run_phase[
        phase: Int
    ](
        b: Int,
        t: Int,
        mut state: SelectState,
        mut lane: Lane,
        s: Shared,
        op: Select,
    ):
        var r = b // op.slices
        var row = WindowRow[MutAnyOrigin](
            op.scores.unsafe_offset(r * op.width),
            Int(op.bounds[unsafe_offset=r]),
            op.width,
            op.slices,
            op.split.unsafe_offset(r * split_words(op.slices)),
            op.ids.unsafe_offset(r * Self.k),
        )
        select_phase[phase, Self.k, Self.split](
            t, state, lane, s, row, b % op.slices
        )


def _select[
    k: Int, split: Bool
](rows: List[List[Float32]], slices: Int) raises -> List[List[Int32]]:
    """Every row through the emulated select; `slices` blocks per row (more
    than one exactly when `split`: each kernel is compiled only where a
    test runs it)."""
    assert_equal(slices > 1, split, "slices and the split kernel disagree")
    var width = 1
    for r in rows:
        width = max(width, len(r))
    var flat = List[Float32](length=len(rows) * width, fill=0.0)
    for i in range(len(rows)):
        ref row = rows[i]  # a reference: `rows[i][j]` would copy the row
        for j in range(len(row)):
            flat[i * width + j] = row[j]
    var out = List[Int32](length=len(rows) * k, fill=7)
    var bounds = List[Int64]()
    for r in rows:
        bounds.append(Int64(len(r)))
    var words = List[UInt32](
        length=max(len(rows) * split_words(slices), 1), fill=0
    )
    var op = Select(
        flat.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
        out.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
        bounds.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
        words.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
        len(rows),
        width,
        slices,
    )
    emulate_kernel[SelectTest[k, split]](op, len(rows) * slices)
    # Each row's last block re-zeroed its arrival counter and histogram.
    for i in range(len(words)):
        assert_equal(
            words[i],
            0,
            String(
                "split word ",
                i,
                ": a row's last block left its counter or histogram set",
            ),
        )
    _ = flat^  # the kernel read it through a pointer
    _ = bounds^
    _ = words^
    var result = List[List[Int32]]()
    for i in range(len(rows)):
        var row = List[Int32]()
        for j in range(k):
            row.append(out[i * k + j])
        result.append(row^)
    return result^


comptime ONLY_K = get_defined_int["MLA_KPOOL_SELECT_K", 0]()
"""The one k checked (0: every k)."""
comptime ONLY_SPLIT = get_defined_int["MLA_KPOOL_SELECT_SPLIT", 0]() != 0
"""With `ONLY_K`: whether the one kernel checked is the split one."""


def _check[
    k: Int, split: Bool = False
](rows: List[List[Float32]], slices: Int = 1) raises:
    comptime if ONLY_K != 0 and (k != ONLY_K or split != ONLY_SPLIT):
        return
    var got = _select[k, split](rows, slices)
    for i in range(len(rows)):
        var want = _expected(rows[i], len(rows[i]), k)
        ref row = got[i]
        for j in range(k):
            if row[j] != want[j]:
                raise Error(
                    "row ",
                    i,
                    " (bound ",
                    len(rows[i]),
                    ", slices ",
                    slices,
                    ", k ",
                    k,
                    ") slot ",
                    j,
                    ": got ",
                    row[j],
                    ", want ",
                    want[j],
                )


def _random(n: Int, levels: Int) -> List[Float32]:
    """`n` scores; `levels > 0` rounds them to that many values (ties)."""
    var out = List[Float32]()
    for _ in range(n):
        var x = random_float64(-4.0, 4.0)
        if levels > 0:
            x = Float64(Int(random_ui64(0, UInt64(levels - 1)))) - 3.0
        out.append(Float32(x))
    return out^


def test_random_rows_and_bounds() raises:
    seed(1)
    var rows = List[List[Float32]]()
    rows.append(_random(5000, 0))
    rows.append(_random(100, 0))  # bound < k: every id, in order
    rows.append(List[Float32]())  # bound 0: all -1
    rows.append(_random(512, 0))  # bound == k
    rows.append(_random(513, 0))
    rows.append(_random(RANK_SORT_PAIRS, 0))  # the last m ranked
    rows.append(_random(RANK_SORT_PAIRS + 1, 0))  # the first m sorted
    _check[512](rows)


def test_more_than_4096_ties_at_the_kth_score() raises:
    seed(2)
    var row = _random(3000, 0)
    for _ in range(5000):
        row.append(0.25)  # ties straddling the k-th place
    for i in range(0, 3000, 7):
        row[i] = 0.25
    var all_tied = List[Float32](length=6000, fill=-1.5)
    var rows = List[List[Float32]]()
    rows.append(row^)
    rows.append(all_tied^)
    rows.append(_random(9000, 5))  # five values only
    _check[2048](rows)


def test_nan_signed_zero_and_infinities() raises:
    var nan = Float32(0.0) / Float32(0.0)
    var inf = Float32(1.0) / Float32(0.0)
    var row = List[Float32]()
    for x in [nan, -0.0, 0.0, -inf, inf, 1.0, nan, -1.0, -0.0, -inf, 2.0]:
        row.append(Float32(x))
    var rows = List[List[Float32]]()
    rows.append(row.copy())
    _check[4](rows)
    _check[11](rows)
    _check[16](rows)


def test_small_k() raises:
    seed(3)
    var rows = List[List[Float32]]()
    rows.append(_random(777, 0))
    rows.append(_random(40, 3))
    _check[1](rows)
    _check[3](rows)


def test_bounds_around_the_block_of_threads() raises:
    """Rows shorter than the block, runs of 0 or 1 id, bounds just past k."""
    seed(5)
    var rows = List[List[Float32]]()
    rows.append(_random(300, 0))  # k < bound < SELECT_THREADS
    rows.append(_random(SELECT_THREADS - 1, 0))
    rows.append(_random(SELECT_THREADS, 0))
    rows.append(_random(SELECT_THREADS + 1, 0))
    rows.append(_random(2 * SELECT_THREADS + 7, 0))
    rows.append(_random(101, 0))  # bound == k
    rows.append(List[Float32]())  # bound 0
    _check[101](rows)


def test_k_2048_around_its_bound() raises:
    seed(6)
    var rows = List[List[Float32]]()
    rows.append(_random(2047, 0))  # bound < k: every id, in order
    rows.append(_random(2048, 0))  # bound == k
    rows.append(_random(2049, 0))  # one candidate left out
    rows.append(_random(40000, 0))  # bound >> k
    rows.append(List[Float32]())  # bound 0: all -1
    _check[2048](rows)


def test_ties_across_thread_groups_and_nan_at_the_threshold() raises:
    """Thousands of equal keys straddle the k-th place over many threads."""
    seed(7)
    var nan = Float32(0.0) / Float32(0.0)
    var inf = Float32(1.0) / Float32(0.0)
    # 600 scores above, then 7,000 NaN and -inf (one key) around them.
    var row = _random(600, 0)
    for i in range(7000):
        row.append(nan if i % 3 else -inf)
    for i in range(0, 600, 5):
        row[i] = -inf
    var tied_top = List[Float32](length=9000, fill=2.0)
    for i in range(0, 9000, 11):
        tied_top[i] = 3.0  # 819 above, 8,181 ties for the rest
    var rows = List[List[Float32]]()
    rows.append(row^)
    rows.append(tied_top^)
    rows.append(List[Float32](length=5000, fill=nan))
    _check[512](rows)
    _check[2048](rows)


def test_k_1() raises:
    """One id: the best, or the lowest id among the best's ties."""
    seed(8)
    var rows = List[List[Float32]]()
    rows.append(_random(5000, 0))
    rows.append(List[Float32](length=3000, fill=1.0))
    rows.append(_random(1, 0))
    rows.append(List[Float32]())
    _check[1](rows)


def test_more_than_262144_candidates() raises:
    seed(4)
    var rows = List[List[Float32]]()
    rows.append(_random(270000, 4000))
    _check[2048](rows)


def test_rows_in_and_past_the_row_cache() raises:
    """One launch whose rows are kept in shared memory or read from global
    memory in every pass, from 1 candidate to past the cache."""
    seed(9)
    var rows = List[List[Float32]]()
    rows.append(_random(CACHE_WORDS - 1, 0))
    rows.append(_random(CACHE_WORDS, 50))
    rows.append(_random(CACHE_WORDS + 1, 0))
    rows.append(_random(20000, 300))
    rows.append(_random(1, 0))
    rows.append(List[Float32]())
    _check[512](rows)


def test_rows_split_over_blocks() raises:
    """Rows of a few requests, each counted over blocks whose last to arrive
    selects: bounds that leave slices empty or short, ties inside one wide
    bucket and across slices (the lowest ids must win), NaN, slice counts
    that do not divide the row, and rows from 0 to 8,192 candidates in one
    launch."""
    seed(10)
    var nan = Float32(0.0) / Float32(0.0)
    var rows = List[List[Float32]]()
    rows.append(_random(8192, 0))
    rows.append(_random(8192, 40))  # ties inside and across every slice
    rows.append(_random(5000, 0))  # the last slices short or empty
    rows.append(_random(2049, 0))
    rows.append(_random(600, 0))  # bound near k: slices empty
    rows.append(List[Float32](length=8000, fill=nan))
    rows.append(_random(1, 0))
    rows.append(List[Float32]())
    _check[512, True](rows, 24)
    _check[512, True](rows, 4)
    _check[512, True](rows, 3)
    _check[100, True](rows, 8)
    _check[2048, True](rows, 2)


def test_split_rows_around_the_wide_bucket() raises:
    """A split row's last block compacts the keys in and above the wide
    bucket of the m-th key: scores one bucket apart, many keys in that
    bucket (past the row cache's pairs, so it picks over the whole row),
    +0 and -0 at the threshold, NaN and infinities, and bounds around k."""
    seed(11)
    var nan = Float32(0.0) / Float32(0.0)
    var inf = Float32(1.0) / Float32(0.0)
    var rows = List[List[Float32]]()
    # 300 keys at 1.0, the rest just below (1.0 - 2^-24: the bucket below,
    # 1.0 sits at the bottom of its bucket).
    var edge = List[Float32](length=8192, fill=Float32(0.99999994))
    for i in range(0, 8192, 27):
        edge[i] = 1.0
    rows.append(edge^)
    # Every key in one bucket: more than the cache's 4,096 pairs.
    var narrow = List[Float32]()
    for i in range(8192):
        narrow.append(Float32(1.0 + Float64(i % 97) * 1.0e-6))
    rows.append(narrow^)
    # Signed zeros around the threshold, among negatives and NaN.
    var zeros = List[Float32]()
    for i in range(8192):
        var x = Float32(-1.0 - Float64(i % 13))
        if i % 9 == 0:
            x = -0.0 if i % 2 else 0.0
        elif i % 31 == 0:
            x = nan
        elif i % 1000 == 0:
            x = inf
        elif i % 1001 == 0:
            x = -inf
        zeros.append(x)
    rows.append(zeros^)
    rows.append(_random(511, 0))
    rows.append(_random(512, 0))
    rows.append(_random(513, 0))
    rows.append(_random(4096, 0))
    _check[512, True](rows, 16)
    _check[1, True](rows, 16)
    _check[2048, True](rows, 13)


def test_split_rows_of_every_cache_size() raises:
    """Split launches whose row cache is the least a split allows (4,096
    words: the wide histogram, then 2,048 pairs), an odd size,
    and past `CACHE_WORDS` (compaction read from global memory; with every
    key tied, the pick over a row kept in global memory), and a row too
    long for a lane pair's compaction counts at k 1."""
    seed(12)
    var smallest = List[List[Float32]]()
    smallest.append(_random(4096, 0))
    smallest.append(_random(4096, 30))
    smallest.append(_random(1500, 0))
    _check[512, True](smallest, 16)
    var odd = List[List[Float32]]()
    odd.append(_random(5000, 0))
    odd.append(List[Float32](length=4999, fill=0.5))
    _check[512, True](odd, 20)
    var wide = List[List[Float32]]()
    wide.append(_random(CACHE_WORDS * 2, 0))
    wide.append(List[Float32](length=CACHE_WORDS * 2, fill=-2.0))
    wide.append(_random(CACHE_WORDS + 3, 200))
    # Past the compaction counts' room at k 1 (a run a lane), within it at
    # k 512 (a lane pair a sector), with ties across the lanes.
    wide.append(_random(4 * CACHE_WORDS + 20, 60))
    _check[512, True](wide, 24)
    _check[1, True](wide, 24)


def test_the_select_compiles_for_every_target() raises:
    comptime if ONLY_K != 0:
        return
    for asm in [
        kernel_code[SelectTest[512, True], "sm_90a"](),
        kernel_code[SelectTest[2048, True], "sm_100a"](),
    ]:
        assert_true(".entry index_select_" in asm, "no kernel entry")
        # Barriers, the histogram's block-scope shared atomics, the block
        # collectives' shuffles (the maximum a butterfly, so every lane has
        # it); the split's GPU-scope histogram adds, arrival, fences and
        # strong loads of the row's histogram.
        for what in [
            "bar.sync",
            "atom.relaxed.cta.shared.add.u32",
            "shfl.sync.up",
            "shfl.sync.bfly",
            "atom.acq_rel.gpu",
            "atom.relaxed.gpu.global.add.u32",
            "fence.",
            "ld.relaxed.gpu.global",
            # The last block's 16-byte reads of the row it compacts.
            "ld.global.v4.b32",
        ]:
            assert_true(what in asm, String("no ", what, " in the PTX"))
        for what in ["shfl.sync.down", ".sys"]:
            assert_true(what not in asm, String(what, " in the PTX"))
        assert_true(".extern .shared" in asm, "no dynamic shared memory")
    # An unsplit launch has no count over blocks: no GPU-scope atomics.
    var unsplit = kernel_code[SelectTest[512, False], "sm_90a"]()
    assert_true(".entry index_select_" in unsplit, "no unsplit kernel entry")
    assert_true(".gpu" not in unsplit, "GPU-scope accesses, unsplit")
    var amd = kernel_code[SelectTest[512, True], "gfx942"]()
    for what in ["s_barrier", "ds_add_u32"]:
        assert_true(what in amd, String("no ", what, " in the AMDGCN"))


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
