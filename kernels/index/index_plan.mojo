"""Which rows `index_top_k` scores, and where their keys lie (CPU and GPU).

Metadata is not trusted. `scored_prefix` walks the offsets while they are
well formed (the CPU path once per call, the GPU's plan launch once per
row through `row_plan`); `request_span` decides whether a request is
scored at all; `candidate_bound` is the candidates a row sees; and
`page_bases` is where a page's keys and scales start for `layer_idx`.
Every function here is device-safe: no allocation, no raising.
"""

from std.math import ceildiv

from .index_operands import IndexTopK
from ..model.ragged import Ptr, read_index


@always_inline
def candidate_bound[
    kpool: Int, causal: Bool
](cache_length: Int, new_rows: Int, i: Int) -> Int:
    """Candidates row `i` of a request's `new_rows` sees: `[0, bound)`."""
    comptime mask = 1 if causal else 0
    return (cache_length + new_rows - (new_rows - 1 - i) * mask) // kpool


@fieldwise_init
struct RequestSpan(Copyable, TrivialRegisterPassable):
    """A request's query rows `[start, start + n)`, its cache length, and
    whether it is scored."""

    var start: Int
    """First query row."""
    var n: Int
    """Query rows."""
    var cache_length: Int
    """Rows cached before this call."""
    var scored: Bool
    """Whether the request's rows are scored (else all `-1`)."""


@fieldwise_init
struct RowPlan(Copyable, TrivialRegisterPassable):
    """A query row's request and candidate bound (`request` -1: all `-1`)."""

    var request: Int
    """The row's request, or -1."""
    var bound: Int
    """Candidates the row sees (0 when `request` is -1)."""


@fieldwise_init
struct CacheSlot(Copyable, TrivialRegisterPassable):
    """Where a cache row lies: its key's first byte and its scale."""

    var key: Int
    """Element offset into `k_blocks`."""
    var scale: Int
    """Element offset into `k_scales`."""


def request_span(op: IndexTopK, b: Int) -> RequestSpan:
    """Request `b`'s rows `[start, start + n)`, its cache length, and whether to score it.

    Scored when its cache length is non-negative and every page its last
    row needs is inside both lookup tables and names a block inside
    `k_blocks` and `k_scales`. `b` must be below `op.scored_requests`
    (well-formed offsets).
    """
    var start = read_index(op.input_row_offsets, b)
    var n = read_index(op.input_row_offsets, b + 1) - start
    var c = read_index(op.k_cache_lengths, b)
    if c < 0:
        return RequestSpan(start, n, c, False)
    if n == 0:
        return RequestSpan(start, n, c, True)
    var rows = (
        candidate_bound[op.kpool, op.causal](c, n, n - 1)
        * op.rows_per_candidate
    )
    var pages = ceildiv(rows, op.page_size)
    if pages > op.key_pages or pages > op.scale_pages:
        return RequestSpan(start, n, c, False)
    for page in range(pages):
        var block = read_index(op.k_lookup_table, b * op.key_pages + page)
        var scale_block = read_index(
            op.k_scales_lookup_table, b * op.scale_pages + page
        )
        if block < 0 or block >= op.key_blocks:
            return RequestSpan(start, n, c, False)
        if scale_block < 0 or scale_block >= op.scale_blocks:
            return RequestSpan(start, n, c, False)
    return RequestSpan(start, n, c, True)


@always_inline
def page_bases(op: IndexTopK, b: Int, page: Int) -> CacheSlot:
    """Where request `b`'s page `page` starts (its slot 0), for `layer_idx`."""
    var block = read_index(op.k_lookup_table, b * op.key_pages + page)
    var scale_block = read_index(
        op.k_scales_lookup_table, b * op.scale_pages + page
    )
    return CacheSlot(
        block * op.block_stride + op.layer_offset,
        scale_block * op.scale_block_stride + op.scale_layer_offset,
    )


def scored_prefix[
    dtype: DType
](
    offsets: Ptr[dtype], batch: Int, total_tokens: Int, row: Int = Int.MAX
) -> Int:
    """Requests `0 .. r - 1` whose offsets are well formed; returns `r`.

    Well formed: `offsets[0] == 0`, non-decreasing, and at most
    `total_tokens`, up to and including `offsets[r]`. The walk stops early
    after the request that holds `row` (whose end is past `row`), so that
    request is `r - 1` whenever `row < offsets[r]`; with the default `row`
    it walks every well-formed request. Device-safe: no allocation, no
    raising.

    Args:
        offsets: `[batch + 1]` query row offsets.
        batch: Requests `B`.
        total_tokens: Query rows `T`.
        row: A query row to stop at (`row_plan`), or none.

    Returns:
        The number of requests walked, all of them well formed.
    """
    if read_index(offsets, 0) != 0:
        return 0
    for b in range(batch):
        var end = read_index(offsets, b + 1)
        if end < read_index(offsets, b) or end > total_tokens:
            return b
        if end > row:
            return b + 1
    return batch


def row_plan(op: IndexTopK, t: Int) -> RowPlan:
    """Row `t`'s request and bound, or `(-1, 0)` for an all `-1` row.

    The CPU path's rule, by the same walk (`scored_prefix`): requests are
    scored while the offsets are well formed (the first is 0, then
    non-decreasing and at most `T`), and a request is skipped when
    `request_span` says so. Device-safe (the GPU's plan launch).
    """
    var walked = scored_prefix(
        op.input_row_offsets, op.scored_requests, op.total_tokens, t
    )
    if walked == 0:
        return RowPlan(-1, 0)
    var b = walked - 1
    # The walk passed the requests before `b` because their ends were not
    # past `t`: `t` is at or after `b`'s start, so it is `b`'s row exactly
    # when it is before `b`'s end.
    if t >= read_index(op.input_row_offsets, b + 1):
        return RowPlan(-1, 0)
    var span = request_span(op, b)
    if not span.scored:
        return RowPlan(-1, 0)
    return RowPlan(
        b,
        candidate_bound[op.kpool, op.causal](
            span.cache_length, span.n, t - span.start
        ),
    )
