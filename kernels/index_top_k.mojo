"""`mla_kpool.index_top_k`: score the paged FP8 key cache, keep each query's top k.

The indexer of a sparse-attention layer (DeepSeek-V3.2's, and GLM-5-Next's
over pooled keys) scores every key a query token may see and hands the ids
of the `k` best to sparse attention. This is MAX 26.7's
`mo.mla.indexer.ragged.float8.paged` (same parameters, same operands in the
same order), under this package's own name so that MAX's builtin stays in
place for the GPUs it serves; this file is its CPU path.

Score of query row `t` (of request `b`) for candidate `j`:

    score[t, j] = k_scale[j] * sum_h max(sum_d q[t, h, d] * k[j, d], 0) * qs[t, h]

FP8 e4m3fn values decoded exactly, products summed in float32. Candidate
`j` is a cache row (`kpool == 1`) or a pool of `kpool` tokens; request `b`
(`c = k_cache_lengths[b]`, `n` new rows, row `t` the `i`-th of them) lets
row `t` see candidates `[0, bound)`:

    bound = (c + n - (n - 1 - i) * causal) // kpool

Output row `t`: the ids of the `m = min(k, bound)` best candidates in
descending score, ties by ascending id (a NaN score ranks as `-inf`), then
`-1`. Deterministic: the same operands give the same rows on every run.

Key layout, by the row width `W` of `k_blocks`: `W == depth` puts candidate
`j` on cache row `j` (`kpool == 1`, or one pooled key per row); `W == depth
/ kpool` (GLM-5-Next) spreads pool `j` over rows `kpool * j + r`, row `r`
holding dims `[r * W, (r + 1) * W)`, its scale on row `kpool * j`. Cache row
`x` of request `b` is slot `x % page_size` of block
`k_lookup_table[b, x // page_size]`, its scale likewise through
`k_scales_lookup_table`; blocks start every `page_stride` elements (`-1`:
packed), which may run past the bound view of a larger arena.

Metadata is not trusted. Requests are scored only while the offsets are
well formed: `input_row_offsets[0] == 0` and non-decreasing up to
`input_row_offsets[b + 1] <= T`. A request is skipped (its rows `-1`) if its
cache length reads negative, or a page it needs lies past the lookup
tables or names a block past `k_blocks` / `k_scales`. Every other row is
`-1` too. Nothing outside the operands is ever read.

CPU scheme: a task per (request, chunk of `CPU_ROW_CHUNK` query rows),
spread over the cores. A task decodes its rows' queries once (transposed,
heads innermost), then walks the candidates a tile at a time: decode the
tile's keys and scales to float32 once, score it for every row of the
chunk with a register-blocked kernel (SIMD over heads, a few candidates at
a time, ReLU and the head weights applied in registers), and feed the
scores into one bounded heap per row, which holds the row's best `k` seen
so far. Memory per task is bounded by the chunk, the tile and `k`, never
by the context length.
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from max.algorithm import sync_parallelize
from max.gpu.host import DeviceContext
from std.math import ceildiv, max, min
from std.builtin.sort import sort
from std.memory import bitcast, stack_allocation
from std.sys import num_physical_cores, simd_width_of
from std.sys.info import is_nvidia_gpu
from std.utils.index import IndexList

from .index_gpu import index_top_k_gpu, window_rows
from .operands import ANY, KernelOperands, dims, expect_shape, expect_target
from .ragged import Field, Ptr, read_index

comptime TOP_K_LIMIT = 2048
"""Largest `k` the op accepts (MAX's limit for this op)."""

comptime CPU_ROW_CHUNK = 16
"""Query rows per CPU task: their decoded queries (16 KiB a row at 32 heads
x 128 dims) and heaps stay cache-resident while a key tile is reused."""

comptime CPU_TILE = 64
"""Candidates decoded per tile (32 KiB of float32 keys at depth 128)."""

comptime CPU_MIN_PART_CANDIDATES = 4 * CPU_TILE
"""Fewest candidates worth a core of their own when one row chunk's
candidates are split between cores."""

comptime CPU_MIN_PARALLEL_WORK = 1 << 20
"""Score multiply-adds below which one core finishes before others wake."""

comptime F32_WIDTH = simd_width_of[DType.float32]()
"""Lanes of one float32 SIMD register."""

comptime DECODE_WIDTH = 16
"""FP8 bytes decoded per SIMD step."""


@always_inline
def decode_e4m3[
    width: Int
](bytes: SIMD[DType.uint8, width]) -> SIMD[DType.float32, width]:
    """Decodes e4m3fn bytes to float32, exactly, with integer SIMD.

    e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities,
    `S.1111.111` is NaN, exponent 0 is subnormal (`m * 2^-9`). A normal
    value's exponent and mantissa bits move into float32's positions and
    its exponent gains 127 - 7 = 120.

    Parameters:
        width: Lanes.

    Args:
        bytes: The e4m3fn bit patterns.

    Returns:
        The values as float32.
    """
    var x = bytes.cast[DType.uint32]()
    var mag = x & 0x7F
    var normal = bitcast[DType.float32, width]((mag << 20) + (120 << 23))
    var subnormal = (x & 7).cast[DType.float32]() * Float32(1.0 / 512.0)
    var value = mag.ge(8).select(normal, subnormal)
    value = mag.eq(0x7F).select(
        SIMD[DType.float32, width](FloatLiteral.nan), value
    )
    return bitcast[DType.float32, width](
        bitcast[DType.uint32, width](value) | ((x & 0x80) << 24)
    )


@always_inline
def decode_e4m3_gpu[
    width: Int
](bytes: SIMD[DType.uint8, width]) -> SIMD[DType.float32, width]:
    """Decodes e4m3fn bytes to float32 exactly, in hardware where there is one.

    On NVIDIA GPUs the bytes are cast as `float8_e4m3fn`, which compiles to
    `cvt.rn.f16x2.e4m3x2` (two bytes to two float16 per instruction, sm_89
    and later) and then float16 to float32: both steps are exact, since
    every e4m3fn value, subnormals included, is a normal float16, and a
    widening conversion keeps a NaN (`S.1111.111`) a NaN. AMD's hardware
    FP8 (gfx942) is the FNUZ variant, with another bias and NaN, and the
    host emulation has none: both take `decode_e4m3`.

    Parameters:
        width: Lanes.

    Args:
        bytes: The e4m3fn bit patterns.

    Returns:
        The values as float32 (the same as `decode_e4m3`'s, up to a NaN's
        payload).
    """
    comptime if is_nvidia_gpu():
        return bitcast[DType.float8_e4m3fn, width](bytes).cast[DType.float32]()
    else:
        return decode_e4m3[width](bytes)


@always_inline
def decode_row[count: Int](src: Ptr[DType.uint8], dest: Ptr[DType.float32]):
    """Decodes `count` consecutive e4m3fn bytes into float32."""
    comptime full = count // DECODE_WIDTH
    comptime for i in range(full):
        dest.unsafe_store[width=DECODE_WIDTH](
            i * DECODE_WIDTH,
            decode_e4m3[DECODE_WIDTH](
                src.unsafe_load[width=DECODE_WIDTH](i * DECODE_WIDTH)
            ),
        )
    comptime for i in range(full * DECODE_WIDTH, count):
        dest[unsafe_offset=i] = decode_e4m3[1](
            SIMD[DType.uint8, 1](src[unsafe_offset=i])
        )[0]


@always_inline
def head_vectors_of[num_heads: Int]() -> Int:
    """SIMD registers one query dim's `num_heads` heads fill."""
    return ceildiv(num_heads, F32_WIDTH)


@always_inline
def padded_heads_of[num_heads: Int]() -> Int:
    """Heads rounded up to whole registers: the decoded queries' row width,
    shared by the tasks that lay them out and the kernel that reads them."""
    return head_vectors_of[num_heads]() * F32_WIDTH


@fieldwise_init
struct IndexOperands[
    offset_dtype: DType,
    length_dtype: DType,
    table_dtype: DType,
    scale_table_dtype: DType,
    num_heads: Int,
    depth: Int,
    k: Int,
    kpool: Int,
    causal: Bool,
    spread: Bool,
    origin: MutOrigin,
](KernelOperands):
    """One index_top_k call: its tensors, sizes and cache geometry.

    Parameters:
        offset_dtype: Integer dtype of `input_row_offsets`.
        length_dtype: Integer dtype of `k_cache_lengths`.
        table_dtype: Integer dtype of `k_lookup_table`.
        scale_table_dtype: Integer dtype of `k_scales_lookup_table`.
        num_heads: Query heads `H`.
        depth: Dims per head and per key `D`.
        k: Ids kept per query row.
        kpool: Tokens per candidate.
        causal: Causal mask (else null).
        spread: A candidate spreads over `kpool` rows of `D / kpool`.
        origin: Origin of the tensor pointers (`MutAnyOrigin` in kernels).
    """

    var output: Field[DType.int32, Self.origin]
    """`[T, k]` int32 result."""
    var q: Field[DType.uint8, Self.origin]
    """`[T, H, D]` e4m3fn query bytes."""
    var qs: Field[DType.float32, Self.origin]
    """`[T, H]` head weights."""
    var input_row_offsets: Field[Self.offset_dtype, Self.origin]
    """`[B + 1]` query row offsets."""
    var k_blocks: Field[DType.uint8, Self.origin]
    """Key block 0's first byte."""
    var k_cache_lengths: Field[Self.length_dtype, Self.origin]
    """`[B]` rows cached before this call."""
    var k_lookup_table: Field[Self.table_dtype, Self.origin]
    """`[B, key_pages]` key block per (request, page)."""
    var k_scales: Field[DType.float32, Self.origin]
    """Scale block 0's first value."""
    var k_scales_lookup_table: Field[Self.scale_table_dtype, Self.origin]
    """`[B, scale_pages]` scale block per (request, page)."""
    var total_tokens: Int
    """Query rows `T`."""
    var scored_requests: Int
    """Requests `0 .. scored_requests - 1` have well-formed offsets."""
    var page_size: Int
    """Cache rows per page."""
    var key_pages: Int
    """Columns of `k_lookup_table`."""
    var scale_pages: Int
    """Columns of `k_scales_lookup_table`."""
    var key_blocks: Int
    """Blocks of the bound `k_blocks` view."""
    var scale_blocks: Int
    """Blocks of the bound `k_scales` view."""
    var block_stride: Int
    """Elements from one key block to the next."""
    var scale_block_stride: Int
    """Elements from one scale block to the next."""
    var layer_offset: Int
    """Elements from a key block's start to `layer_idx`'s slot 0."""
    var scale_layer_offset: Int
    """Elements from a scale block's start to `layer_idx`'s slot 0."""
    var plan: Field[DType.int64, Self.origin]
    """GPU path: `[2 * T]` each row's request and bound (`index_gpu`)."""
    var scores: Field[DType.float32, Self.origin]
    """GPU path: `[window, candidates]` score workspace."""
    var candidates: Int
    """GPU path: the most candidates a row can see (a workspace row)."""
    var first_row: Int
    """GPU path: the window's first row."""

    comptime width = Self.depth // Self.kpool if Self.spread else Self.depth
    """Bytes per cache row, `W`."""
    comptime rows_per_candidate = Self.kpool if Self.spread else 1
    """Cache rows one candidate spans."""
    comptime padded_heads = padded_heads_of[Self.num_heads]()
    """Heads rounded up to whole registers (padding heads weigh 0)."""


comptime IndexTopK = IndexOperands[..., origin=MutAnyOrigin]
"""`IndexOperands` over the kernels' raw tensor pointers."""


@always_inline
def candidate_bound[
    kpool: Int, causal: Bool
](cache_length: Int, new_rows: Int, i: Int) -> Int:
    """Candidates row `i` of a request's `new_rows` sees: `[0, bound)`."""
    comptime mask = 1 if causal else 0
    return (cache_length + new_rows - (new_rows - 1 - i) * mask) // kpool


def request_span(op: IndexTopK, b: Int) -> Tuple[Int, Int, Int, Bool]:
    """Request `b`'s rows `[start, start + n)`, its cache length, and whether to score it.

    Scored when its cache length is non-negative and every page its last
    row needs is inside both lookup tables and names a block inside
    `k_blocks` and `k_scales`. `b` must be below `op.scored_requests`
    (well-formed offsets).
    """
    var start = read_index(op.input_row_offsets, b)
    var n = read_index(op.input_row_offsets, b + 1) - start
    var c = read_index(op.k_cache_lengths, b)
    if c < 0:
        return (start, n, c, False)
    if n == 0:
        return (start, n, c, True)
    var rows = (
        candidate_bound[op.kpool, op.causal](c, n, n - 1)
        * op.rows_per_candidate
    )
    var pages = ceildiv(rows, op.page_size)
    if pages > op.key_pages or pages > op.scale_pages:
        return (start, n, c, False)
    for page in range(pages):
        var block = read_index(op.k_lookup_table, b * op.key_pages + page)
        var scale_block = read_index(
            op.k_scales_lookup_table, b * op.scale_pages + page
        )
        if block < 0 or block >= op.key_blocks:
            return (start, n, c, False)
        if scale_block < 0 or scale_block >= op.scale_blocks:
            return (start, n, c, False)
    return (start, n, c, True)


@always_inline
def page_bases(op: IndexTopK, b: Int, page: Int) -> Tuple[Int, Int]:
    """Where request `b`'s page `page` starts, for `layer_idx`.

    Returns:
        `(key element, scale element)` offsets of its slot 0.
    """
    var block = read_index(op.k_lookup_table, b * op.key_pages + page)
    var scale_block = read_index(
        op.k_scales_lookup_table, b * op.scale_pages + page
    )
    return (
        block * op.block_stride + op.layer_offset,
        scale_block * op.scale_block_stride + op.scale_layer_offset,
    )


@always_inline
def decode_candidates(
    op: IndexTopK,
    b: Int,
    first: Int,
    count: Int,
    keys: Ptr[DType.float32],
    scales: Ptr[DType.float32],
):
    """Decodes candidates `[first, first + count)` of request `b`.

    Keys go to `keys` (`[count, depth]` float32, row-major), scales to
    `scales`. Every page they touch was checked by `request_span`.
    """
    comptime width = op.width
    comptime rows = op.rows_per_candidate
    comptime depth = op.depth
    # A candidate's rows share a page (`page_size % rows == 0`), so the
    # walk keeps a page and slot instead of dividing per row.
    var page = first * rows // op.page_size
    var slot = first * rows % op.page_size
    var key_base = 0
    var scale_base = 0

    if count > 0:
        var at = page_bases(op, b, page)
        key_base = at[0]
        scale_base = at[1]
    for x in range(count):
        comptime for r in range(rows):
            decode_row[width](
                op.k_blocks.unsafe_offset(key_base + (slot + r) * width),
                keys.unsafe_offset(x * depth + r * width),
            )
        scales[unsafe_offset=x] = op.k_scales[unsafe_offset=scale_base + slot]
        slot += rows
        if slot == op.page_size and x + 1 < count:
            slot = 0
            page += 1
            var at = page_bases(op, b, page)
            key_base = at[0]
            scale_base = at[1]


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


@always_inline
def score_order(score: Float32) -> UInt32:
    """A score as an unsigned integer of the same order.

    `-0.0` maps as `0.0` and NaN as `-inf` (the key `0x007FFFFF`), so NaN
    ranks below every number; 0 is the key of no score.
    """
    var value = score + 0.0
    var bits = bitcast[DType.uint32, 1](value)
    var ordered = (~bits) if bits & 0x80000000 else bits | 0x80000000
    if value != value:
        ordered = 0x007FFFFF  # the key of -inf
    return ordered


@always_inline
def rank_key(score: Float32, id: Int) -> UInt64:
    """A candidate's rank as one integer: larger ranks higher.

    The high half orders the scores (`score_order`), the low half
    `2^32 - 1 - id`, so equal scores rank the lower id higher. Ids are
    below 2^31: the output is int32.
    """
    return (UInt64(score_order(score)) << 32) | UInt64(0xFFFFFFFF - id)


def sift_down(keys: Ptr[DType.uint64], size: Int, pos: Int):
    """Restores the min-heap below `pos` (root: the lowest-ranked key)."""
    var i = pos
    var key = keys[unsafe_offset=i]
    while True:
        var child = 2 * i + 1
        if child >= size:
            break
        if (
            child + 1 < size
            and keys[unsafe_offset=child + 1] < keys[unsafe_offset=child]
        ):
            child += 1
        if keys[unsafe_offset=child] >= key:
            break
        keys[unsafe_offset=i] = keys[unsafe_offset=child]
        i = child
    keys[unsafe_offset=i] = key


@always_inline
def offer_tile[
    k: Int
](
    tile: Ptr[DType.float32],
    first: Int,
    count: Int,
    keys: Ptr[DType.uint64],
    size: Int,
) -> Int:
    """Offers candidates `first ..` (scores `tile[0 : count]`) to a row's top k.

    `keys[0 : size]` holds the row's best so far: unordered while fewer
    than `k`, a min-heap once full, where a newcomer replaces the root
    only if it ranks higher. Returns the new size.
    """
    var filled = size
    for x in range(count):
        var key = rank_key(tile[unsafe_offset=x], first + x)
        if filled < k:
            keys[unsafe_offset=filled] = key
            filled += 1
            if filled == k:
                for i in reversed(range(k // 2)):
                    sift_down(keys, k, i)
        elif key > keys[unsafe_offset=0]:
            keys[unsafe_offset=0] = key
            sift_down(keys, k, 0)
    return filled


def write_row[k: Int](keys: Span[mut=True, UInt64, _], dest: Ptr[DType.int32]):
    """Sorts a row's kept keys and writes their ids best first, `-1` after."""
    sort(keys)
    var size = len(keys)
    for x in range(size):
        dest[unsafe_offset=x] = Int32(
            0xFFFFFFFF - Int(keys[size - 1 - x] & 0xFFFFFFFF)
        )
    for x in range(size, k):
        dest[unsafe_offset=x] = -1


@always_inline
def scratch[dtype: DType](mut buffer: List[Scalar[dtype]]) -> Ptr[dtype]:
    """A task-local buffer's data as the kernels' raw pointer type."""
    return buffer.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()


@always_inline
def fill_rows[k: Int](output: Ptr[DType.int32], first: Int, last: Int):
    """Writes `-1` into output rows `[first, last)`."""
    for x in range(first * k, last * k):
        output[unsafe_offset=x] = -1


def keep_top_k(
    op: IndexTopK,
    b: Int,
    first: Int,
    last: Int,
    part: Int,
    parts: Int,
    kept: Ptr[DType.uint64],
    sizes: Pointer[Int, MutAnyOrigin],
):
    """Request `b`'s rows `first .. last - 1`: each one's best `k` of a part.

    The candidates of the chunk's widest row are cut into `parts` runs of
    whole tiles; this keeps, for each row `r`, the rank keys of its best
    `k` visible candidates of run `part` in `kept[r * k :]` (unordered, or
    a heap) and their number in `sizes[r]`: 0 for every row of a request
    that is not scored. Decodes the rows' queries once, then each tile's
    keys once for all the rows.
    """
    comptime k = op.k
    comptime depth = op.depth
    comptime padded = op.padded_heads
    comptime num_heads = op.num_heads
    var rows = last - first
    for r in range(rows):
        sizes[unsafe_offset=r] = 0
    var span = request_span(op, b)
    var start = span[0]
    var n = span[1]
    var c = span[2]
    var widest = candidate_bound[op.kpool, op.causal](c, n, last - 1)
    if not span[3] or widest <= 0:
        return
    var run = ceildiv(ceildiv(widest, parts), CPU_TILE) * CPU_TILE
    var lo = part * run
    var hi = min(lo + run, widest)
    if lo >= hi:
        return

    var queries = List[Float32](length=rows * depth * padded, fill=0.0)
    var weights = List[Float32](length=rows * padded, fill=0.0)
    var decoded = List[Float32](length=depth, fill=0.0)
    for r in range(rows):
        var t = start + first + r
        for h in range(num_heads):
            decode_row[depth](
                op.q.unsafe_offset((t * num_heads + h) * depth),
                scratch(decoded),
            )
            for d in range(depth):
                queries[(r * depth + d) * padded + h] = decoded[d]
            weights[r * padded + h] = op.qs[unsafe_offset=t * num_heads + h]

    var keys = List[Float32](length=CPU_TILE * depth, fill=0.0)
    var scales = List[Float32](length=CPU_TILE, fill=0.0)
    var tile = List[Float32](length=CPU_TILE, fill=0.0)
    for tile_first in range(lo, hi, CPU_TILE):
        var count = min(CPU_TILE, hi - tile_first)
        decode_candidates(
            op, b, tile_first, count, scratch(keys), scratch(scales)
        )
        for r in range(rows):
            var bound = candidate_bound[op.kpool, op.causal](c, n, first + r)
            var visible = min(count, bound - tile_first)
            if visible <= 0:
                continue
            score_tile[num_heads, depth](
                scratch(queries).unsafe_offset(r * depth * padded),
                scratch(weights).unsafe_offset(r * padded),
                scratch(keys),
                scratch(scales),
                visible,
                scratch(tile),
            )
            sizes[unsafe_offset=r] = offer_tile[k](
                scratch(tile),
                tile_first,
                visible,
                kept.unsafe_offset(r * k),
                sizes[unsafe_offset=r],
            )


def write_chunk(
    op: IndexTopK,
    b: Int,
    first: Int,
    last: Int,
    parts: Int,
    kept: Ptr[DType.uint64],
    sizes: Pointer[Int, MutAnyOrigin],
):
    """Writes request `b`'s rows `first .. last - 1` from `keep_top_k`'s parts.

    Part `p`'s keys for row `r` are at `kept[(p * CPU_ROW_CHUNK + r) * k
    :]`, `sizes[p * CPU_ROW_CHUNK + r]` of them. With one part they are
    the row's answer; with more, the best `k` of their union are.
    """
    comptime k = op.k
    var start = read_index(op.input_row_offsets, b)
    var merged = List[UInt64]()
    for r in range(last - first):
        var dest = op.output.unsafe_offset((start + first + r) * k)
        merged.clear()
        for part in range(parts):
            var at = part * CPU_ROW_CHUNK + r
            for x in range(sizes[unsafe_offset=at]):
                merged.append(kept[unsafe_offset=at * k + x])
        var total = len(merged)
        if total > k:
            sort(Span(merged))
        write_row[k](Span(merged)[max(total - k, 0) :], dest)


def index_top_k_cpu(op: IndexTopK):
    """CPU index_top_k: a task per (request, row chunk, part), over the cores.

    Rows that no scored request owns are `-1` first. Each (request, row
    chunk) is one task over all its candidates, or, when there are fewer
    such chunks than cores and the candidates are many, `parts` tasks over
    runs of them whose kept keys are merged per row afterwards (so a
    single long-context decode uses every core).
    """
    comptime k = op.k
    var owned = 0
    if op.scored_requests > 0:
        owned = read_index(op.input_row_offsets, op.scored_requests)
    fill_rows[k](op.output, owned, op.total_tokens)

    var task_request = List[Int]()
    var task_first = List[Int]()
    var work = 0
    var widest = 0
    for b in range(op.scored_requests):
        var start = read_index(op.input_row_offsets, b)
        var n = read_index(op.input_row_offsets, b + 1) - start
        var c = read_index(op.k_cache_lengths, b)
        for first in range(0, n, CPU_ROW_CHUNK):
            task_request.append(b)
            task_first.append(first)
        if n > 0 and c >= 0:
            var bound = candidate_bound[op.kpool, op.causal](c, n, n - 1)
            work += n * max(bound, 0)
            widest = max(widest, bound)
    work *= op.num_heads * op.depth
    var chunks = len(task_request)
    var serial = chunks == 0 or work < CPU_MIN_PARALLEL_WORK
    var parts = 1
    if not serial and chunks < num_physical_cores():
        parts = max(
            1,
            min(
                ceildiv(num_physical_cores(), chunks),
                widest // CPU_MIN_PART_CANDIDATES,
            ),
        )

    var kept = List[UInt64](length=chunks * parts * CPU_ROW_CHUNK * k, fill=0)
    var sizes = List[Int](length=chunks * parts * CPU_ROW_CHUNK, fill=0)
    var kept_at = scratch(kept)
    var sizes_at = sizes.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()

    @always_inline
    def rows_of(chunk: Int) {imm} -> Tuple[Int, Int, Int]:
        var b = task_request[chunk]
        var first = task_first[chunk]
        var n = read_index(op.input_row_offsets, b + 1) - read_index(
            op.input_row_offsets, b
        )
        return (b, first, min(first + CPU_ROW_CHUNK, n))

    def keep_part(task: Int) {imm}:
        var chunk = task // parts
        var part = task % parts
        var rows = rows_of(chunk)
        keep_top_k(
            op,
            rows[0],
            rows[1],
            rows[2],
            part,
            parts,
            kept_at.unsafe_offset(task * CPU_ROW_CHUNK * k),
            sizes_at.unsafe_offset(task * CPU_ROW_CHUNK),
        )

    def write(chunk: Int) {imm}:
        var rows = rows_of(chunk)
        write_chunk(
            op,
            rows[0],
            rows[1],
            rows[2],
            parts,
            kept_at.unsafe_offset(chunk * parts * CPU_ROW_CHUNK * k),
            sizes_at.unsafe_offset(chunk * parts * CPU_ROW_CHUNK),
        )

    if serial:
        for chunk in range(chunks):
            keep_part(chunk)
            write(chunk)
    else:
        sync_parallelize(keep_part, chunks * parts)
        sync_parallelize(write, chunks)
    # The scratch lives until every task is done with it.
    _ = len(kept)
    _ = len(sizes)


def scored_prefix[
    dtype: DType
](offsets: Ptr[dtype], batch: Int, total_tokens: Int) -> Int:
    """Requests `0 .. r - 1` whose offsets are well formed; returns `r`.

    Well formed: `offsets[0] == 0`, non-decreasing, and at most
    `total_tokens`, up to and including `offsets[r]`.
    """
    if read_index(offsets, 0) != 0:
        return 0
    for b in range(batch):
        var end = read_index(offsets, b + 1)
        if end < read_index(offsets, b) or end > total_tokens:
            return b
    return batch


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
    """Registers `mla_kpool.index_top_k` (CPU; MAX's builtin serves GPUs)."""

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

        Parameters:
            num_heads: Query heads `H`.
            depth: Dims per head and per key `D`.
            k: Ids per output row, 1 to 2048.
            quantization_granularity: The keys' quantization group
                (accepted for MAX's signature; one scale per key row is
                read).
            mask_str: `"null"` or `"causal"`.
            kpool: Tokens per candidate (1: every cache row).
            target: `"cpu"` or a GPU, filled in by the graph compiler.
            emulate_gpu: On a CPU target, run the GPU path (`index_gpu`)
                over an emulated grid instead of the CPU kernel.

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
            Error: On a GPU target; if a parameter is out of range, `q` is
                neither uint8 nor float8_e4m3fn, an operand's shape
                disagrees with the others, `W` is neither `D` nor
                `D / kpool`, a spread layout's page size is not a multiple
                of `kpool`, `layer_idx` is past the cache's layers, or a
                page stride is neither `-1` nor at least one block.
        """
        comptime OP = "mla_kpool.index_top_k"
        expect_target[emulate_gpu, target](OP)
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
                ": need num_heads >= 1, depth >= 1, 1 <= k <= 2048,",
                " kpool >= 1 and mask_str 'null' or 'causal'; got num_heads=",
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
        # The GPU path reads the offsets on the device (`index_gpu.row_plan`).
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
                output_indices.unsafe_ptr(),
                q.unsafe_ptr().unsafe_bitcast[UInt8](),
                qs.unsafe_ptr(),
                offsets,
                k_blocks.unsafe_ptr().unsafe_bitcast[UInt8](),
                k_cache_lengths.unsafe_ptr(),
                k_lookup_table.unsafe_ptr(),
                k_scales.unsafe_ptr(),
                k_scales_lookup_table.unsafe_ptr(),
                total_tokens,
                scored,
                page_size,
                k_lookup_table.dim_size(1),
                k_scales_lookup_table.dim_size(1),
                k_blocks.dim_size(0),
                k_scales.dim_size(0),
                block_stride,
                scale_block_stride,
                layer * layer_elems,
                layer * page_size,
                output_indices.unsafe_ptr().unsafe_bitcast[Int64](),
                k_scales.unsafe_ptr(),
                candidates,
                0,
            )
            comptime if on_cpu:
                index_top_k_cpu(op)
            elif emulate_gpu:
                var plan = List[Int64](length=2 * total_tokens, fill=0)
                var work = List[Float32](length=window * candidates, fill=0.0)
                index_top_k_gpu[True](
                    op, scratch(plan), scratch(work), window, ctx
                )
                _ = plan^  # the launches used them through pointers
                _ = work^
            else:
                var plan = ctx.enqueue_create_buffer[DType.int64](
                    2 * total_tokens
                )
                var work = ctx.enqueue_create_buffer[DType.float32](
                    max(window * candidates, 1)
                )
                index_top_k_gpu[False](
                    op,
                    plan.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
                    work.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
                    window,
                    ctx,
                )
                _ = plan^  # freed in stream order, after the launches
                _ = work^

        comptime if kpool > 1 and depth % kpool == 0:
            if spread:
                run[True]()
                return
        run[False]()
