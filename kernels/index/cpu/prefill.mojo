"""The CPU prefill scorer of `index_top_k`: many rows against one key tile.

A chunk of query rows scores a tile of candidates like a small GEMM: the
tile's keys are decoded and transposed once (`block.mojo`: one
SIMD register holds a dim, or a dim pair, of `F32_WIDTH` candidates), and
every row of the chunk that sees any of them walks its heads over the
tile a register block at a time. The tile (8-16 KiB at depth 128) stays
in L1 while the rows pass over it; each head's query values are read once
per tile.

Per (row `t`, candidate `j`) the score is
`scale_j * sum_h w[t, h] * relu(sum_d q[t, h, d] * k[j, d])`: the ReLU is
per head, so the heads cannot be folded into the query. After a block's
dims, its heads' ReLU (keeping a NaN) and weights are applied in registers
and added, head by head, to the row's running totals; the key scales
multiply the totals once every head is in. Where the CPU has AMX-BF16 a
row's 32 heads at a time go through tile products instead
(`amx.score_row_amx`, the same transposed tile in pair words),
then through the same ReLU and weights. Each row's scores go to its pool
(`rank.RowPools`).
"""

from std.math import max

from .amx import (
    AMX_HEADS,
    E4m3ToBf16,
    amx_begin,
    amx_depth_of,
    amx_end,
    amx_heads_of,
    amx_usable,
    score_row_amx,
)
from .block import (
    PREFILL_HEADS,
    PREFILL_TILE,
    PREFILL_VECTORS,
    pack_pairs,
    prefill_heads_of,
    query_words_of,
    score_head_block,
    score_head_block_pairs,
    transpose_tile,
    transpose_tile_pairs,
    use_pairs,
)
from .score import decode_candidates, scratch
from ..fp8 import decode_row
from ..operands import F32_WIDTH, IndexTopK
from ..plan import candidate_bound
from ..rank import RowPools
from ...grid.ragged import Ptr


comptime CPU_PREFILL_MIN_ROWS = 4
"""Fewest rows in a chunk for which the prefill scorer beats scoring row
by row (`score_tile`, which keeps the single-row decode path)."""


@always_inline
def score_row_blocks[
    depth: Int, padded: Int
](
    queries: Ptr[DType.float32],
    weights: Ptr[DType.float32],
    keys: Ptr[DType.float32],
    totals: Ptr[DType.float32],
):
    """Adds one row's weighted ReLU head dots over a key tile to its totals,
    a register block of `PREFILL_HEADS` heads at a time, in bfloat16 pairs
    where `use_pairs[depth]()`, else in float32.

    Args:
        queries: `[padded, query_words_of[depth]()]` the row's query heads
            (pair words, or float32), padding heads zero.
        weights: `[padded]` the heads' weights (padding zero).
        keys: The tile's keys (`transpose_tile_pairs` or `transpose_tile`).
        totals: `[PREFILL_TILE]` the row's running weighted head sums.
    """
    comptime words = query_words_of[depth]()
    for block in range(0, padded, PREFILL_HEADS):
        var head = queries.unsafe_offset(block * words)
        var weight = weights.unsafe_offset(block)
        comptime if use_pairs[depth]():
            score_head_block_pairs[depth](
                head.unsafe_bitcast[UInt32](),
                weight,
                keys.unsafe_bitcast[UInt32](),
                totals,
            )
        else:
            score_head_block[depth](head, weight, keys, totals)


def keep_top_k_prefill(
    op: IndexTopK,
    b: Int,
    start: Int,
    n: Int,
    c: Int,
    first: Int,
    last: Int,
    lo: Int,
    hi: Int,
    kept: Ptr[DType.uint64],
    sizes: Pointer[Int, MutAnyOrigin],
    amx: Bool,
):
    """Rows `first .. last - 1` of request `b` over candidates `[lo, hi)`.

    The prefill form of `keep_top_k`'s scoring: decodes the rows' queries
    once (`[rows, prefill heads, depth]`, heads padded with zeros), then
    per tile of `PREFILL_TILE` candidates decodes and transposes the keys
    once and scores every row that sees any of them (a row whose bound is
    at or before the tile's first candidate skips it: the causal triangle
    at tile granularity), offering each row's visible scores to its pool
    (`offer_pool`). Each row's best `k` then go to its `kept` slots.

    Args:
        op: The call.
        b: The request.
        start: The request's first query row in the call.
        n: The request's new rows.
        c: The request's cache length.
        first: The chunk's first row within the request.
        last: One past the chunk's last row.
        lo: The first candidate of this part.
        hi: One past its last candidate (at most the widest row's bound).
        kept: `[rows, k]` the rows' best keys out (in no order).
        sizes: `[rows]` how many each row kept.
        amx: Whether to score with AMX tiles (`amx_ready()` said so;
            ignored where `amx_usable[depth]()` is false).
    """
    comptime k = op.k
    comptime depth = op.depth
    comptime num_heads = op.num_heads
    comptime padded = prefill_heads_of[num_heads]()
    var rows = last - first

    comptime pairs = use_pairs[depth]()
    comptime words = query_words_of[depth]()
    comptime tiles = amx_usable[depth]()
    comptime amx_dims = amx_depth_of[depth]()
    comptime amx_heads = amx_heads_of[num_heads]()
    var on_amx = tiles and amx
    var heads = amx_heads if on_amx else padded
    # Every value is written below but padding heads and dims, which
    # must be zero: the buffers are cleared only where there are some.
    var queries = List[Float32](
        unsafe_uninit_length=0 if on_amx else rows * padded * words
    )
    if padded != num_heads:
        for x in range(len(queries)):
            queries[x] = 0
    var amx_queries = List[UInt16](
        unsafe_uninit_length=rows * amx_heads * amx_dims if on_amx else 0
    )
    if amx_heads != num_heads or amx_dims != depth:
        for x in range(len(amx_queries)):
            amx_queries[x] = 0
    var weights = List[Float32](length=rows * heads, fill=0.0)
    var decoded = List[Float32](length=depth, fill=0.0)
    var table = E4m3ToBf16(on_amx)
    var q_at = scratch(queries)
    var w_at = scratch(weights)
    for r in range(rows):
        var t = start + first + r
        for h in range(num_heads):
            var src = op.q.unsafe_offset((t * num_heads + h) * depth)
            w_at[unsafe_offset=r * heads + h] = op.qs[
                unsafe_offset=t * num_heads + h
            ]
            comptime if tiles:
                if on_amx:
                    table.decode_row[depth](
                        src,
                        scratch(amx_queries).unsafe_offset(
                            (r * amx_heads + h) * amx_dims
                        ),
                    )
                    continue
            var head = q_at.unsafe_offset((r * padded + h) * words)
            comptime if pairs:
                decode_row[depth](src, scratch(decoded))
                pack_pairs[depth, 1](
                    scratch(decoded), head.unsafe_bitcast[UInt32]()
                )
            else:
                decode_row[depth](src, head)

    var keys = List[Float32](length=PREFILL_TILE * depth, fill=0.0)
    # Float32 keys `[depth, tile]`, or pair words `[depth / 2, tile]`
    # (`[amx_dims / 2, tile]` on AMX, padding dims zero).
    var transposed = List[Float32](
        length=PREFILL_TILE * max(depth, amx_dims // 2), fill=0.0
    )
    # A row's head dots on AMX, `[AMX_HEADS, tile]`.
    var sums = List[Float32](
        length=AMX_HEADS * PREFILL_TILE if on_amx else 0, fill=0.0
    )
    var scales = List[Float32](length=PREFILL_TILE, fill=0.0)
    var totals = List[Float32](length=PREFILL_TILE, fill=0.0)
    var keys_at = scratch(keys)
    var transposed_at = scratch(transposed)
    var scales_at = scratch(scales)
    var totals_at = scratch(totals)
    var pools = RowPools[k](rows)
    comptime Vec = SIMD[DType.float32, F32_WIDTH]
    if on_amx:
        amx_begin()
    for tile_first in range(lo, hi, PREFILL_TILE):
        var count = min(PREFILL_TILE, hi - tile_first)
        decode_candidates(op, b, tile_first, count, keys_at, scales_at)
        if pairs or on_amx:
            transpose_tile_pairs[depth](
                keys_at, count, transposed_at.unsafe_bitcast[UInt32]()
            )
        else:
            transpose_tile[depth](keys_at, count, transposed_at)
        for r in range(rows):
            var bound = candidate_bound[op.kpool, op.causal](c, n, first + r)
            var visible = min(count, bound - tile_first)
            if visible <= 0:
                continue
            comptime for v in range(PREFILL_VECTORS):
                totals_at.unsafe_store[width=F32_WIDTH](v * F32_WIDTH, Vec(0))
            if on_amx:
                score_row_amx[depth, amx_heads](
                    scratch(amx_queries).unsafe_offset(
                        r * amx_heads * amx_dims
                    ),
                    w_at.unsafe_offset(r * heads),
                    transposed_at.unsafe_bitcast[UInt32](),
                    scratch(sums),
                    totals_at,
                )
            else:
                score_row_blocks[depth, padded](
                    q_at.unsafe_offset(r * padded * words),
                    w_at.unsafe_offset(r * heads),
                    transposed_at,
                    totals_at,
                )
            comptime for v in range(PREFILL_VECTORS):
                comptime at = v * F32_WIDTH
                totals_at.unsafe_store[width=F32_WIDTH](
                    at,
                    totals_at.unsafe_load[width=F32_WIDTH](at)
                    * scales_at.unsafe_load[width=F32_WIDTH](at),
                )
            pools.offer(r, totals_at, tile_first, visible)
    if on_amx:
        amx_end()
    pools.keep(kept, sizes)
    # The scratch lives until the last tile is scored.
    _ = len(queries)
    _ = len(amx_queries)
    _ = len(sums)
    _ = len(weights)
    _ = len(decoded)
    _ = len(keys)
    _ = len(transposed)
    _ = len(scales)
    _ = len(totals)
