"""The GPU top-k select of the indexer: one block per score row, or several.

Input: a row of float32 scores (candidate `j` at column `j`, `bound`
candidates) in a workspace; output: the row's `m = min(k, bound)` ids in
descending score order, ties by ascending id, then `-1` (the contract of
`index_top_k`, with NaN ranking as `-inf`, below every number).

A block of `SELECT_THREADS` (512) threads selects one row, in the phases
of `select_phases` (`grid/phases`; per-thread state in registers,
shared-memory atomics, block collectives), each followed by a barrier
(`select_phase` walks through them):

1-3. a *pick* (`pick.pick_phase`: load, radix select, collect): the row's
   top `k` into shared memory, unsorted;
4. for a split row, before the pick, its blocks count it together and the
   last to arrive alone goes on, over the row's compacted candidates
   where they fit the row cache (`_split_phase`);
5. a sort by key descending, id ascending, and the write of the ids, then
   `-1`: by ranking up to `RANK_SORT_PAIRS` pairs, else a bitonic sort.

Grid: `select_slices` blocks per row, on the x axis (2^31 - 1 blocks).
Shared memory: `select_shared_words` (sized at launch), at most
`select_max_words`. Two launches of a split select share its workspace
words (`split_words`): the last block re-zeroes them for the next.
"""

from std.bit import log2_floor, next_power_of_two
from std.math import ceildiv, max, min

from ...grid.block_phases import (
    BLOCK_EXCLUSIVE_SUM,
    BLOCK_MAX,
    NO_COLLECTIVE,
    Lane,
    Shared,
    acquire_fence,
    arrive,
    publish_add,
    publish_fence,
    read_published,
)
from ...grid.phases import Phase, Phases
from ...grid.ragged import Field
from ...grid.shared_buffer import Buffer
from ..rank import ordered_rank_key, score_order
from .compaction import Compaction, compaction_pass
from .pick import (
    CACHE_WORDS,
    PICK_PHASES,
    SELECT_THREADS,
    WIDE_BUCKET,
    WIDE_KEPT,
    PickCandidates,
    SelectShared,
    SelectState,
    cache_start,
    pick_phase,
    row_cache_words,
    sort_width,
)


comptime SPLIT_ROWS = 128
"""A call of fewer query rows than this (all its windows) splits each
long row over blocks."""


comptime SPLIT_BLOCKS = 256
"""The blocks a split launch aims at: one wave of an H100's or H200's 132
SMs at 2 select blocks each (3 fit at 40 registers or fewer: `gpu-report`
has the registers as compiled)."""


comptime MAX_SLICES = 16
"""The most blocks a row is split over: 16 rows (a decode call of 16
requests) make `SPLIT_BLOCKS`; a split row has at least 4,096 candidates,
so a block counts at least 256."""


comptime WIDE_BITS = 12
"""Bits of a split row's first digit, counted by all its blocks."""


comptime WIDE_BUCKETS = 1 << WIDE_BITS
"""Buckets of the wide digit: 4,096 words, in the row cache."""


comptime SPLIT_MIN_CANDIDATES = WIDE_BUCKETS
"""The shortest workspace row that is split (its row cache holds the wide
histogram)."""


comptime _BUCKETS_PER_THREAD = WIDE_BUCKETS // SELECT_THREADS


comptime RANK_SORT_PAIRS = 256
"""The most pairs sorted by ranking (one phase, `m` compares a pair) rather
than by a bitonic sort (`log2(S) (log2(S) + 1) / 2` phases of a
compare-exchange each, `S = next_power_of_two(m)`). An estimate of issue
slots, unmeasured on a GPU: at 512 pairs ranking issues 512 compares a
thread in 16 warps, the sort 45 steps in 8."""


comptime SPLIT_PHASES = Phases(
    Phase("clear"),
    Phase("count_wide"),
    Phase("flush"),
    Phase("arrive", BLOCK_MAX),
    Phase("take"),
    Phase("offer_wide", BLOCK_EXCLUSIVE_SUM),
    Phase("decide_wide"),
    Phase("filter", BLOCK_EXCLUSIVE_SUM),
    Phase("compact"),
)
"""A split row's count and compaction before the pick (step 4,
`_split_phase`): a block maximum after the arrival tells the last block,
block exclusive prefix sums place the wide buckets and the kept runs."""


def select_slices(candidates: Int, total_tokens: Int, k: Int) -> Int:
    """Blocks each row's select is split over: 1 unless the call has few
    rows (`SPLIT_ROWS`) of at least `SPLIT_MIN_CANDIDATES` and `4 k`
    candidates, then `MAX_SLICES`, fewer where the call has more than 16
    rows (`SPLIT_BLOCKS` in all; at least 2 below `SPLIT_ROWS`).
    `mla_kpool._limits.select_slices` is the Python twin.

    Args:
        candidates: The workspace's row width (the longest row).
        total_tokens: Query rows of the call.
        k: Ids per output row.
    """
    if total_tokens >= SPLIT_ROWS or candidates < max(
        SPLIT_MIN_CANDIDATES, 4 * k
    ):
        return 1
    return min(MAX_SLICES, SPLIT_BLOCKS // max(total_tokens, 1))


def split_words(slices: Int) -> Int:
    """`UInt32` words of the split workspace per window row: an arrival
    counter and the row's wide histogram (`WIDE_BUCKETS`); none unsplit.

    Args:
        slices: `select_slices` of the call.
    """
    if slices <= 1:
        return 0
    return 1 + WIDE_BUCKETS


def _sort_steps(k: Int) -> Int:
    """Compare-exchange phases of the bitonic sort of `sort_width(k)` pairs
    (none when `k <= RANK_SORT_PAIRS`: the write ranks them).

    Args:
        k: Ids per output row.
    """
    if k <= RANK_SORT_PAIRS:
        return 0
    var n = log2_floor(sort_width(k))
    return n * (n + 1) // 2


def select_phases(k: Int, split: Bool) -> Phases:
    """The select's phases for `k`: a split row's count (`split` only), a
    pick, the sort steps and the write.

    Args:
        k: Ids per output row, `1 ..= TOP_K_LIMIT`.
        split: Whether the launch's rows are split (`select_slices > 1`).
    """
    var sort = Phases(Phase("sort_step", times=_sort_steps(k)), Phase("write"))
    var count = materialize[SPLIT_PHASES]() if split else Phases()
    return count.then(materialize[PICK_PHASES]()).then(sort)


def select_shared_words(k: Int, candidates: Int) -> Int:
    """Shared words of a select launch over rows of `candidates` columns.

    The state (4 words), two histograms (2 x 256 words), the pairs (2 x
    `sort_width(k)` words), the row cache (the workspace's row width, at
    most `CACHE_WORDS`; a split row's wide histogram, then its compacted
    pairs, live there), and the block collectives' 33 words (16 64-bit
    partials from an even word): 9,765 words (39,060 bytes) for k 512 at
    the GLM-5-Next decode shape, 12,837 (51,348 bytes, past the 48 KiB of
    static shared memory, within an MI300X workgroup's 64 KiB) for k 2048.

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
    """A window row's select, as a select block receives it: its scores,
    split words and output.

    Parameters:
        origin: Origin of the pointers (`MutAnyOrigin` in the kernels: a
            struct's pointer fields must name a parameter).
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
    """The row's `split_words(slices)` words, zero before the launch
    (unread unsplit)."""
    var ids: Field[DType.int32, Self.origin]
    """The row's `k` output ids."""


@always_inline
def _wide_word(bucket: Int) -> Int:
    """Where bucket `bucket` of the wide histogram lives in its words.

    The offer and the decision read each thread's `_BUCKETS_PER_THREAD`
    consecutive buckets, so a warp's lanes read words that far apart: in
    bucket order, 8 buckets a thread put a warp's 32 reads on 4 banks (8
    ways). XOR-ing a bucket's low bits with its 32-word line
    (`(bucket >> 5)`) spreads them over every bank, and keeps each line's
    words in that line (consecutive buckets, as the clear and the flush
    read them, still fill a line once).
    """
    comptime assert (
        _BUCKETS_PER_THREAD & (_BUCKETS_PER_THREAD - 1) == 0
        and _BUCKETS_PER_THREAD <= 32
    ), "a thread's buckets are a power of two within a 32-word line"
    return bucket ^ ((bucket >> 5) & (_BUCKETS_PER_THREAD - 1))


@always_inline
def _wide_digit(key: UInt32) -> Int:
    """A key's bucket of the wide digit: its top `WIDE_BITS` bits."""
    return Int(key >> UInt32(32 - WIDE_BITS))


@always_inline
def _slice_of(whole: WindowRow[MutAnyOrigin], slice: Int) -> Tuple[Int, Int]:
    """Block `slice`'s ids of a split row: `[slice * L, (slice + 1) * L)`
    within the bound, `L = ceil(width / slices)`."""
    var per = ceildiv(whole.width, whole.slices)
    var first = min(slice * per, whole.bound)
    return (first, min(whole.bound, first + per))


@always_inline
def _capacity(whole: WindowRow[MutAnyOrigin]) -> Int:
    """Pairs the row cache holds: keys in its first half, ids after."""
    return row_cache_words(whole.width) // 2


@always_inline
def _pick_row[
    split: Bool, k: Int
](whole: WindowRow[MutAnyOrigin], s: Shared) -> PickCandidates[MutAnyOrigin]:
    """What the selecting block picks from: a split row's compacted pairs
    when they fit the row cache, else the whole row."""
    var cache = row_cache_words(whole.width)
    comptime if split:
        var shared = SelectShared[k](s, cache)
        var n = Int(shared.wide_state().load(WIDE_KEPT))
        if n <= _capacity(whole):
            return PickCandidates[MutAnyOrigin](whole.scores, n, cache, True)
    return PickCandidates[MutAnyOrigin](whole.scores, whole.bound, cache, False)


@always_inline
def _compacted(
    whole: WindowRow[MutAnyOrigin], decided: Buffer["wide_state"]
) -> Compaction[MutAnyOrigin]:
    """What the last block of a split row compacts: its keys in the
    decided bucket or above."""
    return Compaction[MutAnyOrigin](
        whole.scores,
        whole.bound,
        whole.width,
        UInt64(decided.load(WIDE_BUCKET)) << UInt64(32 - WIDE_BITS),
    )


@always_inline
def _split_phase[
    phase: Int, k: Int
](
    thread: Int,
    mut state: SelectState,
    mut lane: Lane,
    s: Shared,
    whole: WindowRow[MutAnyOrigin],
    slice: Int,
):
    """Phase `phase` of `SPLIT_PHASES`: a split row's count and
    compaction (step 4 of the select).

    A split row (a call of fewer than `SPLIT_ROWS` rows and a workspace
    row of at least `SPLIT_MIN_CANDIDATES` and `4 k` candidates: the
    split kernel, `select_slices` blocks per row, `MAX_SLICES` or fewer
    to keep one wave of blocks in all; every row of the launch, short ones
    too) is counted by its blocks together before the pick: each block
    counts its slice's keys by their top `WIDE_BITS` bits (a *wide
    digit*, 4,096 buckets) into a shared histogram with shared atomics,
    adds the buckets it filled to the row's histogram in global memory
    (`publish_add`), and arrives at the row's counter
    (`block_phases.arrive`); a block maximum tells the last to arrive.
    That block alone goes on: it takes the row's histogram (and re-zeroes
    it and the counter for the next launch), finds by a block exclusive
    prefix sum over the buckets, highest first, the bucket `B` that holds
    the m-th key and how many keys `n` lie in `B` or above, and, if they
    fit in the row cache, compacts those `n` (key, id) pairs into it in id
    order (a count per lane pair's run, a prefix sum, a placing:
    `compaction`): its pick
    then runs over `n` candidates, not the row (at GLM-5-Next's decode, 16
    rows of 8,192 candidates, k 512: 16 blocks per row, and about `k` plus
    one bucket's keys left to pick). When they do not fit (ties or a
    narrow spread of scores), it picks over the whole row. Blocks of
    unsplit rows skip these phases.

    Two shared sites stay above 2-way, as the data decides: the wide
    histogram's atomics (keys of one digit serialize on its word; distinct
    digits may share a bank) and the compaction's stores
    (`compaction.compaction_pass`).
    """
    var shared = SelectShared[k](s, row_cache_words(whole.width))
    var wide = shared.wide_histogram()
    var decided = shared.wide_state()
    comptime table = SPLIT_PHASES
    var m = min(k, whole.bound)
    comptime if table.named(phase, "clear"):
        debug_assert(
            row_cache_words(whole.width) >= WIDE_BUCKETS,
            "a split row's cache holds its wide histogram (select_slices)",
        )
        for i in range(thread, WIDE_BUCKETS, SELECT_THREADS):
            wide.store(_wide_word(i), 0)
    elif table.named(phase, "count_wide"):
        var ids = _slice_of(whole, slice)
        for j in range(ids[0] + thread, ids[1], SELECT_THREADS):
            var key = score_order(s.global_load(whole.scores, j))
            _ = wide.atomic_add(_wide_word(_wide_digit(key)), 1)
    elif table.named(phase, "flush"):
        for i in range(thread, WIDE_BUCKETS, SELECT_THREADS):
            var count = wide.load(_wide_word(i))
            if count != 0:
                publish_add(whole.split, 1 + i, count)
        publish_fence()
    elif table.named(phase, "arrive"):
        var last: UInt64 = 0
        if thread == 0:
            var before = arrive(whole.split)
            last = 1 if Int(before) == whole.slices - 1 else 0
        lane.offer(last)
    elif table.named(phase, "take"):
        state.selects = lane.result() != 0
        if state.selects:
            acquire_fence()
            for i in range(thread, WIDE_BUCKETS, SELECT_THREADS):
                wide.store(_wide_word(i), read_published(whole.split, 1 + i))
                # Every block has added its part: zero for the next launch.
                s.global_store(whole.split, 1 + i, 0)
            if thread == 0:
                s.global_store(whole.split, 0, 0)
                if m == 0:
                    # No key is taken: no bucket, no candidate.
                    decided.store(WIDE_BUCKET, UInt32(WIDE_BUCKETS))
                    decided.store(WIDE_KEPT, 0)
    elif table.named(phase, "offer_wide"):
        # Thread t sums buckets from the top: `W - 1 - 8 t` down 8.
        state.count = 0
        if state.selects:
            var top = WIDE_BUCKETS - 1 - _BUCKETS_PER_THREAD * thread
            for i in range(_BUCKETS_PER_THREAD):
                state.count += wide.load(_wide_word(top - i))
        lane.offer(UInt64(state.count))
    elif table.named(phase, "decide_wide"):
        if not state.selects:
            return
        var above = Int(lane.result())
        if above < m and m <= above + Int(state.count):
            var top = WIDE_BUCKETS - 1 - _BUCKETS_PER_THREAD * thread
            for i in range(_BUCKETS_PER_THREAD):
                var count = Int(wide.load(_wide_word(top - i)))
                if above + count >= m:
                    decided.store(WIDE_BUCKET, UInt32(top - i))
                    decided.store(WIDE_KEPT, UInt32(above + count))
                    break
                above += count
    elif table.named(phase, "filter"):
        var kept: UInt64 = 0
        if state.selects and _pick_row[True, k](whole, s).compact:
            kept = compaction_pass[False, k](
                thread, s, _compacted(whole, decided), 0
            )
        lane.offer(kept)
    else:
        comptime assert table.named(phase, "compact")
        if state.selects and _pick_row[True, k](whole, s).compact:
            _ = compaction_pass[True, k](
                thread, s, _compacted(whole, decided), Int(lane.result())
            )


@always_inline
def select_phase[
    phase: Int, k: Int, split: Bool
](
    thread: Int,
    mut state: SelectState,
    mut lane: Lane,
    s: Shared,
    whole: WindowRow[MutAnyOrigin],
    slice: Int,
):
    """One thread's share of phase `phase` of a block's select.

    `@always_inline`, as everything a phase calls, so that each phase is
    inlined into the GPU kernel: LLVM's AMDGPU inliner kept a phase this
    large as a function, called once per phase, its arguments passed
    through scratch memory.

    A split launch's `SPLIT_PHASES` count each row over its blocks and
    let the last to arrive compact its candidates (`_split_phase`); the
    selecting block (every block unsplit) then picks
    the top `k` (of the compacted candidates, or of the whole row) into
    the pairs (`pick.pick_phase`), sorts them and writes the output, while
    a split row's other blocks idle.

    The sort (step 5), by key descending, id ascending, then the write of
    the ids (then `-1`): up to `RANK_SORT_PAIRS` pairs, one phase ranks by
    counting (`_rank_write`): a thread per pair counts the pairs that rank
    before it (every thread reads the same pair at once, a broadcast) and
    writes its id at that rank, no barrier between. More pairs (`m` is
    known to the whole block at run time), a bitonic sort of the `m` pairs
    padded to `S = next_power_of_two(m)`: the compare-exchange steps of
    stages up to `S` (the steps of larger stages, up to `sort_width(k)`,
    do nothing), then a phase writes the ids. Ranking costs `m` compares a
    pair, the sort about `log2(S)^2 / 2` compare-exchanges and a barrier
    each step: at 512 pairs that is 512 against 45.

    Radix select, bitonic sort and ranking by counting are the textbook
    GPU methods (Alabi et al., "Fast k-selection algorithms for graphics
    processing units", 2012; Batcher's bitonic sorter, 1968); a wide first
    digit counted with shared atomics and refined only inside the bucket
    that holds the k-th key is how the fast GPU top-k kernels count
    (FlashInfer's `RadixTopK`, MAX's `nn.topk_bitonic`), and blocks of one
    row that merge their histograms in global memory is FlashInfer's
    multi-block radix top-k, here without a grid-wide barrier: the last
    block to arrive finishes the row alone.

    Parameters:
        phase: The phase of `select_phases(k, split)`.
        k: Ids per output row, `1 ..= TOP_K_LIMIT`.
        split: Whether rows are split over blocks (`whole.slices > 1`;
            an unsplit launch has no count phases).

    Args:
        thread: The thread, `0 ..< SELECT_THREADS`.
        state: The thread's registers.
        lane: The thread's lane in the collectives (`select_phases`).
        s: The block's shared words (`select_shared_words`).
        whole: The window row.
        slice: The block's slice of the row, `0 ..< whole.slices`.
    """
    comptime table = select_phases(k, split)
    comptime name = table.name(phase)
    var selects = not split or state.selects
    comptime if SPLIT_PHASES.has(name):
        # The split count comes first: its phases are the table's.
        _split_phase[phase, k](thread, state, lane, s, whole, slice)
    elif PICK_PHASES.has(name):
        comptime p = phase - table.index("load")
        comptime offers = PICK_PHASES.collective(p) != NO_COLLECTIVE
        if selects:
            pick_phase[p, k](
                thread, state, lane, s, _pick_row[split, k](whole, s)
            )
        elif offers:
            lane.offer(0)
    else:
        if not selects:
            return
        var m = Int(state.pairs)
        var ranks = m <= RANK_SORT_PAIRS
        comptime if table.named(phase, "sort_step"):
            comptime step = table.round(phase)
            if not ranks:
                _bitonic_step[k](
                    thread,
                    step,
                    SelectShared[k](s, row_cache_words(whole.width)),
                    m,
                )
            return
        var shared = SelectShared[k](s, row_cache_words(whole.width))
        if ranks:
            _rank_write[k](thread, shared, m, whole.ids)
            return
        for i in range(thread, k, SELECT_THREADS):
            var id = Int32(-1)
            if i < m:
                id = Int32(shared.pair_ids().load(i))
            s.global_store(whole.ids, i, id)


@always_inline
def _rank_write[
    k: Int
](
    thread: Int,
    shared: SelectShared[k],
    m: Int,
    ids: Field[DType.int32, MutAnyOrigin],
):
    """Writes each of the `m` pairs' id at its rank, then `-1` up to `k`.

    A pair's rank is the number of pairs that rank before it: each thread
    takes pairs `i = thread, thread + SELECT_THREADS, ..` and compares
    their `ordered_rank_key`s with all `m` (the threads of a warp read the
    same pair at once). Ids are distinct, so the ranks are, and every
    output place is written once.

    Parameters:
        k: Ids per output row.

    Args:
        thread: The thread.
        shared: The block's shared memory (the pairs).
        m: Pairs selected, `min(k, bound)`, at most `RANK_SORT_PAIRS`.
        ids: The row's `k` output ids.
    """
    var keys = shared.pair_keys()
    var pair_ids = shared.pair_ids()
    for i in range(thread, m, SELECT_THREADS):
        var id = pair_ids.load(i)
        var mine = ordered_rank_key(keys.load(i), id)
        var rank = 0
        for j in range(m):
            if ordered_rank_key(keys.load(j), pair_ids.load(j)) > mine:
                rank += 1
        shared.s.global_store(ids, rank, Int32(id))
    for i in range(m + thread, k, SELECT_THREADS):
        shared.s.global_store(ids, i, -1)


@always_inline
def _after(key_a: UInt32, id_a: UInt32, key_b: UInt32, id_b: UInt32) -> Bool:
    """Whether pair a ranks after pair b (lower key, or equal and higher id)."""
    return ordered_rank_key(key_a, id_a) < ordered_rank_key(key_b, id_b)


@always_inline
def _bitonic_step[
    k: Int
](thread: Int, step: Int, shared: SelectShared[k], m: Int):
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
        shared: The block's shared memory (the pairs).
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
    var keys = shared.pair_keys()
    var ids = shared.pair_ids()
    for c in range(thread, width // 2, SELECT_THREADS):
        var i = ((c & ~(stride - 1)) << 1) | (c & (stride - 1))
        var j = i + stride
        var ka = keys.load(i)
        var ia = ids.load(i)
        var kb = keys.load(j)
        var ib = ids.load(j)
        # Best first within blocks of `size` whose bit `size` is 0, worst
        # first in the others; the last stage sorts the whole area.
        if _after(ka, ia, kb, ib) == ((i & size) == 0):
            keys.store(i, kb)
            ids.store(i, ib)
            keys.store(j, ka)
            ids.store(j, ia)
