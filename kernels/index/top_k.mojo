"""`mla_kpool.index_top_k`: score the paged FP8 key cache, keep each query's top k.

The indexer of a sparse-attention layer (DeepSeek-V3.2's, GLM-5-Next's
over pooled keys): MAX 26.7's `mo.mla.indexer.ragged.float8.paged` (same
parameters and operands, in order) under this package's own name, leaving
MAX's builtin to the GPUs it serves. Here: the contract, the registration
and its operand checks; the kernels: `cpu/tasks.mojo`, `gpu/launches.mojo`.

Score of query row `t` (of request `b`) for candidate `j`:

    score[t, j] = k_scale[j] * sum_h max(sum_d q[t, h, d] * k[j, d], 0) * qs[t, h]

FP8 e4m3fn values decoded exactly, products summed in float32. Candidate
`j` is a cache row (`kpool == 1`) or a pool of `kpool` tokens; request `b`
(`c = k_cache_lengths[b]`, `n` new rows, row `t` the `i`-th of them) lets
row `t` see candidates `[0, bound)`:

    bound = (c + n - (n - 1 - i) * causal) // kpool

Output row `t`: the ids of the `m = min(k, bound)` best candidates in
descending score, ties by ascending id (a NaN score ranks as `-inf`), then
`-1`, the same rows on every run (key layout: `MLAKPoolIndexTopK.execute`).

Metadata is not trusted: a request is scored only while the offsets are
well formed up to it (`input_row_offsets[0] == 0`, non-decreasing,
`input_row_offsets[b + 1] <= T`), and skipped (rows `-1`) if its cache
length reads negative or a page it needs lies past the lookup tables or
names a block past `k_blocks` / `k_scales`. Every other row is `-1` too.
Nothing outside the operands is ever read.
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from max.gpu.host import DeviceContext
from std.math import max, min
from std.utils.index import IndexList

from .cpu.tasks import index_top_k_cpu, scratch
from .gpu.launches import index_top_k_gpu, window_rows
from .operands import TOP_K_LIMIT, IndexOperands, no_workspace
from .plan import scored_prefix
from .scorers import AUTO, check_scorer, scorer_kernel
from .gpu.select import select_slices, split_words
from ..grid.operands import ANY, dims, expect_shape, expect_target


def block_stride_of(
    op_name: StaticString, operand: StaticString, stride: Int, packed: Int
) raises -> Int:
    """Elements between blocks: `packed` for `-1`, else `stride` (checked).

    Raises:
        Error: If `stride` is neither `-1` nor at least one packed block.
    """
    if stride == -1:
        return packed
    if stride < packed:
        raise Error(
            op_name,
            ": ",
            operand,
            " must be -1 (packed) or at least one block (",
            packed,
            " elements), got ",
            stride,
        )
    return stride


@extensibility.register("mla_kpool.index_top_k")
struct MLAKPoolIndexTopK:
    """Registers `mla_kpool.index_top_k` (CPU and GPU; module docs)."""

    @staticmethod
    def execute[
        *,
        num_heads: Int,
        depth: Int,
        k: Int,
        quantization_granularity: Int,
        mask_str: StaticString,
        kpool: Int = 1,
        target: StaticString,
        emulate_gpu: Bool = False,
        scorer: StaticString = AUTO,
    ](
        output_indices: OutputTensor[dtype=DType.int32, rank=2, ...],
        q: InputTensor[rank=3, ...],
        qs: InputTensor[dtype=DType.float32, rank=2, ...],
        input_row_offsets: InputTensor[rank=1, ...],
        k_blocks: MutableInputTensor[dtype=q.dtype, rank=6, ...],
        page_stride: InputTensor[dtype=DType.int64, rank=1, ...],
        k_cache_lengths: InputTensor[rank=1, ...],
        k_lookup_table: InputTensor[rank=2, ...],
        k_max_prompt_length: InputTensor[rank=1, ...],
        k_max_cache_length: InputTensor[rank=1, ...],
        k_scales: MutableInputTensor[dtype=DType.float32, rank=6, ...],
        scales_page_stride: InputTensor[dtype=DType.int64, rank=1, ...],
        k_scales_lookup_table: InputTensor[rank=2, ...],
        layer_idx: UInt32,
        ctx: DeviceContext,
    ) raises:
        """Writes each query row's top-k candidate ids (see the module doc).

        Key layout, by the row width `W` of `k_blocks`: `W == depth` puts candidate
        `j` on cache row `j` (`kpool == 1`, or one pooled key per row); `W == depth
        / kpool` (GLM-5-Next) spreads pool `j` over rows `kpool * j + r`, row `r`
        holding dims `[r * W, (r + 1) * W)`, its scale on row `kpool * j`. Cache row
        `x` of request `b` is slot `x % page_size` of block
        `k_lookup_table[b, x // page_size]`, its scale likewise through
        `k_scales_lookup_table`; blocks start every `page_stride` elements (`-1`:
        packed), which may run past the bound view of a larger arena.

        The operands are `operands.IndexOperands`; the rows each query
        scores are planned by `plan.mojo`.

        Parameters:
            num_heads: Query heads `H`.
            depth: Dims per head and per key `D`.
            k: Ids per output row, 1 to `TOP_K_LIMIT` (2048).
            quantization_granularity: The keys' quantization group
                (accepted for MAX's signature; one scale per key row is
                read).
            mask_str: `"null"` or `"causal"`.
            kpool: Tokens per candidate (1: every cache row).
            target: `"cpu"` or a GPU, filled in by the graph compiler.
            emulate_gpu: On a CPU target, run the GPU path
                (`gpu/launches.mojo`) over an emulated grid instead of the
                CPU kernel.
            scorer: The GPU path's scorer (`scorers.mojo`):
                `"auto"`, `"simt"` (FP32 FMAs), `"wgmma"` (sm_90 tensor
                cores) or `"mfma"` (gfx942 matrix cores); the tensor ones
                also over the emulated grid with `emulate_gpu`.

        Args:
            output_indices: Output `[T, k]` int32 candidate ids, best
                first, `-1` after the valid ones.
            q: `[T, H, D]` queries, e4m3fn bytes (`uint8` on the CPU,
                where MAX refuses FP8 tensors).
            qs: `[T, H]` float32 head weights (signed).
            input_row_offsets: `[B + 1]` query row offsets.
            k_blocks: `[blocks, kv, layers, page_size, 1, W]` paged keys,
                dtype of `q`; read only.
            page_stride: `[1]` int64 elements between key blocks, `-1`
                for packed.
            k_cache_lengths: `[B]` rows cached before this call.
            k_lookup_table: `[B, pages]` key block per (request, page).
            k_max_prompt_length: `[1]` scratch sizing only; unused.
            k_max_cache_length: `[1]` scratch sizing only; unused.
            k_scales: `[blocks, kv, layers, page_size, 1, 1]` float32 key
                scales; read only.
            scales_page_stride: `[1]` int64, as `page_stride` for scales.
            k_scales_lookup_table: `[B, pages]` scale block per (request,
                page).
            layer_idx: Layer whose keys are scored.
            ctx: Device context (unused on the CPU).

        Raises:
            Error: If `emulate_gpu` is asked of a GPU target, `scorer` is
                unknown or names a scorer the target cannot run (or a
                depth it does not take); if a parameter is out of range, `q` is
                neither uint8 nor float8_e4m3fn, an operand's shape
                disagrees with the others, `W` is neither `D` nor
                `D / kpool`, a spread layout's page size is not a multiple
                of `kpool`, `layer_idx` is past the cache's layers, or a
                page stride is neither `-1` nor at least one block.
        """
        comptime OP = "mla_kpool.index_top_k"
        expect_target[emulate_gpu, target](OP)
        check_scorer[scorer, target, emulate_gpu, depth](OP)
        comptime kernel = scorer_kernel[scorer, target, emulate_gpu, depth]()
        comptime assert (
            q.dtype == DType.uint8 or q.dtype == DType.float8_e4m3fn
        ), "mla_kpool.index_top_k: q and k_blocks must be uint8 or e4m3fn"
        comptime if (
            num_heads < 1
            or depth < 1
            or k < 1
            or k > TOP_K_LIMIT
            or kpool < 1
            or (mask_str != "null" and mask_str != "causal")
        ):
            raise Error(
                OP,
                ": need num_heads >= 1, depth >= 1, 1 <= k <= ",
                TOP_K_LIMIT,
                ", kpool >= 1 and mask_str 'null' or 'causal'; got num_heads=",
                num_heads,
                ", depth=",
                depth,
                ", k=",
                k,
                ", kpool=",
                kpool,
                ", mask_str=",
                mask_str,
            )
        var total_tokens = q.dim_size(0)
        var batch = k_cache_lengths.dim_size(0)
        expect_shape(
            OP,
            "q",
            q.shape(),
            "T, num_heads, depth",
            IndexList[3](ANY, num_heads, depth),
        )
        expect_shape(
            OP, "qs", qs.shape(), "T, num_heads", dims(total_tokens, num_heads)
        )
        expect_shape(
            OP,
            "output_indices",
            output_indices.shape(),
            "T, k",
            dims(total_tokens, k),
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
            "k_lookup_table",
            k_lookup_table.shape(),
            "batch, pages",
            dims(batch, ANY),
        )
        expect_shape(
            OP,
            "k_scales_lookup_table",
            k_scales_lookup_table.shape(),
            "batch, pages",
            dims(batch, ANY),
        )
        var width = k_blocks.dim_size(5)
        var page_size = k_blocks.dim_size(3)
        var layers = k_blocks.dim_size(2)
        expect_shape(
            OP,
            "k_blocks",
            k_blocks.shape(),
            "blocks, kv, layers, page_size, 1, W",
            IndexList[6](ANY, ANY, ANY, ANY, 1, ANY),
        )
        expect_shape(
            OP,
            "k_scales",
            k_scales.shape(),
            "blocks, kv, layers, page_size, 1, 1",
            IndexList[6](ANY, ANY, ANY, page_size, 1, 1),
        )
        var spread = kpool > 1 and width * kpool == depth
        if width != depth and not spread:
            raise Error(
                OP,
                ": k_blocks rows must hold depth=",
                depth,
                " or depth / kpool dims (kpool=",
                kpool,
                "), got W=",
                width,
            )
        if spread and page_size % kpool != 0:
            raise Error(
                OP,
                ": page_size=",
                page_size,
                " must be a multiple of kpool=",
                kpool,
                " when a pool spans kpool rows",
            )
        var layer = Int(layer_idx)
        var scale_layers = k_scales.dim_size(2)
        if layer >= layers or layer >= scale_layers:
            raise Error(
                OP,
                ": layer_idx=",
                layer,
                " is past the cache's layers (k_blocks ",
                layers,
                ", k_scales ",
                scale_layers,
                ")",
            )
        var layer_elems = page_size * width
        var block_stride = block_stride_of(
            OP,
            "page_stride",
            Int(page_stride.unsafe_ptr()[unsafe_offset=0]),
            k_blocks.dim_size(1) * layers * layer_elems,
        )
        var scale_block_stride = block_stride_of(
            OP,
            "scales_page_stride",
            Int(scales_page_stride.unsafe_ptr()[unsafe_offset=0]),
            k_scales.dim_size(1) * scale_layers * page_size,
        )
        if total_tokens == 0:
            return
        comptime on_cpu = target == "cpu" and not emulate_gpu
        var offsets = input_row_offsets.unsafe_ptr()
        # The GPU path reads the offsets on the device (`launches.plan_phase`).
        var scored = batch
        comptime if on_cpu:
            scored = scored_prefix(offsets, batch, total_tokens)
        var rows_per_candidate = kpool if spread else 1
        var candidates = (
            min(k_lookup_table.dim_size(1), k_scales_lookup_table.dim_size(1))
            * page_size
            // rows_per_candidate
        )
        var window = window_rows(candidates, total_tokens)
        # The split select's words: none unless rows are split (at least a
        # word, so the buffer is never empty).
        var split_size = max(
            window * split_words(select_slices(candidates, total_tokens, k)),
            1,
        )

        @always_inline
        @__parameter
        def run[spread: Bool]() raises:
            comptime causal = mask_str == "causal"
            var op = IndexOperands[
                input_row_offsets.dtype,
                k_cache_lengths.dtype,
                k_lookup_table.dtype,
                k_scales_lookup_table.dtype,
                num_heads,
                depth,
                k,
                kpool,
                causal,
                spread,
                MutAnyOrigin,
            ](
                output=output_indices.unsafe_ptr(),
                q=q.unsafe_ptr().unsafe_bitcast[UInt8](),
                qs=qs.unsafe_ptr(),
                input_row_offsets=offsets,
                k_blocks=k_blocks.unsafe_ptr().unsafe_bitcast[UInt8](),
                k_cache_lengths=k_cache_lengths.unsafe_ptr(),
                k_lookup_table=k_lookup_table.unsafe_ptr(),
                k_scales=k_scales.unsafe_ptr(),
                k_scales_lookup_table=k_scales_lookup_table.unsafe_ptr(),
                total_tokens=total_tokens,
                scored_requests=scored,
                page_size=page_size,
                key_pages=k_lookup_table.dim_size(1),
                scale_pages=k_scales_lookup_table.dim_size(1),
                key_blocks=k_blocks.dim_size(0),
                scale_blocks=k_scales.dim_size(0),
                block_stride=block_stride,
                scale_block_stride=scale_block_stride,
                layer_offset=layer * layer_elems,
                scale_layer_offset=layer * page_size,
                work=no_workspace(),
            )
            comptime if on_cpu:
                index_top_k_cpu(op)
            elif emulate_gpu:
                var plan = List[Int64](length=2 * total_tokens, fill=0)
                var work = List[Float32](length=window * candidates, fill=0.0)
                var split = List[UInt32](length=split_size, fill=0)
                index_top_k_gpu[True, kernel](
                    op,
                    scratch(plan),
                    scratch(work),
                    scratch(split),
                    candidates,
                    window,
                    ctx,
                )
                _ = plan^  # the launches used them through pointers
                _ = work^
                _ = split^
            else:
                var plan = ctx.enqueue_create_buffer[DType.int64](
                    2 * total_tokens
                )
                var work = ctx.enqueue_create_buffer[DType.float32](
                    max(window * candidates, 1)
                )
                var plan_ptr = plan.unsafe_ptr().unsafe_origin_cast[
                    MutAnyOrigin
                ]()
                var work_ptr = work.unsafe_ptr().unsafe_origin_cast[
                    MutAnyOrigin
                ]()
                var split = ctx.enqueue_create_buffer[DType.uint32](split_size)
                ctx.enqueue_memset(split, 0)
                var split_ptr = split.unsafe_ptr().unsafe_origin_cast[
                    MutAnyOrigin
                ]()
                index_top_k_gpu[False, kernel](
                    op, plan_ptr, work_ptr, split_ptr, candidates, window, ctx
                )
                _ = plan^  # freed in stream order, after the launches
                _ = work^
                _ = split^

        comptime if kpool > 1 and depth % kpool == 0:
            if spread:
                run[True]()
                return
        run[False]()
