"""Which rows `index_top_k` scores, and where their keys lie (CPU and GPU).

Metadata is not trusted. `scored_prefix` walks the offsets while they are
well formed (`end_well_formed`: the CPU path once per call; the GPU's
plan launch checks them a block per request, `launches.plan_phase`);
`request_span` decides whether a request is scored at all (`span_pages`,
`page_in_arenas`: the GPU plan's threads share the pages);
`candidate_bound` is the candidates a row sees; and `page_bases` is where
a page's keys and scales start for `layer_idx`.
Every function here is device-safe: no allocation, no raising.
"""

from std.math import ceildiv

from .operands import IndexTopK
from ..grid.ragged import Ptr, read_index


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
struct CacheSlot(Copyable, TrivialRegisterPassable):
    """Where a cache row lies: its key's first byte and its scale."""

    var key: Int
    """Element offset into `k_blocks`."""
    var scale: Int
    """Element offset into `k_scales`."""


def span_pages(op: IndexTopK, cache_length: Int, n: Int) -> Int:
    """Pages a request's last row needs (`cache_length >= 0`, `n` rows), or
    -1 when that is past either lookup table."""
    if n == 0:
        return 0
    var rows = (
        candidate_bound[op.kpool, op.causal](cache_length, n, n - 1)
        * op.rows_per_candidate
    )
    var pages = ceildiv(rows, op.page_size)
    if pages > op.key_pages or pages > op.scale_pages:
        return -1
    return pages


@always_inline
def page_in_arenas(op: IndexTopK, b: Int, page: Int) -> Bool:
    """Whether request `b`'s page `page` names a block inside `k_blocks`
    and one inside `k_scales` (the page is inside both lookup tables)."""
    var block = read_index(op.k_lookup_table, b * op.key_pages + page)
    var scale_block = read_index(
        op.k_scales_lookup_table, b * op.scale_pages + page
    )
    return 0 <= block < op.key_blocks and 0 <= scale_block < op.scale_blocks


def request_span(op: IndexTopK, b: Int) -> RequestSpan:
    """Request `b`'s rows `[start, start + n)`, its cache length, and whether to score it.

    Scored when its cache length is non-negative and every page its last
    row needs is inside both lookup tables (`span_pages`) and names a
    block inside `k_blocks` and `k_scales` (`page_in_arenas`). `b` must be
    below `op.scored_requests` (well-formed offsets).
    """
    var start = read_index(op.input_row_offsets, b)
    var n = read_index(op.input_row_offsets, b + 1) - start
    var c = read_index(op.k_cache_lengths, b)
    if c < 0:
        return RequestSpan(start, n, c, False)
    var pages = span_pages(op, c, n)
    if pages < 0:
        return RequestSpan(start, n, c, False)
    for page in range(pages):
        if not page_in_arenas(op, b, page):
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
](offsets: Ptr[dtype], batch: Int, total_tokens: Int) -> Int:
    """Requests `0 .. r - 1` whose offsets are well formed; returns `r`.

    Well formed: `offsets[0] == 0`, non-decreasing, and at most
    `total_tokens`, up to and including `offsets[r]` (the GPU's plan
    launch checks the same per request, `plan_phase`). Device-safe: no
    allocation, no raising.

    Args:
        offsets: `[batch + 1]` query row offsets.
        batch: Requests `B`.
        total_tokens: Query rows `T`.

    Returns:
        The number of requests walked, all of them well formed.
    """
    if read_index(offsets, 0) != 0:
        return 0
    for b in range(batch):
        if not end_well_formed(offsets, b, total_tokens):
            return b
    return batch


@always_inline
def end_well_formed[
    dtype: DType
](offsets: Ptr[dtype], b: Int, total_tokens: Int) -> Bool:
    """Whether request `b`'s end, `offsets[b + 1]`, is at least its start
    and at most `total_tokens`."""
    var end = read_index(offsets, b + 1)
    return read_index(offsets, b) <= end <= total_tokens
