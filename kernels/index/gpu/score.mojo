"""`index_top_k`'s GPU scorers: a window's rows scored against their candidates.

`index_score_phase` (the tiled scorer, a block per (row, tile of
`score_threads` candidates), two phases): the row's FP8 query decoded once
into shared memory, then a thread per candidate reads its key's bytes
(16 per load where aligned; decoded by the hardware's FP8 conversion on
NVIDIA GPUs) and keeps up to `PASS_HEADS` per-head dot products in
registers per pass over the key. `index_score_thread` (untiled, for shapes
whose query does not fit the block's shared memory) reads the query from
global memory. Both apply the NaN-keeping ReLU, the head weights and the
key's scale, and write a float32 workspace row.
"""

from std.math import ceildiv, min

from ...grid.block_phases import SHARED_CHECKED, Shared
from ...grid.shared_buffer import Buffer
from ...grid.gpu_kernel import GpuKernel
from ...grid.phases import Phase, Phases
from ..fp8 import decode_e4m3_gpu
from .shape import (
    key_chunk,
    padded_heads_pow2,
    pass_heads,
    score_passes,
    score_threads,
    score_tiles,
    tile_words,
    tiled_scorer,
)
from ..operands import IndexTopK
from ..plan import CacheSlot, page_bases
from ...grid.ragged import Ptr


@always_inline
def candidate_at(op: IndexTopK, b: Int, j: Int) -> CacheSlot:
    """Where request `b`'s candidate `j` lies, for `layer_idx`: its key's
    first byte (its `D` bytes follow, since a candidate's `kpool` rows of
    `W` bytes are adjacent in its page) and its scale."""
    comptime rows = op.rows_per_candidate
    var page = j * rows // op.page_size
    var slot = j * rows % op.page_size
    var at = page_bases(op, b, page)
    return CacheSlot(at.key + slot * op.width, at.scale + slot)


comptime TENSOR_MAX_DEPTH = 256
"""Largest `depth` the tensor scorers take: `wgmma`'s tiles of keys
and query heads then use 33 KiB of shared memory (under the 48 KiB a block
gets statically), and each lane of `mfma` keeps 64 bytes of key and
64 of query (32 VGPRs) in registers. `mla_kpool._index_op.TENSOR_MAX_DEPTH`
is its Python twin (tests/docs_and_layout/test_kernel_constants.py checks
they agree)."""


@always_inline
def tensor_fits[depth: Int]() -> Bool:
    """Whether the tensor scorers take this depth (`1 ..= TENSOR_MAX_DEPTH`)."""
    return 0 < depth <= TENSOR_MAX_DEPTH


@fieldwise_init
struct CandidateTile(Copyable, TrivialRegisterPassable):
    """One block of a tensor scorer: a window row and a tile of candidates."""

    var row: Int
    """Window row (the workspace row the scores go to)."""
    var t: Int
    """Query row."""
    var request: Int
    """The row's request (`-1`: the row is all `-1`, nothing to score)."""
    var bound: Int
    """Candidates the row sees."""
    var first: Int
    """The tile's first candidate."""

    def idle(self) -> Bool:
        """Whether the tile holds nothing to score (the same for every
        thread of the block, so a block returns as a whole)."""
        return self.request < 0 or self.first >= self.bound


@always_inline
def candidate_tile(op: IndexTopK, block: Int, tile: Int) -> CandidateTile:
    """Block `block` of a launch of `ceil(candidates / tile)` blocks per
    window row: its row, request and bound (`op.work.plan`), first candidate."""
    var tiles = ceildiv(op.work.candidates, tile)
    var row = block // tiles
    var t = op.work.first_row + row
    var request = Int(op.work.plan[unsafe_offset=2 * t])
    var bound = 0
    if request >= 0:
        bound = Int(op.work.plan[unsafe_offset=2 * t + 1])
    return CandidateTile(row, t, request, bound, (block % tiles) * tile)


@always_inline
def load_e4m3[
    width: Int
](s: Shared, src: Ptr[DType.uint8], at: Int, aligned: Bool) -> SIMD[
    DType.float32, width
]:
    """Bytes `at ..< at + width` of `src`, decoded (`decode_e4m3_gpu`).

    One `width`-byte load when `aligned` (the caller checked that
    `src + at` is a multiple of `width`), else `width` byte loads: a
    key's address depends on the page stride, a runtime value, so the
    alignment is checked per candidate instead of assumed.

    Parameters:
        width: Bytes (a power of two, at most 16).

    Args:
        s: The thread's view (records the loads in a profiled emulation).
        src: The bytes.
        at: First byte.
        aligned: `src + at` is a multiple of `width` bytes.

    Returns:
        The `width` values as float32.
    """
    var bytes = SIMD[DType.uint8, width]()
    comptime if width == 1:
        bytes = s.global_load(src, at)
    else:
        if aligned:
            bytes = s.global_load[width=width, alignment=width](src, at)
        else:
            comptime for i in range(width):
                bytes[i] = s.global_load(src, at + i)[0]
    return decode_e4m3_gpu[width](bytes)


@always_inline
def is_aligned[width: Int](src: Ptr[DType.uint8]) -> Bool:
    """Whether `src` is a multiple of `width` bytes (a power of two)."""
    return (Int(src) & (width - 1)) == 0


@always_inline
def dot_heads[
    chunk: Int
](s: Shared, op: IndexTopK, key: Ptr[DType.uint8], t: Int) -> Float32:
    """Row `t`'s weighted sum of ReLU'd head dots with `key`.

    Per head, the dims in ascending order; the query's and the key's
    bytes read `chunk` at a time (both must be multiples of `chunk`).
    """
    var total = Float32(0)
    for h in range(op.num_heads):
        var query = op.q.unsafe_offset((t * op.num_heads + h) * op.depth)
        var dot = Float32(0)
        for c in range(0, op.depth, chunk):
            var x = load_e4m3[chunk](s, query, c, True)
            var y = load_e4m3[chunk](s, key, c, True)
            comptime for i in range(chunk):
                dot += x[i] * y[i]
        # ReLU that keeps a NaN a NaN, as the CPU kernel's.
        var relu = Float32(0) if dot < 0 else dot
        total += relu * s.global_load(op.qs, t * op.num_heads + h)[0]
    return total


@always_inline
def score_candidate(
    s: Shared, op: IndexTopK, b: Int, t: Int, j: Int
) -> Float32:
    """Row `t`'s score of request `b`'s candidate `j` (float32 sums).

    Wide loads when the key and the row's query are aligned to
    `key_chunk` (each head's query then is too), else byte loads: two
    loops, since the compiler merges a branch per load into byte loads.
    """
    comptime chunk = key_chunk[op.depth]()
    var at = candidate_at(op, b, j)
    var key = op.k_blocks.unsafe_offset(at.key)
    var query = op.q.unsafe_offset(t * op.num_heads * op.depth)
    var total: Float32
    if is_aligned[chunk](key) and is_aligned[chunk](query):
        total = dot_heads[chunk](s, op, key, t)
    else:
        total = dot_heads[1](s, op, key, t)
    return total * s.global_load(op.k_scales, at.scale)[0]


def index_score_thread(block: Int, thread: Int, s: Shared, op: IndexTopK):
    """Scores one (row, candidate) of the window into the workspace."""
    comptime threads = score_threads[op.num_heads, op.depth]()
    var row = block // score_tiles(op)
    var j = (block % score_tiles(op)) * threads + thread
    var t = op.work.first_row + row
    var b = Int(s.global_load(op.work.plan, 2 * t))
    var bound = Int(s.global_load(op.work.plan, 2 * t + 1))
    if b < 0 or j >= bound:
        return
    s.global_store(
        op.work.scores,
        row * op.work.candidates + j,
        score_candidate(s, op, b, t, j),
    )


@always_inline
def halving_sum[n: Int](v: SIMD[DType.float32, n]) -> Float32:
    """The lanes' float32 sum as a halving tree: lane `i` plus lane
    `i + n / 2`, recursively (`n` a power of two).

    The same order on every target and in the emulation; the sum of lanes
    `p, p + P, p + 2P, ...` of `v` by the same tree is the `p`-th lane of
    the tree's level with `P` lanes, which is how the passes of the tiled
    scorer add up to the whole head vector's tree.
    """
    comptime if n == 1:
        return v[0]
    else:
        return halving_sum[n // 2](
            v.slice[n // 2]() + v.slice[n // 2, offset=n // 2]()
        )


@always_inline
def stage_query[
    hp: Int, depth: Int, passes: Int, group: Int
](s: Shared, thread: Int, threads: Int, query: Ptr[DType.uint8], heads: Int):
    """Decodes a row's `heads x depth` FP8 query into the block's shared
    words: head `h`, dim `d` at `(d * passes + h % passes) * group + h //
    passes` (a pass's heads of a dim side by side), zero past `heads`.

    A thread takes 16 dims of one head (one 16-byte load, where the row is
    16-byte aligned), and consecutive threads take consecutive heads: each
    of its 16 stores puts a warp's lanes on words `h % passes * group + h
    // passes` of one dim, every bank once for 32 heads or more. (Threads
    over consecutive dims of one head stored a dim's row, `hp` words,
    apart: all on one bank, 32 ways.) The query is read in 16-byte pieces
    `depth` bytes apart, whole sectors half used; it is a few KiB a block
    against the block's keys.
    """
    comptime chunks = depth // 16
    var tile = query_tile(s)
    comptime if depth % 16 != 0:
        # A depth of no 16-byte pieces: a byte a thread, dims in order.
        for x in range(thread, hp * depth, threads):
            var h = x // depth
            var d = x % depth
            var value = Float32(0)
            if h < heads:
                value = decode_e4m3_gpu[1](s.global_load(query, x))[0]
            tile.store_f32(
                (d * passes + h % passes) * group + h // passes, value
            )
        return
    var aligned = is_aligned[16](query)
    for u in range(thread, hp * chunks, threads):
        var h = u % hp
        var first = (u // hp) * 16
        var bytes = SIMD[DType.uint8, 16](0)
        if h < heads:
            var at = h * depth + first
            if aligned:
                bytes = s.global_load[width=16, alignment=16](query, at)
            else:
                comptime for i in range(16):
                    bytes[i] = s.global_load(query, at + i)[0]
        var values = decode_e4m3_gpu[16](bytes)  # zero bytes past `heads`
        comptime for i in range(16):
            tile.store_f32(
                ((first + i) * passes + h % passes) * group + h // passes,
                values[i],
            )


@always_inline
def query_tile(s: Shared) -> Buffer["query"]:
    """The tiled scorer's shared memory: its row's decoded query, every
    word of the block's (`stage_query` lays it out)."""
    return Buffer["query"](s, 0, s.size)


@no_inline
def _checked_f32x[
    width: Int
](tile: Buffer["query"], i: Int) -> SIMD[DType.float32, width]:
    """`tile.load_f32x` out of line: the emulation's checked read."""
    return tile.load_f32x[width](i)


@always_inline
def shared_f32x[
    width: Int
](tile: Buffer["query"], i: Int) -> SIMD[DType.float32, width]:
    """Query words `i ..< i + width` as float32 lanes (`load_f32x`).

    The emulation's checks are a call rather than inline code: the tiled
    scorer reads its query at `D` places per pass, and inlined checks
    made its body too large for the compiler to inline (the GPU build has
    no checks: `SHARED_CHECKED`).
    """
    comptime if SHARED_CHECKED:
        return _checked_f32x[width](tile, i)
    # The alignment makes it one vector load (without it LLVM splits it).
    return (
        tile.s.words.unsafe_offset(tile.start + i)
        .unsafe_bitcast[Float32]()
        .unsafe_load[width=width, alignment=min(4 * width, 16)](0)
    )


@always_inline
def score_pass[
    heads: Int, passes: Int, depth: Int, chunk: Int
](s: Shared, key: Ptr[DType.uint8], p: Int) -> SIMD[DType.float32, heads]:
    """Pass `p` over a key: the dot products of its `heads` heads.

    Lane `m` is head `passes * m + p`: the float32 sum over the dims in
    ascending order, one fma per dim, of the key's value times the
    query's (shared words `(d * passes + p) * heads + m`). The key is read
    `chunk` bytes per load (`key` must be a multiple of `chunk` bytes).
    """
    var acc = SIMD[DType.float32, heads](0)
    var tile = query_tile(s)
    for c in range(0, depth, chunk):
        var k = load_e4m3[chunk](s, key, c, True)
        comptime for i in range(chunk):
            acc = shared_f32x[heads](tile, ((c + i) * passes + p) * heads).fma(
                k[i], acc
            )
    return acc


@always_inline
def pass_sum[
    heads: Int, passes: Int, depth: Int, chunk: Int
](
    s: Shared,
    key: Ptr[DType.uint8],
    aligned: Bool,
    weights: Ptr[DType.float32],
    num_heads: Int,
    p: Int,
) -> Float32:
    """Pass `p`'s share of a score: its heads' ReLU'd, weighted dots.

    The halving tree over lanes `m` (head `passes * m + p`); `aligned`
    says whether `key` is a multiple of `chunk` bytes.
    """
    var acc: SIMD[DType.float32, heads]
    # Two loops, not a branch per load: the compiler merges the latter
    # into byte loads.
    if aligned:
        acc = score_pass[heads, passes, depth, chunk](s, key, p)
    else:
        acc = score_pass[heads, passes, depth, 1](s, key, p)
    var relu = acc.lt(0).select(SIMD[DType.float32, heads](0), acc)
    var w = SIMD[DType.float32, heads](0)
    comptime for m in range(heads):
        if passes * m + p < num_heads:
            w[m] = s.global_load(weights, passes * m + p)[0]
    return halving_sum[heads](relu * w)


comptime TILED_PHASES = Phases(Phase("stage"), Phase("score"))
"""The tiled scorer's phases: the query staged, the candidates scored."""


@always_inline
def index_score_phase(
    phase: Int, block: Int, thread: Int, s: Shared, op: IndexTopK
):
    """The tiled scorer: one row's query in shared memory, heads in registers.

    `stage`: the block's threads decode the row's `[H, D]` FP8 query into
    shared memory once, as float32 (heads padded to a power of two `HP`
    with zeros), dim-major, each dim's heads in `score_passes` groups of
    `pass_heads` (group `p` holds the heads `h % passes == p`). `score`:
    each thread scores one candidate of the block's tile: per group, it
    reads the key's `D` bytes (`key_chunk` at a time where the key is
    aligned to that, else a byte at a time) and, for each dim, adds the
    decoded key byte times the group's query values to float32
    accumulators held in registers; then the NaN-keeping ReLU and the
    head weights (read from global memory: the same few words for the
    whole block), the heads summed by one halving tree over `HP` lanes,
    then the key's scale.

    A thread per candidate: a warp's lanes read keys `D` bytes apart, 16
    at a time, so each request uses half of each sector (the profile's
    50%) and the key's next 16 bytes come from L1; each key byte leaves
    L2 once. The tensor scorers stage keys with whole-sector loads.
    """
    comptime hp = padded_heads_pow2[op.num_heads]()
    comptime heads = op.num_heads
    comptime depth = op.depth
    comptime group = pass_heads[heads]()
    comptime passes = score_passes[heads]()
    comptime threads = score_threads[heads, depth]()
    comptime chunk = key_chunk[depth]()
    var row = block // score_tiles(op)
    var t = op.work.first_row + row
    var b = Int(s.global_load(op.work.plan, 2 * t))
    if b < 0:
        return
    comptime stage = TILED_PHASES.index("stage")
    if phase == stage:
        stage_query[hp, depth, passes, group](
            s, thread, threads, op.q.unsafe_offset(t * heads * depth), heads
        )
        return
    var j = (block % score_tiles(op)) * threads + thread
    if j >= Int(s.global_load(op.work.plan, 2 * t + 1)):
        return
    var at = candidate_at(op, b, j)
    var key = op.k_blocks.unsafe_offset(at.key)
    var aligned = is_aligned[chunk](key)
    var weights = op.qs.unsafe_offset(t * heads)
    # One pass per iteration (unrolled passes let the compiler overlap
    # them, with their registers); the tree over `HP` lanes ends with its
    # levels over the `passes` pass sums.
    var sums = SIMD[DType.float32, passes](0)
    for p in range(passes):
        var sum = pass_sum[group, passes, depth, chunk](
            s, key, aligned, weights, heads, p
        )
        comptime for i in range(passes):
            if p == i:
                sums[i] = sum
    var total = halving_sum[passes](sums)
    s.global_store(
        op.work.scores,
        row * op.work.candidates + j,
        total * s.global_load(op.k_scales, at.scale),
    )


struct SimtScore[Op: type_of(IndexTopK)](GpuKernel):
    """The `"simt"` scorer's launch: tiled (`index_score_phase`) where the
    row's float32 query fits shared memory (`tiled_scorer`), else untiled
    (`index_score_thread`); a thread per candidate, a block per (window
    row, tile of `score_threads` candidates)."""

    comptime Operands = Self.Op
    comptime name = "mla_kpool_index_score_kernel"
    comptime tiled = tiled_scorer[Self.Op.num_heads, Self.Op.depth]()
    """Whether the tiled scorer serves this shape."""
    comptime block_threads = score_threads[Self.Op.num_heads, Self.Op.depth]()
    comptime shared_words = (
        tile_words[Self.Op.num_heads, Self.Op.depth]() if Self.tiled else 0
    )
    comptime phase_table = (
        materialize[TILED_PHASES]() if Self.tiled else Phases(Phase("score"))
    )
    comptime grid_rows = "window_rows"
    comptime rows_per_block = 1
    comptime grid_columns = "candidates"
    comptime columns_per_block = Self.block_threads
    comptime column_flops = (
        2 * padded_heads_pow2[Self.Op.num_heads]() * Self.Op.depth
    )
    comptime flops_peak = "fp32"

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
    def run(phase: Int, block: Int, thread: Int, s: Shared, op: Self.Operands):
        """`index_score_phase`, or `index_score_thread` untiled."""
        comptime if Self.tiled:
            index_score_phase(phase, block, thread, s, op)
        else:
            index_score_thread(block, thread, s, op)
