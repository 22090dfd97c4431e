"""`mla_kpool.max_select`: MAX's top-k select on rows of scores (GPU only).

MAX 26.7 ships a select with the contract of `index_top_k`'s select
(`nn.topk_bitonic.persistent_topk_block_split`: descending, ties to the
lower column, per-row bounds, `-1` padding, a row split over blocks when
rows are few). This op runs it, ordered and deterministic, on a score
matrix, so `python/mla_kpool/bench/kernel_times.py` (run by
`benchmarks/gpu_run.sh`) can time it on the rows our select reads.
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from max.gpu.host import DeviceContext
from nn.topk_bitonic import (
    PERSISTENT_TOPK_MAX_N,
    RowBoundsPtr,
    persistent_topk_block_split,
)


@extensibility.register("mla_kpool.max_select")
struct MaxSelect:
    """Registers `mla_kpool.max_select` (GPU only)."""

    @staticmethod
    def execute[
        *, target: StaticString
    ](
        ids: OutputTensor[dtype=DType.int32, rank=2, ...],
        scores: InputTensor[dtype=DType.float32, rank=2, ...],
        bounds: InputTensor[dtype=DType.int32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        """Each row's top `k` columns by score (`k = ids.dim_size(1)`).

        Args:
            ids: `[rows, k]` int32: columns in descending score order, ties
                by ascending column, `-1` past the row's bound.
            scores: `[rows, n]` float32.
            bounds: `[rows]` int32: columns `[0, bound)` of each row count.
            ctx: The GPU's device context.

        Raises:
            Error: On a CPU target, or `k` past MAX's
                `PERSISTENT_TOPK_MAX_N` (its top-k capacity).
        """
        comptime if target == "cpu":
            raise Error("mla_kpool.max_select: MAX's select runs on a GPU")
        else:
            var k = ids.dim_size(1)
            if k > PERSISTENT_TOPK_MAX_N:
                raise Error(
                    "mla_kpool.max_select: k=",
                    k,
                    " is past MAX's select's ",
                    PERSISTENT_TOPK_MAX_N,
                )
            persistent_topk_block_split[ordered=True, deterministic=True](
                ctx,
                scores.unsafe_ptr(),
                ids.unsafe_ptr(),
                scores.dim_size(1),
                k,
                scores.dim_size(0),
                RowBoundsPtr(bounds.unsafe_ptr()),
            )
