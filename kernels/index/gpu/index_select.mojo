"""The GPU top-k select of the indexer: one block per score row.

Input: a row of float32 scores (candidate `j` at column `j`, `bound`
candidates) in a workspace; output: the row's `m = min(k, bound)` ids in
descending score order, ties by ascending id, then `-1` (the contract of
`index_top_k`, with NaN ranking as `-inf`, below every number).

A block of `SELECT_THREADS` (512) threads selects one row, in phases of
the kernel model (`model/block_phases`: compile-time phases, per-thread
state in registers, shared-memory atomics, block collectives), each phase
below followed by a barrier. Steps 1-3 are a *pick* (`index_pick`): the
row's top `k` into shared memory, unsorted.

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
4. **Split rows** (a call of fewer than `SPLIT_ROWS` rows, `select_slices`
   blocks per row): each block picks from a slice of the row, publishes
   its pick to a global workspace and arrives at the row's counter
   (`block_phases.arrive`); a block maximum tells the last to arrive,
   which picks the top `k` of the picks (keys above each slice's own
   threshold, then its ties, slices in id order: among equal keys, id
   order), re-zeroes the counter, and goes on alone. At GLM-5-Next's
   decode (16 rows of 8,192 candidates, k 512) that is 4 blocks per row.
5. **Sort** by key descending, id ascending, and write the ids (then
   `-1`). For `k <= RANK_SORT_K` one phase ranks by counting: a thread
   per pair counts the pairs that rank before it (every thread reads the
   same pair at once, a broadcast) and writes its id at that rank, no
   barrier between. For a larger `k`, a bitonic sort of the `m` pairs
   padded to `S = next_power_of_two(m)`: the compare-exchange steps of
   stages up to `S` (the steps of larger stages, up to `sort_width(k)`,
   do nothing), then a phase writes the ids.

Grid: `select_slices` blocks per row, on the x axis (2^31 - 1 blocks).
Radix select, bitonic sort and ranking by counting are the textbook GPU
methods (Alabi et al.,
"Fast k-selection algorithms for graphics processing units", 2012;
Batcher's bitonic sorter, 1968); a wide first digit counted with shared
atomics and refined only inside the bucket that holds the k-th key is how
the fast GPU top-k kernels count (FlashInfer's `RadixTopK`, MAX's
`nn.topk_bitonic`), and a row split over blocks with a merge of their
picks is how they fill a GPU with few rows.

**Shared memory** (`select_shared_words`, sized at launch): two
histograms (2 x 256 words), the state (2 words), the pairs (2 x
`sort_width(k)` words), the row cache (the workspace's row width, at most
`CACHE_WORDS`), and the block collectives' 33 words (16 64-bit partials
from an even word): 9,763 words (39,052 bytes) for k 512 at the
GLM-5-Next decode shape, 12,835 (51,340 bytes, past the 48 KiB of static
shared memory, within an MI300X workgroup's 64 KiB) for k 2048.
"""

from std.bit import log2_floor, next_power_of_two
from std.math import max, min

from ...model.block_phases import (
    BLOCK_MAX,
    NO_COLLECTIVE,
    Lane,
    Shared,
    acquire_fence,
    arrive,
    publish_fence,
    read_published,
)
from ...model.ragged import Field, Ptr
from ..index_rank import ordered_rank_key
from .index_pick import (
    CACHE_WORDS,
    PAIRS,
    PICK_PHASES,
    SELECT_THREADS,
    Row,
    SelectState,
    cache_start,
    pick_collective,
    pick_phase,
    row_cache_words,
    sort_width,
    split_count,
    split_ids,
    split_keys,
    split_words,
)


comptime SPLIT_ROWS = 128
"""A window of fewer rows than this splits each row over several blocks."""


comptime MAX_SLICES = 8
"""The most blocks a row is split over."""


comptime RANK_SORT_K = 512
"""The largest `k` whose pairs are sorted by ranking (one phase of `m`
compares per pair) rather than by a bitonic sort (`log2(k) (log2(k) +
1) / 2` phases, a barrier each): GLM-5-Next's 512 takes 1 phase, not 45."""


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


def _sort_steps(k: Int) -> Int:
    """Compare-exchange phases of the bitonic sort of `sort_width(k)` pairs
    (none when `k <= RANK_SORT_K`: the write ranks them).

    Args:
        k: Ids per output row.
    """
    if k <= RANK_SORT_K:
        return 0
    var n = log2_floor(sort_width(k))
    return n * (n + 1) // 2


def select_phases(k: Int) -> Int:
    """Phases of the select for `k`: a pick, publish, arrive, a pick of the
    picks, the sort steps and the write.

    Args:
        k: Ids per output row, `1 ..= TOP_K_LIMIT`.
    """
    return _FIRST_SORT_STEP + _sort_steps(k) + 1


def select_collective(phase: Int) -> Int:
    """The collective after `phase`: the picks' prefix sums, and a block
    maximum after the arrival (which block of a split row is last).

    Args:
        phase: The phase.
    """
    if phase < PICK_PHASES:
        return pick_collective(phase)
    if phase == _ARRIVE:
        return BLOCK_MAX
    if _MERGE <= phase < _MERGE + PICK_PHASES:
        return pick_collective(phase - _MERGE)
    return NO_COLLECTIVE


def select_shared_words(k: Int, candidates: Int) -> Int:
    """Shared words of a select launch over rows of `candidates` columns.

    Args:
        k: Ids per output row.
        candidates: The workspace's row width (the longest row).
    """
    return cache_start(k) + row_cache_words(candidates)


def select_max_words(k: Int) -> Int:
    """The most shared words a select launch for `k` uses."""
    return cache_start(k) + CACHE_WORDS


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
            bound += Int(read_published(split, split_count(v)))
    return Row(
        Ptr[DType.float32](unsafe_from_address=none),
        bound,
        0,
        row_cache_words(width),
        split,
        slices,
        True,
    )


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
        pick_phase[phase, k](thread, state, lane, s, row)
    elif phase == _PUBLISH:
        if split:
            var m = Int(state.pairs)
            var keys = whole.split.unsafe_offset(
                split_keys(whole.slices, k, slice)
            )
            var ids = whole.split.unsafe_offset(
                split_ids(whole.slices, k, slice)
            )
            for i in range(thread, m, SELECT_THREADS):
                keys[unsafe_offset=i] = s.load(PAIRS + i)
                ids[unsafe_offset=i] = s.load(PAIRS + sort_width(k) + i)
            if thread == 0:
                whole.split[unsafe_offset=split_count(slice)] = UInt32(m)
            publish_fence()
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
            if state.merging:
                acquire_fence()
            if state.merging and thread == 0:
                # Every slice has arrived: ready for the next window.
                whole.split[unsafe_offset=0] = 0
        if state.merging:
            var row = merge_row(
                whole.width, whole.slices, whole.split, state.merging
            )
            pick_phase[p, k](thread, state, lane, s, row)
        elif pick_collective(p) != NO_COLLECTIVE:
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
        comptime if k <= RANK_SORT_K:
            _rank_write[k](thread, s, m, whole.ids)
            return
        for i in range(thread, k, SELECT_THREADS):
            var id = Int32(-1)
            if i < m:
                id = Int32(s.load(PAIRS + sort_width(k) + i))
            whole.ids[unsafe_offset=i] = id


def _rank_write[
    k: Int
](thread: Int, s: Shared, m: Int, ids: Field[DType.int32, MutAnyOrigin]):
    """Writes each of the `m` pairs' id at its rank, then `-1` up to `k`.

    A pair's rank is the number of pairs that rank before it: each thread
    takes pairs `i = thread, thread + SELECT_THREADS, ..` and compares
    their `ordered_rank_key`s with all `m` (the threads of a warp read the
    same pair at once). Ids are distinct, so the ranks are, and every
    output place is written once.

    Parameters:
        k: Ids per output row, at most `RANK_SORT_K`.

    Args:
        thread: The thread.
        s: The block's shared words (the pairs).
        m: Pairs selected, `min(k, bound)`.
        ids: The row's `k` output ids.
    """
    comptime id_at = PAIRS + sort_width(k)
    for i in range(thread, m, SELECT_THREADS):
        var id = s.load(id_at + i)
        var mine = ordered_rank_key(s.load(PAIRS + i), id)
        var rank = 0
        for j in range(m):
            if ordered_rank_key(s.load(PAIRS + j), s.load(id_at + j)) > mine:
                rank += 1
        ids[unsafe_offset=rank] = Int32(id)
    for i in range(m + thread, k, SELECT_THREADS):
        ids[unsafe_offset=i] = -1


@always_inline
def _after(key_a: UInt32, id_a: UInt32, key_b: UInt32, id_b: UInt32) -> Bool:
    """Whether pair a ranks after pair b (lower key, or equal and higher id)."""
    return ordered_rank_key(key_a, id_a) < ordered_rank_key(key_b, id_b)


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
    comptime ids = PAIRS + sort_width(k)
    for c in range(thread, width // 2, SELECT_THREADS):
        var i = ((c & ~(stride - 1)) << 1) | (c & (stride - 1))
        var j = i + stride
        var ka = s.load(PAIRS + i)
        var ia = s.load(ids + i)
        var kb = s.load(PAIRS + j)
        var ib = s.load(ids + j)
        # Best first within blocks of `size` whose bit `size` is 0, worst
        # first in the others; the last stage sorts the whole area.
        if _after(ka, ia, kb, ib) == ((i & size) == 0):
            s.store(PAIRS + i, kb)
            s.store(ids + i, ib)
            s.store(PAIRS + j, ka)
            s.store(ids + j, ia)
