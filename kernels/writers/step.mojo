"""`mla_kpool.step`: one call's k-pool work in one op.

Does, in one op, what `ring_close`, the `pool_row_offsets` helper,
`compress` and `seed_tail` do in sequence for one serving call, with the
same outputs bit for bit (on the same device) and the same ring writes:

- `ring_pooled[b]`, `ring_closed_pool[b]`: request `b`'s pending pool,
  closed from the ring and this call's leading rows (`ring_close`);
- `pool_row_offsets [batch + 1]` uint32: the exclusive prefix sum of each
  request's count of pools made only of this call's rows,
  `max(0, (c + n) // kpool - ceil(c / kpool))`, zero when
  `n = input_row_offsets[b+1] - input_row_offsets[b]` or `c` is negative,
  summed in 64 bits and stored modulo 2^32 (what the graph helper computes);
- `first_pool[b]` int64: `ceil(c / kpool)` (floor division of
  `c + kpool - 1`, so a negative `c` rounds down as the graph's does);
- `pooled [total_tokens // kpool, head_dim]`: those pools, written by
  output row exactly as `compress` writes them given `pool_row_offsets`;
- the ring `tail`: each request's trailing tokens stashed (`seed_tail`).

Every request's pending pool is read from the ring before that request's
tokens are written into it, inside the op, so callers cannot order the
writers wrongly. Two requests of one call on the same ring slot are a
caller error with no defined result (as with the separate writers).

The op derives compress's and seed_tail's operands from ring_close's
(`StepOperands`) and runs the writers' own code on them (`step_cpu`,
`step_thread`): the paths cannot drift. A GPU runs two launches in stream
order: `StepScanKernel` (the prefix sum of pool counts, the only dependency
across requests), then `StepKernel`.
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from max.gpu.host import DeviceContext
from std.math import ceildiv, min
from std.memory import bitcast
from std.reflection import call_location
from std.sys import num_physical_cores, size_of

from .compress import CompressOperands, compress_lane, compress_rows
from ..grid.operands import (
    KernelOperands,
    dims,
    expect_offsets,
    expect_pool_rows,
    expect_shape,
    expect_target,
)
from ..grid.block_phases import (
    BLOCK_EXCLUSIVE_SUM,
    Lane,
    Shared,
)
from ..grid.collectives import thread_run
from ..grid.gpu_kernel import GpuKernel, NoState, launch_kernel
from ..grid.parallel import cpu_for_each_range
from ..grid.phases import Phase, Phases
from ..grid.shared_buffer import Buffer
from .gpu_rows import (
    RowLane,
    gpu_rows_per_block,
    gpu_writer_threads,
    row_lane,
)
from ..grid.ragged import Field, Ptr, full_pools, read_index
from .ring_close import (
    RingCloseOperands,
    close_requests,
    ring_close_lane,
    ring_close_operands,
)
from .seed_tail import SeedTailOperands, seed_requests, seed_tail_lane


@fieldwise_init
struct StepOperands[
    dtype: DType,
    offset_dtype: DType,
    length_dtype: DType,
    slot_dtype: DType,
    kpool: Int,
    head_dim: Int,
    origin: MutOrigin,
](KernelOperands):
    """One step call: ring_close's operands and the step's own outputs.

    `close.pooled` is the op's `ring_pooled`; `compress_of` and `seed_of`
    derive the other writers' operands from `close`, so every input
    pointer is held once. Parameters are those of `RingCloseOperands`.
    """

    var close: RingCloseOperands[
        Self.dtype,
        Self.offset_dtype,
        Self.length_dtype,
        Self.slot_dtype,
        Self.kpool,
        Self.head_dim,
        Self.origin,
    ]
    """Operands of ring_close, and every input of the step."""
    var pooled: Field[Self.dtype, Self.origin]
    """Output `[out_rows, head_dim]`: compress's pools."""
    var pool_row_offsets: Field[DType.uint32, Self.origin]
    """Output `[batch + 1]` uint32, written by the scan, read by compress."""
    var first_pool: Field[DType.int64, Self.origin]
    """Output `[batch]` int64."""
    var out_rows: Int
    """Rows of `pooled`."""


comptime Step = StepOperands[..., origin=MutAnyOrigin]
"""`StepOperands` over the kernels' raw tensor pointers."""


@always_inline
def compress_of(
    op: Step,
) -> CompressOperands[
    op.dtype,
    op.offset_dtype,
    DType.uint32,
    op.length_dtype,
    op.kpool,
    op.head_dim,
    MutAnyOrigin,
]:
    """Compress's operands over the step's call."""
    return {
        pooled = op.pooled,
        ape = op.close.ape,
        pool_row_offsets = op.pool_row_offsets,
        call = op.close.call,
        out_rows = op.out_rows,
    }


@always_inline
def seed_of(
    op: Step,
) -> SeedTailOperands[
    op.dtype,
    op.offset_dtype,
    op.length_dtype,
    op.slot_dtype,
    op.kpool,
    op.head_dim,
    MutAnyOrigin,
]:
    """Seed_tail's operands over the step's call."""
    return {call = op.close.call, ring = op.close.ring}


@always_inline
def pool_count[kpool: Int](n: Int, c: Int) -> Int:
    """A request's count in `pool_row_offsets` from its new rows `n` and
    cache length `c` (the graph helper's rule): 0 when either is negative.
    """
    if n < 0 or c < 0:
        return 0
    return full_pools[kpool](c, n).count


@always_inline
def step_pool_count(op: Step, b: Int) -> Int:
    """Request `b`'s count in `pool_row_offsets` (`pool_count`).

    The span is not checked against `total_tokens` (the helper cannot see
    it): a request whose rows lie past the call's counts its pools, and
    compress then writes zeros for them.
    """
    var offsets = op.close.call.input_row_offsets
    var n = read_index(offsets, b + 1) - read_index(offsets, b)
    return pool_count[op.kpool](n, read_index(op.close.call.cache_lengths, b))


@always_inline
def first_pool_id(op: Step, b: Int) -> Int64:
    """`first_pool[b]`: `(c + kpool - 1) // kpool`, rounded down."""
    var c = read_index(op.close.call.cache_lengths, b)
    return Int64((c + op.kpool - 1) // op.kpool)


@always_inline
def write_first_pool(op: Step, b: Int):
    """Writes `first_pool[b]` (`first_pool_id`), on the CPU."""
    op.first_pool[unsafe_offset=b] = first_pool_id(op, b)


def scan_pool_rows(op: Step):
    """Writes `pool_row_offsets[0..batch]`, serially (CPU and GPU).

    The 64-bit prefix sum of `step_pool_count`, stored modulo 2^32.
    """
    var total = 0
    op.pool_row_offsets[unsafe_offset=0] = 0
    for b in range(op.close.call.batch):
        total += step_pool_count(op, b)
        op.pool_row_offsets[unsafe_offset=b + 1] = UInt32(total)


def step_cpu(op: Step):
    """CPU step: the scan, then one parallel region for everything else.

    It runs the writers' code over ranges: `close_requests`,
    `compress_rows` and `seed_requests`. The scan runs on the calling
    thread. Then part `i` of
    `num_physical_cores()` equal parts is a range of requests (closed, then
    seeded) and a range of output rows (compressed): an equal share of the
    rows before `pool_row_offsets[batch]` and of those after. The separate
    writers wake the cores three times; this wakes them once.
    """
    scan_pool_rows(op)
    var batch = op.close.call.batch
    var out_rows = op.out_rows
    var parts = num_physical_cores()
    # Rows past the last pool are only zeroed (the row count is an upper
    # bound): each part gets a share of the pooled rows and one of the rest,
    # or the first part would pool them all. Every row is written once.
    var used = min(max(read_index(op.pool_row_offsets, batch), 0), out_rows)
    var spare = out_rows - used

    def run_parts(lo: Int, hi: Int) {imm}:
        for part in range(lo, hi):
            var b0 = batch * part // parts
            var b1 = batch * (part + 1) // parts
            # A request's ring slot is read (closed) before it is written.
            close_requests(op.close, b0, b1)
            for b in range(b0, b1):
                write_first_pool(op, b)
            var compress = compress_of(op)
            compress_rows(
                compress, used * part // parts, used * (part + 1) // parts
            )
            compress_rows(
                compress,
                used + spare * part // parts,
                used + spare * (part + 1) // parts,
            )
            seed_requests(seed_of(op), b0, b1)

    # Pooling work only, on the scale of the ops it replaces (ring_close's
    # batch * kpool, compress's out_rows * kpool): seeding copies a few rows
    # per request, an order of magnitude cheaper per element than pooling.
    var work = (batch + out_rows) * op.kpool * op.head_dim
    cpu_for_each_range(parts, work, run_parts)


comptime SCAN_THREADS = 1024
"""Threads of the scan launch's one block: a run of request quads each."""


comptime SCAN_QUAD = 4
"""Requests a thread reads with one vector load of each tensor."""


comptime SCAN_PHASES = Phases(
    Phase("stage"), Phase("count", BLOCK_EXCLUSIVE_SUM), Phase("write")
)
"""The scan's phases: each run's first offset staged for the run before
it, each run's pool count offered to a block exclusive prefix sum, then
the run's offsets written from its prefix."""


struct ScanRun(Copyable, TrivialRegisterPassable):
    """One scan thread's run of request quads (`SCAN_QUAD` requests each,
    quad `q` holding requests `4 q ..< 4 q + 4`) and how it reads them.

    A warp's lanes read neighbouring quads, a vector load each (every
    sector used whole); the offset that ends a run's last quad starts
    the next run's first, which the next thread stages in shared memory
    (`run_starts`: its low words, then its high words) for the count.
    """

    var thread: Int
    """The thread, `0 ..< SCAN_THREADS`."""
    var first: Int
    """The run's first quad."""
    var end: Int
    """One past its last quad."""
    var quads: Int
    """Quads of the batch, `ceil(batch / 4)`."""
    var aligned: Bool
    """Whether the offsets, the cache lengths and `pool_row_offsets` start
    on 16 bytes (a whole quad is then one vector access of each)."""

    def __init__(out self, thread: Int, op: Step):
        """Thread `thread`'s run of `op`'s batch."""
        var call = op.close.call
        self.thread = thread
        self.quads = ceildiv(call.batch, SCAN_QUAD)
        var run = thread_run(thread, SCAN_THREADS, self.quads)
        self.first = run[0]
        self.end = run[1]
        self.aligned = (
            (Int(call.input_row_offsets) & 15) == 0
            and (Int(call.cache_lengths) & 15) == 0
            and (Int(op.pool_row_offsets) & 15) == 0
        )


@always_inline
def _index_quad[
    dtype: DType
](s: Shared, ptr: Ptr[dtype], q: Int, entries: Int, aligned: Bool) -> SIMD[
    dtype, SCAN_QUAD
]:
    """Entries `4 q ..< 4 q + 4` of an index tensor of `entries` (0 past
    its end; a vector load when aligned and whole), at the caller's site."""
    var site = call_location()
    var at = SCAN_QUAD * q
    if aligned and at + SCAN_QUAD <= entries:
        comptime bytes = SCAN_QUAD * size_of[dtype]()
        return s.global_load_at[width=SCAN_QUAD, alignment=min(bytes, 16)](
            site, ptr, at
        )
    var out = SIMD[dtype, SCAN_QUAD](0)
    comptime for l in range(SCAN_QUAD):
        if at + l < entries:
            out[l] = s.global_load_at(site, ptr, at + l)
    return out


@always_inline
def _run_starts(s: Shared) -> Buffer["run_starts"]:
    """Each thread's first offset (64 bits): low words, then high words."""
    return Buffer["run_starts"](s, 0, 2 * SCAN_THREADS)


@always_inline
def _stage_run_start(s: Shared, run: ScanRun, op: Step):
    """Stages the offset that starts this thread's run, the previous
    run's end."""
    if run.first >= run.end:
        return
    var batch = op.close.call.batch
    var start = _index_quad(
        s, op.close.call.input_row_offsets, run.first, batch + 1, run.aligned
    )[0]
    var words = bitcast[DType.uint32, 2](Int64(Int(start)))
    _run_starts(s).store(run.thread, words[0])
    _run_starts(s).store(SCAN_THREADS + run.thread, words[1])


@always_inline
def _run_end(s: Shared, run: ScanRun, op: Step) -> Int:
    """The offset that ends this thread's run (`ragged.read_index`'s
    value): the next run's first (staged), or `offsets[batch]` after the
    batch's last whole quad."""
    var batch = op.close.call.batch
    if run.end < run.quads:
        var words = SIMD[DType.uint32, 2](
            _run_starts(s).load(run.thread + 1),
            _run_starts(s).load(SCAN_THREADS + run.thread + 1),
        )
        return Int(bitcast[DType.int64, 1](words))
    if SCAN_QUAD * run.end <= batch:
        return Int(s.global_load(op.close.call.input_row_offsets, batch))
    return 0  # ends no request of the batch


@always_inline
def _quad_counts(
    s: Shared,
    run: ScanRun,
    op: Step,
    q: Int,
    starts: SIMD[op.offset_dtype, SCAN_QUAD],
    next_start: Int,
) -> SIMD[DType.uint32, SCAN_QUAD]:
    """Quad `q`'s pool counts (`pool_count`) modulo 2^32, 0 past the batch,
    from its requests' starts and the start after them.

    The offsets keep only their sum modulo 2^32, so 32-bit counts that
    wrap as they add give the words of `scan_pool_rows`'s 64-bit sums.
    With 4-byte metadata the count is worked in 32 bits: for `c = a kpool
    + r` and `n >= 0`, `(c + n) // kpool - ceil(c / kpool)` is `n // kpool
    + (r + n % kpool) // kpool - (1 if r > 0 else 0)`, no term past `n`
    (the 64-bit form takes twice the registers, past the 64 a thread of
    a 1,024-thread block may have); 8-byte metadata takes `pool_count`.
    """
    comptime K = op.kpool
    var batch = op.close.call.batch
    var c = _index_quad(s, op.close.call.cache_lengths, q, batch, run.aligned)
    var ends = starts.shift_left[1]()
    ends[SCAN_QUAD - 1] = Scalar[op.offset_dtype](next_start)
    var out = SIMD[DType.uint32, SCAN_QUAD](0)
    comptime if size_of[op.offset_dtype]() == 4 and size_of[
        op.length_dtype
    ]() == 4:
        var spans = ends.ge(starts) & c.ge(0)
        var n = ends.cast[DType.uint32]() - starts.cast[DType.uint32]()
        var r = (c % Scalar[op.length_dtype](K)).cast[DType.uint32]()
        var whole = n // UInt32(K) + (r + n % UInt32(K)) // UInt32(K)
        var started = r.gt(0).cast[DType.uint32]()  # ceil's extra pool
        out = (spans & whole.gt(started)).select(
            whole - started, SIMD[DType.uint32, SCAN_QUAD](0)
        )
    else:
        comptime for l in range(SCAN_QUAD):
            var n = Int(ends[l]) - Int(starts[l])
            out[l] = UInt32(pool_count[K](n, Int(c[l])) & 0xFFFFFFFF)
    comptime for l in range(SCAN_QUAD):
        if SCAN_QUAD * q + l >= batch:
            out[l] = 0
    return out


@always_inline
def _write_quad(
    s: Shared,
    run: ScanRun,
    op: Step,
    q: Int,
    before: UInt32,
    counts: SIMD[DType.uint32, SCAN_QUAD],
):
    """Writes `pool_row_offsets[4 q ..< 4 q + 4]` (those up to `batch`):
    the prefix before each request of quad `q`, modulo 2^32."""
    var prefix = SIMD[DType.uint32, SCAN_QUAD](0)
    var total = before
    comptime for l in range(SCAN_QUAD):
        prefix[l] = total
        total += counts[l]
    var at = SCAN_QUAD * q
    var entries = op.close.call.batch + 1
    if run.aligned and at + SCAN_QUAD <= entries:
        s.global_store[width=SCAN_QUAD, alignment=16](
            op.pool_row_offsets, at, prefix
        )
        return
    comptime for l in range(SCAN_QUAD):
        if at + l < entries:
            s.global_store(op.pool_row_offsets, at + l, prefix[l])


@always_inline
def _write_batch_end(s: Shared, run: ScanRun, op: Step, total: UInt32):
    """Writes `pool_row_offsets[batch]` where no quad holds it (the batch
    fills its last quad, or has no request): the run that ends the batch
    writes its total, thread 0 a 0 for no request."""
    var at = SCAN_QUAD * run.quads
    if at != op.close.call.batch:
        return
    if run.first < run.end and run.end == run.quads:
        s.global_store(op.pool_row_offsets, at, total)
    elif run.quads == 0 and run.thread == 0:
        s.global_store(op.pool_row_offsets, 0, UInt32(0))


def step_scan_phase[
    phase: Int
](thread: Int, mut lane: Lane, s: Shared, op: Step):
    """One thread of launch 1 (`StepScanKernel`), phase `phase`.

    `kpool_step_scan_kernel`, one block of `SCAN_THREADS` threads writing
    `pool_row_offsets`: each thread sums the pool counts of a contiguous
    run of request quads (`ScanRun`), a block exclusive prefix sum
    (`block_phases`) gives each run its start, and each thread writes its
    run's offsets. The critical path is a run and the collective, not
    the batch (a run is one quad up to a batch of 4,096). The CPU path
    scans serially (`scan_pool_rows`); the two agree bit for bit (sums
    stored modulo 2^32).

    Loads and stores are a quad a lane (16 bytes of 4-byte metadata on
    16 bytes; a load an element off them and in a partial quad), every
    sector whole, for the `stage` phase's barrier and registers near the
    64 the launch bound of a 1,024-thread block allows (`gpu-report`);
    one block runs, so occupancy does not matter.

    `stage`: each thread stages its run's first offset. `count`: it
    offers its run's pool count (modulo 2^32) to the block's
    exclusive prefix sum. `write`: from that prefix it writes
    `pool_row_offsets[4 q ..< 4 q + 4]` (those up to `[batch]`) for each
    quad `q` of its run, the prefix before each request; `[batch]` past
    the last quad by the last run (thread 0 writes `[0]` for no request).
    """
    var run = ScanRun(thread, op)
    var offsets = op.close.call.input_row_offsets
    var entries = op.close.call.batch + 1
    comptime if SCAN_PHASES.named(phase, "stage"):
        _stage_run_start(s, run, op)
        return
    # Sums modulo 2^32 (`_quad_counts`); the block's sum in 64 bits.
    var total: UInt32 = 0
    comptime if SCAN_PHASES.named(phase, "write"):
        total = UInt32(lane.result() & 0xFFFFFFFF)
    for q in range(run.first, run.end):
        var starts = _index_quad(s, offsets, q, entries, run.aligned)
        var next_start: Int
        if q + 1 < run.end:  # the next quad's first, from L1
            next_start = Int(
                _index_quad(s, offsets, q + 1, entries, run.aligned)[0]
            )
        else:
            next_start = _run_end(s, run, op)
        var counts = _quad_counts(s, run, op, q, starts, next_start)
        comptime if SCAN_PHASES.named(phase, "write"):
            _write_quad(s, run, op, q, total, counts)
        total += counts.reduce_add()
    comptime if SCAN_PHASES.named(phase, "count"):
        lane.offer(UInt64(total))
    else:
        _write_batch_end(s, run, op, total)


def step_thread(block: Int, thread: Int, s: Shared, op: Step):
    """One GPU thread of launch 2 (`StepKernel`): a request or a row.

    Row `r < batch` of the launch's row space (`gpu_rows.row_lane`):
    `ring_close_lane`, then `seed_tail_lane` (the same channels, so each
    ring channel is read before the same thread overwrites it) and, on the
    request's first thread, `first_pool[r]`. Row `batch + i`:
    `compress_lane` for output row `i`. Global memory goes through the
    thread's view `s` (recorded in a profiled emulation).
    """
    var lane = row_lane[op.dtype, op.head_dim](block, thread)
    var batch = op.close.call.batch
    if lane.row < batch:
        ring_close_lane(lane, s, op.close)
        seed_tail_lane(lane, s, seed_of(op))
        if lane.first == 0:
            s.global_store(op.first_pool, lane.row, first_pool_id(op, lane.row))
            s.note_global_load(op.close.call.cache_lengths, lane.row)
    elif lane.row < batch + op.out_rows:
        compress_lane(
            RowLane(lane.row - batch, lane.first, lane.stride),
            s,
            compress_of(op),
        )


struct StepScanKernel[Op: type_of(Step)](GpuKernel):
    """The step's launch 1: one block scans the batch (`step_scan_phase`)."""

    comptime Operands = Self.Op
    comptime name = "kpool_step_scan_kernel"
    comptime State = NoState
    comptime block_threads = SCAN_THREADS
    comptime shared_words = 2 * SCAN_THREADS
    comptime phase_table = SCAN_PHASES
    comptime grid_rows = "1"

    @staticmethod
    def rows(op: Self.Operands) -> Int:
        """One."""
        return 1

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
        """`step_scan_phase`."""
        step_scan_phase[phase](thread, lane, s, op)


struct StepKernel[Op: type_of(Step)](GpuKernel):
    """The step's launch 2: requests then output rows, as many per block as
    `gpu_rows.gpu_rows_per_block`, 4 channels per thread.

    `kpool_step_kernel` over `batch + total_tokens // kpool` rows, several
    per block (`gpu_rows`: 4 channels per thread). Row `b <
    batch` closes request `b` and then seeds it: the thread that pools
    channels `ch` from the ring is the one that later overwrites channels
    `ch` of that ring slot, so reading before writing needs no barrier. Row
    `batch + i` writes output row `i`, finding its owner by binary search
    over the offsets launch 1 wrote. Folding the scan into this launch would
    make every compress row redo it.
    """

    comptime Operands = Self.Op
    comptime name = "kpool_step_kernel"
    comptime block_threads = gpu_writer_threads[
        Self.Op.dtype, Self.Op.head_dim
    ]()
    comptime grid_rows = "batch + out_rows"
    comptime rows_per_block = gpu_rows_per_block[
        Self.Op.dtype, Self.Op.head_dim
    ]()

    @staticmethod
    def rows(op: Self.Operands) -> Int:
        """Requests plus output rows."""
        return op.close.call.batch + op.out_rows

    @staticmethod
    def run(phase: Int, block: Int, thread: Int, s: Shared, op: Self.Operands):
        """`step_thread`."""
        step_thread(block, thread, s, op)


@extensibility.register("mla_kpool.step")
struct MLAKPoolStep:
    """Registers the fused `mla_kpool.step` graph op (CPU and GPU)."""

    @staticmethod
    def execute[
        *,
        head_dim: Int,
        kpool: Int,
        emulate_gpu: Bool = False,
        target: StaticString,
    ](
        ring_pooled: OutputTensor[rank=2, ...],
        ring_closed_pool: OutputTensor[dtype=DType.int32, rank=1, ...],
        pooled: OutputTensor[dtype=ring_pooled.dtype, rank=2, ...],
        pool_row_offsets: OutputTensor[dtype=DType.uint32, rank=1, ...],
        first_pool: OutputTensor[dtype=DType.int64, rank=1, ...],
        tail: MutableInputTensor[dtype=ring_pooled.dtype, rank=4, ...],
        k: InputTensor[dtype=ring_pooled.dtype, rank=2, ...],
        gate: InputTensor[dtype=ring_pooled.dtype, rank=2, ...],
        ape: InputTensor[dtype=DType.float32, rank=2, ...],
        input_row_offsets: InputTensor[rank=1, ...],
        cache_lengths: InputTensor[rank=1, ...],
        slot_idx: InputTensor[rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        """Closes, counts, compresses and seeds one call's pools in one op.

        Parameters:
            head_dim: Channels per key; also the GPU block width (capped at
                1024, threads then stride over channels).
            kpool: Tokens per pool.
            emulate_gpu: Run the GPU kernels' threads over an emulated grid
                on a CPU target (testing; slow).
            target: "cpu" or "gpu", filled in by the graph compiler.

        Args:
            ring_pooled: Output `[batch, head_dim]`, dtype of `k`: the pool
                each request closed from the ring, zero where none.
            ring_closed_pool: Output `[batch]` int32: its pool id, or -1.
            pooled: Output `[total_tokens // kpool, head_dim]`, dtype of
                `k`: the pools made only of this call's rows, request `b`'s
                from row `pool_row_offsets[b]`; other rows zero.
            pool_row_offsets: Output `[batch + 1]` uint32: the exclusive
                prefix sum of each request's count of those pools.
            first_pool: Output `[batch]` int64: `ceil(cache_lengths[b] /
                kpool)`, the pool id at row `pool_row_offsets[b]`.
            tail: `[max_slots, 2, R, head_dim]` ring (plane 0 keys, plane 1
                gate scores; R = kpool, or a multiple of it), read for
                closing and then written with each request's trailing
                tokens.
            k: `[total_tokens, head_dim]` this call's keys.
            gate: `[total_tokens, head_dim]` this call's gate scores.
            ape: `[kpool, head_dim]` float32 within-pool position embedding.
            input_row_offsets: `[batch + 1]` token row offsets (uint32, or
                another integer dtype).
            cache_lengths: `[batch]` cached-prefix length per request.
            slot_idx: `[batch]` ring slot per request.
            ctx: Device context.

        Raises:
            Error: Naming the operand and both shapes, if an operand's
                shape disagrees with `head_dim`, `kpool` or the batch (the
                Python API rejects those before the graph is built).
                Also if `emulate_gpu` is set for a GPU target.
        """
        comptime OP = "mla_kpool.step"
        var batch = ring_closed_pool.dim_size(0)
        expect_pool_rows[kpool](
            OP, "pooled", pooled.shape(), head_dim, k.dim_size(0)
        )
        expect_offsets(OP, "pool_row_offsets", pool_row_offsets.shape(), batch)
        expect_shape(OP, "first_pool", first_pool.shape(), "batch", dims(batch))
        var op = StepOperands(
            ring_close_operands[kpool, head_dim](
                OP,
                "ring_pooled",
                ring_pooled,
                ring_closed_pool,
                tail,
                k,
                gate,
                ape,
                input_row_offsets,
                cache_lengths,
                slot_idx,
            ),
            pooled.unsafe_ptr(),
            pool_row_offsets.unsafe_ptr(),
            first_pool.unsafe_ptr(),
            pooled.dim_size(0),
        )
        expect_target[emulate_gpu, target](OP)
        comptime if target == "cpu" and not emulate_gpu:
            step_cpu(op)
        else:

            launch_kernel[StepScanKernel[type_of(op)], emulate_gpu](op, ctx)
            launch_kernel[StepKernel[type_of(op)], emulate_gpu](op, ctx)
