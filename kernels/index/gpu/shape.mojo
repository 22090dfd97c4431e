"""`index_top_k`'s GPU score launch shape: threads, heads per pass, shared words.

Shapes whose float32 query fits `SCORE_SHARED_LIMIT` words take the tiled
scorer (`score.index_score_phase`), whose blocks grow with the
query (`score_threads`) and which keeps `pass_heads` heads in registers per
pass over a key; the others take the untiled one at `SCORE_THREADS` per
block. The launch (`launches.mojo`), the scorers and gpu-report's driver
all read these.
"""

from std.bit import next_power_of_two
from std.math import ceildiv, max, min

from ..operands import IndexTopK


comptime SCORE_THREADS = 128
"""Threads per block of the untiled score launch (a candidate each); the
tiled scorer's blocks are `score_threads` wide."""


def score_tiles(op: IndexTopK) -> Int:
    """Score blocks per row: tiles of `score_threads` candidates."""
    return ceildiv(op.work.candidates, score_threads[op.num_heads, op.depth]())


@always_inline
def key_chunk[depth: Int]() -> Int:
    """Key bytes one load reads: 16, 8 or 4 when `depth` is a multiple, else 1."""
    comptime if depth % 16 == 0:
        return 16
    elif depth % 8 == 0:
        return 8
    elif depth % 4 == 0:
        return 4
    return 1


@always_inline
def padded_heads_pow2[num_heads: Int]() -> Int:
    """Heads rounded up to a power of two: the SIMD width of a head vector."""
    return next_power_of_two(num_heads)


comptime PASS_HEADS = 16
"""Most heads one pass of the tiled scorer keeps in float32 registers."""


@always_inline
def pass_heads[num_heads: Int]() -> Int:
    """Heads the tiled scorer accumulates per pass over a key."""
    return min(padded_heads_pow2[num_heads](), PASS_HEADS)


@always_inline
def score_passes[num_heads: Int]() -> Int:
    """Passes of the tiled scorer over a key: pass `p` takes the heads
    `h % passes == p`."""
    return padded_heads_pow2[num_heads]() // pass_heads[num_heads]()


@always_inline
def tile_words[num_heads: Int, depth: Int]() -> Int:
    """Shared words of the tiled scorer: the row's float32 query."""
    return padded_heads_pow2[num_heads]() * depth


comptime SCORE_SHARED_LIMIT = 12 * 1024
"""Shared words (48 KiB) a block may use: larger `H * D` score untiled."""


@always_inline
def tiled_scorer[num_heads: Int, depth: Int]() -> Bool:
    """Whether the tiled scorer serves this shape (`index_score_phase`)."""
    return (
        padded_heads_pow2[num_heads]() <= 64
        and tile_words[num_heads, depth]() <= SCORE_SHARED_LIMIT
    )


comptime SCORE_WAVE_WORDS = 1024
"""Shared words (4 KiB) per 64 threads of a tiled-score block.

MI300X has 64 KiB of LDS per CU and 32 wave slots (4 SIMDs x 8 waves of
64 lanes, AMD's CDNA3 ISA guide and HIP occupancy docs): blocks using 4 KiB
per wave fill half the slots (50% occupancy) before the LDS runs out, so a
block's threads grow with its query instead of staying at 128."""


@always_inline
def score_threads[num_heads: Int, depth: Int]() -> Int:
    """Threads per block of the score launch (a candidate each).

    `SCORE_THREADS` for the untiled scorer; for the tiled one a wave of 64
    per `SCORE_WAVE_WORDS` of query, a power of two from 128 to 1024 (256
    for 32 heads x 128 dims, 512 for 64 x 128).
    """
    comptime if not tiled_scorer[num_heads, depth]():
        return SCORE_THREADS
    comptime waves = ceildiv(tile_words[num_heads, depth](), SCORE_WAVE_WORDS)
    return min(max(next_power_of_two(waves * 64), SCORE_THREADS), 1024)
