"""The indexer's candidate order as integers, and the CPU path's top-k heap.

`score_order` maps a float32 score to a uint32 of the same order (NaN as
`-inf`, below every number); `rank_key` adds the tie rule (the lower id
ranks higher). The GPU select (`index_select.mojo`) radix-selects on
`score_order`; the CPU path keeps each row's best `k` rank keys in a
bounded min-heap (`offer_tile`) and writes them best first (`write_row`).
"""

from std.builtin.sort import sort
from std.memory import bitcast

from .ragged import Ptr


@always_inline
def score_order(score: Float32) -> UInt32:
    """A score as an unsigned integer of the same order.

    `-0.0` maps as `0.0` and NaN as `-inf` (the key `0x007FFFFF`), so NaN
    ranks below every number; 0 is the key of no score.
    """
    var value = score + 0.0
    var bits = bitcast[DType.uint32, 1](value)
    var ordered = (~bits) if bits & 0x80000000 else bits | 0x80000000
    if value != value:
        ordered = 0x007FFFFF  # the key of -inf
    return ordered


@always_inline
def rank_key(score: Float32, id: Int) -> UInt64:
    """A candidate's rank as one integer: larger ranks higher.

    The high half orders the scores (`score_order`), the low half
    `2^32 - 1 - id`, so equal scores rank the lower id higher. Ids are
    below 2^31: the output is int32.
    """
    return (UInt64(score_order(score)) << 32) | UInt64(0xFFFFFFFF - id)


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


@always_inline
def offer_tile[
    k: Int
](
    tile: Ptr[DType.float32],
    first: Int,
    count: Int,
    keys: Ptr[DType.uint64],
    size: Int,
) -> Int:
    """Offers candidates `first ..` (scores `tile[0 : count]`) to a row's top k.

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


def write_row[k: Int](keys: Span[mut=True, UInt64, _], dest: Ptr[DType.int32]):
    """Sorts a row's kept keys and writes their ids best first, `-1` after."""
    sort(keys)
    var size = len(keys)
    for x in range(size):
        dest[unsafe_offset=x] = Int32(
            0xFFFFFFFF - Int(keys[size - 1 - x] & 0xFFFFFFFF)
        )
    for x in range(size, k):
        dest[unsafe_offset=x] = -1
