"""`mo.mla.kpool.seed_tail`: stash each request's trailing tokens in its ring.

In place on `tail[max_slots, 2, R, head_dim]`: for every absolute position
`pos` in `[max(c, floor((c + n) / kpool) * kpool - (R - kpool)), c + n)`, row
`start + pos - c` of `k` and `gate` is copied to `tail[s, 0, pos % R]` and
`tail[s, 1, pos % R]`. With MAX's one-pool ring (`R == kpool`) that is exactly
the trailing incomplete pool's tokens; a deeper ring also keeps the
`R - kpool` tokens before them (for speculative decoding, where a pool closed
by a draft that is later rejected must be redone from intact members).
Positions below `c` are never written, and a request whose slot or offsets do
not address the ring and the call's rows is skipped.

Run it after `ring_close` in the same call: it may overwrite ring entries
`ring_close` reads.
"""

import extensibility
from extensibility import InputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from max.gpu.host import DeviceContext
from std.algorithm import vectorize
from std.sys import simd_width_of

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
    copy_channels,
    gpu_aligned,
    gpu_rows_per_block,
    gpu_writer_threads,
    row_lane,
)
from ..grid.ragged import (
    Field,
    Ptr,
    RaggedCall,
    Ring,
    read_index,
    slot_ok,
    token_span,
)


@fieldwise_init
struct SeedTailOperands[
    dtype: DType,
    offset_dtype: DType,
    length_dtype: DType,
    slot_dtype: DType,
    kpool: Int,
    head_dim: Int,
    origin: MutOrigin,
](KernelOperands):
    """One seed_tail call: its tensors and sizes (see `execute`).

    Parameters:
        dtype: Key dtype of `tail`, `k`, `gate`.
        offset_dtype: Integer dtype of `input_row_offsets`.
        length_dtype: Integer dtype of `cache_lengths`.
        slot_dtype: Integer dtype of `slot_idx`.
        kpool: Tokens per pool.
        head_dim: Channels per key.
        origin: Origin of the tensor pointers (`MutAnyOrigin` in kernels).
    """

    var call: RaggedCall[
        Self.dtype, Self.offset_dtype, Self.length_dtype, Self.origin
    ]
    """The new rows and per-request metadata."""
    var ring: Ring[Self.dtype, Self.slot_dtype, Self.origin]
    """The ring, written in place."""


comptime SeedTail = SeedTailOperands[..., origin=MutAnyOrigin]
"""`SeedTailOperands` over the kernels' raw tensor pointers."""


@fieldwise_init
struct Stashing[dtype: DType, origin: MutOrigin](ImplicitlyCopyable):
    """What one request stashes, and where.

    Absolute positions `[lo, hi)` go from rows `first_row + pos - lo` of
    `k` / `gate` to rows `pos % ring_len` of the slot's key and gate
    planes. `lo == hi` (nothing) for a request whose slot or offsets are
    bad.

    Parameters:
        dtype: Key dtype.
        origin: Origin of the ring pointers (`MutAnyOrigin` in `Stash`).
    """

    var lo: Int
    """First position stashed."""
    var hi: Int
    """One past the last position stashed (`c + n`)."""
    var first_row: Int
    """Row of `k` / `gate` holding position `lo`."""
    var ring_key: Field[Self.dtype, Self.origin]
    """Row 0 of the slot's key plane."""
    var ring_gate: Field[Self.dtype, Self.origin]
    """Row 0 of the slot's gate plane."""


comptime Stash[dtype: DType] = Stashing[dtype, MutAnyOrigin]
"""`Stashing` over the kernels' raw tensor pointers."""


@always_inline
def copy_row[dtype: DType, head_dim: Int](dest: Ptr[dtype], src: Ptr[dtype]):
    """Copies one `head_dim` row with full-width SIMD moves (CPU)."""

    def chunk[width: Int](ch: Int) {imm}:
        dest.unsafe_store[width=width](ch, src.unsafe_load[width=width](ch))

    vectorize[simd_width_of[dtype]()](head_dim, chunk)


@always_inline
def plan_stash(b: Int, op: SeedTail) -> Stash[op.dtype]:
    """What request `b` stashes, and where (CPU and GPU)."""
    var span = token_span(op.call.input_row_offsets, b, op.call.total_tokens)
    var c = read_index(op.call.cache_lengths, b)
    var s = read_index(op.ring.slot_idx, b)
    if not span.ok or c < 0 or not slot_ok(s, op.ring.max_slots):
        return Stash[op.dtype](0, 0, 0, op.ring.tail, op.ring.tail)
    var hi = c + span.n
    var lo = max(c, (hi // op.kpool) * op.kpool - (op.ring.ring_len - op.kpool))
    var ring_key = op.ring.tail.unsafe_offset(
        s * 2 * op.ring.ring_len * op.head_dim
    )
    return Stash[op.dtype](
        lo,
        hi,
        span.start + lo - c,
        ring_key,
        ring_key.unsafe_offset(op.ring.ring_len * op.head_dim),
    )


def seed_requests(op: SeedTail, lo: Int, hi: Int):
    """Stashes requests `[lo, hi)` on the calling core: a SIMD row copy per
    position (CPU)."""
    comptime head_dim = op.head_dim
    for b in range(lo, hi):
        var stash = plan_stash(b, op)
        for pos in range(stash.lo, stash.hi):
            var src = (stash.first_row + pos - stash.lo) * head_dim
            var dst = (pos % op.ring.ring_len) * head_dim
            copy_row[op.dtype, head_dim](
                stash.ring_key.unsafe_offset(dst), op.call.k.unsafe_offset(src)
            )
            copy_row[op.dtype, head_dim](
                stash.ring_gate.unsafe_offset(dst),
                op.call.gate.unsafe_offset(src),
            )


def seed_tail_cpu(op: SeedTail):
    """CPU seed_tail: requests split across cores (`seed_requests`)."""

    def seed(lo: Int, hi: Int) {imm}:
        seed_requests(op, lo, hi)

    cpu_for_each_range(
        op.call.batch, op.call.batch * op.ring.ring_len * op.head_dim, seed
    )


@always_inline
def note_plan_stash(s: Shared, b: Int, op: SeedTail):
    """Records `plan_stash`'s metadata reads of request `b` (host code
    only: `Shared.note_span`)."""
    s.note_span(op.call.input_row_offsets, b)
    s.note_global_load(op.call.cache_lengths, b)
    s.note_global_load(op.ring.slot_idx, b)


def seed_tail_lane(lane: RowLane, s: Shared, op: SeedTail):
    """One GPU thread of seed_tail: its channels of request `lane.row`.

    Copies the thread's channels (`gpu_rows.row_lane`) of each of the
    request's trailing positions into its ring slot; the caller skips rows
    past the batch. Global memory goes through the thread's view `s`
    (recorded in a profiled emulation).
    """
    comptime head_dim = op.head_dim
    var stash = plan_stash(lane.row, op)
    note_plan_stash(s, lane.row, op)
    var aligned = gpu_aligned(
        Int(op.call.k) | Int(op.call.gate) | Int(op.ring.tail)
    )
    for pos in range(stash.lo, stash.hi):
        var src = (stash.first_row + pos - stash.lo) * head_dim
        var dst = (pos % op.ring.ring_len) * head_dim
        copy_channels[op.dtype, head_dim](
            lane,
            s,
            stash.ring_key.unsafe_offset(dst),
            op.call.k.unsafe_offset(src),
            aligned,
        )
        copy_channels[op.dtype, head_dim](
            lane,
            s,
            stash.ring_gate.unsafe_offset(dst),
            op.call.gate.unsafe_offset(src),
            aligned,
        )


struct SeedTailKernel[Op: type_of(SeedTail)](GpuKernel):
    """The seed_tail launch: `gpu_rows.gpu_rows_per_block` requests per
    block, 4 channels per thread."""

    comptime Operands = Self.Op
    comptime name = "kpool_seed_tail_kernel"
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
        """`seed_tail_lane` for the thread's request, if any."""
        var lane = row_lane[op.dtype, op.head_dim](block, thread)
        if lane.row < op.call.batch:
            seed_tail_lane(lane, s, op)


@extensibility.register("mo.mla.kpool.seed_tail")
struct MLAKPoolSeedTail:
    """Registers the `mo.mla.kpool.seed_tail` graph op (CPU and GPU)."""

    @staticmethod
    def execute[
        *,
        head_dim: Int,
        kpool: Int,
        emulate_gpu: Bool = False,
        target: StaticString,
    ](
        tail: MutableInputTensor[rank=4, ...],
        k: InputTensor[dtype=tail.dtype, rank=2, ...],
        gate: InputTensor[dtype=tail.dtype, rank=2, ...],
        input_row_offsets: InputTensor[rank=1, ...],
        cache_lengths: InputTensor[rank=1, ...],
        slot_idx: InputTensor[rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        """Stashes each request's trailing incomplete tokens into its ring.

        Parameters:
            head_dim: Channels per key; also the GPU block width (capped at
                1024, threads then stride over channels).
            kpool: Tokens per pool.
            emulate_gpu: Run the GPU kernel's threads over an emulated grid
                on a CPU target (testing; slow). MAX's wrapper never sets
                it, so its graphs get the CPU kernel.
            target: "cpu" or "gpu", filled in by the graph compiler.

        Args:
            tail: `[max_slots, 2, R, head_dim]` ring, written in place (plane
                0 keys, plane 1 gate scores; R = kpool, or a multiple of it).
            k: `[total_tokens, head_dim]` this call's keys.
            gate: `[total_tokens, head_dim]` this call's gate scores.
            input_row_offsets: `[batch + 1]` token row offsets.
            cache_lengths: `[batch]` cached-prefix length per request.
            slot_idx: `[batch]` ring slot per request.
            ctx: Device context.

        Raises:
            Error: Naming the operand and both shapes, if an operand's
                shape disagrees with `head_dim`, `kpool` or the batch (the
                Python API rejects those before the graph is built).
        """
        comptime OP = "mo.mla.kpool.seed_tail"
        var batch = cache_lengths.dim_size(0)
        expect_ring[kpool](OP, tail.shape(), head_dim)
        expect_rows(OP, k.shape(), gate.shape(), head_dim)
        expect_offsets(
            OP, "input_row_offsets", input_row_offsets.shape(), batch
        )
        expect_shape(OP, "slot_idx", slot_idx.shape(), "batch", dims(batch))
        expect_target[emulate_gpu, target](OP)
        var op = SeedTailOperands[
            tail.dtype,
            input_row_offsets.dtype,
            cache_lengths.dtype,
            slot_idx.dtype,
            kpool,
            head_dim,
            MutAnyOrigin,
        ](
            call={
                k = k.unsafe_ptr(),
                gate = gate.unsafe_ptr(),
                input_row_offsets = input_row_offsets.unsafe_ptr(),
                cache_lengths = cache_lengths.unsafe_ptr(),
                batch = batch,
                total_tokens = k.dim_size(0),
            },
            ring={
                tail = tail.unsafe_ptr(),
                slot_idx = slot_idx.unsafe_ptr(),
                max_slots = tail.dim_size(0),
                ring_len = tail.dim_size(2),
            },
        )
        comptime if target == "cpu" and not emulate_gpu:
            seed_tail_cpu(op)
        else:

            launch_kernel[SeedTailKernel[type_of(op)], emulate_gpu](op, ctx)
