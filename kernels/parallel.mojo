"""How the writers split work: CPU core ranges and GPU launch shapes."""

from max.algorithm import sync_parallelize
from std.math import ceildiv, min
from std.sys import num_physical_cores

comptime GPU_MAX_BLOCK = 1024
"""Largest block the GPU writers launch; wider heads stride over channels."""

comptime CPU_MIN_PARALLEL_WORK = 1 << 14
"""Element-members below which one core finishes before others could wake.

Measured with the bench at ring_close batch 64, kpool 4, head_dim 128
(32K element-members, about 12 us on one core): splitting it over 2 cores
still gains a little over the wake-up cost."""


@always_inline
def gpu_block_width[head_dim: Int]() -> Int:
    """Threads per block of every GPU writer: one per channel, at most 1024.

    A wider head keeps 1024 threads, each striding over the channels.
    """
    return min(head_dim, GPU_MAX_BLOCK)


def cpu_for_each_range[
    F: def(Int, Int) -> None
](count: Int, work: Int, body: F):
    """Runs `body(lo, hi)` over `[0, count)`, split across the cores.

    Contiguous ranges, one per physical core; the whole range on the
    calling thread when `work` (element-members touched) is too small to
    pay for waking the others.

    Args:
        count: Items (requests, output rows).
        work: Total work, in element-members, to decide whether to split.
        body: Called with each half-open item range.
    """
    var workers = min(num_physical_cores(), count)
    if workers <= 1 or work < CPU_MIN_PARALLEL_WORK:
        body(0, count)
        return
    var per_worker = ceildiv(count, workers)

    def share(w: Int) {imm}:
        body(w * per_worker, min((w + 1) * per_worker, count))

    sync_parallelize(share, workers)
