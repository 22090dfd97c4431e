"""Unit tests of the CPU prefill scorer's parts: the key sort, the pool, the
register-blocked head block.

Runs without a GPU (`mojo run -I . tests/mojo/test_index_cpu_prefill.mojo`);
`tests/index/test_index_cpu_prefill.py` runs it under pytest. Writer against
writer: the sorting network against `sort`, the pool's kept keys against the
heap's (`heap_offer`, a bounded min-heap written here), bit for bit, and the prefill head blocks against the
row scorer (`score_tile`) within float32 rounding of the head sum, and
the bfloat16 pair form against the float32 form on e4m3fn values (which
bfloat16 holds exactly) within float32 rounding of the dim sum.
"""

from std.builtin.sort import sort
from std.math import abs, max
from std.memory import bitcast
from std.testing import TestSuite, assert_equal, assert_true

from cpu_scores import check_scores, e4m3
from kernels.index.cpu.block import (
    PREFILL_HEADS,
    PREFILL_TILE,
    bf16_pairs,
    pack_pairs,
    prefill_heads_of,
    score_head_block,
    score_head_block_pairs,
    transpose_tile,
    transpose_tile_pairs,
    use_pairs,
)
from kernels.index.fp8 import decode_e4m3
from kernels.index.cpu.score import score_tile, scratch
from kernels.index.operands import padded_heads_of
from kernels.grid.ragged import Ptr
from kernels.index.rank import (
    keep_best,
    kth_best,
    offer_pool,
    pool_room,
    rank_key,
    score_order,
    score_orders,
    sort_keys,
)


def sift_down(keys: Ptr[DType.uint64], size: Int, pos: Int):
    """Restores the min-heap below `pos` (root: the lowest-ranked key)."""
    var i = pos
    var key = keys[unsafe_offset=i]
    while True:
        var child = 2 * i + 1
        if child >= size:
            break
        if (
            child + 1 < size
            and keys[unsafe_offset=child + 1] < keys[unsafe_offset=child]
        ):
            child += 1
        if keys[unsafe_offset=child] >= key:
            break
        keys[unsafe_offset=i] = keys[unsafe_offset=child]
        i = child
    keys[unsafe_offset=i] = key


def heap_offer[
    k: Int
](
    tile: Ptr[DType.float32],
    first: Int,
    count: Int,
    keys: Ptr[DType.uint64],
    size: Int,
) -> Int:
    """The reference top k: offers candidates `first ..` (scores
    `tile[0 : count]`) to a bounded min-heap of a row's best k.

    `keys[0 : size]` holds the row's best so far: unordered while fewer
    than `k`, a min-heap once full, where a newcomer replaces the root
    only if it ranks higher. Returns the new size.
    """
    var filled = size
    for x in range(count):
        var key = rank_key(tile[unsafe_offset=x], first + x)
        if filled < k:
            keys[unsafe_offset=filled] = key
            filled += 1
            if filled == k:
                for i in reversed(range(k // 2)):
                    sift_down(keys, k, i)
        elif key > keys[unsafe_offset=0]:
            keys[unsafe_offset=0] = key
            sift_down(keys, k, 0)
    return filled


def value(i: Int, salt: Int) -> Float32:
    """A deterministic spread of values in [-1, 1], with repeats."""
    return Float32(((i * 7919 + salt * 104729) % 2003) - 1001) / 1001.0


def test_sort_keys_matches_sort() raises:
    # Sizes below and above the network's threshold (`SORT_MIN_KEYS`),
    # powers of two and not (padded); scores with ties, ids past one
    # byte, a NaN and both zeros.
    for size in [5, 63, 64, 67, 700, 701]:
        var mine = List[UInt64]()
        for i in range(size):
            var score = value(i, size)
            if i % 97 == 3:
                score = Float32(FloatLiteral.nan)
            elif i % 89 == 5:
                score = Float32(-0.0)
            mine.append(rank_key(score, 1000 + i * 37))
        var theirs = mine.copy()
        sort_keys(Span(mine))
        sort(Span(theirs))
        for i in range(size):
            assert_equal(mine[i], theirs[i], String("size ", size, " at ", i))


def test_pool_keeps_what_the_heap_keeps() raises:
    comptime k = 16
    # 1,000 candidates with ties in tiles of 24: the pool fills and
    # compacts many times; its best k must be the heap's, bit for bit.
    var n = 1000
    var scores = List[Float32](length=n, fill=0.0)
    for i in range(n):
        scores[i] = Float32((i * 37) % 101) / 7.0
    # NaN (below every number) and -0.0 (as 0.0) where the pool's vector
    # keys and the heap's scalar keys must still agree.
    for i in range(3, n, 97):
        scores[i] = Float32(FloatLiteral.nan)
    for i in range(5, n, 89):
        scores[i] = Float32(-0.0)
    var heap = List[UInt64](length=k, fill=0)
    var pool = List[UInt64](length=pool_room[k](), fill=0)
    var size = 0
    var pooled = 0
    var floor = UInt64(0)
    for first in range(0, n, 24):
        var count = min(24, n - first)
        var tile = scratch(scores).unsafe_offset(first)
        size = heap_offer[k](tile, first, count, scratch(heap), size)
        var offered = offer_pool[k](
            tile, first, count, scratch(pool), pooled, floor
        )
        pooled = offered[0]
        floor = offered[1]
        assert_true(pooled < 2 * k)
    var best = keep_best[k](scratch(pool), pooled)
    assert_equal(best[0], k)
    assert_equal(size, k)
    sort(Span(heap))
    # The floor is below the k-th best.
    assert_true(best[1] < heap[0])
    sort(Span(pool)[:k])
    for i in range(k):
        assert_equal(pool[i], heap[i], String("rank ", i))


def test_score_order_ranks_nan_lowest_and_zeros_alike() raises:
    var scores = SIMD[DType.float32, 8](
        FloatLiteral.nan, -3.0e38, -0.0, 0.0, 1.0, -FloatLiteral.nan, 2.5, -1.0
    )
    var orders = score_orders[8](scores)
    assert_equal(orders[0], 0x007FFFFF)  # the key of -inf
    assert_equal(orders[5], 0x007FFFFF)
    assert_equal(orders[2], orders[3])
    assert_true(orders[0] < orders[1] and orders[1] < orders[7])
    assert_true(orders[7] < orders[2] and orders[3] < orders[4])
    assert_true(orders[4] < orders[6])
    for lane in range(8):
        assert_equal(score_order(scores[lane]), orders[lane])


def test_pool_with_fewer_than_k_keeps_all() raises:
    comptime k = 8
    var scores = List[Float32](length=5, fill=1.0)
    var pool = List[UInt64](length=pool_room[k](), fill=0)
    var offered = offer_pool[k](
        scratch(scores), 40, 5, scratch(pool), 0, UInt64(0)
    )
    assert_equal(offered[0], 5)
    var best = keep_best[k](scratch(pool), 5)
    assert_equal(best[0], 5)
    assert_equal(best[1], 0)  # nothing cut
    # Equal scores: the lowest id ranks highest, the highest lowest.
    sort(Span(pool)[:5])
    for i in range(5):
        assert_equal(pool[i], rank_key(1.0, 44 - i))


def test_kth_best_selects_like_sort() raises:
    # Pools with tied scores (distinct ids), NaN, both zeros and keys that
    # share their high bytes; k from 1 to the pool's size in steps, and
    # the pool's size itself.
    for size in [1, 7, 300, 1025]:
        var keys = List[UInt64]()
        for i in range(size):
            var score = value(i, size) * Float32(1 + i % 3)
            if i % 61 == 4:
                score = Float32(FloatLiteral.nan)
            elif i % 53 == 9:
                score = Float32(-0.0)
            elif i % 47 == 2:
                score = 0.0
            keys.append(rank_key(score, 70000 + i))
        var ordered = keys.copy()
        sort(Span(ordered))
        var ks = List[Int]()
        for k in range(1, size + 1, max(1, size // 37)):
            ks.append(k)
        ks.append(size)
        for k in ks:
            var want = ordered[size - k]
            var bound = kth_best(scratch(keys), size, k)
            var picked = 0
            for i in range(size):
                picked += Int(keys[i] >= bound)
            assert_equal(picked, k, String("size ", size, " k ", k))
            assert_true(bound <= want, String("size ", size, " k ", k))
            if k < size:
                assert_true(
                    bound > ordered[size - k - 1], String("size ", size)
                )


def test_head_blocks_score_like_the_row_scorer() raises:
    comptime num_heads = 20  # not a whole number of blocks or registers
    comptime depth = 24
    comptime padded = prefill_heads_of[num_heads]()
    comptime row_padded = padded_heads_of[num_heads]()
    comptime count = PREFILL_TILE - 3
    # The prefill layout: [heads, depth], padding heads zero.
    var queries = List[Float32](length=padded * depth, fill=0.0)
    var weights = List[Float32](length=padded, fill=0.0)
    # The row scorer's: [depth, padded heads].
    var row_queries = List[Float32](length=depth * row_padded, fill=0.0)
    var row_weights = List[Float32](length=row_padded, fill=0.0)
    for h in range(num_heads):
        weights[h] = value(h, 1)
        row_weights[h] = weights[h]
        for d in range(depth):
            queries[h * depth + d] = value(h * depth + d, 2)
            row_queries[d * row_padded + h] = queries[h * depth + d]
    var keys = List[Float32](length=(PREFILL_TILE + 8) * depth, fill=0.0)
    var scales = List[Float32](length=PREFILL_TILE + 8, fill=0.0)
    for x in range(count):
        scales[x] = 0.5 + Float32(x % 3)
        for d in range(depth):
            keys[x * depth + d] = value(x * depth + d, 3)
    keys[5 * depth + 2] = Float32(FloatLiteral.nan)  # a NaN key
    var transposed = List[Float32](length=PREFILL_TILE * depth, fill=0.0)
    transpose_tile[depth](scratch(keys), count, scratch(transposed))
    var totals = List[Float32](length=PREFILL_TILE, fill=0.0)
    for block in range(0, padded, PREFILL_HEADS):
        score_head_block[depth](
            scratch(queries).unsafe_offset(block * depth),
            scratch(weights).unsafe_offset(block),
            scratch(transposed),
            scratch(totals),
        )
    var want = List[Float32](length=PREFILL_TILE + 8, fill=0.0)
    score_tile[num_heads, depth](
        scratch(row_queries),
        scratch(row_weights),
        scratch(keys),
        scratch(scales),
        count,
        scratch(want),
    )
    for x in range(count):
        var got = totals[x] * scales[x]
        if x == 5:
            assert_true(got != got, "a NaN key scores NaN")
            continue
        var scale = max(abs(want[x]), Float32(1.0))
        assert_true(
            abs(got - want[x]) <= 1e-5 * scale,
            String("candidate ", x, ": ", got, " vs ", want[x]),
        )


def test_pairs_hold_every_e4m3_value_exactly() raises:
    # Every byte: the pair word's halves, widened back to float32, are
    # the decoded value bit for bit (a NaN stays a NaN).
    for byte in range(256):
        var value = decode_e4m3[1](SIMD[DType.uint8, 1](UInt8(byte)))[0]
        var word = bf16_pairs[1](value, -value)[0]
        var low = bitcast[DType.float32, 1](UInt32(word << 16))[0]
        var high = bitcast[DType.float32, 1](UInt32(word & 0xFFFF0000))[0]
        if value != value:
            assert_true(low != low and high != high, String("byte ", byte))
            continue
        assert_equal(low, value, String("byte ", byte))
        assert_equal(high, -value, String("byte ", byte))


def test_pair_blocks_score_like_float32_blocks() raises:
    comptime depth = 38  # not a whole number of packing steps
    comptime if use_pairs[depth]():
        check_pair_blocks[depth]()
    else:
        print("no AVX-512 BF16 on this target: the pair form is not built")


def check_pair_blocks[depth: Int]() raises:
    """The pair blocks against the float32 blocks at `depth` (even)."""
    comptime num_heads = 20
    comptime padded = prefill_heads_of[num_heads]()
    comptime count = PREFILL_TILE - 5
    var queries = List[Float32](length=padded * depth, fill=0.0)
    var weights = List[Float32](length=padded, fill=0.0)
    for h in range(num_heads):
        weights[h] = value(h, 4)
        for d in range(depth):
            queries[h * depth + d] = e4m3(h * depth + d)
    var keys = List[Float32](length=PREFILL_TILE * depth, fill=0.0)
    for x in range(count):
        for d in range(depth):
            keys[x * depth + d] = e4m3(x * depth + d + 5000)
    keys[7 * depth + 31] = Float32(FloatLiteral.nan)  # a NaN key
    var transposed = List[Float32](length=PREFILL_TILE * depth, fill=0.0)
    transpose_tile[depth](scratch(keys), count, scratch(transposed))
    var want = List[Float32](length=PREFILL_TILE, fill=0.0)
    var query_words = List[UInt32](length=padded * depth // 2, fill=0)
    var key_words = List[UInt32](length=PREFILL_TILE * depth // 2, fill=0)
    for h in range(padded):
        pack_pairs[depth, 1](
            scratch(queries).unsafe_offset(h * depth),
            scratch(query_words).unsafe_offset(h * depth // 2),
        )
    transpose_tile_pairs[depth](scratch(keys), count, scratch(key_words))
    var got = List[Float32](length=PREFILL_TILE, fill=0.0)
    for block in range(0, padded, PREFILL_HEADS):
        score_head_block[depth](
            scratch(queries).unsafe_offset(block * depth),
            scratch(weights).unsafe_offset(block),
            scratch(transposed),
            scratch(want),
        )
        score_head_block_pairs[depth](
            scratch(query_words).unsafe_offset(block * depth // 2),
            scratch(weights).unsafe_offset(block),
            scratch(key_words),
            scratch(got),
        )
    check_scores(got, want, count, 7, String("pairs, depth ", depth))


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
