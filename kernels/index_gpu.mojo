"""`mla_kpool.index_top_k` on a GPU (or its emulated grid): plan, score, select.

Three launches, with the same answer as the CPU path (`index_top_k_cpu`):

1. **Plan** (`index_plan_thread`, a thread per query row): the row's
   request and bound, or `-1` when the contract makes the row all `-1`
   (offsets malformed before it, a negative cache length, a page past a
   lookup table or an arena). The offsets are read on the device: nothing
   of the call's metadata goes to the host.
2. **Score** (`index_score_thread`, a thread per (row, candidate)): the
   candidate's FP8 key and the row's FP8 queries, decoded exactly, a float32
   dot per head, the NaN-keeping ReLU, the head weight, the head sum and
   the key's scale, into a float32 workspace row.
3. **Select** (`index_select.select_row_phase`, a block per row): the top
   `k` ids of the workspace row in the contract's order.

Rows go through in windows: the workspace holds `window` rows of
`candidates` scores, `candidates` being the most any row can see (the
lookup tables' pages), and `window` is what `GPU_WORKSPACE_BYTES` allows, so
a 128K-token context never needs a `T x P` matrix at once. Grids are on the
x axis only: a window's score launch has `rows * tiles` blocks, far below
2^31 - 1 (`check_launch` refuses anything past it), so long contexts cannot
overflow a grid dimension.

This first GPU scorer reads each key from global memory once per (row,
candidate) pair, with no shared-memory tiles: correct on every GPU, not yet
designed for the memory system.
"""

from max.gpu.host import DeviceContext
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
def score_candidate(op: IndexTopK, b: Int, t: Int, j: Int) -> Float32:
    """Row `t`'s score of request `b`'s candidate `j` (float32 sums)."""
    comptime rows = op.rows_per_candidate
    var page = j * rows // op.page_size
    var slot = j * rows % op.page_size
    var at = page_bases(op, b, page)
    # A candidate's `rows` rows of `W` bytes follow each other in its page:
    # byte `d` of the key is at `slot * W + d`.
    var key = op.k_blocks.unsafe_offset(at[0] + slot * op.width)
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
    return total * op.k_scales[unsafe_offset=at[1] + slot]


def index_score_thread(block: Int, thread: Int, op: IndexTopK):
    """Scores one (row, candidate) of the window into the workspace."""
    var row = block // op.tiles
    var j = (block % op.tiles) * SCORE_THREADS + thread
    var t = op.first_row + row
    var b = Int(op.plan[unsafe_offset=2 * t])
    var bound = Int(op.plan[unsafe_offset=2 * t + 1])
    if b < 0 or j >= bound:
        return
    op.scores[unsafe_offset=row * op.candidates + j] = score_candidate(
        op, b, t, j
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
    op.tiles = ceildiv(op.candidates, SCORE_THREADS)

    def plan_body(block: Int, thread: Int, o: type_of(op)):
        index_plan_thread(block, thread, o)

    def score_body(block: Int, thread: Int, o: type_of(op)):
        index_score_thread(block, thread, o)

    def select_body(p: Int, block: Int, thread: Int, s: Shared, o: type_of(op)):
        index_select_phase(p, block, thread, s, o)

    launch["mla_kpool_index_plan_kernel", plan_body, emulate](
        op, (ceildiv(op.total_tokens, PLAN_THREADS), PLAN_THREADS), ctx
    )
    var first = 0
    while first < op.total_tokens:
        var rows = min(window, op.total_tokens - first)
        op.first_row = first
        launch["mla_kpool_index_score_kernel", score_body, emulate](
            op, (rows * op.tiles, SCORE_THREADS), ctx
        )
        launch_phased[
            "mla_kpool_index_select_kernel", SELECT_WORDS, select_body, emulate
        ](op, (rows, SELECT_THREADS), select_phases(op.k), ctx)
        first += rows
