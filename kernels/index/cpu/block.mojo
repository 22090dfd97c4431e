"""The CPU prefill scorer's register block, in float32 and in bfloat16 pairs.

A tile's decoded keys are transposed so one SIMD register holds a dim of
`F32_WIDTH` candidates, and a register block of `PREFILL_HEADS` query
heads x `PREFILL_VECTORS` candidate registers walks the dims: each key
register feeds every head of the block and each broadcast query value
every key register. After the dims, the block's heads are folded into the
row's running totals (`fold_heads`): per head a ReLU that keeps a NaN,
times the head weight.

Two forms of the walk:

- float32 (any target): one FMA per (head, register) per dim; keys
  `[depth, PREFILL_TILE]` float32, a query head `[depth]`.
- bfloat16 pairs (AVX-512 BF16): every e4m3fn value, subnormals and NaN
  included, is exactly a bfloat16 (3 mantissa bits within 7, float32's
  exponent range), so decoded queries and keys lose nothing, and
  `vdpbf16ps` (per float32 lane `acc += a0 * b0 + a1 * b1`, the products
  exact in float32) takes two dims per instruction at the rate of one
  512-bit FMA on AMD Zen 4 and Intel Sapphire Rapids. A query head is
  `depth / 2` words, word `p` holding dims `2p` (low half) and `2p + 1`
  (high half); keys `[depth / 2, PREFILL_TILE]` words. Scores differ from
  the float32 form only in the float32 rounding of a sum taken in pairs.
  Source: VDPBF16PS in Intel's Software Developer's Manual, vol. 2.
"""

from std.math import ceildiv
from std.memory import bitcast, stack_allocation
from std.sys import llvm_intrinsic
from std.sys.info import CompilationTarget

from ..operands import F32_WIDTH
from ...grid.ragged import Ptr


comptime CPU_REGISTERS = 32 if F32_WIDTH >= 16 else 16
"""SIMD registers of the target: 32 zmm with AVX-512, 16 ymm with AVX2."""

comptime PREFILL_VECTORS = 2
"""Candidate registers per register block: the tile is this many
registers of `F32_WIDTH` candidates wide."""

comptime PREFILL_TILE = PREFILL_VECTORS * F32_WIDTH
"""Candidates per prefill tile (32 on AVX-512: 16 KiB of float32 keys at
depth 128, 8 KiB of pairs, which stay in L1 while the rows pass)."""


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

comptime CPU_BF16_PAIRS = CompilationTarget._has_feature["avx512bf16"]()
"""Whether the target has AVX-512 BF16 (`vdpbf16ps`)."""


@always_inline
def prefill_heads_of[num_heads: Int]() -> Int:
    """Heads per row rounded up to whole register blocks (padding heads
    have a zero query and weight)."""
    return ceildiv(num_heads, PREFILL_HEADS) * PREFILL_HEADS


@always_inline
def use_pairs[depth: Int]() -> Bool:
    """Whether the prefill scorer takes the bfloat16 pair form at `depth`:
    the target has AVX-512 BF16 and the dims split into whole pairs."""
    return CPU_BF16_PAIRS and F32_WIDTH == 16 and depth % 2 == 0


@always_inline
def query_words_of[depth: Int]() -> Int:
    """Scratch words per query head: `depth / 2` pairs or `depth` floats."""
    return depth // 2 if use_pairs[depth]() else depth


@always_inline
def fold_heads(
    acc: Ptr[DType.float32],
    weights: Ptr[DType.float32],
    totals: Ptr[DType.float32],
):
    """Adds a block's dots, ReLU'd (a NaN stays NaN) and weighted, to totals.

    Args:
        acc: `[PREFILL_HEADS, PREFILL_VECTORS, F32_WIDTH]` the dots.
        weights: `[PREFILL_HEADS]` the heads' weights.
        totals: `[PREFILL_TILE]` the row's running weighted head sums.
    """
    comptime Vec = SIMD[DType.float32, F32_WIDTH]
    comptime for v in range(PREFILL_VECTORS):
        var total = totals.unsafe_load[width=F32_WIDTH](v * F32_WIDTH)
        comptime for h in range(PREFILL_HEADS):
            var dot = acc.unsafe_load[width=F32_WIDTH](
                (h * PREFILL_VECTORS + v) * F32_WIDTH
            )
            total += dot.lt(0).select(Vec(0), dot) * Vec(
                weights[unsafe_offset=h]
            )
        totals.unsafe_store[width=F32_WIDTH](v * F32_WIDTH, total)


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
    fold_heads(acc.unsafe_origin_cast[MutAnyOrigin](), weights, totals)


def transpose_tile[
    depth: Int
](keys: Ptr[DType.float32], count: Int, transposed: Ptr[DType.float32]):
    """Copies `count` decoded keys `[count, depth]` to `[depth, PREFILL_TILE]`."""
    for x in range(count):
        for d in range(depth):
            transposed[unsafe_offset=d * PREFILL_TILE + x] = keys[
                unsafe_offset=x * depth + d
            ]


@always_inline
def bf16_pairs[
    width: Int
](low: SIMD[DType.float32, width], high: SIMD[DType.float32, width]) -> SIMD[
    DType.uint32, width
]:
    """Packs float32 values that are exact bfloat16 (decoded e4m3fn) into
    pair words: `low`'s bfloat16 in the low half, `high`'s in the high."""
    var lo = bitcast[DType.uint32, width](low) >> 16
    var hi = bitcast[DType.uint32, width](high) & 0xFFFF0000
    return lo | hi


comptime PACK_WIDTH = 8
"""Pair words packed per SIMD step."""


@always_inline
def pack_pairs[
    depth: Int, stride: Int
](values: Ptr[DType.float32], words: Ptr[DType.uint32]):
    """`[depth]` decoded float32 values to `depth / 2` pair words, word `p`
    at `words[p * stride]`."""
    comptime pairs = depth // 2
    comptime full = pairs // PACK_WIDTH
    comptime for i in range(full):
        var split = values.unsafe_load[width=2 * PACK_WIDTH](
            2 * PACK_WIDTH * i
        ).deinterleave()
        var packed = bf16_pairs[PACK_WIDTH](split[0], split[1])
        comptime if stride == 1:
            words.unsafe_store[width=PACK_WIDTH](PACK_WIDTH * i, packed)
        else:
            comptime for lane in range(PACK_WIDTH):
                words[unsafe_offset=(PACK_WIDTH * i + lane) * stride] = packed[
                    lane
                ]
    comptime for p in range(full * PACK_WIDTH, pairs):
        words[unsafe_offset=p * stride] = bf16_pairs[1](
            values[unsafe_offset=2 * p], values[unsafe_offset=2 * p + 1]
        )[0]


def transpose_tile_pairs[
    depth: Int
](keys: Ptr[DType.float32], count: Int, words: Ptr[DType.uint32]):
    """Decoded keys `[count, depth]` to pair words `[depth / 2, PREFILL_TILE]`."""
    for x in range(count):
        pack_pairs[depth, PREFILL_TILE](
            keys.unsafe_offset(x * depth), words.unsafe_offset(x)
        )


@always_inline
def dot_pairs(
    acc: SIMD[DType.float32, 16],
    query: SIMD[DType.uint32, 16],
    keys: SIMD[DType.uint32, 16],
) -> SIMD[DType.float32, 16]:
    """Per lane `acc + q0 * k0 + q1 * k1` over its bfloat16 pair (`vdpbf16ps`)."""
    return llvm_intrinsic[
        "llvm.x86.avx512bf16.dpbf16ps.512", SIMD[DType.float32, 16]
    ](
        acc,
        bitcast[DType.bfloat16, 32](query),
        bitcast[DType.bfloat16, 32](keys),
    )


@always_inline
def score_head_block_pairs[
    depth: Int
](
    queries: Ptr[DType.uint32],
    weights: Ptr[DType.float32],
    keys: Ptr[DType.uint32],
    totals: Ptr[DType.float32],
):
    """`score_head_block` in bfloat16 pairs (needs `use_pairs[depth]()`).

    Args:
        queries: `[PREFILL_HEADS, depth / 2]` the block's query pair words.
        weights: `[PREFILL_HEADS]` their head weights.
        keys: `[depth / 2, PREFILL_TILE]` the tile's key pair words.
        totals: `[PREFILL_TILE]` the row's running weighted head sums.
    """
    comptime pairs = depth // 2
    comptime heads = PREFILL_HEADS
    comptime vectors = PREFILL_VECTORS
    comptime Lanes = SIMD[DType.float32, 16]
    comptime Words = SIMD[DType.uint32, 16]
    var acc = stack_allocation[heads * vectors * 16, DType.float32]()
    comptime for x in range(heads * vectors):
        acc.unsafe_store[width=16](x * 16, Lanes(0))
    for p in range(pairs):
        comptime for v in range(vectors):
            var key = keys.unsafe_load[width=16](p * PREFILL_TILE + v * 16)
            comptime for h in range(heads):
                comptime at = (h * vectors + v) * 16
                acc.unsafe_store[width=16](
                    at,
                    dot_pairs(
                        acc.unsafe_load[width=16](at),
                        Words(queries[unsafe_offset=h * pairs + p]),
                        key,
                    ),
                )
    fold_heads(acc.unsafe_origin_cast[MutAnyOrigin](), weights, totals)
