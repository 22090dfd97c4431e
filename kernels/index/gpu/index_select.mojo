"""The GPU top-k select of the indexer: one block per score row.

Input: a row of float32 scores (candidate `j` at column `j`, `bound`
candidates) in a workspace; output: the row's `m = min(k, bound)` ids in
descending score order, ties by ascending id, then `-1` (the contract of
`index_top_k`, with NaN ranking as `-inf`, below every number).

A block of `SELECT_THREADS` (512) threads selects one row, in phases of
the kernel model (`block_phases`: compile-time phases, per-thread state in
registers, shared-memory atomics, block collectives), each phase below
followed by a barrier:

1. **Load**: a row of at most `CACHE_WORDS` candidates is read from global
   memory once, as its `score_order` keys, into shared memory (sized at
   launch from the workspace's row width); a longer row is read from
   global memory in each pass instead.
2. **Radix select** of the k-th largest key, 8 bits at a time from the top
   (4 passes of 3 phases). *Count*: every thread adds the digits of its
   keys (ids `t, t + 512, ..`) that match the prefix fixed so far to a
   shared histogram of 256 buckets with `atomic_add` (two histograms
   alternate, so one is cleared while the other is read). *Offer*: thread
   `t < 256` offers bucket `255 - t`'s count to a block exclusive prefix
   sum: its result is the number of matching keys in higher buckets.
   *Decide*: the one thread whose bucket holds the `need`-th key records
   the longer prefix and what is left of `need`. After 4 passes the block
   knows the k-th key `K` and how many keys equal to `K` the top k takes.
3. **Collect** (2 phases): each thread owns a contiguous run of ids and
   offers its count of keys above `K` and at `K` (packed in one 64-bit
   value) to a block exclusive prefix sum; then writes its selected
   (key, id) pairs to their places: keys above `K` in id order, then the
   lowest-id `need` keys at `K` after all `m - need` of them. Ties are
   taken in id order because the runs are.
4. **Bitonic sort** of the `m` pairs padded to `S = next_power_of_two(m)`
   by key descending, id ascending: the compare-exchange steps of stages
   up to `S` (the steps of larger stages, up to `sort_width(k)`, do
   nothing), then a phase writes the ids (then `-1`).

Grid: one block per row, on the x axis (2^31 - 1 rows). Radix select and
bitonic sort are the textbook GPU methods (Alabi et al., "Fast k-selection
algorithms for graphics processing units", 2012; Batcher's bitonic sorter,
1968); a wide first digit counted with shared atomics and refined only
inside the bucket that holds the k-th key is how the fast GPU top-k
kernels count (FlashInfer's `RadixTopK`, MAX's `nn.topk_bitonic`).

**Shared memory** (`select_shared_words`): two histograms (2 x 256
words), the state (2 words), the pairs (2 x `sort_width(k)` words) and the
row cache (the workspace's row width, at most `CACHE_WORDS`): 12,804
words (51,216 bytes) for k 512 at the GLM-5-Next decode shape, past the
48 KiB of static shared memory, so it is sized at launch; at most
`select_max_words(k)` (16,900 words, 67,600 bytes, for k 2048: above the
64 KiB of an MI300X workgroup, which a row cache of 8,192 words at k
512 stays within).
"""

from std.bit import log2_floor, next_power_of_two
from std.math import max, min

from ...model.block_phases import (
    BLOCK_EXCLUSIVE_SUM,
    BLOCK_MAX,
    NO_COLLECTIVE,
    Lane,
    Shared,
    arrive,
)
from ..index_rank import score_order
from ...model.ragged import Field, Ptr


comptime SELECT_THREADS = 512
"""Threads per row block: 16 warps, 8 wave64."""

comptime DIGIT_BITS = 8
"""Bits of the key fixed per radix pass."""

comptime RADIX_BUCKETS = 1 << DIGIT_BITS
"""Buckets of one digit."""

comptime _PASSES = 32 // DIGIT_BITS
"""Radix passes over a 32-bit key."""

comptime CACHE_WORDS = 8192
"""The longest row kept in shared memory (32 KiB of keys)."""

comptime _HIST = 0
"""Pass `p` counts digit `d` at `_HIST + (p % 2) * RADIX_BUCKETS + d`."""

comptime _STATE = _HIST + 2 * RADIX_BUCKETS
"""(prefix, need): the bits of the k-th key fixed so far, and how many keys
with that prefix the top k still takes."""

comptime _PAIRS = _STATE + 2
"""The pairs' keys (`sort_width(k)` words), then their ids."""

comptime SPLIT_ROWS = 128
"""A window of fewer rows than this splits each row over several blocks."""

comptime MAX_SLICES = 8
"""The most blocks a row is split over."""

# The phases of picking a row's top k into the pairs (unsorted): load, 3
# per pass, count-and-offer, scatter. A block picks from its slice, then
# (a split row's last block to arrive) from the slices' picks, then sorts.
comptime _LOAD = 0
comptime _FIRST_PASS = 1
comptime _PASS_PHASES = 3
comptime _COLLECT = _FIRST_PASS + _PASSES * _PASS_PHASES
comptime _SCATTER = _COLLECT + 1
comptime PICK_PHASES = _SCATTER + 1
"""Phases of one pick."""
comptime _PUBLISH = PICK_PHASES
comptime _ARRIVE = _PUBLISH + 1
comptime _MERGE = _ARRIVE + 1
comptime _FIRST_SORT_STEP = _MERGE + PICK_PHASES


def select_slices(candidates: Int, total_tokens: Int, k: Int) -> Int:
    """Blocks each row's select is split over: 1 unless the call has few
    rows (`SPLIT_ROWS`), then as many as give each slice at least `4 k`
    candidates and let the merge keep every slice's pick in shared memory,
    at most `MAX_SLICES` (`mla_kpool._limits.select_slices` is the Python
    twin).

    Args:
        candidates: The workspace's row width (the longest row).
        total_tokens: Query rows of the call.
        k: Ids per output row.
    """
    if total_tokens >= SPLIT_ROWS:
        return 1
    return max(
        1, min(MAX_SLICES, candidates // (4 * k), CACHE_WORDS // (2 * k))
    )


def split_words(slices: Int, k: Int) -> Int:
    """`UInt32` words of the split workspace per window row: an arrival
    counter, each slice's pick count, keys and ids (none unsplit)."""
    if slices <= 1:
        return 0
    return 1 + slices * (1 + 2 * k)


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
    """Phases of the select for `k`: a pick, publish, arrive, a pick of the
    picks, the sort steps and the write.

    Args:
        k: Ids per output row, `1 ..= TOP_K_LIMIT`.
    """
    return _FIRST_SORT_STEP + _sort_steps(k) + 1


def _pick_collective(phase: Int) -> Int:
    """The collective after pick phase `phase`: a block exclusive prefix sum
    after each pass's offer and after the collect's count."""
    if phase == _COLLECT:
        return BLOCK_EXCLUSIVE_SUM
    var p = phase - _FIRST_PASS
    if 0 <= p < _PASSES * _PASS_PHASES and p % _PASS_PHASES == 1:
        return BLOCK_EXCLUSIVE_SUM
    return NO_COLLECTIVE


def select_collective(phase: Int) -> Int:
    """The collective after `phase`: the picks' prefix sums, and a block
    maximum after the arrival (which block of a split row is last).

    Args:
        phase: The phase.
    """
    if phase < PICK_PHASES:
        return _pick_collective(phase)
    if phase == _ARRIVE:
        return BLOCK_MAX
    if _MERGE <= phase < _MERGE + PICK_PHASES:
        return _pick_collective(phase - _MERGE)
    return NO_COLLECTIVE


def _base_words(k: Int) -> Int:
    """Shared words before the row cache."""
    return _PAIRS + 2 * sort_width(k)


def select_shared_words(k: Int, candidates: Int) -> Int:
    """Shared words of a select launch over rows of `candidates` columns.

    Args:
        k: Ids per output row.
        candidates: The workspace's row width (the longest row).
    """
    return _base_words(k) + row_cache_words(candidates)


def row_cache_words(candidates: Int) -> Int:
    """Words of row cache for rows of `candidates` columns.

    Args:
        candidates: The workspace's row width (the longest row).
    """
    return min(max(candidates, 0), CACHE_WORDS)


def select_max_words(k: Int) -> Int:
    """The most shared words a select launch for `k` uses."""
    return _base_words(k) + CACHE_WORDS


@fieldwise_init
struct SelectState(Copyable, Defaultable, TrivialRegisterPassable):
    """What a select thread keeps in registers across the barriers."""

    var prefix: UInt32
    """The bits of the k-th key fixed so far (then the k-th key)."""
    var need: UInt32
    """How many keys with that prefix the top k still takes."""
    var count: UInt32
    """This thread's bucket count, from its offer to its decision."""
    var pairs: UInt32
    """Pairs the last pick placed: `min(k, bound)` of its row."""
    var merging: Bool
    """Whether this block is a split row's last to arrive (it merges)."""

    def __init__(out self):
        """Before the first pass."""
        self.prefix = 0
        self.need = 0
        self.count = 0
        self.pairs = 0
        self.merging = False


@fieldwise_init
struct SelectRow[origin: MutOrigin](Copyable, TrivialRegisterPassable):
    """What one pick reads: a slice of a row's scores, or the slices' picks.

    Parameters:
        origin: Origin of the pointers (`MutAnyOrigin`, as `Row`).
    """

    var scores: Field[DType.float32, Self.origin]
    """The slice's scores, `bound` of them (unread for a merge)."""
    var bound: Int
    """Candidates of the pick, at least 0."""
    var first: Int
    """The id of the slice's first candidate."""
    var cache: Int
    """Words of row cache this launch has (`select_shared_words`)."""
    var split: Field[DType.uint32, Self.origin]
    """The window row's split words (`split_words`); read by a merge."""
    var slices: Int
    """Blocks the row is split over; a merge reads their picks."""
    var merge: Bool
    """Whether this pick reads the slices' picks, not scores."""

    @always_inline
    def cached(self) -> Bool:
        """Whether the pick's keys are in shared memory."""
        return self.bound <= self.cache

    @always_inline
    def key[k: Int](self, s: Shared, j: Int) -> UInt32:
        """Candidate `j`'s key, from the cache or from global memory."""
        if self.cached():
            return s.load(_base_words(k) + j)
        return score_order(self.scores[unsafe_offset=j])

    @always_inline
    def id[k: Int](self, s: Shared, j: Int) -> UInt32:
        """Candidate `j`'s id: its place in the row, or (a merge) the id the
        slices' picks hold, kept after the keys in the cache."""
        if self.merge:
            return s.load(_base_words(k) + self.slices * k + j)
        return UInt32(self.first + j)


comptime Row = SelectRow[MutAnyOrigin]
"""The pick a select phase receives."""


@fieldwise_init
struct WindowRow[origin: MutOrigin](Copyable, TrivialRegisterPassable):
    """A window row's select: its scores, split words and output.

    Parameters:
        origin: Origin of the pointers (`MutAnyOrigin`, as `SelectCall`).
    """

    var scores: Field[DType.float32, Self.origin]
    """The row's scores, `bound` of them."""
    var bound: Int
    """Candidates of the row (ids `0 ..< bound`), at least 0."""
    var width: Int
    """The workspace's row width (the longest row)."""
    var slices: Int
    """Blocks the row is split over (`select_slices`)."""
    var split: Field[DType.uint32, Self.origin]
    """The row's `split_words(slices, k)` words, zero before the launch
    (unread unsplit)."""
    var ids: Field[DType.int32, Self.origin]
    """The row's `k` output ids."""


comptime SelectCall = WindowRow[MutAnyOrigin]
"""The window row a select block receives."""


def slice_row(
    scores: Field[DType.float32, MutAnyOrigin],
    bound: Int,
    width: Int,
    slice: Int,
    slices: Int,
    split: Field[DType.uint32, MutAnyOrigin],
) -> Row:
    """Block `slice`'s pick of a row of `bound` candidates: ids `slice * L
    ..< (slice + 1) * L`, `L = ceil(width / slices)`.

    Args:
        scores: The row's scores.
        bound: Candidates of the row.
        width: The workspace's row width.
        slice: The block's slice, `0 ..< slices`.
        slices: `select_slices` of the call.
        split: The window row's split words.
    """
    var per = (width + slices - 1) // slices
    var first = min(slice * per, bound)
    return Row(
        scores.unsafe_offset(first),
        min(bound - first, per),
        first,
        row_cache_words(width),
        split,
        slices,
        False,
    )


def merge_row(
    width: Int,
    slices: Int,
    split: Field[DType.uint32, MutAnyOrigin],
    merging: Bool,
) -> Row:
    """The last block's pick of the slices' picks (none in other blocks).

    Args:
        width: The workspace's row width.
        slices: `select_slices` of the call.
        split: The window row's split words.
        merging: Whether this block merges.
    """
    var none = 0
    var bound = 0
    if merging:
        for v in range(slices):
            bound += Int(split[unsafe_offset=1 + v])
    return Row(
        Ptr[DType.float32](unsafe_from_address=none),
        bound,
        0,
        row_cache_words(width),
        split,
        slices,
        True,
    )


@always_inline
def _shift(p: Int) -> Int:
    """The lowest bit of pass `p`'s digit."""
    return 32 - DIGIT_BITS * (p + 1)


def select_phase[
    phase: Int, k: Int
](
    thread: Int,
    mut state: SelectState,
    mut lane: Lane,
    s: Shared,
    whole: SelectCall,
    slice: Int,
):
    """One thread's share of phase `phase` of a block's select.

    Phases `0 ..< PICK_PHASES` pick the top `k` of the block's slice of the
    row (`whole`, all of it when unsplit) into the pairs. A split row's
    block then publishes its pick to the split words and arrives; the last
    to arrive picks the top `k` of the picks (`merge_row`) while the others
    idle, and sorts and writes the output. An unsplit row's block sorts
    and writes its own pick.

    Parameters:
        phase: The phase, `0 ..< select_phases(k)`.
        k: Ids per output row, `1 ..= TOP_K_LIMIT`.

    Args:
        thread: The thread, `0 ..< SELECT_THREADS`.
        state: The thread's registers.
        lane: The thread's lane in the collectives (`select_collective`).
        s: The block's shared words (`select_shared_words`).
        whole: The window row.
        slice: The block's slice of the row, `0 ..< whole.slices`.
    """
    var split = whole.slices > 1
    comptime if phase < PICK_PHASES:
        var row = slice_row(
            whole.scores,
            whole.bound,
            whole.width,
            slice,
            whole.slices,
            whole.split,
        )
        _pick_phase[phase, k](thread, state, lane, s, row)
    elif phase == _PUBLISH:
        if split:
            var m = Int(state.pairs)
            var keys = whole.split.unsafe_offset(1 + whole.slices + slice * k)
            var at = keys.unsafe_offset(whole.slices * k)
            for i in range(thread, m, SELECT_THREADS):
                keys[unsafe_offset=i] = s.load(_PAIRS + i)
                at[unsafe_offset=i] = s.load(_PAIRS + sort_width(k) + i)
            if thread == 0:
                whole.split[unsafe_offset=1 + slice] = UInt32(m)
    elif phase == _ARRIVE:
        var last: UInt64 = 0
        if split and thread == 0:
            var before = arrive(whole.split)
            last = 1 if Int(before) == whole.slices - 1 else 0
        lane.offer(last)
    elif phase < _FIRST_SORT_STEP:
        comptime p = phase - _MERGE
        comptime if p == 0:
            state.merging = lane.result() != 0
            if state.merging and thread == 0:
                # Every slice has arrived: ready for the next window.
                whole.split[unsafe_offset=0] = 0
        if state.merging:
            var row = merge_row(
                whole.width, whole.slices, whole.split, state.merging
            )
            _pick_phase[p, k](thread, state, lane, s, row)
        elif _pick_collective(p) != NO_COLLECTIVE:
            lane.offer(0)
    else:
        if split and not state.merging:
            return
        comptime if phase < select_phases(k) - 1:
            _bitonic_step[k](
                thread, phase - _FIRST_SORT_STEP, s, Int(state.pairs)
            )
            return
        var m = Int(state.pairs)
        for i in range(thread, k, SELECT_THREADS):
            var id = Int32(-1)
            if i < m:
                id = Int32(s.load(_PAIRS + sort_width(k) + i))
            whole.ids[unsafe_offset=i] = id


def _pick_phase[
    phase: Int, k: Int
](thread: Int, mut state: SelectState, mut lane: Lane, s: Shared, row: Row,):
    """One thread's share of phase `phase` of a pick of `row`'s top `k`
    into the pairs (module docs, steps 1-3).

    Parameters:
        phase: The phase, `0 ..< PICK_PHASES`.
        k: Ids per output row.

    Args:
        thread: The thread.
        state: The thread's registers.
        lane: The thread's lane in the collectives (`_pick_collective`).
        s: The block's shared words.
        row: The pick's candidates.
    """
    comptime assert (
        RADIX_BUCKETS <= SELECT_THREADS
    ), "a bucket per thread in the offer"
    var m = min(k, row.bound)
    # Every candidate is taken: no radix passes, no threshold.
    var take_all = row.bound <= k
    comptime if phase == _LOAD:
        if thread < RADIX_BUCKETS:
            s.store(_HIST + thread, 0)
        if row.merge:
            _gather_picks[k](thread, s, row)
        elif row.cached():
            for j in range(thread, row.bound, SELECT_THREADS):
                s.store(
                    _base_words(k) + j, score_order(row.scores[unsafe_offset=j])
                )
        state.prefix = 0
        state.need = UInt32(m)
        state.pairs = UInt32(m)
    elif phase < _COLLECT:
        comptime p = (phase - _FIRST_PASS) // _PASS_PHASES
        comptime step = (phase - _FIRST_PASS) % _PASS_PHASES
        comptime hist = _HIST + (p % 2) * RADIX_BUCKETS
        comptime if step == 0:
            _count[k, p](thread, state, s, row, take_all)
        elif step == 1:
            state.count = 0
            if thread < RADIX_BUCKETS and not take_all:
                state.count = s.load(hist + RADIX_BUCKETS - 1 - thread)
            lane.offer(UInt64(state.count))
        else:
            _decide[p](thread, state, lane, s, take_all)
    elif phase == _COLLECT:
        _count_run[k](thread, state, lane, s, row, take_all)
    else:
        _scatter_run[k](thread, state, lane, s, row, m, take_all)


def _gather_picks[k: Int](thread: Int, s: Shared, row: Row):
    """A merge's load: the slices' picks, in slice order, into the cache
    (keys, then ids after `slices * k` words).

    Each slice's pick holds its keys above its own threshold, then its ties,
    each in id order, and the slices cover ascending ids: so among equal
    keys, the order here is id order, which the pick's tie rule (the
    lowest places) needs.
    """
    var cache = _base_words(k)
    var counts = row.split.unsafe_offset(1)
    var keys = row.split.unsafe_offset(1 + row.slices)
    var picked = keys.unsafe_offset(row.slices * k)
    var start = 0
    for v in range(row.slices):
        var count = Int(counts[unsafe_offset=v])
        for i in range(thread, count, SELECT_THREADS):
            s.store(cache + start + i, keys[unsafe_offset=v * k + i])
            s.store(
                cache + row.slices * k + start + i,
                picked[unsafe_offset=v * k + i],
            )
        start += count


def _decide[
    p: Int
](thread: Int, state: SelectState, mut lane: Lane, s: Shared, take_all: Bool,):
    """Pass `p`'s decision: the thread whose bucket holds the `need`-th key
    records the prefix with that bucket's digit and the keys still needed.

    Parameters:
        p: The pass.

    Args:
        thread: The thread; bucket `255 - thread` is its own.
        state: The thread's registers (its bucket's count).
        lane: The offer's result: matching keys in higher buckets.
        s: The block's shared words.
        take_all: Whether every candidate is taken (nothing to decide).
    """
    if thread >= RADIX_BUCKETS or take_all:
        return
    var above = UInt32(lane.result())
    if above < state.need and state.need <= above + state.count:
        var digit = UInt32(RADIX_BUCKETS - 1 - thread)
        s.store(_STATE, state.prefix | (digit << UInt32(_shift(p))))
        s.store(_STATE + 1, state.need - above)


def _count[
    k: Int, p: Int
](thread: Int, mut state: SelectState, s: Shared, row: Row, take_all: Bool,):
    """Pass `p`'s count: this thread's keys that match the prefix, by digit.

    Pass `p > 0` first takes the state the previous pass's decision
    recorded; the other histogram is cleared for the next pass.

    Parameters:
        k: Ids per output row.
        p: The pass.

    Args:
        thread: The thread.
        state: The thread's registers.
        s: The block's shared words.
        row: The block's row.
        take_all: Whether every candidate is taken (nothing to count).
    """
    comptime hist = _HIST + (p % 2) * RADIX_BUCKETS
    comptime other = _HIST + ((p + 1) % 2) * RADIX_BUCKETS
    if thread < RADIX_BUCKETS:
        s.store(other + thread, 0)
    if take_all:
        return
    comptime if p > 0:
        state.prefix = s.load(_STATE)
        state.need = s.load(_STATE + 1)
    comptime shift = _shift(p)
    # The bits above this pass's digit (none in pass 0).
    comptime mask = UInt32(
        (UInt64(0xFFFFFFFF) << UInt64(shift + DIGIT_BITS)) & 0xFFFFFFFF
    )
    for j in range(thread, row.bound, SELECT_THREADS):
        var key = row.key[k](s, j)
        if key & mask == state.prefix:
            var digit = Int((key >> UInt32(shift)) & (RADIX_BUCKETS - 1))
            _ = s.atomic_add(hist + digit, 1)


@always_inline
def _run(thread: Int, bound: Int) -> Tuple[Int, Int]:
    """Thread `thread`'s contiguous run of ids `[lo, hi)` in the collect."""
    var per = (bound + SELECT_THREADS - 1) // SELECT_THREADS
    var lo = min(thread * per, bound)
    return (lo, min(lo + per, bound))


@always_inline
def _selected(key: UInt32, threshold: UInt32, take_all: Bool) -> Int:
    """2 above the k-th key (or any key when all are taken), 1 at it, 0."""
    if take_all or key > threshold:
        return 2
    return 1 if key == threshold else 0


def _count_run[
    k: Int
](
    thread: Int,
    mut state: SelectState,
    mut lane: Lane,
    s: Shared,
    row: Row,
    take_all: Bool,
):
    """Takes the k-th key `K` and `need`, then offers this run's counts of
    keys above `K` (high 32 bits) and at it (low 32 bits)."""
    if not take_all:
        state.prefix = s.load(_STATE)
        state.need = s.load(_STATE + 1)
    var above: UInt64 = 0
    var ties: UInt64 = 0
    var run = _run(thread, row.bound)
    for j in range(run[0], run[1]):
        var kind = _selected(row.key[k](s, j), state.prefix, take_all)
        if kind == 2:
            above += 1
        elif kind == 1:
            ties += 1
    lane.offer(above << 32 | ties)


def _scatter_run[
    k: Int
](
    thread: Int,
    state: SelectState,
    mut lane: Lane,
    s: Shared,
    row: Row,
    m: Int,
    take_all: Bool,
):
    """Writes this thread's selected pairs, and pads the pairs to the sort's
    width: the keys above `K` first, in id order; the `need` lowest ids at
    `K` after all `m - need` of them."""
    var before = lane.result()
    var at = Int(before >> 32)
    var tie = Int(before & 0xFFFFFFFF)
    var need = 0 if take_all else Int(state.need)
    var above_total = m - need
    var run = _run(thread, row.bound)
    for j in range(run[0], run[1]):
        var key = row.key[k](s, j)
        var kind = _selected(key, state.prefix, take_all)
        var slot = -1
        if kind == 2:
            slot = at
            at += 1
        elif kind == 1:
            if tie < need:
                slot = above_total + tie
            tie += 1
        if slot >= 0:
            s.store(_PAIRS + slot, key)
            s.store(_PAIRS + sort_width(k) + slot, row.id[k](s, j))
    # Padding ranks after every pair: key 0 (no score), the largest id.
    for i in range(m + thread, next_power_of_two(max(m, 1)), SELECT_THREADS):
        s.store(_PAIRS + i, 0)
        s.store(_PAIRS + sort_width(k) + i, 0xFFFFFFFF)


@always_inline
def _after(key_a: UInt32, id_a: UInt32, key_b: UInt32, id_b: UInt32) -> Bool:
    """Whether pair a ranks after pair b (lower key, or equal and higher id)."""
    return key_a < key_b or (key_a == key_b and id_a > id_b)


@always_inline
def _bitonic_step[k: Int](thread: Int, step: Int, s: Shared, m: Int):
    """Compare-exchange step `step` of the bitonic sort of the pairs.

    Steps run stage by stage (`size` = 2, 4, .., `sort_width(k)`), each
    stage from `stride = size / 2` down to 1; the steps of stages past
    `next_power_of_two(m)` do nothing, since the pairs that matter are
    sorted by then. A thread takes compared pairs `c = thread, thread +
    512, ..`: `c` with a 0 bit inserted at `stride` is the lower index.

    Parameters:
        k: Ids per output row.

    Args:
        thread: The thread.
        step: The step, `0 ..< _sort_steps(k)`.
        s: The block's shared words.
        m: Pairs selected, `min(k, bound)`.
    """
    var size = 2
    var left = step
    while left >= log2_floor(size):
        left -= log2_floor(size)
        size *= 2
    var width = next_power_of_two(max(m, 1))
    if size > width:
        return
    var stride = size >> (left + 1)
    comptime ids = _PAIRS + sort_width(k)
    for c in range(thread, width // 2, SELECT_THREADS):
        var i = ((c & ~(stride - 1)) << 1) | (c & (stride - 1))
        var j = i + stride
        var ka = s.load(_PAIRS + i)
        var ia = s.load(ids + i)
        var kb = s.load(_PAIRS + j)
        var ib = s.load(ids + j)
        # Best first within blocks of `size` whose bit `size` is 0, worst
        # first in the others; the last stage sorts the whole area.
        if _after(ka, ia, kb, ib) == ((i & size) == 0):
            s.store(_PAIRS + i, kb)
            s.store(ids + i, ib)
            s.store(_PAIRS + j, ka)
            s.store(ids + j, ia)
