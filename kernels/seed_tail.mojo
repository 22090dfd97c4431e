"""`mo.mla.kpool.seed_tail`: stash each request's trailing tokens in its ring.

In place on `tail[max_slots, 2, R, head_dim]`: for every absolute position
`pos` in `[max(c, floor((c + n) / kpool) * kpool - (R - kpool)), c + n)`, row
`start + pos - c` of `k` and `gate` is copied to `tail[s, 0, pos % R]` and
`tail[s, 1, pos % R]`. With the documented ring (`R == kpool`) that is exactly
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
from max.gpu import block_idx, thread_idx
from max.algorithm import sync_parallelize
from std.algorithm import vectorize
from std.math import ceildiv, min
from std.sys import num_physical_cores, simd_width_of

from .ragged import Ptr, read_index, slot_ok, token_span
from .ring_close import GPU_MAX_BLOCK


@always_inline
def copy_row[dtype: DType, head_dim: Int](dest: Ptr[dtype], src: Ptr[dtype]):
    """Copies one `head_dim` row with full-width SIMD moves (CPU)."""

    def chunk[width: Int](ch: Int) {imm}:
        dest.unsafe_store[width=width](ch, src.unsafe_load[width=width](ch))

    vectorize[simd_width_of[dtype]()](head_dim, chunk)


@always_inline
def stash_range[
    kpool: Int
](cache_length: Int, new_tokens: Int, ring_len: Int) -> Tuple[Int, Int]:
    """Absolute positions `[lo, hi)` seed_tail stashes for one request."""
    var hi = cache_length + new_tokens
    var lo = max(cache_length, (hi // kpool) * kpool - (ring_len - kpool))
    return (lo, hi)


def seed_tail_cpu[
    dtype: DType,
    offset_dtype: DType,
    length_dtype: DType,
    slot_dtype: DType,
    kpool: Int,
    head_dim: Int,
](
    tail: Ptr[dtype],
    k: Ptr[dtype],
    gate: Ptr[dtype],
    input_row_offsets: Ptr[offset_dtype],
    cache_lengths: Ptr[length_dtype],
    slot_idx: Ptr[slot_dtype],
    batch: Int,
    total_tokens: Int,
    max_slots: Int,
    ring_len: Int,
):
    """CPU seed_tail: a row copy per stashed position, requests in parallel.

    Parameters:
        dtype: Key dtype.
        offset_dtype: Integer dtype of `input_row_offsets`.
        length_dtype: Integer dtype of `cache_lengths`.
        slot_dtype: Integer dtype of `slot_idx`.
        kpool: Tokens per pool.
        head_dim: Channels per key.

    Args:
        tail: Ring `[max_slots, 2, ring_len, head_dim]`, written in place.
        k: `[total_tokens, head_dim]` keys.
        gate: `[total_tokens, head_dim]` gate scores.
        input_row_offsets: `[batch + 1]` token row offsets.
        cache_lengths: `[batch]` cached-prefix lengths.
        slot_idx: `[batch]` ring slots.
        batch: Requests.
        total_tokens: Rows of `k`.
        max_slots: Ring slots.
        ring_len: Ring length R (a multiple of `kpool`).
    """

    def seed_request(b: Int) {imm}:
        var span = token_span(input_row_offsets, b, total_tokens)
        var c = read_index(cache_lengths, b)
        var s = read_index(slot_idx, b)
        if not span[2] or c < 0 or not slot_ok(s, max_slots):
            return
        var stash = stash_range[kpool](c, span[1], ring_len)
        var ring_key = tail.unsafe_offset(s * 2 * ring_len * head_dim)
        var ring_gate = ring_key.unsafe_offset(ring_len * head_dim)
        for pos in range(stash[0], stash[1]):
            var src = (span[0] + pos - c) * head_dim
            var dst = (pos % ring_len) * head_dim
            copy_row[dtype, head_dim](
                ring_key.unsafe_offset(dst), k.unsafe_offset(src)
            )
            copy_row[dtype, head_dim](
                ring_gate.unsafe_offset(dst), gate.unsafe_offset(src)
            )

    var work = batch * ring_len * head_dim
    var workers = min(num_physical_cores(), batch)
    if workers <= 1 or work < 1 << 18:
        for b in range(batch):
            seed_request(b)
        return
    var per_worker = ceildiv(batch, workers)

    def seed_range(w: Int) {imm}:
        for b in range(w * per_worker, min((w + 1) * per_worker, batch)):
            seed_request(b)

    sync_parallelize(seed_range, workers)


def seed_tail_gpu[
    dtype: DType,
    offset_dtype: DType,
    length_dtype: DType,
    slot_dtype: DType,
    kpool: Int,
    head_dim: Int,
](
    tail: Ptr[dtype],
    k: Ptr[dtype],
    gate: Ptr[dtype],
    input_row_offsets: Ptr[offset_dtype],
    cache_lengths: Ptr[length_dtype],
    slot_idx: Ptr[slot_dtype],
    batch: Int,
    total_tokens: Int,
    max_slots: Int,
    ring_len: Int,
    ctx: DeviceContext,
) raises:
    """GPU seed_tail: one block per request, threads over channels.

    Parameters and Args are those of `seed_tail_cpu`, plus `ctx`.
    """
    if batch == 0:
        return
    comptime block = min(head_dim, GPU_MAX_BLOCK)
    var tokens64 = Int64(total_tokens)
    var slots64 = Int64(max_slots)
    var ring64 = Int64(ring_len)

    def kpool_seed_tail_kernel() {var}:
        var b = Int(block_idx.x)
        var span = token_span(input_row_offsets, b, Int(tokens64))
        var c = read_index(cache_lengths, b)
        var s = read_index(slot_idx, b)
        if not span[2] or c < 0 or not slot_ok(s, Int(slots64)):
            return
        var ring = Int(ring64)
        var stash = stash_range[kpool](c, span[1], ring)
        var ring_key = tail.unsafe_offset(s * 2 * ring * head_dim)
        var ring_gate = ring_key.unsafe_offset(ring * head_dim)
        for pos in range(stash[0], stash[1]):
            var src = (span[0] + pos - c) * head_dim
            var dst = (pos % ring) * head_dim
            for ch in range(Int(thread_idx.x), head_dim, block):
                ring_key[unsafe_offset=dst + ch] = k[unsafe_offset=src + ch]
                ring_gate[unsafe_offset=dst + ch] = gate[unsafe_offset=src + ch]

    ctx.enqueue_function(
        kpool_seed_tail_kernel, grid_dim=batch, block_dim=block
    )


@extensibility.register("mo.mla.kpool.seed_tail")
struct MLAKPoolSeedTail:
    """Registers the `mo.mla.kpool.seed_tail` graph op (CPU and GPU)."""

    @staticmethod
    def execute[
        *,
        head_dim: Int,
        kpool: Int,
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
            Error: If the operand shapes disagree with `head_dim`/`kpool`.
        """
        var batch = cache_lengths.dim_size(0)
        var total_tokens = k.dim_size(0)
        var max_slots = tail.dim_size(0)
        var ring_len = tail.dim_size(2)
        if (
            k.dim_size(1) != head_dim
            or gate.dim_size(1) != head_dim
            or gate.dim_size(0) != total_tokens
            or tail.dim_size(1) != 2
            or tail.dim_size(3) != head_dim
            or ring_len < kpool
            or ring_len % kpool != 0
            or slot_idx.dim_size(0) != batch
            or input_row_offsets.dim_size(0) != batch + 1
        ):
            raise Error("mo.mla.kpool.seed_tail: operand shapes disagree")
        comptime if target == "cpu":
            seed_tail_cpu[
                tail.dtype,
                input_row_offsets.dtype,
                cache_lengths.dtype,
                slot_idx.dtype,
                kpool,
                head_dim,
            ](
                tail.unsafe_ptr(),
                k.unsafe_ptr(),
                gate.unsafe_ptr(),
                input_row_offsets.unsafe_ptr(),
                cache_lengths.unsafe_ptr(),
                slot_idx.unsafe_ptr(),
                batch,
                total_tokens,
                max_slots,
                ring_len,
            )
        else:
            seed_tail_gpu[
                tail.dtype,
                input_row_offsets.dtype,
                cache_lengths.dtype,
                slot_idx.dtype,
                kpool,
                head_dim,
            ](
                tail.unsafe_ptr(),
                k.unsafe_ptr(),
                gate.unsafe_ptr(),
                input_row_offsets.unsafe_ptr(),
                cache_lengths.unsafe_ptr(),
                slot_idx.unsafe_ptr(),
                batch,
                total_tokens,
                max_slots,
                ring_len,
                ctx,
            )
