"""The GPU top-k select of the indexer: one block per score row, in phases.

Input: a row of float32 scores (candidate `j` at column `j`, `bound`
candidates) in a workspace; output: the row's `m = min(k, bound)` ids in
descending score order, ties by ascending id, then `-1` (the contract of
`index_top_k`, with NaN ranking as `-inf`, below every number).

A block of `SELECT_THREADS` threads selects one row, written as phases
separated by barriers (`block_phases`):

1. **Radix select** of the k-th largest `score_order` key, 8 bits at a
   time from the top (4 passes of 3 phases): each thread counts the
   digits of the keys it reads into a histogram of its own (no atomics),
   the threads then add the histograms bucket by bucket, and thread 0
   walks the buckets from the top to the one that holds the k-th key,
   which fixes 8 more bits of it. After the 4 passes the block knows the
   k-th key `K` exactly and how many of the keys equal to `K` the top k
   takes (`need`): the keys above `K`, then the `need` lowest ids at `K`,
   however many candidates tie there.
2. **Collect**: each thread owns a contiguous run of ids, counts its keys
   above `K` and at `K`, and after a prefix over the threads writes its
   selected (key, id) pairs to their places; ties are taken in id order
   because the runs are.
3. **Bitonic sort** of the (at most `k`, padded to a power of two) pairs
   by key descending, id ascending: `log2(S) (log2(S) + 1) / 2` phases of
   compare-exchanges over the shared pairs.
4. **Write** the ids, then `-1`.

Shared memory: the per-thread histograms (`SELECT_THREADS * 256` words),
reused for the pairs once the select is done, plus 256 bucket totals and a
few words of state; `SELECT_WORDS` in all (33 KiB, under the 48 KiB of
static shared memory every target gives a block). Grid: one block per row,
on the x axis (2^31 - 1 rows).

A row needs no memory beyond its scores: a long context costs time, not
workspace. Radix select and bitonic sort are the textbook GPU methods
(e.g. Alabi et al., "Fast k-selection algorithms for graphics processing
units", 2012; Batcher's bitonic sorter, 1968).
"""

from std.bit import log2_floor, next_power_of_two
from std.math import min

from .block_phases import Shared
from .index_top_k import score_order
from .ragged import Ptr

comptime SELECT_THREADS = 32
"""Threads per row block."""

comptime RADIX_BUCKETS = 256
"""Buckets of one 8-bit digit."""

comptime SELECT_MAX_K = 2048
"""Largest `k` (MAX's largest `top_k`); the pair area holds this many."""

comptime _HIST = 0
"""First word of the per-thread histograms, later of the pairs."""

comptime _TOTALS = SELECT_THREADS * RADIX_BUCKETS
"""First word of the 256 bucket totals."""

comptime _COUNTS = _TOTALS + RADIX_BUCKETS
"""Per-thread counts above `K` (then at `K` after `SELECT_THREADS`)."""

comptime _STATE = _COUNTS + 2 * SELECT_THREADS
"""The select's state: prefix, mask, need, all."""

comptime SELECT_WORDS = _STATE + 4
"""Shared words per block."""

comptime _PAIR_KEYS = _HIST
comptime _PAIR_IDS = _HIST + SELECT_MAX_K

comptime _PASSES = 4
comptime _PASS_PHASES = 3
comptime _SELECT_PHASES = 1 + _PASSES * _PASS_PHASES
"""The state's first write, then 3 phases per digit."""

comptime _COLLECT_PHASES = 3


@always_inline
def sort_width(k: Int) -> Int:
    """The pairs' area: the smallest power of two at least `k`."""
    return next_power_of_two(k)


def _sort_steps(k: Int) -> Int:
    """Compare-exchange phases of the bitonic sort of `sort_width(k)`."""
    var n = log2_floor(sort_width(k))
    return n * (n + 1) // 2


def select_phases(k: Int) -> Int:
    """Phases of the select body for `k`: select, collect, sort, write."""
    return _SELECT_PHASES + _COLLECT_PHASES + _sort_steps(k) + 1


@always_inline
def _run(thread: Int, bound: Int) -> Tuple[Int, Int]:
    """Thread `thread`'s contiguous run of ids `[lo, hi)`."""
    var per = (bound + SELECT_THREADS - 1) // SELECT_THREADS
    var lo = min(thread * per, bound)
    return (lo, min(lo + per, bound))


@always_inline
def _after(key_a: UInt32, id_a: UInt32, key_b: UInt32, id_b: UInt32) -> Bool:
    """Whether pair a ranks after pair b (lower key, or equal and higher id)."""
    return key_a < key_b or (key_a == key_b and id_a > id_b)


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
    var m = min(k, bound)
    if phase == 0:
        if thread == 0:
            s.store(_STATE, 0)  # prefix
            s.store(_STATE + 1, 0)  # mask
            s.store(_STATE + 2, UInt32(m))  # need: keys still to place
            s.store(_STATE + 3, UInt32(1 if bound <= k else 0))  # take all
        return
    if phase < _SELECT_PHASES:
        var step = (phase - 1) % _PASS_PHASES
        var shift = 24 - 8 * ((phase - 1) // _PASS_PHASES)
        if step == 0:
            _count_digits(thread, s, scores, bound, shift)
        elif step == 1:
            _add_histograms(thread, s)
        elif thread == 0:
            _choose_bucket(s, shift)
        return
    var p = phase - _SELECT_PHASES
    if p == 0:
        _count_run(thread, s, scores, bound)
    elif p == 1:
        if thread == 0:
            _prefix_counts(s)
    elif p == 2:
        _scatter_run(thread, s, scores, bound, m, sort_width(k))
    elif p < _COLLECT_PHASES + _sort_steps(k):
        _bitonic_step(thread, s, p - _COLLECT_PHASES, sort_width(k))
    else:
        for i in range(thread, k, SELECT_THREADS):
            var id = Int32(-1)
            if i < m:
                id = Int32(s.load(_PAIR_IDS + i))
            ids[unsafe_offset=i] = id


def _count_digits(
    thread: Int, s: Shared, scores: Ptr[DType.float32], bound: Int, shift: Int
):
    """Counts this thread's keys that match the prefix, by digit."""
    if s.load(_STATE + 3) != 0:
        return
    var base = _HIST + thread * RADIX_BUCKETS
    for b in range(RADIX_BUCKETS):
        s.store(base + b, 0)
    var prefix = s.load(_STATE)
    var mask = s.load(_STATE + 1)
    for j in range(thread, bound, SELECT_THREADS):
        var key = score_order(scores[unsafe_offset=j])
        if key & mask == prefix:
            var at = base + Int((key >> UInt32(shift)) & 0xFF)
            s.store(at, s.load(at) + 1)


def _add_histograms(thread: Int, s: Shared):
    """Bucket totals: each thread adds its share of the buckets."""
    if s.load(_STATE + 3) != 0:
        return
    comptime per = RADIX_BUCKETS // SELECT_THREADS
    for b in range(thread * per, (thread + 1) * per):
        var total: UInt32 = 0
        for t in range(SELECT_THREADS):
            total += s.load(_HIST + t * RADIX_BUCKETS + b)
        s.store(_TOTALS + b, total)


def _choose_bucket(s: Shared, shift: Int):
    """Fixes the k-th key's next digit: the bucket that holds it."""
    if s.load(_STATE + 3) != 0:
        return
    var need = s.load(_STATE + 2)
    var above: UInt32 = 0
    var b = RADIX_BUCKETS - 1
    while b > 0 and above + s.load(_TOTALS + b) < need:
        above += s.load(_TOTALS + b)
        b -= 1
    s.store(_STATE, s.load(_STATE) | (UInt32(b) << UInt32(shift)))
    s.store(_STATE + 1, s.load(_STATE + 1) | (UInt32(0xFF) << UInt32(shift)))
    s.store(_STATE + 2, need - above)


@always_inline
def _selected(key: UInt32, threshold: UInt32, take_all: Bool) -> Int:
    """2 above the k-th key (or any key when all are taken), 1 at it, 0."""
    if take_all or key > threshold:
        return 2
    return 1 if key == threshold else 0


def _count_run(thread: Int, s: Shared, scores: Ptr[DType.float32], bound: Int):
    """This thread's keys above the k-th key and at it."""
    var threshold = s.load(_STATE)
    var take_all = s.load(_STATE + 3) != 0
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
    s.store(_COUNTS + thread, above)
    s.store(_COUNTS + SELECT_THREADS + thread, ties)


def _prefix_counts(s: Shared):
    """Exclusive prefixes of the counts, in place (thread 0)."""
    var above: UInt32 = 0
    var ties: UInt32 = 0
    for t in range(SELECT_THREADS):
        var a = s.load(_COUNTS + t)
        var e = s.load(_COUNTS + SELECT_THREADS + t)
        s.store(_COUNTS + t, above)
        s.store(_COUNTS + SELECT_THREADS + t, ties)
        above += a
        ties += e
    # The keys above K come first; `need` of the ties follow them.
    s.store(_STATE + 1, above)


def _scatter_run(
    thread: Int,
    s: Shared,
    scores: Ptr[DType.float32],
    bound: Int,
    m: Int,
    width: Int,
):
    """Writes this thread's selected pairs, and pads the pair area."""
    var threshold = s.load(_STATE)
    var take_all = s.load(_STATE + 3) != 0
    var need = Int(s.load(_STATE + 2))
    var above_total = Int(s.load(_STATE + 1))
    var at = Int(s.load(_COUNTS + thread))
    var tie = Int(s.load(_COUNTS + SELECT_THREADS + thread))
    var run = _run(thread, bound)
    for j in range(run[0], run[1]):
        var key = score_order(scores[unsafe_offset=j])
        var kind = _selected(key, threshold, take_all)
        var slot = -1
        if kind == 2:
            slot = at
            at += 1
        elif kind == 1:
            if tie < need:
                slot = above_total + tie
            tie += 1
        if slot >= 0:
            s.store(_PAIR_KEYS + slot, key)
            s.store(_PAIR_IDS + slot, UInt32(j))
    # Padding ranks after every pair: key 0 (no score), the largest id.
    for i in range(m + thread, width, SELECT_THREADS):
        s.store(_PAIR_KEYS + i, 0)
        s.store(_PAIR_IDS + i, 0xFFFFFFFF)


def _bitonic_step(thread: Int, s: Shared, step: Int, width: Int):
    """Compare-exchange step `step` of the bitonic sort of `width` pairs.

    Steps run stage by stage (`size` = 2, 4, .., `width`), each stage from
    `stride = size / 2` down to 1; the pairs end in rank order (best
    first).
    """
    var size = 2
    var left = step
    while left >= log2_floor(size):
        left -= log2_floor(size)
        size *= 2
    var stride = size >> (left + 1)
    for i in range(thread, width, SELECT_THREADS):
        var j = i ^ stride
        if j <= i:
            continue
        var ka = s.load(_PAIR_KEYS + i)
        var ia = s.load(_PAIR_IDS + i)
        var kb = s.load(_PAIR_KEYS + j)
        var ib = s.load(_PAIR_IDS + j)
        # Best first within blocks of `size` whose bit `size` is 0, worst
        # first in the others; the last stage sorts the whole area.
        var best_first = (i & size) == 0
        if _after(ka, ia, kb, ib) == best_first:
            s.store(_PAIR_KEYS + i, kb)
            s.store(_PAIR_IDS + i, ib)
            s.store(_PAIR_KEYS + j, ka)
            s.store(_PAIR_IDS + j, ia)
