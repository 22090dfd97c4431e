"""`index_top_k`'s tensor-core scorer for Hopper (sm_90a): FP8 `wgmma`.

One block of 128 threads (a warpgroup) scores a tile of `WGMMA_TILE` = 64
candidates for `R` query rows (`WgmmaScore.tile_rows`), as one matrix
product per chunk of up to `WGMMA_HEADS` = 64 heads:

    D[m, n] = sum_d key[j0 + m, d] * q[t0 + n / Hn, n % Hn, d]

(A = keys, B = the rows' queries, `Hn` the chunk's heads rounded up to a
power of two, at least 8) on `wgmma.mma_async.m64nNk32.f32.e4m3.e4m3` (SASS `QGMMA`),
the candidates as M, the rows' heads as N = R x Hn, the depth as K in
steps of 32 (rounded up, the padding zero). This is how DeepGEMM's SM90
`fp8_paged_mqa_logits` lays the product out (64 keys as M per warpgroup,
heads as N); the code here is this package's own.

At decode a tile takes one row (R = 1: each row has its own request and
keys). At prefill (`wgmma_groups_rows`) it takes `group_rows` consecutive
rows (4 at 32 heads, 2 at 64: N up to `WGMMA_GROUP_N` = 128), so the
tile's keys are read and staged once for R rows instead of once per row.
The rows of a group may belong to several requests (a request's rows are
consecutive): a *segment* is a request's rows in the group, and each
segment stages its request's keys and runs its own product, of which only
its rows keep the sums.

Phases (`gpu_kernel.gpu_block_kernel`), for segment `s` of `R`, chunk `c`
of `C` (C > 1 only when R = 1):

- stage: for `s = 0`, the chunk's query heads of every row of the group;
  for `c = 0`, the segment's keys; each as e4m3fn bytes in shared memory,
  K-major, in the unswizzled core-matrix layout `tile_byte` (8 rows x 16
  bytes per core matrix); keys past the segment's bound, heads past
  `num_heads` and rows of no request are zero. Then the generic-to-async
  proxy fence, so `wgmma` sees the stores.
- multiply: the warpgroup issues the `depth / 32` chained `wgmma`s; each
  thread takes its accumulator registers (candidates `16 w + g`,
  `16 w + g + 8`, columns `8 i + 2 q`, `+ 1`), applies the NaN-keeping
  ReLU and its row's head weights, and adds its sums for the segment's
  rows to its own shared words.
- last: a thread per (row, candidate) adds the four partial sums (one
  per thread of the quad that held the candidate) in a fixed order and
  multiplies by the key's scale: the scale once after the head sum, as
  DeepGEMM does.

A segment with nothing to score (no row, or all its rows' bounds at or
below the tile) skips its phases as a block.

Numerics: the products of e4m3 values are exact, but the tensor core adds
them with fewer bits than a float32 FMA chain (docs/ops.md derives the
bound the tests use); the head sum and the scale are float32 in a fixed
order, so the scores are the same on every launch. On the emulated grid the instruction is
`wgmma_model.wgmma_e4m3_model`, written from the PTX ISA.

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
from std.bit import next_power_of_two
from std.math import ceildiv, max, min
from std.memory import bitcast
from std.sys import inlined_assembly
from std.sys.info import is_nvidia_gpu

from ...model.block_phases import Lane, Shared
from ...model.gpu_kernel import STATIC_SHARED_BYTES, GpuKernel
from .index_gpu_score import candidate_at, is_aligned
from ..index_operands import IndexTopK
from ...model.ragged import Ptr
from .wgmma_model import WGMMA_FP8_K, wgmma_e4m3_model


comptime WGMMA_TILE = 64
"""Candidates per block: the instruction's M."""

comptime WGMMA_THREADS = 128
"""Threads per block: one warpgroup."""

comptime WGMMA_HEADS = 64
"""Most heads per matrix product (the instruction's N)."""

comptime WGMMA_GROUP_N = 128
"""Most columns (query rows x heads) of a grouped tile's product: a
thread's accumulator is N / 2 = 64 float32 registers."""

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
    """Columns a query row takes in chunk `chunk`'s product: its heads
    rounded up to a power of two, at least 8 (the accumulator fragment,
    `N / 2` registers, is a SIMD vector: a power of two wide)."""
    return max(
        8, next_power_of_two(min(WGMMA_HEADS, num_heads - chunk * WGMMA_HEADS))
    )


@always_inline
def wgmma_phases[num_heads: Int, rows: Int]() -> Int:
    """Phases of the scorer: stage and multiply per (request of the tile's
    rows, chunk), then the sum."""
    return 2 * wgmma_chunks[num_heads]() * rows + 1


@always_inline
def query_word[depth: Int]() -> Int:
    """First shared word of the query tile (after the key tile)."""
    return WGMMA_TILE * wgmma_depth[depth]() // 4


def tile_words(kp: Int, n: Int, rows: Int) -> Int:
    """Shared words of a tile of `rows` query rows: `WGMMA_TILE` keys and
    `rows * n` query heads of `kp` bytes, 4 partial sums per (row, key)."""
    return (WGMMA_TILE + rows * n) * kp // 4 + 4 * WGMMA_TILE * rows


@always_inline
def partial_word[num_heads: Int, depth: Int, rows: Int]() -> Int:
    """First shared word of the partial sums (4 per row and candidate)."""
    comptime kp = wgmma_depth[depth]()
    return tile_words(kp, chunk_n[num_heads, 0](), rows) - 4 * WGMMA_TILE * rows


@always_inline
def wgmma_words[num_heads: Int, depth: Int, rows: Int]() -> Int:
    """Shared words of the scorer: keys, query heads, partial sums."""
    comptime kp = wgmma_depth[depth]()
    return tile_words(kp, chunk_n[num_heads, 0](), rows)


def group_rows[num_heads: Int, depth: Int]() -> Int:
    """Query rows one grouped tile scores.

    The most, a power of two, whose columns (`chunk_n` each) fit one
    product of `WGMMA_GROUP_N` columns and whose tiles fit the block's
    static shared memory: 4 for 32 heads of 128, 2 for 64; 1 when the
    heads take more than one product.
    """
    comptime if wgmma_chunks[num_heads]() > 1:
        return 1
    comptime n = chunk_n[num_heads, 0]()
    comptime kp = wgmma_depth[depth]()
    var rows = 1
    while (
        2 * rows * n <= WGMMA_GROUP_N
        and 4 * tile_words(kp, n, 2 * rows) <= STATIC_SHARED_BYTES
    ):
        rows *= 2
    return rows


def wgmma_tile_flops[num_heads: Int, depth: Int]() -> Int:
    """Flops the tensor cores do per tile of one query row, padding
    included (2 per MAC)."""
    var n = 0
    comptime for c in range(wgmma_chunks[num_heads]()):
        n += chunk_n[num_heads, c]()
    return 2 * WGMMA_TILE * n * wgmma_depth[depth]()


def wgmma_tiles(op: IndexTopK) -> Int:
    """Blocks per group of rows: tiles of `WGMMA_TILE` candidates."""
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


@fieldwise_init
struct TileRow(Copyable, TrivialRegisterPassable):
    """A window row as a tile sees it: its request and bound."""

    var request: Int
    """The row's request (`-1`: none, or past the window)."""
    var bound: Int
    """Candidates the row sees."""


@always_inline
def tile_row(op: IndexTopK, row: Int) -> TileRow:
    """Window row `row`'s request and bound (`op.work.plan`)."""
    if row >= op.work.rows:
        return TileRow(-1, 0)
    var t = op.work.first_row + row
    var request = Int(op.work.plan[unsafe_offset=2 * t])
    if request < 0:
        return TileRow(-1, 0)
    return TileRow(request, Int(op.work.plan[unsafe_offset=2 * t + 1]))


@fieldwise_init
struct Segment(Copyable, TrivialRegisterPassable):
    """The rows of a tile's group that belong to one request: one product
    over the request's keys serves them all."""

    var request: Int
    """Their request."""
    var bound: Int
    """The most candidates one of them sees."""
    var members: Int
    """Bit `r` set: row `r` of the group is one of them (0: no segment)."""

    def active(self, first: Int) -> Bool:
        """Whether a tile from candidate `first` has anything to score."""
        return self.members != 0 and first < self.bound


@always_inline
def segment_at[rows: Int, s: Int](op: IndexTopK, first_row: Int) -> Segment:
    """Segment `s` of the group of `rows` window rows from `first_row`:
    the rows of row `s`'s request when row `s` is the first of them in the
    group (rows of a request are consecutive), else none."""
    var head = tile_row(op, first_row + s)
    if head.request < 0:
        return Segment(-1, 0, 0)
    comptime if s > 0:
        if tile_row(op, first_row + s - 1).request == head.request:
            return Segment(-1, 0, 0)
    var members = 0
    var bound = 0
    comptime for r in range(s, rows):
        var row = tile_row(op, first_row + r)
        if row.request == head.request:
            members |= 1 << r
            bound = max(bound, row.bound)
    return Segment(head.request, bound, members)


@always_inline
def uniform(flag: Bool) -> Bool:
    """`flag`, which every thread of the block computes alike, made
    warp-uniform for ptxas: a per-thread branch before the chained
    `wgmma`s makes it serialize them (advisory C7518). Lane 0's value,
    broadcast, is uniform by construction (DeepGEMM broadcasts its
    predicates so)."""
    comptime if is_nvidia_gpu():
        return warp.broadcast(Int32(Int(flag))) != 0
    return flag


@always_inline
def multiply_chunk[
    chunk: Int, rows: Int
](s: Shared, thread: Int, op: IndexTopK, first_row: Int, members: Int):
    """A multiply phase: chunk `chunk`'s product for a segment's rows and
    their heads' partial sums.

    The product's columns are the group's `rows` query rows times the
    chunk's heads (`chunk_n` columns a row); every row's query is in the tile,
    only the `members` rows (bit `r`: row `r`) add their sums. Every
    thread of the warpgroup must call this (the instruction is
    warpgroup-wide); each adds its two candidate rows' ReLU'd, weighted
    heads to its own partial-sum words.
    """
    comptime heads = op.num_heads
    comptime kp = wgmma_depth[op.depth]()
    comptime cn = chunk_n[heads, chunk]()
    comptime n = rows * cn
    comptime width = n // 2
    comptime leading = CORE_BYTES
    comptime stride = CORE_BYTES * (kp // 16)
    comptime partials = partial_word[heads, op.depth, rows]()
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
    # 8 (i / 4) + 2q + i % 2 (PTX ISA's m64nNk32 accumulator fragment);
    # column c is query row c / cn (cn a power of two of 8 or more, so the
    # same for the 8 columns 8 (i / 4) ..), head c % cn of the chunk.
    var lane = thread % 32
    var quad = lane % 4
    var first_t = op.work.first_row + first_row
    var sums = SIMD[DType.float32, 2 * rows](0)
    comptime for i in range(width):
        comptime member = (8 * (i // 4)) // cn
        var h = chunk * WGMMA_HEADS + (8 * (i // 4)) % cn + 2 * quad + i % 2
        if h < heads and (members >> member) & 1 != 0:
            var v = acc[i]
            # ReLU that keeps a NaN a NaN, as the other scorers'.
            var relu = Float32(0) if v < 0 else v
            sums[2 * member + (i // 2) % 2] += (
                relu * op.qs[unsafe_offset=(first_t + member) * heads + h]
            )
    comptime for member in range(rows):
        if (members >> member) & 1 != 0:
            comptime for r in range(2):
                var m = 16 * (thread // 32) + lane // 4 + 8 * r
                var word = partials + 4 * (member * WGMMA_TILE + m) + quad
                comptime if chunk == 0:
                    s.store_f32(word, sums[2 * member + r])
                else:
                    s.store_f32(word, s.load_f32(word) + sums[2 * member + r])


@always_inline
def write_scores[
    rows: Int
](thread: Int, s: Shared, op: IndexTopK, first_row: Int, first: Int):
    """The last phase: a thread per (row, candidate) adds its four partial
    sums (one per thread of the quad that held the candidate) in a fixed
    order and multiplies by the key's scale, once after the head sum, as
    DeepGEMM does."""
    comptime partials = partial_word[op.num_heads, op.depth, rows]()
    for e in range(thread, rows * WGMMA_TILE, WGMMA_THREADS):
        var member = e // WGMMA_TILE
        var row = tile_row(op, first_row + member)
        var j = first + e % WGMMA_TILE
        if row.request < 0 or j >= row.bound:
            continue
        var word = partials + 4 * e
        var total = (s.load_f32(word) + s.load_f32(word + 1)) + (
            s.load_f32(word + 2) + s.load_f32(word + 3)
        )
        op.work.scores[
            unsafe_offset=(first_row + member) * op.work.candidates + j
        ] = (
            total
            * op.k_scales[unsafe_offset=candidate_at(op, row.request, j).scale]
        )


@always_inline
def index_wgmma_phase[
    phase: Int, rows: Int
](block: Int, thread: Int, s: Shared, op: IndexTopK):
    """One phase of the tensor-core scorer (module docs) for the window
    rows `rows * (block / wgmma_tiles(op))` on, candidates from
    `64 * (block % tiles)`.

    Inlined into the kernel: a wgmma chain that crosses a call is
    serialized (ptxas advisory C7510).
    """
    comptime heads = op.num_heads
    comptime depth = op.depth
    comptime kp = wgmma_depth[depth]()
    comptime units = kp // 16
    comptime chunks = wgmma_chunks[heads]()
    var tiles = wgmma_tiles(op)
    var first_row = (block // tiles) * rows
    var j0 = (block % tiles) * WGMMA_TILE
    comptime if phase == 2 * chunks * rows:
        write_scores[rows](thread, s, op, first_row, j0)
        return
    comptime seg = phase // (2 * chunks)
    comptime chunk = (phase // 2) % chunks
    var segment = segment_at[rows, seg](op, first_row)
    var active = uniform(segment.active(j0))
    comptime if phase % 2 == 1:
        if active:
            multiply_chunk[chunk, rows](
                s, thread, op, first_row, segment.members
            )
        return
    comptime cn = chunk_n[heads, chunk]()
    comptime if seg == 0:
        # Every row's query heads of the chunk, once for the group's
        # segments: row r's head h at column r * cn + h.
        var t0 = op.work.first_row + first_row
        for u in range(thread, rows * cn * units, WGMMA_THREADS):
            var c = u // units
            var r = c // cn
            var h = chunk * WGMMA_HEADS + c % cn
            var valid = h < heads and tile_row(op, first_row + r).request >= 0
            var src = op.q
            if valid:
                src = op.q.unsafe_offset(((t0 + r) * heads + h) * depth)
            stage_unit[kp, depth](
                s, query_word[depth](), c, u % units, src, valid
            )
    comptime if chunk == 0:
        if active:
            for u in range(thread, WGMMA_TILE * units, WGMMA_THREADS):
                var m = u // units
                var j = j0 + m
                var valid = j < segment.bound
                var src = op.k_blocks
                if valid:
                    src = op.k_blocks.unsafe_offset(
                        candidate_at(op, segment.request, j).key
                    )
                stage_unit[kp, depth](s, 0, m, u % units, src, valid)
    comptime if is_nvidia_gpu():
        # The tiles were written through the generic proxy; wgmma reads
        # them through the async proxy.
        fence_async_view_proxy()


comptime _ROW_NAME = "mla_kpool_index_wgmma_score_kernel"
comptime _GROUP_NAME = "mla_kpool_index_wgmma_rows_score_kernel"


struct WgmmaScore[Op: type_of(IndexTopK), grouped: Bool = False](GpuKernel):
    """The `"wgmma"` scorer's launch (sm_90): a warpgroup per (group of
    `tile_rows` window rows, tile of `WGMMA_TILE` candidates),
    `index_wgmma_phase`.

    Parameters:
        Op: The operand struct.
        grouped: A tile scores `group_rows` query rows against the keys it
            stages once (a prefill's rows, many per request), else one
            (decode: a row per request). With one group row (more heads
            than a product takes) both are the same kernel.
    """

    comptime Operands = Self.Op
    comptime tile_rows = (
        group_rows[Self.Op.num_heads, Self.Op.depth]() if Self.grouped else 1
    )
    """Window rows a block scores."""
    comptime name = _GROUP_NAME if Self.tile_rows > 1 else _ROW_NAME
    comptime block_threads = WGMMA_THREADS
    comptime shared_words = wgmma_words[
        Self.Op.num_heads, Self.Op.depth, Self.tile_rows
    ]()
    comptime phases = wgmma_phases[Self.Op.num_heads, Self.tile_rows]()
    comptime grid_rows = "window_rows"
    comptime rows_per_block = Self.tile_rows
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
        index_wgmma_phase[phase, Self.tile_rows](block, thread, s, op)


def wgmma_groups_rows(total_tokens: Int, requests: Int) -> Bool:
    """Whether a call's wgmma tiles score several rows each (`WgmmaScore`'s
    `grouped`): its requests have two query rows or more on average (a
    prefill); at decode a tile's rows would each need their own keys.
    `mla_kpool._limits.wgmma_groups_rows` is the Python twin."""
    return total_tokens >= 2 * max(requests, 1)
