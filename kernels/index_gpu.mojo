"""`mla_kpool.index_top_k` on a GPU (or its emulated grid): plan, score, select.

Three launches, with the same answer as the CPU path (`index_top_k_cpu`):

1. **Plan** (`index_plan_thread`, a thread per query row): the row's
   request and bound, or `-1` when the contract makes the row all `-1`
   (offsets malformed before it, a negative cache length, a page past a
   lookup table or an arena). The offsets are read on the device: nothing
   of the call's metadata goes to the host.
2. **Score** (`index_score_phase`, a block per (row, tile of
   `SCORE_THREADS` candidates), two phases): the row's FP8 query decoded
   once into shared memory, then a thread per candidate reads its key's
   bytes once and keeps the per-head dot products in registers, with the
   NaN-keeping ReLU, the head weights and the key's scale applied there,
   into a float32 workspace row (`index_score_thread`, untiled, for shapes
   whose query does not fit the block's shared memory).
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
    decode_e4m3,
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
"""Threads per block of the score launch (a candidate each)."""


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
    """Score blocks per row: tiles of `SCORE_THREADS` candidates."""
    return ceildiv(op.candidates, SCORE_THREADS)


@always_inline
def score_candidate(op: IndexTopK, b: Int, t: Int, j: Int) -> Float32:
    """Row `t`'s score of request `b`'s candidate `j` (float32 sums)."""
    var at = candidate_at(op, b, j)
    var key = op.k_blocks.unsafe_offset(at[0])
    var total = Float32(0)
    for h in range(op.num_heads):
        var query = op.q.unsafe_offset((t * op.num_heads + h) * op.depth)
        var dot = Float32(0)
        for d in range(op.depth):
            var x = decode_e4m3[1](SIMD[DType.uint8, 1](query[unsafe_offset=d]))
            var y = decode_e4m3[1](SIMD[DType.uint8, 1](key[unsafe_offset=d]))
            dot += x[0] * y[0]
        # ReLU that keeps a NaN a NaN, as the CPU kernel's.
        var relu = Float32(0) if dot < 0 else dot
        total += relu * op.qs[unsafe_offset=t * op.num_heads + h]
    return total * op.k_scales[unsafe_offset=at[1]]


def index_score_thread(block: Int, thread: Int, op: IndexTopK):
    """Scores one (row, candidate) of the window into the workspace."""
    var row = block // score_tiles(op)
    var j = (block % score_tiles(op)) * SCORE_THREADS + thread
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


@always_inline
def tile_words[num_heads: Int, depth: Int]() -> Int:
    """Shared words of the tiled scorer: the row's query and head weights."""
    return padded_heads_pow2[num_heads]() * (depth + 1)


comptime SCORE_SHARED_LIMIT = 12 * 1024
"""Shared words (48 KiB) a block may use: larger `H * D` score untiled."""


@always_inline
def tiled_scorer[num_heads: Int, depth: Int]() -> Bool:
    """Whether the tiled scorer serves this shape (`index_score_phase`)."""
    return (
        padded_heads_pow2[num_heads]() <= 64
        and tile_words[num_heads, depth]() <= SCORE_SHARED_LIMIT
    )


def index_score_phase(
    phase: Int, block: Int, thread: Int, s: Shared, op: IndexTopK
):
    """The tiled scorer: one row's query in shared memory, heads in registers.

    Phase 0: the block's threads decode the row's `[H, D]` FP8 query into
    shared memory once, as `[D, HP]` float32 (heads innermost, padded to a
    power of two `HP` with zeros), and its head weights after it. Phase 1:
    each thread scores one candidate of the block's tile: it reads the
    key's `D` bytes from global memory once, and for each dim adds the
    decoded key byte times the dim's `HP` query values to `HP` float32
    accumulators held in registers; then the NaN-keeping ReLU, the head
    weights and the key's scale, all in registers.
    """
    comptime hp = padded_heads_pow2[op.num_heads]()
    comptime heads = op.num_heads
    comptime depth = op.depth
    var row = block // score_tiles(op)
    var t = op.first_row + row
    var b = Int(op.plan[unsafe_offset=2 * t])
    if b < 0:
        return
    if phase == 0:
        var query = op.q.unsafe_offset(t * heads * depth)
        for x in range(thread, hp * depth, SCORE_THREADS):
            var d = x // hp
            var h = x % hp
            var value = Float32(0)
            if h < heads:
                value = decode_e4m3[1](
                    SIMD[DType.uint8, 1](query[unsafe_offset=h * depth + d])
                )[0]
            s.store_f32(x, value)
        for h in range(thread, hp, SCORE_THREADS):
            var weight = Float32(0)
            if h < heads:
                weight = op.qs[unsafe_offset=t * heads + h]
            s.store_f32(depth * hp + h, weight)
        return
    var j = (block % score_tiles(op)) * SCORE_THREADS + thread
    if j >= Int(op.plan[unsafe_offset=2 * t + 1]):
        return
    var at = candidate_at(op, b, j)
    var key = op.k_blocks.unsafe_offset(at[0])
    var acc = SIMD[DType.float32, hp](0)
    for d in range(depth):
        var k = decode_e4m3[1](SIMD[DType.uint8, 1](key[unsafe_offset=d]))[0]
        acc = s.load_f32x[hp](d * hp).fma(k, acc)
    var relu = acc.lt(0).select(SIMD[DType.float32, hp](0), acc)
    var total = (relu * s.load_f32x[hp](depth * hp)).reduce_add()
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
            ](op, (rows * tiles, SCORE_THREADS), 2, ctx)
        else:
            launch["mla_kpool_index_score_kernel", score_body, emulate](
                op, (rows * tiles, SCORE_THREADS), ctx
            )
        launch_phased[
            "mla_kpool_index_select_kernel", SELECT_WORDS, select_body, emulate
        ](op, (rows, SELECT_THREADS), select_phases(op.k), ctx)
        first += rows
