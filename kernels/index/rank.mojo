"""The indexer's candidate order as integers, and the CPU path's top k.

`score_order` maps a float32 score to a uint32 of the same order (NaN as
`-inf`, below every number); `rank_key` adds the tie rule (the lower id
ranks higher). The GPU select (`select.mojo`) radix-selects on
`score_order`; the CPU path keeps each row's best `k` rank keys in a
pool of `2k` cut back by a radix select (`offer_pool`, `keep_best`,
`RowPools`), and writes them best first (`write_row`, a bitonic sorting
network on SIMD vectors).
"""

from std.builtin.sort import sort
from std.math import iota, isnan, max, min
from std.sys.intrinsics import compressed_store
from std.memory import bitcast, stack_allocation

from ..grid.ragged import Ptr


@always_inline
def score_order(score: Float32) -> UInt32:
    """A score as an unsigned integer of the same order.

    `-0.0` maps as `0.0` and NaN as `-inf` (the key `0x007FFFFF`), so NaN
    ranks below every number; 0 is the key of no score.
    """
    return score_orders[1](score)[0]


@always_inline
def score_orders[
    width: Int
](score: SIMD[DType.float32, width]) -> SIMD[DType.uint32, width]:
    """`score_order` of each lane."""
    var value = score + 0.0
    var bits = bitcast[DType.uint32, width](value)
    var ordered = (bits & 0x80000000).ne(0).select(~bits, bits | 0x80000000)
    return isnan(value).select(SIMD[DType.uint32, width](0x007FFFFF), ordered)


@always_inline
def rank_key(score: Float32, id: Int) -> UInt64:
    """A candidate's rank as one integer: larger ranks higher.

    The high half orders the scores (`score_order`), the low half
    `2^32 - 1 - id`, so equal scores rank the lower id higher. Ids are
    below 2^31: the output is int32.
    """
    return ordered_rank_key(score_order(score), UInt32(id))


@always_inline
def ordered_rank_key(order: UInt32, id: UInt32) -> UInt64:
    """`rank_key` of a score already in `score_order` form (the GPU
    select keeps its pairs so)."""
    return (UInt64(order) << 32) | UInt64(~id)


comptime SORT_MIN_KEYS = 64
"""Fewest keys that `sort_keys` sorts with its network (fewer: `sort`)."""

comptime SORT_LANES = 8
"""Rank keys per vector of the sorting network (512 bits)."""


@always_inline
def _exchange_in_vector[
    j: Int
](
    v: SIMD[DType.int64, SORT_LANES], ascending: SIMD[DType.bool, SORT_LANES]
) -> SIMD[DType.int64, SORT_LANES]:
    """One compare-exchange step of distance `j < SORT_LANES` inside a
    vector: lane `l` meets lane `l ^ j`; of a pair, the lower lane keeps
    the smaller key where `ascending`, the larger elsewhere."""
    comptime L = SORT_LANES
    var partner: SIMD[DType.int64, L]
    comptime if j == 1:
        partner = v.shuffle[1, 0, 3, 2, 5, 4, 7, 6]()
    elif j == 2:
        partner = v.shuffle[2, 3, 0, 1, 6, 7, 4, 5]()
    else:
        partner = v.shuffle[4, 5, 6, 7, 0, 1, 2, 3]()
    var lower = (iota[DType.int64, L]() & Int64(j)).eq(0)
    var take_min = lower.eq(ascending)
    return take_min.select(min(v, partner), max(v, partner))


def sort_keys(keys: Span[mut=True, UInt64, _]):
    """Sorts rank keys ascending: a bitonic sorting network on SIMD vectors.

    The keys, as int64 with the top bit flipped (the same order), padded
    with `Int64.MIN` (below every key) to a power of two,
    go through the network's `log2(n) (log2(n) + 1) / 2` compare-exchange
    steps, each a branch-free min and max over 8-key vectors: steps of a
    distance of 8 keys or more pair whole vectors, the last three steps
    of each stage run inside a vector on shuffles, in registers. At a
    row's 512 kept keys that is 45 steps of 64 vectors, where a radix
    sort spends six counting and six scattering passes whose counters
    serialize on crowded buckets. Rank keys are distinct (distinct ids),
    so the order is the one `sort` gives.
    Source: K. E. Batcher, "Sorting networks and their applications"
    (1968).
    """
    comptime L = SORT_LANES
    comptime Vec = SIMD[DType.int64, L]
    var size = len(keys)
    if size < SORT_MIN_KEYS:
        sort(keys)
        return
    var n = L
    while n < size:
        n *= 2
    # Signed: the keys with their top bit flipped keep their order as
    # int64, whose min and max AVX2 has (compare and blend) and whose
    # unsigned forms it builds from four instructions.
    comptime flip = Int64.MIN
    var padded = List[Int64](length=n, fill=flip)
    var at = padded.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    for x in range(size):
        at[unsafe_offset=n - size + x] = Int64(keys[x]) ^ flip
    var stage = 2
    while stage <= n:
        # Keys `i` with `i & stage == 0` sort ascending, the others
        # descending, so each pair of blocks forms the next stage's
        # bitonic sequence.
        var j = stage // 2
        while j >= L:
            for base in range(0, n, 2 * j):
                var ascending = base & stage == 0
                for x in range(base, base + j, L):
                    var a = at.unsafe_load[width=L](x)
                    var b = at.unsafe_load[width=L](x + j)
                    var low = min(a, b)
                    var high = max(a, b)
                    at.unsafe_store[width=L](x, low if ascending else high)
                    at.unsafe_store[width=L](x + j, high if ascending else low)
            j //= 2
        for x in range(0, n, L):
            var ascending = (
                (iota[DType.int64, L]() + Int64(x)) & Int64(stage)
            ).eq(0)
            var v = at.unsafe_load[width=L](x)
            if stage >= 8:
                v = _exchange_in_vector[4](v, ascending)
            if stage >= 4:
                v = _exchange_in_vector[2](v, ascending)
            v = _exchange_in_vector[1](v, ascending)
            at.unsafe_store[width=L](x, v)
        stage *= 2
    for x in range(size):
        keys[x] = UInt64(at[unsafe_offset=n - size + x] ^ flip)
    _ = len(padded)


comptime POOL_LANES = 8
"""Rank keys `offer_pool` builds and appends per step (one 512-bit vector)."""


@always_inline
def pool_room[k: Int]() -> Int:
    """Keys a row's pool must have room for: `2 * k` and one step more."""
    return 2 * k + POOL_LANES


def offer_pool[
    k: Int
](
    tile: Ptr[DType.float32],
    first: Int,
    count: Int,
    pool: Ptr[DType.uint64],
    size: Int,
    floor: UInt64,
) -> Tuple[Int, UInt64]:
    """Offers candidates `first ..` (scores `tile[0 : count]`) to a row's pool.

    The pool (`pool[0 : size]`, room for `pool_room[k]()` keys) holds every
    key seen that ranks above `floor`, a superset of the row's best `k`.
    `POOL_LANES` keys at a time are built in a vector and those above the
    floor appended with one compressing store; when the pool reaches `2 *
    k` keys it keeps its best `k` (`keep_best`) and `floor` rises to
    `keep_best`'s floor if that is higher (at most just below the k-th
    best so far): a key at or below it can never be in the answer. So each key costs O(1) amortized, where a heap's
    replacement costs a sift of `log2(k)` levels. Returns the new size and
    floor.
    """
    comptime L = POOL_LANES
    var filled = size
    var low = floor
    var lane = iota[DType.uint32, L]()
    for x in range(0, count, L):
        var scores = SIMD[DType.float32, L](0)
        var live = lane.lt(UInt32(count - x))
        if x + L <= count:
            scores = tile.unsafe_load[width=L](x)
        else:
            for l in range(count - x):
                scores[l] = tile[unsafe_offset=x + l]
        var ids = lane + UInt32(first + x)
        var keys = (score_orders[L](scores).cast[DType.uint64]() << 32) | (
            ~ids
        ).cast[DType.uint64]()
        var above = keys.gt(low) & live
        compressed_store(keys, pool.unsafe_offset(filled), above)
        filled += Int(above.cast[DType.uint8]().reduce_add())
        if filled >= 2 * k:
            var best = keep_best[k](pool, filled)
            filled = best[0]
            low = max(low, best[1])
    return (filled, low)


comptime SELECT_COUNTERS = 4
"""Counter sets of `kth_best`'s counting pass. Scores of a row share their
high bytes, so most keys of a pass count into one bucket, and with one
counter set each increment waits for the previous one's store."""


@always_inline
def _digit(key: UInt64, shift: Int) -> Int:
    """Byte `shift / 8` of a key."""
    return Int((key >> UInt64(shift)) & 0xFF)


struct RowPools[k: Int](Movable):
    """A pool of rank keys per query row (`offer_pool`), and their answer.

    Parameters:
        k: Keys kept per row.
    """

    var keys: List[UInt64]
    """`[rows, pool_room[Self.k]()]` the pools (unwritten slots uninitialized)."""
    var sizes: List[Int]
    """`[rows]` keys in each pool."""
    var floors: List[UInt64]
    """`[rows]` each pool's floor."""

    def __init__(out self, rows: Int):
        """Empty pools for `rows` rows."""
        self.keys = List[UInt64](
            unsafe_uninit_length=rows * pool_room[Self.k]()
        )
        self.sizes = List[Int](length=rows, fill=0)
        self.floors = List[UInt64](length=rows, fill=0)

    @always_inline
    def offer(
        mut self, row: Int, scores: Ptr[DType.float32], first: Int, count: Int
    ):
        """Offers candidates `first ..` (scores `scores[0 : count]`) to
        `row`'s pool."""
        var pool = self.keys.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
        var offered = offer_pool[Self.k](
            scores,
            first,
            count,
            pool.unsafe_offset(row * pool_room[Self.k]()),
            self.sizes[row],
            self.floors[row],
        )
        self.sizes[row] = offered[0]
        self.floors[row] = offered[1]

    def keep(
        mut self, kept: Ptr[DType.uint64], sizes: Pointer[Int, MutAnyOrigin]
    ):
        """Each row's best `k` keys to `kept[row * k :]` (in no order), how
        many to `sizes[row]`."""
        var pool = self.keys.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
        for row in range(len(self.sizes)):
            var at = pool.unsafe_offset(row * pool_room[Self.k]())
            var size = keep_best[Self.k](at, self.sizes[row])[0]
            for x in range(size):
                kept[unsafe_offset=row * Self.k + x] = at[unsafe_offset=x]
            sizes[unsafe_offset=row] = size


def kth_best(pool: Ptr[DType.uint64], size: Int, k: Int) -> UInt64:
    """A bound that exactly the best `k` of `size >= k >= 1` distinct rank
    keys are at or above (at most the `k`-th largest key; its low bytes
    may be zero).

    A most-significant-digit radix select: per byte, one counting pass
    over the keys that share the bytes chosen so far, until the byte's
    bucket that holds the `k`-th key is taken whole. After each pass the
    keys of the chosen bucket are copied aside (branch-free), so a pass
    reads only them: a pool of a thousand keys costs about two passes
    over it however many bytes it takes. Consecutive keys count into
    `SELECT_COUNTERS` counter sets in turn.
    """
    var need = k
    var prefix = UInt64(0)
    var counts = stack_allocation[SELECT_COUNTERS * 256, DType.int32]()
    var narrowed = List[UInt64](unsafe_uninit_length=size)
    var kept = narrowed.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    var src = pool
    var left = size
    for shift in range(56, -8, -8):
        for d in range(SELECT_COUNTERS * 256):
            counts[unsafe_offset=d] = 0
        var y = 0
        while y + SELECT_COUNTERS <= left:
            comptime for c in range(SELECT_COUNTERS):
                var d = _digit(src[unsafe_offset=y + c], shift)
                counts[unsafe_offset=c * 256 + d] += 1
            y += SELECT_COUNTERS
        for z in range(y, left):
            counts[unsafe_offset=_digit(src[unsafe_offset=z], shift)] += 1
        for d in range(256):
            comptime for c in range(1, SELECT_COUNTERS):
                counts[unsafe_offset=d] += counts[unsafe_offset=c * 256 + d]
        var d = 255
        var above = 0
        while above + Int(counts[unsafe_offset=d]) < need:
            above += Int(counts[unsafe_offset=d])
            d -= 1
        need -= above
        prefix |= UInt64(d) << UInt64(shift)
        if Int(counts[unsafe_offset=d]) == need:
            break
        # Keep only the chosen bucket's keys for the next byte.
        var filled = 0
        for y in range(left):
            var key = src[unsafe_offset=y]
            kept[unsafe_offset=filled] = key
            filled += Int(_digit(key, shift) == d)
        src = kept
        left = filled
    _ = len(narrowed)
    return prefix


def keep_best[k: Int](pool: Ptr[DType.uint64], size: Int) -> Tuple[Int, UInt64]:
    """Moves the best `min(size, k)` of `pool[0 : size]` to its front, in no
    order. Selects (`kth_best`) instead of sorting.

    Returns:
        How many it kept, and a floor: a key at or below it ranks below
        every kept key (0 when it kept them all).
    """
    if size <= k:
        return (size, UInt64(0))
    var bound = kth_best(pool, size, k)
    var kept = 0
    for x in range(size):
        var key = pool[unsafe_offset=x]
        pool[unsafe_offset=kept] = key
        kept += Int(key >= bound)
    # `bound` is above 0: `size > k` keys are distinct and some rank
    # below it.
    return (kept, bound - 1)


def write_row[k: Int](keys: Span[mut=True, UInt64, _], dest: Ptr[DType.int32]):
    """Sorts a row's kept keys and writes their ids best first, `-1` after."""
    sort_keys(keys)
    var size = len(keys)
    for x in range(size):
        dest[unsafe_offset=x] = Int32(
            0xFFFFFFFF - Int(keys[size - 1 - x] & 0xFFFFFFFF)
        )
    for x in range(size, k):
        dest[unsafe_offset=x] = -1
