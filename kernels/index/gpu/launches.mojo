"""`mla_kpool.index_top_k` on a GPU (or its emulated grid): plan, score, select.

Three launches, with the same answer as the CPU path (`index_top_k_cpu`):

Each launch is a kernel declaration (`gpu_kernel.GpuKernel`): `PlanKernel`,
the scorer's (`scorers.ScoreKernel`: `SimtScore`, `WgmmaScore`,
`MfmaScore`) and `SelectKernel`.

1. **Plan** (`PlanKernel`, a block per request): each row's request and
   bound, or `-1` where the contract makes the row all `-1`; the offsets
   are read on the device: nothing of the call's metadata goes to the host.
2. **Score** (the scorer's `ScoreKernel`): a float32 workspace row of
   scores per query row (`index_top_k_gpu` has the FP32 scorer's walk).
3. **Select** (`SelectKernel`, a block per row, or several): the top `k`
   ids of the workspace row in the contract's order.

Rows go through in windows (`window_rows`), so a long context never needs
a `T x P` matrix at once nor overflows a grid dimension (x axis only).

It has run on an NVIDIA H200 (docs/performance.md).
"""
from max.gpu.host import DeviceContext
from std.math import ceildiv, max, min
from std.sys import is_gpu

from ...grid.block_phases import BLOCK_SUM, Lane, Shared
from ...grid.gpu_kernel import GpuKernel, NoState, launch_kernel
from ...grid.phases import Phase, Phases
from ..operands import IndexTopK
from ..plan import (
    candidate_bound,
    end_well_formed,
    page_in_arenas,
    span_pages,
)
from ..scorers import SIMT, ScoreKernel
from .wgmma import wgmma_groups_rows
from .select import (
    SELECT_THREADS,
    SelectState,
    WindowRow,
    select_max_words,
    select_phase,
    select_phases,
    select_shared_words,
    select_slices,
    split_words,
)
from ...grid.ragged import Ptr


comptime GPU_WORKSPACE_BYTES = 1 << 28
"""Scores workspace per call (256 MiB): rows per window follow from it.
`mla_kpool._limits` is the Python twin of this and of `window_rows`
(tests/docs_and_layout/test_kernel_constants.py checks they agree)."""

comptime PLAN_THREADS = 256
"""Threads per block of the plan launch (a request per block)."""


comptime PLAN_PHASES = Phases(Phase("check", BLOCK_SUM), Phase("write"))
"""The plan's phases (`plan_phase`): the checks, their failures counted by
a block sum, then the rows."""


@always_inline
def _note_page_in_arenas(s: Shared, op: IndexTopK, b: Int, page: Int):
    """Records `plan.page_in_arenas`'s reads of the two lookup tables."""
    s.note_global_load(op.k_lookup_table, b * op.key_pages + page)
    s.note_global_load(op.k_scales_lookup_table, b * op.scale_pages + page)


def _write_plan(
    s: Shared, op: IndexTopK, first: Int, end: Int, thread: Int, b: Int
):
    """Rows `[first, end)` planned as all `-1` (`b` -1) or as request `b`'s
    rows from its first, `first` (their bounds by `candidate_bound`)."""
    var c = 0
    var n = 0
    if b >= 0:
        c = Int(s.global_load(op.k_cache_lengths, b))
        n = end - first
    for t in range(first + thread, end, PLAN_THREADS):
        var bound = 0
        if b >= 0:
            bound = candidate_bound[op.kpool, op.causal](c, n, t - first)
        s.global_store(op.work.plan, 2 * t, Int64(b))
        s.global_store(op.work.plan, 2 * t + 1, Int64(bound))


def plan_phase[
    phase: Int
](block: Int, thread: Int, mut lane: Lane, s: Shared, op: IndexTopK):
    """Block `b`'s share of the plan: request `b`'s rows, and the rows no
    request holds where `b` is the one that knows them.

    The rule of the CPU path (`plan.scored_prefix`, `request_span`),
    a request per block: request `b`'s rows are planned when the offsets
    are well formed up to its end (`end_well_formed` for every request
    through `b`, `offsets[0] == 0`), and scored when its cache length is
    non-negative and every page it needs is in both tables and arenas.
    Rows past the last well-formed end are all `-1`, written by the block
    of the first malformed request (block 0 when `offsets[0] != 0`) or by
    the last request's block. With no requests block 0 writes every row.

    `check`: each thread checks its share of the ends before `b` and of
    `b`'s pages and offers the failures (before `b` in the high 32 bits,
    `b`'s own in the low) to a block sum. `write`: the rows are written.

    Parameters:
        phase: The phase of `PLAN_PHASES`.

    Args:
        block: The request `b` (0 with no requests).
        thread: The thread, `0 ..< PLAN_THREADS`.
        lane: The thread's lane in the block sum after `check`.
        s: The thread's view (its global reads and writes, recorded in a
            profiled emulation; the checks shared with the CPU path,
            `end_well_formed` and `page_in_arenas`, are noted beside
            their calls).
        op: The call.
    """
    var b = block
    var batch = op.scored_requests
    var offsets = op.input_row_offsets
    var tokens = op.total_tokens
    comptime checks = PLAN_PHASES.named(phase, "check")
    if b >= batch:
        # No requests: every row is all -1 (`scored_prefix` walks none).
        comptime if checks:
            lane.offer(0)
        else:
            _write_plan(s, op, 0, tokens, thread, -1)
        return
    s.note_span(offsets, b)
    var own = end_well_formed(offsets, b, tokens)
    comptime if checks:
        var before: UInt64 = 0
        if thread == 0 and Int(s.global_load(offsets, 0)) != 0:
            before = 1
        for i in range(thread, b, PLAN_THREADS):
            s.note_span(offsets, i)
            if not end_well_formed(offsets, i, tokens):
                before = 1
        var unscored: UInt64 = 0
        if own:
            var start = Int(s.global_load(offsets, b))
            var n = Int(s.global_load(offsets, b + 1)) - start
            var c = Int(s.global_load(op.k_cache_lengths, b))
            var pages = span_pages(op, c, n) if c >= 0 else -1
            if pages < 0:
                unscored = 1
            for page in range(thread, max(pages, 0), PLAN_THREADS):
                _note_page_in_arenas(s, op, b, page)
                if not page_in_arenas(op, b, page):
                    unscored = 1
        lane.offer(before << 32 | unscored)
    else:
        var failed = lane.result()
        if failed >> 32 != 0:
            # Offsets malformed before `b`: an earlier block writes these
            # rows; block 0 here means `offsets[0] != 0`, so no row is
            # any request's.
            if b == 0:
                _write_plan(s, op, 0, tokens, thread, -1)
            return
        var start = Int(s.global_load(offsets, b))
        if not own:
            _write_plan(s, op, start, tokens, thread, -1)
            return
        var end = Int(s.global_load(offsets, b + 1))
        var scored = (failed & 0xFFFFFFFF) == 0
        _write_plan(s, op, start, end, thread, b if scored else -1)
        if b == batch - 1:
            _write_plan(s, op, end, tokens, thread, -1)


@always_inline
def select_row[
    phase: Int, split: Bool
](row: Int, op: IndexTopK, s: Shared, mut state: SelectState) -> WindowRow[
    MutAnyOrigin
]:
    """Window row `row`'s scores, bound, split words and output ids.

    An unsplit select reads the row's bound from the plan in its first
    phase (`load`) and keeps it in `state` (every phase read the same two
    words again after its barrier: 41-53 registers on sm_90a, 32 with it
    kept). A split
    select reads it in each phase: kept, it took 40 registers to 48, half
    an SM's warps instead of three quarters.
    """
    var t = op.work.first_row + row
    var bound: Int
    comptime if split or select_phases(op.k, split).named(phase, "load"):
        var b = Int(s.global_load(op.work.plan, 2 * t))
        bound = 0
        if b >= 0:
            bound = Int(s.global_load(op.work.plan, 2 * t + 1))
        comptime if not split:
            state.bound = UInt32(bound)
    else:
        bound = Int(state.bound)
    return WindowRow[MutAnyOrigin](
        op.work.scores.unsafe_offset(row * op.work.candidates),
        bound,
        op.work.candidates,
        op.work.slices,
        op.work.split.unsafe_offset(row * split_words(op.work.slices)),
        op.output.unsafe_offset(t * op.k),
    )


struct PlanKernel[Op: type_of(IndexTopK)](GpuKernel):
    """Launch 1: a block per request writes its rows' plans (`plan_phase`,
    two phases): each row's request and bound, or `-1` when the contract
    makes the row all `-1` (offsets malformed before it, a negative cache
    length, a page past a lookup table or an arena). The block's threads
    share the checks of the offsets before the request and of its pages, a
    block sum counts what failed, then they write the request's rows. The
    offsets are read on the device: nothing of the call's metadata goes to
    the host."""

    comptime Operands = Self.Op
    comptime name = "mla_kpool_index_plan_kernel"
    comptime State = NoState
    comptime block_threads = PLAN_THREADS
    comptime phase_table = PLAN_PHASES
    comptime grid_rows = "batch"

    @staticmethod
    def rows(op: Self.Operands) -> Int:
        """Requests `B` (one block with none)."""
        return max(op.scored_requests, 1)

    @staticmethod
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
        """`plan_phase`."""
        plan_phase[phase](block, thread, lane, s, op)


comptime _SELECT = "mla_kpool_index_select_kernel"
"""The select's kernel name, a block per row."""


comptime _SPLIT_SELECT = "mla_kpool_index_split_select_kernel"
"""The select's kernel name, rows split over blocks."""


struct SelectKernel[Op: type_of(IndexTopK), split: Bool](GpuKernel):
    """Launch 3: a block per window row selects its top `k`, or (`split`)
    `select_slices` blocks per row count it and the last selects
    (`select.select_phase`)."""

    comptime Operands = Self.Op
    comptime State = SelectState
    comptime name = _SPLIT_SELECT if Self.split else _SELECT
    comptime block_threads = SELECT_THREADS
    comptime shared_words = select_max_words(Self.Op.k)
    comptime dynamic_shared = True
    comptime phase_table = select_phases(Self.Op.k, Self.split)
    comptime grid_rows = "window_rows"
    comptime grid_columns = "select_slices" if Self.split else "1"

    @staticmethod
    def rows(op: Self.Operands) -> Int:
        """Rows of the window."""
        return op.work.rows

    @staticmethod
    def columns(op: Self.Operands) -> Int:
        """Blocks per row (`select.select_slices`)."""
        return op.work.slices

    @staticmethod
    def launch_shared_words(op: Self.Operands) -> Int:
        """The pairs and a row cache as wide as the workspace's rows."""
        return select_shared_words(Self.Op.k, op.work.candidates)

    @staticmethod
    @always_inline
    def run_phase[
        phase: Int
    ](
        block: Int,
        thread: Int,
        mut state: SelectState,
        mut lane: Lane,
        s: Shared,
        op: Self.Operands,
    ):
        """`select_phase` on window row `block / slices`, its slice
        `block % slices`.

        Inlined into the GPU kernel, every phase (`select_phase` and what
        it calls are `@always_inline` too): left to itself the AMDGPU
        inliner kept each phase a function, called once, with its
        arguments in scratch memory. The emulated grid calls
        `_select_phase_host` instead, so that its host code keeps a
        function per phase.
        """
        comptime if is_gpu():
            var slices = op.work.slices
            var row = select_row[phase, Self.split](
                block // slices, op, s, state
            )
            select_phase[phase, Self.Op.k, Self.split](
                thread, state, lane, s, row, block % slices
            )
        else:
            _select_phase_host[phase, Self.Op, Self.split](
                block, thread, state, lane, s, op
            )


@no_inline
def _select_phase_host[
    phase: Int, Op: type_of(IndexTopK), split: Bool
](
    block: Int,
    thread: Int,
    mut state: SelectState,
    mut lane: Lane,
    s: Shared,
    op: Op,
):
    """`select_phase` out of line, for the emulated grid: the phase bodies
    are `@always_inline` for the GPU, and `emulate_kernel`'s unrolled loop
    over the phases would otherwise take them all into one function."""
    var slices = op.work.slices
    var row = select_row[phase, split](block // slices, op, s, state)
    select_phase[phase, Op.k, split](
        thread, state, lane, s, row, block % slices
    )


def window_rows(candidates: Int, total_tokens: Int) -> Int:
    """Rows per window: as many as `GPU_WORKSPACE_BYTES` of scores hold.

    Rows go through in windows: the workspace holds `window` rows of
    `candidates` scores, `candidates` being the most any row can see (the
    lookup tables' pages), and `window` is what `GPU_WORKSPACE_BYTES`
    allows, so a 128K-token context never needs a `T x P` matrix at once.
    Grids are on the x axis only: a window's score launch has `rows *
    tiles` blocks, far below 2^31 - 1 (`check_launch` refuses anything
    past it), so long contexts cannot overflow a grid dimension.
    """
    var per_row = max(candidates, 1) * 4
    return max(1, min(total_tokens, GPU_WORKSPACE_BYTES // per_row))


def index_top_k_gpu[
    emulate: Bool, scorer: StaticString = SIMT
](
    op_in: IndexTopK,
    plan: Ptr[DType.int64],
    scores: Ptr[DType.float32],
    split: Ptr[DType.uint32],
    candidates: Int,
    window: Int,
    ctx: DeviceContext,
) raises:
    """Runs the three launches over every window of rows.

    The score launch (`score.index_score_phase`, a block per (row, tile
    of `score_threads` candidates), two phases): the row's FP8 query
    decoded once into shared memory, then a thread per candidate reads its
    key's bytes (16 per load where aligned; decoded by the hardware's FP8
    conversion on NVIDIA GPUs) and keeps up to `PASS_HEADS` per-head dot
    products in registers per pass over the key, with the NaN-keeping
    ReLU, the head weights and the key's scale applied there, into a
    float32 workspace row (`index_score_thread`, untiled, for shapes whose
    query does not fit the block's shared memory). The launch's shape is
    `shape.mojo`'s. That is the `"simt"` scorer (`SimtScore`); the tensor
    scorers (`wgmma.mojo` on sm_90, `mfma.mojo` on gfx942) fill the same
    workspace row, as `scorers.mojo` picks.

    A decode reads each visible key once per query row (once per
    request); a prefill reads a request's keys once per row, from the L2
    cache after the first.

    Parameters:
        emulate: Run every launch over the emulated grid on the CPU.
        scorer: `"simt"`, `"wgmma"` or `"mfma"`, as
            `scorers.scorer_kernel` chose it (`ScoreKernel` maps it
            to its kernel).

    Args:
        op_in: The call (its workspace is set here).
        plan: `[2 * T]` int64 device workspace.
        scores: `[window * candidates]` float32 device workspace.
        split: `[window * split_words(slices)]` uint32 device
            workspace, zero (`slices = select_slices(candidates, T, k)`).
        candidates: The most candidates a row can see (a workspace row).
        window: Rows per window (`window_rows`).
        ctx: Device context (unused when emulated).

    Raises:
        Error: From a launch (a grid past 2^31 - 1 blocks; emulated, a
            broken phase model).
    """
    var op = op_in
    op.work.plan = plan
    op.work.scores = scores
    op.work.split = split
    op.work.slices = select_slices(candidates, op.total_tokens, op.k)
    op.work.candidates = candidates
    comptime Op = type_of(op)
    launch_kernel[PlanKernel[Op], emulate](op, ctx)
    var first = 0
    while first < op.total_tokens:
        op.work.first_row = first
        op.work.rows = min(window, op.total_tokens - first)
        comptime Score = ScoreKernel[scorer, Op]
        comptime Grouped = ScoreKernel[scorer, Op, True]
        comptime if Grouped.name != Score.name:
            if wgmma_groups_rows(op.total_tokens, op.scored_requests):
                launch_kernel[Grouped, emulate](
                    rebind[Grouped.Operands](op), ctx
                )
            else:
                launch_kernel[Score, emulate](rebind[Score.Operands](op), ctx)
        else:
            launch_kernel[Score, emulate](rebind[Score.Operands](op), ctx)
        if op.work.slices > 1:
            launch_kernel[SelectKernel[Op, True], emulate](op, ctx)
        else:
            launch_kernel[SelectKernel[Op, False], emulate](op, ctx)
        first += op.work.rows
