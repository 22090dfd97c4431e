"""`mla_kpool.index_top_k` on the CPU: tasks over the cores, a top k per row.

A task per (request, chunk of `CPU_ROW_CHUNK` query rows, or
`CPU_PREFILL_CHUNK` in a long prefill), spread over the cores. A chunk of
a few rows (a decode) decodes its queries once (transposed, heads
innermost), then walks the candidates a tile at a time: decode the tile's
keys and scales to float32 once, score it for every row of the chunk
(`score.mojo`), and offer the scores to one bounded pool per
row (`rank.RowPools`), which holds a superset of the row's best `k`
seen so far. A chunk of at least `CPU_PREFILL_MIN_ROWS` rows (a prefill)
takes the register-blocked prefill scorer (`prefill.mojo`),
which scores many rows against each transposed key tile. Where the CPU
has AMX-BF16, both score on AMX tiles (`amx.mojo`;
`keep_rows_amx` for the few-row form). Memory per task is bounded by the
chunk, the tile and `k`, never by the context length.
"""

from max.algorithm import sync_parallelize
from std.math import ceildiv, max, min
from std.sys import num_physical_cores

from .amx import (
    AMX_HEADS,
    AMX_ROW_TILE,
    E4m3ToBf16,
    amx_begin,
    amx_depth_of,
    amx_end,
    amx_heads_of,
    amx_ready,
    amx_usable,
    score_tile_amx,
)
from .prefill import CPU_PREFILL_MIN_ROWS, keep_top_k_prefill
from .score import decode_candidates, scratch, score_tile
from ..fp8 import decode_row
from ..operands import IndexTopK
from ..plan import candidate_bound, request_span
from ..rank import RowPools, keep_best, write_row
from ...grid.ragged import Ptr, read_index


comptime CPU_ROW_CHUNK = 16
"""Query rows per CPU task: their decoded queries (16 KiB a row at 32 heads
x 128 dims) and pools stay cache-resident while a key tile is reused."""

comptime CPU_PREFILL_CHUNK = 64
"""Query rows per CPU task in a long prefill: a key tile decoded and
transposed once serves four times `CPU_ROW_CHUNK`'s rows (with AMX
scoring, the decode cost as much as the products at 16 rows)."""

comptime CPU_TASKS_PER_CORE = 8
"""Fewest tasks per core for which a call takes `CPU_PREFILL_CHUNK` rows
a task: a causal prefill's chunks differ in work, and fewer, larger ones
would leave cores idle at the end."""

comptime CPU_TILE = 64
"""Candidates decoded per tile (32 KiB of float32 keys at depth 128)."""

comptime CPU_MIN_PART_CANDIDATES = 4 * CPU_TILE
"""Fewest candidates worth a core of their own when one row chunk's
candidates are split between cores."""

comptime CPU_MIN_PARALLEL_MACS = 1 << 20
"""Score multiply-adds below which one core finishes before others wake
(the writers' threshold, `parallel.CPU_MIN_PARALLEL_MEMBERS`, counts pooled
element-members instead)."""


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
    amx: Bool,
):
    """Request `b`'s rows `first .. last - 1`: each one's best `k` of a part.

    The candidates of the chunk's widest row are cut into `parts` runs of
    whole tiles; this keeps, for each row `r`, the rank keys of its best
    `k` visible candidates of run `part` in `kept[r * k :]` (in no order,
    from a pool per row: `RowPools`) and their number in `sizes[r]`: 0 for
    every row of a request that is not scored. Decodes the rows' queries once, then each tile's
    keys once for all the rows; a chunk of `CPU_PREFILL_MIN_ROWS` rows or
    more goes to `keep_top_k_prefill` instead (on AMX tiles where `amx`).
    """
    comptime k = op.k
    comptime depth = op.depth
    comptime padded = op.padded_heads
    comptime num_heads = op.num_heads
    var rows = last - first
    for r in range(rows):
        sizes[unsafe_offset=r] = 0
    var span = request_span(op, b)
    var start = span.start
    var n = span.n
    var c = span.cache_length
    var widest = candidate_bound[op.kpool, op.causal](c, n, last - 1)
    if not span.scored or widest <= 0:
        return
    var run = ceildiv(ceildiv(widest, parts), CPU_TILE) * CPU_TILE
    var lo = part * run
    var hi = min(lo + run, widest)
    if lo >= hi:
        return
    if rows >= CPU_PREFILL_MIN_ROWS:
        keep_top_k_prefill(
            op, b, start, n, c, first, last, lo, hi, kept, sizes, amx
        )
        return
    comptime if amx_usable[depth]():
        if amx:
            keep_rows_amx(op, b, start, n, c, first, last, lo, hi, kept, sizes)
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
    var pools = RowPools[k](rows)
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
            pools.offer(r, scratch(tile), tile_first, visible)
    pools.keep(kept, sizes)


def keep_rows_amx(
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
    """`keep_top_k`'s few-row (decode) scoring on AMX tiles.

    Builds each row's query as pair words `[dims / 2, heads]` once, then
    per tile of `CPU_TILE` candidates decodes the keys straight to
    bfloat16 rows (`E4m3ToBf16`) and scores every row that sees them with
    `score_tile_amx`, offering the scores to the row's pool. Arguments as
    for `keep_top_k_prefill`; needs `amx_ready()` and
    `amx_usable[op.depth]()`.
    """
    comptime k = op.k
    comptime depth = op.depth
    comptime num_heads = op.num_heads
    comptime dims = amx_depth_of[depth]()
    comptime heads = amx_heads_of[num_heads]()
    var rows = last - first
    var table = E4m3ToBf16(True)
    # Padding heads and dims must be zero in queries, weights and keys.
    var queries = List[UInt32](length=rows * dims // 2 * heads, fill=0)
    var weights = List[Float32](length=rows * heads, fill=0.0)
    var decoded = List[UInt16](length=dims, fill=0)
    for r in range(rows):
        var t = start + first + r
        var words = scratch(queries).unsafe_offset(r * dims // 2 * heads)
        for h in range(num_heads):
            table.decode_row[depth](
                op.q.unsafe_offset((t * num_heads + h) * depth),
                scratch(decoded),
            )
            for p in range(dims // 2):
                words[unsafe_offset=p * heads + h] = UInt32(decoded[2 * p]) | (
                    UInt32(decoded[2 * p + 1]) << 16
                )
            weights[r * heads + h] = op.qs[unsafe_offset=t * num_heads + h]

    comptime assert CPU_TILE % AMX_ROW_TILE == 0, "whole AMX passes a tile"
    var keys = List[UInt16](length=CPU_TILE * dims, fill=0)
    var scales = List[Float32](length=CPU_TILE, fill=0.0)
    var tile = List[Float32](length=CPU_TILE, fill=0.0)
    var sums = List[Float32](length=AMX_ROW_TILE * AMX_HEADS, fill=0.0)
    var pools = RowPools[k](rows)
    amx_begin()
    for tile_first in range(lo, hi, CPU_TILE):
        var count = min(CPU_TILE, hi - tile_first)
        decode_candidates[DType.uint16](
            op,
            b,
            tile_first,
            count,
            scratch(keys),
            scratch(scales),
            table,
            dims,
        )
        for r in range(rows):
            var bound = candidate_bound[op.kpool, op.causal](c, n, first + r)
            var visible = min(count, bound - tile_first)
            if visible <= 0:
                continue
            score_tile_amx[depth, heads](
                scratch(queries).unsafe_offset(r * dims // 2 * heads),
                scratch(weights).unsafe_offset(r * heads),
                scratch(keys),
                scratch(scales),
                visible,
                scratch(sums),
                scratch(tile),
            )
            pools.offer(r, scratch(tile), tile_first, visible)
    amx_end()
    pools.keep(kept, sizes)


def write_chunk(
    op: IndexTopK,
    b: Int,
    first: Int,
    last: Int,
    parts: Int,
    chunk: Int,
    kept: Ptr[DType.uint64],
    sizes: Pointer[Int, MutAnyOrigin],
):
    """Writes request `b`'s rows `first .. last - 1` from `keep_top_k`'s parts.

    Part `p`'s keys for row `r` are at `kept[(p * chunk + r) * k :]`,
    `sizes[p * chunk + r]` of them (`chunk`: the call's rows per task).
    With one part they are the row's answer; with more, the best `k` of
    their union are.
    """
    comptime k = op.k
    var start = read_index(op.input_row_offsets, b)
    var merged = List[UInt64]()
    for r in range(last - first):
        var dest = op.output.unsafe_offset((start + first + r) * k)
        merged.clear()
        for part in range(parts):
            var at = part * chunk + r
            for x in range(sizes[unsafe_offset=at]):
                merged.append(kept[unsafe_offset=at * k + x])
        var size = keep_best[k](scratch(merged), len(merged))[0]
        write_row[k](Span(merged)[:size], dest)


@fieldwise_init
struct RowChunk(Copyable, TrivialRegisterPassable):
    """A task's query rows: request `request`'s rows `first ..< end`."""

    var request: Int
    """The request."""
    var first: Int
    """First row, counted within the request."""
    var end: Int
    """One past the last row, within the request."""


def index_top_k_cpu(op: IndexTopK):
    """CPU index_top_k: a task per (request, row chunk, part), over the cores.

    Rows that no scored request owns are `-1` first. A chunk is
    `CPU_ROW_CHUNK` rows, or `CPU_PREFILL_CHUNK` when the call has rows
    for `CPU_TASKS_PER_CORE` such tasks a core. Each (request, row chunk)
    is one task over all its candidates that keeps and writes its
    rows in scratch of its own (the latest chunks first), or, when there
    are fewer such chunks than cores and the candidates are many, `parts`
    tasks over runs of them whose kept keys are merged per row afterwards
    (so a single long-context decode uses every core).
    """
    comptime k = op.k
    var owned = 0
    if op.scored_requests > 0:
        owned = read_index(op.input_row_offsets, op.scored_requests)
    fill_rows[k](op.output, owned, op.total_tokens)

    var task_rows = CPU_ROW_CHUNK
    if owned >= CPU_PREFILL_CHUNK * CPU_TASKS_PER_CORE * num_physical_cores():
        task_rows = CPU_PREFILL_CHUNK
    var task_request = List[Int]()
    var task_first = List[Int]()
    var work = 0
    var widest = 0
    for b in range(op.scored_requests):
        var start = read_index(op.input_row_offsets, b)
        var n = read_index(op.input_row_offsets, b + 1) - start
        var c = read_index(op.k_cache_lengths, b)
        # Last chunk first: in a causal prefill the later rows see more
        # candidates, and the heaviest tasks should not start last.
        for first in reversed(range(0, n, task_rows)):
            task_request.append(b)
            task_first.append(first)
        if n > 0 and c >= 0:
            var bound = candidate_bound[op.kpool, op.causal](c, n, n - 1)
            work += n * max(bound, 0)
            widest = max(widest, bound)
    work *= op.num_heads * op.depth
    # The AMX check costs a CPUID and a system call: only for a call with
    # work for more than one core.
    var amx = work >= CPU_MIN_PARALLEL_MACS and amx_ready()
    var chunks = len(task_request)
    var serial = chunks == 0 or work < CPU_MIN_PARALLEL_MACS
    var parts = 1
    if not serial and chunks < num_physical_cores():
        parts = max(
            1,
            min(
                ceildiv(num_physical_cores(), chunks),
                widest // CPU_MIN_PART_CANDIDATES,
            ),
        )

    @always_inline
    def rows_of(chunk: Int) {imm} -> RowChunk:
        var b = task_request[chunk]
        var first = task_first[chunk]
        var n = read_index(op.input_row_offsets, b + 1) - read_index(
            op.input_row_offsets, b
        )
        return RowChunk(b, first, min(first + task_rows, n))

    if parts == 1:
        # Each task keeps and writes its own rows, in scratch of its own.
        def keep_and_write(chunk: Int) {imm}:
            var rows = rows_of(chunk)
            var kept = List[UInt64](unsafe_uninit_length=task_rows * k)
            var sizes = List[Int](length=task_rows, fill=0)
            var sizes_at = sizes.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
            keep_top_k(
                op,
                rows.request,
                rows.first,
                rows.end,
                0,
                1,
                scratch(kept),
                sizes_at,
                amx,
            )
            write_chunk(
                op,
                rows.request,
                rows.first,
                rows.end,
                1,
                task_rows,
                scratch(kept),
                sizes_at,
            )
            _ = len(kept)
            _ = len(sizes)

        if serial:
            for chunk in range(chunks):
                keep_and_write(chunk)
        else:
            sync_parallelize(keep_and_write, chunks)
        return

    var kept = List[UInt64](unsafe_uninit_length=chunks * parts * task_rows * k)
    var sizes = List[Int](length=chunks * parts * task_rows, fill=0)
    var kept_at = scratch(kept)
    var sizes_at = sizes.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()

    def keep_part(task: Int) {imm}:
        var chunk = task // parts
        var part = task % parts
        var rows = rows_of(chunk)
        keep_top_k(
            op,
            rows.request,
            rows.first,
            rows.end,
            part,
            parts,
            kept_at.unsafe_offset(task * task_rows * k),
            sizes_at.unsafe_offset(task * task_rows),
            amx,
        )

    def write(chunk: Int) {imm}:
        var rows = rows_of(chunk)
        write_chunk(
            op,
            rows.request,
            rows.first,
            rows.end,
            parts,
            task_rows,
            kept_at.unsafe_offset(chunk * parts * task_rows * k),
            sizes_at.unsafe_offset(chunk * parts * task_rows),
        )

    sync_parallelize(keep_part, chunks * parts)
    sync_parallelize(write, chunks)
    # The scratch lives until every task is done with it.
    _ = len(kept)
    _ = len(sizes)
