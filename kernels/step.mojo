"""`mla_kpool.step`: one call's k-pool work in one op.

Does, in one op, what `ring_close`, the `pool_row_offsets` helper,
`compress` and `seed_tail` do in sequence for one serving call, with the
same outputs bit for bit (on the same device) and the same ring writes:

- `ring_pooled[b]`, `ring_closed_pool[b]`: request `b`'s pending pool,
  closed from the ring and this call's leading rows (`ring_close`);
- `pool_row_offsets [batch + 1]` uint32: the exclusive prefix sum of each
  request's count of pools made only of this call's rows,
  `max(0, (c + n) // kpool - ceil(c / kpool))`, zero when
  `n = input_row_offsets[b+1] - input_row_offsets[b]` or `c` is negative,
  summed in 64 bits and stored modulo 2^32 (what the graph helper computes);
- `first_pool[b]` int64: `ceil(c / kpool)` (floor division of
  `c + kpool - 1`, so a negative `c` rounds down as the graph's does);
- `pooled [total_tokens // kpool, head_dim]`: those pools, written by
  output row exactly as `compress` writes them given `pool_row_offsets`;
- the ring `tail`: each request's trailing tokens stashed (`seed_tail`).

Every request's pending pool is read from the ring before that request's
tokens are written into it, inside the op, so callers cannot order the
writers wrongly. Two requests of one call on the same ring slot are a
caller error with no defined result (as with the separate writers).

The op holds the three writers' operand structs and runs their code on
them, so the paths cannot drift apart: the CPU path runs `close_requests`,
`compress_rows` and `seed_requests` over ranges, the GPU path runs
`ring_close_thread`, `seed_tail_thread` and `compress_thread`.

GPU launches. The prefix sum of pool counts is the only dependency across
requests: a compress row must know which request owns it. Two launches on
one stream, which the stream orders:

1. `kpool_step_scan_kernel`, one thread: the serial scan writing
   `pool_row_offsets`. Without shared memory or a barrier (neither of
   which the emulated grid can check) a block-wide scan still leaves the
   last request's offset depending on every count, the same critical path
   as one thread, plus contention; a faster scan needs either a barrier or
   a third launch (per-chunk sums, then bases). At serving batches (up to a
   few hundred requests) the scan is a few hundred simple iterations, less
   than a launch costs, so it stays one thread.
2. `kpool_step_kernel`, `batch + total_tokens // kpool` blocks. Block
   `b < batch` closes request `b` and then seeds it: the thread that pools
   channel `ch` from the ring is the one that later overwrites channel `ch`
   of that ring slot, so reading before writing needs no barrier. Block
   `batch + i` writes output row `i`, finding its owner by binary search
   over the offsets launch 1 wrote. Folding the scan into this launch would
   make every compress block redo it.

On the CPU the scan runs first on the calling thread; then each core takes
a contiguous range of requests, which it closes and seeds in that order,
and a contiguous range of output rows, which it compresses, in one
parallel region (the separate writers wake the cores three times).
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from max.gpu.host import DeviceContext
from max.gpu import block_idx, thread_idx
from std.sys import num_physical_cores

from .compress import CompressOperands, compress_rows, compress_thread
from .operands import (
    ANY,
    dims,
    expect_offsets,
    expect_pool_rows,
    expect_ring,
    expect_rows,
    expect_shape,
    expect_target,
)
from .parallel import (
    KernelOperands,
    cpu_for_each_range,
    emulate_grid,
    gpu_block_width,
)
from .ragged import Field, full_pools, read_index
from .ring_close import RingCloseOperands, close_requests, ring_close_thread
from .seed_tail import SeedTailOperands, seed_requests, seed_tail_thread


@fieldwise_init
struct StepOperands[
    dtype: DType,
    offset_dtype: DType,
    length_dtype: DType,
    slot_dtype: DType,
    kpool: Int,
    head_dim: Int,
    origin: MutOrigin,
](KernelOperands):
    """One step call: the three writers' operands over its tensors.

    `close.pooled` is the op's `ring_pooled`; `compress.pool_row_offsets`
    is its uint32 output, written by the scan before `compress` reads it;
    `seed.tail` is `close.tail`.

    Parameters:
        dtype: Key dtype of the pooled outputs, `tail`, `k`, `gate`.
        offset_dtype: Integer dtype of `input_row_offsets`.
        length_dtype: Integer dtype of `cache_lengths`.
        slot_dtype: Integer dtype of `slot_idx`.
        kpool: Tokens per pool.
        head_dim: Channels per key.
        origin: Origin of the tensor pointers (`MutAnyOrigin` in kernels).
    """

    var close: RingCloseOperands[
        Self.dtype,
        Self.offset_dtype,
        Self.length_dtype,
        Self.slot_dtype,
        Self.kpool,
        Self.head_dim,
        Self.origin,
    ]
    """Operands of ring_close."""
    var compress: CompressOperands[
        Self.dtype,
        Self.offset_dtype,
        DType.uint32,
        Self.length_dtype,
        Self.kpool,
        Self.head_dim,
        Self.origin,
    ]
    """Operands of compress."""
    var seed: SeedTailOperands[
        Self.dtype,
        Self.offset_dtype,
        Self.length_dtype,
        Self.slot_dtype,
        Self.kpool,
        Self.head_dim,
        Self.origin,
    ]
    """Operands of seed_tail."""
    var first_pool: Field[DType.int64, Self.origin]
    """Output `[batch]` int64."""


comptime Step = StepOperands[..., origin=MutAnyOrigin]
"""`StepOperands` over the kernels' raw tensor pointers."""


@always_inline
def step_pool_count(op: Step, b: Int) -> Int:
    """Request `b`'s count in `pool_row_offsets` (the graph helper's rule).

    The span is not checked against `total_tokens` (the helper cannot see
    it): a request whose rows lie past the call's counts its pools, and
    compress then writes zeros for them.
    """
    var offsets = op.compress.input_row_offsets
    var n = read_index(offsets, b + 1) - read_index(offsets, b)
    var c = read_index(op.compress.cache_lengths, b)
    if n < 0 or c < 0:
        return 0
    return full_pools[op.kpool](c, n)[1]


@always_inline
def write_first_pool(op: Step, b: Int):
    """`first_pool[b]`: `(c + kpool - 1) // kpool`, rounded down."""
    var c = read_index(op.compress.cache_lengths, b)
    op.first_pool[unsafe_offset=b] = Int64((c + op.kpool - 1) // op.kpool)


def scan_pool_rows(op: Step):
    """Writes `pool_row_offsets[0..batch]`, serially (CPU and GPU).

    The 64-bit prefix sum of `step_pool_count`, stored modulo 2^32.
    """
    var pool_row_offsets = op.compress.pool_row_offsets
    var total = 0
    pool_row_offsets[unsafe_offset=0] = 0
    for b in range(op.compress.batch):
        total += step_pool_count(op, b)
        pool_row_offsets[unsafe_offset=b + 1] = UInt32(total)


def step_cpu(op: Step):
    """CPU step: the scan, then one parallel region for everything else.

    Part `i` of `num_physical_cores()` equal parts is a range of requests
    (closed, then seeded) and a range of output rows (compressed): an equal
    share of the rows before `pool_row_offsets[batch]` and of those after.
    """
    scan_pool_rows(op)
    var batch = op.close.batch
    var out_rows = op.compress.out_rows
    var parts = num_physical_cores()
    # Rows past the last pool are only zeroed (the output's row count is an
    # upper bound): each part gets an equal share of the pooled rows and of
    # the rest, not an equal share of all rows, or the first part would
    # pool them all. Any split is correct; every row is written once.
    var used = min(
        max(read_index(op.compress.pool_row_offsets, batch), 0), out_rows
    )
    var spare = out_rows - used

    def run_parts(lo: Int, hi: Int) {imm}:
        for part in range(lo, hi):
            var b0 = batch * part // parts
            var b1 = batch * (part + 1) // parts
            # A request's ring slot is read (closed) before it is written.
            close_requests(op.close, b0, b1)
            for b in range(b0, b1):
                write_first_pool(op, b)
            compress_rows(
                op.compress, used * part // parts, used * (part + 1) // parts
            )
            compress_rows(
                op.compress,
                used + spare * part // parts,
                used + spare * (part + 1) // parts,
            )
            seed_requests(op.seed, b0, b1)

    # Pooling work only, on the scale of the ops it replaces (ring_close's
    # batch * kpool, compress's out_rows * kpool): seeding copies a few rows
    # per request, an order of magnitude cheaper per element than pooling.
    var work = (batch + out_rows) * op.kpool * op.head_dim
    cpu_for_each_range(parts, work, run_parts)


def step_scan_thread(block: Int, thread: Int, op: Step):
    """The one GPU thread of launch 1: `scan_pool_rows` (see the module)."""
    if block == 0 and thread == 0:
        scan_pool_rows(op)


def kpool_step_scan_kernel[
    dtype: DType,
    offset_dtype: DType,
    length_dtype: DType,
    slot_dtype: DType,
    kpool: Int,
    head_dim: Int,
](
    op: StepOperands[
        dtype,
        offset_dtype,
        length_dtype,
        slot_dtype,
        kpool,
        head_dim,
        MutAnyOrigin,
    ]
):
    """GPU entry of launch 1: `step_scan_thread` at this block and thread.

    Parameters are those of `StepOperands`.
    """
    step_scan_thread(Int(block_idx.x), Int(thread_idx.x), op)


def step_thread(block: Int, thread: Int, op: Step):
    """One GPU thread of launch 2: a request's close and seed, or a row.

    Block `b < batch`: thread `t` runs `ring_close_thread` and then
    `seed_tail_thread` for request `b`, both over channels `t`, `t + W`,
    ... (`W = gpu_block_width[head_dim]()`), so each ring channel is read
    before the same thread overwrites it; thread 0 also writes
    `first_pool[b]`. Block `batch + i`: `compress_thread` for output row
    `i`, over the `pool_row_offsets` that launch 1 wrote.
    `kpool_step_kernel` runs this on a GPU, `emulate_grid` on the CPU.
    """
    var batch = op.close.batch
    if block < batch:
        ring_close_thread(block, thread, op.close)
        seed_tail_thread(block, thread, op.seed)
        if thread == 0:
            write_first_pool(op, block)
    else:
        compress_thread(block - batch, thread, op.compress)


def kpool_step_kernel[
    dtype: DType,
    offset_dtype: DType,
    length_dtype: DType,
    slot_dtype: DType,
    kpool: Int,
    head_dim: Int,
](
    op: StepOperands[
        dtype,
        offset_dtype,
        length_dtype,
        slot_dtype,
        kpool,
        head_dim,
        MutAnyOrigin,
    ]
):
    """GPU entry of launch 2: `step_thread` at this block and thread.

    Parameters are those of `StepOperands`; they name the instance in a
    profiler trace.
    """
    step_thread(Int(block_idx.x), Int(thread_idx.x), op)


@always_inline
def step_scan_launch() -> Tuple[Int, Int]:
    """`(grid, block)` of `kpool_step_scan_kernel`: one thread."""
    return (1, 1)


@always_inline
def step_launch[head_dim: Int](batch: Int, out_rows: Int) -> Tuple[Int, Int]:
    """`(grid, block)` of `kpool_step_kernel`: a block per request and row."""
    return (batch + out_rows, gpu_block_width[head_dim]())


def step_gpu[emulate: Bool](op: Step, ctx: DeviceContext) raises:
    """GPU step: the two launches of the module docstring, on `ctx`.

    With `emulate`, runs the same threads through `emulate_grid` on the
    CPU instead (the operands are then host memory and `ctx` is unused).
    """
    var scan = step_scan_launch()
    var shape = step_launch[op.head_dim](op.close.batch, op.compress.out_rows)
    comptime if emulate:

        def scan_work(block: Int, thread: Int) {imm}:
            step_scan_thread(block, thread, op)

        def thread_work(block: Int, thread: Int) {imm}:
            step_thread(block, thread, op)

        emulate_grid("kpool_step_scan_kernel", scan[0], scan[1], scan_work)
        if shape[0] == 0:
            return
        emulate_grid("kpool_step_kernel", shape[0], shape[1], thread_work)
    else:
        ctx.enqueue_function[
            kpool_step_scan_kernel[
                op.dtype,
                op.offset_dtype,
                op.length_dtype,
                op.slot_dtype,
                op.kpool,
                op.head_dim,
            ]
        ](op, grid_dim=scan[0], block_dim=scan[1])
        if shape[0] == 0:
            return
        ctx.enqueue_function[
            kpool_step_kernel[
                op.dtype,
                op.offset_dtype,
                op.length_dtype,
                op.slot_dtype,
                op.kpool,
                op.head_dim,
            ]
        ](op, grid_dim=shape[0], block_dim=shape[1])


@extensibility.register("mla_kpool.step")
struct MLAKPoolStep:
    """Registers the fused `mla_kpool.step` graph op (CPU and GPU)."""

    @staticmethod
    def execute[
        *,
        head_dim: Int,
        kpool: Int,
        emulate_gpu: Bool = False,
        target: StaticString,
    ](
        ring_pooled: OutputTensor[rank=2, ...],
        ring_closed_pool: OutputTensor[dtype=DType.int32, rank=1, ...],
        pooled: OutputTensor[dtype=ring_pooled.dtype, rank=2, ...],
        pool_row_offsets: OutputTensor[dtype=DType.uint32, rank=1, ...],
        first_pool: OutputTensor[dtype=DType.int64, rank=1, ...],
        tail: MutableInputTensor[dtype=ring_pooled.dtype, rank=4, ...],
        k: InputTensor[dtype=ring_pooled.dtype, rank=2, ...],
        gate: InputTensor[dtype=ring_pooled.dtype, rank=2, ...],
        ape: InputTensor[dtype=DType.float32, rank=2, ...],
        input_row_offsets: InputTensor[rank=1, ...],
        cache_lengths: InputTensor[rank=1, ...],
        slot_idx: InputTensor[rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        """Closes, counts, compresses and seeds one call's pools in one op.

        Parameters:
            head_dim: Channels per key; also the GPU block width (capped at
                1024, threads then stride over channels).
            kpool: Tokens per pool.
            emulate_gpu: Run the GPU kernels' threads over an emulated grid
                on a CPU target (testing; slow).
            target: "cpu" or "gpu", filled in by the graph compiler.

        Args:
            ring_pooled: Output `[batch, head_dim]`, dtype of `k`: the pool
                each request closed from the ring, zero where none.
            ring_closed_pool: Output `[batch]` int32: its pool id, or -1.
            pooled: Output `[total_tokens // kpool, head_dim]`, dtype of
                `k`: the pools made only of this call's rows, request `b`'s
                from row `pool_row_offsets[b]`; other rows zero.
            pool_row_offsets: Output `[batch + 1]` uint32: the exclusive
                prefix sum of each request's count of those pools.
            first_pool: Output `[batch]` int64: `ceil(cache_lengths[b] /
                kpool)`, the pool id at row `pool_row_offsets[b]`.
            tail: `[max_slots, 2, R, head_dim]` ring (plane 0 keys, plane 1
                gate scores; R = kpool, or a multiple of it), read for
                closing and then written with each request's trailing
                tokens.
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
                Also if `emulate_gpu` is set for a GPU target.
        """
        comptime OP = "mla_kpool.step"
        var batch = ring_closed_pool.dim_size(0)
        var total_tokens = k.dim_size(0)
        expect_shape(
            OP,
            "ring_pooled",
            ring_pooled.shape(),
            "batch, head_dim",
            dims(batch, head_dim),
        )
        expect_shape(
            OP, "pooled", pooled.shape(), "rows, head_dim", dims(ANY, head_dim)
        )
        expect_pool_rows[kpool](OP, "pooled", pooled.dim_size(0), total_tokens)
        expect_offsets(OP, "pool_row_offsets", pool_row_offsets.shape(), batch)
        expect_shape(OP, "first_pool", first_pool.shape(), "batch", dims(batch))
        expect_ring[kpool](OP, tail.shape(), head_dim)
        expect_rows(OP, k.shape(), gate.shape(), head_dim)
        expect_shape(
            OP, "ape", ape.shape(), "kpool, head_dim", dims(kpool, head_dim)
        )
        expect_offsets(
            OP, "input_row_offsets", input_row_offsets.shape(), batch
        )
        expect_shape(
            OP, "cache_lengths", cache_lengths.shape(), "batch", dims(batch)
        )
        expect_shape(OP, "slot_idx", slot_idx.shape(), "batch", dims(batch))
        expect_target[emulate_gpu, target](OP)
        comptime dtype = ring_pooled.dtype
        comptime offset_dtype = input_row_offsets.dtype
        comptime length_dtype = cache_lengths.dtype
        comptime slot_dtype = slot_idx.dtype
        var close = RingCloseOperands[
            dtype,
            offset_dtype,
            length_dtype,
            slot_dtype,
            kpool,
            head_dim,
            MutAnyOrigin,
        ](
            ring_pooled.unsafe_ptr(),
            ring_closed_pool.unsafe_ptr(),
            tail.unsafe_ptr(),
            k.unsafe_ptr(),
            gate.unsafe_ptr(),
            ape.unsafe_ptr(),
            input_row_offsets.unsafe_ptr(),
            cache_lengths.unsafe_ptr(),
            slot_idx.unsafe_ptr(),
            batch,
            total_tokens,
            tail.dim_size(0),
            tail.dim_size(2),
        )
        var op = StepOperands(
            close,
            CompressOperands[
                dtype,
                offset_dtype,
                DType.uint32,
                length_dtype,
                kpool,
                head_dim,
                MutAnyOrigin,
            ](
                pooled.unsafe_ptr(),
                close.k,
                close.gate,
                close.ape,
                close.input_row_offsets,
                pool_row_offsets.unsafe_ptr(),
                close.cache_lengths,
                batch,
                total_tokens,
                pooled.dim_size(0),
            ),
            SeedTailOperands[
                dtype,
                offset_dtype,
                length_dtype,
                slot_dtype,
                kpool,
                head_dim,
                MutAnyOrigin,
            ](
                close.tail,
                close.k,
                close.gate,
                close.input_row_offsets,
                close.cache_lengths,
                close.slot_idx,
                batch,
                total_tokens,
                close.max_slots,
                close.ring_len,
            ),
            first_pool.unsafe_ptr(),
        )
        comptime if target == "cpu" and not emulate_gpu:
            step_cpu(op)
        else:
            step_gpu[emulate_gpu](op, ctx)
