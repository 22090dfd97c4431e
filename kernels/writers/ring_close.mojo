"""`mo.mla.kpool.ring_close`: close each request's pending pool.

Per request `b` (64-bit arithmetic): `start = input_row_offsets[b]`,
`n = input_row_offsets[b+1] - start`, `c = cache_lengths[b]`,
`s = slot_idx[b]`, `r = c % kpool`, `p = c // kpool`. The ring slot `s`
holds the pending pool's first `r` members; when this call brings the other
`kpool - r` (`c + n >= (p + 1) * kpool`), members `q < r` come from
`tail[s, :, (p * kpool + q) % R]` and members `q >= r` from rows
`start + q - r` of `k` and `gate`, and the pool is written to `pooled[b]`
with `closed_pool[b] = p`. Otherwise (nothing pending, too few tokens, or
metadata that does not address the ring or the call's rows)
`closed_pool[b] = -1` and `pooled[b]` is zero. `tail` is only read.

`R` is the ring length `tail.dim_size(2)`: `kpool` for MAX's op, or
a multiple of it for a deeper ring. Since `p * kpool % R` is a multiple of
`kpool` and `R` is too, a pool's members never wrap around the ring's end.
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from max.gpu.host import DeviceContext

from ..grid.operands import (
    KernelOperands,
    dims,
    expect_offsets,
    expect_ring,
    expect_rows,
    expect_shape,
    expect_target,
)
from ..grid.block_phases import Shared
from ..grid.gpu_kernel import GpuKernel, launch_kernel
from ..grid.parallel import cpu_for_each_range
from .gpu_rows import (
    RowLane,
    gpu_aligned,
    gpu_rows_per_block,
    gpu_writer_threads,
    row_lane,
)
from .pooling import (
    PoolMembers,
    PoolSegments,
    cpu_pool_row,
    gpu_pool_row,
    zero_row,
)
from ..grid.ragged import (
    Field,
    RaggedCall,
    Ring,
    pending_pool,
    read_index,
    slot_ok,
    token_span,
)


@fieldwise_init
struct RingCloseOperands[
    dtype: DType,
    offset_dtype: DType,
    length_dtype: DType,
    slot_dtype: DType,
    kpool: Int,
    head_dim: Int,
    origin: MutOrigin,
](KernelOperands):
    """One ring_close call: its tensors and sizes (see `execute`).

    Parameters:
        dtype: Key dtype of `pooled`, `tail`, `k`, `gate`.
        offset_dtype: Integer dtype of `input_row_offsets`.
        length_dtype: Integer dtype of `cache_lengths`.
        slot_dtype: Integer dtype of `slot_idx`.
        kpool: Tokens per pool.
        head_dim: Channels per key.
        origin: Origin of the tensor pointers (`MutAnyOrigin` in kernels).
    """

    var pooled: Field[Self.dtype, Self.origin]
    """Output `[batch, head_dim]`."""
    var closed_pool: Field[DType.int32, Self.origin]
    """Output `[batch]` int32."""
    var ape: Field[DType.float32, Self.origin]
    """`[kpool, head_dim]` float32."""
    var call: RaggedCall[
        Self.dtype, Self.offset_dtype, Self.length_dtype, Self.origin
    ]
    """The new rows and per-request metadata."""
    var ring: Ring[Self.dtype, Self.slot_dtype, Self.origin]
    """The ring, read only here."""


comptime RingClose = RingCloseOperands[..., origin=MutAnyOrigin]
"""`RingCloseOperands` over the kernels' raw tensor pointers."""


def ring_close_operands[
    kpool: Int, head_dim: Int
](
    op_name: StaticString,
    pooled_name: StaticString,
    pooled: OutputTensor[rank=2, ...],
    closed_pool: OutputTensor[dtype=DType.int32, rank=1, ...],
    tail: MutableInputTensor[dtype=pooled.dtype, rank=4, ...],
    k: InputTensor[dtype=pooled.dtype, rank=2, ...],
    gate: InputTensor[dtype=pooled.dtype, rank=2, ...],
    ape: InputTensor[dtype=DType.float32, rank=2, ...],
    input_row_offsets: InputTensor[rank=1, ...],
    cache_lengths: InputTensor[rank=1, ...],
    slot_idx: InputTensor[rank=1, ...],
) raises -> RingCloseOperands[
    pooled.dtype,
    input_row_offsets.dtype,
    cache_lengths.dtype,
    slot_idx.dtype,
    kpool,
    head_dim,
    MutAnyOrigin,
]:
    """Checks ring_close's operands and gathers them (also the step's).

    `batch` is `closed_pool.dim_size(0)`.

    Parameters:
        kpool: Tokens per pool.
        head_dim: Channels per key.

    Args:
        op_name: Registered op name, the messages' prefix.
        pooled_name: What the op calls `pooled` (the step's `ring_pooled`).
        pooled: Output `[batch, head_dim]`.
        closed_pool: Output `[batch]` int32.
        tail: The ring, read only here.
        k: This call's keys.
        gate: This call's gate scores.
        ape: Within-pool position embedding.
        input_row_offsets: Token row offsets.
        cache_lengths: Cached-prefix lengths.
        slot_idx: Ring slots.

    Raises:
        Error: Naming the operand and both shapes (see `execute`).
    """
    var batch = closed_pool.dim_size(0)
    expect_shape(
        op_name,
        pooled_name,
        pooled.shape(),
        "batch, head_dim",
        dims(batch, head_dim),
    )
    expect_ring[kpool](op_name, tail.shape(), head_dim)
    expect_rows(op_name, k.shape(), gate.shape(), head_dim)
    expect_shape(
        op_name, "ape", ape.shape(), "kpool, head_dim", dims(kpool, head_dim)
    )
    expect_offsets(
        op_name, "input_row_offsets", input_row_offsets.shape(), batch
    )
    expect_shape(
        op_name, "cache_lengths", cache_lengths.shape(), "batch", dims(batch)
    )
    expect_shape(op_name, "slot_idx", slot_idx.shape(), "batch", dims(batch))
    return {
        pooled = pooled.unsafe_ptr(),
        closed_pool = closed_pool.unsafe_ptr(),
        ape = ape.unsafe_ptr(),
        call = {
            k = k.unsafe_ptr(),
            gate = gate.unsafe_ptr(),
            input_row_offsets = input_row_offsets.unsafe_ptr(),
            cache_lengths = cache_lengths.unsafe_ptr(),
            batch = batch,
            total_tokens = k.dim_size(0),
        },
        ring = {
            tail = tail.unsafe_ptr(),
            slot_idx = slot_idx.unsafe_ptr(),
            max_slots = tail.dim_size(0),
            ring_len = tail.dim_size(2),
        },
    }


@fieldwise_init
struct ClosingPool[dtype: DType, origin: MutOrigin](ImplicitlyCopyable):
    """What one request closes: a pool id and where its members are.

    Parameters:
        dtype: Key dtype.
        origin: Origin of the member pointers (`MutAnyOrigin` in
            `ClosePlan`: the step overwrites the ring in the kernel that
            reads it, so no read-only loads; see `PoolSegments`).
    """

    var pool: Int
    """The pool id closed, or -1 (nothing to close)."""
    var members: PoolSegments[Self.dtype, Self.origin]
    """The pool's members: the first `c % kpool` from the ring slot, the
    others from this call's rows. For `pool == -1` they point at the
    operands' first rows: safe to prefetch, never pooled."""


comptime ClosePlan[dtype: DType] = ClosingPool[dtype, MutAnyOrigin]
"""`ClosingPool` over the kernels' raw tensor pointers."""


@always_inline
def plan_close(b: Int, op: RingClose) -> ClosePlan[op.dtype]:
    """What request `b` closes, and where its members are (CPU and GPU)."""
    comptime kpool = op.kpool
    comptime head_dim = op.head_dim
    var span = token_span(op.call.input_row_offsets, b, op.call.total_tokens)
    var c = read_index(op.call.cache_lengths, b)
    var s = read_index(op.ring.slot_idx, b)
    var p = pending_pool[kpool](c, span.n)
    if not span.ok or not slot_ok(s, op.ring.max_slots):
        p = -1
    if p < 0:
        return ClosePlan(
            -1,
            PoolMembers[op.dtype](
                op.ring.tail, op.ring.tail, 0, op.call.k, op.call.gate
            ),
        )
    var ring_key = op.ring.tail.unsafe_offset(
        ((s * 2) * op.ring.ring_len + (p * kpool) % op.ring.ring_len) * head_dim
    )
    var first_new = span.start * head_dim
    return ClosePlan(
        p,
        PoolMembers[op.dtype](
            ring_key,
            ring_key.unsafe_offset(op.ring.ring_len * head_dim),
            c % kpool,
            op.call.k.unsafe_offset(first_new),
            op.call.gate.unsafe_offset(first_new),
        ),
    )


def close_requests(op: RingClose, lo: Int, hi: Int):
    """Closes requests `[lo, hi)` on the calling core (CPU).

    Channels go in SIMD steps through `cpu_pool_row`; the next request's
    gate rows are prefetched while this one pools.
    """
    comptime head_dim = op.head_dim
    if lo >= hi:
        return
    var this = plan_close(lo, op)
    for b in range(lo, hi):
        var next = plan_close(min(b + 1, hi - 1), op)
        var row = op.pooled.unsafe_offset(b * head_dim)
        op.closed_pool[unsafe_offset=b] = Int32(this.pool)
        if this.pool < 0:
            zero_row[op.dtype, head_dim](row)
        else:
            cpu_pool_row[op.dtype, op.kpool, head_dim](
                this.members, op.ape, row, next.members
            )
        this = next


def ring_close_cpu(op: RingClose):
    """CPU ring_close: requests split across cores (`close_requests`)."""

    def close(lo: Int, hi: Int) {imm}:
        close_requests(op, lo, hi)

    cpu_for_each_range(
        op.call.batch, op.call.batch * op.kpool * op.head_dim, close
    )


@always_inline
def note_plan_close(s: Shared, b: Int, op: RingClose):
    """Records `plan_close`'s metadata reads of request `b` (host code
    only: `Shared.note_span`)."""
    s.note_span(op.call.input_row_offsets, b)
    s.note_global_load(op.call.cache_lengths, b)
    s.note_global_load(op.ring.slot_idx, b)


def ring_close_lane(lane: RowLane, s: Shared, op: RingClose):
    """One GPU thread of ring_close: its channels of request `lane.row`.

    The thread's request and channels are `gpu_rows.row_lane`'s (4
    channels per thread, several requests per block); the caller skips
    rows past the batch. The request's first thread writes
    `closed_pool[b]`. A request with nothing to close writes -1 and zeros
    and never touches the ring. Global memory goes through the thread's
    view `s` (recorded in a profiled emulation).
    """
    comptime head_dim = op.head_dim
    var plan = plan_close(lane.row, op)
    note_plan_close(s, lane.row, op)
    if lane.first == 0:
        s.global_store(op.closed_pool, lane.row, Int32(plan.pool))
    gpu_pool_row[op.dtype, op.kpool, head_dim](
        lane,
        s,
        plan.members,
        op.ape,
        op.pooled.unsafe_offset(lane.row * head_dim),
        plan.pool >= 0,
        ring_close_aligned(op),
    )


@always_inline
def ring_close_aligned(op: RingClose) -> Bool:
    """Whether every tensor ring_close reads or writes by row is 16-byte
    aligned (`gpu_rows.gpu_aligned`)."""
    return gpu_aligned(
        Int(op.call.k)
        | Int(op.call.gate)
        | Int(op.ring.tail)
        | Int(op.ape)
        | Int(op.pooled)
    )


struct RingCloseKernel[Op: type_of(RingClose)](GpuKernel):
    """The ring_close launch: `gpu_rows.gpu_rows_per_block` requests per
    block, 4 channels per thread."""

    comptime Operands = Self.Op
    comptime name = "kpool_ring_close_kernel"
    comptime block_threads = gpu_writer_threads[
        Self.Op.dtype, Self.Op.head_dim
    ]()
    comptime grid_rows = "batch"
    comptime rows_per_block = gpu_rows_per_block[
        Self.Op.dtype, Self.Op.head_dim
    ]()

    @staticmethod
    def rows(op: Self.Operands) -> Int:
        """Requests."""
        return op.call.batch

    @staticmethod
    def run(phase: Int, block: Int, thread: Int, s: Shared, op: Self.Operands):
        """`ring_close_lane` for the thread's request, if any."""
        var lane = row_lane[op.dtype, op.head_dim](block, thread)
        if lane.row < op.call.batch:
            ring_close_lane(lane, s, op)


@extensibility.register("mo.mla.kpool.ring_close")
struct MLAKPoolRingClose:
    """Registers the `mo.mla.kpool.ring_close` graph op (CPU and GPU)."""

    @staticmethod
    def execute[
        *,
        head_dim: Int,
        kpool: Int,
        emulate_gpu: Bool = False,
        target: StaticString,
    ](
        pooled: OutputTensor[rank=2, ...],
        closed_pool: OutputTensor[dtype=DType.int32, rank=1, ...],
        tail: MutableInputTensor[dtype=pooled.dtype, rank=4, ...],
        k: InputTensor[dtype=pooled.dtype, rank=2, ...],
        gate: InputTensor[dtype=pooled.dtype, rank=2, ...],
        ape: InputTensor[dtype=DType.float32, rank=2, ...],
        input_row_offsets: InputTensor[rank=1, ...],
        cache_lengths: InputTensor[rank=1, ...],
        slot_idx: InputTensor[rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        """Closes each request's pending tail-ring pool.

        Parameters:
            head_dim: Channels per key; also the GPU block width (capped at
                1024, threads then stride over channels).
            kpool: Tokens per pool.
            emulate_gpu: Run the GPU kernel's threads over an emulated grid
                on a CPU target (testing; slow). MAX's wrapper never sets
                it, so its graphs get the CPU kernel.
            target: "cpu" or "gpu", filled in by the graph compiler.

        Args:
            pooled: Output `[batch, head_dim]` pooled keys, dtype of `k`;
                zero where `closed_pool` is -1.
            closed_pool: Output `[batch]` int32 pool id closed, or -1.
            tail: `[max_slots, 2, R, head_dim]` ring (plane 0 keys, plane 1
                gate scores; R = kpool, or a multiple of it). Read only.
            k: `[total_tokens, head_dim]` this call's keys.
            gate: `[total_tokens, head_dim]` this call's gate scores.
            ape: `[kpool, head_dim]` float32 within-pool position embedding.
            input_row_offsets: `[batch + 1]` token row offsets (uint32, or
                another integer dtype).
            cache_lengths: `[batch]` cached-prefix length per request.
            slot_idx: `[batch]` ring slot per request.
            ctx: Device context.

        Raises:
            Error: Naming the operand and both shapes, if an operand's
                shape disagrees with `head_dim`, `kpool` or the batch (the
                Python API rejects those before the graph is built).
        """
        comptime OP = "mo.mla.kpool.ring_close"
        var op = ring_close_operands[kpool, head_dim](
            OP,
            "pooled",
            pooled,
            closed_pool,
            tail,
            k,
            gate,
            ape,
            input_row_offsets,
            cache_lengths,
            slot_idx,
        )
        expect_target[emulate_gpu, target](OP)
        comptime if target == "cpu" and not emulate_gpu:
            ring_close_cpu(op)
        else:

            launch_kernel[RingCloseKernel[type_of(op)], emulate_gpu](op, ctx)
