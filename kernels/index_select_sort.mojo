"""The GPU select's collect and sort: selected pairs placed, sorted, written.

Once `index_select._count_run` has fixed the k-th key `K` and counted each
thread's keys above and at it, `_prefix_group` turns a group's counts into
exclusive prefixes and `_scatter_run` writes each thread's selected
(key, id) pairs to their places, ties in id order. The bitonic sort
(`_bitonic_step`) then orders the pairs, its last step writing the ids to
the output (`_write_ids` when `k = 1` needs no sort).
"""

from std.bit import log2_floor

from .block_phases import Shared
from .index_rank import score_order
from .index_select_layout import (
    SELECT_THREADS,
    _GROUP_ABOVE,
    _GROUP_TIES,
    _LANES,
    _PAIR_IDS,
    _PAIR_KEYS,
    _STATE,
    _TIES,
    _ABOVE,
    _WARPS,
    _padded,
    _run,
)
from .ragged import Ptr


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
