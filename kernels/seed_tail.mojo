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
from std.algorithm import vectorize
from std.sys import simd_width_of

from .operands import dims, expect_ring, expect_rows, expect_shape
from .parallel import cpu_for_each_range, emulate_grid, gpu_block_width
from .ragged import Ptr, read_index, slot_ok, token_span


@always_inline
def copy_row[dtype: DType, head_dim: Int](dest: Ptr[dtype], src: Ptr[dtype]):
    """Copies one `head_dim` row with full-width SIMD moves (CPU)."""

    def chunk[width: Int](ch: Int) {imm}:
        dest.unsafe_store[width=width](ch, src.unsafe_load[width=width](ch))

    vectorize[simd_width_of[dtype]()](head_dim, chunk)


@always_inline
def plan_stash[
    dtype: DType,
    offset_dtype: DType,
    length_dtype: DType,
    slot_dtype: DType,
    kpool: Int,
    head_dim: Int,
](
    b: Int,
    tail: Ptr[dtype],
    input_row_offsets: Ptr[offset_dtype],
    cache_lengths: Ptr[length_dtype],
    slot_idx: Ptr[slot_dtype],
    total_tokens: Int,
    max_slots: Int,
    ring_len: Int,
) -> Tuple[Int, Int, Int, Ptr[dtype], Ptr[dtype]]:
    """What request `b` stashes, and where (CPU and GPU).

    Returns:
        `(lo, hi, row_of_lo, ring_key, ring_gate)`: absolute positions
        `[lo, hi)` go from rows `row_of_lo + pos - lo` of `k`/`gate` to
        rows `pos % ring_len` of the slot's key and gate planes. `lo == hi`
        (nothing) for a request whose slot or offsets are bad.
    """
    var span = token_span(input_row_offsets, b, total_tokens)
    var c = read_index(cache_lengths, b)
    var s = read_index(slot_idx, b)
    if not span[2] or c < 0 or not slot_ok(s, max_slots):
        return (0, 0, 0, tail, tail)
    var hi = c + span[1]
    var lo = max(c, (hi // kpool) * kpool - (ring_len - kpool))
    var ring_key = tail.unsafe_offset(s * 2 * ring_len * head_dim)
    return (
        lo,
        hi,
        span[0] + lo - c,
        ring_key,
        ring_key.unsafe_offset(ring_len * head_dim),
    )


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
    """CPU seed_tail: a SIMD row copy per stashed position.

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

    def seed_requests(lo: Int, hi: Int) {imm}:
        for b in range(lo, hi):
            var plan = plan_stash[
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
            for pos in range(plan[0], plan[1]):
                var src = (plan[2] + pos - plan[0]) * head_dim
                var dst = (pos % ring_len) * head_dim
                copy_row[dtype, head_dim](
                    plan[3].unsafe_offset(dst), k.unsafe_offset(src)
                )
                copy_row[dtype, head_dim](
                    plan[4].unsafe_offset(dst), gate.unsafe_offset(src)
                )

    cpu_for_each_range(batch, batch * ring_len * head_dim, seed_requests)


def seed_tail_thread[
    dtype: DType,
    offset_dtype: DType,
    length_dtype: DType,
    slot_dtype: DType,
    kpool: Int,
    head_dim: Int,
](
    block: Int,
    thread: Int,
    tail: Ptr[dtype],
    k: Ptr[dtype],
    gate: Ptr[dtype],
    input_row_offsets: Ptr[offset_dtype],
    cache_lengths: Ptr[length_dtype],
    slot_idx: Ptr[slot_dtype],
    total_tokens: Int,
    max_slots: Int,
    ring_len: Int,
):
    """One GPU thread of seed_tail: request `block`, channels from `thread`.

    Block `b` stashes request `b`'s trailing positions; thread `t` copies
    channels `t`, `t + W`, ... of each (`W = gpu_block_width[head_dim]()`).
    `kpool_seed_tail_kernel` runs this on a GPU, `emulate_grid` on the CPU.

    Parameters and Args are those of `seed_tail_cpu`, plus the launch
    indices `block` and `thread`.
    """
    comptime stride = gpu_block_width[head_dim]()
    var plan = plan_stash[
        dtype, offset_dtype, length_dtype, slot_dtype, kpool, head_dim
    ](
        block,
        tail,
        input_row_offsets,
        cache_lengths,
        slot_idx,
        total_tokens,
        max_slots,
        ring_len,
    )
    for pos in range(plan[0], plan[1]):
        var src = (plan[2] + pos - plan[0]) * head_dim
        var dst = (pos % ring_len) * head_dim
        for ch in range(thread, head_dim, stride):
            plan[3][unsafe_offset=dst + ch] = k[unsafe_offset=src + ch]
            plan[4][unsafe_offset=dst + ch] = gate[unsafe_offset=src + ch]


def kpool_seed_tail_kernel[
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
    total_tokens: Int64,
    max_slots: Int64,
    ring_len: Int64,
):
    """GPU entry of seed_tail: `seed_tail_thread` at this block and thread.

    Parameters and Args are those of `seed_tail_cpu` (sizes as Int64).
    """
    seed_tail_thread[
        dtype, offset_dtype, length_dtype, slot_dtype, kpool, head_dim
    ](
        Int(block_idx.x),
        Int(thread_idx.x),
        tail,
        k,
        gate,
        input_row_offsets,
        cache_lengths,
        slot_idx,
        Int(total_tokens),
        Int(max_slots),
        Int(ring_len),
    )


@always_inline
def seed_tail_launch[head_dim: Int](batch: Int) -> Tuple[Int, Int]:
    """`(grid, block)` of `kpool_seed_tail_kernel`: a block per request."""
    return (batch, gpu_block_width[head_dim]())


def seed_tail_gpu[
    dtype: DType,
    offset_dtype: DType,
    length_dtype: DType,
    slot_dtype: DType,
    kpool: Int,
    head_dim: Int,
    emulate: Bool,
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
    """GPU seed_tail: launches `kpool_seed_tail_kernel` on `ctx`.

    With `emulate`, runs the same threads through `emulate_grid` on the
    CPU instead (the operands are then host memory and `ctx` is unused).

    Parameters and Args are those of `seed_tail_cpu`, plus `emulate` and
    `ctx`.
    """
    if batch == 0:
        return
    var shape = seed_tail_launch[head_dim](batch)
    comptime if emulate:

        def thread_work(block: Int, thread: Int) {imm}:
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

        emulate_grid("kpool_seed_tail_kernel", shape[0], shape[1], thread_work)
    else:
        ctx.enqueue_function[
            kpool_seed_tail_kernel[
                dtype, offset_dtype, length_dtype, slot_dtype, kpool, head_dim
            ]
        ](
            tail,
            k,
            gate,
            input_row_offsets,
            cache_lengths,
            slot_idx,
            Int64(total_tokens),
            Int64(max_slots),
            Int64(ring_len),
            grid_dim=shape[0],
            block_dim=shape[1],
        )


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
        var batch = cache_lengths.dim_size(0)
        var total_tokens = k.dim_size(0)
        var max_slots = tail.dim_size(0)
        var ring_len = tail.dim_size(2)
        comptime OP = "mo.mla.kpool.seed_tail"
        expect_ring[kpool](OP, tail.shape(), head_dim)
        expect_rows(OP, k.shape(), gate.shape(), head_dim)
        expect_shape(
            OP,
            "input_row_offsets",
            input_row_offsets.shape(),
            "batch + 1",
            dims(batch + 1),
        )
        expect_shape(OP, "slot_idx", slot_idx.shape(), "batch", dims(batch))
        comptime if emulate_gpu and target != "cpu":
            raise Error(
                "mo.mla.kpool.seed_tail: emulate_gpu needs a CPU target"
            )
        comptime if target == "cpu" and not emulate_gpu:
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
                emulate_gpu,
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
