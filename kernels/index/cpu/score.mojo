"""The CPU scorer of `index_top_k`: a tile of keys decoded once, scored per row.

`decode_candidates` walks a request's pages and decodes a tile's keys and
scales to float32; `score_tile` scores one query row against the tile with
a register-blocked kernel (SIMD over heads, a few candidates at a time,
ReLU and the head weights applied in registers).
"""

from std.math import max
from std.sys import PrefetchOptions, prefetch
from std.memory import stack_allocation

from .amx import E4m3ToBf16
from ..fp8 import decode_row
from ..operands import (
    F32_WIDTH,
    IndexTopK,
    head_vectors_of,
    padded_heads_of,
)
from ..plan import page_bases
from ...grid.ragged import Ptr


@always_inline
def scratch[dtype: DType](mut buffer: List[Scalar[dtype]]) -> Ptr[dtype]:
    """A task-local buffer's data as the kernels' raw pointer type."""
    return buffer.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()


@always_inline
def prefetch_page(op: IndexTopK, b: Int, page: Int):
    """Asks the cache for request `b`'s key page `page` (its key bytes and
    scales), a page the walk will read (so its lookup entries were
    checked).

    The walk's pages sit in blocks anywhere in the arena, so the hardware
    prefetcher, which follows addresses within a page, stalls at each new
    page; the walk asks for its next page as it enters one.
    """
    comptime line = 64
    comptime read = PrefetchOptions().for_read().high_locality()
    var at = page_bases(op, b, page)
    for x in range(0, op.page_size * op.width, line):
        prefetch[read](op.k_blocks.unsafe_offset(at.key + x))
    for x in range(0, op.page_size, line // 4):
        prefetch[read](op.k_scales.unsafe_offset(at.scale + x))


@always_inline
def decode_candidates[
    dtype: DType = DType.float32
](
    op: IndexTopK,
    b: Int,
    first: Int,
    count: Int,
    keys: Ptr[dtype],
    scales: Ptr[DType.float32],
    table: E4m3ToBf16 = E4m3ToBf16(False),
    stride: Int = op.depth,
):
    """Decodes candidates `[first, first + count)` of request `b`.

    Keys go to `keys` (`[count, stride]`, row-major): float32 values, or
    with `dtype` uint16 their bfloat16 bits (through `table`); scales to
    `scales`. Every page they touch was checked by `request_span`.
    """
    comptime width = op.width
    comptime rows = op.rows_per_candidate
    # A candidate's rows share a page (`page_size % rows == 0`), so the
    # walk keeps a page and slot instead of dividing per row.
    var page = first * rows // op.page_size
    var slot = first * rows % op.page_size
    var key_base = 0
    var scale_base = 0

    # The walk's last page: lookup entries past it are never read.
    var last_page = ((first + count) * rows - 1) // op.page_size
    if count > 0:
        var at = page_bases(op, b, page)
        key_base = at.key
        scale_base = at.scale
        if page < last_page:
            prefetch_page(op, b, page + 1)
    for x in range(count):
        comptime for r in range(rows):
            var src = op.k_blocks.unsafe_offset(key_base + (slot + r) * width)
            var dest = keys.unsafe_offset(x * stride + r * width)
            comptime if dtype == DType.uint16:
                table.decode_row[width](src, rebind[Ptr[DType.uint16]](dest))
            else:
                decode_row[width](src, rebind[Ptr[DType.float32]](dest))
        scales[unsafe_offset=x] = op.k_scales[unsafe_offset=scale_base + slot]
        slot += rows
        if slot == op.page_size and x + 1 < count:
            slot = 0
            page += 1
            var at = page_bases(op, b, page)
            key_base = at.key
            scale_base = at.scale
            if page < last_page:
                prefetch_page(op, b, page + 1)


@always_inline
def score_tile[
    num_heads: Int, depth: Int
](
    queries: Ptr[DType.float32],
    weights: Ptr[DType.float32],
    keys: Ptr[DType.float32],
    scales: Ptr[DType.float32],
    count: Int,
    scores: Ptr[DType.float32],
):
    """Scores one query row against `count` decoded candidates.

    The register-blocked kernel: for `block` candidates at a time it keeps
    `block x head_vectors` float32 vectors of per-head dot products (SIMD
    over heads), walks the dims once, then applies ReLU and the head
    weights in registers and sums the heads.

    Args:
        queries: The row's decoded query, `[depth, padded_heads]` (heads
            innermost, padding heads 0).
        weights: `[padded_heads]` head weights (padding 0).
        keys: `[>= count rounded up to block, depth]` decoded keys.
        scales: `[>= count rounded up]` key scales.
        count: Candidates to score.
        scores: `[>= count rounded up]` float32 scores out; entries past
            `count` are scratch.
    """
    comptime head_vectors = head_vectors_of[num_heads]()
    comptime padded = padded_heads_of[num_heads]()
    comptime block = max(1, 8 // head_vectors)
    comptime Vec = SIMD[DType.float32, F32_WIDTH]
    for j in range(0, count, block):
        # Constant offsets only, so the compiler keeps these in registers.
        var acc = stack_allocation[block * padded, DType.float32]()
        comptime for x in range(block * head_vectors):
            acc.unsafe_store[width=F32_WIDTH](x * F32_WIDTH, Vec(0))
        for d in range(depth):
            comptime for c in range(block):
                var key = Vec(keys[unsafe_offset=(j + c) * depth + d])
                comptime for h in range(head_vectors):
                    comptime at = (c * head_vectors + h) * F32_WIDTH
                    acc.unsafe_store[width=F32_WIDTH](
                        at,
                        queries.unsafe_load[width=F32_WIDTH](
                            d * padded + h * F32_WIDTH
                        ).fma(key, acc.unsafe_load[width=F32_WIDTH](at)),
                    )
        comptime for c in range(block):
            var total = Vec(0)
            comptime for h in range(head_vectors):
                comptime at = (c * head_vectors + h) * F32_WIDTH
                var dot = acc.unsafe_load[width=F32_WIDTH](at)
                # ReLU that keeps a NaN (a NaN key byte) a NaN: `max`
                # would turn it into 0 and hide it inside a real score.
                total += dot.lt(0).select(Vec(0), dot) * (
                    weights.unsafe_load[width=F32_WIDTH](h * F32_WIDTH)
                )
            scores[unsafe_offset=j + c] = (
                total.reduce_add() * scales[unsafe_offset=j + c]
            )
