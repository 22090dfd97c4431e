"""`mla_kpool.index_top_k` on a GPU (or its emulated grid): plan, score, select.

Three launches, with the same answer as the CPU path (`index_top_k_cpu`):

1. **Plan** (`index_plan_thread`, a thread per query row): the row's
   request and bound, or `-1` when the contract makes the row all `-1`
   (offsets malformed before it, a negative cache length, a page past a
   lookup table or an arena). The offsets are read on the device: nothing
   of the call's metadata goes to the host.
2. **Score** (`index_score_phase`, a block per (row, tile of
   `score_threads` candidates), two phases): the row's FP8 query decoded
   once into shared memory, then a thread per candidate reads its key's
   bytes (16 per load where aligned; decoded by the hardware's FP8
   conversion on NVIDIA GPUs) and keeps up to `PASS_HEADS` per-head dot
   products in registers per pass over the key, with the NaN-keeping
   ReLU, the head weights and the key's scale applied there, into a
   float32 workspace row (`index_score_thread`, untiled, for shapes whose
   query does not fit the block's shared memory).
3. **Select** (`index_select.select_row_phase`, a block per row): the top
   `k` ids of the workspace row in the contract's order.

Rows go through in windows: the workspace holds `window` rows of
`candidates` scores, `candidates` being the most any row can see (the
lookup tables' pages), and `window` is what `GPU_WORKSPACE_BYTES` allows, so
a 128K-token context never needs a `T x P` matrix at once. Grids are on the
x axis only: a window's score launch has `rows * tiles` blocks, far below
2^31 - 1 (`check_launch` refuses anything past it), so long contexts cannot
overflow a grid dimension.

A decode reads each visible key once per query row (once per request); a
prefill reads a request's keys once per row, from the L2 cache after the
first. Never run on a real GPU.
"""

from max.gpu.host import DeviceContext
from std.bit import next_power_of_two
from std.math import ceildiv, max, min

from .block_phases import Shared, launch_phased
from .index_select import (
    SELECT_THREADS,
    SELECT_WORDS,
    select_phases,
    select_row_phase,
)
from .index_top_k import (
    IndexTopK,
    candidate_bound,
    decode_e4m3_gpu,
    page_bases,
    request_span,
)
from .parallel import launch
from .ragged import Ptr, read_index

comptime GPU_WORKSPACE_BYTES = 1 << 28
"""Scores workspace per call (256 MiB): rows per window follow from it."""

comptime PLAN_THREADS = 256
"""Threads per block of the plan launch (a row each)."""

comptime SCORE_THREADS = 128
"""Threads per block of the untiled score launch (a candidate each); the
tiled scorer's blocks are `score_threads` wide."""


def row_plan(op: IndexTopK, t: Int) -> Tuple[Int, Int]:
    """Row `t`'s `(request, bound)`, or `(-1, 0)` for an all `-1` row.

    The CPU path's rule: requests are scored while the offsets are well
    formed (the first is 0, then non-decreasing and at most `T`), and a
    request is skipped when `request_span` says so.
    """
    if read_index(op.input_row_offsets, 0) != 0:
        return (-1, 0)
    for b in range(op.scored_requests):
        var start = read_index(op.input_row_offsets, b)
        var end = read_index(op.input_row_offsets, b + 1)
        if end < start or end > op.total_tokens:
            return (-1, 0)
        if t < end:
            var span = request_span(op, b)
            if not span[3]:
                return (-1, 0)
            return (
                b,
                candidate_bound[op.kpool, op.causal](
                    span[2], span[1], t - start
                ),
            )
    return (-1, 0)


def index_plan_thread(block: Int, thread: Int, op: IndexTopK):
    """Writes row `block * PLAN_THREADS + thread`'s plan: request, bound."""
    var t = block * PLAN_THREADS + thread
    if t >= op.total_tokens:
        return
    var plan = row_plan(op, t)
    op.plan[unsafe_offset=2 * t] = Int64(plan[0])
    op.plan[unsafe_offset=2 * t + 1] = Int64(plan[1])


@always_inline
def candidate_at(op: IndexTopK, b: Int, j: Int) -> Tuple[Int, Int]:
    """Where request `b`'s candidate `j` lies, for `layer_idx`.

    Returns:
        `(key element, scale element)`: the key's first byte (its `D` bytes
        follow, since a candidate's `kpool` rows of `W` bytes are adjacent
        in its page) and its scale.
    """
    comptime rows = op.rows_per_candidate
    var page = j * rows // op.page_size
    var slot = j * rows % op.page_size
    var at = page_bases(op, b, page)
    return (at[0] + slot * op.width, at[1] + slot)


def score_tiles(op: IndexTopK) -> Int:
    """Score blocks per row: tiles of `score_threads` candidates."""
    return ceildiv(op.candidates, score_threads[op.num_heads, op.depth]())


@always_inline
def key_chunk[depth: Int]() -> Int:
    """Key bytes one load reads: 16, 8 or 4 when `depth` is a multiple, else 1."""
    comptime if depth % 16 == 0:
        return 16
    elif depth % 8 == 0:
        return 8
    elif depth % 4 == 0:
        return 4
    return 1


@always_inline
def load_e4m3[
    width: Int
](src: Ptr[DType.uint8], at: Int, aligned: Bool) -> SIMD[DType.float32, width]:
    """Bytes `at ..< at + width` of `src`, decoded (`decode_e4m3_gpu`).

    One `width`-byte load when `aligned` (the caller checked that
    `src + at` is a multiple of `width`), else `width` byte loads: a
    key's address depends on the page stride, a runtime value, so the
    alignment is checked per candidate instead of assumed.

    Parameters:
        width: Bytes (a power of two, at most 16).

    Args:
        src: The bytes.
        at: First byte.
        aligned: `src + at` is a multiple of `width` bytes.

    Returns:
        The `width` values as float32.
    """
    var bytes = SIMD[DType.uint8, width]()
    comptime if width == 1:
        bytes[0] = src[unsafe_offset=at]
    else:
        if aligned:
            bytes = src.unsafe_offset(at).unsafe_load[
                width=width, alignment=width
            ](0)
        else:
            comptime for i in range(width):
                bytes[i] = src[unsafe_offset=at + i]
    return decode_e4m3_gpu[width](bytes)


@always_inline
def is_aligned[width: Int](src: Ptr[DType.uint8]) -> Bool:
    """Whether `src` is a multiple of `width` bytes (a power of two)."""
    return (Int(src) & (width - 1)) == 0


@always_inline
def dot_heads[
    chunk: Int
](op: IndexTopK, key: Ptr[DType.uint8], t: Int) -> Float32:
    """Row `t`'s weighted sum of ReLU'd head dots with `key`.

    Per head, the dims in ascending order; the query's and the key's
    bytes read `chunk` at a time (both must be multiples of `chunk`).
    """
    var total = Float32(0)
    for h in range(op.num_heads):
        var query = op.q.unsafe_offset((t * op.num_heads + h) * op.depth)
        var dot = Float32(0)
        for c in range(0, op.depth, chunk):
            var x = load_e4m3[chunk](query, c, True)
            var y = load_e4m3[chunk](key, c, True)
            comptime for i in range(chunk):
                dot += x[i] * y[i]
        # ReLU that keeps a NaN a NaN, as the CPU kernel's.
        var relu = Float32(0) if dot < 0 else dot
        total += relu * op.qs[unsafe_offset=t * op.num_heads + h]
    return total


@always_inline
def score_candidate(op: IndexTopK, b: Int, t: Int, j: Int) -> Float32:
    """Row `t`'s score of request `b`'s candidate `j` (float32 sums).

    Wide loads when the key and the row's query are aligned to
    `key_chunk` (each head's query then is too), else byte loads: two
    loops, since the compiler merges a branch per load into byte loads.
    """
    comptime chunk = key_chunk[op.depth]()
    var at = candidate_at(op, b, j)
    var key = op.k_blocks.unsafe_offset(at[0])
    var query = op.q.unsafe_offset(t * op.num_heads * op.depth)
    var total: Float32
    if is_aligned[chunk](key) and is_aligned[chunk](query):
        total = dot_heads[chunk](op, key, t)
    else:
        total = dot_heads[1](op, key, t)
    return total * op.k_scales[unsafe_offset=at[1]]


def index_score_thread(block: Int, thread: Int, op: IndexTopK):
    """Scores one (row, candidate) of the window into the workspace."""
    comptime threads = score_threads[op.num_heads, op.depth]()
    var row = block // score_tiles(op)
    var j = (block % score_tiles(op)) * threads + thread
    var t = op.first_row + row
    var b = Int(op.plan[unsafe_offset=2 * t])
    var bound = Int(op.plan[unsafe_offset=2 * t + 1])
    if b < 0 or j >= bound:
        return
    op.scores[unsafe_offset=row * op.candidates + j] = score_candidate(
        op, b, t, j
    )


@always_inline
def padded_heads_pow2[num_heads: Int]() -> Int:
    """Heads rounded up to a power of two: the SIMD width of a head vector."""
    return next_power_of_two(num_heads)


comptime PASS_HEADS = 16
"""Most heads one pass of the tiled scorer keeps in float32 registers."""


@always_inline
def pass_heads[num_heads: Int]() -> Int:
    """Heads the tiled scorer accumulates per pass over a key."""
    return min(padded_heads_pow2[num_heads](), PASS_HEADS)


@always_inline
def score_passes[num_heads: Int]() -> Int:
    """Passes of the tiled scorer over a key: pass `p` takes the heads
    `h % passes == p`."""
    return padded_heads_pow2[num_heads]() // pass_heads[num_heads]()


@always_inline
def tile_words[num_heads: Int, depth: Int]() -> Int:
    """Shared words of the tiled scorer: the row's float32 query."""
    return padded_heads_pow2[num_heads]() * depth


comptime SCORE_SHARED_LIMIT = 12 * 1024
"""Shared words (48 KiB) a block may use: larger `H * D` score untiled."""


@always_inline
def tiled_scorer[num_heads: Int, depth: Int]() -> Bool:
    """Whether the tiled scorer serves this shape (`index_score_phase`)."""
    return (
        padded_heads_pow2[num_heads]() <= 64
        and tile_words[num_heads, depth]() <= SCORE_SHARED_LIMIT
    )


comptime SCORE_WAVE_WORDS = 1024
"""Shared words (4 KiB) per 64 threads of a tiled-score block.

MI300X has 64 KiB of LDS per CU and 32 wave slots (4 SIMDs x 8 waves of
64 lanes, AMD's CDNA3 ISA guide and HIP occupancy docs): blocks using 4 KiB
per wave fill half the slots (50% occupancy) before the LDS runs out, so a
block's threads grow with its query instead of staying at 128."""


@always_inline
def score_threads[num_heads: Int, depth: Int]() -> Int:
    """Threads per block of the score launch (a candidate each).

    `SCORE_THREADS` for the untiled scorer; for the tiled one a wave of 64
    per `SCORE_WAVE_WORDS` of query, a power of two from 128 to 1024 (256
    for 32 heads x 128 dims, 512 for 64 x 128).
    """
    comptime if not tiled_scorer[num_heads, depth]():
        return SCORE_THREADS
    comptime waves = ceildiv(tile_words[num_heads, depth](), SCORE_WAVE_WORDS)
    return min(max(next_power_of_two(waves * 64), SCORE_THREADS), 1024)


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


@no_inline
def _checked_f32x[width: Int](s: Shared, i: Int) -> SIMD[DType.float32, width]:
    """`s.load_f32x` out of line: the emulation's checked read."""
    return s.load_f32x[width](i)


@always_inline
def shared_f32x[width: Int](s: Shared, i: Int) -> SIMD[DType.float32, width]:
    """Shared words `i ..< i + width` as float32 lanes (`s.load_f32x`).

    The emulation's checks are a call rather than inline code: the tiled
    scorer reads its query at `D` places per pass, and inlined checks
    made the body too large for the compiler to inline into the kernel,
    which then kept them (and its arguments in memory) on the GPU too.
    """
    if s.checked:
        return _checked_f32x[width](s, i)
    return (
        s.words.unsafe_offset(i)
        .unsafe_bitcast[Float32]()
        .unsafe_load[width=width](0)
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
    for c in range(0, depth, chunk):
        var k = load_e4m3[chunk](key, c, True)
        comptime for i in range(chunk):
            acc = shared_f32x[heads](s, ((c + i) * passes + p) * heads).fma(
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
            w[m] = weights[unsafe_offset=passes * m + p]
    return halving_sum[heads](relu * w)


def index_score_phase(
    phase: Int, block: Int, thread: Int, s: Shared, op: IndexTopK
):
    """The tiled scorer: one row's query in shared memory, heads in registers.

    Phase 0: the block's threads decode the row's `[H, D]` FP8 query into
    shared memory once, as float32 (heads padded to a power of two `HP`
    with zeros), dim-major, each dim's heads in `score_passes` groups of
    `pass_heads` (group `p` holds the heads `h % passes == p`). Phase 1:
    each thread scores one candidate of the block's tile: per group, it
    reads the key's `D` bytes (`key_chunk` at a time where the key is
    aligned to that, else a byte at a time) and, for each dim, adds the
    decoded key byte times the group's query values to float32
    accumulators held in registers; then the NaN-keeping ReLU and the
    head weights (read from global memory: the same few words for the
    whole block), the heads summed by one halving tree over `HP` lanes,
    then the key's scale.
    """
    comptime hp = padded_heads_pow2[op.num_heads]()
    comptime heads = op.num_heads
    comptime depth = op.depth
    comptime group = pass_heads[heads]()
    comptime passes = score_passes[heads]()
    comptime threads = score_threads[heads, depth]()
    comptime chunk = key_chunk[depth]()
    var row = block // score_tiles(op)
    var t = op.first_row + row
    var b = Int(op.plan[unsafe_offset=2 * t])
    if b < 0:
        return
    if phase == 0:
        # Source order: consecutive threads read consecutive query bytes.
        var query = op.q.unsafe_offset(t * heads * depth)
        for x in range(thread, hp * depth, threads):
            var h = x // depth
            var d = x % depth
            var value = Float32(0)
            if h < heads:
                value = decode_e4m3_gpu[1](
                    SIMD[DType.uint8, 1](query[unsafe_offset=x])
                )[0]
            s.store_f32((d * passes + h % passes) * group + h // passes, value)
        return
    var j = (block % score_tiles(op)) * threads + thread
    if j >= Int(op.plan[unsafe_offset=2 * t + 1]):
        return
    var at = candidate_at(op, b, j)
    var key = op.k_blocks.unsafe_offset(at[0])
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
    op.scores[unsafe_offset=row * op.candidates + j] = (
        total * op.k_scales[unsafe_offset=at[1]]
    )


def index_select_phase(
    phase: Int, block: Int, thread: Int, s: Shared, op: IndexTopK
):
    """One phase of window row `block`'s select into the output."""
    var t = op.first_row + block
    var b = Int(op.plan[unsafe_offset=2 * t])
    var bound = Int(op.plan[unsafe_offset=2 * t + 1]) if b >= 0 else 0
    select_row_phase(
        phase,
        thread,
        s,
        op.scores.unsafe_offset(block * op.candidates),
        bound,
        op.k,
        op.output.unsafe_offset(t * op.k),
    )


def window_rows(candidates: Int, total_tokens: Int) -> Int:
    """Rows per window: as many as `GPU_WORKSPACE_BYTES` of scores hold."""
    var per_row = max(candidates, 1) * 4
    return max(1, min(total_tokens, GPU_WORKSPACE_BYTES // per_row))


def index_top_k_gpu[
    emulate: Bool
](
    op_in: IndexTopK,
    plan: Ptr[DType.int64],
    scores: Ptr[DType.float32],
    window: Int,
    ctx: DeviceContext,
) raises:
    """Runs the three launches over every window of rows.

    Args:
        op_in: The call (its workspace fields are set here).
        plan: `[2 * T]` int64 device workspace.
        scores: `[window * candidates]` float32 device workspace.
        window: Rows per window (`window_rows`).
        ctx: Device context (unused when emulated).

    Raises:
        Error: From a launch (a grid past 2^31 - 1 blocks; emulated, a
            broken phase model).
    """
    var op = op_in
    op.plan = plan
    op.scores = scores
    var tiles = score_tiles(op)

    def plan_body(block: Int, thread: Int, o: type_of(op)):
        index_plan_thread(block, thread, o)

    def score_body(block: Int, thread: Int, o: type_of(op)):
        index_score_thread(block, thread, o)

    def select_body(p: Int, block: Int, thread: Int, s: Shared, o: type_of(op)):
        index_select_phase(p, block, thread, s, o)

    def tile_body(p: Int, block: Int, thread: Int, s: Shared, o: type_of(op)):
        index_score_phase(p, block, thread, s, o)

    comptime tiled = tiled_scorer[op.num_heads, op.depth]()

    launch["mla_kpool_index_plan_kernel", plan_body, emulate](
        op, (ceildiv(op.total_tokens, PLAN_THREADS), PLAN_THREADS), ctx
    )
    var first = 0
    while first < op.total_tokens:
        var rows = min(window, op.total_tokens - first)
        op.first_row = first
        comptime if tiled:
            launch_phased[
                "mla_kpool_index_score_kernel",
                tile_words[op.num_heads, op.depth](),
                tile_body,
                emulate,
            ](
                op,
                (rows * tiles, score_threads[op.num_heads, op.depth]()),
                2,
                ctx,
            )
        else:
            launch["mla_kpool_index_score_kernel", score_body, emulate](
                op, (rows * tiles, SCORE_THREADS), ctx
            )
        launch_phased[
            "mla_kpool_index_select_kernel", SELECT_WORDS, select_body, emulate
        ](op, (rows, SELECT_THREADS), select_phases(op.k), ctx)
        first += rows
