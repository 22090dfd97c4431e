"""`index_top_k`'s tensor-core scorer for Hopper (sm_90a): FP8 `wgmma`.

One block of 128 threads (a warpgroup) scores one query row against a tile
of `WGMMA_TILE` = 64 candidates, as one matrix product per chunk of up to
`WGMMA_HEADS` = 64 heads:

    D[m, n] = sum_d key[j0 + m, d] * q[t, h0 + n, d]      (A = keys, B = query)

on `wgmma.mma_async.m64nNk32.f32.e4m3.e4m3` (SASS `QGMMA`), the candidates
as M, the chunk's heads as N (rounded up to a multiple of 8), the depth as
K in steps of 32 (rounded up, the padding zero). This is how DeepGEMM's
SM90 `fp8_paged_mqa_logits` lays the product out (64 keys as M per
warpgroup, heads as N); the code here is this package's own.

Phases (`gpu_kernel.gpu_block_kernel`), for chunk `c` of `C`:

- `2c`: the block copies the chunk's query heads (and, for `c = 0`, the
  tile's keys) as e4m3fn bytes into shared memory, K-major, in the
  unswizzled core-matrix layout `tile_byte` (8 rows x 16 bytes per core
  matrix); keys past the row's bound and heads past `num_heads` are zero.
  Then the generic-to-async proxy fence, so `wgmma` sees the stores.
- `2c + 1`: the warpgroup issues the `depth / 32` chained `wgmma`s; each
  thread takes its accumulator registers (rows `16 w + g`, `16 w + g + 8`,
  columns `8 i + 2 q`, `+ 1`), applies the NaN-keeping ReLU and the head
  weights, and adds its two rows' sums to its own shared words.
- `2C`: a thread per candidate adds its row's four partial sums (one per
  thread of the quad that held the row) in a fixed order and multiplies by
  the key's scale: the scale once after the head sum, as DeepGEMM does.

Numerics: the products of e4m3 values are exact, but the tensor core adds
them with fewer bits than a float32 FMA chain (docs/ops.md derives the
bound the tests use); the head sum and the scale are float32 in a fixed
order, so the scores are the same on every launch. On the emulated grid the
instruction is `wgmma_model.wgmma_e4m3_model`, written from the PTX ISA.

Shapes: any `num_heads`; `depth` up to `index_gpu_score.TENSOR_MAX_DEPTH`
(a tile of keys and one of query heads must fit the block's static shared
memory).
"""

from max.gpu.compute.mma import (
    WGMMADescriptor,
    wgmma_async,
    wgmma_commit_group_sync,
    wgmma_fence_aligned,
    wgmma_wait_group_sync,
)
from max.gpu.memory import AddressSpace, fence_async_view_proxy
from max.gpu.primitives import warp
from std.math import ceildiv, min
from std.memory import bitcast
from std.sys import inlined_assembly
from std.sys.info import is_nvidia_gpu

from ...model.block_phases import Lane, Shared
from ...model.gpu_kernel import GpuKernel
from .index_gpu_score import candidate_at, candidate_tile, is_aligned
from ..index_operands import IndexTopK
from ...model.ragged import Ptr
from .wgmma_model import WGMMA_FP8_K, wgmma_e4m3_model


comptime WGMMA_TILE = 64
"""Candidates per block: the instruction's M."""

comptime WGMMA_THREADS = 128
"""Threads per block: one warpgroup."""

comptime WGMMA_HEADS = 64
"""Most heads per matrix product (the instruction's N)."""

comptime CORE_BYTES = 128
"""Bytes of one core matrix: 8 rows of 16 bytes."""


@always_inline
def wgmma_depth[depth: Int]() -> Int:
    """`depth` rounded up to whole instructions (32 bytes of K each)."""
    return ceildiv(depth, WGMMA_FP8_K) * WGMMA_FP8_K


@always_inline
def wgmma_chunks[num_heads: Int]() -> Int:
    """Matrix products per tile: chunks of up to `WGMMA_HEADS` heads."""
    return ceildiv(num_heads, WGMMA_HEADS)


@always_inline
def chunk_n[num_heads: Int, chunk: Int]() -> Int:
    """N of chunk `chunk`'s product: its heads rounded up to 8."""
    return ceildiv(min(WGMMA_HEADS, num_heads - chunk * WGMMA_HEADS), 8) * 8


@always_inline
def wgmma_phases[num_heads: Int]() -> Int:
    """Phases of the scorer: stage and multiply per chunk, then the sum."""
    return 2 * wgmma_chunks[num_heads]() + 1


@always_inline
def query_word[depth: Int]() -> Int:
    """First shared word of the query tile (after the key tile)."""
    return WGMMA_TILE * wgmma_depth[depth]() // 4


@always_inline
def partial_word[num_heads: Int, depth: Int]() -> Int:
    """First shared word of the partial sums (4 per candidate)."""
    return (
        query_word[depth]()
        + chunk_n[num_heads, 0]() * wgmma_depth[depth]() // 4
    )


@always_inline
def wgmma_words[num_heads: Int, depth: Int]() -> Int:
    """Shared words of the scorer: keys, query heads, partial sums."""
    return partial_word[num_heads, depth]() + 4 * WGMMA_TILE


@always_inline
def wgmma_instructions[num_heads: Int, depth: Int]() -> Int:
    """`wgmma`s per tile of `WGMMA_TILE` candidates (and one query row)."""
    return wgmma_chunks[num_heads]() * (wgmma_depth[depth]() // WGMMA_FP8_K)


def wgmma_tile_flops[num_heads: Int, depth: Int]() -> Int:
    """Flops the tensor cores do per tile, padding included (2 per MAC)."""
    var n = 0
    comptime for c in range(wgmma_chunks[num_heads]()):
        n += chunk_n[num_heads, c]()
    return 2 * WGMMA_TILE * n * wgmma_depth[depth]()


def wgmma_tiles(op: IndexTopK) -> Int:
    """Blocks per row: tiles of `WGMMA_TILE` candidates."""
    return ceildiv(op.work.candidates, WGMMA_TILE)


@always_inline
def tile_byte[kp: Int](row: Int, k: Int) -> Int:
    """Byte of element `(row, k)` in a K-major tile `kp` bytes wide.

    Core matrices of 8 rows x 16 bytes, 128 contiguous bytes each; along K
    they follow one another (the descriptor's LBO = 128 bytes), and each
    group of 8 rows holds `kp / 16` of them (SBO = `8 * kp` bytes).
    """
    return (
        ((row // 8) * (kp // 16) + k // 16) * CORE_BYTES
        + (row % 8) * 16
        + k % 16
    )


@always_inline
def descriptor(address: Int, leading: Int, stride: Int) -> Int64:
    """A `wgmma` descriptor: K-major, no swizzle, no base offset.

    Args:
        address: The tile's shared address in bytes (a multiple of 16).
        leading: Bytes between core matrices along K (LBO).
        stride: Bytes between groups of 8 rows (SBO).
    """
    return (
        Int64((address & 0x3FFFF) >> 4)
        | (Int64(leading >> 4) << 16)
        | (Int64(stride >> 4) << 32)
    )


@always_inline
def store_words4(s: Shared, i: Int, value: SIMD[DType.uint32, 4]):
    """Stores 4 words at `i` (a multiple of 4): one 16-byte store on a GPU."""
    if s.checked:
        comptime for w in range(4):
            s.store(i + w, value[w])
    else:
        s.words.unsafe_offset(i).unsafe_store[width=4, alignment=16](0, value)


@always_inline
def stage_unit[
    kp: Int, depth: Int
](
    s: Shared,
    first_word: Int,
    row: Int,
    unit: Int,
    src: Ptr[DType.uint8],
    valid: Bool,
):
    """Copies bytes `16 unit ..< 16 unit + 16` of a row into its tile.

    Bytes past `depth`, and every byte of a row that is not `valid`, are
    zero. One 16-byte load where the source is aligned and whole, else
    byte loads (a key's address depends on the runtime page stride).
    """
    var bytes = SIMD[DType.uint8, 16](0)
    var first = 16 * unit
    if valid:
        var at = src.unsafe_offset(first)
        if first + 16 <= depth and is_aligned[16](at):
            bytes = at.unsafe_load[width=16, alignment=16](0)
        else:
            comptime for i in range(16):  # unrolled: no local memory
                if first + i < depth:
                    bytes[i] = at[unsafe_offset=i]
    store_words4(
        s,
        first_word + tile_byte[kp](row, first) // 4,
        bitcast[DType.uint32, 4](bytes),
    )


@always_inline
def multiply_chunk[chunk: Int](s: Shared, thread: Int, op: IndexTopK, t: Int):
    """Phase `2 chunk + 1`: the chunk's product and its heads' partial sums.

    Every thread of the warpgroup must call this (the instruction is
    warpgroup-wide); each adds its two rows' ReLU'd, weighted heads to its
    own partial-sum words.
    """
    comptime heads = op.num_heads
    comptime kp = wgmma_depth[op.depth]()
    comptime n = chunk_n[heads, chunk]()
    comptime width = n // 2
    comptime leading = CORE_BYTES
    comptime stride = CORE_BYTES * (kp // 16)
    comptime partials = partial_word[heads, op.depth]()
    var base = 0
    comptime if is_nvidia_gpu():
        base = Int(s.words.unsafe_address_space_cast[AddressSpace.SHARED]())
    var keys = base
    var query = base + 4 * query_word[op.depth]()
    var acc = SIMD[DType.float32, width](0)
    # The same descriptors for the hardware and for the model: only the
    # instruction differs between the GPU and the emulated grid.
    comptime if is_nvidia_gpu():
        wgmma_fence_aligned()
    comptime for step in range(kp // WGMMA_FP8_K):
        var a = descriptor(keys + 2 * CORE_BYTES * step, leading, stride)
        var b = descriptor(query + 2 * CORE_BYTES * step, leading, stride)
        comptime if is_nvidia_gpu():
            acc = wgmma_async[
                WGMMA_TILE,
                n,
                WGMMA_FP8_K,
                DType.float32,
                width,
                a_type=DType.float8_e4m3fn,
                b_type=DType.float8_e4m3fn,
            ](
                WGMMADescriptor[DType.float8_e4m3fn](a),
                WGMMADescriptor[DType.float8_e4m3fn](b),
                acc,
            )
        else:
            acc = wgmma_e4m3_model[n, width](s, thread, a, b, acc)
    comptime if is_nvidia_gpu():
        wgmma_commit_group_sync()
        wgmma_wait_group_sync[0]()
        # Each accumulator register passes through an empty asm after the
        # wait, so nothing reads it before the wait (else ptxas injects a
        # wait of its own, advisory C7517); MAX's `warpgroup_fence` is the
        # same code-motion fence.
        comptime for i in range(width):
            acc[i] = inlined_assembly[
                "", Float32, constraints="=f,0", has_side_effect=True
            ](acc[i])
    # Register i holds row 16w + g + 8 ((i / 2) % 2), column
    # 8 (i / 4) + 2q + i % 2 (PTX ISA's m64nNk32 accumulator fragment).
    var lane = thread % 32
    var quad = lane % 4
    var weights = op.qs.unsafe_offset(t * heads)
    var sums = SIMD[DType.float32, 2](0)
    comptime for i in range(width):
        var h = chunk * WGMMA_HEADS + 8 * (i // 4) + 2 * quad + i % 2
        if h < heads:
            var v = acc[i]
            # ReLU that keeps a NaN a NaN, as the other scorers'.
            var relu = Float32(0) if v < 0 else v
            sums[(i // 2) % 2] += relu * weights[unsafe_offset=h]
    comptime for r in range(2):
        var m = 16 * (thread // 32) + lane // 4 + 8 * r
        var word = partials + 4 * m + quad
        comptime if chunk == 0:
            s.store_f32(word, sums[r])
        else:
            s.store_f32(word, s.load_f32(word) + sums[r])


@always_inline
def index_wgmma_phase[
    phase: Int
](block: Int, thread: Int, s: Shared, op: IndexTopK):
    """One phase of the tensor-core scorer (module docs) for window row
    `block / wgmma_tiles(op)`, candidates from `64 * (block % tiles)`.

    Inlined into the kernel: a wgmma chain that crosses a call is
    serialized (ptxas advisory C7510).
    """
    comptime heads = op.num_heads
    comptime depth = op.depth
    comptime kp = wgmma_depth[depth]()
    comptime units = kp // 16
    comptime chunks = wgmma_chunks[heads]()
    comptime nb = chunk_n[heads, 0]()
    var tile = candidate_tile(op, block, WGMMA_TILE)
    var idle = tile.idle()
    comptime if is_nvidia_gpu():
        # The same for every thread of the block, but ptxas cannot prove it:
        # a per-thread early return before the chained wgmmas makes it
        # serialize them (advisory C7518). Lane 0's value, broadcast, is
        # uniform by construction (DeepGEMM broadcasts its predicates so).
        idle = warp.broadcast(Int32(Int(idle))) != 0
    if idle:
        return
    var row, t, b = tile.row, tile.t, tile.request
    var bound, j0 = tile.bound, tile.first
    comptime if phase == 2 * chunks:
        var j = j0 + thread
        if thread >= WGMMA_TILE or j >= bound:
            return
        var word = partial_word[heads, depth]() + 4 * thread
        var total = (s.load_f32(word) + s.load_f32(word + 1)) + (
            s.load_f32(word + 2) + s.load_f32(word + 3)
        )
        op.work.scores[unsafe_offset=row * op.work.candidates + j] = (
            total * op.k_scales[unsafe_offset=candidate_at(op, b, j).scale]
        )
        return
    comptime chunk = phase // 2
    comptime if phase % 2 == 1:
        multiply_chunk[chunk](s, thread, op, t)
        return
    comptime if chunk == 0:
        for u in range(thread, WGMMA_TILE * units, WGMMA_THREADS):
            var m = u // units
            var j = j0 + m
            var valid = j < bound
            var src = op.k_blocks
            if valid:
                src = op.k_blocks.unsafe_offset(candidate_at(op, b, j).key)
            stage_unit[kp, depth](s, 0, m, u % units, src, valid)
    for u in range(thread, nb * units, WGMMA_THREADS):
        var n = u // units
        var h = chunk * WGMMA_HEADS + n
        var valid = h < heads
        var src = op.q
        if valid:
            src = op.q.unsafe_offset((t * heads + h) * depth)
        stage_unit[kp, depth](s, query_word[depth](), n, u % units, src, valid)
    comptime if is_nvidia_gpu():
        # The tiles were written through the generic proxy; wgmma reads
        # them through the async proxy.
        fence_async_view_proxy()


struct WgmmaScore[Op: type_of(IndexTopK)](GpuKernel):
    """The `"wgmma"` scorer's launch (sm_90): a warpgroup per (window row,
    tile of `WGMMA_TILE` candidates), `index_wgmma_phase`."""

    comptime Operands = Self.Op
    comptime name = "mla_kpool_index_wgmma_score_kernel"
    comptime block_threads = WGMMA_THREADS
    comptime shared_words = wgmma_words[Self.Op.num_heads, Self.Op.depth]()
    comptime phases = wgmma_phases[Self.Op.num_heads]()
    comptime grid_rows = "window_rows"
    comptime rows_per_block = 1
    comptime grid_columns = "candidates"
    comptime columns_per_block = WGMMA_TILE
    comptime column_flops = (
        wgmma_tile_flops[Self.Op.num_heads, Self.Op.depth]() // WGMMA_TILE
    )
    comptime pads_columns = True
    comptime flops_peak = "fp8"

    @staticmethod
    def rows(op: Self.Operands) -> Int:
        """Rows of the window."""
        return op.work.rows

    @staticmethod
    def columns(op: Self.Operands) -> Int:
        """A workspace row's candidates."""
        return op.work.candidates

    @staticmethod
    @always_inline
    def run_phase[
        phase: Int
    ](
        block: Int,
        thread: Int,
        mut state: Self.State,
        mut lane: Lane,
        s: Shared,
        op: Self.Operands,
    ):
        """`index_wgmma_phase`."""
        index_wgmma_phase[phase](block, thread, s, op)
