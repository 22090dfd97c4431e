"""A split row's compaction: the last block of a split row (`select`)
copies the candidates whose keys reach the decided bucket into the row
cache, in id order, so that its pick runs over them and not the row.

Two phases, a block exclusive prefix sum between them: each thread counts
its kept candidates and notes them (`kept_counts`), then places them from
its prefix (`compaction_pass`). Lanes read the row a pair to a 32-byte
sector, so a warp's 16-byte loads use every byte of the sectors they
touch (of a row that starts on 32 bytes: a workspace row width of a
multiple of 8).
"""

from std.math import ceildiv

from ...grid.block_phases import Shared
from ...grid.collectives import thread_run
from ...grid.ragged import Field
from ..rank import score_order
from .pick import (
    SELECT_THREADS,
    SelectShared,
    kept_counts_words,
    row_cache_words,
)


comptime _COUNT_BITS = 4
"""Bits of one quad's kept count (0 to 4) in `kept_counts`."""


comptime _COUNTS_PER_WORD = 32 // _COUNT_BITS


@always_inline
def _quads(bound: Int) -> Int:
    """Groups of 4 candidates that cover `bound`, read 16 bytes at a time
    (`_quad_keys`)."""
    return ceildiv(bound, 4)


@always_inline
def _starts_aligned(scores: Field[DType.float32, MutAnyOrigin]) -> Bool:
    """Whether a row's scores start on 16 bytes (the same for every thread
    of the block)."""
    return (Int(scores) & 15) == 0


@always_inline
def _quad_keys(
    s: Shared,
    scores: Field[DType.float32, MutAnyOrigin],
    first: Int,
    bound: Int,
    aligned: Bool,
) -> SIMD[DType.uint32, 4]:
    """The order keys of candidates `first ..< first + 4` (`first` a
    multiple of 4): one 16-byte load when the row starts on 16 bytes and
    all 4 are in it, else a load each; 0 past `bound`.

    A lane reads a quad, a lane pair's two quads a whole 32-byte sector
    where the row starts on 32 bytes (`compaction_lanes`)."""
    var keys = SIMD[DType.uint32, 4](0)
    if aligned and first + 4 <= bound:
        var v = s.global_load[width=4, alignment=16](scores, first)
        comptime for l in range(4):
            keys[l] = score_order(v[l])
    else:
        comptime for l in range(4):
            if first + l < bound:
                keys[l] = score_order(s.global_load(scores, first + l))
    return keys


@fieldwise_init
struct Compaction[origin: MutOrigin](Copyable, TrivialRegisterPassable):
    """A row to compact, as the compaction's phases receive it.

    Parameters:
        origin: Origin of the pointers (`MutAnyOrigin` in the kernels).
    """

    var scores: Field[DType.float32, Self.origin]
    """The row's scores, `bound` of them."""
    var bound: Int
    """Candidates of the row, at least 0."""
    var width: Int
    """The workspace's row width (sizes the row cache)."""
    var floor: UInt64
    """The lowest key kept (the decided bucket's first; 2^32 keeps none)."""


def compaction_lanes[k: Int](bound: Int) -> Int:
    """Lanes that share a run of the compaction's quads: 2 when each lane's
    counts fit `kept_counts` (`kept_counts_words(k)` words, taken 512 at a
    time: rows of up to 16,384 (1 + sort_width(k) // 256) candidates),
    else 1 (a run a lane, half of each sector a request).

    Parameters:
        k: Ids per output row.

    Args:
        bound: Candidates of the row.
    """
    var spans = ceildiv(_quads(bound), 2)
    var per_lane = ceildiv(spans, SELECT_THREADS // 2)
    var words = ceildiv(per_lane, _COUNTS_PER_WORD) * SELECT_THREADS
    return 2 if words <= kept_counts_words(k) else 1


@always_inline
def _count_word(i: Int, thread: Int) -> Int:
    """The `kept_counts` word of `thread`'s `i`-th span (lanes side by
    side: a warp's stores and its partners' loads fill 32 banks once)."""
    return (i // _COUNTS_PER_WORD) * SELECT_THREADS + thread


@always_inline
def _count_shift(i: Int) -> UInt32:
    """Where span `i`'s count lies in its `kept_counts` word."""
    return UInt32(_COUNT_BITS * (i % _COUNTS_PER_WORD))


@always_inline
def _count_of(word: UInt32, i: Int) -> Int:
    """Span `i`'s count in its `kept_counts` word."""
    return Int((word >> _count_shift(i)) & ((1 << _COUNT_BITS) - 1))


@always_inline
def _kept_quad(
    s: Shared, row: Compaction[MutAnyOrigin], q: Int, aligned: Bool
) -> Tuple[SIMD[DType.uint32, 4], SIMD[DType.bool, 4]]:
    """Quad `q`'s keys (candidates `4 q ..< 4 q + 4`, `_quad_keys`) and
    which of them are kept: in the row, and at `row.floor` or above. The
    count and the placing read the row through this one test, so they
    agree on every candidate."""
    var keys = _quad_keys(s, row.scores, 4 * q, row.bound, aligned)
    var kept = SIMD[DType.bool, 4](fill=False)
    comptime for l in range(4):
        kept[l] = 4 * q + l < row.bound and UInt64(keys[l]) >= row.floor
    return (keys, kept)


@always_inline
def compaction_pass[
    place: Bool, k: Int
](thread: Int, s: Shared, row: Compaction[MutAnyOrigin], at: Int) -> UInt64:
    """The compaction's count (`place` false: this thread's kept
    candidates, its counts noted in `kept_counts`) or its placing (`place`:
    from `at`, the block exclusive prefix sum of the counts, the kept
    (key, id) pairs into the row cache in id order); the count returns
    the thread's kept candidates (the placing, 0).

    Lanes `2 p` and `2 p + 1` share a run of spans of 2 quads, a quad a
    lane, so a warp's loads use every byte of the 32-byte sectors they
    touch (a run a lane would use half of each; a row that starts 16
    bytes past a sector, half as well). To place in id order, a
    lane adds its partner's kept candidates of the spans before (the odd
    lane, of its span too), from the counts its partner noted; the odd
    lane's prefix counted its partner's whole run, which it takes back
    first. Rows too long for the counts (`compaction_lanes`) take runs of
    one lane. The row cache's stores fall where the scores put them: up
    to 5-way in the profile at DeepSeek-V3.2's decode (2.2 wavefronts a
    request), as the data decides. The pair's bookkeeping costs the split
    kernel registers (`gpu-report`): at 2 blocks an SM,
    `select.SPLIT_BLOCKS` is still one wave.

    Parameters:
        place: Whether this is the placing (else the count).
        k: Ids per output row.

    Args:
        thread: The thread, `0 ..< SELECT_THREADS`.
        s: The block's shared words.
        row: The row to compact.
        at: The count's block exclusive prefix sum (the placing's).
    """
    if compaction_lanes[k](row.bound) == 2:
        return _pass[place, k, 2](thread, s, row, at)
    return _pass[place, k, 1](thread, s, row, at)


@always_inline
def _pass[
    place: Bool, k: Int, lanes: Int
](thread: Int, s: Shared, row: Compaction[MutAnyOrigin], at: Int) -> UInt64:
    """`compaction_pass` with runs shared by `lanes` lanes (1 or 2)."""
    var shared = SelectShared[k](s, row_cache_words(row.width))
    var counts = shared.kept_counts()
    var aligned = _starts_aligned(row.scores)
    var side = thread % lanes
    var partner = thread ^ 1
    var run = thread_run(
        thread // lanes,
        SELECT_THREADS // lanes,
        ceildiv(_quads(row.bound), lanes),
    )
    var total: UInt64 = 0
    var word: UInt32 = 0
    var next = at
    comptime if place and lanes == 2:
        if side == 1:
            for i in range(run[1] - run[0]):
                if i % _COUNTS_PER_WORD == 0:
                    word = counts.load(_count_word(i, partner))
                next -= _count_of(word, i)
    for span in range(run[0], run[1]):
        var i = span - run[0]
        var q = lanes * span + side
        var quad = _kept_quad(s, row, q, aligned)
        comptime if place:
            # The partner's kept candidates of this span: before the odd
            # lane's, after the even lane's.
            var theirs = 0
            comptime if lanes == 2:
                if i % _COUNTS_PER_WORD == 0:
                    word = counts.load(_count_word(i, partner))
                theirs = _count_of(word, i)
            next += theirs * side
            comptime for l in range(4):
                if quad[1][l]:
                    shared.row_keys().store(next, quad[0][l])
                    shared.row_ids().store(next, UInt32(4 * q + l))
                    next += 1
            next += theirs * (1 - side)
        else:
            var mine: UInt32 = 0
            comptime for l in range(4):
                mine += UInt32(Int(quad[1][l]))
            total += UInt64(mine)
            comptime if lanes == 2:
                word |= mine << _count_shift(i)
                var full = i % _COUNTS_PER_WORD == _COUNTS_PER_WORD - 1
                if full or span + 1 == run[1]:
                    counts.store(_count_word(i, thread), word)
                    word = 0
    return total
