"""The GPU top-k select of the indexer: one block per score row, in phases.

Input: a row of float32 scores (candidate `j` at column `j`, `bound`
candidates) in a workspace; output: the row's `m = min(k, bound)` ids in
descending score order, ties by ascending id, then `-1` (the contract of
`index_top_k`, with NaN ranking as `-inf`, below every number).

A block of `SELECT_THREADS` (512) threads selects one row, written as
phases separated by barriers (`block_phases`, which has no atomics):

1. **Radix select** of the k-th largest `score_order` key, 4 bits at a
   time from the top (8 passes of 3 phases). *Count*: each thread counts
   the digits of the keys it reads (ids `t, t + 512, ..`, coalesced) that
   match the prefix fixed so far, into a histogram of its own, a column
   of the shared `[15, 512]` histogram (digit 0 is never counted: the
   walk below never needs its total). *Columns*: thread `(r, g)` adds
   digit row `r`'s 16 words `g, g + 32, ..` (one bank each). *Totals*:
   15 threads add the 32 partial sums of a row. The next pass's count
   phase starts with every thread walking the 15 totals from the top to
   the bucket that holds the k-th key (the same answer in every thread;
   thread 0 records it), which fixes 4 more bits of it. After 8 passes
   the block knows the k-th key `K` exactly and how many of the keys
   equal to `K` the top k takes (`need`): the keys above `K`, then the
   `need` lowest ids at `K`, however many candidates tie there.
2. **Collect** (3 phases): each thread owns a contiguous run of ids and
   counts its keys above `K` and at `K`; 16 threads turn a warp's counts
   into exclusive prefixes; then every thread adds the earlier warps'
   sums and writes its selected (key, id) pairs to their places. Ties
   are taken in id order because the runs are.
3. **Bitonic sort** of the (at most `k`, padded to a power of two `S`)
   pairs by key descending, id ascending: `log2(S) (log2(S) + 1) / 2`
   phases of compare-exchanges, a thread per compared pair; the last one
   writes the ids (then `-1`) to the output instead of shared memory.

Grid: one block per row, on the x axis (2^31 - 1 rows). A row needs no
memory beyond its scores: a long context costs time, not workspace. Radix
select and bitonic sort are the textbook GPU methods (e.g. Alabi et al.,
"Fast k-selection algorithms for graphics processing units", 2012;
Batcher's bitonic sorter, 1968); the two-level sum over thread-private
histograms is the race-free form of the histogram step of Merrill and
Grimshaw's radix sort ("High performance and scalable radix sorting",
2011).

The shared words' layout and the phase counts are in
`index_select_layout.mojo`; the collect's placement and the sort in
`index_select_sort.mojo`.
"""

from std.math import min

from .block_phases import Shared
from .index_rank import score_order
from .index_select_layout import (
    DIGIT_BITS,
    RADIX_BUCKETS,
    SELECT_THREADS,
    _ABOVE,
    _COLLECT_PHASES,
    _COUNTED,
    _HIST,
    _HIST_WORDS,
    _LANES,
    _PASSES,
    _PASS_PHASES,
    _SELECT_PHASES,
    _STATE,
    _TIES,
    _TOTALS,
    _WARPS,
    _GROUP_TIES,
    _padded,
    _run,
    _shift,
    _sort_steps,
    sort_width,
)
from .index_select_sort import (
    _bitonic_step,
    _prefix_group,
    _scatter_run,
    _selected,
    _write_ids,
)
from .ragged import Ptr


def select_row_phase(
    phase: Int,
    thread: Int,
    s: Shared,
    scores: Ptr[DType.float32],
    bound: Int,
    k: Int,
    ids: Ptr[DType.int32],
):
    """One thread's share of one phase of one row's select.

    Args:
        phase: The phase, `0 ..< select_phases(k)`.
        thread: The thread, `0 ..< SELECT_THREADS`.
        s: The block's shared words (`SELECT_WORDS`).
        scores: The row's scores, `bound` of them.
        bound: Candidates of the row (ids `0 ..< bound`), at least 0.
        k: Ids per output row, `1 ..= SELECT_MAX_K`.
        ids: The row's `k` output ids.
    """
    comptime assert (
        _GROUP_TIES + _WARPS <= _HIST_WORDS
    ), "the collect's counts must fit in the histogram area"
    comptime assert (
        SELECT_THREADS // _LANES >= _COUNTED
    ), "the column sums need a group of 32 threads per counted digit"
    var m = min(k, bound)
    # Every candidate is taken: no radix passes, no threshold.
    var take_all = bound <= k
    if phase < _SELECT_PHASES:
        if take_all:
            return
        var p = phase // _PASS_PHASES
        var step = phase % _PASS_PHASES
        if step == 0:
            _count_digits(thread, s, scores, bound, m, p)
        elif step == 1:
            _sum_columns(thread, s)
        elif thread < _COUNTED:
            _sum_partials(thread, s)
        return
    var c = phase - _SELECT_PHASES
    var width = sort_width(k)
    if c == 0:
        _count_run(thread, s, scores, bound, m, take_all)
    elif c == 1:
        if thread < _WARPS:
            _prefix_group(thread, s)
    elif c == 2:
        _scatter_run(thread, s, scores, bound, m, take_all, width)
    elif _sort_steps(k) == 0:
        _write_ids(thread, s, k, m, ids)
    else:
        var step = c - _COLLECT_PHASES
        _bitonic_step(
            thread, s, step, width, step == _sort_steps(k) - 1, k, m, ids
        )


def _pass_state(s: Shared, p: Int, m: Int) -> Tuple[UInt32, UInt32]:
    """The (prefix, need) pass `p` counts with; pass `_PASSES`: (`K`, need).

    Pass 0 starts from (0, `m`). Pass `p > 0` takes pass `p - 1`'s
    recorded state and totals and walks the buckets from the top to the
    one that holds the `need`-th key: its digit joins the prefix, and the
    keys of the buckets above it leave `need`. Bucket 0's total is never
    read: when buckets 15 to 1 hold fewer than `need`, it is bucket 0.

    Args:
        s: The block's shared words.
        p: The pass, `0 ..= _PASSES`.
        m: `min(k, bound)`.
    """
    if p == 0:
        return (UInt32(0), UInt32(m))
    var slot = _STATE + 2 * ((p - 1) % 2)
    var prefix = s.load(slot)
    var need = s.load(slot + 1)
    var shift = _shift(p - 1)
    var above: UInt32 = 0
    var b = _COUNTED
    while b > 0:
        var total = s.load(_TOTALS + b - 1)
        if above + total >= need:
            break
        above += total
        b -= 1
    return (prefix | (UInt32(b) << UInt32(shift)), need - above)


def _record_state(thread: Int, s: Shared, p: Int, state: Tuple[UInt32, UInt32]):
    """Thread 0 records pass `p`'s state in slot `p % 2`.

    Args:
        thread: The thread.
        s: The block's shared words.
        p: The pass, `0 ..= _PASSES`.
        state: `_pass_state(s, p, m)`.
    """
    if thread == 0:
        var slot = _STATE + 2 * (p % 2)
        s.store(slot, state[0])
        s.store(slot + 1, state[1])


def _count_digits(
    thread: Int,
    s: Shared,
    scores: Ptr[DType.float32],
    bound: Int,
    m: Int,
    p: Int,
):
    """Pass `p`'s count: this thread's keys that match the prefix, by digit.

    Args:
        thread: The thread.
        s: The block's shared words.
        scores: The row's scores.
        bound: Candidates of the row.
        m: `min(k, bound)`.
        p: The pass.
    """
    var state = _pass_state(s, p, m)
    _record_state(thread, s, p, state)
    comptime for d in range(_COUNTED):
        s.store(_HIST + d * SELECT_THREADS + thread, 0)
    var shift = _shift(p)
    # The bits above this pass's digit (none in pass 0).
    var mask = UInt32(
        (UInt64(0xFFFFFFFF) << UInt64(shift + DIGIT_BITS)) & 0xFFFFFFFF
    )
    var prefix = state[0]
    for j in range(thread, bound, SELECT_THREADS):
        var key = score_order(scores[unsafe_offset=j])
        if key & mask == prefix:
            var digit = Int((key >> UInt32(shift)) & (RADIX_BUCKETS - 1))
            if digit != 0:
                var at = _HIST + (digit - 1) * SELECT_THREADS + thread
                s.store(at, s.load(at) + 1)


def _sum_columns(thread: Int, s: Shared):
    """Partial sums: thread `(r, g)` adds row `r`'s words `g, g + 32, ..`.

    It keeps the sum in the first of them (a word only it reads here).

    Args:
        thread: The thread: row `thread / 32`, lane `thread % 32`.
        s: The block's shared words.
    """
    var row = thread // _LANES
    if row >= _COUNTED:
        return
    var at = _HIST + row * SELECT_THREADS + thread % _LANES
    var total: UInt32 = 0
    comptime for i in range(SELECT_THREADS // _LANES):
        total += s.load(at + i * _LANES)
    s.store(at, total)


def _sum_partials(row: Int, s: Shared):
    """Bucket total of digit `row + 1`: its row's 32 partial sums.

    Row `r` starts at lane `r`, so the 15 threads read distinct banks.

    Args:
        row: The digit row, `0 ..< 15`.
        s: The block's shared words.
    """
    var total: UInt32 = 0
    for x in range(_LANES):
        total += s.load(_HIST + row * SELECT_THREADS + (x + row) % _LANES)
    s.store(_TOTALS + row, total)


def _count_run(
    thread: Int,
    s: Shared,
    scores: Ptr[DType.float32],
    bound: Int,
    m: Int,
    take_all: Bool,
):
    """Fixes `K` (thread 0 records it), then counts this run's keys above it
    and at it.

    Args:
        thread: The thread.
        s: The block's shared words.
        scores: The row's scores.
        bound: Candidates of the row.
        m: `min(k, bound)`.
        take_all: Whether every candidate is taken (no `K`).
    """
    var threshold: UInt32 = 0
    if not take_all:
        var state = _pass_state(s, _PASSES, m)
        _record_state(thread, s, _PASSES, state)
        threshold = state[0]
    var above: UInt32 = 0
    var ties: UInt32 = 0
    var run = _run(thread, bound)
    for j in range(run[0], run[1]):
        var kind = _selected(
            score_order(scores[unsafe_offset=j]), threshold, take_all
        )
        if kind == 2:
            above += 1
        elif kind == 1:
            ties += 1
    s.store(_ABOVE + _padded(thread), above)
    s.store(_TIES + _padded(thread), ties)
