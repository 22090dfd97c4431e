"""The GPU select's shared words and phase counts (`index_select.mojo`).

Shared memory: the histogram (15 x 512 words), whose area later holds the
pairs (2 x 2048 words) and the collect's counts; 15 bucket totals and 4
words of state: `SELECT_WORDS` in all (30,796 bytes). Shared words are
laid out so that a warp's accesses fall in distinct banks (the counters
of a digit row are thread-indexed; the collect's counts are padded by a
word per 32).

Occupancy (theoretical; limits: NVIDIA CUDA C++ Programming Guide,
"Compute Capabilities", table of technical specifications for compute
capability 9.0, and "Shared Memory" (1 KB reserved per block); AMD
"AMD Instinct MI300 ISA" and ROCm "GPU hardware specifications" for
MI300X: 64 KiB LDS per CU, 4 SIMDs of 8 wave64 slots, 512 VGPRs per SIMD
lane): a 512-thread block is 16 warps on an H200 (228 KB shared per SM:
7 blocks by shared memory, 4 by the 64 warps of an SM, fewer if a thread
takes more than 32 registers: 3 up to 40, 2 up to 64) and 8 wave64 on
an MI300X (2 workgroups by the 64 KiB of LDS: 16 of 32 wave slots, 50%,
with up to 128 VGPRs).
"""

from std.bit import log2_floor, next_power_of_two
from std.math import max, min


comptime SELECT_THREADS = 512
"""Threads per row block: 16 warps, 8 wave64."""

comptime _LANES = 32
"""Threads of an NVIDIA warp, and banks of shared memory (both targets)."""

comptime DIGIT_BITS = 4
"""Bits of the key fixed per radix pass."""

comptime RADIX_BUCKETS = 1 << DIGIT_BITS
"""Buckets of one digit."""

comptime _COUNTED = RADIX_BUCKETS - 1
"""Digits counted per pass: `1 ..< RADIX_BUCKETS` (never 0)."""

comptime _PASSES = 32 // DIGIT_BITS
"""Radix passes over a 32-bit key."""

comptime SELECT_MAX_K = 2048
"""Largest `k` (MAX's largest `top_k`); the pair area holds this many."""

comptime _HIST = 0
"""Word of digit `d`'s counter of thread `t`: `_HIST + (d - 1) * T + t`."""

comptime _HIST_WORDS = _COUNTED * SELECT_THREADS
"""The histogram area, reused for the pairs and the collect's counts."""

comptime _PAIR_KEYS = _HIST
"""Keys of the pairs (the histogram area's first `SELECT_MAX_K` words)."""

comptime _PAIR_IDS = _HIST + SELECT_MAX_K
"""Ids of the pairs."""

comptime _PADDED = SELECT_THREADS + SELECT_THREADS // _LANES
"""Words of one padded per-thread count array (`_padded`)."""

comptime _ABOVE = _PAIR_IDS + SELECT_MAX_K
"""Per-thread counts of keys above `K`, then their exclusive prefixes."""

comptime _TIES = _ABOVE + _PADDED
"""Per-thread counts of keys at `K`, then their exclusive prefixes."""

comptime _WARPS = SELECT_THREADS // _LANES
"""Groups of 32 threads: the collect's prefix runs per group."""

comptime _GROUP_ABOVE = _TIES + _PADDED
"""Keys above `K` per group of 32 threads."""

comptime _GROUP_TIES = _GROUP_ABOVE + _WARPS
"""Keys at `K` per group of 32 threads."""

comptime _TOTALS = _HIST + _HIST_WORDS
"""The 15 bucket totals of a pass (digit `d` at `_TOTALS + d - 1`)."""

comptime _STATE = _TOTALS + _COUNTED
"""Two slots of (prefix, need): pass `p` records its state in slot
`p % 2`; the collect's (`K`, need) is slot 0."""

comptime SELECT_WORDS = _STATE + 4
"""Shared words per block."""

comptime _PASS_PHASES = 3
comptime _SELECT_PHASES = _PASSES * _PASS_PHASES
"""Count, column sums and totals per digit."""

comptime _COLLECT_PHASES = 3


@always_inline
def sort_width(k: Int) -> Int:
    """The pairs' area: the smallest power of two at least `k`.

    Args:
        k: Ids per output row.
    """
    return next_power_of_two(k)


def _sort_steps(k: Int) -> Int:
    """Compare-exchange phases of the bitonic sort of `sort_width(k)` pairs.

    Args:
        k: Ids per output row.
    """
    var n = log2_floor(sort_width(k))
    return n * (n + 1) // 2


def select_phases(k: Int) -> Int:
    """Phases of the select body for `k`: select, collect, sort (and write).

    The last sort phase writes the output; `k = 1` has no sort phase and
    writes in a phase of its own.

    Args:
        k: Ids per output row, `1 ..= SELECT_MAX_K`.
    """
    return _SELECT_PHASES + _COLLECT_PHASES + max(_sort_steps(k), 1)


@always_inline
def _run(thread: Int, bound: Int) -> Tuple[Int, Int]:
    """Thread `thread`'s contiguous run of ids `[lo, hi)` in the collect.

    Args:
        thread: The thread.
        bound: Candidates of the row.
    """
    var per = (bound + SELECT_THREADS - 1) // SELECT_THREADS
    var lo = min(thread * per, bound)
    return (lo, min(lo + per, bound))


@always_inline
def _padded(thread: Int) -> Int:
    """Thread `thread`'s word in a padded count array: a word skipped per 32.

    The collect's prefix thread `g` reads words `33 g + i`, in bank
    `(g + i) % 32`: the 16 prefix threads never share a bank.

    Args:
        thread: The thread.
    """
    return thread + thread // _LANES


@always_inline
def _shift(p: Int) -> Int:
    """The lowest bit of pass `p`'s digit.

    Args:
        p: The pass, `0 ..< _PASSES`.
    """
    return 32 - DIGIT_BITS * (p + 1)
