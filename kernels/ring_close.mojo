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

`R` is the ring length `tail.dim_size(2)`: `kpool` for the documented op, or
a multiple of it for a deeper ring. Since `p * kpool % R` is a multiple of
`kpool` and `R` is too, a pool's members never wrap around the ring's end.
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from max.gpu.host import DeviceContext
from max.gpu import block_idx, thread_idx

from .operands import dims, expect_ring, expect_rows, expect_shape
from .parallel import cpu_for_each_range, emulate_grid, gpu_block_width
from .pooling import PoolMembers, cpu_pool_row, pool_channels
from .ragged import Ptr, pending_pool, read_index, slot_ok, token_span


@always_inline
def plan_close[
    dtype: DType,
    offset_dtype: DType,
    length_dtype: DType,
    slot_dtype: DType,
    kpool: Int,
    head_dim: Int,
](
    b: Int,
    tail: Ptr[dtype],
    k: Ptr[dtype],
    gate: Ptr[dtype],
    input_row_offsets: Ptr[offset_dtype],
    cache_lengths: Ptr[length_dtype],
    slot_idx: Ptr[slot_dtype],
    total_tokens: Int,
    max_slots: Int,
    ring_len: Int,
) -> Tuple[Int, PoolMembers[dtype]]:
    """What request `b` closes, and where its members are (CPU and GPU).

    Returns:
        `(pool, members)`: the pool id closed, or -1 (the members then
        point at the operands' first rows, safe to prefetch and never
        pooled); the first `c % kpool` members come from ring slot `s`, the
        others from this call's rows.
    """
    var span = token_span(input_row_offsets, b, total_tokens)
    var c = read_index(cache_lengths, b)
    var s = read_index(slot_idx, b)
    var p = pending_pool[kpool](c, span[1])
    if not span[2] or not slot_ok(s, max_slots):
        p = -1
    if p < 0:
        return (-1, PoolMembers[dtype](tail, tail, 0, k, gate))
    var ring_key = tail.unsafe_offset(
        ((s * 2) * ring_len + (p * kpool) % ring_len) * head_dim
    )
    var first_new = span[0] * head_dim
    return (
        p,
        PoolMembers[dtype](
            ring_key,
            ring_key.unsafe_offset(ring_len * head_dim),
            c % kpool,
            k.unsafe_offset(first_new),
            gate.unsafe_offset(first_new),
        ),
    )


def ring_close_cpu[
    dtype: DType,
    offset_dtype: DType,
    length_dtype: DType,
    slot_dtype: DType,
    kpool: Int,
    head_dim: Int,
](
    pooled: Ptr[dtype],
    closed_pool: Ptr[DType.int32],
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
    """CPU ring_close: requests split across cores, channels in SIMD steps.

    Parameters:
        dtype: Key dtype of `pooled`, `tail`, `k`, `gate`.
        offset_dtype: Integer dtype of `input_row_offsets`.
        length_dtype: Integer dtype of `cache_lengths`.
        slot_dtype: Integer dtype of `slot_idx`.
        kpool: Tokens per pool.
        head_dim: Channels per key.

    Args:
        pooled: Output `[batch, head_dim]`.
        closed_pool: Output `[batch]` int32.
        tail: Ring `[max_slots, 2, ring_len, head_dim]`, read only.
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
    """

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
            var row = pooled.unsafe_offset(b * head_dim)
            closed_pool[unsafe_offset=b] = Int32(this[0])
            if this[0] < 0:
                for ch in range(head_dim):
                    row[unsafe_offset=ch] = 0
            else:
                cpu_pool_row[dtype, kpool, head_dim](this[1], ape, row, next[1])
            this = next

    cpu_for_each_range(batch, batch * kpool * head_dim, close_requests)


def ring_close_thread[
    dtype: DType,
    offset_dtype: DType,
    length_dtype: DType,
    slot_dtype: DType,
    kpool: Int,
    head_dim: Int,
](
    block: Int,
    thread: Int,
    pooled: Ptr[dtype],
    closed_pool: Ptr[DType.int32],
    tail: Ptr[dtype],
    k: Ptr[dtype],
    gate: Ptr[dtype],
    ape: Ptr[DType.float32],
    input_row_offsets: Ptr[offset_dtype],
    cache_lengths: Ptr[length_dtype],
    slot_idx: Ptr[slot_dtype],
    total_tokens: Int,
    max_slots: Int,
    ring_len: Int,
):
    """One GPU thread of ring_close: request `block`, channels from `thread`.

    Block `b` closes request `b`; thread `t` pools channels `t`, `t + W`,
    `t + 2W`, ... with `W = gpu_block_width[head_dim]()` threads per block,
    so a head wider than 1024 channels is still covered. Thread 0 writes
    `closed_pool[b]`. A request with nothing to close writes -1 and zeros
    and never touches the ring. `kpool_ring_close_kernel` runs this on a
    GPU, `emulate_grid` on the CPU.

    Parameters and Args are those of `ring_close_cpu`, plus the launch
    indices `block` and `thread`.
    """
    comptime stride = gpu_block_width[head_dim]()
    var plan = plan_close[
        dtype, offset_dtype, length_dtype, slot_dtype, kpool, head_dim
    ](
        block,
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
    var row = pooled.unsafe_offset(block * head_dim)
    if thread == 0:
        closed_pool[unsafe_offset=block] = Int32(plan[0])
    for ch in range(thread, head_dim, stride):
        if plan[0] < 0:
            row[unsafe_offset=ch] = 0
        else:
            row[unsafe_offset=ch] = pool_channels[dtype, 1, kpool](
                plan[1], ape, head_dim, ch
            )


def kpool_ring_close_kernel[
    dtype: DType,
    offset_dtype: DType,
    length_dtype: DType,
    slot_dtype: DType,
    kpool: Int,
    head_dim: Int,
](
    pooled: Ptr[dtype],
    closed_pool: Ptr[DType.int32],
    tail: Ptr[dtype],
    k: Ptr[dtype],
    gate: Ptr[dtype],
    ape: Ptr[DType.float32],
    input_row_offsets: Ptr[offset_dtype],
    cache_lengths: Ptr[length_dtype],
    slot_idx: Ptr[slot_dtype],
    total_tokens: Int64,
    max_slots: Int64,
    ring_len: Int64,
):
    """GPU entry of ring_close: `ring_close_thread` at this block and thread.

    Parameters and Args are those of `ring_close_cpu` (sizes as Int64:
    GPU kernel arguments need fixed-width integers).
    """
    ring_close_thread[
        dtype, offset_dtype, length_dtype, slot_dtype, kpool, head_dim
    ](
        Int(block_idx.x),
        Int(thread_idx.x),
        pooled,
        closed_pool,
        tail,
        k,
        gate,
        ape,
        input_row_offsets,
        cache_lengths,
        slot_idx,
        Int(total_tokens),
        Int(max_slots),
        Int(ring_len),
    )


@always_inline
def ring_close_launch[head_dim: Int](batch: Int) -> Tuple[Int, Int]:
    """`(grid, block)` of `kpool_ring_close_kernel`: a block per request."""
    return (batch, gpu_block_width[head_dim]())


def ring_close_gpu[
    dtype: DType,
    offset_dtype: DType,
    length_dtype: DType,
    slot_dtype: DType,
    kpool: Int,
    head_dim: Int,
    emulate: Bool,
](
    pooled: Ptr[dtype],
    closed_pool: Ptr[DType.int32],
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
    ctx: DeviceContext,
) raises:
    """GPU ring_close: launches `kpool_ring_close_kernel` on `ctx`.

    With `emulate`, runs the same threads through `emulate_grid` on the
    CPU instead (the operands are then host memory and `ctx` is unused).

    Parameters and Args are those of `ring_close_cpu`, plus `emulate` and
    `ctx`.
    """
    if batch == 0:
        return
    var shape = ring_close_launch[head_dim](batch)
    comptime if emulate:

        def thread_work(block: Int, thread: Int) {imm}:
            ring_close_thread[
                dtype, offset_dtype, length_dtype, slot_dtype, kpool, head_dim
            ](
                block,
                thread,
                pooled,
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

        emulate_grid("kpool_ring_close_kernel", shape[0], shape[1], thread_work)
    else:
        ctx.enqueue_function[
            kpool_ring_close_kernel[
                dtype, offset_dtype, length_dtype, slot_dtype, kpool, head_dim
            ]
        ](
            pooled,
            closed_pool,
            tail,
            k,
            gate,
            ape,
            input_row_offsets,
            cache_lengths,
            slot_idx,
            Int64(total_tokens),
            Int64(max_slots),
            Int64(ring_len),
            grid_dim=shape[0],
            block_dim=shape[1],
        )


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
        var batch = closed_pool.dim_size(0)
        var total_tokens = k.dim_size(0)
        var max_slots = tail.dim_size(0)
        var ring_len = tail.dim_size(2)
        comptime OP = "mo.mla.kpool.ring_close"
        expect_shape(
            OP,
            "pooled",
            pooled.shape(),
            "batch, head_dim",
            dims(batch, head_dim),
        )
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
            raise Error(
                "mo.mla.kpool.ring_close: emulate_gpu needs a CPU target"
            )
        comptime if target == "cpu" and not emulate_gpu:
            ring_close_cpu[
                pooled.dtype,
                input_row_offsets.dtype,
                cache_lengths.dtype,
                slot_idx.dtype,
                kpool,
                head_dim,
            ](
                pooled.unsafe_ptr(),
                closed_pool.unsafe_ptr(),
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
            )
        else:
            ring_close_gpu[
                pooled.dtype,
                input_row_offsets.dtype,
                cache_lengths.dtype,
                slot_idx.dtype,
                kpool,
                head_dim,
                emulate_gpu,
            ](
                pooled.unsafe_ptr(),
                closed_pool.unsafe_ptr(),
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
                ctx,
            )
