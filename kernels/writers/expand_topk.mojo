"""`mo.mla.kpool.expand_topk`: expand the indexer's selected pools into positions.

The indexer picks `pool_topk` pools per query token; attention reads
tokens: pool `p` widens into positions `p * kpool .. p * kpool + kpool - 1`.

Token row `t` belongs to request `b` when `input_row_offsets[b] <= t <
input_row_offsets[b + 1]`; its query position is `c + local` (`c =
cache_lengths[b]`, `local = t - input_row_offsets[b]`, 64-bit) and it sees
`visible = c + local + 1` positions. Output row `t` (`pool_topk * kpool +
tail` int32 columns, `tail = kpool - 1` with `always_select_tail`, else 0)
is packed:

1. for each id `p = pool_ids[t, j]` in selection order that is a complete
   pool the query sees (`0 <= p` and `(p + 1) * kpool <= visible`), the
   positions `p * kpool .. p * kpool + kpool - 1`; other ids (`-1`, negative,
   a pool still filling or in the query's future) are skipped, never
   expanded into positions the query must not see; a repeated id is
   expanded each time;
2. with `always_select_tail`, the `visible % kpool` newest positions
   `visible - visible % kpool .. visible - 1` (the pool still filling, the
   query included);
3. `-1` in every remaining column.

So valid positions always come first and a column is never a clamped or
invented position. A row is all `-1` when no request owns it (past the last
offset, or in the span of a request with bad metadata: decreasing offsets,
offsets past `total_tokens`, a negative cache length) and when its
positions would not fit int32 (`visible > 2^31`). Nothing is ever read or
written out of bounds (`query_visible` finds a row's request).
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from max.gpu.host import DeviceContext
from std.math import ceildiv, iota, max, min
from std.sys import is_gpu, size_of

from ..grid.operands import (
    ANY,
    KernelOperands,
    dims,
    expect_offsets,
    expect_shape,
    expect_target,
)
from ..grid.block_phases import (
    BLOCK_EXCLUSIVE_SUM,
    PROFILE_BUILD,
    Lane,
    Shared,
)
from ..grid.collectives import thread_run
from ..grid.gpu_kernel import GpuKernel, launch_kernel
from ..grid.parallel import cpu_for_each_range
from ..grid.phases import Phase, Phases
from ..grid.shared_buffer import Buffer
from ..grid.ragged import Field, Ptr, last_span_at, read_index, token_span
from .gpu_rows import note_last_span_at, profiled

comptime POSITION_LIMIT = 1 << 31
"""Most positions a query may see: its newest one must fit int32."""

comptime GPU_EXPAND_THREADS = 256
"""Most threads per block of the GPU kernel (a block per token row)."""

comptime GPU_EXPAND_SHARED_IDS = 8192
"""Most selected ids a row compacts in shared memory (32 KiB); rows of
more take the warp kernel (`ExpandTopKWarpKernel`)."""

comptime GPU_EXPAND_WARP = 32
"""Threads per block of the warp kernel: one warp.

Its threads never communicate, so each scans the whole row for the count
of valid ids before each id; its lanes read each id together (one
broadcast load) and share out the columns.
"""

comptime CPU_STORE_WIDTH = 16
"""Positions (int32) per CPU SIMD store: one 64-byte cache line."""


@always_inline
def tail_width[kpool: Int, always_select_tail: Bool]() -> Int:
    """Columns after the expanded pools: `kpool - 1` with the tail, else 0."""
    return kpool - 1 if always_select_tail else 0


@always_inline
def row_width[kpool: Int, pool_topk: Int, always_select_tail: Bool]() -> Int:
    """Output columns per token row: `pool_topk * kpool + tail_width`."""
    return pool_topk * kpool + tail_width[kpool, always_select_tail]()


@fieldwise_init
struct ExpandTopKOperands[
    pool_dtype: DType,
    offset_dtype: DType,
    length_dtype: DType,
    kpool: Int,
    pool_topk: Int,
    always_select_tail: Bool,
    origin: MutOrigin,
](KernelOperands):
    """One expand_topk call: its tensors and sizes (see `execute`).

    Parameters:
        pool_dtype: Integer dtype of `pool_ids` (int32 by MAX's convention).
        offset_dtype: Integer dtype of `input_row_offsets`.
        length_dtype: Integer dtype of `cache_lengths`.
        kpool: Tokens per pool.
        pool_topk: Selected pools per token row.
        always_select_tail: Whether rows carry the pool still filling.
        origin: Origin of the tensor pointers (`MutAnyOrigin` in kernels).
    """

    var positions: Field[DType.int32, Self.origin]
    """Output `[total_tokens, row_width]` int32."""
    var pool_ids: Field[Self.pool_dtype, Self.origin]
    """`[total_tokens, pool_topk]` selected pool ids."""
    var input_row_offsets: Field[Self.offset_dtype, Self.origin]
    """`[batch + 1]` token row offsets."""
    var cache_lengths: Field[Self.length_dtype, Self.origin]
    """`[batch]` cached-prefix lengths."""
    var batch: Int
    """Requests in this call."""
    var total_tokens: Int
    """Token rows."""

    comptime width = row_width[
        Self.kpool, Self.pool_topk, Self.always_select_tail
    ]()
    """Output columns per token row."""


comptime ExpandTopK = ExpandTopKOperands[..., origin=MutAnyOrigin]
"""`ExpandTopKOperands` over the kernels' raw tensor pointers."""


@always_inline
def query_visible(op: ExpandTopK, row: Int) -> Int:
    """How many positions token row `row` sees, or 0 for an all `-1` row.

    The owner is the last `b` in `[0, batch]` with `input_row_offsets[b] <=
    row` (binary search); 0 when that is no request, its span is not valid
    or does not hold `row`, its cache length is negative, or `visible`
    exceeds `POSITION_LIMIT`. Never reads outside `input_row_offsets[0 :
    batch + 1]` and `cache_lengths[0 : batch]`.

    The search is exact for the non-decreasing offsets of any real batch.
    When the offsets decrease somewhere the spans of valid requests may
    overlap or be missed by the search: each row then holds all `-1` or
    the expansion for some valid request whose span holds it, and nothing
    is ever read or written out of bounds.
    """
    var b = last_span_at(op.input_row_offsets, op.batch, row)
    if b < 0 or b >= op.batch:
        return 0
    var span = token_span(op.input_row_offsets, b, op.total_tokens)
    if not span.ok or row < span.start or row >= span.start + span.n:
        return 0
    var c = read_index(op.cache_lengths, b)
    # Checked before the sum, so an int64 length near 2^63 cannot wrap.
    if c < 0 or c >= POSITION_LIMIT:
        return 0
    var visible = c + (row - span.start) + 1
    return visible if visible <= POSITION_LIMIT else 0


@always_inline
def note_query_visible(s: Shared, op: ExpandTopK, row: Int):
    """Records `query_visible(op, row)`'s metadata reads (host code only,
    when profiled: its search and conditions evaluated again)."""
    comptime if PROFILE_BUILD:
        comptime if not is_gpu():
            if not profiled(s):
                return
            note_last_span_at(s, op.input_row_offsets, op.batch, row)
            var b = last_span_at(op.input_row_offsets, op.batch, row)
            if b < 0 or b >= op.batch:
                return
            s.note_span(op.input_row_offsets, b)
            var span = token_span(op.input_row_offsets, b, op.total_tokens)
            if not span.ok or row < span.start or row >= span.start + span.n:
                return
            s.note_global_load(op.cache_lengths, b)


@always_inline
def _valid(p: Int, complete: Int) -> Bool:
    """Whether pool id `p` expands: a complete pool the query sees."""
    return p >= 0 and p < complete


@always_inline
def _run_width[pool_topk: Int, threads: Int]() -> Int:
    """Ids of every thread's run when they are all alike and 2 or 4 of them
    (one 8- or 16-byte load a run), else 1 (a load an id)."""
    comptime width = pool_topk // threads
    comptime if pool_topk % threads == 0 and (width == 2 or width == 4):
        return width
    return 1


@always_inline
def _run_ids[
    dtype: DType, //, pool_topk: Int, threads: Int
](s: Shared, ids: Ptr[dtype], first: Int) -> SIMD[
    dtype, _run_width[pool_topk, threads]()
]:
    """A thread's run of ids from `first` in one vector load, where runs
    are alike (`_run_width`) and the row is aligned to them: a warp's
    lanes then read consecutive 8 or 16 bytes, every byte of each sector
    (an id at a time, lanes 8 bytes apart used half of each). Zeros where
    the load is not made (`_run_id` then loads an id at a time)."""
    comptime width = _run_width[pool_topk, threads]()
    comptime bytes = width * size_of[dtype]()
    var run = SIMD[dtype, width](0)
    comptime if width > 1 and bytes <= 16:
        if (Int(ids) & (bytes - 1)) == 0:
            run = s.global_load[width=width, alignment=bytes](ids, first)
    return run


@always_inline
def _run_id[
    dtype: DType, //, pool_topk: Int, threads: Int
](
    s: Shared,
    ids: Ptr[dtype],
    run: SIMD[dtype, _run_width[pool_topk, threads]()],
    j: Int,
    first: Int,
) -> Int:
    """Id `j` of the row: from `run` (`_run_ids` from `first`) where it
    was loaded whole, else loaded alone."""
    comptime width = _run_width[pool_topk, threads]()
    comptime bytes = width * size_of[dtype]()
    comptime if width > 1 and bytes <= 16:
        if (Int(ids) & (bytes - 1)) == 0:
            # A lane picked by comparisons: a vector indexed at run time
            # went through local memory (16 bytes of stack on sm_90a).
            var id = Int(run[0])
            comptime for l in range(1, width):
                if j - first == l:
                    id = Int(run[l])
            return id
    return Int(s.global_load(ids, j))


@always_inline
def store_run[count: Int](dest: Ptr[DType.int32], first: Int):
    """Stores the `count` positions `first, first + 1, ...` at `dest`."""
    comptime full = count // CPU_STORE_WIDTH
    comptime for i in range(full):
        dest.unsafe_store[width=CPU_STORE_WIDTH](
            i * CPU_STORE_WIDTH,
            iota[DType.int32, CPU_STORE_WIDTH](
                Int32(first + i * CPU_STORE_WIDTH)
            ),
        )
    comptime for q in range(full * CPU_STORE_WIDTH, count):
        dest[unsafe_offset=q] = Int32(first + q)


@always_inline
def cpu_expand_row[
    pool_dtype: DType, kpool: Int, pool_topk: Int, always_select_tail: Bool
](ids: Ptr[pool_dtype], dest: Ptr[DType.int32], visible: Int):
    """Writes one packed output row on the CPU.

    Args:
        ids: The row's `pool_topk` selected pool ids.
        dest: The row's `row_width` output columns.
        visible: Positions the query sees (0: all `-1`).
    """
    comptime width = row_width[kpool, pool_topk, always_select_tail]()
    var complete = visible // kpool
    var col = 0
    for j in range(pool_topk):
        var p = read_index(ids, j)
        if _valid(p, complete):
            store_run[kpool](dest.unsafe_offset(col), p * kpool)
            col += kpool
    comptime if always_select_tail:
        var partial = visible % kpool
        for q in range(partial):
            dest[unsafe_offset=col + q] = Int32(visible - partial + q)
        col += partial
    var unused = SIMD[DType.int32, CPU_STORE_WIDTH](-1)
    while col + CPU_STORE_WIDTH <= width:
        dest.unsafe_store[width=CPU_STORE_WIDTH](col, unused)
        col += CPU_STORE_WIDTH
    while col < width:
        dest[unsafe_offset=col] = -1
        col += 1


def expand_topk_cpu(op: ExpandTopK):
    """CPU expand_topk: token rows split across cores, SIMD stores per row."""
    comptime width = op.width

    def expand_rows(lo: Int, hi: Int) {imm}:
        for row in range(lo, hi):
            cpu_expand_row[
                op.pool_dtype, op.kpool, op.pool_topk, op.always_select_tail
            ](
                op.pool_ids.unsafe_offset(row * op.pool_topk),
                op.positions.unsafe_offset(row * width),
                query_visible(op, row),
            )

    cpu_for_each_range(
        op.total_tokens, op.total_tokens * (op.pool_topk + width), expand_rows
    )


@always_inline
def gpu_expand_threads[pool_topk: Int]() -> Int:
    """Threads per block of the compacting kernel: the row's ids a thread
    each, in multiples of 64 (whole warps on every target, as a block
    collective needs), at most `GPU_EXPAND_THREADS`."""
    return min(max(ceildiv(pool_topk, 64) * 64, 64), GPU_EXPAND_THREADS)


struct ExpandState(Copyable, Defaultable, TrivialRegisterPassable):
    """What an expand_topk thread keeps across the barriers."""

    var visible: Int
    """Positions the row's query sees (`query_visible`)."""

    def __init__(out self):
        """Before the first phase."""
        self.visible = 0


comptime EXPAND_PHASES = Phases(
    Phase("count", BLOCK_EXCLUSIVE_SUM), Phase("compact"), Phase("write")
)
"""The compacting kernel's phases (`expand_topk_phase`)."""


def expand_topk_phase[
    phase: Int
](
    row: Int,
    thread: Int,
    mut state: ExpandState,
    mut lane: Lane,
    s: Shared,
    op: ExpandTopK,
):
    """One thread of the compacting kernel: token row `row`, phase `phase`.

    A stream compaction (a block prefix sum of valid-id counts, as in
    CUB's `BlockScan`-based select), then coalesced stores:

    - `count`: the thread counts the valid ids of its contiguous run of
      the row (`collectives.thread_run`) and offers the count to the
      block's exclusive prefix sum;
    - `compact`: from that prefix it writes its valid ids, in order, to
      `kept_ids` from `prefix`; the last thread writes the row's valid
      total to `kept_total`;
    - `write`: thread `i` writes columns `i, i + T, ...`: column `c` below
      `total * kpool` is member `c % kpool` of compacted id `c / kpool`,
      then the tail's positions, then `-1`.
    """
    comptime kpool = op.kpool
    comptime pool_topk = op.pool_topk
    comptime width = op.width
    comptime threads = gpu_expand_threads[pool_topk]()
    var ids = op.pool_ids.unsafe_offset(row * pool_topk)
    var run = thread_run(thread, threads, pool_topk)
    # Shared memory: the row's valid ids compacted, then how many.
    var kept_ids = Buffer["kept_ids"](s, 0, pool_topk)
    var kept_total = Buffer["kept_total"](s, pool_topk, 1)
    comptime if EXPAND_PHASES.named(phase, "count"):
        state.visible = query_visible(op, row)
        note_query_visible(s, op, row)
        var complete = state.visible // kpool
        var count = 0
        var run_ids = _run_ids[pool_topk, threads](s, ids, run[0])
        for j in range(run[0], run[1]):
            if _valid(
                _run_id[pool_topk, threads](s, ids, run_ids, j, run[0]),
                complete,
            ):
                count += 1
        lane.offer(UInt64(count))
    elif EXPAND_PHASES.named(phase, "compact"):
        var complete = state.visible // kpool
        var at = Int(lane.result())
        var run_ids = _run_ids[pool_topk, threads](s, ids, run[0])
        for j in range(run[0], run[1]):
            var p = _run_id[pool_topk, threads](s, ids, run_ids, j, run[0])
            if _valid(p, complete):
                kept_ids.store(at, UInt32(p))
                at += 1
        if thread == threads - 1:
            kept_total.store(0, UInt32(at))
    else:
        var filled = Int(kept_total.load(0)) * kpool
        var partial = 0
        comptime if op.always_select_tail:
            partial = state.visible % kpool
        var dest = op.positions.unsafe_offset(row * width)
        for col in range(thread, width, threads):
            var value = Int32(-1)
            if col < filled:
                value = Int32(
                    Int(kept_ids.load(col // kpool)) * kpool + col % kpool
                )
            elif col < filled + partial:
                value = Int32(state.visible - partial + col - filled)
            s.global_store(dest, col, value)


struct ExpandTopKKernel[Op: type_of(ExpandTopK)](GpuKernel):
    """The expand_topk launch for rows of at most `GPU_EXPAND_SHARED_IDS`
    ids: a block per token row compacts its valid ids in shared memory and
    writes the row with coalesced stores (`expand_topk_phase`)."""

    comptime Operands = Self.Op
    comptime State = ExpandState
    comptime name = "kpool_expand_topk_kernel"
    comptime block_threads = gpu_expand_threads[Self.Op.pool_topk]()
    comptime shared_words = Self.Op.pool_topk + 1
    comptime phase_table = EXPAND_PHASES
    comptime grid_rows = "tokens"

    @staticmethod
    def rows(op: Self.Operands) -> Int:
        """Token rows (none when rows have no columns)."""
        return op.total_tokens if Self.Op.width > 0 else 0

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
        """`expand_topk_phase`."""
        expand_topk_phase[phase](block, thread, state, lane, s, op)


def expand_topk_warp_thread(block: Int, thread: Int, s: Shared, op: ExpandTopK):
    """One thread of the warp kernel: token row `block`, every 32nd column.

    Thread `i` of the warp writes columns `i`, `i + 32`, ... Every thread
    walks the row's ids in selection order, counting the columns the valid
    ones fill, and writes the positions that land in its columns; then its
    tail columns, then `-1`. The threads never communicate, so the result
    does not depend on their order. Global memory goes through the
    thread's view `s` (recorded in a profiled emulation).
    """
    comptime kpool = op.kpool
    comptime width = op.width
    comptime stride = GPU_EXPAND_WARP
    var row = block
    var visible = query_visible(op, row)
    note_query_visible(s, op, row)
    var complete = visible // kpool
    var ids = op.pool_ids.unsafe_offset(row * op.pool_topk)
    var dest = op.positions.unsafe_offset(row * width)
    var col = thread
    var filled = 0
    for j in range(op.pool_topk):
        var p = Int(s.global_load(ids, j))
        if _valid(p, complete):
            filled += kpool
            # Column `col` holds member `col - (filled - kpool)` of pool p.
            while col < filled:
                s.global_store(
                    dest, col, Int32(p * kpool - filled + kpool + col)
                )
                col += stride
    comptime if op.always_select_tail:
        filled += visible % kpool
        while col < filled:
            s.global_store(dest, col, Int32(visible - filled + col))
            col += stride
    while col < width:
        s.global_store(dest, col, Int32(-1))
        col += stride


struct ExpandTopKWarpKernel[Op: type_of(ExpandTopK)](GpuKernel):
    """The expand_topk launch for rows of more than `GPU_EXPAND_SHARED_IDS`
    ids: a warp per token row (`expand_topk_warp_thread`)."""

    comptime Operands = Self.Op
    comptime name = "kpool_expand_topk_warp_kernel"
    comptime block_threads = GPU_EXPAND_WARP
    comptime grid_rows = "tokens"

    @staticmethod
    def rows(op: Self.Operands) -> Int:
        """Token rows."""
        return op.total_tokens

    @staticmethod
    def run(phase: Int, block: Int, thread: Int, s: Shared, op: Self.Operands):
        """`expand_topk_warp_thread`."""
        expand_topk_warp_thread(block, thread, s, op)


def launch_expand_topk[
    emulate_gpu: Bool
](op: ExpandTopK, ctx: DeviceContext) raises:
    """Launches the GPU kernel for `op`'s row width (on a GPU, or emulated):
    `ExpandTopKKernel` up to `GPU_EXPAND_SHARED_IDS` ids a row, else
    `ExpandTopKWarpKernel`."""
    comptime if op.pool_topk <= GPU_EXPAND_SHARED_IDS:
        launch_kernel[ExpandTopKKernel[type_of(op)], emulate_gpu](op, ctx)
    else:
        launch_kernel[ExpandTopKWarpKernel[type_of(op)], emulate_gpu](op, ctx)


@extensibility.register("mo.mla.kpool.expand_topk")
struct MLAKPoolExpandTopK:
    """Registers the `mo.mla.kpool.expand_topk` graph op (CPU and GPU)."""

    @staticmethod
    def execute[
        *,
        kpool: Int,
        pool_topk: Int,
        always_select_tail: Bool,
        emulate_gpu: Bool = False,
        target: StaticString,
    ](
        positions: OutputTensor[dtype=DType.int32, rank=2, ...],
        pool_ids: InputTensor[rank=2, ...],
        input_row_offsets: InputTensor[rank=1, ...],
        cache_lengths: InputTensor[rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        """Expands each token row's selected pool ids into token positions.

        Parameters:
            kpool: Tokens per pool (at least 1).
            pool_topk: Selected pools per token row (`pool_ids.shape[1]`).
            always_select_tail: Append the `visible % kpool` newest
                positions after the pools (the output is `kpool - 1`
                columns wider).
            emulate_gpu: Run the GPU kernel's threads over an emulated grid
                on a CPU target (testing; slow). MAX's wrapper never sets
                it, so its graphs get the CPU kernel.
            target: "cpu" or "gpu", filled in by the graph compiler.

        Args:
            positions: Output `[total_tokens, pool_topk * kpool + tail]`
                int32 token positions, packed, `-1` where unused (`tail` is
                `kpool - 1` with `always_select_tail`, else 0).
            pool_ids: `[total_tokens, pool_topk]` selected pool ids in
                selection order, `-1` where fewer were selected (int32 by
                MAX's convention; any integer dtype is read).
            input_row_offsets: `[batch + 1]` token row offsets (uint32, or
                another integer dtype).
            cache_lengths: `[batch]` cached-prefix length per request.
            ctx: Device context.

        Raises:
            Error: If `kpool < 1`, or naming the operand and both shapes
                if an operand's shape disagrees with `pool_topk`, the row
                width or the batch (the Python API rejects those before the
                graph is built).
        """
        comptime width = row_width[kpool, pool_topk, always_select_tail]()
        var total_tokens = pool_ids.dim_size(0)
        var batch = cache_lengths.dim_size(0)
        comptime OP = "mo.mla.kpool.expand_topk"
        comptime if kpool < 1 or pool_topk < 0:
            raise Error(
                OP,
                ": kpool must be at least 1 and pool_topk at least 0, got",
                " kpool=",
                kpool,
                ", pool_topk=",
                pool_topk,
            )
        expect_shape(
            OP,
            "pool_ids",
            pool_ids.shape(),
            "total_tokens, pool_topk",
            dims(ANY, pool_topk),
        )
        expect_shape(
            OP,
            "positions",
            positions.shape(),
            "total_tokens, pool_topk * kpool + tail",
            dims(total_tokens, width),
        )
        expect_offsets(
            OP, "input_row_offsets", input_row_offsets.shape(), batch
        )
        expect_target[emulate_gpu, target](OP)
        var op = ExpandTopKOperands[
            pool_ids.dtype,
            input_row_offsets.dtype,
            cache_lengths.dtype,
            kpool,
            pool_topk,
            always_select_tail,
            MutAnyOrigin,
        ](
            positions.unsafe_ptr(),
            pool_ids.unsafe_ptr(),
            input_row_offsets.unsafe_ptr(),
            cache_lengths.unsafe_ptr(),
            batch,
            total_tokens,
        )
        comptime if target == "cpu" and not emulate_gpu:
            expand_topk_cpu(op)
        else:
            launch_expand_topk[emulate_gpu](op, ctx)
