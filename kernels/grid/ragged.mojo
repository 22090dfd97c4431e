"""Reading ragged per-request metadata without trusting it.

A serving pipeline builds `input_row_offsets`, `cache_lengths` and
`slot_idx` elsewhere; a wrong value must never turn into an out-of-bounds
read or write. Every kernel reads its request's metadata through these
helpers, which widen each index to 64 bits (so `c + n` past 2^32 cannot
wrap) and report whether the request is safe to touch.
"""

comptime Ptr[dtype: DType] = Pointer[Scalar[dtype], MutAnyOrigin]
"""Raw element pointer every kernel works through (tensor data, any origin)."""

comptime Field[dtype: DType, origin: MutOrigin] = Pointer[Scalar[dtype], origin]
"""A tensor pointer held in an operand struct (`Ptr` once `origin` is bound:
struct fields must name their origin, so the structs take it as a parameter
and the kernels use them with `MutAnyOrigin`)."""


@always_inline
def read_index[dtype: DType](ptr: Ptr[dtype], i: Int) -> Int:
    """Reads entry `i` of a uint32/int32/int64/uint64 index tensor as `Int`.

    A uint64 past 2^63 reads negative, which every caller rejects.
    """
    return Int(ptr[unsafe_offset=i])


@fieldwise_init
struct TokenSpan(Copyable, TrivialRegisterPassable):
    """A request's token rows `[start, start + n)`, and whether they are
    valid (`ok`; `n` is 0 when not)."""

    var start: Int
    """First row."""
    var n: Int
    """Rows."""
    var ok: Bool
    """Whether `0 <= start <= end <= total_tokens`."""


@always_inline
def token_span[
    dtype: DType
](input_row_offsets: Ptr[dtype], b: Int, total_tokens: Int) -> TokenSpan:
    """Request `b`'s token rows and whether they are valid.

    Valid means `0 <= start <= end <= total_tokens`: decreasing offsets or
    offsets past the call's tokens make the request untouchable.
    """
    var start = read_index(input_row_offsets, b)
    var end = read_index(input_row_offsets, b + 1)
    var ok = 0 <= start and start <= end and end <= total_tokens
    return TokenSpan(start, end - start if ok else 0, ok)


@always_inline
def slot_ok(slot: Int, max_slots: Int) -> Bool:
    """Whether a ring slot index addresses a slot of the ring."""
    return 0 <= slot and slot < max_slots


@always_inline
def pending_pool[kpool: Int](cache_length: Int, new_tokens: Int) -> Int:
    """The pool id `ring_close` closes for one request, or -1.

    The pending pool `p = c // kpool` holds `r = c % kpool` ring members; it
    closes when this call brings the other `kpool - r`.
    """
    var r = cache_length % kpool
    var p = cache_length // kpool
    if (
        cache_length < 0
        or r == 0
        or cache_length + new_tokens < (p + 1) * kpool
    ):
        return -1
    return p


@fieldwise_init
struct PoolRange(Copyable, TrivialRegisterPassable):
    """Pools `first ..< first + count`."""

    var first: Int
    """First pool id."""
    var count: Int
    """Pools (at least 0)."""


@always_inline
def full_pools[kpool: Int](cache_length: Int, new_tokens: Int) -> PoolRange:
    """The pools made entirely of this call's tokens.

    `first = ceil(c / kpool)`; `count = floor((c + n) / kpool) - first`, at
    least 0.
    """
    var first = (cache_length + kpool - 1) // kpool
    var count = (cache_length + new_tokens) // kpool - first
    return PoolRange(first, max(count, 0))


@always_inline
def last_span_at[
    dtype: DType
](row_offsets: Ptr[dtype], batch: Int, row: Int) -> Int:
    """The last `b` in `[0, batch]` with `row_offsets[b] <= row`, else -1.

    A binary search over `[batch + 1]` row offsets (`input_row_offsets` or
    `pool_row_offsets`), exact when they never decrease; it reads only
    entries `0..batch`.
    """
    var lo = 0
    var hi = batch + 1
    while lo < hi:
        var mid = (lo + hi) // 2
        if read_index(row_offsets, mid) <= row:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@fieldwise_init
struct RaggedCall[
    dtype: DType, offset_dtype: DType, length_dtype: DType, origin: MutOrigin
](Copyable, TrivialRegisterPassable):
    """One call's new rows and per-request metadata, as every writer reads
    them (a field of each writer's operand struct).

    Parameters:
        dtype: Key dtype of `k` and `gate`.
        offset_dtype: Integer dtype of `input_row_offsets`.
        length_dtype: Integer dtype of `cache_lengths`.
        origin: Origin of the tensor pointers (`MutAnyOrigin` in kernels).
    """

    var k: Field[Self.dtype, Self.origin]
    """`[total_tokens, head_dim]` keys."""
    var gate: Field[Self.dtype, Self.origin]
    """`[total_tokens, head_dim]` gate scores."""
    var input_row_offsets: Field[Self.offset_dtype, Self.origin]
    """`[batch + 1]` token row offsets."""
    var cache_lengths: Field[Self.length_dtype, Self.origin]
    """`[batch]` cached-prefix lengths."""
    var batch: Int
    """Requests in this call."""
    var total_tokens: Int
    """Rows of `k` and `gate`."""


@fieldwise_init
struct Ring[dtype: DType, slot_dtype: DType, origin: MutOrigin](
    Copyable, TrivialRegisterPassable
):
    """The tail ring and each request's slot in it (`ring_close` reads it,
    `seed_tail` writes it).

    Parameters:
        dtype: Key dtype of `tail`.
        slot_dtype: Integer dtype of `slot_idx`.
        origin: Origin of the tensor pointers (`MutAnyOrigin` in kernels).
    """

    var tail: Field[Self.dtype, Self.origin]
    """`[max_slots, 2, ring_len, head_dim]`: keys, then gates."""
    var slot_idx: Field[Self.slot_dtype, Self.origin]
    """`[batch]` ring slots."""
    var max_slots: Int
    """Ring slots."""
    var ring_len: Int
    """Ring length R (a multiple of `kpool`)."""
