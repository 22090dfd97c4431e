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

The op reuses the writers' plan functions and thread bodies, so the two
paths cannot drift apart: the CPU path pools with `cpu_pool_row`, the GPU
path runs `ring_close_thread`, `seed_tail_thread` and `compress_thread`.

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
from std.algorithm import vectorize
from std.sys import num_physical_cores, simd_width_of

from .compress import compress_thread, last_span_at, owner, pool_row_of
from .operands import (
    ANY,
    dims,
    expect_pool_rows,
    expect_ring,
    expect_rows,
    expect_shape,
)
from .parallel import cpu_for_each_range, emulate_grid, gpu_block_width
from .pooling import PoolMembers, cpu_pool_row
from .ragged import Ptr, full_pools, read_index
from .ring_close import plan_close, ring_close_thread
from .seed_tail import copy_row, plan_stash, seed_tail_thread


@always_inline
def step_pool_count[
    offset_dtype: DType, length_dtype: DType, kpool: Int
](
    input_row_offsets: Ptr[offset_dtype],
    cache_lengths: Ptr[length_dtype],
    b: Int,
) -> Int:
    """Request `b`'s count in `pool_row_offsets` (the graph helper's rule).

    The span is not checked against `total_tokens` (the helper cannot see
    it): a request whose rows lie past the call's counts its pools, and
    compress then writes zeros for them.
    """
    var n = read_index(input_row_offsets, b + 1) - read_index(
        input_row_offsets, b
    )
    var c = read_index(cache_lengths, b)
    if n < 0 or c < 0:
        return 0
    return full_pools[kpool](c, n)[1]


@always_inline
def step_first_pool[
    length_dtype: DType, kpool: Int
](cache_lengths: Ptr[length_dtype], b: Int) -> Int64:
    """`first_pool[b]`: `(c + kpool - 1) // kpool`, rounded down."""
    return Int64((read_index(cache_lengths, b) + kpool - 1) // kpool)


@always_inline
def zero_row[dtype: DType, head_dim: Int](dest: Ptr[dtype]):
    """Writes `head_dim` zeros (+0.0) with full-width SIMD stores (CPU)."""

    def chunk[width: Int](ch: Int) {imm}:
        dest.unsafe_store[width=width](ch, SIMD[dtype, width](0))

    vectorize[simd_width_of[dtype]()](head_dim, chunk)


def scan_pool_rows[
    offset_dtype: DType, length_dtype: DType, kpool: Int
](
    pool_row_offsets: Ptr[DType.uint32],
    input_row_offsets: Ptr[offset_dtype],
    cache_lengths: Ptr[length_dtype],
    batch: Int,
):
    """Writes `pool_row_offsets[0..batch]`, serially (CPU and GPU).

    Parameters:
        offset_dtype: Integer dtype of `input_row_offsets`.
        length_dtype: Integer dtype of `cache_lengths`.
        kpool: Tokens per pool.

    Args:
        pool_row_offsets: Output `[batch + 1]` uint32, the 64-bit prefix sum
            of `step_pool_count` modulo 2^32.
        input_row_offsets: `[batch + 1]` token row offsets.
        cache_lengths: `[batch]` cached-prefix lengths.
        batch: Requests.
    """
    var total = 0
    pool_row_offsets[unsafe_offset=0] = 0
    for b in range(batch):
        total += step_pool_count[offset_dtype, length_dtype, kpool](
            input_row_offsets, cache_lengths, b
        )
        pool_row_offsets[unsafe_offset=b + 1] = UInt32(total)


def step_cpu[
    dtype: DType,
    offset_dtype: DType,
    length_dtype: DType,
    slot_dtype: DType,
    kpool: Int,
    head_dim: Int,
](
    ring_pooled: Ptr[dtype],
    closed_pool: Ptr[DType.int32],
    pooled: Ptr[dtype],
    pool_row_offsets: Ptr[DType.uint32],
    first_pool: Ptr[DType.int64],
    tail: Ptr[dtype],
    k: Ptr[dtype],
    gate: Ptr[dtype],
    ape: Ptr[DType.float32],
    input_row_offsets: Ptr[offset_dtype],
    cache_lengths: Ptr[length_dtype],
    slot_idx: Ptr[slot_dtype],
    batch: Int,
    total_tokens: Int,
    max_slots: Int,
    ring_len: Int,
    out_rows: Int,
):
    """CPU step: the scan, then one parallel region for everything else.

    Part `i` of `num_physical_cores()` equal parts is a range of requests
    (closed, then seeded) and a range of output rows (compressed): an equal
    share of the rows before `pool_row_offsets[batch]` and of those after.

    Parameters:
        dtype: Key dtype of the pooled outputs, `tail`, `k`, `gate`.
        offset_dtype: Integer dtype of `input_row_offsets`.
        length_dtype: Integer dtype of `cache_lengths`.
        slot_dtype: Integer dtype of `slot_idx`.
        kpool: Tokens per pool.
        head_dim: Channels per key.

    Args:
        ring_pooled: Output `[batch, head_dim]`.
        closed_pool: Output `[batch]` int32.
        pooled: Output `[out_rows, head_dim]`.
        pool_row_offsets: Output `[batch + 1]` uint32.
        first_pool: Output `[batch]` int64.
        tail: Ring `[max_slots, 2, ring_len, head_dim]`, updated in place.
        k: `[total_tokens, head_dim]` keys.
        gate: `[total_tokens, head_dim]` gate scores.
        ape: `[kpool, head_dim]` float32.
        input_row_offsets: `[batch + 1]` token row offsets.
        cache_lengths: `[batch]` cached-prefix lengths.
        slot_idx: `[batch]` ring slots.
        batch: Requests in this call.
        total_tokens: Rows of `k` and `gate`.
        max_slots: Ring slots.
        ring_len: Ring length R (a multiple of `kpool`).
        out_rows: Rows of `pooled` (`total_tokens // kpool`).
    """
    scan_pool_rows[offset_dtype, length_dtype, kpool](
        pool_row_offsets, input_row_offsets, cache_lengths, batch
    )

    @always_inline
    def plan(b: Int) {imm} -> Tuple[Int, PoolMembers[dtype]]:
        return plan_close[
            dtype, offset_dtype, length_dtype, slot_dtype, kpool, head_dim
        ](
            b,
            tail,
            k,
            gate,
            input_row_offsets,
            cache_lengths,
            slot_idx,
            total_tokens,
            max_slots,
            ring_len,
        )

    def close_requests(lo: Int, hi: Int) {imm}:
        if lo >= hi:
            return
        var this = plan(lo)
        for b in range(lo, hi):
            # The next request's gates are prefetched while this one pools.
            var next = plan(min(b + 1, hi - 1))
            var row = ring_pooled.unsafe_offset(b * head_dim)
            closed_pool[unsafe_offset=b] = Int32(this[0])
            first_pool[unsafe_offset=b] = step_first_pool[length_dtype, kpool](
                cache_lengths, b
            )
            if this[0] < 0:
                zero_row[dtype, head_dim](row)
            else:
                cpu_pool_row[dtype, kpool, head_dim](this[1], ape, row, next[1])
            this = next

    def compress_rows(lo: Int, hi: Int) {imm}:
        if lo >= hi:
            return
        var last = last_span_at(pool_row_offsets, batch, lo)
        for row in range(lo, hi):
            # Rows ascend, so the span start only moves forward.
            while (
                last < batch and read_index(pool_row_offsets, last + 1) <= row
            ):
                last += 1
            var first = pool_row_of[
                offset_dtype, DType.uint32, length_dtype, kpool
            ](
                input_row_offsets,
                pool_row_offsets,
                cache_lengths,
                owner(last, batch),
                row,
                total_tokens,
            )
            var dest = pooled.unsafe_offset(row * head_dim)
            if first < 0:
                zero_row[dtype, head_dim](dest)
                continue
            var member0 = first * head_dim
            cpu_pool_row[dtype, kpool, head_dim](
                PoolMembers[dtype].new_rows(k, gate, member0),
                ape,
                dest,
                PoolMembers[dtype].new_rows(
                    k, gate, member0 + kpool * head_dim
                ),
            )

    def seed_requests(lo: Int, hi: Int) {imm}:
        for b in range(lo, hi):
            var stash = plan_stash[
                dtype, offset_dtype, length_dtype, slot_dtype, kpool, head_dim
            ](
                b,
                tail,
                input_row_offsets,
                cache_lengths,
                slot_idx,
                total_tokens,
                max_slots,
                ring_len,
            )
            for pos in range(stash[0], stash[1]):
                var src = (stash[2] + pos - stash[0]) * head_dim
                var dst = (pos % ring_len) * head_dim
                copy_row[dtype, head_dim](
                    stash[3].unsafe_offset(dst), k.unsafe_offset(src)
                )
                copy_row[dtype, head_dim](
                    stash[4].unsafe_offset(dst), gate.unsafe_offset(src)
                )

    var parts = num_physical_cores()
    # Rows past the last pool are only zeroed (the output's row count is an
    # upper bound): each part gets an equal share of the pooled rows and of
    # the rest, not an equal share of all rows, or the first part would
    # pool them all. Any split is correct; every row is written once.
    var used = min(max(read_index(pool_row_offsets, batch), 0), out_rows)
    var spare = out_rows - used

    def run_parts(lo: Int, hi: Int) {imm}:
        for part in range(lo, hi):
            var b0 = batch * part // parts
            var b1 = batch * (part + 1) // parts
            # A request's ring slot is read (closed) before it is written.
            close_requests(b0, b1)
            compress_rows(used * part // parts, used * (part + 1) // parts)
            compress_rows(
                used + spare * part // parts,
                used + spare * (part + 1) // parts,
            )
            seed_requests(b0, b1)

    # Pooling work only, on the scale of the ops it replaces (ring_close's
    # batch * kpool, compress's out_rows * kpool): seeding copies a few rows
    # per request, an order of magnitude cheaper per element than pooling.
    var work = (batch + out_rows) * kpool * head_dim
    cpu_for_each_range(parts, work, run_parts)


def step_scan_thread[
    offset_dtype: DType, length_dtype: DType, kpool: Int
](
    block: Int,
    thread: Int,
    pool_row_offsets: Ptr[DType.uint32],
    input_row_offsets: Ptr[offset_dtype],
    cache_lengths: Ptr[length_dtype],
    batch: Int,
):
    """The one GPU thread of launch 1: `scan_pool_rows` (see the module).

    Parameters and Args are those of `scan_pool_rows`, plus the launch
    indices `block` and `thread` (both 0).
    """
    if block == 0 and thread == 0:
        scan_pool_rows[offset_dtype, length_dtype, kpool](
            pool_row_offsets, input_row_offsets, cache_lengths, batch
        )


def kpool_step_scan_kernel[
    offset_dtype: DType, length_dtype: DType, kpool: Int
](
    pool_row_offsets: Ptr[DType.uint32],
    input_row_offsets: Ptr[offset_dtype],
    cache_lengths: Ptr[length_dtype],
    batch: Int64,
):
    """GPU entry of launch 1: `step_scan_thread` at this block and thread.

    Parameters and Args are those of `scan_pool_rows` (`batch` as Int64).
    """
    step_scan_thread[offset_dtype, length_dtype, kpool](
        Int(block_idx.x),
        Int(thread_idx.x),
        pool_row_offsets,
        input_row_offsets,
        cache_lengths,
        Int(batch),
    )


def step_thread[
    dtype: DType,
    offset_dtype: DType,
    length_dtype: DType,
    slot_dtype: DType,
    kpool: Int,
    head_dim: Int,
](
    block: Int,
    thread: Int,
    ring_pooled: Ptr[dtype],
    closed_pool: Ptr[DType.int32],
    pooled: Ptr[dtype],
    pool_row_offsets: Ptr[DType.uint32],
    first_pool: Ptr[DType.int64],
    tail: Ptr[dtype],
    k: Ptr[dtype],
    gate: Ptr[dtype],
    ape: Ptr[DType.float32],
    input_row_offsets: Ptr[offset_dtype],
    cache_lengths: Ptr[length_dtype],
    slot_idx: Ptr[slot_dtype],
    batch: Int,
    total_tokens: Int,
    max_slots: Int,
    ring_len: Int,
):
    """One GPU thread of launch 2: a request's close and seed, or a row.

    Block `b < batch`: thread `t` runs `ring_close_thread` and then
    `seed_tail_thread` for request `b`, both over channels `t`, `t + W`,
    ... (`W = gpu_block_width[head_dim]()`), so each ring channel is read
    before the same thread overwrites it; thread 0 also writes
    `first_pool[b]`. Block `batch + i`: `compress_thread` for output row
    `i`, over the `pool_row_offsets` that launch 1 wrote.
    `kpool_step_kernel` runs this on a GPU, `emulate_grid` on the CPU.

    Parameters and Args are those of `step_cpu` (but `out_rows`), plus the
    launch indices `block` and `thread`.
    """
    if block < batch:
        ring_close_thread[
            dtype, offset_dtype, length_dtype, slot_dtype, kpool, head_dim
        ](
            block,
            thread,
            ring_pooled,
            closed_pool,
            tail,
            k,
            gate,
            ape,
            input_row_offsets,
            cache_lengths,
            slot_idx,
            total_tokens,
            max_slots,
            ring_len,
        )
        seed_tail_thread[
            dtype, offset_dtype, length_dtype, slot_dtype, kpool, head_dim
        ](
            block,
            thread,
            tail,
            k,
            gate,
            input_row_offsets,
            cache_lengths,
            slot_idx,
            total_tokens,
            max_slots,
            ring_len,
        )
        if thread == 0:
            first_pool[unsafe_offset=block] = step_first_pool[
                length_dtype, kpool
            ](cache_lengths, block)
    else:
        compress_thread[
            dtype, offset_dtype, DType.uint32, length_dtype, kpool, head_dim
        ](
            block - batch,
            thread,
            pooled,
            k,
            gate,
            ape,
            input_row_offsets,
            pool_row_offsets,
            cache_lengths,
            batch,
            total_tokens,
        )


def kpool_step_kernel[
    dtype: DType,
    offset_dtype: DType,
    length_dtype: DType,
    slot_dtype: DType,
    kpool: Int,
    head_dim: Int,
](
    ring_pooled: Ptr[dtype],
    closed_pool: Ptr[DType.int32],
    pooled: Ptr[dtype],
    pool_row_offsets: Ptr[DType.uint32],
    first_pool: Ptr[DType.int64],
    tail: Ptr[dtype],
    k: Ptr[dtype],
    gate: Ptr[dtype],
    ape: Ptr[DType.float32],
    input_row_offsets: Ptr[offset_dtype],
    cache_lengths: Ptr[length_dtype],
    slot_idx: Ptr[slot_dtype],
    batch: Int64,
    total_tokens: Int64,
    max_slots: Int64,
    ring_len: Int64,
):
    """GPU entry of launch 2: `step_thread` at this block and thread.

    Parameters and Args are those of `step_cpu` but `out_rows` (sizes as
    Int64: GPU kernel arguments need fixed-width integers).
    """
    step_thread[dtype, offset_dtype, length_dtype, slot_dtype, kpool, head_dim](
        Int(block_idx.x),
        Int(thread_idx.x),
        ring_pooled,
        closed_pool,
        pooled,
        pool_row_offsets,
        first_pool,
        tail,
        k,
        gate,
        ape,
        input_row_offsets,
        cache_lengths,
        slot_idx,
        Int(batch),
        Int(total_tokens),
        Int(max_slots),
        Int(ring_len),
    )


@always_inline
def step_scan_launch() -> Tuple[Int, Int]:
    """`(grid, block)` of `kpool_step_scan_kernel`: one thread."""
    return (1, 1)


@always_inline
def step_launch[head_dim: Int](batch: Int, out_rows: Int) -> Tuple[Int, Int]:
    """`(grid, block)` of `kpool_step_kernel`: a block per request and row."""
    return (batch + out_rows, gpu_block_width[head_dim]())


def step_gpu[
    dtype: DType,
    offset_dtype: DType,
    length_dtype: DType,
    slot_dtype: DType,
    kpool: Int,
    head_dim: Int,
    emulate: Bool,
](
    ring_pooled: Ptr[dtype],
    closed_pool: Ptr[DType.int32],
    pooled: Ptr[dtype],
    pool_row_offsets: Ptr[DType.uint32],
    first_pool: Ptr[DType.int64],
    tail: Ptr[dtype],
    k: Ptr[dtype],
    gate: Ptr[dtype],
    ape: Ptr[DType.float32],
    input_row_offsets: Ptr[offset_dtype],
    cache_lengths: Ptr[length_dtype],
    slot_idx: Ptr[slot_dtype],
    batch: Int,
    total_tokens: Int,
    max_slots: Int,
    ring_len: Int,
    out_rows: Int,
    ctx: DeviceContext,
) raises:
    """GPU step: the two launches of the module docstring, on `ctx`.

    With `emulate`, runs the same threads through `emulate_grid` on the
    CPU instead (the operands are then host memory and `ctx` is unused).

    Parameters and Args are those of `step_cpu`, plus `emulate` and `ctx`.
    """
    var scan = step_scan_launch()
    var shape = step_launch[head_dim](batch, out_rows)
    comptime if emulate:

        def scan_work(block: Int, thread: Int) {imm}:
            step_scan_thread[offset_dtype, length_dtype, kpool](
                block,
                thread,
                pool_row_offsets,
                input_row_offsets,
                cache_lengths,
                batch,
            )

        def thread_work(block: Int, thread: Int) {imm}:
            step_thread[
                dtype, offset_dtype, length_dtype, slot_dtype, kpool, head_dim
            ](
                block,
                thread,
                ring_pooled,
                closed_pool,
                pooled,
                pool_row_offsets,
                first_pool,
                tail,
                k,
                gate,
                ape,
                input_row_offsets,
                cache_lengths,
                slot_idx,
                batch,
                total_tokens,
                max_slots,
                ring_len,
            )

        emulate_grid("kpool_step_scan_kernel", scan[0], scan[1], scan_work)
        if shape[0] == 0:
            return
        emulate_grid("kpool_step_kernel", shape[0], shape[1], thread_work)
    else:
        ctx.enqueue_function[
            kpool_step_scan_kernel[offset_dtype, length_dtype, kpool]
        ](
            pool_row_offsets,
            input_row_offsets,
            cache_lengths,
            Int64(batch),
            grid_dim=scan[0],
            block_dim=scan[1],
        )
        if shape[0] == 0:
            return
        ctx.enqueue_function[
            kpool_step_kernel[
                dtype, offset_dtype, length_dtype, slot_dtype, kpool, head_dim
            ]
        ](
            ring_pooled,
            closed_pool,
            pooled,
            pool_row_offsets,
            first_pool,
            tail,
            k,
            gate,
            ape,
            input_row_offsets,
            cache_lengths,
            slot_idx,
            Int64(batch),
            Int64(total_tokens),
            Int64(max_slots),
            Int64(ring_len),
            grid_dim=shape[0],
            block_dim=shape[1],
        )


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
        var batch = ring_closed_pool.dim_size(0)
        var total_tokens = k.dim_size(0)
        var max_slots = tail.dim_size(0)
        var ring_len = tail.dim_size(2)
        var out_rows = pooled.dim_size(0)
        comptime OP = "mla_kpool.step"
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
        expect_pool_rows[kpool](OP, "pooled", out_rows, total_tokens)
        expect_shape(
            OP,
            "pool_row_offsets",
            pool_row_offsets.shape(),
            "batch + 1",
            dims(batch + 1),
        )
        expect_shape(OP, "first_pool", first_pool.shape(), "batch", dims(batch))
        expect_ring[kpool](OP, tail.shape(), head_dim)
        expect_rows(OP, k.shape(), gate.shape(), head_dim)
        expect_shape(
            OP, "ape", ape.shape(), "kpool, head_dim", dims(kpool, head_dim)
        )
        expect_shape(
            OP,
            "input_row_offsets",
            input_row_offsets.shape(),
            "batch + 1",
            dims(batch + 1),
        )
        expect_shape(
            OP, "cache_lengths", cache_lengths.shape(), "batch", dims(batch)
        )
        expect_shape(OP, "slot_idx", slot_idx.shape(), "batch", dims(batch))
        comptime if emulate_gpu and target != "cpu":
            raise Error("mla_kpool.step: emulate_gpu needs a CPU target")
        comptime if target == "cpu" and not emulate_gpu:
            step_cpu[
                ring_pooled.dtype,
                input_row_offsets.dtype,
                cache_lengths.dtype,
                slot_idx.dtype,
                kpool,
                head_dim,
            ](
                ring_pooled.unsafe_ptr(),
                ring_closed_pool.unsafe_ptr(),
                pooled.unsafe_ptr(),
                pool_row_offsets.unsafe_ptr(),
                first_pool.unsafe_ptr(),
                tail.unsafe_ptr(),
                k.unsafe_ptr(),
                gate.unsafe_ptr(),
                ape.unsafe_ptr(),
                input_row_offsets.unsafe_ptr(),
                cache_lengths.unsafe_ptr(),
                slot_idx.unsafe_ptr(),
                batch,
                total_tokens,
                max_slots,
                ring_len,
                out_rows,
            )
        else:
            step_gpu[
                ring_pooled.dtype,
                input_row_offsets.dtype,
                cache_lengths.dtype,
                slot_idx.dtype,
                kpool,
                head_dim,
                emulate_gpu,
            ](
                ring_pooled.unsafe_ptr(),
                ring_closed_pool.unsafe_ptr(),
                pooled.unsafe_ptr(),
                pool_row_offsets.unsafe_ptr(),
                first_pool.unsafe_ptr(),
                tail.unsafe_ptr(),
                k.unsafe_ptr(),
                gate.unsafe_ptr(),
                ape.unsafe_ptr(),
                input_row_offsets.unsafe_ptr(),
                cache_lengths.unsafe_ptr(),
                slot_idx.unsafe_ptr(),
                batch,
                total_tokens,
                max_slots,
                ring_len,
                out_rows,
                ctx,
            )
