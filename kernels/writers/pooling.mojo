"""The one pooling routine every writer shares.

A pool of `kpool` consecutive tokens collapses to one key, channel by channel:

    score[q, ch]  = gate[q, ch] + ape[q, ch]                 (float32)
    weight[q, ch] = exp(score[q, ch] - max_q score[q, ch])
    pooled[ch]    = sum_q weight[q, ch] * key[q, ch] / sum_q weight[q, ch]

a softmax over the pool's members q, computed in float32 with max
subtraction (gates of magnitude 100 cannot overflow) and cast to the key
dtype at the end. Every writer pools through this module (`pool_channels`
on GPU, `cpu_pool_row` on CPU, the same arithmetic lane for lane), with the
same member order and the same fused multiply-adds, each lane's channel
computed alone whatever the SIMD width (16 bytes a GPU thread, a cache line
a CPU step), so a pool comes out bitwise identical whichever writer builds
it on a device (docs/ops.md, Numerics). NaN in a gate, ape or key reaches
only its own channel, as it does in a softmax.

A pool's members come from two row segments, described by `PoolMembers`:
q < `split` from the ring segment (the pending pool's members stored in the
tail ring, contiguous because a pool never straddles the ring's wrap
point), q >= `split` from this call's rows of `k` and `gate`. A pool made
only of this call's rows (`compress`) has `split = 0`.
"""

from max.gpu.memory import AddressSpace
from std.math import exp, isnan
from std.memory import bitcast
from std.algorithm import vectorize
from std.sys import (
    PrefetchOptions,
    align_of,
    prefetch,
    is_gpu,
    simd_width_of,
    size_of,
)
from std.utils.numerics import nan, neg_inf

from .gpu_rows import RowLane, access_alignment, gpu_channel_width
from ..grid.block_phases import Shared
from ..grid.ragged import Ptr

comptime ACCUM = DType.float32
"""Scores, weights and sums are float32 whatever the key dtype."""


@always_inline
def cpu_pool_width[dtype: DType]() -> Int:
    """Channels one CPU SIMD step pools: one 64-byte cache line of keys.

    Parameters:
        dtype: Key dtype.

    Returns:
        The SIMD width every CPU writer uses, so that they agree bitwise.
    """
    return max(simd_width_of[ACCUM](), 64 // size_of[dtype]())


@always_inline
def _member[
    dtype: DType,
    width: Int,
    key_alignment: Int = align_of[Scalar[dtype]](),
    ape_alignment: Int = align_of[Float32](),
](
    key: Pointer[Scalar[dtype], _],
    gate: Pointer[Scalar[dtype], _],
    ape: Ptr[DType.float32],
    member_offset: Int,
    ape_offset: Int,
) -> Tuple[SIMD[ACCUM, width], SIMD[ACCUM, width]]:
    """Loads one member's (score, key) for `width` channels, in float32.

    The alignments are what the loads may claim (the GPU writers' 16-byte
    accesses); the defaults are the elements' own. On a GPU the loads go
    through the global address space: a member row is picked at run time
    from the ring or this call's rows, and through that choice the
    compiler no longer sees that both are global (generic loads).
    """
    comptime if is_gpu():
        return _load_member[dtype, width, key_alignment, ape_alignment](
            key.unsafe_address_space_cast[AddressSpace.GLOBAL](),
            gate.unsafe_address_space_cast[AddressSpace.GLOBAL](),
            ape.unsafe_address_space_cast[AddressSpace.GLOBAL](),
            member_offset,
            ape_offset,
        )
    return _load_member[dtype, width, key_alignment, ape_alignment](
        key, gate, ape, member_offset, ape_offset
    )


@always_inline
def _load_member[
    dtype: DType,
    width: Int,
    key_alignment: Int,
    ape_alignment: Int,
](
    key: Pointer[Scalar[dtype], ...],
    gate: Pointer[Scalar[dtype], ...],
    ape: Pointer[Float32, ...],
    member_offset: Int,
    ape_offset: Int,
) -> Tuple[SIMD[ACCUM, width], SIMD[ACCUM, width]]:
    """`_member`'s loads, in the pointers' address space."""
    var score = gate.unsafe_load[width=width, alignment=key_alignment](
        member_offset
    ).cast[ACCUM]() + ape.unsafe_load[width=width, alignment=ape_alignment](
        ape_offset
    )
    var value = key.unsafe_load[width=width, alignment=key_alignment](
        member_offset
    ).cast[ACCUM]()
    return (score, value)


@fieldwise_init
struct PoolSegments[dtype: DType, origin: MutOrigin](ImplicitlyCopyable):
    """Where one pool's members are: a ring segment, then this call's rows.

    Member `q < split` is row `q` of `ring_key` / `ring_gate`; member
    `q >= split` is row `q - split` of `new_key` / `new_gate`. Rows are
    `row_stride` elements apart (`head_dim`). Kernels name it
    `PoolMembers[dtype]`.

    Parameters:
        dtype: Key and gate dtype.
        origin: Origin of the pointers (`MutAnyOrigin` in `PoolMembers`).
            Mutable although pooling only reads its members: the step
            closes a ring slot and then overwrites it in the same kernel,
            and through an immutable pointer the GPU compiler may load the
            ring with non-coherent loads (`ld.global.nc`, the read-only
            path), valid only for memory the kernel never writes.
    """

    var ring_key: Pointer[Scalar[Self.dtype], Self.origin]
    """Key row of member 0 in the ring segment."""
    var ring_gate: Pointer[Scalar[Self.dtype], Self.origin]
    """Gate row of member 0 in the ring segment."""
    var split: Int
    """Members taken from the ring segment (0 for a pool of new rows)."""
    var new_key: Pointer[Scalar[Self.dtype], Self.origin]
    """Key row of member `split`, in this call's `k`."""
    var new_gate: Pointer[Scalar[Self.dtype], Self.origin]
    """Gate row of member `split`, in this call's `gate`."""

    @staticmethod
    @always_inline
    def new_rows(
        k: Ptr[Self.dtype], gate: Ptr[Self.dtype], first: Int
    ) -> PoolSegments[Self.dtype, MutAnyOrigin]:
        """A pool made only of this call's rows, member 0 at element `first`.

        Args:
            k: This call's keys.
            gate: This call's gate scores.
            first: Element offset of member 0 (`first_row * head_dim`).

        Returns:
            Members with an empty ring segment.
        """
        return PoolSegments[Self.dtype, MutAnyOrigin](
            k, gate, 0, k.unsafe_offset(first), gate.unsafe_offset(first)
        )

    @always_inline
    def row(
        self, q: Int, row_stride: Int
    ) -> Tuple[Ptr[Self.dtype], Ptr[Self.dtype], Int]:
        """`(key, gate, offset)` of member `q`: a ring or a new-token row.

        The pointers come back as the kernels' own (`MutAnyOrigin`), so
        two rows of one origin may be returned together.
        """
        if q < self.split:
            return (
                self.ring_key.unsafe_origin_cast[MutAnyOrigin](),
                self.ring_gate.unsafe_origin_cast[MutAnyOrigin](),
                q * row_stride,
            )
        return (
            self.new_key.unsafe_origin_cast[MutAnyOrigin](),
            self.new_gate.unsafe_origin_cast[MutAnyOrigin](),
            (q - self.split) * row_stride,
        )


comptime PoolMembers[dtype: DType] = PoolSegments[dtype, MutAnyOrigin]
"""`PoolSegments` over the kernels' raw tensor pointers (`Ptr`): mutable,
so a GPU kernel never reads a member through the read-only path."""


@always_inline
def _accumulate[
    width: Int
](
    score: SIMD[ACCUM, width],
    value: SIMD[ACCUM, width],
    peak: SIMD[ACCUM, width],
    mut total: SIMD[ACCUM, width],
    mut acc: SIMD[ACCUM, width],
    mut undefined: SIMD[ACCUM, width],
):
    """Adds one member to the softmax sums (pass 2), in member order.

    `max` skips NaN and CPU `exp(NaN)` is +inf, so a NaN shifted score (a
    NaN gate or ape, or inf - inf) is tracked in `undefined`, as a softmax
    would propagate it: a lane of `undefined` holds a NaN once any of its
    shifted scores was NaN (0 before). A float32 vector, not a bool one:
    AVX2 has no mask registers, and a bool vector kept across members
    was packed to bytes and back at every member.
    """
    var shifted = score - peak
    undefined = isnan(shifted).select(shifted, undefined)
    var weight = exp(shifted)
    total += weight
    acc = weight.fma(value, acc)


@always_inline
def _pooled[
    dtype: DType, width: Int
](
    total: SIMD[ACCUM, width],
    acc: SIMD[ACCUM, width],
    undefined: SIMD[ACCUM, width],
) -> SIMD[dtype, width]:
    """The pooled key from the pass-2 sums, cast to the key dtype."""
    return to_key_dtype[dtype](
        isnan(undefined).select(SIMD[ACCUM, width](nan[ACCUM]()), acc / total)
    )


@always_inline
def to_key_dtype[
    dtype: DType, width: Int
](value: SIMD[ACCUM, width]) -> SIMD[dtype, width]:
    """`value.cast[dtype]()`, with bfloat16 in SIMD integer ops on a CPU.

    On x86 the compiler turns a float32 to bfloat16 cast into a runtime
    call per lane (`__truncsfbf2`), a quarter of ring_close's time at
    bfloat16. The same rounding in vector integer ops: round to nearest,
    ties to even, on the high 16 bits (`bits + 0x7FFF + bit 16`, which
    also rounds past the largest finite value to infinity), and a NaN as
    the quiet NaN `0x7FC0` with its sign: bit for bit what that runtime
    call returns (Mojo's runtime drops a NaN's payload; the tests check
    every high half). Subnormals round like the rest (bfloat16 has
    float32's exponent range), where a host whose compiler converts with
    AVX512-BF16's `vcvtneps2bf16` flushes them to zero (and keeps a NaN's
    payload). A GPU converts in one instruction.
    """
    comptime if dtype == DType.bfloat16 and not is_gpu():
        var bits = bitcast[DType.uint32, width](value)
        var rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        var quiet = ((bits >> 16) & 0x8000) | 0x7FC0
        var high = isnan(value).select(quiet, rounded).cast[DType.uint16]()
        return bitcast[dtype, width](high)
    else:
        return value.cast[dtype]()


@always_inline
def pool_channels[
    dtype: DType,
    width: Int,
    kpool: Int,
    key_alignment: Int = align_of[Scalar[dtype]](),
    ape_alignment: Int = align_of[Float32](),
](
    s: Shared,
    members: PoolMembers[dtype],
    ape: Ptr[DType.float32],
    row_stride: Int,
    ch: Int,
) -> SIMD[dtype, width]:
    """Pools channels `[ch, ch + width)` of one pool (the GPU writers' path).

    The member loads are `_member`'s, shared with the CPU path; the
    thread's view `s` records them beside it (`note_global_load`: the gate
    and ape in pass 1, whose key load is dead, all three in pass 2).

    The ape (`kpool x head_dim` floats, 2 KiB at kpool 4) is read by
    every block from L1 and L2, not HBM.

    Parameters:
        dtype: Key and gate dtype (float32, bfloat16 or float16).
        width: Channels pooled at once (`gpu_channel_width`).
        kpool: Tokens per pool.
        key_alignment: Alignment the key and gate loads may claim.
        ape_alignment: Alignment the ape loads may claim.

    Args:
        s: The thread's view (records the loads in a profiled emulation).
        members: Where the pool's members are.
        ape: `[kpool, row_stride]` float32 within-pool position embedding.
        row_stride: Elements between consecutive member rows (`head_dim`).
        ch: First channel.

    Returns:
        The pooled key for the `width` channels, in the key dtype.
    """
    # Pass 1: the per-channel maximum score, so no exp can overflow.
    var peak = SIMD[ACCUM, width](neg_inf[ACCUM]())
    for q in range(kpool):
        var m = members.row(q, row_stride)
        var member = _member[dtype, width, key_alignment, ape_alignment](
            m[0], m[1], ape, m[2] + ch, q * row_stride + ch
        )
        s.note_global_load[width](m[1], m[2] + ch)
        s.note_global_load[width](ape, q * row_stride + ch)
        peak = max(peak, member[0])
    # Pass 2: weights and the weighted sum, members in order q = 0..kpool-1.
    var total = SIMD[ACCUM, width](0)
    var acc = SIMD[ACCUM, width](0)
    var undefined = SIMD[ACCUM, width](0)
    for q in range(kpool):
        var m = members.row(q, row_stride)
        var member = _member[dtype, width, key_alignment, ape_alignment](
            m[0], m[1], ape, m[2] + ch, q * row_stride + ch
        )
        s.note_global_load[width](m[1], m[2] + ch)
        s.note_global_load[width](ape, q * row_stride + ch)
        s.note_global_load[width](m[0], m[2] + ch)
        _accumulate(member[0], member[1], peak, total, acc, undefined)
    return _pooled[dtype](total, acc, undefined)


@always_inline
def _gpu_pool_row[
    dtype: DType,
    kpool: Int,
    head_dim: Int,
    key_alignment: Int,
    ape_alignment: Int,
](
    lane: RowLane,
    s: Shared,
    members: PoolMembers[dtype],
    ape: Ptr[DType.float32],
    dest: Ptr[dtype],
    pooled: Bool,
):
    """`gpu_pool_row` with the loads' and stores' alignments fixed."""
    comptime width = gpu_channel_width[dtype, head_dim]()
    for ch in range(lane.first, head_dim, lane.stride):
        var value = SIMD[dtype, width](0)
        if pooled:
            value = pool_channels[
                dtype, width, kpool, key_alignment, ape_alignment
            ](s, members, ape, head_dim, ch)
        s.global_store[width=width, alignment=key_alignment](dest, ch, value)


@always_inline
def gpu_pool_row[
    dtype: DType, kpool: Int, head_dim: Int
](
    lane: RowLane,
    s: Shared,
    members: PoolMembers[dtype],
    ape: Ptr[DType.float32],
    dest: Ptr[dtype],
    pooled: Bool,
    aligned: Bool,
):
    """One GPU thread's channels of one pooled row (`gpu_rows.row_lane`).

    Parameters:
        dtype: Key dtype.
        kpool: Tokens per pool.
        head_dim: Channels per key (also the member row stride).

    Args:
        lane: The thread's channels (`first`, `first + stride`, ...).
        s: The thread's view: the loads and stores go through it (recorded
            in a profiled emulation).
        members: Where the pool's members are.
        ape: `[kpool, head_dim]` float32 within-pool position embedding.
        dest: The output row.
        pooled: Whether the row is a pool (else zeros, members unread).
        aligned: Whether every operand base is 16-byte aligned
            (`gpu_aligned`): 16-byte accesses, else element accesses.
    """
    comptime width = gpu_channel_width[dtype, head_dim]()
    if aligned:
        _gpu_pool_row[
            dtype,
            kpool,
            head_dim,
            access_alignment[dtype, width](),
            access_alignment[DType.float32, width](),
        ](lane, s, members, ape, dest, pooled)
    else:
        _gpu_pool_row[
            dtype,
            kpool,
            head_dim,
            align_of[Scalar[dtype]](),
            align_of[Float32](),
        ](lane, s, members, ape, dest, pooled)


comptime CPU_PREFETCH_POOL_BYTES = 16 * 1024
"""Most key bytes of one pool that pass 1 prefetches for pass 2: a third of
a 48 KiB L1 (half of a 32 KiB one). At kpool 128 x 128 float32 channels
(64 KiB) the prefetched rows evicted one another: without the prefetch
`ring_close` ran 1.2x faster (docs/performance.md); at kpool 4 (2 KiB) it
gains a few percent."""


@always_inline
def cpu_chunk_width[dtype: DType, head_dim: Int]() -> Int:
    """Channels per SIMD step on CPU: a power of two dividing `head_dim`.

    At most one 64-byte cache line of keys (`cpu_pool_width`), so every
    CPU writer of a given `(dtype, head_dim)` uses the same width.
    """
    var width = cpu_pool_width[dtype]()
    while head_dim % width != 0:
        width //= 2
    return width


@always_inline
def cpu_pool_row[
    dtype: DType, kpool: Int, head_dim: Int
](
    members: PoolMembers[dtype],
    ape: Ptr[DType.float32],
    dest: Ptr[dtype],
    next: PoolMembers[dtype],
):
    """Pools all `head_dim` channels of one pool into `dest[0:head_dim]`.

    The CPU writers' only entry to the pooling math. Same arithmetic, lane
    for lane, as `pool_channels`, but member rows are walked in order with
    every channel's running maximum, weight sum and weighted sum kept in
    small stack arrays: each pass streams whole rows instead of hopping a
    row stride per channel chunk. Pass 1 prefetches each member's key row
    for pass 2 when the pool's key rows fit `CPU_PREFETCH_POOL_BYTES` (a
    larger pool's would evict one another before pass 2 reads them), and
    pass 2 prefetches the next pool's gate rows for its pass 1, so the
    core rarely waits on memory (docs/performance.md).

    Parameters:
        dtype: Key dtype.
        kpool: Tokens per pool.
        head_dim: Channels per key (also the member row stride).

    Args:
        members: Where the pool's members are.
        ape: `[kpool, head_dim]` float32 within-pool position embedding.
        dest: Destination row, `head_dim` elements of `dtype`.
        next: The pool this core pools next. Its gate rows are prefetched
            during pass 2, so its pass 1 finds them in cache; only
            addresses, never dereferenced (any value is safe).
    """
    comptime width = cpu_chunk_width[dtype, head_dim]()
    comptime chunks = head_dim // width
    comptime line = 64 // size_of[dtype]()
    comptime prefetch_read = PrefetchOptions().for_read().high_locality()
    comptime prefetch_keys = (
        kpool * head_dim * size_of[dtype]() <= CPU_PREFETCH_POOL_BYTES
    )
    var peak = Array[SIMD[ACCUM, width], chunks](fill=neg_inf[ACCUM]())
    var total = Array[SIMD[ACCUM, width], chunks](fill=0)
    var acc = Array[SIMD[ACCUM, width], chunks](fill=0)
    var undefined = Array[SIMD[ACCUM, width], chunks](fill=0)
    # Pass 1: every channel's maximum score, member rows in order.
    for q in range(kpool):
        var m = members.row(q, head_dim)
        comptime if prefetch_keys:
            for ch in range(0, head_dim, line):
                prefetch[prefetch_read](m[0].unsafe_offset(m[2] + ch))
        for c in range(chunks):
            var ch = c * width
            var member = _member[dtype, width](
                m[0], m[1], ape, m[2] + ch, q * head_dim + ch
            )
            peak[c] = max(peak[c], member[0])
    # Pass 2: weights and weighted sums, member rows in order.
    for q in range(kpool):
        var m = members.row(q, head_dim)
        var ahead = next.row(q, head_dim)
        for ch in range(0, head_dim, line):
            prefetch[prefetch_read](ahead[1].unsafe_offset(ahead[2] + ch))
        for c in range(chunks):
            var ch = c * width
            var member = _member[dtype, width](
                m[0], m[1], ape, m[2] + ch, q * head_dim + ch
            )
            _accumulate(
                member[0], member[1], peak[c], total[c], acc[c], undefined[c]
            )
    for c in range(chunks):
        dest.unsafe_store[width=width](
            c * width, _pooled[dtype](total[c], acc[c], undefined[c])
        )


@always_inline
def zero_row[dtype: DType, head_dim: Int](dest: Ptr[dtype]):
    """Writes `head_dim` zeros (+0.0) with full-width SIMD stores (CPU)."""

    def chunk[width: Int](ch: Int) {imm}:
        dest.unsafe_store[width=width](ch, SIMD[dtype, width](0))

    vectorize[simd_width_of[dtype]()](head_dim, chunk)
