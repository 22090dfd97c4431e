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

At decode a tile takes one row (R = 1); at prefill (`wgmma_groups_rows`)
`group_rows` consecutive rows, one product per request among them
(`Segment`). `WgmmaScore` has the phases and the shared layout.

Numerics: the products of e4m3 values are exact, but the tensor core adds
them with fewer bits than a float32 FMA chain (docs/ops.md derives the
bound the tests use); the head sum and the scale are float32 in a fixed
order, so the scores are the same on every launch. On the emulated grid the instruction is
`emulated.wgmma.wgmma_e4m3_model`, written from the PTX ISA.

Shapes: any `num_heads`; `depth` up to `score.TENSOR_MAX_DEPTH`
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
from max.gpu.memory import AddressSpace
from max.gpu.primitives import warp
from std.math import ceildiv, max
from std.sys import inlined_assembly
from std.sys.info import is_nvidia_gpu

from ...grid.shared_buffer import Buffer
from ...grid.block_phases import Lane, Shared
from ...grid.gpu_kernel import GpuKernel, NoState
from .score import candidate_at
from ..operands import IndexTopK
from .wgmma_tiles import (
    CORE_BYTES,
    WGMMA_HEADS,
    WGMMA_SPAN,
    WGMMA_THREADS,
    WGMMA_TILE,
    TileShape,
    async_fence,
    chunk_n,
    descriptor,
    group_rows,
    groups_blocks,
    pair_first,
    stage_keys,
    stage_query,
    tile_row,
    wgmma_tile_flops,
)
from .emulated.wgmma import WGMMA_FP8_K, wgmma_e4m3_model


@fieldwise_init
struct Segment(Copyable, TrivialRegisterPassable):
    """The rows of a tile's group that belong to one request: one product
    over the request's keys serves them all.

    At decode a tile takes one row (R = 1: each row has its own request and
    keys). At prefill (`wgmma_groups_rows`) it takes `group_rows` consecutive
    rows (4 at 32 heads, 2 at 64: N up to `WGMMA_GROUP_N` = 128), so the
    tile's keys are read and staged once for R rows instead of once per row.
    The rows of a group may belong to several requests (a request's rows are
    consecutive): a *segment* is a request's rows in the group, and each
    segment stages its request's keys and runs its own product, of which only
    its rows keep the sums.
    """

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
def segment_at[rows: Int](op: IndexTopK, first_row: Int, s: Int) -> Segment:
    """Segment `s` of the group of `rows` window rows from `first_row`:
    the rows of row `s`'s request when row `s` is the first of them in the
    group (rows of a request are consecutive), else none."""
    var head = tile_row(op, first_row + s)
    if head.request < 0:
        return Segment(-1, 0, 0)
    if s > 0 and tile_row(op, first_row + s - 1).request == head.request:
        return Segment(-1, 0, 0)
    var members = 0
    var bound = 0
    comptime for r in range(rows):
        if r < s:
            continue
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
def issue_product[
    Shape: type_of(TileShape), chunk: Int
](s: Shared, thread: Int, buf: Int) -> SIMD[
    DType.float32, Shape.rows * chunk_n[Shape.heads, chunk]() // 2
]:
    """Issues chunk `chunk`'s product of key buffer `buf`'s tile with
    the query tile (every row of the block): the `kp / 32` chained
    `wgmma`s, committed as a group and not waited for (`await_product`).

    Every thread of the warpgroup must call this (the instruction is
    warpgroup-wide). Returns the accumulator registers: column `c` of the
    product is query row `c / cn`, head `c % cn` of the chunk (`cn` =
    `chunk_n`).
    """
    comptime kp = Shape.kp
    comptime n = Shape.rows * chunk_n[Shape.heads, chunk]()
    comptime width = n // 2
    comptime leading = CORE_BYTES
    comptime stride = CORE_BYTES * (kp // 16)
    var base = 0
    comptime if is_nvidia_gpu():
        base = Int(s.words.unsafe_address_space_cast[AddressSpace.SHARED]())
    var keys = base + 4 * Shape.key_tile(s, buf).start
    var query = base + 4 * Shape.query_tile(s).start
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
    return acc


@always_inline
def await_product[width: Int](mut acc: SIMD[DType.float32, width]):
    """Waits for the issued product (`issue_product`) to land in `acc`."""
    comptime if is_nvidia_gpu():
        wgmma_wait_group_sync[0]()
        # Each accumulator register passes through an empty asm after the
        # wait, so nothing reads it before the wait (else ptxas injects a
        # wait of its own, advisory C7517); MAX's `warpgroup_fence` is the
        # same code-motion fence.
        comptime for i in range(width):
            acc[i] = inlined_assembly[
                "", Float32, constraints="=f,0", has_side_effect=True
            ](acc[i])


@always_inline
def add_partials[
    Shape: type_of(TileShape), chunk: Int, width: Int
](
    acc: SIMD[DType.float32, width],
    s: Shared,
    thread: Int,
    op: IndexTopK,
    first_row: Int,
    members: Int,
    partials: Buffer["partials"],
):
    """A thread's share of a landed product: for each of its two
    candidates, the ReLU'd, weighted heads of each `members` row (bit
    `r`: row `r` of the block), added to its own partial-sum words in
    `partials` (4 per row and candidate: one per thread of a quad)."""
    comptime heads = Shape.heads
    comptime cn = chunk_n[heads, chunk]()
    # Register i holds row 16w + g + 8 ((i / 2) % 2), column
    # 8 (i / 4) + 2q + i % 2 (PTX ISA's m64nNk32 accumulator fragment);
    # column c is query row c / cn (cn a power of two of 8 or more, so the
    # same for the 8 columns 8 (i / 4) ..), head c % cn of the chunk.
    var lane = thread % 32
    var quad = lane % 4
    var first_t = op.work.first_row + first_row
    var sums = SIMD[DType.float32, 2 * Shape.rows](0)
    comptime for i in range(width):
        comptime member = (8 * (i // 4)) // cn
        var h = chunk * WGMMA_HEADS + (8 * (i // 4)) % cn + 2 * quad + i % 2
        if h < heads and (members >> member) & 1 != 0:
            var v = acc[i]
            # ReLU that keeps a NaN a NaN, as the other scorers'.
            var relu = Float32(0) if v < 0 else v
            sums[2 * member + (i // 2) % 2] += (
                relu * s.global_load(op.qs, (first_t + member) * heads + h)[0]
            )
    comptime for member in range(Shape.rows):
        if (members >> member) & 1 != 0:
            comptime for r in range(2):
                var m = 16 * (thread // 32) + lane // 4 + 8 * r
                var word = 4 * (member * WGMMA_TILE + m) + quad
                comptime if chunk == 0:
                    partials.store_f32(word, sums[2 * member + r])
                else:
                    partials.store_f32(
                        word, partials.load_f32(word) + sums[2 * member + r]
                    )


@always_inline
def write_scores[
    rows: Int
](
    thread: Int,
    s: Shared,
    op: IndexTopK,
    first_row: Int,
    first: Int,
    members: Int,
    partials: Buffer["partials"],
):
    """A tile's scores: a thread per (`members` row, candidate from
    `first`) adds its four partial sums (one per thread of the quad that
    held the candidate) in a fixed order and multiplies by the key's
    scale, once after the head sum, as DeepGEMM does. `partials` starts
    on 16 bytes (`tile_words` keeps every region 16-byte aligned)."""
    debug_assert(partials.start % 4 == 0, "partial sums are 16-byte aligned")
    for e in range(thread, rows * WGMMA_TILE, WGMMA_THREADS):
        var member = e // WGMMA_TILE
        var row = tile_row(op, first_row + member)
        var j = first + e % WGMMA_TILE
        if (members >> member) & 1 == 0 or j >= row.bound:
            continue
        # One 16-byte load of the four sums: consecutive threads read
        # consecutive 16 bytes (four scalar loads were 4-way conflicts).
        var sums = partials.load_f32x[4](4 * e)
        var total = (sums[0] + sums[1]) + (sums[2] + sums[3])
        s.global_store(
            op.work.scores,
            (first_row + member) * op.work.candidates + j,
            total
            * s.global_load(
                op.k_scales, candidate_at(op, row.request, j).scale
            )[0],
        )


@always_inline
def chunked_phase[
    Shape: type_of(TileShape), phase: Int
](thread: Int, s: Shared, op: IndexTopK, row: Int, first: Int):
    """A phase of a block of one row and one tile whose heads take several
    products (`wgmma_phases`): chunk `c`'s `stage` stages its query heads
    (and, for `c = 0`, the keys), its `multiply` multiplies it, and
    `write` writes the scores."""
    comptime table = Shape.phase_table
    var segment = segment_at[1](op, row, 0)
    var active = uniform(segment.active(first))
    if not active:
        return
    comptime if table.named(phase, "write"):
        write_scores[1](thread, s, op, row, first, 1, Shape.partials(s, 0))
        return
    comptime chunk = table.round(phase)
    comptime if table.named(phase, "multiply"):
        var acc = issue_product[Shape, chunk](s, thread, 0)
        await_product(acc)
        add_partials[Shape, chunk](
            acc, s, thread, op, row, 1, Shape.partials(s, 0)
        )
        return
    comptime if chunk == 0:
        stage_keys[Shape](
            s, thread, op, segment.request, segment.bound, first, 0
        )
    stage_query[Shape, chunk](s, thread, op, row)
    async_fence()


@always_inline
def pipelined_phase[
    Shape: type_of(TileShape), phase: Int
](thread: Int, s: Shared, op: IndexTopK, first_row: Int, block_first: Int):
    """A phase of a block with one chunk of heads (`wgmma_phases`): its
    pairs (segment `p / span`, tile `p % span`) in turn, double-buffered.

    `stage` stages every row's query and pair 0's keys. Pair `p`'s phase
    issues its product on key buffer `p % 2`, stages pair `p + 1`'s keys
    into the other buffer and writes pair `p - 1`'s scores while the
    tensor cores work, then waits and adds pair `p`'s partial sums to set
    `p % 2`. `write` writes the last pair's scores. A pair with nothing to
    score is skipped by the block.
    """
    comptime table = Shape.phase_table
    comptime if table.named(phase, "stage"):
        stage_query[Shape, 0](s, thread, op, first_row)
        _ = stage_pair[Shape](0, thread, s, op, first_row, block_first)
        async_fence()
        return
    # `write` is the pair after the last: it only writes that one's scores.
    comptime p = phase - table.index("pair")
    comptime if is_nvidia_gpu():
        pair_phase[Shape](p, thread, s, op, first_row, block_first)
    else:
        pair_phase_host[Shape](p, thread, s, op, first_row, block_first)


@no_inline
def pair_phase_host[
    Shape: type_of(TileShape)
](
    p: Int,
    thread: Int,
    s: Shared,
    op: IndexTopK,
    first_row: Int,
    block_first: Int,
):
    """`pair_phase` out of line, for the emulated grid: one body for every
    pair instead of one a phase (the host compile of a grouped block's 16
    pairs took minutes). On a GPU it stays inlined: a wgmma chain that
    crosses a call is serialized (ptxas advisory C7510)."""
    pair_phase[Shape](p, thread, s, op, first_row, block_first)


@always_inline
def pair_phase[
    Shape: type_of(TileShape)
](
    p: Int,
    thread: Int,
    s: Shared,
    op: IndexTopK,
    first_row: Int,
    block_first: Int,
):
    """Pair `p`'s phase of `pipelined_phase`: its product, and what the
    threads do while it runs (`while_multiplying`). `p` is a run-time
    value (a constant once inlined on a GPU)."""
    comptime rows = Shape.rows
    comptime span = Shape.span
    if p < Shape.pairs:
        var multiply = segment_at[rows](op, first_row, p // span)
        if uniform(multiply.active(pair_first(block_first, p, span))):
            # The accumulators live only in this branch: defined by the
            # wgmmas alone (ptxas serializes a chain whose accumulators
            # other instructions define, advisory C7515).
            var acc = issue_product[Shape, 0](s, thread, p % 2)
            while_multiplying[Shape](p, thread, s, op, first_row, block_first)
            await_product(acc)
            add_partials[Shape, 0](
                acc,
                s,
                thread,
                op,
                first_row,
                multiply.members,
                Shape.partials(s, p % 2),
            )
            return
    while_multiplying[Shape](p, thread, s, op, first_row, block_first)


@always_inline
def stage_pair[
    Shape: type_of(TileShape)
](
    p: Int,
    thread: Int,
    s: Shared,
    op: IndexTopK,
    first_row: Int,
    block_first: Int,
) -> Bool:
    """Stages pair `p`'s keys (its segment's request, its tile) into key
    buffer `p % 2`, unless the pair has nothing to score. Returns whether
    it did (the block alike): the caller fences the stores for `wgmma`."""
    var segment = segment_at[Shape.rows](op, first_row, p // Shape.span)
    var first = pair_first(block_first, p, Shape.span)
    if not uniform(segment.active(first)):
        return False
    stage_keys[Shape](
        s, thread, op, segment.request, segment.bound, first, p % 2
    )
    return True


@always_inline
def while_multiplying[
    Shape: type_of(TileShape)
](
    p: Int,
    thread: Int,
    s: Shared,
    op: IndexTopK,
    first_row: Int,
    block_first: Int,
):
    """What pair `p`'s phase does while the tensor cores multiply: stage
    pair `p + 1`'s keys into the other buffer, write pair `p - 1`'s
    scores."""
    comptime rows = Shape.rows
    comptime span = Shape.span
    if p + 1 < Shape.pairs:
        if stage_pair[Shape](p + 1, thread, s, op, first_row, block_first):
            async_fence()
    if p >= 1:
        var done = segment_at[rows](op, first_row, (p - 1) // span)
        write_scores[rows](
            thread,
            s,
            op,
            first_row,
            pair_first(block_first, p - 1, span),
            done.members,
            Shape.partials(s, (p - 1) % 2),
        )


@always_inline
def index_wgmma_phase[
    Shape: type_of(TileShape), phase: Int
](block: Int, thread: Int, s: Shared, op: IndexTopK):
    """One phase of the tensor-core scorer (`WgmmaScore`) for the window
    rows from `Shape.rows * (block / spans)`, candidates from
    `64 * Shape.span * (block % spans)` (`spans`: blocks per row group).

    Inlined into the kernel: a wgmma chain that crosses a call is
    serialized (ptxas advisory C7510).
    """
    var spans = ceildiv(op.work.candidates, WGMMA_TILE * Shape.span)
    var first_row = (block // spans) * Shape.rows
    var first = (block % spans) * WGMMA_TILE * Shape.span
    comptime if Shape.chunks > 1:
        chunked_phase[Shape, phase](thread, s, op, first_row, first)
    else:
        pipelined_phase[Shape, phase](thread, s, op, first_row, first)


comptime _ROW_NAME = "mla_kpool_index_wgmma_score_kernel"
comptime _GROUP_NAME = "mla_kpool_index_wgmma_rows_score_kernel"


struct WgmmaScore[Op: type_of(IndexTopK), grouped: Bool = False](GpuKernel):
    """The `"wgmma"` scorer's launch (sm_90): a warpgroup per (group of
    `Shape.rows` window rows, span of `Shape.span` tiles of `WGMMA_TILE`
    candidates), `index_wgmma_phase`.

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

    Parameters:
        Op: The operand struct.
        grouped: A block scores `group_rows` query rows over `WGMMA_SPAN`
            tiles, staging the query once and each tile's keys once for
            its rows (a prefill's rows, many per request), else one row
            and one tile (decode: a row per request). Where the shape has
            no grouped blocks (`groups_blocks`), both are the same kernel.
    """

    comptime Operands = Self.Op
    comptime many = Self.grouped and groups_blocks[
        Self.Op.num_heads, Self.Op.depth
    ]()
    """Whether a block takes several rows and tiles."""
    comptime Shape = TileShape[
        Self.Op.num_heads,
        Self.Op.depth,
        group_rows[Self.Op.num_heads, Self.Op.depth]() if Self.many else 1,
        WGMMA_SPAN if Self.many else 1,
    ]
    """The block's rows, tiles and shared memory."""
    comptime name = _GROUP_NAME if Self.many else _ROW_NAME
    comptime State = NoState
    comptime block_threads = WGMMA_THREADS
    comptime shared_words = Self.Shape.words
    comptime phase_table = materialize[Self.Shape.phase_table]()
    comptime grid_rows = "window_rows"
    comptime rows_per_block = Self.Shape.rows
    comptime grid_columns = "candidates"
    comptime columns_per_block = WGMMA_TILE * Self.Shape.span
    comptime column_flops = (
        wgmma_tile_flops[Self.Op.num_heads, Self.Op.depth]() // WGMMA_TILE
    )
    comptime padded_tile = WGMMA_TILE
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
        index_wgmma_phase[Self.Shape, phase](block, thread, s, op)


def wgmma_groups_rows(total_tokens: Int, requests: Int) -> Bool:
    """Whether a call's wgmma blocks take several rows and tiles each
    (`WgmmaScore`'s `grouped`): its requests have two query rows or more
    on average (a prefill); at decode a block's rows would each need their
    own keys. `mla_kpool._limits.wgmma_groups_rows` is the Python twin."""
    return total_tokens >= 2 * max(requests, 1)
