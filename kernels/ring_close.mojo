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
from max.algorithm import sync_parallelize
from std.math import ceildiv, min
from std.sys import num_physical_cores

from .pooling import cpu_pool_row, pool_channels
from .ragged import Ptr, pending_pool, read_index, slot_ok, token_span

comptime GPU_MAX_BLOCK = 1024
"""Largest block the GPU writers launch; wider heads stride over channels."""


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
    """CPU ring_close: requests in parallel, channels in SIMD steps.

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

    def close_request(b: Int) {imm}:
        var span = token_span(input_row_offsets, b, total_tokens)
        var c = read_index(cache_lengths, b)
        var s = read_index(slot_idx, b)
        var p = pending_pool[kpool](c, span[1])
        var row = pooled.unsafe_offset(b * head_dim)
        if not span[2] or not slot_ok(s, max_slots) or p < 0:
            closed_pool[unsafe_offset=b] = -1
            for ch in range(head_dim):
                row[unsafe_offset=ch] = 0
            return
        var r = c % kpool
        var ring_key = tail.unsafe_offset(
            ((s * 2) * ring_len + (p * kpool) % ring_len) * head_dim
        )
        var ring_gate = ring_key.unsafe_offset(ring_len * head_dim)
        var first_new = span[0] * head_dim
        cpu_pool_row[dtype, kpool, head_dim](
            ring_key,
            ring_gate,
            r,
            k.unsafe_offset(first_new),
            gate.unsafe_offset(first_new),
            ape,
            row,
        )
        closed_pool[unsafe_offset=b] = Int32(p)

    # Below a few thousand members the whole call costs less than waking
    # the worker threads.
    var work = batch * kpool * head_dim
    var workers = min(num_physical_cores(), batch)
    if workers <= 1 or work < 1 << 16:
        for b in range(batch):
            close_request(b)
        return

    var per_worker = ceildiv(batch, workers)

    def close_range(w: Int) {imm}:
        for b in range(w * per_worker, min((w + 1) * per_worker, batch)):
            close_request(b)

    sync_parallelize(close_range, workers)


def ring_close_gpu[
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
    ctx: DeviceContext,
) raises:
    """GPU ring_close: one block per request, one thread per channel.

    Blocks are `min(head_dim, 1024)` wide; a wider head strides its threads
    over the channels. A request with nothing to close writes -1 and zeros
    and returns before touching the ring.

    Parameters and Args are those of `ring_close_cpu`, plus `ctx`, the
    device context the kernel is enqueued on.
    """
    if batch == 0:
        return
    comptime block = min(head_dim, GPU_MAX_BLOCK)
    var tokens64 = Int64(total_tokens)
    var slots64 = Int64(max_slots)
    var ring64 = Int64(ring_len)

    def kpool_ring_close_kernel() {var}:
        var b = Int(block_idx.x)
        var span = token_span(input_row_offsets, b, Int(tokens64))
        var c = read_index(cache_lengths, b)
        var s = read_index(slot_idx, b)
        var p = pending_pool[kpool](c, span[1])
        var ring = Int(ring64)
        var row = pooled.unsafe_offset(b * head_dim)
        if not span[2] or not slot_ok(s, Int(slots64)) or p < 0:
            if thread_idx.x == 0:
                closed_pool[unsafe_offset=b] = -1
            for ch in range(Int(thread_idx.x), head_dim, block):
                row[unsafe_offset=ch] = 0
            return
        var ring_key = tail.unsafe_offset(
            ((s * 2) * ring + (p * kpool) % ring) * head_dim
        )
        var ring_gate = ring_key.unsafe_offset(ring * head_dim)
        var first_new = span[0] * head_dim
        for ch in range(Int(thread_idx.x), head_dim, block):
            row[unsafe_offset=ch] = pool_channels[dtype, 1, kpool](
                ring_key,
                ring_gate,
                c % kpool,
                k.unsafe_offset(first_new),
                gate.unsafe_offset(first_new),
                ape,
                head_dim,
                ch,
            )
        if thread_idx.x == 0:
            closed_pool[unsafe_offset=b] = Int32(p)

    ctx.enqueue_function(
        kpool_ring_close_kernel, grid_dim=batch, block_dim=block
    )


@extensibility.register("mo.mla.kpool.ring_close")
struct MLAKPoolRingClose:
    """Registers the `mo.mla.kpool.ring_close` graph op (CPU and GPU)."""

    @staticmethod
    def execute[
        *,
        head_dim: Int,
        kpool: Int,
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
            Error: If the operand shapes disagree with `head_dim`/`kpool`
                (the Python API rejects those before the graph is built).
        """
        var batch = closed_pool.dim_size(0)
        var total_tokens = k.dim_size(0)
        var max_slots = tail.dim_size(0)
        var ring_len = tail.dim_size(2)
        if (
            pooled.dim_size(1) != head_dim
            or k.dim_size(1) != head_dim
            or gate.dim_size(1) != head_dim
            or tail.dim_size(3) != head_dim
            or tail.dim_size(1) != 2
            or ring_len < kpool
            or ring_len % kpool != 0
            or ape.dim_size(0) != kpool
            or ape.dim_size(1) != head_dim
            or gate.dim_size(0) != total_tokens
            or pooled.dim_size(0) != batch
            or cache_lengths.dim_size(0) != batch
            or slot_idx.dim_size(0) != batch
            or input_row_offsets.dim_size(0) != batch + 1
        ):
            raise Error("mo.mla.kpool.ring_close: operand shapes disagree")
        comptime if target == "cpu":
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
