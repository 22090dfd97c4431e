"""`index_top_k`'s tensor-core scorer for AMD MI300 (CDNA3, gfx942): FP8 MFMA.

One block of 256 threads (4 waves of 64 lanes) scores one query row
against a tile of `MFMA_TILE` = 64 candidates; wave `w` takes candidates
`16 w ..< 16 w + 16`, as the columns of `v_mfma_f32_16x16x32_fp8_fp8`
(CDNA3 ISA, "Matrix Arithmetic Instructions"), with the query's heads, 16
at a time, as its rows:

    D[i, j] = sum_k q[t, 16 c + i, k] * key[j0 + 16 w + j, k]   (A = query, B = keys)

over K in steps of 32 bytes (the depth rounded up, the padding zero), and
heads past `num_heads` zero rows. With the heads as rows, lane `l` holds
`D[4 (l / 16) + r][l % 16]` for `r < 4` (AMD matrix instruction
calculator): four heads of one candidate, so a lane sums its heads in
registers, and only the 4 lanes `l % 16 + 16 g` share a candidate.

The operands come straight from global memory, a contiguous run of K
per lane, with no shared-memory staging (`row_fragment`); the e4m3fn
bytes go to an e4m3fnuz instruction (`fn_to_fnuz_words`); `MfmaScore`
has the phases.

Numerics: products of e4m3 values are exact; the MFMA adds them with its
own adder (CDNA3 FP8 MFMA: fewer bits than a float32 FMA chain), the head
sum and the scale are float32 in a fixed order, so the scores are the same
on every launch. On the emulated grid the instruction is
`emulated.mfma.mfma_f32_16x16x32_fp8_model`, written from the ISA tables.

Shapes: any `num_heads`; `depth` up to `score.TENSOR_MAX_DEPTH`
(each lane keeps `depth / 4` bytes of key and of query in registers).
"""

from max.gpu.compute.mma import mma
from std.math import ceildiv, min
from std.memory import bitcast
from std.sys.info import is_amd_gpu

from ...grid.block_phases import Shared
from ...grid.shared_buffer import Buffer
from ...grid.gpu_kernel import GpuKernel
from ...grid.phases import Phase, Phases
from .score import candidate_at, candidate_tile, is_aligned
from ..operands import IndexTopK
from .emulated.mfma import (
    MFMA_ACC,
    MFMA_K,
    MFMA_LANES,
    MFMA_M,
    MFMA_N,
    mfma_f32_16x16x32_fp8_model,
)
from ...grid.ragged import Ptr


comptime MFMA_TILE = 64
"""Candidates per block: 16 (the instruction's N) per wave."""

comptime MFMA_WAVES = MFMA_TILE // MFMA_N
"""Waves per block."""

comptime MFMA_THREADS = MFMA_WAVES * MFMA_LANES
"""Threads per block: 4 waves of 64."""

comptime MFMA_HEADS = MFMA_M
"""Heads per instruction (its M): a chunk."""

comptime MFMA_GROUPS = MFMA_LANES // MFMA_N
"""Lane groups along K (`lane / 16`): 4."""


@always_inline
def mfma_depth[depth: Int]() -> Int:
    """`depth` rounded up to whole instructions (32 bytes of K each)."""
    return ceildiv(depth, MFMA_K) * MFMA_K


@always_inline
def mfma_steps[depth: Int]() -> Int:
    """Instructions per head chunk: `S = ceil(depth / 32)`."""
    return mfma_depth[depth]() // MFMA_K


@always_inline
def mfma_chunks[num_heads: Int]() -> Int:
    """Head chunks per tile: `ceil(num_heads / 16)`."""
    return ceildiv(num_heads, MFMA_HEADS)


comptime MFMA_PHASES = Phases(Phase("products"), Phase("sum"))
"""The scorer's phases (`MfmaScore`): the products, then the sum, for any
`num_heads`: the chunks run in one phase, since their operands come from
global memory, not from shared tiles."""


@always_inline
def mfma_words[num_heads: Int, depth: Int]() -> Int:
    """Shared `UInt32` words of the scorer, whatever the shape (2 KiB): 4
    partial sums per candidate, then a NaN flag per thread (`group_sums`,
    `query_nans`)."""
    return MFMA_GROUPS * MFMA_TILE + MFMA_THREADS


@always_inline
def group_sums(s: Shared) -> Buffer["group_sums"]:
    """The scorer's partial sums: 4 per candidate (one per group of heads
    a lane holds), the first of its shared words."""
    return Buffer["group_sums"](s, 0, MFMA_GROUPS * MFMA_TILE)


@always_inline
def query_nans(s: Shared) -> Buffer["query_nans"]:
    """A word per thread: whether its query bytes hold a NaN (after the
    sums)."""
    return Buffer["query_nans"](s, MFMA_GROUPS * MFMA_TILE, MFMA_THREADS)


@always_inline
def has_nan_byte[width: Int](words: SIMD[DType.uint64, width]) -> Bool:
    """Whether any byte is an e4m3fn NaN (`0x7F` or `0xFF`).

    Per byte, `(b & 0x7F) + 1` sets bit 7 only when the low 7 bits are all
    ones, and never carries into the next byte.
    """
    var x = bitcast[DType.uint32, 2 * width](words)
    var hit = ((x & 0x7F7F7F7F) + 0x01010101) & 0x80808080
    return hit.reduce_or() != 0


@always_inline
def mfma_instructions[num_heads: Int, depth: Int]() -> Int:
    """MFMAs per tile of `MFMA_TILE` candidates (all its waves)."""
    return MFMA_WAVES * mfma_chunks[num_heads]() * mfma_steps[depth]()


@always_inline
def mfma_tile_flops[num_heads: Int, depth: Int]() -> Int:
    """Flops the matrix cores do per tile, padding included (2 per MAC)."""
    return (
        2
        * MFMA_TILE
        * MFMA_HEADS
        * mfma_chunks[num_heads]()
        * mfma_depth[depth]()
    )


def mfma_tiles(op: IndexTopK) -> Int:
    """Blocks per window row: tiles of `MFMA_TILE` candidates."""
    return ceildiv(op.work.candidates, MFMA_TILE)


@always_inline
def fn_to_fnuz_words[
    width: Int
](x: SIMD[DType.uint32, width]) -> SIMD[DType.uint32, width]:
    """Clears every `0x80` byte of `x` to `0x00`, leaving the others.

    e4m3fn's `0x80` is -0 and e4m3fnuz's is its only NaN; every other
    byte keeps its meaning up to a factor of 2 (below). Per byte,
    `(b & 0x7F) + 0x7F` has bit 7 set unless the magnitude is 0 (and never
    carries into the next byte), so the mask keeps the sign bit of every
    byte with a nonzero magnitude.

    **e4m3fn bytes on an e4m3fnuz instruction** (`fn_to_fnuz_words`): for
    every byte but `0x80`, `0x7F`, `0xFF`, the e4m3fnuz value is the e4m3fn
    value halved (bias 8 instead of 7). The fragment loader clears `0x80`
    (e4m3fn's -0, e4m3fnuz's NaN) to `0x00`, and each dot product is
    multiplied by 4 (exact). `0x7F` / `0xFF` (NaN in e4m3fn) read as +-240
    in e4m3fnuz, so each lane also looks for them in its key and query bytes:
    a NaN key byte makes that candidate's score NaN, a NaN query byte the
    whole row's (through a flag per thread in shared memory), as in the FP32
    scorers.

    Parameters:
        width: Words.

    Args:
        x: The e4m3fn bytes, 4 per word.

    Returns:
        The same bytes with `0x80` replaced by `0x00`.
    """
    return x & (((x & 0x7F7F7F7F) + 0x7F7F7F7F) | 0x7F7F7F7F)


@always_inline
def fragment_width[steps: Int]() -> Int:
    """Lanes of a fragment vector: `steps` rounded up to a power of two
    (SIMD widths must be powers of two); the lanes past `steps` stay 0 and
    feed no instruction."""
    var width = 1
    while width < steps:
        width *= 2
    return width


@always_inline
def load_unit(s: Shared, at: Ptr[DType.uint8], count: Int) -> UInt64:
    """Bytes `0 ..< min(count, 8)` of `at` as a little-endian uint64, the
    rest zero: one 8-byte load when whole and aligned, else byte loads."""
    if count >= 8 and is_aligned[8](at):
        return bitcast[DType.uint64, 1](
            s.global_load[width=8, alignment=8](at, 0)
        )
    var bytes = SIMD[DType.uint8, 8](0)
    for i in range(min(count, 8)):
        bytes[i] = s.global_load(at, i)[0]
    return bitcast[DType.uint64, 1](bytes)


@always_inline
def row_fragment[
    steps: Int, depth: Int
](s: Shared, src: Ptr[DType.uint8], valid: Bool, group: Int) -> SIMD[
    DType.uint64, fragment_width[steps]()
]:
    """Lane group `group`'s bytes of one row: its operand registers.

    **Operands straight from global memory.** Lane `l` of wave `w` holds
    row `l % 16` of A (head `16 c + l % 16`) and column `l % 16` of B (the
    wave's candidate `l % 16`), 8 bytes of K per instruction. Since a dot
    product may take K in any order as long as both operands take the same
    one, lane group `g = l / 16` holds bytes `8 S g ..< 8 S (g + 1)` of its
    rows (`S` = instructions per chunk), 8 of them per instruction: one
    contiguous run per lane (two 16-byte loads at depth 128), no shared-memory
    staging and no barrier before the product. A key is read once per block;
    the query row once per wave, from the cache.


    Bytes `8 steps group ..< 8 steps (group + 1)` of the row, zero past
    `depth` and for a row that is not `valid` (a padding head, a candidate
    past the bound), with `0x80` cleared (`fn_to_fnuz_words`). Lane `s`
    (bytes `8 s ..< 8 s + 8` of the run) feeds instruction `s` of the
    chunk. One vector load where `steps` is a power of two and the run is
    whole and aligned, else 8-byte units (a key's address depends on the
    runtime page stride, and depths need not be powers of two). At depth
    128 the run is 32 bytes, two 16-byte loads on a GPU: each request's
    lanes are rows apart and use half of each sector (the profile's
    49%), the lane's other load the rest, from L1.

    Parameters:
        steps: Instructions per chunk (`mfma_steps`).
        depth: The row's bytes.

    Args:
        s: The thread's view (its loads recorded by a profiled emulation).
        src: The row's first byte (read only when `valid`).
        valid: Whether the row exists.
        group: The lane's group along K, `lane / 16`.

    Returns:
        `fragment_width[steps]()` uint64 (little-endian bytes).
    """
    comptime n = 8 * steps
    comptime width = fragment_width[steps]()
    comptime align = 16 if n % 16 == 0 else 8
    var words = SIMD[DType.uint64, width](0)
    var first = n * group
    if valid:
        var at = src.unsafe_offset(first)
        var whole = first + n <= depth and is_aligned[align](at)
        comptime if width == steps:
            if whole:
                words = bitcast[DType.uint64, width](
                    s.global_load[width=n, alignment=align](at, 0)
                )
        if width != steps or not whole:
            comptime for i in range(steps):
                words[i] = load_unit(
                    s, at.unsafe_offset(8 * i), depth - first - 8 * i
                )
    return bitcast[DType.uint64, width](
        fn_to_fnuz_words(bitcast[DType.uint32, 2 * width](words))
    )


@always_inline
def key_fragment(
    s: Shared,
    op: IndexTopK,
    b: Int,
    j0: Int,
    bound: Int,
    wave: Int,
    lane: Int,
) -> SIMD[DType.uint64, fragment_width[mfma_steps[op.depth]()]()]:
    """Lane `lane` of wave `wave`'s B operands (one uint64 per instruction):
    candidate `j0 + 16 wave + lane % 16`, lane group `lane / 16`."""
    comptime steps = mfma_steps[op.depth]()
    var j = j0 + MFMA_N * wave + lane % MFMA_N
    var valid = j < bound
    var src = op.k_blocks
    if valid:
        src = op.k_blocks.unsafe_offset(candidate_at(op, b, j).key)
    return row_fragment[steps, op.depth](s, src, valid, lane // MFMA_N)


@always_inline
def query_fragment(
    s: Shared, op: IndexTopK, t: Int, chunk: Int, lane: Int
) -> SIMD[DType.uint64, fragment_width[mfma_steps[op.depth]()]()]:
    """Lane `lane`'s A operands for head chunk `chunk` (one uint64 per
    instruction): head `16 chunk + lane % 16` of row `t`, lane group
    `lane / 16`; zero past `num_heads`."""
    comptime steps = mfma_steps[op.depth]()
    var h = MFMA_HEADS * chunk + lane % MFMA_M
    var valid = h < op.num_heads
    var src = op.q
    if valid:
        src = op.q.unsafe_offset((t * op.num_heads + h) * op.depth)
    return row_fragment[steps, op.depth](s, src, valid, lane // MFMA_M)


@always_inline
def add_heads[
    num_heads: Int
](
    s: Shared,
    acc: SIMD[DType.float32, MFMA_ACC],
    chunk: Int,
    lane: Int,
    weights: Ptr[DType.float32],
    partial: Float32,
) -> Float32:
    """`partial` plus the lane's 4 heads of chunk `chunk`, ReLU'd, weighted.

    Register `r` holds head `16 chunk + 4 (lane / 16) + r` (D's row); the
    dot is the register times 4 (e4m3fnuz halves both operands). Heads past
    `num_heads` (zero rows) are skipped.
    """
    var sum = partial
    comptime for r in range(MFMA_ACC):
        var h = MFMA_HEADS * chunk + MFMA_ACC * (lane // MFMA_N) + r
        if num_heads % MFMA_HEADS == 0 or h < num_heads:
            var v = acc[r] * 4
            # ReLU that keeps a NaN a NaN, as the other scorers'.
            var relu = Float32(0) if v < 0 else v
            sum += relu * s.global_load(weights, h)[0]
    return sum


@always_inline
def multiply_tile(
    s: Shared, thread: Int, op: IndexTopK, t: Int, b: Int, j0: Int, bound: Int
):
    """Phase 0: the wave's products and its lanes' partial head sums.

    Every lane of the wave must call this (MFMA is wave-wide); each stores
    one partial sum, for its candidate and lane group.
    """
    comptime heads = op.num_heads
    comptime steps = mfma_steps[op.depth]()
    comptime chunks = mfma_chunks[heads]()
    var wave = thread // MFMA_LANES
    var lane = thread % MFMA_LANES
    var weights = op.qs.unsafe_offset(t * heads)
    var partial = Float32(0)
    # e4m3fnuz has no NaN where e4m3fn has 0x7F / 0xFF: the lanes note
    # them, and the score becomes NaN as the FP32 scorers' would.
    var key = key_fragment(s, op, b, j0, bound, wave, lane)
    var key_nan = has_nan_byte(key)
    var query_nan = False
    comptime if is_amd_gpu():
        for c in range(chunks):
            var query = query_fragment(s, op, t, c, lane)
            query_nan = query_nan or has_nan_byte(query)
            var acc = SIMD[DType.float32, MFMA_ACC](0)
            comptime for step in range(steps):
                var d = SIMD[DType.float32, MFMA_ACC](0)
                mma(
                    d,
                    bitcast[DType.float8_e4m3fnuz, 8](query[step]),
                    bitcast[DType.float8_e4m3fnuz, 8](key[step]),
                    acc,
                )
                acc = d
            partial = add_heads[heads](s, acc, c, lane, weights, partial)
    else:
        # Emulated: lanes are threads run one after another, so gather
        # every lane's registers (the loaders the GPU lanes run, which read
        # only the op's inputs) and let the ISA model pick the elements;
        # a profile records only this lane's own loads.
        var others = s.unrecorded()
        for c in range(chunks):
            query_nan = query_nan or has_nan_byte(
                query_fragment(s, op, t, c, lane)
            )
            var acc = SIMD[DType.float32, MFMA_ACC](0)
            comptime for step in range(steps):
                var a = SIMD[DType.uint64, MFMA_LANES](0)
                var k = SIMD[DType.uint64, MFMA_LANES](0)
                for l in range(MFMA_LANES):
                    a[l] = query_fragment(others, op, t, c, l)[step]
                    k[l] = key_fragment(others, op, b, j0, bound, wave, l)[step]
                acc = mfma_f32_16x16x32_fp8_model(a, k, lane, acc)
            partial = add_heads[heads](s, acc, c, lane, weights, partial)
    if key_nan:
        partial = Float32(FloatLiteral.nan)
    var m = MFMA_N * wave + lane % MFMA_N
    group_sums(s).store_f32(MFMA_GROUPS * m + lane // MFMA_N, partial)
    query_nans(s).store(thread, UInt32(1) if query_nan else UInt32(0))


def index_mfma_phase(
    phase: Int, block: Int, thread: Int, s: Shared, op: IndexTopK
):
    """One phase of the MFMA scorer (`MfmaScore`).

    Block `block` scores window row `block / mfma_tiles(op)` against
    candidates `64 * (block % tiles) ..< + 64`, with `MFMA_THREADS`
    threads, `MFMA_PHASES` and `mfma_words` shared words; it writes
    `op.work.scores[row * candidates + j]` (float32) for the candidates below
    the row's bound (`op.work.plan`).

    Args:
        phase: The phase of `MFMA_PHASES`: `products`, or `sum` (and
            scale).
        block: Block of the launch.
        thread: Thread of the block, 0 to 255.
        s: The block's shared words.
        op: The call (q `[T, H, D]` and keys e4m3fn bytes, qs `[T, H]`
            and key scales float32).
    """
    var tile = candidate_tile(op, block, MFMA_TILE)
    if tile.idle():
        return
    var row, t, b = tile.row, tile.t, tile.request
    var bound, j0 = tile.bound, tile.first
    comptime products = MFMA_PHASES.index("products")
    if phase == products:
        multiply_tile(s, thread, op, t, b, j0, bound)
        return
    var j = j0 + thread
    if thread >= MFMA_TILE or j >= bound:
        return
    # One 16-byte load of the candidate's four group sums: consecutive
    # threads read consecutive 16 bytes (four scalar loads were 4-way).
    comptime assert MFMA_GROUPS == 4, "a candidate's sums are 16 bytes"
    var sums = group_sums(s).load_f32x[4](MFMA_GROUPS * thread)
    var total = (sums[0] + sums[1]) + (sums[2] + sums[3])
    # Every wave loads the whole query row: wave 0's lanes hold all of it.
    var row_nan = UInt32(0)
    for lane in range(MFMA_LANES):
        row_nan |= query_nans(s).load(lane)
    if row_nan != 0:
        total = Float32(FloatLiteral.nan)
    var scale = s.global_load(op.k_scales, candidate_at(op, b, j).scale)
    s.global_store(op.work.scores, row * op.work.candidates + j, total * scale)


struct MfmaScore[Op: type_of(IndexTopK)](GpuKernel):
    """The `"mfma"` scorer's launch (gfx942): `MFMA_WAVES` waves per (window
    row, tile of `MFMA_TILE` candidates), `index_mfma_phase`.

    Phases (`gpu_kernel.gpu_block_kernel`):

    - `products`: each wave issues `ceil(H / 16) * S` MFMAs; per head
      chunk, each lane scales its 4 registers by 4, applies the NaN-keeping
      ReLU and the head weights and adds them to its partial sum (chunks,
      then registers, ascending), then stores the partial in shared word
      `4 m + l / 16` of its candidate `m = 16 w + l % 16`.
    - `sum`: a thread per candidate adds its 4 partial sums in a fixed
      order and multiplies by the key's scale (once, after the head sum);
      NaN if wave 0's lanes saw a NaN query byte.
    """

    comptime Operands = Self.Op
    comptime name = "mla_kpool_index_mfma_score_kernel"
    comptime block_threads = MFMA_THREADS
    comptime shared_words = mfma_words[Self.Op.num_heads, Self.Op.depth]()
    comptime phase_table = MFMA_PHASES
    comptime grid_rows = "window_rows"
    comptime rows_per_block = 1
    comptime grid_columns = "candidates"
    comptime columns_per_block = MFMA_TILE
    comptime column_flops = (
        mfma_tile_flops[Self.Op.num_heads, Self.Op.depth]() // MFMA_TILE
    )
    comptime padded_tile = MFMA_TILE
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
    def run(phase: Int, block: Int, thread: Int, s: Shared, op: Self.Operands):
        """`index_mfma_phase`."""
        index_mfma_phase(phase, block, thread, s, op)
