"""The wgmma scorer's blocks: their shapes, shared memory and staging.

What `wgmma.mojo`'s phases stand on: how many rows and tiles a
block takes (`group_rows`, `TileShape`), where its key tiles, query tile
and partial sums lie in shared memory, the K-major core-matrix layout
`wgmma` reads (`tile_byte`, `descriptor`, from the PTX ISA's "Shared
Memory Matrix Layout"), and the copies of keys and query heads into it
(`stage_keys`, `stage_query`: 16-byte loads where aligned, zero padding).
"""

from max.gpu.memory import fence_async_view_proxy
from std.bit import next_power_of_two
from std.math import ceildiv, max, min
from std.memory import bitcast
from std.sys.info import is_nvidia_gpu

from ...grid.block_phases import Shared
from ...grid.gpu_kernel import STATIC_SHARED_BYTES
from ...grid.phases import Phase, Phases
from ...grid.shared_buffer import Buffer
from .score import candidate_at, is_aligned
from ..operands import IndexTopK
from ...grid.ragged import Ptr
from .emulated.wgmma import WGMMA_FP8_K


comptime WGMMA_TILE = 64
"""Candidates per block: the instruction's M."""

comptime WGMMA_THREADS = 128
"""Threads per block: one warpgroup."""

comptime WGMMA_HEADS = 64
"""Most heads per matrix product (the instruction's N)."""

comptime WGMMA_GROUP_N = 128
"""Most columns (query rows x heads) of a grouped tile's product: a
thread's accumulator is N / 2 = 64 float32 registers."""

comptime WGMMA_SPAN = 4
"""Tiles of `WGMMA_TILE` candidates a grouped block scores in turn, the
next tile's keys loading while the tensor cores multiply this one's."""

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


def tile_words(kp: Int, n: Int, rows: Int, buffers: Int) -> Int:
    """Shared words of a block: `buffers` tiles of `WGMMA_TILE` keys and
    one of `rows * n` query heads, `kp` bytes each, and `buffers` sets of
    4 partial sums per (row, key)."""
    return (buffers * WGMMA_TILE + rows * n) * kp // 4 + (
        4 * WGMMA_TILE * rows * buffers
    )


def groups_blocks[num_heads: Int, depth: Int]() -> Bool:
    """Whether the shape has grouped blocks (several rows and tiles): its
    heads take one product and one row's double-buffered tiles fit the
    block's static shared memory (not 33-64 heads at depth 225-256)."""
    comptime if wgmma_chunks[num_heads]() > 1:
        return False
    comptime n = chunk_n[num_heads, 0]()
    return 4 * tile_words(wgmma_depth[depth](), n, 1, 2) <= STATIC_SHARED_BYTES


def group_rows[num_heads: Int, depth: Int]() -> Int:
    """Query rows a grouped block scores.

    The most, a power of two, whose columns (`chunk_n` each) fit one
    product of `WGMMA_GROUP_N` columns and whose double-buffered tiles fit
    the block's static shared memory: 4 for 32 heads of 128, 2 for 64; 1
    where the shape has no grouped blocks (`groups_blocks`).
    """
    comptime if not groups_blocks[num_heads, depth]():
        return 1
    comptime n = chunk_n[num_heads, 0]()
    comptime kp = wgmma_depth[depth]()
    var rows = 1
    while (
        2 * rows * n <= WGMMA_GROUP_N
        and 4 * tile_words(kp, n, 2 * rows, 2) <= STATIC_SHARED_BYTES
    ):
        rows *= 2
    return rows


struct TileShape[heads: Int, depth: Int, rows: Int, span: Int]:
    """A block of the wgmma scorer: `rows` query rows, `span` tiles of
    `WGMMA_TILE` candidates, and its shared-memory layout (words).

    With one chunk of heads the block runs *pairs* (a segment of its rows,
    a tile) one after another, double-buffered; with several (more than
    64 heads: one row, one tile) a stage and a multiply per chunk.
    """

    comptime kp = wgmma_depth[Self.depth]()
    """Bytes of K per row, padded."""
    comptime chunks = wgmma_chunks[Self.heads]()
    """Products per tile."""
    comptime pairs = Self.rows * Self.span
    """(segment, tile) pairs of a block (one chunk of heads)."""
    comptime buffers = min(2, Self.pairs)
    """Key tiles and partial-sum sets in shared memory."""
    comptime key_words = WGMMA_TILE * Self.kp // 4
    """Words of one key tile."""
    comptime query_word = Self.buffers * Self.key_words
    """First word of the query tile (after the key tiles)."""
    comptime partial_words = 4 * WGMMA_TILE * Self.rows
    """Words of one set of partial sums."""
    comptime words = tile_words(
        Self.kp, chunk_n[Self.heads, 0](), Self.rows, Self.buffers
    )
    """Shared words of the block."""
    comptime partial_word = Self.words - Self.buffers * Self.partial_words
    """First word of the partial sums (the last of the block's words)."""
    comptime phase_table = _phases(Self.chunks, Self.pairs)
    """Phases (`_phases`)."""

    @staticmethod
    def key_tile(s: Shared, buf: Int) -> Buffer["key_tile"]:
        """Key buffer `buf`: a tile's keys, `tile_byte` places each byte."""
        return Buffer["key_tile"](s, buf * Self.key_words, Self.key_words)

    @staticmethod
    def query_tile(s: Shared) -> Buffer["query_tile"]:
        """The rows' query heads of the chunk being multiplied."""
        return Buffer["query_tile"](
            s, Self.query_word, Self.partial_word - Self.query_word
        )

    @staticmethod
    def partials(s: Shared, set: Int) -> Buffer["partials"]:
        """Partial-sum set `set`: 4 words per row and candidate, one per
        thread of the quad that held it."""
        return Buffer["partials"](
            s, Self.partial_word + set * Self.partial_words, Self.partial_words
        )


def _phases(chunks: Int, pairs: Int) -> Phases:
    """A block's phases: a stage and a multiply per chunk of heads, then
    the scores written; or, with one chunk, the query and the first pair
    staged, a phase per pair, then the last pair's scores written."""
    if chunks > 1:
        var chunk = Phases(Phase("stage"), Phase("multiply"))
        return chunk.repeat(chunks).then(Phases(Phase("write")))
    return Phases(Phase("stage"), Phase("pair", times=pairs), Phase("write"))


def wgmma_tile_flops[num_heads: Int, depth: Int]() -> Int:
    """Flops the tensor cores do per tile of one query row, padding
    included (2 per MAC)."""
    var n = 0
    comptime for c in range(wgmma_chunks[num_heads]()):
        n += chunk_n[num_heads, c]()
    return 2 * WGMMA_TILE * n * wgmma_depth[depth]()


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
def tile_unit[units: Int](u: Int) -> Tuple[Int, Int]:
    """The row and 16-byte unit a tile's `u`-th staged unit is.

    Units go down a core matrix's 8 rows first, then along K, then to the
    next 8 rows, so the 8 units of a quarter warp's 16-byte stores fill one
    core matrix's 128 contiguous bytes: every bank once, no conflict.
    (Along K first, the 8 stores landed 128 bytes apart, on 4 banks: 8
    ways.) Each row's 16-byte source loads stay whole sectors.

    Parameters:
        units: 16-byte units per row (`kp / 16`).

    Args:
        u: The unit, `0 ..< rows * units` (rows a multiple of 8).
    """
    var group = u // (8 * units)
    var unit = (u // 8) % units
    return (group * 8 + u % 8, unit)


@always_inline
def unit_words[
    depth: Int
](s: Shared, src: Ptr[DType.uint8], unit: Int, valid: Bool) -> SIMD[
    DType.uint32, 4
]:
    """Bytes `16 unit ..< 16 unit + 16` of a row, as the 4 words its tile
    holds (the caller stores them at `tile_byte(row, 16 unit) / 4`).

    Bytes past `depth`, and every byte of a row that is not `valid`, are
    zero. One 16-byte load where the source is aligned and whole, else
    byte loads (a key's address depends on the runtime page stride).
    """
    var bytes = SIMD[DType.uint8, 16](0)
    var first = 16 * unit
    if valid:
        if first + 16 <= depth and is_aligned[16](src.unsafe_offset(first)):
            bytes = s.global_load[width=16, alignment=16](src, first)
        else:
            comptime for i in range(16):  # unrolled: no local memory
                if first + i < depth:
                    bytes[i] = s.global_load(src, first + i)[0]
    return bitcast[DType.uint32, 4](bytes)


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


@always_inline
def stage_query[
    Shape: type_of(TileShape), chunk: Int
](s: Shared, thread: Int, op: IndexTopK, first_row: Int):
    """Chunk `chunk`'s query heads of every row of the block into the
    query tile: row `r`'s head `h` at column `r * cn + h` (zero past the
    heads and for rows of no request)."""
    comptime heads = Shape.heads
    comptime cn = chunk_n[heads, chunk]()
    comptime units = Shape.kp // 16
    var t0 = op.work.first_row + first_row
    for u in range(thread, Shape.rows * cn * units, WGMMA_THREADS):
        # Along K first: a quarter warp's stores are 8-way (`tile_unit`'s
        # order would take the grouped block from 128 to 152 registers,
        # 25% to 19% occupancy, for stores made once a block and chunk).
        var c = u // units
        var unit = u % units
        var r = c // cn
        var h = chunk * WGMMA_HEADS + c % cn
        var valid = h < heads and tile_row(op, first_row + r).request >= 0
        var src = op.q
        if valid:
            src = op.q.unsafe_offset(((t0 + r) * heads + h) * Shape.depth)
        Shape.query_tile(s).store_words[4](
            tile_byte[Shape.kp](c, 16 * unit) // 4,
            unit_words[Shape.depth](s, src, unit, valid),
        )


@always_inline
def stage_keys[
    Shape: type_of(TileShape)
](
    s: Shared,
    thread: Int,
    op: IndexTopK,
    request: Int,
    bound: Int,
    first: Int,
    buf: Int,
):
    """Request `request`'s keys of the tile from candidate `first` into
    key buffer `buf` (zero from candidate `bound` on)."""
    comptime units = Shape.kp // 16
    for u in range(thread, WGMMA_TILE * units, WGMMA_THREADS):
        var at = tile_unit[units](u)
        var m = at[0]
        var j = first + m
        var valid = j < bound
        var src = op.k_blocks
        if valid:
            src = op.k_blocks.unsafe_offset(candidate_at(op, request, j).key)
        Shape.key_tile(s, buf).store_words[4](
            tile_byte[Shape.kp](m, 16 * at[1]) // 4,
            unit_words[Shape.depth](s, src, at[1], valid),
        )


@always_inline
def async_fence():
    """Makes the tiles written through the generic proxy visible to
    `wgmma`, which reads them through the async proxy."""
    comptime if is_nvidia_gpu():
        fence_async_view_proxy()


@always_inline
def pair_first(block_first: Int, pair: Int, span: Int) -> Int:
    """The first candidate of pair `pair`'s tile (pairs run a segment's
    `span` tiles in turn)."""
    return block_first + (pair % span) * WGMMA_TILE
