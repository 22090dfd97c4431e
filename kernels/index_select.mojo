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

**Shared memory**: the histogram (15 x 512 words), whose area later
holds the pairs (2 x 2048 words) and the collect's counts; 15 bucket
totals and 4 words of state: `SELECT_WORDS` in all (30,796 bytes). Words
are laid out so that a warp's accesses fall in distinct banks (the
counters of a digit row are thread-indexed; the collect's counts are
padded by a word per 32).

**Occupancy** (theoretical; limits: NVIDIA CUDA C++ Programming Guide,
"Compute Capabilities", table of technical specifications for compute
capability 9.0, and "Shared Memory" (1 KB reserved per block); AMD
"AMD Instinct MI300 ISA" and ROCm "GPU hardware specifications" for
MI300X: 64 KiB LDS per CU, 4 SIMDs of 8 wave64 slots, 512 VGPRs per SIMD
lane): a 512-thread block is 16 warps on an H200 (228 KB shared per SM:
7 blocks by shared memory, 4 by the 64 warps of an SM, fewer if a thread
takes more than 32 registers: 3 up to 40, 2 up to 64) and 8 wave64 on
an MI300X (2 workgroups by the 64 KiB of LDS: 16 of 32 wave slots, 50%,
with up to 128 VGPRs).

The file reads top down: the layout and phase counts, the radix select,
then the collect's placement and the sort.
"""

from std.bit import log2_floor, next_power_of_two
from std.math import max, min

from .block_phases import Shared
from .index_operands import TOP_K_LIMIT
from .index_rank import score_order
from .ragged import Ptr


comptime SELECT_THREADS = 512
"""Threads per row block: 16 warps, 8 wave64."""

comptime _LANES = 32
"""Threads of an NVIDIA warp, and banks of shared memory (both targets)."""

comptime DIGIT_BITS = 4
"""Bits of the key fixed per radix pass."""

comptime RADIX_BUCKETS = 1 << DIGIT_BITS
"""Buckets of one digit."""

comptime _COUNTED = RADIX_BUCKETS - 1
"""Digits counted per pass: `1 ..< RADIX_BUCKETS` (never 0)."""

comptime _PASSES = 32 // DIGIT_BITS
"""Radix passes over a 32-bit key."""

comptime _HIST = 0
"""Word of digit `d`'s counter of thread `t`: `_HIST + (d - 1) * T + t`."""

comptime _HIST_WORDS = _COUNTED * SELECT_THREADS
"""The histogram area, reused for the pairs and the collect's counts."""

comptime _PAIR_KEYS = _HIST
"""Keys of the pairs (the histogram area's first `TOP_K_LIMIT` words: the
pair area holds the largest `k`)."""

comptime _PAIR_IDS = _HIST + TOP_K_LIMIT
"""Ids of the pairs."""

comptime _PADDED = SELECT_THREADS + SELECT_THREADS // _LANES
"""Words of one padded per-thread count array (`_padded`)."""

comptime _ABOVE = _PAIR_IDS + TOP_K_LIMIT
"""Per-thread counts of keys above `K`, then their exclusive prefixes."""

comptime _TIES = _ABOVE + _PADDED
"""Per-thread counts of keys at `K`, then their exclusive prefixes."""

comptime _WARPS = SELECT_THREADS // _LANES
"""Groups of 32 threads: the collect's prefix runs per group."""

comptime _GROUP_ABOVE = _TIES + _PADDED
"""Keys above `K` per group of 32 threads."""

comptime _GROUP_TIES = _GROUP_ABOVE + _WARPS
"""Keys at `K` per group of 32 threads."""

comptime _TOTALS = _HIST + _HIST_WORDS
"""The 15 bucket totals of a pass (digit `d` at `_TOTALS + d - 1`)."""

comptime _STATE = _TOTALS + _COUNTED
"""Two slots of (prefix, need): pass `p` records its state in slot
`p % 2`; the collect's (`K`, need) is slot 0."""

comptime SELECT_WORDS = _STATE + 4
"""Shared words per block."""

comptime _PASS_PHASES = 3
comptime _SELECT_PHASES = _PASSES * _PASS_PHASES
"""Count, column sums and totals per digit."""

comptime _COLLECT_PHASES = 3


@always_inline
def sort_width(k: Int) -> Int:
    """The pairs' area: the smallest power of two at least `k`.

    Args:
        k: Ids per output row.
    """
    return next_power_of_two(k)


def _sort_steps(k: Int) -> Int:
    """Compare-exchange phases of the bitonic sort of `sort_width(k)` pairs.

    Args:
        k: Ids per output row.
    """
    var n = log2_floor(sort_width(k))
    return n * (n + 1) // 2


def select_phases(k: Int) -> Int:
    """Phases of the select body for `k`: select, collect, sort (and write).

    The last sort phase writes the output; `k = 1` has no sort phase and
    writes in a phase of its own.

    Args:
        k: Ids per output row, `1 ..= TOP_K_LIMIT`.
    """
    return _SELECT_PHASES + _COLLECT_PHASES + max(_sort_steps(k), 1)


@always_inline
def _run(thread: Int, bound: Int) -> Tuple[Int, Int]:
    """Thread `thread`'s contiguous run of ids `[lo, hi)` in the collect.

    Args:
        thread: The thread.
        bound: Candidates of the row.
    """
    var per = (bound + SELECT_THREADS - 1) // SELECT_THREADS
    var lo = min(thread * per, bound)
    return (lo, min(lo + per, bound))


@always_inline
def _padded(thread: Int) -> Int:
    """Thread `thread`'s word in a padded count array: a word skipped per 32.

    The collect's prefix thread `g` reads words `33 g + i`, in bank
    `(g + i) % 32`: the 16 prefix threads never share a bank.

    Args:
        thread: The thread.
    """
    return thread + thread // _LANES


@always_inline
def _shift(p: Int) -> Int:
    """The lowest bit of pass `p`'s digit.

    Args:
        p: The pass, `0 ..< _PASSES`.
    """
    return 32 - DIGIT_BITS * (p + 1)


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
        k: Ids per output row, `1 ..= TOP_K_LIMIT`.
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


# The collect and the sort: once `_count_run` has fixed the k-th key `K`
# and counted each thread's keys above and at it, `_prefix_group` turns a
# group's counts into exclusive prefixes and `_scatter_run` writes each
# thread's selected (key, id) pairs to their places, ties in id order;
# the bitonic sort (`_bitonic_step`) then orders the pairs, its last step
# writing the ids to the output (`_write_ids` when `k = 1` needs no sort).


@always_inline
def _selected(key: UInt32, threshold: UInt32, take_all: Bool) -> Int:
    """2 above the k-th key (or any key when all are taken), 1 at it, 0.

    Args:
        key: A candidate's key.
        threshold: The k-th key `K`.
        take_all: Whether every candidate is taken.
    """
    if take_all or key > threshold:
        return 2
    return 1 if key == threshold else 0


def _prefix_group(group: Int, s: Shared):
    """Exclusive prefixes of a group of 32 threads' counts, and its sums.

    Args:
        group: The group, `0 ..< SELECT_THREADS / 32`.
        s: The block's shared words.
    """
    var above: UInt32 = 0
    var ties: UInt32 = 0
    for i in range(_LANES):
        var at = _padded(group * _LANES + i)
        var a = s.load(_ABOVE + at)
        var e = s.load(_TIES + at)
        s.store(_ABOVE + at, above)
        s.store(_TIES + at, ties)
        above += a
        ties += e
    s.store(_GROUP_ABOVE + group, above)
    s.store(_GROUP_TIES + group, ties)


def _scatter_run(
    thread: Int,
    s: Shared,
    scores: Ptr[DType.float32],
    bound: Int,
    m: Int,
    take_all: Bool,
    width: Int,
):
    """Writes this thread's selected pairs, and pads the pair area.

    The keys above `K` come first, in id order; the `need` lowest ids at
    `K` follow them.

    Args:
        thread: The thread.
        s: The block's shared words.
        scores: The row's scores.
        bound: Candidates of the row.
        m: `min(k, bound)`.
        take_all: Whether every candidate is taken.
        width: `sort_width(k)`.
    """
    var threshold: UInt32 = 0
    var need = 0
    if not take_all:
        threshold = s.load(_STATE)
        need = Int(s.load(_STATE + 1))
    var at = Int(s.load(_ABOVE + _padded(thread)))
    var tie = Int(s.load(_TIES + _padded(thread)))
    var above_total = 0
    var group = thread // _LANES
    for g in range(_WARPS):
        var a = Int(s.load(_GROUP_ABOVE + g))
        above_total += a
        if g < group:
            at += a
            tie += Int(s.load(_GROUP_TIES + g))
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


@always_inline
def _after(key_a: UInt32, id_a: UInt32, key_b: UInt32, id_b: UInt32) -> Bool:
    """Whether pair a ranks after pair b (lower key, or equal and higher id).

    Args:
        key_a: Pair a's key.
        id_a: Pair a's id.
        key_b: Pair b's key.
        id_b: Pair b's id.
    """
    return key_a < key_b or (key_a == key_b and id_a > id_b)


@always_inline
def _write_id(ids: Ptr[DType.int32], i: Int, id: UInt32, k: Int, m: Int):
    """Output slot `i` (if below `k`): `id` for the first `m`, then -1.

    Args:
        ids: The row's `k` output ids.
        i: The slot (pair) index.
        id: The id the sorted pairs hold at `i`.
        k: Ids per output row.
        m: `min(k, bound)`.
    """
    if i < k:
        ids[unsafe_offset=i] = Int32(id) if i < m else Int32(-1)


def _write_ids(thread: Int, s: Shared, k: Int, m: Int, ids: Ptr[DType.int32]):
    """Writes the (sorted) pairs' ids, then -1: the phase after no sort.

    Args:
        thread: The thread.
        s: The block's shared words.
        k: Ids per output row.
        m: `min(k, bound)`.
        ids: The row's `k` output ids.
    """
    for i in range(thread, k, SELECT_THREADS):
        var id: UInt32 = 0
        if i < m:
            id = s.load(_PAIR_IDS + i)
        _write_id(ids, i, id, k, m)


def _bitonic_step(
    thread: Int,
    s: Shared,
    step: Int,
    width: Int,
    last: Bool,
    k: Int,
    m: Int,
    ids: Ptr[DType.int32],
):
    """Compare-exchange step `step` of the bitonic sort of `width` pairs.

    Steps run stage by stage (`size` = 2, 4, .., `width`), each stage from
    `stride = size / 2` down to 1; the pairs end in rank order (best
    first). A thread takes compared pairs `c = thread, thread + 512, ..`
    of the `width / 2`: `c` with a 0 bit inserted at `stride` is the lower
    index. The last step writes the ids to the output.

    Args:
        thread: The thread.
        s: The block's shared words.
        step: The step, `0 ..< _sort_steps(k)`.
        width: `sort_width(k)`.
        last: Whether this is the last step.
        k: Ids per output row.
        m: `min(k, bound)`.
        ids: The row's `k` output ids.
    """
    var size = 2
    var left = step
    while left >= log2_floor(size):
        left -= log2_floor(size)
        size *= 2
    var stride = size >> (left + 1)
    for c in range(thread, width // 2, SELECT_THREADS):
        var i = ((c & ~(stride - 1)) << 1) | (c & (stride - 1))
        var j = i + stride
        var ka = s.load(_PAIR_KEYS + i)
        var ia = s.load(_PAIR_IDS + i)
        var kb = s.load(_PAIR_KEYS + j)
        var ib = s.load(_PAIR_IDS + j)
        # Best first within blocks of `size` whose bit `size` is 0, worst
        # first in the others; the last stage sorts the whole area.
        var swap = _after(ka, ia, kb, ib) == ((i & size) == 0)
        if last:
            _write_id(ids, i, ib if swap else ia, k, m)
            _write_id(ids, j, ia if swap else ib, k, m)
        elif swap:
            s.store(_PAIR_KEYS + i, kb)
            s.store(_PAIR_IDS + i, ib)
            s.store(_PAIR_KEYS + j, ka)
            s.store(_PAIR_IDS + j, ia)
