"""Unit tests of the CPU prefill scorer's AMX block.

Runs on a host with AMX (`mojo run -I . tests/mojo/test_index_cpu_amx.mojo`;
`tests/test_index_cpu_prefill.py` runs it under pytest only where the CPU
has AMX-BF16). Writer against writer: the AMX block's totals against the
float32 register blocks' on e4m3fn values (which bfloat16 holds exactly),
within float32 rounding of the dim and head sums, at head counts and
depths that are not whole tiles, with a NaN key and a key tile whose last
candidates are stale.
"""

from std.math import abs, max
from std.testing import TestSuite, assert_true

from kernels.index.cpu.index_cpu_amx import (
    AMX_HEADS,
    amx_begin,
    amx_depth_of,
    amx_end,
    amx_heads_of,
    amx_ready,
    amx_usable,
    score_row_amx,
    to_bfloat16_bits,
)
from kernels.index.cpu.index_cpu_block import (
    PREFILL_HEADS,
    PREFILL_TILE,
    prefill_heads_of,
    score_head_block,
    transpose_tile,
    transpose_tile_pairs,
)
from kernels.index.cpu.index_cpu_score import scratch
from kernels.index.index_fp8 import decode_e4m3


def e4m3(i: Int) -> Float32:
    """A deterministic e4m3fn value (byte `i * 37 mod 256`, never NaN)."""
    var byte = (i * 37 + 11) % 256
    if byte & 0x7F == 0x7F:
        byte -= 1
    return decode_e4m3[1](SIMD[DType.uint8, 1](UInt8(byte)))[0]


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
        to_bfloat16_bits[depth](
            scratch(queries).unsafe_offset(h * depth),
            scratch(bits).unsafe_offset(h * dims),
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
    var nonzero = 0
    for x in range(count):
        var at = String("heads ", num_heads, " depth ", depth, " x ", x)
        if x == nan_at:
            assert_true(got[x] != got[x], "a NaN key scores NaN: " + at)
            continue
        nonzero += Int(want[x] != 0)
        var scale = max(abs(want[x]), Float32(1.0))
        assert_true(
            abs(got[x] - want[x]) <= 1e-5 * scale,
            String(at, ": ", got[x], " vs ", want[x]),
        )
    assert_true(nonzero > count // 2, "the case scores mostly nonzero")


def test_amx_blocks_score_like_float32_blocks() raises:
    comptime assert amx_usable[128](), "the AMX block is built here"
    assert_true(amx_ready(), "this host grants the AMX tile state")
    check_amx_row[32, 128](3)  # GLM-5-Next's indexer: whole tiles
    check_amx_row[20, 38](17)  # a part head block, a part dim step
    check_amx_row[64, 64](28)  # two head blocks


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
