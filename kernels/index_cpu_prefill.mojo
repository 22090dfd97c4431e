"""The CPU prefill scorer of `index_top_k`: many rows against one key tile.

A chunk of query rows scores a tile of candidates like a small GEMM: the
tile's decoded keys are transposed to `[depth, PREFILL_TILE]`, so one
SIMD register holds a dim of `F32_WIDTH` candidates, and a register block
of `PREFILL_HEADS` query heads x `PREFILL_VECTORS` candidate registers
walks the dims with one FMA per (head, register): each key register feeds
every head of the block and each broadcast query value every candidate
register. The tile (16 KiB at depth 128 on AVX-512) stays in L1 while
every row of the chunk passes over it; each head's query values are read
once per tile.

Per (row `t`, candidate `j`) the score is
`scale_j * sum_h w[t, h] * relu(sum_d q[t, h, d] * k[j, d])`: the ReLU is
per head, so the heads cannot be folded into the query. After a block's
dims, its heads' ReLU (keeping a NaN) and weights are applied in registers
and added, head by head, to the row's running totals; the key scales
multiply the totals once every head is in.
"""

from std.math import ceildiv
from std.memory import stack_allocation

from .index_cpu_score import decode_candidates, scratch
from .index_fp8 import decode_row
from .index_operands import F32_WIDTH, IndexTopK
from .index_plan import candidate_bound
from .index_rank import keep_best, offer_pool
from .ragged import Ptr


comptime CPU_REGISTERS = 32 if F32_WIDTH >= 16 else 16
"""SIMD registers of the target: 32 zmm with AVX-512, 16 ymm with AVX2."""

comptime PREFILL_VECTORS = 2
"""Candidate registers per register block: the tile is this many
registers of `F32_WIDTH` candidates wide."""

comptime PREFILL_TILE = PREFILL_VECTORS * F32_WIDTH
"""Candidates per prefill tile (32 on AVX-512: 16 KiB of keys at depth
128, which stay in L1 while the chunk's rows pass over them)."""


def floor_pow2(n: Int) -> Int:
    """The largest power of two at most `n` (1 for `n < 2`)."""
    var p = 1
    while p * 2 <= n:
        p *= 2
    return p


comptime PREFILL_HEADS = floor_pow2(
    (CPU_REGISTERS - PREFILL_VECTORS - 2) // PREFILL_VECTORS
)
"""Query heads per register block: as many as leave the block's key
registers and a broadcast free (8 on AVX-512: 16 accumulators; 4 on
AVX2: 8), a power of two so that common head counts split evenly."""

comptime CPU_PREFILL_MIN_ROWS = 4
"""Fewest rows in a chunk for which the prefill scorer beats scoring row
by row (`score_tile`, which keeps the single-row decode path)."""


@always_inline
def prefill_heads_of[num_heads: Int]() -> Int:
    """Heads per row rounded up to whole register blocks (padding heads
    have a zero query and weight)."""
    return ceildiv(num_heads, PREFILL_HEADS) * PREFILL_HEADS


@always_inline
def score_head_block[
    depth: Int
](
    queries: Ptr[DType.float32],
    weights: Ptr[DType.float32],
    keys: Ptr[DType.float32],
    totals: Ptr[DType.float32],
):
    """Adds one register block of heads' weighted ReLU dots to a row's totals.

    Args:
        queries: `[PREFILL_HEADS, depth]` the block's decoded query heads.
        weights: `[PREFILL_HEADS]` their head weights.
        keys: `[depth, PREFILL_TILE]` the tile's decoded keys, transposed.
        totals: `[PREFILL_TILE]` the row's running weighted head sums.
    """
    comptime heads = PREFILL_HEADS
    comptime vectors = PREFILL_VECTORS
    comptime Vec = SIMD[DType.float32, F32_WIDTH]
    # Constant offsets only, so the compiler keeps these in registers.
    var acc = stack_allocation[heads * vectors * F32_WIDTH, DType.float32]()
    comptime for x in range(heads * vectors):
        acc.unsafe_store[width=F32_WIDTH](x * F32_WIDTH, Vec(0))
    for d in range(depth):
        comptime for v in range(vectors):
            var key = keys.unsafe_load[width=F32_WIDTH](
                d * PREFILL_TILE + v * F32_WIDTH
            )
            comptime for h in range(heads):
                comptime at = (h * vectors + v) * F32_WIDTH
                acc.unsafe_store[width=F32_WIDTH](
                    at,
                    Vec(queries[unsafe_offset=h * depth + d]).fma(
                        key, acc.unsafe_load[width=F32_WIDTH](at)
                    ),
                )
    comptime for v in range(vectors):
        var total = totals.unsafe_load[width=F32_WIDTH](v * F32_WIDTH)
        comptime for h in range(heads):
            var dot = acc.unsafe_load[width=F32_WIDTH](
                (h * vectors + v) * F32_WIDTH
            )
            # ReLU that keeps a NaN (a NaN key byte) a NaN.
            total += dot.lt(0).select(Vec(0), dot) * Vec(
                weights[unsafe_offset=h]
            )
        totals.unsafe_store[width=F32_WIDTH](v * F32_WIDTH, total)


def transpose_tile[
    depth: Int
](keys: Ptr[DType.float32], count: Int, transposed: Ptr[DType.float32]):
    """Copies `count` decoded keys `[count, depth]` to `[depth, PREFILL_TILE]`."""
    for x in range(count):
        for d in range(depth):
            transposed[unsafe_offset=d * PREFILL_TILE + x] = keys[
                unsafe_offset=x * depth + d
            ]


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
        kept: `[rows, k]` the rows' best keys out (ascending).
        sizes: `[rows]` how many each row kept.
    """
    comptime k = op.k
    comptime depth = op.depth
    comptime num_heads = op.num_heads
    comptime padded = prefill_heads_of[num_heads]()
    var rows = last - first

    var queries = List[Float32](length=rows * padded * depth, fill=0.0)
    var weights = List[Float32](length=rows * padded, fill=0.0)
    var q_at = scratch(queries)
    var w_at = scratch(weights)
    for r in range(rows):
        var t = start + first + r
        for h in range(num_heads):
            decode_row[depth](
                op.q.unsafe_offset((t * num_heads + h) * depth),
                q_at.unsafe_offset((r * padded + h) * depth),
            )
            w_at[unsafe_offset=r * padded + h] = op.qs[
                unsafe_offset=t * num_heads + h
            ]

    var keys = List[Float32](length=PREFILL_TILE * depth, fill=0.0)
    var transposed = List[Float32](length=PREFILL_TILE * depth, fill=0.0)
    var scales = List[Float32](length=PREFILL_TILE, fill=0.0)
    var totals = List[Float32](length=PREFILL_TILE, fill=0.0)
    var keys_at = scratch(keys)
    var transposed_at = scratch(transposed)
    var scales_at = scratch(scales)
    var totals_at = scratch(totals)
    # Each row's pool of keys above its floor (`offer_pool`).
    comptime room = 2 * k + 1
    var pool = List[UInt64](length=rows * room, fill=0)
    var pool_at = scratch(pool)
    var pooled = List[Int](length=rows, fill=0)
    var floors = List[UInt64](length=rows, fill=0)
    comptime Vec = SIMD[DType.float32, F32_WIDTH]
    for tile_first in range(lo, hi, PREFILL_TILE):
        var count = min(PREFILL_TILE, hi - tile_first)
        decode_candidates(op, b, tile_first, count, keys_at, scales_at)
        transpose_tile[depth](keys_at, count, transposed_at)
        for r in range(rows):
            var bound = candidate_bound[op.kpool, op.causal](c, n, first + r)
            var visible = min(count, bound - tile_first)
            if visible <= 0:
                continue
            comptime for v in range(PREFILL_VECTORS):
                totals_at.unsafe_store[width=F32_WIDTH](v * F32_WIDTH, Vec(0))
            for block in range(0, padded, PREFILL_HEADS):
                score_head_block[depth](
                    q_at.unsafe_offset((r * padded + block) * depth),
                    w_at.unsafe_offset(r * padded + block),
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
            var offered = offer_pool[k](
                totals_at,
                tile_first,
                visible,
                pool_at.unsafe_offset(r * room),
                pooled[r],
                floors[r],
            )
            pooled[r] = offered[0]
            floors[r] = offered[1]
    for r in range(rows):
        var size = keep_best[k](pool_at.unsafe_offset(r * room), pooled[r])
        for x in range(size):
            kept[unsafe_offset=r * k + x] = pool_at[unsafe_offset=r * room + x]
        sizes[unsafe_offset=r] = size
    # The scratch lives until the last tile is scored.
    _ = len(pool)
    _ = len(queries)
    _ = len(weights)
    _ = len(keys)
    _ = len(transposed)
    _ = len(scales)
    _ = len(totals)
