"""A pick: one block's top `k` of a row's scores (or of the candidates a
split row's last block compacted) into shared memory, unsorted: the load,
radix select and collect of the GPU select (`select` has the whole
select and its docs: the split, the sort, the output).

A pick runs the phases of `PICK_PHASES` (`grid/phases`): the load (a row
of at most `CACHE_WORDS` keys into shared memory), 4 radix passes of 8
bits (count with shared atomics, offer the bucket counts to a block
exclusive prefix sum, decide the k-th key's bucket), the collect's count
(a block exclusive prefix sum of each thread's counts above and at the
k-th key) and its scatter of the (key, id) pairs.

**Shared memory** is `SelectShared`'s named buffers: the pass state, the
split select's state, two radix histograms, the pairs' keys and ids (a
split row's compaction counts over both before the pick), then the row
cache (`row_cache_words`).
"""

from std.bit import next_power_of_two
from std.math import max, min
from std.reflection import call_location

from ...grid.block_phases import (
    BLOCK_EXCLUSIVE_SUM,
    SHARED_CHECKED,
    BlockShared,
    Lane,
    Shared,
)
from ...grid.collectives import thread_run
from ...grid.phases import Phase, Phases
from ...grid.shared_buffer import Buffer, SharedBuffer
from ...grid.ragged import Field
from ..rank import score_order


comptime SELECT_THREADS = 512
"""Threads per row block: 16 warps, 8 wave64."""


comptime DIGIT_BITS = 8
"""Bits of the key fixed per radix pass."""


comptime RADIX_BUCKETS = 1 << DIGIT_BITS
"""Buckets of one digit."""


comptime RADIX_PASSES = 32 // DIGIT_BITS
"""Radix passes over a 32-bit key."""


comptime CACHE_WORDS = 8192
"""The longest row kept in shared memory (32 KiB of keys)."""


comptime _STATE = 0
"""(prefix, need): the bits of the k-th key fixed so far, and how many keys
with that prefix the top k still takes."""


comptime WIDE_STATE = _STATE + 2
"""A split row's (threshold bucket, candidates at or above it): what its
last block decided from the row's wide histogram (`select`)."""


comptime HISTOGRAMS = WIDE_STATE + 2
"""The radix histograms' first word: pass `p` counts digit `d` at
`HISTOGRAMS + (p % 2) * RADIX_BUCKETS + d`."""


comptime PAIRS = HISTOGRAMS + 2 * RADIX_BUCKETS
"""The pairs' keys (`sort_width(k)` words), then their ids."""


comptime PICK_PHASES = Phases(Phase("load")).then(
    Phases(
        Phase("count"), Phase("offer", BLOCK_EXCLUSIVE_SUM), Phase("decide")
    ).repeat(RADIX_PASSES)
).then(Phases(Phase("collect", BLOCK_EXCLUSIVE_SUM), Phase("scatter")))
"""A pick's phases (`pick_phase`): the load; per radix pass a count, an
offer of the bucket counts to a block exclusive prefix sum and a decision;
the collect's count, offered to another, and its scatter."""


@always_inline
def sort_width(k: Int) -> Int:
    """The pairs' area: the smallest power of two at least `k`.

    Args:
        k: Ids per output row.
    """
    return next_power_of_two(k)


def cache_start(k: Int) -> Int:
    """Shared words before the row cache: state, histograms, pairs."""
    return PAIRS + 2 * sort_width(k)


def kept_counts_words(k: Int) -> Int:
    """Words of `SelectLayout.kept_counts`: the histograms and the pairs.

    Args:
        k: Ids per output row.
    """
    return cache_start(k) - HISTOGRAMS


def row_cache_words(candidates: Int) -> Int:
    """Words of row cache for rows of `candidates` columns.

    Args:
        candidates: The workspace's row width (the longest row).
    """
    return min(max(candidates, 0), CACHE_WORDS)


comptime STATE_PREFIX = 0
"""`SelectShared.state`'s word of the bits of the k-th key fixed so far."""

comptime STATE_NEED = 1
"""`SelectShared.state`'s word of how many keys with that prefix the top
k still takes."""

comptime WIDE_BUCKET = 0
"""`SelectShared.wide_state`'s word of a split row's threshold bucket."""

comptime WIDE_KEPT = 1
"""`SelectShared.wide_state`'s word of the candidates at or above it."""


comptime SelectShared[k: Int] = SelectLayout[MutAnyOrigin, k]
"""The select's shared memory, as its phases name it."""


@fieldwise_init
struct SelectLayout[origin: MutOrigin, k: Int](TrivialRegisterPassable):
    """The select's shared memory by name, for `k` and a launch's row
    cache of `cache_words` (`select.select_shared_words` sizes it all).

    Parameters:
        origin: Origin of the view's pointers (`MutAnyOrigin`:
            `SelectShared`).
        k: Ids per output row.
    """

    var s: BlockShared[Self.origin, SHARED_CHECKED]
    """The block's words."""
    var cache_words: Int
    """Words of row cache (`row_cache_words` of the workspace's width)."""

    @always_inline
    def histogram(self, p: Int) -> SharedBuffer[Self.origin, "histogram"]:
        """Radix pass `p`'s count by digit (two alternate: one is cleared
        while the other is read)."""
        return SharedBuffer[Self.origin, "histogram"](
            self.s, HISTOGRAMS + (p % 2) * RADIX_BUCKETS, RADIX_BUCKETS
        )

    @always_inline
    def state(self) -> SharedBuffer[Self.origin, "state"]:
        """The pass state: `STATE_PREFIX`, `STATE_NEED`."""
        return SharedBuffer[Self.origin, "state"](self.s, _STATE, 2)

    @always_inline
    def wide_state(self) -> SharedBuffer[Self.origin, "wide_state"]:
        """A split row's decision: `WIDE_BUCKET`, `WIDE_KEPT`."""
        return SharedBuffer[Self.origin, "wide_state"](self.s, WIDE_STATE, 2)

    @always_inline
    def pair_keys(self) -> SharedBuffer[Self.origin, "pair_keys"]:
        """The picked pairs' keys (`sort_width(k)`, padded for the sort)."""
        return SharedBuffer[Self.origin, "pair_keys"](
            self.s, PAIRS, sort_width(Self.k)
        )

    @always_inline
    def pair_ids(self) -> SharedBuffer[Self.origin, "pair_ids"]:
        """The picked pairs' ids, beside their keys."""
        return SharedBuffer[Self.origin, "pair_ids"](
            self.s, PAIRS + sort_width(Self.k), sort_width(Self.k)
        )

    @always_inline
    def kept_counts(self) -> SharedBuffer[Self.origin, "kept_counts"]:
        """A split row's compaction counts (`select`), over the histograms
        and the pairs: free until the pick's load."""
        return SharedBuffer[Self.origin, "kept_counts"](
            self.s, HISTOGRAMS, kept_counts_words(Self.k)
        )

    @always_inline
    def row_keys(self) -> SharedBuffer[Self.origin, "row_keys"]:
        """The row cache: a row's keys (a compacted row's in its first
        half, `row_ids` after)."""
        return SharedBuffer[Self.origin, "row_keys"](
            self.s, cache_start(Self.k), self.cache_words
        )

    @always_inline
    def row_ids(self) -> SharedBuffer[Self.origin, "row_ids"]:
        """A compacted row's ids: the row cache's second half."""
        var half = self.cache_words // 2
        return SharedBuffer[Self.origin, "row_ids"](
            self.s, cache_start(Self.k) + half, half
        )

    @always_inline
    def wide_histogram(self) -> SharedBuffer[Self.origin, "wide_histogram"]:
        """A split row's count by wide digit, in the row cache before its
        compaction (`select._wide_word` places the buckets)."""
        return SharedBuffer[Self.origin, "wide_histogram"](
            self.s, cache_start(Self.k), self.cache_words
        )


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
    var selects: Bool
    """Whether this block selects its row: an unsplit row's block, or the
    last of a split row's blocks to arrive."""
    var bound: UInt32
    """The row's candidates, read from the plan in the first phase (every
    later phase would read the same two words again after its barrier)."""

    def __init__(out self):
        """Before the first pass."""
        self.prefix = 0
        self.need = 0
        self.count = 0
        self.pairs = 0
        self.selects = False
        self.bound = 0


@fieldwise_init
struct PickCandidates[origin: MutOrigin](Copyable, TrivialRegisterPassable):
    """What one pick reads, as a select phase receives it: a row's scores,
    or candidates already compacted into the row cache.

    Parameters:
        origin: Origin of the pointers (`MutAnyOrigin` in the kernels: a
            struct's pointer fields must name a parameter).
    """

    var scores: Field[DType.float32, Self.origin]
    """The row's scores, `bound` of them (unread when compacted)."""
    var bound: Int
    """Candidates of the pick, at least 0."""
    var cache: Int
    """Words of row cache this launch has (`select_shared_words`)."""
    var compact: Bool
    """Whether the candidates are in shared memory already, in id order:
    keys in the row cache's first half, ids in its second."""

    @always_inline
    def cached(self) -> Bool:
        """Whether the pick's keys are in shared memory."""
        return self.compact or self.bound <= self.cache

    @always_inline
    def key[k: Int](self, shared: SelectShared[k], j: Int) -> UInt32:
        """Candidate `j`'s key, from the cache or from global memory (the
        profile's site is the caller's line)."""
        var site = call_location()
        if self.cached():
            return shared.row_keys().load_at(site, j)
        return score_order(shared.s.global_load_at(site, self.scores, j))

    @always_inline
    def id[k: Int](self, shared: SelectShared[k], j: Int) -> UInt32:
        """Candidate `j`'s id: its place in the row, or (compacted) the id
        kept beside its key."""
        if self.compact:
            return shared.row_ids().load(j)
        return UInt32(j)


@always_inline
def _shift(p: Int) -> Int:
    """The lowest bit of pass `p`'s digit."""
    return 32 - DIGIT_BITS * (p + 1)


@always_inline
def pick_phase[
    phase: Int, k: Int
](
    thread: Int,
    mut state: SelectState,
    mut lane: Lane,
    s: Shared,
    row: PickCandidates[MutAnyOrigin],
):
    """One thread's share of phase `phase` of a pick of `row`'s top `k`
    into the pairs (steps 1-3 of the select).

    1. **Load**: a row of at most `CACHE_WORDS` candidates is read from
       global memory once, as its `score_order` keys, into shared memory
       (sized at launch from the workspace's row width); a longer row is
       read from global memory in each pass instead.
    2. **Radix select** of the k-th largest key, 8 bits at a time from the
       top (4 passes of 3 phases). *Count*: every thread adds the digits
       of its keys (ids `t, t + 512, ..`) that match the prefix fixed so
       far to a shared histogram of 256 buckets with `atomic_add` (two
       histograms alternate, so one is cleared while the other is read).
       *Offer*: thread `t < 256` offers bucket `255 - t`'s count to a
       block exclusive prefix sum: its result is the number of matching
       keys in higher buckets. *Decide*: the one thread whose bucket holds
       the `need`-th key records the longer prefix and what is left of
       `need`. After 4 passes the block knows the k-th key `K` and how
       many keys equal to `K` the top k takes.
    3. **Collect** (2 phases): each thread owns a contiguous run of ids
       and offers its count of keys above `K` and at `K` (packed in one
       64-bit value) to a block exclusive prefix sum; then writes its
       selected (key, id) pairs to their places: keys above `K` in id
       order, then the lowest-id `need` keys at `K` after all `m - need`
       of them. Ties are taken in id order because the runs are.

    Parameters:
        phase: The phase of `PICK_PHASES`.
        k: Ids per output row.

    Args:
        thread: The thread.
        state: The thread's registers.
        lane: The thread's lane in the collectives (`PICK_PHASES`).
        s: The block's shared words.
        row: The pick's candidates.
    """
    comptime assert (
        RADIX_BUCKETS <= SELECT_THREADS
    ), "a bucket per thread in the offer"
    var m = min(k, row.bound)
    # Every candidate is taken: no radix passes, no threshold.
    var take_all = row.bound <= k
    var shared = SelectShared[k](s, row.cache)
    comptime table = PICK_PHASES
    # The radix pass of a count, an offer or a decision.
    comptime p = table.round(phase)
    comptime if table.named(phase, "load"):
        if thread < RADIX_BUCKETS:
            shared.histogram(0).store(thread, 0)
        if row.cached() and not row.compact:
            var keys = shared.row_keys()
            for j in range(thread, row.bound, SELECT_THREADS):
                keys.store(j, score_order(s.global_load(row.scores, j)))
        state.prefix = 0
        state.need = UInt32(m)
        state.pairs = UInt32(m)
    elif table.named(phase, "count"):
        _count[k, p](thread, state, shared, row, take_all)
    elif table.named(phase, "offer"):
        state.count = 0
        if thread < RADIX_BUCKETS and not take_all:
            state.count = shared.histogram(p).load(RADIX_BUCKETS - 1 - thread)
        lane.offer(UInt64(state.count))
    elif table.named(phase, "decide"):
        _decide[p](thread, state, lane, shared.state(), take_all)
    elif table.named(phase, "collect"):
        _count_run[k](thread, state, lane, shared, row, take_all)
    else:
        _scatter_run[k](thread, state, lane, shared, row, m, take_all)


@always_inline
def _decide[
    p: Int
](
    thread: Int,
    state: SelectState,
    mut lane: Lane,
    words: Buffer["state"],
    take_all: Bool,
):
    """Pass `p`'s decision: the thread whose bucket holds the `need`-th key
    records the prefix with that bucket's digit and the keys still needed.

    Parameters:
        p: The pass.

    Args:
        thread: The thread; bucket `255 - thread` is its own.
        state: The thread's registers (its bucket's count).
        lane: The offer's result: matching keys in higher buckets.
        words: The pass state.
        take_all: Whether every candidate is taken (nothing to decide).
    """
    if thread >= RADIX_BUCKETS or take_all:
        return
    var above = UInt32(lane.result())
    if above < state.need and state.need <= above + state.count:
        var digit = UInt32(RADIX_BUCKETS - 1 - thread)
        words.store(STATE_PREFIX, state.prefix | (digit << UInt32(_shift(p))))
        words.store(STATE_NEED, state.need - above)


@always_inline
def _count[
    k: Int, p: Int
](
    thread: Int,
    mut state: SelectState,
    shared: SelectShared[k],
    row: PickCandidates[MutAnyOrigin],
    take_all: Bool,
):
    """Pass `p`'s count: this thread's keys that match the prefix, by digit.

    Pass `p > 0` first takes the state the previous pass's decision
    recorded; the other histogram is cleared for the next pass. The
    histogram's atomics fall on the digits the scores have: keys that
    share a digit serialize on its word (every lane of a warp, where a
    row's scores cluster), and distinct digits may share a bank; no
    layout avoids what the data decides.

    Parameters:
        k: Ids per output row.
        p: The pass.

    Args:
        thread: The thread.
        state: The thread's registers.
        shared: The block's shared memory.
        row: The block's row.
        take_all: Whether every candidate is taken (nothing to count).
    """
    var hist = shared.histogram(p)
    if thread < RADIX_BUCKETS:
        shared.histogram(p + 1).store(thread, 0)
    if take_all:
        return
    comptime if p > 0:
        state.prefix = shared.state().load(STATE_PREFIX)
        state.need = shared.state().load(STATE_NEED)
    comptime shift = _shift(p)
    # The bits above this pass's digit (none in pass 0).
    comptime mask = UInt32(
        (UInt64(0xFFFFFFFF) << UInt64(shift + DIGIT_BITS)) & 0xFFFFFFFF
    )
    for j in range(thread, row.bound, SELECT_THREADS):
        var key = row.key[k](shared, j)
        if key & mask == state.prefix:
            var digit = Int((key >> UInt32(shift)) & (RADIX_BUCKETS - 1))
            _ = hist.atomic_add(digit, 1)


@always_inline
def _selected(key: UInt32, threshold: UInt32, take_all: Bool) -> Int:
    """2 above the k-th key (or any key when all are taken), 1 at it, 0."""
    if take_all or key > threshold:
        return 2
    return 1 if key == threshold else 0


@always_inline
def _count_run[
    k: Int
](
    thread: Int,
    mut state: SelectState,
    mut lane: Lane,
    shared: SelectShared[k],
    row: PickCandidates[MutAnyOrigin],
    take_all: Bool,
):
    """Takes the k-th key `K` and `need`, then offers this run's counts of
    keys above `K` (high 32 bits) and at it (low 32 bits)."""
    if not take_all:
        state.prefix = shared.state().load(STATE_PREFIX)
        state.need = shared.state().load(STATE_NEED)
    var above: UInt64 = 0
    var ties: UInt64 = 0
    var run = thread_run[odd=True](thread, SELECT_THREADS, row.bound)
    for j in range(run[0], run[1]):
        var kind = _selected(row.key[k](shared, j), state.prefix, take_all)
        if kind == 2:
            above += 1
        elif kind == 1:
            ties += 1
    lane.offer(above << 32 | ties)


@always_inline
def _scatter_run[
    k: Int
](
    thread: Int,
    state: SelectState,
    mut lane: Lane,
    shared: SelectShared[k],
    row: PickCandidates[MutAnyOrigin],
    m: Int,
    take_all: Bool,
):
    """Writes this thread's selected pairs, and pads the pairs to the sort's
    width: the keys above `K` first, in id order; the `need` lowest ids at
    `K` after all `m - need` of them.

    The pair stores land where the scores put them (each thread at its
    own offsets), and a compacted row's ids are read only for the keys
    selected, so a warp's lanes may share banks at both: up to 4-way in
    the profile at DeepSeek-V3.2's decode, a few hundred requests a row.
    Writing in id order is what lets the rank sort's ties fall to the
    lower id without another key.
    """
    var before = lane.result()
    var at = Int(before >> 32)
    var tie = Int(before & 0xFFFFFFFF)
    var need = 0 if take_all else Int(state.need)
    var above_total = m - need
    var run = thread_run[odd=True](thread, SELECT_THREADS, row.bound)
    for j in range(run[0], run[1]):
        var key = row.key[k](shared, j)
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
            shared.pair_keys().store(slot, key)
            shared.pair_ids().store(slot, row.id[k](shared, j))
    # Padding ranks after every pair: key 0 (no score), the largest id.
    for i in range(m + thread, next_power_of_two(max(m, 1)), SELECT_THREADS):
        shared.pair_keys().store(i, 0)
        shared.pair_ids().store(i, 0xFFFFFFFF)
