"""How the GPU writers give a row's channels to threads.

Every writer's GPU work is rows of `head_dim` channels (a request's closed
pool, an output row, a stashed position), each channel independent. A
thread takes `gpu_channel_width` consecutive channels, 4: the 16 bytes of
one float32 ape load (8 channels of 16-bit keys used half of each ape
sector a request), so a warp's every load and store is one contiguous
run; a row takes `gpu_row_threads` threads (32 at 128 channels), and a block of
`GPU_WRITER_THREADS` threads covers several rows (`gpu_rows_per_block`),
so a decode batch of 64 requests is 16 blocks of 64 threads rather than
64 blocks each under a warp, and a batch of 4096 keeps every thread of its
blocks busy. A head wider than 1024 threads' channels strides, each
thread taking channels `first`, `first + stride`, ...

The vector accesses need 16-byte aligned rows: a row's offset is a
multiple of the channel width (it divides `head_dim`), and the operand
base pointers are checked at run time (`gpu_aligned`); a call whose
tensors are not aligned (a view MAX hands at an odd offset) takes the
same arithmetic with element loads. Either way each channel is computed
by the same float32 operations in the same order as the CPU path's wider
SIMD steps, but not bitwise equal to them: on a GPU the softmax's `exp`
compiles to the approximate `ex2.approx.ftz.f32` (PTX), so a GPU pool
agrees with the CPU's within the oracle's tolerance
(`mla_kpool.reference.tolerance`, what the GPU tests check). Bitwise
equality holds between the writers on one device: ring_close, compress
and the fused step build the same pool bit for bit on a GPU, as on a CPU.

The vector accesses follow the 128-bit loads of fast GPU kernels (MAX's
`nn.topk_bitonic`, CUTLASS's `AlignedArray` copies).
"""

from std.math import max, min
from std.sys import align_of, is_gpu, size_of

from ..grid.block_phases import PROFILE_BUILD, Shared
from ..grid.parallel import GPU_MAX_BLOCK
from ..grid.ragged import Ptr, read_index

comptime GPU_ACCESS_BYTES = 16
"""Bytes one thread loads or stores at once: a 128-bit access."""

comptime GPU_WRITER_THREADS = 64
"""Threads per writer block when a row needs fewer: two warps, so a decode
batch spreads over as many SMs as it has blocks and a large batch still
keeps 32 blocks of a full SM busy."""


@always_inline
def gpu_channel_width[dtype: DType, head_dim: Int]() -> Int:
    """Channels per thread: 16 bytes of float32 (the ape's, and the keys'
    at float32; 8 bytes of 16-bit keys), halved until it divides
    `head_dim` (1 for an odd head)."""
    var width = max(GPU_ACCESS_BYTES // max(size_of[dtype](), 4), 1)
    while width > 1 and head_dim % width != 0:
        width //= 2
    return width


@always_inline
def gpu_row_threads[dtype: DType, head_dim: Int]() -> Int:
    """Threads per row: one per channel group, at most 1024 (wider heads
    stride)."""
    return max(
        min(head_dim // gpu_channel_width[dtype, head_dim](), GPU_MAX_BLOCK), 1
    )


@always_inline
def gpu_rows_per_block[dtype: DType, head_dim: Int]() -> Int:
    """Rows per block: as many as fill `GPU_WRITER_THREADS`, at least one."""
    return max(GPU_WRITER_THREADS // gpu_row_threads[dtype, head_dim](), 1)


@always_inline
def gpu_writer_threads[dtype: DType, head_dim: Int]() -> Int:
    """Threads per block: whole rows only."""
    return (
        gpu_row_threads[dtype, head_dim]()
        * gpu_rows_per_block[dtype, head_dim]()
    )


@fieldwise_init
struct RowLane(ImplicitlyCopyable):
    """Which row a thread works on, and its channels in it."""

    var row: Int
    """The row (request, output row) of the op's row space."""
    var first: Int
    """The thread's first channel, a multiple of `width`."""
    var stride: Int
    """Channels between the thread's groups: `row threads x width`."""


@always_inline
def row_lane[dtype: DType, head_dim: Int](block: Int, thread: Int) -> RowLane:
    """Thread `thread` of block `block`: row `block x rows per block +
    thread / row threads`, channels from `(thread % row threads) x width`.
    """
    comptime width = gpu_channel_width[dtype, head_dim]()
    comptime threads = gpu_row_threads[dtype, head_dim]()
    comptime rows = gpu_rows_per_block[dtype, head_dim]()
    return RowLane(
        block * rows + thread // threads,
        (thread % threads) * width,
        threads * width,
    )


@always_inline
def gpu_aligned(addresses: Int) -> Bool:
    """Whether every address OR-ed into `addresses` (`Int(p) | Int(q) |
    ...`, the operands' base pointers) is a multiple of `GPU_ACCESS_BYTES`.
    """
    return (addresses & (GPU_ACCESS_BYTES - 1)) == 0


@always_inline
def access_alignment[dtype: DType, width: Int]() -> Int:
    """The alignment a `width`-element access of `dtype` may claim when its
    row base is 16-byte aligned and its offset a multiple of `width`."""
    return min(width * size_of[dtype](), GPU_ACCESS_BYTES)


@always_inline
def _copy_channels[
    dtype: DType, head_dim: Int, alignment: Int
](lane: RowLane, s: Shared, dest: Ptr[dtype], src: Ptr[dtype]):
    """`copy_channels` with the accesses' alignment fixed."""
    comptime width = gpu_channel_width[dtype, head_dim]()
    for ch in range(lane.first, head_dim, lane.stride):
        s.global_store[width=width, alignment=alignment](
            dest,
            ch,
            s.global_load[width=width, alignment=alignment](src, ch),
        )


@always_inline
def copy_channels[
    dtype: DType, head_dim: Int
](lane: RowLane, s: Shared, dest: Ptr[dtype], src: Ptr[dtype], aligned: Bool):
    """Copies the thread's channels of one `head_dim` row from `src` to
    `dest`: 16-byte accesses when `aligned` (`gpu_aligned` of both
    operands' bases), else element accesses; through the thread's view
    `s` (recorded in a profiled emulation)."""
    comptime width = gpu_channel_width[dtype, head_dim]()
    if aligned:
        _copy_channels[dtype, head_dim, access_alignment[dtype, width]()](
            lane, s, dest, src
        )
    else:
        _copy_channels[dtype, head_dim, align_of[Scalar[dtype]]()](
            lane, s, dest, src
        )


# The metadata reads of the helpers the CPU path shares (`token_span`,
# `last_span_at`, `read_index` in `ragged`, the writers' plans): the GPU
# path records them beside the call with `Shared.note_global_load`, so the
# helpers take no view and the CPU kernels stay as they are. Host code
# only: a GPU build has nothing of them.


@always_inline
def profiled(s: Shared) -> Bool:
    """Whether `s` records its accesses (a profiled emulation); a constant
    False on a GPU."""
    comptime if is_gpu():
        return False
    else:
        return Int(s.profile) != 0


@always_inline
def note_last_span_at[
    dtype: DType
](s: Shared, row_offsets: Ptr[dtype], batch: Int, row: Int):
    """Records the reads of `ragged.last_span_at(row_offsets, batch, row)`:
    its binary search walked again on the host, when profiled."""
    comptime if PROFILE_BUILD:
        comptime if not is_gpu():
            if not profiled(s):
                return
            var lo = 0
            var hi = batch + 1
            while lo < hi:
                var mid = (lo + hi) // 2
                s.note_global_load(row_offsets, mid)
                if read_index(row_offsets, mid) <= row:
                    lo = mid + 1
                else:
                    hi = mid
