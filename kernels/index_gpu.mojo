"""`mla_kpool.index_top_k` on a GPU (or its emulated grid): plan, score, select.

Three launches, with the same answer as the CPU path (`index_top_k_cpu`):

1. **Plan** (`index_plan_thread`, a thread per query row, through
   `index_plan.row_plan`): the row's request and bound, or `-1` when the
   contract makes the row all `-1` (offsets malformed before it, a
   negative cache length, a page past a lookup table or an arena). The
   offsets are read on the device: nothing of the call's metadata goes to
   the host.
2. **Score** (`index_gpu_score.index_score_phase`, a block per (row, tile of
   `score_threads` candidates), two phases): the row's FP8 query decoded
   once into shared memory, then a thread per candidate reads its key's
   bytes (16 per load where aligned; decoded by the hardware's FP8
   conversion on NVIDIA GPUs) and keeps up to `PASS_HEADS` per-head dot
   products in registers per pass over the key, with the NaN-keeping
   ReLU, the head weights and the key's scale applied there, into a
   float32 workspace row (`index_score_thread`, untiled, for shapes whose
   query does not fit the block's shared memory). The launch's shape is
   `index_gpu_shape.mojo`'s. That is the `"simt"` scorer; the tensor
   scorers (`index_wgmma.mojo` on sm_90, `index_mfma.mojo` on gfx942)
   fill the same workspace row, as `index_scorers.mojo` picks.
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
first. It has run on an NVIDIA H200 (docs/performance.md).
"""
from max.gpu.host import DeviceContext
from std.math import ceildiv, max, min

from .block_phases import Shared, launch_phased
from .index_gpu_score import index_score_phase, index_score_thread
from .index_mfma import (
    MFMA_THREADS,
    index_mfma_phase,
    mfma_phases,
    mfma_tiles,
    mfma_words,
)
from .index_wgmma import (
    WGMMA_THREADS,
    index_wgmma_phase,
    wgmma_phases,
    wgmma_tiles,
    wgmma_words,
)
from .index_gpu_shape import (
    SCORE_THREADS,
    score_threads,
    score_tiles,
    tile_words,
    tiled_scorer,
)
from .index_operands import IndexTopK
from .index_plan import row_plan
from .index_select import select_row_phase
from .index_select_layout import SELECT_THREADS, SELECT_WORDS, select_phases
from .parallel import launch
from .ragged import Ptr


comptime GPU_WORKSPACE_BYTES = 1 << 28
"""Scores workspace per call (256 MiB): rows per window follow from it."""

comptime PLAN_THREADS = 256
"""Threads per block of the plan launch (a row each)."""


def index_plan_thread(block: Int, thread: Int, op: IndexTopK):
    """Writes row `block * PLAN_THREADS + thread`'s plan: request, bound."""
    var t = block * PLAN_THREADS + thread
    if t >= op.total_tokens:
        return
    var plan = row_plan(op, t)
    op.plan[unsafe_offset=2 * t] = Int64(plan[0])
    op.plan[unsafe_offset=2 * t + 1] = Int64(plan[1])


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
    emulate: Bool, scorer: StaticString = "simt"
](
    op_in: IndexTopK,
    plan: Ptr[DType.int64],
    scores: Ptr[DType.float32],
    window: Int,
    ctx: DeviceContext,
) raises:
    """Runs the three launches over every window of rows.

    Parameters:
        emulate: Run every launch over the emulated grid on the CPU.
        scorer: `"simt"` (FP32, `index_gpu_score`), `"wgmma"`
            (`index_wgmma`) or `"mfma"` (`index_mfma`), as
            `index_scorers.scorer_kernel` chose it.

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

    def wgmma_body(p: Int, block: Int, thread: Int, s: Shared, o: type_of(op)):
        index_wgmma_phase(p, block, thread, s, o)

    def mfma_body(p: Int, block: Int, thread: Int, s: Shared, o: type_of(op)):
        index_mfma_phase(p, block, thread, s, o)

    comptime tiled = tiled_scorer[op.num_heads, op.depth]()

    launch["mla_kpool_index_plan_kernel", plan_body, emulate](
        op, (ceildiv(op.total_tokens, PLAN_THREADS), PLAN_THREADS), ctx
    )
    var first = 0
    while first < op.total_tokens:
        var rows = min(window, op.total_tokens - first)
        op.first_row = first
        comptime if scorer == "mfma":
            launch_phased[
                "mla_kpool_index_mfma_score_kernel",
                mfma_words[op.num_heads, op.depth](),
                mfma_body,
                emulate,
            ](
                op,
                (rows * mfma_tiles(op), MFMA_THREADS),
                mfma_phases[op.num_heads](),
                ctx,
            )
        elif scorer == "wgmma":
            launch_phased[
                "mla_kpool_index_wgmma_score_kernel",
                wgmma_words[op.num_heads, op.depth](),
                wgmma_body,
                emulate,
            ](
                op,
                (rows * wgmma_tiles(op), WGMMA_THREADS),
                wgmma_phases[op.num_heads](),
                ctx,
            )
        elif tiled:
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
