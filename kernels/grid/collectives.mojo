"""The collectives a phase of a cooperative kernel may end with.

A kernel's phase table (`GpuKernel.phase_table`, `phases.Phases`) names
the collective after a phase: every thread `offer`s a 64-bit value in that
phase through its `Lane`, the collective runs between the phases, and the
next phase reads the `result()`.
Warp ones (sum, max, exclusive prefix sum, broadcast of lane 0, ballot)
and block ones (sum, max, exclusive prefix sum). On a GPU they are
butterflies and scans of MAX's warp shuffles (`max.gpu.primitives.warp`),
the block ones with a 64-bit partial per warp in shared memory after the
kernel's own words and a barrier (`gpu_collective`); emulated they are
computed over the lanes gathered (`emulate_collective`), and a lane that
offered nothing, an offer with no collective after it or a result no
collective gave fails the launch. The warp
is the target's (32 lanes on NVIDIA, 64 on AMD); emulated it is
`EMULATED_WARP`, so a kernel reads its width from `warp_lanes()`.
"""

from max.gpu import WARP_SIZE, barrier
from max.gpu.primitives import warp
from std.bit import log2_floor
from std.math import ceildiv, max, min
from std.sys import is_gpu


comptime EMULATED_WARP = 32
"""Lanes of a warp in the emulation (an NVIDIA warp)."""

comptime MAX_WARPS = 32
"""Warps of the largest block (1024 threads of 32 lanes): the words a block
collective keeps per warp bound its scratch."""

# The collectives a phase may end with (`phases.Phase.collective`).
comptime NO_COLLECTIVE = 0
comptime WARP_SUM = 1
"""Every lane gets the sum of its warp's values."""
comptime WARP_MAX = 2
"""Every lane gets the largest value of its warp."""
comptime WARP_EXCLUSIVE_SUM = 3
"""Lane `l` gets the sum of lanes `0 ..< l` of its warp."""
comptime WARP_BROADCAST = 4
"""Every lane gets lane 0's value."""
comptime WARP_BALLOT = 5
"""Every lane gets bit `l` set for each lane `l` of its warp whose value is
not zero."""
comptime BLOCK_SUM = 6
"""Every thread gets the sum of the block's values."""
comptime BLOCK_MAX = 7
"""Every thread gets the largest value of the block."""
comptime BLOCK_EXCLUSIVE_SUM = 8
"""Thread `t` gets the sum of threads `0 ..< t`."""


@always_inline
def warp_lanes() -> Int:
    """Lanes of a warp: the target's on a GPU, `EMULATED_WARP` emulated."""
    comptime if is_gpu():
        return WARP_SIZE
    return EMULATED_WARP


@always_inline
def is_block_collective(kind: Int) -> Bool:
    """Whether collective `kind` spans the block (it needs scratch words)."""
    return kind >= BLOCK_SUM


def collective_scratch_words(threads: Int) -> Int:
    """Shared words a block collective of `threads` threads uses after the
    kernel's own: two per warp (a 64-bit partial), warps of 32 lanes, and
    one to align the partials to 8 bytes after an odd count of words."""
    return 2 * ceildiv(threads, 32) + 1


@always_inline
def scratch_start(words: Int) -> Int:
    """The word the block collectives' scratch starts at after `words` of
    the kernel's own: the next even word (the partials are 64-bit)."""
    return words + words % 2


struct Lane(Copyable, Defaultable, TrivialRegisterPassable):
    """A thread's value in the collective after a phase, then its result.

    A phase whose table entry has a collective after it (`phases.Phase`)
    must `offer` a value in every thread, and only such a phase may; the
    next phase reads the result with `result()`. On a GPU the flags are
    never read, and the compiler drops them; emulated they find a lane
    that offered nothing (its value would be stale or undefined on a GPU),
    an offer no collective takes and a result read where no collective
    gave one.
    """

    var value: UInt64
    var offered: Bool
    var fresh: Bool
    var stale_read: Bool

    def __init__(out self):
        """A lane that has offered nothing and holds no result."""
        self.value = 0
        self.offered = False
        self.fresh = False
        self.stale_read = False

    @always_inline
    def offer(mut self, value: UInt64):
        """This thread's value for the collective after this phase."""
        self.value = value
        self.offered = True
        self.fresh = False

    @always_inline
    def result(mut self) -> UInt64:
        """The last collective's result for this thread."""
        if not self.fresh:
            self.stale_read = True
        return self.value


@always_inline
def _butterfly[largest: Bool](x: UInt64) -> UInt64:
    """The sum (or the largest) of the warp's values, in every lane: a
    butterfly of `shuffle_xor`s, so no lane depends on the reduction a
    library version leaves where (a `shuffle_down` tree gives lane 0
    alone the whole)."""
    var y = x
    comptime for i in range(log2_floor(WARP_SIZE)):
        var other = warp.shuffle_xor(y, UInt32(1 << i))
        comptime if largest:
            y = max(y, other)
        else:
            y += other
    return y


@always_inline
def gpu_collective[
    kind: Int
](
    mut lane: Lane,
    thread: Int,
    threads: Int,
    scratch: Pointer[UInt32, MutAnyOrigin],
):
    """Runs collective `kind` on a GPU: every thread of the block calls it.

    Block collectives use `collective_scratch_words(threads)` words at
    `scratch` (from an even word: `scratch_start`) and a barrier; the phase's barrier after them keeps the next
    collective from overwriting words still being read.

    Parameters:
        kind: The collective (`WARP_SUM` ... `BLOCK_EXCLUSIVE_SUM`).

    Args:
        lane: The thread's lane: its offered value becomes its result.
        thread: The thread.
        threads: Threads of the block.
        scratch: The block's scratch words (block collectives only).
    """
    var x = lane.value
    var lanes = warp_lanes()
    var y: UInt64
    comptime if kind == WARP_SUM or kind == BLOCK_SUM:
        y = _butterfly[False](x)
    elif kind == WARP_MAX or kind == BLOCK_MAX:
        y = _butterfly[True](x)
    elif kind == WARP_EXCLUSIVE_SUM:
        y = warp.prefix_sum[exclusive=True](x)
    elif kind == BLOCK_EXCLUSIVE_SUM:
        y = warp.prefix_sum[exclusive=False](x)
    elif kind == WARP_BROADCAST:
        y = warp.broadcast(x)
    else:
        comptime assert kind == WARP_BALLOT, "unknown collective"
        var bit = UInt64(1) << UInt64(thread % lanes)
        y = _butterfly[False](bit if x != 0 else UInt64(0))
    comptime if is_block_collective(kind):
        var w = thread // lanes
        var partials = scratch.unsafe_bitcast[UInt64]()
        if thread % lanes == lanes - 1 or thread == threads - 1:
            partials[unsafe_offset=w] = y
        barrier()
        var before: UInt64 = 0
        var all: UInt64 = 0
        for v in range(ceildiv(threads, lanes)):
            var partial = partials[unsafe_offset=v]
            comptime if kind == BLOCK_MAX:
                all = max(all, partial)
            else:
                all += partial
                if v < w:
                    before += partial
        comptime if kind == BLOCK_EXCLUSIVE_SUM:
            y = before + y - x
        else:
            y = all
    lane.value = y
    lane.fresh = True


def _warp_result(
    kind: Int, values: List[UInt64], lo: Int, hi: Int, l: Int
) -> UInt64:
    """Lane `l`'s result of warp collective `kind` over `values[lo:hi]`."""
    var result: UInt64 = 0
    if kind == WARP_BROADCAST:
        return values[lo]
    for i in range(lo, hi):
        if kind == WARP_MAX:
            result = max(result, values[i])
        elif kind == WARP_BALLOT:
            if values[i] != 0:
                result |= UInt64(1) << UInt64(i - lo)
        elif kind == WARP_SUM or i < l:
            result += values[i]
    return result


def emulate_collective(
    kernel: StaticString,
    kind: Int,
    block: Int,
    phase: Int,
    name: StaticString,
    mut lanes: List[Lane],
) raises:
    """Runs collective `kind` over a block's lanes, on the CPU.

    Args:
        kernel: Name of the kernel, for messages.
        kind: The collective.
        block: The block, for messages.
        phase: The phase it follows, for messages.
        name: That phase's name in the kernel's table, for messages.
        lanes: The block's lanes, thread by thread.

    Raises:
        Error: Naming the first thread that offered no value.
    """
    var n = len(lanes)
    var values = List[UInt64](capacity=n)
    for t in range(n):
        if not lanes[t].offered:
            raise Error(
                kernel,
                ": block ",
                block,
                " phase ",
                phase,
                " (",
                name,
                ") thread ",
                t,
                " offered no value to the collective after the phase (its"
                " lane would be stale on a GPU)",
            )
        values.append(lanes[t].value)
    var results = List[UInt64](length=n, fill=0)
    if is_block_collective(kind):
        var sum: UInt64 = 0
        var most: UInt64 = 0
        for t in range(n):
            results[t] = sum
            sum += values[t]
            most = max(most, values[t])
        if kind != BLOCK_EXCLUSIVE_SUM:
            for t in range(n):
                results[t] = most if kind == BLOCK_MAX else sum
    else:
        for lo in range(0, n, EMULATED_WARP):
            var hi = min(lo + EMULATED_WARP, n)
            for t in range(lo, hi):
                results[t] = _warp_result(kind, values, lo, hi, t)
    for t in range(n):
        lanes[t].value = results[t]
        lanes[t].offered = False
        lanes[t].fresh = True


def check_lanes(
    kernel: StaticString,
    block: Int,
    phase: Int,
    name: StaticString,
    kind: Int,
    mut lanes: List[Lane],
) raises:
    """Fails the launch if a thread read a result anywhere but in the phase
    right after its collective, or offered a value in a phase the kernel's
    phase table gives no collective; a phase with none ends the results.

    Args:
        kernel: Name of the kernel, for messages.
        block: The block.
        phase: The phase just run.
        name: Its name in the kernel's phase table.
        kind: The collective after it in the table (`NO_COLLECTIVE`: none).
        lanes: The block's lanes.

    Raises:
        Error: Naming the kernel, block, phase and the first such thread.
    """
    var place = String(kernel, ": block ", block, " phase ", phase)
    place += String(" (", name, ") thread ")
    for t in range(len(lanes)):
        if lanes[t].stale_read:
            raise Error(
                place, t, " read a collective result that no collective gave it"
            )
        if kind == NO_COLLECTIVE:
            if lanes[t].offered:
                raise Error(
                    place,
                    t,
                    " offered a value, but the phase table has no collective"
                    " after phase ",
                    name,
                )
            lanes[t].fresh = False


@always_inline
def thread_run[
    odd: Bool = False
](thread: Int, threads: Int, count: Int) -> Tuple[Int, Int]:
    """Thread `thread`'s contiguous run `[lo, hi)` of `count` items split
    over `threads`: the runs in thread order, so a block exclusive prefix
    sum of what each thread counts in its run places the runs in item order.

    Parameters:
        odd: Runs of an odd length (one item longer where the even split
            is even; the last threads' runs then end early or are empty):
            for items read from shared memory, where the `i`-th items of a
            warp's runs are a run's length apart, an odd length puts them
            on 32 different banks (an even one on `gcd(length, 32)`-way
            conflicts).

    Args:
        thread: The thread, `0 ..< threads`.
        threads: Threads sharing the items.
        count: Items, at least 0.
    """
    var per = ceildiv(count, threads)
    comptime if odd:
        per |= 1
    var lo = min(thread * per, count)
    return (lo, min(lo + per, count))
