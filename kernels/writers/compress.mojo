"""`mo.mla.kpool.compress`: pool every pool made entirely of this call's tokens.

Request `b` (64-bit arithmetic, `start`, `n`, `c` as in `ring_close`) builds
pools `P` from `first = ceil(c / kpool)` up to `floor((c + n) / kpool)`
(exclusive); member `q` of pool `P` is row `start + P * kpool + q - c` of `k`
and `gate`, and pool `P` lands at output row
`pool_row_offsets[b] + P - first`.

The kernel walks output rows, not requests: row `i` belongs to the request
`b` with `pool_row_offsets[b] <= i < pool_row_offsets[b + 1]`, and holds that
request's pool `first + (i - pool_row_offsets[b])` if the request has that
many pools, else zeros. Rows outside every span (past
`pool_row_offsets[batch]` in particular) are zero. So every row is written
exactly once, whatever `pool_row_offsets` says, and nothing can land outside
the output: offsets that disagree with the true counts truncate a request's
pools to its own span. Offsets that decrease make the row-to-request mapping
unspecified (each row still holds zeros or some request's pool).
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from max.gpu.host import DeviceContext
from std.sys import is_gpu

from ..grid.operands import (
    KernelOperands,
    dims,
    expect_offsets,
    expect_pool_rows,
    expect_rows,
    expect_shape,
    expect_target,
)
from ..grid.block_phases import PROFILE_BUILD, Shared
from ..grid.gpu_kernel import GpuKernel, launch_kernel
from ..grid.parallel import cpu_for_each_range
from .gpu_rows import (
    RowLane,
    gpu_aligned,
    gpu_rows_per_block,
    gpu_writer_threads,
    note_last_span_at,
    profiled,
    row_lane,
)
from .pooling import PoolMembers, cpu_pool_row, gpu_pool_row, zero_row
from ..grid.ragged import (
    Field,
    RaggedCall,
    full_pools,
    last_span_at,
    read_index,
    token_span,
)


@fieldwise_init
struct CompressOperands[
    dtype: DType,
    offset_dtype: DType,
    pool_offset_dtype: DType,
    length_dtype: DType,
    kpool: Int,
    head_dim: Int,
    origin: MutOrigin,
](KernelOperands):
    """One compress call: its tensors and sizes (see `execute`).

    Parameters:
        dtype: Key dtype of `pooled`, `k`, `gate`.
        offset_dtype: Integer dtype of `input_row_offsets`.
        pool_offset_dtype: Integer dtype of `pool_row_offsets`.
        length_dtype: Integer dtype of `cache_lengths`.
        kpool: Tokens per pool.
        head_dim: Channels per key.
        origin: Origin of the tensor pointers (`MutAnyOrigin` in kernels).
    """

    var pooled: Field[Self.dtype, Self.origin]
    """Output `[out_rows, head_dim]`."""
    var ape: Field[DType.float32, Self.origin]
    """`[kpool, head_dim]` float32."""
    var pool_row_offsets: Field[Self.pool_offset_dtype, Self.origin]
    """`[batch + 1]` pool row offsets."""
    var call: RaggedCall[
        Self.dtype, Self.offset_dtype, Self.length_dtype, Self.origin
    ]
    """The new rows and per-request metadata."""
    var out_rows: Int
    """Rows of `pooled` (at most `total_tokens // kpool`)."""


comptime Compress = CompressOperands[..., origin=MutAnyOrigin]
"""`CompressOperands` over the kernels' raw tensor pointers."""


@always_inline
def owner(last_span: Int, batch: Int) -> Int:
    """The request owning a row whose last span start is `last_span`, or -1.

    -1 (before the first span) and `batch` (past the last) own nothing.
    """
    return last_span if last_span < batch else -1


@always_inline
def pool_row_of(op: Compress, b: Int, row: Int) -> Int:
    """First `k` row of the pool request `b` writes at output `row`, or -1.

    -1 when the row lies past the request's pools, before its span, or the
    request's metadata does not address this call's rows.
    """
    if b < 0:
        return -1
    var span = token_span(op.call.input_row_offsets, b, op.call.total_tokens)
    var c = read_index(op.call.cache_lengths, b)
    var j = row - read_index(op.pool_row_offsets, b)
    if (
        not span.ok
        or c < 0
        or j < 0
        or row >= read_index(op.pool_row_offsets, b + 1)
    ):
        return -1
    var pools = full_pools[op.kpool](c, span.n)
    if j >= pools.count:
        return -1
    return span.start + (pools.first + j) * op.kpool - c


def compress_rows(op: Compress, lo: Int, hi: Int):
    """Writes output rows `[lo, hi)` on the calling core (CPU).

    Finds the owner of row `lo` by binary search, then walks forward;
    pools through `cpu_pool_row`, prefetching the next pool's gate rows.
    """
    comptime head_dim = op.head_dim
    if lo >= hi:
        return
    var last = last_span_at(op.pool_row_offsets, op.call.batch, lo)
    for row in range(lo, hi):
        # Rows ascend, so the span start only moves forward.
        while (
            last < op.call.batch
            and read_index(op.pool_row_offsets, last + 1) <= row
        ):
            last += 1
        var first = pool_row_of(op, owner(last, op.call.batch), row)
        var dest = op.pooled.unsafe_offset(row * head_dim)
        if first < 0:
            zero_row[op.dtype, head_dim](dest)
            continue
        var member0 = first * head_dim
        cpu_pool_row[op.dtype, op.kpool, head_dim](
            PoolMembers[op.dtype].new_rows(op.call.k, op.call.gate, member0),
            op.ape,
            dest,
            PoolMembers[op.dtype].new_rows(
                op.call.k, op.call.gate, member0 + op.kpool * head_dim
            ),
        )


def compress_cpu(op: Compress):
    """CPU compress: output rows split evenly across the cores.

    Each core finds the owner of its first row by binary search, then
    walks forward (`compress_rows`), so a long prefill and many short
    decodes balance alike.
    """

    def write_rows(lo: Int, hi: Int) {imm}:
        compress_rows(op, lo, hi)

    cpu_for_each_range(
        op.out_rows, op.out_rows * op.kpool * op.head_dim, write_rows
    )


@always_inline
def note_pool_row_of(s: Shared, op: Compress, b: Int, row: Int):
    """Records `pool_row_of(op, b, row)`'s metadata reads (host code only,
    when profiled: its conditions evaluated again)."""
    comptime if PROFILE_BUILD:
        comptime if not is_gpu():
            if b < 0 or not profiled(s):
                return
            s.note_span(op.call.input_row_offsets, b)
            s.note_global_load(op.call.cache_lengths, b)
            s.note_global_load(op.pool_row_offsets, b)
            var span = token_span(
                op.call.input_row_offsets, b, op.call.total_tokens
            )
            var c = read_index(op.call.cache_lengths, b)
            if span.ok and c >= 0 and row >= read_index(op.pool_row_offsets, b):
                s.note_global_load(op.pool_row_offsets, b + 1)


def compress_lane(lane: RowLane, s: Shared, op: Compress):
    """One GPU thread of compress: its channels of output row `lane.row`.

    Finds the owner of the row by binary search over `pool_row_offsets`
    and writes the thread's channels (`gpu_rows.row_lane`) of the owner's
    pool, or zeros when no request owns the row. The caller skips rows
    past `out_rows`. Global memory goes through the thread's view `s`
    (recorded in a profiled emulation).
    """
    comptime head_dim = op.head_dim
    var row = lane.row
    var b = owner(
        last_span_at(op.pool_row_offsets, op.call.batch, row), op.call.batch
    )
    note_last_span_at(s, op.pool_row_offsets, op.call.batch, row)
    var first = pool_row_of(op, b, row)
    note_pool_row_of(s, op, b, row)
    gpu_pool_row[op.dtype, op.kpool, head_dim](
        lane,
        s,
        PoolMembers[op.dtype].new_rows(
            op.call.k, op.call.gate, max(first, 0) * head_dim
        ),
        op.ape,
        op.pooled.unsafe_offset(row * head_dim),
        first >= 0,
        gpu_aligned(
            Int(op.call.k) | Int(op.call.gate) | Int(op.ape) | Int(op.pooled)
        ),
    )


struct CompressKernel[Op: type_of(Compress)](GpuKernel):
    """The compress launch: `gpu_rows.gpu_rows_per_block` output rows per
    block, 4 channels per thread."""

    comptime Operands = Self.Op
    comptime name = "kpool_compress_kernel"
    comptime block_threads = gpu_writer_threads[
        Self.Op.dtype, Self.Op.head_dim
    ]()
    comptime grid_rows = "out_rows"
    comptime rows_per_block = gpu_rows_per_block[
        Self.Op.dtype, Self.Op.head_dim
    ]()

    @staticmethod
    def rows(op: Self.Operands) -> Int:
        """Output rows."""
        return op.out_rows

    @staticmethod
    def run(phase: Int, block: Int, thread: Int, s: Shared, op: Self.Operands):
        """`compress_lane` for the thread's output row, if any."""
        var lane = row_lane[op.dtype, op.head_dim](block, thread)
        if lane.row < op.out_rows:
            compress_lane(lane, s, op)


@extensibility.register("mo.mla.kpool.compress")
struct MLAKPoolCompress:
    """Registers the `mo.mla.kpool.compress` graph op (CPU and GPU)."""

    @staticmethod
    def execute[
        *,
        head_dim: Int,
        kpool: Int,
        emulate_gpu: Bool = False,
        target: StaticString,
    ](
        pooled: OutputTensor[rank=2, ...],
        k: InputTensor[dtype=pooled.dtype, rank=2, ...],
        gate: InputTensor[dtype=pooled.dtype, rank=2, ...],
        ape: InputTensor[dtype=DType.float32, rank=2, ...],
        input_row_offsets: InputTensor[rank=1, ...],
        pool_row_offsets: InputTensor[rank=1, ...],
        cache_lengths: InputTensor[rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        """Pools every complete pool made only of this call's tokens.

        Parameters:
            head_dim: Channels per key; also the GPU block width (capped at
                1024, threads then stride over channels).
            kpool: Tokens per pool.
            emulate_gpu: Run the GPU kernel's threads over an emulated grid
                on a CPU target (testing; slow). MAX's wrapper never sets
                it, so its graphs get the CPU kernel.
            target: "cpu" or "gpu", filled in by the graph compiler.

        Args:
            pooled: Output `[total_tokens // kpool, head_dim]`, dtype of `k`:
                request `b`'s pools at rows from `pool_row_offsets[b]`; rows
                past `pool_row_offsets[batch]` are zero. The row count is an
                upper bound on the pool count, which is data-dependent.
            k: `[total_tokens, head_dim]` this call's keys.
            gate: `[total_tokens, head_dim]` this call's gate scores.
            ape: `[kpool, head_dim]` float32 within-pool position embedding.
            input_row_offsets: `[batch + 1]` token row offsets.
            pool_row_offsets: `[batch + 1]` exclusive prefix sum of each
                request's pool count.
            cache_lengths: `[batch]` cached-prefix length per request.
            ctx: Device context.

        Raises:
            Error: Naming the operand and both shapes, if an operand's
                shape disagrees with `head_dim`, `kpool` or the batch (the
                Python API rejects those before the graph is built).
        """
        comptime OP = "mo.mla.kpool.compress"
        var batch = cache_lengths.dim_size(0)
        var total_tokens = k.dim_size(0)
        expect_pool_rows[kpool](
            OP, "pooled", pooled.shape(), head_dim, total_tokens
        )
        expect_rows(OP, k.shape(), gate.shape(), head_dim)
        expect_shape(
            OP, "ape", ape.shape(), "kpool, head_dim", dims(kpool, head_dim)
        )
        expect_offsets(
            OP, "input_row_offsets", input_row_offsets.shape(), batch
        )
        expect_offsets(OP, "pool_row_offsets", pool_row_offsets.shape(), batch)
        expect_target[emulate_gpu, target](OP)
        var op = CompressOperands[
            pooled.dtype,
            input_row_offsets.dtype,
            pool_row_offsets.dtype,
            cache_lengths.dtype,
            kpool,
            head_dim,
            MutAnyOrigin,
        ](
            pooled=pooled.unsafe_ptr(),
            ape=ape.unsafe_ptr(),
            pool_row_offsets=pool_row_offsets.unsafe_ptr(),
            call={
                k = k.unsafe_ptr(),
                gate = gate.unsafe_ptr(),
                input_row_offsets = input_row_offsets.unsafe_ptr(),
                cache_lengths = cache_lengths.unsafe_ptr(),
                batch = batch,
                total_tokens = total_tokens,
            },
            out_rows=pooled.dim_size(0),
        )
        comptime if target == "cpu" and not emulate_gpu:
            compress_cpu(op)
        else:

            launch_kernel[CompressKernel[type_of(op)], emulate_gpu](op, ctx)
