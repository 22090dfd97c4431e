"""Unit tests of the CPU prefill scorer's AMX block.

Runs on a host with AMX (`mojo run -I . tests/mojo/test_index_cpu_amx.mojo`;
`tests/index/test_index_cpu_prefill.py` runs it under pytest only where the CPU
has AMX-BF16). Writer against writer: the bfloat16 table against
`decode_e4m3` on every byte; the prefill block's totals against the
float32 register blocks' and the decode tiles' scores against the row
scorer's (`score_tile`) on e4m3fn values (which bfloat16 holds exactly),
within float32 rounding of the dim and head sums, at head counts and
depths that are not whole tiles, with a NaN key and key tiles whose last
candidates are stale or unscored.
"""

from std.math import abs, max
from std.memory import bitcast
from std.testing import TestSuite, assert_equal, assert_true

from cpu_scores import check_scores, e4m3
from kernels.index.cpu.amx import (
    AMX_HEADS,
    AMX_ROW_TILE,
    BF16_LANES,
    E4m3ToBf16,
    amx_begin,
    amx_depth_of,
    amx_end,
    amx_heads_of,
    amx_ready,
    amx_usable,
    score_row_amx,
    score_tile_amx,
)
from kernels.index.cpu.block import (
    PREFILL_HEADS,
    PREFILL_TILE,
    prefill_heads_of,
    score_head_block,
    transpose_tile,
    transpose_tile_pairs,
)
from kernels.index.cpu.score import score_tile, scratch
from kernels.index.operands import padded_heads_of
from kernels.index.fp8 import decode_e4m3


def byte(i: Int) -> UInt8:
    """A deterministic e4m3fn byte, never NaN."""
    var b = (i * 2654435761 >> 7) % 256
    if b & 0x7F == 0x7F:
        b -= 1
    return UInt8(b)


def e4m3_of(b: UInt8) -> Float32:
    """The value of an e4m3fn byte."""
    return decode_e4m3[1](SIMD[DType.uint8, 1](b))[0]


def check_amx_row[num_heads: Int, depth: Int](nan_at: Int) raises:
    """One row's AMX totals against the float32 blocks' over a key tile."""
    comptime padded = prefill_heads_of[num_heads]()
    comptime heads = amx_heads_of[num_heads]()
    comptime dims = amx_depth_of[depth]()
    comptime count = PREFILL_TILE - 3
    var queries = List[Float32](length=padded * depth, fill=0.0)
    var bits = List[UInt16](length=heads * dims, fill=0)
    var weights = List[Float32](length=heads, fill=0.0)
    for h in range(num_heads):
        weights[h] = Float32(h % 5 + 1) / 4.0
        for d in range(depth):
            queries[h * depth + d] = e4m3(h * depth + d)
            # e4m3fn values are exact bfloat16: the float32's high half.
            bits[h * dims + d] = UInt16(
                bitcast[DType.uint32, 1](queries[h * depth + d]) >> 16
            )
    var keys = List[Float32](length=PREFILL_TILE * depth, fill=0.0)
    for x in range(PREFILL_TILE):
        for d in range(depth):
            keys[x * depth + d] = e4m3(x * depth + d + 7000)
    keys[nan_at * depth + depth - 1] = Float32(FloatLiteral.nan)
    var transposed = List[Float32](length=PREFILL_TILE * depth, fill=0.0)
    transpose_tile[depth](scratch(keys), count, scratch(transposed))
    var want = List[Float32](length=PREFILL_TILE, fill=0.0)
    for block in range(0, padded, PREFILL_HEADS):
        score_head_block[depth](
            scratch(queries).unsafe_offset(block * depth),
            scratch(weights).unsafe_offset(block),
            scratch(transposed),
            scratch(want),
        )
    # Stale words past `count` (a previous tile's) must not reach the
    # first `count` candidates.
    var words = List[UInt32](length=PREFILL_TILE * dims // 2, fill=0xFFC0FFC0)
    for p in range(depth // 2, dims // 2):
        for x in range(PREFILL_TILE):
            words[p * PREFILL_TILE + x] = 0
    transpose_tile_pairs[depth](scratch(keys), count, scratch(words))
    var sums = List[Float32](length=AMX_HEADS * PREFILL_TILE, fill=0.0)
    var got = List[Float32](length=PREFILL_TILE, fill=0.0)
    amx_begin()
    score_row_amx[depth, heads](
        scratch(bits),
        scratch(weights),
        scratch(words),
        scratch(sums),
        scratch(got),
    )
    amx_end()
    check_scores(
        got, want, count, nan_at, String("heads ", num_heads, " depth ", depth)
    )


def test_bfloat16_table_decodes_every_byte() raises:
    var table = E4m3ToBf16(True)
    var bytes = SIMD[DType.uint8, BF16_LANES](0)
    for first in range(0, 256, BF16_LANES):
        for lane in range(BF16_LANES):
            bytes[lane] = UInt8(first + lane)
        var bits = table.decode(bytes)
        for lane in range(BF16_LANES):
            var want = decode_e4m3[1](SIMD[DType.uint8, 1](bytes[lane]))[0]
            var got = bitcast[DType.float32, 1](UInt32(bits[lane]) << 16)[0]
            if want != want:
                assert_true(got != got, String("byte ", first + lane))
            else:
                assert_equal(
                    bitcast[DType.uint32, 1](got)[0],
                    bitcast[DType.uint32, 1](want)[0],
                    String("byte ", first + lane),
                )


def check_amx_tile[num_heads: Int, depth: Int](count: Int, nan_at: Int) raises:
    """The decode form: one row's AMX scores against the row scorer's."""
    comptime row_padded = padded_heads_of[num_heads]()
    comptime heads = amx_heads_of[num_heads]()
    comptime dims = amx_depth_of[depth]()
    comptime tile = 64
    var table = E4m3ToBf16(True)
    var query_bytes = List[UInt8](length=num_heads * depth, fill=0)
    for i in range(len(query_bytes)):
        query_bytes[i] = byte(i)
    var key_bytes = List[UInt8](length=tile * depth, fill=0)
    for i in range(len(key_bytes)):
        key_bytes[i] = byte(i + 9000)
    key_bytes[nan_at * depth + depth // 2] = 0x7F  # a NaN key
    # The row scorer's layout: [depth, padded heads] float32, keys float32.
    var queries = List[Float32](length=depth * row_padded, fill=0.0)
    var weights = List[Float32](length=heads, fill=0.0)
    var keys = List[Float32](length=(tile + 8) * depth, fill=0.0)
    var scales = List[Float32](length=tile + 8, fill=0.0)
    for h in range(num_heads):
        weights[h] = Float32(h % 5 + 1) / 4.0 - 0.5
        for d in range(depth):
            queries[d * row_padded + h] = e4m3_of(query_bytes[h * depth + d])
    for x in range(tile):
        scales[x] = 0.5 + Float32(x % 3)
        for d in range(depth):
            keys[x * depth + d] = e4m3_of(key_bytes[x * depth + d])
    var want = List[Float32](length=tile + 8, fill=0.0)
    score_tile[num_heads, depth](
        scratch(queries),
        scratch(weights),
        scratch(keys),
        scratch(scales),
        count,
        scratch(want),
    )
    # The AMX layout: query pair words [dims / 2, heads], keys [tile, dims]
    # bfloat16 bits, from the table.
    var words = List[UInt32](length=dims // 2 * heads, fill=0)
    var decoded = List[UInt16](length=dims, fill=0)
    for h in range(num_heads):
        table.decode_row[depth](
            scratch(query_bytes).unsafe_offset(h * depth), scratch(decoded)
        )
        for p in range(dims // 2):
            words[p * heads + h] = UInt32(decoded[2 * p]) | (
                UInt32(decoded[2 * p + 1]) << 16
            )
    var key_bits = List[UInt16](length=tile * dims, fill=0)
    for x in range(tile):
        table.decode_row[depth](
            scratch(key_bytes).unsafe_offset(x * depth),
            scratch(key_bits).unsafe_offset(x * dims),
        )
    var sums = List[Float32](length=AMX_ROW_TILE * AMX_HEADS, fill=0.0)
    var got = List[Float32](length=tile, fill=0.0)
    amx_begin()
    score_tile_amx[depth, heads](
        scratch(words),
        scratch(weights),
        scratch(key_bits),
        scratch(scales),
        count,
        scratch(sums),
        scratch(got),
    )
    amx_end()
    check_scores(
        got, want, count, nan_at, String("heads ", num_heads, " depth ", depth)
    )


def test_amx_decode_tiles_score_like_the_row_scorer() raises:
    assert_true(amx_ready(), "this host grants the AMX tile state")
    check_amx_tile[32, 128](64, 40)  # GLM-5-Next: whole tiles
    check_amx_tile[20, 38](45, 3)  # part heads and dims, a part tile
    check_amx_tile[64, 64](17, 16)  # two head blocks, one part pass


def test_amx_blocks_score_like_float32_blocks() raises:
    comptime assert amx_usable[128](), "the AMX block is built here"
    assert_true(amx_ready(), "this host grants the AMX tile state")
    check_amx_row[32, 128](3)  # GLM-5-Next's indexer: whole tiles
    check_amx_row[20, 38](17)  # a part head block, a part dim step
    check_amx_row[64, 64](28)  # two head blocks


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
