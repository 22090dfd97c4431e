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
from max.gpu import block_idx, thread_idx

from .operands import ANY, dims, expect_pool_rows, expect_rows, expect_shape
from .parallel import cpu_for_each_range, emulate_grid, gpu_block_width
from .pooling import PoolMembers, cpu_pool_row, pool_channels
from .ragged import Ptr, full_pools, read_index, token_span


@always_inline
def last_span_at[
    dtype: DType
](pool_row_offsets: Ptr[dtype], batch: Int, row: Int) -> Int:
    """The last `b` in `[0, batch]` with `pool_row_offsets[b] <= row`, else -1.

    A binary search, exact when the offsets never decrease.
    """
    var lo = 0
    var hi = batch + 1
    while lo < hi:
        var mid = (lo + hi) // 2
        if read_index(pool_row_offsets, mid) <= row:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@always_inline
def owner(last_span: Int, batch: Int) -> Int:
    """The request owning a row whose last span start is `last_span`, or -1.

    -1 (before the first span) and `batch` (past the last) own nothing.
    """
    return last_span if last_span < batch else -1


@always_inline
def pool_row_of[
    offset_dtype: DType,
    pool_offset_dtype: DType,
    length_dtype: DType,
    kpool: Int,
](
    input_row_offsets: Ptr[offset_dtype],
    pool_row_offsets: Ptr[pool_offset_dtype],
    cache_lengths: Ptr[length_dtype],
    b: Int,
    row: Int,
    total_tokens: Int,
) -> Int:
    """First `k` row of the pool request `b` writes at output `row`, or -1.

    -1 when the row lies past the request's pools, before its span, or the
    request's metadata does not address this call's rows.
    """
    if b < 0:
        return -1
    var span = token_span(input_row_offsets, b, total_tokens)
    var c = read_index(cache_lengths, b)
    var j = row - read_index(pool_row_offsets, b)
    if (
        not span[2]
        or c < 0
        or j < 0
        or row >= read_index(pool_row_offsets, b + 1)
    ):
        return -1
    var pools = full_pools[kpool](c, span[1])
    if j >= pools[1]:
        return -1
    return span[0] + (pools[0] + j) * kpool - c


def compress_cpu[
    dtype: DType,
    offset_dtype: DType,
    pool_offset_dtype: DType,
    length_dtype: DType,
    kpool: Int,
    head_dim: Int,
](
    pooled: Ptr[dtype],
    k: Ptr[dtype],
    gate: Ptr[dtype],
    ape: Ptr[DType.float32],
    input_row_offsets: Ptr[offset_dtype],
    pool_row_offsets: Ptr[pool_offset_dtype],
    cache_lengths: Ptr[length_dtype],
    batch: Int,
    total_tokens: Int,
    out_rows: Int,
):
    """CPU compress: output rows split evenly across the cores.

    Each core finds the owner of its first row by binary search, then
    walks forward, so a long prefill and many short decodes balance alike.

    Parameters:
        dtype: Key dtype.
        offset_dtype: Integer dtype of `input_row_offsets`.
        pool_offset_dtype: Integer dtype of `pool_row_offsets`.
        length_dtype: Integer dtype of `cache_lengths`.
        kpool: Tokens per pool.
        head_dim: Channels per key.

    Args:
        pooled: Output `[out_rows, head_dim]`.
        k: `[total_tokens, head_dim]` keys.
        gate: `[total_tokens, head_dim]` gate scores.
        ape: `[kpool, head_dim]` float32.
        input_row_offsets: `[batch + 1]` token row offsets.
        pool_row_offsets: `[batch + 1]` pool row offsets.
        cache_lengths: `[batch]` cached-prefix lengths.
        batch: Requests.
        total_tokens: Rows of `k`.
        out_rows: Rows of `pooled` (`total_tokens // kpool`).
    """

    def write_rows(lo: Int, hi: Int) {imm}:
        var last = last_span_at(pool_row_offsets, batch, lo)
        for row in range(lo, hi):
            # Rows ascend, so the span start only moves forward.
            while (
                last < batch and read_index(pool_row_offsets, last + 1) <= row
            ):
                last += 1
            var first = pool_row_of[
                offset_dtype, pool_offset_dtype, length_dtype, kpool
            ](
                input_row_offsets,
                pool_row_offsets,
                cache_lengths,
                owner(last, batch),
                row,
                total_tokens,
            )
            var dest = pooled.unsafe_offset(row * head_dim)
            if first < 0:
                for ch in range(head_dim):
                    dest[unsafe_offset=ch] = 0
                continue
            var member0 = first * head_dim
            cpu_pool_row[dtype, kpool, head_dim](
                PoolMembers[dtype].new_rows(k, gate, member0),
                ape,
                dest,
                PoolMembers[dtype].new_rows(
                    k, gate, member0 + kpool * head_dim
                ),
            )

    cpu_for_each_range(out_rows, out_rows * kpool * head_dim, write_rows)


def compress_thread[
    dtype: DType,
    offset_dtype: DType,
    pool_offset_dtype: DType,
    length_dtype: DType,
    kpool: Int,
    head_dim: Int,
](
    block: Int,
    thread: Int,
    pooled: Ptr[dtype],
    k: Ptr[dtype],
    gate: Ptr[dtype],
    ape: Ptr[DType.float32],
    input_row_offsets: Ptr[offset_dtype],
    pool_row_offsets: Ptr[pool_offset_dtype],
    cache_lengths: Ptr[length_dtype],
    batch: Int,
    total_tokens: Int,
):
    """One GPU thread of compress: output row `block`, channels from `thread`.

    Block `i` finds the owner of output row `i` by binary search over
    `pool_row_offsets` and writes that row: the owner's pool, or zeros when
    no request owns it. Thread `t` writes channels `t`, `t + W`, ... with
    `W = gpu_block_width[head_dim]()`. `kpool_compress_kernel` runs this on
    a GPU, `emulate_grid` on the CPU.

    Parameters and Args are those of `compress_cpu`, plus the launch
    indices `block` and `thread`.
    """
    comptime stride = gpu_block_width[head_dim]()
    var row = block
    var first = pool_row_of[
        offset_dtype, pool_offset_dtype, length_dtype, kpool
    ](
        input_row_offsets,
        pool_row_offsets,
        cache_lengths,
        owner(last_span_at(pool_row_offsets, batch, row), batch),
        row,
        total_tokens,
    )
    var dest = pooled.unsafe_offset(row * head_dim)
    var member0 = max(first, 0) * head_dim
    for ch in range(thread, head_dim, stride):
        if first < 0:
            dest[unsafe_offset=ch] = 0
        else:
            dest[unsafe_offset=ch] = pool_channels[dtype, 1, kpool](
                PoolMembers[dtype].new_rows(k, gate, member0), ape, head_dim, ch
            )


def kpool_compress_kernel[
    dtype: DType,
    offset_dtype: DType,
    pool_offset_dtype: DType,
    length_dtype: DType,
    kpool: Int,
    head_dim: Int,
](
    pooled: Ptr[dtype],
    k: Ptr[dtype],
    gate: Ptr[dtype],
    ape: Ptr[DType.float32],
    input_row_offsets: Ptr[offset_dtype],
    pool_row_offsets: Ptr[pool_offset_dtype],
    cache_lengths: Ptr[length_dtype],
    batch: Int64,
    total_tokens: Int64,
):
    """GPU entry of compress: `compress_thread` at this block and thread.

    Parameters and Args are those of `compress_cpu` (sizes as Int64).
    """
    compress_thread[
        dtype, offset_dtype, pool_offset_dtype, length_dtype, kpool, head_dim
    ](
        Int(block_idx.x),
        Int(thread_idx.x),
        pooled,
        k,
        gate,
        ape,
        input_row_offsets,
        pool_row_offsets,
        cache_lengths,
        Int(batch),
        Int(total_tokens),
    )


@always_inline
def compress_launch[head_dim: Int](out_rows: Int) -> Tuple[Int, Int]:
    """`(grid, block)` of `kpool_compress_kernel`: a block per output row."""
    return (out_rows, gpu_block_width[head_dim]())


def compress_gpu[
    dtype: DType,
    offset_dtype: DType,
    pool_offset_dtype: DType,
    length_dtype: DType,
    kpool: Int,
    head_dim: Int,
    emulate: Bool,
](
    pooled: Ptr[dtype],
    k: Ptr[dtype],
    gate: Ptr[dtype],
    ape: Ptr[DType.float32],
    input_row_offsets: Ptr[offset_dtype],
    pool_row_offsets: Ptr[pool_offset_dtype],
    cache_lengths: Ptr[length_dtype],
    batch: Int,
    total_tokens: Int,
    out_rows: Int,
    ctx: DeviceContext,
) raises:
    """GPU compress: launches `kpool_compress_kernel` on `ctx`.

    With `emulate`, runs the same threads through `emulate_grid` on the
    CPU instead (the operands are then host memory and `ctx` is unused).

    Parameters and Args are those of `compress_cpu`, plus `emulate` and
    `ctx`.
    """
    if out_rows == 0:
        return
    var shape = compress_launch[head_dim](out_rows)
    comptime if emulate:

        def thread_work(block: Int, thread: Int) {imm}:
            compress_thread[
                dtype,
                offset_dtype,
                pool_offset_dtype,
                length_dtype,
                kpool,
                head_dim,
            ](
                block,
                thread,
                pooled,
                k,
                gate,
                ape,
                input_row_offsets,
                pool_row_offsets,
                cache_lengths,
                batch,
                total_tokens,
            )

        emulate_grid("kpool_compress_kernel", shape[0], shape[1], thread_work)
    else:
        ctx.enqueue_function[
            kpool_compress_kernel[
                dtype,
                offset_dtype,
                pool_offset_dtype,
                length_dtype,
                kpool,
                head_dim,
            ]
        ](
            pooled,
            k,
            gate,
            ape,
            input_row_offsets,
            pool_row_offsets,
            cache_lengths,
            Int64(batch),
            Int64(total_tokens),
            grid_dim=shape[0],
            block_dim=shape[1],
        )


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
        var batch = cache_lengths.dim_size(0)
        var total_tokens = k.dim_size(0)
        var out_rows = pooled.dim_size(0)
        comptime OP = "mo.mla.kpool.compress"
        expect_shape(
            OP, "pooled", pooled.shape(), "rows, head_dim", dims(ANY, head_dim)
        )
        expect_pool_rows[kpool](OP, "pooled", out_rows, total_tokens)
        expect_rows(OP, k.shape(), gate.shape(), head_dim)
        expect_shape(
            OP, "ape", ape.shape(), "kpool, head_dim", dims(kpool, head_dim)
        )
        expect_shape(
            OP,
            "input_row_offsets",
            input_row_offsets.shape(),
            "batch + 1",
            dims(batch + 1),
        )
        expect_shape(
            OP,
            "pool_row_offsets",
            pool_row_offsets.shape(),
            "batch + 1",
            dims(batch + 1),
        )
        comptime if emulate_gpu and target != "cpu":
            raise Error("mo.mla.kpool.compress: emulate_gpu needs a CPU target")
        comptime if target == "cpu" and not emulate_gpu:
            compress_cpu[
                pooled.dtype,
                input_row_offsets.dtype,
                pool_row_offsets.dtype,
                cache_lengths.dtype,
                kpool,
                head_dim,
            ](
                pooled.unsafe_ptr(),
                k.unsafe_ptr(),
                gate.unsafe_ptr(),
                ape.unsafe_ptr(),
                input_row_offsets.unsafe_ptr(),
                pool_row_offsets.unsafe_ptr(),
                cache_lengths.unsafe_ptr(),
                batch,
                total_tokens,
                out_rows,
            )
        else:
            compress_gpu[
                pooled.dtype,
                input_row_offsets.dtype,
                pool_row_offsets.dtype,
                cache_lengths.dtype,
                kpool,
                head_dim,
                emulate_gpu,
            ](
                pooled.unsafe_ptr(),
                k.unsafe_ptr(),
                gate.unsafe_ptr(),
                ape.unsafe_ptr(),
                input_row_offsets.unsafe_ptr(),
                pool_row_offsets.unsafe_ptr(),
                cache_lengths.unsafe_ptr(),
                batch,
                total_tokens,
                out_rows,
                ctx,
            )
